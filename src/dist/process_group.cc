// ProcessGroup on c10d: a TCPStore (torchrun's, or rank 0's) and a ProcessGroupGloo.
#include "torchpoint/process_group.h"

#include <ATen/ops/cat.h>
#include <fmt/format.h>

#include <unistd.h>
#include <xxhash.h>

#include <cstdlib>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "torchpoint/error.h"

namespace torchpoint {

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;  // under torchpoint's own prefix
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;  // null on a side channel
  std::string prefix;                               // of `store`'s keys

  c10d::ProcessGroupGloo& collectives() const {
    if (!gloo) {
      throw Error(ErrorCode::Unsupported,
                  "a side channel of a process group makes string exchanges only; call "
                  "collectives on the group itself");
    }
    return *gloo;
  }
};

namespace {

// What a c10d or gloo exception says, without the C++ backtrace a c10::Error carries ("frame #0:
// c10::Error::Error..."): LibTorch's internals tell a user nothing torchpoint's message does not.
std::string cause_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

std::optional<std::string> variable(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

long long integer_variable(const char* name, long long fallback, long long low, long long high) {
  std::optional<std::string> text = variable(name);
  if (!text) return fallback;
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(*text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text->size() || value < low || value > high) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("the environment variable {}={} is not a whole number in [{}, {}]; "
                            "start the program with torchrun, or set it correctly",
                            name, *text, low, high));
  }
  return value;
}

std::vector<std::uint8_t> bytes_of(const std::string& s) {
  return std::vector<std::uint8_t>(s.begin(), s.end());
}

std::string string_of(const std::vector<std::uint8_t>& b) {
  return std::string(b.begin(), b.end());
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    out += fmt::format("{}{}", i == 0 ? "" : ", ", ranks[i]);
  }
  return out;
}

// The name every rank of this start of the group agrees on, for its keys in the store.
//
// torchrun's agent store outlives the workers: after a restart it still holds the keys of every
// earlier start, and nothing in the workers' environment numbers the rendezvous round the agents
// agreed on (TORCHELASTIC_RESTART_COUNT is per agent: an agent whose workers were restarted for a
// membership change, not a failure, keeps its count, so two agents' workers would meet under
// different names and wait forever). So the ranks meet by themselves: each announces a random
// nonce under its rank, and the name is a hash of the W nonces it reads. A rank may read an
// earlier start's nonce of a rank that has not announced yet; so each rank publishes the name it
// computed and reads again until every rank published the same name. Every such name holds every
// rank's own fresh nonce (a rank hashes the nonce it just wrote), so no name of an earlier start
// can match it, and once all agree nothing changes any more. Cost: about 2W store reads per rank,
// more when the ranks start far apart.
std::string meet(c10d::Store& store, const ProcessGroupOptions& options) {
  const int world = options.world_size(), rank = options.rank();
  std::random_device device;
  std::mt19937_64 rng((static_cast<std::uint64_t>(device()) << 32) ^ device() ^
                      static_cast<std::uint64_t>(::getpid()) ^
                      static_cast<std::uint64_t>(
                          std::chrono::steady_clock::now().time_since_epoch().count()));
  const std::string nonce = fmt::format("{:016x}{:016x}", rng(), rng());
  std::vector<std::string> nonce_keys, name_keys;
  for (int r = 0; r < world; ++r) {
    nonce_keys.push_back(fmt::format("torchpoint/meet/nonce/{}", r));
    name_keys.push_back(fmt::format("torchpoint/meet/name/{}", r));
  }
  store.set(nonce_keys[rank], bytes_of(nonce));
  const auto deadline = std::chrono::steady_clock::now() + options.timeout();
  auto pause = std::chrono::milliseconds(5);
  std::string published;
  for (;;) {
    std::vector<int> silent;  // ranks that never announced themselves, in any start
    for (int r = 0; r < world; ++r) {
      if (!store.check({nonce_keys[r]})) silent.push_back(r);
    }
    std::vector<int> elsewhere;  // ranks whose published name is not this one's
    if (silent.empty()) {
      std::string all;
      for (const std::string& key : nonce_keys) all += string_of(store.get(key)) + "/";
      const XXH128_hash_t h = XXH3_128bits(all.data(), all.size());
      const std::string name = fmt::format("{:016x}{:016x}", h.high64, h.low64);
      if (name != published) {
        store.set(name_keys[rank], bytes_of(name));
        published = name;
      }
      for (int r = 0; r < world; ++r) {
        if (r == rank) continue;
        if (!store.check({name_keys[r]}) || string_of(store.get(name_keys[r])) != name) {
          elsewhere.push_back(r);
        }
      }
      if (elsewhere.empty()) return name;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error(ErrorCode::IOError,
                  fmt::format("rank {} of {}: the processes did not all start within {} ms of "
                              "one another: {}; a process that failed to start, or a torchrun "
                              "agent that did not restart its workers, is the usual cause",
                              rank, world, options.timeout().count(),
                              silent.empty()
                                  ? fmt::format("rank{} {} did not join this start of the group",
                                                elsewhere.size() > 1 ? "s" : "",
                                                rank_list(elsewhere))
                                  : fmt::format("rank{} {} never announced itself",
                                                silent.size() > 1 ? "s" : "",
                                                rank_list(silent))));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(200));
  }
}

}  // namespace

