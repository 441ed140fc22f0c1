// Qwen3-MoE on the GPU: bf16 (or block-FP8) weights in device memory, bf16 paged HND KV in
// device memory, the layers built from the CUDA backend ops (src/backend/cuda); the whole model
// on one GPU or one rank's slice of it (prefill TP/EP, decode DP/EP). Steps run through the
// CUDA model runner (model/cuda/runner.h: metadata, graphs, forward and sampling); this file
// holds the weights and the layers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/cuda/factory.h"
#include "model/cuda/options.h"
#include "model/model.h"
#include "model/shard.h"

namespace tandem {

class MtpCuda;  // model/cuda/mtp_cuda.h
struct MtpScratch;

namespace cuda_model {
class CudaRunner;
}

class Qwen3MoeCuda final : public Model {
 public:
  /// Loads config.json and the safetensors weights of `dir` (mmap -> pinned staging ->
  /// device): the slice opts.shard names. Throws kUnsupported, naming config.json and the
  /// field, for shapes the CUDA ops do not cover (head_dim other than 64 / 128, attention
  /// bias, > 512 experts, top-k > 16, a local GQA group other than 1/2/4/8/16).
  /// Sharded (opts.shard.size > 1) the load is collective: every rank of the group loads its
  /// model at the same time (the communicators are built then).
  static std::unique_ptr<Qwen3MoeCuda> load(const std::string& dir, const CudaModelOptions& opts);
  /// A model of `config`'s shapes with random weights generated on the device (benchmarks at
  /// real shapes without a checkpoint on disk): matrices ~ U(-a, a) with a = 0.02 * sqrt(3)
  /// (o_proj and the experts' down_proj 1000x smaller, so that routing stays balanced as a
  /// trained router's), norms ~ 1 + U(-0.05, 0.05), deterministic in `seed`.
  static std::unique_ptr<Qwen3MoeCuda> random(const ModelConfig& config,
                                              const CudaModelOptions& opts, uint64_t seed);
  ~Qwen3MoeCuda() override;

  const ModelConfig& config() const override { return config_; }
  /// What this rank holds.
  const ShardPlan& shard() const;
  /// bf16 pools of this rank's KV heads (all of them unless prefill TP).
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const override;
  /// Device pools, zero-filled (a padding token of a captured step may read any page).
  KvCache make_kv_cache(int64_t num_pages, int64_t page_size) override;
  /// Sharded, the call is collective as Qwen3MoeCpu::forward's: prefill TP ranks pass the
  /// same batch; decode DP/EP ranks their own (an empty one still runs a zero-token step,
  /// serving this rank's experts). batch.on_layer_kv(l) runs once layer l's KV write has been
  /// enqueued on the cache's stream (KvCache::device_stream()), not when it has completed.
  void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) override;
  /// Samples on the GPU (backend/cuda/sampling.h): only tokens and logprobs come back.
  bool samples_on_device() const override { return true; }
  void forward_sample(const ForwardBatch& batch, KvCache& kv,
                      const std::vector<DeviceSampling>& rows, std::vector<SampledToken>& out,
                      const std::function<void()>& wait_masks = {}) override;

  /// As forward, leaving the fp32 logits rows [num_logit_rows, vocab] on the device (valid
  /// until the next call; ordered on stream()).
  const float* forward_device(const ForwardBatch& batch, KvCache& kv);
  cudaStream_t stream() const { return stream_; }
  /// kv_cache_mb_for() with this device's free and total memory now (call after loading,
  /// before the KV cache exists). utilization in (0, 1].
  int64_t kv_cache_budget_mb(double utilization) const;
  int64_t kv_cache_mb_hint() const override;
  /// Linears (or groups of experts) kept FP8 in device memory (0: all bf16).
  int64_t fp8_linears() const;
  /// Whether the FP8 linears take FP8 activations (W8A8; TANDEM_CUDA_FP8_ACT, on by default).
  bool fp8_activations() const;
  /// Bytes of weights in device memory.
  int64_t weight_bytes() const { return weight_bytes_; }
  /// Captures the decode graph of every bucket <= max_batch (single-GPU models; a sharded
  /// model's ranks capture together on first use). Writes page 0 of `kv`.
  void warm_up(KvCache& kv, int64_t max_batch) override;
  /// With mtp_graphs on (else nothing): captures the verify graph (K + 1 tokens per sequence,
  /// logits of all) and the chained MTP pass's graph of every bucket <= max_batch that fits
  /// max_tokens (single-GPU models). Writes page 0 of `kv` and `mtp_kv`.
  void warm_up_speculative(KvCache& kv, KvCache& mtp_kv, int64_t max_batch, int64_t k) override;
  /// Batch-size buckets captured so far (decode steps).
  std::vector<int64_t> captured_buckets() const;
  /// Verify-step graphs captured so far: (bucket of sequences, tokens per sequence).
  std::vector<std::pair<int64_t, int64_t>> captured_verify_graphs() const;
  /// Steps that ran forward_verify_draft (tests, benchmarks).
  int64_t fused_steps() const { return fused_steps_; }

