// The model the real-engine HTTP tests run over: the CPU model, or with TANDEM_TEST_DEVICE=cuda
// (tools/gpu_model_run.sh) the GPU model sized from the engine's config.
#pragma once

#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/engine.h"
#include "model/qwen3_moe.h"
#ifdef TANDEM_WITH_CUDA
#include "model/cuda/qwen3_moe_cuda.h"
#endif

namespace tandem::testing {

inline bool test_device_is_cuda() {
  const char* dev = std::getenv("TANDEM_TEST_DEVICE");
  return dev != nullptr && std::string(dev) == "cuda";
}

inline std::unique_ptr<Model> load_test_model(const std::string& dir, const EngineConfig& cfg) {
  if (test_device_is_cuda()) {
#ifdef TANDEM_WITH_CUDA
    CudaModelOptions o;
    o.max_tokens = cfg.max_batched_tokens;
    o.max_seqs = cfg.max_num_seqs;
    o.page_size = cfg.page_size;
    o.deterministic = cfg.deterministic;
    return Qwen3MoeCuda::load(dir, o);
#else
    throw std::runtime_error("TANDEM_TEST_DEVICE=cuda: built without CUDA");
#endif
  }
  return Qwen3MoeCpu::load(dir);
}

}  // namespace tandem::testing
