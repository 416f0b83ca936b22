// For crash tests: run a child process, and the log it appends one line at a time —
// "step <n> <value>" lines plus lines of other kinds ("resumed", "final <digest>", ...).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace torchpoint::testing {

// Runs `program` with `args`; returns its wait status.
inline int run_child(const char* program, const std::vector<std::string>& args) {
  pid_t pid = ::fork();
  if (pid == 0) {
    std::vector<char*> argv = {const_cast<char*>(program)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(program, argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// One write per line, appended: a SIGKILL can cut the run but never a line in half.
inline void append_line(const std::string& path, const std::string& line) {
  FILE* f = std::fopen(path.c_str(), "a");
  std::fputs((line + "\n").c_str(), f);
  std::fclose(f);
}

// "step <n> <bits of loss in hex>": equal lines mean bit-identical losses.
inline std::string step_line(std::int64_t step, float loss) {
  std::uint32_t bits;
  std::memcpy(&bits, &loss, sizeof bits);
  char line[64];
  std::snprintf(line, sizeof line, "step %" PRId64 " %08x", step, bits);
  return line;
}

struct ChildLog {
  std::multimap<long, std::string> steps;                  // every step line of every run
  std::map<std::string, std::vector<std::string>> others;  // by first word: the rest
  std::size_t count(const std::string& kind) const {
    auto it = others.find(kind);
    return it == others.end() ? 0 : it->second.size();
  }
  // The rest of the last line of `kind`, or "" when there is none.
  std::string last(const std::string& kind) const {
    auto it = others.find(kind);
    return it == others.end() || it->second.empty() ? "" : it->second.back();
  }
};

inline ChildLog read_child_log(const std::string& path) {
  ChildLog out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind, rest;
    words >> kind;
    if (kind == "step") {
      long step;
      std::string value;
      words >> step >> value;
      out.steps.emplace(step, value);
      continue;
    }
    std::getline(words >> std::ws, rest);
    out.others[kind].push_back(rest);
  }
  return out;
}

}  // namespace torchpoint::testing
