#include "format/ordered_json.h"

#include <unordered_map>
#include <utility>
#include <vector>

namespace torchpoint {
namespace {

using ObjectVector = Json::object_t::Container;  // the vector underneath ordered_map

// Objects smaller than this are searched for duplicates by walking them; larger ones get a
// hash index of their keys.
constexpr std::size_t kIndexFrom = 32;

// An nlohmann SAX handler that builds the value as ordered_json's own DOM parser does, except
// that keys are appended to their object's vector instead of searched for.
class Builder {
 public:
  explicit Builder(Json& root) : root_(root) {}

  bool null() { return add(Json(nullptr)); }
  bool boolean(bool v) { return add(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return add(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return add(Json(v)); }
  bool number_float(Json::number_float_t v, const std::string&) { return add(Json(v)); }
  bool string(std::string& v) { return add(Json(std::move(v))); }
  bool binary(Json::binary_t& v) { return add(Json::binary(std::move(v))); }

  bool start_object(std::size_t) {
    open(Json::object());
    return true;
  }
  bool key(std::string& k) {
    Frame& f = frames_.back();
    ObjectVector& items = f.value->get_ref<Json::object_t&>();
    std::size_t position = items.size();
    if (f.index.empty() && items.size() < kIndexFrom) {
      for (std::size_t i = 0; i < items.size(); ++i) {
        if (items[i].first == k) position = i;
      }
    } else {
      if (f.index.empty()) {
        for (std::size_t i = 0; i < items.size(); ++i) f.index.emplace(items[i].first, i);
      }
      auto [it, inserted] = f.index.emplace(k, items.size());
      if (!inserted) position = it->second;
    }
    if (position == items.size()) items.emplace_back(std::move(k), Json());
    f.slot = &items[position].second;
    return true;
  }
  bool end_object() {
    frames_.pop_back();
    return true;
  }

  bool start_array(std::size_t) {
    open(Json::array());
    return true;
  }
  bool end_array() {
    frames_.pop_back();
    return true;
  }

  // Rethrown as the concrete type the DOM parser throws, so callers' catch clauses still match.
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) {
    switch (ex.id / 100) {
      case 1:
        throw static_cast<const nlohmann::detail::parse_error&>(ex);
      case 4:
        throw static_cast<const nlohmann::detail::out_of_range&>(ex);
      default:
        throw static_cast<const nlohmann::detail::other_error&>(ex);
    }
  }

 private:
  struct Frame {
    Json* value = nullptr;
    Json* slot = nullptr;  // for an object: where the value of the last key goes
    std::unordered_map<std::string, std::size_t> index;
  };

  // Stores a complete value where the innermost open container wants it; returns its address.
  Json* place(Json v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = frames_.back();
    if (f.value->is_array()) {
      auto& items = f.value->get_ref<Json::array_t&>();
      items.push_back(std::move(v));
      return &items.back();
    }
    *f.slot = std::move(v);
    return f.slot;
  }
  bool add(Json v) {
    place(std::move(v));
    return true;
  }
  // A container is placed first and filled in place: its address stays valid while it is open,
  // because its parent grows only after it is closed.
  void open(Json empty) {
    Frame f;
    f.value = place(std::move(empty));
    frames_.push_back(std::move(f));
  }

  Json& root_;
  std::vector<Frame> frames_;
};

}  // namespace

Json parse_ordered_json(std::string_view text) {
  Json root;
  Builder builder(root);
  Json::sax_parse(text, &builder);
  return root;
}

void append_new_key(Json& object, std::string key, Json value) {
  object.get_ref<Json::object_t&>().emplace_back(std::move(key), std::move(value));
}

std::string string_field(const Json& object, const char* key) {
  auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace torchpoint
