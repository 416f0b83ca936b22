#include "torchpoint/retention.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "torchpoint/error.h"

namespace torchpoint {
namespace {

void keep(RetentionDecision& d, std::string reason) {
  d.keep = true;
  d.reasons.push_back(std::move(reason));
}

std::string number_text(double value) { return fmt::format("{}", value); }

}  // namespace

const char* checkpoint_status_name(CheckpointStatus status) {
  switch (status) {
    case CheckpointStatus::Valid:
      return "valid";
    case CheckpointStatus::Corrupt:
      return "corrupt";
    case CheckpointStatus::Uncommitted:
      return "uncommitted";
  }
  return "?";
}

std::vector<RetentionDecision> plan_retention(const std::vector<RetentionEntry>& oldest_first,
                                              const RetentionPolicy& policy) {
  if (policy.best_metric() && policy.keep_best() == 0) {
    throw Error(ErrorCode::InvalidArgument, "retention: keep_best must be at least 1");
  }
  if (policy.keep_every_n_steps() && *policy.keep_every_n_steps() <= 0) {
    throw Error(ErrorCode::InvalidArgument, "retention: keep_every_n_steps must be at least 1");
  }
  if (policy.keep_period_ms() && *policy.keep_period_ms() <= 0) {
    throw Error(ErrorCode::InvalidArgument, "retention: keep_period_ms must be at least 1");
  }
  std::vector<RetentionDecision> decisions(oldest_first.size());
  std::vector<std::size_t> valid;  // indices, oldest first
  for (std::size_t i = 0; i < oldest_first.size(); ++i) {
    const RetentionEntry& e = oldest_first[i];
    RetentionDecision& d = decisions[i];
    d.keep = false;
    if (!e.pinned.empty()) keep(d, e.pinned);
    switch (e.status) {
      case CheckpointStatus::Valid:
        valid.push_back(i);
        break;
      case CheckpointStatus::Corrupt:
        if (!policy.delete_corrupt()) {
          keep(d, "corrupt: not counted, not deleted (see torchpoint verify)");
        } else {
          d.reasons.push_back("corrupt");  // deleted unless pinned
        }
        break;
      case CheckpointStatus::Uncommitted:
        keep(d, "uncommitted: a save in progress, or one that died; not counted, not deleted");
        break;
    }
  }

  if (!valid.empty()) keep(decisions[valid.back()], "newest valid");
  if (!policy.has_rule()) {
    for (std::size_t i : valid) {
      if (!decisions[i].keep) keep(decisions[i], "no retention rule");
    }
    return decisions;
  }
  if (policy.keep_last()) {
    const std::size_t n = *policy.keep_last();
    for (std::size_t k = 0; k < valid.size() && k < n; ++k) {
      keep(decisions[valid[valid.size() - 1 - k]], fmt::format("last {}", n));
    }
  }
  if (policy.best_metric()) {
    const std::string& metric = *policy.best_metric();
    std::vector<std::size_t> ranked;
    for (std::size_t i : valid) {
      const std::optional<double>& v = oldest_first[i].metric;
      if (v && !std::isnan(*v)) {
        ranked.push_back(i);
      } else if (policy.keep_without_metric()) {
        keep(decisions[i], fmt::format("records no {}", metric));
      }
    }
    if (ranked.empty()) {
      throw Error(ErrorCode::NotFound,
                  fmt::format("retention: no valid checkpoint records the metric '{}', so the "
                              "best cannot be told; nothing is deleted",
                              metric));
    }
    // Stable: among equal values the earliest stays first.
    std::stable_sort(ranked.begin(), ranked.end(), [&](std::size_t a, std::size_t b) {
      double va = *oldest_first[a].metric, vb = *oldest_first[b].metric;
      return policy.best_mode_max() ? va > vb : va < vb;
    });
    const std::size_t k = std::min(policy.keep_best(), ranked.size());
    for (std::size_t r = 0; r < k; ++r) {
      std::size_t i = ranked[r];
      std::string rank = k == 1 ? "best" : fmt::format("best {}", policy.keep_best());
      keep(decisions[i], fmt::format("{} {} {}={}", rank, policy.best_mode_max() ? "max" : "min",
                                     metric, number_text(*oldest_first[i].metric)));
    }
  }
  if (policy.keep_every_n_steps()) {
    const std::int64_t n = *policy.keep_every_n_steps();
    for (std::size_t i : valid) {
      const std::optional<std::int64_t>& step = oldest_first[i].step;
      if (step && *step % n == 0) keep(decisions[i], fmt::format("step a multiple of {}", n));
    }
  }
  if (policy.keep_period_ms()) {
    const std::int64_t period = *policy.keep_period_ms();
    std::map<std::int64_t, std::size_t> newest_of_period;
    for (std::size_t i : valid) {
      std::int64_t t = oldest_first[i].commit_time_ms;
      std::int64_t bucket = t >= 0 ? t / period : -((-t + period - 1) / period);
      auto [it, inserted] = newest_of_period.emplace(bucket, i);
      if (!inserted && t >= oldest_first[it->second].commit_time_ms) it->second = i;
    }
    for (const auto& [bucket, i] : newest_of_period) {
      keep(decisions[i], fmt::format("newest of its {} ms period", period));
    }
  }
  std::vector<std::string> missed;
  if (policy.keep_last()) missed.push_back(fmt::format("not in the last {}", *policy.keep_last()));
  if (policy.best_metric())
    missed.push_back(policy.keep_best() == 1 ? "not the best" : "not among the best");
  if (policy.keep_every_n_steps()) missed.push_back("not on a kept step");
  if (policy.keep_period_ms()) missed.push_back("not the newest of its period");
  const std::string why = fmt::format("{}", fmt::join(missed, ", "));
  for (std::size_t i : valid) {
    if (!decisions[i].keep) decisions[i].reasons.push_back(why);
  }
  return decisions;
}

}  // namespace torchpoint
