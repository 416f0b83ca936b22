// torchpoint::Error: the one exception type every torchpoint call throws.
#pragma once

#include <stdexcept>
#include <string>

namespace torchpoint {

// What kind of failure an Error reports. Callers branch on the code, people read the message.
enum class ErrorCode {
  NotFound,         // a path, checkpoint, component or key that should exist does not
  Corruption,       // bytes on disk fail a checksum or a structural rule
  Incompatible,     // a valid checkpoint that does not fit (newer format, other model shape)
  IOError,          // the operating system refused an I/O call
  InvalidArgument,  // the caller passed something unusable
  Locked,           // another writer holds the project lock
  Unsupported,      // a dtype, device or feature torchpoint does not handle
};

// Name of a code, e.g. "Corruption".
const char* error_code_name(ErrorCode code) noexcept;

// Thrown by every fallible torchpoint function. The message has three parts: what failed,
// where (path, component, key), and the likely cause or what to do about it.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);

  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace torchpoint
