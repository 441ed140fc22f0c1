// Gated DeltaNet ops: causal conv1d, the gated delta rule, gated RMSNorm. See deltanet.h.
#include <cmath>

#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/deltanet.h"

namespace tandem::cuda {

using namespace detail;

namespace {

constexpr int kMaxConvKernel = 8;

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// ---------------------------------------------------------------- causal conv1d
// One thread per (token, channel): the kernel's inputs come from x (earlier tokens of the same
// sequence) or from the sequence's window (the positions before its first new token). kDecode
// (one token per sequence): the thread is the window's only reader, so it also shifts the
// window (no conv1d_state_kernel launch).
template <bool kDecode>
__global__ void conv1d_kernel(CausalConv1dParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t t = blockIdx.x;
  if (c >= p.channels) return;
  const int hist = static_cast<int>(p.kernel) - 1;
  const int32_t s = p.seqs.token_seq[t];
  const int64_t begin = p.seqs.seq_begin[s];
  const int64_t i = t - begin;
  const int32_t slot = p.seqs.state_slot[s];
  const bool zero = slot < 0 || p.seqs.fresh[s] != 0;
  float const* win = zero ? nullptr : p.states + slot * p.state_stride + c * hist;
  float acc = 0.f;
  for (int j = 0; j <= hist; ++j) {
    const int64_t m = i - hist + j;  // input index relative to the sequence's first new token
    float v;
    if (m >= 0) {
      v = __bfloat162float(p.x[(begin + m) * p.x_stride + c]);
    } else {
      v = zero ? 0.f : win[hist + m];
    }
    acc += __bfloat162float(p.weight[c * p.kernel + j]) * v;
  }
  p.out[t * p.channels + c] = __float2bfloat16_rn(p.silu ? silu_f(acc) : acc);
  if constexpr (kDecode) {
    if (slot < 0) return;
    float* w = p.states + slot * p.state_stride + c * hist;
    for (int j = 0; j + 1 < hist; ++j) w[j] = zero ? 0.f : w[j + 1];
    w[hist - 1] = __bfloat162float(p.x[t * p.x_stride + c]);
  }
}

// One thread per (sequence, channel): the window becomes the last kernel - 1 inputs. Runs
// after conv1d_kernel (which reads the old window).
__global__ void conv1d_state_kernel(CausalConv1dParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t s = blockIdx.x;
  if (c >= p.channels) return;
  const int32_t slot = p.seqs.state_slot[s];
  if (slot < 0) return;
  const int hist = static_cast<int>(p.kernel) - 1;
  const bool zero = p.seqs.fresh[s] != 0;
  const int64_t begin = p.seqs.seq_begin[s], len = p.seqs.seq_begin[s + 1] - begin;
  float* win = p.states + slot * p.state_stride + c * hist;
  float nw[kMaxConvKernel];
  for (int j = 0; j < hist; ++j) {
    const int64_t m = len - hist + j;
    nw[j] =
        m >= 0 ? __bfloat162float(p.x[(begin + m) * p.x_stride + c]) : (zero ? 0.f : win[hist + m]);
  }
  for (int j = 0; j < hist; ++j) win[j] = nw[j];
}

// ---------------------------------------------------------------- delta rule
// Workspace layout: qn [n, hk, dk] | kn [n, hk, dk] | beta [n, hv] | g [n, hv].
struct Ws {
  float *q, *k, *beta, *g;
};
__host__ __device__ inline Ws ws_at(float* w, int64_t n, int64_t hk, int64_t hv, int64_t dk) {
  return {w, w + n * hk * dk, w + 2 * n * hk * dk, w + 2 * n * hk * dk + n * hv};
}

// One block per token: a warp per q / k head normalises it (fp32); threads compute the gates.
__global__ void __launch_bounds__(128) delta_prep_kernel(GatedDeltaRuleParams p) {
  const int64_t t = blockIdx.x;
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dk = p.k_dim;
  const Ws ws = ws_at(p.workspace, p.num_tokens, hk, hv, dk);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const float q_scale = rsqrtf(static_cast<float>(dk));
  bf16 const* row = p.qkv + t * p.qkv_stride;
  for (int64_t h = warp; h < 2 * hk; h += nwarps) {  // [0, hk): q heads, [hk, 2 hk): k heads
    bf16 const* src = row + h * dk;
    float ss = 0.f;
    for (int64_t i = lane; i < dk; i += 32) {
      const float v = __bfloat162float(src[i]);
      ss += v * v;
    }
    ss = warp_sum(ss);
    const bool is_q = h < hk;
    const float inv = 1.0f / sqrtf(ss + 1e-6f) * (is_q ? q_scale : 1.0f);
    float* dst = (is_q ? ws.q + (t * hk + h) * dk : ws.k + (t * hk + h - hk) * dk);
    for (int64_t i = lane; i < dk; i += 32) dst[i] = __bfloat162float(src[i]) * inv;
  }
  for (int64_t h = threadIdx.x; h < hv; h += blockDim.x) {
    const float b = __bfloat162float(p.b[t * p.ab_stride + h]);
    const float x = __bfloat162float(p.a[t * p.ab_stride + h]) + p.dt_bias[h];
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    ws.beta[t * hv + h] = 1.0f / (1.0f + expf(-b));
    ws.g[t * hv + h] = -expf(p.a_log[h]) * sp;
  }
}

// One block per (32 value columns, value head, sequence): 4 warps split the k_dim rows of the
// state, lane l owns column 32 * blockIdx.x + l; the block's state slice stays in registers
// over the sequence's tokens (read once, written once).
constexpr int kDeltaWarps = 4;
template <int kDk>
__global__ void __launch_bounds__(kDeltaWarps * 32) delta_rule_kernel(GatedDeltaRuleParams p) {
  constexpr int kRows = kDk / kDeltaWarps;
  __shared__ float sQ[kDk], sK[kDk];
  __shared__ float sRed1[kDeltaWarps][32], sRed2[kDeltaWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dv = p.v_dim;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  const int64_t h = blockIdx.y, s = blockIdx.z;
  const int64_t kh = h / (hv / hk);
  const bool col = j < dv;
  const Ws ws = ws_at(p.workspace, p.num_tokens, hk, hv, kDk);
  const int64_t begin = p.seqs.seq_begin[s], end = p.seqs.seq_begin[s + 1];
  const int32_t slot = p.seqs.state_slot[s];
  float* gS = slot >= 0 ? p.states + slot * p.state_stride + h * kDk * dv : nullptr;
  const bool zero = gS == nullptr || p.seqs.fresh[s] != 0;
  const int r0 = warp * kRows;
  float S[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) S[r] = (!zero && col) ? gS[(r0 + r) * dv + j] : 0.f;

  bf16 const* gV = p.qkv + 2 * hk * kDk + h * dv + j;
  for (int64_t t = begin; t < end; ++t) {
    __syncthreads();  // the previous token is done with sQ / sK / sRed1
    for (int i = threadIdx.x; i < kDk; i += blockDim.x) {
      sQ[i] = ws.q[(t * hk + kh) * kDk + i];
      sK[i] = ws.k[(t * hk + kh) * kDk + i];
    }
    __syncthreads();
    const float decay = expf(ws.g[t * hv + h]), beta = ws.beta[t * hv + h];
    float part = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      S[r] *= decay;
      part += S[r] * sK[r0 + r];
    }
    sRed1[warp][lane] = part;
    __syncthreads();
    float kv = 0.f;
#pragma unroll
    for (int w = 0; w < kDeltaWarps; ++w) kv += sRed1[w][lane];
    const float v = col ? __bfloat162float(gV[t * p.qkv_stride]) : 0.f;
    const float delta = (v - kv) * beta;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      S[r] += sK[r0 + r] * delta;
      o += S[r] * sQ[r0 + r];
    }
    sRed2[warp][lane] = o;
    __syncthreads();
    if (warp == 0 && col) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kDeltaWarps; ++w) sum += sRed2[w][lane];
      p.out[(t * hv + h) * dv + j] = sum;
    }
  }
  if (gS != nullptr && col) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) gS[(r0 + r) * dv + j] = S[r];
  }
}

