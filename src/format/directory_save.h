// A directory checkpoint written by several writers (the ranks of a multi-process run) and
// committed by one: the committer opens it (lock, temporary directory, save hooks), every writer
// writes and fsyncs its own component files into temp_path() and reports what it wrote, and the
// committer writes the manifest listing every file and renames the directory into place.
// save_directory() is the one-writer case.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "format/manifest.h"
#include "io/atomic_commit.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

// One component file as written: what the manifest lists for it.
struct WrittenComponent {
  std::string file_name;
  std::string component;
  std::uint64_t size = 0;
  std::uint64_t header_checksum = 0;  // of the whole file, for a shard index
  // Shard `shard` (from 1) of `shards`; 0 and 0 for a component in one file or an index.
  int shard = 0;
  int shards = 0;
  bool index = false;   // the component's shard index, not a container
  bool linked = false;  // a hard link to an older checkpoint's identical shard: no bytes written

  // For sending to the committer: {"file", "component", "size", "header_checksum", "shard",
  // "shards", "index", "linked"}.
  Json to_json() const;
  // Throws InvalidArgument naming `from` when `json` is not what to_json() makes.
  static WrittenComponent from_json(const Json& json, const std::string& from);
};

class LinkSource;

// Writes `components` into `dir` as new files, each fsynced and closed: <name>.safetensors,
// or, over options.shard_size, a component's shards followed by its index. Nothing sharded:
// one file after another on the calling thread. Otherwise the shards that `link_source` may
// hold unchanged are compared on two threads (and hard-linked when they match) while two
// others write the rest. Returns the files in component order, shards in order, then the
// indexes. Any writer. On failure the files already written stay in `dir` (the caller's
// temporary directory, removed as a whole).
//
// With `part` (index, count > 1), the writers of one checkpoint that all hold the same
// `components` (a replicated model on every rank) share their files: each plans every file the
// same way from the tensors' names, shapes and dtypes alone, then writes only the files dealt
// to `part.index` (the largest first, each to the part with the fewest bytes so far, a tie to
// the highest index, so part 0, which writes the indexes and usually commits, gets the least).
// The union over the parts is what one writer would have written.
struct WriterPart {
  int index = 0;
  int count = 1;
};
std::vector<WrittenComponent> write_components(Env& env, const std::string& dir,
                                               const std::vector<Component>& components,
                                               const SaveDirectoryOptions& options = {},
                                               const LinkSource* link_source = nullptr,
                                               WriterPart part = {});

// The tensors, as "component/tensor", in the files that write_components() with `part` writes
// (for staging only those before a background write).
std::unordered_set<std::string> tensors_of_part(const std::vector<Component>& components,
                                                const SaveDirectoryOptions& options,
                                                WriterPart part);

class DirectorySave {
 public:
  // The committer's side. Checks `component_names` (every component any writer will write),
  // creates the parent, takes its lock (held until commit or destruction), removes what dead
  // writers left there, creates the temporary directory and runs options.before_components in
  // it. Throws what save_directory() throws; nothing is left behind.
  DirectorySave(Env& env, const std::string& path, const std::vector<std::string>& component_names,
                const SaveDirectoryOptions& options);
  ~DirectorySave();
  DirectorySave(const DirectorySave&) = delete;
  DirectorySave& operator=(const DirectorySave&) = delete;

  const std::string& temp_path() const;
  // After the save hooks have run: the components that will be written, a subset of those given
  // at construction (a hook saved some itself). Throws InvalidArgument for a name not given
  // then, or given twice.
  void set_component_names(const std::vector<std::string>& component_names);
  // Lists again what save hooks wrote in temp_path(), for hooks that ran after the constructor
  // (those of the other processes, in the same directory). Call it before any component is
  // written there; throws as the constructor does for a file a hook may not write.
  void collect_hook_files();
  // Every writer has written its files (`files`, in the order the manifest lists them): writes
  // the manifest last and commits. Throws InvalidArgument when `files` differs from the component
  // names given at construction. On failure nothing is committed and the destructor removes the
  // temporary directory.
  void commit(const std::vector<WrittenComponent>& files, const CheckpointInfo& info);

 private:
  Env& env_;
  std::string path_;
  std::vector<std::string> component_names_;
  std::unique_ptr<ProjectLock> lock_;
  std::unique_ptr<PendingDir> pending_;
  std::vector<ManifestExtraFile> extra_files_;  // what the save hooks wrote
};

}  // namespace torchpoint
