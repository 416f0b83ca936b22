#include "format/staging_gate.h"

#include "torchpoint/error.h"

namespace torchpoint::detail {

thread_local const StagingGate* current_staging_gate = nullptr;

void StagingGate::publish(std::size_t end) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    published_.store(end, std::memory_order_release);
  }
  cv_.notify_all();
}

void StagingGate::abandon() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void StagingGate::wait_for(const void* data, std::size_t bytes) const {
  const auto* p = static_cast<const std::uint8_t*>(data);
  if (p < base_ || p >= base_ + size_) return;
  const std::size_t end = static_cast<std::size_t>(p - base_) + bytes;
  if (published_.load(std::memory_order_acquire) >= end) return;
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] {
    return abandoned_.load(std::memory_order_acquire) ||
           published_.load(std::memory_order_acquire) >= end;
  });
  if (published_.load(std::memory_order_acquire) < end) {
    throw Error(ErrorCode::InvalidArgument,
                "the snapshot of this asynchronous save failed before it was complete; nothing "
                "was committed (the caller got the snapshot's error)");
  }
}

}  // namespace torchpoint::detail
