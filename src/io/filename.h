// Every on-disk name torchpoint builds or parses, in one place.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace torchpoint {

inline constexpr std::string_view kLockFileName = ".lock";
inline constexpr std::string_view kManifestFileName = "manifest.json";
inline constexpr std::string_view kContainerExtension = ".safetensors";
inline constexpr std::string_view kCheckpointPrefix = "checkpoint_";

// "checkpoint_7".
std::string checkpoint_name(std::uint64_t number);
// 7 for "checkpoint_7"; nullopt for anything else ("checkpoint_07", "checkpoint_7.tmp-…").
std::optional<std::uint64_t> parse_checkpoint_name(std::string_view name);

// The first run of digits in `name` at or after `from`, as a number ("epoch-03-loss-1.2.ckpt"
// gives 3): the order of file checkpoints whose names carry a number. nullopt when there is
// none, or when it has more than 18 digits.
std::optional<std::uint64_t> first_number(std::string_view name, std::size_t from = 0);

// Natural order: runs of digits compare as numbers ("step-9" before "step-10"), the rest as
// bytes; equal numbers with more leading zeros first. Ties of checkpoint numbers are broken
// with it.
bool natural_less(std::string_view a, std::string_view b);

// A fresh temporary sibling name for `final_name`: "<final_name>.tmp-<pid>-<random hex>".
std::string temp_name(std::string_view final_name);
// True for names made by temp_name().
bool is_temp_name(std::string_view name);
// The pid recorded in a temp_name(); nullopt for other names.
std::optional<int> temp_name_pid(std::string_view name);

// "model.safetensors" for component "model".
std::string component_file_name(std::string_view component);
// "model" for "model.safetensors"; nullopt for other names.
std::optional<std::string> parse_component_file_name(std::string_view file_name);
// Shard k (from 1) of n of a component, in Hugging Face's layout:
// "model-00001-of-00004.safetensors", and its index "model.safetensors.index.json".
std::string shard_file_name(std::string_view component, int shard, int shards);
std::string shard_index_file_name(std::string_view component);
// True for a name ending like a shard stem ("-00001-of-00004"): not usable as a component name.
bool looks_like_shard_stem(std::string_view name);

// Joins two path pieces with exactly one '/'.
std::string join_path(std::string_view dir, std::string_view name);
// The directory part of `path` ("." when there is none).
std::string parent_path(std::string_view path);
// The last component of `path`, ignoring trailing slashes.
std::string base_name(std::string_view path);

}  // namespace torchpoint
