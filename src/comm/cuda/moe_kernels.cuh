// Device code of the MoE dispatch / combine kernels (protocol: moe_params.h). Included by moe.cu
// (nvcc) and by the CPU emulation test, which defines TANDEM_AR_HOST_EMULATION and supplies the
// CUDA built-ins first (threads, __syncthreads, atomics, moe_smem(), f32_to_e4m3()).
// Only block-level primitives are used (no warp intrinsics), so the emulation runs them as is.
// Every __syncthreads is reached by every thread of the block (no early return before one).
#pragma once

#ifndef TANDEM_AR_HOST_EMULATION
#include <cuda_fp8.h>
#endif

#include "comm/cuda/all_reduce_kernels.cuh"
#include "comm/cuda/moe_params.h"

// Every kernel here is launched with kMoeThreads = 256 threads (moe.h); __launch_bounds__(256).

namespace tandem::comm::cuda::detail {

#ifndef TANDEM_AR_HOST_EMULATION
__device__ __forceinline__ unsigned char* moe_smem() {
  extern __shared__ __align__(16) unsigned char tandem_moe_smem[];
  return tandem_moe_smem;
}
__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float e4m3_to_f32(uint8_t v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v, __NV_E4M3)));
}
#endif

__device__ __forceinline__ int moe_min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int moe_max(int a, int b) { return a > b ? a : b; }

constexpr int kMoeMaxGroups = 8;

/// Items (tokens, rows) a block works on at once, one per group of blockDim / groups threads
/// (at least min_threads each): more independent memory chains in flight when items outnumber
/// the blocks. Uniform over the block.
__device__ __forceinline__ int moe_groups(int items, int min_threads) {
  int g = 1;
  const int nt = static_cast<int>(blockDim.x);
  while (g < kMoeMaxGroups && g * static_cast<int>(gridDim.x) < items && nt % (2 * g) == 0 &&
         nt / (2 * g) >= min_threads)
    g *= 2;
  return g;
}

// ---- block-level building blocks ---------------------------------------------------------------

/// Exclusive prefix sum of a[0..n) (shared memory) in place; returns the total to every thread.
/// tmp: blockDim.x ints of shared memory. Every thread must call it. On the GPU the per-thread
/// sums are scanned with warp shuffles (three barriers; blockDim a multiple of 32), in the CPU
/// emulation with a Hillis-Steele pass over shared memory.
__device__ inline int block_exclusive_scan(int* a, int n, int* tmp) {
  const int nt = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x);
  const int per = (n + nt - 1) / nt;
  const int lo = moe_min(n, tid * per), hi = moe_min(n, lo + per);
  int s = 0;
  for (int i = lo; i < hi; ++i) s += a[i];
#ifndef TANDEM_AR_HOST_EMULATION
  const int lane = tid & 31, warp = tid >> 5, nwarps = (nt + 31) >> 5;
  int v = s;
  TANDEM_AR_UNROLL for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) tmp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int wv = lane < nwarps ? tmp[lane] : 0;
    TANDEM_AR_UNROLL for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, wv, o);
      if (lane >= o) wv += y;
    }
    if (lane < nwarps) tmp[lane] = wv;
  }
  __syncthreads();
  int run = v - s + (warp > 0 ? tmp[warp - 1] : 0);
  const int total = tmp[nwarps - 1];
#else
  tmp[tid] = s;
  __syncthreads();
  for (int off = 1; off < nt; off <<= 1) {  // Hillis-Steele, inclusive
    const int v = tid >= off ? tmp[tid - off] : 0;
    __syncthreads();
    tmp[tid] += v;
    __syncthreads();
  }
  int run = tmp[tid] - s;
  const int total = tmp[nt - 1];
#endif
  for (int i = lo; i < hi; ++i) {
    const int v = a[i];
    a[i] = run;
    run += v;
  }
  __syncthreads();
  return total;
}

/// Counting sort, in one block, of V items with k keys each: key(v, j) is a class in [0, C) or
/// -1. Calls emit(v, j, c, pos) once per keyed pair, pos = its place in class-major order
/// (classes ascending, items ascending within a class). start[0..C] (shared) receives each
/// class's first position, start[C] the total. area: area_ints ints of shared memory.
/// Items are cut into S contiguous segments (one thread each): count, scan, place.
template <class Key, class Emit>
__device__ void block_counting_sort(int V, int k, int C, Key key, Emit emit, int* area,
                                    int area_ints, int* start) {
  const int nt = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x);
  int S = moe_max(1, (area_ints - nt) / moe_max(C, 1));
  S = moe_min(S, nt);
  S = moe_min(S, moe_max(1, (V + 3) / 4));
  const int per = (V + S - 1) / S;
  int* cnt = area;  // [C][S]
  int* tmp = area + C * S;
  for (int i = tid; i < C * S; i += nt) cnt[i] = 0;
  __syncthreads();
  if (tid < S) {
    const int lo = moe_min(V, tid * per), hi = moe_min(V, lo + per);
    for (int v = lo; v < hi; ++v)
      for (int j = 0; j < k; ++j) {
        const int c = key(v, j);
        if (c >= 0) cnt[c * S + tid] += 1;
      }
  }
  __syncthreads();
  const int total = block_exclusive_scan(cnt, C * S, tmp);
  for (int c = tid; c < C; c += nt) start[c] = cnt[c * S];
  if (tid == 0) start[C] = total;
  __syncthreads();
  if (tid < S) {
    const int lo = moe_min(V, tid * per), hi = moe_min(V, lo + per);
    for (int v = lo; v < hi; ++v)
      for (int j = 0; j < k; ++j) {
        const int c = key(v, j);
        if (c >= 0) emit(v, j, c, cnt[c * S + tid]++);
      }
  }
  __syncthreads();
}

