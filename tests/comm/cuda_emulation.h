// The CUDA built-ins the communication kernels' device code uses, for running that code on
// CPU threads (tests/comm/test_*_emulated.cpp): every CUDA thread is a std::thread,
// __syncthreads a std::barrier, the cross-GPU flags C++ release/acquire atomics, peer memory
// plain host memory shared by the rank threads, dynamic shared memory one buffer per block.
// Include this before comm/cuda/*_kernels.cuh. Not covered: the GPU's own memory model,
// timing, IPC, NCCL.
#pragma once

#include <atomic>
#include <barrier>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "core/dtype.h"

#define TANDEM_AR_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __grid_constant__
#define __launch_bounds__(...)

namespace emu {
struct Dim {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local Dim thread_idx, block_idx, block_dim, grid_dim;
inline thread_local std::barrier<>* block_sync = nullptr;
inline thread_local unsigned char* block_smem = nullptr;
}  // namespace emu

#define threadIdx ::emu::thread_idx
#define blockIdx ::emu::block_idx
#define blockDim ::emu::block_dim
#define gridDim ::emu::grid_dim

inline void __syncthreads() { emu::block_sync->arrive_and_wait(); }
[[noreturn]] inline void __trap() { std::abort(); }

struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float __uint_as_float(uint32_t u) { return std::bit_cast<float>(u); }
inline uint32_t __float_as_uint(float f) { return std::bit_cast<uint32_t>(f); }
struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  uint16_t lo, hi;
};
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) {
  return {tandem::f32_to_bf16(f.x), tandem::f32_to_bf16(f.y)};
}
inline uint32_t atomicAdd(uint32_t* p, uint32_t v) {
  return std::atomic_ref<uint32_t>(*p).fetch_add(v, std::memory_order_acq_rel);
}
inline uint32_t atomicOr(uint32_t* p, uint32_t v) {
  return std::atomic_ref<uint32_t>(*p).fetch_or(v, std::memory_order_relaxed);
}
inline int __popc(uint32_t v) { return std::popcount(v); }

namespace tandem::comm::cuda::detail {
inline void st_release_sys(uint32_t* addr, uint32_t v) {
  std::atomic_ref<uint32_t>(*addr).store(v, std::memory_order_release);
}
inline uint32_t ld_acquire_sys(uint32_t const* addr) {
  const uint32_t v =
      std::atomic_ref<uint32_t>(*const_cast<uint32_t*>(addr)).load(std::memory_order_acquire);
  std::this_thread::yield();  // spinning threads share two cores with everyone else
  return v;
}
inline uint64_t global_timer_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
inline unsigned char* moe_smem() { return emu::block_smem; }
inline uint8_t f32_to_e4m3(float x) { return tandem::f32_to_f8e4m3(x); }
inline float e4m3_to_f32(uint8_t v) { return tandem::f8e4m3_to_f32(v); }
}  // namespace tandem::comm::cuda::detail

namespace emu {

/// Runs one kernel launch: every thread of every block at once (smem_bytes of shared memory
/// per block), then joins them.
template <class Fn, class P>
void launch(Fn fn, int blocks, int threads, size_t smem_bytes, const P& params) {
  std::vector<std::unique_ptr<std::barrier<>>> bars;
  std::vector<std::vector<unsigned char>> smem(static_cast<size_t>(blocks));
  for (int b = 0; b < blocks; ++b) {
    bars.push_back(std::make_unique<std::barrier<>>(threads));
    smem[static_cast<size_t>(b)].assign(smem_bytes + 16, 0xcd);  // garbage, like a GPU
  }
  std::vector<std::thread> ts;
  ts.reserve(static_cast<size_t>(blocks * threads));
  for (int b = 0; b < blocks; ++b) {
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, b, t] {
        thread_idx = {static_cast<unsigned>(t), 0, 0};
        block_idx = {static_cast<unsigned>(b), 0, 0};
        block_dim = {static_cast<unsigned>(threads), 1, 1};
        grid_dim = {static_cast<unsigned>(blocks), 1, 1};
        block_sync = bars[static_cast<size_t>(b)].get();
        auto* raw = smem[static_cast<size_t>(b)].data();
        block_smem = raw + (16 - reinterpret_cast<uintptr_t>(raw) % 16) % 16;
        fn(params);
      });
    }
  }
  for (auto& th : ts) th.join();
}

}  // namespace emu
