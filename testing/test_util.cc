#include "testing/test_util.h"

#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>

#include "format/checksum.h"
#include "format/dtype.h"
#include "format/manifest.h"
#include "torchpoint/env.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/torchpoint-test-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = buf.data();
}

TempDir::~TempDir() {
  try {
    Env::posix().remove_all(path_);
  } catch (...) {  // swallowed: a leftover temp dir must not turn a passing test into a crash
  }
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  at::Tensor ca = a.contiguous(), cb = b.contiguous();
  // An empty tensor may have no data: memcmp(nullptr, ...) is undefined even for 0 bytes.
  std::size_t bytes = ca.numel() * ca.element_size();
  return bytes == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), bytes) == 0;
}

at::Tensor make_tensor(c10::ScalarType dtype, std::vector<std::int64_t> shape, std::uint64_t seed) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  std::mt19937_64 rng(seed);
  auto* p = static_cast<std::uint8_t*>(t.data_ptr());
  std::size_t n = t.numel() * t.element_size();
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::uint8_t>(rng());
  if (dtype == c10::ScalarType::Bool) {
    for (std::size_t i = 0; i < n; ++i) p[i] &= 1;  // only 0 and 1 are valid bools
  }
  return t;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void make_manifest_newer(const std::string& manifest_path) {
  std::string bytes = read_bytes(manifest_path);
  const std::string version = "\"format_version\": \"1.";
  std::size_t at = bytes.find(version);
  const std::string key = fmt::format("\"{}\": \"", kManifestChecksumKey);
  std::size_t key_at = bytes.rfind(key);
  if (at == std::string::npos || key_at == std::string::npos) {
    throw std::runtime_error(manifest_path + " is not a format 1.x manifest");
  }
  bytes[at + version.size() - 2] = '9';
  // Resealed as the writer seals: the checksum covers the text with 16 zeros in its place.
  std::size_t digits = key_at + key.size();
  bytes.replace(digits, 16, std::string(16, '0'));
  bytes.replace(digits, 16, checksum_hex(xxh3(bytes.data(), bytes.size())));
  write_bytes(manifest_path, bytes);
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path);
}

void flip_bit(const std::string& path, std::uint64_t offset, int bit) {
  std::string bytes = read_bytes(path);
  if (offset >= bytes.size()) throw std::runtime_error("flip_bit past the end of " + path);
  bytes[offset] = static_cast<char>(bytes[offset] ^ (1 << bit));
  write_bytes(path, bytes);
}

void truncate_to(const std::string& path, std::uint64_t size) {
  if (::truncate(path.c_str(), static_cast<off_t>(size)) != 0) {
    throw std::runtime_error("truncate failed for " + path);
  }
}

std::uint64_t file_size(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) throw std::runtime_error("stat failed for " + path);
  return static_cast<std::uint64_t>(st.st_size);
}

std::uint64_t file_link_count(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) throw std::runtime_error("stat failed for " + path);
  return static_cast<std::uint64_t>(st.st_nlink);
}

std::vector<std::string> list_sorted(const std::string& dir) {
  std::vector<std::string> names = Env::posix().list_dir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

std::string python() {
  const char* from_env = std::getenv("TORCHPOINT_PYTHON");
  std::string path = from_env && *from_env ? from_env : TORCHPOINT_PYTHON;
  return "'" + path + "'";
}

CommandOutput run_python_script(const std::string& script, const std::vector<std::string>& args) {
  const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
  if (src == nullptr) throw std::runtime_error("TORCHPOINT_SOURCE_DIR is set by CTest");
  auto quote = [](const std::string& word) {
    std::string out = "'";
    for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return out + "'";
  };
  std::string command = python() + " " + quote(std::string(src) + "/tests/python/" + script);
  for (const std::string& arg : args) command += " " + quote(arg);
  command += " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) throw std::runtime_error("cannot run " + command);
  CommandOutput result;
  char buffer[4096];
  while (std::size_t n = std::fread(buffer, 1, sizeof buffer, pipe))
    result.output.append(buffer, n);
  const int status = ::pclose(pipe);
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

void expect_safetensors_reads(const std::vector<std::string>& files, const std::string& scratch) {
  const std::string blob_path = scratch + "/judge.bin";
  std::ofstream blob(blob_path, std::ios::binary);
  std::uint64_t at = 0;
  nlohmann::json expected = {{"blob", blob_path}, {"files", nlohmann::json::array()}};
  for (const std::string& path : files) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const auto& [name, value] : load_file(path).tensors) {
      at::Tensor t = value.contiguous();
      const auto length = static_cast<std::uint64_t>(t.numel() * t.element_size());
      blob.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(length));
      tensors.push_back({{"name", name},
                         {"dtype", std::string(dtype_info(t.scalar_type(), name).name)},
                         {"shape", t.sizes().vec()},
                         {"offset", at},
                         {"length", length}});
      at += length;
    }
    expected["files"].push_back({{"path", path}, {"tensors", tensors}});
  }
  blob.close();
  std::ofstream(scratch + "/judge.json") << expected.dump();
  CommandOutput judged = run_python_script("safetensors_judge.py", {scratch + "/judge.json"});
  EXPECT_EQ(judged.status, 0) << judged.output;
  EXPECT_NE(judged.output.find("ok: "), std::string::npos) << judged.output;
}

}  // namespace torchpoint::testing
