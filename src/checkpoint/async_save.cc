#include "torchpoint/async_save.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace torchpoint {

namespace detail {

// The state one background save shares between its thread, its handles and its checkpointer.
struct AsyncJob {
  std::string path;
  std::thread thread;
  std::mutex mutex;
  std::condition_variable finished_cv;
  bool finished = false;
  std::exception_ptr error;
  bool error_taken = false;  // thrown to someone already

  void wait_finished() {
    std::unique_lock<std::mutex> lock(mutex);
    finished_cv.wait(lock, [&] { return finished; });
  }
  // Throws the save's error, to one caller only.
  void rethrow_once() {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (error && !error_taken) {
        error_taken = true;
        e = error;
      }
    }
    if (e) std::rethrow_exception(e);
  }
};

}  // namespace detail

namespace {

constexpr std::size_t kAlignment = 64;

std::size_t aligned(std::size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

// Only dense tensors are copied; any other layout is passed on for the writer to refuse.
bool stageable(const at::Tensor& t) { return t.defined() && t.layout() == at::kStrided; }

}  // namespace

// One buffer, sliced into a view per tensor. It is reallocated only when a state does not fit
// (or a CUDA tensor needs pinned memory it lacks), and only between saves: the previous save
// has finished with it by then.
struct AsyncCheckpointer::Staging {
  at::Tensor buffer;  // uint8
  bool pinned = false;

  static std::size_t bytes_needed(const NamedTensors& tensors, bool& any_cuda) {
    std::size_t total = 0;
    for (const auto& [name, t] : tensors) {
      if (!stageable(t)) continue;
      total += aligned(t.nbytes());
      any_cuda = any_cuda || t.is_cuda();
    }
    return total;
  }

  void reserve(std::size_t bytes, bool need_pinned) {
    const bool fits = buffer.defined() && static_cast<std::size_t>(buffer.numel()) >= bytes;
    if (fits && (pinned || !need_pinned)) return;
    buffer = at::Tensor();  // free the old buffer before taking the new one
    at::TensorOptions options = at::TensorOptions().dtype(at::kByte);
    if (need_pinned) options = options.pinned_memory(true);
    // Aligned beyond the first tensor: the allocator's own alignment is at least 64 bytes.
    buffer = at::empty({static_cast<std::int64_t>(std::max<std::size_t>(bytes, 1))}, options);
    pinned = need_pinned;
  }

  // Copies of `tensors`, each a view of the buffer from `offset` on, on the CPU, contiguous.
  NamedTensors copy(const NamedTensors& tensors, std::size_t& offset) {
    NamedTensors out;
    out.reserve(tensors.size());
    auto* base = static_cast<std::uint8_t*>(buffer.data_ptr());
    for (const auto& [name, t] : tensors) {
      if (!stageable(t)) {
        out.emplace_back(name, t);
        continue;
      }
      at::Tensor view = at::from_blob(base + offset, t.sizes(),
                                      at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU));
      if (t.device().is_cpu() && t.is_contiguous()) {
        // One plain copy on this thread: at::copy_ would hand each tensor to the intra-op pool,
        // whose wake-ups cost more than the copy for most tensors of a model and stall on a busy
        // machine.
        if (t.nbytes() > 0) std::memcpy(base + offset, t.data_ptr(), t.nbytes());
      } else {
        view.copy_(t);  // strided layouts, other devices
      }
      offset += aligned(t.nbytes());
      out.emplace_back(name, std::move(view));
    }
    return out;
  }
};

SaveHandle::SaveHandle(std::shared_ptr<detail::AsyncJob> job) : job_(std::move(job)) {}

const std::string& SaveHandle::path() const {
  static const std::string kNone;
  return job_ ? job_->path : kNone;
}

bool SaveHandle::done() const {
  if (!job_) return true;
  std::lock_guard<std::mutex> lock(job_->mutex);
  return job_->finished;
}

void SaveHandle::wait() const {
  if (!job_) return;
  job_->wait_finished();
  job_->rethrow_once();
}

AsyncCheckpointer::AsyncCheckpointer(Env& env) : env_(env), staging_(std::make_unique<Staging>()) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  std::string path = job_ ? job_->path : "";
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "torchpoint: the background save of %s failed, and nothing waited for it: %s\n",
                 path.c_str(), e.what());
  } catch (...) {
    std::fprintf(stderr,
                 "torchpoint: the background save of %s failed, and nothing waited for it\n",
                 path.c_str());
  }
}

void AsyncCheckpointer::wait() {
  if (!job_) return;
  std::shared_ptr<detail::AsyncJob> job = std::move(job_);
  job_.reset();
  if (job->thread.joinable()) job->thread.join();
  job->rethrow_once();
}

bool AsyncCheckpointer::in_flight() const { return job_ != nullptr; }

std::size_t AsyncCheckpointer::staging_bytes() const {
  return staging_->buffer.defined() ? static_cast<std::size_t>(staging_->buffer.numel()) : 0;
}

SaveHandle AsyncCheckpointer::start(const std::string& path, std::function<void()> write) {
  auto job = std::make_shared<detail::AsyncJob>();
  job->path = path;
  // The thread holds the job, not the other way round: a job owns its std::thread object only
  // to be joined by this checkpointer.
  job->thread = std::thread([job_ptr = job.get(), write = std::move(write)] {
    std::exception_ptr error;
    try {
      write();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(job_ptr->mutex);
    job_ptr->error = error;
    job_ptr->finished = true;
    job_ptr->finished_cv.notify_all();
  });
  job_ = job;
  return SaveHandle(std::move(job));
}

SaveHandle AsyncCheckpointer::save_file(const std::string& path, const Container& contents,
                                        std::function<void()> after_commit) {
  wait();
  bool any_cuda = false;
  staging_->reserve(Staging::bytes_needed(contents.tensors, any_cuda), any_cuda);
  std::size_t offset = 0;
  Container snapshot{staging_->copy(contents.tensors, offset), contents.state};
  Env* env = &env_;
  return start(path,
               [path, snapshot = std::move(snapshot), env, after_commit = std::move(after_commit)] {
                 torchpoint::save_file(path, snapshot, *env);
                 if (after_commit) after_commit();
               });
}

SaveHandle AsyncCheckpointer::save_directory(const std::string& path,
                                             const std::vector<Component>& components,
                                             const CheckpointInfo& info,
                                             const SaveDirectoryOptions& options,
                                             std::function<void()> after_commit) {
  wait();
  bool any_cuda = false;
  std::size_t bytes = 0;
  for (const Component& c : components)
    bytes += Staging::bytes_needed(c.contents.tensors, any_cuda);
  staging_->reserve(bytes, any_cuda);
  std::size_t offset = 0;
  std::vector<Component> snapshot;
  snapshot.reserve(components.size());
  for (const Component& c : components) {
    snapshot.push_back({c.name, {staging_->copy(c.contents.tensors, offset), c.contents.state}});
  }
  Env* env = &env_;
  return start(path, [path, snapshot = std::move(snapshot), info, options, env,
                      after_commit = std::move(after_commit)] {
    torchpoint::save_directory(path, snapshot, info, *env, options);
    if (after_commit) after_commit();
  });
}

}  // namespace torchpoint
