// Embedding gather, RMSNorm (+ fused residual add), q/k RMSNorm + RoPE. See norm.h.
#include <cmath>

#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/decode_switches.h"
#include "backend/cuda/kv_fp8.cuh"
#include "backend/cuda/norm.h"

namespace tandem::cuda {

using namespace detail;

namespace {

// ---------------------------------------------------------------- embedding
// One block per token; kVec bf16 per thread access.
template <int kVec>
__global__ void embedding_kernel(EmbeddingParams p) {
  pdl_wait();
  const int64_t t = blockIdx.x;
  const int32_t id = p.ids[t];
  if (id < 0 || id >= p.vocab) __trap();  // NOTE: ids are validated at the boundary
  bf16 const* gSrc = p.table + static_cast<int64_t>(id) * p.hidden;
  bf16* gDst = p.out + t * p.hidden;
  for (int64_t i = threadIdx.x * kVec; i < p.hidden; i += blockDim.x * kVec) {
    copy_bf16<kVec>(gDst + i, gSrc + i);
  }
}

// ---------------------------------------------------------------- rms norm
// One block per row; two passes over the row (the second one hits L1/L2).
template <int kVec, bool kAdd>
__global__ void rms_norm_kernel(bf16 const* __restrict__ x, bf16* residual,
                                bf16 const* __restrict__ weight, bf16* out, int64_t dim, float eps,
                                bool trigger) {
  pdl_wait();
  if (trigger) pdl_trigger();  // the next linear may stream its weights meanwhile
  const int64_t row = blockIdx.x;
  bf16 const* gX = x + row * dim;
  bf16* gRes = kAdd ? residual + row * dim : nullptr;
  bf16* gOut = out + row * dim;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * kVec;
  // Pass 1: (residual += x) and the sum of squares of what the norm reads.
  float ss = 0.f;
  for (int64_t i = threadIdx.x * kVec; i < dim; i += stride) {
    float rX[kVec];
    load_bf16<kVec>(gX + i, rX);
    if constexpr (kAdd) {
      float rR[kVec];
      load_bf16<kVec>(gRes + i, rR);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        // the norm reads the bf16-rounded residual it stores
        rX[j] = __bfloat162float(__float2bfloat16_rn(rR[j] + rX[j]));
      }
      store_bf16<kVec>(gRes + i, rX);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) ss += rX[j] * rX[j];
  }
  ss = block_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
  // Pass 2: normalise and scale (each thread re-reads only what it wrote in pass 1).
  bf16 const* gIn = kAdd ? gRes : gX;
  for (int64_t i = threadIdx.x * kVec; i < dim; i += stride) {
    float rX[kVec], rW[kVec];
    load_bf16<kVec>(gIn + i, rX);
    load_bf16<kVec>(weight + i, rW);
#pragma unroll
    for (int j = 0; j < kVec; ++j) rX[j] = rW[j] * (rX[j] * inv);
    store_bf16<kVec>(gOut + i, rX);
  }
}

template <bool kAdd>
void rms_norm_dispatch(bf16 const* x, bf16* residual, bf16 const* weight, bf16* out, int64_t rows,
                       int64_t dim, float eps, cudaStream_t stream) {
  TANDEM_CHECK(dim > 0 && rows >= 0, "rms_norm: rows ", rows, " dim ", dim);
  if (rows == 0) return;
  TANDEM_CHECK(rows <= INT32_MAX, "rms_norm: too many rows ", rows);
  const bool vec8 = dim % 8 == 0 && aligned_to(16, x, residual, weight, out);
  const int vec = vec8 ? 8 : 1;
  const int threads = row_threads((dim + vec - 1) / vec, 1024);
  switch (vec) {
    case 8:
      TANDEM_CUDA_CHECK(launch_pdl(rms_norm_kernel<8, kAdd>, static_cast<unsigned>(rows), threads,
                                   0, stream, x, residual, weight, out, dim, eps,
                                   decode_switches().pdl_trigger));
      break;
    case 1:
      TANDEM_CUDA_CHECK(launch_pdl(rms_norm_kernel<1, kAdd>, static_cast<unsigned>(rows), threads,
                                   0, stream, x, residual, weight, out, dim, eps,
                                   decode_switches().pdl_trigger));
      break;
    default: TANDEM_THROW(kUnsupported, "rms_norm: unsupported vector width ", vec);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

// ---------------------------------------------------------------- q/k norm + rope
constexpr int kMaxHalf = 64;
struct InvFreq {
  float v[kMaxHalf];  // [head_dim / 2]
};

// One block per token (4 warps); one warp per head. Lane l owns elements
// [l * kPer, (l + 1) * kPer) of each half, so rotate-half pairs stay in one thread.
template <int kHeadDim>
__global__ void __launch_bounds__(128) qk_norm_rope_kernel(QkNormRopeParams p, InvFreq f) {
  pdl_wait();
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kPer = kHalf / 32;  // 1 (64) or 2 (128)
  __shared__ float sCos[kHalf], sSin[kHalf];
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(p.positions[t]);
  for (int i = threadIdx.x; i < kHalf; i += blockDim.x) {
    float s, c;
    sincosf(pos * f.v[i], &s, &c);
    sCos[i] = c;
    sSin[i] = s;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t heads = p.num_q_heads + p.num_kv_heads;
  const int i0 = lane * kPer;
  for (int64_t h = warp; h < heads; h += nwarps) {
    const bool is_q = h < p.num_q_heads;
    bf16* gH = is_q ? p.q + (t * p.num_q_heads + h) * kHeadDim
                    : p.k + (t * p.num_kv_heads + (h - p.num_q_heads)) * kHeadDim;
    bf16 const* w = is_q ? p.q_weight : p.k_weight;
    float r1[kPer], r2[kPer];
    load_bf16<kPer>(gH + i0, r1);
    load_bf16<kPer>(gH + kHalf + i0, r2);
    if (w != nullptr) {
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) ss += r1[j] * r1[j] + r2[j] * r2[j];
      ss = warp_sum(ss);
      const float inv = 1.0f / sqrtf(ss / static_cast<float>(kHeadDim) + p.eps);
      float w1[kPer], w2[kPer];
      load_bf16<kPer>(w + i0, w1);
      load_bf16<kPer>(w + kHalf + i0, w2);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        r1[j] = w1[j] * (r1[j] * inv);
        r2[j] = w2[j] * (r2[j] * inv);
      }
    }
    float o1[kPer], o2[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float c = sCos[i0 + j], s = sSin[i0 + j];
      o1[j] = r1[j] * c - r2[j] * s;
      o2[j] = r2[j] * c + r1[j] * s;
    }
    store_bf16<kPer>(gH + i0, o1);
    store_bf16<kPer>(gH + kHalf + i0, o2);
  }
}

// Same layout as qk_norm_rope_kernel; heads [0, q) are q, [q, q + kv) k, [q + kv, q + 2 kv) v.
template <int kHeadDim>
__global__ void __launch_bounds__(128) qkv_prep_kernel(QkvPrepParams p, InvFreq f, bool trigger) {
  pdl_wait();
  if (trigger) pdl_trigger();
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kPer = kHalf / 32;
  __shared__ float sCos[kHalf], sSin[kHalf];
  const int64_t t = blockIdx.x;
  const float pos = static_cast<float>(p.positions[t]);
  for (int i = threadIdx.x; i < kHalf; i += blockDim.x) {
    float s, c;
    sincosf(pos * f.v[i], &s, &c);
    sCos[i] = c;
    sSin[i] = s;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t qh = p.num_q_heads, kvh = p.num_kv_heads, heads = qh + 2 * kvh;
  const int64_t slot = p.slot_index[t];
  const int i0 = lane * kPer;
  bf16 const* gRow = p.qkv + t * heads * kHeadDim;
  // blockIdx.y splits the token's heads over several blocks (a decode step has few tokens).
  for (int64_t h = blockIdx.y * nwarps + warp; h < heads; h += gridDim.y * nwarps) {
    bf16 const* gSrc = gRow + h * kHeadDim;
    bf16* gDst;
    uint8_t* gDst8 = nullptr;  // fp8 pool: this k or v row's codes
    if (h < qh) {
      gDst = p.q_out + (t * qh + h) * kHeadDim;
    } else {
      if (slot < 0) continue;
      const int64_t kv = h < qh + kvh ? 0 : 1, kh = h - qh - kv * kvh;
      const int64_t page = slot / p.page_size, s = slot % p.page_size;
      const int64_t off = (((page * 2 + kv) * kvh + kh) * p.page_size + s) * kHeadDim;
      gDst = p.pool + off;
      if (p.kv_fp8) gDst8 = reinterpret_cast<uint8_t*>(p.pool) + off;
    }
    float r1[kPer], r2[kPer];
    load_bf16<kPer>(gSrc + i0, r1);
    load_bf16<kPer>(gSrc + kHalf + i0, r2);
    if (h >= qh + kvh) {  // v: copied unchanged (fp8: quantized)
      if (gDst8 != nullptr) {
        store_kv_fp8<kPer>(gDst8 + i0, r1, p.v_scale);
        store_kv_fp8<kPer>(gDst8 + kHalf + i0, r2, p.v_scale);
      } else {
        store_bf16<kPer>(gDst + i0, r1);
        store_bf16<kPer>(gDst + kHalf + i0, r2);
      }
      continue;
    }
    bf16 const* w = h < qh ? p.q_weight : p.k_weight;
    if (w != nullptr) {
      float ss = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) ss += r1[j] * r1[j] + r2[j] * r2[j];
      ss = warp_sum(ss);
      const float inv = 1.0f / sqrtf(ss / static_cast<float>(kHeadDim) + p.eps);
      float w1[kPer], w2[kPer];
      load_bf16<kPer>(w + i0, w1);
      load_bf16<kPer>(w + kHalf + i0, w2);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        r1[j] = w1[j] * (r1[j] * inv);
        r2[j] = w2[j] * (r2[j] * inv);
      }
    }
    float o1[kPer], o2[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const float c = sCos[i0 + j], s = sSin[i0 + j];
      o1[j] = r1[j] * c - r2[j] * s;
      o2[j] = r2[j] * c + r1[j] * s;
    }
    if (gDst8 != nullptr) {
      store_kv_fp8<kPer>(gDst8 + i0, o1, p.k_scale);
      store_kv_fp8<kPer>(gDst8 + kHalf + i0, o2, p.k_scale);
    } else {
      store_bf16<kPer>(gDst + i0, o1);
      store_bf16<kPer>(gDst + kHalf + i0, o2);
    }
  }
}

// inv_freq exactly as the CPU reference (and transformers) computes it, in fp32.
InvFreq make_inv_freq(int64_t head_dim, double theta) {
  InvFreq f{};
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    float expo = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    f.v[i] = 1.0f / static_cast<float>(std::pow(static_cast<float>(theta), expo));
  }
  return f;
}

}  // namespace

