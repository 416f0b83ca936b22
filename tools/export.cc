// torchpoint export PATH OUT.pt: one component's tensors as a file Python's torch.load reads.
#include <ATen/core/Dict.h>
#include <fmt/format.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "checkpoint_view.h"
#include "commands.h"
#include "output.h"
#include "torchpoint/error.h"

namespace torchpoint::tool {

int run_export(const ExportOptions& options, std::ostream& out) {
  CheckpointView view = open_checkpoint(options.path);
  const ComponentView* component = find_component(view, options.component);
  if (!component) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{} has no component '{}'; its components are: {}; choose one with "
                            "--component",
                            view.path, options.component, component_names(view)));
  }
  c10::Dict<std::string, at::Tensor> dict;
  std::size_t count = 0;
  for (const auto& [key, value] : component->state.entries()) {
    if (!std::holds_alternative<at::Tensor>(value)) continue;
    // A copy with its own storage: the loaded tensors are views of one mapping of the file,
    // which the pickler would otherwise write whole, once per tensor.
    dict.insert(key, std::get<at::Tensor>(value).clone(at::MemoryFormat::Contiguous));
    ++count;
  }
  if (count == 0) {
    throw Error(ErrorCode::NotFound,
                fmt::format("component '{}' of {} holds no tensors: nothing to export",
                            options.component, view.path));
  }
  // The same zip-of-pickle format as Python's torch.save (torch.load returns a dict).
  std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(dict));
  write_file_atomically(options.output, std::string_view(bytes.data(), bytes.size()));
  out << fmt::format("wrote {} tensors of component '{}' ({} bytes) to {}\n", count,
                     options.component, bytes.size(), options.output);
  return kExitOk;
}

}  // namespace torchpoint::tool