// Multi-token chunks: one warp per (kCols value columns, value head, sequence) holding its
// [k_dim, kCols] state slice in registers over the chunk: lane l owns column l % kCols of the
// block's and rows [part * 16, part * 16 + 16), part = l / kCols (kSplit = k_dim / 16 parts), so
// a lane keeps 16 state values, a dot product ends with log2(kSplit) shuffles, and a 1-sequence
// prefill still has several warps per SM (32 value heads x 128 columns: 1024 warps). A token
// needs no block-wide reduction: q, k of the next token are prefetched into registers while
// this one computes, then staged through a per-warp double buffer (one __syncwarp per token).
template <int kDk>
struct ChunkShape {
  static constexpr int kRows = 16;
  static constexpr int kSplit = kDk / kRows;
  static constexpr int kCols = 32 / kSplit;
};
template <int kDk>
__global__ void __launch_bounds__(32) delta_rule_chunk_kernel(GatedDeltaRuleParams p) {
  using Sh = ChunkShape<kDk>;
  constexpr int kPer = (kDk + 31) / 32;  // q / k elements each lane stages
  __shared__ float sQ[2][kDk], sK[2][kDk];
  const int lane = threadIdx.x;
  const int part = lane / Sh::kCols, r0 = part * Sh::kRows;
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dv = p.v_dim;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * Sh::kCols + lane % Sh::kCols;
  const int64_t h = blockIdx.y, s = blockIdx.z;
  const int64_t kh = h / (hv / hk);
  const bool col = j < dv;
  const Ws ws = ws_at(p.workspace, p.num_tokens, hk, hv, kDk);
  const int64_t begin = p.seqs.seq_begin[s], end = p.seqs.seq_begin[s + 1];
  const int32_t slot = p.seqs.state_slot[s];
  float* gS = slot >= 0 ? p.states + slot * p.state_stride + h * kDk * dv : nullptr;
  const bool zero = gS == nullptr || p.seqs.fresh[s] != 0;
  float S[Sh::kRows];
#pragma unroll
  for (int i = 0; i < Sh::kRows; ++i) S[i] = (!zero && col) ? gS[(r0 + i) * dv + j] : 0.f;

  bf16 const* gV = p.qkv + 2 * hk * kDk + h * dv + j;
  float nq[kPer], nk[kPer], nv = 0.f, ng = 0.f, nb = 0.f;
  auto fetch = [&](int64_t t) {
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = lane + 32 * e;
      nq[e] = i < kDk ? ws.q[(t * hk + kh) * kDk + i] : 0.f;
      nk[e] = i < kDk ? ws.k[(t * hk + kh) * kDk + i] : 0.f;
    }
    nv = col ? __bfloat162float(gV[t * p.qkv_stride]) : 0.f;
    ng = ws.g[t * hv + h];
    nb = ws.beta[t * hv + h];
  };
  if (begin < end) fetch(begin);
  for (int64_t t = begin; t < end; ++t) {
    const int buf = static_cast<int>((t - begin) & 1);
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = lane + 32 * e;
      if (i < kDk) {
        sQ[buf][i] = nq[e];
        sK[buf][i] = nk[e];
      }
    }
    __syncwarp();
    const float decay = expf(ng), beta = nb, v = nv;
    if (t + 1 < end) fetch(t + 1);
    float const* k = sK[buf] + r0;
    float const* q = sQ[buf] + r0;
    float kv[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < Sh::kRows; ++i) {
      S[i] *= decay;
      kv[i & 3] += S[i] * k[i];
    }
    float kvs = (kv[0] + kv[1]) + (kv[2] + kv[3]);
