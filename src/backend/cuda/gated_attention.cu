// Qwen3.5 gated attention prologue, output gate, shared expert gate. See gated_attention.h.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/gated_attention.h"
#include "backend/cuda/kv_fp8.cuh"

namespace tandem::cuda {

using namespace detail;

namespace {

constexpr int kMaxHalf = 128;
struct InvFreq {
  float v[kMaxHalf];  // [rotary_dim / 2]
};

constexpr int kPrepWarps = 4;

// One block per (token, group of heads); one warp per head. Lane l owns elements l + 32 i; the
// normed head goes through shared memory so that rotate-half partners can be read.
template <int kHeadDim>
__global__ void __launch_bounds__(kPrepWarps * 32)
    gated_qkv_prep_kernel(GatedQkvPrepParams p, InvFreq f) {
  constexpr int kPer = kHeadDim / 32;
  __shared__ float sCos[kMaxHalf], sSin[kMaxHalf];
  __shared__ float sRow[kPrepWarps][kHeadDim];
  const int64_t t = blockIdx.x;
  const int half = static_cast<int>(p.rotary_dim / 2);
  const float pos = static_cast<float>(p.positions[t]);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * f.v[i], &s, &c);
    sCos[i] = c;
    sSin[i] = s;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t qh = p.num_q_heads, kvh = p.num_kv_heads, heads = qh + 2 * kvh;
  const int64_t slot = p.slot_index[t];
  bf16 const* gRow = p.qkv + t * (2 * qh + 2 * kvh) * kHeadDim;
  for (int64_t h = static_cast<int64_t>(blockIdx.y) * kPrepWarps + warp; h < heads;
       h += static_cast<int64_t>(gridDim.y) * kPrepWarps) {
    bf16 const* gSrc;
    bf16* gDst;
    uint8_t* gDst8 = nullptr;  // fp8 pool: this k or v row's codes
    if (h < qh) {
      gSrc = gRow + h * 2 * kHeadDim;
      gDst = p.q_out + (t * qh + h) * kHeadDim;
      bf16* gGate = p.gate_out + (t * qh + h) * kHeadDim;
#pragma unroll
      for (int i = 0; i < kPer; ++i) gGate[lane + 32 * i] = gSrc[kHeadDim + lane + 32 * i];
    } else {
      if (slot < 0) continue;
      const int64_t kv = h < qh + kvh ? 0 : 1, kh = h - qh - kv * kvh;
      gSrc = gRow + 2 * qh * kHeadDim + (kv * kvh + kh) * kHeadDim;
      const int64_t page = slot / p.page_size, s = slot % p.page_size;
      const int64_t off = (((page * 2 + kv) * kvh + kh) * p.page_size + s) * kHeadDim;
      gDst = p.pool + off;
      if (p.kv_fp8) gDst8 = reinterpret_cast<uint8_t*>(p.pool) + off;
    }
    float r[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) r[i] = __bfloat162float(gSrc[lane + 32 * i]);
    if (h >= qh + kvh) {  // v: copied unchanged (fp8: quantized)
      if (gDst8 != nullptr) {
#pragma unroll
        for (int i = 0; i < kPer; ++i) gDst8[lane + 32 * i] = kv_fp8_quantize(r[i], p.v_scale);
      } else {
#pragma unroll
        for (int i = 0; i < kPer; ++i) gDst[lane + 32 * i] = gSrc[lane + 32 * i];
      }
      continue;
    }
    bf16 const* w = h < qh ? p.q_weight : p.k_weight;
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) ss += r[i] * r[i];
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(kHeadDim) + p.eps);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      r[i] = __bfloat162float(w[lane + 32 * i]) * (r[i] * inv);
      sRow[warp][lane + 32 * i] = r[i];
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + 32 * i;
      float o = r[i];
      if (e < half) {
        o = r[i] * sCos[e] - sRow[warp][e + half] * sSin[e];
      } else if (e < 2 * half) {
        o = r[i] * sCos[e - half] + sRow[warp][e - half] * sSin[e - half];
      }
      if (gDst8 != nullptr) {
        gDst8[e] = kv_fp8_quantize(o, p.k_scale);
      } else {
        gDst[e] = __float2bfloat16_rn(o);
      }
    }
    __syncwarp();  // sRow is rewritten by the warp's next head
  }
}

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void sigmoid_mul_kernel(SigmoidMulParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.count) return;
  p.out[i] = __float2bfloat16_rn(__bfloat162float(p.x[i]) * sigmoid_f(__bfloat162float(p.gate[i])));
}

