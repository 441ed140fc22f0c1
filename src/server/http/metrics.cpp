#include "server/http/metrics.h"

#include <algorithm>
#include <cstdio>

namespace tandem {

namespace {

std::string format_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

void header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void scalar(std::string& out, const std::string& name, const char* type, const std::string& help,
            double value) {
  header(out, name, type, help);
  out += name + " " + format_double(value) + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help,
                       const std::string& labels) const {
  HistogramCounts c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    c.buckets = counts_;
    c.sum = sum_;
    c.count = count_;
  }
  render(out, name, help, labels, bounds_, c);
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help,
                       const std::string& labels, std::span<const double> bounds,
                       const HistogramCounts& counts) {
  header(out, name, "histogram", help);
  const std::string pre = labels.empty() ? "" : labels + ",";
  const std::string own = labels.empty() ? "" : "{" + labels + "}";
  // (counts of no observation yet may be empty: all zero)
  auto at = [&](size_t i) { return i < counts.buckets.size() ? counts.buckets[i] : 0; };
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds.size(); ++i) {
    cumulative += at(i);
    out += name + "_bucket{" + pre + "le=\"" + format_double(bounds[i]) + "\"} " +
           std::to_string(cumulative) + "\n";
  }
  for (size_t i = bounds.size(); i < counts.buckets.size(); ++i) cumulative += at(i);
  out += name + "_bucket{" + pre + "le=\"+Inf\"} " + std::to_string(cumulative) + "\n";
  out += name + "_sum" + own + " " + format_double(counts.sum) + "\n";
  out += name + "_count" + own + " " + std::to_string(counts.count) + "\n";
}

namespace {
// vLLM's build_1_2_5_buckets, up to 1M tokens (vLLM stops at max_model_len).
std::vector<double> buckets_1_2_5() {
  std::vector<double> b;
  for (double m = 1; m <= 1e6; m *= 10) {
    for (double k : {1.0, 2.0, 5.0}) {
      if (k * m <= 1e6) b.push_back(k * m);
    }
  }
  return b;
}
}  // namespace

ServerMetrics::ServerMetrics()
    : ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0}),
      itl_({0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
            0.075, 0.1,    0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5}),
      e2e_({0.01, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,  5.0,
            10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0}),
      prefill_time_({0.01, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,  5.0,
                     10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0}),
      decode_time_({0.01, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,  5.0,
                    10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0}),
      prompt_len_(buckets_1_2_5()),
      generation_len_(buckets_1_2_5()),
      max_tokens_(buckets_1_2_5()),
      max_generated_(buckets_1_2_5()),
      n_({1, 2, 5, 10, 20}) {}

void ServerMetrics::observe_sequence(int64_t prompt_tokens, int64_t generation_tokens) {
  prompt_len_.observe(double(prompt_tokens));
  generation_len_.observe(double(generation_tokens));
}

void ServerMetrics::observe_request_params(int64_t n, int64_t max_tokens, int64_t max_generated) {
  n_.observe(double(n));
  max_tokens_.observe(double(max_tokens));
  max_generated_.observe(double(max_generated));
}

void ServerMetrics::observe_request(double ttft_s, double duration_s) {
  if (ttft_s < 0) return;
  prefill_time_.observe(ttft_s);
  decode_time_.observe(std::max(0.0, duration_s - ttft_s));
}

void ServerMetrics::set_model_name(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  model_name_ = name;
}

void ServerMetrics::set_extra(std::function<std::string()> extra) {
  std::lock_guard<std::mutex> lock(mu_);
  extra_ = std::move(extra);
}

void ServerMetrics::count_sequence(const std::string& outcome) {
  std::lock_guard<std::mutex> lock(mu_);
  ++sequences_[outcome];
}

void ServerMetrics::count_response(int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++responses_[status];
}

