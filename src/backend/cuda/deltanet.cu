// Gated DeltaNet ops: causal conv1d, the gated delta rule, gated RMSNorm. See deltanet.h.
#include <algorithm>
#include <cmath>

#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/deltanet.h"

namespace tandem::cuda {

using namespace detail;

namespace {

constexpr int kMaxConvKernel = 8;

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

// Where sequence s's state after its tokens goes (DeltaNetSeqs::state_slot_out): its out slot,
// else its own slot (in place).
__device__ __forceinline__ int32_t out_slot(DeltaNetSeqs const& q, int64_t s) {
  return q.state_slot_out != nullptr ? q.state_slot_out[s] : q.state_slot[s];
}

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
    const int32_t oslot = out_slot(p.seqs, s);
    if (oslot < 0) return;
    float* w = p.states + oslot * p.state_stride + c * hist;  // == win in place: j + 1 read first
    for (int j = 0; j + 1 < hist; ++j) w[j] = zero ? 0.f : win[j + 1];
    w[hist - 1] = __bfloat162float(p.x[t * p.x_stride + c]);
  }
}

// Prefill, kernel 4, 8-channel aligned rows: a thread owns 8 channels (16-byte loads and
// stores) over a tile of kConvTokens tokens, keeping the previous 3 inputs in registers while
// the tokens stay in one sequence (refilled from x or the window where a sequence starts).
// Same products in the same order as conv1d_kernel, so the two agree bit for bit.
constexpr int kConvTokens = 16;
__global__ void __launch_bounds__(128) conv1d_prefill4_kernel(CausalConv1dParams p) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * 8;
  if (c0 >= p.channels) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kConvTokens;
  const int64_t t1 = t0 + kConvTokens < p.num_tokens ? t0 + kConvTokens : p.num_tokens;
  float w[8][4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // weight[c0 .. c0 + 8, 0 .. 4): 32 bf16, 64 bytes
    float v[8];
    load_bf16<8>(p.weight + c0 * 4 + q * 8, v);
#pragma unroll
    for (int e = 0; e < 8; ++e) w[2 * q + e / 4][e % 4] = v[e];
  }
  float prev[3][8];
  int32_t cur_seq = -1;
  for (int64_t t = t0; t < t1; ++t) {
    const int32_t s = p.seqs.token_seq[t];
    if (s != cur_seq) {  // a sequence starts at t (or the tile does): the 3 inputs before t
      cur_seq = s;
      const int64_t begin = p.seqs.seq_begin[s];
      const int32_t slot = p.seqs.state_slot[s];
      const bool zero = slot < 0 || p.seqs.fresh[s] != 0;
      float const* win = zero ? nullptr : p.states + slot * p.state_stride + c0 * 3;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const int64_t r = t - 3 + j;
        if (r >= begin) {
          load_bf16<8>(p.x + r * p.x_stride + c0, prev[j]);
        } else {
          const int64_t m = r - begin;  // -3 .. -1: window entry 3 + m
#pragma unroll
          for (int e = 0; e < 8; ++e) prev[j][e] = zero ? 0.f : win[e * 3 + 3 + m];
        }
      }
    }
    float cur[8], o[8];
    load_bf16<8>(p.x + t * p.x_stride + c0, cur);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float acc = 0.f;
      acc += w[e][0] * prev[0][e];
      acc += w[e][1] * prev[1][e];
      acc += w[e][2] * prev[2][e];
      acc += w[e][3] * cur[e];
      o[e] = p.silu ? silu_f(acc) : acc;
      prev[0][e] = prev[1][e];
      prev[1][e] = prev[2][e];
      prev[2][e] = cur[e];
    }
    store_bf16<8>(p.out + t * p.channels + c0, o);
  }
}

// One thread per (sequence, channel): the window becomes the last kernel - 1 inputs. Runs
// after conv1d_kernel (which reads the old window).
__global__ void conv1d_state_kernel(CausalConv1dParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t s = blockIdx.x;
  if (c >= p.channels) return;
  const int32_t slot = p.seqs.state_slot[s], oslot = out_slot(p.seqs, s);
  if (oslot < 0) return;
  const int hist = static_cast<int>(p.kernel) - 1;
  const bool zero = slot < 0 || p.seqs.fresh[s] != 0;
  const int64_t begin = p.seqs.seq_begin[s], len = p.seqs.seq_begin[s + 1] - begin;
  float const* win = zero ? nullptr : p.states + slot * p.state_stride + c * hist;
  float nw[kMaxConvKernel];
  for (int j = 0; j < hist; ++j) {
    const int64_t m = len - hist + j;
    nw[j] =
        m >= 0 ? __bfloat162float(p.x[(begin + m) * p.x_stride + c]) : (zero ? 0.f : win[hist + m]);
  }
  float* wout = p.states + oslot * p.state_stride + c * hist;
  for (int j = 0; j < hist; ++j) wout[j] = nw[j];
}

// ---------------------------------------------------------------- delta rule
// Workspace layout (floats, each region 16-byte aligned): qn [n, hk, dk] | kn [n, hk, dk] |
// beta [n, hv] | g [n, hv] | the chunked form's W [n, hv, dk] bf16 | U' [n, hv, dvp] bf16 |
// P [n, hv, kChunk] bf16 | gamma [n, hv] fp32. The chunked form keeps the normalised q, k in
// bf16 inside the qn region (qb [n, hk, dk] then kb [n, hk, dk]): it never reads the fp32 ones.
constexpr int kChunk = 64;  // tokens per chunk of the chunked form
__host__ __device__ inline int64_t pad_cols(int64_t dv) { return (dv + 31) / 32 * 32; }
__host__ __device__ inline int64_t align4(int64_t floats) { return (floats + 3) / 4 * 4; }
struct Ws {
  float *q, *k, *beta, *g;
  bf16 *qb, *kb, *w, *u, *p;
  float* gam;
};
// Float offsets of the regions (Ws order: q k beta g w u p gam) and the total.
struct WsOffsets {
  int64_t k, beta, g, w, u, p, gam, total;
};
__host__ __device__ inline WsOffsets ws_offsets(int64_t n, int64_t hk, int64_t hv, int64_t dk,
                                                int64_t dv) {
  WsOffsets o{};
  o.k = align4(n * hk * dk);
  o.beta = o.k + align4(n * hk * dk);
  o.g = o.beta + align4(n * hv);
  o.w = o.g + align4(n * hv);
  o.u = o.w + align4(n * hv * dk / 2);
  o.p = o.u + align4(n * hv * pad_cols(dv) / 2);
  o.gam = o.p + align4(n * hv * kChunk / 2);
  o.total = o.gam + align4(n * hv);
  return o;
}
__host__ __device__ inline Ws ws_at(float* w, int64_t n, int64_t hk, int64_t hv, int64_t dk,
                                    int64_t dv) {
  const WsOffsets o = ws_offsets(n, hk, hv, dk, dv);
  Ws ws{};
  ws.q = w;
  ws.k = w + o.k;
  ws.beta = w + o.beta;
  ws.g = w + o.g;
  ws.w = reinterpret_cast<bf16*>(w + o.w);
  ws.u = reinterpret_cast<bf16*>(w + o.u);
  ws.p = reinterpret_cast<bf16*>(w + o.p);
  ws.gam = w + o.gam;
  ws.qb = reinterpret_cast<bf16*>(w);
  ws.kb = ws.qb + n * hk * dk;
  return ws;
}
__host__ __device__ inline Ws ws_at(GatedDeltaRuleParams const& p) {
  return ws_at(p.workspace, p.num_tokens, p.num_k_heads, p.num_v_heads, p.k_dim, p.v_dim);
}

