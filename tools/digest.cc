// torchpoint digest PATH [--component NAME]: one SHA-256 for the tensors of a checkpoint.
#include <fmt/format.h>

#include "commands.h"
#include "torchpoint/inspect.h"
#include "torchpoint/error.h"

namespace torchpoint::tool {

int run_digest(const DigestOptions& options, std::ostream& out) {
  CheckpointView view = open_checkpoint(options.path);
  std::vector<TensorRef> tensors;
  if (options.component) {
    const ComponentView* c = find_component(view, *options.component);
    if (!c) {
      throw Error(ErrorCode::NotFound,
                  fmt::format("{} has no component '{}'; its components are: {}", view.path,
                              *options.component, component_names(view)));
    }
    tensors = sorted_tensors(*c);
  } else {
    tensors = sorted_tensors(view);
  }
  out << fmt::format("{}  {}\n", tensor_digest(tensors), view.path);
  return kExitOk;
}

}  // namespace torchpoint::tool
