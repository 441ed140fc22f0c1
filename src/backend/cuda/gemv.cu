// Small-m GEMM for decode. See gemv.h.
//
// A warp owns R rows of W at a time (grid-stride over the rows): each lane loads 16 bytes
// (8 bf16) of each row per step, U steps unrolled with the loads first (U * R = 8 loads of
// 16 bytes in flight per lane), then multiplies them by the matching 8 elements of each of the
// m rows of x (16-byte __ldg loads: x is small and stays in L1/L2), accumulating in fp32. A
// butterfly reduction leaves every sum in every lane; lane i writes output i. W is read with
// L1::no_allocate (streamed once) so that L1 keeps x. When all U steps of a warp are in range
// (k a multiple of 256 U: every decode shape) the loads are unguarded. Registers (ptxas, sm_90a):
// 70 at m = 1 (28 warps/SM), 122-150 at m = 3..8 (12-16 warps/SM), no spills.
#include <algorithm>
#include <atomic>

#include "backend/cuda/check.h"
#include "backend/cuda/gemv.h"

namespace tandem::cuda {
namespace {

constexpr int kMaxWarpsPerBlock = 4;

__device__ __forceinline__ uint4 load_stream(uint4 const* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 8 bf16 (one uint4) to fp32: the high half of a word is a float with the low 16 bits cleared.
__device__ __forceinline__ void unpack8(uint4 const& v, float (&f)[8]) {
  uint32_t const u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

// U steps of one lane: chunk c = base + 32 u of each of the R rows (wr) and of each of the M rows
// of x. All W loads first (load_w), then per step the x loads (L1 hits) and the FMAs (fma_x).
// kGuard: chunks past nchunk are skipped.
template <int R, int U, bool kGuard>
__device__ __forceinline__ void load_w(uint4 const* const (&wr)[R], int64_t base, int64_t nchunk,
                                       uint4 (&wv)[U][R]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t c = base + 32 * u;
#pragma unroll
    for (int r = 0; r < R; ++r) wv[u][r] = !kGuard || c < nchunk ? load_stream(wr[r] + c) : uint4{};
  }
}

template <int M, int R, int U, bool kGuard>
__device__ __forceinline__ void fma_x(uint4 const* x4, uint4 const (&wv)[U][R], int64_t base,
                                      int64_t nchunk, float (&acc)[M][R]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t c = base + 32 * u;
    if (kGuard && c >= nchunk) continue;
    float wf[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) unpack8(wv[u][r], wf[r]);
#pragma unroll
    for (int i = 0; i < M; ++i) {
      float xf[8];
      unpack8(__ldg(x4 + i * nchunk + c), xf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][r] = fmaf(xf[j], wf[r][j], acc[i][r]);
      }
    }
  }
}

// kPdl (a programmatic dependent launch): the W loads of a warp's first step are issued before
// griddepcontrol.wait (W is constant; x is the previous kernel's output), then the warp waits and
// lets the next kernel launch; a warp without rows waits too (completion stays transitive).
__device__ __forceinline__ void pdl_wait_and_trigger() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

template <int M, int R, int U, bool F32, bool kPdl>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * 32, M <= 2 ? 7 : (M < 8 ? 4 : 3))
    gemv_kernel(GemvParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x >> 5);
  const int64_t warp = int64_t{blockIdx.x} * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t n = p.n, nchunk = p.k / 8;  // 16-byte chunks per row
  uint4 const* x4 = reinterpret_cast<uint4 const*>(p.x);
  uint4 const* w4 = reinterpret_cast<uint4 const*>(p.w);
  bool waited = !kPdl;
  for (int64_t row0 = warp * R; row0 < n; row0 += warps * R) {
    uint4 const* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = w4 + (row0 + r < n ? row0 + r : row0) * nchunk;
    float acc[M][R];
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int r = 0; r < R; ++r) acc[i][r] = 0.f;
    }
    for (int64_t base = lane; base < nchunk; base += 32 * U) {
      uint4 wv[U][R];
      // Warp-uniform: all U steps in range (always, when k is a multiple of 256 * U): no guards.
      const bool full = base - lane + 32 * U <= nchunk;
      if (full) {
        load_w<R, U, false>(wr, base, nchunk, wv);
      } else {
        load_w<R, U, true>(wr, base, nchunk, wv);
      }
      if (kPdl && !waited) {
        pdl_wait_and_trigger();
        waited = true;
      }
      if (full) {
        fma_x<M, R, U, false>(x4, wv, base, nchunk, acc);
      } else {
        fma_x<M, R, U, true>(x4, wv, base, nchunk, acc);
      }
    }
    // Butterfly: every lane ends with every sum (same order in every lane: deterministic).
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[i][r] += __shfl_xor_sync(0xffffffffu, acc[i][r], o);
      }
    }
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (lane == (i * R + r) % 32 && row0 + r < n) {
          const float v = p.alpha * acc[i][r];
          if constexpr (F32) {
            p.y_f32[i * n + row0 + r] = v;
          } else {
            p.y[i * n + row0 + r] = __float2bfloat16_rn(v);
          }
        }
      }
    }
  }
  if (kPdl && !waited) pdl_wait_and_trigger();
}