/// acc[8] += w * (8 bf16 of v), one fma each (the same rounding as std::fma on the CPU).
__device__ __forceinline__ void fma_bf16x8(float (&acc)[8], float w, uint4 const& v) {
  float x[8];
  accumulate<__nv_bfloat16, true>(x, v);
  TANDEM_AR_UNROLL for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, x[i], acc[i]);
}

/// Stores 8 fp32 as bf16 (16 bytes) or fp32 (32 bytes) at element chunk c of row `row`.
__device__ __forceinline__ void store_chunk(void* out, size_t row, int hidden, int c, int out_f32,
                                            float const (&acc)[8]) {
  if (out_f32) {
    auto* o =
        reinterpret_cast<uint4*>(static_cast<char*>(out) + (row * hidden + size_t(c) * 8) * 4);
    float a0[4] = {acc[0], acc[1], acc[2], acc[3]};
    float a1[4] = {acc[4], acc[5], acc[6], acc[7]};
    o[0] = pack<float>(a0);
    o[1] = pack<float>(a1);
  } else {
    auto* o =
        reinterpret_cast<uint4*>(static_cast<char*>(out) + (row * hidden + size_t(c) * 8) * 2);
    *o = pack<__nv_bfloat16>(acc);
  }
}

// ---- prefill -----------------------------------------------------------------------------------

/// Tokens of a call (device count, clamped), or max_tokens.
__device__ __forceinline__ int prefill_tokens(int32_t const* count, int max_tokens) {
  return count ? moe_max(0, moe_min(*count, max_tokens)) : max_tokens;
}

/// Block b: counting sort of tile b's pairs by local expert: each pair's rank in its expert
/// within the tile (scratch[t * k + j]) and the tile's count per expert (scratch tail [b][L]).
__global__ void __launch_bounds__(256)
    prefill_count_kernel(__grid_constant__ const PrefillDispatchParams p) {
  const int k = p.top_k, L = p.local_experts, nt = static_cast<int>(blockDim.x);
  const int V = prefill_tokens(p.num_tokens, p.max_tokens);
  const int t0 = static_cast<int>(blockIdx.x) * kMoePrefillTile;
  const int n = moe_max(0, moe_min(V - t0, kMoePrefillTile));
  int* start = reinterpret_cast<int*>(moe_smem());  // [L + 1]
  int* sids = start + moe_align(L + 1, 4);          // [tile * k] local expert or -1
  int* area = sids + moe_align(size_t(kMoePrefillTile) * k, 4);
  const int area_ints = kMoePrefillSmemBytes / 4 - static_cast<int>(area - start);
  const int tile_pairs = moe_min(kMoePrefillTile, p.max_tokens - t0) * k;
  for (int i = threadIdx.x; i < tile_pairs; i += nt) {
    p.slot_row[size_t(t0) * k + i] = -1;  // the gather overwrites the local pairs
    if (i < n * k) {
      const int e = p.topk_ids[size_t(t0) * k + i] - p.expert_begin;
      sids[i] = e >= 0 && e < L ? e : -1;
    }
  }
  __syncthreads();
  int32_t* rank = p.scratch;
  block_counting_sort(
      n, k, L, [&](int v, int j) { return sids[v * k + j]; },
      [&](int v, int j, int c, int pos) { rank[size_t(t0 + v) * k + j] = pos - start[c]; }, area,
      area_ints, start);
  int32_t* tile_cnt = p.scratch + size_t(p.max_tokens) * k + size_t(blockIdx.x) * L;
  for (int e = threadIdx.x; e < L; e += nt) tile_cnt[e] = start[e + 1] - start[e];
}

/// One block: tile counts -> tile bases, expert offsets.
__global__ void __launch_bounds__(256)
    prefill_scan_kernel(__grid_constant__ const PrefillDispatchParams p) {
  const int L = p.local_experts, nt = static_cast<int>(blockDim.x);
  const int tiles = (p.max_tokens + kMoePrefillTile - 1) / kMoePrefillTile;
  int* offs = reinterpret_cast<int*>(moe_smem());             // [L + 1]
  int* tmp = offs + moe_align(L + 1, 4);                      // [blockDim]
  int32_t* cnt = p.scratch + size_t(p.max_tokens) * p.top_k;  // [tiles][L]
  for (int e = threadIdx.x; e < L; e += nt) {
    int run = 0;
    for (int b = 0; b < tiles; ++b) {
      const int c = cnt[size_t(b) * L + e];
      cnt[size_t(b) * L + e] = run;
      run += c;
    }
    offs[e] = run;
  }
  __syncthreads();
  const int total = block_exclusive_scan(offs, L, tmp);
  if (threadIdx.x == 0) offs[L] = total;
  __syncthreads();
  for (int e = threadIdx.x; e <= L; e += nt) p.expert_offsets[e] = offs[e];
  for (int e = threadIdx.x; e < L; e += nt)
    for (int b = 0; b < tiles; ++b) cnt[size_t(b) * L + e] += offs[e];
}

