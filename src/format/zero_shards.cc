// The layout of ZeRO-sharded optimizer state in a directory checkpoint, and its reassembly
// onto any other range of the flat space (another number of processes, or one whole state).
#include "format/zero_shards.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <memory>

#include "torchpoint/error.h"

namespace torchpoint::detail {
namespace {

constexpr const char* kZeroKey = "zero";

[[noreturn]] void corrupt(const std::string& where, const std::string& what) {
  throw Error(ErrorCode::Corruption, fmt::format("{}: {}", where, what));
}

// A count in decimal digits only, of at most `max_digits` digits.
template <typename T>
bool parse_count(std::string_view text, T& out,
                 std::size_t max_digits = std::numeric_limits<T>::digits10) {
  if (text.empty() || text.size() > max_digits) return false;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc() && end == text.data() + text.size() && out >= 0;
}

// "<prefix>.<g>.<i>.<rest>" -> g, i, rest.
bool split_key(std::string_view key, std::string_view prefix, int& g, int& i,
               std::string& rest) {
  if (!key.starts_with(prefix) || key.size() <= prefix.size() || key[prefix.size()] != '.') {
    return false;
  }
  key.remove_prefix(prefix.size() + 1);
  const std::size_t a = key.find('.');
  if (a == std::string_view::npos) return false;
  const std::size_t b = key.find('.', a + 1);
  if (b == std::string_view::npos) return false;
  if (!parse_count(key.substr(0, a), g) || !parse_count(key.substr(a + 1, b - a - 1), i)) {
    return false;
  }
  rest = std::string(key.substr(b + 1));
  return !rest.empty();
}

// "<field>.<k>" -> field, k (a chunk's key, after the parameter's "state.<g>.<i>.").
bool split_chunk(std::string_view rest, std::string_view& field, std::int64_t& k) {
  const std::size_t dot = rest.rfind('.');
  if (dot == std::string_view::npos || dot == 0) return false;
  if (!parse_count(rest.substr(dot + 1), k, 12)) return false;
  field = rest.substr(0, dot);
  return true;
}

}  // namespace

std::int64_t zero_chunk_elements() {
  const char* text = std::getenv("TORCHPOINT_ZERO_CHUNK_ELEMENTS");
  if (text == nullptr || *text == '\0') return kZeroChunkElements;
  std::int64_t n = 0;
  const std::string_view view(text);
  if (!parse_count(view, n) || n == 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("TORCHPOINT_ZERO_CHUNK_ELEMENTS is '{}': give a positive number of "
                            "elements, or unset it for the default {}",
                            view, kZeroChunkElements));
  }
  return n;
}

TensorFilter zero_shard_filter(const ZeroLayout& layout, std::int64_t begin, std::int64_t end) {
  std::map<std::pair<int, int>, std::int64_t> offsets;
  for (const ZeroLayout::Param& p : layout.params) offsets[{p.group, p.index}] = p.offset;
  // The pieces' extents, indexed from the shard's values on the first call (the values are an
  // ordered object, whose find() walks every key).
  auto pieces = std::make_shared<std::map<std::pair<int, int>, std::pair<std::int64_t, std::int64_t>>>();
  auto indexed = std::make_shared<bool>(false);
  return [offsets = std::move(offsets), pieces, indexed, begin, end, chunk = layout.chunk](
             const std::string& tensor, const Json& state) {
    if (!*indexed) {
      *indexed = true;
      auto values = state.find("values");
      if (values != state.end() && values->is_object()) {
        int g = 0, i = 0;
        std::string rest;
        for (const auto& [key, value] : values->items()) {
          if (!value.is_number_integer() || !split_key(key, "zero", g, i, rest)) continue;
          if (rest == "begin") (*pieces)[{g, i}].first = value.get<std::int64_t>();
          if (rest == "numel") (*pieces)[{g, i}].second = value.get<std::int64_t>();
        }
      }
    }
    int g = 0, i = 0;
    std::string rest;
    // Anything not a piece's state, or not understood, is read: parse() judges it.
    if (!split_key(tensor, "state", g, i, rest)) return true;
    auto offset = offsets.find({g, i});
    auto piece = pieces->find({g, i});
    if (offset == offsets.end() || piece == pieces->end()) return true;
    std::int64_t first = offset->second + piece->second.first;
    std::int64_t numel = piece->second.second;
    std::string_view field;
    std::int64_t k = 0;
    if (chunk > 0) {
      if (!split_chunk(rest, field, k) || k >= (numel + chunk - 1) / chunk) return true;
      first += k * chunk;
      numel = std::min(chunk, numel - k * chunk);
    }
    return first < end && first + numel > begin;
  };
}

