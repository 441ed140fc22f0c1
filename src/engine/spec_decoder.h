// MTP speculative decoding as one part of the engine: the SpecDecoder owns drafting,
// verification (acceptance), the fused verify + draft step and the rollback of rejected
// positions (KV pages, hybrid recurrent states). The engine holds one when
// num_speculative_tokens > 0 and calls it at a few points of its step:
//   schedule(): prepare()         hold prefilled prompts, ask the hidden states it needs
//   forward():  device_rows()     the verify chunks' device sampling rows
//               forward()         the fused step (true), else the hybrid state snapshots
//   complete(): accept()          a verify chunk's drafts accepted, its tokens appended
//               note_computed()   positions the MTP layer must follow
//               finish_step()     the next drafts, hybrid states rolled back
//   (error):    abort_step()      a failed forward's MTP passes (collective layers)
// The acceptance rule itself and the configuration live in engine/speculative.h; the model
// side is Model's MTP methods (model/model.h).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/request.h"
#include "engine/scheduler.h"
#include "kv/block_manager.h"
#include "kv/kv_cache.h"
#include "model/model.h"

namespace tandem {

struct EngineConfig;

/// What the decoder asks of the engine that owns it.
struct SpecEngineHooks {
  /// Why the sequence ends after its last token (EOS, stop id, max_tokens, the context end);
  /// kNone: it goes on. Sets out.stop_token_id.
  std::function<FinishReason(const Sequence& s, StepOutput& out)> stop_reason;
  /// Ends a sequence (pages freed, its finished callback).
  std::function<void(Sequence& s, FinishReason reason, StepOutput& out)> finish;
};

class SpecDecoder {
 public:
  /// `config` is the engine's resolved configuration (num_speculative_tokens > 0); every
  /// reference must outlive the decoder. Creates the MTP layer's KV cache (the target's page
  /// ids) and sizes counters.spec_accepted_per_pos.
  SpecDecoder(Model& model, const EngineConfig& config, BlockManager& blocks, KvCache& kv,
              Scheduler& scheduler, EngineStats& counters, SpecEngineHooks hooks);

  /// Model::warm_up_speculative: verify steps of K + 1 tokens and the chained draft passes.
  void warm_up();
  /// Engine::add_prefilled: keeps the prompt's hidden states (rows of positions
  /// [begin, prompt_len)) for the MTP pass over the prompt when s is first scheduled.
  void add_prefilled(Sequence& s, std::vector<float> prompt_hidden, int64_t begin);

  // ---- the step's call points -----------------------------------------------------------
  /// After scheduling: takes prefilled sequences' first decode rows out of the batch (their
  /// MTP pass over the prompt runs in finish_step), and asks the forward for what drafting
  /// and rollback need (final hidden states on the host, the recurrence inputs).
  void prepare(ScheduledBatch& batch);
  /// True when the step has work without a target forward (held prefilled prompts).
  bool has_held_prompts() const { return !held_.empty(); }
  /// A row of this step as device sampling: false when it needs host logits (a host-rule
  /// sampled request, a constrained verify chunk, ...). Appends a verify chunk's rows (one
  /// per position) to `rows`; other rows are the engine's.
  bool device_rows(const ScheduledSeq& ss, std::vector<DeviceSampling>& rows) const;
  /// Before the target's forward. Draws the benchmarks' forced acceptances; runs the whole
  /// step fused (Model::forward_verify_draft, `rows` the device rows, null when the step
  /// needs host logits) and returns true, `sampled` then holding the rows' tokens; else
  /// snapshots the verify chunks' hybrid states and returns false (the engine forwards).
  bool forward(const ScheduledBatch& batch, const std::vector<DeviceSampling>* rows,
               std::vector<SampledToken>& sampled);
  /// A verify chunk's outputs: accepts its drafts from the target's rows (host `logits`
  /// [rows, vocab] from first_row, or `sampled` when the rows were sampled on the device),
  /// appends the accepted tokens and the target's next one to s.tokens and `out`, releases
  /// the pages past them. Returns why the sequence finishes (kNone: the engine emits `out`).
  FinishReason accept(const ScheduledSeq& ss, const std::vector<float>& logits,
                      const std::vector<SampledToken>* sampled, int64_t first_row,
                      int64_t hidden_row, StepOutput& out);
  /// Positions [start, start + count) of s computed this step (the forward's hidden rows
  /// from hidden_row on): the MTP layer runs over them in finish_step.
  void note_computed(const Sequence& s, int64_t start, int64_t count, int64_t hidden_row);
  /// After the outputs (or for an empty step): the MTP layer over the computed positions and
  /// the next drafts of every decoding sequence; then hybrid states of rejected drafts rolled
  /// back. A collective MTP layer runs exactly K passes.
  void finish_step();
  /// The forward failed (its sequences finished): a collective MTP layer still runs the
  /// step's K passes, empty.
  void abort_step() {
    fused_ = false;
    pad_mtp_passes(0);
  }

