// Grouped expert GEMM with E4M3 weights (W8A16). See moe_gemm.h (MoeGemmParams::w_fp8) and
// fp8_linear.h.
//
// The CTA / grid layout, row-tile scan, gather, PDL and epilogues of moe_gemm.cu; what differs
// is the weight operand:
//   - the K tile is one 128-deep scale block; the B tile in shared memory is E4M3 (BN x 128
//     bytes per stage), filled by 16-byte cp.async, 16-byte chunk c of row r stored at chunk
//     c ^ 4 (r & 1) (bank-conflict-free reads below);
//   - no ldmatrix: per 64-deep half of the tile a thread reads the 16 codes of its n row
//     (g = lane / 4) at bytes [16 t, 16 t + 16) of the half (t = lane % 4), converts them to
//     bf16 in registers (fp8_dequant.cuh) and uses bytes 4 s .. 4 s + 3 as the B fragment of
//     k step s. That permutes K inside the half (mma k 2t + j + 8h <-> column 16 t + 4 s +
//     2 h + j), so the A fragments are read with the same permutation (16-byte loads of row g
//     at elements 16 t .. 16 t + 15 of the half: conflict-free with the 272-byte row stride);
//   - the tile's MMAs accumulate into a second accumulator, added to the output accumulator
//     times the block's scale of each column (n) at the end of the tile;
//   - MXFP8 (kMx, p.w_e8m0): the 16 codes a thread converts lie in one 32-deep scale block, whose
//     E8M0 code becomes the conversion's multiplier (fp8_dequant.cuh); the tile's sums are added
//     unscaled.
// Tiles: small 16 x 32 (6 stages, 2 warps), medium 64 x 64 (3 stages, 4 warps), large
// 128 x 128 (3 stages, 8 warps, 1 CTA / SM), picked as moe_gemm_pick_tile picks; a dense
// matrix (no offsets) takes the small tile up to 128 rows (more CTAs).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_dequant.cuh"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm_fp8.h"
#include "core/env.h"

