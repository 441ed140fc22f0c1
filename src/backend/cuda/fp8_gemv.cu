// FP8-weight small-m GEMM for decode. See fp8_linear.h.
//
// On the tensor cores (mma.sync m16n8k16 bf16, fp32 accumulation), with the weights as the
// A operand and the m <= 16 tokens as B (one or two 8-token n tiles), so no MMA work is spent
// on padding weight rows and each converted weight serves every token. A block of 8 warps owns
// 16 weight rows; warp w takes the 128-deep K blocks w, w + 8, ... (two 64-deep tiles each).
// Per tile a lane loads 16 bytes (16 E4M3) of weight rows g and g + 8 (g = lane / 4) at column
// 16 t (t = lane % 4) straight from global memory (streamed, L1::no_allocate) and the same
// 16 columns of its tokens' x rows (L1-cached), converts the codes in registers
// (fp8_dequant.cuh) and uses bytes 4 s .. 4 s + 3 as k step s: K permuted inside the tile
// identically for both operands (as moe_gemm_fp8.cu). A K block's MMAs go to a second
// accumulator, scaled into the output accumulator by each row's block scale. Loads for two K
// blocks (8 x 16 bytes per lane) are in flight before their MMAs. The 8 warps' partial sums
// meet in shared memory and warp 0 adds them in a fixed order: deterministic.
// MXFP8 (MX, p.w_e8m0): a lane's 16 codes lie in one 32-deep scale block; its E8M0 code goes
// into the conversion's multiplier (fp8_dequant.cuh) and the K block's sum is added unscaled.
#include <algorithm>
#include <atomic>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_dequant.cuh"
#include "backend/cuda/fp8_linear.h"

namespace tandem::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kUnroll = 4;  // K blocks whose loads are issued together

