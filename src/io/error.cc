#include "torchpoint/error.h"

#include <fmt/format.h>

namespace torchpoint {

const char* error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::NotFound:
      return "NotFound";
    case ErrorCode::Corruption:
      return "Corruption";
    case ErrorCode::Incompatible:
      return "Incompatible";
    case ErrorCode::IOError:
      return "IOError";
    case ErrorCode::InvalidArgument:
      return "InvalidArgument";
    case ErrorCode::Locked:
      return "Locked";
    case ErrorCode::Unsupported:
      return "Unsupported";
  }
  return "Unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(fmt::format("[{}] {}", error_code_name(code), message)), code_(code) {}

}  // namespace torchpoint
