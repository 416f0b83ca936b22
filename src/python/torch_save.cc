// save_torch_state_dict: a file that Python's torch.load reads, with weights_only=True (the
// default since PyTorch 2.6) as well as False. LibTorch's own pickler cannot be used for this:
// it wraps dicts and lists in torch.jit._pickle globals that the weights-only unpickler refuses.
// So the file is built here from the few pieces torch.save itself uses for a dict of tensors:
//   archive/data.pkl   a protocol-2 pickle of {name: tensor}, each tensor a
//                      torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False,
//                      OrderedDict()) over a typed storage (torch.FloatStorage, ...), or
//                      _rebuild_tensor_v3(untyped storage, ..., dtype) for the dtypes that
//                      torch 2.x writes that way (uint16/32/64, float8);
//   archive/data/<k>   each storage's bytes, little-endian, 64-byte aligned in the file;
//   archive/version, archive/byteorder
// in a zip of stored records with a ZIP64 end record, as PyTorch's writer makes it.
#include <fmt/format.h>

#include <bit>
#include <cstring>
#include <functional>
#include <limits>

#include "compat/torch_compat.h"
#include "io/atomic_commit.h"
#include "python/torch_pickle.h"
#include "python/torch_value.h"
#include "python/torch_zip.h"
#include "torchpoint/error.h"
#include "torchpoint/interop.h"

namespace torchpoint {
namespace {

// The pickle opcodes used (Python's pickletools names them).
constexpr char kProto = '\x80', kEmptyDict = '}', kMark = '(', kBinUnicode = 'X', kGlobal = 'c',
               kTuple = 't', kEmptyTuple = ')', kBinPersId = 'Q', kBinInt = 'J', kLong1 = '\x8a',
               kNewFalse = '\x89', kReduce = 'R', kSetItems = 'u', kStop = '.', kNone = 'N',
               kNewTrue = '\x88', kTuple3 = '\x87', kBinFloat = 'G', kEmptyList = ']', kAppends = 'e', kBuild = 'b';

// The typed storage class of `type` ("FloatStorage"), or empty for the newer dtypes.
std::string_view typed_storage(c10::ScalarType type) {
  for (const detail::StorageType& t : detail::kStorageTypes) {
    if (t.dtype == type) return t.name;
  }
  return {};
}

// The Python name of a dtype written with _rebuild_tensor_v3, or empty.
std::string_view v3_dtype_name(c10::ScalarType type) {
  for (const compat::NewerDtype& d : compat::kNewerDtypes) {
    if (compat::scalar_type_for(d.safetensors) == type) return d.python;
  }
  return {};
}

class Pickler {
 public:
  Pickler() { out_ += {kProto, '\x02'}; }
  void op(char c) { out_ += c; }
  void text(std::string_view s) {
    out_ += kBinUnicode;
    le(static_cast<std::uint32_t>(s.size()), 4);
    out_ += s;
  }
  void global(std::string_view module, std::string_view name) {
    out_ += kGlobal;
    out_ += module;
    out_ += '\n';
    out_ += name;
    out_ += '\n';
  }
  void integer(std::int64_t v) {
    if (v >= std::numeric_limits<std::int32_t>::min() &&
        v <= std::numeric_limits<std::int32_t>::max()) {
      out_ += kBinInt;
      le(static_cast<std::uint32_t>(static_cast<std::int32_t>(v)), 4);
    } else {
      out_ += kLong1;  // 8 bytes, two's complement, little-endian
      out_ += '\x08';
      le(static_cast<std::uint64_t>(v), 8);
    }
  }
  void ints(c10::IntArrayRef values) {
    if (values.empty()) return op(kEmptyTuple);
    op(kMark);
    for (std::int64_t v : values) integer(v);
    op(kTuple);
  }
  void number(double v) {
    out_ += kBinFloat;  // big-endian
    const auto bits = std::bit_cast<std::uint64_t>(v);
    for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xff);
  }
  // A Python bytes, as protocol 2 writes it: _codecs.encode(<its Latin-1 text>, "latin1").
  void bytes(std::string_view b) {
    global("_codecs", "encode");
    op(kMark);
    std::string latin1;
    latin1.reserve(b.size() * 2);
    for (char c : b) {
      auto u = static_cast<unsigned char>(c);
      if (u < 0x80) {
        latin1 += c;
      } else {
        latin1 += static_cast<char>(0xc0 | (u >> 6));
        latin1 += static_cast<char>(0x80 | (u & 0x3f));
      }
    }
    text(latin1);
    text("latin1");
    op(kTuple);
    op(kReduce);
  }
  std::string finish() {
    out_ += kStop;
    return std::move(out_);
  }

