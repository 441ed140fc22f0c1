// The router over colocated `tandem serve` replicas (data-parallel serving without
// disaggregation): `tandem router --replica HOST:PORT,...` (each replica's --control-port).
// Every request runs whole on one replica, picked as Router picks a prefill instance: by the
// prompt tokens it would compute (prompt minus the prefix the replica holds, from its KV events
// in server/prefix_index.h) plus the prompt tokens the router placed there that it has not
// started yet (their first token has not come back). Without KV events: least-queued.
// Membership: the replicas' loads are polled every health_interval (a replica that does not
// answer is routed around until it answers again, and a request sent to one found gone goes to
// the next pick; its requests end with an error when its connection is lost). Each --replica
// is one replica: a host name is not expanded into its addresses, as the disaggregated Router
// does with a headless Service (list the replicas' stable names, e.g. a StatefulSet's pods).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/request.h"
#include "server/prefix_index.h"
#include "server/router.h"

namespace tandem {

class ReplicaRouter final : public EngineClient {
 public:
  /// Replicas at "host:port" (nothing needs to be up yet). RouterConfig's health_interval and
  /// KV-event fields apply (kv_events_port: the replicas' KV events on their hosts).
  ReplicaRouter(const std::vector<std::string>& endpoints, RouterConfig config);
  ~ReplicaRouter() override;

  /// Throws Error(kIo) when no replica is usable, else as the picked replica's engine does.
  void submit(GenRequest request, OutputCallback on_output) override;
  void abort(const std::string& id) override;
  /// The replicas' engine counters, summed.
  EngineStats stats() const override;
  int64_t max_model_len() const override;
  int64_t vocab_size() const override;
  bool constraints_from_spec() const override { return true; }

  bool ready() const;
  /// Prometheus text: per replica liveness and placed tokens, the prefix-routing counters.
  std::string metrics_text() const;
  /// Prompt tokens routed and, of them, held by the picked replica (the index's view).
  int64_t routed_prompt_tokens() const { return routed_prompt_.load(); }
  int64_t routed_cached_tokens() const { return routed_cached_.load(); }

 private:
  struct Replica;
  void monitor();
  int pick(const std::vector<int32_t>& prompt, int64_t& new_tokens);

  RouterConfig config_;
  PrefixIndex index_;
  bool indexed_ = false;  // some replica's KV events are subscribed to
  std::vector<std::unique_ptr<Replica>> replicas_;
  mutable std::mutex mu_;                      // loads, placements, live requests
  std::unordered_map<std::string, int> live_;  // request id -> replica
  std::atomic<int64_t> routed_prompt_{0}, routed_cached_{0}, events_lost_{0};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread monitor_;
};

}  // namespace tandem