#pragma unroll
    for (int off = Sh::kCols; off < 32; off <<= 1) kvs += __shfl_xor_sync(0xffffffffu, kvs, off);
    const float delta = (v - kvs) * beta;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < Sh::kRows; ++i) {
      S[i] += k[i] * delta;
      o[i & 3] += S[i] * q[i];
    }
    float os = (o[0] + o[1]) + (o[2] + o[3]);
#pragma unroll
    for (int off = Sh::kCols; off < 32; off <<= 1) os += __shfl_xor_sync(0xffffffffu, os, off);
    if (col && part == 0) p.out[(t * hv + h) * dv + j] = os;
  }
  if (gS != nullptr && col) {
#pragma unroll
    for (int i = 0; i < Sh::kRows; ++i) gS[(r0 + i) * dv + j] = S[i];
  }
}

// ---------------------------------------------------------------- gated rms norm
// One warp per row.
__global__ void __launch_bounds__(128) gated_rms_norm_kernel(GatedRmsNormParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= p.rows) return;
  float const* x = p.x + r * p.dim;
  bf16 const* z = p.gate + (r / p.heads) * p.gate_stride + (r % p.heads) * p.dim;
  float ss = 0.f;
  for (int64_t i = lane; i < p.dim; i += 32) ss += x[i] * x[i];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(p.dim) + p.eps);
  bf16* o = p.out + r * p.dim;
  for (int64_t i = lane; i < p.dim; i += 32) {
    o[i] = __float2bfloat16_rn(p.weight[i] * (x[i] * inv) * silu_f(__bfloat162float(z[i])));
  }
}

