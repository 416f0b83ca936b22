// The retention policy as a pure function: a table of listings and policies, and what each
// entry's fate must be. No files: Accelerator, prune and the reliability suite test it on disk.
#include "torchpoint/retention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "io/filename.h"
#include "testing/test_util.h"
#include "torchpoint/checkpoint_manager.h"

namespace torchpoint {
namespace {

using testing::expect_error;
constexpr auto kValid = CheckpointStatus::Valid;
constexpr auto kCorrupt = CheckpointStatus::Corrupt;
constexpr auto kUncommitted = CheckpointStatus::Uncommitted;
const double kNaN = std::numeric_limits<double>::quiet_NaN();

// checkpoint_<n> for each number, valid, step = n, committed at n seconds.
std::vector<RetentionEntry> numbered(const std::vector<std::int64_t>& numbers) {
  std::vector<RetentionEntry> out;
  for (std::int64_t n : numbers) {
    out.push_back({"checkpoint_" + std::to_string(n), kValid, n, std::nullopt, n * 1000, ""});
  }
  return out;
}

// The names kept, in listing order.
std::vector<std::string> kept(const std::vector<RetentionEntry>& entries,
                              const RetentionPolicy& policy) {
  std::vector<RetentionDecision> decisions = plan_retention(entries, policy);
  EXPECT_EQ(decisions.size(), entries.size());
  std::vector<std::string> out;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    EXPECT_FALSE(decisions[i].reasons.empty()) << entries[i].name << ": every fate has a reason";
    if (decisions[i].keep) out.push_back(entries[i].name);
  }
  return out;
}

using Names = std::vector<std::string>;

TEST(Retention, NoRuleKeepsEverything) {
  auto entries = numbered({1, 2, 3});
  EXPECT_EQ(kept(entries, RetentionPolicy()),
            (Names{"checkpoint_1", "checkpoint_2", "checkpoint_3"}));
  EXPECT_TRUE(
      plan_retention(std::vector<RetentionEntry>{}, RetentionPolicy().keep_last(2)).empty());
}

TEST(Retention, KeepLastCountsValidOnesAcrossDigitBoundaries) {
  // The caller lists by number: 9 before 10, 99999 before 100000.
  auto entries = numbered({8, 9, 10, 11});
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(2)),
            (Names{"checkpoint_10", "checkpoint_11"}));
  entries = numbered({99998, 99999, 100000});
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(1)), (Names{"checkpoint_100000"}));
  // keep_last 0 still keeps the newest valid one.
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(0)), (Names{"checkpoint_100000"}));
  auto decisions = plan_retention(numbered({1, 2, 3}), RetentionPolicy().keep_last(2));
  EXPECT_EQ(decisions[0].reasons, (Names{"not in the last 2"}));
  EXPECT_EQ(decisions[1].reasons, (Names{"last 2"}));
  EXPECT_EQ(decisions[2].reasons, (Names{"newest valid", "last 2"}));
}

TEST(Retention, CorruptAndUncommittedAreNotCountedAndKeptUnlessAsked) {
  auto entries = numbered({1, 2, 3, 4, 5});
  entries[4].status = kCorrupt;      // the newest is corrupt: checkpoint_4 is the newest valid
  entries[2].status = kUncommitted;  // a save in progress
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(1)),
            (Names{"checkpoint_3", "checkpoint_4", "checkpoint_5"}));
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(1).delete_corrupt(true)),
            (Names{"checkpoint_3", "checkpoint_4"}));
  // All corrupt: nothing valid, nothing counted; delete_corrupt removes them all.
  for (auto& e : entries) e.status = kCorrupt;
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(1).delete_corrupt(true)), Names{});
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(1)).size(), 5u);
}

TEST(Retention, PinnedEntriesStayWithTheirReason) {
  auto entries = numbered({1, 2, 3, 4});
  entries[1].pinned = "newer than the checkpoint this run resumed from";
  entries[2].pinned = "newer than the checkpoint this run resumed from";
  entries[2].status = kCorrupt;
  auto decisions = plan_retention(entries, RetentionPolicy().keep_last(1).delete_corrupt(true));
  EXPECT_FALSE(decisions[0].keep);
  EXPECT_TRUE(decisions[1].keep);
  EXPECT_EQ(decisions[1].reasons.front(), "newer than the checkpoint this run resumed from");
  EXPECT_TRUE(decisions[2].keep) << "pinned wins over delete_corrupt: the caller decides";
  EXPECT_TRUE(decisions[3].keep);
}

