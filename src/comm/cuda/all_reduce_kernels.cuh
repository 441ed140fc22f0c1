// Device code of the one-shot and two-shot all-reduce (protocol: all_reduce_params.h).
// Included by all_reduce.cu (nvcc) and by the CPU emulation test, which defines
// TANDEM_AR_HOST_EMULATION and supplies the CUDA built-ins (threads, barriers, atomics) first.
#pragma once

#ifndef TANDEM_AR_HOST_EMULATION
#include <cuda_bf16.h>

#include <cstdio>
#include <cstring>
#endif

#include "comm/cuda/all_reduce_params.h"

#ifdef TANDEM_AR_HOST_EMULATION
#define TANDEM_AR_UNROLL
#else
#define TANDEM_AR_UNROLL _Pragma("unroll")
#endif

namespace tandem::comm::cuda::detail {

#ifndef TANDEM_AR_HOST_EMULATION
__device__ __forceinline__ void st_release_sys(uint32_t* addr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(uint32_t const* addr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif  // TANDEM_AR_HOST_EMULATION

// flag >= epoch, robust to the 32-bit counter wrapping.
__device__ __forceinline__ bool reached(uint32_t flag, uint32_t epoch) {
  return static_cast<int32_t>(flag - epoch) >= 0;
}

/// Block b of this rank meets block b of every rank at epoch. Everything the block wrote
/// before is visible to the peers after it; everything they wrote before is visible here.
template <int N>
__device__ __forceinline__ void block_barrier(AllReduceParams const& p, uint32_t epoch) {
  __syncthreads();  // the block's prior writes happen before thread t's release below
  if (threadIdx.x < N) {
    const int t = static_cast<int>(threadIdx.x);
    st_release_sys(&p.signals[t]->flags[blockIdx.x][p.rank], epoch);
    uint32_t const* mine = &p.signals[p.rank]->flags[blockIdx.x][t];
    if (!reached(ld_acquire_sys(mine), epoch)) {
      const uint64_t start = global_timer_ns();
      uint32_t spins = 0;
      uint32_t seen;
      while (!reached(seen = ld_acquire_sys(mine), epoch)) {
        if (p.timeout_ns != 0 && (++spins & 1023u) == 0 &&
            global_timer_ns() - start > p.timeout_ns) {
          printf(
              "tandem all-reduce: rank %d block %d gave up waiting for rank %d "
              "(epoch %u, flag %u): a peer died or the ranks' calls differ\n",
              p.rank, static_cast<int>(blockIdx.x), t, epoch, seen);
          __trap();
        }
      }
    }
  }
  __syncthreads();  // thread t's acquire happens before the block's later reads
}

// ---- 16-byte vectors ----------------------------------------------------------------------

template <typename T>
struct VecTraits;
template <>
struct VecTraits<float> {
  static constexpr int kElems = 4;
};
template <>
struct VecTraits<__nv_bfloat16> {
  static constexpr int kElems = 8;
};

__device__ __forceinline__ uint32_t word(uint4 const& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

/// acc (+)= the vector's elements as fp32.
template <typename T, bool kFirst>
__device__ __forceinline__ void accumulate(float (&acc)[VecTraits<T>::kElems], uint4 const& v) {
  TANDEM_AR_UNROLL for (int w = 0; w < 4; ++w) {
    const uint32_t u = word(v, w);
    if constexpr (sizeof(T) == 4) {
      const float x = __uint_as_float(u);
      acc[w] = kFirst ? x : acc[w] + x;
    } else {
      const float lo = __uint_as_float(u << 16);
      const float hi = __uint_as_float(u & 0xffff0000u);
      acc[2 * w] = kFirst ? lo : acc[2 * w] + lo;
      acc[2 * w + 1] = kFirst ? hi : acc[2 * w + 1] + hi;
    }
  }
}

template <typename T>
__device__ __forceinline__ uint4 pack(float const (&acc)[VecTraits<T>::kElems]) {
  uint32_t w[4];
  TANDEM_AR_UNROLL for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4) {
      w[i] = __float_as_uint(acc[i]);
    } else {
      __nv_bfloat162 h = __float22bfloat162_rn(make_float2(acc[2 * i], acc[2 * i + 1]));
      memcpy(&w[i], &h, sizeof(uint32_t));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// Sum of the N ranks' vectors, in rank order (the same on every rank).
template <typename T, int N>
__device__ __forceinline__ uint4 reduce(uint4 const (&in)[N]) {
  float acc[VecTraits<T>::kElems];
  accumulate<T, true>(acc, in[0]);
  TANDEM_AR_UNROLL for (int i = 1; i < N; ++i) { accumulate<T, false>(acc, in[i]); }
  return pack<T>(acc);
}

/// Vector v of the input; the tail vector is padded with zeros.
template <typename T>
__device__ __forceinline__ uint4 load_input(void const* input, size_t v, size_t count) {
  constexpr int kE = VecTraits<T>::kElems;
  const size_t first = v * kE;
  if (first + kE <= count) return reinterpret_cast<uint4 const*>(input)[v];
  uint32_t w[4] = {0, 0, 0, 0};
  if constexpr (sizeof(T) == 4) {
    auto const* src = reinterpret_cast<uint32_t const*>(input);
    TANDEM_AR_UNROLL for (int i = 0; i < 4; ++i) {
      if (first + i < count) w[i] = src[first + i];
    }
  } else {
    auto const* src = reinterpret_cast<uint16_t const*>(input);
    TANDEM_AR_UNROLL for (int i = 0; i < 8; ++i) {
      if (first + i < count) w[i / 2] |= uint32_t(src[first + i]) << (16 * (i % 2));
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// Stores vector v of the output; the tail vector stores only its valid elements.
template <typename T>
__device__ __forceinline__ void store_output(void* output, size_t v, size_t count, uint4 val) {
  constexpr int kE = VecTraits<T>::kElems;
  const size_t first = v * kE;
  if (first + kE <= count) {
    reinterpret_cast<uint4*>(output)[v] = val;
    return;
  }
  if constexpr (sizeof(T) == 4) {
    auto* dst = reinterpret_cast<uint32_t*>(output);
    TANDEM_AR_UNROLL for (int i = 0; i < 4; ++i) {
      if (first + i < count) dst[first + i] = word(val, i);
    }
  } else {
    auto* dst = reinterpret_cast<uint16_t*>(output);
    TANDEM_AR_UNROLL for (int i = 0; i < 8; ++i) {
      if (first + i < count) {
        dst[first + i] = static_cast<uint16_t>(word(val, i / 2) >> (16 * (i % 2)));
      }
    }
  }
}

// ---- per-block bookkeeping ------------------------------------------------------------------

/// Saves the block's epoch; in copy mode the last block to finish advances the call counter
/// (every block read it at its start, before any block can get here).
template <bool kRegistered>
__device__ __forceinline__ void finish_block(Signal* self, uint32_t epoch, uint32_t call) {
  if (threadIdx.x != 0) return;
  self->epoch[blockIdx.x] = epoch;
  if constexpr (!kRegistered) {
    const uint32_t done = atomicAdd(&self->blocks_done, 1u);
    if (done == gridDim.x - 1) {
      self->blocks_done = 0;
      self->call_count = call + 1;
    }
  }
}

// Loads in flight per thread per loop trip: more for few ranks, fewer registers for many.
template <int N>
constexpr int kUnroll = N <= 4 ? 2 : 1;

// ---- kernels --------------------------------------------------------------------------------

// One-shot: every rank reads the whole message from every rank and reduces it.
template <typename T, int N, bool kRegistered>
__global__ void __launch_bounds__(kMaxThreads)
    one_shot_kernel(__grid_constant__ const AllReduceParams p) {
  constexpr int kE = VecTraits<T>::kElems;
  constexpr int kU = kUnroll<N>;
  Signal* self = p.signals[p.rank];
  const size_t nvec = (p.count + kE - 1) / kE;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;

  uint32_t epoch = threadIdx.x < N ? self->epoch[blockIdx.x] : 0;
  uint32_t call = 0;
  size_t off = 0;
  if constexpr (!kRegistered) {
    // 1. copy this block's part of the input into this call's staging buffer
    call = self->call_count;
    off = (call & 1u) * p.parity_stride;
    auto* g_own = reinterpret_cast<uint4*>(static_cast<char*>(p.data[p.rank]) + off);
    for (size_t v = tid; v < nvec; v += stride) g_own[v] = load_input<T>(p.input, v, p.count);
  }
  // 2. wait until every rank's copy of this block's part is there
  block_barrier<N>(p, ++epoch);

  // 3. read the part from every rank, reduce, store
  uint4 const* g_src[N];
  TANDEM_AR_UNROLL for (int i = 0; i < N; ++i) {
    g_src[i] = reinterpret_cast<uint4 const*>(static_cast<char const*>(p.data[i]) + off);
  }
  for (size_t v0 = tid; v0 < nvec; v0 += stride * kU) {
    uint4 r_in[kU][N];
    TANDEM_AR_UNROLL for (int u = 0; u < kU; ++u) {
      const size_t v = v0 + u * stride;
      if (v < nvec) {
        TANDEM_AR_UNROLL for (int i = 0; i < N; ++i) { r_in[u][i] = g_src[i][v]; }
      }
    }
    TANDEM_AR_UNROLL for (int u = 0; u < kU; ++u) {
      const size_t v = v0 + u * stride;
      if (v < nvec) store_output<T>(p.output, v, p.count, reduce<T, N>(r_in[u]));
    }
  }

  // 4. registered input: no peer may still read it when the producer writes the next one
  if constexpr (kRegistered) block_barrier<N>(p, ++epoch);
  finish_block<kRegistered>(self, epoch, call);
}

// Two-shot: the message is cut into N segments; rank r reduces segment r (reduce-scatter),
// then every rank reads the other ranks' reduced segments (all-gather).
template <typename T, int N, bool kRegistered>
__global__ void __launch_bounds__(kMaxThreads)
    two_shot_kernel(__grid_constant__ const AllReduceParams p) {
  constexpr int kE = VecTraits<T>::kElems;
  Signal* self = p.signals[p.rank];
  const size_t nvec = (p.count + kE - 1) / kE;
  const size_t seg = (nvec + N - 1) / N;  // vectors per segment (the last may be short)
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;

  uint32_t epoch = threadIdx.x < N ? self->epoch[blockIdx.x] : 0;
  uint32_t call = 0;
  size_t off = 0;
  if constexpr (!kRegistered) {
    call = self->call_count;
    off = (call & 1u) * p.parity_stride;
  }
  auto* g_own = reinterpret_cast<uint4*>(static_cast<char*>(p.data[p.rank]) + off);
  if constexpr (!kRegistered) {
    // 1. copy this block's part of every segment into staging
    for (size_t j = tid; j < seg; j += stride) {
      TANDEM_AR_UNROLL for (int s = 0; s < N; ++s) {
        const size_t v = s * seg + j;
        if (v < nvec) g_own[v] = load_input<T>(p.input, v, p.count);
      }
    }
  }
  block_barrier<N>(p, ++epoch);

  // 2. reduce-scatter: this block's part of segment `rank`, from every rank
  uint4 const* g_src[N];
  TANDEM_AR_UNROLL for (int i = 0; i < N; ++i) {
    g_src[i] = reinterpret_cast<uint4 const*>(static_cast<char const*>(p.data[i]) + off);
  }
  for (size_t j = tid; j < seg; j += stride) {
    const size_t v = size_t(p.rank) * seg + j;
    if (v >= nvec) break;
    uint4 r_in[N];
    TANDEM_AR_UNROLL for (int i = 0; i < N; ++i) { r_in[i] = g_src[i][v]; }
    const uint4 red = reduce<T, N>(r_in);
    g_own[v] = red;  // peers read it in step 3
    store_output<T>(p.output, v, p.count, red);
  }
  block_barrier<N>(p, ++epoch);

  // 3. all-gather: this block's part of every other segment, from its owner
  for (size_t j = tid; j < seg; j += stride) {
    uint4 r_in[N];
    TANDEM_AR_UNROLL for (int s = 0; s < N; ++s) {
      const size_t v = s * seg + j;
      if (s != p.rank && v < nvec) r_in[s] = g_src[s][v];
    }
    TANDEM_AR_UNROLL for (int s = 0; s < N; ++s) {
      const size_t v = s * seg + j;
      if (s != p.rank && v < nvec) store_output<T>(p.output, v, p.count, r_in[s]);
    }
  }

  if constexpr (kRegistered) block_barrier<N>(p, ++epoch);
  finish_block<kRegistered>(self, epoch, call);
}

}  // namespace tandem::comm::cuda::detail
