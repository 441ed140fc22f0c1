// A tiny key-value store over TCP for bootstrapping a group of ranks (one process each):
// rank 0 serves, every rank (rank 0 too) is a client. Values are byte blobs; get() blocks until
// the key is set or the timeout passes. Used to exchange CUDA IPC handles and the NCCL id.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "net/cluster_auth.h"

namespace tandem::comm {

/// Where a rank finds the group: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun style).
struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // LOCAL_RANK if set, else rank: picks the GPU
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;

  /// Reads the environment; throws kInvalidArgument with the variable's name when one is
  /// missing or malformed (MASTER_ADDR defaults to 127.0.0.1, MASTER_PORT to 29500).
  static RankEnv from_env();
};

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // rank 0's address (clients connect here)
  int port = 29500;                // 0 on rank 0: pick a free port (read it back with port())
  int rank = 0;
  int world_size = 1;
  /// Bounds connecting, every blocking get() and the barrier.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  /// The cluster key (null: none): rank 0's server admits only clients that pass the mutual
  /// handshake (net/cluster_auth.h), and the clients check rank 0 holds it too.
  net::KeyRef key;

  /// The options of rank env.rank in the group env describes (rank 0 at MASTER_ADDR:PORT).
  static TcpStoreOptions of(const RankEnv& env);
};

class TcpStoreServer;

/// Client of the group's store (rank 0 also runs the server). Thread-safe; every rank must
/// call barrier() the same number of times. Errors (timeouts, a lost connection) throw
/// tandem::Error of kind kIo with the key, the rank and the address in the message.
class TcpStore {
 public:
  explicit TcpStore(TcpStoreOptions options);
  /// Rank 0 waits (up to the timeout) for the other ranks to disconnect before it stops
  /// serving, so a fast rank 0 does not pull the store from under slower ranks.
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  /// Stores value under key (overwrites).
  void set(std::string_view key, std::span<const uint8_t> value);
  void set(std::string_view key, std::string_view value);
  /// Blocks until key exists, returns its value; throws after the timeout.
  std::vector<uint8_t> get(std::string_view key);
  std::vector<uint8_t> get(std::string_view key, std::chrono::milliseconds timeout);
  std::string get_string(std::string_view key);
  /// Atomically adds delta to the integer counter under key (created at 0); returns the new value.
  int64_t add(std::string_view key, int64_t delta);
  /// Returns once every rank has entered the barrier (or throws after the timeout).
  void barrier();
  /// Every rank contributes value; returns all ranks' values in rank order.
  std::vector<std::vector<uint8_t>> all_gather(std::string_view key,
                                               std::span<const uint8_t> value);

  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  /// The port the server listens on (the chosen one when options.port was 0).
  int port() const { return port_; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }

 private:
  struct Reply {
    uint8_t status;
    int64_t num;
    std::vector<uint8_t> value;
  };
  Reply request(uint8_t op, int64_t arg, std::string_view key, std::span<const uint8_t> value,
                std::chrono::milliseconds reply_timeout);
  void connect_to_server();

  TcpStoreOptions options_;
  int port_ = 0;
  std::unique_ptr<TcpStoreServer> server_;  // rank 0 only
  int fd_ = -1;
  std::mutex mu_;
  int64_t barrier_generation_ = 0;
};

}  // namespace tandem::comm