std::string zero_shard_name(const std::string& optimizer, int rank) {
  return fmt::format("{}_zero_{}", optimizer, rank);
}

std::int64_t ZeroLayout::Param::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

std::vector<int> ZeroLayout::ranks_meeting(std::int64_t begin, std::int64_t end) const {
  std::vector<int> out;
  if (part <= 0 || begin >= end) return out;
  for (std::int64_t r = begin / part; r < world && r * part < end; ++r) {
    out.push_back(static_cast<int>(r));
  }
  return out;
}

Json ZeroLayout::to_json() const {
  Json ps = Json::array();
  for (const Param& p : params) {
    ps.push_back({{"group", p.group}, {"index", p.index}, {"offset", p.offset}, {"shape", p.shape}});
  }
  Json files = Json::array();
  for (int r = 0; r < world; ++r) files.push_back(zero_shard_name(optimizer, r));
  Json out = {{"optimizer", optimizer}, {"stage", stage}, {"world", world}, {"total", total},
              {"part", part}};
  if (chunk > 0) out["chunk"] = chunk;
  out["shards"] = std::move(files);
  out["params"] = std::move(ps);
  return out;
}

ZeroLayout ZeroLayout::from_json(const Json& json, const std::string& where) {
  ZeroLayout out;
  try {
    out.optimizer = json.at("optimizer").get<std::string>();
    out.stage = json.at("stage").get<int>();
    out.world = json.at("world").get<int>();
    out.total = json.at("total").get<std::int64_t>();
    out.part = json.at("part").get<std::int64_t>();
    if (json.contains("chunk")) out.chunk = json.at("chunk").get<std::int64_t>();
    for (const Json& p : json.at("params")) {
      out.params.push_back({p.at("group").get<int>(), p.at("index").get<int>(),
                            p.at("offset").get<std::int64_t>(),
                            p.at("shape").get<std::vector<std::int64_t>>()});
    }
  } catch (const Json::exception& e) {
    corrupt(where, fmt::format("the ZeRO layout in the manifest is malformed ({})", e.what()));
  }
  if (out.chunk < 0) {
    corrupt(where, fmt::format("the ZeRO layout of {} has chunks of {} elements",
                               out.optimizer, out.chunk));
  }
  if (out.world < 1 || out.total < 0 || out.part < 0 ||
      (out.total > 0 && (out.part * out.world < out.total ||
                         out.part != (out.total + out.world - 1) / out.world))) {
    corrupt(where, fmt::format("the ZeRO layout of {} does not add up: {} elements over {} "
                               "processes in parts of {}",
                               out.optimizer, out.total, out.world, out.part));
  }
  std::int64_t next = 0;
  for (const Param& p : out.params) {
    if (p.offset != next || p.numel() < 0) {
      corrupt(where, fmt::format("the ZeRO layout of {}: parameter {} of group {} begins at "
                                 "element {}, where {} was expected",
                                 out.optimizer, p.index, p.group, p.offset, next));
    }
    next += p.numel();
  }
  if (next != out.total) {
    corrupt(where, fmt::format("the ZeRO layout of {}: its parameters hold {} elements, not {}",
                               out.optimizer, next, out.total));
  }
  return out;
}

std::vector<ZeroLayout> zero_layouts(const Json& metadata, const std::string& where) {
  std::vector<ZeroLayout> out;
  if (!metadata.is_object() || !metadata.contains(kZeroKey)) return out;
  const Json& all = metadata.at(kZeroKey);
  if (!all.is_array()) corrupt(where, "the manifest's \"zero\" entry is not a list");
  for (const Json& layout : all) out.push_back(ZeroLayout::from_json(layout, where));
  return out;
}

