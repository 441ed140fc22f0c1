// Qwen3.5 hybrid MoE on one GPU: bf16 weights in device memory, bf16 paged HND KV for the
// full-attention layers, fp32 per-sequence state slots (conv window + recurrent state per
// DeltaNet layer, the layout of Qwen35MoeCpu) in device memory, the layers built from the CUDA
// backend ops (backend/cuda/deltanet.h, gated_attention.h and the Qwen3 ones). Steps run
// through the CUDA model runner (model/cuda/runner.h: metadata with the DeltaNet sequences and
// their state slots, graphs, forward and sampling); this file holds the weights, the layers,
// the MTP layer and the fused speculative step.
// The (1 + w) zero-centred RMSNorm weights are stored as 1 + w (added in fp32 at load, then
// rounded to bf16). One GPU, or one rank of a sharded instance (CudaModelOptions::shard, as the
// CPU Qwen35MoeCpu splits it; the collectives of model/cuda/shard_comms.h):
//   prefill TP=t EP=t: gated attention heads split (KV heads replicated when t exceeds them),
//     o_proj row-parallel; DeltaNet split by heads (DeltaNetHeads: value heads hv / t with their
//     key heads; in_proj rows, conv channels, A_log / dt_bias and the state slots of those
//     heads; out_proj row-parallel); routed experts E / t (MoeLayer over its range); the shared
//     expert's intermediate split (its sigmoid gate replicated); one all-reduce after each
//     mixer and one after each MoE block; vocab-parallel lm_head; eager steps; the whole state
//     of a prompt merged on the devices (gather_state);
//   decode DP=d EP=d: attention, DeltaNet, router, shared expert and lm_head replicated, each
//     rank its own sequences, KV pages and state slots; routed experts E / d through the
//     dispatch / combine inside the decode and verify graphs; every step collective (a rank
//     without sequences runs a zero-token one); the MTP layer's experts through the same
//     exchange (mtp_collective: exactly K passes per step, eager).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "model/cuda/factory.h"
#include "model/cuda/options.h"
#include "model/cuda/stage_clock.h"
#include "model/model.h"

namespace tandem {

namespace cuda_model {
class CudaRunner;
}

class Qwen35MoeCuda final : public Model {
 public:
  /// Loads config.json (model_type qwen3_5_moe or qwen3_5_moe_text) and the safetensors weights
  /// of `dir` (both layouts; experts fused 3D or one tensor per expert). Throws kUnsupported,
  /// naming config.json and the field, for shapes the CUDA ops do not cover
  /// (check_cuda_model_config), kInvalidArgument naming what does not split over a sharded
  /// opts.shard (heads, experts, the shared expert's intermediate size).
  static std::unique_ptr<Qwen35MoeCuda> load(const std::string& dir, const CudaModelOptions& opts);
  ~Qwen35MoeCuda() override;

  const ModelConfig& config() const override { return config_; }
  /// bf16 pools of the full-attention layers only (num_layers = their count).
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const override;
  /// Device pools, zero-filled; the state slots (KvCache::allocate_states) go to device memory.
  KvCache make_kv_cache(int64_t num_pages, int64_t page_size) override;
  /// As Qwen35MoeCpu: per DeltaNet layer the conv window [conv_dim, kernel - 1], then the
  /// recurrent state [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim].
  int64_t state_slot_elems() const override;
  /// As Model::forward; every sequence needs a state slot of `kv` (a cache made by this model).
  void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) override;
  /// Samples on the GPU (backend/cuda/sampling.h): only tokens and logprobs come back.
  bool samples_on_device() const override { return true; }
  void forward_sample(const ForwardBatch& batch, KvCache& kv,
                      const std::vector<DeviceSampling>& rows, std::vector<SampledToken>& out,
                      const std::function<void()>& wait_masks = {}) override;
  int64_t kv_cache_mb_hint() const override;

