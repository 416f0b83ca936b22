// Weights written by Python (torch.save of a state dict, and a safetensors file from another
// writer) load into a LibTorch module with the exact values.
#include "torchpoint/interop.h"

#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>

#include "compat/torch_compat.h"
#include "testing/test_util.h"
#include "torchpoint/error.h"
#include "torchpoint/module_state.h"

namespace torchpoint {
namespace {

class FromPython : public ::testing::Test {
 protected:
  // The script takes a few seconds (it imports torch): it runs once for all tests here.
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir();
    const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
    if (src == nullptr) return;
    std::string cmd = fmt::format("{} {}/tests/python/write_python_weights.py {}",
                                  testing::python(), src, dir_->path());
    int rc = std::system(cmd.c_str());
    script_ok_ = WIFEXITED(rc) && WEXITSTATUS(rc) == 0;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(std::getenv("TORCHPOINT_SOURCE_DIR"), nullptr);
    ASSERT_TRUE(script_ok_) << "tests/python/write_python_weights.py failed: it needs the project "
                               "venv's torch (scripts/setup.sh "
                               "makes it; TORCHPOINT_PYTHON overrides it)";
    std::ifstream in(path("expected.json"));
    expected_ = nlohmann::json::parse(in);
    std::ifstream tensors(path("tensors.json"));
    tensors_ = nlohmann::json::parse(tensors);
  }

  static std::string path(const std::string& name) { return *dir_ / name; }

  // Loads `sd` into a fresh Sequential and checks every value against Python's.
  void expect_python_values(const StateDict& sd) {
    auto model =
        torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
    LoadReport report = load_module_state_dict(*model, sd);
    EXPECT_EQ(report.loaded.size(), 4u);
    for (const auto& item : model->named_parameters()) {
      const auto& want = expected_.at(item.key());
      at::Tensor got = item.value().detach().contiguous();
      ASSERT_EQ(got.sizes().vec(), want.at("shape").get<std::vector<std::int64_t>>()) << item.key();
      const float* p = got.data_ptr<float>();
      const auto& values = want.at("values");
      ASSERT_EQ(static_cast<std::size_t>(got.numel()), values.size());
      for (std::size_t i = 0; i < values.size(); ++i) {
        double v = std::strtod(values[i].get<std::string>().c_str(), nullptr);
        EXPECT_EQ(static_cast<float>(v), p[i]) << item.key() << "[" << i << "]";
      }
    }
  }

  // Python's tensor `key` of file `name` ("bn" for bn.pt), rebuilt from the bytes it wrote.
  at::Tensor python_tensor(const std::string& name, const std::string& key) {
    static const std::map<std::string, c10::ScalarType> kDtypes = {
        {"float32", at::kFloat},     {"float64", at::kDouble}, {"float16", at::kHalf},
        {"bfloat16", at::kBFloat16}, {"int64", at::kLong},     {"int32", at::kInt},
        {"int16", at::kShort},       {"int8", at::kChar},      {"uint8", at::kByte},
        {"bool", at::kBool}};
    const auto& info = tensors_.at(name).at("tensors").at(key);
    auto range = info.at("bytes").get<std::vector<std::size_t>>();
    std::string raw =
        testing::read_bytes(path(name + ".raw")).substr(range[0], range[1] - range[0]);
    static const std::map<std::string, std::string> kNewer = {{"uint16", "U16"},
                                                              {"uint32", "U32"},
                                                              {"uint64", "U64"},
                                                              {"float8_e4m3fn", "F8_E4M3"},
                                                              {"float8_e5m2", "F8_E5M2"}};
    const std::string dtype_name = info.at("dtype");
    c10::ScalarType dtype = kDtypes.contains(dtype_name)
                                ? kDtypes.at(dtype_name)
                                : *compat::scalar_type_for(kNewer.at(dtype_name));
    at::Tensor t = at::empty(info.at("shape").get<std::vector<std::int64_t>>(),
                             at::TensorOptions().dtype(dtype));
    EXPECT_EQ(raw.size(), static_cast<std::size_t>(t.numel() * t.element_size())) << key;
    if (!raw.empty()) std::memcpy(t.data_ptr(), raw.data(), raw.size());
    return t;
  }

