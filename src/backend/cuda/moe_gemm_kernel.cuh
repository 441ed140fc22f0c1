// The grouped expert GEMM's one mma.sync kernel template (moe_gemm.h), shared by the bf16
// (moe_gemm.cu), W8A16 (moe_gemm_fp8.cu) and W8A8 (moe_gemm_fp8a.cu) variants. Included by those
// .cu files only.
//
// One CTA computes a BM x BN tile of one expert's output. The 1-D grid enumerates (row-tile slot,
// N tile) with the N tile fastest, so the CTAs that run together share the x rows of one row tile
// (read once from HBM) and consecutive row tiles of one expert reuse its weight tiles from L2.
// Row-tile slot s maps to (expert, row tile) by a warp scan over ceil(count_e / BM) read from the
// device offsets; slots past the last real tile exit.
//
// moe_gemm_mma_kernel<Ops, kSilu, kDense> writes once what every variant does: programmatic
// dependent launch, the row-tile scan, the row gather, the cp.async pipeline (prologue and main
// loop) and the epilogue (plain or fused SiLU-mul). The operand policy Ops (one per variant)
// says what the stages hold and how a K tile is multiplied:
//   using Cfg = MmaTileShape<...>;                   // tile, warps, stages
//   static constexpr bool kNoOffsets;                // offsets may be null (one dense expert)
//   static constexpr bool kXRowTimesK;               // MoeTile::x_row holds row * K (else row)
//   static constexpr size_t kSmemBytes;              // dynamic shared memory
//   Ops(MoeGemmParams const&, MoeTile const&);
//   void load_a(int stage, int kt), load_b(int stage, int kt);  // cp.async, no commit
//   void begin();                                    // before the main loop
//   void compute(int stage, int kt, int k_tiles, float (&acc)[kMI][kNI][4]);
//   bool finish(float (&acc)[kMI][kNI][4]);          // after the loop; false: no epilogue
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/moe_gemm.h"

namespace tandem::cuda::moe_gemm_detail {

__device__ __forceinline__ uint32_t smem_addr(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte async copy; valid false fills the destination with zeros (rows/k past the end).
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
__device__ __forceinline__ uint32_t word(uint4 const& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

/// The CTA tile: BM x BN outputs, K tiles of BK, kWarpsM x kWarpsN warp tiles (kWarpsK warps
/// each, one per K half: their sums are added by the policy's finish()), kStages cp.async stages.
template <int kBM, int kBN, int kBK, int kWarpsM, int kWarpsN, int kStages, int kMinBlocks,
          int kWarpsK = 1>
struct MmaTileShape {
  static constexpr int BM = kBM, BN = kBN, BK = kBK, kStagesN = kStages;
  static constexpr int kWarpsM_ = kWarpsM, kWarpsN_ = kWarpsN, kWarpsK_ = kWarpsK;
  static constexpr int kMinBlocksPerSm = kMinBlocks;
  static constexpr int kThreads = kWarpsM * kWarpsN * kWarpsK * 32;
  static constexpr int kWM = BM / kWarpsM, kWN = BN / kWarpsN;  // warp tile
  static constexpr int kMI = kWM / 16, kNI = kWN / 8;           // mma tiles per warp
  static_assert(BM % (16 * kWarpsM) == 0, "warp tile rows: multiple of 16");
  static_assert(kWN % (2 * kMoeGateUpInterleave) == 0, "a warp holds whole gate/up pairs");
  static_assert(kStages >= 2, "pipeline depth");
};

/// What a CTA works on, for the operand policies.
struct MoeTile {
  int row0, rows;  // first permuted row, real rows (<= BM)
  int n0, n_rows;  // first output column (packed for kSiluMul), real columns (<= BN)
  int expert, K, N;
  int tid, lane;
  int wk, wt, wm, wn;    // the warp's K half, warp tile (wm * kWarpsN + wn), its row and column
  int64_t const* x_row;  // shared [BM]: each row's x row (times K where Ops::kXRowTimesK)
  uint8_t* smem;         // dynamic shared memory
};

/// bf16 x rows into one stage (BM x BK, row stride kLd elements), zeros past rows / K.
template <class Cfg, int kLd>
__device__ __forceinline__ void load_x_bf16(bf16* sAs, MoeGemmParams const& p, MoeTile const& t,
                                            int k0) {
  constexpr int BK = Cfg::BK, kThreads = Cfg::kThreads, kChunks = Cfg::BM * BK / 8;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = t.tid + i * kThreads;
    const int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
    const bool ok = r < t.rows && k0 + col < t.K;
    cp_async16(sAs + r * kLd + col, ok ? p.x + t.x_row[r] + k0 + col : p.x, ok);
  }
}

/// E4M3 weight rows into one stage (BN x BK bytes): 16-byte chunk c of row r stored at chunk
/// c ^ (kSwizzle (r & 1)), zeros past n_rows / K.
template <class Cfg, int kSwizzle>
__device__ __forceinline__ void load_w_e4m3(uint8_t* sBs, uint8_t const* gW, MoeGemmParams const& p,
                                            MoeTile const& t, int k0) {
  constexpr int BK = Cfg::BK, kThreads = Cfg::kThreads, kChunks = Cfg::BN * BK / 16;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = t.tid + i * kThreads;
    const int r = c / (BK / 16), chunk = c % (BK / 16), col = chunk * 16;
    const bool ok = r < t.n_rows && k0 + col < t.K;
    cp_async16(sBs + r * BK + (chunk ^ ((r & 1) * kSwizzle)) * 16,
               ok ? gW + static_cast<int64_t>(r) * t.K + k0 + col : p.w_fp8, ok);
  }
}

/// The per-128 weight scales (block kb) of this thread's accumulator columns n = 8 ni + 2 t + j.
template <class Cfg>
__device__ __forceinline__ void load_w_scales(float (&sc)[Cfg::kNI][2], float const* gS, int KB,
                                              int kb, MoeTile const& t) {
#pragma unroll
  for (int ni = 0; ni < Cfg::kNI; ++ni) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int n = t.wn * Cfg::kWN + ni * 8 + 2 * (t.lane & 3) + j;
      sc[ni][j] = n < t.n_rows ? __ldg(gS + static_cast<int64_t>(n) * KB + kb) : 0.f;
    }
  }
}

