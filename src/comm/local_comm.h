// LocalCommunicator: the ranks of a group as threads of one process, sharing a group object.
// Same semantics as GlooCommunicator (rank-order sums, synchronous send), for tests and for
// running a sharded model inside one process.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace tandem::comm {

class LocalGroup;

class LocalCommunicator final : public Communicator {
 public:
  /// world_size communicators sharing one new group (rank r at index r); hand each to its own
  /// thread. A call waits at most `timeout` for the other ranks, then throws kIo.
  static std::vector<std::unique_ptr<LocalCommunicator>> create_group(
      int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(120));

  int rank() const override { return rank_; }
  int world_size() const override;
  void all_reduce_sum(void* data, int64_t count, DType dtype) override;
  void all_gather(const void* in, void* out, int64_t count, DType dtype) override;
  void all_gather_v(const void* in, void* out, std::span<const int64_t> counts,
                    DType dtype) override;
  void all_to_all_v(const void* in, std::span<const int64_t> send_counts, void* out,
                    std::span<const int64_t> recv_counts, DType dtype) override;
  void broadcast(void* data, int64_t count, DType dtype, int root) override;
  void barrier() override;
  void send(const void* data, int64_t bytes, int peer, uint32_t tag) override;
  void recv(void* data, int64_t bytes, int peer, uint32_t tag) override;

  /// Makes every rank's pending and later calls throw kIo: when one rank fails, the others
  /// stop waiting for it instead of running into the timeout.
  void abort_group();

 private:
  LocalCommunicator(std::shared_ptr<LocalGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}

  std::shared_ptr<LocalGroup> group_;
  int rank_;
};

/// Runs body(comm) for every rank of a new local group, each on its own thread, and waits for
/// all. The first failure aborts the group (so no rank hangs) and is rethrown here, with the
/// failing rank in the message.
void run_local_group(int world_size, const std::function<void(Communicator& comm)>& body,
                     std::chrono::milliseconds timeout = std::chrono::seconds(120));

}  // namespace tandem::comm
