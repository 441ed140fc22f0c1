// Decode MoE expert GEMVs. See moe_decode.h.
//
// gate_up: grid (slot s of num_tokens * top_k, block of 8 output columns). Every warp loads the
// routing of all slots (<= 64 ids and compact rows: one load round trip), and the block of slot
// s works only if s is the first slot routed to its local expert (the others exit), for all of
// that expert's slots (their compact rows, ascending slot = moe_permute's order). A warp's
// column j: the packed gate row 16 (j / 8) + j % 8 and the up row 8 after it, 4 16-byte loads
// of each in flight per lane (hidden 2048: two rounds), fp32 FMAs against each token's x.
// down: grid of 8-warp blocks over the hidden columns. Before griddepcontrol.wait a block lists
// the non-empty local experts (ballot scan over the offsets) and each slot's token and weight,
// and every warp issues the loads of its column's down rows for the first experts (<= 24
// 16-byte loads per lane: all 8 experts of one token at inter 768); then it waits for gate_up and
// consumes the act rows.
#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_decode.h"
#include "backend/cuda/moe_gemm.h"

namespace tandem::cuda {
namespace {

using detail::launch_pdl;
using detail::pdl_trigger;
using detail::pdl_wait;

constexpr int kWarps = 8, kThreads = kWarps * 32, kMaxSlots = 64, kT = kMoeDecodeMaxTokens;
constexpr int kMaxLocal = static_cast<int>(kRouterMaxExperts);  // down: local experts listed
constexpr int kPreLoads = 24;  // down: 16-byte loads per lane issued before the wait (at most)

__device__ __forceinline__ uint4 load_stream(uint4 const* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 8 bf16 (one uint4) to fp32.
__device__ __forceinline__ void unpack8(uint4 const& v, float (&f)[8]) {
  uint32_t const u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ float dot8(uint4 const& a, uint4 const& b, float acc) {
  float fa[8], fb[8];
  unpack8(a, fa);
  unpack8(b, fb);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc = fmaf(fa[j], fb[j], acc);
  return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

// kMaxT >= num_tokens (accumulators per lane), kU 16-byte loads per lane and row in flight.
template <int kMaxT, int kU>
__global__ void __launch_bounds__(kThreads, 2) gate_up_kernel(MoeDecodeParams p) {
  pdl_wait();  // the router's ids and rows
  pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int S = p.num_tokens * p.top_k, s = blockIdx.x;
  // Every slot's expert id, and this slot's expert.
  const int id0 = lane < S ? p.topk_ids[lane] : -1;
  const int id1 = lane + 32 < S ? p.topk_ids[lane + 32] : -1;
  const int my_id = __shfl_sync(0xffffffffu, s < 32 ? id0 : id1, s & 31);
  const int le = my_id - p.expert_begin;
  if (le < 0 || le >= p.num_local_experts) return;  // routed to another rank
  const unsigned m0 = __ballot_sync(0xffffffffu, id0 == my_id);
  const unsigned m1 = __ballot_sync(0xffffffffu, id1 == my_id);
  const int first = m0 != 0 ? __ffs(m0) - 1 : 32 + __ffs(m1) - 1;
  if (first != s) return;  // the expert's first slot does its work
  const int j = blockIdx.y * kWarps + warp;
  if (j >= p.inter) return;
  // The expert's slots in ascending order: their tokens and compact rows (rows of act: by
  // local expert, then slot, so they are consecutive from the router's offset).
  const int row0 = p.expert_offsets[le];
  const int M = __popc(m0) + __popc(m1);  // <= num_tokens: one slot per token and expert
  int tok[kMaxT];
  {
    unsigned a = m0, b = m1;
#pragma unroll
    for (int i = 0; i < kMaxT; ++i) {
      int sl = 0;
      if (a != 0) {
        sl = __ffs(a) - 1;
        a &= a - 1;
      } else if (b != 0) {
        sl = 32 + __ffs(b) - 1;
        b &= b - 1;
      }
      tok[i] = sl / p.top_k;
    }
  }
  const int H = p.hidden, nchunk = H / 8;
  constexpr int G = static_cast<int>(kMoeGateUpInterleave);
  const int64_t grow = 2 * G * (j / G) + (j % G);
  uint4 const* wg =
      reinterpret_cast<uint4 const*>(p.gate_up + (int64_t{le} * 2 * p.inter + grow) * H);
  uint4 const* wu = wg + int64_t{G} * nchunk;
  uint4 const* x4 = reinterpret_cast<uint4 const*>(p.x);
  float ag[kMaxT], au[kMaxT];
#pragma unroll
  for (int i = 0; i < kMaxT; ++i) ag[i] = au[i] = 0.f;
  for (int base = lane; base < nchunk; base += 32 * kU) {
    uint4 vg[kU], vu[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = base + 32 * u;
      vg[u] = c < nchunk ? load_stream(wg + c) : uint4{};
      vu[u] = c < nchunk ? load_stream(wu + c) : uint4{};
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int c = base + 32 * u;
      if (c >= nchunk) break;
#pragma unroll
      for (int i = 0; i < kMaxT; ++i) {
        if (i < M) {
          const uint4 xv = x4[int64_t{tok[i]} * nchunk + c];  // after the wait: not .nc
          ag[i] = dot8(vg[u], xv, ag[i]);
          au[i] = dot8(vu[u], xv, au[i]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kMaxT; ++i) {
    if (i < M) {
      const float g = warp_sum(ag[i]), u = warp_sum(au[i]);
      if (lane == 0) p.act[int64_t{row0 + i} * p.inter + j] = __float2bfloat16_rn(silu(g) * u);
    }
  }
}

// kCpl 16-byte chunks per lane cover a down row (inter / 8 <= 32 kCpl); kPre experts' rows are
// loaded before the wait.
template <int kCpl>
__global__ void __launch_bounds__(kThreads, 2) down_kernel(MoeDecodeParams p) {
  constexpr int kPre = kCpl >= kPreLoads ? 1 : kPreLoads / kCpl;
  // At most kMaxSlots non-empty experts (each has a routed row).
  __shared__ int sExp[kMaxSlots], sOff[kMaxLocal + 1], sWarpCount[kWarps], sNum;
  __shared__ int sTok[kMaxSlots];
  __shared__ float sW[kMaxSlots];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int L = p.num_local_experts;
  // Routing, complete before gate_up started: non-empty local experts in ascending order, one
  // expert per thread and pass (one pass up to 256 local experts).
  if (tid == 0) sOff[L] = p.expert_offsets[L];
  int total = 0;
  for (int e0 = 0; e0 < L; e0 += kThreads) {
    const int e = e0 + tid;
    int count = 0;
    if (e < L) {
      sOff[e] = p.expert_offsets[e];
      count = p.expert_offsets[e + 1] - p.expert_offsets[e];
    }
    const unsigned ne = __ballot_sync(0xffffffffu, count > 0);
    if (lane == 0) sWarpCount[warp] = __popc(ne);
    __syncthreads();
    int before = total;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? sWarpCount[w] : 0;
      total += sWarpCount[w];
    }
    if (count > 0) sExp[before + __popc(ne & ((1u << lane) - 1u))] = e;
    __syncthreads();  // sWarpCount is rewritten by the next pass
  }
  const int rows = sOff[L];
  if (tid < rows) {
    const int slot = p.permuted_src[tid];
    sTok[tid] = slot / p.top_k;
    sW[tid] = p.topk_weights[slot];
  }
  if (tid == 0) sNum = total;
  __syncthreads();
  const int ng = sNum, I = p.inter, nchunk = I / 8, H = p.hidden;
  const int h = blockIdx.x * kWarps + warp;
  const bool active = h < H;
  auto load_rows = [&](int g0, uint4(&wv)[kPre][kCpl]) {
#pragma unroll
    for (int g = 0; g < kPre; ++g) {
      const bool ok = active && g0 + g < ng;
      uint4 const* base =
          ok ? reinterpret_cast<uint4 const*>(p.down + (int64_t{sExp[g0 + g]} * H + h) * I)
             : nullptr;
#pragma unroll
      for (int c = 0; c < kCpl; ++c) {
        const int cc = lane + 32 * c;
        wv[g][c] = ok && cc < nchunk ? load_stream(base + cc) : uint4{};
      }
    }
  };
  uint4 wv[kPre][kCpl];
  load_rows(0, wv);
  pdl_wait();  // gate_up's act rows
  pdl_trigger();
  if (!active) return;
  uint4 const* act4 = reinterpret_cast<uint4 const*>(p.act);
  float acc[kT];
#pragma unroll
  for (int t = 0; t < kT; ++t) acc[t] = 0.f;
  for (int g0 = 0; g0 < ng; g0 += kPre) {
    if (g0 > 0) load_rows(g0, wv);
#pragma unroll
    for (int g = 0; g < kPre; ++g) {
      if (g0 + g >= ng) break;
      const int e = sExp[g0 + g];
      for (int r = sOff[e]; r < sOff[e + 1]; ++r) {
        float part = 0.f;
#pragma unroll
        for (int c = 0; c < kCpl; ++c) {
          const int cc = lane + 32 * c;
          if (cc < nchunk) part = dot8(wv[g][c], act4[int64_t{r} * nchunk + cc], part);
        }
        // The grouped GEMM's bf16 output row, then the unpermute's weighted sum.
        const float y = __bfloat162float(__float2bfloat16_rn(warp_sum(part)));
        const int t = sTok[r];
        const float w = sW[r];
#pragma unroll
        for (int tt = 0; tt < kT; ++tt) {
          if (tt == t) acc[tt] += w * y;
        }
      }
    }
  }
  float v = 0.f;
#pragma unroll
  for (int tt = 0; tt < kT; ++tt) v = tt == lane ? acc[tt] : v;
  if (lane < p.num_tokens) p.out[int64_t{lane} * H + h] = __float2bfloat16_rn(v);
}

// ---- One token, the top-k inside the expert kernels (moe_decode_topk_launch) ----

constexpr int kTopkPerLane = 8;  // logits per lane: num_experts <= 256
constexpr int kMaxTopK = 8;

// The top-k softmax of one token's logits with the decode router's arithmetic and tie rule
// (moe_layer_kernels.cu: greater probability, then lower expert id; renormalized over the
// top-k when asked). Every lane ends with the same ids and weights (slots j < K).
__device__ __forceinline__ void warp_topk(float const* logits, int E, int K, bool renormalize,
                                          int (&sel_e)[kMaxTopK], float (&sel_w)[kMaxTopK]) {
  const int lane = threadIdx.x & 31;
  float prob[kTopkPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kTopkPerLane; ++i) {
    const int ee = lane + 32 * i;
    prob[i] = ee < E ? __ldcg(logits + ee) : -INFINITY;
    mx = fmaxf(mx, prob[i]);
  }
  mx = detail::warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kTopkPerLane; ++i) {
    const int ee = lane + 32 * i;
    prob[i] = ee < E ? expf(prob[i] - mx) : 0.f;
    sum += prob[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kTopkPerLane; ++i) {
    const int ee = lane + 32 * i;
    prob[i] = ee < E ? prob[i] / sum : -INFINITY;
  }
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    sel_w[j] = 0.f;
    sel_e[j] = 0;
    if (j < K) {
      float bv = -INFINITY;
      int be = INT32_MAX;
#pragma unroll
      for (int i = 0; i < kTopkPerLane; ++i) {
        if (prob[i] > bv) {
          bv = prob[i];
          be = lane + 32 * i;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (ov > bv || (ov == bv && oe < be)) {
          bv = ov;
          be = oe;
        }
      }
      sel_w[j] = bv;
      sel_e[j] = be;
#pragma unroll
      for (int i = 0; i < kTopkPerLane; ++i) {
        if (lane + 32 * i == be) prob[i] = -INFINITY;
      }
    }
  }
  float ksum = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    if (j < K) ksum += sel_w[j];
  }
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    if (j < K && renormalize) sel_w[j] = sel_w[j] / ksum;
  }
}

// sel[j] for a runtime j (registers, no local-memory indexing).
template <typename V>
__device__ __forceinline__ V pick(V const (&sel)[kMaxTopK], int j) {
  V v = sel[0];
#pragma unroll
  for (int i = 1; i < kMaxTopK; ++i) v = i == j ? sel[i] : v;
  return v;
}

constexpr int kTopkU = 8;  // gate_up: 16-byte loads per lane and row (hidden <= 2048: one round)

// Grid: at most the CTAs that fit at once; warp items q = (slot q / inter, column q % inter).
// kPrefetch: the next item's rows are loaded while the current one is reduced (about 220
// registers: one CTA per SM); otherwise one item at a time in <= 128 registers (two CTAs per
// SM, or one beside a down CTA that streams its rows meanwhile).
// kL2Down: once its first item's loads are issued, every thread also prefetches its share of
// the local slots' down weights into L2 (128-byte lines, evict_last), so that down reads them
// from L2 while gate_up's own loads leave DRAM bandwidth unused.
template <bool kPrefetch, bool kL2Down>
__global__ void __launch_bounds__(kThreads, kPrefetch ? 1 : 2)
    gate_up_routed_kernel(MoeDecodeTopkParams p) {
  pdl_wait();  // the router's logits
  pdl_trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int K = p.top_k, I = p.inter, L = p.num_local_experts;
  int sel_e[kMaxTopK];
  float sel_w[kMaxTopK];
  warp_topk(p.logits, p.num_experts, K, p.renormalize, sel_e, sel_w);
  if (blockIdx.x == 0) {  // the routing, as the router kernel writes it
    if (warp == 0 && lane < K) {
      p.topk_ids[lane] = pick(sel_e, lane);
      p.topk_weights[lane] = pick(sel_w, lane);
    }
    for (int le = tid; le <= L; le += kThreads) {
      int before = 0;
#pragma unroll
      for (int j = 0; j < kMaxTopK; ++j) {
        const int l = sel_e[j] - p.expert_begin;
        before += j < K && l >= 0 && l < L && l < le;
      }
      p.expert_offsets[le] = before;
    }
  }
  const int H = p.hidden, nchunk = H / 8, items = K * I;
  constexpr int G = static_cast<int>(kMoeGateUpInterleave);
  uint4 const* x4 = reinterpret_cast<uint4 const*>(p.x);
  uint4 xr[kTopkU];
#pragma unroll
  for (int u = 0; u < kTopkU; ++u) {
    const int c = lane + 32 * u;
    xr[u] = c < nchunk ? x4[c] : uint4{};  // after the wait: not .nc
  }
  // Item q's gate and up rows into g, u; false (nothing loaded) for another rank's expert.
  auto load_item = [&](int q, uint4(&g)[kTopkU], uint4(&u)[kTopkU]) {
    const int j = q / I, c = q - j * I;
    const int le = pick(sel_e, j) - p.expert_begin;
    const bool ok = le >= 0 && le < L;
    const int64_t grow = 2 * G * (c / G) + (c % G);
    uint4 const* wg =
        reinterpret_cast<uint4 const*>(p.gate_up + (int64_t{ok ? le : 0} * 2 * I + grow) * H);
    uint4 const* wu = wg + int64_t{G} * nchunk;
#pragma unroll
    for (int k = 0; k < kTopkU; ++k) {
      const int cc = lane + 32 * k;
      g[k] = ok && cc < nchunk ? load_stream(wg + cc) : uint4{};
      u[k] = ok && cc < nchunk ? load_stream(wu + cc) : uint4{};
    }
    return ok;
  };
  const int step = gridDim.x * kWarps;
  int q = blockIdx.x * kWarps + warp;
  uint4 ga[kTopkU], ua[kTopkU];
  bool has = q < items && load_item(q, ga, ua);
  if constexpr (kL2Down) {
    const int64_t lines = int64_t{H} * I * 2 / 128, gt = int64_t{blockIdx.x} * kThreads + tid;
    const int64_t stride = int64_t{gridDim.x} * kThreads;
    for (int j = 0; j < K; ++j) {
      const int l = pick(sel_e, j) - p.expert_begin;
      if (l < 0 || l >= L) continue;
      char const* base = reinterpret_cast<char const*>(p.down + int64_t{l} * H * I);
      for (int64_t line = gt; line < lines; line += stride) {
        asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(base + line * 128));
      }
    }
  }
  while (q < items) {
    const int qn = q + step;
    uint4 gb[kTopkU], ub[kTopkU];
    bool hasn = false;
    if constexpr (kPrefetch) hasn = qn < items && load_item(qn, gb, ub);  // in flight meanwhile
    if (has) {
      float ag = 0.f, au = 0.f;
#pragma unroll
      for (int k = 0; k < kTopkU; ++k) {
        if (lane + 32 * k < nchunk) {
          ag = dot8(ga[k], xr[k], ag);
          au = dot8(ua[k], xr[k], au);
        }
      }
      ag = warp_sum(ag);
      au = warp_sum(au);
      if (lane == 0) p.act[int64_t{q}] = __float2bfloat16_rn(silu(ag) * au);  // [j, c] = q
    }
    if constexpr (kPrefetch) {
#pragma unroll
      for (int k = 0; k < kTopkU; ++k) {
        ga[k] = gb[k];
        ua[k] = ub[k];
      }
    } else {
      hasn = qn < items && load_item(qn, ga, ua);
    }
    has = hasn;
    q = qn;
  }
}

// A warp per output column h; kCpl 16-byte chunks per lane cover a down row, kPre slots' rows
// are loaded before the wait (then the rest, kPre at a time).
template <int kCpl>
__global__ void __launch_bounds__(kThreads, 2) down_routed_kernel(MoeDecodeTopkParams p) {
  constexpr int kPre0 = kCpl >= kPreLoads ? 1 : kPreLoads / kCpl;
  constexpr int kPre = kPre0 < kMaxTopK ? kPre0 : kMaxTopK;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int K = p.top_k, L = p.num_local_experts, H = p.hidden, I = p.inter, nchunk = I / 8;
  const int h = blockIdx.x * kWarps + warp;
  const bool active = h < H;
  // The logits are complete: the router finished before gate_up (which launched this) waited.
  int sel_e[kMaxTopK];
  float sel_w[kMaxTopK];
  warp_topk(p.logits, p.num_experts, K, p.renormalize, sel_e, sel_w);
  int le[kMaxTopK], rank[kMaxTopK];
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    const int l = sel_e[j] - p.expert_begin;
    le[j] = j < K && l >= 0 && l < L ? l : -1;
  }
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    rank[j] = 0;
#pragma unroll
    for (int i = 0; i < kMaxTopK; ++i) rank[j] += le[i] >= 0 && le[i] < le[j];
  }
  auto load_rows = [&](int j0, uint4(&wv)[kPre][kCpl]) {
#pragma unroll
    for (int g = 0; g < kPre; ++g) {
      const int j = j0 + g < kMaxTopK ? j0 + g : 0;
      const bool ok = active && j0 + g < kMaxTopK && le[j] >= 0;
      uint4 const* base =
          ok ? reinterpret_cast<uint4 const*>(p.down + (int64_t{le[j]} * H + h) * I) : nullptr;
#pragma unroll
      for (int c = 0; c < kCpl; ++c) {
        const int cc = lane + 32 * c;
        wv[g][c] = ok && cc < nchunk ? load_stream(base + cc) : uint4{};
      }
    }
  };
  uint4 wv[kPre][kCpl];
  load_rows(0, wv);
  pdl_wait();  // gate_up's act rows
  pdl_trigger();
  if (!active) return;
  uint4 const* act4 = reinterpret_cast<uint4 const*>(p.act);
  float y[kMaxTopK];
#pragma unroll
  for (int j0 = 0; j0 < kMaxTopK; j0 += kPre) {
    if (j0 > 0) load_rows(j0, wv);
#pragma unroll
    for (int g = 0; g < kPre; ++g) {
      const int j = j0 + g;
      if (j < kMaxTopK) {
        float part = 0.f;
        if (le[j] >= 0) {
#pragma unroll
          for (int c = 0; c < kCpl; ++c) {
            const int cc = lane + 32 * c;
            if (cc < nchunk) part = dot8(wv[g][c], act4[int64_t{j} * nchunk + cc], part);
          }
        }
        // The grouped GEMM's bf16 output row.
        y[j] = __bfloat162float(__float2bfloat16_rn(warp_sum(part)));
      }
    }
  }
  // The unpermute's weighted sum, in ascending local expert order.
  float acc = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxTopK; ++r) {
    float w = 0.f, yy = 0.f;
    bool any = false;
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      if (le[j] >= 0 && rank[j] == r) {
        w = sel_w[j];
        yy = y[j];
        any = true;
      }
    }
    if (any) acc += w * yy;
  }
  if (lane == 0) p.out[h] = __float2bfloat16_rn(acc);
}

bool aligned16(void const* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

}  // namespace

bool moe_decode_supported(MoeDecodeParams const& p) {
  return p.num_tokens >= 1 && p.num_tokens <= kMoeDecodeMaxTokens && p.top_k >= 1 &&
         p.num_tokens * p.top_k <= kMaxSlots && p.hidden >= 8 && p.hidden % 8 == 0 &&
         p.inter >= 8 && p.inter % kMoeGateUpInterleave == 0 && p.inter <= 2048 &&
         p.num_local_experts >= 1 && p.num_local_experts <= kMaxLocal && p.expert_begin >= 0 &&
         p.x != nullptr && p.gate_up != nullptr && p.down != nullptr && p.act != nullptr &&
         p.out != nullptr && aligned16(p.x) && aligned16(p.gate_up) && aligned16(p.down) &&
         aligned16(p.act) && p.topk_ids != nullptr && p.topk_weights != nullptr &&
         p.expert_offsets != nullptr && p.permuted_src != nullptr;
}

void moe_decode_launch(MoeDecodeParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kUnsupported, moe_decode_supported(p), "moe_decode: unsupported sizes (tokens ",
                    p.num_tokens, ", top_k ", p.top_k, ", hidden ", p.hidden, ", inter ", p.inter,
                    ", local experts ", p.num_local_experts, ") or unaligned pointers");
  const dim3 gu_grid(static_cast<unsigned>(p.num_tokens * p.top_k),
                     static_cast<unsigned>((p.inter + kWarps - 1) / kWarps));
  // One token: 8 loads of each row in flight per lane (hidden 2048: the whole rows at once).
  auto gate_up = [&](auto kernel) {
    TANDEM_CUDA_CHECK(launch_pdl(kernel, gu_grid, dim3(kThreads), 0, stream, p));
  };
  if (p.num_tokens == 1) {
    gate_up(gate_up_kernel<1, 8>);
  } else if (p.num_tokens <= 2) {
    gate_up(gate_up_kernel<2, 8>);
  } else if (p.num_tokens <= 4) {
    gate_up(gate_up_kernel<4, 4>);
  } else {
    gate_up(gate_up_kernel<kT, 4>);
  }
  const unsigned dn_blocks = static_cast<unsigned>((p.hidden + kWarps - 1) / kWarps);
  const int cpl = (p.inter / 8 + 31) / 32;
  auto down = [&](auto kernel) {
    TANDEM_CUDA_CHECK(launch_pdl(kernel, dim3(dn_blocks), dim3(kThreads), 0, stream, p));
  };
  if (cpl <= 1) {
    down(down_kernel<1>);
  } else if (cpl <= 2) {
    down(down_kernel<2>);
  } else if (cpl <= 3) {
    down(down_kernel<3>);
  } else if (cpl <= 4) {
    down(down_kernel<4>);
  } else if (cpl <= 6) {
    down(down_kernel<6>);
  } else {
    down(down_kernel<8>);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

bool moe_decode_topk_supported(MoeDecodeTopkParams const& p) {
  return p.top_k >= 1 && p.top_k <= kMaxTopK && p.num_experts >= p.top_k &&
         p.num_experts <= 32 * kTopkPerLane && p.hidden >= 8 && p.hidden % 8 == 0 &&
         p.hidden <= 8 * 32 * kTopkU && p.inter >= 8 && p.inter % kMoeGateUpInterleave == 0 &&
         p.inter <= 2048 && p.num_local_experts >= 1 && p.num_local_experts <= 256 &&
         p.expert_begin >= 0 && p.x != nullptr && p.logits != nullptr && p.gate_up != nullptr &&
         p.down != nullptr && p.act != nullptr && p.out != nullptr && p.topk_ids != nullptr &&
         p.topk_weights != nullptr && p.expert_offsets != nullptr && aligned16(p.x) &&
         aligned16(p.gate_up) && aligned16(p.down) && aligned16(p.act);
}

void moe_decode_topk_launch(MoeDecodeTopkParams const& p, cudaStream_t stream,
                            MoeTopkGateUp gate_up) {
  TANDEM_CHECK_KIND(kUnsupported, moe_decode_topk_supported(p),
                    "moe_decode_topk: unsupported sizes (hidden ", p.hidden, ", inter ", p.inter,
                    ", experts ", p.num_experts, ", top_k ", p.top_k, ", local experts ",
                    p.num_local_experts, ") or unaligned pointers");
  // Persistent gate_up: at most the CTAs resident at once (and one per 8 items).
  auto* const gu_kernel = gate_up == MoeTopkGateUp::kPrefetch ? gate_up_routed_kernel<true, false>
                          : gate_up == MoeTopkGateUp::kPrefetchL2Down
                              ? gate_up_routed_kernel<true, true>
                              : gate_up_routed_kernel<false, false>;
  int dev = 0, sms = 0, per_sm = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
  TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  TANDEM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gu_kernel, kThreads, 0));
  if (gate_up == MoeTopkGateUp::kOnePerSm) per_sm = std::min(per_sm, 1);
  const int64_t want = (int64_t{p.top_k} * p.inter + kWarps - 1) / kWarps;
  const unsigned gu_blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>(want, int64_t{sms} * std::max(per_sm, 1))));
  TANDEM_CUDA_CHECK(launch_pdl(gu_kernel, dim3(gu_blocks), dim3(kThreads), 0, stream, p));
  const unsigned dn_blocks = static_cast<unsigned>((p.hidden + kWarps - 1) / kWarps);
  const int cpl = (p.inter / 8 + 31) / 32;
  auto down = [&](auto kernel) {
    TANDEM_CUDA_CHECK(launch_pdl(kernel, dim3(dn_blocks), dim3(kThreads), 0, stream, p));
  };
  if (cpl <= 1) {
    down(down_routed_kernel<1>);
  } else if (cpl <= 2) {
    down(down_routed_kernel<2>);
  } else if (cpl <= 3) {
    down(down_routed_kernel<3>);
  } else if (cpl <= 4) {
    down(down_routed_kernel<4>);
  } else if (cpl <= 6) {
    down(down_routed_kernel<6>);
  } else {
    down(down_routed_kernel<8>);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
