// Grouped expert GEMM on the FP8 tensor cores (W8A8): E4M3 weights x E4M3 activations, see
// moe_gemm.h (MoeGemmParams::fp8_activations) and fp8_linear.h (the numerics).
//
// moe_gemm_kernel.cuh's kernel (grid layout, row-tile scan, gather, pipeline, PDL, epilogues)
// with the operand policy W8A8Ops below; what differs from the W8A16 one (moe_gemm_fp8.cu) is
// the A operand and the MMA:
//   - the bf16 activations come into shared memory as before (cp.async stages of BM x 128);
//     once a stage has landed, the CTA quantizes it in one pass to E4M3 per row and 128-column
//     group (the K tile is one group): 16 threads per row, 8 columns each, the row's amax by
//     shuffles, s = amax / 448, q = e4m3(x * (448 / amax)) rounded to nearest even, satfinite
//     (fp8_linear.h), into one E4M3 A buffer (BM x 128 bytes) and the row scales. Rows past
//     the tile's real rows are skipped (decode tiles hold one or two real rows). So the
//     activations are quantized where they are consumed, with no extra pass over memory: the
//     per-128-group amax of the SiLU-mul output spans several CTAs of the gate_up GEMM, which a
//     producer epilogue could only gather through another round trip;
//   - mma.sync m16n8k32 e4m3 x e4m3 -> f32 (sm_89+). Both operands are read with 16-byte
//     loads: a thread (g = lane / 4, t = lane % 4) reads bytes [32 t, 32 t + 32) of its rows
//     (A rows g, g + 8; B row g) and uses bytes 32 t + 8 s .. + 7 as the fragment of k step s.
//     That permutes K inside the tile the same way for A and B (mma k 4 t + j + 16 h <->
//     byte 32 t + 8 s + 4 h + j), which leaves the dot products unchanged. Both buffers store
//     16-byte chunk c of row r at chunk c ^ (r & 1): conflict-free (a phase of 8 lanes reads
//     chunks 2 t of an even row and 2 t ^ 1 of an odd one);
//   - the tile's MMAs accumulate into a second accumulator, added to the output accumulator
//     times (activation scale of the row) x (weight scale of the column) at the end of every
//     128-deep K block (DeepSeek-V3's promotion interval; Hopper's FP8 MMAs accumulate with
//     reduced precision inside an instruction chain).
// Pre-quantized activations (MoeGemmParams::x_fp8 / x_scale, made by one fp8_quantize_rows_launch
// pass): the E4M3 rows go by cp.async straight into E4M3 A stages (same swizzle), the row scales
// are read per K block from global memory; no quant pass and one barrier per K tile. (On the
// H200 the in-kernel quantization made this kernel slower than the W8A16 one at every size:
// every CTA of an n-tile row repeats it, between two barriers in every K tile.)
// Tiles: small 16 x 32 (6 stages, 2 warps), medium 64 x 64 (4 stages, 4 warps), large
// 128 x 128 (3 stages, 8 warps, 1 CTA / SM), picked as moe_gemm_fp8.cu picks.
#include <cuda_fp8.h>

#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm_fp8.h"
#include "backend/cuda/moe_gemm_kernel.cuh"