int sm_count() {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Rows per warp: 1 for m <= 2 (x reuse does not matter, more warps), 2 above (each x load
// serves two rows of W). Steps unrolled so that each lane has 8 16-byte loads of W in flight.
template <int M, bool F32>
void launch_m(GemvParams const& p, cudaStream_t stream) {
  constexpr int R = M <= 2 ? 1 : 2;
  constexpr int U = 8 / R;
  const int64_t row_warps = (p.n + R - 1) / R;
  const int sms = sm_count();
  // Fewer warps than 4 per SM: one warp per block, so that they spread over the SMs.
  const int wpb = row_warps >= int64_t{4} * sms ? kMaxWarpsPerBlock : 1;
  // Enough blocks for every row warp, at most 16 warps' worth per SM (then grid-stride).
  const int64_t max_blocks = int64_t{16} * sms * kMaxWarpsPerBlock / wpb;
  const int64_t blocks = std::min<int64_t>((row_warps + wpb - 1) / wpb, max_blocks);
  if (p.pdl) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks));
    cfg.blockDim = dim3(static_cast<unsigned>(wpb * 32));
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    TANDEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, gemv_kernel<M, R, U, F32, true>, p));
  } else {
    gemv_kernel<M, R, U, F32, false>
        <<<static_cast<unsigned>(blocks), static_cast<unsigned>(wpb * 32), 0, stream>>>(p);
  }
}

template <bool F32>
void dispatch(GemvParams const& p, cudaStream_t stream) {
  switch (p.m) {
    case 1: launch_m<1, F32>(p, stream); break;
    case 2: launch_m<2, F32>(p, stream); break;
    case 3: launch_m<3, F32>(p, stream); break;
    case 4: launch_m<4, F32>(p, stream); break;
    case 5: launch_m<5, F32>(p, stream); break;
    case 6: launch_m<6, F32>(p, stream); break;
    case 7: launch_m<7, F32>(p, stream); break;
    case 8: launch_m<8, F32>(p, stream); break;
    default: TANDEM_THROW(kUnsupported, "gemv: m ", p.m, " > ", kGemvMaxM);
  }
}

bool aligned(void const* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

bool gemv_supported(GemvParams const& p) {
  const bool f32 = p.y_f32 != nullptr;
  void const* y = f32 ? static_cast<void const*>(p.y_f32) : static_cast<void const*>(p.y);
  return p.m >= 1 && p.m <= kGemvMaxM && p.n >= 1 && p.k >= 8 && p.k % 8 == 0 && p.x != nullptr &&
         p.w != nullptr && y != nullptr && aligned(p.x, 16) && aligned(p.w, 16) &&
         aligned(y, f32 ? 4 : 2);
}

void gemv_launch(GemvParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.m >= 0 && p.n > 0 && p.k > 0, "gemv: bad sizes m ", p.m, " n ", p.n, " k ", p.k);
  if (p.m == 0) return;
  TANDEM_CHECK_KIND(kUnsupported, gemv_supported(p), "gemv: unsupported operands (m ", p.m, " n ",
                    p.n, " k ", p.k, "; needs 1 <= m <= 8, k % 8 == 0, 16-byte aligned x and w)");
  if (p.y_f32 != nullptr) {
    dispatch<true>(p, stream);
  } else {
    dispatch<false>(p, stream);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
