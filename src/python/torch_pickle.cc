#include "python/torch_pickle.h"

#include <fmt/format.h>

#include <bit>
#include <deque>
#include <type_traits>
#include <unordered_map>
#include <variant>

#include "compat/torch_compat.h"
#include "torchpoint/error.h"

namespace torchpoint::detail {
namespace {

// Bounds far above what torch.save writes (it batches SETITEMS by 1000 and nests a few levels
// deep), so that a hostile pickle cannot grow memory faster than its own size.
constexpr std::size_t kMaxStack = 1 << 20;
constexpr std::size_t kMaxMarks = 1 << 10;
constexpr std::size_t kMaxObjects = 1 << 22;
// A tensor costs a few hundred bytes of LibTorch bookkeeping but only a few bytes of pickle
// (REDUCE of memoized arguments); the largest models have some thousands.
constexpr std::size_t kMaxTensors = 1 << 18;
constexpr std::size_t kMaxGlobalName = 256;
constexpr std::size_t kMaxDims = 64;

// Values on the stack and in the memo are small: scalars, or an index of an object in the
// arena. Objects never own each other, so a deep or cyclic structure frees without recursion,
// and copying a value (BINGET) never copies a string or a container.
struct None {};
struct Ref {
  std::uint32_t index;
};
using Value = std::variant<None, bool, std::int64_t, double, Ref>;

enum class Callable {
  kOrderedDict,
  kRebuildTensor,    // _rebuild_tensor_v2: the dtype is the typed storage's
  kRebuildTensorV3,  // _rebuild_tensor_v3: an untyped (byte) storage and a dtype argument
  kRebuildParameter,
  kStorageType,
  kDtype,  // torch.uint16, ...: the last argument of _rebuild_tensor_v3
  // Read only by unpickle_value, as data: nothing is ever called.
  kCounter,        // collections.Counter
  kNdReconstruct,  // numpy._core.multiarray._reconstruct: an empty ndarray, filled by BUILD
  kNdArrayType,    // numpy.ndarray, its first argument
  kNdDtype,        // numpy.dtype("u4", False, True), its byte order set by BUILD
  kCodecsEncode,   // _codecs.encode(text, "latin1"): bytes, as protocol 2 writes them
};

struct Str {
  std::string text;
  bool bytes = false;  // a Python bytes, not a str
};
struct Tuple {
  std::vector<Value> items;
};
struct List {
  std::vector<Value> items;
};
struct Dict {
  std::vector<std::pair<Value, Value>> entries;
  bool ordered = false;
  bool counter = false;
};
struct Global {
  Callable what;
  std::string name;  // "torch.FloatStorage"
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};
struct Storage {
  at::Tensor data;  // 1-D, contiguous
};
struct Tensor {
  at::Tensor tensor;
};
struct NdDtype {
  std::string code;         // "u4", "f8", "b1", ...
  std::string order = "|";  // '<', '>', '|' (no order: one byte), '=' (native)
};
struct NdArray {
  bool built = false;
  std::vector<std::int64_t> shape;
  std::string descr;  // "<u4"
  std::string data;
};
using Object = std::variant<Str, Tuple, List, Dict, Global, Storage, Tensor, NdDtype, NdArray>;

// The bytes of one element of NumPy dtype `code`, or 0 when it is not a plain number type.
std::size_t numpy_item_size(std::string_view code) {
  static constexpr std::pair<std::string_view, std::size_t> kCodes[] = {
      {"b1", 1}, {"i1", 1}, {"u1", 1}, {"i2", 2}, {"u2", 2}, {"f2", 2},
      {"i4", 4}, {"u4", 4}, {"f4", 4}, {"i8", 8}, {"u8", 8}, {"f8", 8}};
  for (const auto& [name, size] : kCodes) {
    if (name == code) return size;
  }
  return 0;
}

// The Latin-1 bytes of UTF-8 `text` whose code points are all below 256, as Python's
// str.encode("latin1"); false for other text.
bool latin1_bytes(std::string_view text, std::string& out) {
  out.clear();
  for (std::size_t i = 0; i < text.size(); ++i) {
    auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if ((c == 0xc2 || c == 0xc3) && i + 1 < text.size() &&
               (static_cast<unsigned char>(text[i + 1]) & 0xc0) == 0x80) {
      out += static_cast<char>(((c & 0x1f) << 6) | (static_cast<unsigned char>(text[++i]) & 0x3f));
    } else {
      return false;
    }
  }
  return true;
}

constexpr int kMaxDepth = 100;

class Unpickler {
 public:
  Unpickler(std::string_view data, const StorageLoader& load, const std::string& where,
            bool objects = false)
      : data_(data), load_(load), where_(where), objects_mode_(objects) {}

