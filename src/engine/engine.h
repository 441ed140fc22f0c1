// The engine: continuous batching over one model instance.
//   step(): schedule -> build the batch -> forward -> sample -> post-process.
// With MTP speculative decoding on, a SpecDecoder (engine/spec_decoder.h) joins the step at
// a few points; the step itself is the same.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>

#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/spec_decoder.h"
#include "kv/block_manager.h"
#include "kv/kv_cache.h"
#include "model/model.h"

namespace tandem {

struct EngineConfig {
  int64_t page_size = 16;             // tokens per KV page
  int64_t num_pages = 0;              // 0: derived from kv_cache_mb
  int64_t kv_cache_mb = 512;          // KV budget when num_pages is 0
  int64_t max_num_seqs = 64;          // running sequences at most
  int64_t max_batched_tokens = 1024;  // tokens per step (chunked prefill budget)
  // Prompt chunks sized to a per-step time target (Scheduler::set_step_time_target): > 0 that
  // many ms, < 0 auto (twice the decode rows' predicted time), 0 off (the token budget only).
  double step_time_target_ms = 0;
  int64_t min_prefill_chunk = 16;  // prompt tokens a step computes at least (policy on)
  // Auto target (step_time_target_ms < 0): > 0 that many times the predicted decode-only step
  // over the live sequences; 0 the arrival rule (Scheduler::set_step_time_target).
  double step_time_factor = 0;
  // Non-empty: one CSV line per step to this file (t_s, decode_rows, decode_context,
  // prefill_tokens, prefill_context, target_ms, predicted_ms, measured_ms), the step-time
  // model's prediction made before the step, so that the policy's model can be checked.
  std::string step_trace_path;
  // Model::warm_up at construction: the CUDA model captures its decode graphs for every batch
  // size up to max_num_seqs before the first request (as vLLM does at startup) instead of on
  // first use, where a capture stalls every running sequence's next token.
  // Start-up phases for a person watching (server/startup.h): called with "graphs" before
  // the warm-up's captures (the KV cache and state slots are allocated by then). Null: none.
  std::function<void(const std::string& phase)> on_startup_phase;
  bool warm_up = false;
  int64_t max_model_len = 0;   // 0: the model's max_position_embeddings
  int64_t max_waiting = 1024;  // queue limit; submit beyond it fails (429)
  bool enable_prefix_cache = true;
  // --deterministic: batch-invariant numerics, a request's tokens and logprobs independent of
  // the batch it shares, its chunking and prefix-cache hits. The CPU model is so by
  // construction; the GPU model takes it as CudaModelOptions::deterministic (the CLI passes it
  // on; the engine itself schedules as usual).
  bool deterministic = false;
  // Hybrid models (recurrent state per sequence): the prefix cache checkpoints the state every
  // state_checkpoint_interval prompt tokens (rounded up to whole pages) into at most
  // num_state_checkpoints slots, out of the kv_cache_mb budget (0: max_num_seqs, and when the
  // pages are sized from kv_cache_mb at most a quarter of what the live states leave).
  int64_t state_checkpoint_interval = 64;
  int64_t num_state_checkpoints = 0;
  // MTP speculative decoding (engine/spec_decoder.h): drafts per sequence and step, 1..4 (0:
  // off). The model's MTP layer must be loaded (Model::load_mtp); its KV pages are counted
  // with the target's.
  int64_t num_speculative_tokens = 0;
  // Benchmarks only, NOT lossless: accept each draft with this probability whatever the
  // target says (models a given acceptance rate on random weights); < 0: off.
  double spec_forced_accept_prob = -1.0;
  // Hybrid models: a verify step keeps its DeltaNet recurrence inputs and a rejected draft's
  // state rolls back by replaying them (Model::replay_states) instead of a second forward over
  // the accepted tokens. Off (false here: tests compare the two rollbacks): a forward, as for a
  // model that cannot replay.
  bool spec_state_replay = true;
  // Tests only: may replace a sequence's drafts after the MTP drafted them (given its tokens
  // so far); replaced drafts count as deterministic (q one-hot) in rejection sampling.
  using SpecHookFn = std::function<void(const std::string& id, std::span<const int32_t> tokens,
                                        std::vector<int32_t>& drafts)>;
  SpecHookFn spec_draft_hook;
  // Builds the constraint of a request that carries only GenRequest::constraint_spec (a
  // request from a router); empty: such a request is refused (kInvalidArgument).
  ConstraintFactory constraint_factory;
  // KV events (--kv-events-config): the prefix cache's block stores and evictions, handed to
  // this sink after each step (events/ publishes them as vLLM does). Null: none recorded.
  std::shared_ptr<KvEventSink> kv_events;
};

/// Single-threaded engine core. Not thread-safe; AsyncEngine wraps it in a thread.
class Engine {
 public:
  Engine(Model& model, const EngineConfig& config);