namespace tandem::cuda::moe_gemm_detail {

namespace {

// kWarpsK 2: two warps per warp tile, one per 64-deep half of every K tile (twice the warps
// per SM for the latency-bound decode shapes), their sums added through shared memory.
template <int kBM, int kBN, int kWarpsM, int kWarpsN, int kStages, int kMinBlocks, int kWarpsK = 1>
struct Fp8Tile {
  static constexpr int BM = kBM, BN = kBN, BK = 128, kWarpsN_ = kWarpsN, kStagesN = kStages;
  static constexpr int kWarpsM_ = kWarpsM, kWarpsK_ = kWarpsK;
  static_assert(kWarpsK == 1 || kWarpsK == 2, "K halves per tile");
  static constexpr int kMinBlocksPerSm = kMinBlocks;
  static constexpr int kThreads = kWarpsM * kWarpsN * kWarpsK * 32;
  static constexpr int kWM = BM / kWarpsM, kWN = BN / kWarpsN;
  static constexpr int kMI = kWM / 16, kNI = kWN / 8;
  static constexpr int kLdA = BK + 8;  // bf16 elements (272 bytes: 16 mod 128)
  static constexpr int kStageABytes = BM * kLdA * 2, kStageBBytes = BN * BK;  // bytes
  static constexpr size_t kSmemBytes = size_t{kStages} * (kStageABytes + kStageBBytes);
  static constexpr int kChunksA = BM * BK / 8, kChunksB = BN * BK / 16;  // 16-byte chunks
  static_assert(BM % (16 * kWarpsM) == 0, "warp tile rows: multiple of 16");
  static_assert(kWN % (2 * kMoeGateUpInterleave) == 0, "a warp holds whole gate/up pairs");
  static_assert(kChunksA % kThreads == 0 && kChunksB % kThreads == 0, "whole chunks per thread");
  static_assert(BK == kFp8BlockK, "one K tile per scale block");
};

using Fp8Small = Fp8Tile<16, 32, 1, 2, 6, 1>;
using Fp8SmallK2 = Fp8Tile<16, 32, 1, 2, 6, 1, 2>;
using Fp8Medium = Fp8Tile<64, 64, 2, 2, 3, 1>;
using Fp8Large = Fp8Tile<128, 128, 2, 4, 3, 1>;

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
// A plain load (not asm): the compiler may schedule it early, after the barrier before it.
__device__ __forceinline__ uint4 lds128(void const* p) { return *static_cast<uint4 const*>(p); }
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  // Not volatile: a pure function of its operands, free to be scheduled around the loads.
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }
__device__ __forceinline__ uint32_t word(uint4 const& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <class Cfg, bool kSilu, bool kMx>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    moe_gemm_fp8_kernel(MoeGemmParams p, int n_tiles) {
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

  // 1. Row-tile slot -> (expert, first row, rows), as moe_gemm.cu; no offsets: one dense expert.
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
    sXRow[r] = src * K;
  }
  __syncthreads();
  uint8_t const* gW = p.w_fp8 + (static_cast<int64_t>(expert) * N + n0) * K;
  float const* gS = kMx ? nullptr : p.w_scale + (static_cast<int64_t>(expert) * N + n0) * KB;
  const int KE = static_cast<int>(mxfp8_scale_cols(p.k));
  uint8_t const* gE = kMx ? p.w_e8m0 + (static_cast<int64_t>(expert) * N + n0) * KE : nullptr;
  uint8_t* smem = reinterpret_cast<uint8_t*>(smem_u4);
  bf16* sA = reinterpret_cast<bf16*>(smem);
  uint8_t* sB = smem + kStages * Cfg::kStageABytes;

  const int k_tiles = (K + BK - 1) / BK;
  auto load_stage_a = [&](int stage, int kt) {
    const int k0 = kt * BK;
    bf16* sAs = sA + stage * (BM * kLdA);
#pragma unroll
    for (int i = 0; i < Cfg::kChunksA / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
      const bool ok = r < rows && k0 + col < K;
      cp_async16(sAs + r * kLdA + col, ok ? p.x + sXRow[r] + k0 + col : p.x, ok);
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
      // Swizzled: chunk ^ 4 on odd rows, so that rows g and g + 1 of one read fall in
      // different banks.
      cp_async16(sBs + r * BK + (chunk ^ ((r & 1) << 2)) * 16,
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

  constexpr int kTileWarps = Cfg::kWarpsM_ * Cfg::kWarpsN_;
  const int wk = warp / kTileWarps, wt = warp % kTileWarps;
  const int wm = wt / Cfg::kWarpsN_, wn = wt % Cfg::kWarpsN_;
  const int g = lane >> 2, t = lane & 3;
  float acc[kMI][kNI][4], blk[kMI][kNI][4];
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[mi][ni][v] = blk[mi][ni][v] = 0.f;

  // The scales of this thread's accumulator columns (n = 8 ni + 2 t + j) in the current block.
  float sc[kNI][2];
  auto load_scales = [&](int kb) {
#pragma unroll
    for (int ni = 0; ni < kNI; ++ni) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = wn * Cfg::kWN + ni * 8 + 2 * t + j;
        if constexpr (kMx) {
          sc[ni][j] = 1.f;
        } else {
          sc[ni][j] = n < n_rows ? __ldg(gS + static_cast<int64_t>(n) * KB + kb) : 0.f;
        }
      }
    }
  };
  load_scales(0);

  const int a_row = wm * Cfg::kWM + g;  // + 16 mi (+ 8)
  const int b_row = wn * Cfg::kWN + g;  // + 8 ni
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < k_tiles) {
      load_stage_a(next % kStages, next);
      load_stage_b(next % kStages, next);
    }
    cp_async_commit();

    bf16 const* sAs = sA + (kt % kStages) * (BM * kLdA);
    uint8_t const* sBs = sB + (kt % kStages) * Cfg::kStageBBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the two 64-deep halves of the tile
      if (Cfg::kWarpsK_ == 2 && h != wk) continue;
      uint4 bq[kNI];
      uint32_t bmul[kNI];  // kMx: the conversion multiplier of row r's 32-deep block
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni) {
        const int r = b_row + ni * 8;
        bq[ni] = lds128(sBs + r * BK + (((4 * h + t) ^ ((r & 1) << 2)) * 16));
        if constexpr (kMx) {
          const int kcol = kt * BK + 64 * h + 16 * t;
          const bool ok = r < n_rows && kcol < K;
          bmul[ni] = detail::e8m0_bf16x2_mul(
              ok ? __ldg(gE + static_cast<int64_t>(r) * KE + kcol / kMxfp8BlockK) : 127u);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint4 a[kMI][2];
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi) {
          const int col = 64 * h + t * 16 + half * 8;
          a[mi][0] = lds128(sAs + (a_row + mi * 16) * kLdA + col);
          a[mi][1] = lds128(sAs + (a_row + mi * 16 + 8) * kLdA + col);
        }
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
          const int s = 2 * half + sub;
          uint32_t b[kNI][2];
#pragma unroll
          for (int ni = 0; ni < kNI; ++ni) {
            if constexpr (kMx) {
              detail::e4m3x4_to_bf16_mx(word(bq[ni], s), bmul[ni], b[ni][0], b[ni][1]);
            } else {
              detail::e4m3x4_to_bf16(word(bq[ni], s), b[ni][0], b[ni][1]);
            }
          }
#pragma unroll
          for (int mi = 0; mi < kMI; ++mi) {
            const uint32_t a0 = word(a[mi][0], 2 * sub), a1 = word(a[mi][1], 2 * sub);
            const uint32_t a2 = word(a[mi][0], 2 * sub + 1), a3 = word(a[mi][1], 2 * sub + 1);
#pragma unroll
            for (int ni = 0; ni < kNI; ++ni) {
              mma_bf16(blk[mi][ni], a0, a1, a2, a3, b[ni][0], b[ni][1]);
            }
          }
        }
      }
    }
    // End of the tile (a 128-deep scale block): scale its sums into the output.
    {
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            acc[mi][ni][v] = fmaf(sc[ni][v & 1], blk[mi][ni][v], acc[mi][ni][v]);
            blk[mi][ni][v] = 0.f;
          }
      if (kt + 1 < k_tiles) load_scales(kt + 1);
    }
  }
  cp_async_wait<0>();
  if constexpr (Cfg::kWarpsK_ == 2) {
    // The second K half's sums to the first's warps (the stages are free once all arrived).
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem_u4);
    constexpr int kPer = kMI * kNI * 4;
    if (wk == 1) {
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            red[(wt * kPer + (mi * kNI + ni) * 4 + v) * 32 + lane] = acc[mi][ni][v];
          }
    }
    __syncthreads();
    if (wk == 1) return;
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          acc[mi][ni][v] += red[(wt * kPer + (mi * kNI + ni) * 4 + v) * 32 + lane];
        }
  }

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