std::optional<ProcessGroupOptions> ProcessGroupOptions::from_environment() {
  if (!variable("WORLD_SIZE")) return std::nullopt;
  const long long world = integer_variable("WORLD_SIZE", 1, 1, 1 << 20);
  ProcessGroupOptions o;
  o.world_size(static_cast<int>(world));
  o.rank(static_cast<int>(integer_variable("RANK", 0, 0, world - 1)));
  const long long local_world = integer_variable("LOCAL_WORLD_SIZE", 1, 1, world);
  o.local_world_size(static_cast<int>(local_world));
  o.local_rank(static_cast<int>(integer_variable("LOCAL_RANK", 0, 0, local_world - 1)));
  o.master_addr(variable("MASTER_ADDR").value_or("127.0.0.1"));
  o.master_port(static_cast<int>(integer_variable("MASTER_PORT", 29500, 1, 65535)));
  o.restart_count(static_cast<int>(integer_variable("TORCHELASTIC_RESTART_COUNT", 0, 0, 1 << 30)));
  o.use_agent_store(variable("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True");
  const long long seconds = integer_variable("TORCHPOINT_PROCESS_TIMEOUT", 300, 1, 7 * 24 * 3600);
  o.timeout(std::chrono::seconds(seconds));
  return o;
}

ProcessGroup::ProcessGroup(ProcessGroupOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}

ProcessGroup::~ProcessGroup() = default;

std::shared_ptr<ProcessGroup> ProcessGroup::create(const ProcessGroupOptions& options) {
  if (options.world_size() < 1 || options.rank() < 0 || options.rank() >= options.world_size()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("rank {} of a group of {} processes: the rank must be in [0, {})",
                            options.rank(), options.world_size(), options.world_size()));
  }
  auto impl = std::make_unique<Impl>();
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(options.master_port());
  store_options.isServer = options.rank() == 0 && !options.use_agent_store();
  store_options.numWorkers = options.world_size();
  store_options.timeout = options.timeout();
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(options.master_addr(), store_options);
  } catch (const std::exception& e) {
    throw Error(
        ErrorCode::IOError,
        fmt::format("rank {}: cannot reach the rendezvous store at {}:{} ({}); start the "
                    "program with torchrun, or check MASTER_ADDR and MASTER_PORT",
                    options.rank(), options.master_addr(), options.master_port(), cause_of(e)));
  }
  // Each start of the group under a name of its own, so that no key of an earlier start (in
  // torchrun's agent store, which outlives the workers) is ever read.
  std::string name;
  try {
    name = meet(*store, options);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(ErrorCode::IOError,
                fmt::format("rank {}: lost the rendezvous store at {}:{} while the processes "
                            "met ({})",
                            options.rank(), options.master_addr(), options.master_port(),
                            cause_of(e)));
  }
  impl->prefix = fmt::format("torchpoint/{}", name);
  impl->store = c10::make_intrusive<c10d::PrefixStore>(impl->prefix, store);

  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout());
  std::optional<std::string> interface = variable("GLOO_SOCKET_IFNAME");
  try {
    gloo_options->devices.push_back(
        interface ? c10d::ProcessGroupGloo::createDeviceForInterface(*interface)
                  : c10d::ProcessGroupGloo::createDefaultDevice());
    impl->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo", impl->store), options.rank(),
        options.world_size(), gloo_options);
  } catch (const std::exception& e) {
    throw Error(
        ErrorCode::IOError,
        fmt::format("rank {} of {}: the gloo process group could not connect ({}); every "
                    "rank must start within {} ms of the others",
                    options.rank(), options.world_size(), cause_of(e),
                    options.timeout().count()));
  }
  return std::shared_ptr<ProcessGroup>(new ProcessGroup(options, std::move(impl)));
}