  PyValue run_value() {
    Value top = interpret();
    std::vector<bool> open(objects_.size(), false);
    return tree(top, 0, open);
  }

  std::vector<std::pair<std::string, at::Tensor>> run() {
    Value top = interpret();
    const Dict* dict = as<Dict>(top);
    if (dict == nullptr) {
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{} holds an object of type {}, not a state dict; save it with "
                              "torch.save(model.state_dict(), path)",
                              where_, kind(top)));
    }
    std::vector<std::pair<std::string, at::Tensor>> out;
    out.reserve(dict->entries.size());
    for (const auto& [key, value] : dict->entries) {
      const Str* name = as<Str>(key);
      if (name == nullptr) {
        throw Error(ErrorCode::Incompatible,
                    fmt::format("{}: a key of the state dict is of type {}, not a string", where_,
                                kind(key)));
      }
      const Tensor* tensor = as<Tensor>(value);
      if (tensor == nullptr) {
        throw Error(
            ErrorCode::Incompatible,
            fmt::format("{}: '{}' is of type {}, not a tensor; only tensors can be loaded into "
                        "a module",
                        where_, name->text, kind(value)));
      }
      out.emplace_back(name->text, tensor->tensor);
    }
    return out;
  }

 private:
  [[noreturn]] void corrupt(const std::string& cause) const {
    throw Error(ErrorCode::Corruption,
                fmt::format("{}: data.pkl is damaged at byte {}: {}", where_, op_at_, cause));
  }

  // --- reading the byte stream ---
  void need(std::size_t n) const {
    if (data_.size() - at_ < n) corrupt("the pickle ends early (truncated?)");
  }
  std::uint64_t le(int n) {
    need(n);
    std::uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = v << 8 | static_cast<std::uint8_t>(data_[at_ + i]);
    at_ += n;
    return v;
  }
  std::string_view take(std::size_t n) {
    need(n);
    std::string_view s = data_.substr(at_, n);
    at_ += n;
    return s;
  }
  std::string_view line() {
    std::string_view rest = data_.substr(at_, kMaxGlobalName + 1);
    std::size_t end = rest.find('\n');
    if (end == std::string_view::npos) corrupt("a GLOBAL name is unterminated or too long");
    at_ += end + 1;
    return rest.substr(0, end);
  }