/// Per token (a group of threads each): its local pairs' rows (metadata, slot map), row copies.
__global__ void __launch_bounds__(256)
    prefill_gather_kernel(__grid_constant__ const PrefillDispatchParams p) {
  const int k = p.top_k, L = p.local_experts, chunks = p.hidden / 8;
  const int V = prefill_tokens(p.num_tokens, p.max_tokens);
  const int G = moe_groups(V, moe_max(k, 8)), gs = static_cast<int>(blockDim.x) / G;
  const int g = static_cast<int>(threadIdx.x) / gs, gt = static_cast<int>(threadIdx.x) % gs;
  int* pos = reinterpret_cast<int*>(moe_smem()) + g * kMoeMaxTopK;  // [groups][kMoeMaxTopK]
  int32_t const* rank = p.scratch;
  int32_t const* base = p.scratch + size_t(p.max_tokens) * k;
  auto const* x = static_cast<uint4 const*>(p.x);
  auto* out = static_cast<uint4*>(p.out_x);
  for (int t0 = static_cast<int>(blockIdx.x) * G; t0 < V; t0 += static_cast<int>(gridDim.x) * G) {
    const int t = t0 + g;
    const bool act = t < V;
    if (act && gt < k) {
      const size_t pair = size_t(t) * k + gt;
      const int e = p.topk_ids[pair] - p.expert_begin;
      int r = -1;
      if (e >= 0 && e < L) {
        r = base[size_t(t / kMoePrefillTile) * L + e] + rank[pair];
        p.row_token[r] = t;
        p.row_slot[r] = gt;
        if (p.row_weight) p.row_weight[r] = p.topk_weights[pair];
        p.slot_row[pair] = r;
      }
      pos[gt] = r;
    }
    __syncthreads();
    if (act) {
      for (int c = gt; c < chunks; c += gs) {
        const uint4 v = x[size_t(t) * chunks + c];
        for (int q = 0; q < k; ++q)
          if (pos[q] >= 0) out[size_t(pos[q]) * chunks + c] = v;
      }
    }
    __syncthreads();  // pos is rewritten for the next token
  }
}

/// acc (8 lanes of chunk c) += the n ordered pairs' weighted vectors, loads four at a time.
template <class Src, class Weight>
__device__ __forceinline__ void weighted_sum_chunk(float (&acc)[8], int n, int const* ord, Src src,
                                                   Weight weight) {
  for (int q0 = 0; q0 < n; q0 += 4) {
    uint4 v[4];
    float w[4];
    TANDEM_AR_UNROLL for (int u = 0; u < 4; ++u) {
      if (q0 + u < n) {
        v[u] = src(ord[q0 + u]);
        w[u] = weight(ord[q0 + u]);
      }
    }
    TANDEM_AR_UNROLL for (int u = 0; u < 4; ++u) {
      if (q0 + u < n) fma_bf16x8(acc, w[u], v[u]);
    }
  }
}

/// Per token (a group of threads each): the local pairs' weighted outputs in ascending expert
/// id (fp32); every row of out written (zeros past T).
__global__ void __launch_bounds__(256)
    prefill_combine_kernel(__grid_constant__ const PrefillCombineParams p) {
  const int k = p.top_k, chunks = p.hidden / 8;
  const int T = prefill_tokens(p.num_tokens, p.max_tokens);
  const int G = moe_groups(p.max_tokens, moe_max(k, 8)), gs = static_cast<int>(blockDim.x) / G;
  const int g = static_cast<int>(threadIdx.x) / gs, gt = static_cast<int>(threadIdx.x) % gs;
  int* ord = reinterpret_cast<int*>(moe_smem()) + g * kMoeMaxTopK;  // [groups][kMoeMaxTopK]
  auto const* eo = static_cast<uint4 const*>(p.expert_out);
  for (int t0 = static_cast<int>(blockIdx.x) * G; t0 < p.max_tokens;
       t0 += static_cast<int>(gridDim.x) * G) {
    const int t = t0 + g;
    const bool act = t < p.max_tokens;
    int32_t const* srow = p.slot_row + size_t(t) * k;
    int32_t const* ids = p.topk_ids + size_t(t) * k;
    if (act && t < T && gt < k && srow[gt] >= 0) {
      int q = 0;  // place among the local slots by ascending expert id
      for (int j = 0; j < k; ++j) q += (srow[j] >= 0 && ids[j] < ids[gt]) ? 1 : 0;
      ord[q] = gt;
    }
    __syncthreads();
    if (act) {
      int n = 0;
      if (t < T)
        for (int j = 0; j < k; ++j) n += srow[j] >= 0 ? 1 : 0;
      float const* wt = p.topk_weights + size_t(t) * k;
      for (int c = gt; c < chunks; c += gs) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        weighted_sum_chunk(
            acc, n, ord, [&](int j) { return eo[size_t(srow[j]) * chunks + c]; },
            [&](int j) { return wt[j]; });
        store_chunk(p.out, t, p.hidden, c, p.out_f32, acc);
      }
    }
    __syncthreads();  // ord is rewritten for the next token
  }
}

/// Block b of this rank meets block b of every rank at epoch (all_reduce_kernels.cuh's
/// block_barrier with a run-time rank count).
__device__ inline void moe_ar_barrier(AllReduceParams const& p, uint32_t epoch) {
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < p.world_size) {
    const int t = static_cast<int>(threadIdx.x);
    st_release_sys(&p.signals[t]->flags[blockIdx.x][p.rank], epoch);
    uint32_t const* mine = &p.signals[p.rank]->flags[blockIdx.x][t];
    if (!reached(ld_acquire_sys(mine), epoch)) {
      const uint64_t start = global_timer_ns();
      uint32_t spins = 0, seen;
      while (!reached(seen = ld_acquire_sys(mine), epoch)) {
        if (p.timeout_ns != 0 && (++spins & 1023u) == 0 &&
            global_timer_ns() - start > p.timeout_ns) {
          printf(
              "tandem moe prefill combine: rank %d block %d gave up waiting for rank %d (epoch %u, "
              "flag %u): a peer died or the ranks' calls differ\n",
              p.rank, static_cast<int>(blockIdx.x), t, epoch, seen);
          __trap();
        }
      }
    }
  }
  __syncthreads();
}