std::unique_ptr<ProcessGroup> ProcessGroup::side_channel() {
  auto impl = std::make_unique<Impl>();
  impl->prefix = fmt::format("{}/side/{}", impl_->prefix, ++side_channels_);
  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<std::uint16_t>(options_.master_port());
  store_options.isServer = false;
  store_options.waitWorkers = false;
  store_options.timeout = options_.timeout();
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(options_.master_addr(), store_options);
  } catch (const std::exception& e) {
    throw Error(ErrorCode::IOError,
                fmt::format("rank {}: cannot open a second connection to the rendezvous store "
                            "at {}:{} ({})",
                            rank(), options_.master_addr(), options_.master_port(), cause_of(e)));
  }
  impl->store = c10::make_intrusive<c10d::PrefixStore>(impl->prefix, store);
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(options_, std::move(impl)));
}

std::shared_ptr<ProcessGroup> ProcessGroup::from_environment() {
  static std::mutex mutex;
  static std::shared_ptr<ProcessGroup> group;
  static bool made = false;
  std::lock_guard<std::mutex> lock(mutex);
  if (!made) {
    std::optional<ProcessGroupOptions> options = ProcessGroupOptions::from_environment();
    if (options && options->world_size() > 1) group = create(*options);
    made = true;
  }
  return group;
}

std::uint64_t ProcessGroup::enter_collective() {
  (void)impl_->collectives();  // a side channel refuses here, before anything is counted
  const std::uint64_t n = ++collectives_;
  ++store_requests_;
  impl_->store->set(fmt::format("progress/{}", rank()), bytes_of(std::to_string(n)));
  return n;
}