TEST(Retention, KeepBestByMetricWithTiesNaNAndMissingValues) {
  auto entries = numbered({1, 2, 3, 4, 5, 6});
  const std::vector<std::optional<double>> loss = {0.5, 0.3, kNaN, 0.3, std::nullopt, 0.9};
  for (std::size_t i = 0; i < entries.size(); ++i) entries[i].metric = loss[i];
  auto policy = RetentionPolicy().keep_last(1).best_metric("val_loss");
  // Tie at 0.3: the earliest (checkpoint_2) wins; NaN and missing never do.
  EXPECT_EQ(kept(entries, policy), (Names{"checkpoint_2", "checkpoint_6"}));
  EXPECT_EQ(plan_retention(entries, policy)[1].reasons, (Names{"best min val_loss=0.3"}));
  EXPECT_EQ(plan_retention(entries, policy)[0].reasons, (Names{"not in the last 1, not the best"}));
  EXPECT_EQ(kept(entries, policy.keep_best(2)),
            (Names{"checkpoint_2", "checkpoint_4", "checkpoint_6"}));
  EXPECT_EQ(
      kept(entries, RetentionPolicy().keep_last(1).best_metric("val_loss").best_mode_max(true)),
      (Names{"checkpoint_6"}));
  EXPECT_EQ(kept(entries,
                 RetentionPolicy().keep_last(0).best_metric("val_loss").keep_without_metric(true)),
            (Names{"checkpoint_2", "checkpoint_3", "checkpoint_5", "checkpoint_6"}));
  // A corrupt entry's metric does not count.
  entries[1].status = kCorrupt;
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(1).best_metric("val_loss")),
            (Names{"checkpoint_2", "checkpoint_4", "checkpoint_6"}));
  // No valid checkpoint records it: NotFound, nothing can be decided.
  expect_error(
      [] {
        plan_retention(numbered({1, 2}), RetentionPolicy().keep_last(1).best_metric("acc"));
      },
      ErrorCode::NotFound, {"'acc'", "nothing is deleted"});
}

TEST(Retention, KeepEveryNStepsAndOnePerPeriod) {
  auto entries = numbered({1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_last(1).keep_every_n_steps(3)),
            (Names{"checkpoint_3", "checkpoint_6", "checkpoint_7"}));
  entries[5].step.reset();  // no step recorded: only other rules can keep it
  EXPECT_EQ(kept(entries, RetentionPolicy().keep_every_n_steps(3)),
            (Names{"checkpoint_3", "checkpoint_7"}));
  // Committed at 1..7 s; periods of 2.5 s: [0, 2.5) [2.5, 5) [5, 7.5) keep 2, 4 and 7.
  EXPECT_EQ(kept(numbered({1, 2, 3, 4, 5, 6, 7}), RetentionPolicy().keep_period_ms(2500)),
            (Names{"checkpoint_2", "checkpoint_4", "checkpoint_7"}));
}

// The one numbering rule of listings and resume_from_checkpoint, and its tie-break.
TEST(Retention, CheckpointNumbersAndNaturalOrder) {
  EXPECT_EQ(checkpoint_number("checkpoint_10"), 10u);
  EXPECT_EQ(checkpoint_number("checkpoint_10.tmp-12-ab"), 10u) << "a temporary: its final name";
  EXPECT_EQ(checkpoint_number("run3-epoch-10.ckpt"), 10u);
  EXPECT_EQ(checkpoint_number("epoch-03-loss-1.2.ckpt"), 3u);
  EXPECT_EQ(checkpoint_number("step_200"), 200u);
  EXPECT_EQ(checkpoint_number("best.ckpt"), std::nullopt);
  EXPECT_TRUE(natural_less("step-9-a", "step-10-a"));
  EXPECT_FALSE(natural_less("step-10-a", "step-9-a"));
  EXPECT_TRUE(natural_less("99999", "100000"));
  EXPECT_TRUE(natural_less("a-007", "a-7")) << "more leading zeros first";
  EXPECT_TRUE(natural_less("a", "a-1"));
  EXPECT_FALSE(natural_less("x", "x"));
  EXPECT_TRUE(natural_less("loss-0.09", "loss-0.10"));
}

TEST(Retention, BadPoliciesAreRefused) {
  auto entries = numbered({1});
  expect_error([&] { plan_retention(entries, RetentionPolicy().best_metric("x").keep_best(0)); },
               ErrorCode::InvalidArgument, {"keep_best"});
  expect_error([&] { plan_retention(entries, RetentionPolicy().keep_every_n_steps(0)); },
               ErrorCode::InvalidArgument, {"keep_every_n_steps"});
  expect_error([&] { plan_retention(entries, RetentionPolicy().keep_period_ms(-1)); },
               ErrorCode::InvalidArgument, {"keep_period_ms"});
}

}  // namespace
}  // namespace torchpoint
