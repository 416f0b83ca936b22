// Small helpers shared by torchpoint's tests: temporary directories, tensors, file surgery.
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "torchpoint/error.h"

namespace torchpoint::testing {

// Runs `fn` and expects it to throw a torchpoint::Error with `code` whose message contains
// every one of `parts`; returns that error (a test failure is recorded otherwise).
template <typename Fn>
Error expect_error(Fn&& fn, ErrorCode code, const std::vector<std::string>& parts = {}) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "message lacks '" << part << "': " << e.what();
    }
    return e;
  }
  ADD_FAILURE() << "expected an Error with code " << error_code_name(code);
  return Error(code, "");
}

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// True when both tensors have the same dtype, shape and bytes (NaNs with equal bits are equal).
bool bitwise_equal(const at::Tensor& a, const at::Tensor& b);

// A deterministic tensor of any supported dtype with varied values, seeded by `seed`.
at::Tensor make_tensor(c10::ScalarType dtype, std::vector<std::int64_t> shape, std::uint64_t seed);

// The Python that runs the tests' independent judges (torch 2.13, safetensors, numpy: the
// project venv that scripts/setup.sh makes), as a quoted shell word. TORCHPOINT_PYTHON in the
// environment overrides the one the build was configured with.
std::string python();

// Has the real safetensors library (tests/python/safetensors_judge.py, in the venv) open each
// file with safe_open and load_file, and expects exactly the tensors that torchpoint's own
// verified load_file() returns: names, dtypes, shapes and bytes. `scratch` is a directory for
// the expectation files.
void expect_safetensors_reads(const std::vector<std::string>& files, const std::string& scratch);

// What a command printed (stdout and stderr together) and its exit status.
struct CommandOutput {
  int status = -1;  // the exit code; -1 when it did not exit normally
  std::string output;
};

// Runs tests/python/SCRIPT of the source tree (TORCHPOINT_SOURCE_DIR, set by CTest) with the
// judges' Python and `args`, each quoted as one shell word.
CommandOutput run_python_script(const std::string& script, const std::vector<std::string>& args);

std::string read_bytes(const std::string& path);
void write_bytes(const std::string& path, const std::string& bytes);
// Flips bit `bit` of byte `offset` in place.
void flip_bit(const std::string& path, std::uint64_t offset, int bit);
// Rewrites a directory checkpoint's manifest.json as a newer torchpoint would write it: format
// version 9.x, resealed with a valid manifest checksum. Throws if it is not a manifest.
void make_manifest_newer(const std::string& manifest_path);
void truncate_to(const std::string& path, std::uint64_t size);
std::uint64_t file_size(const std::string& path);
// The number of names (hard links) of the file at `path`.
std::uint64_t file_link_count(const std::string& path);
// Names in `dir`, sorted.
std::vector<std::string> list_sorted(const std::string& dir);

}  // namespace torchpoint::testing