// Times one exchange's store requests (waiting for the other ranks included).
struct ProcessGroup::StoreTimer {
  explicit StoreTimer(ProcessGroup& g) : group(g), start(std::chrono::steady_clock::now()) {}
  ~StoreTimer() {
    group.store_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  ProcessGroup& group;
  std::chrono::steady_clock::time_point start;
};

void ProcessGroup::collective_failed(std::uint64_t n, const std::string& what,
                                     const std::exception& cause) {
  // Who is to blame: a rank still before collective #n never reached it; a rank that entered it
  // and neither left it (its count moved on) nor failed in it too (as this one did) stopped
  // answering inside it. The ranks that fail for the same reason fail at about the same time (the
  // same timeout); they get a few seconds to say so before being blamed.
  std::vector<std::string> behind;
  try {
    impl_->store->set(fmt::format("failed/{}", rank()), bytes_of(std::to_string(n)));
    auto count_of = [&](const std::string& key) -> std::uint64_t {
      return impl_->store->check({key}) ? std::stoull(string_of(impl_->store->get(key))) : 0;
    };
    // Only a timeout has other ranks failing at about the same time; a connection a peer closed
    // or reset (it died) is named at once.
    const std::string said = cause_of(cause);
    const bool timed_out = said.find("imed out") != std::string::npos ||
                           said.find("timeout") != std::string::npos;
    const auto grace = timed_out ? std::min<std::chrono::milliseconds>(timeout() / 2,
                                                                       std::chrono::seconds(5))
                                 : std::chrono::milliseconds(0);
    const auto until = std::chrono::steady_clock::now() + grace;
    for (;;) {
      behind.clear();
      bool undecided = false;
      for (int r = 0; r < size(); ++r) {
        if (r == rank()) continue;
        const std::uint64_t reached = count_of(fmt::format("progress/{}", r));
        if (reached < n) {
          behind.push_back(reached == 0
                               ? fmt::format("rank {} never reached any collective", r)
                               : fmt::format("rank {} stopped before it (at collective #{})", r,
                                             reached));
        } else if (reached == n && count_of(fmt::format("failed/{}", r)) != n) {
          behind.push_back(fmt::format("rank {} entered it and stopped answering", r));
          undecided = true;
        }
      }
      if (!undecided || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    // The store itself is gone (its server, rank 0 or torchrun, died): the cause says enough.
    behind.clear();
  }
  std::string who;
  for (std::size_t i = 0; i < behind.size(); ++i) who += (i == 0 ? "" : ", ") + behind[i];
  throw Error(
      ErrorCode::IOError,
      behind.empty()
          ? fmt::format("rank {}: {} (collective #{}) failed: {}", rank(), what, n, cause_of(cause))
          : fmt::format("rank {}: {} (collective #{}) failed: {}; a process that died or "
                        "stopped answering (the group waits at most {} ms): {}",
                        rank(), what, n, who, timeout().count(), cause_of(cause)));
}

void ProcessGroup::barrier(const std::string& what) {
  std::uint64_t n = enter_collective();
  try {
    impl_->collectives().barrier()->wait();
  } catch (const std::exception& e) {
    collective_failed(n, what, e);
  }
}

void ProcessGroup::broadcast(std::vector<at::Tensor>& tensors, int root, const std::string& what) {
  if (tensors.empty()) return;
  std::uint64_t n = enter_collective();
  c10d::BroadcastOptions o;
  o.rootRank = root;
  try {
    impl_->collectives().broadcast(tensors, o)->wait();
  } catch (const std::exception& e) {
    collective_failed(n, what, e);
  }
}

void ProcessGroup::allreduce(at::Tensor& tensor, ReduceOp op, const std::string& what) {
  std::uint64_t n = enter_collective();
  c10d::AllreduceOptions o;
  o.reduceOp = op == ReduceOp::Sum   ? c10d::ReduceOp::SUM
               : op == ReduceOp::Max ? c10d::ReduceOp::MAX
                                     : c10d::ReduceOp::MIN;
  std::vector<at::Tensor> tensors{tensor};
  try {
    impl_->collectives().allreduce(tensors, o)->wait();
  } catch (const std::exception& e) {
    collective_failed(n, what, e);
  }
}

std::vector<at::Tensor> ProcessGroup::allgather(const at::Tensor& tensor, const std::string& what) {
  std::uint64_t n = enter_collective();
  std::vector<at::Tensor> input{tensor.contiguous()};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < size(); ++r) output[0].push_back(at::empty_like(input[0]));
  try {
    impl_->collectives().allgather(output, input)->wait();
  } catch (const std::exception& e) {
    collective_failed(n, what, e);
  }
  return output[0];
}

namespace {

// gloo's reduce-scatter where LibTorch has one (2.x, which also gained the coalesced form this
// tests for); on 1.13 an allreduce of which this rank keeps its part.
template <typename Gloo>
at::Tensor reduce_scatter_on(Gloo& gloo, at::Tensor& in, std::int64_t part, int rank) {
  if constexpr (requires(Gloo& g, std::vector<at::Tensor>& v) {
                  g.reduce_scatter_tensor_coalesced(v, v);
                }) {
    at::Tensor out = at::empty({part}, in.options());
    gloo._reduce_scatter_base(out, in)->wait();
    return out;
  } else {
    std::vector<at::Tensor> tensors{in.clone()};
    gloo.allreduce(tensors)->wait();
    return tensors[0].narrow(0, part * rank, part).clone();
  }
}

}  // namespace

at::Tensor ProcessGroup::reduce_scatter(const at::Tensor& input, const std::string& what) {
  const std::int64_t part = input.numel() / size();
  if (input.dim() != 1 || part * size() != input.numel()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("reduce_scatter() for {}: the input holds {} elements, not a "
                            "multiple of the {} processes",
                            what, input.numel(), size()));
  }
  std::uint64_t n = enter_collective();
  at::Tensor in = input.contiguous();
  try {
    return reduce_scatter_on(impl_->collectives(), in, part, rank());
  } catch (const std::exception& e) {
    collective_failed(n, what, e);
  }
}

std::vector<std::string> ProcessGroup::wait_for_keys(const std::vector<std::string>& keys,
                                                     const std::vector<int>& ranks,
                                                     const std::string& what) {
  StoreTimer timer(*this);
  store_requests_ += 1 + keys.size();  // the wait, then a get for each key
  try {
    impl_->store->wait(keys, timeout());
  } catch (const std::exception& e) {
    std::vector<int> missing;
    try {
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if (!impl_->store->check({keys[i]})) missing.push_back(ranks[i]);
      }
    } catch (const std::exception&) {
      // The store itself is gone: the cause says enough.
      missing.clear();
    }
    throw Error(ErrorCode::IOError,
                missing.empty()
                    ? fmt::format("rank {}: {} failed: {}", rank(), what, cause_of(e))
                    : fmt::format("rank {}: {}: rank{} {} stopped answering (nothing within {} "
                                  "ms)",
                                  rank(), what, missing.size() > 1 ? "s" : "", rank_list(missing),
                                  timeout().count()));
  }
  std::vector<std::string> values;
  for (const std::string& key : keys) values.push_back(string_of(impl_->store->get(key)));
  return values;
}