  // Every tensor of `sd` against Python's: the same order, dtype, shape, strides, storage
  // offset and bytes.
  void expect_python_tensors(const StateDict& sd, const std::string& name) {
    const auto& file = tensors_.at(name);
    EXPECT_EQ(sd.keys(), file.at("order").get<std::vector<std::string>>());
    for (const auto& key : file.at("order").get<std::vector<std::string>>()) {
      const auto& info = file.at("tensors").at(key);
      const at::Tensor& got = sd.tensor(key);
      EXPECT_EQ(got.strides().vec(), info.at("stride").get<std::vector<std::int64_t>>()) << key;
      EXPECT_EQ(got.storage_offset(), info.at("offset").get<std::int64_t>()) << key;
      EXPECT_TRUE(testing::bitwise_equal(got, python_tensor(name, key))) << key;
    }
  }

  static testing::TempDir* dir_;
  static bool script_ok_;
  nlohmann::json expected_;
  nlohmann::json tensors_;
};

testing::TempDir* FromPython::dir_ = nullptr;
bool FromPython::script_ok_ = false;

TEST_F(FromPython, TorchSaveOfAStateDictLoadsIntoAModule) {
  // What torch.save(model.state_dict(), path) writes (an OrderedDict), and a plain dict.
  for (const char* name : {"ordered.pt", "model.pt"}) {
    SCOPED_TRACE(name);
    StateDict sd = load_torch_state_dict(path(name));
    EXPECT_EQ(sd.keys(), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
    EXPECT_EQ(sd.description(), path(name));
    expect_python_values(sd);
  }
}

TEST_F(FromPython, BatchNormStateDictLoadsBitForBitWithViewsAndSharedStorage) {
  StateDict sd = load_torch_state_dict(path("bn.pt"));
  expect_python_tensors(sd, "bn");
  // 0.weight was saved as a transposed view; 0.bias and 2.bias are slices of one storage and
  // stay so, as after torch.load; nothing else shares.
  EXPECT_FALSE(sd.tensor("0.weight").is_contiguous());
  EXPECT_TRUE(sd.tensor("0.bias").is_alias_of(sd.tensor("2.bias")));
  EXPECT_FALSE(sd.tensor("0.bias").is_alias_of(sd.tensor("0.weight")));
  EXPECT_EQ(sd.tensor("1.num_batches_tracked").scalar_type(), at::kLong);
  EXPECT_EQ(sd.tensor("1.num_batches_tracked").item<std::int64_t>(), 2);

  auto model = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3),
                                     torch::nn::Linear(3, 2));
  LoadReport report = load_module_state_dict(*model, sd);
  EXPECT_EQ(report.loaded.size(), 9u);
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(testing::bitwise_equal(item.value().detach(), python_tensor("bn", item.key())))
        << item.key();
  }
  for (const auto& item : model->named_buffers()) {
    EXPECT_TRUE(testing::bitwise_equal(item.value(), python_tensor("bn", item.key())))
        << item.key();
  }
}

TEST_F(FromPython, Zip64SizesAndOffsetsAreRead) {
  // Archives over 4 GiB keep sizes and offsets in ZIP64 extra fields; zip64.pt has them all
  // there (and 0xffffffff in the 32-bit fields), for bn.pt's records.
  expect_python_tensors(load_torch_state_dict(path("zip64.pt")), "bn");
}

TEST_F(FromPython, ParametersSavedDirectlyLoadAsTensors) {
  // torch.save({"w": nn.Parameter(...)}) rebuilds through torch._utils._rebuild_parameter.
  StateDict sd = load_torch_state_dict(path("parameter.pt"));
  ASSERT_EQ(sd.keys(), std::vector<std::string>{"w"});
  EXPECT_TRUE(testing::bitwise_equal(sd.tensor("w"), at::arange(6, at::kFloat).reshape({2, 3})));
}