/// Prefill combine fused with the registered one-shot all-reduce: block b writes the weighted
/// local sums of its tokens into this rank's registered buffer (c.out = ar.data[rank]), meets
/// block b of every rank, sums the ranks' partials of the same tokens in rank order (fp32) into
/// ar.output, and meets them again (nobody overwrites a buffer a peer still reads). Every rank
/// runs the same grid; all blocks must be resident (they spin on their peers), as in the
/// all-reduce whose per-block epochs (Signal::epoch) this shares.
__global__ void __launch_bounds__(256)
    prefill_combine_all_reduce_kernel(__grid_constant__ const PrefillCombineParams c,
                                      __grid_constant__ const AllReduceParams ar) {
  const int k = c.top_k, chunks = c.hidden / 8, N = ar.world_size;
  const int T = prefill_tokens(c.num_tokens, c.max_tokens);
  const int G = moe_groups(c.max_tokens, moe_max(k, 8)), gs = static_cast<int>(blockDim.x) / G;
  const int g = static_cast<int>(threadIdx.x) / gs, gt = static_cast<int>(threadIdx.x) % gs;
  int* ord = reinterpret_cast<int*>(moe_smem()) + g * kMoeMaxTopK;  // [groups][kMoeMaxTopK]
  Signal* self = ar.signals[ar.rank];
  uint32_t epoch = static_cast<int>(threadIdx.x) < N ? self->epoch[blockIdx.x] : 0;
  auto const* eo = static_cast<uint4 const*>(c.expert_out);
  const int step = static_cast<int>(gridDim.x) * G;
  // 1. this block's tokens: weighted local sums -> own registered buffer
  for (int t0 = static_cast<int>(blockIdx.x) * G; t0 < c.max_tokens; t0 += step) {
    const int t = t0 + g;
    const bool act = t < c.max_tokens;
    int32_t const* srow = c.slot_row + size_t(t) * k;
    int32_t const* ids = c.topk_ids + size_t(t) * k;
    if (act && t < T && gt < k && srow[gt] >= 0) {
      int q = 0;
      for (int j = 0; j < k; ++j) q += (srow[j] >= 0 && ids[j] < ids[gt]) ? 1 : 0;
      ord[q] = gt;
    }
    __syncthreads();
    if (act) {
      int n = 0;
      if (t < T)
        for (int j = 0; j < k; ++j) n += srow[j] >= 0 ? 1 : 0;
      float const* wt = c.topk_weights + size_t(t) * k;
      for (int ch = gt; ch < chunks; ch += gs) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        weighted_sum_chunk(
            acc, n, ord, [&](int j) { return eo[size_t(srow[j]) * chunks + ch]; },
            [&](int j) { return wt[j]; });
        store_chunk(ar.data[ar.rank], t, c.hidden, ch, c.out_f32, acc);
      }
    }
    __syncthreads();
  }
  // 2. every rank's partials of these tokens are there
  moe_ar_barrier(ar, ++epoch);
  // 3. sum them in rank order (fp32, rounded once), the same tokens again
  const size_t esz = c.out_f32 ? 4 : 2;
  const int vec = c.out_f32 ? 4 : 8;  // elements per 16 bytes
  const int vchunks = c.hidden / vec;
  for (int t0 = static_cast<int>(blockIdx.x) * G; t0 < c.max_tokens; t0 += step) {
    const int t = t0 + g;
    if (t < c.max_tokens) {
      for (int ch = gt; ch < vchunks; ch += gs) {
        const size_t off = (size_t(t) * c.hidden + size_t(ch) * vec) * esz;
        if (c.out_f32) {
          float acc[4];
          accumulate<float, true>(
              acc, *reinterpret_cast<uint4 const*>(static_cast<char const*>(ar.data[0]) + off));
          for (int q = 1; q < N; ++q)
            accumulate<float, false>(
                acc, *reinterpret_cast<uint4 const*>(static_cast<char const*>(ar.data[q]) + off));
          *reinterpret_cast<uint4*>(static_cast<char*>(ar.output) + off) = pack<float>(acc);
        } else {
          float acc[8];
          accumulate<__nv_bfloat16, true>(
              acc, *reinterpret_cast<uint4 const*>(static_cast<char const*>(ar.data[0]) + off));
          for (int q = 1; q < N; ++q)
            accumulate<__nv_bfloat16, false>(
                acc, *reinterpret_cast<uint4 const*>(static_cast<char const*>(ar.data[q]) + off));
          *reinterpret_cast<uint4*>(static_cast<char*>(ar.output) + off) = pack<__nv_bfloat16>(acc);
        }
      }
    }
  }
  // 4. no peer reads this rank's buffer any more when the next producer writes it
  moe_ar_barrier(ar, ++epoch);
  if (threadIdx.x == 0) self->epoch[blockIdx.x] = epoch;
}

// ---- decode ------------------------------------------------------------------------------------

__device__ __forceinline__ MoeSignal* moe_signal(MoeDecodeParams const& p, int r) {
  return reinterpret_cast<MoeSignal*>(p.peer[r] + p.layout.signal);
}

