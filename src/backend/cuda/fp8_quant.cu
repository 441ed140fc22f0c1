// Activation quantization for the block-scaled FP8 GEMM (fp8_gemm.h): per token and
// 128-column group, s = amax / 448 and q = e4m3(x * (448 / amax)) (fp8_linear.h: the FP8
// activation numerics, shared with the grouped GEMM's in-kernel quantizer). One warp per
// group, 4 columns a lane.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_gemm.h"
#include "backend/cuda/fp8_linear.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kWarpsPerBlock = 4;

__global__ void fp8_quantize_act_kernel(const __nv_bfloat16* __restrict__ x,
                                        uint8_t* __restrict__ q, float* __restrict__ scale,
                                        int64_t m, int64_t m_pad, int64_t k) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = k / 128;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (task >= m_pad * groups) return;
  const int64_t row = task / groups, g = task % groups;
  const int64_t col = g * 128 + lane * 4;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (row < m) {
    const uint2 raw = *reinterpret_cast<const uint2*>(x + row * k + col);  // 4 bf16
    const auto* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
    for (int i = 0; i < 4; ++i) v[i] = __bfloat162float(h[i]);
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int off = 16; off > 0; off >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = amax > 0.f ? __fdiv_rn(amax, 448.0f) : 1.0f;
  const float inv = amax > 0.f ? fminf(__fdiv_rn(448.0f, amax), 3.402823466e38f) : 1.0f;
  uint32_t packed = 0;
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8_storage_t c =
        __nv_cvt_float_to_fp8(__fmul_rn(v[i], inv), __NV_SATFINITE, __NV_E4M3);
    packed |= static_cast<uint32_t>(c) << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(q + row * k + col) = packed;
  if (lane == 0) scale[g * m_pad + row] = s;
}

// Row-major scales [m, ceil(k / 128)] for the W8A8 grouped GEMM (fp8_linear.h); a last partial
// group of k % 128 columns (k % 4 == 0) is its own group.
__global__ void fp8_quantize_rows_kernel(const __nv_bfloat16* __restrict__ x,
                                         uint8_t* __restrict__ q, float* __restrict__ scale,
                                         int64_t m, int64_t k) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = (k + 127) / 128;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (task >= m * groups) return;
  const int64_t row = task / groups, g = task % groups;
  const int64_t col = g * 128 + lane * 4;
  const bool valid = col < k;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (valid) {
    const uint2 raw = *reinterpret_cast<const uint2*>(x + row * k + col);
    const auto* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
    for (int i = 0; i < 4; ++i) v[i] = __bfloat162float(h[i]);
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int off = 16; off > 0; off >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float s = amax > 0.f ? __fdiv_rn(amax, 448.0f) : 1.0f;
  const float inv = amax > 0.f ? fminf(__fdiv_rn(448.0f, amax), 3.402823466e38f) : 1.0f;
  uint32_t packed = 0;
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8_storage_t c =
        __nv_cvt_float_to_fp8(__fmul_rn(v[i], inv), __NV_SATFINITE, __NV_E4M3);
    packed |= static_cast<uint32_t>(c) << (8 * i);
  }
  if (valid) *reinterpret_cast<uint32_t*>(q + row * k + col) = packed;
  if (lane == 0) scale[row * groups + g] = s;
}

}  // namespace

void fp8_quantize_rows_launch(const __nv_bfloat16* x, uint8_t* q, float* scale, int64_t m,
                              int64_t k, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kUnsupported, k > 0 && k % 16 == 0, "fp8 quantize rows: k (", k,
                    ") must be a positive multiple of 16");
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      reinterpret_cast<uintptr_t>(x) % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0,
      "fp8 quantize rows: x must be 8-byte and q 4-byte aligned");
  if (m <= 0) return;
  const int64_t tasks = m * ((k + 127) / 128);
  const int64_t blocks = (tasks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  fp8_quantize_rows_kernel<<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, stream>>>(
      x, q, scale, m, k);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void fp8_quantize_act_launch(const Fp8QuantParams& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kUnsupported, p.k > 0 && p.k % 128 == 0, "fp8 quantize: k (", p.k,
                    ") must be a positive multiple of 128");
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      reinterpret_cast<uintptr_t>(p.x) % 8 == 0 && reinterpret_cast<uintptr_t>(p.q) % 4 == 0,
      "fp8 quantize: x must be 8-byte and q 4-byte aligned");
  if (p.m <= 0) return;
  const int64_t m_pad = fp8_pad_m(p.m);
  const int64_t tasks = m_pad * (p.k / 128);
  const int64_t blocks = (tasks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  fp8_quantize_act_kernel<<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, stream>>>(
      p.x, p.q, p.scale, p.m, m_pad, p.k);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tandem::cuda