TEST_F(FromPython, EveryDtypeLoadsBitForBit) {
  StateDict sd = load_torch_state_dict(path("buffers.pt"));
  expect_python_tensors(sd, "buffers");
  EXPECT_EQ(sd.tensor("scalar").dim(), 0);
  EXPECT_EQ(sd.tensor("empty").numel(), 0);
  // Into a LibTorch module with buffers of the same names, dtypes and shapes.
  torch::nn::Module module;
  for (const auto& key : tensors_.at("buffers").at("order").get<std::vector<std::string>>()) {
    module.register_buffer(key, at::zeros_like(python_tensor("buffers", key)));
  }
  EXPECT_EQ(load_module_state_dict(module, sd).loaded.size(), 13u);
  for (const auto& item : module.named_buffers()) {
    EXPECT_TRUE(testing::bitwise_equal(item.value(), python_tensor("buffers", item.key())))
        << item.key();
  }
}

// torch 2.x writes uint16/32/64 and float8 tensors with _rebuild_tensor_v3 over untyped
// storages: a LibTorch that has these dtypes reads them bit for bit, views and shared storage
// included; LibTorch 1.13 refuses the file, naming the dtype.
TEST_F(FromPython, NewerDtypesLoadBitForBitOrAreRefusedByName) {
  if (!compat::scalar_type_for("U16")) {
    testing::expect_error([&] { load_torch_state_dict(path("newer.pt")); }, ErrorCode::Unsupported,
                          {"newer.pt", "dtype torch.uint16", "LibTorch 1.13", "2.3 or later"});
    return;
  }
  StateDict sd = load_torch_state_dict(path("newer.pt"));
  expect_python_tensors(sd, "newer");
  const at::Tensor& whole = sd.tensor("uint16");
  const at::Tensor& row = sd.tensor("uint16_row");
  EXPECT_TRUE(row.is_alias_of(whole)) << "the view shares its storage";
  EXPECT_EQ(row.storage_offset(), 4);
}

// save_torch_state_dict writes what load_torch_state_dict (and torch.load, in cli_test) reads
// back bit for bit: every dtype this LibTorch has, 0-d, empty and non-contiguous tensors.
TEST(TorchSave, RoundTripsThroughTheReader) {
  testing::TempDir dir;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::uint64_t seed = 1;
  for (c10::ScalarType type : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,
                               at::kInt, at::kShort, at::kChar, at::kByte, at::kBool}) {
    tensors.emplace_back(fmt::format("t{}", seed), testing::make_tensor(type, {3, 4}, seed));
    ++seed;
  }
  for (const char* name : {"U16", "U32", "U64", "F8_E4M3", "F8_E5M2"}) {
    if (auto type = compat::scalar_type_for(name)) {
      tensors.emplace_back(name, testing::make_tensor(*type, {5}, seed++));
    }
  }
  tensors.emplace_back("scalar", at::scalar_tensor(1.5, at::kDouble));
  tensors.emplace_back("empty", at::zeros({0, 3}));
  tensors.emplace_back("transposed", testing::make_tensor(at::kFloat, {4, 6}, 99).t());
  save_torch_state_dict(dir / "out.pt", tensors);
  StateDict back = load_torch_state_dict(dir / "out.pt");
  ASSERT_EQ(back.size(), tensors.size());
  std::size_t i = 0;
  for (const auto& [name, t] : tensors) {
    EXPECT_EQ(back.keys()[i++], name);
    EXPECT_TRUE(testing::bitwise_equal(back.tensor(name), t)) << name;
  }
  testing::expect_error(
      [&] {
        save_torch_state_dict(dir / "bad.pt", {{"z", at::zeros({2}, at::kComplexFloat)}});
      },
      ErrorCode::Unsupported, {"'z'", "ComplexFloat"});
  EXPECT_FALSE(Env::posix().stat(dir / "bad.pt").exists);
}

