// RngState: captures and restores every random number generator a training run draws from.
#pragma once

#include <ATen/core/Generator.h>

#include <concepts>
#include <functional>
#include <istream>
#include <locale>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

// A standard-library-style random engine (std::mt19937, std::mt19937_64, std::minstd_rand,
// std::ranlux48, ...): copyable, and its whole state written by operator<< and read back by
// operator>>.
template <typename E>
concept TextSerializableEngine = std::copy_constructible<E> && std::is_copy_assignable_v<E> &&
    requires(E& e, std::ostream& out, std::istream& in) {
  out << e;
  in >> e;
};

namespace detail {

// Type-erased access to a registered engine.
struct EngineSlot {
  // The engine's state as text.
  std::function<std::string()> save;
  // Parses `text` into a copy of the engine. Returns a function that assigns the copy to the
  // engine (and cannot fail), or an empty function when `text` is not exactly a state
  // written by save() for this engine type.
  std::function<std::function<void()>(const std::string&)> parse;
};

// Text of an engine in the "C" locale, so that a global locale cannot change it.
template <typename Engine>
std::string engine_text(const Engine& engine) {
  std::ostringstream out;
  out.imbue(std::locale::classic());
  out << engine;
  return out.str();
}

template <typename Engine>
EngineSlot make_engine_slot(Engine& engine) {
  EngineSlot slot;
  slot.save = [&engine] { return engine_text(engine); };
  slot.parse = [&engine](const std::string& text) -> std::function<void()> {
    Engine parsed = engine;
    std::istringstream in(text);
    in.imbue(std::locale::classic());
    in >> parsed;
    // Writing the parsed engine back must give the same text: this rejects truncated text,
    // trailing data and values out of range for this engine type (e.g. an mt19937_64 state
    // read into an mt19937).
    if (in.fail() || engine_text(parsed) != text) return {};
    return [&engine, parsed] { engine = parsed; };
  };
  return slot;
}

}  // namespace detail

// The state of every random number generator of a run, as one StateDict component:
//   "cpu"                the default CPU generator (at::detail::getDefaultCPUGenerator()):
//                        torch::randn, rand, randperm, dropout, parameter init, RandomSampler.
//                        A uint8 tensor of the full state, including the cached normal
//                        sample, so a restore between two torch::randn calls still matches.
//   "cuda.<i>"           the default generator of CUDA device i, when CUDA is present.
//   "generators.<name>"  an at::Generator registered under <name> (uint8 tensor).
//   "engines.<name>"     a standard-library engine registered under <name> (JSON string of its
//                        operator<< text).
//
// Restore RNG state last: load the model, optimizer, scheduler, scaler, sampler and counters
// first (building and loading them can draw random numbers), then call load_state_dict()
// right before the first training step. Any draw after it shifts every later draw.
//
// Each generator is read and written under its own mutex, so a draw on another thread never
// sees half a state; the generators are not captured atomically together. Registration is not
// thread-safe. Registered engines are held by reference: the caller keeps them alive;
// registered at::Generators are shared handles and stay alive with this object.
//
// Example:
//   std::mt19937 shuffle_rng(7);
//   torchpoint::RngState rng;
//   rng.register_engine("shuffle", shuffle_rng);
//   rng.register_generator("augment", at::detail::createCPUGenerator(3));
//   torchpoint::StateDict saved = rng.state_dict();
//   ...                                   // later, after everything else was loaded:
//   rng.load_state_dict(saved);           // restore RNG state last
class RngState {
 public:
  // Covers the default CPU generator and, when CUDA is present, every device's default
  // generator; nothing is registered yet.
  RngState() = default;

  // Adds `generator` (CPU or CUDA) under `name`. Throws InvalidArgument for an undefined
  // generator, an empty name or a name already registered (as a generator or an engine).
  void register_generator(const std::string& name, at::Generator generator);

  // Adds `engine` under `name`; the caller keeps it alive while this RngState is used. Throws
  // InvalidArgument for an empty name or a name already registered.
  template <TextSerializableEngine Engine>
  void register_engine(const std::string& name, Engine& engine) {
    add_engine(name, detail::make_engine_slot(engine));
  }

  // A snapshot of every covered generator and engine (see the key layout above).
  StateDict state_dict() const;

  // Restores every covered generator and engine from `state`. Checks everything first: a
  // missing or extra generator or engine, a state of the wrong dtype or size, or a state the
  // generator refuses, throws Incompatible listing every problem and naming each generator,
  // and leaves every generator and engine unchanged. Restore RNG state last (see above).
  void load_state_dict(const StateDict& state);

 private:
  void add_engine(const std::string& name, detail::EngineSlot slot);
  void check_new_name(const std::string& name) const;

  std::vector<std::pair<std::string, at::Generator>> generators_;
  std::vector<std::pair<std::string, detail::EngineSlot>> engines_;
};

}  // namespace torchpoint
