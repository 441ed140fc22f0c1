// Block-scaled FP8 GEMM on Hopper through cuBLASLt: y[m, n] (bf16) = x W^T with
//   x: E4M3 activations [m, k] and one f32 scale per token and 128-column group
//      (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F), made by fp8_quantize_act_launch;
//   W: E4M3 weights [n, k] (the checkpoint's [out, in]) and one f32 scale per 128x128 block
//      (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F): Qwen's weight_scale_inv, repacked.
// fp32 accumulation with the scales applied per 128-deep K block (no fast accumulation).
//
// Scale layouts cuBLASLt expects (the ones PyTorch's scaled_mm passes for BlockWise1x128 x
// BlockWise128x128):
//   activation scales: K-block major, tokens contiguous: s_x[kb * m_pad + i], kb < k / 128,
//     m_pad = fp8_pad_m(m); the GEMM runs over m_pad rows (the quantizer zero-fills rows m..m_pad,
//     so x and y hold m_pad rows);
//   weight scales: row-major [ceil(n / 128)][fp8_weight_scale_ld(k)], K blocks padded to a
//     multiple of 4 (fp8_pack_weight_scales does it from the checkpoint's [ceil(n/128),
//     ceil(k/128)]).
// Shapes: k % 128 == 0, n % 16 == 0.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace tandem::cuda {

/// Rows the FP8 GEMM and its activation buffers are sized for: m rounded up to 4.
constexpr int64_t fp8_pad_m(int64_t m) { return (m + 3) / 4 * 4; }
/// Row stride (floats) of the packed weight scales: ceil(k / 128) rounded up to 4.
constexpr int64_t fp8_weight_scale_ld(int64_t k) { return ((k + 127) / 128 + 3) / 4 * 4; }

/// Checkpoint weight_scale_inv [ceil(n/128), ceil(k/128)] row-major -> the packed host layout
/// above (padding zero).
std::vector<float> fp8_pack_weight_scales(const float* scale_inv, int64_t n, int64_t k);

struct Fp8QuantParams {
  const __nv_bfloat16* x;  // [m, k]
  uint8_t* q;              // [m_pad, k] E4M3; rows m..m_pad zero
  float* scale;            // [k / 128, m_pad]: scale[kb * m_pad + i]
  int64_t m, k;            // k % 128 == 0
};

/// Per token and 128-column group: s = amax / 448 (1 for an all-zero group), q = e4m3(x *
/// (448 / amax)) rounded to nearest even (satfinite), fp8_linear.h's FP8 activation numerics.
/// One warp per group.
void fp8_quantize_act_launch(const Fp8QuantParams& p, cudaStream_t stream);

struct Fp8GemmParams {
  const uint8_t* x;      // [m_pad, k] E4M3
  const float* x_scale;  // [k / 128, m_pad]
  const uint8_t* w;      // [n, k] E4M3
  const float* w_scale;  // [ceil(n / 128), fp8_weight_scale_ld(k)]
  __nv_bfloat16* y;      // [m_pad, n]
  int64_t m, n, k;       // m as given (the GEMM runs over fp8_pad_m(m) rows)
};

/// Owns a cuBLASLt handle and workspace; caches one plan per (m_pad, n, k). Not thread safe;
/// one per stream. run() is CUDA-graph capturable once the shape's plan exists.
class Fp8GemmLt {
 public:
  explicit Fp8GemmLt(size_t workspace_bytes = size_t{32} << 20);
  ~Fp8GemmLt();
  Fp8GemmLt(Fp8GemmLt const&) = delete;
  Fp8GemmLt& operator=(Fp8GemmLt const&) = delete;

  /// Throws kUnsupported when cuBLASLt has no block-scaled algorithm here (not Hopper, cuBLAS
  /// older than 12.9) or the shape breaks the rules above.
  void run(Fp8GemmParams const& p, cudaStream_t stream);
  size_t num_plans() const { return plans_.size(); }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Plan& plan_for(int64_t m_pad, int64_t n, int64_t k);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  void* scale_placeholder_ = nullptr;  // [256 B] scale pointer for plan creation
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int64_t, int64_t, int64_t>, Plan> plans_;
};

}  // namespace tandem::cuda
