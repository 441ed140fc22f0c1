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

}  // namespace tandem::cuda
