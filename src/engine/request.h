// What the front end hands the engine, and what the engine streams back.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/constraint.h"
#include "engine/sampling.h"

namespace tandem {

enum class FinishReason { kNone, kLength, kStop, kAbort, kError };
const char* finish_reason_name(FinishReason r);  // "length", "stop", "abort", "error"

/// One sequence to generate. (OpenAI `n` > 1 becomes n requests with ids "<id>-<i>".)
struct GenRequest {
  std::string id;                   // unique among live requests
  std::vector<int32_t> prompt_ids;  // non-empty
  SamplingParams sampling;
  int32_t max_tokens = 16;              // >= 1
  int32_t min_tokens = 0;               // EOS / stop ids suppressed before this many tokens
  std::vector<int32_t> stop_token_ids;  // finish with reason kStop (token included)
  bool ignore_eos = false;
  // False: never speculate for this request (one token per step), e.g. when a per-request
  // logits processor (structured outputs) must see every token before the next is drafted.
  bool allow_speculation = true;
  // Structured outputs / thinking budget: restricts each sampled token (null: none). One per
  // request (it holds the request's grammar state); in-process only, released when the
  // request finishes.
  std::shared_ptr<TokenConstraint> constraint;
  // The constraint as data (the server layer's encoding; "": none): what the codecs carry. An
  // engine given a request with a spec and no constraint builds it with its
  // EngineConfig::constraint_factory, so the grammar is compiled where the request samples
  // (the prefill instance for token 1, the decode rank for the rest).
  std::string constraint_spec;
};

/// Tokens produced for one request since the last callback.
struct StepOutput {
  std::string id;
  std::vector<int32_t> token_ids;
  std::vector<float> token_logprobs;                    // when sampling.logprobs >= 0
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // when sampling.logprobs > 0
  // First callback only, when sampling.prompt_logprobs >= 0: one entry per prompt token
  // after the first (the first has none).
  std::vector<float> prompt_token_logprobs;
  std::vector<std::vector<TokenLogprob>> prompt_top_logprobs;
  int32_t num_cached_prompt_tokens = 0;  // prefix-cache hits (first callback)
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  int32_t stop_token_id = -1;  // the EOS / stop id that finished it, if any
  std::string error;           // finish_reason == kError
  // kError for a request that never started for lack of capacity (e.g. a router queue
  // timeout): the client may retry after this many seconds (the HTTP front answers 429).
  int32_t retry_after_s = 0;
};

/// Called on the engine thread; must not block.
using OutputCallback = std::function<void(const StepOutput&)>;

/// Counts of a histogram with fixed upper bounds (the bounds live with the metric, e.g.
/// kQueueTimeBounds); summed over ranks and instances with add().
struct HistogramCounts {
  std::vector<uint64_t> buckets;  // per bound, not cumulative; one more for +Inf
  double sum = 0;
  uint64_t count = 0;

  void observe(std::span<const double> bounds, double value) {
    if (buckets.size() != bounds.size() + 1) buckets.assign(bounds.size() + 1, 0);
    size_t i = 0;
    while (i < bounds.size() && value > bounds[i]) ++i;
    ++buckets[i];
    sum += value;
    ++count;
  }
  void add(const HistogramCounts& o) {
    if (o.buckets.size() > buckets.size()) buckets.resize(o.buckets.size(), 0);
    for (size_t i = 0; i < o.buckets.size(); ++i) buckets[i] += o.buckets[i];
    sum += o.sum;
    count += o.count;
  }
};

/// vllm:request_queue_time_seconds' bounds (seconds; those of the other request-latency
/// histograms: vLLM's request latency buckets with 0.01 / 0.05 / 0.1 in front).
inline constexpr std::array<double, 21> kQueueTimeBounds = {
    0.01, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,  5.0,
    10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0};
/// vllm:iteration_tokens_total's bounds (tokens per engine step; vLLM's buckets).
inline constexpr std::array<double, 13> kIterationTokensBounds = {
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384};

/// Counters exported on /metrics.
struct EngineStats {
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t kv_pages_total = 0;
  int64_t kv_pages_free = 0;
  int64_t prefix_cache_queries = 0;  // prompt tokens looked up
  int64_t prefix_cache_hits = 0;     // prompt tokens found
  int64_t prompt_tokens = 0;         // total prompt tokens computed
  int64_t generation_tokens = 0;     // total tokens generated
  int64_t preemptions = 0;
  // MTP speculative decoding, as vLLM counts it: verified draft sequences, their draft
  // tokens, the accepted ones, and accepted drafts by position (0: the first draft).
  int64_t spec_num_drafts = 0;
  int64_t spec_num_draft_tokens = 0;
  int64_t spec_num_accepted_tokens = 0;
  std::vector<int64_t> spec_accepted_per_pos;  // [num_speculative_tokens]; empty when off
  HistogramCounts queue_time;                  // seconds, arrival at the engine -> first scheduled
  HistogramCounts iteration_tokens;            // tokens computed per engine step

  /// Sums another engine's counters into these (ranks of an instance, instances of a router).
  void add(const EngineStats& o) {
    running += o.running;
    waiting += o.waiting;
    kv_pages_total += o.kv_pages_total;
    kv_pages_free += o.kv_pages_free;
    prefix_cache_queries += o.prefix_cache_queries;
    prefix_cache_hits += o.prefix_cache_hits;
    prompt_tokens += o.prompt_tokens;
    generation_tokens += o.generation_tokens;
    preemptions += o.preemptions;
    spec_num_drafts += o.spec_num_drafts;
    spec_num_draft_tokens += o.spec_num_draft_tokens;
    spec_num_accepted_tokens += o.spec_num_accepted_tokens;
    if (o.spec_accepted_per_pos.size() > spec_accepted_per_pos.size()) {
      spec_accepted_per_pos.resize(o.spec_accepted_per_pos.size(), 0);
    }
    for (size_t i = 0; i < o.spec_accepted_per_pos.size(); ++i) {
      spec_accepted_per_pos[i] += o.spec_accepted_per_pos[i];
    }
    queue_time.add(o.queue_time);
    iteration_tokens.add(o.iteration_tokens);
  }
};

/// The engine as the front end sees it. Thread-safe.
class EngineClient {
 public:
  virtual ~EngineClient() = default;
  /// Queues a request. Throws Error(kInvalidArgument) for a request that can never run
  /// (prompt + max_tokens over the model length) and Error(kOutOfResources) when the
  /// waiting queue is full. Every accepted request gets exactly one finished callback.
  virtual void submit(GenRequest request, OutputCallback on_output) = 0;
  /// Aborts a live request (no-op for an unknown id); its pages are freed at once and it
  /// gets a finished callback with kAbort.
  virtual void abort(const std::string& id) = 0;
  virtual EngineStats stats() const = 0;
  virtual int64_t max_model_len() const = 0;
  virtual int64_t vocab_size() const = 0;
  /// Whether submit() honours constraints (false: the HTTP front refuses structured outputs).
  virtual bool supports_constraints() const { return true; }
  /// Whether submit() takes the constraint as GenRequest::constraint_spec alone and builds it
  /// where the request samples (a router: its instances compile the grammar); the HTTP front
  /// then only validates the spec. False: the front builds GenRequest::constraint.
  virtual bool constraints_from_spec() const { return false; }
  /// The ids that end a generation (the model's EOS ids); empty when unknown.
  virtual std::vector<int32_t> eos_token_ids() const { return {}; }
};

}  // namespace tandem
