#include "torchpoint/async_save.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <utility>

#include "format/staging_gate.h"
#include "io/huge_pages.h"

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

// Only dense tensors are copied; any other layout is passed on for the writer to refuse.
bool stageable(const at::Tensor& t) { return t.defined() && t.layout() == at::kStrided; }

}  // namespace

namespace detail {

// A tensor still to be copied into its view of the staging buffer.
struct PendingCopy {
  at::Tensor source;
  at::Tensor view;
  std::size_t end;  // offset in the buffer where its bytes end
};

}  // namespace detail

using detail::PendingCopy;

// One buffer, sliced into a view per tensor. Each container's tensors are laid out as its file
// will hold them (data order: descending element size, the caller's order among equals; no gaps;
// the first at a 4096-byte boundary), so that the writer sends the buffer to the disk as it is,
// without copying it again. It is reallocated only when a state does not fit (or a CUDA tensor
// needs pinned memory it lacks), and only between saves: the previous save has finished with it
// by then.
struct AsyncCheckpointer::Staging {
  static constexpr std::size_t kImageAlign = 4096;  // O_DIRECT's alignment

  at::Tensor buffer;  // uint8; base() is its first 4096-byte boundary
  bool pinned = false;

  static std::size_t round_up(std::size_t n) {
    return (n + kImageAlign - 1) / kImageAlign * kImageAlign;
  }

  // The bytes one container's image takes, rounded up to a whole block (O_DIRECT writes the
  // last block whole).
  static std::size_t bytes_needed(const NamedTensors& tensors, bool& any_cuda,
                                  const std::function<bool(const std::string&)>& keep = {}) {
    std::size_t total = 0;
    for (const auto& [name, t] : tensors) {
      if (!stageable(t) || (keep && !keep(name))) continue;
      total += t.nbytes();
      any_cuda = any_cuda || t.is_cuda();
    }
    return round_up(total);
  }

  void reserve(std::size_t bytes, bool need_pinned) {
    const bool fits = buffer.defined() && capacity() >= bytes;
    if (fits && (pinned || !need_pinned)) return;
    buffer = at::Tensor();  // free the old buffer before taking the new one
    at::TensorOptions options = at::TensorOptions().dtype(at::kByte);
    if (need_pinned) options = options.pinned_memory(true);
    buffer = at::empty({static_cast<std::int64_t>(bytes + kImageAlign)}, options);
    pinned = need_pinned;
    if (!pinned) advise_huge_pages(buffer.data_ptr(), static_cast<std::size_t>(buffer.numel()));
  }

  std::uint8_t* base() const {
    auto address = reinterpret_cast<std::uintptr_t>(buffer.data_ptr());
    return reinterpret_cast<std::uint8_t*>((address + kImageAlign - 1) / kImageAlign * kImageAlign);
  }
  std::size_t capacity() const {
    if (!buffer.defined()) return 0;
    return static_cast<std::size_t>(buffer.numel()) -
           static_cast<std::size_t>(base() - static_cast<std::uint8_t*>(buffer.data_ptr()));
  }

  // Views of the buffer from `offset` (a block boundary) on, one per tensor of `tensors`, in the
  // caller's order, laid out in data order; `offset` moves past the image. The copies still to
  // be made are appended to `copies`, in buffer order.
  NamedTensors views(const NamedTensors& tensors, std::size_t& offset,
                     std::vector<PendingCopy>& copies,
                     const std::function<bool(const std::string&)>& keep = {}) {
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (stageable(tensors[i].second) && (!keep || keep(tensors[i].first))) order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return tensors[a].second.element_size() > tensors[b].second.element_size();
    });
    NamedTensors out = tensors;  // the tensors that are not staged stay as they are
    std::size_t at = offset;
    for (std::size_t i : order) {
      const at::Tensor& t = tensors[i].second;
      at::Tensor view = at::from_blob(base() + at, t.sizes(),
                                      at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU));
      at += t.nbytes();
      copies.push_back({t, view, at});
      out[i].second = std::move(view);
    }
    offset = offset + round_up(at - offset);
    return out;
  }
};

