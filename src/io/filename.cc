#include "io/filename.h"

#include <fmt/format.h>
#include <unistd.h>

#include <charconv>
#include <random>

namespace torchpoint {
namespace {

constexpr std::string_view kTempMarker = ".tmp-";

bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool all_hex(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    bool hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
    if (!hex) return false;
  }
  return true;
}

}  // namespace

std::string checkpoint_name(std::uint64_t number) {
  return fmt::format("{}{}", kCheckpointPrefix, number);
}

std::optional<std::uint64_t> parse_checkpoint_name(std::string_view name) {
  if (!name.starts_with(kCheckpointPrefix)) return std::nullopt;
  std::string_view digits = name.substr(kCheckpointPrefix.size());
  // One canonical spelling per number, so "checkpoint_07" never shadows "checkpoint_7".
  if (!all_digits(digits) || (digits.size() > 1 && digits[0] == '0')) return std::nullopt;
  std::uint64_t value = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return value;
}

std::string temp_name(std::string_view final_name) {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return fmt::format("{}{}{}-{:016x}", final_name, kTempMarker, ::getpid(), rng());
}

bool is_temp_name(std::string_view name) {
  std::size_t at = name.rfind(kTempMarker);
  if (at == std::string_view::npos || at == 0) return false;
  std::string_view rest = name.substr(at + kTempMarker.size());
  std::size_t dash = rest.find('-');
  if (dash == std::string_view::npos) return false;
  return all_digits(rest.substr(0, dash)) && all_hex(rest.substr(dash + 1));
}

std::optional<int> temp_name_pid(std::string_view name) {
  if (!is_temp_name(name)) return std::nullopt;
  std::string_view rest = name.substr(name.rfind(kTempMarker) + kTempMarker.size());
  int pid = 0;
  auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.find('-'), pid);
  if (ec != std::errc()) return std::nullopt;
  return pid;
}

std::string component_file_name(std::string_view component) {
  return fmt::format("{}{}", component, kContainerExtension);
}

std::optional<std::string> parse_component_file_name(std::string_view file_name) {
  if (!file_name.ends_with(kContainerExtension) || file_name.size() == kContainerExtension.size()) {
    return std::nullopt;
  }
  return std::string(file_name.substr(0, file_name.size() - kContainerExtension.size()));
}

std::string shard_file_name(std::string_view component, int shard, int shards) {
  return fmt::format("{}-{:05d}-of-{:05d}{}", component, shard, shards, kContainerExtension);
}

std::string shard_index_file_name(std::string_view component) {
  return fmt::format("{}{}.index.json", component, kContainerExtension);
}

bool looks_like_shard_stem(std::string_view name) {
  // "-NNNNN-of-NNNNN" at the end.
  constexpr std::string_view kShape = "-#####-of-#####";
  if (name.size() < kShape.size()) return false;
  std::string_view tail = name.substr(name.size() - kShape.size());
  for (std::size_t i = 0; i < kShape.size(); ++i) {
    bool digit = tail[i] >= '0' && tail[i] <= '9';
    if (kShape[i] == '#' ? !digit : tail[i] != kShape[i]) return false;
  }
  return true;
}

std::string join_path(std::string_view dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return fmt::format("{}{}", dir, name);
  return fmt::format("{}/{}", dir, name);
}

std::string parent_path(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  std::size_t slash = path.rfind('/');
  if (slash == std::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

std::string base_name(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  std::size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

std::optional<std::uint64_t> first_number(std::string_view name, std::size_t from) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  std::size_t begin = from;
  while (begin < name.size() && !digit(name[begin])) ++begin;
  if (begin >= name.size()) return std::nullopt;
  std::size_t end = begin;
  while (end < name.size() && digit(name[end])) ++end;
  if (end - begin > 18) return std::nullopt;  // would not fit; such a name carries no order
  std::uint64_t value = 0;
  for (std::size_t i = begin; i < end; ++i)
    value = value * 10 + static_cast<std::uint64_t>(name[i] - '0');
  return value;
}

bool natural_less(std::string_view a, std::string_view b) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      std::size_t ie = i, je = j;
      while (ie < a.size() && digit(a[ie])) ++ie;
      while (je < b.size() && digit(b[je])) ++je;
      std::string_view x = a.substr(i, ie - i), y = b.substr(j, je - j);
      std::size_t xz = x.find_first_not_of('0'), yz = y.find_first_not_of('0');
      std::string_view xs = xz == std::string_view::npos ? "" : x.substr(xz);
      std::string_view ys = yz == std::string_view::npos ? "" : y.substr(yz);
      if (xs.size() != ys.size()) return xs.size() < ys.size();
      if (xs != ys) return xs < ys;
      if (x.size() != y.size()) return x.size() > y.size();
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

}  // namespace torchpoint
