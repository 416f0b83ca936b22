// torchpoint export PATH OUT.pt: one component's tensors as a file Python's torch.load reads.
#include <fmt/format.h>

#include "torchpoint/inspect.h"
#include "commands.h"
#include "output.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/error.h"
#include "torchpoint/interop.h"

namespace torchpoint::tool {

int run_export(const ExportOptions& options, std::ostream& out) {
  if (options.to == "accelerate") {
    AccelerateExport exported = export_accelerate_checkpoint(options.path, options.output);
    out << fmt::format("wrote {} ({}): Python's accelerator.load_state(\"{}\") restores it\n",
                       options.output, fmt::join(exported.files, ", "), options.output);
    for (const std::string& note : exported.notes) out << "  note: " << note << '\n';
    return kExitOk;
  }
  CheckpointView view = open_checkpoint(options.path);
  const ComponentView* component = find_component(view, options.component);
  if (!component) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{} has no component '{}'; its components are: {}; choose one with "
                            "--component",
                            view.path, options.component, component_names(view)));
  }
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [key, value] : component->state.entries()) {
    if (std::holds_alternative<at::Tensor>(value))
      tensors.emplace_back(key, std::get<at::Tensor>(value));
  }
  if (tensors.empty()) {
    throw Error(ErrorCode::NotFound,
                fmt::format("component '{}' of {} holds no tensors: nothing to export",
                            options.component, view.path));
  }
  // The zip-of-pickle format of Python's torch.save: torch.load returns a dict, with
  // weights_only=True (PyTorch 2.6's default) too.
  // Streamed from the loaded tensors to the file: memory stays near the checkpoint's size.
  std::uint64_t size = save_torch_state_dict(options.output, tensors);
  out << fmt::format("wrote {} tensors of component '{}' ({} bytes) to {}\n", tensors.size(),
                     options.component, size, options.output);
  return kExitOk;
}

}  // namespace torchpoint::tool
