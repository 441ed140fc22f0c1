// Continuous-batching scheduler: chunked prefill under a token budget (or sized to a per-step
// time target from an online model of the step time), paged KV with prefix caching,
// admission control and preemption by recompute.
#pragma once

#include <array>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/request.h"
#include "engine/speculative.h"
#include "kv/block_manager.h"
#include "model/forward_batch.h"

namespace tandem {

/// A request's state inside the engine.
struct Sequence {
  GenRequest req;
  OutputCallback on_output;
  std::vector<int32_t> tokens;  // prompt followed by output
  int64_t prompt_len = 0;
  int64_t num_computed = 0;           // tokens whose KV is in the cache
  int64_t num_cached_prompt = 0;      // prefix-cache hit at first admission
  std::vector<int32_t> pages;         // block table
  std::vector<uint64_t> page_hashes;  // hashes of the leading full prompt pages
  int32_t state_slot = -1;            // hybrid models: recurrent state slot while running
  std::vector<float> initial_state;   // prefilled elsewhere: restored into the slot at admission
  SamplerRng rng;
  double arrival_s = -1;     // when the scheduler got it (its clock; queue-time metric)
  uint64_t device_seed = 0;  // the seed of on-device sampling (the request's, else random)
  bool admitted_once = false;
  bool prompt_logprobs_done = false;
  StepOutput prompt_out;  // prompt logprobs gathered across chunks
  SequenceSpec spec;      // MTP speculative decoding: the drafts and their bookkeeping
  // req.constraint's next-token mask, filled by the engine's MaskWorker during the forward.
  std::vector<uint32_t> mask;
  bool mask_active = false;
  std::string mask_error;

  int64_t num_output() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

struct ScheduledSeq {
  Sequence* seq;
  int64_t num_tokens;  // tokens computed this step, starting at seq->num_computed
  LogitsMode logits;
  bool verify = false;  // seq->spec.tokens (the last token and its drafts), logits for each
};

/// A copy of one KvCache state slot into another (hybrid models' prefix cache).
struct StateCopy {
  int32_t src = -1, dst = -1;
};

/// What a step computes, in the terms of the step-time model (StepCostModel).
struct StepShape {
  double decode_rows = 0;      // sequences computing one token after their prompt
  double decode_context = 0;   // KV positions those rows attend to, summed
  double prefill_tokens = 0;   // other tokens (prompt chunks, recomputation)
  double prefill_context = 0;  // KV positions the prefill tokens attend to, summed
  /// Adds a chunk of n tokens at positions [start, start + n).
  void add(int64_t start, int64_t n, bool decode);
};

/// An online least-squares model of a step's duration (seconds),
///   t = a + b*decode_rows + c*decode_context + d*prefill_tokens + e*prefill_context
///         + f*[prefill_tokens > 0],
/// fit from measured steps with exponential forgetting (weight 0.995^age, ~200 steps), every
/// coefficient kept >= 0 (a coefficient the fit wants negative is dropped from the fit).
/// f is what a step with prompt tokens costs beyond its tokens: with a CUDA model the decode-
/// only steps replay a captured graph and the mixed ones run eagerly (launch overheads).
class StepCostModel {
 public:
  static constexpr int kTerms = 6;
  void observe(const StepShape& shape, double seconds);
  double predict(const StepShape& shape) const;
  /// The time n prefill tokens at positions [start, start + n) add to a step (without f).
  double prefill_cost(int64_t start, int64_t n) const;
  /// f: what the first prompt token of a step adds beyond its own cost.
  double mixed_cost() const;
  /// The most prefill tokens from position `start` that fit in `seconds` (0 when none;
  /// INT64_MAX when prefill costs nothing in the fit).
  int64_t prefill_tokens_within(double seconds, int64_t start) const;
  /// Enough steps seen to size chunks: 4 with prefill tokens.
  bool ready() const { return num_prefill_steps_ >= 4; }
  int64_t num_steps() const { return num_steps_; }
  /// a..f in seconds per unit of the terms above.
  std::array<double, kTerms> coefficients() const;

 private:
  void solve();
  std::array<double, kTerms * kTerms> xtx_{};
  std::array<double, kTerms> xty_{};
  std::array<double, kTerms> theta_{};  // of the scaled terms
  int64_t num_steps_ = 0;
  int64_t num_prefill_steps_ = 0;
};

struct ScheduledBatch {
  std::vector<ScheduledSeq> seqs;
  StepShape shape;  // for the step-time model (Scheduler::observe_step)
  ForwardBatch forward;
  /// Before the forward: checkpoints restored into the state slots of admitted sequences.
  std::vector<StateCopy> state_restores;
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  /// num_state_slots > 0 (hybrid models): every running sequence holds one state slot,
  /// taken at admission and given back on preemption and removal.
  Scheduler(BlockManager& blocks, int64_t max_num_seqs, int64_t max_batched_tokens,
            int64_t num_state_slots = 0);

