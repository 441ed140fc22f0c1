// FP8-weight small-m GEMM for decode. See fp8_linear.h.
//
// The structure of gemv.cu: a warp owns R rows of W at a time (grid-stride over the rows);
// each lane loads 16 bytes (16 E4M3) of each row per step, U steps unrolled with the loads
// first (U * R = 8 loads of 16 bytes in flight per lane). A 16-byte chunk lies in one 128-deep
// K block: its 16 products with each x row are summed in fp32, then scaled by the row's block
// scale into the accumulator. W is read with L1::no_allocate so that L1 keeps x.
#include <algorithm>
#include <atomic>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_dequant.cuh"
#include "backend/cuda/fp8_linear.h"

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

// bf16x2 word -> two fp32.
__device__ __forceinline__ float lo_f32(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_f32(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// 16 E4M3 (one uint4) -> 8 bf16x2 words, element order kept.
__device__ __forceinline__ void dequant16(uint4 const& v, uint32_t (&b)[8]) {
  detail::e4m3x4_to_bf16(v.x, b[0], b[1]);
  detail::e4m3x4_to_bf16(v.y, b[2], b[3]);
  detail::e4m3x4_to_bf16(v.z, b[4], b[5]);
  detail::e4m3x4_to_bf16(v.w, b[6], b[7]);
}

// U steps of one lane: chunk c = base + 32 u (16 elements of K) of each of the R rows and of
// each of the M rows of x (two 16-byte loads each). kGuard: chunks past nchunk are skipped.
template <int M, int R, int U, bool kGuard>
__device__ __forceinline__ void step(uint4 const* x4, uint4 const* const (&wr)[R],
                                     float const* const (&sr)[R], int64_t base, int64_t nchunk,
                                     float (&acc)[M][R]) {
  uint4 wv[U][R];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t c = base + 32 * u;
#pragma unroll
    for (int r = 0; r < R; ++r) wv[u][r] = !kGuard || c < nchunk ? load_stream(wr[r] + c) : uint4{};
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t c = base + 32 * u;
    if (kGuard && c >= nchunk) continue;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = __ldg(sr[r] + (c >> 3));  // 8 chunks per K block
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint32_t wb[8];
      dequant16(wv[u][r], wb);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const uint4 xa = __ldg(x4 + (i * nchunk + c) * 2);
        const uint4 xb = __ldg(x4 + (i * nchunk + c) * 2 + 1);
        uint32_t const xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        float part = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          part = fmaf(lo_f32(xw[j]), lo_f32(wb[j]), part);
          part = fmaf(hi_f32(xw[j]), hi_f32(wb[j]), part);
        }
        acc[i][r] = fmaf(s[r], part, acc[i][r]);
      }
    }
  }
}

template <int M, int R, int U, bool F32>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * 32, M <= 2 ? 5 : (M <= 4 ? 3 : 2))
    fp8_gemv_kernel(Fp8GemvParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t{gridDim.x} * (blockDim.x >> 5);
  const int64_t warp = int64_t{blockIdx.x} * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t n = p.n, nchunk = p.k / 16;  // 16-byte chunks per row of W
  const int64_t kb = fp8_row_scale_cols(p.k);
  uint4 const* x4 = reinterpret_cast<uint4 const*>(p.x);
  uint4 const* w4 = reinterpret_cast<uint4 const*>(p.w);
  for (int64_t row0 = warp * R; row0 < n; row0 += warps * R) {
    uint4 const* wr[R];
    float const* sr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r < n ? row0 + r : row0;
      wr[r] = w4 + row * nchunk;
      sr[r] = p.w_scale + row * kb;
    }
    float acc[M][R];
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int r = 0; r < R; ++r) acc[i][r] = 0.f;
    }
    for (int64_t base = lane; base < nchunk; base += 32 * U) {
      if (base - lane + 32 * U <= nchunk) {  // warp-uniform
        step<M, R, U, false>(x4, wr, sr, base, nchunk, acc);
      } else {
        step<M, R, U, true>(x4, wr, sr, base, nchunk, acc);
      }
    }
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
          if constexpr (F32) {
            p.y_f32[i * n + row0 + r] = acc[i][r];
          } else {
            p.y[i * n + row0 + r] = __float2bfloat16_rn(acc[i][r]);
          }
        }
      }
    }
  }
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