std::string ProcessGroup::next_key() { return fmt::format("msg/{}", ++exchanges_); }

std::string ProcessGroup::broadcast_string(const std::string& value, int root,
                                           const std::string& what) {
  std::string k = next_key();
  if (rank() == root) {
    StoreTimer timer(*this);
    ++store_requests_;
    impl_->store->set(k, bytes_of(value));
    return value;
  }
  return wait_for_keys({k}, {root}, what)[0];
}

std::vector<std::string> ProcessGroup::allgather_strings(const std::string& value,
                                                         const std::string& what) {
  std::string k = next_key();
  {
    StoreTimer timer(*this);
    ++store_requests_;
    impl_->store->set(fmt::format("{}/{}", k, rank()), bytes_of(value));
  }
  std::vector<std::string> keys;
  std::vector<int> ranks;
  for (int r = 0; r < size(); ++r) {
    keys.push_back(fmt::format("{}/{}", k, r));
    ranks.push_back(r);
  }
  return wait_for_keys(keys, ranks, what);
}

std::vector<std::string> ProcessGroup::gather_strings(const std::string& value, int root,
                                                      const std::string& what) {
  std::string k = next_key();
  if (rank() != root) {
    StoreTimer timer(*this);
    ++store_requests_;
    impl_->store->set(fmt::format("{}/{}", k, rank()), bytes_of(value));
    return {};
  }
  std::vector<std::string> keys;
  std::vector<int> ranks;
  for (int r = 0; r < size(); ++r) {
    if (r == root) continue;
    keys.push_back(fmt::format("{}/{}", k, r));
    ranks.push_back(r);
  }
  std::vector<std::string> others = wait_for_keys(keys, ranks, what);
  std::vector<std::string> all;
  for (int r = 0, i = 0; r < size(); ++r) all.push_back(r == root ? value : others[i++]);
  return all;
}