 private:
  void le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  std::string out_;
};

// Where the bytes of a file go, in order: a string, or a file (through a buffer, so the many
// small headers do not each cost a system call, while large records go straight from the
// tensor's memory to the file and the file is never whole in memory).
using Sink = std::function<void(std::string_view)>;

// A zip of stored (uncompressed) records, each record's data 64-byte aligned, with ZIP64
// fields wherever a size or offset does not fit 32 bits and always a ZIP64 end record.
class ZipWriter {
 public:
  explicit ZipWriter(Sink sink) : sink_(std::move(sink)) {}

  void add(const std::string& name, std::string_view data) {
    Entry e{name, pos_, data.size(), detail::crc32(data)};
    const bool zip64 = e.offset >= kMax32 || e.size >= kMax32;
    // Local header: 30 bytes, the name, a ZIP64 field if needed, then padding to 64 bytes.
    std::size_t extra = zip64 ? 20 : 0;
    std::size_t data_at = e.offset + 30 + name.size() + extra + 4;
    std::size_t pad = (64 - data_at % 64) % 64;
    extra += 4 + pad;
    u32(0x04034b50);
    u16(zip64 ? 45 : 20);  // version needed
    u16(0);                // flags
    u16(0);                // stored
    u16(0);                // time
    u16(0x21);             // date: 1980-01-01
    u32(e.crc);
    u32(zip64 ? kMax32 : e.size);
    u32(zip64 ? kMax32 : e.size);
    u16(name.size());
    u16(extra);
    out_ += name;
    if (zip64) {
      u16(0x0001);
      u16(16);
      u64(e.size);
      u64(e.size);
    }
    u16(0x4246);  // "FB": PyTorch's padding field
    u16(pad);
    out_.append(pad, 'Z');
    flush();
    sink_(data);
    pos_ += data.size();
    entries_.push_back(std::move(e));
  }

  // Writes the directory and end records; returns the size of the whole file.
  std::uint64_t finish() {
    const std::uint64_t directory_at = pos_;
    for (const Entry& e : entries_) {
      const bool big_size = e.size >= kMax32, big_offset = e.offset >= kMax32;
      const std::uint16_t extra = (big_size ? 16 : 0) + (big_offset ? 8 : 0);
      u32(0x02014b50);
      u16(45);  // made by
      u16(extra ? 45 : 20);
      u16(0);
      u16(0);
      u16(0);
      u16(0x21);
      u32(e.crc);
      u32(big_size ? kMax32 : e.size);
      u32(big_size ? kMax32 : e.size);
      u16(e.name.size());
      u16(extra ? extra + 4 : 0);
      u16(0);  // comment
      u16(0);  // disk
      u16(0);  // internal attributes
      u32(0);  // external attributes
      u32(big_offset ? kMax32 : e.offset);
      out_ += e.name;
      if (extra) {
        u16(0x0001);
        u16(extra);
        if (big_size) {
          u64(e.size);
          u64(e.size);
        }
        if (big_offset) u64(e.offset);
      }
    }
    const std::uint64_t directory_size = pos_ + out_.size() - directory_at;
    const std::uint64_t end64_at = pos_ + out_.size();
    u32(0x06064b50);  // ZIP64 end of central directory record
    u64(44);
    u16(45);
    u16(45);
    u32(0);
    u32(0);
    u64(entries_.size());
    u64(entries_.size());
    u64(directory_size);
    u64(directory_at);
    u32(0x07064b50);  // its locator
    u32(0);
    u64(end64_at);
    u32(1);
    u32(0x06054b50);  // end of central directory
    u16(0);
    u16(0);
    u16(std::min<std::size_t>(entries_.size(), 0xffff));
    u16(std::min<std::size_t>(entries_.size(), 0xffff));
    u32(std::min<std::uint64_t>(directory_size, kMax32));
    u32(std::min<std::uint64_t>(directory_at, kMax32));
    u16(0);
    flush();
    return pos_;
  }