ZeroShard ZeroShard::parse(const StateDict& contents, const ZeroLayout& layout, int rank,
                           const std::string& where) {
  const std::string name = zero_shard_name(layout.optimizer, rank);
  if (!contents.contains("zero.rank") || !contents.contains("zero.world") ||
      contents.get<int>("zero.rank") != rank || contents.get<int>("zero.world") != layout.world) {
    corrupt(where, fmt::format("{} is not rank {}'s shard of {} processes", name, rank,
                               layout.world));
  }
  std::map<std::pair<int, int>, const ZeroLayout::Param*> params;
  for (const ZeroLayout::Param& p : layout.params) params[{p.group, p.index}] = &p;
  const std::int64_t lo = std::min(layout.total, layout.part * rank);
  const std::int64_t hi = std::min(layout.total, lo + layout.part);
  // What the shard holds of each piece: its fields in order, its values, its tensors by chunk
  // (chunk 0 is the whole piece when the layout has no chunks).
  struct Held {
    std::vector<std::string> fields;
    StateDict values;
    std::map<std::int64_t, std::map<std::string, at::Tensor>> chunks;
  };
  std::map<std::pair<int, int>, Held> held;
  ZeroShard out;
  int g = 0, i = 0;
  std::string rest;
  for (const auto& [key, value] : contents.entries()) {
    if (split_key(key, "zero", g, i, rest)) {
      Piece& piece = out.pieces[{g, i}];
      if (rest == "begin") {
        piece.begin = contents.get<std::int64_t>(key);
      } else if (rest == "numel") {
        piece.numel = contents.get<std::int64_t>(key);
      }
      continue;
    }
    if (!split_key(key, "state", g, i, rest)) continue;
    out.pieces[{g, i}];
    Held& h = held[{g, i}];
    std::string_view field = rest;
    std::int64_t k = 0;
    if (std::holds_alternative<at::Tensor>(value)) {
      if (layout.chunk > 0 && !split_chunk(rest, field, k)) {
        corrupt(where, fmt::format("{}: {} is not a chunk (state.<g>.<i>.<field>.<k>), though "
                                   "the layout cuts pieces into chunks of {} elements",
                                   name, key, layout.chunk));
      }
      h.chunks[k][std::string(field)] = std::get<at::Tensor>(value);
    } else {
      h.values.set(std::string(field), std::get<Json>(value));
    }
    if (std::find(h.fields.begin(), h.fields.end(), field) == h.fields.end()) {
      h.fields.emplace_back(field);
    }
  }
  for (auto& entry : out.pieces) {
    // Named without a structured binding: the lambda below uses it (clang 14 allows no capture
    // of a binding).
    const std::pair<int, int>& at = entry.first;
    Piece& piece = entry.second;
    auto p = params.find(at);
    const bool fits = p != params.end() && piece.numel > 0 && piece.begin >= 0 &&
                      piece.begin + piece.numel <= p->second->numel() &&
                      p->second->offset + piece.begin >= lo &&
                      p->second->offset + piece.begin + piece.numel <= hi;
    if (!fits) {
      corrupt(where, fmt::format("{} holds elements [{}, {}) of parameter {} of group {}, which "
                                 "are not in rank {}'s range [{}, {}) of its layout",
                                 name, piece.begin, piece.begin + piece.numel, at.second,
                                 at.first, rank, lo, hi));
    }
    const Held& h = held[at];
    const std::int64_t chunk = layout.chunk > 0 ? layout.chunk : piece.numel;
    auto run_of = [&](std::int64_t from, std::int64_t numel,
                      const std::map<std::string, at::Tensor>* tensors) {
      Run run{piece.begin + from, numel, {}};
      for (const std::string& field : h.fields) {
        if (h.values.contains(field)) {
          run.state.set(field, h.values.value(field));
        } else if (tensors != nullptr && tensors->contains(field)) {
          run.state.set(field, tensors->at(field));
        }
      }
      piece.runs.push_back(std::move(run));
    };
    for (const auto& [k, tensors] : h.chunks) {
      const std::int64_t chunks = (piece.numel + chunk - 1) / chunk;
      const std::int64_t from = k * chunk;
      const std::int64_t numel = k < chunks ? std::min(chunk, piece.numel - from) : 0;
      for (const auto& [field, t] : tensors) {
        if (k >= chunks || t.dim() != 1 || t.numel() != numel) {
          corrupt(where, fmt::format("{}: state.{}.{}.{}{} holds {} elements, where its piece of "
                                     "{} elements in chunks of {} has {}",
                                     name, at.first, at.second, field,
                                     layout.chunk > 0 ? fmt::format(".{}", k) : "", t.numel(),
                                     piece.numel, chunk, numel));
        }
      }
      run_of(from, numel, &tensors);
    }
    if (piece.runs.empty()) run_of(0, piece.numel, nullptr);
  }
  return out;
}

