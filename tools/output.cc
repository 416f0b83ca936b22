#include "output.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>

#include "torchpoint/env.h"

namespace torchpoint::tool {

void Table::print(std::ostream& out, const std::string& indent) const {
  std::vector<std::size_t> widths;
  for (const auto& row : rows_) {
    if (widths.size() < row.size()) widths.resize(row.size(), 0);
    for (std::size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], row[i].size());
  }
  for (const auto& row : rows_) {
    std::string line = indent;
    for (std::size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(widths[i] - row[i].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out << line << '\n';
  }
}

std::string iso_time(std::int64_t unix_ms) {
  std::time_t seconds = static_cast<std::time_t>(unix_ms / 1000);
  std::tm utc{};
  gmtime_r(&seconds, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

std::string format_double(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return fmt::format("{}", value);
}

Json json_double(double value) {
  if (std::isfinite(value)) return value;
  return format_double(value);
}

// Names that are not UTF-8 (a file name is any bytes) are printed with U+FFFD in their place,
// so the output stays valid JSON.
void print_json(std::ostream& out, const Json& value) {
  out << value.dump(2, ' ', false, Json::error_handler_t::replace) << '\n';
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
  torchpoint::write_file_atomically(Env::posix(), path, bytes);
}

}  // namespace torchpoint::tool