 private:
  static constexpr std::uint64_t kMax32 = 0xffffffffu;
  struct Entry {
    std::string name;
    std::uint64_t offset;
    std::uint64_t size;
    std::uint32_t crc;
  };
  void le(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
  }
  void u16(std::uint64_t v) { le(v, 2); }
  void u32(std::uint64_t v) { le(v, 4); }
  void u64(std::uint64_t v) { le(v, 8); }
  // Hands the headers built so far to the sink.
  void flush() {
    sink_(out_);
    pos_ += out_.size();
    out_.clear();
  }
  Sink sink_;
  std::uint64_t pos_ = 0;  // bytes handed to the sink
  std::string out_;        // headers not yet handed over
  std::vector<Entry> entries_;
};

// Writes Python values with the globals torch.load(weights_only=True) accepts (and, for NumPy
// arrays, those Accelerate adds to them); tensors' storages are collected for the zip.
class ValueWriter {
 public:
  explicit ValueWriter(Pickler& pickle) : pickle_(pickle) {}

  void write(const detail::PyValue& v, const std::string& name) {
    using Kind = detail::PyValue::Kind;
    switch (v.kind) {
      case Kind::kNone:
        return pickle_.op(kNone);
      case Kind::kBool:
        return pickle_.op(v.boolean ? kNewTrue : kNewFalse);
      case Kind::kInt:
        return pickle_.integer(v.integer);
      case Kind::kFloat:
        return pickle_.number(v.number);
      case Kind::kStr:
        return pickle_.text(v.text);
      case Kind::kBytes:
        return pickle_.bytes(v.text);
      case Kind::kTuple:
        if (v.items.empty()) return pickle_.op(kEmptyTuple);
        pickle_.op(kMark);
        for (std::size_t i = 0; i < v.items.size(); ++i) {
          write(v.items[i], fmt::format("{}[{}]", name, i));
        }
        return pickle_.op(kTuple);
      case Kind::kList:
        pickle_.op(kEmptyList);
        if (v.items.empty()) return;
        pickle_.op(kMark);
        for (std::size_t i = 0; i < v.items.size(); ++i) {
          write(v.items[i], fmt::format("{}[{}]", name, i));
        }
        return pickle_.op(kAppends);
      case Kind::kDict:
        if (v.type == "OrderedDict" || v.type == "Counter") {
          pickle_.global("collections", v.type);
          pickle_.op(kEmptyTuple);
          pickle_.op(kReduce);
        } else {
          pickle_.op(kEmptyDict);
        }
        if (v.entries.empty()) return;
        pickle_.op(kMark);
        for (const auto& [key, value] : v.entries) {
          write(key, name);
          write(value, key.kind != Kind::kStr ? name
                       : name.empty()          ? key.text
                                               : fmt::format("{}/{}", name, key.text));
        }
        return pickle_.op(kSetItems);
      case Kind::kTensor:
        return tensor(v.tensor, name);
      case Kind::kArray:
        return array(v, name);
    }
  }

  std::vector<at::Tensor>& storages() { return storages_; }

 private:
  void tensor(const at::Tensor& value, const std::string& name) {
    if (!value.defined()) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("tensor '{}' is undefined: nothing to save", name));
    }
    // Its own storage of exactly its bytes: views of one buffer are written apart (as
    // safetensors does), so a file never holds more bytes than its tensors.
    at::Tensor t = value.detach().to(at::kCPU).contiguous();
    const std::string_view typed = typed_storage(t.scalar_type());
    const std::string_view v3 = typed.empty() ? v3_dtype_name(t.scalar_type()) : "";
    if (typed.empty() && v3.empty()) {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("tensor '{}' has dtype {}, which torchpoint cannot write for "
                              "torch.load; convert it (e.g. .to(torch::kFloat))",
                              name, c10::toString(t.scalar_type())));
    }
    const std::string key = std::to_string(storages_.size());
    Pickler& pickle = pickle_;
    pickle.global("torch._utils", v3.empty() ? "_rebuild_tensor_v2" : "_rebuild_tensor_v3");
    pickle.op(kMark);
    {  // persistent id: ('storage', storage class, key, location, size)
      pickle.op(kMark);
      pickle.text("storage");
      if (!v3.empty()) {
        pickle.global("torch.storage", "UntypedStorage");
      } else {
        pickle.global("torch", typed);
      }
      pickle.text(key);
      pickle.text("cpu");
      pickle.integer(v3.empty() ? t.numel() : t.numel() * t.element_size());
      pickle.op(kTuple);
      pickle.op(kBinPersId);
    }
    pickle.integer(0);
    pickle.ints(t.sizes());
    pickle.ints(t.strides());
    pickle.op(kNewFalse);
    pickle.global("collections", "OrderedDict");
    pickle.op(kEmptyTuple);
    pickle.op(kReduce);
    if (!v3.empty()) pickle.global("torch", v3);
    pickle.op(kTuple);
    pickle.op(kReduce);
    storages_.push_back(std::move(t));
  }

  // numpy._core.multiarray._reconstruct(numpy.ndarray, (0,), b"b"), then BUILD with
  // (1, shape, dtype, False, bytes): what NumPy's own pickling writes.
  void array(const detail::PyValue& v, const std::string& name) {
    if (v.type.size() < 3) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("'{}': a NumPy array without a dtype", name));
    }
    pickle_.global("numpy._core.multiarray", "_reconstruct");
    pickle_.global("numpy", "ndarray");
    pickle_.op(kMark);
    pickle_.integer(0);
    pickle_.op(kTuple);
    pickle_.bytes("b");
    pickle_.op(kTuple3);
    pickle_.op(kReduce);
    pickle_.op(kMark);
    pickle_.integer(1);
    pickle_.ints(v.shape);
    pickle_.global("numpy", "dtype");
    pickle_.op(kMark);
    pickle_.text(v.type.substr(1));
    pickle_.op(kNewFalse);
    pickle_.op(kNewTrue);
    pickle_.op(kTuple);
    pickle_.op(kReduce);
    pickle_.op(kMark);
    pickle_.integer(3);
    pickle_.text(v.type.substr(0, 1));
    pickle_.op(kNone);
    pickle_.op(kNone);
    pickle_.op(kNone);
    pickle_.integer(-1);
    pickle_.integer(-1);
    pickle_.integer(0);
    pickle_.op(kTuple);
    pickle_.op(kBuild);
    pickle_.op(kNewFalse);
    pickle_.bytes(v.text);
    pickle_.op(kTuple);
    pickle_.op(kBuild);
  }

  Pickler& pickle_;
  std::vector<at::Tensor> storages_;
};