/// Waits until flags[b][src] >= epoch for every sender block b and source rank src.
__device__ inline void moe_wait_all(MoeDecodeParams const& p, bool combine, uint32_t epoch) {
  MoeSignal* self = moe_signal(p, p.rank);
  const int n = p.send_blocks * p.world_size;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int b = i / p.world_size, src = i % p.world_size;
    uint32_t const* f = combine ? &self->combine[b][src] : &self->dispatch[b][src];
    if (!reached(ld_acquire_sys(f), epoch)) {
      const uint64_t t0 = global_timer_ns();
      uint32_t spins = 0, seen;
      while (!reached(seen = ld_acquire_sys(f), epoch)) {
        if (p.timeout_ns != 0 && (++spins & 1023u) == 0 && global_timer_ns() - t0 > p.timeout_ns) {
          printf(
              "tandem moe %s: rank %d block %d gave up waiting for rank %d block %d (epoch %u, "
              "flag %u): a peer died or the ranks' calls differ\n",
              combine ? "combine" : "dispatch", p.rank, static_cast<int>(blockIdx.x), src, b, epoch,
              seen);
          __trap();
        }
      }
    }
  }
  __syncthreads();
}

/// Publishes this block's epoch to every rank (after all of the block's writes).
__device__ inline void moe_release_all(MoeDecodeParams const& p, bool combine, uint32_t epoch) {
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < p.world_size) {
    MoeSignal* peer = moe_signal(p, static_cast<int>(threadIdx.x));
    st_release_sys(
        combine ? &peer->combine[blockIdx.x][p.rank] : &peer->dispatch[blockIdx.x][p.rank], epoch);
  }
}

/// The last block to finish advances the call counter of this kernel kind.
__device__ inline void moe_finish(MoeSignal* self, int kind, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t done = atomicAdd(&self->done[kind], 1u);
    if (done == gridDim.x - 1) {
      self->done[kind] = 0;
      self->calls[kind] = epoch;
    }
  }
}

/// Bit d set when token t has an expert on rank d.
__device__ __forceinline__ uint32_t moe_dest_mask(MoeDecodeParams const& p, int t) {
  uint32_t m = 0;
  for (int j = 0; j < p.top_k; ++j)
    m |= 1u << (p.topk_ids[size_t(t) * p.top_k + j] / p.local_experts);
  return m;
}

