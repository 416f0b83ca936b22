// The `torchpoint` command-line tool, run as users run it: the built binary (TORCHPOINT_CLI) is
// spawned on real checkpoints written by save_directory and save_file — valid ones, a
// corrupted one (a flipped bit), a half-written one (a checkpoint_N.tmp-<pid>-<hex> directory)
// and an uncommitted one (no manifest.json) — and its stdout, stderr and exit status checked.
// Exported .pt files are loaded by Python's torch.load (tests/python/export_check.py).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "inspect/sha256.h"
#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "tests/learner_job.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/data_position.h"
#include "torchpoint/env.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

#ifndef TORCHPOINT_CLI
#error "TORCHPOINT_CLI must name the built torchpoint tool"
#endif

namespace torchpoint {
namespace {

using testing::TempDir;
using Json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// SHA-256 (FIPS 180-4 and its example vectors)

std::string sha256_hex(const std::string& bytes) {
  detail::Sha256 h;
  h.update(bytes);
  return h.hex_digest();
}

TEST(Sha256, Fips180Vectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnop"
                       "jklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  EXPECT_EQ(sha256_hex(std::string(1'000'000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, AnySplitOfTheInputGivesTheSameDigest) {
  std::string input;
  for (int i = 0; i < 300; ++i) input.push_back(static_cast<char>(i * 7 + 3));
  std::string expected = sha256_hex(input);
  // Splits around the 55/56/64-byte padding and block boundaries.
  for (std::size_t first : {0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 200, 300}) {
    detail::Sha256 h;
    h.update(input.data(), first);
    for (std::size_t i = first; i < input.size(); i += 13) {
      h.update(input.data() + i, std::min<std::size_t>(13, input.size() - i));
    }
    EXPECT_EQ(h.hex_digest(), expected) << "first chunk " << first;
  }
}

// ---------------------------------------------------------------------------------------------
// Running the tool

struct Result {
  int status = -1;
  std::string out;
  std::string err;
};

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Result run_command(const std::string& command, const std::string& err_file) {
  Result run;
  std::string full = command + " 2>" + quote(err_file);
  FILE* pipe = ::popen(full.c_str(), "r");
  if (pipe == nullptr) ADD_FAILURE() << "popen failed: " << full;
  if (pipe == nullptr) return run;
  char buffer[4096];
  std::size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) run.out.append(buffer, n);
  int raw = ::pclose(pipe);
  run.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  run.err = slurp(err_file);
  return run;
}

// Runs `torchpoint args...`.
Result tp(const std::vector<std::string>& args) {
  static TempDir scratch;
  std::string command = quote(TORCHPOINT_CLI);
  for (const std::string& a : args) command += " " + quote(a);
  return run_command(command, scratch / "stderr");
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Whitespace-separated words of a line.
std::vector<std::string> words(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// Index of the first line that has `word` as one of its words; -1 if none.
int line_index(const std::vector<std::string>& lines, const std::string& word) {
  for (std::size_t i = 0; i < lines.size(); ++i) {
    for (const std::string& w : words(lines[i])) {
      if (w == word) return static_cast<int>(i);
    }
  }
  return -1;
}

std::string line_with(const std::string& text, const std::string& word) {
  std::vector<std::string> lines = lines_of(text);
  int i = line_index(lines, word);
  return i < 0 ? std::string() : lines[i];
}

Json parse_json(const Result& run) {
  Json j = Json::parse(run.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON:\n" << run.out << run.err;
  return j;
}

// `text` with every run of white space replaced by one space.
std::string squeeze(const std::string& text) {
  std::string out;
  for (const std::string& w : words(text)) out += (out.empty() ? "" : " ") + w;
  return out;
}

bool exists(const std::string& path) { return Env::posix().stat(path).exists; }

// ---------------------------------------------------------------------------------------------
// Real checkpoints

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

StateDict model_state(float shift) {
  StateDict sd;
  sd.set("fc.weight", torch::arange(6, torch::kFloat).reshape({2, 3}) + shift);
  sd.set("fc.bias", torch::tensor({0.5f, -1.5f}) + shift);
  sd.set("special", torch::tensor({kNaN, -0.0, kInf, -kInf, 1e-300}, torch::kDouble));
  sd.set("ids", torch::tensor({std::int64_t{-7}, std::int64_t{1} << 40}, torch::kLong));
  sd.set("half", torch::tensor({0.5, -2.0}).to(torch::kHalf));
  sd.set("bf", torch::tensor({1.0, -3.0}).to(torch::kBFloat16));
  sd.set("small", torch::tensor({-5, 7}, torch::kInt).to(torch::kShort));
  sd.set("bytes", torch::tensor({0, 255}, torch::kInt).to(torch::kByte));
  sd.set("mask", torch::tensor({true, false, true}));
  sd.set("scalar", torch::scalar_tensor(2.5, torch::kFloat));
  sd.set("empty", torch::zeros({0, 4}, torch::kInt));
  sd.set("config", Json{{"hidden", 3}});
  return sd;
}

StateDict optimizer_state(float shift) {
  StateDict sd;
  sd.set("state.0.exp_avg", torch::full({2, 3}, 0.25f + shift));
  sd.set("state.0.step", torch::scalar_tensor(3.0, torch::kFloat));
  sd.set("param_groups.0.lr", 0.01);
  return sd;
}

MetricRecords records() {
  MetricRecords r;
  for (double v : {1.0, 0.5, 0.25}) r.record("train", "loss", v);
  for (double v : {1.2, 0.8, 0.6}) r.record("valid", "loss", v);
  for (double v : {0.5, 0.7, 0.9}) r.record("train", "acc", v);
  return r;
}

TrainingCounters counters(std::int64_t step) {
  TrainingCounters c;
  c.epoch = 3;
  c.step = step;
  return c;
}

std::vector<Component> components(std::int64_t step, float shift) {
  return {{"model", model_state(shift).to_container()},
          {"optimizer", optimizer_state(shift).to_container()},
          {"records", records().state_dict().to_container()},
          {"counters", counters(step).state_dict().to_container()}};
}

// A directory checkpoint with the manifest metadata {"metrics": {"val_loss": val_loss}}.
void save_checkpoint(const std::string& path, std::int64_t step, float shift,
                     double val_loss = 1.0) {
  CheckpointInfo info;
  info.step = step;
  info.iteration = step / 100;
  info.metadata = {{"metrics", {{"val_loss", val_loss}}}};
  save_directory(path, components(step, shift), info);
}

// The same state as save_checkpoint(), as one file (StateDict::set_child layout).
void save_file_checkpoint(const std::string& path, std::int64_t step, float shift) {
  StateDict all;
  all.set_child("model", model_state(shift));
  all.set_child("optimizer", optimizer_state(shift));
  all.set_child("records", records().state_dict());
  all.set_child("counters", counters(step).state_dict());
  save_file(path, all.to_container());
}

// Flips a bit of the last byte of a container file (tensor data).
void corrupt(const std::string& file) { testing::flip_bit(file, testing::file_size(file) - 1, 0); }

void make_dir(const std::string& path) { ASSERT_EQ(::mkdir(path.c_str(), 0755), 0) << path; }

// runs/checkpoints/ with: checkpoint_1, _2, _9 (valid), _10 (corrupt: a flipped bit),
// checkpoint_11.tmp-123-abcdef0123456789 (half-written: a save that died), checkpoint_12
// (no manifest.json: never committed), plus entries that are not checkpoints.
struct Project {
  TempDir tmp;
  std::string root = tmp / "runs";
  std::string dir = root + "/checkpoints";
  std::string ckpt(int n) const { return dir + "/checkpoint_" + std::to_string(n); }
  std::string temp = dir + "/checkpoint_11.tmp-123-abcdef0123456789";

  Project() {
    save_checkpoint(ckpt(1), 100, 0, 0.9);
    save_checkpoint(ckpt(2), 200, 1, 0.5);
    save_checkpoint(ckpt(9), 900, 2, 0.7);
    save_checkpoint(ckpt(10), 1000, 3, 0.8);
    corrupt(ckpt(10) + "/model.safetensors");
    save_checkpoint(ckpt(12), 1200, 4);
    Env::posix().remove_file(ckpt(12) + "/manifest.json");
    // After the saves: save_directory sweeps temporaries of dead writers.
    make_dir(temp);
    testing::write_bytes(temp + "/model.safetensors", "partial");
    testing::write_bytes(dir + "/notes.txt", "not a checkpoint");
    make_dir(dir + "/logs");
  }
};

// ---------------------------------------------------------------------------------------------
// Usage

TEST(Cli, UsageErrorsExitTwoAndHelpExitsZero) {
  EXPECT_EQ(tp({}).status, 2);
  Result unknown = tp({"frobnicate"});
  EXPECT_EQ(unknown.status, 2);
  EXPECT_NE(unknown.err.find("unknown command 'frobnicate'"), std::string::npos) << unknown.err;
  EXPECT_EQ(tp({"ls"}).status, 2);                  // missing DIR
  EXPECT_EQ(tp({"ls", "a", "--bogus"}).status, 2);  // unknown option
  EXPECT_EQ(tp({"prune", "x"}).status, 2);          // --keep-last is required
  EXPECT_EQ(tp({"prune", "x", "--keep-last", "1", "--mode", "max"}).status, 2);  // needs best
  EXPECT_EQ(tp({"prune", "x", "--keep-last", "1", "--keep-best", "m", "--mode", "up"}).status, 2);

  Result help = tp({"--help"});
  EXPECT_EQ(help.status, 0);
  for (const char* command :
       {"ls", "show", "verify", "diff", "digest", "export", "plot", "prune"}) {
    EXPECT_NE(help.out.find(command), std::string::npos) << command;
    Result sub = tp({command, "--help"});
    EXPECT_EQ(sub.status, 0) << command;
    EXPECT_NE(sub.out.find(std::string("torchpoint ") + command), std::string::npos) << sub.out;
  }
  // Help text is wrapped: compare with runs of white space collapsed.
  EXPECT_NE(squeeze(tp({"digest", "--help"}).out).find("the first dotted part of each key"),
            std::string::npos);
  EXPECT_NE(squeeze(tp({"prune", "--help"}).out).find("metadata[\"metrics\"][METRIC]"),
            std::string::npos);
  Result version = tp({"--version"});
  EXPECT_EQ(version.status, 0);
  EXPECT_NE(version.out.find("torchpoint "), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// ls

TEST(CliLs, ListsInNumericOrderWithStatusAndMarksTheLatestValid) {
  Project p;
  Result run = tp({"ls", p.root});  // a project directory: its checkpoints/ is listed
  ASSERT_EQ(run.status, 0) << run.err;
  std::vector<std::string> lines = lines_of(run.out);
  int i1 = line_index(lines, "checkpoint_1/"), i2 = line_index(lines, "checkpoint_2/");
  int i9 = line_index(lines, "checkpoint_9/"), i10 = line_index(lines, "checkpoint_10/");
  int i11 = line_index(lines, "checkpoint_11.tmp-123-abcdef0123456789/");
  int i12 = line_index(lines, "checkpoint_12/");
  ASSERT_TRUE(i1 >= 0 && i2 >= 0 && i9 >= 0 && i10 >= 0 && i11 >= 0 && i12 >= 0) << run.out;
  EXPECT_LT(i1, i2);
  EXPECT_LT(i2, i9);
  EXPECT_LT(i9, i10);  // numeric: lexically "checkpoint_10" < "checkpoint_9"
  EXPECT_LT(i10, i11);
  EXPECT_LT(i11, i12);
  EXPECT_EQ(words(lines[i9]).front(), "*") << run.out;
  for (int i : {i1, i2, i10, i11, i12}) EXPECT_NE(words(lines[i]).front(), "*") << lines[i];
  EXPECT_EQ(words(lines[i9]).back(), "valid");
  EXPECT_EQ(words(lines[i10]).back(), "corrupt");
  EXPECT_EQ(words(lines[i11]).back(), "uncommitted");
  EXPECT_EQ(words(lines[i12]).back(), "uncommitted");
  EXPECT_NE(lines[i2].find("val_loss=0.5"), std::string::npos) << lines[i2];
  EXPECT_EQ(run.out.find("notes.txt"), std::string::npos);
  EXPECT_EQ(run.out.find("logs"), std::string::npos);
  // The corrupt one says why.
  EXPECT_NE(run.out.find("checkpoint_10: "), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("model.safetensors"), std::string::npos) << run.out;

  // The checkpoints directory itself gives the same listing.
  Result direct = tp({"ls", p.dir});
  EXPECT_EQ(direct.status, 0);
  EXPECT_EQ(lines_of(direct.out).size(), lines.size());
}

TEST(CliLs, JsonHasEveryField) {
  Project p;
  Result run = tp({"ls", p.root, "--json"});
  ASSERT_EQ(run.status, 0) << run.err;
  Json j = parse_json(run);
  EXPECT_EQ(j["directory"], p.dir);
  EXPECT_EQ(j["latest"], "checkpoint_9");
  std::vector<std::string> names, statuses;
  for (const Json& c : j["checkpoints"]) {
    names.push_back(c["name"]);
    statuses.push_back(c["status"]);
  }
  EXPECT_EQ(names, (std::vector<std::string>{
                       "checkpoint_1", "checkpoint_2", "checkpoint_9", "checkpoint_10",
                       "checkpoint_11.tmp-123-abcdef0123456789", "checkpoint_12"}));
  EXPECT_EQ(statuses, (std::vector<std::string>{"valid", "valid", "valid", "corrupt", "uncommitted",
                                                "uncommitted"}));
  const Json& c9 = j["checkpoints"][2];
  EXPECT_EQ(c9["number"], 9);
  EXPECT_EQ(c9["step"], 900);
  EXPECT_EQ(c9["latest"], true);
  EXPECT_EQ(c9["kind"], "directory");
  EXPECT_EQ(c9["metrics"]["val_loss"], 0.7);
  std::uint64_t size = 0;
  for (const std::string& f : testing::list_sorted(p.ckpt(9))) {
    size += testing::file_size(p.ckpt(9) + "/" + f);
  }
  EXPECT_EQ(c9["size_bytes"], size);
  EXPECT_GT(c9["modified_unix_ms"].get<std::int64_t>(), 1'600'000'000'000);
  EXPECT_FALSE(j["checkpoints"][3]["problems"].empty());
  EXPECT_EQ(j["checkpoints"][4]["number"], 11);
  EXPECT_EQ(j["checkpoints"][4]["latest"], false);
}

TEST(CliLs, PicksTheHighestNumberNotTheLexicallyLast) {
  TempDir tmp;
  save_checkpoint(tmp / "checkpoint_9", 9, 0);
  save_checkpoint(tmp / "checkpoint_10", 10, 0);
  Json j = parse_json(tp({"ls", tmp.path(), "--json"}));
  EXPECT_EQ(j["latest"], "checkpoint_10");
}

// A file name is any bytes: one that is not UTF-8 is shown with U+FFFD in its place, and the
// JSON stays valid (before, ls --json and verify --json failed with a json.exception).
TEST(CliLs, NamesThatAreNotUtf8KeepTheJsonValid) {
  TempDir tmp;
  const std::string name = "epoch-3\xff.ckpt";
  save_file_checkpoint(tmp / name, 3, 0);
  Result ls = tp({"ls", tmp.path(), "--json"});
  ASSERT_EQ(ls.status, 0) << ls.err;
  Json j = parse_json(ls);
  ASSERT_EQ(j["checkpoints"].size(), 1u);
  EXPECT_EQ(j["checkpoints"][0]["name"], "epoch-3\xef\xbf\xbd.ckpt");
  EXPECT_EQ(j["checkpoints"][0]["status"], "valid");
  Result verify = tp({"verify", "--json", tmp / name});
  ASSERT_EQ(verify.status, 0) << verify.err;
  EXPECT_EQ(parse_json(verify)["results"][0]["ok"], true) << verify.out;
}

TEST(CliLs, ListsFileCheckpoints) {
  TempDir tmp;
  save_file_checkpoint(tmp / "epoch-9.ckpt", 9, 0);
  save_file_checkpoint(tmp / "epoch-10.ckpt", 10, 0);
  save_file_checkpoint(tmp / "epoch-11.ckpt", 11, 0);
  corrupt(tmp / "epoch-11.ckpt");
  testing::write_bytes(tmp / "epoch-12.ckpt.tmp-77-0123456789abcdef", "half");
  Result run = tp({"ls", tmp.path(), "--json"});
  ASSERT_EQ(run.status, 0) << run.err;
  Json j = parse_json(run);
  EXPECT_EQ(j["latest"], "epoch-10.ckpt");
  std::vector<std::string> names;
  for (const Json& c : j["checkpoints"]) names.push_back(c["name"]);
  EXPECT_EQ(names, (std::vector<std::string>{"epoch-9.ckpt", "epoch-10.ckpt", "epoch-11.ckpt",
                                             "epoch-12.ckpt.tmp-77-0123456789abcdef"}));
  EXPECT_EQ(j["checkpoints"][2]["status"], "corrupt");
  EXPECT_EQ(j["checkpoints"][3]["status"], "uncommitted");
  EXPECT_EQ(j["checkpoints"][0]["kind"], "file");
  EXPECT_EQ(j["checkpoints"][0]["step"], 9);  // counters.step, read from the header
  EXPECT_EQ(j["checkpoints"][1]["step"], 10);
  EXPECT_EQ(j["checkpoints"][0]["size_bytes"], testing::file_size(tmp / "epoch-9.ckpt"));
}

// A checkpoint that retention deletes while `ls` verifies it (renamed to a temporary name, then
// removed, as save_state and `prune` do) is not listed as corrupt. The hook fires when the
// lister opens the doomed checkpoint's files, i.e. in the middle of verifying it; the control
// damages the file at that same moment instead, and that is listed as corrupt.
TEST(CliLs, ACheckpointDeletedWhileBeingListedIsNotCalledCorrupt) {
  enum class Action { RenameAway, Unlink, FlipABit };
  for (bool directory : {true, false}) {
    for (Action action : {Action::RenameAway, Action::Unlink, Action::FlipABit}) {
      if (directory && action == Action::Unlink) continue;  // directories are renamed first
      SCOPED_TRACE(fmt::format("directory {} action {}", directory, static_cast<int>(action)));
      TempDir tmp;
      const std::string doomed = directory ? tmp / "checkpoint_1" : tmp / "epoch-1.ckpt";
      for (int n : {0, 1, 2}) {
        if (directory) {
          save_checkpoint(tmp / fmt::format("checkpoint_{}", n), n, 0);
        } else {
          save_file_checkpoint(tmp / fmt::format("epoch-{}.ckpt", n), n, 0);
        }
      }
      const std::string data_file = directory ? doomed + "/model.safetensors" : doomed;
      testing::FaultEnv env;
      auto fired = std::make_shared<bool>(false);
      env.set_before_op([&, fired](testing::Op op, const std::string& path) {
        if (op != testing::Op::Open || path != data_file || *fired) return;
        *fired = true;
        if (action == Action::RenameAway) {
          std::string temp = doomed + ".tmp-1-0123456789abcdef";
          ASSERT_EQ(std::rename(doomed.c_str(), temp.c_str()), 0);
          Env::posix().remove_all(temp);
        } else if (action == Action::Unlink) {
          ASSERT_EQ(std::remove(doomed.c_str()), 0);
        } else {
          corrupt(data_file);
        }
      });
      CheckpointListing listing = list_checkpoints(tmp.path(), env);
      ASSERT_TRUE(*fired) << "the hook never ran: the test proves nothing";
      std::vector<std::string> names;
      for (const ListedCheckpoint& c : listing.entries) {
        names.push_back(c.name);
        if (action != Action::FlipABit) {
          EXPECT_NE(c.status, CheckpointStatus::Corrupt) << c.name << ": " << c.problems.at(0);
        }
      }
      if (action == Action::FlipABit) {
        ASSERT_EQ(listing.entries.size(), 3u);
        EXPECT_EQ(listing.entries[1].status, CheckpointStatus::Corrupt) << "control";
      } else {
        EXPECT_EQ(names.size(), 2u) << "the deleted checkpoint is not listed";
      }
    }
  }
}

TEST(CliLs, ErrorsNameThePath) {
  Project p;
  Result missing = tp({"ls", p.tmp / "nowhere"});
  EXPECT_EQ(missing.status, 2);
  EXPECT_NE(missing.err.find(p.tmp / "nowhere"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("does not exist"), std::string::npos) << missing.err;
  Result checkpoint = tp({"ls", p.ckpt(1)});
  EXPECT_EQ(checkpoint.status, 2);
  EXPECT_NE(checkpoint.err.find("is a checkpoint"), std::string::npos) << checkpoint.err;
  Result file = tp({"ls", p.dir + "/notes.txt"});
  EXPECT_EQ(file.status, 2);
  EXPECT_NE(file.err.find("notes.txt"), std::string::npos) << file.err;
  TempDir empty;
  Result none = tp({"ls", empty.path()});
  EXPECT_EQ(none.status, 0);
  EXPECT_NE(none.out.find("no checkpoints"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// show

TEST(CliShow, ShowsComponentsTensorsStateVersionsAndRecords) {
  Project p;
  Result run = tp({"show", p.ckpt(2)});
  ASSERT_EQ(run.status, 0) << run.err;
  const std::string& out = run.out;
  EXPECT_EQ(words(line_with(out, "fc.weight")),
            (std::vector<std::string>{"fc.weight", "F32", "[2,", "3]", "24"}));
  EXPECT_EQ(words(line_with(out, "ids")), (std::vector<std::string>{"ids", "I64", "[2]", "16"}));
  EXPECT_EQ(words(line_with(out, "bf")), (std::vector<std::string>{"bf", "BF16", "[2]", "4"}));
  EXPECT_EQ(words(line_with(out, "scalar")),
            (std::vector<std::string>{"scalar", "F32", "[]", "4"}));
  EXPECT_EQ(words(line_with(out, "empty")),
            (std::vector<std::string>{"empty", "I32", "[0,", "4]", "0"}));
  EXPECT_TRUE(std::regex_search(out, std::regex("step +200\n"))) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex("iteration +2\n"))) << out;
  Json manifest = Json::parse(slurp(p.ckpt(2) + "/manifest.json"));
  EXPECT_NE(out.find(fmt::format("format 1.0, torchpoint {}, LibTorch {}",
                                 manifest["torchpoint_version"].get<std::string>(),
                                 manifest["libtorch_version"].get<std::string>())),
            std::string::npos)
      << out;
  EXPECT_NE(out.find(R"({"metrics":{"val_loss":0.5}})"), std::string::npos) << out;
  for (const char* c : {"model", "optimizer", "records", "counters"}) {
    EXPECT_NE(out.find(fmt::format("component {} ({}.safetensors, ", c, c)), std::string::npos)
        << c;
  }
  EXPECT_NE(out.find(R"(state: {"epoch":3,"step":200,)"), std::string::npos) << out;
  EXPECT_NE(out.find(R"(state: {"config":{"hidden":3}})"), std::string::npos) << out;
  EXPECT_EQ(words(line_with(out, "acc")),
            (std::vector<std::string>{"records", "train", "acc", "3", "0.9"}));
  std::vector<std::string> lines = lines_of(out);
  int valid_loss = line_index(lines, "valid");
  ASSERT_GE(valid_loss, 0);
  EXPECT_EQ(words(lines[valid_loss]),
            (std::vector<std::string>{"records", "valid", "loss", "3", "0.6"}));
}

TEST(CliShow, JsonOfADirectoryAndOfAFileCheckpoint) {
  Project p;
  save_file_checkpoint(p.tmp / "state.ckpt", 200, 1);
  for (const std::string& path : {p.ckpt(2), p.tmp / "state.ckpt"}) {
    SCOPED_TRACE(path);
    Result run = tp({"show", path, "--json"});
    ASSERT_EQ(run.status, 0) << run.err;
    Json j = parse_json(run);
    bool directory = path == p.ckpt(2);
    EXPECT_EQ(j["kind"], directory ? "directory" : "file");
    EXPECT_EQ(j["step"], 200);  // the manifest's, or the counters component's
    EXPECT_EQ(j["versions"]["format"], "1.0");
    std::vector<std::string> names;
    for (const Json& c : j["components"]) names.push_back(c["name"]);
    EXPECT_EQ(names, (std::vector<std::string>{"model", "optimizer", "records", "counters"}));
    const Json& model = j["components"][0];
    EXPECT_EQ(model["tensors"][0],
              (Json{{"name", "fc.weight"}, {"dtype", "F32"}, {"shape", {2, 3}}, {"bytes", 24}}));
    EXPECT_EQ(model["tensors"].size(), 11u);
    EXPECT_EQ(model["state"], (Json{{"config", {{"hidden", 3}}}}));
    EXPECT_EQ(j["components"][3]["state"]["step"], 200);
    ASSERT_EQ(j["records"].size(), 3u);
    EXPECT_EQ(j["records"][0]["set"], "train");
    EXPECT_EQ(j["records"][0]["metric"], "loss");
    EXPECT_EQ(j["records"][0]["count"], 3);
    EXPECT_EQ(j["records"][0]["last"], 0.25);
    EXPECT_EQ(j["records"][0]["values"], (Json{1.0, 0.5, 0.25}));
    if (directory) {
      EXPECT_EQ(j["iteration"], 2);
      EXPECT_EQ(j["metadata"]["metrics"]["val_loss"], 0.5);
      EXPECT_EQ(model["file"], "model.safetensors");
      EXPECT_EQ(model["size_bytes"], testing::file_size(p.ckpt(2) + "/model.safetensors"));
    }
  }
}

TEST(CliShow, RefusesCorruptUncommittedAndForeignPathsNamingThem) {
  Project p;
  Result corrupt_run = tp({"show", p.ckpt(10)});
  EXPECT_EQ(corrupt_run.status, 2);
  EXPECT_NE(corrupt_run.err.find(p.ckpt(10) + "/model.safetensors"), std::string::npos)
      << corrupt_run.err;
  Result uncommitted = tp({"show", p.ckpt(12)});
  EXPECT_EQ(uncommitted.status, 2);
  EXPECT_NE(uncommitted.err.find(p.ckpt(12) + " has no manifest.json"), std::string::npos)
      << uncommitted.err;
  Result half = tp({"show", p.temp});
  EXPECT_EQ(half.status, 2);
  EXPECT_NE(half.err.find(p.temp), std::string::npos) << half.err;
  Result project = tp({"show", p.dir});
  EXPECT_EQ(project.status, 2);
  EXPECT_NE(project.err.find("torchpoint ls " + p.dir), std::string::npos) << project.err;
  Result foreign = tp({"show", p.dir + "/notes.txt"});
  EXPECT_EQ(foreign.status, 2);
  EXPECT_NE(foreign.err.find(p.dir + "/notes.txt"), std::string::npos) << foreign.err;
  Result missing = tp({"show", p.tmp / "nowhere"});
  EXPECT_EQ(missing.status, 2);
  EXPECT_NE(missing.err.find(p.tmp / "nowhere does not exist"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// verify

TEST(CliVerify, ValidInvalidAndMissing) {
  Project p;
  Result ok = tp({"verify", p.ckpt(1)});
  EXPECT_EQ(ok.status, 0) << ok.out << ok.err;
  EXPECT_EQ(ok.out, "valid    " + p.ckpt(1) + "\n");

  // Every problem, not only the first: two damaged files.
  corrupt(p.ckpt(9) + "/optimizer.safetensors");
  corrupt(p.ckpt(9) + "/model.safetensors");
  Result bad = tp({"verify", p.ckpt(9)});
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.out.find("INVALID  " + p.ckpt(9) + " (2 problems)"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("  - " + p.ckpt(9) + "/model.safetensors"), std::string::npos);
  EXPECT_NE(bad.out.find("  - " + p.ckpt(9) + "/optimizer.safetensors"), std::string::npos);

  Result several = tp({"verify", p.ckpt(1), p.ckpt(10), p.ckpt(12), p.temp});
  EXPECT_EQ(several.status, 1);
  EXPECT_NE(several.out.find("4 checked: 1 valid, 3 invalid"), std::string::npos) << several.out;
  EXPECT_NE(several.out.find("has no manifest.json"), std::string::npos);

  Result missing = tp({"verify", p.ckpt(1), p.tmp / "nowhere"});
  EXPECT_EQ(missing.status, 2);
  EXPECT_NE(missing.err.find(p.tmp / "nowhere does not exist"), std::string::npos);
  EXPECT_NE(missing.out.find("valid    " + p.ckpt(1)), std::string::npos);  // still checked

  save_file_checkpoint(p.tmp / "state.ckpt", 1, 0);
  EXPECT_EQ(tp({"verify", p.tmp / "state.ckpt"}).status, 0);
  corrupt(p.tmp / "state.ckpt");
  EXPECT_EQ(tp({"verify", p.tmp / "state.ckpt"}).status, 1);
}

TEST(CliVerify, Json) {
  Project p;
  Result run = tp({"verify", "--json", p.ckpt(1), p.ckpt(10)});
  EXPECT_EQ(run.status, 1);
  Json j = parse_json(run);
  EXPECT_EQ(j["ok"], false);
  ASSERT_EQ(j["results"].size(), 2u);
  EXPECT_EQ(j["results"][0],
            (Json{{"path", p.ckpt(1)}, {"ok", true}, {"problems", Json::array()}}));
  EXPECT_EQ(j["results"][1]["ok"], false);
  ASSERT_EQ(j["results"][1]["problems"].size(), 1u);
  EXPECT_NE(j["results"][1]["problems"][0].get<std::string>().find("model.safetensors"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// diff

TEST(CliDiff, IdenticalAcrossDirectoryAndFileCheckpoints) {
  Project p;
  save_file_checkpoint(p.tmp / "state.ckpt", 200, 1);
  Result same = tp({"diff", p.ckpt(2), p.tmp / "state.ckpt"});
  EXPECT_EQ(same.status, 0) << same.out << same.err;
  EXPECT_EQ(lines_of(same.out).back(), "identical");
  EXPECT_EQ(words(line_with(same.out, "model/fc.weight")).front(), "equal");
  EXPECT_NE(same.out.find("16 tensors: 16 equal"), std::string::npos) << same.out;
}

TEST(CliDiff, ReportsMaxAbsDifferenceAndOneSidedTensors) {
  Project p;
  Result run = tp({"diff", p.ckpt(1), p.ckpt(2)});  // shift 0 vs 1, step 100 vs 200
  EXPECT_EQ(run.status, 1);
  EXPECT_EQ(words(line_with(run.out, "model/fc.weight")),
            (std::vector<std::string>{"DIFFERENT", "model/fc.weight", "max", "abs", "diff", "1"}));
  EXPECT_EQ(words(line_with(run.out, "model/ids")).front(), "equal");
  EXPECT_EQ(words(line_with(run.out, "model/special")).front(), "equal");  // NaN == NaN bitwise
  EXPECT_NE(run.out.find("counters/step  100 vs 200"), std::string::npos) << run.out;
  EXPECT_EQ(lines_of(run.out).back(), "not identical");

  TempDir tmp;
  StateDict a = model_state(0), b = model_state(0);
  b.erase("fc.bias");
  b.set("extra", torch::ones({3}));
  b.set("ids", torch::tensor({1, 2}, torch::kInt));
  b.set("mask", torch::tensor({true, false}));
  b.set("special", torch::tensor({kNaN, 0.0, kInf, -kInf, 1e-300}, torch::kDouble));
  save_directory(tmp / "a", {{"model", a.to_container()}});
  save_directory(tmp / "b", {{"model", b.to_container()}});
  Result d = tp({"diff", tmp / "a", tmp / "b"});
  EXPECT_EQ(d.status, 1);
  EXPECT_EQ(words(line_with(d.out, "model/fc.bias")),
            (std::vector<std::string>{"ONLY", "IN", "A", "model/fc.bias", "F32", "[2]"}));
  EXPECT_EQ(words(line_with(d.out, "model/extra")),
            (std::vector<std::string>{"ONLY", "IN", "B", "model/extra", "F32", "[3]"}));
  EXPECT_EQ(words(line_with(d.out, "model/ids")),
            (std::vector<std::string>{"DTYPE", "model/ids", "I64", "vs", "I32"}));
  EXPECT_EQ(words(line_with(d.out, "model/mask")),
            (std::vector<std::string>{"SHAPE", "model/mask", "[3]", "vs", "[2]"}));
  // -0.0 vs 0.0: different bits, no numeric difference.
  EXPECT_NE(line_with(d.out, "model/special").find("max abs diff 0 (same values, different bits"),
            std::string::npos)
      << d.out;

  Result j = tp({"diff", "--json", tmp / "a", tmp / "b"});
  EXPECT_EQ(j.status, 1);
  Json parsed = parse_json(j);
  EXPECT_EQ(parsed["identical"], false);
  std::map<std::string, std::string> status;
  for (const Json& t : parsed["tensors"]) status[t["key"]] = t["status"];
  EXPECT_EQ(status["model/fc.bias"], "only_in_a");
  EXPECT_EQ(status["model/extra"], "only_in_b");
  EXPECT_EQ(status["model/ids"], "dtype");
  EXPECT_EQ(status["model/mask"], "shape");
  EXPECT_EQ(status["model/special"], "different");
  EXPECT_EQ(status["model/fc.weight"], "equal");
}

TEST(CliDiff, CorruptOrMissingSideIsAnError) {
  Project p;
  Result run = tp({"diff", p.ckpt(1), p.ckpt(10)});
  EXPECT_EQ(run.status, 2);
  EXPECT_NE(run.err.find(p.ckpt(10)), std::string::npos) << run.err;
  EXPECT_EQ(tp({"diff", p.ckpt(1), p.tmp / "nowhere"}).status, 2);
}

// ---------------------------------------------------------------------------------------------
// digest

std::string digest_of(const Result& run) {
  std::vector<std::string> w = words(run.out);
  return w.empty() ? std::string() : w.front();
}

TEST(CliDigest, SameStateSameDigestInEitherLayout) {
  Project p;
  save_file_checkpoint(p.tmp / "state.ckpt", 200, 1);
  Result dir = tp({"digest", p.ckpt(2)});
  Result file = tp({"digest", p.tmp / "state.ckpt"});
  ASSERT_EQ(dir.status, 0) << dir.err;
  ASSERT_EQ(file.status, 0) << file.err;
  EXPECT_EQ(dir.out, digest_of(dir) + "  " + p.ckpt(2) + "\n");
  EXPECT_EQ(digest_of(dir).size(), 64u);
  EXPECT_EQ(digest_of(dir), digest_of(file));
  EXPECT_NE(digest_of(dir), digest_of(tp({"digest", p.ckpt(1)})));

  Result model_dir = tp({"digest", p.ckpt(2), "--component", "model"});
  Result model_file = tp({"digest", p.tmp / "state.ckpt", "--component", "model"});
  EXPECT_EQ(digest_of(model_dir), digest_of(model_file));
  EXPECT_NE(digest_of(model_dir), digest_of(dir));
  // The optimizer of checkpoint_1 and _2 differ, their records do not.
  EXPECT_EQ(digest_of(tp({"digest", p.ckpt(1), "--component", "records"})),
            digest_of(tp({"digest", p.ckpt(2), "--component", "records"})));
}

void put_u64(detail::Sha256& h, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    unsigned char b = static_cast<unsigned char>(v >> (8 * i));
    h.update(&b, 1);
  }
}

TEST(CliDigest, FollowsTheDocumentedEncoding) {
  TempDir tmp;
  StateDict model;
  model.set("w", torch::tensor({1.0f, 2.0f}));
  model.set("b", torch::tensor({std::int64_t{3}}).reshape({1, 1}));
  save_directory(tmp / "c", {{"model", model.to_container()}});
  detail::Sha256 h;
  h.update("torchpoint-digest-v1\n");
  // Sorted by key: model/b before model/w.
  put_u64(h, 7);
  h.update("model/b");
  put_u64(h, 3);
  h.update("I64");
  put_u64(h, 2);
  put_u64(h, 1);
  put_u64(h, 1);
  put_u64(h, 8);
  h.update(std::string("\x03\0\0\0\0\0\0\0", 8));
  put_u64(h, 7);
  h.update("model/w");
  put_u64(h, 3);
  h.update("F32");
  put_u64(h, 1);
  put_u64(h, 2);
  put_u64(h, 8);
  h.update(std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8));
  EXPECT_EQ(digest_of(tp({"digest", tmp / "c"})), h.hex_digest());
}

TEST(CliDigest, Errors) {
  Project p;
  Result corrupt_run = tp({"digest", p.ckpt(10)});
  EXPECT_EQ(corrupt_run.status, 2);
  EXPECT_NE(corrupt_run.err.find(p.ckpt(10)), std::string::npos);
  EXPECT_EQ(corrupt_run.out, "");
  Result component = tp({"digest", p.ckpt(1), "--component", "nope"});
  EXPECT_EQ(component.status, 2);
  EXPECT_NE(component.err.find("no component 'nope'; its components are: model, optimizer, "
                               "records, counters"),
            std::string::npos)
      << component.err;
  EXPECT_EQ(tp({"digest", p.temp}).status, 2);
}

// ---------------------------------------------------------------------------------------------
// export: Python's torch.load reads the file as a dict of tensors with the same values

std::string torch_dtype_name(c10::ScalarType t) {
  switch (t) {
    case torch::kFloat:
      return "torch.float32";
    case torch::kDouble:
      return "torch.float64";
    case torch::kHalf:
      return "torch.float16";
    case torch::kBFloat16:
      return "torch.bfloat16";
    case torch::kLong:
      return "torch.int64";
    case torch::kInt:
      return "torch.int32";
    case torch::kShort:
      return "torch.int16";
    case torch::kChar:
      return "torch.int8";
    case torch::kByte:
      return "torch.uint8";
    case torch::kBool:
      return "torch.bool";
    default:
      return "?";
  }
}

// {"<name>": {"dtype": "torch.float32", "shape": [...], "values": [...], "hex": "<bytes>"}},
// in the component's order. Floats are exact (every element converts exactly to double);
// NaN and infinities as strings.
Json expected_export(const StateDict& component) {
  Json out = Json::array();
  for (const auto& [name, value] : component.entries()) {
    if (!std::holds_alternative<at::Tensor>(value)) continue;
    at::Tensor t = std::get<at::Tensor>(value).contiguous();
    Json values = Json::array();
    at::Tensor flat = t.reshape({-1});
    for (std::int64_t i = 0; i < flat.numel(); ++i) {
      if (t.is_floating_point()) {
        double v = flat[i].item<double>();
        values.push_back(std::isnan(v)   ? Json("nan")
                         : std::isinf(v) ? Json(v > 0 ? "inf" : "-inf")
                                         : Json(v));
      } else if (t.scalar_type() == torch::kBool) {
        values.push_back(flat[i].item<bool>());
      } else {
        values.push_back(flat[i].item<std::int64_t>());
      }
    }
    std::string hex;
    const auto* p = static_cast<const unsigned char*>(t.data_ptr());
    for (std::int64_t i = 0; i < t.numel() * static_cast<std::int64_t>(t.element_size()); ++i) {
      hex += fmt::format("{:02x}", p[i]);
    }
    out.push_back({{"name", name},
                   {"dtype", torch_dtype_name(t.scalar_type())},
                   {"shape", t.sizes().vec()},
                   {"values", values},
                   {"hex", hex}});
  }
  return out;
}

std::string source_dir() {
  const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
  return src ? src : "";
}

void expect_python_loads(const std::string& pt, const StateDict& component,
                         const std::string& json_path) {
  std::ofstream(json_path) << expected_export(component).dump();
  ASSERT_FALSE(source_dir().empty()) << "TORCHPOINT_SOURCE_DIR is set by CTest";
  TempDir scratch;
  Result py = run_command(fmt::format("{} {} {} {}", testing::python(),
                                      quote(source_dir() + "/tests/python/export_check.py"),
                                      quote(pt), quote(json_path)),
                          scratch / "stderr");
  EXPECT_EQ(py.status, 0) << "export_check.py failed (it runs with the project venv's torch):\n"
                          << py.out << py.err;
  EXPECT_NE(py.out.find("ok:"), std::string::npos) << py.out;
}

TEST(CliExport, TorchLoadReadsEveryValue) {
  Project p;
  std::string pt = p.tmp / "model.pt";
  Result run = tp({"export", p.ckpt(2), pt});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("wrote 11 tensors of component 'model'"), std::string::npos) << run.out;
  expect_python_loads(pt, model_state(1), p.tmp / "expected.json");

  // From a file checkpoint, another component.
  save_file_checkpoint(p.tmp / "state.ckpt", 200, 1);
  std::string opt = p.tmp / "optimizer.pt";
  Result from_file = tp({"export", p.tmp / "state.ckpt", opt, "--component", "optimizer"});
  ASSERT_EQ(from_file.status, 0) << from_file.err;
  expect_python_loads(opt, optimizer_state(1), p.tmp / "expected_opt.json");
}

// A sharded component is one component to every command: the same digest, no difference
// from the same state in one file, verified, shown, exported whole; ls tells the shared bytes.
TEST(CliSharded, EveryCommandTreatsAShardedComponentAsOne) {
  TempDir tmp;
  StateDict model;
  model.set("frozen.weight", testing::make_tensor(at::kFloat, {512, 1024}, 1));  // 2 MiB
  model.set("head.weight", testing::make_tensor(at::kFloat, {64, 1024}, 2));
  model.set("head.bias", testing::make_tensor(at::kFloat, {64}, 3));
  model.set("frozen.count", testing::make_tensor(at::kLong, {300000}, 4));  // 2.3 MiB
  std::vector<Component> components = {{"model", model.to_container()},
                                       {"optimizer", {{{"step", torch::ones({1})}}, {}}}};
  SaveDirectoryOptions sharded;
  sharded.shard_size = std::uint64_t{2} << 20;
  sharded.frozen = {"model/frozen.weight", "model/frozen.count"};
  const std::string first = tmp / "runs/checkpoint_0", second = tmp / "runs/checkpoint_1";
  save_directory(first, components, {}, Env::posix(), sharded);
  // A training step changes the head in place; the frozen tensors keep their bytes.
  static_cast<std::uint8_t*>(model.tensor("head.weight").data_ptr())[100] ^= 0x10;
  save_directory(tmp / "whole", components);
  sharded.link_from = first;
  save_directory(second, components, {}, Env::posix(), sharded);

  EXPECT_EQ(digest_of(tp({"digest", second})), digest_of(tp({"digest", tmp / "whole"})));
  EXPECT_EQ(digest_of(tp({"digest", second, "--component", "model"})),
            digest_of(tp({"digest", tmp / "whole", "--component", "model"})));
  Result diff = tp({"diff", tmp / "whole", second});
  EXPECT_EQ(diff.status, 0) << diff.out << diff.err;
  Result verified = tp({"verify", first, second});
  EXPECT_EQ(verified.status, 0) << verified.out << verified.err;
  Result shown = tp({"show", second});
  ASSERT_EQ(shown.status, 0) << shown.err;
  EXPECT_NE(shown.out.find("3 shards model-*-of-00003.safetensors and "
                           "model.safetensors.index.json"),
            std::string::npos)
      << shown.out;
  EXPECT_NE(shown.out.find("frozen.count"), std::string::npos) << shown.out;
  std::string pt = tmp / "model.pt";
  Result exported = tp({"export", second, pt});
  ASSERT_EQ(exported.status, 0) << exported.err;
  EXPECT_NE(exported.out.find("wrote 4 tensors of component 'model'"), std::string::npos)
      << exported.out;
  expect_python_loads(pt, model, tmp / "expected.json");

  // Both checkpoints share the two frozen shards, and say so.
  std::uint64_t shared = testing::file_size(second + "/model-00001-of-00003.safetensors") +
                         testing::file_size(second + "/model-00002-of-00003.safetensors");
  Result ls = tp({"ls", tmp / "runs", "--json"});
  ASSERT_EQ(ls.status, 0) << ls.err;
  Json listing = Json::parse(ls.out);
  ASSERT_EQ(listing["checkpoints"].size(), 2u);
  for (const Json& c : listing["checkpoints"]) {
    EXPECT_EQ(c["shared_bytes"], shared) << c.dump();
    EXPECT_EQ(c["status"], "valid");
  }
  Result table = tp({"ls", tmp / "runs"});
  EXPECT_NE(table.out.find("SHARED"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find(std::to_string(shared)), std::string::npos) << table.out;
}

// Peak resident memory, in bytes, of one run of the CLI with `args` (its exit status must be 0),
// measured by tests/python/peak_rss.py.
std::int64_t peak_rss_of(const std::vector<std::string>& args) {
  std::string command = testing::python() + " " +  // already a quoted shell word
                        quote(source_dir() + "/tests/python/peak_rss.py") + " " +
                        quote(TORCHPOINT_CLI);
  for (const std::string& a : args) command += " " + quote(a);
  static TempDir scratch;
  Result run = run_command(command, scratch / "stderr");
  EXPECT_EQ(run.status, 0) << args[0] << ": " << run.err;
  return std::atoll(run.out.c_str());
}

// export streams the .pt file from the loaded tensors: beyond what the same process needs to
// verify the checkpoint (LibTorch itself, bounded buffers), it holds one copy of the tensors,
// never a second copy as the whole file in memory.
TEST(CliExport, MemoryStaysNearTheCheckpointSize) {
  TempDir tmp;
  const std::string checkpoint = tmp / "checkpoint_0";
  Container model;
  for (int i = 0; i < 3; ++i) {
    model.tensors.emplace_back(fmt::format("layer{}.weight", i), torch::randn({16 << 20}));
  }
  save_directory(checkpoint, {{"model", model}});  // 192 MiB: two shards of the default size
  std::int64_t file_bytes = 0;
  for (const std::string& name : testing::list_sorted(checkpoint)) {
    file_bytes += static_cast<std::int64_t>(testing::file_size(checkpoint + "/" + name));
  }
  const std::int64_t verify_peak = peak_rss_of({"verify", checkpoint});
  const std::int64_t export_peak =
      peak_rss_of({"export", checkpoint, tmp / "model.pt", "--component", "model"});
  EXPECT_GT(testing::file_size(tmp / "model.pt"), 3u * (64u << 20)) << "every tensor exported";
  const std::int64_t extra = export_peak - verify_peak;
  RecordProperty("verify_peak_bytes", std::to_string(verify_peak));
  RecordProperty("export_peak_bytes", std::to_string(export_peak));
  EXPECT_LE(extra, file_bytes * 5 / 4)
      << "export took " << extra << " bytes more than verify, for a checkpoint of " << file_bytes;
}

TEST(CliExport, Errors) {
  Project p;
  Result component = tp({"export", p.ckpt(1), p.tmp / "x.pt", "--component", "nope"});
  EXPECT_EQ(component.status, 2);
  EXPECT_NE(component.err.find("no component 'nope'"), std::string::npos) << component.err;
  Result corrupt_run = tp({"export", p.ckpt(10), p.tmp / "x.pt"});
  EXPECT_EQ(corrupt_run.status, 2);
  EXPECT_NE(corrupt_run.err.find(p.ckpt(10)), std::string::npos);
  EXPECT_FALSE(exists(p.tmp / "x.pt"));
  Result no_dir = tp({"export", p.ckpt(1), p.tmp / "no/such/dir/x.pt"});
  EXPECT_EQ(no_dir.status, 2);
  EXPECT_NE(no_dir.err.find(p.tmp / "no/such/dir"), std::string::npos) << no_dir.err;
}

// The top-level component of a file checkpoint (keys without a dot) is named "": the help and
// the list of components in an error both say how to select it, and selecting it works.
TEST(CliExport, TheTopLevelComponentIsSelectedWithAnEmptyName) {
  TempDir tmp;
  StateDict state;
  state.set("scale", torch::full({3}, 2.0));
  state.set_child("model", model_state(0));
  save_file(tmp / "state.ckpt", state.to_container());
  Result help = tp({"export", "--help"});
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.out.find(R"(--component "")"), std::string::npos) << help.out;
  Result wrong = tp({"export", tmp / "state.ckpt", tmp / "x.pt", "--component", "nope"});
  EXPECT_EQ(wrong.status, 2);
  EXPECT_NE(wrong.err.find(R"(top level: --component "")"), std::string::npos) << wrong.err;
  Result top = tp({"export", tmp / "state.ckpt", tmp / "top.pt", "--component", ""});
  EXPECT_EQ(top.status, 0) << top.err;
  EXPECT_NE(top.out.find("wrote 1 tensors"), std::string::npos) << top.out;
}

// ---------------------------------------------------------------------------------------------
// plot

// tests/python/plot_check.py on a picture the tool wrote: for a PNG, its size, title and tick
// labels drawn and `colors` colours of sets; for an SVG, the lines listing its metadata.
testing::CommandOutput plot_check(const std::vector<std::string>& args) {
  testing::CommandOutput check = testing::run_python_script("plot_check.py", args);
  EXPECT_EQ(check.status, 0) << check.output;
  return check;
}

// The last bytes of a whole PDF file, trailing white space aside, are "%%EOF".
bool ends_with_eof(std::string pdf) {
  pdf.erase(pdf.find_last_not_of(" \r\n") + 1);
  return pdf.ends_with("%%EOF");
}

TEST(CliPlot, DrawsAPanelPerMetricInTheFormatTheExtensionNames) {
  Project p;
  std::string svg_path = p.tmp / "curves.svg";
  Result run = tp({"plot", p.ckpt(2), svg_path});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(run.out, "wrote 3 series to " + svg_path + "\n");
  std::string svg = slurp(svg_path);
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  // Two panels (loss, acc) side by side, two sets: 800 x (64 + 300) px.
  EXPECT_EQ(plot_check({svg_path}).output,
            "svg 800x364 panels=2 columns=2 title='checkpoint_2'\n"
            "series set='train' metric='loss' values=3 points=3 runs=1\n"
            "series set='valid' metric='loss' values=3 points=3 runs=1\n"
            "series set='train' metric='acc' values=3 points=3 runs=1\n");

  std::string png_path = p.tmp / "curves.png";
  ASSERT_EQ(tp({"plot", p.ckpt(2), png_path}).status, 0);
  EXPECT_EQ(slurp(png_path).rfind("\x89PNG\r\n\x1a\n", 0), 0u);
  EXPECT_EQ(plot_check({png_path, "800", "364", "--colors", "2"}).output.rfind("ok: 800x364", 0),
            0u);
  std::string pdf_path = p.tmp / "curves.pdf";
  ASSERT_EQ(tp({"plot", p.ckpt(2), pdf_path}).status, 0);
  std::string pdf = slurp(pdf_path);
  EXPECT_EQ(pdf.rfind("%PDF-", 0), 0u);
  EXPECT_TRUE(ends_with_eof(pdf));

  // A NaN breaks the curve: 4 values, 3 points in 2 runs. A file checkpoint's records are found
  // too, and names are XML-escaped in the SVG.
  StateDict all;
  MetricRecords r;
  for (double v : {1.0, kNaN, 0.5, 0.4}) r.record("train", "loss<&>", v);
  all.set_child("records", r.state_dict());
  save_file(p.tmp / "nan.ckpt", all.to_container());
  ASSERT_EQ(tp({"plot", p.tmp / "nan.ckpt", svg_path}).status, 0);
  svg = slurp(svg_path);
  EXPECT_NE(svg.find("data-set=\"train\" data-metric=\"loss&lt;&amp;&gt;\" values=\"4\" "
                     "points=\"3\" runs=\"2\""),
            std::string::npos)
      << svg.substr(0, 1000);
  EXPECT_EQ(plot_check({svg_path}).output,
            "svg 800x364 panels=1 columns=1 title='nan.ckpt'\n"
            "series set='train' metric='loss<&>' values=4 points=3 runs=2\n");
  ASSERT_EQ(tp({"plot", p.tmp / "nan.ckpt", png_path}).status, 0);
  plot_check({png_path, "800", "364", "--colors", "1"});
}

TEST(CliPlot, Errors) {
  Project p;
  TempDir tmp;
  save_directory(tmp / "c", {{"model", model_state(0).to_container()}});
  Result none = tp({"plot", tmp / "c", tmp / "x.svg"});
  EXPECT_EQ(none.status, 2);
  EXPECT_NE(none.err.find(tmp / "c holds no metric records"), std::string::npos) << none.err;
  EXPECT_FALSE(exists(tmp / "x.svg"));
  Result corrupt_run = tp({"plot", p.ckpt(10), tmp / "x.svg"});
  EXPECT_EQ(corrupt_run.status, 2);
  EXPECT_NE(corrupt_run.err.find(p.ckpt(10)), std::string::npos);
  Result jpg = tp({"plot", p.ckpt(2), tmp / "x.jpg"});
  EXPECT_EQ(jpg.status, 2);
  EXPECT_NE(jpg.err.find(tmp / "x.jpg"), std::string::npos) << jpg.err;
  EXPECT_NE(jpg.err.find(".png, .svg or .pdf"), std::string::npos) << jpg.err;
  EXPECT_FALSE(exists(tmp / "x.jpg"));
}

// ---------------------------------------------------------------------------------------------
// prune

// checkpoint_1, _2, _3, _9, _10 valid (val_loss .9 .3 .5 .6 .7), checkpoint_11 corrupt,
// checkpoint_12.tmp-… half-written.
struct PruneProject {
  TempDir tmp;
  std::string dir = tmp / "checkpoints";
  std::string ckpt(int n) const { return dir + "/checkpoint_" + std::to_string(n); }
  std::string temp = dir + "/checkpoint_12.tmp-123-abcdef0123456789";
  PruneProject() {
    std::vector<std::pair<int, double>> runs = {{1, .9}, {2, .3},  {3, .5},
                                                {9, .6}, {10, .7}, {11, .1}};
    for (auto [n, loss] : runs) save_checkpoint(ckpt(n), n * 100, 0, loss);
    corrupt(ckpt(11) + "/model.safetensors");
    make_dir(temp);
  }
  std::vector<std::string> left() const { return testing::list_sorted(dir); }
};

std::string action(const std::string& out, const std::string& name) {
  std::vector<std::string> w = words(line_with(out, name));
  return w.empty() ? std::string() : w.front();
}

TEST(CliPrune, DryRunDeletesNothing) {
  PruneProject p;
  std::vector<std::string> before = p.left();
  Result run = tp({"prune", p.tmp.path(), "--keep-last", "2", "--keep-best", "val_loss", "--mode",
                   "min", "--dry-run"});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(lines_of(run.out).front(), "dry run: nothing is deleted");
  EXPECT_EQ(action(run.out, "checkpoint_1"), "DELETE");
  EXPECT_EQ(action(run.out, "checkpoint_2"), "KEEP");  // best val_loss (0.1 is corrupt)
  EXPECT_EQ(action(run.out, "checkpoint_3"), "DELETE");
  EXPECT_EQ(action(run.out, "checkpoint_9"), "KEEP");   // last 2
  EXPECT_EQ(action(run.out, "checkpoint_10"), "KEEP");  // newest valid, last 2
  EXPECT_EQ(action(run.out, "checkpoint_11"), "KEEP");  // corrupt: never deleted
  EXPECT_EQ(action(run.out, "checkpoint_12.tmp-123-abcdef0123456789"), "KEEP");
  EXPECT_NE(line_with(run.out, "checkpoint_2").find("best min val_loss=0.3"), std::string::npos);
  EXPECT_NE(line_with(run.out, "checkpoint_10").find("newest valid; last 2"), std::string::npos);
  // Rows in numeric order.
  std::vector<std::string> lines = lines_of(run.out);
  EXPECT_LT(line_index(lines, "checkpoint_9"), line_index(lines, "checkpoint_10"));
  EXPECT_NE(run.out.find("5 kept, 2 would be deleted"), std::string::npos) << run.out;
  EXPECT_EQ(p.left(), before);
}

TEST(CliPrune, DeletesWhatItSays) {
  PruneProject p;
  Result run = tp({"prune", p.dir, "--keep-last", "2", "--keep-best", "val_loss"});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_NE(run.out.find("5 kept, 2 deleted"), std::string::npos) << run.out;
  EXPECT_EQ(p.left(), (std::vector<std::string>{".lock", "checkpoint_10", "checkpoint_11",
                                                "checkpoint_12.tmp-123-abcdef0123456789",
                                                "checkpoint_2", "checkpoint_9"}));
  EXPECT_EQ(tp({"verify", p.ckpt(2), p.ckpt(9), p.ckpt(10)}).status, 0);
}

TEST(CliPrune, NeverDeletesTheNewestValidAndMaxModeKeepsTheHighest) {
  PruneProject p;
  Result run = tp({"prune", p.dir, "--keep-last", "0", "--keep-best", "val_loss", "--mode", "max"});
  ASSERT_EQ(run.status, 0) << run.err;
  EXPECT_EQ(p.left(),
            (std::vector<std::string>{".lock", "checkpoint_1", "checkpoint_10", "checkpoint_11",
                                      "checkpoint_12.tmp-123-abcdef0123456789"}));
  Result again = tp({"prune", p.dir, "--keep-last", "0"});
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_EQ(action(again.out, "checkpoint_10"), "KEEP");
  EXPECT_EQ(p.left(), (std::vector<std::string>{".lock", "checkpoint_10", "checkpoint_11",
                                                "checkpoint_12.tmp-123-abcdef0123456789"}));
}

// Accelerator checkpoints with metrics logged by log(), as Accelerate users log: ls shows
// them, and prune --keep-best ranks by them.
TEST(CliAccelerator, LoggedMetricsAreListedAndRankPrune) {
  TempDir tmp;
  {
    Accelerator acc(
        ProjectConfiguration().project_dir(tmp.path()).automatic_checkpoint_naming(true));
    torch::nn::Linear model(2, 1);
    acc.prepare(model);
    for (double val_loss : {0.9, 0.2, 0.5, 0.7}) {
      acc.log({{"val_loss", val_loss}, {"accuracy", 1 - val_loss}});
      acc.save_state();
    }
  }
  Result ls = tp({"ls", tmp.path(), "--json"});
  ASSERT_EQ(ls.status, 0) << ls.err;
  Json listed = parse_json(ls);
  ASSERT_EQ(listed["checkpoints"].size(), 4u);
  EXPECT_EQ(listed["checkpoints"][1]["metrics"]["val_loss"], 0.2);
  EXPECT_EQ(listed["checkpoints"][3]["metrics"]["accuracy"], 1 - 0.7);
  Result prune = tp({"prune", tmp.path(), "--keep-last", "1", "--keep-best", "val_loss"});
  ASSERT_EQ(prune.status, 0) << prune.err;
  EXPECT_EQ(testing::list_sorted(tmp / "checkpoints"),
            (std::vector<std::string>{".lock", "checkpoint_1", "checkpoint_3"}));
}

// The checkpoints a Learner's model_checkpoint writes: ls shows their epoch, step and metric,
// show and plot read their records, prune keeps the best by that metric.
TEST(CliLearner, LsShowPlotAndPruneLearnerCheckpoints) {
  TempDir tmp;
  auto data = testing::seed_data(256);
  auto learner = testing::linear_learner();
  FitResult result = learner->fit(
      {data.x, data.y}, FitOptions().epochs(4).verbose(false).callbacks(
                            {callbacks::model_checkpoint(tmp / "ck/").monitor("train_loss")}));
  const auto& losses = result.records.values("train", "loss");
  std::vector<std::string> files = testing::list_sorted(tmp / "ck");
  ASSERT_EQ(files.size(), 4u);

  Result ls = tp({"ls", tmp / "ck", "--json"});
  ASSERT_EQ(ls.status, 0) << ls.err;
  Json j = parse_json(ls);
  ASSERT_EQ(j["checkpoints"].size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) {
    const Json& c = j["checkpoints"][i];
    EXPECT_EQ(c["number"], i + 1);
    EXPECT_EQ(c["step"], static_cast<std::int64_t>((i + 1) * 8));  // 256 / 32 steps per epoch
    EXPECT_EQ(c["metrics"]["train_loss"].get<double>(), losses[i]);
  }
  EXPECT_EQ(j["latest"], files.back());
  Result text = tp({"ls", tmp / "ck"});
  EXPECT_NE(line_with(text.out, files[0]).find("train_loss="), std::string::npos) << text.out;

  Result show = tp({"show", tmp / "ck/" + files[2]});
  ASSERT_EQ(show.status, 0) << show.err;
  EXPECT_NE(show.out.find("records"), std::string::npos) << show.out;
  EXPECT_NE(squeeze(show.out).find("records train loss 3"), std::string::npos) << show.out;
  Result plot = tp({"plot", tmp / "ck/" + files[2], tmp / "p.svg"});
  ASSERT_EQ(plot.status, 0) << plot.err;
  EXPECT_NE(slurp(tmp / "p.svg").find("data-set=\"train\" data-metric=\"loss\" values=\"3\""),
            std::string::npos);
  Result png = tp({"plot", tmp / "ck/" + files[2], tmp / "p.png"});
  ASSERT_EQ(png.status, 0) << png.err;
  EXPECT_EQ(slurp(tmp / "p.png").rfind("\x89PNG\r\n\x1a\n", 0), 0u);

  std::size_t best = std::min_element(losses.begin(), losses.end()) - losses.begin();
  Result prune = tp({"prune", tmp / "ck", "--keep-last", "1", "--keep-best", "train_loss"});
  ASSERT_EQ(prune.status, 0) << prune.err;
  std::vector<std::string> kept = {files[best], files.back()};
  std::sort(kept.begin(), kept.end());
  kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
  std::vector<std::string> left;
  for (const std::string& name : testing::list_sorted(tmp / "ck")) {
    if (name != ".lock") left.push_back(name);
  }
  EXPECT_EQ(left, kept) << prune.out;
}

TEST(CliPrune, Errors) {
  PruneProject p;
  std::vector<std::string> before = p.left();
  Result metric = tp({"prune", p.dir, "--keep-last", "1", "--keep-best", "accuracy"});
  EXPECT_EQ(metric.status, 2);
  EXPECT_NE(metric.err.find("no valid checkpoint in " + p.dir + " records the metric 'accuracy'"),
            std::string::npos)
      << metric.err;
  EXPECT_EQ(p.left(), before);
  Result missing = tp({"prune", p.tmp / "nowhere", "--keep-last", "1"});
  EXPECT_EQ(missing.status, 2);
  EXPECT_NE(missing.err.find(p.tmp / "nowhere"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Python Accelerate's directories: show, verify, export --to accelerate

TEST(CliAccelerate, ShowsVerifiesAndExportsAccelerateDirectories) {
  TempDir dir;
  auto written = testing::run_python_script("accelerate_checkpoints.py", {"write", dir.path()});
  ASSERT_EQ(written.status, 0) << written.output;

  Result show = tp({"show", dir / "adamw"});
  EXPECT_EQ(show.status, 0) << show.err;
  for (const char* part :
       {"a checkpoint of Python Accelerate's save_state, 4 files",
        "optimizer.bin (optimizer, ", "torch.optim.AdamW, 1 param group, state for 4 parameters",
        "state.0.exp_avg_sq", "float32 [8, 4]", "param_groups.0.betas", "(0.9, 0.999)",
        "custom_checkpoint_0.pkl (custom, ", "an LR scheduler: last_epoch 3",
        "random_state.1", "tuple of 625 ints", "numpy <u4 [624]",
        "Python random (not applicable in C++)", "torch_manual_seed", "uint8 [5056]",
        "model.safetensors (model, ", "0.weight"}) {
    EXPECT_NE(show.out.find(part), std::string::npos) << part << "\n" << show.out;
  }
  Json j = parse_json(tp({"show", "--json", dir / "sgd"}));
  EXPECT_EQ(j["format"], "accelerate");
  ASSERT_EQ(j["files"].size(), 3u);
  EXPECT_EQ(j["files"][1]["name"], "optimizer.bin");
  EXPECT_EQ(j["files"][1]["summary"], "torch.optim.SGD, 2 param groups, state for 4 parameters");

  Result valid = tp({"verify", dir / "adamw"});
  EXPECT_EQ(valid.status, 0) << valid.out << valid.err;
  EXPECT_NE(valid.out.find("valid    " + dir / "adamw" + " (Python Accelerate"), std::string::npos);
  Result bad = tp({"verify", dir / "damaged", dir / "forbidden_global"});
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.out.find("optimizer/data/1' fails its CRC-32 check"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("collections.deque"), std::string::npos) << bad.out;

  // A torchpoint checkpoint, exported, is an Accelerate directory the CLI reads as one.
  Accelerator acc;
  torch::nn::Linear model(3, 2);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.1));
  acc.prepare(model, adam);
  acc.backward(model->forward(torch::ones({1, 3})).sum());
  adam.step();
  const std::string saved = acc.save_state(dir / "torchpoint_checkpoint");
  Result exported = tp({"export", "--to", "accelerate", saved, dir / "to_python"});
  EXPECT_EQ(exported.status, 0) << exported.out << exported.err;
  EXPECT_NE(exported.out.find("wrote " + dir / "to_python" +
                              " (model.safetensors, optimizer.bin, random_states_0.pkl)"),
            std::string::npos)
      << exported.out;
  EXPECT_NE(exported.out.find("MT19937"), std::string::npos) << exported.out;  // the note
  Result shown = tp({"show", dir / "to_python"});
  EXPECT_NE(shown.out.find("torch.optim.Adam, 1 param group, state for 2 parameters"),
            std::string::npos)
      << shown.out;
  EXPECT_EQ(tp({"verify", dir / "to_python"}).status, 0);
  Result again = tp({"export", "--to", "accelerate", saved, dir / "to_python"});
  EXPECT_EQ(again.status, 2);
  EXPECT_NE(again.err.find("exists"), std::string::npos) << again.err;
}

}  // namespace
}  // namespace torchpoint