template <int kDk>
void delta_rule_dispatch(GatedDeltaRuleParams const& p, dim3 grid, bool decode,
                         cudaStream_t stream) {
  if (decode) {
    delta_rule_kernel<kDk><<<grid, kDeltaWarps * 32, 0, stream>>>(p);
  } else {
    constexpr int kCols = ChunkShape<kDk>::kCols;
    const dim3 g(static_cast<unsigned>((p.v_dim + kCols - 1) / kCols), grid.y, grid.z);
    delta_rule_chunk_kernel<kDk><<<g, 32, 0, stream>>>(p);
  }
}

void check_seqs(DeltaNetSeqs const& s, int64_t num_tokens, const char* op) {
  TANDEM_CHECK(s.num_seqs >= 0 && s.num_seqs <= 65535 && num_tokens >= 0 && num_tokens <= INT32_MAX,
               op, ": ", s.num_seqs, " sequences, ", num_tokens, " tokens");
  TANDEM_CHECK(num_tokens == 0 || (s.seq_begin != nullptr && s.token_seq != nullptr &&
                                   s.state_slot != nullptr && s.fresh != nullptr),
               op, ": missing sequence arrays");
}

}  // namespace

void causal_conv1d_launch(CausalConv1dParams const& p, cudaStream_t stream) {
  check_seqs(p.seqs, p.num_tokens, "causal_conv1d");
  TANDEM_CHECK(p.kernel >= 2 && p.kernel <= kMaxConvKernel, "causal_conv1d: kernel ", p.kernel,
               " outside [2, ", kMaxConvKernel, "]");
  TANDEM_CHECK(p.channels > 0 && p.x_stride >= p.channels, "causal_conv1d: channels ", p.channels,
               " x_stride ", p.x_stride);
  if (p.num_tokens == 0) return;
  constexpr int threads = 128;
  const int64_t cblocks = (p.channels + threads - 1) / threads;
  TANDEM_CHECK(cblocks <= 65535, "causal_conv1d: too many channels ", p.channels);
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(cblocks));
  if (p.num_tokens == p.seqs.num_seqs) {  // a decode step: one token per sequence
    conv1d_kernel<true><<<grid, threads, 0, stream>>>(p);
    TANDEM_CUDA_CHECK_LAUNCH();
    return;
  }
  conv1d_kernel<false><<<grid, threads, 0, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
  if (p.seqs.num_seqs > 0) {
    conv1d_state_kernel<<<dim3(static_cast<unsigned>(p.seqs.num_seqs),
                               static_cast<unsigned>(cblocks)),
                          threads, 0, stream>>>(p);
    TANDEM_CUDA_CHECK_LAUNCH();
  }
}