namespace tandem::cuda::moe_gemm_detail {

namespace {

__device__ __forceinline__ void mma_e4m3(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();  // FP8 MMAs need sm_89+ (the project builds sm_90a)
#endif
}
// Two floats -> two E4M3 codes (lo in bits 0..7), rounded to nearest even, satfinite.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// E4M3 x (quantized here from bf16, or kPreQ: p.x_fp8 / p.x_scale, made by
// fp8_quantize_rows_launch, loaded by cp.async straight into E4M3 stages: no quant pass, one
// barrier per K tile) and E4M3 weights with per-128 scales (moe_gemm_kernel.cuh's operand
// policy).
template <class Shape, bool kPreQ>
struct W8A8Ops {
  using Cfg = Shape;
  static constexpr bool kNoOffsets = true, kXRowTimesK = false;
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kThreads = Cfg::kThreads;
  static constexpr int kStages = Cfg::kStagesN, kMI = Cfg::kMI, kNI = Cfg::kNI;
  static constexpr int kLdA = BK + 8;  // bf16 elements (272 bytes: 16 mod 128)
  static constexpr int kStageABytes = BM * kLdA * 2, kStageBBytes = BN * BK;  // bytes
  static constexpr int kQABytes = BM * BK;                                    // E4M3 A buffer
  static constexpr int kChunksA = BM * BK / 8;                                // 16-byte chunks
  // kPreQ: E4M3 stages of BM x 128 bytes, no bf16 stages.
  static constexpr int kChunksAQ = BM * BK / 16;
  static constexpr size_t kSmemBytes =
      kPreQ ? size_t{kStages} * (kQABytes + kStageBBytes)
            : size_t{kStages} * (kStageABytes + kStageBBytes) + kQABytes + BM * sizeof(float);
  static constexpr int kQuantRows = kThreads / 16;  // rows per quant pass
  static_assert(Cfg::kWarpsK_ == 1, "one warp per warp tile");
  static_assert(kChunksA % kThreads == 0, "whole chunks per thread");
  static_assert(BM % kQuantRows == 0, "whole quant passes");
  static_assert(kChunksAQ % kThreads == 0, "whole E4M3 A chunks per thread");
  static_assert(BK == kFp8BlockK, "one K tile per scale block");

  MoeGemmParams const& p;
  MoeTile t;
  int KB;
  uint8_t const* gW;
  float const* gS;
  // Not kPreQ: bf16 A stages, B stages, one E4M3 A buffer + its row scales. kPreQ: E4M3 A
  // stages (at sQA + stage * kQABytes), B stages.
  bf16* sA;
  uint8_t* sB;
  uint8_t* sQA;            // [BM][128] E4M3
  float* sAScale;          // [BM] (not kPreQ)
  float sc[kNI][2];        // the weight scales of this thread's columns (n = 8 ni + 2 t + j), block
  float sa_next[kMI][2];   // kPreQ: this thread's rows' activation scales (a_row + 16 mi + 8 h)
  float blk[kMI][kNI][4];  // the current K block's sums