void embedding_launch(EmbeddingParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0 && p.hidden > 0, "embedding: tokens ", p.num_tokens, " hidden ",
               p.hidden);
  if (p.num_tokens == 0) return;
  TANDEM_CHECK(p.num_tokens <= INT32_MAX, "embedding: too many tokens ", p.num_tokens);
  const int vec = p.hidden % 8 == 0 && aligned_to(16, p.table, p.out) ? 8 : 1;
  const int threads = row_threads((p.hidden + vec - 1) / vec, 256);
  const unsigned blocks = static_cast<unsigned>(p.num_tokens);
  switch (vec) {
    case 8:
      TANDEM_CUDA_CHECK(launch_pdl(embedding_kernel<8>, blocks, threads, 0, stream, p));
      break;
    case 1:
      TANDEM_CUDA_CHECK(launch_pdl(embedding_kernel<1>, blocks, threads, 0, stream, p));
      break;
    default: TANDEM_THROW(kUnsupported, "embedding: unsupported vector width ", vec);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void rms_norm_launch(RmsNormParams const& p, cudaStream_t stream) {
  rms_norm_dispatch<false>(p.x, nullptr, p.weight, p.out, p.rows, p.dim, p.eps, stream);
}

void add_rms_norm_launch(AddRmsNormParams const& p, cudaStream_t stream) {
  rms_norm_dispatch<true>(p.x, p.residual, p.weight, p.out, p.rows, p.dim, p.eps, stream);
}

void qk_norm_rope_launch(QkNormRopeParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0 && p.num_q_heads >= 0 && p.num_kv_heads >= 0,
               "qk_norm_rope: bad sizes");
  if (p.head_dim != 64 && p.head_dim != 128) {
    TANDEM_THROW(kUnsupported, "qk_norm_rope: unsupported head_dim ", p.head_dim);
  }
  if (p.num_tokens == 0) return;
  TANDEM_CHECK(p.num_tokens <= INT32_MAX, "qk_norm_rope: too many tokens ", p.num_tokens);
  const InvFreq f = make_inv_freq(p.head_dim, p.rope_theta);
  const unsigned blocks = static_cast<unsigned>(p.num_tokens);
  const int64_t heads = p.num_q_heads + p.num_kv_heads;
  const int threads = heads >= 4 ? 128 : static_cast<int>(std::max<int64_t>(heads, 1) * 32);
  switch (p.head_dim) {
    case 64: qk_norm_rope_kernel<64><<<blocks, threads, 0, stream>>>(p, f); break;
    case 128: qk_norm_rope_kernel<128><<<blocks, threads, 0, stream>>>(p, f); break;
    default: TANDEM_THROW(kUnsupported, "qk_norm_rope: unsupported head_dim ", p.head_dim);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void qkv_prep_launch(QkvPrepParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0 && p.num_q_heads >= 0 && p.num_kv_heads >= 0 && p.page_size > 0,
               "qkv_prep: bad sizes");
  if (p.head_dim != 64 && p.head_dim != 128) {
    TANDEM_THROW(kUnsupported, "qkv_prep: unsupported head_dim ", p.head_dim);
  }
  if (p.num_tokens == 0) return;
  TANDEM_CHECK(p.num_tokens <= INT32_MAX, "qkv_prep: too many tokens ", p.num_tokens);
  const InvFreq f = make_inv_freq(p.head_dim, p.rope_theta);
  const int64_t heads = p.num_q_heads + 2 * p.num_kv_heads;
  const int threads = heads >= 4 ? 128 : static_cast<int>(std::max<int64_t>(heads, 1) * 32);
  // Few tokens: a block per (token, group of 4 heads) so a decode step spreads over the SMs.
  const int64_t head_blocks = p.num_tokens >= 256 ? 1 : std::min<int64_t>((heads + 3) / 4, 32);
  const dim3 blocks(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(head_blocks));
  switch (p.head_dim) {
    case 64:
      TANDEM_CUDA_CHECK(launch_pdl(qkv_prep_kernel<64>, blocks, threads, 0, stream, p, f,
                                   decode_switches().pdl_trigger));
      break;
    case 128:
      TANDEM_CUDA_CHECK(launch_pdl(qkv_prep_kernel<128>, blocks, threads, 0, stream, p, f,
                                   decode_switches().pdl_trigger));
      break;
    default: TANDEM_THROW(kUnsupported, "qkv_prep: unsupported head_dim ", p.head_dim);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
