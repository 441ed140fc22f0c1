// GlooCommunicator: the CPU communicator of one process per rank, over Gloo's TCP transport.
// The group rendezvous runs through the project's TcpStore (RANK / WORLD_SIZE / MASTER_ADDR /
// MASTER_PORT), so any launcher that sets those variables can start a CPU instance.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/tcp_store.h"

namespace tandem::comm {

struct GlooOptions {
  /// Address the TCP transport binds to and advertises to its peers (loopback by default:
  /// one host). Ignored when iface is set.
  std::string hostname = "127.0.0.1";
  /// Network interface to bind to instead (e.g. "eth0") for groups spanning hosts.
  std::string iface;
  /// Bounds the rendezvous and every collective / send / recv.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  /// Key prefix in the store: groups rendezvousing over one store need distinct prefixes.
  std::string store_prefix = "tandem/gloo/";
};

class GlooCommunicator final : public Communicator {
 public:
  /// Connects the full mesh of the store's group (rank and size come from the store).
  /// Collective: every rank of the group constructs one. The store is only used during the
  /// constructor. Errors (timeouts, unreachable peers) throw kIo.
  explicit GlooCommunicator(TcpStore& store, GlooOptions options = {});
  /// Bootstraps from RankEnv::from_env(): creates (and keeps) its own TcpStore, then connects.
  static std::unique_ptr<GlooCommunicator> from_env(GlooOptions options = {});
  ~GlooCommunicator() override;
  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  /// Two-shot: a reduce-scatter (all-to-all of 1/N chunks, each summed in rank order by its
  /// owner) then an all-gather; (N-1)/N * 2 * B bytes per rank, results bit-identical on every
  /// rank and to LocalCommunicator.
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

 private:
  struct Impl;
  GlooCommunicator(TcpStore& store, GlooOptions options, std::unique_ptr<TcpStore> owned);

  int rank_ = 0;
  int world_size_ = 1;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem::comm
