// The roles' own /metrics endpoint (`tandem prefill|decode|router --metrics-port`): a minimal
// HTTP listener beside the control protocol (disagg/instance_api), and the Prometheus text of
// the instances' loads.
#pragma once

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "disagg/decode_instance.h"
#include "disagg/prefill_instance.h"

namespace tandem {

/// A minimal HTTP endpoint answering GET /metrics with render()'s Prometheus text (the
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

}  // namespace tandem
