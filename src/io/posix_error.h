// The one place where an errno becomes a torchpoint::Error.
#pragma once

#include <string>

#include "torchpoint/error.h"

namespace torchpoint {

// Builds the Error for a failed system call: `context` says what was attempted and on which
// path ("fsync of /runs/a/model.safetensors"); the errno decides the code and the hint.
Error posix_error(const std::string& context, int err);

}  // namespace torchpoint
