// The interface every model implementation (CPU or CUDA, any architecture) offers the engine,
// and the host references of its speculative-decoding methods.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/forward_batch.h"

namespace tandem {

/// The interface every model implementation (CPU now, CUDA later) offers the engine.
class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  /// KV geometry for a cache of num_pages pages of page_size tokens.
  virtual KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const = 0;
  /// The KV cache forward() writes into: host fp32 pools by default; a GPU model allocates
  /// device pools.
  virtual KvCache make_kv_cache(int64_t num_pages, int64_t page_size) {
    return KvCache(kv_geometry(num_pages, page_size));
  }
  /// The KV cache size (MiB) this model would take when the engine is given none
  /// (EngineConfig::kv_cache_mb <= 0); 0: no preference (the engine's default).
  virtual int64_t kv_cache_mb_hint() const { return 0; }
  /// Hybrid models: floats of one sequence's recurrent state over all its layers (one
  /// KvCache state slot; every sequence of a batch passes its ForwardSeq::state_slot). 0: the
  /// model keeps no per-sequence state.
  virtual int64_t state_slot_elems() const { return 0; }
  /// Hybrid models, speculative decoding: rolls recurrent states forward over a prefix of the
  /// last forward's chunks without a forward. Each replay's state slot holds the state before
  /// its chunk again (the engine restored it); its state becomes the one after the chunk's
  /// first `count` tokens, recomputed from the per-token inputs of the recurrence that the last
  /// forward / forward_sample kept (ForwardBatch::keep_recurrent_inputs; no other forward may
  /// run in between, MTP passes may). Returns false, changing nothing, when that forward kept
  /// none (the engine then runs those tokens through forward()). Rank-local: no collective.
  virtual bool replay_states(const std::vector<StateReplay>& replays, KvCache& kv) {
    (void)replays;
    (void)kv;
    return false;
  }
  /// Hybrid models on prefill TP ranks: the whole state of `slot` (HybridStateLayout::full in
  /// model/hybrid_state.h: every DeltaNet head) merged from the ranks' heads by the model itself
  /// (a GPU model on its devices, not through the host). Collective: every rank of the group
  /// calls it for the same slots in the same order; rank `root` gets the whole state in `out`,
  /// the others an empty vector. Returns false, changing nothing, when the model does not
  /// gather (the caller merges the parts over its communicator: gather_hybrid_state).
  virtual bool gather_state(KvCache& kv, int64_t slot, int root, std::vector<float>& out) {
    (void)kv;
    (void)slot;
    (void)root;
    (void)out;
    return false;
  }
  /// As gather_state, but the whole state stays on the device (for a device-to-device state
  /// transfer, TransferSender::send_state_from): collective in the same way (a rank may call
  /// gather_state while another calls this for the same slot: the collective part is the same);
  /// returns, on every rank, the model's device buffer holding the whole state
  /// (HybridStateLayout::full(config()).slot_elems() floats), written in the model's stream
  /// order and valid until the next gather or forward. Null, changing nothing, when the model
  /// does not gather on the device.
  virtual const float* gather_state_device(KvCache& kv, int64_t slot) {
    (void)kv;
    (void)slot;
    return nullptr;
  }
  /// Whether gather_state_device gives the whole state (a prefill TP rank of a GPU hybrid).
  virtual bool gathers_state_on_device() const { return false; }
  /// Runs the batch, writing new KV into `kv` and the requested logits rows
  /// ([batch.num_logit_rows(), vocab], fp32) into `logits`.
  virtual void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) = 0;
  // MTP speculative decoding (engine/speculative.h). The draft / verify / accept split: the
  // engine verifies with forward() (several tokens per sequence, logits for each, hidden_out),
  // and drafts with mtp_forward(), one pass over every drafting sequence per draft position.
  /// Loads the MTP layer (mtp.* tensors) from the checkpoint in `dir` (the model's own
  /// directory or a separate one). Throws kNotFound naming the directory when it has none,
  /// kUnsupported for a model without MTP support.
  virtual void load_mtp(const std::string& dir);
  virtual bool has_mtp() const { return false; }
  /// True when an MTP pass is collective (a decode DP/EP rank of a group of several whose MTP
  /// layer's MoE block is sharded by experts, as the target's): every rank of the group then
  /// makes the same number of mtp_forward / mtp_forward_sample calls per step, in the same
  /// order, a rank without drafting rows with an empty batch (it still serves its experts).
  /// Engine::draft runs exactly num_speculative_tokens passes per step then (mtp_passes).
  virtual bool mtp_collective() const { return false; }
  /// The MTP layer's own KV pool: one layer, indexed by the same page ids (block tables) as
  /// the target's KV, so a page holds both and admission counts both.
  virtual KvGeometry mtp_kv_geometry(int64_t num_pages, int64_t page_size) const;
  /// One MTP pass. batch.seqs[i].tokens are the tokens t + 1 for positions start_pos..,
  /// `hidden` [batch.num_tokens(), hidden] the hidden states at positions t (the target's
  /// hidden_out, or the previous pass's `hidden_out` when chaining); writes the MTP KV of those
  /// positions into `mtp_kv`. `logits` [rows, vocab] and `hidden_out` [rows, hidden] (after
  /// mtp.norm) for the rows the batch asks logits of (ForwardBatch::logit_token_rows).
  virtual void mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                           std::vector<float>& logits, std::vector<float>& hidden_out);
  /// Before serving: captures what the model would otherwise capture on first use (the CUDA
  /// model's decode graphs for every batch-size bucket up to max_batch), so that no request
  /// pays for it mid-stream. May write into `kv` (contents the engine has not handed out).
  virtual void warm_up(KvCache& kv, int64_t max_batch) {
    (void)kv;
    (void)max_batch;
  }
  /// As warm_up, for speculative decoding with K drafts: verify steps of K + 1 tokens per
  /// sequence and chained (one-token) MTP passes (the CUDA model's verify and draft graphs of
  /// every bucket up to max_batch). May write into `kv` and `mtp_kv` as warm_up does.
  virtual void warm_up_speculative(KvCache& kv, KvCache& mtp_kv, int64_t max_batch, int64_t k) {
    (void)kv;
    (void)mtp_kv;
    (void)max_batch;
    (void)k;
  }
  /// The MTP layer's KV cache (mtp_kv_geometry): host pools by default, zero-filled (as a GPU
  /// model's device pools): a decode instance never writes the MTP KV of prompt positions
  /// (the prefill instance computed the prompt), so a fresh page reads zeros, never garbage.
  virtual KvCache make_mtp_kv_cache(int64_t num_pages, int64_t page_size);
  /// As mtp_forward, sampling each logits row on the device with rows[i] (samples_on_device():
  /// the logits never leave it); out gets one entry per row.
  virtual void mtp_forward_sample(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                                  const std::vector<DeviceSampling>& rows,
                                  std::vector<SampledToken>& out, std::vector<float>& hidden_out);
  /// True when mtp_draft_chain() runs (a GPU model: the drafts' hidden states and logits stay
  /// on the device, one host sync per chain).
  virtual bool mtp_drafts_on_device() const { return false; }
  /// A whole chain of greedy MTP drafts: pass 0 as mtp_forward over `first`, its hidden input
  /// the target's final hidden states of the last forward / forward_sample (batch order: row
  /// hidden_rows[t] for token t of `first`; the engine asks no hidden_out then), then chain[0],
  /// chain[1], ... (MtpChainPass: every logits row of pass 0 once per pass). drafts[p][i]: the
  /// argmax (ties: the lowest id) of pass p's logits row i, p = 0 .. chain.size(); a row's
  /// drafts past its writes are unspecified. No forward may run between the target's and this.
  virtual void mtp_draft_chain(const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                               const std::vector<MtpChainPass>& chain, KvCache& mtp_kv,
                               std::vector<std::vector<int32_t>>& drafts);
  /// True when forward_verify_draft() runs on the model's device in one go (one host
  /// synchronisation per speculative step).
  virtual bool fuses_verify_and_draft() const { return false; }
  /// A steady speculative decode step in one call (greedy device drafts). Every
  /// sequence of `batch` is a verify chunk (its last token, then its drafts; logits kAll) or a
  /// one-token decode (kLast); its block table covers the verify positions, and as many of the
  /// chained drafts' positions as it can (start + drafts + num_drafts). Runs forward_sample
  /// with `rows` (out: one entry per row), then per sequence i: a_i = min(forced[i], drafts) when
  /// forced[i] >= 0, else the leading drafts equal to the sampled token of the row before each;
  /// then its next drafts as draft() would make them after a_i + 1 tokens: the MTP layer over
  /// positions start .. start + a_i (the token at t + 1: the accepted drafts, then row a_i's
  /// token; the target's hidden states), its row's argmax, chained num_drafts - 1 times at
  /// positions start + a_i + 1 ... Drafts at positions past the block table are unspecified; MTP
  /// KV past the sequence's tokens may be written (it is rewritten before it is read).
  /// Hybrid models (state_slot_elems() > 0): every sequence's state is then the one after
  /// position start + a (step.spare_slots: a free slot per verify sequence for the step's use).
  /// With a collective MTP layer (mtp_collective(): a decode EP rank) the forward is the rank's
  /// lockstep forward and the MTP passes are exactly num_drafts (pass 0, then the chained ones,
  /// each one exchange whatever rows it has), as many as an unfused step runs (and pads to).
  /// The default: snapshot_verify_states, forward_sample (keeping the recurrence inputs),
  /// verify_draft_on_host, then rollback_verify_states.
  virtual void forward_verify_draft(const ForwardBatch& batch, KvCache& kv,
                                    const std::vector<DeviceSampling>& rows, KvCache& mtp_kv,
                                    VerifyDraftStep& step, std::vector<SampledToken>& out);
  /// True when forward_sample() is available (a GPU model: the logits never leave it).
  virtual bool samples_on_device() const { return false; }
  /// Runs the batch and samples each logits row (batch order: kLast rows, and every row of a
  /// kAll sequence) on the device with rows[i]; out gets one entry per row. Fills
  /// batch.hidden_out as forward() does. `wait_masks` (when set) is called once the forward is
  /// enqueued and before any rows[i].mask is read.
  virtual void forward_sample(const ForwardBatch& batch, KvCache& kv,
                              const std::vector<DeviceSampling>& rows,
                              std::vector<SampledToken>& out,
                              const std::function<void()>& wait_masks = {});
};

