// The subcommands of the `torchpoint` tool. Each run_* function prints to `out` and returns
// the process exit status; errors are thrown as torchpoint::Error and reported by main().
#pragma once

#include <cstddef>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "torchpoint/tensor_file.h"

namespace torchpoint::tool {

// Exit statuses, the same for every subcommand.
inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;  // verify found a problem, diff found a difference
inline constexpr int kExitError = 2;        // bad usage, missing path, unreadable or corrupt input

struct LsOptions {
  std::string dir;
  bool json = false;
};
int run_ls(const LsOptions& options, std::ostream& out);

struct ShowOptions {
  std::string path;
  bool json = false;
};
int run_show(const ShowOptions& options, std::ostream& out);
// show and verify of a directory written by Python Accelerate (accelerate_view.cc).
int show_accelerate(const std::string& path, bool json, std::ostream& out);
// Every problem found reading the files (structure, zip CRCs, pickle globals).
VerifyReport verify_accelerate(const std::string& path);

struct VerifyOptions {
  std::vector<std::string> paths;
  bool json = false;
};
int run_verify(const VerifyOptions& options, std::ostream& out, std::ostream& err);

struct DiffOptions {
  std::string a;
  std::string b;
  bool json = false;
};
int run_diff(const DiffOptions& options, std::ostream& out);

struct DigestOptions {
  std::string path;
  std::optional<std::string> component;
};
int run_digest(const DigestOptions& options, std::ostream& out);

struct ExportOptions {
  std::string path;
  std::string output;
  std::string component = "model";
  std::string to = "torch";  // or "accelerate"
};
int run_export(const ExportOptions& options, std::ostream& out);

struct ConsolidateOptions {
  std::string path;
  std::string output;
};
int run_consolidate(const ConsolidateOptions& options, std::ostream& out);

struct PlotOptions {
  std::string path;
  std::string output;
};
int run_plot(const PlotOptions& options, std::ostream& out);

struct PruneOptions {
  std::string dir;
  std::size_t keep_last = 0;
  std::optional<std::string> keep_best;
  std::string mode = "min";
  bool dry_run = false;
};
int run_prune(const PruneOptions& options, std::ostream& out);

}  // namespace torchpoint::tool