// kDense (GemmLt's batch-invariant mode, bf16 weights only): the plain epilogue may write fp32
// (p.y_f32) and expert_offsets may be null (one dense expert of max_rows rows), as it may for
// every Ops with kNoOffsets. The default kernels compile without either.
template <class Ops, bool kSilu, bool kDense>
__global__ void __launch_bounds__(Ops::Cfg::kThreads, Ops::Cfg::kMinBlocksPerSm)
    moe_gemm_mma_kernel(MoeGemmParams p, int n_tiles) {
  using Cfg = typename Ops::Cfg;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK;
  constexpr int kStages = Cfg::kStagesN, kThreads = Cfg::kThreads;
  constexpr int kMI = Cfg::kMI, kNI = Cfg::kNI;
  constexpr bool kNoOffsets = kDense || Ops::kNoOffsets;
  extern __shared__ uint4 smem_u4[];
  __shared__ int sExpert, sRow0, sRows;
  __shared__ int64_t sXRow[BM];  // x row of each tile row (times K where Ops::kXRowTimesK)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Programmatic dependent launch: a kernel launched with programmatic stream serialization
  // after this one may start once every CTA of this grid has triggered (or exited). A CTA
  // triggers only once its own predecessors are known complete (at once when launched
  // normally, after griddepcontrol.wait otherwise), so that completion stays transitive.
  if (p.pdl == MoeGemmPdl::kWaitFirst) asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (p.pdl != MoeGemmPdl::kPrefetchWeights) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
  const int m_slot = static_cast<int>(blockIdx.x / n_tiles);
  const int n_tile = static_cast<int>(blockIdx.x % n_tiles);

  // 1. Row-tile slot -> (expert, first row, rows): warp 0 scans tile counts 32 experts at a time.
  if (warp == 0) {
    const bool dense = kNoOffsets && p.expert_offsets == nullptr;  // one expert of max_rows rows
    const int E = dense ? 1 : static_cast<int>(p.num_experts);
    int base = 0;  // row tiles of the experts before this chunk
    bool found = false;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      int start = 0, count = 0;
      if (e < E) {
        if (dense) {
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
      if (who != 0) {  // uniform over the warp
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
  if (expert < 0) {  // past the last row tile: uniform over the CTA
    // Under kPrefetchWeights still wait, so that this grid completes after its predecessor.
    if (p.pdl == MoeGemmPdl::kPrefetchWeights) {
      asm volatile("griddepcontrol.wait;\n" ::: "memory");
    }
    return;
  }
  const int row0 = sRow0, rows = sRows;
  const int K = static_cast<int>(p.k), N = static_cast<int>(p.n);
  const int n0 = n_tile * BN;

  // x row of each tile row: the permuted row itself, or the token it was gathered from.
  const int gather_div = static_cast<int>(p.gather_div);
  for (int r = tid; r < rows; r += kThreads) {
    const int64_t src =
        p.gather_src != nullptr ? p.gather_src[row0 + r] / gather_div : int64_t{row0} + r;
    sXRow[r] = Ops::kXRowTimesK ? src * K : src;
  }
  __syncthreads();

  constexpr int kTileWarps = Cfg::kWarpsM_ * Cfg::kWarpsN_;
  const int wk = Cfg::kWarpsK_ == 1 ? 0 : warp / kTileWarps;
  const int wt = Cfg::kWarpsK_ == 1 ? warp : warp % kTileWarps;
  const int wm = wt / Cfg::kWarpsN_, wn = wt % Cfg::kWarpsN_;
  Ops ops(p, MoeTile{row0, rows, n0, min(BN, N - n0), expert, K, N, tid, lane, wk, wt, wm, wn,
                     sXRow, reinterpret_cast<uint8_t*>(smem_u4)});

  // 2. Prologue: kStages - 1 k tiles in flight (a group is committed even when empty so the
  // wait count below stays exact).
  const int k_tiles = (K + BK - 1) / BK;
  if (p.pdl == MoeGemmPdl::kPrefetchWeights) {
    // Weight tiles first (they do not depend on the preceding kernel), then wait for it and
    // load x. Group 0 holds every prologue B tile and A tile 0; group s holds A tile s.
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) ops.load_b(s, s);
    }
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) ops.load_a(s, s);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_tiles) {
        ops.load_a(s, s);
        ops.load_b(s, s);
      }
      cp_async_commit();
    }
  }

  float acc[kMI][kNI][4];
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[mi][ni][v] = 0.f;
  ops.begin();

  // 3. Main loop: wait for k tile kt, refill the stage consumed last iteration, compute.
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < k_tiles) {
      ops.load_a(next % kStages, next);
      ops.load_b(next % kStages, next);
    }
    cp_async_commit();
    ops.compute(kt % kStages, kt, k_tiles, acc);
  }
  cp_async_wait<0>();
  if (!ops.finish(acc)) return;

  // 4. Epilogue. Accumulator (mi, ni)[2 h + v] is row 16 mi + g + 8 h, column 8 ni + 2 t + v of
  // the warp tile (g = lane / 4, t = lane % 4).
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * Cfg::kWM + mi * 16 + g + 8 * h;
      if (r >= rows) continue;
      const int64_t grow = static_cast<int64_t>(row0) + r;
      if constexpr (!kSilu) {
        if (kDense && p.y_f32 != nullptr) {  // fp32 out (uniform over the CTA)
          float* gF = p.y_f32 + grow * N;
#pragma unroll
          for (int ni = 0; ni < kNI; ++ni) {
            const int col = n0 + wn * Cfg::kWN + ni * 8 + 2 * t;
            if (col < N) {
              *reinterpret_cast<float2*>(gF + col) =
                  make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
            }
          }
          continue;
        }
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
        // n blocks 2 np (gate) and 2 np + 1 (up) are one interleave pair of the packed rows.
        const int inter = N / 2;
        bf16* gY = p.y + grow * inter;
#pragma unroll
        for (int np = 0; np < kNI / 2; ++np) {
          const int pcol = n0 + wn * Cfg::kWN + np * 16;  // packed column, multiple of 16
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

// Raises the dynamic shared memory limit of one kernel once per device (the limit is per
// device). The first launch normally runs eagerly, before any graph capture; MoeLayer's
// constructor also calls moe_gemm_prepare() so that a capture never is the first launch.
template <class Ops, bool kSilu, bool kDense = false>
void moe_gemm_raise_smem() {
  if constexpr (Ops::kSmemBytes > 48 * 1024) {
    static std::atomic<uint64_t> raised{0};  // bit d: done on device d
    int dev = 0;
    TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= 64 || !((raised.load(std::memory_order_relaxed) >> dev) & 1u)) {
      TANDEM_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_mma_kernel<Ops, kSilu, kDense>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(Ops::kSmemBytes)));
      if (dev < 64) raised.fetch_or(uint64_t{1} << dev, std::memory_order_relaxed);
    }
  }
}

