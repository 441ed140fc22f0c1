// Starts a group of ranks on this host by fork(): one process per rank, each with the
// torchrun-style environment set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and
// NVLink multicast kept off (NCCL_NVLS_ENABLE=0). Used by the multi-GPU tests and benchmarks.
// NOTE: the calling process must not have initialised CUDA (fork after cuInit is undefined);
// probe GPUs with run_in_child().
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace tandem::comm {

/// How one forked rank ended.
struct LocalRankResult {
  int rank = 0;
  bool ok = false;         // exited 0
  int exit_code = -1;      // when it exited
  int term_signal = 0;     // when a signal ended it
  bool timed_out = false;  // killed by the launcher
  std::string message;     // what body threw (empty when ok)
};

/// Sets the environment variables that keep NVLink multicast (NVLS) off, overriding any value.
void disable_nvlink_multicast_env();

/// Returns a TCP port that was free a moment ago on the loopback interface.
int pick_free_port();

/// Forks world_size children running body(rank) with the group environment set; waits for
/// all of them. After the first failure the others get `grace` to finish before SIGKILL; all
/// are killed at `timeout`. Never throws for a child's failure: read the results.
std::vector<LocalRankResult> run_local_ranks(int world_size,
                                             const std::function<void(int rank)>& body,
                                             std::chrono::seconds timeout,
                                             std::chrono::seconds grace = std::chrono::seconds(30));

/// Runs fn in a forked child and returns its result, or fallback when the child fails: keeps
/// CUDA out of the calling process (e.g. fn counts GPUs).
int run_in_child(const std::function<int()>& fn, int fallback);

/// One line per failed rank ("rank 1: exit 1: <message>"); empty when all succeeded.
std::string describe_failures(const std::vector<LocalRankResult>& results);

}  // namespace tandem::comm
