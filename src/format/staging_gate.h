// Lets a background write start before its snapshot is complete: the thread taking the snapshot
// copies tensors into one staging buffer, front to back, and publishes how far it has got; the
// container writer, before reading a tensor's bytes from that buffer, waits until they are there.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace torchpoint::detail {

class StagingGate {
 public:
  StagingGate(const std::uint8_t* base, std::size_t size) : base_(base), size_(size) {}

  // Bytes [0, end) of the buffer hold their final values.
  void publish(std::size_t end);
  // The snapshot failed: writers waiting now or later throw.
  void abandon();
  // Whether [data, data + bytes) lies inside the buffer.
  bool contains(const void* data, std::size_t bytes) const {
    const auto* p = static_cast<const std::uint8_t*>(data);
    return p >= base_ && p <= base_ + size_ && bytes <= static_cast<std::size_t>(base_ + size_ - p);
  }
  // Returns once [data, data + bytes) holds its final values; at once for memory outside the
  // buffer. Throws InvalidArgument when the snapshot was abandoned before reaching them.
  void wait_for(const void* data, std::size_t bytes) const;

 private:
  const std::uint8_t* base_;
  std::size_t size_;
  std::atomic<std::size_t> published_{0};
  std::atomic<bool> abandoned_{false};
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
};

// The gate of the writes made on this thread (set by an asynchronous save's thread), or null.
extern thread_local const StagingGate* current_staging_gate;

}  // namespace torchpoint::detail
