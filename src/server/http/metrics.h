// Front-end metrics in the Prometheus text exposition format (GET /metrics): tandem_* names,
// and the same figures under vLLM's names (vllm:*, label model_name), so dashboards built
// for vLLM work unchanged (docs/operations.md lists them).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "engine/request.h"

namespace tandem {

/// A cumulative histogram with fixed upper bounds (seconds). Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  /// Appends the `_bucket`, `_sum` and `_count` lines of metric `name`; labels (e.g.
  /// `model_name="x"`) go on every line.
  void render(std::string& out, const std::string& name, const std::string& help,
              const std::string& labels = "") const;
  /// The same for counts kept elsewhere (the engine's, EngineStats).
  static void render(std::string& out, const std::string& name, const std::string& help,
                     const std::string& labels, std::span<const double> bounds,
                     const HistogramCounts& counts);

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last is +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

/// Everything the HTTP front counts. Thread-safe.
class ServerMetrics {
 public:
  ServerMetrics();

  /// One generated sequence (a choice) ended: outcome is a finish reason ("stop", "length",
  /// "abort") or "error".
  void count_sequence(const std::string& outcome);
  /// One HTTP response was sent with this status.
  void count_response(int status);
  void add_prompt_tokens(int64_t n) { prompt_tokens_ += n; }
  void add_generation_tokens(int64_t n) { generation_tokens_ += n; }

  Histogram& ttft() { return ttft_; }                // seconds, submit -> first token
  Histogram& inter_token_latency() { return itl_; }  // seconds between tokens
  Histogram& e2e_latency() { return e2e_; }          // seconds, request -> last token
  /// One HTTP generation answered: its time to first token and whole duration (seconds);
  /// they make the prefill (request -> first token) and decode (first -> last) times.
  void observe_request(double ttft_s, double duration_s);
  /// One generated sequence (a choice) ended: its prompt and generated tokens.
  void observe_sequence(int64_t prompt_tokens, int64_t generation_tokens);
  /// Every choice of one request ended: its n, max_tokens (the effective one) and the most
  /// tokens one of its choices generated.
  void observe_request_params(int64_t n, int64_t max_tokens, int64_t max_generated);
  /// The model_name label of the vllm:* metrics.
  void set_model_name(const std::string& name);
  /// Text appended to render() (e.g. the router's per-instance metrics); null: none.
  void set_extra(std::function<std::string()> extra);

  /// The whole exposition, engine gauges and counters included.
  std::string render(const EngineStats& stats) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, uint64_t> sequences_;  // by outcome
  std::map<int, uint64_t> responses_;          // by HTTP status
  std::atomic<int64_t> prompt_tokens_{0};
  std::atomic<int64_t> generation_tokens_{0};
  Histogram ttft_;
  Histogram itl_;
  Histogram e2e_;
  Histogram prefill_time_;
  Histogram decode_time_;
  Histogram prompt_len_;      // tokens, 1-2-5 buckets (as vLLM's, up to 1M)
  Histogram generation_len_;  // likewise
  Histogram max_tokens_;      // likewise
  Histogram max_generated_;   // likewise
  Histogram n_;               // 1, 2, 5, 10, 20
  std::string model_name_ = "tandem";
  std::function<std::string()> extra_;
};

}  // namespace tandem