  __device__ __forceinline__ W8A8Ops(MoeGemmParams const& p_, MoeTile const& t_) : p(p_), t(t_) {
    KB = static_cast<int>(fp8_row_scale_cols(p.k));
    const int64_t row = static_cast<int64_t>(t.expert) * t.N + t.n0;
    gW = p.w_fp8 + row * t.K;
    gS = p.w_scale + row * KB;
    uint8_t* smem = t.smem;
    sA = reinterpret_cast<bf16*>(smem);
    sB = kPreQ ? smem + kStages * kQABytes : smem + kStages * kStageABytes;
    sQA = kPreQ ? smem : sB + kStages * kStageBBytes;
    sAScale = reinterpret_cast<float*>(sQA + kQABytes);
  }
  __device__ __forceinline__ void load_a(int stage, int kt) {
    const int k0 = kt * BK;
    if constexpr (kPreQ) {
      uint8_t* sAs = sQA + stage * kQABytes;
#pragma unroll
      for (int i = 0; i < kChunksAQ / kThreads; ++i) {
        const int c = t.tid + i * kThreads;
        const int r = c / (BK / 16), chunk = c % (BK / 16), col = chunk * 16;
        if (r >= t.rows) continue;  // rows past the real ones: their outputs are never stored
        const bool ok = k0 + col < t.K;
        cp_async16(sAs + r * BK + (chunk ^ (r & 1)) * 16,
                   ok ? p.x_fp8 + t.x_row[r] * t.K + k0 + col : p.x_fp8, ok);
      }
    } else {
      bf16* sAs = sA + stage * (BM * kLdA);
#pragma unroll
      for (int i = 0; i < kChunksA / kThreads; ++i) {
        const int c = t.tid + i * kThreads;
        const int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
        if (r >= t.rows) continue;  // never read: the quant pass skips rows past the real ones
        const bool ok = k0 + col < t.K;
        cp_async16(sAs + r * kLdA + col, ok ? p.x + t.x_row[r] * t.K + k0 + col : p.x, ok);
      }
    }
  }
  __device__ __forceinline__ void load_b(int stage, int kt) {
    load_w_e4m3<Cfg, 1>(sB + stage * kStageBBytes, gW, p, t, kt * BK);
  }
  __device__ __forceinline__ void load_act_scales(int kb) {
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = t.wm * Cfg::kWM + (t.lane >> 2) + mi * 16 + 8 * h;
        sa_next[mi][h] = r < t.rows ? __ldg(p.x_scale + t.x_row[r] * KB + kb) : 0.f;
      }
    }
  }
  __device__ __forceinline__ void begin() {
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (int v = 0; v < 4; ++v) blk[mi][ni][v] = 0.f;
    load_w_scales<Cfg>(sc, gS, KB, 0, t);
    if constexpr (kPreQ) load_act_scales(0);
  }
  __device__ __forceinline__ void compute(int stage, int kt, int k_tiles,
                                          float (&acc)[kMI][kNI][4]) {
    const int tid = t.tid, rows = t.rows;
    const int g = t.lane >> 2, tq = t.lane & 3;
    const int a_row = t.wm * Cfg::kWM + g;         // + 16 mi (+ 8)
    const int b_row = t.wn * Cfg::kWN + g;         // + 8 ni
    const int q_row = tid / 16, q_col = tid % 16;  // quant pass: 8 columns of one row
    // Quantize the stage's real rows: per row, s = amax / 448, q = e4m3(x * 448 / amax). (The
    // barrier before this: stage kt landed; every warp is done with sQA / sAScale of tile
    // kt - 1.)
    if constexpr (!kPreQ) {
      bf16 const* sAs = sA + stage * (BM * kLdA);
      for (int rb = 0; rb < rows; rb += kQuantRows) {  // uniform across the CTA
        const int r = rb + q_row;
        const bool real = r < rows;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (real) v = lds128(sAs + r * kLdA + q_col * 8);
        float f[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          f[2 * i] = bf16_lo(word(v, i));
          f[2 * i + 1] = bf16_hi(word(v, i));
        }
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
        for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        const float s = amax > 0.f ? __fdiv_rn(amax, 448.0f) : 1.0f;
        const float inv = amax > 0.f ? fminf(__fdiv_rn(448.0f, amax), 3.402823466e38f) : 1.0f;
        uint2 q;
        q.x = e4m3x2(__fmul_rn(f[0], inv), __fmul_rn(f[1], inv)) |
              e4m3x2(__fmul_rn(f[2], inv), __fmul_rn(f[3], inv)) << 16;
        q.y = e4m3x2(__fmul_rn(f[4], inv), __fmul_rn(f[5], inv)) |
              e4m3x2(__fmul_rn(f[6], inv), __fmul_rn(f[7], inv)) << 16;
        if (real) {
          *reinterpret_cast<uint2*>(sQA + r * BK + (((q_col >> 1) ^ (r & 1)) * 16) +
                                    (q_col & 1) * 8) = q;
          if (q_col == 0) sAScale[r] = s;
        }
      }
      __syncthreads();
    }

    // The tile's MMAs: 4 k steps of 32, two 16-byte chunks per operand row.
    uint8_t const* sBs = sB + stage * kStageBBytes;
    uint8_t const* sAq = kPreQ ? sQA + stage * kQABytes : sQA;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint4 a[kMI][2], b[kNI];
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = a_row + mi * 16 + 8 * h;
          a[mi][h] = lds128(sAq + r * BK + (((2 * tq + c) ^ (r & 1)) * 16));
        }
      }
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni) {
        const int r = b_row + ni * 8;
        b[ni] = lds128(sBs + r * BK + (((2 * tq + c) ^ (r & 1)) * 16));
      }
