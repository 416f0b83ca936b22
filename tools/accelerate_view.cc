// torchpoint show / verify of a directory written by Python Accelerate's save_state.
#include <fmt/format.h>

#include "commands.h"
#include "output.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint::tool {

int show_accelerate(const std::string& path, bool json, std::ostream& out) {
  AccelerateView view = inspect_accelerate_checkpoint(path);
  if (json) {
    Json files = Json::array();
    for (const AccelerateFileView& f : view.files) {
      Json values = Json::array();
      for (const auto& [key, text] : f.values) values.push_back({{"key", key}, {"value", text}});
      Json file = {{"name", f.name},  {"kind", f.kind},     {"size_bytes", f.size},
                   {"summary", f.summary}, {"values", values}};
      if (!f.problem.empty()) file["problem"] = f.problem;
      files.push_back(std::move(file));
    }
    print_json(out, {{"path", view.path},
                     {"format", "accelerate"},
                     {"step", view.step < 0 ? Json(nullptr) : Json(view.step)},
                     {"files", files}});
    return kExitOk;
  }
  out << fmt::format("{} (a checkpoint of Python Accelerate's save_state, {} files)\n", view.path,
                     view.files.size());
  Table summary({"step", view.step < 0 ? std::string("-") : std::to_string(view.step)});
  summary.add({"load", "Accelerator::load_state(dir) in C++; accelerator.load_state(dir) in Python"});
  summary.print(out, "  ");
  for (const AccelerateFileView& f : view.files) {
    out << '\n' << fmt::format("{} ({}, {} bytes): {}\n", f.name, f.kind, f.size,
                               f.problem.empty() ? f.summary : "UNREADABLE: " + f.problem);
    if (f.values.empty()) continue;
    Table values({"KEY", "VALUE"});
    for (const auto& [key, text] : f.values) values.add({key, text});
    values.print(out, "  ");
  }
  return kExitOk;
}

VerifyReport verify_accelerate(const std::string& path) {
  VerifyReport report;
  report.path = path;
  for (const AccelerateFileView& f : inspect_accelerate_checkpoint(path).files) {
    if (!f.problem.empty()) report.add(f.problem, f.problem_code);
  }
  return report;
}

}  // namespace torchpoint::tool