namespace {

ErrorCode error_code_named(const std::string& name) {
  for (ErrorCode c :
       {ErrorCode::NotFound, ErrorCode::Corruption, ErrorCode::Incompatible, ErrorCode::IOError,
        ErrorCode::InvalidArgument, ErrorCode::Locked, ErrorCode::Unsupported}) {
    if (name == error_code_name(c)) return c;
  }
  return ErrorCode::IOError;
}

// What one process tells the others about a step it took.
nlohmann::json outcome_of(const std::exception_ptr& failure, const std::string& value = "") {
  if (!failure) return {{"ok", true}, {"value", value}};
  try {
    std::rethrow_exception(failure);
  } catch (const Error& e) {
    return {{"ok", false}, {"code", error_code_name(e.code())}, {"message", e.what()}};
  } catch (const std::exception& e) {
    return {{"ok", false}, {"code", error_code_name(ErrorCode::IOError)}, {"message", cause_of(e)}};
  }
  return {{"ok", false}, {"code", error_code_name(ErrorCode::IOError)}, {"message", "unknown"}};
}

// Calls `fn` on flat copies of `tensors` (consecutive ones of one dtype, up to 25 MiB at a time)
// and copies what `fn` left in each flat tensor back into the tensors.
void for_each_bucket(const std::vector<at::Tensor>& tensors,
                     const std::function<void(at::Tensor&)>& fn) {
  constexpr std::size_t kBucketBytes = 25 << 20;
  at::NoGradGuard no_grad;
  std::size_t i = 0;
  while (i < tensors.size()) {
    std::size_t end = i, bytes = 0;
    std::vector<at::Tensor> parts;
    while (end < tensors.size() && tensors[end].scalar_type() == tensors[i].scalar_type() &&
           (end == i || bytes + tensors[end].nbytes() <= kBucketBytes)) {
      bytes += tensors[end].nbytes();
      parts.push_back(tensors[end].reshape({-1}));
      ++end;
    }
    at::Tensor flat = at::cat(parts);
    fn(flat);
    std::int64_t offset = 0;
    for (std::size_t k = i; k < end; ++k) {
      std::int64_t n = tensors[k].numel();
      tensors[k].copy_(flat.slice(0, offset, offset + n).view(tensors[k].sizes()));
      offset += n;
    }
    i = end;
  }
}

}  // namespace

std::string ProcessGroup::decided_by_main(const std::function<std::string()>& fn,
                                          const std::string& what) {
  if (rank() == 0) {
    std::string value;
    std::exception_ptr failure;
    try {
      value = fn();
    } catch (const std::exception&) {
      failure = std::current_exception();
    }
    broadcast_string(outcome_of(failure, value).dump(), 0, what);
    if (failure) std::rethrow_exception(failure);
    return value;
  }
  nlohmann::json outcome = nlohmann::json::parse(broadcast_string("", 0, what));
  if (!outcome.at("ok").get<bool>()) {
    throw Error(error_code_named(outcome.at("code").get<std::string>()),
                fmt::format("rank {}: {} failed on the main process (rank 0): {}", rank(), what,
                            outcome.at("message").get<std::string>()));
  }
  return outcome.at("value").get<std::string>();
}

void ProcessGroup::agree(const std::exception_ptr& failure, const std::string& what) {
  // Every rank's outcome to rank 0, rank 0's verdict to every rank: one request per rank and
  // two exchanges (about 3 store requests per rank, 2W on rank 0), where an all-to-all
  // exchange would cost every rank W.
  std::vector<std::string> outcomes = gather_strings(outcome_of(failure).dump(), 0, what);
  nlohmann::json verdict = nlohmann::json::array();
  if (rank() == 0) {
    for (std::size_t r = 0; r < outcomes.size(); ++r) {
      nlohmann::json outcome = nlohmann::json::parse(outcomes[r]);
      if (outcome.at("ok").get<bool>()) continue;
      outcome["rank"] = r;
      verdict.push_back(std::move(outcome));
    }
  }
  verdict = nlohmann::json::parse(broadcast_string(verdict.dump(), 0, what));
  if (verdict.empty()) return;
  if (failure) std::rethrow_exception(failure);
  std::string failed;
  for (const nlohmann::json& outcome : verdict) {
    failed += fmt::format("{}rank {}: {}", failed.empty() ? "" : "; ",
                          outcome.at("rank").get<std::size_t>(),
                          outcome.at("message").get<std::string>());
  }
  throw Error(error_code_named(verdict[0].at("code").get<std::string>()),
              fmt::format("rank {}: {} failed on another process ({})", rank(), what, failed));
}

void ProcessGroup::broadcast_tensors(const std::vector<at::Tensor>& tensors, int root,
                                     const std::string& what) {
  for_each_bucket(tensors, [&](at::Tensor& flat) {
    std::vector<at::Tensor> one{flat};
    broadcast(one, root, what);
  });
}

void ProcessGroup::average_tensors(const std::vector<at::Tensor>& tensors,
                                   const std::string& what) {
  const double world = size();
  for_each_bucket(tensors, [&](at::Tensor& flat) {
    allreduce(flat, ReduceOp::Sum, what);
    flat.div_(world);
  });
}

}  // namespace torchpoint
