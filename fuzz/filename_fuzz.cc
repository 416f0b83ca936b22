// Fuzzes the parsers of on-disk names (io/filename.h): the input is one name or path. Besides
// crashes and sanitizer reports, it checks that every name a parser accepts is the one its
// builder makes, so no two spellings ever mean the same checkpoint.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "io/filename.h"

namespace tp = torchpoint;

namespace {

void require(bool ok, const char* what, std::string_view name) {
  if (ok) return;
  std::fprintf(stderr, "filename_fuzz: %s fails for '%.*s'\n", what, static_cast<int>(name.size()),
               name.data());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view name(reinterpret_cast<const char*>(data), size);

  if (auto number = tp::parse_checkpoint_name(name)) {
    require(tp::checkpoint_name(*number) == name, "checkpoint_name(parse_checkpoint_name(x)) == x",
            name);
  }
  if (auto component = tp::parse_component_file_name(name)) {
    require(tp::component_file_name(*component) == name,
            "component_file_name(parse_component_file_name(x)) == x", name);
  }
  bool temp = tp::is_temp_name(name);
  require(temp || !tp::temp_name_pid(name), "temp_name_pid only for temp names", name);
  if (!name.empty()) {
    std::string made = tp::temp_name(name);
    require(tp::is_temp_name(made), "is_temp_name(temp_name(x))", name);
    require(tp::temp_name_pid(made) == static_cast<int>(::getpid()), "temp_name_pid(temp_name(x))",
            name);
  }
  std::string parent = tp::parent_path(name);
  std::string base = tp::base_name(name);
  tp::join_path(parent, base);
  return 0;
}
