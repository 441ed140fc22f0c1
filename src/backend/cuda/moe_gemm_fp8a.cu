// Grouped expert GEMM on the FP8 tensor cores (W8A8): E4M3 weights x E4M3 activations, see
// moe_gemm.h (MoeGemmParams::fp8_activations) and fp8_linear.h (the numerics).
//
// The CTA / grid layout, row-tile scan, gather, PDL and epilogues of moe_gemm_fp8.cu; what
// differs is the A operand and the MMA:
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
#include <atomic>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm_fp8.h"

namespace tandem::cuda::moe_gemm_detail {

namespace {

template <int kBM, int kBN, int kWarpsM, int kWarpsN, int kStages, int kMinBlocks>
struct W8A8Tile {
  static constexpr int BM = kBM, BN = kBN, BK = 128, kWarpsN_ = kWarpsN, kStagesN = kStages;
  static constexpr int kMinBlocksPerSm = kMinBlocks;
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kWM = BM / kWarpsM, kWN = BN / kWarpsN;
  static constexpr int kMI = kWM / 16, kNI = kWN / 8;
  static constexpr int kLdA = BK + 8;  // bf16 elements (272 bytes: 16 mod 128)
  static constexpr int kStageABytes = BM * kLdA * 2, kStageBBytes = BN * BK;  // bytes
  static constexpr int kQABytes = BM * BK;                                    // E4M3 A buffer
  static constexpr size_t kSmemBytes =
      size_t{kStages} * (kStageABytes + kStageBBytes) + kQABytes + BM * sizeof(float);
  static constexpr int kChunksA = BM * BK / 8, kChunksB = BN * BK / 16;  // 16-byte chunks
  // Pre-quantized A (MoeGemmParams::x_fp8): E4M3 stages of BM x 128 bytes, no bf16 stages.
  static constexpr int kChunksAQ = BM * BK / 16;
  static constexpr size_t kSmemBytesPreQ = size_t{kStages} * (kQABytes + kStageBBytes);
  static constexpr int kQuantRows = kThreads / 16;  // rows per quant pass
  static_assert(BM % (16 * kWarpsM) == 0, "warp tile rows: multiple of 16");
  static_assert(kWN % (2 * kMoeGateUpInterleave) == 0, "a warp holds whole gate/up pairs");
  static_assert(kChunksA % kThreads == 0 && kChunksB % kThreads == 0, "whole chunks per thread");
  static_assert(BM % kQuantRows == 0, "whole quant passes");
  static_assert(kChunksAQ % kThreads == 0, "whole E4M3 A chunks per thread");
  static_assert(BK == kFp8BlockK, "one K tile per scale block");
};

using W8A8Small = W8A8Tile<16, 32, 1, 2, 6, 1>;
using W8A8Medium = W8A8Tile<64, 64, 2, 2, 4, 1>;
using W8A8Large = W8A8Tile<128, 128, 2, 4, 3, 1>;

__device__ __forceinline__ uint32_t smem_addr(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, void const* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint4 lds128(void const* p) { return *static_cast<uint4 const*>(p); }
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
__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }
__device__ __forceinline__ uint32_t word(uint4 const& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
// Two floats -> two E4M3 codes (lo in bits 0..7), rounded to nearest even, satfinite.
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  return static_cast<uint32_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// kPreQ: the activations come quantized (p.x_fp8 / p.x_scale, fp8_quantize_rows_launch), loaded
// by cp.async straight into E4M3 stages; no quant pass, one barrier per K tile.
template <class Cfg, bool kSilu, bool kPreQ>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    moe_gemm_w8a8_kernel(MoeGemmParams p, int n_tiles) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kLdA = Cfg::kLdA;
  constexpr int kStages = Cfg::kStagesN, kThreads = Cfg::kThreads;
  constexpr int kMI = Cfg::kMI, kNI = Cfg::kNI;
  extern __shared__ uint4 smem_u4[];
  __shared__ int sExpert, sRow0, sRows;
  __shared__ int64_t sXRow[BM];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (p.pdl == MoeGemmPdl::kWaitFirst) asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (p.pdl != MoeGemmPdl::kPrefetchWeights) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
  const int m_slot = static_cast<int>(blockIdx.x / n_tiles);
  const int n_tile = static_cast<int>(blockIdx.x % n_tiles);

  // 1. Row-tile slot -> (expert, first row, rows), as moe_gemm_fp8.cu.
  if (warp == 0) {
    const int E = p.expert_offsets == nullptr ? 1 : static_cast<int>(p.num_experts);
    int base = 0;
    bool found = false;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      int start = 0, count = 0;
      if (e < E) {
        if (p.expert_offsets == nullptr) {
          count = static_cast<int>(p.max_rows);
        } else {
          start = p.expert_offsets[e];
          count = p.expert_offsets[e + 1] - start;
        }
      }
      const int tiles = (count + BM - 1) / BM;
      int incl = tiles;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const int first = base + incl - tiles;
      const bool mine = m_slot >= first && m_slot < first + tiles;
      const unsigned who = __ballot_sync(0xffffffffu, mine);
      if (who != 0) {
        if (mine) {
          const int r = (m_slot - first) * BM;
          sExpert = e;
          sRow0 = start + r;
          sRows = min(BM, count - r);
        }
        found = true;
        break;
      }
      base += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (!found && lane == 0) sExpert = -1;
  }
  __syncthreads();
  const int expert = sExpert;
  if (expert < 0) {
    if (p.pdl == MoeGemmPdl::kPrefetchWeights) {
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
    }
    return;
  }
  const int row0 = sRow0, rows = sRows;
  const int K = static_cast<int>(p.k), N = static_cast<int>(p.n);
  const int KB = static_cast<int>(fp8_row_scale_cols(p.k));
  const int n0 = n_tile * BN;
  const int n_rows = min(BN, N - n0);

  const int gather_div = static_cast<int>(p.gather_div);
  for (int r = tid; r < rows; r += kThreads) {
    const int64_t src =
        p.gather_src != nullptr ? p.gather_src[row0 + r] / gather_div : int64_t{row0} + r;
    sXRow[r] = src;
  }
  __syncthreads();
  uint8_t const* gW = p.w_fp8 + (static_cast<int64_t>(expert) * N + n0) * K;
  float const* gS = p.w_scale + (static_cast<int64_t>(expert) * N + n0) * KB;
  uint8_t* smem = reinterpret_cast<uint8_t*>(smem_u4);
  // Not kPreQ: bf16 A stages, B stages, one E4M3 A buffer + its row scales. kPreQ: E4M3 A
  // stages (at sQA + stage * kQABytes), B stages.
  bf16* sA = reinterpret_cast<bf16*>(smem);
  uint8_t* sB = kPreQ ? smem + kStages * Cfg::kQABytes : smem + kStages * Cfg::kStageABytes;
  uint8_t* sQA = kPreQ ? smem : sB + kStages * Cfg::kStageBBytes;  // [BM][128] E4M3
  float* sAScale = reinterpret_cast<float*>(sQA + Cfg::kQABytes);  // [BM] (not kPreQ)

  const int k_tiles = (K + BK - 1) / BK;
  auto load_stage_a = [&](int stage, int kt) {
    const int k0 = kt * BK;
    if constexpr (kPreQ) {
      uint8_t* sAs = sQA + stage * Cfg::kQABytes;
#pragma unroll
      for (int i = 0; i < Cfg::kChunksAQ / kThreads; ++i) {
        const int c = tid + i * kThreads;
        const int r = c / (BK / 16), chunk = c % (BK / 16), col = chunk * 16;
        if (r >= rows) continue;  // rows past the real ones: their outputs are never stored
        const bool ok = k0 + col < K;
        cp_async16(sAs + r * BK + (chunk ^ (r & 1)) * 16,
                   ok ? p.x_fp8 + sXRow[r] * K + k0 + col : p.x_fp8, ok);
      }
    } else {
      bf16* sAs = sA + stage * (BM * kLdA);
#pragma unroll
      for (int i = 0; i < Cfg::kChunksA / kThreads; ++i) {
        const int c = tid + i * kThreads;
        const int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
        if (r >= rows) continue;  // never read: the quant pass skips rows past the real ones
        const bool ok = k0 + col < K;
        cp_async16(sAs + r * kLdA + col, ok ? p.x + sXRow[r] * K + k0 + col : p.x, ok);
      }
    }
  };
  auto load_stage_b = [&](int stage, int kt) {
    const int k0 = kt * BK;
    uint8_t* sBs = sB + stage * Cfg::kStageBBytes;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksB / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / (BK / 16), chunk = c % (BK / 16), col = chunk * 16;
      const bool ok = r < n_rows && k0 + col < K;
      cp_async16(sBs + r * BK + (chunk ^ (r & 1)) * 16,
                 ok ? gW + static_cast<int64_t>(r) * K + k0 + col : p.w_fp8, ok);
    }
  };

