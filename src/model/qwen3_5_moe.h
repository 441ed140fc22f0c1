// Qwen3.5 hybrid MoE on the CPU backend: gated DeltaNet (linear attention) and gated full
// attention layers per config.layer_types, every layer a routed MoE with a shared expert.
// Full-attention layers keep paged HND KV; DeltaNet layers keep a per-sequence state (conv
// window + recurrent state) in a KvCache state slot (ForwardSeq::state_slot; layout in
// model/hybrid_state.h). One process holds the whole model, or one rank of a sharded instance
// holds its slice (model/shard.h) and runs its part of every step in lockstep with its group:
//   prefill TP=t EP=t: gated attention as Qwen3MoeCpu (q / KV heads split, o_proj row-parallel);
//     DeltaNet split by heads (DeltaNetHeads: value heads hv / t, their key heads; in_proj rows,
//     conv channels, A_log / dt_bias, the state of those heads; out_proj row-parallel); routed
//     experts E / t; the shared expert's intermediate split (its sigmoid gate replicated); one
//     all-reduce after each mixer and one after each MoE block; lm_head vocab-parallel;
//   decode DP=d EP=d: attention, DeltaNet (whole state per sequence), router, shared expert and
//     lm_head replicated, each rank its own batch; routed experts E / d by all-to-all.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/hybrid_state.h"
#include "model/qwen3_moe.h"

namespace tandem {

/// Qwen3.5-MoE forward on the CPU, fp32 weights, accumulation and state; whole or one rank's
/// slice (see above).
class Qwen35MoeCpu final : public Model {
 public:
  /// Loads config.json (model_type qwen3_5_moe or qwen3_5_moe_text) and the safetensors weights
  /// of `dir` (image-text layout: model.language_model.*, the vision tower and mtp.* skipped;
  /// experts fused 3D or one tensor per expert). Errors name the file and the tensor.
  static std::unique_ptr<Qwen35MoeCpu> load(const std::string& dir);
  /// Loads only this rank's slice of `dir`. `comm` is the instance's group (rank == shard.rank,
  /// world_size == shard.size) and must outlive the model; it may be null in ShardMode::kSingle
  /// only. Throws kInvalidArgument naming what does not split (heads, experts, the shared
  /// expert's intermediate size).
  static std::unique_ptr<Qwen35MoeCpu> load(const std::string& dir, const ShardSpec& shard,
                                            comm::Communicator* comm);
  ~Qwen35MoeCpu() override;

