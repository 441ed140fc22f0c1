// Model configuration read from a Hugging Face checkpoint directory.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace tandem {

/// How the checkpoint stores its quantized linear weights (config.json quantization_config).
/// Only the linears (attention q/k/v/o, MLP and expert gate/up/down) are ever quantized; the
/// router, norms, embedding and lm_head stay as stored. A linear is quantized exactly when its
/// `weight` is stored as F8_E4M3 (modules_to_not_convert / ignore keep theirs in bf16).
enum class WeightQuant : uint8_t {
  kNone,
  kFp8Block,  // quant_method "fp8": W = e4m3 * weight_scale_inv (f32) per 128x128 block
  kMxfp8,     // quant_method "modelopt", quant_algo "MXFP8": W = e4m3 * 2^(e - 127) per 1x32,
              // weight_scale holding e (E8M0 as U8)
};

std::string_view weight_quant_name(WeightQuant q);

struct QuantConfig {
  WeightQuant method = WeightQuant::kNone;
  int64_t block_rows = 0;                  // output-dim elements per scale (128 block FP8, 1 MXFP8)
  int64_t block_cols = 0;                  // input-dim elements per scale (128 block FP8, 32 MXFP8)
  std::vector<std::string> not_converted;  // modules_to_not_convert (fp8) / ignore (modelopt)

  bool quantized() const { return method != WeightQuant::kNone; }
  /// The scale tensor beside `<module>.weight`: "weight_scale_inv" or "weight_scale".
  std::string scale_name(const std::string& weight_name) const;
  /// dir/config.json's top-level quantization_config (kNone when absent), whatever the
  /// model_type (ModelConfig::quant holds what the model reads: Qwen3.5 also text_config's).
  /// Errors name the file and field.
  static QuantConfig from_dir(const std::string& dir);
};

/// Qwen3-MoE hyper-parameters (config.json, model_type "qwen3_moe"). Both spellings are
/// accepted: the hub one (num_experts, rope_theta, torch_dtype) and the transformers-5 one
/// (num_local_experts, rope_parameters.rope_theta, dtype).
struct ModelConfig {
  std::string model_type;    // "qwen3_moe"
  std::string architecture;  // "Qwen3MoeForCausalLM"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP width (mlp_only_layers and non-sparse steps)
  int64_t moe_intermediate_size = 0;  // width of one expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // independent of hidden_size / num_attention_heads
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  bool norm_topk_prob = false;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 0;
  DType dtype = DType::kBF16;          // the checkpoint's declared dtype
  std::vector<int64_t> eos_token_ids;  // from generation_config.json, else config.json
  int64_t bos_token_id = -1;
  QuantConfig quant;  // quantization_config; kNone when absent

  // Qwen3.5 hybrid MoE (model_type "qwen3_5_moe" / "qwen3_5_moe_text"); empty layer_types for
  // Qwen3-MoE. Every Qwen3.5 layer is MoE with a shared expert; full-attention layers use the
  // fields above (head_dim, heads, rope_theta), linear-attention layers the linear_* ones.
  enum class LayerType : uint8_t { kFullAttention, kLinearAttention };
  std::vector<LayerType> layer_types;    // one per layer
  std::string weight_prefix = "model.";  // "model.language_model." for the image-text layout
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;
  int64_t shared_expert_intermediate_size = 0;
  double partial_rotary_factor = 1.0;   // RoPE on the first head_dim * factor dims
  bool attn_output_gate = false;        // q_proj emits a sigmoid gate per head
  int64_t mtp_num_hidden_layers = 0;    // MTP weights (mtp.*) are not loaded
  DType ssm_state_dtype = DType::kF32;  // mamba_ssm_dtype: the recurrent state's dtype

  bool is_hybrid() const { return !layer_types.empty(); }
  /// Rotary dims of a full-attention head (even).
  int64_t rotary_dim() const;

  /// True when layer `layer` uses the sparse MoE block (Qwen3MoeDecoderLayer rule).
  bool is_moe_layer(int64_t layer) const;

  /// Reads dir/config.json (and dir/generation_config.json when present). Errors name the
  /// file and field.
  static ModelConfig from_dir(const std::string& dir);
  /// Parses config.json text; `origin` names the file in errors.
  static ModelConfig from_json(const std::string& json_text, const std::string& origin);
};

}  // namespace tandem
