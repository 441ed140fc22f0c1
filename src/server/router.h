// The router (DESIGN.md section 3, steps 2 and 6): the OpenAI front's EngineClient for
// disaggregated serving, so HttpServer serves the API unchanged over prefill and decode
// instances. Per request: pick the decode instance with the smallest batch under its limit
// (it reserves KV pages and registers the output callback), pick the prefill instance with the
// fewest queued input tokens (it prefills and hands the KV over), then tokens stream from the
// decode instance through the callback.
//
// Membership heals: a monitor thread polls every instance's load; an instance that does not
// answer (load().alive false) is marked unready, its requests end with an error, and it is
// routed around; when it answers again (remote clients reconnect with backoff, so a restarted
// instance on the same address comes back) it is re-admitted. Transitions are logged. An
// endpoint given as a DNS name is re-resolved: one member per address.
//
// Capacity: when every usable decode instance is at its batch limit, requests wait in a
// bounded FIFO queue (max_queue, queue_timeout) and are placed as slots free up; a full
// queue is refused at once (Error kOutOfResources: 429) and a timed-out request ends with
// an error carrying retry_after_s (429 before any output). No usable instance at all is not
// "full": Error(kIo) (503).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "disagg/decode_instance.h"
#include "disagg/prefill_instance.h"
#include "engine/request.h"
#include "net/cluster_auth.h"
#include "server/prefix_index.h"

namespace tandem {

struct RouterConfig {
  // How often the instances' loads (and liveness) are fetched. Picking uses these, plus what
  // the router itself placed since: no per-request round trip to every instance.
  std::chrono::milliseconds health_interval{20};
  size_t max_queue = 256;                             // requests waiting for a decode slot
  std::chrono::milliseconds queue_timeout{30000};     // then they end with a retryable error
  std::chrono::milliseconds resolve_interval{10000};  // DNS names are re-resolved this often
  // Membership transitions (instance up / down / added); null: stderr.
  std::function<void(const std::string&)> log;
  // The cluster key for the control connections to watched instances (null: none).
  net::KeyRef cluster_key;
  // Prefix-aware routing (server/prefix_index.h): > 0, the router subscribes to each prefill
  // instance's KV events at tcp://<its host>:kv_events_port (replay at kv_events_replay_port,
  // 0: none; topic kv_events_topic) and picks by expected prompt tokens to compute plus queue.
  // 0: least-queued only.
  int kv_events_port = 0;
  int kv_events_replay_port = 0;
  std::string kv_events_topic;
  int64_t prefix_index_blocks = int64_t{1} << 20;  // page hashes the index keeps at most
  // ReplicaRouter: explicit KV-event endpoints, one per replica in order (replay: the same or
  // empty), instead of kv_events_port on each replica's host (several replicas on one host).
  std::vector<std::string> kv_events_endpoints, kv_events_replay_endpoints;
};

/// One line per instance for /metrics and logs.
struct RouterSnapshot {
  std::vector<PrefillLoad> prefill;
  std::vector<DecodeLoad> decode;
  std::vector<std::string> prefill_names, decode_names;  // the addresses
  int64_t live_requests = 0;
  int64_t queued_requests = 0;
  // Prefix-aware routing: prompt tokens routed, of them held by the picked instance (as the
  // index predicted), KV event batches lost (instances fell back), pages indexed.
  int64_t routed_prompt_tokens = 0, routed_cached_tokens = 0;
  int64_t kv_event_batches_lost = 0, prefix_index_blocks = 0;
};

class Router final : public EngineClient {
 public:
  /// Fixed instances (they must outlive the router); at least one of each.
  Router(std::vector<PrefillClient*> prefill, std::vector<DecodeClient*> decode,
         RouterConfig config = {});
  /// No instance yet: add them with watch_prefill / watch_decode.
  explicit Router(RouterConfig config);
  /// Stops the monitor; requests still queued end with kAbort (live ones are left to their
  /// instances).
  ~Router() override;