/// dispatch_send: block 0 routes and pushes counts + routing rows, the others push payload rows.
__global__ void __launch_bounds__(256)
    moe_dispatch_send_kernel(__grid_constant__ const MoeDecodeParams p) {
  MoeSignal* self = moe_signal(p, p.rank);
  const uint32_t calls = self->calls[kMoeDispatchSend];
  const uint32_t epoch = calls + 1, par = calls & 1u;
  const int k = p.top_k, N = p.world_size, L = p.local_experts, E = p.num_experts;
  const int T = moe_max(0, moe_min(*p.num_tokens, p.max_tokens));
  const size_t row_bytes = moe_row_bytes(p.payload, p.hidden);
  const size_t meta_bytes = moe_meta_bytes(k);

  if (blockIdx.x == 0) {
    const int nt = static_cast<int>(blockDim.x), budget = kMoeSendSmemBytes / 4;
    int* estart = reinterpret_cast<int*>(moe_smem());  // [E + 1]
    int* cur = estart + moe_align(E + 1, 4);
    const size_t tk = moe_align(size_t(T) * k, 4);
    // Stage the routing in shared memory when it fits (else read it from global memory).
    const bool staged =
        moe_align(E + 1, 4) + 3 * tk + moe_align(T, 4) + 4 * size_t(E) + nt <= size_t(budget);
    int32_t const* ids = p.topk_ids;
    float const* wts = p.topk_weights;
    int32_t* rk = p.rank_scratch;
    uint32_t* smask = nullptr;
    if (staged) {
      int32_t* sids = cur;
      float* sw = reinterpret_cast<float*>(cur + tk);
      rk = cur + 2 * tk;
      smask = reinterpret_cast<uint32_t*>(cur + 3 * tk);
      cur += 3 * tk + moe_align(T, 4);
      for (int i = threadIdx.x; i < T * k; i += nt) {
        sids[i] = p.topk_ids[i];
        sw[i] = p.topk_weights[i];
      }
      __syncthreads();
      for (int t = threadIdx.x; t < T; t += nt) {
        uint32_t m = 0;
        for (int j = 0; j < k; ++j) m |= 1u << (sids[t * k + j] / L);
        smask[t] = m;
      }
      ids = sids;
      wts = sw;
    }
    const int area_ints = budget - static_cast<int>(cur - estart);
    // 1. rank of every pair within its expert (over this rank's tokens, in token order) and the
    //    experts' first positions (estart). Small T: one bitmap of tokens per expert, ranks by
    //    population count (parallel, three barriers); else a counting sort by segments.
    const int TW = (T + 31) / 32;
    if (staged && size_t(E) * TW + nt <= size_t(area_ints)) {
      auto* bits = reinterpret_cast<uint32_t*>(cur);  // [E][TW]
      int* tmp = cur + size_t(E) * TW;                // [blockDim]
      for (int i = threadIdx.x; i < E * TW; i += nt) bits[i] = 0;
      __syncthreads();
      for (int i = threadIdx.x; i < T * k; i += nt) {
        const int v = i / k;
        atomicOr(&bits[size_t(ids[i]) * TW + v / 32], 1u << (v % 32));
      }
      __syncthreads();
      for (int i = threadIdx.x; i < T * k; i += nt) {
        const int v = i / k;
        uint32_t const* row = bits + size_t(ids[i]) * TW;
        int r = __popc(row[v / 32] & ((1u << (v % 32)) - 1u));
        for (int w = 0; w < v / 32; ++w) r += __popc(row[w]);
        rk[i] = r;
      }
      for (int e = threadIdx.x; e < E; e += nt) {
        int c = 0;
        for (int w = 0; w < TW; ++w) c += __popc(bits[size_t(e) * TW + w]);
        estart[e] = c;
      }
      __syncthreads();
      const int total = block_exclusive_scan(estart, E, tmp);
      if (threadIdx.x == 0) estart[E] = total;
      __syncthreads();
    } else {
      block_counting_sort(
          T, k, E, [&](int v, int j) { return static_cast<int>(ids[size_t(v) * k + j]); },
          [&](int v, int j, int c, int pos) { rk[size_t(v) * k + j] = pos - estart[c]; }, cur,
          area_ints, estart);
    }
    // 2. routing rows (16-byte stores), at the token's index, to the ranks that own one of its
    //    experts: token, epoch stamp, k ids, k weights, k ranks, zero padding
    const int W = 2 + 3 * k, Q = static_cast<int>(meta_bytes / 16);
    const size_t moff = p.layout.meta + par * p.layout.meta_parity;
    auto word = [&](int v, int wd) -> uint32_t {
      if (wd == 0) return static_cast<uint32_t>(v);
      if (wd == 1) return epoch;
      if (wd < 2 + k) return static_cast<uint32_t>(ids[size_t(v) * k + wd - 2]);
      if (wd < 2 + 2 * k) return __float_as_uint(wts[size_t(v) * k + wd - 2 - k]);
      if (wd < W) return static_cast<uint32_t>(rk[size_t(v) * k + wd - 2 - 2 * k]);
      return 0u;
    };
    for (int i = threadIdx.x; i < T * Q; i += nt) {
      const int v = i / Q, q = i % Q;
      uint32_t mask = 0;
      if (smask) {
        mask = smask[v];
      } else {
        for (int j = 0; j < k; ++j) mask |= 1u << (ids[size_t(v) * k + j] / L);
      }
      const uint4 val =
          make_uint4(word(v, 4 * q), word(v, 4 * q + 1), word(v, 4 * q + 2), word(v, 4 * q + 3));
      for (int d = 0; d < N; ++d)
        if (mask >> d & 1u)
          reinterpret_cast<uint4*>(p.peer[d] + moff +
                                   (size_t(p.rank) * p.max_tokens + v) * meta_bytes)[q] = val;
    }
    // 3. per destination: its local experts' counts and this rank's token count
    for (int i = threadIdx.x; i < N * (L + 1); i += nt) {
      const int d = i / (L + 1), e = i % (L + 1);
      auto* cnt =
          reinterpret_cast<int32_t*>(p.peer[d] + p.layout.counts + par * p.layout.counts_parity) +
          size_t(p.rank) * (L + 1);
      cnt[e] = e < L ? estart[d * L + e + 1] - estart[d * L + e] : T;
    }
  }
  if (blockIdx.x != 0 || gridDim.x == 1) {
    const int workers = gridDim.x == 1 ? 1 : static_cast<int>(gridDim.x) - 1;
    const int wid = gridDim.x == 1 ? 0 : static_cast<int>(blockIdx.x) - 1;
    const size_t xoff = p.layout.xbuf + par * p.layout.xbuf_parity;
    for (int t = wid; t < T; t += workers) {
      const uint32_t mask = moe_dest_mask(p, t);
      const size_t dst_off = xoff + (size_t(p.rank) * p.max_tokens + t) * row_bytes;
      if (p.payload == MoePayload::kBF16) {
        auto const* src = reinterpret_cast<uint4 const*>(static_cast<char const*>(p.x) +
                                                         size_t(t) * p.hidden * 2);
        for (int c = threadIdx.x; c < p.hidden / 8; c += blockDim.x) {
          const uint4 v = src[c];
          for (int d = 0; d < N; ++d)
            if (mask >> d & 1u) reinterpret_cast<uint4*>(p.peer[d] + dst_off)[c] = v;
        }
      } else {
        // fp8: one 128-element group per thread: amax, scale = amax / 448, q = e4m3(x * 448 / amax)
        auto const* src = reinterpret_cast<uint4 const*>(static_cast<char const*>(p.x) +
                                                         size_t(t) * p.hidden * 2);
        for (int g = threadIdx.x; g < p.hidden / kMoeFp8Group; g += blockDim.x) {
          float amax = 0.f;
          for (int c = 0; c < kMoeFp8Group / 8; ++c) {
            float x[8];
            accumulate<__nv_bfloat16, true>(x, src[g * (kMoeFp8Group / 8) + c]);
            for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(x[i]));
          }
          const float scale = amax / 448.f;
          const float inv = amax > 0.f ? 448.f / amax : 0.f;
          for (int c = 0; c < kMoeFp8Group / 16; ++c) {  // 16 elements -> one 16-byte store
            float x0[8], x1[8];
            accumulate<__nv_bfloat16, true>(x0, src[g * (kMoeFp8Group / 8) + 2 * c]);
            accumulate<__nv_bfloat16, true>(x1, src[g * (kMoeFp8Group / 8) + 2 * c + 1]);
            uint32_t w[4] = {0, 0, 0, 0};
            for (int i = 0; i < 8; ++i) {
              w[i / 4] |= uint32_t(f32_to_e4m3(x0[i] * inv)) << (8 * (i % 4));
              w[2 + i / 4] |= uint32_t(f32_to_e4m3(x1[i] * inv)) << (8 * (i % 4));
            }
            const uint4 q = make_uint4(w[0], w[1], w[2], w[3]);
            for (int d = 0; d < N; ++d)
              if (mask >> d & 1u)
                reinterpret_cast<uint4*>(p.peer[d] + dst_off + size_t(g) * kMoeFp8Group)[c] = q;
          }
          for (int d = 0; d < N; ++d)
            if (mask >> d & 1u) reinterpret_cast<float*>(p.peer[d] + dst_off + p.hidden)[g] = scale;
        }
      }
    }
  }
  moe_release_all(p, false, epoch);
  moe_finish(self, kMoeDispatchSend, epoch);
}

