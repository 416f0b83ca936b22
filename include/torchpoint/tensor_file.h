// Container files: named tensors plus JSON state in one safetensors-compatible file.
//
// The file is readable by any safetensors reader (Python's `safetensors`, Hugging Face tools);
// torchpoint adds an XXH3-64 checksum per tensor and one over the header, so every byte of the
// file is covered. docs/format.md describes the format.
#pragma once

#include <ATen/core/Tensor.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "torchpoint/env.h"
#include "torchpoint/error.h"

namespace torchpoint {

// JSON that keeps the order in which keys were inserted.
using Json = nlohmann::ordered_json;

// Tensors by name, in the caller's order (kept across a save and load).
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// What one container file holds.
struct Container {
  NamedTensors tensors;
  // Non-tensor state. Numbers round-trip exactly, except NaN and infinities, which JSON cannot
  // hold: keep those in tensors.
  Json state = Json::object();
};

// Atomically writes `contents` to `path`: a temporary sibling is written, fsynced and renamed
// over `path`, then the directory is fsynced. Tensors are written contiguous, on the CPU.
// On failure `path` keeps its previous contents (or stays absent) and no temporary remains.
// Throws Unsupported for a dtype safetensors cannot hold, InvalidArgument for an empty,
// duplicate or non-UTF-8 tensor name.
//
// Example:
//   torchpoint::save_file("weights.safetensors", {{{"w", torch::ones({2, 2})}}, {{"step", 7}}});
void save_file(const std::string& path, const Container& contents, Env& env = Env::posix());

// Reads, validates and checksums a whole container file into this process's memory (one read,
// straight from the device for a file not in the page cache, hashed as it lands): the tensors
// own their bytes, so nothing done to the file afterwards (overwritten, truncated, deleted)
// changes or faults a returned tensor. Tensors of 64 KiB or more share one allocation, each
// giving its own pages back when it dies. Throws NotFound, Corruption (naming the file
// and, for data, the tensor; also when the file changes size while being read), Incompatible (a
// newer major format version) or Unsupported (a tensor that does not fit in memory). Nothing is
// returned unless every check passed.
Container load_file(const std::string& path, Env& env = Env::posix());

// As load_file(), but zero-copy: the returned tensors are copy-on-write views of one mapping of
// the file (MAP_PRIVATE), which saves the memory and the copy of a large file. The checksums are
// checked with ordinary reads before the mapping is made, so a file truncated during the load
// is a Corruption error. The risk is afterwards, and it is the caller's: if another process
// overwrites the file in place, the pages not yet written through a tensor may show the new
// bytes; if it truncates the file, touching a tensor beyond the new end kills the process with
// SIGBUS. Renaming or deleting the file is safe (torchpoint's own commits only rename). Use it
// only for files nothing else writes to.
Container load_file_mapped(const std::string& path, Env& env = Env::posix());

// Reads a container file into tensors that already exist, such as a model's parameters, in
// place (optimizers and views keep seeing them). `into` must name exactly the file's tensors,
// each with the file's dtype and shape; any device and layout. The file is verified in full
// (header, every checksum, its size) before any tensor changes, and the version counters are
// bumped as an in-place op would. Returns the file's JSON state.
// Two ways, chosen per file:
//  - One read (the default where the system's available memory holds twice the file): the
//    data is read once into new memory, straight from the device for a file not in the page
//    cache, and hashed as it lands. Then each CPU tensor of 64 KiB or more that is its
//    storage's whole memory, from LibTorch's CPU allocator, has its storage take that memory
//    (the tensor, its views and its optimizer see the new values; the old memory is freed, so
//    the data pointer changes); every other tensor is copied into. Peak extra memory: the
//    file's data, until the call returns. Nothing can fail once tensors begin to change.
//  - Two reads (TORCHPOINT_LOAD_MEMORY=frugal, or too little memory): the file is verified with
//    no allocation of its size, then read again, from the page cache, into the tensors'
//    memory, a megabyte at a time checked against the first read. Only a file that becomes
//    unreadable (IOError) or changes (Corruption: another process writing into it) between
//    the two reads fails after the tensors began to change, and that error says they may hold
//    part of the file.
// After any failure of the checks (NotFound, Corruption, Incompatible naming every mismatch,
// InvalidArgument for a name given twice) no tensor of `into` has changed.
//
// Example:
//   torchpoint::NamedTensors params;
//   for (const auto& p : model->named_parameters()) params.emplace_back(p.key(), p.value());
//   torchpoint::load_file_into("weights.safetensors", params);
Json load_file_into(const std::string& path, const NamedTensors& into, Env& env = Env::posix());

// Reads single tensors of a container file without reading the others: the constructor reads
// and validates the header only; read() reads one tensor's bytes and checks its checksum.
//
// Example:
//   torchpoint::TensorFileReader reader("model.safetensors");
//   at::Tensor w = reader.read("fc.weight");
class TensorFileReader {
 public:
  // Throws NotFound, Corruption or Incompatible as load_file() does for the header.
  explicit TensorFileReader(const std::string& path, Env& env = Env::posix());
  ~TensorFileReader();
  TensorFileReader(TensorFileReader&&) noexcept;
  TensorFileReader& operator=(TensorFileReader&&) noexcept;

  // Tensor names in the writer's order.
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  const Json& state() const;
  // A fresh tensor holding `name`'s data. Throws NotFound for an unknown name, Corruption when
  // its checksum does not match.
  at::Tensor read(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Every problem found in a file or directory checkpoint, not only the first, each with its
// error code: Corruption when the checkpoint's own checksums, sizes or structure prove it
// damaged; IOError when it could not be read (permissions, an I/O error); Incompatible or
// Unsupported when it was written by a newer torchpoint or holds what this build cannot hold;
// NotFound when it is missing or was never committed.
struct VerifyReport {
  std::string path;
  std::vector<std::string> problems;
  std::vector<ErrorCode> codes;  // one per problem
  bool ok() const { return problems.empty(); }
  void add(std::string problem, ErrorCode code) {
    problems.push_back(std::move(problem));
    codes.push_back(code);
  }
  // True when it has problems and every one is Corruption: the only kind of checkpoint that
  // may be passed over (or deleted) without losing anything that could still be read.
  bool proven_corrupt() const {
    if (ok()) return false;
    for (ErrorCode c : codes) {
      if (c != ErrorCode::Corruption) return false;
    }
    return true;
  }
  // The first problem that is not Corruption (IOError, Incompatible, ...), or Corruption.
  ErrorCode worst_code() const {
    for (ErrorCode c : codes) {
      if (c != ErrorCode::Corruption) return c;
    }
    return ErrorCode::Corruption;
  }
};

// Checks every structural rule and checksum of a container file or a directory checkpoint.
// Never throws for bad contents; they become problems.
VerifyReport verify(const std::string& path, Env& env = Env::posix());

}  // namespace torchpoint
