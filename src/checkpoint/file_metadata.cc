#include "checkpoint/file_metadata.h"

#include <fstream>

#include "format/container.h"
#include "format/ordered_json.h"

namespace torchpoint::detail {

// Reads only the header; never throws for a damaged file (verification is elsewhere).
Json file_metadata(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char size_bytes[8] = {};
  if (!in.read(reinterpret_cast<char*>(size_bytes), 8)) return Json::object();
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | size_bytes[i];
  if (n > kMaxHeaderSize) return Json::object();
  std::string header(n, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(n))) return Json::object();
  // parse_ordered_json: linear in the number of keys (tensors), where Json::parse is quadratic.
  Json parsed;
  try {
    parsed = parse_ordered_json(header);
  } catch (const nlohmann::json::exception&) {
    return Json::object();
  }
  auto metadata = parsed.is_object() ? parsed.find(std::string(kMetadataKey)) : parsed.end();
  if (metadata == parsed.end() || !metadata->is_object()) return Json::object();
  auto ours_text = metadata->find(std::string(kTorchpointKey));
  if (ours_text == metadata->end() || !ours_text->is_string()) return Json::object();
  try {
    Json ours = parse_ordered_json(ours_text->get_ref<const std::string&>());
    return ours.is_object() ? ours : Json::object();
  } catch (const nlohmann::json::exception&) {
    return Json::object();
  }
}

std::optional<std::int64_t> file_checkpoint_step(const std::string& path) {
  Json metadata = file_metadata(path);
  auto state = metadata.find("state");
  if (state == metadata.end() || !state->is_object()) return std::nullopt;
  auto values = state->find("values");
  for (const char* key : {"step", "counters.step"}) {
    // StateDict layout keeps JSON values under "values"; other containers at the top level.
    for (const Json* where : {values != state->end() ? &*values : nullptr, &*state}) {
      if (where == nullptr || !where->is_object()) continue;
      auto v = where->find(key);
      if (v != where->end() && v->is_number_integer()) return v->get<std::int64_t>();
    }
  }
  return std::nullopt;
}

std::optional<Json> file_checkpoint_metrics(const std::string& path) {
  Json metadata = file_metadata(path);
  auto state = metadata.find("state");
  if (state == metadata.end() || !state->is_object()) return std::nullopt;
  auto values = state->find("values");
  if (values == state->end() || !values->is_object()) return std::nullopt;
  auto metrics = values->find("learner.metrics");
  if (metrics == values->end() || !metrics->is_object()) return std::nullopt;
  return *metrics;
}

}  // namespace torchpoint::detail