// One block per row.
__global__ void __launch_bounds__(128) shared_expert_gate_kernel(SharedExpertGateParams p) {
  const int64_t r = blockIdx.x;
  bf16 const* xn = p.xn + r * p.hidden;
  float d = 0.f;
  for (int64_t i = threadIdx.x; i < p.hidden; i += blockDim.x) {
    d += __bfloat162float(xn[i]) * __bfloat162float(p.w[i]);
  }
  const float g = sigmoid_f(block_sum(d));
  bf16 const* s = p.s + r * p.hidden;
  bf16* y = p.y + r * p.hidden;
  for (int64_t i = threadIdx.x; i < p.hidden; i += blockDim.x) {
    y[i] = __float2bfloat16_rn(__bfloat162float(y[i]) + g * __bfloat162float(s[i]));
  }
}

}  // namespace

void gated_qkv_prep_launch(GatedQkvPrepParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0 && p.num_q_heads > 0 && p.num_kv_heads > 0 && p.page_size > 0,
               "gated_qkv_prep: bad sizes");
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) {
    TANDEM_THROW(kUnsupported, "gated_qkv_prep: unsupported head_dim ", p.head_dim);
  }
  TANDEM_CHECK(p.rotary_dim > 0 && p.rotary_dim % 2 == 0 && p.rotary_dim <= p.head_dim,
               "gated_qkv_prep: rotary_dim ", p.rotary_dim, " must be even and <= ", p.head_dim);
  TANDEM_CHECK(p.q_weight != nullptr && p.k_weight != nullptr, "gated_qkv_prep: no norm weights");
  if (p.num_tokens == 0) return;
  TANDEM_CHECK(p.num_tokens <= INT32_MAX, "gated_qkv_prep: too many tokens ", p.num_tokens);
  InvFreq f{};
  for (int64_t i = 0; i < p.rotary_dim / 2; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(p.rotary_dim);
    f.v[i] = 1.0f / static_cast<float>(std::pow(static_cast<float>(p.rope_theta), expo));
  }
  const int64_t heads = p.num_q_heads + 2 * p.num_kv_heads;
  // Few tokens: a block per (token, group of 4 heads) so a decode step spreads over the SMs.
  const int64_t head_blocks =
      p.num_tokens >= 256 ? 1 : std::min<int64_t>((heads + kPrepWarps - 1) / kPrepWarps, 32);
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(head_blocks));
  constexpr int threads = kPrepWarps * 32;
  switch (p.head_dim) {
    case 64: gated_qkv_prep_kernel<64><<<grid, threads, 0, stream>>>(p, f); break;
    case 128: gated_qkv_prep_kernel<128><<<grid, threads, 0, stream>>>(p, f); break;
    case 256: gated_qkv_prep_kernel<256><<<grid, threads, 0, stream>>>(p, f); break;
    default: TANDEM_THROW(kUnsupported, "gated_qkv_prep: unsupported head_dim ", p.head_dim);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void sigmoid_mul_launch(SigmoidMulParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.count >= 0, "sigmoid_mul: bad count");
  if (p.count == 0) return;
  constexpr int threads = 256;
  const int64_t blocks = (p.count + threads - 1) / threads;
  TANDEM_CHECK(blocks <= INT32_MAX, "sigmoid_mul: too large");
  sigmoid_mul_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
}

void shared_expert_gate_launch(SharedExpertGateParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.rows >= 0 && p.hidden > 0, "shared_expert_gate: bad sizes");
  if (p.rows == 0) return;
  TANDEM_CHECK(p.rows <= INT32_MAX, "shared_expert_gate: too many rows");
  shared_expert_gate_kernel<<<static_cast<unsigned>(p.rows), 128, 0, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