std::string ServerMetrics::render(const EngineStats& s) const {
  std::string out;
  std::string model;
  std::map<std::string, uint64_t> seq_copy;
  std::function<std::string()> extra;
  {
    std::lock_guard<std::mutex> lock(mu_);
    model = model_name_;
    seq_copy = sequences_;
    extra = extra_;
    header(out, "tandem_requests_finished_total", "counter",
           "Generated sequences by outcome (finish reason, or error).");
    // Always list the usual outcomes so dashboards see zeros.
    std::map<std::string, uint64_t> seq = sequences_;
    for (const char* k : {"stop", "length", "abort", "error"}) seq.try_emplace(k, 0);
    for (const auto& [k, v] : seq) {
      out += "tandem_requests_finished_total{outcome=\"" + k + "\"} " + std::to_string(v) + "\n";
    }
    header(out, "tandem_http_responses_total", "counter", "HTTP responses by status code.");
    for (const auto& [k, v] : responses_) {
      out += "tandem_http_responses_total{status=\"" + std::to_string(k) + "\"} " +
             std::to_string(v) + "\n";
    }
  }
  scalar(out, "tandem_prompt_tokens_total", "counter",
         "Prompt tokens of requests served over HTTP.", double(prompt_tokens_.load()));
  scalar(out, "tandem_generation_tokens_total", "counter", "Generated tokens returned over HTTP.",
         double(generation_tokens_.load()));
  ttft_.render(out, "tandem_time_to_first_token_seconds", "Time to first token.");
  itl_.render(out, "tandem_inter_token_latency_seconds", "Time between output tokens.");
  e2e_.render(out, "tandem_e2e_request_latency_seconds", "End-to-end request latency.");

  scalar(out, "tandem_num_requests_running", "gauge", "Sequences running in the engine.",
         double(s.running));
  scalar(out, "tandem_num_requests_waiting", "gauge", "Sequences waiting in the engine.",
         double(s.waiting));
  scalar(out, "tandem_kv_pages_total", "gauge", "KV cache pages in the pool.",
         double(s.kv_pages_total));
  scalar(out, "tandem_kv_pages_used", "gauge", "KV cache pages in use.",
         double(s.kv_pages_total - s.kv_pages_free));
  scalar(out, "tandem_kv_pages_free", "gauge", "KV cache pages free.", double(s.kv_pages_free));
  scalar(
      out, "tandem_kv_cache_usage_perc", "gauge", "Fraction of KV pages in use (0..1).",
      s.kv_pages_total > 0 ? double(s.kv_pages_total - s.kv_pages_free) / s.kv_pages_total : 0.0);
  scalar(out, "tandem_prefix_cache_queries_total", "counter",
         "Prompt tokens looked up in the prefix cache.", double(s.prefix_cache_queries));
  scalar(out, "tandem_prefix_cache_hits_total", "counter",
         "Prompt tokens found in the prefix cache.", double(s.prefix_cache_hits));
  scalar(out, "tandem_prefix_cache_hit_rate", "gauge",
         "Prefix cache hits / queries since start (0..1).",
         s.prefix_cache_queries > 0 ? double(s.prefix_cache_hits) / s.prefix_cache_queries : 0.0);
  scalar(out, "tandem_engine_prompt_tokens_total", "counter",
         "Prompt tokens computed by the engine (prefix-cache hits excluded).",
         double(s.prompt_tokens));
  scalar(out, "tandem_engine_generation_tokens_total", "counter", "Tokens generated by the engine.",
         double(s.generation_tokens));
  scalar(out, "tandem_num_preemptions_total", "counter", "Sequences preempted by the engine.",
         double(s.preemptions));
  const bool spec = !s.spec_accepted_per_pos.empty();  // speculative decoding on
  if (spec) {
    scalar(out, "tandem_spec_decode_num_drafts_total", "counter",
           "Draft sequences verified (one per sequence and step).", double(s.spec_num_drafts));
    scalar(out, "tandem_spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
           double(s.spec_num_draft_tokens));
    scalar(out, "tandem_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
           double(s.spec_num_accepted_tokens));
    header(out, "tandem_spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Draft tokens accepted, by draft position (0: the first draft).");
    for (size_t i = 0; i < s.spec_accepted_per_pos.size(); ++i) {
      out += "tandem_spec_decode_num_accepted_tokens_per_pos_total{position=\"" +
             std::to_string(i) + "\"} " + std::to_string(s.spec_accepted_per_pos[i]) + "\n";
    }
  }
  prefill_time_.render(out, "tandem_request_prefill_time_seconds",
                       "Request arrival to first token (includes queueing).");
  decode_time_.render(out, "tandem_request_decode_time_seconds", "First token to last token.");
  Histogram::render(out, "tandem_request_queue_time_seconds",
                    "Arrival at the engine to first scheduled.", "", kQueueTimeBounds,
                    s.queue_time);
  Histogram::render(out, "tandem_iteration_tokens_total", "Tokens computed per engine step.", "",
                    kIterationTokensBounds, s.iteration_tokens);
  prompt_len_.render(out, "tandem_request_prompt_tokens", "Prompt tokens per sequence.");
  generation_len_.render(out, "tandem_request_generation_tokens", "Generated tokens per sequence.");
  max_tokens_.render(out, "tandem_request_params_max_tokens",
                     "The max_tokens of each request (the effective one when not given).");
  n_.render(out, "tandem_request_params_n", "The n of each request.");
  max_generated_.render(out, "tandem_request_max_num_generation_tokens",
                        "The most tokens one choice of a request generated.");

  // The same under vLLM's names and labels (what its Grafana dashboard queries).
  std::string esc;
  for (char ch : model) {
    if (ch == '"' || ch == '\\') esc += '\\';
    esc += ch == '\n' ? ' ' : ch;
  }
  const std::string label = "model_name=\"" + esc + "\"";
  auto vllm = [&](const std::string& name, const char* type, const std::string& help,
                  double value) {
    header(out, name, type, help);
    out += name + "{" + label + "} " + format_double(value) + "\n";
  };
  vllm("vllm:num_requests_running", "gauge", "Requests running.", double(s.running));
  vllm("vllm:num_requests_waiting", "gauge", "Requests waiting.", double(s.waiting));
  vllm("vllm:kv_cache_usage_perc", "gauge", "KV cache usage (0..1).",
       s.kv_pages_total > 0 ? double(s.kv_pages_total - s.kv_pages_free) / s.kv_pages_total : 0.0);
  vllm("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
       double(s.prefix_cache_queries));
  vllm("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
       double(s.prefix_cache_hits));
  vllm("vllm:num_preemptions_total", "counter", "Preemptions.", double(s.preemptions));
  vllm("vllm:prompt_tokens_total", "counter", "Prompt tokens.", double(prompt_tokens_.load()));
  vllm("vllm:generation_tokens_total", "counter", "Generated tokens.",
       double(generation_tokens_.load()));
  if (spec) {
    vllm("vllm:spec_decode_num_drafts_total", "counter", "Draft sequences verified.",
         double(s.spec_num_drafts));
    vllm("vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.",
         double(s.spec_num_draft_tokens));
    vllm("vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
         double(s.spec_num_accepted_tokens));
    header(out, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Draft tokens accepted, by draft position.");
    for (size_t i = 0; i < s.spec_accepted_per_pos.size(); ++i) {
      out += "vllm:spec_decode_num_accepted_tokens_per_pos_total{" + label + ",position=\"" +
             std::to_string(i) + "\"} " + std::to_string(s.spec_accepted_per_pos[i]) + "\n";
    }
  }
  header(out, "vllm:request_success_total", "counter", "Finished requests by finish reason.");
  for (const char* k : {"stop", "length", "abort"}) {
    auto it = seq_copy.find(k);
    out += "vllm:request_success_total{" + label + ",finished_reason=\"" + k + "\"} " +
           std::to_string(it == seq_copy.end() ? 0 : it->second) + "\n";
  }
  ttft_.render(out, "vllm:time_to_first_token_seconds", "Time to first token.", label);
  itl_.render(out, "vllm:inter_token_latency_seconds", "Time between output tokens.", label);
  e2e_.render(out, "vllm:e2e_request_latency_seconds", "End-to-end request latency.", label);
  prefill_time_.render(out, "vllm:request_prefill_time_seconds",
                       "Request arrival to first token (includes queueing).", label);
  decode_time_.render(out, "vllm:request_decode_time_seconds", "First token to last token.", label);
  Histogram::render(out, "vllm:request_queue_time_seconds",
                    "Arrival at the engine to first scheduled.", label, kQueueTimeBounds,
                    s.queue_time);
  Histogram::render(out, "vllm:iteration_tokens_total", "Tokens per engine step.", label,
                    kIterationTokensBounds, s.iteration_tokens);
  prompt_len_.render(out, "vllm:request_prompt_tokens", "Prompt tokens per sequence.", label);
  generation_len_.render(out, "vllm:request_generation_tokens", "Generated tokens per sequence.",
                         label);
  max_tokens_.render(out, "vllm:request_params_max_tokens", "The max_tokens request parameter.",
                     label);
  n_.render(out, "vllm:request_params_n", "The n request parameter.", label);
  max_generated_.render(out, "vllm:request_max_num_generation_tokens",
                        "The most tokens one choice of a request generated.", label);
  if (extra) out += extra();
  return out;
}

}  // namespace tandem