  void add(std::unique_ptr<Sequence> seq);
  /// Picks this step's work: running sequences first (decode and unfinished prefill, in
  /// admission order), then waiting ones FCFS. Preempts the newest running sequence when
  /// pages run out. With a step-time target (set_step_time_target) and a fitted model: every
  /// decode row first, then prompt chunks sized so that the step's predicted time meets the
  /// target, within the token budget; see set_step_time_target for the starvation rule.
  ScheduledBatch schedule();
  /// The step-time policy. target_s > 0: that many seconds per step; < 0: auto, the predicted
  /// time of a decode step over every live sequence (running, and waiting ones up to
  /// max_num_seqs counted as decode rows) times clamp(1.25 / (1 - u), 2, 3), u the share of time
  /// the prompts that arrived over the last ~2 s need for their prefill (so that prefill keeps
  /// up with arrivals, 25% to spare), or, with decode_factor >= 1 (the decode step then at least
  /// the measured decode-only steps' average), times max(decode_factor,
  /// 1.25 / (1 - min(u, 0.95))): a ratio of step to decode-only step (the ITL goal p99 <= 3x
  /// p50 is a ratio) that the arriving prompt work raises, without the cap of 3; 0: off (the
  /// token budget only). Never starved: a step with prompt work computes at least
  /// min_prefill_chunk prompt tokens (within the token budget and what is left of the
  /// prompts), whatever the decode rows take.
  void set_step_time_target(double target_s, int64_t min_prefill_chunk = 16,
                            double decode_factor = 0);
  /// After a step's forward (and sampling): its measured duration, for the model.
  void observe_step(const StepShape& shape, double seconds);
  const StepCostModel& cost_model() const { return cost_; }
  /// The target the last schedule() sized prefill to (seconds; 0: it did not). Until the
  /// model is fit (StepCostModel::ready) the policy's steps take min_prefill_chunk * 2^k
  /// prompt tokens at most, k the steps seen so far.
  double last_step_target() const { return last_target_s_; }
  /// The clock of arrival and queue times (seconds; default: steady_clock).
  void set_clock(std::function<double()> clock) { clock_ = std::move(clock); }
  /// Seconds from add() to first scheduled, per admitted sequence (kQueueTimeBounds).
  const HistogramCounts& queue_time() const { return queue_time_; }
  /// Tokens per non-empty schedule() (kIterationTokensBounds).
  const HistogramCounts& iteration_tokens() const { return iteration_tokens_; }
  /// After the forward: marks the scheduled tokens computed and publishes full prompt
  /// pages to the prefix cache.
  void commit(const ScheduledBatch& batch);
  /// Removes a sequence (finished or aborted) and frees its pages.
  std::unique_ptr<Sequence> remove(const std::string& id);
  Sequence* find(const std::string& id);
  std::vector<std::string> live_ids() const;

  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t preemptions() const { return preemptions_; }
  /// State slots not held by a running sequence (0 for a model without states).
  int64_t num_free_state_slots() const { return slots_.num_free(); }
  /// A free state slot taken for a sequence to come (a device transfer writes it), or -1 (none
  /// free, or no states); give it back with release_state_slot or hand it to a sequence
  /// (Sequence::state_slot) that then owns it.
  int32_t reserve_state_slot() { return stateful_ ? slots_.allocate() : -1; }
  void release_state_slot(int32_t slot) { slots_.release(slot); }
  /// Hybrid models' prefix cache: prompt prefill chunks end at every multiple of `interval`
  /// tokens (a multiple of the page size), where commit() checkpoints the state into one of
  /// `capacity` slots from `first_slot` on; admission resumes a prompt from the deepest
  /// checkpoint its cached pages reach. Requires state slots and an enabled prefix cache.
  void enable_state_checkpoints(int32_t first_slot, int64_t capacity, int64_t interval);
  /// The checkpoints commit() asks for (src: a running slot, dst: a checkpoint slot), to be
  /// copied before the next forward; clears the list.
  std::vector<StateCopy> take_state_saves() { return std::move(state_saves_); }
  const StateCheckpoints* state_checkpoints() const { return checkpoints_.get(); }

 private:
  ScheduledBatch schedule_timed();
  void decay_arrivals(double now);
  void finish_batch(ScheduledBatch& batch);
  void admitted(Sequence& s);
  bool ensure_pages(Sequence& seq, int64_t num_tokens);
  void preempt(Sequence* seq);
  void free_pages(Sequence& seq);
  void release_slot(Sequence& seq);
  // Prefill chunks stop at the next checkpoint position (hybrid prefix cache).
  int64_t limit_chunk(const Sequence& seq, int64_t chunk) const;
  // Admission with a prefix match: keeps the pages up to the deepest checkpoint; returns the
  // checkpoint slot to restore (-1: none, start from zero).
  int32_t match_with_checkpoint(Sequence& seq, int64_t max_pages);

  BlockManager& blocks_;
  int64_t max_num_seqs_;
  int64_t max_batched_tokens_;
  std::unordered_map<std::string, std::unique_ptr<Sequence>> seqs_;
  std::list<Sequence*> running_;  // admission order
  std::deque<Sequence*> waiting_;
  int64_t preemptions_ = 0;
  StateSlotAllocator slots_;
  bool stateful_ = false;
  std::unique_ptr<StateCheckpoints> checkpoints_;
  int64_t checkpoint_interval_ = 0;
  std::vector<StateCopy> state_saves_;
  double target_s_ = 0;
  int64_t min_prefill_chunk_ = 16;
  double decode_factor_ = 0;
  double decode_step_s_ = 0;  // measured decode-only steps, exponentially averaged (0.9)
  double last_target_s_ = 0;
  StepCostModel cost_;
  std::function<double()> clock_;
  HistogramCounts queue_time_;
  HistogramCounts iteration_tokens_;
  // Prompt work arrived lately (auto target): tokens and their context, decayed by
  // exp(-age / kArrivalWindowS).
  static constexpr double kArrivalWindowS = 2.0;
  double arrived_tokens_ = 0, arrived_context_ = 0, arrivals_at_ = 0;
};

}  // namespace tandem