// The gates of token t: beta = sigmoid(b), g = -exp(a_log) softplus(a + dt_bias), a thread per
// value head.
__device__ __forceinline__ void delta_gates(GatedDeltaRuleParams const& p, Ws const& ws,
                                            int64_t t) {
  const int64_t hv = p.num_v_heads;
  for (int64_t h = threadIdx.x; h < hv; h += blockDim.x) {
    const float b = __bfloat162float(p.b[t * p.ab_stride + h]);
    const float x = __bfloat162float(p.a[t * p.ab_stride + h]) + p.dt_bias[h];
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    ws.beta[t * hv + h] = 1.0f / (1.0f + expf(-b));
    ws.g[t * hv + h] = -expf(p.a_log[h]) * sp;
  }
}

// The chunked form's prep at k_dim 64 / 128 on rows aligned for kDk / 32-element vectors: one
// block per token, a warp per kHeads q / k heads (heads warp, warp + nwarps, ...: one pass over
// the 2 hk heads when 2 hk <= 32 kHeads), each lane loading its kDk / 32 contiguous elements of
// each (kHeads loads in flight) once and storing them normalised as bf16.
template <int kDk, int kHeads>
__global__ void __launch_bounds__(1024) delta_prep_vec_kernel(GatedDeltaRuleParams p) {
  constexpr int kPer = kDk / 32;
  const int64_t t = blockIdx.x;
  const int64_t hk = p.num_k_heads;
  const Ws ws = ws_at(p);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const float q_scale = rsqrtf(static_cast<float>(kDk));
  bf16 const* row = p.qkv + t * p.qkv_stride;
  // [0, hk): q heads, [hk, 2 hk): k heads
  for (int64_t h0 = warp; h0 < 2 * hk; h0 += static_cast<int64_t>(nwarps) * kHeads) {
    float v[kHeads][kPer];
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
      const int64_t h = h0 + j * nwarps;
      if (h < 2 * hk) load_bf16<kPer>(row + h * kDk + lane * kPer, v[j]);
    }
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
      const int64_t h = h0 + j * nwarps;
      if (h >= 2 * hk) break;
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < kPer; ++e) ss += v[j][e] * v[j][e];
      ss = warp_sum(ss);
      const bool is_q = h < hk;
      const float inv = 1.0f / sqrtf(ss + 1e-6f) * (is_q ? q_scale : 1.0f);
#pragma unroll
      for (int e = 0; e < kPer; ++e) v[j][e] *= inv;
      const int64_t off = (t * hk + (is_q ? h : h - hk)) * kDk;
      store_bf16<kPer>((is_q ? ws.qb : ws.kb) + off + lane * kPer, v[j]);
    }
  }
  delta_gates(p, ws, t);
}

// One block per token: a warp per q / k head normalises it (fp32; kBf16: stored as bf16 for the
// chunked form's tensor cores); threads compute the gates.
template <bool kBf16>
__global__ void __launch_bounds__(128) delta_prep_kernel(GatedDeltaRuleParams p) {
  const int64_t t = blockIdx.x;
  const int64_t hk = p.num_k_heads, dk = p.k_dim;
  const Ws ws = ws_at(p);
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
    const int64_t off = (t * hk + (is_q ? h : h - hk)) * dk;
    if constexpr (kBf16) {
      bf16* dst = (is_q ? ws.qb : ws.kb) + off;
      for (int64_t i = lane; i < dk; i += 32) {
        dst[i] = __float2bfloat16_rn(__bfloat162float(src[i]) * inv);
      }
    } else {
      float* dst = (is_q ? ws.q : ws.k) + off;
      for (int64_t i = lane; i < dk; i += 32) dst[i] = __bfloat162float(src[i]) * inv;
    }
  }
  delta_gates(p, ws, t);
}

// One block per (32 value columns, value head, sequence): 4 warps split the k_dim rows of the
// state, lane l owns column 32 * blockIdx.x + l; the block's state slice stays in registers
// over the sequence's tokens (read once, written once). A sequence of at most kDeltaPreload
// tokens (a decode step, a speculative verify or replay) has every token's q, k, gates and v
// staged in shared memory up front, their loads in flight with the state's, so that its tokens
// wait on no global load; a longer one stages each token in turn.
constexpr int kDeltaWarps = 4;
constexpr int kDeltaPreload = 8;
template <int kDk>
__global__ void __launch_bounds__(kDeltaWarps * 32) delta_rule_kernel(GatedDeltaRuleParams p) {
  constexpr int kRows = kDk / kDeltaWarps;
  __shared__ float sQ[kDeltaPreload][kDk], sK[kDeltaPreload][kDk];
  __shared__ float sV[kDeltaPreload][32], sG[kDeltaPreload], sB[kDeltaPreload];
  __shared__ float sRed1[kDeltaWarps][32], sRed2[kDeltaWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dv = p.v_dim;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  const int64_t h = blockIdx.y, s = blockIdx.z;
  const int64_t kh = h / (hv / hk);
  const bool col = j < dv;
  const Ws ws = ws_at(p);
  const int64_t begin = p.seqs.seq_begin[s], end = p.seqs.seq_begin[s + 1];
  const int32_t slot = p.seqs.state_slot[s];
  float* gS = slot >= 0 ? p.states + slot * p.state_stride + h * kDk * dv : nullptr;
  if (p.states_only && gS == nullptr) return;  // (the whole block)
  const int32_t oslot = out_slot(p.seqs, s);
  float* gO = oslot >= 0 ? p.states + oslot * p.state_stride + h * kDk * dv : nullptr;
  const bool zero = gS == nullptr || p.seqs.fresh[s] != 0;
  const int r0 = warp * kRows;
  bf16 const* gV = p.qkv + 2 * hk * kDk + h * dv + j;
  // Token t's inputs into buffer b (0 .. kDeltaPreload - 1).
  auto stage = [&](int64_t t, int b) {
    for (int i = threadIdx.x; i < kDk; i += blockDim.x) {
      sQ[b][i] = ws.q[(t * hk + kh) * kDk + i];
      sK[b][i] = ws.k[(t * hk + kh) * kDk + i];
    }
    if (warp == 0) sV[b][lane] = col ? __bfloat162float(gV[t * p.qkv_stride]) : 0.f;
    if (threadIdx.x == 32) {
      sG[b] = expf(ws.g[t * hv + h]);
      sB[b] = ws.beta[t * hv + h];
    }
  };
  const bool preload = end - begin <= kDeltaPreload;
  if (preload) {
    for (int64_t t = begin; t < end; ++t) stage(t, static_cast<int>(t - begin));
  }
  float S[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) S[r] = (!zero && col) ? gS[(r0 + r) * dv + j] : 0.f;

  for (int64_t t = begin; t < end; ++t) {
    const int b = preload ? static_cast<int>(t - begin) : 0;
    // (the previous token's last barrier came after its every read of the staging and sRed1)
    if (!preload) stage(t, 0);
    if (!preload || t == begin) __syncthreads();  // the staging
    const float decay = sG[b], beta = sB[b];
    float part = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      S[r] *= decay;
      part += S[r] * sK[b][r0 + r];
    }
    sRed1[warp][lane] = part;
    __syncthreads();
    float kv = 0.f;
#pragma unroll
    for (int w = 0; w < kDeltaWarps; ++w) kv += sRed1[w][lane];
    const float delta = (sV[b][lane] - kv) * beta;
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      S[r] += sK[b][r0 + r] * delta;
      o += S[r] * sQ[b][r0 + r];
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
  if (gO != nullptr && col) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) gO[(r0 + r) * dv + j] = S[r];
  }
}