/// dispatch_recv: waits for every source, then packs the received rows per local expert.
__global__ void __launch_bounds__(256)
    moe_dispatch_recv_kernel(__grid_constant__ const MoeDecodeParams p) {
  MoeSignal* self = moe_signal(p, p.rank);
  const uint32_t calls = self->calls[kMoeDispatchRecv];
  const uint32_t epoch = calls + 1, par = calls & 1u;
  const int k = p.top_k, N = p.world_size, L = p.local_experts;
  const size_t row_bytes = moe_row_bytes(p.payload, p.hidden);
  const size_t meta_bytes = moe_meta_bytes(k);
  const int e_begin = p.rank * L;

  int* base = reinterpret_cast<int*>(moe_smem());  // [N][L + 1]: counts, then first row of (s, e)
  int* offs = base + moe_align(N * (L + 1), 4);    // [L + 1]
  int* istart = offs + moe_align(L + 1, 4);        // [N + 1] first item of each source
  int* pos = istart + moe_align(N + 1, 4);         // [groups][kMoeMaxTopK] packed row of each slot
  int* tmp = pos + kMoeMaxGroups * kMoeMaxTopK;    // [blockDim]

  moe_wait_all(p, false, epoch);

  auto const* counts = reinterpret_cast<int32_t const*>(p.peer[p.rank] + p.layout.counts +
                                                        par * p.layout.counts_parity);
  for (int i = threadIdx.x; i < N * (L + 1); i += blockDim.x) base[i] = counts[i];
  __syncthreads();
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int s = 0;
    for (int q = 0; q < N; ++q) s += base[q * (L + 1) + e];
    offs[e] = s;
  }
  if (threadIdx.x == 0) {
    int s = 0;
    for (int q = 0; q < N; ++q) {
      istart[q] = s;
      s += base[q * (L + 1) + L];
    }
    istart[N] = s;
  }
  __syncthreads();
  const int rows = block_exclusive_scan(offs, L, tmp);
  if (threadIdx.x == 0) offs[L] = rows;
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int run = offs[e];
    for (int q = 0; q < N; ++q) {
      const int c = base[q * (L + 1) + e];
      base[q * (L + 1) + e] = run;
      run += c;
    }
  }
  __syncthreads();
  if (blockIdx.x == 0)
    for (int e = threadIdx.x; e <= L; e += blockDim.x) p.expert_offsets[e] = offs[e];

  const int items = istart[N];
  const int chunks = static_cast<int>(row_bytes / 16);
  const int G = moe_groups(items, moe_max(k, 8)), gs = static_cast<int>(blockDim.x) / G;
  const int g = static_cast<int>(threadIdx.x) / gs, gt = static_cast<int>(threadIdx.x) % gs;
  int* gpos = pos + g * kMoeMaxTopK;
  for (int it0 = static_cast<int>(blockIdx.x) * G; it0 < items;
       it0 += static_cast<int>(gridDim.x) * G) {
    const int it = it0 + g;
    int s = 0, t = 0;
    bool act = false;
    int32_t const* m = nullptr;
    if (it < items) {
      while (s + 1 < N && istart[s + 1] <= it) ++s;
      t = it - istart[s];
      m = reinterpret_cast<int32_t const*>(p.peer[p.rank] + p.layout.meta +
                                           par * p.layout.meta_parity +
                                           (size_t(s) * p.max_tokens + t) * meta_bytes);
      act = static_cast<uint32_t>(m[1]) == epoch;  // else not sent here this call
    }
    if (act && gt < k) {
      const int e = m[2 + gt] - e_begin;
      int r = -1;
      if (e >= 0 && e < L) {
        r = base[s * (L + 1) + e] + m[2 + 2 * k + gt];
        p.row_src[r] = s;
        p.row_token[r] = t;
        p.row_slot[r] = gt;
        p.row_expert[r] = m[2 + gt];
        p.row_weight[r] = __uint_as_float(static_cast<uint32_t>(m[2 + k + gt]));
      }
      gpos[gt] = r;
    }
    __syncthreads();
    if (act) {
      auto const* src = reinterpret_cast<uint4 const*>(p.peer[p.rank] + p.layout.xbuf +
                                                       par * p.layout.xbuf_parity +
                                                       (size_t(s) * p.max_tokens + t) * row_bytes);
      for (int c = gt; c < chunks; c += gs) {
        const uint4 v = src[c];
        for (int q = 0; q < k; ++q)
          if (gpos[q] >= 0)
            reinterpret_cast<uint4*>(static_cast<char*>(p.out_x) + size_t(gpos[q]) * row_bytes)[c] =
                v;
      }
    }
    __syncthreads();  // gpos is rewritten for the next round
  }
  moe_finish(self, kMoeDispatchRecv, epoch);
}