StateDict zero_piece_state(const ZeroLayout& layout, const std::map<int, ZeroShard>& shards,
                           const ZeroLayout::Param& param, std::int64_t begin,
                           std::int64_t numel, const std::string& where) {
  struct Source {
    const ZeroShard::Run* run;
    std::int64_t from, to;  // of the requested elements, relative to `begin`
  };
  std::vector<Source> sources;
  const std::int64_t lo = param.offset + begin, hi = lo + numel;
  for (int r : layout.ranks_meeting(lo, hi)) {
    auto shard = shards.find(r);
    if (shard == shards.end()) {
      corrupt(where, fmt::format("the checkpoint lacks {}, which holds elements of parameter {} "
                                 "of group {} of {}",
                                 zero_shard_name(layout.optimizer, r), param.index, param.group,
                                 layout.optimizer));
    }
    auto piece = shard->second.pieces.find({param.group, param.index});
    if (piece == shard->second.pieces.end()) continue;
    for (const ZeroShard::Run& run : piece->second.runs) {
      const std::int64_t a = std::max(begin, run.begin);
      const std::int64_t b = std::min(begin + numel, run.begin + run.numel);
      if (a < b) sources.push_back({&run, a - begin, b - begin});
    }
  }
  StateDict out;
  if (sources.empty()) return out;
  // The elements of each field the runs hold (they do not overlap): a field they cover whole
  // needs no zeros first.
  std::map<std::string, std::int64_t> covered;
  for (const Source& s : sources) {
    for (const auto& [key, value] : s.run->state.entries()) {
      if (std::holds_alternative<at::Tensor>(value)) covered[key] += s.to - s.from;
    }
  }
  // Each field once, in the order the first run holding it lists it.
  for (const Source& s : sources) {
    for (const auto& [key, value] : s.run->state.entries()) {
      if (std::holds_alternative<Json>(value)) {
        const Json& v = std::get<Json>(value);
        if (!out.contains(key)) {
          out.set(key, v);
        } else if (v.is_number_integer() && out.value(key).is_number_integer() &&
                   v.get<std::int64_t>() > out.value(key).get<std::int64_t>()) {
          out.set(key, v);
        }
        continue;
      }
      const at::Tensor& t = std::get<at::Tensor>(value);
      if (!out.contains(key)) {
        out.set(key, covered[key] == numel ? at::empty({numel}, t.options())
                                           : at::zeros({numel}, t.options()));
      }
      const at::Tensor& into = out.tensor(key);
      into.narrow(0, s.from, s.to - s.from)
          .copy_(t.narrow(0, begin + s.from - s.run->begin, s.to - s.from));
    }
  }
  return out;
}

StateDict zero_consolidate(const ZeroLayout& layout, const StateDict& main,
                           const std::map<int, ZeroShard>& shards, const std::string& where) {
  StateDict out = main;
  for (const ZeroLayout::Param& p : layout.params) {
    StateDict state = zero_piece_state(layout, shards, p, 0, p.numel(), where);
    const std::string prefix = fmt::format("state.{}.{}", p.group, p.index);
    for (const auto& [key, value] : state.entries()) {
      if (std::holds_alternative<at::Tensor>(value)) {
        out.set(prefix + "." + key, std::get<at::Tensor>(value).view(p.shape));
      } else {
        out.set(prefix + "." + key, std::get<Json>(value));
      }
    }
  }
  return out;
}

void zero_consolidate(DirectoryCheckpoint& checkpoint, const std::string& where) {
  std::vector<ZeroLayout> layouts = zero_layouts(checkpoint.info.metadata, where);
  if (layouts.empty()) return;
  for (const ZeroLayout& layout : layouts) {
    auto find = [&](const std::string& name) {
      return std::find_if(checkpoint.components.begin(), checkpoint.components.end(),
                          [&](const Component& c) { return c.name == name; });
    };
    auto main = find(layout.optimizer);
    if (main == checkpoint.components.end()) {
      corrupt(where, fmt::format("the ZeRO layout names {}, which the checkpoint lacks",
                                 layout.optimizer));
    }
    std::map<int, ZeroShard> shards;
    for (int r = 0; r < layout.world; ++r) {
      auto it = find(zero_shard_name(layout.optimizer, r));
      if (it == checkpoint.components.end()) continue;  // zero_piece_state names it if needed
      shards.emplace(r, ZeroShard::parse(StateDict::from_container(it->contents), layout, r,
                                         where));
    }
    StateDict whole = zero_consolidate(layout, StateDict::from_container(main->contents), shards,
                                       where);
    main->contents = whole.to_container();
    for (int r = 0; r < layout.world; ++r) {
      auto it = find(zero_shard_name(layout.optimizer, r));
      if (it != checkpoint.components.end()) checkpoint.components.erase(it);
    }
  }
  checkpoint.info.metadata.erase(kZeroKey);
}

}  // namespace torchpoint::detail