// The same decode step as one kernel (GatedDeltaRuleParams::fused_decode): the block normalises its
// token's q / k head and computes its gates itself, in delta_prep_kernel's order of operations, so
// no prep launch precedes it (the q / k head is read by the hv / hk value heads' column blocks: a
// few KB).
template <int kDk>
__global__ void __launch_bounds__(kDeltaWarps * 32)
    delta_rule_fused_kernel(GatedDeltaRuleParams p) {
  constexpr int kRows = kDk / kDeltaWarps;
  __shared__ float sQ[kDk], sK[kDk];
  __shared__ float sRed1[kDeltaWarps][32], sRed2[kDeltaWarps][32];
  __shared__ float sInv[2], sGate[2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dv = p.v_dim;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  const int64_t h = blockIdx.y, s = blockIdx.z;
  const int64_t kh = h / (hv / hk);
  const bool col = j < dv;
  const float q_scale = rsqrtf(static_cast<float>(kDk));
  const int64_t begin = p.seqs.seq_begin[s], end = p.seqs.seq_begin[s + 1];
  const int32_t slot = p.seqs.state_slot[s];
  float* gS = slot >= 0 ? p.states + slot * p.state_stride + h * kDk * dv : nullptr;
  const int32_t oslot = out_slot(p.seqs, s);
  float* gO = oslot >= 0 ? p.states + oslot * p.state_stride + h * kDk * dv : nullptr;
  const bool zero = gS == nullptr || p.seqs.fresh[s] != 0;
  const int r0 = warp * kRows;
  float S[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) S[r] = (!zero && col) ? gS[(r0 + r) * dv + j] : 0.f;

  bf16 const* gV = p.qkv + 2 * hk * kDk + h * dv + j;
  for (int64_t t = begin; t < end; ++t) {
    __syncthreads();  // the previous token is done with sQ / sK / sRed1 / sInv / sGate
    bf16 const* row = p.qkv + t * p.qkv_stride;
    // Warp 0: the q head's sum of squares, warp 1: the k head's (lane-strided, then the warp
    // sum: delta_prep_kernel's order); warp 2: the gates.
    if (warp < 2) {
      bf16 const* src = row + (warp == 0 ? kh : hk + kh) * kDk;
      float ss = 0.f;
      for (int i = lane; i < kDk; i += 32) {
        const float v = __bfloat162float(src[i]);
        ss += v * v;
      }
      ss = warp_sum(ss);
      if (lane == 0) sInv[warp] = 1.0f / sqrtf(ss + 1e-6f) * (warp == 0 ? q_scale : 1.0f);
    } else if (warp == 2 && lane == 0) {
      const float b = __bfloat162float(p.b[t * p.ab_stride + h]);
      const float x = __bfloat162float(p.a[t * p.ab_stride + h]) + p.dt_bias[h];
      const float sp = x > 20.0f ? x : log1pf(expf(x));
      sGate[0] = -expf(p.a_log[h]) * sp;
      sGate[1] = 1.0f / (1.0f + expf(-b));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kDk; i += blockDim.x) {
      sQ[i] = __bfloat162float(row[kh * kDk + i]) * sInv[0];
      sK[i] = __bfloat162float(row[(hk + kh) * kDk + i]) * sInv[1];
    }
    __syncthreads();
    const float decay = expf(sGate[0]), beta = sGate[1];
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
  if (gO != nullptr && col) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) gO[(r0 + r) * dv + j] = S[r];
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
  const Ws ws = ws_at(p);
  const int64_t begin = p.seqs.seq_begin[s], end = p.seqs.seq_begin[s + 1];
  const int32_t slot = p.seqs.state_slot[s];
  float* gS = slot >= 0 ? p.states + slot * p.state_stride + h * kDk * dv : nullptr;
  if (p.states_only && gS == nullptr) return;  // (the whole warp)
  const int32_t oslot = out_slot(p.seqs, s);
  float* gO = oslot >= 0 ? p.states + oslot * p.state_stride + h * kDk * dv : nullptr;
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
  if (gO != nullptr && col) {
#pragma unroll
    for (int i = 0; i < Sh::kRows; ++i) gO[(r0 + i) * dv + j] = S[i];
  }
}

// ---------------------------------------------------------------- chunked delta rule
// The chunkwise (WY / UT) form on tensor cores, for prefill. Tokens are cut into global tiles
// of kChunk (tile m: tokens [64 m, 64 m + 64)); a tile's tokens of one sequence form a chunk (a
// sequence's tokens are contiguous, so a chunk is the tile's piece of it). Per chunk and value
// head, with gamma_i = sum of g over the chunk's tokens up to i, G_i = exp(gamma_i), S0 the state
// before the chunk:
//   A = strictly lower (beta_i exp(gamma_i - gamma_j) k_i . k_j), T = (I + A)^-1,
//   W = T diag(beta G) K,  U' = T diag(beta) V                    (chunk_wy_kernel, parallel)
//   U = U' - W S0,  O = diag(G) Q S0 + P U,  P = lower-incl. (exp(gamma_i - gamma_j) q_i . k_j),
//   S = G_last S0 + K^T diag(exp(gamma_last - gamma_j)) U        (chunk_state_kernel, in order)
// Entries between tokens of different sequences are masked, so T is block diagonal per chunk.
// mma.sync m16n8k16 bf16 -> fp32 on operands in padded shared tiles (row strides of 8 extra
// bf16 make the fragment loads conflict-free); the state stays fp32 in the accumulators of
// chunk_state_kernel over the whole sequence (a bf16 copy in shared memory is the operand).

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t const (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two bf16 as one fragment register, `lo` in the low half.
__device__ __forceinline__ uint32_t pack2(bf16 lo, bf16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}
__device__ __forceinline__ uint32_t ld32(bf16 const* p) {
  return *reinterpret_cast<uint32_t const*>(p);
}
// Fragments (lane = 4 g + t), by ldmatrix from 16-byte aligned rows (kLdmatrix) or by 32-/16-bit
// shared loads (the reference layout of the PTX fragment tables).
constexpr bool kLdmatrix = true;
__device__ __forceinline__ uint32_t saddr(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], void const* p, bool trans) {
  if (trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(saddr(p)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(saddr(p)));
  }
}
__device__ __forceinline__ void ldsm_x2(uint32_t& b0, uint32_t& b1, void const* p, bool trans) {
  if (trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(b0), "=r"(b1)
                 : "r"(saddr(p)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(b0), "=r"(b1)
                 : "r"(saddr(p)));
  }
}
// A 16x16 at (r0, k0) of a row-major [m][k] tile (k contiguous).
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], bf16 const* s, int ld, int r0, int k0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kLdmatrix) {
    ldsm_x4(a, s + (r0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8, false);
    return;
  }
  bf16 const* p = s + (r0 + g) * ld + k0 + 2 * t;
  a[0] = ld32(p);
  a[1] = ld32(p + 8 * ld);
  a[2] = ld32(p + 8);
  a[3] = ld32(p + 8 * ld + 8);
}
// A 16x16 at (r0, k0) of A = X^T, X a row-major [k][m] tile.
__device__ __forceinline__ void frag_a_t(uint32_t (&a)[4], bf16 const* s, int ld, int r0, int k0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kLdmatrix) {
    ldsm_x4(a, s + (k0 + (lane & 7) + ((lane >> 4) & 1) * 8) * ld + r0 + ((lane >> 3) & 1) * 8,
            true);
    return;
  }
  bf16 const* p = s + (k0 + 2 * t) * ld + r0 + g;
  a[0] = pack2(p[0], p[ld]);
  a[1] = pack2(p[8], p[ld + 8]);
  a[2] = pack2(p[8 * ld], p[9 * ld]);
  a[3] = pack2(p[8 * ld + 8], p[9 * ld + 8]);
}
// B 16x8 at (k0, n0) of B = X^T, X a row-major [n][k] tile (k contiguous).
__device__ __forceinline__ void frag_b_nk(uint32_t& b0, uint32_t& b1, bf16 const* s, int ld, int k0,
                                          int n0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kLdmatrix) {  // lanes 16..31: addresses unused, kept in the tile
    ldsm_x2(b0, b1, s + (n0 + (lane & 7)) * ld + k0 + ((lane >> 3) & 1) * 8, false);
    return;
  }
  bf16 const* p = s + (n0 + g) * ld + k0 + 2 * t;
  b0 = ld32(p);
  b1 = ld32(p + 8);
}
// B 16x8 at (k0, n0) of a row-major [k][n] tile.
__device__ __forceinline__ void frag_b_kn(uint32_t& b0, uint32_t& b1, bf16 const* s, int ld, int k0,
                                          int n0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if constexpr (kLdmatrix) {
    ldsm_x2(b0, b1, s + (k0 + (lane & 15)) * ld + n0, true);
    return;
  }
  bf16 const* p = s + (k0 + 2 * t) * ld + n0 + g;
  b0 = pack2(p[0], p[ld]);
  b1 = pack2(p[8 * ld], p[9 * ld]);
}
// acc[nt] += A[r0 : r0 + 16, 0 : kK] * B[0 : kK, n0 + 8 nt : n0 + 8 nt + 8], A row-major
// [m][k], B row-major [k][n].
template <int kNt, int kK>
__device__ __forceinline__ void warp_gemm_kn(float (&acc)[kNt][4], bf16 const* sa, int lda, int r0,
                                             bf16 const* sb, int ldb, int n0) {
#pragma unroll
  for (int kk = 0; kk < kK; kk += 16) {
    uint32_t a[4];
    frag_a(a, sa, lda, r0, kk);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      uint32_t b0, b1;
      frag_b_kn(b0, b1, sb, ldb, kk, n0 + 8 * nt);
      mma16816(acc[nt], a, b0, b1);
    }
  }
}

