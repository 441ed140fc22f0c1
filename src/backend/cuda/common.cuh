// Device helpers shared by the CUDA ops: bf16 vector loads/stores as fp32, warp and block
// reductions. Included by .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace tandem::cuda::detail {

using bf16 = __nv_bfloat16;

/// Loads N consecutive bf16 (N * 2 bytes aligned) as fp32.
template <int N>
__device__ __forceinline__ void load_bf16(bf16 const* p, float (&v)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "vector width");
  if constexpr (N == 1) {
    v[0] = __bfloat162float(*p);
  } else {
    using Raw = std::conditional_t<N == 8, uint4, std::conditional_t<N == 4, uint2, uint32_t>>;
    Raw raw = *reinterpret_cast<Raw const*>(p);
    __nv_bfloat162 const* h = reinterpret_cast<__nv_bfloat162 const*>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      float2 f = __bfloat1622float2(h[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
}

/// Stores N fp32 as consecutive bf16 (round to nearest even).
template <int N>
__device__ __forceinline__ void store_bf16(bf16* p, float const (&v)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8, "vector width");
  if constexpr (N == 1) {
    *p = __float2bfloat16_rn(v[0]);
  } else {
    using Raw = std::conditional_t<N == 8, uint4, std::conditional_t<N == 4, uint2, uint32_t>>;
    Raw raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<Raw*>(p) = raw;
  }
}

/// Copies N bf16 unchanged (16 bytes for N = 8).
template <int N>
__device__ __forceinline__ void copy_bf16(bf16* dst, bf16 const* src) {
  if constexpr (N == 8) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(src);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
/// NOTE: contains __syncthreads(); call from all threads.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float s_part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // s_part may still be read by a previous call
  if (lane == 0) s_part[warp] = v;
  __syncthreads();
  const int nwarps = blockDim.x >> 5;
  float t = lane < nwarps ? s_part[lane] : 0.f;
  return warp_sum(t);
}

/// True when every pointer is aligned to `bytes`.
template <typename... P>
inline bool aligned_to(size_t bytes, P const*... ptrs) {
  return ((reinterpret_cast<uintptr_t>(ptrs) % bytes == 0) && ...);
}

/// Threads for a row of `vecs` vectors: a multiple of 32, at most `max_threads`.
inline int row_threads(int64_t vecs, int max_threads) {
  int64_t t = (vecs + 31) / 32 * 32;
  if (t < 32) t = 32;
  if (t > max_threads) t = max_threads;
  return static_cast<int>(t);
}

/// Programmatic dependent launch: kernels launched by launch_pdl() may be scheduled while the
/// previous kernel in the stream is still finishing (hiding launch latency between the small
/// kernels of a decode step); they must call pdl_wait() before touching global memory, which
/// returns once the previous kernel has completed and its writes are visible (a no-op for a
/// normal launch). Every thread waits, so completion stays transitive along the stream.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

/// Lets the next kernel in the stream, when it is a programmatic dependent launch, be scheduled
/// now (griddepcontrol.launch_dependents; otherwise it launches when this grid's CTAs exit), so
/// that it can issue loads of constant data (weights) while this kernel still runs. Call it
/// after pdl_wait(): the next kernel may then read, before its own wait, what the kernels
/// before this one wrote.
__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

/// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization
/// allowed.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace tandem::cuda::detail