/// combine_send: every packed row's expert output to its home rank at (token, slot).
__global__ void __launch_bounds__(256)
    moe_combine_send_kernel(__grid_constant__ const MoeDecodeParams p) {
  MoeSignal* self = moe_signal(p, p.rank);
  const uint32_t calls = self->calls[kMoeCombineSend];
  const uint32_t epoch = calls + 1, par = calls & 1u;
  const int rows = p.expert_offsets[p.local_experts];
  const int chunks = p.hidden / 8;
  const size_t total = size_t(rows) * chunks;
  auto const* eo = static_cast<uint4 const*>(p.expert_out);
  const size_t coff = p.layout.cbuf + par * p.layout.cbuf_parity;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / chunks, c = i % chunks;
    const int s = p.row_src[r];
    const size_t dst_row = size_t(p.row_token[r]) * p.top_k + p.row_slot[r];
    reinterpret_cast<uint4*>(p.peer[s] + coff)[dst_row * chunks + c] = eo[r * chunks + c];
  }
  moe_release_all(p, true, epoch);
  moe_finish(self, kMoeCombineSend, epoch);
}

/// combine_recv: waits for every expert rank, then the weighted sum per token, ascending expert.
__global__ void __launch_bounds__(256)
    moe_combine_recv_kernel(__grid_constant__ const MoeDecodeParams p) {
  MoeSignal* self = moe_signal(p, p.rank);
  const uint32_t calls = self->calls[kMoeCombineRecv];
  const uint32_t epoch = calls + 1, par = calls & 1u;
  const int k = p.top_k, chunks = p.hidden / 8;
  const int T = moe_max(0, moe_min(*p.num_tokens, p.max_tokens));
  const int G = moe_groups(T, moe_max(k, 8)), gs = static_cast<int>(blockDim.x) / G;
  const int g = static_cast<int>(threadIdx.x) / gs, gt = static_cast<int>(threadIdx.x) % gs;
  int* ord = reinterpret_cast<int*>(moe_smem()) + g * kMoeMaxTopK;  // [groups][kMoeMaxTopK]
  moe_wait_all(p, true, epoch);
  auto const* cb =
      reinterpret_cast<uint4 const*>(p.peer[p.rank] + p.layout.cbuf + par * p.layout.cbuf_parity);
  for (int t0 = static_cast<int>(blockIdx.x) * G; t0 < T; t0 += static_cast<int>(gridDim.x) * G) {
    const int t = t0 + g;
    const bool act = t < T;
    int32_t const* ids = p.topk_ids + size_t(t) * k;
    if (act && gt < k) {
      int q = 0;  // place by ascending expert id
      for (int j = 0; j < k; ++j) q += ids[j] < ids[gt] ? 1 : 0;
      ord[q] = gt;
    }
    __syncthreads();
    if (act) {
      float const* wt = p.topk_weights + size_t(t) * k;
      for (int c = gt; c < chunks; c += gs) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        weighted_sum_chunk(
            acc, k, ord, [&](int j) { return cb[(size_t(t) * k + j) * chunks + c]; },
            [&](int j) { return wt[j]; });
        store_chunk(p.out, t, p.hidden, c, p.out_f32, acc);
      }
    }
    __syncthreads();  // ord is rewritten for the next round
  }
  moe_finish(self, kMoeCombineRecv, epoch);
}

// ---- test helper -------------------------------------------------------------------------------

/// A stand-in expert for tests and benchmarks: out[r][i] = bf16(dequant(x[r][i]) * f(e)) with
/// f(e) = 1 + (e % 7) / 4, e = row_expert[r] (exact in fp32, so a CPU can reproduce it).
struct FakeExpertParams {
  void const* x;                  // [rows, row_bytes] dispatch output
  int32_t const* expert_offsets;  // [L + 1]
  int32_t const* row_expert;      // [rows]
  void* out;                      // bf16 [rows, H]
  int local_experts;
  int hidden;
  MoePayload payload;
};

__device__ __forceinline__ float fake_expert_factor(int e) { return 1.f + float(e % 7) * 0.25f; }

__global__ void __launch_bounds__(256)
    fake_expert_kernel(__grid_constant__ const FakeExpertParams p) {
  const int rows = p.expert_offsets[p.local_experts];
  const size_t row_bytes = moe_row_bytes(p.payload, p.hidden);
  const int chunks = p.hidden / 8;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size_t(rows) * chunks;
       i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / chunks;
    const int c = static_cast<int>(i % chunks);
    const float f = fake_expert_factor(p.row_expert[r]);
    char const* row = static_cast<char const*>(p.x) + r * row_bytes;
    float v[8];
    if (p.payload == MoePayload::kBF16) {
      accumulate<__nv_bfloat16, true>(v, reinterpret_cast<uint4 const*>(row)[c]);
    } else {
      const float scale = reinterpret_cast<float const*>(row + p.hidden)[c * 8 / kMoeFp8Group];
      for (int q = 0; q < 8; ++q) v[q] = e4m3_to_f32(static_cast<uint8_t>(row[c * 8 + q])) * scale;
    }
    for (int q = 0; q < 8; ++q) v[q] *= f;
    reinterpret_cast<uint4*>(static_cast<char*>(p.out) + r * p.hidden * 2)[c] =
        pack<__nv_bfloat16>(v);
  }
}

}  // namespace tandem::comm::cuda::detail