/// Model::mtp_draft_chain's meaning on the host, from the target's hidden states
/// `target_hidden` ([tokens of the target's batch, hidden], batch order) with mtp_forward: each
/// chained pass runs its live rows only (none: an empty pass with a collective MTP layer, so
/// that every pass of the chain runs); a row past its drafts keeps its last draft. The
/// reference the device chains are tested against (a test model that drafts "on its device").
void mtp_draft_chain_on_host(Model& model, std::span<const float> target_hidden,
                             const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                             const std::vector<MtpChainPass>& chain, KvCache& mtp_kv,
                             std::vector<std::vector<int32_t>>& drafts);

/// Model::forward_verify_draft after its forward_sample, on the host: the accepted drafts from
/// `sampled` and the next drafts through mtp_draft_chain_on_host over the target's hidden states
/// `target_hidden` ([batch tokens, hidden], batch order). The reference of the fused device step.
void verify_draft_on_host(Model& model, std::span<const float> target_hidden,
                          const ForwardBatch& batch, const std::vector<SampledToken>& sampled,
                          KvCache& mtp_kv, VerifyDraftStep& step);

/// The host reference of Model::forward_verify_draft's state handling for hybrid models (nothing
/// for a model without state slots): before the verify, snapshot_verify_states copies each
/// verify sequence's state into its step.spare_slots slot; after verify_draft_on_host,
/// rollback_verify_states gives each sequence that accepted fewer drafts than it verified
/// (step.accepted) its snapshot back and replay_states over its kept positions (throws when the
/// verify kept no recurrence inputs).
void snapshot_verify_states(Model& model, const ForwardBatch& batch, const VerifyDraftStep& step,
                            KvCache& kv);
void rollback_verify_states(Model& model, const ForwardBatch& batch, const VerifyDraftStep& step,
                            KvCache& kv);

}  // namespace tandem
