// The `torchpoint` command-line tool: look inside checkpoints without writing code.
//
// Exit status, for every subcommand: 0 success; 1 a check failed (verify found a problem,
// diff found a difference); 2 bad usage, or a path that is missing, not a checkpoint,
// unreadable or corrupt.
#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <functional>
#include <iostream>
#include <utility>

#include "commands.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"

namespace tp = torchpoint::tool;

namespace {

constexpr const char* kComponentRule =
    "Components: in a directory checkpoint, each <component>.safetensors file. In a file "
    "checkpoint (e.g. state.ckpt, saved from a StateDict built with set_child), the first "
    "dotted part of each key: \"model.fc.weight\" is tensor \"fc.weight\" of component "
    "\"model\"; keys without a dot form the top-level component \"\".";

constexpr const char* kDigestRule =
    "The digest is a SHA-256 over the bytes \"torchpoint-digest-v1\\n\" followed, for each "
    "tensor in the byte order of \"<component>/<name>\" (just \"<name>\" for the top-level "
    "component), by that key, its dtype name (F32, BF16, ...), its number of dimensions, each "
    "dimension, and its raw little-endian bytes; the strings and the bytes are preceded by "
    "their length, and every length and number is an 8-byte little-endian integer. JSON values "
    "and the file layout do not enter it, so a directory checkpoint and a file checkpoint of "
    "the same state have the same digest.";

// CLI11 prints footers as they are: break them into lines of at most `width` characters.
std::string wrap(const std::string& text, std::size_t width = 90) {
  std::string out;
  std::size_t line_start = 0;
  std::size_t i = 0;
  while (i < text.size()) {
    std::size_t word_end = text.find_first_of(" \n", i);
    if (word_end == std::string::npos) word_end = text.size();
    std::string word = text.substr(i, word_end - i);
    if (out.size() - line_start + word.size() + 1 > width && out.size() > line_start) {
      out += '\n';
      line_start = out.size();
    } else if (out.size() > line_start) {
      out += ' ';
    }
    out += word;
    if (word_end < text.size() && text[word_end] == '\n') {
      out += '\n';
      line_start = out.size();
    }
    i = word_end + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect, check and manage torchpoint checkpoints.", "torchpoint"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "torchpoint " + torchpoint::torchpoint_version());
  app.footer(wrap(
      "Exit status: 0 success, 1 a check failed (verify, diff), 2 usage error or a path that "
      "is missing, not a checkpoint, unreadable or corrupt.\nRun `torchpoint <command> --help` "
      "for the options of a command."));

  tp::LsOptions ls;
  CLI::App* ls_cmd = app.add_subcommand(
      "ls",
      "List the checkpoints of a directory in numeric order, with status; * marks the "
      "latest valid one (what loading the latest picks)");
  ls_cmd
      ->add_option("dir", ls.dir,
                   "A project directory (its checkpoints/ subdirectory is listed), a directory "
                   "of checkpoint_<N> directories, or a directory of file checkpoints "
                   "(*.ckpt, *.safetensors)")
      ->required();
  ls_cmd->add_flag("--json", ls.json, "Machine-readable output");
  ls_cmd->footer(
      wrap("Status: valid (every checksum verified), corrupt (verify found problems), uncommitted "
           "(a temporary *.tmp-<pid>-<hex> entry, or a directory without manifest.json). Numbers: "
           "N of checkpoint_<N>; for a file checkpoint, the first number in its name "
           "(epoch-03-loss-1.2.ckpt is 3); entries without a number come first."));

  tp::ShowOptions show;
  CLI::App* show_cmd =
      app.add_subcommand("show",
                         "Show a checkpoint's components, tensors, JSON state, counters, versions, "
                         "metadata and metric records");
  show_cmd->add_option("path", show.path, "A directory checkpoint or a checkpoint file")
      ->required();
  show_cmd->add_flag("--json", show.json, "Machine-readable output");
  show_cmd->footer(wrap(std::string(kComponentRule) +
                        " Metric records: a \"records\" component (or \"records.\" keys of any "
                        "component) holding MetricRecords' state."));

  tp::VerifyOptions verify;
  CLI::App* verify_cmd = app.add_subcommand(
      "verify", "Check every checksum and structural rule; print every problem found");
  verify_cmd->add_option("paths", verify.paths, "Directory checkpoints or checkpoint files")
      ->required();
  verify_cmd->add_flag("--json", verify.json, "Machine-readable output");
  verify_cmd->footer(
      wrap("Exit status: 0 all valid, 1 any invalid, 2 a missing path or bad usage."));

  tp::DiffOptions diff;
  CLI::App* diff_cmd = app.add_subcommand(
      "diff", "Compare two checkpoints tensor by tensor (and their JSON values)");
  diff_cmd->add_option("a", diff.a, "First checkpoint")->required();
  diff_cmd->add_option("b", diff.b, "Second checkpoint")->required();
  diff_cmd->add_flag("--json", diff.json, "Machine-readable output");
  diff_cmd->footer(wrap(std::string(kComponentRule) +
                        " Tensors match by \"<component>/<name>\"; equal means same dtype, shape "
                        "and bytes. Exit status: 0 identical, 1 not, 2 error."));

  tp::DigestOptions digest;
  CLI::App* digest_cmd = app.add_subcommand(
      "digest", "Print a SHA-256 of a checkpoint's tensors (names, dtypes, shapes, bytes)");
  digest_cmd->add_option("path", digest.path, "A directory checkpoint or a checkpoint file")
      ->required();
  std::string digest_component;
  CLI::Option* digest_component_option =
      digest_cmd->add_option("--component", digest_component, "Only this component's tensors");
  digest_cmd->footer(wrap(std::string(kDigestRule) + " " + kComponentRule));

  tp::ExportOptions export_options;
  CLI::App* export_cmd =
      app.add_subcommand("export",
                         "Write a component's tensors as a PyTorch file: torch.load(OUT) returns a "
                         "dict of name -> tensor; or, with --to accelerate, a whole directory "
                         "checkpoint as a directory Python Accelerate's load_state restores");
  export_cmd->add_option("path", export_options.path, "A directory checkpoint or a checkpoint file")
      ->required();
  export_cmd->add_option("output", export_options.output,
                         "The .pt file to write (with --to accelerate: the new directory)")
      ->required();
  export_cmd
      ->add_option("--to", export_options.to,
                   "torch: one component as a .pt file; accelerate: every component in the "
                   "layout of Accelerate's save_state (model.safetensors, optimizer.bin, "
                   "scheduler.bin, custom_checkpoint_<i>.pkl, random_states_<rank>.pkl)")
      ->check(CLI::IsMember({"torch", "accelerate"}))
      ->capture_default_str();
  export_cmd
      ->add_option("--component", export_options.component,
                   "The component to export; --component \"\" exports the top-level "
                   "keys of a file checkpoint (those without a dot)")
      ->capture_default_str();
  export_cmd->footer(
      wrap(std::string(kComponentRule) + " Only tensors are exported (JSON values are not)."));

  tp::ConsolidateOptions consolidate;
  CLI::App* consolidate_cmd = app.add_subcommand(
      "consolidate",
      "Write a copy of a directory checkpoint with every ZeRO-sharded optimizer state joined "
      "into one file, as one process without ZeRO saves it");
  consolidate_cmd->add_option("path", consolidate.path, "A directory checkpoint")->required();
  consolidate_cmd->add_option("output", consolidate.output, "The new directory (must not exist)")
      ->required();
  consolidate_cmd->footer(
      wrap("Every file is verified first; the copy has a manifest and checksums of its own and "
           "is committed atomically. Loading needs no consolidation (load_state reshards onto "
           "any number of processes); this is for tools and programs that want one file."));

  tp::PlotOptions plot;
  CLI::App* plot_cmd =
      app.add_subcommand("plot", "Draw the metric curves of a checkpoint's records");
  plot_cmd->add_option("path", plot.path, "A directory checkpoint or a checkpoint file")
      ->required();
  plot_cmd->add_option("output", plot.output, "The .png, .svg or .pdf file to write")->required();
  plot_cmd->footer(
      wrap("Reads MetricRecords' state from a \"records\" component (or \"records.\" keys) and "
           "draws one panel per metric: x is the epoch (1, 2, ...), one line per set. The "
           "output's extension picks the format: .png, .svg or .pdf."));

  tp::PruneOptions prune;
  CLI::App* prune_cmd = app.add_subcommand(
      "prune",
      "Delete old checkpoints, keeping the last N valid ones, the newest valid one "
      "and optionally the best");
  prune_cmd->add_option("dir", prune.dir, "A directory of checkpoints, as for ls")->required();
  prune_cmd->add_option("--keep-last", prune.keep_last, "Keep the N newest valid checkpoints")
      ->required();
  std::string keep_best;
  CLI::Option* best = prune_cmd->add_option(
      "--keep-best", keep_best,
      "Also keep the valid checkpoint with the best value of METRIC, read from its manifest: "
      "metadata[\"metrics\"][METRIC] (a number)");
  prune_cmd->add_option("--mode", prune.mode, "Whether the best METRIC is the min or the max")
      ->check(CLI::IsMember({"min", "max"}))
      ->needs(best)
      ->capture_default_str();
  prune_cmd->add_flag("--dry-run", prune.dry_run, "Print the decisions; delete nothing");
  prune_cmd->footer(
      wrap("Order is numeric. The newest valid checkpoint is never deleted, nor corrupt or "
           "uncommitted entries (they are not counted either). Prints one KEEP or DELETE line per "
           "checkpoint. A deleted directory is renamed to a temporary name first, so an "
           "interrupted prune never leaves a damaged checkpoint behind."));

  // CLI11 would report an unknown command as "A subcommand is required"; name it instead.
  bool known = false;
  std::function<bool(const CLI::App*)> every = [](const CLI::App*) { return true; };
  for (const CLI::App* command : std::as_const(app).get_subcommands(every)) {
    known = known || (argc > 1 && command->get_name() == argv[1]);
  }
  if (argc > 1 && argv[1][0] != '-' && !known) {
    std::cerr << "torchpoint: unknown command '" << argv[1]
              << "'; the commands are ls, show, verify, diff, digest, export, consolidate, "
                 "plot, prune "
                 "(torchpoint --help)\n";
    return tp::kExitError;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int status = app.exit(e);  // prints help (status 0) or the usage error
    return status == 0 ? tp::kExitOk : tp::kExitError;
  }

  if (digest_component_option->count() > 0) digest.component = digest_component;
  if (best->count() > 0) prune.keep_best = keep_best;
  std::string command = app.get_subcommands().front()->get_name();
  try {
    if (*ls_cmd) return tp::run_ls(ls, std::cout);
    if (*show_cmd) return tp::run_show(show, std::cout);
    if (*verify_cmd) return tp::run_verify(verify, std::cout, std::cerr);
    if (*diff_cmd) return tp::run_diff(diff, std::cout);
    if (*digest_cmd) return tp::run_digest(digest, std::cout);
    if (*export_cmd) return tp::run_export(export_options, std::cout);
    if (*consolidate_cmd) return tp::run_consolidate(consolidate, std::cout);
    if (*plot_cmd) return tp::run_plot(plot, std::cout);
    if (*prune_cmd) return tp::run_prune(prune, std::cout);
  } catch (const torchpoint::Error& e) {
    std::cout.flush();
    std::cerr << "torchpoint " << command << ": error: " << e.what() << '\n';
  } catch (const c10::Error& e) {
    std::cout.flush();
    std::cerr << "torchpoint " << command << ": error: " << e.what_without_backtrace() << '\n';
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "torchpoint " << command << ": error: " << e.what() << '\n';
  }
  return tp::kExitError;
}
