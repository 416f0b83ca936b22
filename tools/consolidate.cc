// torchpoint consolidate: a checkpoint whose ZeRO-sharded optimizer state is joined into one
// file per component, which one process without ZeRO loads (and any other tool reads whole).
#include <fmt/format.h>

#include "commands.h"
#include "torchpoint/checkpoint_dir.h"

namespace torchpoint::tool {

int run_consolidate(const ConsolidateOptions& options, std::ostream& out) {
  const std::size_t shards = consolidate_directory(options.path, options.output);
  out << (shards == 0
              ? fmt::format("{}: no sharded optimizer state; wrote a verified copy at {}\n",
                            options.path, options.output)
              : fmt::format("{}: joined {} shards of optimizer state; wrote {}\n", options.path,
                            shards, options.output));
  return kExitOk;
}

}  // namespace torchpoint::tool