  // MTP speculative decoding (mtp_cuda.h): the layer on this GPU (its experts sharded as the
  // target's under decode DP/EP), its KV in device pools, passes eager; verify steps of K + 1
  // tokens per sequence replay graphs as decode steps do. Not with prefill TP (prefill instances do
  // not speculate).
  void load_mtp(const std::string& dir) override;
  /// Random MTP weights (benchmarks at real shapes without a checkpoint).
  void random_mtp(uint64_t seed);
  bool has_mtp() const override { return mtp_ != nullptr; }
  /// Decode DP/EP with several ranks: the MTP layer holds this rank's experts only and each
  /// pass runs through the target's MoE exchange (collective; mtp_cuda.h).
  bool mtp_collective() const override;
  MtpCuda* mtp() { return mtp_.get(); }  // benchmarks (stage timing); nullptr without one
  KvGeometry mtp_kv_geometry(int64_t num_pages, int64_t page_size) const override;
  KvCache make_mtp_kv_cache(int64_t num_pages, int64_t page_size) override;
  void mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                   std::vector<float>& logits, std::vector<float>& hidden_out) override;
  void mtp_forward_sample(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                          const std::vector<DeviceSampling>& rows, std::vector<SampledToken>& out,
                          std::vector<float>& hidden_out) override;
  /// The draft chain on the device (MtpCuda::draft_chain; its hidden input this model's final
  /// hidden states of the last launch) once the MTP layer is loaded, unless set_device_chain(false)
  /// (tests and benchmarks: each pass's hidden states then go through the host).
  bool mtp_drafts_on_device() const override;
  void set_device_chain(bool on) { device_chain_ = on; }
  void mtp_draft_chain(const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                       const std::vector<MtpChainPass>& chain, KvCache& mtp_kv,
                       std::vector<std::vector<int32_t>>& drafts) override;
  /// The fused speculative step (verify, its sampler, the acceptance and the next drafts on the
  /// stream, one synchronisation: MtpCuda::draft_after_verify): with the device chain, on one
  /// GPU or a decode DP/EP rank (the verify is the rank's lockstep forward, its K MTP passes K
  /// exchanges); on unless set_fused_step(false) (tests and benchmarks: the unfused step).
  bool fuses_verify_and_draft() const override;
  void set_fused_step(bool on) { fused_step_ = on; }
  void forward_verify_draft(const ForwardBatch& batch, KvCache& kv,
                            const std::vector<DeviceSampling>& rows, KvCache& mtp_kv,
                            VerifyDraftStep& step, std::vector<SampledToken>& out) override;
  /// One MTP pass leaving the logits rows on the device (benchmarks; as forward_device).
  const float* mtp_forward_device(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv);
  /// The MoE path the last MoE layer of the last forward took ("decode", "mma", "cublas",
  /// "padded"; "" before any).
  std::string last_moe_path() const;
  /// Routing balance of the last MoE layer of the last forward: the most tokens any expert got
  /// over the mean (1 = perfectly balanced). Synchronises the stream.
  double last_moe_imbalance() const;
  /// Decode-step buckets (the batch sizes graphs are captured for).
  const std::vector<int64_t>& buckets() const;

  struct Impl;

 private:
  Qwen3MoeCuda(ModelConfig config, const CudaModelOptions& opts);
  MtpScratch mtp_scratch() const;
  bool mtp_graphs_on() const;  // CudaModelOptions::mtp_graphs, one GPU
  std::unique_ptr<cuda_model::CudaRunner> runner_;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<MtpCuda> mtp_;
  int64_t fused_steps_ = 0;
  bool device_chain_ = true;
  bool fused_step_ = true;
  ModelConfig config_;
  CudaModelOptions opts_;
  cudaStream_t stream_ = nullptr;
  int64_t weight_bytes_ = 0;
};

}  // namespace tandem
