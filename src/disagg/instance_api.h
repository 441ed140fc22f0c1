// The control protocol between the router and an instance's rank 0 (DESIGN.md section 3):
// the router holds one TCP connection per instance and sees it as a DecodeClient or a
// PrefillClient, exactly like an instance in its own process.
//
// Frames: u32 type, u32 payload bytes, payload (each message's fields listed once in
// instance_api.cpp over disagg/protocol.h's, core/byte_codec.h's encoding). Calls carry a
// serial and get one reply with it; the instance also pushes request outputs (decode) and
// prefill failures on the same connection.
//   router -> instance: kHello, kAccept(req, prefill sharding), kSubmit(req, descriptor),
//                       kPrefilled(id, first output), kFail(id, error), kAbort(id), kLoad
//   instance -> router: kReply(serial, ok | error kind + message, body), kOutput(StepOutput),
//                       kPrefillDone(id, error, first output)
// A frame's payload is at most kMaxControlFrameBytes: a larger one closes the connection.
// With a cluster key (net/cluster_auth.h) each connection starts with the mutual handshake; a
// peer that fails it is closed, logged and counted before any frame is read.
// A lost connection: the instance aborts the requests that came through it; the client ends
// the requests it had there with an error and reports the instance down (load().alive false)
// until it reconnects: load() retries with backoff (100 ms doubling to 5 s), so an instance
// that starts after the router, or restarts on the same address, is used (again) once it
// answers.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "disagg/decode_instance.h"
#include "disagg/prefill_instance.h"
#include "net/cluster_auth.h"

namespace tandem {

/// The largest control frame either side reads (a request's prompt, its grammar, a first
/// output with prompt logprobs); a larger one closes the connection.
constexpr uint32_t kMaxControlFrameBytes = 256u << 20;

/// Serves this process's instance (exactly one of decode / prefill / a colocated engine) to
/// routers.
class InstanceServer {
 public:
  /// Listens on host:port (0: any free port). The instance must outlive the server. With a
  /// key, every connection must pass the cluster-key handshake first.
  InstanceServer(DecodeClient* decode, PrefillClient* prefill, const std::string& host, int port,
                 net::KeyRef key = nullptr);
  /// A colocated engine (`tandem serve --control-port`): a router's replica (RemoteReplica).
  InstanceServer(EngineClient* engine, const std::string& host, int port,
                 net::KeyRef key = nullptr);
  ~InstanceServer();
  int port() const { return port_; }
  /// Closes the listener and the connections (aborting their requests); idempotent.
  void stop();
  /// Graceful stop (SIGTERM): the instance reports itself draining (routers send it nothing
  /// new; a decode instance refuses new requests as full), the requests it has may finish
  /// within `grace`, then stop().
  void drain(std::chrono::milliseconds grace);
  bool draining() const { return draining_; }

 private:
  struct Conn;
  size_t live_requests();
  void accept_loop();
  void serve(std::shared_ptr<Conn> conn);

  void abort_request(const std::string& id);
  DecodeClient* decode_;
  PrefillClient* prefill_;
  net::KeyRef key_;
  EngineClient* engine_ = nullptr;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> draining_{false};
  std::thread accept_thread_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Conn>> conns_;
  std::vector<std::thread> threads_;
};

/// One connection to an InstanceServer: calls with replies, plus pushed messages.
class InstanceConnection {
 public:
  using OnPush = std::function<void(uint32_t type, const std::vector<uint8_t>& payload)>;
  /// Connects to "host:port"; throws Error(kIo) when it cannot. on_push and on_lost run on
  /// the connection's reader thread (on_lost not when the connection is destroyed).
  /// With a key, the cluster-key handshake runs first (throws Error(kIo) when it fails).
  InstanceConnection(const std::string& endpoint, OnPush on_push, std::function<void()> on_lost,
                     const net::KeyRef& key = nullptr);
  ~InstanceConnection();
  /// Sends a call and waits for its reply body; rethrows the instance's Error (same kind).
  /// Throws Error(kIo) when the connection is lost, or when no reply came within `timeout`
  /// (then the connection is shut down: an instance that hangs counts as lost).
  std::vector<uint8_t> call(uint32_t type, const std::vector<uint8_t>& body,
                            std::chrono::milliseconds timeout = std::chrono::seconds(30));
  /// Sends a one-way message (no reply); false when the connection is lost.
  bool send(uint32_t type, const std::vector<uint8_t>& body);
  bool alive() const { return alive_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  void read_loop();
  std::string endpoint_;
  int fd_ = -1;
  OnPush on_push_;
  std::function<void()> on_lost_;
  std::atomic<bool> alive_{true};
  std::atomic<bool> closing_{false};  // destroyed on purpose: on_lost is not called
  std::mutex write_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_serial_ = 1;
  struct Reply {
    bool done = false;
    std::vector<uint8_t> bytes;
  };
  std::map<uint64_t, Reply> replies_;
  std::thread reader_;
};

/// A connection to one instance that heals: poll() drops a lost connection and reconnects
/// when the backoff allows (100 ms, doubling to 5 s; reset by a success). Thread-safe.
class InstanceLink {
 public:
  /// Runs on a fresh connection before it is used (the hello); throws to refuse it.
  using OnConnect = std::function<void(InstanceConnection&)>;
  InstanceLink(std::string endpoint, InstanceConnection::OnPush on_push,
               std::function<void()> on_lost, OnConnect on_connect, net::KeyRef key = nullptr);
  /// Closes the connection (on_lost is not called).
  void close();
  /// The live connection, or null.
  std::shared_ptr<InstanceConnection> get() const;
  /// Heals the connection (see above). True when it was connected at the start of the call
  /// and still is: a loss is always reported by one false, even when it reconnects at once.
  bool poll();
  const std::string& endpoint() const { return endpoint_; }
  /// Why the last connection attempt failed ("" after a success).
  std::string last_error() const;