__device__ __forceinline__ void cp_async16(void* dst, void const* src, bool valid) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// chunk_wy_kernel: one block of 4 warps per (tile, value head). Shared tiles. kCompact (the
// default): K is scaled in place into beta G K, A (fp32) takes Q's place once Q K^T is done and T
// takes A's once the substitution is: 52 KB at dk = dv = 128, 4 blocks per SM. Otherwise (the
// first layout, GatedDeltaRuleParams::wide_wy, for comparison) every tile has its own place:
// 97 KB, 2 blocks per SM.
template <int kDk>
struct WyShape {
  static constexpr int kLdK = kDk + 8;     // bf16 rows of K, Q, beta G K
  static constexpr int kLdA = kChunk + 4;  // fp32 rows of A (16-byte aligned)
  static constexpr int kLdT = kChunk + 8;  // bf16 rows of T
  static constexpr size_t kKBytes = kChunk * kLdK * sizeof(bf16);
  static constexpr size_t kABytes = kChunk * kLdA * sizeof(float);
  static constexpr size_t kTBytes = kChunk * kLdT * sizeof(bf16);
  // Q, then A, then T (kCompact).
  static constexpr size_t kQatBytes = kKBytes > kABytes ? kKBytes : kABytes;
  static size_t smem_bytes(int64_t dvp, bool compact) {
    const size_t v = kChunk * (dvp + 8) * sizeof(bf16), meta = 4 * kChunk * sizeof(float);
    return compact ? kKBytes + kQatBytes + v + meta : 3 * kKBytes + kTBytes + v + kABytes + meta;
  }
};
template <int kDk, bool kCompact>
__global__ void __launch_bounds__(128, 4) chunk_wy_kernel(GatedDeltaRuleParams p, bool vec_v) {
  using Sh = WyShape<kDk>;
  static_assert(Sh::kKBytes % 16 == 0 && Sh::kABytes % 16 == 0 && Sh::kTBytes % 16 == 0 &&
                Sh::kTBytes <= Sh::kQatBytes);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dv = p.v_dim, n = p.num_tokens;
  const int dvp = static_cast<int>(pad_cols(dv)), ldv = dvp + 8;
  bf16 *sK, *sQ, *sKs, *sT, *sV;
  float* sA;
  if constexpr (kCompact) {
    sK = reinterpret_cast<bf16*>(smem_raw);
    sKs = sK;
    sQ = reinterpret_cast<bf16*>(smem_raw + Sh::kKBytes);
    sA = reinterpret_cast<float*>(sQ);
    sT = sQ;
    sV = reinterpret_cast<bf16*>(smem_raw + Sh::kKBytes + Sh::kQatBytes);
  } else {
    sK = reinterpret_cast<bf16*>(smem_raw);
    sQ = sK + kChunk * Sh::kLdK;
    sKs = sQ + kChunk * Sh::kLdK;
    sT = sKs + kChunk * Sh::kLdK;
    sV = sT + kChunk * Sh::kLdT;
    sA = reinterpret_cast<float*>(sV + kChunk * ldv);
  }
  float* sGam = reinterpret_cast<float*>(sV + kChunk * ldv) + (kCompact ? 0 : kChunk * Sh::kLdA);
  float* sBeta = sGam + kChunk;
  float* sKsc = sBeta + kChunk;  // beta G per row
  int* sSeq = reinterpret_cast<int*>(sKsc + kChunk);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kChunk, h = blockIdx.y;
  const int64_t kh = h / (hv / hk);
  const Ws ws = ws_at(p);

  // K, Q and (when its rows are 16-byte aligned) V by cp.async, zero-filled past the end (and
  // V past dv); meanwhile the row metadata; gamma = the sum of g over the earlier tokens of the
  // row's sequence in the tile.
  constexpr int kVec = kDk / 8;
  for (int i = tid; i < kChunk * kVec; i += blockDim.x) {
    const int r = i / kVec, c = (i % kVec) * 8;
    const int64_t t = t0 + r;
    const int64_t ts = t < n ? t : 0;
    cp_async16(sK + r * Sh::kLdK + c, ws.kb + (ts * hk + kh) * kDk + c, t < n);
    cp_async16(sQ + r * Sh::kLdK + c, ws.qb + (ts * hk + kh) * kDk + c, t < n);
  }
  bf16 const* gv = p.qkv + 2 * hk * kDk + h * dv;
  if (vec_v) {
    const int vv = dvp / 8;
    for (int i = tid; i < kChunk * vv; i += blockDim.x) {
      const int r = i / vv, c = (i % vv) * 8;
      const int64_t t = t0 + r;
      const bool ok = t < n && c < dv;
      cp_async16(sV + r * ldv + c, gv + (ok ? t * p.qkv_stride + c : 0), ok);
    }
  }
  cp_async_commit();
  if (tid < kChunk) {
    const int64_t t = t0 + tid;
    const bool valid = t < n;
    sSeq[tid] = valid ? p.seqs.token_seq[t] : -1 - tid;  // rows past the end: no pairs
    sGam[tid] = valid ? ws.g[t * hv + h] : 0.f;
    sBeta[tid] = valid ? ws.beta[t * hv + h] : 0.f;
  }
  __syncthreads();
  float gam = 0.f;
  if (tid < kChunk) {
    const int seq = sSeq[tid];
    for (int r = 0; r <= tid; ++r) gam += sSeq[r] == seq ? sGam[r] : 0.f;
  }
  cp_async_wait<0>();
  __syncthreads();  // sGam (raw g) read by all; the tiles landed
  if (tid < kChunk) {
    sGam[tid] = gam;
    sKsc[tid] = sBeta[tid] * expf(gam);
  }
  __syncthreads();

  // K K^T and Q K^T, masked and decayed: warp w owns rows [16 w, 16 w + 16).
  {
    const int r0 = 16 * warp;
    float ak[8][4] = {}, aq[8][4] = {};
#pragma unroll
    for (int kk = 0; kk < kDk; kk += 16) {
      uint32_t fk[4], fq[4];
      frag_a(fk, sK, Sh::kLdK, r0, kk);
      frag_a(fq, sQ, Sh::kLdK, r0, kk);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        uint32_t b0, b1;
        frag_b_nk(b0, b1, sK, Sh::kLdK, kk, 8 * nt);
        mma16816(ak[nt], fk, b0, b1);
        mma16816(aq[nt], fq, b0, b1);
      }
    }
    if constexpr (kCompact) __syncthreads();  // every warp is done with sQ: A takes its place
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = r0 + g + 8 * hh;
      const int si = sSeq[i];
      const float gi = sGam[i], bi = sBeta[i];
      const int64_t ti = t0 + i;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        float pv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 8 * nt + 2 * t + e;
          const bool same = sSeq[j] == si;
          const float dec = (same && j <= i) ? expf(gi - sGam[j]) : 0.f;
          sA[i * Sh::kLdA + j] = j < i ? bi * dec * ak[nt][2 * hh + e] : 0.f;
          pv[e] = dec * aq[nt][2 * hh + e];
        }
        if (ti < n) {
          *reinterpret_cast<__nv_bfloat162*>(ws.p + (ti * hv + h) * kChunk + 8 * nt + 2 * t) =
              __floats2bfloat162_rn(pv[0], pv[1]);
        }
      }
    }
  }
  __syncthreads();

  // beta G K and beta V (zero past dv and the end), threads u, u + stride, ...
  auto scale = [&](int u, int stride) {
    for (int i = u; i < kChunk * kVec; i += stride) {
      const int r = i / kVec, c = (i % kVec) * 8;
      float v[8];
      load_bf16<8>(sK + r * Sh::kLdK + c, v);
      const float sc = sKsc[r];
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] *= sc;
      store_bf16<8>(sKs + r * Sh::kLdK + c, v);
    }
    if (vec_v) {
      const int vv = dvp / 8;
      for (int i = u; i < kChunk * vv; i += stride) {
        const int r = i / vv, c = (i % vv) * 8;
        float v[8];
        load_bf16<8>(sV + r * ldv + c, v);
        const float b = sBeta[r];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] *= b;
        store_bf16<8>(sV + r * ldv + c, v);
      }
    } else {
#pragma unroll 8
      for (int i = u; i < kChunk * dvp; i += stride) {
        const int r = i / dvp, c = i % dvp;
        const int64_t t = t0 + r;
        const float v = (t < n && c < dv) ? __bfloat162float(gv[t * p.qkv_stride + c]) : 0.f;
        sV[r * ldv + c] = __float2bfloat16_rn(sBeta[r] * v);
      }
    }
  };
  // T = (I + A)^-1 by forward substitution, thread c < kChunk owning column c (in registers;
  // the rows of A are broadcast reads): x_i = [i == c] - sum_{j < i} A_ij x_j; meanwhile the
  // other warps scale. Or (kCompact, wy_blocked_inverse) blockwise by all four warps: the 16 x 16
  // diagonal blocks T_ii = (I + A_ii)^-1 by substitution (a warp each), then per block row
  // i = 1..3 R_ik = T_ii A_ik (k < i) and T_ij = -sum_{k = j}^{i - 1} R_ik T_kj, each in place
  // of its operand in sA (fp32 throughout).
  float x[kChunk];
  if (kCompact && p.wy_blocked_inverse) {
    scale(tid, blockDim.x);
    {
      const int c = lane & 15, b0 = 16 * warp;  // lanes 16..31 repeat lanes 0..15
      float y[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        float acc = i == c ? 1.f : 0.f;
        float const* arow = sA + (b0 + i) * Sh::kLdA + b0;
#pragma unroll
        for (int j = 0; j < i; ++j) acc -= arow[j] * y[j];
        y[i] = acc;
      }
      __syncwarp();  // the warp is done reading its block
      if (lane < 16) {
#pragma unroll
        for (int i = 0; i < 16; ++i) sA[(b0 + i) * Sh::kLdA + b0 + c] = y[i];
      }
    }
    __syncthreads();
#pragma unroll
    for (int bi = 1; bi < 4; ++bi) {
      const int w = 16 * bi;  // the block row's rows [w, w + 16), columns [0, w) left of T_ii
      const int per = 16 * w / 128;  // entries per thread: 2 bi
      float rv[6];
      // The block row's entries from rv back into sA, between barriers.
      auto store_rv = [&] {
        __syncthreads();
#pragma unroll
        for (int q = 0; q < 6; ++q) {
          if (q >= per) break;
          const int e = tid + 128 * q;
          sA[(w + e / w) * Sh::kLdA + e % w] = rv[q];
        }
        __syncthreads();
      };
#pragma unroll
      for (int q = 0; q < 6; ++q) {
        if (q >= per) break;
        const int e = tid + 128 * q, r = e / w, c = e % w;
        float const* trow = sA + (w + r) * Sh::kLdA + w;
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < 16; ++m) acc += trow[m] * sA[(w + m) * Sh::kLdA + c];
        rv[q] = acc;
      }
      store_rv();
#pragma unroll
      for (int q = 0; q < 6; ++q) {
        if (q >= per) break;
        const int e = tid + 128 * q, r = e / w, c = e % w;
        float const* rrow = sA + (w + r) * Sh::kLdA;
        float acc = 0.f;
        for (int m = c & ~15; m < w; ++m) acc += rrow[m] * sA[m * Sh::kLdA + c];
        rv[q] = -acc;
      }
      store_rv();
    }
    // T as bf16 over itself: thread (c, rh) holds rows rh, rh + 2, ... of column c.
    const int c = tid & (kChunk - 1), rh = tid / kChunk;
    float tv[kChunk / 2];