namespace {

// The writer's chunk: publishing more often wakes it for no use.
constexpr std::size_t kPublishEvery = 8u << 20;

// Copies every pending tensor, front to back, telling the writer how far the copy has got.
void fill(const std::vector<PendingCopy>& copies, detail::StagingGate& gate) {
  std::size_t published = 0;
  for (const PendingCopy& c : copies) {
    const at::Tensor& t = c.source;
    if (!t.device().is_cpu() || !t.is_contiguous()) {
      c.view.copy_(t);  // strided layouts, other devices
      continue;
    }
    // Plain copies on this thread (at::copy_ would hand each tensor to the intra-op pool, whose
    // wake-ups cost more than the copy for most tensors of a model and stall on a busy
    // machine), a chunk at a time, each published at once: the writer sends it to the disk
    // while the next is copied.
    const auto* src = static_cast<const std::uint8_t*>(t.data_ptr());
    auto* dst = static_cast<std::uint8_t*>(c.view.data_ptr());
    const std::size_t size = t.nbytes(), start = c.end - size;
    for (std::size_t done = 0; done < size;) {
      const std::size_t piece = std::min(kPublishEvery, size - done);
      std::memcpy(dst + done, src + done, piece);
      done += piece;
      if (start + done - published >= kPublishEvery) {
        published = start + done;
        gate.publish(published);
      }
    }
  }
  gate.publish(std::numeric_limits<std::size_t>::max());
}

}  // namespace

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
  std::shared_ptr<detail::AsyncJob> job = std::move(job_);  // leaves job_ empty
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

SaveHandle AsyncCheckpointer::snapshot_and_start(const std::string& path,
                                                 std::vector<PendingCopy> copies,
                                                 std::function<void()> write) {
  // The writer starts at once (opening files, writing what is already copied) while this
  // thread copies the rest; it waits at each tensor not copied yet.
  auto gate = std::make_shared<detail::StagingGate>(staging_->base(), staging_->capacity());
  SaveHandle handle = start(path, [gate, write = std::move(write)] {
    struct Scope {
      explicit Scope(const detail::StagingGate* g) { detail::current_staging_gate = g; }
      ~Scope() { detail::current_staging_gate = nullptr; }
    } scope(gate.get());
    write();
  });
  try {
    fill(copies, *gate);
  } catch (...) {
    // The writer stops at the first tensor not copied and removes what it wrote; its error is
    // a consequence of this one, which is the one the caller gets.
    gate->abandon();
    std::shared_ptr<detail::AsyncJob> job = std::move(job_);  // leaves job_ empty
    job->thread.join();
    throw;
  }
  return handle;
}

SaveHandle AsyncCheckpointer::save_file(const std::string& path, const Container& contents,
                                        std::function<void()> after_commit) {
  wait();
  bool any_cuda = false;
  staging_->reserve(Staging::bytes_needed(contents.tensors, any_cuda), any_cuda);
  std::size_t offset = 0;
  std::vector<PendingCopy> copies;
  Container snapshot{staging_->views(contents.tensors, offset, copies), contents.state};
  Env* env = &env_;
  return snapshot_and_start(
      path, std::move(copies),
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
  Env* env = &env_;
  return save_with(path, components,
                   [path, info, options, env, after_commit = std::move(after_commit)](
                       const std::vector<Component>& snapshot) {
                     torchpoint::save_directory(path, snapshot, info, *env, options);
                     if (after_commit) after_commit();
                   });
}

SaveHandle AsyncCheckpointer::save_with(const std::string& path,
                                        const std::vector<Component>& components,
                                        std::function<void(const std::vector<Component>&)> write,
                                        const StageFilter& stage) {
  wait();
  auto keep_of = [&](const Component& c) -> std::function<bool(const std::string&)> {
    if (!stage) return {};
    return [&stage, &c](const std::string& tensor) { return stage(c.name, tensor); };
  };
  bool any_cuda = false;
  std::size_t bytes = 0;
  for (const Component& c : components) {
    bytes += Staging::bytes_needed(c.contents.tensors, any_cuda, keep_of(c));
  }
  staging_->reserve(bytes, any_cuda);
  std::size_t offset = 0;
  std::vector<PendingCopy> copies;
  std::vector<Component> snapshot;
  snapshot.reserve(components.size());
  for (const Component& c : components) {
    snapshot.push_back({c.name,
                        {staging_->views(c.contents.tensors, offset, copies, keep_of(c)),
                         c.contents.state}});
  }
  return snapshot_and_start(path, std::move(copies),
                            [snapshot = std::move(snapshot), write = std::move(write)] {
                              write(snapshot);
                            });
}

}  // namespace torchpoint
