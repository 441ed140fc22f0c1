// The control protocol between the router and an instance's rank 0 (DESIGN.md section 3):
// the router holds one TCP connection per instance and sees it as a DecodeClient or a
// PrefillClient, exactly like an instance in its own process.
//
// Frames: u32 type, u32 payload bytes, payload (engine/lockstep.h ByteWriter encoding, host
// byte order). Calls carry a serial and get one reply with it; the instance also pushes
// request outputs (decode) and prefill failures on the same connection.
//   router -> instance: kHello, kAccept(req, prefill sharding), kSubmit(req, descriptor),
//                       kPrefilled(id, first output), kFail(id, error), kAbort(id), kLoad
//   instance -> router: kReply(serial, ok | error kind + message, body), kOutput(StepOutput),
//                       kPrefillDone(id, error, first output)
// A lost connection: the instance aborts the requests that came through it; the router sees
// the instance as down (load().alive false), which ends its requests with an error.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/decode_instance.h"
#include "engine/prefill_instance.h"

namespace tandem {

/// A minimal HTTP endpoint answering every GET with render()'s Prometheus text (the
/// instances' and the router's /metrics: queued input tokens, input tokens/s, batch per rank
/// against --max-decode-batch). One thread; one request per connection.
class MetricsEndpoint {
 public:
  MetricsEndpoint(const std::string& host, int port, std::function<std::string()> render);
  ~MetricsEndpoint();
  int port() const { return port_; }

 private:
  void loop();
  std::function<std::string()> render_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// Prometheus text of instances (label instance="<name>"): queued input tokens and input
/// tokens/s per prefill instance, batch per rank and the limit per decode instance, liveness.
std::string instances_metrics_text(const std::vector<std::pair<std::string, PrefillLoad>>& prefill,
                                   const std::vector<std::pair<std::string, DecodeLoad>>& decode);

/// Serves this process's instance (exactly one of decode / prefill) to routers.
class InstanceServer {
 public:
  /// Listens on host:port (0: any free port). The instance must outlive the server.
  InstanceServer(DecodeClient* decode, PrefillClient* prefill, const std::string& host, int port);
  ~InstanceServer();
  int port() const { return port_; }
  /// Closes the listener and the connections (aborting their requests); idempotent.
  void stop();

 private:
  struct Conn;
  void accept_loop();
  void serve(std::shared_ptr<Conn> conn);

  DecodeClient* decode_;
  PrefillClient* prefill_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
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
  InstanceConnection(const std::string& endpoint, OnPush on_push, std::function<void()> on_lost);
  ~InstanceConnection();
  /// Sends a call and waits for its reply body; rethrows the instance's Error (same kind).
  /// Throws Error(kIo) when the connection is lost.
  std::vector<uint8_t> call(uint32_t type, const std::vector<uint8_t>& body);
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

/// A decode instance in another process (its rank 0's InstanceServer).
class RemoteDecode final : public DecodeClient {
 public:
  explicit RemoteDecode(const std::string& endpoint);
  ~RemoteDecode() override { conn_.reset(); }  // NOTE: first: its reader calls into members
  std::optional<transfer::TransferDescriptor> accept(const GenRequest& req,
                                                     const transfer::KvSharding& src,
                                                     OutputCallback on_output) override;
  void prefilled(const std::string& id, const StepOutput& first) override;
  void fail(const std::string& id, const std::string& error) override;
  void abort(const std::string& id) override;
  DecodeLoad load() const override;
  int64_t max_model_len() const override { return max_model_len_; }
  int64_t vocab_size() const override { return vocab_size_; }

 private:
  void on_push(uint32_t type, const std::vector<uint8_t>& payload);
  std::unique_ptr<InstanceConnection> conn_;
  int64_t max_model_len_ = 0;
  int64_t vocab_size_ = 0;
  std::mutex mu_;
  std::unordered_map<std::string, OutputCallback> callbacks_;
};

/// A prefill instance in another process.
class RemotePrefill final : public PrefillClient {
 public:
  explicit RemotePrefill(const std::string& endpoint);
  ~RemotePrefill() override { conn_.reset(); }  // NOTE: first: its reader calls into members
  transfer::KvSharding kv_sharding() const override { return sharding_; }
  void submit(const GenRequest& req, transfer::TransferDescriptor dst,
              PrefillDone on_done) override;
  void abort(const std::string& id) override;
  PrefillLoad load() const override;

 private:
  void on_push(uint32_t type, const std::vector<uint8_t>& payload);
  void on_lost();
  std::unique_ptr<InstanceConnection> conn_;
  transfer::KvSharding sharding_;
  std::mutex mu_;
  std::unordered_map<std::string, PrefillDone> done_;  // id -> its callback
};

}  // namespace tandem
