// Qwen3.5 hybrid MoE on the CPU backend: gated DeltaNet (linear attention) and gated full
// attention layers per config.layer_types, every layer a routed MoE with a shared expert.
// Full-attention layers keep paged HND KV; DeltaNet layers keep a per-sequence state (conv
// window + recurrent state) in a KvCache state slot (ForwardSeq::state_slot).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/qwen3_moe.h"

namespace tandem {

/// Qwen3.5-MoE forward on the CPU, fp32 weights, accumulation and state. One process holds the
/// whole model (no sharding yet).
class Qwen35MoeCpu final : public Model {
 public:
  /// Loads config.json (model_type qwen3_5_moe or qwen3_5_moe_text) and the safetensors weights
  /// of `dir` (image-text layout: model.language_model.*, the vision tower and mtp.* skipped;
  /// experts fused 3D or one tensor per expert). Errors name the file and the tensor.
  static std::unique_ptr<Qwen35MoeCpu> load(const std::string& dir);
  ~Qwen35MoeCpu() override;

  const ModelConfig& config() const override { return config_; }
  /// KV of the full-attention layers only (num_layers = their count).
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const override;
  /// Per linear-attention layer: conv window [conv_dim, kernel - 1], then the recurrent state
  /// [linear_num_value_heads, linear_key_head_dim, linear_value_head_dim].
  int64_t state_slot_elems() const override;
  /// As Model::forward; every sequence needs a state slot of `kv` (kv.allocate_states).
  void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) override;
  /// Refused for now: speculation here must also roll back the DeltaNet states of rejected
  /// drafts (per-position states during the verify), which is not built yet.
  void load_mtp(const std::string& dir) override;

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
    HostTensor shared_gate_up;  // [2 * shared_inter, hidden]
    HostTensor shared_down;     // [hidden, shared_inter]
    HostTensor shared_gate;     // [1, hidden]
  };

  explicit Qwen35MoeCpu(ModelConfig config);
  void load_weights(const class Checkpoint& ckpt);

  ModelConfig config_;
  int64_t num_linear_ = 0, num_attention_ = 0;
  int64_t conv_dim_ = 0, key_dim_ = 0, value_dim_ = 0;  // DeltaNet widths
  HostTensor embed_;                                    // [vocab, hidden]
  HostTensor norm_;                                     // [hidden], 1 + w
  HostTensor lm_head_;                                  // [vocab, hidden]; empty when tied
  std::vector<Layer> layers_;
};

/// The CPU model for the checkpoint in `dir`, picked by config.json's model_type (qwen3_moe:
/// Qwen3MoeCpu; qwen3_5_moe / qwen3_5_moe_text: Qwen35MoeCpu).
std::unique_ptr<Model> load_cpu_model(const std::string& dir);

}  // namespace tandem