#pragma unroll
      for (int sub = 0; sub < 2; ++sub) {
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi) {
          const uint32_t a0 = word(a[mi][0], 2 * sub), a1 = word(a[mi][1], 2 * sub);
          const uint32_t a2 = word(a[mi][0], 2 * sub + 1), a3 = word(a[mi][1], 2 * sub + 1);
#pragma unroll
          for (int ni = 0; ni < kNI; ++ni) {
            mma_e4m3(blk[mi][ni], a0, a1, a2, a3, word(b[ni], 2 * sub), word(b[ni], 2 * sub + 1));
          }
        }
      }
    }
    // End of the K block: its sums times the row's and the column's scales into the output.
    float sa[kMI][2];
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = a_row + mi * 16 + 8 * h;
        if constexpr (kPreQ) {
          sa[mi][h] = sa_next[mi][h];
        } else {
          sa[mi][h] = r < rows ? sAScale[r] : 0.f;
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const float f = __fmul_rn(sa[mi][v >> 1], sc[ni][v & 1]);
          acc[mi][ni][v] = fmaf(f, blk[mi][ni][v], acc[mi][ni][v]);
          blk[mi][ni][v] = 0.f;
        }
    if (kt + 1 < k_tiles) {
      load_w_scales<Cfg>(sc, gS, KB, kt + 1, t);
      if constexpr (kPreQ) load_act_scales(kt + 1);
    }
  }
  __device__ __forceinline__ bool finish(float (&)[kMI][kNI][4]) { return true; }
};

template <int kBM, int kBN, int kWarpsM, int kWarpsN, int kStages, int kMinBlocks>
using W8A8Tile = MmaTileShape<kBM, kBN, 128, kWarpsM, kWarpsN, kStages, kMinBlocks>;
using W8A8Small = W8A8Tile<16, 32, 1, 2, 6, 1>;
using W8A8Medium = W8A8Tile<64, 64, 2, 2, 4, 1>;
using W8A8Large = W8A8Tile<128, 128, 2, 4, 3, 1>;

template <class Cfg, bool kSilu, bool kPreQ>
void launch_tile(MoeGemmParams const& p, cudaStream_t stream) {
  moe_gemm_launch_mma<W8A8Ops<Cfg, kPreQ>, kSilu>(p, moe_gemm_m_tiles(p, Cfg::BM, true),
                                                  "moe_gemm (fp8 w8a8)", stream);
}

template <class Cfg, bool kPreQ>
void launch_epilogue(MoeGemmParams const& p, cudaStream_t stream) {
  switch (p.epilogue) {
    case MoeGemmEpilogue::kPlain: launch_tile<Cfg, false, kPreQ>(p, stream); break;
    case MoeGemmEpilogue::kSiluMul: launch_tile<Cfg, true, kPreQ>(p, stream); break;
    default: TANDEM_THROW(kUnsupported, "moe_gemm (fp8 w8a8): unsupported epilogue");
  }
}

}  // namespace

template <bool kPreQ>
void launch_tiles(MoeGemmParams const& p, MoeGemmTile tile, cudaStream_t stream) {
  switch (tile) {
    case MoeGemmTile::kSmall: launch_epilogue<W8A8Small, kPreQ>(p, stream); break;
    case MoeGemmTile::kMedium: launch_epilogue<W8A8Medium, kPreQ>(p, stream); break;
    default: launch_epilogue<W8A8Large, kPreQ>(p, stream); break;  // the large tiles
  }
}

template <class Cfg>
void raise_all() {
  moe_gemm_raise_smem<W8A8Ops<Cfg, false>, false>();
  moe_gemm_raise_smem<W8A8Ops<Cfg, false>, true>();
  moe_gemm_raise_smem<W8A8Ops<Cfg, true>, false>();
  moe_gemm_raise_smem<W8A8Ops<Cfg, true>, true>();
}

void moe_gemm_w8a8_launch(MoeGemmParams const& p, MoeGemmTile tile, cudaStream_t stream) {
  if (p.x_fp8 != nullptr) {
    launch_tiles<true>(p, tile, stream);
  } else {
    launch_tiles<false>(p, tile, stream);
  }
}

void moe_gemm_w8a8_prepare() {
  raise_all<W8A8Small>();
  raise_all<W8A8Medium>();
  raise_all<W8A8Large>();
}

}  // namespace tandem::cuda::moe_gemm_detail
