// Fuzzes the manifest parser and the directory readers: the input is a manifest.json.
//
// The input is parsed as given (collecting problems, as verify() does), then with its checksum
// made right it becomes the manifest of an in-memory copy of the golden checkpoint
// tests/data/golden_v1/checkpoint_1, which verify() and load_directory() then read. Only
// torchpoint::Error may escape; anything else is a bug and crashes the fuzzer.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "checksum_fixup.h"
#include "format/json_depth.h"
#include "format/manifest.h"
#include "format/ordered_json.h"
#include "memory_env.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;

namespace {

constexpr const char* kDir = "/fuzz/checkpoint_1";

std::string read_golden(const std::string& name) {
  std::string path = std::string(TORCHPOINT_GOLDEN_DIR) + "/checkpoint_1/" + name;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "manifest_fuzz: cannot read %s\n", path.c_str());
    std::abort();
  }
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// The golden checkpoint's component files, read once.
const std::string& model_file() {
  static const std::string bytes = read_golden("model.safetensors");
  return bytes;
}
const std::string& optimizer_file() {
  static const std::string bytes = read_golden("optimizer.safetensors");
  return bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  // Differential: the linear-time parser agrees with nlohmann's own on every input, in value,
  // key order and whether it throws.
  if (tp::json_depth_within(input)) {
    std::string theirs, ours;
    try {
      theirs = tp::Json::parse(input).dump();
    } catch (const tp::Json::exception& e) {
      theirs = "error " + std::to_string(e.id);
    }
    try {
      ours = tp::parse_ordered_json(input).dump();
    } catch (const tp::Json::exception& e) {
      ours = "error " + std::to_string(e.id);
    }
    if (theirs != ours) {
      std::fprintf(stderr, "parse_ordered_json differs from ordered_json::parse:\n%s\n%s\n",
                   theirs.c_str(), ours.c_str());
      std::abort();
    }
  }
  {
    std::vector<std::string> problems;
    tp::Problems collect(&problems);
    tp::parse_manifest(input, "manifest.json", collect);
  }

  std::string fixed(input);
  tp::fuzz::fix_manifest_checksum(fixed);
  tp::fuzz::MemoryEnv env;
  env.add_file(std::string(kDir) + "/manifest.json", fixed);
  env.add_file(std::string(kDir) + "/model.safetensors", model_file());
  env.add_file(std::string(kDir) + "/optimizer.safetensors", optimizer_file());
  tp::verify(kDir, env);
  try {
    tp::load_directory(kDir, env);
  } catch (const tp::Error&) {
  }
  return 0;
}