size_t gated_delta_rule_workspace_floats(int64_t num_tokens, int64_t num_k_heads,
                                         int64_t num_v_heads, int64_t k_dim) {
  return static_cast<size_t>(num_tokens * (2 * num_k_heads * k_dim + 2 * num_v_heads));
}

void gated_delta_rule_launch(GatedDeltaRuleParams const& p, cudaStream_t stream) {
  check_seqs(p.seqs, p.num_tokens, "gated_delta_rule");
  TANDEM_CHECK(p.num_k_heads > 0 && p.num_v_heads % p.num_k_heads == 0,
               "gated_delta_rule: ", p.num_v_heads, " value heads over ", p.num_k_heads,
               " key heads");
  if (p.k_dim != 16 && p.k_dim != 32 && p.k_dim != 64 && p.k_dim != 128) {
    TANDEM_THROW(kUnsupported, "gated_delta_rule: unsupported k_dim ", p.k_dim,
                 " (16, 32, 64 or 128)");
  }
  TANDEM_CHECK(p.v_dim > 0 && p.v_dim <= 256, "gated_delta_rule: v_dim ", p.v_dim);
  TANDEM_CHECK(p.qkv_stride >= 2 * p.num_k_heads * p.k_dim + p.num_v_heads * p.v_dim &&
                   p.ab_stride >= p.num_v_heads,
               "gated_delta_rule: strides ", p.qkv_stride, " / ", p.ab_stride, " too small");
  TANDEM_CHECK(p.num_v_heads <= 65535, "gated_delta_rule: too many value heads");
  if (p.num_tokens == 0) return;
  TANDEM_CHECK(p.workspace != nullptr, "gated_delta_rule: no workspace");
  delta_prep_kernel<<<static_cast<unsigned>(p.num_tokens), 128, 0, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
  if (p.seqs.num_seqs == 0) return;
  const dim3 grid(static_cast<unsigned>((p.v_dim + 31) / 32), static_cast<unsigned>(p.num_v_heads),
                  static_cast<unsigned>(p.seqs.num_seqs));
  // A decode step (one token per sequence): 4 warps split the state's rows (4x the warps
  // for the state's one read and write); otherwise a warp holds whole columns over the chunk.
  const bool decode = p.num_tokens == p.seqs.num_seqs;
  switch (p.k_dim) {
    case 16: delta_rule_dispatch<16>(p, grid, decode, stream); break;
    case 32: delta_rule_dispatch<32>(p, grid, decode, stream); break;
    case 64: delta_rule_dispatch<64>(p, grid, decode, stream); break;
    case 128: delta_rule_dispatch<128>(p, grid, decode, stream); break;
    default: TANDEM_THROW(kUnsupported, "gated_delta_rule: unsupported k_dim ", p.k_dim);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void gated_rms_norm_launch(GatedRmsNormParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.rows >= 0 && p.dim > 0 && p.heads > 0 && p.gate_stride >= p.heads * p.dim,
               "gated_rms_norm: bad sizes");
  if (p.rows == 0) return;
  constexpr int kRowsPerBlock = 4;
  const int64_t blocks = (p.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  TANDEM_CHECK(blocks <= INT32_MAX, "gated_rms_norm: too many rows");
  gated_rms_norm_kernel<<<static_cast<unsigned>(blocks), kRowsPerBlock * 32, 0, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