  /// Validates and queues a request (throws Error as EngineClient::submit documents).
  void add(GenRequest request, OutputCallback on_output);
  /// Disaggregated decode: reserves KV pages for a request whose prompt KV another instance
  /// will write (the transfer engine). Returns false when the pool cannot supply them now.
  bool reserve_pages(int64_t num_tokens, std::vector<int32_t>& pages);
  /// Hybrid models over a device transfer (TransferBackend::carries_device_state): reserves the
  /// state slot the transfer writes the prompt's state into (TransferDescriptor::dst_state_slot);
  /// -1 when none is free. add_prefilled(..., state_slot) hands it to the sequence, else
  /// release_state_slot gives it back.
  int32_t reserve_state_slot();
  void release_state_slot(int32_t slot);
  /// Gives reserved pages back (a transfer that failed or was cancelled).
  void release_pages(const std::vector<int32_t>& pages);
  /// Disaggregated decode: adds a request whose prompt KV is already in `pages` (reserved
  /// above and filled by the transfer engine) and whose first token was sampled by the
  /// prefill instance. The first token is reported through on_output at once; decoding
  /// continues from it (a seeded stream skips the draw the prefill instance used for it).
  /// Takes ownership of the pages.
  /// Hybrid models: `state` is the prompt's final recurrent state (state_slot_elems floats,
  /// the layout of Model::state_slot_elems), restored into the sequence's slot at admission;
  /// or, with `state_slot` >= 0 (reserve_state_slot, written by a device transfer) and `state`
  /// empty, the sequence runs in that slot, which it then owns.
  /// Speculating: `prompt_hidden` ([n - prompt_hidden_begin, hidden]; may be empty) are the
  /// target's final hidden states of prompt positions prompt_hidden_begin..n - 1 as the
  /// prefill computed them. The first step that schedules the sequence leaves it out of the
  /// target's batch and runs the MTP layer over those positions instead (in draft()'s pass 0,
  /// as a single engine does over a prompt it computed), so the MTP KV holds the prompt and
  /// the sequence's first decode step verifies drafts, as in one engine.
  void add_prefilled(GenRequest request, OutputCallback on_output, std::vector<int32_t> pages,
                     int32_t first_token, float first_logprob, std::vector<float> state = {},
                     std::vector<float> prompt_hidden = {}, int64_t prompt_hidden_begin = 0,
                     int32_t state_slot = -1);
  /// Hybrid models: a live running sequence's recurrent state (its state slot), e.g. for a
  /// prefill instance to send after the prompt; empty when it holds none.
  std::span<const float> sequence_state(const std::string& id);
  /// Throws Error(kInvalidArgument) for a request that can never run. Thread-safe.
  void validate(const GenRequest& request) const;
  /// The constraint built from request.constraint_spec with config().constraint_factory
  /// (compiles its grammar, cached by the factory); null for a request without a spec.
  /// Thread-safe (an instance builds it off the engine thread where it can). add() and
  /// add_prefilled() call it for a request with a spec and no constraint.
  std::shared_ptr<TokenConstraint> constraint_from_spec(const GenRequest& request) const;
  /// Aborts a request: pages freed now, finished callback with kAbort.
  void abort(const std::string& id);
  void abort_all();
  /// Runs one step: schedule() -> forward() -> complete(). Returns false when there was
  /// nothing to do.
  bool step();