__device__ __forceinline__ uint4 load_stream(void const* p) {
  uint4 v;
  // Not volatile (read-only data, no side effects): the compiler may schedule it freely.
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(uint4 const& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// NT 8-token n tiles (m <= 8 NT). Accumulator [nt][v]: v = 0, 1: weight row g, tokens
// 8 nt + 2 t + v; v = 2, 3: row g + 8.
template <int NT, bool F32, bool MX>
__global__ void __launch_bounds__(kWarps * 32) fp8_gemv_kernel(Fp8GemvParams p) {
  __shared__ float red[kWarps][NT * 4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int64_t n = p.n, k = p.k, m = p.m;
  const int64_t kb_count = fp8_row_scale_cols(k);
  const int64_t r0 = int64_t{blockIdx.x} * 16;
  const int64_t ra = min(r0 + g, n - 1), rb = min(r0 + g + 8, n - 1);  // clamped: loads only
  uint8_t const* wa = p.w + ra * k;
  uint8_t const* wb = p.w + rb * k;
  float const* sa = MX ? nullptr : p.w_scale + ra * kb_count;
  float const* sb = MX ? nullptr : p.w_scale + rb * kb_count;
  const int64_t mx_cols = mxfp8_scale_cols(k);
  uint8_t const* ea = MX ? p.w_e8m0 + ra * mx_cols : nullptr;
  uint8_t const* eb = MX ? p.w_e8m0 + rb * mx_cols : nullptr;
  // x rows of this lane's B fragments (tokens g + 8 nt); null past m.
  bf16 const* xr[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xr[nt] = g + 8 * nt < m ? p.x + (g + 8 * nt) * k : nullptr;

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[nt][v] = 0.f;

  for (int64_t kb0 = warp; kb0 < kb_count; kb0 += int64_t{kWarps} * kUnroll) {
    // Loads first: kUnroll K blocks x 2 tiles x rows g, g + 8.
    uint4 qa[kUnroll][2], qb[kUnroll][2];
    float sca[kUnroll], scb[kUnroll];
    uint32_t mua[kUnroll][2], mub[kUnroll][2];  // MX: the conversion multipliers
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t kb = kb0 + int64_t{kWarps} * u;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t col = kb * 128 + 64 * j + 16 * t;
        const bool ok = kb < kb_count && col < k;
        qa[u][j] = ok ? load_stream(wa + col) : uint4{};
        qb[u][j] = ok ? load_stream(wb + col) : uint4{};
        if constexpr (MX) {
          mua[u][j] = detail::e8m0_bf16x2_mul(ok ? __ldg(ea + col / kMxfp8BlockK) : 127u);
          mub[u][j] = detail::e8m0_bf16x2_mul(ok ? __ldg(eb + col / kMxfp8BlockK) : 127u);
        }
      }
      if constexpr (MX) {
        sca[u] = scb[u] = 1.f;
      } else {
        sca[u] = kb < kb_count ? __ldg(sa + kb) : 0.f;
        scb[u] = kb < kb_count ? __ldg(sb + kb) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t kb = kb0 + int64_t{kWarps} * u;
      if (kb >= kb_count) break;  // warp-uniform
      float blk[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int v = 0; v < 4; ++v) blk[nt][v] = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t col = kb * 128 + 64 * j + 16 * t;
        uint4 xv[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const bool ok = xr[nt] != nullptr && col < k;
          xv[nt][0] = ok ? __ldg(reinterpret_cast<uint4 const*>(xr[nt] + col)) : uint4{};
          xv[nt][1] = ok ? __ldg(reinterpret_cast<uint4 const*>(xr[nt] + col + 8)) : uint4{};
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t a0, a1, a2, a3;
          if constexpr (MX) {
            detail::e4m3x4_to_bf16_mx(word(qa[u][j], s), mua[u][j], a0, a2);
            detail::e4m3x4_to_bf16_mx(word(qb[u][j], s), mub[u][j], a1, a3);
          } else {
            detail::e4m3x4_to_bf16(word(qa[u][j], s), a0, a2);
            detail::e4m3x4_to_bf16(word(qb[u][j], s), a1, a3);
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            // Elements 4 s .. 4 s + 3 of the lane's 16: pairs 2 s and 2 s + 1.
            const uint32_t b0 = word(xv[nt][s >> 1], (2 * s) & 3);
            const uint32_t b1 = word(xv[nt][s >> 1], (2 * s + 1) & 3);
            mma_bf16(blk[nt], a0, a1, a2, a3, b0, b1);
          }
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        acc[nt][0] = fmaf(sca[u], blk[nt][0], acc[nt][0]);
        acc[nt][1] = fmaf(sca[u], blk[nt][1], acc[nt][1]);
        acc[nt][2] = fmaf(scb[u], blk[nt][2], acc[nt][2]);
        acc[nt][3] = fmaf(scb[u], blk[nt][3], acc[nt][3]);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int v = 0; v < 4; ++v) red[warp][nt * 4 + v][lane] = acc[nt][v];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += red[w][nt * 4 + v][lane];
      const int64_t row = r0 + g + 8 * (v >> 1), tok = 8 * nt + 2 * t + (v & 1);
      if (row < n && tok < m) {
        if constexpr (F32) {
          p.y_f32[tok * n + row] = sum;
        } else {
          p.y[tok * n + row] = __float2bfloat16_rn(sum);
        }
      }
    }
  }
}

template <int NT, bool F32>
void launch_nt(Fp8GemvParams const& p, cudaStream_t stream) {
  const int64_t blocks = (p.n + 15) / 16;
  TANDEM_CHECK(blocks <= INT32_MAX, "fp8_gemv: n too large: ", p.n);
  if (p.w_e8m0 != nullptr) {
    fp8_gemv_kernel<NT, F32, true><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(p);
  } else {
    fp8_gemv_kernel<NT, F32, false><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(p);
  }
}

template <bool F32>
void dispatch(Fp8GemvParams const& p, cudaStream_t stream) {
  if (p.m <= 8) {
    launch_nt<1, F32>(p, stream);
  } else if (p.m <= 16) {
    launch_nt<2, F32>(p, stream);
  } else {
    TANDEM_THROW(kUnsupported, "fp8_gemv: m ", p.m, " > ", kFp8GemvMaxM);
  }
}

bool aligned(void const* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// One thread per 16 codes: exact bf16 values (fp8_dequant.cuh), times the row's block scale in
// fp32, rounded to bf16; MXFP8 (e8m0 set): the E8M0 scale folded into the conversion (exact).
template <bool MX>
__global__ void fp8_dequantize_kernel(uint8_t const* q, float const* scale, uint8_t const* e8m0,
                                      int64_t rows, int64_t cols, bf16* out) {
  const int64_t per_row = cols / 16, chunks = rows * per_row, kb = fp8_row_scale_cols(cols);
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < chunks; i += stride) {
    const int64_t r = i / per_row, c = (i % per_row) * 16;
    const uint4 v = load_stream(q + r * cols + c);
    if constexpr (MX) {
      const uint32_t mul =
          detail::e8m0_bf16x2_mul(__ldg(e8m0 + r * mxfp8_scale_cols(cols) + c / kMxfp8BlockK));
      uint32_t o[8];
      detail::e4m3x4_to_bf16_mx(v.x, mul, o[0], o[1]);
      detail::e4m3x4_to_bf16_mx(v.y, mul, o[2], o[3]);
      detail::e4m3x4_to_bf16_mx(v.z, mul, o[4], o[5]);
      detail::e4m3x4_to_bf16_mx(v.w, mul, o[6], o[7]);
      uint4* dst = reinterpret_cast<uint4*>(out + r * cols + c);
      dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
      dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
      continue;
    }
    const float s = __ldg(scale + r * kb + c / 128);
    uint32_t w[8];
    detail::e4m3x4_to_bf16(v.x, w[0], w[1]);
    detail::e4m3x4_to_bf16(v.y, w[2], w[3]);
    detail::e4m3x4_to_bf16(v.z, w[4], w[5]);
    detail::e4m3x4_to_bf16(v.w, w[6], w[7]);
    uint32_t o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float lo = __uint_as_float(w[j] << 16) * s,
                  hi = __uint_as_float(w[j] & 0xffff0000u) * s;
      __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
      o[j] = *reinterpret_cast<uint32_t*>(&b);
    }
    uint4* dst = reinterpret_cast<uint4*>(out + r * cols + c);
    dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
    dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

}  // namespace

namespace {

void dequantize(uint8_t const* q, float const* row_scale, uint8_t const* e8m0, int64_t rows,
                int64_t cols, bf16* out, cudaStream_t stream) {
  TANDEM_CHECK(rows >= 0 && cols > 0 && cols % 16 == 0, "fp8_dequantize: bad shape ", rows, " x ",
               cols, " (cols % 16 == 0)");
  TANDEM_CHECK(q != nullptr && (row_scale != nullptr || e8m0 != nullptr) && out != nullptr &&
                   aligned(q, 16) && aligned(out, 16),
               "fp8_dequantize: q and out must be 16-byte aligned, scales set");
  if (rows == 0) return;
  const int64_t chunks = rows * (cols / 16);
  const int64_t blocks = std::min<int64_t>((chunks + 255) / 256, 132 * 16);
  if (e8m0 != nullptr) {
    fp8_dequantize_kernel<true>
        <<<static_cast<unsigned>(blocks), 256, 0, stream>>>(q, row_scale, e8m0, rows, cols, out);
  } else {
    fp8_dequantize_kernel<false>
        <<<static_cast<unsigned>(blocks), 256, 0, stream>>>(q, row_scale, e8m0, rows, cols, out);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace

void fp8_dequantize_launch(uint8_t const* q, float const* row_scale, int64_t rows, int64_t cols,
                           bf16* out, cudaStream_t stream) {
  TANDEM_CHECK(row_scale != nullptr, "fp8_dequantize: row_scale is null");
  dequantize(q, row_scale, nullptr, rows, cols, out, stream);
}

void mxfp8_dequantize_launch(uint8_t const* q, uint8_t const* e8m0, int64_t rows, int64_t cols,
                             bf16* out, cudaStream_t stream) {
  TANDEM_CHECK(e8m0 != nullptr, "mxfp8_dequantize: e8m0 is null");
  dequantize(q, nullptr, e8m0, rows, cols, out, stream);
}

bool mxfp8_codes_in_range(uint8_t const* e8m0, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (e8m0[i] < kMxfp8MinCode || e8m0[i] > kMxfp8MaxCode) return false;
  }
  return true;
}

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
         p.x != nullptr && p.w != nullptr && (p.w_scale != nullptr || p.w_e8m0 != nullptr) &&
         y != nullptr && aligned(p.x, 16) && aligned(p.w, 16) && aligned(p.w_scale, 4) &&
         aligned(y, f32 ? 4 : 2);
}

void fp8_gemv_launch(Fp8GemvParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.m >= 0 && p.n > 0 && p.k > 0, "fp8_gemv: bad sizes m ", p.m, " n ", p.n, " k ",
               p.k);
  if (p.m == 0) return;
  TANDEM_CHECK_KIND(kUnsupported, fp8_gemv_supported(p), "fp8_gemv: unsupported operands (m ", p.m,
                    " n ", p.n, " k ", p.k,
                    "; needs 1 <= m <= 16, k % 16 == 0, 16-byte aligned x and w, row scales or "
                    "E8M0 scales)");
  if (p.y_f32 != nullptr) {
    dispatch<true>(p, stream);
  } else {
    dispatch<false>(p, stream);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
