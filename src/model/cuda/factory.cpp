// Building a CUDA model. See factory.h.
#include "model/cuda/factory.h"

#include <algorithm>

#include "backend/cuda/moe.h"
#include "core/error.h"
#include "model/cuda/qwen3_5_moe_cuda.h"
#include "model/cuda/qwen3_moe_cuda.h"

namespace tandem {

std::unique_ptr<Model> load_cuda_model(const std::string& dir, const CudaModelOptions& opts) {
  const ModelConfig config = ModelConfig::from_dir(dir);
  if (config.is_hybrid()) return Qwen35MoeCuda::load(dir, opts);
  return Qwen3MoeCuda::load(dir, opts);
}

int64_t kv_cache_mb_for(size_t free_bytes, size_t total_bytes, double utilization) {
  TANDEM_CHECK_KIND(kInvalidArgument, utilization > 0.0 && utilization <= 1.0,
                    "--gpu-memory-utilization must be in (0, 1], not ", utilization);
  const double keep = (1.0 - utilization) * static_cast<double>(total_bytes);
  const double kv = static_cast<double>(free_bytes) - keep;
  return std::max<int64_t>(64, static_cast<int64_t>(kv / (1 << 20)));
}

void check_gqa_group(int64_t group, const std::string& origin, const char* what) {
  TANDEM_CHECK_KIND(kUnsupported,
                    group == 1 || group == 2 || group == 4 || group == 8 || group == 16, origin,
                    ": ", what, " = ", group, " is not supported on the GPU (1, 2, 4, 8 or 16)");
}

void check_cuda_model_config(const ModelConfig& c, const std::string& origin) {
  if (c.is_hybrid()) {
    // Qwen3.5 (Qwen35MoeCuda): gated attention at head_dim 64 / 128 / 256, DeltaNet layers
    // within the CUDA DeltaNet ops (backend/cuda/deltanet.h).
    TANDEM_CHECK_KIND(kUnsupported, c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256,
                      origin, ": head_dim ", c.head_dim,
                      " is not supported on the GPU (64, 128 or 256)");
    const int64_t dk = c.linear_key_head_dim;
    TANDEM_CHECK_KIND(kUnsupported, dk == 16 || dk == 32 || dk == 64 || dk == 128, origin,
                      ": linear_key_head_dim ", dk,
                      " is not supported on the GPU (16, 32, 64 or 128)");
    TANDEM_CHECK_KIND(kUnsupported, c.linear_value_head_dim > 0 && c.linear_value_head_dim <= 256,
                      origin, ": linear_value_head_dim ", c.linear_value_head_dim,
                      " is not supported on the GPU (at most 256)");
    TANDEM_CHECK_KIND(kUnsupported, c.linear_conv_kernel_dim >= 2 && c.linear_conv_kernel_dim <= 8,
                      origin, ": linear_conv_kernel_dim ", c.linear_conv_kernel_dim,
                      " is not supported on the GPU (2 to 8)");
    TANDEM_CHECK_KIND(kUnsupported, c.ssm_state_dtype == DType::kF32, origin,
                      ": mamba_ssm_dtype other than float32 is not supported on the GPU");
  } else {
    TANDEM_CHECK_KIND(kUnsupported, c.head_dim == 64 || c.head_dim == 128, origin, ": head_dim ",
                      c.head_dim, " is not supported on the GPU (64 or 128)");
  }
  TANDEM_CHECK_KIND(kUnsupported, !c.attention_bias, origin,
                    ": attention_bias true is not supported on the GPU");
  const int64_t group =
      c.num_key_value_heads > 0 ? c.num_attention_heads / c.num_key_value_heads : 0;
  check_gqa_group(group, origin, "num_attention_heads / num_key_value_heads");
  bool any_moe = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) any_moe |= c.is_moe_layer(l);
  if (any_moe) {
    // The CUDA MoE kernels' limits (backend/cuda/moe.h).
    TANDEM_CHECK_KIND(kUnsupported, c.num_experts <= cuda::kRouterMaxExperts, origin,
                      ": num_experts ", c.num_experts, " is not supported on the GPU (at most ",
                      cuda::kRouterMaxExperts, ")");
    TANDEM_CHECK_KIND(kUnsupported, c.num_experts_per_tok <= cuda::kRouterMaxTopK, origin,
                      ": num_experts_per_tok ", c.num_experts_per_tok,
                      " is not supported on the GPU (at most ", cuda::kRouterMaxTopK, ")");
  }
}

}  // namespace tandem
