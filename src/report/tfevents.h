// TensorBoard's event files, written: the TFRecord framing (length, masked CRC-32C of the
// length, payload, masked CRC-32C of the payload) around serialized tensorflow.Event protocol
// buffers carrying scalar summaries. Only the few fields TensorBoard's scalar reader needs are
// encoded, by hand on the protobuf wire format (field numbers from tensorflow/core/util/
// event.proto and framework/summary.proto).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace torchpoint::detail {

// CRC-32C of `data`, masked as TFRecord stores it.
std::uint32_t tfrecord_masked_crc(const std::string& data);

// One TFRecord: the framing around `payload`.
std::string tfrecord(const std::string& payload);

// A serialized Event holding only file_version (the first event of every file).
std::string event_file_version(double wall_time);
// A serialized Event with a SessionLog START at `step`: TensorBoard drops what earlier files
// logged at `step` and later (the epochs a resumed run repeats).
std::string event_session_start(double wall_time, std::int64_t step);
// A serialized Event with a Summary of scalar values (tag, value) at `step`.
std::string event_scalars(double wall_time, std::int64_t step,
                          const std::vector<std::pair<std::string, float>>& values);

// The file name TensorBoard looks for: events.out.tfevents.<seconds>.<host>.<pid>.<serial>.
std::string event_file_name(double wall_time, int serial);

}  // namespace torchpoint::detail