template <int M, bool F32>
void launch_m(Fp8GemvParams const& p, cudaStream_t stream) {
  constexpr int R = M <= 2 ? 1 : 2;
  constexpr int U = 8 / R;
  const int64_t row_warps = (p.n + R - 1) / R;
  const int sms = sm_count();
  const int wpb = row_warps >= int64_t{4} * sms ? kMaxWarpsPerBlock : 1;
  const int64_t max_blocks = int64_t{16} * sms * kMaxWarpsPerBlock / wpb;
  const int64_t blocks = std::min<int64_t>((row_warps + wpb - 1) / wpb, max_blocks);
  fp8_gemv_kernel<M, R, U, F32>
      <<<static_cast<unsigned>(blocks), static_cast<unsigned>(wpb * 32), 0, stream>>>(p);
}

template <bool F32>
void dispatch(Fp8GemvParams const& p, cudaStream_t stream) {
  switch (p.m) {
    case 1: launch_m<1, F32>(p, stream); break;
    case 2: launch_m<2, F32>(p, stream); break;
    case 3: launch_m<3, F32>(p, stream); break;
    case 4: launch_m<4, F32>(p, stream); break;
    case 5: launch_m<5, F32>(p, stream); break;
    case 6: launch_m<6, F32>(p, stream); break;
    case 7: launch_m<7, F32>(p, stream); break;
    case 8: launch_m<8, F32>(p, stream); break;
    default: TANDEM_THROW(kUnsupported, "fp8_gemv: m ", p.m, " > ", kFp8GemvMaxM);
  }
}

bool aligned(void const* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

}  // namespace

std::vector<float> fp8_expand_row_scales(const float* block_scales, int64_t n, int64_t k,
                                         int64_t block_rows) {
  TANDEM_CHECK(n > 0 && k > 0 && block_rows > 0, "fp8_expand_row_scales: bad sizes n ", n, " k ", k,
               " block_rows ", block_rows);
  const int64_t kb = fp8_row_scale_cols(k);
  std::vector<float> out(static_cast<size_t>(n * kb));
  for (int64_t i = 0; i < n; ++i) {
    std::copy(block_scales + (i / block_rows) * kb, block_scales + (i / block_rows + 1) * kb,
              out.begin() + i * kb);
  }
  return out;
}

bool fp8_gemv_supported(Fp8GemvParams const& p) {
  const bool f32 = p.y_f32 != nullptr;
  void const* y = f32 ? static_cast<void const*>(p.y_f32) : static_cast<void const*>(p.y);
  return p.m >= 1 && p.m <= kFp8GemvMaxM && p.n >= 1 && p.k >= 16 && p.k % 16 == 0 &&
         p.x != nullptr && p.w != nullptr && p.w_scale != nullptr && y != nullptr &&
         aligned(p.x, 16) && aligned(p.w, 16) && aligned(p.w_scale, 4) && aligned(y, f32 ? 4 : 2);
}

void fp8_gemv_launch(Fp8GemvParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.m >= 0 && p.n > 0 && p.k > 0, "fp8_gemv: bad sizes m ", p.m, " n ", p.n, " k ",
               p.k);
  if (p.m == 0) return;
  TANDEM_CHECK_KIND(kUnsupported, fp8_gemv_supported(p), "fp8_gemv: unsupported operands (m ", p.m,
                    " n ", p.n, " k ", p.k,
                    "; needs 1 <= m <= 8, k % 16 == 0, 16-byte aligned x and w, row scales)");
  if (p.y_f32 != nullptr) {
    dispatch<true>(p, stream);
  } else {
    dispatch<false>(p, stream);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
