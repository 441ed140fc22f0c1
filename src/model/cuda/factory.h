// Building a CUDA model: the architecture from config.json's model_type, the checks the server
// runs before touching the GPU, and the KV budget arithmetic.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "model/config.h"
#include "model/cuda/options.h"
#include "model/model.h"

namespace tandem {

/// The CUDA model for the checkpoint in `dir`, picked by config.json's model_type (qwen3_moe:
/// Qwen3MoeCuda; qwen3_5_moe / qwen3_5_moe_text: Qwen35MoeCuda).
std::unique_ptr<Model> load_cuda_model(const std::string& dir, const CudaModelOptions& opts);

/// The KV cache a GPU can give once the model is loaded, as vLLM's --gpu-memory-utilization:
/// what is free beyond the share (1 - utilization) of the device's memory left unused, in MiB
/// (at least 64). CPU-only arithmetic; CudaRunner::kv_cache_budget_mb asks the device.
int64_t kv_cache_mb_for(size_t free_bytes, size_t total_bytes, double utilization);

/// Checks that the CUDA model covers `config` (throws kUnsupported naming `origin` and the
/// field otherwise). CPU-only: the server calls it before touching the GPU.
void check_cuda_model_config(const ModelConfig& config, const std::string& origin);

/// A local GQA group (query heads per KV head) the CUDA attention kernels take (1, 2, 4, 8 or
/// 16); throws kUnsupported naming `origin` and `what` otherwise.
void check_gqa_group(int64_t group, const std::string& origin, const char* what);

}  // namespace tandem