  const ModelConfig& config() const override { return config_; }
  /// What this rank holds: attention heads, experts, vocabulary rows ...
  const ShardPlan& shard() const { return plan_; }
  /// ... and DeltaNet heads (its state slots hold those heads only).
  const DeltaNetHeads& deltanet_heads() const { return dn_; }
  /// The layout of this rank's state slots (HybridStateLayout::of(config, deltanet_heads())).
  HybridStateLayout state_layout() const { return HybridStateLayout::of(config_, dn_); }
  /// KV of the full-attention layers only (num_layers = their count), this rank's KV heads.
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const override;
  /// Per linear-attention layer: conv window [conv_dim, kernel - 1], then the recurrent state
  /// [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim] (this rank's heads).
  int64_t state_slot_elems() const override;
  /// As Model::forward; every sequence needs a state slot of `kv` (kv.allocate_states).
  /// Sharded, the call is collective, made by every rank for every step: kPrefillTpEp ranks pass
  /// the same batch (each its own KV / state slots of its heads) and get all logits rows, full
  /// vocabulary; kDecodeDpEp ranks pass their own batches, which may be empty.
  void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) override;
  /// MTP speculative decoding (model/qwen3_5_mtp.cpp): the mtp.* layer of `dir` (the published
  /// Qwen3.5 layout), its own one-layer KV; the engine rolls the DeltaNet states of rejected
  /// drafts back (Engine::rollback_states).
  void load_mtp(const std::string& dir) override;
  bool has_mtp() const override;
  KvGeometry mtp_kv_geometry(int64_t num_pages, int64_t page_size) const override;
  void mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                   std::vector<float>& logits, std::vector<float>& hidden_out) override;

  /// Recomputes the states of the last forward's chunks (Model::replay_states) from what it
  /// kept: per DeltaNet layer each token's conv input and gates (this rank's heads).
  bool replay_states(const std::vector<StateReplay>& replays, KvCache& kv) override;

  /// Floats of one linear-attention layer's part of a state slot.
  int64_t state_elems_per_layer() const;
  int64_t num_linear_layers() const { return num_linear_; }
  int64_t num_attention_layers() const { return num_attention_; }

 private:
  struct Layer {
    bool linear = false;
    int64_t index = 0;      // among the layers of its kind: KV layer or state part
    HostTensor input_norm;  // [hidden], 1 + w
    HostTensor post_norm;   // [hidden], 1 + w
    // Full attention.
    HostTensor qkv;     // [q_heads * 2 * head_dim + 2 * kv_heads * head_dim, hidden]
    HostTensor o;       // [hidden, q_heads * head_dim]
    HostTensor q_norm;  // [head_dim], 1 + w
    HostTensor k_norm;  // [head_dim], 1 + w
    // Gated DeltaNet.
    HostTensor in_proj;   // [conv_dim + value_dim + 2 * v_heads, hidden]: qkv | z | b | a
    HostTensor conv;      // [conv_dim, kernel]
    HostTensor a_log;     // [v_heads]
    HostTensor dt_bias;   // [v_heads]
    HostTensor out_norm;  // [v_dim] (plain weight)
    HostTensor out_proj;  // [hidden, value_dim]
    // MoE + shared expert.
    HostTensor router;                // [experts, hidden]
    std::vector<HostTensor> gate_up;  // per expert [2 * inter, hidden]
    std::vector<HostTensor> down;     // per expert [hidden, inter]
    std::vector<const float*> gate_up_ptrs, down_ptrs;
    HostTensor shared_gate_up;  // [2 * shared_inter, hidden] (this rank's rows: gate, then up)
    HostTensor shared_down;     // [hidden, shared_inter] (this rank's columns)
    HostTensor shared_gate;     // [1, hidden]
  };

  Qwen35MoeCpu(ModelConfig config, ShardPlan plan, DeltaNetHeads dn, comm::Communicator* comm);
  void load_weights(const class Checkpoint& ckpt, const std::string& config_path);
  // y = the MoE block (routed experts + gated shared expert) of the n rows of xn, summed over
  // the ranks.
  void moe_block(const Layer& layer, const float* xn, int64_t n, float* y);
  // One DeltaNet layer's recurrence over n tokens of one sequence: the conv over `mixed`
  // ([n, conv_dim_]) into conv_out, then the delta rule with the gates g, beta ([n, v_heads])
  // into out ([n, value_dim_]), on that layer's part of the state slot `slot`.
  void recurrence(const Layer& layer, const float* mixed, const float* g, const float* beta,
                  int64_t n, float* slot, float* conv_out, float* out) const;
  // logits [rows, vocab] from the final hidden rows `last` [rows, hidden] (normed).
  void lm_head(const float* last, int64_t rows, std::vector<float>& logits);

  ModelConfig config_;
  ShardPlan plan_;
  DeltaNetHeads dn_;
  comm::Communicator* comm_ = nullptr;
  std::unique_ptr<comm::MoeAllToAll> all_to_all_;  // kDecodeDpEp only
  int64_t num_linear_ = 0, num_attention_ = 0;
  // DeltaNet widths of this rank's heads: key_dim_ = hk_local * dk, value_dim_ = hv_local * dv.
  int64_t conv_dim_ = 0, key_dim_ = 0, value_dim_ = 0;
  IndexRange shared_inter_;  // this rank's columns of the shared expert's intermediate
  HostTensor embed_;         // [vocab, hidden]
  HostTensor norm_;          // [hidden], 1 + w
  HostTensor lm_head_;       // [this rank's vocab rows, hidden]; empty when tied
  std::vector<Layer> layers_;
  // The last forward's recurrence inputs (ForwardBatch::keep_recurrent_inputs), per DeltaNet
  // layer: the conv inputs [tokens, conv_dim_], beta and g [tokens, v_heads]; kept_tokens_ < 0:
  // none kept.
  struct KeptInputs {
    std::vector<float> mixed, beta, g;
  };
  std::vector<KeptInputs> kept_;
  int64_t kept_tokens_ = -1;
  std::vector<std::pair<int64_t, int64_t>> kept_chunks_;  // (first row, tokens) per sequence
  struct Mtp;                                             // qwen3_5_mtp.cpp
  std::shared_ptr<Mtp> mtp_;                              // the MTP layer, once loaded
};

/// The CPU model for the checkpoint in `dir`, picked by config.json's model_type (qwen3_moe:
/// Qwen3MoeCpu; qwen3_5_moe / qwen3_5_moe_text: Qwen35MoeCpu).
std::unique_ptr<Model> load_cpu_model(const std::string& dir);
/// The same, one rank's slice (both models' load(dir, shard, comm)); the instances' CPU model
/// factory (disagg/instance_parts.cpp).
std::unique_ptr<Model> load_cpu_model(const std::string& dir, const ShardSpec& shard,
                                      comm::Communicator* comm);

}  // namespace tandem