template <class Cfg, bool kSilu, bool kMx>
void raise_smem_one() {
  if constexpr (Cfg::kSmemBytes > 48 * 1024) {
    static std::atomic<uint64_t> raised{0};
    int dev = 0;
    TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= 64 || !((raised.load(std::memory_order_relaxed) >> dev) & 1u)) {
      TANDEM_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_fp8_kernel<Cfg, kSilu, kMx>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(Cfg::kSmemBytes)));
      if (dev < 64) raised.fetch_or(uint64_t{1} << dev, std::memory_order_relaxed);
    }
  }
}

template <class Cfg, bool kSilu>
void raise_smem() {
  raise_smem_one<Cfg, kSilu, false>();
  raise_smem_one<Cfg, kSilu, true>();
}

template <class Cfg, bool kSilu>
void launch_tile(MoeGemmParams const& p, cudaStream_t stream) {
  const int64_t n_tiles = (p.n + Cfg::BN - 1) / Cfg::BN;
  const int64_t m_tiles =
      p.expert_offsets == nullptr
          ? (p.max_rows + Cfg::BM - 1) / Cfg::BM
          : std::min(p.max_rows, p.max_rows / Cfg::BM + std::min(p.num_experts, p.max_rows));
  const int64_t blocks = m_tiles * n_tiles;
  TANDEM_CHECK(blocks <= INT32_MAX, "moe_gemm (fp8): grid too large: ", blocks);
  const bool mx = p.w_e8m0 != nullptr;
  auto kernel = mx ? moe_gemm_fp8_kernel<Cfg, kSilu, true> : moe_gemm_fp8_kernel<Cfg, kSilu, false>;
  if (mx) {
    raise_smem_one<Cfg, kSilu, true>();
  } else {
    raise_smem_one<Cfg, kSilu, false>();
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(Cfg::kThreads);
  cfg.dynamicSmemBytes = Cfg::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = p.pdl != MoeGemmPdl::kOff ? 1 : 0;
  TANDEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, static_cast<int>(n_tiles)));
  TANDEM_CUDA_CHECK_LAUNCH();
}

template <class Cfg>
void launch_epilogue(MoeGemmParams const& p, cudaStream_t stream) {
  switch (p.epilogue) {
    case MoeGemmEpilogue::kPlain: launch_tile<Cfg, false>(p, stream); break;
    case MoeGemmEpilogue::kSiluMul: launch_tile<Cfg, true>(p, stream); break;
    default: TANDEM_THROW(kUnsupported, "moe_gemm (fp8): unsupported epilogue");
  }
}

