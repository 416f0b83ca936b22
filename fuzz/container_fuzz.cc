// Fuzzes the container reader: the input is the whole file.
//
// Each input is read twice. As given, through the collecting parser that verify() uses (it
// keeps going after a bad checksum, so the JSON behind it is reached too). Then with its header
// checksum made right, through every public reader: load_file, verify, TensorFileReader and the
// reader of foreign safetensors files (which has no checksums, so any offsets reach the tensors).
// Only torchpoint::Error may escape a reader; anything else is a bug and crashes the fuzzer.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "checksum_fixup.h"
#include "format/container.h"
#include "memory_env.h"
#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;

namespace {

constexpr const char* kPath = "/fuzz/input.safetensors";

void parse_collecting(std::string_view bytes, bool allow_foreign) {
  std::vector<std::string> problems;
  tp::Problems collect(&problems);
  tp::parse_container_header(bytes, bytes.size(), kPath, collect, allow_foreign);
}

void read_everything(tp::Env& env) {
  try {
    tp::load_file(kPath, env);
  } catch (const tp::Error&) {
  }
  tp::verify(kPath, env);
  try {
    tp::TensorFileReader reader(kPath, env);
    for (const std::string& name : reader.names()) {
      try {
        reader.read(name);
      } catch (const tp::Error&) {
      }
    }
  } catch (const tp::Error&) {
  }
  try {
    tp::load_container(env, kPath, nullptr, /*allow_foreign=*/true);
  } catch (const tp::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  parse_collecting(input, false);
  parse_collecting(input, true);

  std::string fixed(input);
  tp::fuzz::fix_header_checksum(fixed);
  tp::fuzz::MemoryEnv env;
  env.add_file(kPath, fixed);
  read_everything(env);
  return 0;
}