#pragma unroll
    for (int q = 0; q < kChunk / 2; ++q) tv[q] = sA[(rh + 2 * q) * Sh::kLdA + c];
    __syncthreads();
#pragma unroll
    for (int q = 0; q < kChunk / 2; ++q) {
      sT[(rh + 2 * q) * Sh::kLdT + c] = __float2bfloat16_rn(tv[q]);
    }
  } else {
    if (tid < kChunk && p.wy_probe_no_substitution) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) x[i] = i == tid ? 1.f : -sA[i * Sh::kLdA + tid];
    } else if (tid < kChunk) {
      const int c = tid;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        float acc[4] = {i == c ? 1.f : 0.f, 0.f, 0.f, 0.f};
        float const* arow = sA + i * Sh::kLdA;
#pragma unroll
        for (int j = 0; j + 4 <= i; j += 4) {
          const float4 a4 = *reinterpret_cast<float4 const*>(arow + j);
          acc[0] -= a4.x * x[j];
          acc[1] -= a4.y * x[j + 1];
          acc[2] -= a4.z * x[j + 2];
          acc[3] -= a4.w * x[j + 3];
        }
#pragma unroll
        for (int j = i & ~3; j < i; ++j) acc[0] -= arow[j] * x[j];
        x[i] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
      }
      if constexpr (!kCompact) {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) sT[i * Sh::kLdT + c] = __float2bfloat16_rn(x[i]);
      }
    } else {
      scale(tid - kChunk, kChunk);
    }
    if constexpr (kCompact) {
      __syncthreads();  // every thread is done with A: T takes its place
      if (tid < kChunk) {
#pragma unroll
        for (int i = 0; i < kChunk; ++i) sT[i * Sh::kLdT + tid] = __float2bfloat16_rn(x[i]);
      }
    }
  }
  __syncthreads();

  // W = T (beta G K), U' = T (beta V), 32 columns at a time; rows past the end are not stored.
  const int r0 = 16 * warp, g = lane >> 2, t = lane & 3;
  auto store = [&](float(&acc)[4][4], bf16* dst, int64_t ld, int col0) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t ti = t0 + r0 + g + 8 * hh;
      if (ti >= n) continue;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        *reinterpret_cast<__nv_bfloat162*>(dst + (ti * hv + h) * ld + col0 + 8 * nt + 2 * t) =
            __floats2bfloat162_rn(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
      }
    }
  };
