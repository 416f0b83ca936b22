// Text and JSON output shared by the subcommands.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "torchpoint/tensor_file.h"

namespace torchpoint::tool {

// Columns padded to their widest cell; the last column is not padded.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::ostream& out, const std::string& indent = "") const;

 private:
  std::vector<std::vector<std::string>> rows_;
};

// "2024-05-01T12:00:00Z" (UTC) for milliseconds since the Unix epoch.
std::string iso_time(std::int64_t unix_ms);
// Shortest text that reads back as the same double; "nan", "inf", "-inf" for the others.
std::string format_double(double value);
// A double as JSON: a number, or the strings "nan", "inf", "-inf" (JSON has no such numbers).
Json json_double(double value);
// Prints `value` indented by two spaces, followed by a newline.
void print_json(std::ostream& out, const Json& value);

// Writes `bytes` to `path` as torchpoint writes its own files: into a temporary sibling,
// fsynced, then renamed over `path`. On failure `path` is unchanged. Throws torchpoint::Error.
void write_file_atomically(const std::string& path, std::string_view bytes);

}  // namespace torchpoint::tool