// Writes a torch.save file of `value`, its records under `archive`/, to `sink`; returns its
// size.
std::uint64_t write_torch_value(const detail::PyValue& value, std::string_view archive,
                                const Sink& sink) {
  static_assert(std::endian::native == std::endian::little, "storages are written little-endian");
  Pickler pickle;
  ValueWriter writer(pickle);
  writer.write(value, "");
  ZipWriter zip(sink);
  zip.add(fmt::format("{}/data.pkl", archive), pickle.finish());
  zip.add(fmt::format("{}/byteorder", archive), "little");
  const std::vector<at::Tensor>& storages = writer.storages();
  for (std::size_t i = 0; i < storages.size(); ++i) {
    const at::Tensor& t = storages[i];
    zip.add(fmt::format("{}/data/{}", archive, i),
            std::string_view(static_cast<const char*>(t.data_ptr()),
                             static_cast<std::size_t>(t.numel() * t.element_size())));
  }
  zip.add(fmt::format("{}/version", archive), "3\n");
  return zip.finish();
}

detail::PyValue tensors_value(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  detail::PyValue dict = detail::PyValue::dict();
  dict.entries.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    dict.entries.push_back({detail::PyValue::of(name), detail::PyValue::of(t)});
  }
  return dict;
}

// Writes the file of `tensors` to `sink`; returns its size.
std::uint64_t write_torch_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                     const Sink& sink) {
  return write_torch_value(tensors_value(tensors), "archive", sink);
}

}  // namespace

std::string torch_state_dict_bytes(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::string out;
  write_torch_state_dict(tensors, [&out](std::string_view bytes) { out += bytes; });
  return out;
}

std::uint64_t save_torch_state_dict(const std::string& path,
                                    const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                    Env& env) {
  return detail::save_torch_value(path, tensors_value(tensors), "archive", env);
}

std::uint64_t detail::save_torch_value(const std::string& path, const PyValue& value,
                                       std::string_view archive, Env& env) {
  constexpr std::size_t kBufferSize = std::size_t{1} << 20;
  PendingFile pending(env, path);
  std::unique_ptr<File> file = env.open(pending.temp_path(), OpenMode::CreateExclusive);
  std::uint64_t offset = 0;
  std::string buffer;
  buffer.reserve(kBufferSize);
  auto drain = [&] {
    file->write_all(buffer.data(), buffer.size(), offset);
    offset += buffer.size();
    buffer.clear();
  };
  std::uint64_t size = write_torch_value(value, archive, [&](std::string_view bytes) {
    if (buffer.size() + bytes.size() <= kBufferSize) {
      buffer += bytes;
      return;
    }
    drain();
    file->write_all(bytes.data(), bytes.size(), offset);  // a storage, from its own memory
    offset += bytes.size();
  });
  drain();
  // Durable before the rename publishes it.
  file->sync();
  file->close();
  pending.commit();
  return size;
}

}  // namespace torchpoint