#pragma unroll 1
  for (int c0 = 0; c0 < kDk; c0 += 32) {
    float acc[4][4] = {};
    warp_gemm_kn<4, kChunk>(acc, sT, Sh::kLdT, r0, sKs + c0, Sh::kLdK, 0);
    store(acc, ws.w, kDk, c0);
  }
#pragma unroll 1
  for (int c0 = 0; c0 < dvp; c0 += 32) {
    float acc[4][4] = {};
    warp_gemm_kn<4, kChunk>(acc, sT, Sh::kLdT, r0, sV + c0, ldv, 0);
    store(acc, ws.u, dvp, c0);
  }
  if (tid < kChunk && t0 + tid < n) ws.gam[(t0 + tid) * hv + h] = sGam[tid];
}

// chunk_state_kernel: one block of kGroups groups of 4 warps per (kGroups x 8 kNt value
// columns, value head, sequence), over the sequence's chunks in order; the next kStages - 1
// chunks' tiles arrive by cp.async while this one computes (W, Q, K, P shared by the groups, U'
// per group). Group q owns 8 kNt columns: its state [dk, 8 kNt] stays in the fp32 accumulators
// (warp w of the group: rows [w dk / 4, (w + 1) dk / 4)), a bf16 copy in its sS is the operand of
// W S and Q S. Shapes (GatedDeltaRuleParams::state_variant): 32 columns x 4 warps x 3 stages
// (the first), and 64 columns x 8 warps x 2 stages for grids of at least two blocks per SM (the
// shared tiles loaded once for twice the columns).
// 32 columns x 8 or 16 warps (16 or 8 per group) measured no faster at one sequence (the
// sequence-order chain's per-chunk latency, not the warps' issue, bounds it there).
template <int kDk, int kGroups, int kNt, int kStages>
struct StateShape {
  static constexpr int kCols = 8 * kNt;  // per group
  static constexpr int kBlockCols = kGroups * kCols;
  static constexpr int kThreads = 128 * kGroups;
  static constexpr int kLdK = kDk + 8;
  static constexpr int kLdP = kChunk + 8;
  // Row strides of 48 B or more are conflict-free for ldmatrix (8 columns: 16 B + 32 B pad).
  static constexpr int kLdV = kCols + 8 > 24 ? kCols + 8 : 24;
  static constexpr int kStage =
      3 * kChunk * kLdK + kChunk * kLdP + kGroups * kChunk * kLdV;  // bf16
  static constexpr size_t kSmemBytes =
      (kStages * kStage + kGroups * (kDk + 2 * kChunk) * kLdV) * sizeof(bf16) +
      kChunk * sizeof(float);
  static constexpr int kMt = kDk / 64;  // 16-row tiles of the state per warp
  static_assert(kSmemBytes <= 227 * 1024, "chunk_state_kernel: shared memory");
};
template <int kDk, int kGroups, int kNt, int kStages>
__global__ void __launch_bounds__(128 * kGroups) chunk_state_kernel(GatedDeltaRuleParams p) {
  using Sh = StateShape<kDk, kGroups, kNt, kStages>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int grp = (tid >> 5) / 4, warp = (tid >> 5) % 4;  // the group, the warp in it
  bf16* sStage = reinterpret_cast<bf16*>(smem_raw);
  bf16* sS = sStage + kStages * Sh::kStage + grp * kDk * Sh::kLdV;
  bf16* sU = sStage + kStages * Sh::kStage + kGroups * kDk * Sh::kLdV + grp * kChunk * Sh::kLdV;
  bf16* sUt = sU + kGroups * kChunk * Sh::kLdV;
  float* sGam = reinterpret_cast<float*>(sStage + kStages * Sh::kStage +
                                         kGroups * (kDk + 2 * kChunk) * Sh::kLdV);
  const int64_t hk = p.num_k_heads, hv = p.num_v_heads, dv = p.v_dim, dvp = pad_cols(dv);
  const int64_t bcol0 = static_cast<int64_t>(blockIdx.x) * Sh::kBlockCols;
  const int64_t col0 = bcol0 + grp * Sh::kCols, h = blockIdx.y, s = blockIdx.z;
  const int64_t kh = h / (hv / hk);
  const Ws ws = ws_at(p);
  const int64_t begin = p.seqs.seq_begin[s], end = p.seqs.seq_begin[s + 1];
  if (begin >= end) return;
  const int32_t slot = p.seqs.state_slot[s];
  float* gS = slot >= 0 ? p.states + slot * p.state_stride + h * kDk * dv : nullptr;
  const int32_t oslot = out_slot(p.seqs, s);
  float* gO = oslot >= 0 ? p.states + oslot * p.state_stride + h * kDk * dv : nullptr;
  const bool zero = gS == nullptr || p.seqs.fresh[s] != 0;

  // The state: accS[mt][nt] holds rows srow(mt) + g (+ 8), columns 8 nt + 2 t (+ 1).
  const int srow0 = warp * (kDk / 4);
  float accS[Sh::kMt][kNt][4];
#pragma unroll
  for (int mt = 0; mt < Sh::kMt; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = srow0 + 16 * mt + g + 8 * (e >> 1);
        const int64_t c = col0 + 8 * nt + 2 * t + (e & 1);
        accS[mt][nt][e] = (!zero && c < dv) ? gS[r * dv + c] : 0.f;
      }
    }
  }
  auto write_sS = [&] {
#pragma unroll
    for (int mt = 0; mt < Sh::kMt; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = srow0 + 16 * mt + g + 8 * hh;
          *reinterpret_cast<__nv_bfloat162*>(sS + r * Sh::kLdV + 8 * nt + 2 * t) =
              __floats2bfloat162_rn(accS[mt][nt][2 * hh], accS[mt][nt][2 * hh + 1]);
        }
      }
    }
  };
  write_sS();

  const int64_t m_first = begin / kChunk, m_last = (end - 1) / kChunk;
  // Tiles of chunk m into stage st; rows outside the chunk (and U' columns past dvp) are
  // zero-filled.
  auto issue = [&](int64_t m, int st) {
    bf16* sW = sStage + st * Sh::kStage;
    bf16* sQ = sW + kChunk * Sh::kLdK;
    bf16* sK = sQ + kChunk * Sh::kLdK;
    bf16* sP = sK + kChunk * Sh::kLdK;
    bf16* sUp = sP + kChunk * Sh::kLdP;  // [kGroups][kChunk][kLdV]
    const int64_t t0 = m * kChunk;
    constexpr int kVec = kDk / 8;
    for (int i = tid; i < kChunk * kVec; i += Sh::kThreads) {
      const int r = i / kVec, c = (i % kVec) * 8;
      const int64_t tt = t0 + r;
      const bool v = tt >= begin && tt < end;
      const int64_t ts = v ? tt : begin;  // a valid address either way
      cp_async16(sW + r * Sh::kLdK + c, ws.w + (ts * hv + h) * kDk + c, v);
      cp_async16(sQ + r * Sh::kLdK + c, ws.qb + (ts * hk + kh) * kDk + c, v);
      cp_async16(sK + r * Sh::kLdK + c, ws.kb + (ts * hk + kh) * kDk + c, v);
    }
    for (int i = tid; i < kChunk * (kChunk / 8); i += Sh::kThreads) {
      const int r = i / (kChunk / 8), c = (i % (kChunk / 8)) * 8;
      const int64_t tt = t0 + r;
      const bool v = tt >= begin && tt < end;
      const int64_t ts = v ? tt : begin;
      cp_async16(sP + r * Sh::kLdP + c, ws.p + (ts * hv + h) * kChunk + c, v);
    }
    constexpr int kUVec = Sh::kBlockCols / 8;
    for (int i = tid; i < kChunk * kUVec; i += Sh::kThreads) {
      const int r = i / kUVec, cb = (i % kUVec) * 8;  // column in the block
      const int q = cb / Sh::kCols, c = cb % Sh::kCols;
      const int64_t tt = t0 + r;
      const bool v = tt >= begin && tt < end && bcol0 + cb < dvp;
      const int64_t ts = v ? tt : begin;
      cp_async16(sUp + (q * kChunk + r) * Sh::kLdV + c,
                 ws.u + (ts * hv + h) * dvp + (v ? bcol0 + cb : 0), v);
    }
    cp_async_commit();
  };
  auto gam_of = [&](int64_t m) {
    const int64_t tt = m * kChunk + tid;
    return (tid < kChunk && tt >= begin && tt < end) ? ws.gam[tt * hv + h] : 0.f;
  };

  // kStages stages: chunks m + 1 .. m + kStages - 1 are in flight while m computes (a commit
  // group per chunk, empty past the last, so wait_group kStages - 1 always means "chunk m
  // landed").
