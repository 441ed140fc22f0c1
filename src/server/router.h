// The router (DESIGN.md section 3, steps 2 and 6): the OpenAI front's EngineClient for
// disaggregated serving, so HttpServer serves the API unchanged over prefill and decode
// instances. Per request: pick the decode instance with the smallest batch under its limit
// (it reserves KV pages and registers the output callback), pick the prefill instance with the
// fewest queued input tokens (it prefills and hands the KV over), then tokens stream from the
// decode instance through the callback.
//
// A decode instance that dies (load().alive false) ends only its own requests, with an error,
// and is never picked again; a failed prefill ends its request on the decode side with an
// error (DecodeClient::fail).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/decode_instance.h"
#include "engine/prefill_instance.h"
#include "engine/request.h"

namespace tandem {

struct RouterConfig {
  // How often the instances' loads (and liveness) are fetched. Picking uses these, plus what
  // the router itself placed since: no per-request round trip to every instance.
  std::chrono::milliseconds health_interval{20};
};

/// One line per instance for /metrics and logs.
struct RouterSnapshot {
  std::vector<PrefillLoad> prefill;
  std::vector<DecodeLoad> decode;
  int64_t live_requests = 0;
};

class Router final : public EngineClient {
 public:
  /// The instances must outlive the router; at least one of each.
  Router(std::vector<PrefillClient*> prefill, std::vector<DecodeClient*> decode,
         RouterConfig config = {});
  /// Stops the health monitor (live requests are left to their instances).
  ~Router() override;

  /// Throws Error(kInvalidArgument) for a request that can never run (decided by the decode
  /// instance) and Error(kOutOfResources) when every decode instance is at its batch limit or
  /// no instance of a role is up.
  void submit(GenRequest request, OutputCallback on_output) override;
  void abort(const std::string& id) override;
  EngineStats stats() const override;
  int64_t max_model_len() const override { return max_model_len_; }
  int64_t vocab_size() const override { return vocab_size_; }

  RouterSnapshot snapshot() const;
  /// Prometheus text: queued input tokens and input tokens/s per prefill instance, batch per
  /// rank vs --max-decode-batch per decode instance, liveness.
  std::string metrics_text() const;

 private:
  struct Live;
  void refresh_loads();
  int pick_prefill(int64_t prompt_tokens);
  std::vector<int> decode_order() const;
  void note_accepted(int decode);
  void monitor();
  void end_dead_decode(int d);

  std::vector<PrefillClient*> prefill_;
  std::vector<DecodeClient*> decode_;
  RouterConfig config_;
  int64_t max_model_len_ = 0;
  int64_t vocab_size_ = 0;
  std::vector<std::atomic<bool>> decode_dead_;
  mutable std::mutex load_mu_;  // the loads as last fetched, plus placements since
  std::vector<PrefillLoad> prefill_loads_;
  std::vector<DecodeLoad> decode_loads_;
  struct Registry {  // shared with the requests' callbacks, which may outlive the router
    std::mutex mu;
    std::unordered_map<std::string, std::shared_ptr<Live>> live;
    std::atomic<int64_t> generated{0};
  };
  std::shared_ptr<Registry> reg_ = std::make_shared<Registry>();

  std::mutex mu_;  // stop_
  std::condition_variable stop_cv_;
  bool stop_ = false;
  std::thread monitor_;
};

}  // namespace tandem
