// Dense GEMM through cuBLASLt: y = alpha * x W^T + beta * y, bf16 in and out, fp32
// accumulation. W in the Hugging Face [out, in] layout.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

struct GemmParams {
  bf16 const* x;  // [m, k]
  bf16 const* w;  // [n, k]
  bf16* y;        // [m, n]
  int64_t m, n, k;
  float alpha = 1.0f;
  float beta = 0.0f;  // 0: y is only written
};

/// Owns a cuBLASLt handle and workspace on the current device and caches one matmul plan
/// (descriptors + heuristic algorithm) per (m, n, k, beta != 0, pointer alignment). Not thread
/// safe; one per stream. run() is CUDA-graph capturable once the shape's plan exists (call it
/// once first, with pointers of the same alignment).
class GemmLt {
 public:
  explicit GemmLt(size_t workspace_bytes = size_t{32} << 20);
  ~GemmLt();
  GemmLt(GemmLt const&) = delete;
  GemmLt& operator=(GemmLt const&) = delete;

  void run(GemmParams const& p, cudaStream_t stream);
  /// Number of cached plans (shapes seen).
  size_t num_plans() const { return plans_.size(); }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Plan& plan_for(int64_t m, int64_t n, int64_t k, bool beta, uint32_t align);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int64_t, int64_t, int64_t, bool, uint32_t>, Plan> plans_;
};

}  // namespace tandem::cuda