#pragma unroll
  for (int k = 0; k + 1 < kStages; ++k) {
    if (m_first + k <= m_last) {
      issue(m_first + k, k);
    } else {
      cp_async_commit();
    }
  }
  float gq[kStages];  // gamma of chunks m .. m + kStages - 1 (this thread's row)
#pragma unroll
  for (int k = 0; k + 1 < kStages; ++k) gq[k] = gam_of(m_first + k);
  for (int64_t m = m_first; m <= m_last; ++m) {
    const int st = static_cast<int>((m - m_first) % kStages);
    if (m + kStages - 1 <= m_last) {
      issue(m + kStages - 1, (st + kStages - 1) % kStages);
    } else {
      cp_async_commit();
    }
    gq[kStages - 1] = gam_of(m + kStages - 1);
    if (tid < kChunk) sGam[tid] = gq[0];
    cp_async_wait<kStages - 1>();
    __syncthreads();  // this chunk's tiles, sGam, sS
    bf16 const* sW = sStage + st * Sh::kStage;
    bf16 const* sQ = sW + kChunk * Sh::kLdK;
    bf16 const* sK = sQ + kChunk * Sh::kLdK;
    bf16 const* sP = sK + kChunk * Sh::kLdK;
    bf16 const* sUp = sP + kChunk * Sh::kLdP + grp * kChunk * Sh::kLdV;
    const int64_t t0 = m * kChunk;
    const int lo = begin > t0 ? static_cast<int>(begin - t0) : 0;
    const int hi = end - t0 < kChunk ? static_cast<int>(end - t0) : kChunk;
    const float g_last = sGam[hi - 1];

    // U = U' - W S0 and Q S0 for the warp's 16 token rows.
    const int r0 = 16 * warp;
    float accU[kNt][4] = {}, accO[kNt][4] = {};
#pragma unroll
    for (int kk = 0; kk < kDk; kk += 16) {
      uint32_t aw[4], aq[4];
      frag_a(aw, sW, Sh::kLdK, r0, kk);
      frag_a(aq, sQ, Sh::kLdK, r0, kk);
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        uint32_t b0, b1;
        frag_b_kn(b0, b1, sS, Sh::kLdV, kk, 8 * nt);
        mma16816(accU[nt], aw, b0, b1);
        mma16816(accO[nt], aq, b0, b1);
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = r0 + g + 8 * hh;
      const bool in = i >= lo && i < hi;
      const float gi = sGam[i];
      const float f = in ? expf(g_last - gi) : 0.f;
      const float gqi = in ? expf(gi) : 0.f;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const int j = 8 * nt + 2 * t;
        const float2 up =
            __bfloat1622float2(*reinterpret_cast<__nv_bfloat162 const*>(sUp + i * Sh::kLdV + j));
        const float u0 = in ? up.x - accU[nt][2 * hh] : 0.f;
        const float u1 = in ? up.y - accU[nt][2 * hh + 1] : 0.f;
        *reinterpret_cast<__nv_bfloat162*>(sU + i * Sh::kLdV + j) = __floats2bfloat162_rn(u0, u1);
        *reinterpret_cast<__nv_bfloat162*>(sUt + i * Sh::kLdV + j) =
            __floats2bfloat162_rn(f * u0, f * u1);
        accO[nt][2 * hh] *= gqi;
        accO[nt][2 * hh + 1] *= gqi;
      }
    }
    __syncthreads();  // sU, sUt complete; every warp is done with sS

    // O = diag(G) Q S0 + P U.
    warp_gemm_kn<kNt, kChunk>(accO, sP, Sh::kLdP, r0, sU, Sh::kLdV, 0);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int i = r0 + g + 8 * hh;
      if (i < lo || i >= hi) continue;
      float* o = p.out + ((t0 + i) * hv + h) * dv;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t c = col0 + 8 * nt + 2 * t + e;
          if (c < dv) o[c] = accO[nt][2 * hh + e];
        }
      }
    }
    // S = G_last S0 + K^T Ut.
    const float decay = expf(g_last);
#pragma unroll
    for (int mt = 0; mt < Sh::kMt; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) accS[mt][nt][e] *= decay;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kChunk; kk += 16) {
#pragma unroll
      for (int mt = 0; mt < Sh::kMt; ++mt) {
        uint32_t a[4];
        frag_a_t(a, sK, Sh::kLdK, srow0 + 16 * mt, kk);
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          uint32_t b0, b1;
          frag_b_kn(b0, b1, sUt, Sh::kLdV, kk, 8 * nt);
          mma16816(accS[mt][nt], a, b0, b1);
        }
      }
    }
    write_sS();
    __syncthreads();  // sS for the next chunk; this stage, sU, sUt, sGam free
#pragma unroll
    for (int k = 0; k + 1 < kStages; ++k) gq[k] = gq[k + 1];
  }
  if (gO != nullptr) {
#pragma unroll
    for (int mt = 0; mt < Sh::kMt; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = srow0 + 16 * mt + g + 8 * (e >> 1);
          const int64_t c = col0 + 8 * nt + 2 * t + (e & 1);
          if (c < dv) gO[r * dv + c] = accS[mt][nt][e];
        }
      }
    }
  }
}

template <class Kernel>
void raise_smem(Kernel kernel, size_t bytes) {
  // NOTE: cudaFuncSetAttribute is not a stream operation, so it is legal during capture.
  TANDEM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes)));
}

// Streaming multiprocessors of the current device (cached per device).
int sm_count() {
  static int cached[64] = {};
  int dev = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cached[dev] = n > 0 ? n : 1;
  }
  return cached[dev];
}

template <int kDk, int kGroups, int kNt, int kStages>
void state_launch(GatedDeltaRuleParams const& p, cudaStream_t stream) {
  using Sh = StateShape<kDk, kGroups, kNt, kStages>;
  auto kernel = chunk_state_kernel<kDk, kGroups, kNt, kStages>;
  raise_smem(kernel, Sh::kSmemBytes);
  const dim3 grid(static_cast<unsigned>((p.v_dim + Sh::kBlockCols - 1) / Sh::kBlockCols),
                  static_cast<unsigned>(p.num_v_heads), static_cast<unsigned>(p.seqs.num_seqs));
  kernel<<<grid, Sh::kThreads, Sh::kSmemBytes, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
}