  // MTP speculative decoding: the published Qwen3.5 layout of Qwen35MoeCpu::load_mtp
  // (model/qwen3_5_mtp.cpp) in bf16 on the device, its decoder layer run by this model's own
  // gated-attention and MoE (+ shared expert) code over its own one-layer paged KV on the
  // target's page ids; embedding and lm_head shared. forward() and forward_sample() fill
  // ForwardBatch::hidden_out (bf16-rounded, batch order); the DeltaNet states of rejected
  // drafts roll back through the device state slots (KvCache::copy_state, replay_states; inside
  // forward_verify_draft when the step is fused). Chained
  // draft passes (one token per sequence) replay CUDA graphs by batch bucket (captured at
  // warm-up or on first use) when CudaModelOptions::mtp_graphs is on and decode graphs are; other
  // passes run eagerly; verify steps replay graphs (set_verify_graphs).
  /// Loads the mtp.* tensors of `dir`; kNotFound naming `dir` when it has none.
  void load_mtp(const std::string& dir) override;
  bool has_mtp() const override;
  /// True on a decode EP rank of several with the MTP layer loaded (its experts sharded).
  bool mtp_collective() const override;
  /// Prefill TP: Model::gather_state on the devices (each rank's heads scattered into a zeroed
  /// whole layer, summed over the ranks by the all-reduce: exact); the root's copy comes to
  /// the host, and stays on the device (gathered_state). False elsewhere.
  bool gather_state(KvCache& kv, int64_t slot, int root, std::vector<float>& out) override;
  /// Prefill TP: the same gather, left on the device (Model::gather_state_device; no host copy,
  /// no synchronisation). Null elsewhere.
  const float* gather_state_device(KvCache& kv, int64_t slot) override;
  bool gathers_state_on_device() const override;
  /// The last gather_state's whole state on this rank's device ([HybridStateLayout::full(c)
  /// .slot_elems()] fp32; null before the first).
  const float* gathered_state() const;
  /// Model::replay_states on the device: a verify step (a verify graph always; an eager batch
  /// with keep_recurrent_inputs of at most max_num_seqs * 5 tokens, of any size on a decode EP
  /// rank, whose rollback cannot be a forward) copies each DeltaNet layer's
  /// in_proj rows aside (grown on demand: linear layers x tokens x the in_proj width, bf16;
  /// growing drops the verify graphs); the replay gathers the accepted rows and runs the conv
  /// and the delta rule over them per layer (no GEMM, no MoE).
  bool replay_states(const std::vector<StateReplay>& replays, KvCache& kv) override;
  /// One layer, the target's KV heads and head_dim, bf16.
  KvGeometry mtp_kv_geometry(int64_t num_pages, int64_t page_size) const override;
  /// Device pools, zero-filled.
  KvCache make_mtp_kv_cache(int64_t num_pages, int64_t page_size) override;
  void mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                   std::vector<float>& logits, std::vector<float>& hidden_out) override;
  void mtp_forward_sample(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                          const std::vector<DeviceSampling>& rows, std::vector<SampledToken>& out,
                          std::vector<float>& hidden_out) override;
  /// True once the MTP layer is loaded with the device chain on (set_device_chain): drafts chain
  /// on the device (mtp_draft_chain).
  bool mtp_drafts_on_device() const override;
  /// On by default (the faster on the H200: docs/perf.md); off for tests and benchmarks.
  void set_device_chain(bool on);
  bool device_chain() const;
  /// Model::mtp_draft_chain on the stream: pass 0's h_t gathered on the device from the last
  /// forward's final hidden states, each chained pass's tokens (the argmax of the pass before,
  /// DeviceSampler::argmax) and h_t (its mtp.norm rows) copied on the device; chained passes
  /// replay the MTP graphs of their buckets; one copy to the host and one synchronisation at
  /// the end.
  void mtp_draft_chain(const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                       const std::vector<MtpChainPass>& chain, KvCache& mtp_kv,
                       std::vector<std::vector<int32_t>>& drafts) override;
  /// True when the device chain is (mtp_drafts_on_device) and the fused step is on
  /// (set_fused_step; off for tests and benchmarks).
  bool fuses_verify_and_draft() const override;
  void set_fused_step(bool on);
  /// Model::forward_verify_draft with one host synchronisation: the verify forward (a verify
  /// graph when it fits; its DeltaNet recurrence inputs kept, each verify sequence's state after
  /// all its tokens written to its VerifyDraftStep::spare_slots slot) and its device sampler,
  /// the acceptance (spec_advance), then from the accepted counts on the device (spec_replay)
  /// the spare's state copied back where every draft was accepted, the kept positions replayed
  /// on the state before the step elsewhere; MTP pass 0 over every verify position and the chained
  /// passes (their positions and MTP KV slots from spec_advance); the sequences run in device order
  /// (verify chunks first) and the results come back in the caller's.
  void forward_verify_draft(const ForwardBatch& batch, KvCache& kv,
                            const std::vector<DeviceSampling>& rows, KvCache& mtp_kv,
                            VerifyDraftStep& step, std::vector<SampledToken>& out) override;
  /// Steps that ran forward_verify_draft (tests, benchmarks).
  int64_t fused_steps() const;
  /// Benchmarks: time the fused step's stages (verify, sample + accept, state settle, MTP pass
  /// 0, chained passes, copies + host wait; device and host time each, StageClock); the totals
  /// since the last take.
  void profile_fused_stages(bool on);
  std::vector<cuda_model::StageTimes> take_fused_stage_times();
  /// Captures the decode graph of every bucket up to max_batch (writes KV at position 0 of
  /// page 0 and the state slots 0..bucket - 1).
  void warm_up(KvCache& kv, int64_t max_batch) override;
  /// Captures the verify graph (K + 1 tokens per sequence; verify graphs on) of every bucket up
  /// to max_batch (writes KV at positions 0..K of page 0 and the state slots 0..bucket - 1) and,
  /// with K >= 2 and draft graphs on, the chained MTP pass graph of each (MTP KV at position 0
  /// of page 0); sizes the verify steps' kept recurrence inputs (replay_states).
  void warm_up_speculative(KvCache& kv, KvCache& mtp_kv, int64_t max_batch, int64_t k) override;
  /// Batch buckets whose chained MTP pass graph is captured.
  std::vector<int64_t> captured_mtp_buckets() const;

  cudaStream_t stream() const { return stream_; }
  /// kv_cache_mb_for() with this device's free and total memory now.
  int64_t kv_cache_budget_mb(double utilization) const;
  int64_t weight_bytes() const { return weight_bytes_; }
  /// Layers (MTP excluded) whose routed experts stay block FP8 on the device (a block-FP8
  /// checkpoint with CudaModelOptions::fp8_weights).
  int64_t fp8_expert_layers() const;
  /// Dense linears (attention qkv / o, DeltaNet in_proj / out_proj, shared expert gate_up /
  /// down) kept in block FP8 on the device: those whose tensors the checkpoint stores F8_E4M3.
  int64_t fp8_dense_linears() const;
  /// Whether the FP8 linears take FP8 activations (W8A8: the experts always, the dense linears
  /// from 512 rows; TANDEM_CUDA_FP8_ACT=0: W8A16).
  bool fp8_activations() const;
  /// Batch-size buckets captured so far (decode graphs).
  std::vector<int64_t> captured_buckets() const;
  /// Decode-step buckets (the batch sizes graphs are captured for).
  const std::vector<int64_t>& buckets() const;
  /// (bucket, tokens per sequence) of the verify graphs captured so far.
  std::vector<std::pair<int64_t, int64_t>> captured_verify_graphs() const;
  /// On by default (the faster on the H200; off for tests and benchmarks): a
  /// verify step (2..5 tokens per sequence, the same for all, logits of all) replays a CUDA
  /// graph per (batch bucket, tokens per sequence), captured at warm_up_speculative or on first
  /// use, its tokens decode tokens of the attention and one DeltaNet chunk per sequence.
  /// Changing it drops the captured graphs.
  void set_verify_graphs(bool on);
  bool verify_graphs() const;
  /// Drops the captured decode graphs (the next decode step of each bucket captures again), e.g.
  /// after a change of backend/cuda/decode_switches.h, which a graph keeps as captured.
  void reset_graphs();
  /// On by default (the faster on the H200; off for tests and benchmarks): steps of
  /// up to 256 tokens run the shared expert on a second stream beside the routed experts. Changing
  /// it drops the captured graphs.
  void set_shared_expert_fork(bool on);
  bool shared_expert_fork() const;
  /// On by default (the faster on the H200; off for tests and benchmarks): a
  /// DeltaNet layer's decode delta rule as one kernel (GatedDeltaRuleParams::fused_decode).
  /// Changing it drops the captured graphs.
  void set_fused_deltanet_decode(bool on);
  bool fused_deltanet_decode() const;
  int64_t num_linear_layers() const;
  int64_t num_attention_layers() const;

  struct Impl;

 private:
  Qwen35MoeCuda(ModelConfig config, const CudaModelOptions& opts);
  // Runs the batch: a captured graph (returns true: logits of every row computed) or eagerly
  // up to the gathered logits rows' hidden states (returns false: the head is the caller's).
  // state_out (per sequence, when set): the slot its DeltaNet state after the chunk goes to (-1:
  // its own), its own slot then only read.
  bool launch(const ForwardBatch& batch, KvCache& kv,
              const std::vector<int32_t>* state_out = nullptr);
  // An MTP pass's inputs on the device (mtp_draft_chain); defined in the .cpp.
  struct MtpDeviceIn;
  // One MTP pass up to the logits rows' logits on the device; returns the rows. Its h_t:
  // `hidden` (host, batch order), or `dev`'s.
  int64_t mtp_launch(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                     const MtpDeviceIn* dev = nullptr);
  // A decode EP rank's MTP pass without tokens: the MTP layer's exchange only.
  void mtp_empty_pass();
  // mtp_launch's host h_t (batch order, fp32) into the MTP input (device order, bf16).
  void stage_mtp_hidden(const ForwardBatch& batch, const float* hidden, int64_t n_run);
  // The last MTP pass's rows' hidden states (after mtp.norm) as fp32 (synchronises).
  void mtp_hidden(int64_t rows, std::vector<float>& out);
  std::unique_ptr<cuda_model::CudaRunner> runner_;
  std::unique_ptr<Impl> impl_;
  ModelConfig config_;
  CudaModelOptions opts_;
  cudaStream_t stream_ = nullptr;
  int64_t weight_bytes_ = 0;
};

}  // namespace tandem