  if (p.pdl == MoeGemmPdl::kPrefetchWeights) {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage_b(s, s);
    }
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) load_stage_a(s, s);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) {
        load_stage_a(s, s);
        load_stage_b(s, s);
      }
      cp_async_commit();
    }
  }

  const int wm = warp / Cfg::kWarpsN_, wn = warp % Cfg::kWarpsN_;
  const int g = lane >> 2, t = lane & 3;
  float acc[kMI][kNI][4], blk[kMI][kNI][4];
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[mi][ni][v] = blk[mi][ni][v] = 0.f;

  // The weight scales of this thread's accumulator columns (n = 8 ni + 2 t + j), current block.
  float sc[kNI][2];
  auto load_scales = [&](int kb) {
#pragma unroll
    for (int ni = 0; ni < kNI; ++ni) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = wn * Cfg::kWN + ni * 8 + 2 * t + j;
        sc[ni][j] = n < n_rows ? __ldg(gS + static_cast<int64_t>(n) * KB + kb) : 0.f;
      }
    }
  };
  load_scales(0);
  // kPreQ: this thread's rows' activation scales (rows a_row + 16 mi + 8 h), current block.
  float sa_next[kMI][2];
  auto load_act_scales = [&](int kb) {
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wm * Cfg::kWM + g + mi * 16 + 8 * h;
        sa_next[mi][h] = r < rows ? __ldg(p.x_scale + sXRow[r] * KB + kb) : 0.f;
      }
    }
  };
  if constexpr (kPreQ) load_act_scales(0);

  const int a_row = wm * Cfg::kWM + g;           // + 16 mi (+ 8)
  const int b_row = wn * Cfg::kWN + g;           // + 8 ni
  const int q_row = tid / 16, q_col = tid % 16;  // quant pass: 8 columns of one row
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt landed; every warp is done with sQA / sAScale of tile kt - 1
    const int next = kt + kStages - 1;
    if (next < k_tiles) {
      load_stage_a(next % kStages, next);
      load_stage_b(next % kStages, next);
    }
    cp_async_commit();

    // 2. Quantize the stage's real rows: per row, s = amax / 448, q = e4m3(x * 448 / amax).
    if constexpr (!kPreQ) {
      bf16 const* sAs = sA + (kt % kStages) * (BM * kLdA);
      for (int rb = 0; rb < rows; rb += Cfg::kQuantRows) {  // uniform across the CTA
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

    // 3. The tile's MMAs: 4 k steps of 32, two 16-byte chunks per operand row.
    uint8_t const* sBs = sB + (kt % kStages) * Cfg::kStageBBytes;
    uint8_t const* sAq = kPreQ ? sQA + (kt % kStages) * Cfg::kQABytes : sQA;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint4 a[kMI][2], b[kNI];
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = a_row + mi * 16 + 8 * h;
          a[mi][h] = lds128(sAq + r * BK + (((2 * t + c) ^ (r & 1)) * 16));
        }
      }
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni) {
        const int r = b_row + ni * 8;
        b[ni] = lds128(sBs + r * BK + (((2 * t + c) ^ (r & 1)) * 16));
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
    {
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
        load_scales(kt + 1);
        if constexpr (kPreQ) load_act_scales(kt + 1);
      }
    }
  }
  cp_async_wait<0>();

  // 4. Epilogue, as moe_gemm.cu: accumulator (mi, ni)[2 h + v] is row 16 mi + g + 8 h, column
  // 8 ni + 2 t + v of the warp tile.
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * Cfg::kWM + mi * 16 + g + 8 * h;
      if (r >= rows) continue;
      const int64_t grow = static_cast<int64_t>(row0) + r;
      if constexpr (!kSilu) {
        bf16* gY = p.y + grow * N;
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni) {
          const int col = n0 + wn * Cfg::kWN + ni * 8 + 2 * t;
          if (col < N) {
            *reinterpret_cast<__nv_bfloat162*>(gY + col) =
                __floats2bfloat162_rn(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
          }
        }
      } else {
        const int inter = N / 2;
        bf16* gY = p.y + grow * inter;
#pragma unroll
        for (int np = 0; np < kNI / 2; ++np) {
          const int pcol = n0 + wn * Cfg::kWN + np * 16;
          if (pcol < N) {
            const int col = (pcol / 16) * 8 + 2 * t;
            const float y0 = silu(acc[mi][2 * np][2 * h]) * acc[mi][2 * np + 1][2 * h];
            const float y1 = silu(acc[mi][2 * np][2 * h + 1]) * acc[mi][2 * np + 1][2 * h + 1];
            *reinterpret_cast<__nv_bfloat162*>(gY + col) = __floats2bfloat162_rn(y0, y1);
          }
        }
      }
    }
  }
}