template <int kDk>
void chunked_dispatch(GatedDeltaRuleParams const& p, cudaStream_t stream) {
  const int64_t tiles = (p.num_tokens + kChunk - 1) / kChunk;
  TANDEM_CHECK(tiles <= INT32_MAX, "gated_delta_rule: too many tokens");
  const size_t wy_smem = WyShape<kDk>::smem_bytes(pad_cols(p.v_dim), !p.wide_wy);
  // V by 16-byte cp.async when its rows allow (the model's and the benchmark's always do).
  const bool vec_v =
      p.v_dim % 8 == 0 && p.qkv_stride % 8 == 0 && reinterpret_cast<uintptr_t>(p.qkv) % 16 == 0;
  const dim3 wy_grid(static_cast<unsigned>(tiles), static_cast<unsigned>(p.num_v_heads));
  auto wy = p.wide_wy ? chunk_wy_kernel<kDk, false> : chunk_wy_kernel<kDk, true>;
  raise_smem(wy, wy_smem);
  // All of the SM's unified memory as shared memory: 4 compact blocks (4 x 53 KB) fit.
  TANDEM_CUDA_CHECK(cudaFuncSetAttribute(wy, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared));
  wy<<<wy_grid, 128, wy_smem, stream>>>(p, vec_v);
  TANDEM_CUDA_CHECK_LAUNCH();
  if (p.stages < 3) return;
  int variant = p.state_variant;
  if (variant == 0) {  // by the grid's size
    const int64_t blocks32 = (p.v_dim + 31) / 32 * p.num_v_heads * p.seqs.num_seqs;
    const int sms = sm_count();
    variant = blocks32 >= 2 * sms ? 2 : 1;
  }
  switch (variant) {
    case 1: state_launch<kDk, 1, 4, 3>(p, stream); break;
    case 2: state_launch<kDk, 2, 4, 2>(p, stream); break;
    default: TANDEM_CHECK(false, "gated_delta_rule: state_variant ", p.state_variant);
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

// by_block: delta_rule_kernel over each sequence's tokens (a decode step, or short chunks).
template <int kDk>
void delta_rule_dispatch(GatedDeltaRuleParams const& p, dim3 grid, bool decode, bool by_block,
                         cudaStream_t stream) {
  if (decode && p.fused_decode) {
    delta_rule_fused_kernel<kDk><<<grid, kDeltaWarps * 32, 0, stream>>>(p);
  } else if (by_block) {
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
  const bool vec = p.kernel == 4 && p.channels % 8 == 0 && p.x_stride % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.weight) % 16 == 0;
  if (vec) {
    const int64_t vblocks = (p.channels / 8 + threads - 1) / threads;
    conv1d_prefill4_kernel<<<dim3(static_cast<unsigned>((p.num_tokens + kConvTokens - 1) /
                                                        kConvTokens),
                                  static_cast<unsigned>(vblocks)),
                             threads, 0, stream>>>(p);
  } else {
    conv1d_kernel<false><<<grid, threads, 0, stream>>>(p);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
  if (p.seqs.num_seqs > 0) {
    conv1d_state_kernel<<<dim3(static_cast<unsigned>(p.seqs.num_seqs),
                               static_cast<unsigned>(cblocks)),
                          threads, 0, stream>>>(p);
    TANDEM_CUDA_CHECK_LAUNCH();
  }
}

void gated_delta_rule_occupancy(int64_t v_dim, int (&blocks)[4]) {
  const int64_t dvp = pad_cols(v_dim);
  auto wy_occ = [&](auto kernel, size_t smem) {
    raise_smem(kernel, smem);
    TANDEM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           cudaSharedmemCarveoutMaxShared));
    int n = 0;
    TANDEM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, 128, smem));
    return n;
  };
  blocks[0] = wy_occ(chunk_wy_kernel<128, true>, WyShape<128>::smem_bytes(dvp, true));
  blocks[1] = wy_occ(chunk_wy_kernel<128, false>, WyShape<128>::smem_bytes(dvp, false));
  auto st_occ = [&](auto kernel, int threads, size_t smem) {
    raise_smem(kernel, smem);
    int n = 0;
    TANDEM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
    return n;
  };
  using S1 = StateShape<128, 1, 4, 3>;
  using S2 = StateShape<128, 2, 4, 2>;
  blocks[2] = st_occ(chunk_state_kernel<128, 1, 4, 3>, S1::kThreads, S1::kSmemBytes);
  blocks[3] = st_occ(chunk_state_kernel<128, 2, 4, 2>, S2::kThreads, S2::kSmemBytes);
}

size_t gated_delta_rule_workspace_floats(int64_t num_tokens, int64_t num_k_heads,
                                         int64_t num_v_heads, int64_t k_dim, int64_t v_dim) {
  return static_cast<size_t>(ws_offsets(num_tokens, num_k_heads, num_v_heads, k_dim, v_dim).total);
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
  // A decode step (one token per sequence): 4 warps split the state's rows (4x the warps
  // for the state's one read and write). Prefill: the chunked tensor-core form (k_dim 64 or
  // 128, chunks longer than short_chunk_tokens on average), else (or when asked) a warp holds
  // whole columns over the tokens.
  const bool decode = p.num_tokens == p.seqs.num_seqs;
  const bool chunked = !decode && !p.sequential && (p.k_dim == 64 || p.k_dim == 128) &&
                       p.num_tokens > p.short_chunk_tokens * p.seqs.num_seqs;
  if (chunked) {
    // q / k as kDk / 32-element vectors when the rows allow (the model's always do).
    const int64_t per = p.k_dim / 32;
    const bool vec =
        p.qkv_stride % per == 0 && reinterpret_cast<uintptr_t>(p.qkv) % (per * sizeof(bf16)) == 0;
    const unsigned blocks = static_cast<unsigned>(p.num_tokens);
    if (vec) {
      const int heads = p.prep_heads4 ? 4 : 1;  // per warp
      const int threads =
          32 * static_cast<int>(std::min<int64_t>((2 * p.num_k_heads + heads - 1) / heads, 32));
      auto prep =
          p.k_dim == 64
              ? (heads == 4 ? delta_prep_vec_kernel<64, 4> : delta_prep_vec_kernel<64, 1>)
              : (heads == 4 ? delta_prep_vec_kernel<128, 4> : delta_prep_vec_kernel<128, 1>);
      prep<<<blocks, threads, 0, stream>>>(p);
    } else {
      delta_prep_kernel<true><<<blocks, 128, 0, stream>>>(p);
    }
    TANDEM_CUDA_CHECK_LAUNCH();
    if (p.seqs.num_seqs == 0 || p.stages < 2) return;
    if (p.k_dim == 64) {
      chunked_dispatch<64>(p, stream);
    } else {
      chunked_dispatch<128>(p, stream);
    }
    return;
  }
  if (!decode || !p.fused_decode) {  // the fused decode kernel normalises q / k itself
    delta_prep_kernel<false><<<static_cast<unsigned>(p.num_tokens), 128, 0, stream>>>(p);
    TANDEM_CUDA_CHECK_LAUNCH();
  }
  if (p.seqs.num_seqs == 0) return;
  const dim3 grid(static_cast<unsigned>((p.v_dim + 31) / 32), static_cast<unsigned>(p.num_v_heads),
                  static_cast<unsigned>(p.seqs.num_seqs));
  // Short chunks (a speculative verify, a state replay) as a decode step's blocks: coalesced
  // state rows, a few block barriers per token.
  const bool by_block = decode || (!p.sequential && !p.short_chunks_by_warp &&
                                   p.num_tokens <= p.short_chunk_tokens * p.seqs.num_seqs);
  switch (p.k_dim) {
    case 16: delta_rule_dispatch<16>(p, grid, decode, by_block, stream); break;
    case 32: delta_rule_dispatch<32>(p, grid, decode, by_block, stream); break;
    case 64: delta_rule_dispatch<64>(p, grid, decode, by_block, stream); break;
    case 128: delta_rule_dispatch<128>(p, grid, decode, by_block, stream); break;
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