  // The parts of step(), for the role loops (prefill TP, decode DP) that add their own work
  // between them (broadcast the batch, send KV, forward an empty batch in lockstep).
  /// Picks this step's work; an empty batch when there is none.
  ScheduledBatch schedule();
  /// Runs the model on the batch. An empty batch is forwarded too (a decode DP rank serves its
  /// experts to the other ranks). When the model throws, the batch's requests finish with
  /// kError and false is returned (complete() must then not be called).
  bool forward(const ScheduledBatch& batch);
  /// Marks the batch computed, samples, streams outputs and finishes requests.
  void complete(const ScheduledBatch& batch);
  bool has_work() const { return scheduler_.has_work(); }
  /// Hybrid models: the state copies (running slot -> prefix-cache checkpoint slot) the last
  /// complete() made, e.g. for a prefill instance's other ranks to make the same ones.
  const std::vector<StateCopy>& last_state_saves() const { return last_state_saves_; }
  /// Hybrid models: state slots not held by a running sequence (of max_num_seqs).
  int64_t num_free_state_slots() const { return scheduler_.num_free_state_slots(); }

  EngineStats stats() const;
  /// Hybrid models: rolled-back sequences whose state Model::replay_states recomputed (the
  /// others took a second forward).
  int64_t state_replays() const { return spec_ ? spec_->state_replays() : 0; }
  int64_t max_model_len() const { return config_.max_model_len; }
  const EngineConfig& config() const { return config_; }
  const Model& model() const { return model_; }
  const BlockManager& blocks() const { return blocks_; }
  /// A hybrid's prefix-cache state checkpoints (null: none).
  const StateCheckpoints* state_checkpoints() const { return scheduler_.state_checkpoints(); }
  /// Hands the prefix cache's block events so far to EngineConfig::kv_events (called after each
  /// step; never blocks).
  void flush_kv_events();
  /// The KV pages (the transfer engine writes reserved pages of prefilled requests here).
  KvCache& kv_cache() { return kv_; }

 private:
  void process_outputs(const ScheduledBatch& batch, const std::vector<float>& logits);
  void copy_states(const std::vector<StateCopy>& copies);
  /// The batch's rows as device sampling requests; false when a row needs host logits
  /// (prompt logprobs, penalties, min_tokens masking).
  bool device_rows(const ScheduledBatch& batch, std::vector<DeviceSampling>& rows) const;
  void finish(Sequence& seq, FinishReason reason, StepOutput& out);
  /// Finishes on EOS / stop id / length, else reports the output.
  void finish_if_done(Sequence& seq, StepOutput& out);
  /// Why the sequence ends after its last token (kNone: it goes on); sets out.stop_token_id.
  FinishReason finish_reason_of(const Sequence& seq, StepOutput& out) const;

  /// Constrained rows that sample this step: their masks filled on the worker (during the
  /// forward; process_outputs waits).
  void start_masks(const ScheduledBatch& batch);

  Model& model_;
  EngineConfig config_;
  BlockManager blocks_;
  KvCache kv_;
  Scheduler scheduler_;
  std::vector<float> logits_;
  std::vector<DeviceSampling> device_rows_;
  std::vector<SampledToken> sampled_;  // this step's tokens when sampled on the device
  bool sampled_on_device_ = false;
  std::unique_ptr<MaskWorker> masks_;  // created at the first constrained request
  EngineStats counters_;
  std::unique_ptr<SpecDecoder> spec_;                 // MTP speculative decoding; null when off
  std::vector<StateCopy> last_state_saves_;           // complete()'s checkpoint copies (hybrids)
  std::chrono::steady_clock::time_point step_start_;  // schedule() -> complete(): the step time
  // EngineConfig::step_trace_path: the file, and this step's target and prediction.
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> trace_{nullptr, &std::fclose};
  double trace_target_s_ = 0, trace_predicted_s_ = 0;
  std::chrono::steady_clock::time_point trace_t0_;
};

/// The engine on its own thread, behind the thread-safe EngineClient interface.
class AsyncEngine final : public EngineClient {
 public:
  AsyncEngine(std::unique_ptr<Model> model, const EngineConfig& config);
  ~AsyncEngine() override;

  void submit(GenRequest request, OutputCallback on_output) override;
  void abort(const std::string& id) override;
  EngineStats stats() const override;
  int64_t max_model_len() const override { return engine_.max_model_len(); }
  int64_t vocab_size() const override { return model_->config().vocab_size; }
  std::vector<int32_t> eos_token_ids() const override;
  const Model& model() const { return *model_; }

 private:
  void loop();

  std::unique_ptr<Model> model_;
  Engine engine_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<GenRequest, OutputCallback>> incoming_;
  std::vector<std::string> aborts_;
  int64_t pending_ = 0;  // submitted, not yet handed to the engine
  EngineStats last_stats_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tandem