bool aligned(void const* p, uintptr_t b) { return reinterpret_cast<uintptr_t>(p) % b == 0; }

// The small tile with two warps per warp tile along K (default), or one (TANDEM_FP8_SPLITK=0:
// for measuring the two).
bool small_split_k() {
  static const bool on = env::flag("TANDEM_FP8_SPLITK", true);
  return on;
}

}  // namespace

void moe_gemm_fp8_launch(MoeGemmParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.max_rows >= 0 && p.num_experts >= 1 && p.n > 0 && p.k > 0,
               "moe_gemm (fp8): bad sizes: max_rows ", p.max_rows, " experts ", p.num_experts,
               " n ", p.n, " k ", p.k);
  TANDEM_CHECK(p.expert_offsets != nullptr || p.num_experts == 1,
               "moe_gemm (fp8): no expert_offsets needs num_experts 1, got ", p.num_experts);
  if (p.k % 16 != 0 || p.n % 8 != 0 ||
      (p.epilogue == MoeGemmEpilogue::kSiluMul && p.n % (2 * kMoeGateUpInterleave) != 0)) {
    TANDEM_THROW(kUnsupported, "moe_gemm (fp8): unsupported n ", p.n, " / k ", p.k,
                 " (k % 16, n % 8, silu-mul n % 16)");
  }
  TANDEM_CHECK(p.n <= INT32_MAX / 2 && p.k <= INT32_MAX / 2 && p.max_rows <= INT32_MAX / 2 &&
                   p.num_experts * p.n * fp8_row_scale_cols(p.k) <= INT64_MAX / 8,
               "moe_gemm (fp8): too large");
  TANDEM_CHECK(p.gather_div >= 1 && p.gather_div <= INT32_MAX, "moe_gemm (fp8): bad gather_div ",
               p.gather_div);
  TANDEM_CHECK(p.w_scale != nullptr || p.w_e8m0 != nullptr,
               "moe_gemm (fp8): w_scale and w_e8m0 are null");
  TANDEM_CHECK_KIND(kUnsupported, p.w_e8m0 == nullptr || !p.fp8_activations,
                    "moe_gemm (fp8): MXFP8 scales (w_e8m0) with FP8 activations (W8A8 takes "
                    "per-128 scales)");
  TANDEM_CHECK(
      aligned(p.x, 16) && aligned(p.w_fp8, 16) && aligned(p.y, 16) && aligned(p.w_scale, 4),
      "moe_gemm (fp8): x, w_fp8, y must be 16-byte aligned");
  if (p.max_rows == 0) return;
  MoeGemmTile tile =
      p.tile == MoeGemmTile::kAuto ? moe_gemm_pick_tile(p.max_rows, p.num_experts) : p.tile;
  if (p.tile == MoeGemmTile::kAuto && p.expert_offsets == nullptr && p.max_rows <= 128) {
    tile = MoeGemmTile::kSmall;
  }
  if (p.fp8_activations) {
    TANDEM_CHECK((p.x_fp8 == nullptr) == (p.x_scale == nullptr) && aligned(p.x_fp8, 16) &&
                     aligned(p.x_scale, 4),
                 "moe_gemm (fp8): x_fp8 and x_scale go together, x_fp8 16-byte aligned");
    moe_gemm_w8a8_launch(p, tile, stream);
    return;
  }
  switch (tile) {
    case MoeGemmTile::kSmall:
      if (small_split_k()) {
        launch_epilogue<Fp8SmallK2>(p, stream);
      } else {
        launch_epilogue<Fp8Small>(p, stream);
      }
      break;
    case MoeGemmTile::kMedium: launch_epilogue<Fp8Medium>(p, stream); break;
    default: launch_epilogue<Fp8Large>(p, stream); break;  // the large tiles
  }
}

void moe_gemm_fp8_prepare() {
  raise_smem<Fp8Small, false>();
  raise_smem<Fp8Small, true>();
  raise_smem<Fp8SmallK2, false>();
  raise_smem<Fp8SmallK2, true>();
  raise_smem<Fp8Medium, false>();
  raise_smem<Fp8Medium, true>();
  raise_smem<Fp8Large, false>();
  raise_smem<Fp8Large, true>();
  moe_gemm_w8a8_prepare();
}

}  // namespace tandem::cuda::moe_gemm_detail