  /// Hybrid models: rolled-back sequences whose state Model::replay_states recomputed.
  int64_t state_replays() const { return state_replays_; }

 private:
  // A sequence's target positions [start, start + count) computed this step (hidden_ rows from
  // hidden_row on).
  struct Computed {
    std::string id;
    int64_t start = 0, count = 0, hidden_row = 0;
  };
  // A prefilled prompt held out of the target's batch: its positions and transferred hidden
  // rows ([count, hidden]).
  struct HeldPrompt {
    std::string id;
    int64_t start = 0, count = 0;
    std::vector<float> rows;
  };

  // Drafting (finish_step).
  /// The MTP layer over the computed positions, then the chained drafts: on the device in
  /// one call, or pass by pass through the host.
  void draft();
  /// Pass 0 and the chain in one model call (Model::mtp_draft_chain). Returns its passes.
  int64_t draft_chain_on_device(const ForwardBatch& first, const std::vector<int64_t>& hidden_rows,
                                const std::vector<Sequence*>& drafting,
                                const std::vector<int64_t>& num_drafts);
  /// Pass by pass, each pass's hidden states through the host; the rows' tokens sampled here
  /// unless on_device (the MTP's argmax there). Returns its passes.
  int64_t draft_on_host(const ForwardBatch& first, const std::vector<int64_t>& hidden_rows,
                        const std::vector<Sequence*>& drafting, std::vector<int64_t>& num_drafts,
                        bool on_device);
  /// After a fused step: the drafts the model made, where its accepted count is the host's.
  void adopt_fused_drafts(const std::vector<Computed>& computed);
  /// Tests: EngineConfig::spec_draft_hook over the drafting sequences' drafts.
  void apply_draft_hook(const std::vector<Sequence*>& drafting);
  /// The held prompts as Computed entries whose rows are appended to hidden_ (an entry of
  /// this step that continues one merged into it). True when there were any.
  bool take_held_prompts(std::vector<Computed>& computed);
  /// The drafts s may have: K within the context. Not bounded by max_tokens, as vLLM's: the
  /// verify stops emitting at max_tokens, and a batch whose every sequence verifies K drafts
  /// keeps the GPU's verify graphs.
  int64_t draft_limit(const Sequence& s) const;
  /// The drafts s gets after this step (0: none; draft_limit, and the pages its chained
  /// drafts write, allocated here).
  int64_t draft_budget(Sequence& s, const Computed& c);
  /// True when s's drafts can be the MTP's argmax on the model's device (no host logits).
  bool drafts_on_device(const Sequence& s) const;
  /// Runs empty MTP passes up to K after `done` ran this step, for a collective MTP layer
  /// (a decode EP rank's peers need its experts in every pass); nothing otherwise.
  void pad_mtp_passes(int64_t done);

  // The fused step (forward).
  /// Benchmarks (spec_forced_accept_prob): each verify chunk's accepted drafts.
  void draw_forced_accepts(const ScheduledBatch& batch);
  /// True when this step can run fused (every sequence a verify chunk or a one-token decode
  /// drafting on the device; a hybrid with the state replay on); allocates the pages its
  /// chained drafts write (false when the pool has none).
  bool can_fuse(const ScheduledBatch& batch);
  void forward_fused(const ScheduledBatch& batch, const std::vector<DeviceSampling>& rows,
                     std::vector<SampledToken>& sampled);

  // Hybrid states: copied to the spare slot before a verify, restored and replayed over the
  // kept positions after it (a fused step did both on the device).
  void snapshot_states(const ScheduledBatch& batch);
  void rollback_states();
  int64_t spare_state_slot(int32_t slot) const;

  Model& model_;
  const EngineConfig& config_;
  BlockManager& blocks_;
  KvCache& kv_;
  Scheduler& scheduler_;
  EngineStats& counters_;
  SpecEngineHooks hooks_;
  KvCache mtp_kv_;             // the MTP layer's KV (same page ids as kv_)
  std::vector<float> hidden_;  // [batch tokens, hidden] this step's target hidden states
  std::vector<Computed> computed_;
  std::vector<HeldPrompt> held_;
  std::vector<Computed> rollbacks_;  // verified sequences whose state must go back (hybrids)
  bool fused_ = false;               // this step ran Model::forward_verify_draft
  int64_t state_replays_ = 0;
  SamplerRng forced_accept_rng_{0x5eed};  // spec_forced_accept_prob draws
};

}  // namespace tandem