/// Row-tile slots for p: ceil(max_rows / BM) for one dense expert (no offsets) where
/// exact_dense; otherwise the bound sum_e ceil(c_e / BM) <= floor(max_rows / BM) + (non-empty
/// experts), and <= max_rows (each non-empty expert has at least as many rows as tiles).
inline int64_t moe_gemm_m_tiles(MoeGemmParams const& p, int64_t bm, bool exact_dense) {
  if (exact_dense && p.expert_offsets == nullptr) return (p.max_rows + bm - 1) / bm;
  return std::min(p.max_rows, p.max_rows / bm + std::min(p.num_experts, p.max_rows));
}

/// Launches moe_gemm_mma_kernel<Ops, kSilu, kDense> over m_tiles row-tile slots (what: the
/// variant's name in errors).
template <class Ops, bool kSilu, bool kDense = false>
void moe_gemm_launch_mma(MoeGemmParams const& p, int64_t m_tiles, char const* what,
                         cudaStream_t stream) {
  using Cfg = typename Ops::Cfg;
  const int64_t n_tiles = (p.n + Cfg::BN - 1) / Cfg::BN;
  const int64_t blocks = m_tiles * n_tiles;
  TANDEM_CHECK(blocks <= INT32_MAX, what, ": grid too large: ", blocks);
  moe_gemm_raise_smem<Ops, kSilu, kDense>();
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(Cfg::kThreads);
  cfg.dynamicSmemBytes = Ops::kSmemBytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = p.pdl != MoeGemmPdl::kOff ? 1 : 0;
  TANDEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, moe_gemm_mma_kernel<Ops, kSilu, kDense>, p,
                                       static_cast<int>(n_tiles)));
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda::moe_gemm_detail
