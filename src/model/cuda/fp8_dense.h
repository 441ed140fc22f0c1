// W8A8 dense linears of the CUDA models at prefill sizes: cuBLASLt's block-scaled FP8 GEMM
// (backend/cuda/fp8_gemm.h: 1x128 activation scales x 128x128 weight scales) over the weights
// the model keeps in E4M3 with row scales (backend/cuda/fp8_linear.h), instead of dequantizing
// them into a bf16 scratch. The activations are quantized per token and 128-column group by
// fp8_quantize_act_launch (the FP8 activation numerics of fp8_linear.h, the same as the W8A8
// grouped GEMM's in-kernel quantizer). Host code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "backend/cuda/fp8_gemm.h"
#include "model/cuda/cuda_mem.h"

namespace tandem::cuda_model {

class Fp8DenseLt {
 public:
  /// Scratch for the quantized activations of up to max_rows rows of up to max_k columns.
  Fp8DenseLt(int64_t max_rows, int64_t max_k);

  /// y[m, n] (bf16) = x[m, k] W^T for the E4M3 weight q [n, k] with row scales [n, ceil(k /
  /// 128)]: the rows in multiples of 4 through cuBLASLt, the last m % 4 through the W8A8 grouped
  /// GEMM (moe_gemm.h, one dense expert). False (nothing launched) when this weight or shape
  /// cannot take it: k % 128 or n % 16 not 0, m < 4 or above the scratch, row scales that are
  /// not one value per 128-row block (a shard starting inside a block), no cuBLASLt
  /// block-scaled algorithm here, or the weight's first use inside a graph capture. The first
  /// use of a weight packs its block scales (a device -> host copy and a sync: eager only).
  bool run(const __nv_bfloat16* x, const uint8_t* q, const float* row_scale, __nv_bfloat16* y,
           int64_t m, int64_t n, int64_t k, cudaStream_t stream);

 private:
  struct Scales {
    DeviceMem packed;  // [ceil(n / 128), fp8_weight_scale_ld(k)]
    bool ok = false;
  };
  Scales const& scales_for(const uint8_t* q, const float* row_scale, int64_t n, int64_t k,
                           cudaStream_t stream);

  int64_t max_rows_, max_k_;
  std::unique_ptr<cuda::Fp8GemmLt> lt_;
  bool lt_ok_ = true;
  DeviceMem xq_, xs_;
  std::unordered_map<const uint8_t*, Scales> scales_;
};

}  // namespace tandem::cuda_model