 private:
  std::string endpoint_;
  net::KeyRef key_;
  InstanceConnection::OnPush on_push_;
  std::function<void()> on_lost_;
  OnConnect on_connect_;
  mutable std::mutex mu_;
  std::mutex connect_mu_;  // one attempt at a time
  std::shared_ptr<InstanceConnection> conn_;
  std::chrono::steady_clock::time_point next_try_{};
  std::chrono::milliseconds backoff_{100};
  std::string last_error_;
};

/// A decode instance in another process (its rank 0's InstanceServer). Connects at once when
/// it can, else later (load() heals the connection; alive false meanwhile).
class RemoteDecode final : public DecodeClient {
 public:
  explicit RemoteDecode(const std::string& endpoint, net::KeyRef key = nullptr);
  ~RemoteDecode() override { link_.close(); }  // NOTE: first: its reader calls into members
  std::optional<transfer::TransferDescriptor> accept(const GenRequest& req,
                                                     const transfer::KvSharding& src,
                                                     OutputCallback on_output) override;
  void prefilled(const std::string& id, const StepOutput& first) override;
  void fail(const std::string& id, const std::string& error) override;
  void abort(const std::string& id) override;
  DecodeLoad load() const override;
  /// 0 until the first connection.
  int64_t max_model_len() const override { return max_model_len_; }
  int64_t vocab_size() const override { return vocab_size_; }
  const std::string& endpoint() const { return link_.endpoint(); }
  /// The instance's engine counters as of the last load() (of its rank 0 in a process
  /// group).
  EngineStats stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }
  /// The instance said it is draining (SIGTERM): usable by its live requests only.
  bool draining() const { return draining_; }

 private:
  void on_push(uint32_t type, const std::vector<uint8_t>& payload);
  void on_lost();
  std::shared_ptr<InstanceConnection> conn(const char* what) const;
  mutable std::mutex stats_mu_;
  mutable EngineStats stats_;
  mutable std::atomic<bool> draining_{false};
  std::atomic<int64_t> max_model_len_{0};
  std::atomic<int64_t> vocab_size_{0};
  std::mutex mu_;
  std::unordered_map<std::string, OutputCallback> callbacks_;
  std::unordered_set<std::string> accepting_;  // accept() calls in flight
  mutable InstanceLink link_;  // NOTE: last: its reader thread uses the members above
};

/// A colocated `tandem serve` in another process (its --control-port), for a router that
/// fronts replicas (data-parallel serving without disaggregation): requests and their outputs
/// over the control protocol. Connects at once when it can, else later (load() heals).
class RemoteReplica final : public EngineClient {
 public:
  /// With a key, the control connection passes the cluster-key handshake first.
  explicit RemoteReplica(const std::string& endpoint, net::KeyRef key = nullptr);
  ~RemoteReplica() override { link_.close(); }  // NOTE: first: its reader calls into members
  /// Throws as the replica's engine does (kInvalidArgument, kOutOfResources), or Error(kIo)
  /// when it is not connected.
  void submit(GenRequest request, OutputCallback on_output) override;
  void abort(const std::string& id) override;
  /// As of the last load().
  EngineStats stats() const override {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }
  int64_t max_model_len() const override { return max_model_len_; }
  int64_t vocab_size() const override { return vocab_size_; }
  bool constraints_from_spec() const override { return true; }
  /// Heals the connection and fetches the engine's counters; false when it does not answer.
  bool load() const;
  bool draining() const { return draining_; }
  const std::string& endpoint() const { return link_.endpoint(); }

 private:
  void on_push(uint32_t type, const std::vector<uint8_t>& payload);
  void on_lost();
  mutable std::mutex stats_mu_;
  mutable EngineStats stats_;
  mutable std::atomic<bool> draining_{false};
  std::atomic<int64_t> max_model_len_{0};
  std::atomic<int64_t> vocab_size_{0};
  std::mutex mu_;
  std::unordered_map<std::string, OutputCallback> callbacks_;
  mutable InstanceLink link_;  // NOTE: last: its reader thread uses the members above
};

/// A prefill instance in another process.
class RemotePrefill final : public PrefillClient {
 public:
  explicit RemotePrefill(const std::string& endpoint, net::KeyRef key = nullptr);
  ~RemotePrefill() override { link_.close(); }  // NOTE: first: its reader calls into members
  transfer::KvSharding kv_sharding() const override;
  const std::string& endpoint() const { return link_.endpoint(); }
  bool draining() const { return draining_; }
  void submit(const GenRequest& req, transfer::TransferDescriptor dst,
              PrefillDone on_done) override;
  void abort(const std::string& id) override;
  PrefillLoad load() const override;

 private:
  void on_push(uint32_t type, const std::vector<uint8_t>& payload);
  void on_lost();
  mutable std::mutex sharding_mu_;
  transfer::KvSharding sharding_;
  mutable std::atomic<bool> draining_{false};
  std::mutex mu_;
  std::unordered_map<std::string, PrefillDone> done_;  // id -> its callback
  mutable InstanceLink link_;  // NOTE: last: its reader thread uses the members above
};

}  // namespace tandem