  /// Instances at "host:port" over the control protocol (RemotePrefill / RemoteDecode): one
  /// per address the host resolves to, re-resolved every resolve_interval (a Kubernetes
  /// headless Service). Nothing needs to be up yet.
  void watch_prefill(const std::string& endpoint);
  void watch_decode(const std::string& endpoint);

  /// Throws Error(kInvalidArgument) for a request that can never run (decided by the decode
  /// instance), Error(kIo) when no instance of a role is usable, Error(kOutOfResources) when
  /// every decode instance is at its batch limit and the queue is full.
  void submit(GenRequest request, OutputCallback on_output) override;
  void abort(const std::string& id) override;
  EngineStats stats() const override;
  /// Of the decode instances seen so far (before any: a large placeholder, so requests are
  /// refused with 503 rather than as too long).
  int64_t max_model_len() const override;
  int64_t vocab_size() const override;
  // Constraints travel as GenRequest::constraint_spec: the prefill instance builds one for
  // token 1, the decode rank for the rest (each compiles the grammar where it samples).
  bool constraints_from_spec() const override { return true; }

  /// At least one prefill and one decode instance usable (GET /ready).
  bool ready() const;
  RouterSnapshot snapshot() const;
  /// Prometheus text: queued input tokens and input tokens/s per prefill instance, batch per
  /// rank vs --max-decode-batch per decode instance, liveness, the router queue.
  std::string metrics_text() const;

 private:
  struct Live;
  struct Queued;
  struct Prefill;
  struct Decode;
  struct Watch;
  enum class Place { kPlaced, kFull, kNone };

  void add_prefill(const std::string& name, PrefillClient* client,
                   std::unique_ptr<PrefillClient> owned);
  void add_decode(const std::string& name, DecodeClient* client,
                  std::unique_ptr<DecodeClient> owned);
  std::vector<std::shared_ptr<Prefill>> prefills() const;
  std::vector<std::shared_ptr<Decode>> decodes() const;
  Place place(const GenRequest& req, const std::shared_ptr<Live>& live, const OutputCallback& relay,
              std::string& why);
  std::shared_ptr<Prefill> pick_prefill(const std::vector<int32_t>& prompt);
  std::vector<std::shared_ptr<Decode>> decode_order() const;
  void refresh();
  void resolve_watches(bool force);
  void drain_queue();
  void monitor();
  void end_dead_decode(const std::shared_ptr<Decode>& d);
  void log(const std::string& line) const;
  void finish(const std::string& id, const std::shared_ptr<Live>& live, FinishReason reason,
              const std::string& error, int32_t retry_after_s);

  RouterConfig config_;
  mutable std::mutex members_mu_;  // the member lists (they only grow)
  std::vector<std::shared_ptr<Prefill>> prefill_;
  std::vector<std::shared_ptr<Decode>> decode_;
  std::vector<std::unique_ptr<Watch>> watches_;
  mutable std::mutex load_mu_;             // every member's load and up flag, plus placements since
  std::atomic<int64_t> max_model_len_{0};  // 0: no decode instance seen yet
  std::atomic<int64_t> vocab_size_{0};
  PrefixIndex index_;
  std::atomic<int> next_index_id_{0};
  std::atomic<int64_t> routed_prompt_{0}, routed_cached_{0}, events_lost_{0};

  struct Registry {  // shared with the requests' callbacks, which may outlive the router
    std::mutex mu;
    std::unordered_map<std::string, std::shared_ptr<Live>> live;
    std::atomic<int64_t> generated{0};
    std::function<void()> on_finished;  // wakes the monitor (a slot may have freed)
  };
  std::shared_ptr<Registry> reg_ = std::make_shared<Registry>();

  mutable std::mutex queue_mu_;
  std::deque<std::shared_ptr<Queued>> queue_;

  std::mutex mu_;  // stop_, wake_
  std::condition_variable stop_cv_;
  bool stop_ = false;
  bool wake_ = false;
  std::thread monitor_;
};

}  // namespace tandem
