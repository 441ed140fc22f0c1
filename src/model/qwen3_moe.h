// Qwen3-MoE on the CPU backend: weights loaded from a Hugging Face checkpoint, forward over
// paged HND KV. One process holds the whole model, or one rank of a sharded instance holds
// its slice (model/shard.h) and runs its part of every step in lockstep with its group.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/forward_batch.h"
#include "model/model.h"
#include "model/shard.h"

namespace tandem {

namespace comm {
class Communicator;
class MoeAllToAll;
}  // namespace comm

class Checkpoint;

/// Qwen3-MoE forward on the CPU, fp32 weights and accumulation.
class Qwen3MoeCpu final : public Model {
 public:
  /// Loads config.json and the safetensors weights of `dir`. Errors name file and tensor.
  static std::unique_ptr<Qwen3MoeCpu> load(const std::string& dir);
  /// Loads only this rank's slice of `dir` (see ShardPlan): row ranges of the split weights,
  /// the column range of o_proj, this rank's experts. `comm` is the instance's group
  /// (rank == shard.rank, world_size == shard.size) and must outlive the model; it may be null
  /// in ShardMode::kSingle only. Throws kInvalidArgument when the model does not split.
  static std::unique_ptr<Qwen3MoeCpu> load(const std::string& dir, const ShardSpec& shard,
                                           comm::Communicator* comm);
  ~Qwen3MoeCpu() override;

  const ModelConfig& config() const override { return config_; }
  /// What this rank holds.
  const ShardPlan& shard() const { return plan_; }
  /// The KV cache of this rank: its local KV heads (ShardPlan::kv_heads).
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const override;
  /// Single: as Model::forward. Sharded, the call is collective, made by every rank for every
  /// step:
  ///  - kPrefillTpEp: every rank passes the same batch (its own KV cache of local heads) and
  ///    gets all logits rows, full vocabulary.
  ///  - kDecodeDpEp: every rank passes its own batch, which may be empty (the rank still serves
  ///    its experts to the others), and gets its own logits rows.
  void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) override;

  /// The MTP layer: mtp.fc [hidden, 2 hidden] over [RMSNorm_e(embed(t + 1)); RMSNorm_h(h_t)]
  /// (mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden), mtp.layers.0 (a Qwen3-MoE decoder
  /// layer: all heads on this rank; its MoE block sharded as the target's, kDecodeDpEp: this
  /// rank's experts only, run through the decode all-to-all), mtp.norm; embedding and lm_head
  /// shared. Not with ShardMode::kPrefillTpEp (prefill instances do not speculate).
  void load_mtp(const std::string& dir) override;
  bool has_mtp() const override { return mtp_ != nullptr; }
  /// kDecodeDpEp with several ranks and an MoE MTP layer: mtp_forward is collective (an empty
  /// batch still serves this rank's MTP experts).
  bool mtp_collective() const override;
  /// Bytes of the MTP layer's weights held here (0 without one).
  int64_t mtp_weight_bytes() const;
  KvGeometry mtp_kv_geometry(int64_t num_pages, int64_t page_size) const override;
  void mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                   std::vector<float>& logits, std::vector<float>& hidden_out) override;

  /// The reference of the GPU's FP8 KV cache (--kv-cache-dtype fp8, CudaModelOptions::
  /// kv_cache_fp8): every KV write of the target's layers goes through E4M3 (cpu::KvWriteParams::
  /// kv_fp8) with layer l's scales k_scales[l] / v_scales[l] (empty: 1.0), so the fp32 pools hold
  /// what the GPU's FP8 pools dequantize to. The MTP layer's KV stays exact.
  void set_kv_fp8(std::vector<float> k_scales = {}, std::vector<float> v_scales = {});

 private:
  struct Layer {
    HostTensor input_norm;  // [hidden]
    HostTensor post_norm;   // [hidden]
    HostTensor q_norm;      // [head_dim]
    HostTensor k_norm;      // [head_dim]
    HostTensor qkv;         // [(q_heads + 2 kv_heads) * head_dim, hidden], local heads
    HostTensor o;           // [hidden, q_heads * head_dim], local heads' columns
    bool moe = false;
    HostTensor router;                // [experts, hidden], all experts
    std::vector<HostTensor> gate_up;  // per local expert (or one dense): [2 * inter, hidden]
    std::vector<HostTensor> down;     // per local expert (or one dense): [hidden, inter]
    std::vector<const float*> gate_up_ptrs, down_ptrs;
  };

  Qwen3MoeCpu(ModelConfig config, ShardPlan plan, comm::Communicator* comm);
  void load_weights(const Checkpoint& ckpt, const std::string& config_path);
  // y = this rank's part of the MoE block for the n rows of xn; sums over ranks included.
  void moe_block(const Layer& layer, const float* xn, const int32_t* topk_ids, const float* topk_w,
                 int64_t n, float* y);
  // logits [rows, vocab] from the final hidden rows `last` [rows, hidden] (normed).
  void lm_head(const float* last, int64_t rows, std::vector<float>& logits);

  struct Mtp;

  ModelConfig config_;
  ShardPlan plan_;
  comm::Communicator* comm_ = nullptr;
  std::unique_ptr<comm::MoeAllToAll> all_to_all_;  // kDecodeDpEp only

  HostTensor embed_;    // [vocab, hidden]
  HostTensor norm_;     // [hidden]
  HostTensor lm_head_;  // [this rank's vocab rows, hidden]; empty when tied
  std::vector<Layer> layers_;
  std::unique_ptr<Mtp> mtp_;
  bool kv_fp8_ = false;                     // set_kv_fp8
  std::vector<float> k_scales_, v_scales_;  // per layer
};

}  // namespace tandem