// A file of 100 GiB (sparse: nothing is written) is read from its end, never whole: before,
// load_torch_state_dict read it into memory and died with std::bad_alloc.
TEST(TorchZipReader, AHugeSparseFileIsRefusedFromItsEnd) {
  testing::TempDir dir;
  const std::string path = dir / "huge.pt";
  { std::ofstream touch(path); }
  ASSERT_EQ(::truncate(path.c_str(), std::int64_t{100} << 30), 0);
  testing::expect_error([&] { load_torch_state_dict(path); }, ErrorCode::Corruption,
                        {path, "no end-of-central-directory record"});
}

// Where the bytes of record `name` begin in zip `bytes` (found from its local header).
std::size_t record_data(const std::string& bytes, const std::string& name) {
  // The first occurrence of the name is in the local header (the directory comes last).
  std::size_t header = bytes.find(name) - 30;
  EXPECT_EQ(bytes.compare(header, 4, "PK\x03\x04"), 0) << name;
  auto u16 = [&](std::size_t at) {
    return static_cast<std::uint8_t>(bytes[at]) | static_cast<std::uint8_t>(bytes[at + 1]) << 8;
  };
  return header + 30 + u16(header + 26) + u16(header + 28);
}

TEST_F(FromPython, HostileFilesAreClearErrors) {
  std::string bytes = testing::read_bytes(path("bn.pt"));
  testing::write_bytes(path("short.pt"), bytes.substr(0, bytes.size() - 1));
  testing::expect_error([&] { load_torch_state_dict(path("short.pt")); }, ErrorCode::Corruption,
                        {path("short.pt"), "truncated"});
  testing::write_bytes(path("half.pt"), bytes.substr(0, bytes.size() / 2));
  testing::expect_error([&] { load_torch_state_dict(path("half.pt")); }, ErrorCode::Corruption,
                        {path("half.pt"), "truncated"});
  testing::expect_error([&] { load_torch_state_dict(path("compressed.pt")); },
                        ErrorCode::Unsupported,
                        {path("compressed.pt"), "'bn/data.pkl' is compressed", "torch.save"});
  testing::expect_error([&] { load_torch_state_dict(path("bad_opcode.pt")); },
                        ErrorCode::Corruption,
                        {path("bad_opcode.pt"), "data.pkl", "byte 2", "opcode 0xff"});
  testing::expect_error(
      [&] { load_torch_state_dict(path("past_end.pt")); }, ErrorCode::Corruption,
      {path("past_end.pt"), "storage offset 250", "past the end of its storage of 10 elements"});
  // 2^62 float32 elements are 2^64 bytes: the message says so instead of a wrapped-around size.
  Error huge = testing::expect_error(
      [&] { load_torch_state_dict(path("huge_storage.pt")); }, ErrorCode::Corruption,
      {path("huge_storage.pt"), "4611686018427387904 Float elements", "needs more than 2^64"});
  EXPECT_EQ(std::string(huge.what()).find("needs 0"), std::string::npos) << huge.what();
  testing::expect_error([&] { load_torch_state_dict(path("unknown_global.pt")); },
                        ErrorCode::Unsupported, {path("unknown_global.pt"), "posix.system"});
  testing::expect_error([&] { load_torch_state_dict(path("not_tensor.pt")); },
                        ErrorCode::Incompatible,
                        {path("not_tensor.pt"), "'step' is of type int, not a tensor"});
  testing::expect_error([&] { load_torch_state_dict(path("a_list.pt")); }, ErrorCode::Incompatible,
                        {path("a_list.pt"), "holds an object of type list, not a state dict"});
  testing::expect_error([&] { load_torch_state_dict(path("legacy.pt")); }, ErrorCode::Unsupported,
                        {path("legacy.pt"), "before PyTorch 1.6"});
  // A flipped bit in a storage's bytes: the record's CRC-32 catches it.
  std::string flipped = bytes;
  flipped[record_data(bytes, "bn/data/1") + 5] ^= 0x10;
  testing::write_bytes(path("flipped.pt"), flipped);
  testing::expect_error([&] { load_torch_state_dict(path("flipped.pt")); }, ErrorCode::Corruption,
                        {path("flipped.pt"), "'bn/data/1' fails its CRC-32 check"});
  // A storage record shorter than the pickle says: named, with both sizes.
  std::string renamed = bytes;
  renamed.replace(renamed.find("bn/data/7"), 9, "bn/data/x");
  renamed.replace(renamed.find("bn/data/7"), 9, "bn/data/x");  // local header and directory
  testing::write_bytes(path("no_record.pt"), renamed);
  testing::expect_error([&] { load_torch_state_dict(path("no_record.pt")); }, ErrorCode::Corruption,
                        {"storage '7'", "'bn/data/7'", "missing"});
}