template <class Cfg, bool kSilu, bool kPreQ>
void raise_smem() {
  constexpr size_t kBytes = kPreQ ? Cfg::kSmemBytesPreQ : Cfg::kSmemBytes;
  if constexpr (kBytes > 48 * 1024) {
    static std::atomic<uint64_t> raised{0};
    int dev = 0;
    TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= 64 || !((raised.load(std::memory_order_relaxed) >> dev) & 1u)) {
      TANDEM_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_w8a8_kernel<Cfg, kSilu, kPreQ>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(kBytes)));
      if (dev < 64) raised.fetch_or(uint64_t{1} << dev, std::memory_order_relaxed);
    }
  }
}

template <class Cfg, bool kSilu, bool kPreQ>
void launch_tile(MoeGemmParams const& p, cudaStream_t stream) {
  const int64_t n_tiles = (p.n + Cfg::BN - 1) / Cfg::BN;
  const int64_t m_tiles =
      p.expert_offsets == nullptr
          ? (p.max_rows + Cfg::BM - 1) / Cfg::BM
          : std::min(p.max_rows, p.max_rows / Cfg::BM + std::min(p.num_experts, p.max_rows));
  const int64_t blocks = m_tiles * n_tiles;
  TANDEM_CHECK(blocks <= INT32_MAX, "moe_gemm (fp8 w8a8): grid too large: ", blocks);
  auto kernel = moe_gemm_w8a8_kernel<Cfg, kSilu, kPreQ>;
  raise_smem<Cfg, kSilu, kPreQ>();
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(Cfg::kThreads);
  cfg.dynamicSmemBytes = kPreQ ? Cfg::kSmemBytesPreQ : Cfg::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = p.pdl != MoeGemmPdl::kOff ? 1 : 0;
  TANDEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, static_cast<int>(n_tiles)));
  TANDEM_CUDA_CHECK_LAUNCH();
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
  raise_smem<Cfg, false, false>();
  raise_smem<Cfg, true, false>();
  raise_smem<Cfg, false, true>();
  raise_smem<Cfg, true, true>();
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
