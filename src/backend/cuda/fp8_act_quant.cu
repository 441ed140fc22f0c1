// Fused activation quantizers for the W8A8 grouped GEMM (fp8_act_quant.h). Each 128-column
// group is one warp, 4 columns a lane: amax by shuffles, then the E4M3 codes and the scale.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_act_quant.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

// v[4]: lane's 4 values of a 128-column group (already the bf16-rounded activation). Writes
// the 4 codes at q (4-byte aligned) and, from lane 0, the group's scale.
__device__ __forceinline__ void quantize_group4(float const (&v)[4], int lane, uint8_t* q,
                                                float* scale) {
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
  *reinterpret_cast<uint32_t*>(q) = packed;
  if (lane == 0) *scale = s;
}

__device__ __forceinline__ void load_bf16x4(__nv_bfloat16 const* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat16*>(&raw);
  for (int i = 0; i < 4; ++i) v[i] = __bfloat162float(h[i]);
}

__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* p, float const (&v)[4]) {
  uint2 raw;
  auto* h = reinterpret_cast<__nv_bfloat16*>(&raw);
  for (int i = 0; i < 4; ++i) h[i] = __float2bfloat16_rn(v[i]);
  *reinterpret_cast<uint2*>(p) = raw;
}

__device__ __forceinline__ float round_bf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

constexpr int kNormWarps = 8;
constexpr int kNormMaxGroupsPerWarp = 8;  // dim <= 8 * 8 * 128 = 8192

// One block of 8 warps per row; warp w owns groups w, w + 8, ...; values stay in registers
// between the mean-square pass and the quantization.
__global__ void __launch_bounds__(kNormWarps * 32) rms_norm_fp8_kernel(RmsNormFp8Params p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  const int64_t groups = p.dim / 128;
  __nv_bfloat16 const* x = p.x + row * p.dim;
  __nv_bfloat16* res = p.residual ? p.residual + row * p.dim : nullptr;
  float v[kNormMaxGroupsPerWarp][4];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kNormMaxGroupsPerWarp; ++i) {
    const int64_t g = warp + static_cast<int64_t>(i) * kNormWarps;
    if (g < groups) {
      const int64_t col = g * 128 + lane * 4;
      load_bf16x4(x + col, v[i]);
      if (res != nullptr) {
        float r[4];
        load_bf16x4(res + col, r);
        for (int j = 0; j < 4; ++j) v[i][j] = round_bf16(r[j] + v[i][j]);
        store_bf16x4(res + col, v[i]);
      }
      for (int j = 0; j < 4; ++j) ss += v[i][j] * v[i][j];
    }
  }
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  __shared__ float partial[kNormWarps];
  if (lane == 0) partial[warp] = ss;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kNormWarps; ++w) total += partial[w];
  const float inv = rsqrtf(total / static_cast<float>(p.dim) + p.eps);
#pragma unroll
  for (int i = 0; i < kNormMaxGroupsPerWarp; ++i) {
    const int64_t g = warp + static_cast<int64_t>(i) * kNormWarps;
    if (g < groups) {
      const int64_t col = g * 128 + lane * 4;
      float wt[4], o[4];
      load_bf16x4(p.weight + col, wt);
      for (int j = 0; j < 4; ++j) o[j] = round_bf16(wt[j] * (v[i][j] * inv));
      if (p.out != nullptr) store_bf16x4(p.out + row * p.dim + col, o);
      quantize_group4(o, lane, p.q + row * p.dim + col, p.scale + row * groups + g);
    }
  }
}

constexpr int kWarpsPerBlock = 8;

__global__ void gather_fp8_kernel(Fp8GatherQuantParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = p.k / 128;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (task >= p.rows * groups) return;
  const int64_t row = task / groups, g = task % groups;
  if (p.row_count != nullptr && row >= *p.row_count) return;
  const int64_t token = p.src[row] / p.div;
  const int64_t col = g * 128 + lane * 4;
  float v[4];
  load_bf16x4(p.x + token * p.k + col, v);
  quantize_group4(v, lane, p.q + row * p.k + col, p.scale + row * groups + g);
}

__global__ void silu_mul_fp8_kernel(SiluMulFp8Params p) {
  const int lane = threadIdx.x & 31;
  const int64_t groups = p.inter / 128;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (task >= p.rows * groups) return;
  const int64_t row = task / groups, g = task % groups;
  if (p.row_count != nullptr && row >= *p.row_count) return;
  const int64_t col = g * 128 + lane * 4;
  float gate[4], up[4], v[4];
  int64_t gcol = col, ucol = p.inter + col;
  if (p.interleave > 0) {
    gcol = (col / p.interleave) * 2 * p.interleave + col % p.interleave;
    ucol = gcol + p.interleave;
  }
  load_bf16x4(p.gate_up + row * 2 * p.inter + gcol, gate);
  load_bf16x4(p.gate_up + row * 2 * p.inter + ucol, up);
  for (int j = 0; j < 4; ++j) v[j] = round_bf16(gate[j] / (1.0f + expf(-gate[j])) * up[j]);
  quantize_group4(v, lane, p.q + row * p.inter + col, p.scale + row * groups + g);
}

unsigned blocks_for(int64_t tasks) {
  return static_cast<unsigned>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

void rms_norm_quantize_fp8_launch(RmsNormFp8Params const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(
      kUnsupported,
      p.dim > 0 && p.dim % 128 == 0 && p.dim <= 128 * kNormWarps * kNormMaxGroupsPerWarp,
      "rms_norm_quantize_fp8: dim (", p.dim, ") must be a positive multiple of 128, at most 8192");
  TANDEM_CHECK_KIND(kInvalidArgument, p.x && p.weight && p.q && p.scale,
                    "rms_norm_quantize_fp8: x, weight, q and scale must be set");
  if (p.rows <= 0) return;
  rms_norm_fp8_kernel<<<static_cast<unsigned>(p.rows), kNormWarps * 32, 0, stream>>>(p);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void fp8_gather_quantize_launch(Fp8GatherQuantParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kUnsupported, p.k > 0 && p.k % 128 == 0, "fp8_gather_quantize: k (", p.k,
                    ") must be a positive multiple of 128");
  TANDEM_CHECK_KIND(kInvalidArgument, p.x && p.src && p.q && p.scale && p.div >= 1,
                    "fp8_gather_quantize: x, src, q, scale must be set and div >= 1");
  if (p.rows <= 0) return;
  gather_fp8_kernel<<<blocks_for(p.rows * (p.k / 128)), kWarpsPerBlock * 32, 0, stream>>>(p);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void silu_mul_quantize_fp8_launch(SiluMulFp8Params const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kUnsupported, p.inter > 0 && p.inter % 128 == 0,
                    "silu_mul_quantize_fp8: inter (", p.inter,
                    ") must be a positive multiple of 128");
  TANDEM_CHECK_KIND(kInvalidArgument, p.gate_up && p.q && p.scale,
                    "silu_mul_quantize_fp8: gate_up, q and scale must be set");
  TANDEM_CHECK_KIND(kUnsupported,
                    p.interleave == 0 || (p.interleave % 4 == 0 && 128 % p.interleave == 0),
                    "silu_mul_quantize_fp8: interleave (", p.interleave,
                    ") must be 0 or a multiple of 4 dividing 128");
  if (p.rows <= 0) return;
  silu_mul_fp8_kernel<<<blocks_for(p.rows * (p.inter / 128)), kWarpsPerBlock * 32, 0, stream>>>(p);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tandem::cuda
