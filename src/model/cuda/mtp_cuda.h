// The MTP layer of a Qwen3-MoE target on the GPU (Qwen3MoeCuda::load_mtp): bf16 weights in
// device memory, its own one-layer bf16 paged KV on the target's page ids, the target's
// embedding and lm_head shared. One pass (Model::mtp_forward) over a batch:
//   x = fc([RMSNorm_e(embed(t + 1)); RMSNorm_h(h_t)])      [n, hidden]
//   x = decoder layer (attention over the MTP KV, the MoE block or the dense MLP)
//   hidden_out = mtp.norm(x) of the logits rows; logits = lm_head(hidden_out).
// Scratch activations, the GEMM plans and the logits buffer are the target's (MtpScratch):
// the passes run on the target's stream after its forward.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/forward_batch.h"

namespace tandem {

namespace cuda {
class GemmLt;
}
namespace cuda_model {
class DeviceSampler;
class ShardComms;
}  // namespace cuda_model
namespace comm {
class CudaMoe;
}

/// The target's buffers a pass borrows (all device pointers, bf16 unless said).
struct MtpScratch {
  void *x, *xn, *y, *qkv, *q, *attn, *last;  // [t_cap, hidden] / qkv rows / q heads
  float* logits = nullptr;                   // [rows_cap, vocab] fp32
  float* attn_ws = nullptr;                  // split-KV workspace
  size_t attn_ws_floats = 0;
  cuda::GemmLt* gemm = nullptr;
  const void* embed = nullptr;    // [vocab, hidden]
  const void* lm_head = nullptr;  // [vocab, hidden]
  int64_t t_cap = 0, rows_cap = 0;
  int num_sms = 0;
  // Chained draft passes (one token per sequence) replay CUDA graphs for these batch-size
  // buckets (the target's; empty: always eager) up to graph_context tokens of context.
  std::vector<int64_t> buckets;
  int64_t graph_context = 0;
  cudaStream_t stream = nullptr;
  cuda_model::DeviceSampler* sampler = nullptr;  // the target's (draft chains' argmax)
  // Decode DP/EP (a group of several ranks): the target's collectives (model/cuda/
  // shard_comms.h: the MoE exchange sized for t_cap tokens, its intermediates). The MTP layer
  // then holds only the experts [ep_expert_begin, ep_expert_begin + ep_local_experts) and its
  // MoE block runs through the exchange as the target's layers do (ShardComms::moe_ep): every
  // pass is collective, an empty one (no tokens) included. Null: one rank holds every expert.
  comm::CudaMoe* ep = nullptr;
  cuda_model::ShardComms* comms = nullptr;
  int64_t ep_expert_begin = 0, ep_local_experts = 0;
};

class MtpCuda {
 public:
  /// Loads the mtp.* tensors of `dir` (all heads; every expert, or this rank's with
  /// scratch.ep; bf16 on the device whatever the stored dtype). Throws kNotFound naming `dir`
  /// when it has none.
  static std::unique_ptr<MtpCuda> load(const ModelConfig& config, const std::string& dir,
                                       const MtpScratch& scratch);
  /// Random weights of the target's distribution (benchmarks; Qwen3MoeCuda::random's rule).
  static std::unique_ptr<MtpCuda> random(const ModelConfig& config, uint64_t seed,
                                         const MtpScratch& scratch);
  ~MtpCuda();

  /// One layer, the target's KV heads, bf16.
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const;
  /// Device pools, zero-filled.
  KvCache make_kv_cache(int64_t num_pages, int64_t page_size);
  /// One pass (see the top of the file): `hidden` [batch.num_tokens(), hidden] fp32 on the
  /// host. Leaves the rows' logits in scratch.logits and their normed hidden states in
  /// hidden_out() (device, [rows, hidden] bf16), ordered on the stream. Returns the rows.
  /// A chained pass (one token per sequence, its logits) replays the graph of its batch
  /// bucket (captured on first use, padded with sequences that write no KV); others are eager.
  /// With scratch.ep (collective): an empty batch still runs the MoE exchange (this rank's
  /// experts serve the other ranks' tokens).
  int64_t forward(const ForwardBatch& batch, const float* hidden, KvCache& kv);
  /// True when each pass is collective (scratch.ep and a MoE MTP layer): forward and every
  /// pass of draft_chain and draft_after_verify run one MoE exchange, empty ones included.
  bool collective() const;
  /// Model::mtp_draft_chain on the stream: pass 0 over `first` with its hidden states
  /// gathered from `target_hidden` (device bf16 [target_rows, hidden]) at `hidden_rows`, then
  /// the chained passes (tokens and hidden states copied on the device from the pass before);
  /// each pass's argmax into a device buffer (the target's sampler), one copy to the host and
  /// one synchronisation at the end. Chained passes replay the graphs captured so far
  /// (warm-up, or single passes) and run eagerly otherwise.
  void draft_chain(const ForwardBatch& first, const void* target_hidden, int64_t target_rows,
                   std::span<const int32_t> hidden_rows, const std::vector<MtpChainPass>& chain,
                   KvCache& kv, std::vector<std::vector<int32_t>>& drafts);
  /// Model::forward_verify_draft's drafting half on the stream, after the target's verify
  /// forward and its sampler (`sampled`: device [verify tokens], one row per token): the
  /// accepted drafts (spec_advance), pass 0 over every verify position (hidden states gathered
  /// from `target_hidden` at `hidden_rows`, its logits row at the last accepted position), the
  /// chained passes at the positions after it; step.accepted and step.drafts come back in one
  /// copy and one synchronisation. Every pass has every sequence (a chained position past the
  /// block table writes no KV), so a collective layer runs exactly K exchanges, as many as the
  /// unfused step's pass 0, chained and empty passes (Engine::pad_mtp_passes).
  void draft_after_verify(const ForwardBatch& verify, const void* target_hidden,
                          int64_t target_rows, std::span<const int32_t> hidden_rows,
                          const int32_t* sampled, VerifyDraftStep& step, KvCache& kv);
  /// The last pass's hidden states of its logits rows as fp32 on the host (synchronises).
  void hidden_to_host(int64_t rows, std::vector<float>& out);
  int64_t weight_bytes() const { return weight_bytes_; }
  /// Benchmarks: time each stage of the following passes with CUDA events (off by default);
  /// stage_ms() gives the last pass's (name, ms) per stage (synchronises; empty when off).
  void profile_stages(bool on);  // (the passes run eagerly while it is on)
  /// Buckets whose chained-pass graph is captured.
  std::vector<int64_t> captured_buckets() const;
  std::vector<std::pair<std::string, float>> stage_ms() const;

  struct Impl;

 private:
  explicit MtpCuda(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  int64_t weight_bytes_ = 0;
};

}  // namespace tandem
