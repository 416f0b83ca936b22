// Saves that do not stop training: a snapshot of the state is taken on the calling thread (every
// tensor copied into staging memory that is reused from one save to the next), then written,
// fsynced and committed on a background thread by the same code as a synchronous save. Once a
// save call returns, the caller may change every tensor it passed.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/env.h"
#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {

namespace detail {
struct AsyncJob;
struct PendingCopy;
}  // namespace detail

// One save running in the background. Copyable; all copies refer to the same save.
class SaveHandle {
 public:
  SaveHandle() = default;  // refers to no save: wait() returns at once
  explicit SaveHandle(std::shared_ptr<detail::AsyncJob> job);

  // Where the save commits.
  const std::string& path() const;
  // Whether it has committed or failed.
  bool done() const;
  // Blocks until the save has committed (then returns) or failed (then throws its error). The
  // error is thrown once, by whichever comes first of this, the next save of the same
  // AsyncCheckpointer and its wait(); later calls return quietly.
  void wait() const;

 private:
  std::shared_ptr<detail::AsyncJob> job_;
};

// Runs saves in the background, one at a time. A save first waits for the previous one (and
// throws that one's error if nobody has received it yet: the new save is then not started),
// copies the state into staging memory on the calling thread, and returns a handle while a
// background thread writes and commits. The writer starts at once and sends each part to the
// disk as soon as it is copied. Staging memory is allocated for the largest state saved so far
// and reused; it holds each file's tensor bytes as the file will (so they are not copied twice),
// which takes that state's tensor bytes plus at most 4 KiB per file and 4 KiB. Tensors on a CUDA
// device are copied into pinned host memory.
//
// Not thread-safe: call it from one thread. The destructor waits for the save in flight and
// never throws; an error nobody received is then printed on stderr.
//
// Example:
//   torchpoint::AsyncCheckpointer saver;
//   for (...) {
//     ...  // train
//     saver.save_file("state.ckpt", container);  // returns once the tensors are copied
//   }
//   saver.wait();  // the last save is committed, or its error is thrown
class AsyncCheckpointer {
 public:
  explicit AsyncCheckpointer(Env& env = Env::posix());
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // save_file() of a snapshot of `contents`, in the background. `after_commit` (optional) runs
  // on the background thread after the commit; an error it throws is the save's error.
  SaveHandle save_file(const std::string& path, const Container& contents,
                       std::function<void()> after_commit = {});
  // save_directory() of a snapshot of `components`, in the background. options.before_components
  // runs on the background thread: it must not read state the training loop changes.
  SaveHandle save_directory(const std::string& path, const std::vector<Component>& components,
                            const CheckpointInfo& info = {},
                            const SaveDirectoryOptions& options = {},
                            std::function<void()> after_commit = {});

  // For one writer of a checkpoint that several processes write (each its own part): a
  // snapshot of `components` taken now and handed to `write` on the background thread, which
  // writes, reports and commits as it must. Only the tensors `stage` accepts are copied (all,
  // when it is empty); the others stay the caller's own, and `write` may read their names,
  // shapes and dtypes but not their values.
  using StageFilter =
      std::function<bool(const std::string& component, const std::string& tensor)>;
  SaveHandle save_with(const std::string& path, const std::vector<Component>& components,
                       std::function<void(const std::vector<Component>&)> write,
                       const StageFilter& stage = {});

  // Blocks until the save in flight (if any) has committed or failed; throws its error unless
  // it was already received through a handle.
  void wait();
  // Whether a save has been started and not yet waited for.
  bool in_flight() const;
  // Bytes of staging memory held.
  std::size_t staging_bytes() const;

 private:
  struct Staging;
  SaveHandle start(const std::string& path, std::function<void()> write);
  // Starts `write` on the background thread, then makes `copies` on this one.
  SaveHandle snapshot_and_start(const std::string& path, std::vector<detail::PendingCopy> copies,
                                std::function<void()> write);
  Env& env_;
  std::unique_ptr<Staging> staging_;
  std::shared_ptr<detail::AsyncJob> job_;
};

}  // namespace torchpoint
