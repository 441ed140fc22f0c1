// `tandem convert`: a Qwen3-MoE or Qwen3.5 checkpoint (bf16 / f16 / f32, block FP8 or MXFP8)
// rewritten with its linear weights quantized to MXFP8 or block FP8 (model/quant.h), statically.
// Qwen3.5: as Qwen's -FP8 checkpoints, the DeltaNet in_proj_qkv / in_proj_z / out_proj too
// (in_proj_b / in_proj_a, conv1d, the shared-expert gate stay); experts stored fused 3D
// (transformers 5) and the MTP layer stay as stored.
//
// Output directory: config.json with the new quantization_config, hf_quant_config.json for
// MXFP8 (ModelOpt's file), safetensors (model.safetensors, or shards of at most shard_bytes
// plus model.safetensors.index.json), and every other file of the input (tokenizer,
// generation_config.json, ...) copied, except golden.json and README.md. Linears whose input
// width is not a multiple of 32 stay unquantized under MXFP8 (and are listed as ignored), as
// vLLM's MXFP8 kernels need whole blocks; the router, norms, embedding and lm_head stay as
// stored.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"

namespace tandem {

struct ConvertOptions {
  std::string in_dir;
  std::string out_dir;  // created; must not exist or be empty
  WeightQuant format = WeightQuant::kMxfp8;
  uint64_t shard_bytes = 4ull << 30;
  /// Called after each tensor: (tensors written, of total; bytes written, of total).
  std::function<void(int64_t, int64_t, uint64_t, uint64_t)> progress;
};

/// Quantization error of one tensor kind (e.g. "experts.down_proj") against the input's
/// values (bf16 as stored, or the dequantized input when it was quantized already).
struct QuantErrorStats {
  std::string kind;
  int64_t tensors = 0;
  int64_t elements = 0;
  double sum_sq_err = 0.0;
  double sum_sq_ref = 0.0;
  double max_abs_err = 0.0;
  /// max over elements of |error| / E4M3's rounding bound for that element (<= 1 when every
  /// element rounds to nearest without saturating): max(|w| 2^-4, scale 2^-10).
  double max_bound_ratio = 0.0;

  double rel_rms() const { return sum_sq_ref > 0 ? std::sqrt(sum_sq_err / sum_sq_ref) : 0.0; }
};

struct ConvertReport {
  std::vector<QuantErrorStats> kinds;  // sorted by kind
  int64_t quantized_tensors = 0;
  int64_t copied_tensors = 0;
  std::vector<std::string> kept_unquantized;  // linears left as stored (see above)
  uint64_t bytes_out = 0;
  std::vector<std::string> files;  // safetensors files written
};

/// Converts; throws (naming the file and tensor) on bad input. Deterministic.
ConvertReport convert_checkpoint(const ConvertOptions& options);

/// The table printed by `tandem convert`: one line per tensor kind.
std::string format_report(const ConvertReport& report);

/// config.json as convert writes it: `config_text` (the input's config.json) with its
/// quantization_config replaced by `format`'s (block FP8: quant_method "fp8", 128x128 blocks,
/// modules_to_not_convert; MXFP8: ModelOpt's, ignore), whose list of unquantized modules is
/// lm_head, model.embed_tokens, model.layers.L.mlp.gate for every MoE layer L of `config`, then
/// `kept` (linears left unquantized). For writers of such checkpoints other than convert
/// (tools/make_random_checkpoint --format fp8), so that both write the same config.
std::string converted_config_json(const std::string& config_text, const ModelConfig& config,
                                  WeightQuant format, const std::vector<std::string>& kept);

/// The tensor kind of a linear weight name ("model.layers.3.mlp.experts.7.up_proj.weight" ->
/// "experts.up_proj"; "...self_attn.q_proj.weight" -> "q_proj"; dense MLP "mlp.up_proj"), or
/// "" when the name is not a quantizable linear.
std::string linear_kind(const std::string& name);

}  // namespace tandem