  // --- objects and the stack ---
  Ref make(Object object) {
    if (objects_.size() >= kMaxObjects) corrupt("too many objects");
    objects_.push_back(std::move(object));
    return Ref{static_cast<std::uint32_t>(objects_.size() - 1)};
  }
  template <typename T>
  T* as(const Value& v) {
    const Ref* ref = std::get_if<Ref>(&v);
    return ref == nullptr ? nullptr : std::get_if<T>(&objects_[ref->index]);
  }
  void push(Value v) {
    if (stack_.size() >= kMaxStack) corrupt("the stack grows too deep");
    stack_.push_back(v);
  }
  Value pop() {
    if (stack_.size() <= floor()) corrupt("the stack is empty");
    Value v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Value& top() {
    if (stack_.size() <= floor()) corrupt("the stack is empty");
    return stack_.back();
  }
  // Items above the innermost MARK are not visible to ordinary opcodes.
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  std::vector<Value> pop_mark() {
    if (marks_.empty()) corrupt("an opcode needs a MARK that is not there");
    std::size_t from = marks_.back();
    marks_.pop_back();
    std::vector<Value> items(stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
    return items;
  }

  std::string kind(const Value& v) const {
    struct Visitor {
      const Unpickler& self;
      std::string operator()(None) const { return "None"; }
      std::string operator()(bool) const { return "bool"; }
      std::string operator()(std::int64_t) const { return "int"; }
      std::string operator()(double) const { return "float"; }
      std::string operator()(Ref r) const {
        return std::visit(
            [](const auto& o) -> std::string {
              using T = std::decay_t<decltype(o)>;
              if constexpr (std::is_same_v<T, Str>) {
                return o.bytes ? "bytes" : "str";
              } else if constexpr (std::is_same_v<T, Tuple>) {
                return "tuple";
              } else if constexpr (std::is_same_v<T, List>) {
                return "list";
              } else if constexpr (std::is_same_v<T, Dict>) {
                return o.ordered ? "OrderedDict" : "dict";
              } else if constexpr (std::is_same_v<T, Global>) {
                return o.name;
              } else if constexpr (std::is_same_v<T, Storage>) {
                return "storage";
              } else if constexpr (std::is_same_v<T, NdDtype>) {
                return "numpy.dtype";
              } else if constexpr (std::is_same_v<T, NdArray>) {
                return "numpy.ndarray";
              } else {
                return "tensor";
              }
            },
            self.objects_[r.index]);
      }
    };
    return std::visit(Visitor{*this}, v);
  }

  // --- the interpreter ---
  Value interpret() {
    while (true) {
      op_at_ = at_;
      need(1);
      auto op = static_cast<std::uint8_t>(data_[at_++]);
      switch (op) {
        case 0x80: {  // PROTO
          std::uint64_t version = le(1);
          if (version > 5) corrupt(fmt::format("unknown pickle protocol {}", version));
          break;
        }
        case 0x95:  // FRAME: a length hint only
          le(8);
          break;
        case '}':  // EMPTY_DICT
          push(make(Dict{}));
          break;
        case ')':  // EMPTY_TUPLE
          push(make(Tuple{}));
          break;
        case ']':  // EMPTY_LIST
          push(make(List{}));
          break;
        case '(':  // MARK
          if (marks_.size() >= kMaxMarks) corrupt("MARKs nest too deep");
          marks_.push_back(stack_.size());
          break;
        case 't':  // TUPLE
          push(make(Tuple{pop_mark()}));
          break;
        case 0x85:    // TUPLE1
        case 0x86:    // TUPLE2
        case 0x87: {  // TUPLE3
          std::size_t n = op - 0x84u;
          std::vector<Value> items(n);
          for (std::size_t i = n; i-- > 0;) items[i] = pop();
          push(make(Tuple{std::move(items)}));
          break;
        }
        case 'X':  // BINUNICODE
          push(make(Str{std::string(take(le(4)))}));
          break;
        case 0x8c:  // SHORT_BINUNICODE
          push(make(Str{std::string(take(le(1)))}));
          break;
        case 0x8d:  // BINUNICODE8
          push(make(Str{std::string(take(le(8)))}));
          break;
        case 'C':  // SHORT_BINBYTES
          push(make(Str{std::string(take(le(1))), true}));
          break;
        case 'B':  // BINBYTES
          push(make(Str{std::string(take(le(4))), true}));
          break;
        case 0x8e:  // BINBYTES8
          push(make(Str{std::string(take(le(8))), true}));
          break;
        case 'J':  // BININT
          push(static_cast<std::int64_t>(static_cast<std::int32_t>(le(4))));
          break;
        case 'K':  // BININT1
          push(static_cast<std::int64_t>(le(1)));
          break;
        case 'M':  // BININT2
          push(static_cast<std::int64_t>(le(2)));
          break;
        case 0x8a: {  // LONG1: little-endian two's complement of n bytes
          std::uint64_t n = le(1);
          if (n > 8) corrupt(fmt::format("an integer of {} bytes does not fit in 64 bits", n));
          std::uint64_t v = n == 0 ? 0 : le(static_cast<int>(n));
          if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~std::uint64_t{0} << (8 * n);
          push(static_cast<std::int64_t>(v));
          break;
        }
        case 'G': {  // BINFLOAT: big-endian
          need(8);
          std::uint64_t bits = 0;
          for (int i = 0; i < 8; ++i) bits = bits << 8 | static_cast<std::uint8_t>(data_[at_++]);
          push(std::bit_cast<double>(bits));
          break;
        }
        case 0x88:  // NEWTRUE
          push(true);
          break;
        case 0x89:  // NEWFALSE
          push(false);
          break;
        case 'N':  // NONE
          push(None{});
          break;
        case 'c': {                          // GLOBAL
          std::string_view module = line();  // read before the name: the order matters
          push(make(global(module, line())));
          break;
        }
        case 'R': {  // REDUCE
          Value args = pop();
          Value callable = pop();
          push(reduce(callable, args));
          break;
        }
        case 'b': {  // BUILD
          Value state = pop();
          if (objects_mode_ && build_numpy(top(), state)) break;
          // model.state_dict() sets `_metadata` (per-module versions) on its OrderedDict this
          // way; it is not needed to load the tensors, so it is dropped.
          Dict* dict = as<Dict>(top());
          if (dict == nullptr || !dict->ordered) {
            throw Error(ErrorCode::Unsupported,
                        fmt::format("{}: data.pkl sets the attributes of a {} (BUILD); only an "
                                    "OrderedDict's are accepted",
                                    where_, kind(top())));
          }
          break;
        }
        case 's': {  // SETITEM
          Value value = pop();
          Value key = pop();
          dict_at_top().entries.emplace_back(key, value);
          break;
        }
        case 'u': {  // SETITEMS
          std::vector<Value> items = pop_mark();
          if (items.size() % 2 != 0) corrupt("SETITEMS with an odd number of items");
          Dict& dict = dict_at_top();
          for (std::size_t i = 0; i < items.size(); i += 2) {
            dict.entries.emplace_back(items[i], items[i + 1]);
          }
          break;
        }
        case 'a': {  // APPEND
          Value value = pop();
          list_at_top().items.push_back(value);
          break;
        }
        case 'e': {  // APPENDS
          std::vector<Value> items = pop_mark();
          List& list = list_at_top();
          list.items.insert(list.items.end(), items.begin(), items.end());
          break;
        }
        case 'q':  // BINPUT
          put(le(1));
          break;
        case 'r':  // LONG_BINPUT
          put(le(4));
          break;
        case 0x94:  // MEMOIZE
          put(memo_.size());
          break;
        case 'h':  // BINGET
          get(le(1));
          break;
        case 'j':  // LONG_BINGET
          get(le(4));
          break;
        case 'Q':  // BINPERSID
          push(persistent_load(pop()));
          break;
        case '.': {  // STOP
          Value result = pop();
          if (!stack_.empty() || !marks_.empty()) corrupt("STOP leaves items on the stack");
          return result;
        }
        default:
          corrupt(fmt::format("bad or unsupported pickle opcode 0x{:02x}", op));
      }
    }
  }

  Dict& dict_at_top() {
    Dict* dict = as<Dict>(top());
    if (dict == nullptr) corrupt(fmt::format("SETITEM on a {}, not a dict", kind(top())));
    return *dict;
  }
  List& list_at_top() {
    List* list = as<List>(top());
    if (list == nullptr) corrupt(fmt::format("APPEND on a {}, not a list", kind(top())));
    return *list;
  }

  void put(std::uint64_t index) {
    Value v = top();
    if (!memo_.contains(index) && memo_.size() >= kMaxObjects) corrupt("the memo grows too big");
    memo_[index] = v;
  }
  void get(std::uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) corrupt(fmt::format("memo entry {} was never set", index));
    push(it->second);
  }

  Global global(std::string_view module, std::string_view name) {
    std::string full = fmt::format("{}.{}", module, name);
    if (module == "collections" && name == "OrderedDict") return {Callable::kOrderedDict, full};
    if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
      return {Callable::kRebuildTensor, full};
    }
    if (module == "torch._utils" && name == "_rebuild_tensor_v3") {
      return {Callable::kRebuildTensorV3, full};
    }
    if (module == "torch.storage" && name == "UntypedStorage") {
      return {Callable::kStorageType, full, c10::ScalarType::Byte};
    }
    if (module == "torch") {
      for (const compat::NewerDtype& d : compat::kNewerDtypes) {
        if (d.python != name) continue;
        auto type = compat::scalar_type_for(d.safetensors);
        if (!type) {
          throw Error(ErrorCode::Unsupported,
                      fmt::format("{}: data.pkl holds a tensor of dtype torch.{}, which LibTorch "
                                  "{} cannot hold; read the file with LibTorch 2.3 or later",
                                  where_, name, compat::torch_version()));
        }
        return {Callable::kDtype, full, *type};
      }
    }
    if (module == "torch._utils" && name == "_rebuild_parameter") {
      return {Callable::kRebuildParameter, full};
    }
    if (module == "torch") {
      for (const StorageType& type : kStorageTypes) {
        if (type.name == name) return {Callable::kStorageType, full, type.dtype};
      }
    }
    if (objects_mode_) {
      if (full == "collections.Counter") return {Callable::kCounter, full};
      if (full == "numpy._core.multiarray._reconstruct" ||
          full == "numpy.core.multiarray._reconstruct") {
        return {Callable::kNdReconstruct, full};
      }
      if (full == "numpy.ndarray") return {Callable::kNdArrayType, full};
      if (full == "numpy.dtype") return {Callable::kNdDtype, full};
      if (full == "_codecs.encode") return {Callable::kCodecsEncode, full};
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: the pickle refers to the Python global {}, which torchpoint "
                              "does not read: it reads only tensors, numbers, strings, bytes, "
                              "None, tuples, lists, dicts (OrderedDict, Counter) and NumPy "
                              "arrays of numbers, and never calls a Python function",
                              where_, full));
    }
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: data.pkl refers to the Python global {}, which is not part of a "
                            "state dict of tensors that torchpoint can read (tensors of dtype "
                            "float32/64, float16, bfloat16, int8/16/32/64, uint8/16/32/64, "
                            "float8_e4m3fn/e5m2 or bool, in a dict or OrderedDict)",
                            where_, full));
  }

  Value reduce(const Value& callable, const Value& args_value) {
    const Global* fn = as<Global>(callable);
    const Tuple* args_tuple = as<Tuple>(args_value);
    if (fn == nullptr || args_tuple == nullptr) {
      corrupt(fmt::format("REDUCE of a {} with {} arguments", kind(callable), kind(args_value)));
    }
    // Objects live in a deque, which keeps references valid while make() adds more.
    const std::vector<Value>& args = args_tuple->items;
    switch (fn->what) {
      case Callable::kOrderedDict:
        if (!args.empty()) {
          throw Error(ErrorCode::Unsupported,
                      fmt::format("{}: data.pkl builds an OrderedDict from arguments", where_));
        }
        return make(Dict{{}, true});
      case Callable::kRebuildTensor:
        return rebuild_tensor(args, /*v3=*/false);
      case Callable::kRebuildTensorV3:
        return rebuild_tensor(args, /*v3=*/true);
      case Callable::kRebuildParameter:
        if (args.size() != 3 || as<Tensor>(args[0]) == nullptr) {
          corrupt("_rebuild_parameter takes (tensor, requires_grad, hooks)");
        }
        return args[0];
      case Callable::kCounter: {
        Dict counter{{}, false, true};
        if (args.size() == 1) {
          const Dict* from = as<Dict>(args[0]);
          if (from == nullptr) corrupt(fmt::format("Counter of a {}", kind(args[0])));
          counter.entries = from->entries;
        } else if (!args.empty()) {
          corrupt("Counter takes at most one argument");
        }
        return make(std::move(counter));
      }
      case Callable::kNdReconstruct: {
        const Global* type = args.empty() ? nullptr : as<Global>(args[0]);
        if (args.size() != 3 || type == nullptr || type->what != Callable::kNdArrayType) {
          throw Error(ErrorCode::Unsupported,
                      fmt::format("{}: the pickle reconstructs a NumPy object other than a "
                                  "numpy.ndarray",
                                  where_));
        }
        return make(NdArray{});
      }
      case Callable::kNdDtype: {
        const Str* code = args.empty() ? nullptr : as<Str>(args[0]);
        if (code == nullptr) corrupt("numpy.dtype() without a type code");
        if (numpy_item_size(code->text) == 0) {
          throw Error(ErrorCode::Unsupported,
                      fmt::format("{}: the pickle holds a NumPy array of dtype '{}'; only "
                                  "arrays of booleans, integers and floats are read",
                                  where_, code->text));
        }
        return make(NdDtype{code->text});
      }
      case Callable::kCodecsEncode: {
        const Str* text = args.size() == 2 ? as<Str>(args[0]) : nullptr;
        const Str* codec = args.size() == 2 ? as<Str>(args[1]) : nullptr;
        std::string bytes;
        if (text == nullptr || codec == nullptr || codec->text != "latin1" ||
            !latin1_bytes(text->text, bytes)) {
          corrupt("_codecs.encode is given something other than Latin-1 text and \"latin1\"");
        }
        return make(Str{std::move(bytes), true});
      }
      case Callable::kStorageType:
      case Callable::kDtype:
      case Callable::kNdArrayType:
        break;
    }
    throw Error(
        ErrorCode::Unsupported,
        fmt::format("{}: data.pkl calls {}, which torch.save never does", where_, fn->name));
  }

  // BUILD of a NumPy dtype (its byte order) or ndarray (shape, dtype, order and bytes); false
  // when `target` is neither.
  bool build_numpy(const Value& target, const Value& state_value) {
    const Tuple* state = as<Tuple>(state_value);
    if (NdDtype* dtype = as<NdDtype>(target)) {
      const Str* order = state != nullptr && state->items.size() >= 2 ? as<Str>(state->items[1])
                                                                      : nullptr;
      if (order == nullptr || order->text.size() != 1 ||
          std::string_view("<>|=").find(order->text) == std::string_view::npos) {
        corrupt("a numpy.dtype's state has no byte order");
      }
      dtype->order = order->text;
      return true;
    }
    NdArray* array = as<NdArray>(target);
    if (array == nullptr) return false;
    if (state == nullptr || state->items.size() != 5) {
      corrupt("a numpy.ndarray's state is not (version, shape, dtype, fortran, data)");
    }
    const NdDtype* dtype = as<NdDtype>(state->items[2]);
    const Str* data = as<Str>(state->items[4]);
    if (dtype == nullptr) corrupt(fmt::format("a numpy.ndarray's dtype is a {}", kind(state->items[2])));
    if (data == nullptr) {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: the pickle holds a NumPy array of Python objects", where_));
    }
    std::vector<std::int64_t> shape = integers(state->items[1], "a numpy.ndarray's shape");
    std::uint64_t count = 1;
    for (std::int64_t d : shape) {
      if (d < 0 || __builtin_mul_overflow(count, static_cast<std::uint64_t>(d), &count)) {
        corrupt("a numpy.ndarray's shape is negative or overflows");
      }
    }
    std::uint64_t bytes = 0;
    if (__builtin_mul_overflow(count, numpy_item_size(dtype->code), &bytes) ||
        bytes != data->text.size()) {
      corrupt(fmt::format("a numpy.ndarray of shape [{}] and dtype {} holds {} bytes",
                          fmt::join(shape, ", "), dtype->code, data->text.size()));
    }
    if (dtype->order == ">") {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: the pickle holds a big-endian NumPy array", where_));
    }
    array->built = true;
    array->shape = std::move(shape);
    array->descr = (numpy_item_size(dtype->code) == 1 ? "|" : "<") + dtype->code;
    array->data = data->text;
    return true;
  }

  // The plain tree of `v`. `open` marks the objects on the path from the root, so a structure
  // that contains itself is refused instead of unrolled forever; `nodes_` bounds what shared
  // references could multiply.
  PyValue tree(const Value& v, int depth, std::vector<bool>& open) {
    if (++nodes_ > kMaxObjects) corrupt("the pickle expands to too many values");
    if (std::holds_alternative<None>(v)) return PyValue::none();
    if (const bool* b = std::get_if<bool>(&v)) return PyValue::of(*b);
    if (const std::int64_t* i = std::get_if<std::int64_t>(&v)) return PyValue::of(*i);
    if (const double* d = std::get_if<double>(&v)) return PyValue::of(*d);
    const std::uint32_t index = std::get<Ref>(v).index;
    if (depth > kMaxDepth) corrupt(fmt::format("values nest more than {} levels deep", kMaxDepth));
    if (open[index]) corrupt("a value contains itself");
    open[index] = true;
    PyValue out;
    const Object& object = objects_[index];
    if (const Str* str = std::get_if<Str>(&object)) {
      out = PyValue::of(str->text);
      if (str->bytes) out.kind = PyValue::Kind::kBytes;
    } else if (const Tuple* tuple = std::get_if<Tuple>(&object)) {
      out = PyValue::tuple({});
      for (const Value& item : tuple->items) out.items.push_back(tree(item, depth + 1, open));
    } else if (const List* list = std::get_if<List>(&object)) {
      out = PyValue::list({});
      for (const Value& item : list->items) out.items.push_back(tree(item, depth + 1, open));
    } else if (const Dict* dict = std::get_if<Dict>(&object)) {
      out = PyValue::dict();
      out.type = dict->counter ? "Counter" : dict->ordered ? "OrderedDict" : "dict";
      for (const auto& [key, value] : dict->entries) {
        out.entries.push_back({tree(key, depth + 1, open), tree(value, depth + 1, open)});
      }
    } else if (const Tensor* tensor = std::get_if<Tensor>(&object)) {
      out = PyValue::of(tensor->tensor);
    } else if (const NdArray* array = std::get_if<NdArray>(&object)) {
      if (!array->built) corrupt("a numpy.ndarray is never given its data");
      out.kind = PyValue::Kind::kArray;
      out.type = array->descr;
      out.shape = array->shape;
      out.text = array->data;
    } else {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: the pickle holds a bare {}, which is not data", where_,
                              kind(v)));
    }
    open[index] = false;
    return out;
  }

  std::int64_t integer(const Value& v, const char* what) {
    const std::int64_t* i = std::get_if<std::int64_t>(&v);
    if (i == nullptr) corrupt(fmt::format("{} is a {}, not an int", what, kind(v)));
    return *i;
  }
  std::vector<std::int64_t> integers(const Value& v, const char* what) {
    const Tuple* t = as<Tuple>(v);
    if (t == nullptr) corrupt(fmt::format("{} is a {}, not a tuple", what, kind(v)));
    if (t->items.size() > kMaxDims) corrupt(fmt::format("{} has too many dimensions", what));
    std::vector<std::int64_t> out;
    for (const Value& item : t->items) out.push_back(integer(item, what));
    return out;
  }

  // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks[,
  // metadata]), or _rebuild_tensor_v3(untyped storage, ..., backward_hooks, dtype[,
  // metadata]): a view of the storage, checked to stay inside it.
  Value rebuild_tensor(const std::vector<Value>& args, bool v3) {
    const std::size_t fixed = v3 ? 7 : 6;
    if (args.size() != fixed && args.size() != fixed + 1) {
      corrupt(fmt::format("_rebuild_tensor_v{} takes {} or {} arguments, not {}", v3 ? 3 : 2, fixed,
                          fixed + 1, args.size()));
    }
    const Storage* storage = as<Storage>(args[0]);
    if (storage == nullptr) corrupt(fmt::format("a tensor's storage is a {}", kind(args[0])));
    at::Tensor data = storage->data;
    if (v3) {
      // The storage holds bytes; the tensor's elements are of the dtype argument.
      const Global* dtype = as<Global>(args[6]);
      if (dtype == nullptr || dtype->what != Callable::kDtype) {
        corrupt(fmt::format("_rebuild_tensor_v3's dtype is a {}", kind(args[6])));
      }
      if (data.scalar_type() != c10::ScalarType::Byte) {
        corrupt("_rebuild_tensor_v3 is given a typed storage");
      }
      const std::int64_t size = static_cast<std::int64_t>(c10::elementSize(dtype->dtype));
      if (data.numel() % size != 0) {
        corrupt(fmt::format("a storage of {} bytes does not hold whole elements of {}",
                            data.numel(), dtype->name));
      }
      data = data.view(dtype->dtype);
    }
    std::int64_t offset = integer(args[1], "a storage offset");
    std::vector<std::int64_t> sizes = integers(args[2], "a tensor's size");
    std::vector<std::int64_t> strides = integers(args[3], "a tensor's stride");
    if (sizes.size() != strides.size()) {
      corrupt(fmt::format("a tensor has {} sizes but {} strides", sizes.size(), strides.size()));
    }
    const std::int64_t available = data.numel();
    // The last element a view reaches is offset + sum((size - 1) * stride); it must lie in the
    // storage. An empty view reaches nothing but its offset must still be in range.
    std::int64_t last = offset;
    std::int64_t numel = 1;
    bool empty = false;
    if (offset < 0) corrupt(fmt::format("storage offset {} is negative", offset));
    for (std::size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] < 0 || strides[d] < 0) {
        corrupt(fmt::format("a tensor has size {} and stride {} in dimension {}", sizes[d],
                            strides[d], d));
      }
      if (sizes[d] == 0) empty = true;
      std::int64_t reach = 0;
      if (sizes[d] > 0 && (__builtin_mul_overflow(sizes[d] - 1, strides[d], &reach) ||
                           __builtin_add_overflow(last, reach, &last))) {
        corrupt("a tensor's size and stride overflow");
      }
      if (__builtin_mul_overflow(numel, sizes[d], &numel)) corrupt("a tensor's size overflows");
    }
    if (empty ? offset > available : last >= available) {
      corrupt(
          fmt::format("a tensor of size [{}], stride [{}] at storage offset {} reaches past "
                      "the end of its storage of {} elements",
                      fmt::join(sizes, ", "), fmt::join(strides, ", "), offset, available));
    }
    if (++tensors_ > kMaxTensors) corrupt(fmt::format("more than {} tensors", kMaxTensors));
    return make(Tensor{data.as_strided(sizes, strides, offset)});
  }

  // ('storage', storage type, key, location, numel), as torch.save's persistent_id writes it.
  Value persistent_load(const Value& pid) {
    const Tuple* t = as<Tuple>(pid);
    if (t == nullptr || t->items.size() != 5) {
      corrupt(fmt::format("a persistent id is a {}, not a 5-tuple", kind(pid)));
    }
    const std::vector<Value>& items = t->items;
    const Str* tag = as<Str>(items[0]);
    const Global* type = as<Global>(items[1]);
    const Str* key = as<Str>(items[2]);
    std::int64_t numel = integer(items[4], "a storage's size");
    if (tag == nullptr || tag->text != "storage") corrupt("a persistent id is not a storage");
    if (type == nullptr || type->what != Callable::kStorageType) {
      corrupt(fmt::format("a storage's type is {}", kind(items[1])));
    }
    if (key == nullptr) corrupt(fmt::format("a storage's key is a {}", kind(items[2])));
    if (numel < 0) corrupt(fmt::format("storage '{}' has {} elements", key->text, numel));
    std::string name = key->text;
    c10::ScalarType dtype = type->dtype;
    auto it = storages_.find(name);
    if (it != storages_.end()) {
      const at::Tensor& seen = std::get<Storage>(objects_[it->second.index]).data;
      if (seen.scalar_type() != dtype || seen.numel() != numel) {
        corrupt(fmt::format("storage '{}' is declared twice with different types or sizes", name));
      }
      return it->second;
    }
    at::Tensor data = load_(name, dtype, numel);
    Ref ref = make(Storage{std::move(data)});
    storages_.emplace(std::move(name), ref);
    return ref;
  }

  std::string_view data_;
  const StorageLoader& load_;
  const std::string& where_;
  std::size_t at_ = 0;
  std::size_t op_at_ = 0;
  std::deque<Object> objects_;
  std::size_t tensors_ = 0;
  std::vector<Value> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, Value> memo_;
  std::unordered_map<std::string, Ref> storages_;
  bool objects_mode_ = false;
  std::size_t nodes_ = 0;
};

}  // namespace

PyValue unpickle_value(std::string_view pickle, const StorageLoader& load, const std::string& where) {
  return Unpickler(pickle, load, where, /*objects=*/true).run_value();
}

std::vector<std::pair<std::string, at::Tensor>> unpickle_state_dict(std::string_view pickle,
                                                                    const StorageLoader& load,
                                                                    const std::string& where) {
  return Unpickler(pickle, load, where).run();
}

}  // namespace torchpoint::detail