// Every prefix of a file, and every single-byte change (with the CRCs zeroed, so the changes
// reach the pickle interpreter), is either loaded or refused with a torchpoint::Error: nothing
// crashes, hangs or throws anything else.
TEST_F(FromPython, EveryTruncationAndByteChangeIsLoadedOrRefused) {
  std::string bytes = testing::read_bytes(path("bn.pt"));
  const std::string p = path("mutant.pt");
  auto outcome = [&](const std::string& mutant) {
    testing::write_bytes(p, mutant);
    try {
      load_torch_state_dict(p);
      return std::string("loaded");
    } catch (const Error& e) {
      return std::string(error_code_name(e.code()));
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a torchpoint::Error: " << e.what();
      return std::string("other");
    }
  };
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    ASSERT_EQ(outcome(bytes.substr(0, n)), "Corruption") << "first " << n << " bytes";
  }
  std::string unchecked = bytes;
  for (std::size_t at = unchecked.find("PK\x01\x02"); at != std::string::npos;
       at = unchecked.find("PK\x01\x02", at + 1)) {
    unchecked.replace(at + 16, 4, std::string(4, '\0'));
  }
  ASSERT_EQ(outcome(unchecked), "loaded");
  std::map<std::string, int> counts;
  for (std::size_t i = 0; i < unchecked.size(); ++i) {
    std::string mutant = unchecked;
    mutant[i] = static_cast<char>(mutant[i] ^ (i % 3 == 0 ? 0xff : 1 << (i % 8)));
    ++counts[outcome(mutant)];
  }
  for (const auto& [outcome_name, n] : counts) RecordProperty(outcome_name, n);
  EXPECT_EQ(counts.count("other"), 0u);
  EXPECT_GT(counts["Corruption"], 0);
  EXPECT_GT(counts["loaded"], 0);  // bytes of tensors, dates: no check covers them once CRCs go
}

TEST_F(FromPython, ForeignSafetensorsLoadAfterStructuralChecks) {
  ForeignContainer c = load_safetensors(path("plain.safetensors"));
  EXPECT_FALSE(c.verified);
  expect_python_values(StateDict::from_container(c.contents));
  // load_file insists on checksums: a foreign file is refused there, with a reason.
  testing::expect_error([&] { load_file(path("plain.safetensors")); }, ErrorCode::Corruption,
                        {"not a torchpoint file"});
  // A torchpoint file through the same door is fully verified.
  save_file(path("ours.safetensors"), c.contents);
  EXPECT_TRUE(load_safetensors(path("ours.safetensors")).verified);
}

TEST_F(FromPython, DamagedOrWrongFilesAreClearErrors) {
  std::string bytes = testing::read_bytes(path("plain.safetensors"));
  testing::write_bytes(path("short.safetensors"), bytes.substr(0, bytes.size() - 3));
  testing::expect_error([&] { load_safetensors(path("short.safetensors")); }, ErrorCode::Corruption,
                        {"truncated"});
  testing::expect_error([&] { load_torch_state_dict(path("plain.safetensors")); },
                        ErrorCode::Corruption, {"torch.save"});
  testing::expect_error([&] { load_torch_state_dict(path("missing.pt")); }, ErrorCode::NotFound);
}

}  // namespace
}  // namespace torchpoint
