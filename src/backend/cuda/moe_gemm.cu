// Grouped expert GEMM. See moe_gemm.h.
//
// One CTA computes a BM x BN tile of one expert's output. The 1-D grid enumerates
// (row-tile slot, N tile) with the N tile fastest, so the CTAs that run together share the
// x rows of one row tile (read once from HBM) and consecutive row tiles of one expert reuse
// its weight tiles from L2. Row-tile slot s maps to (expert, row tile) by a warp scan over
// ceil(count_e / BM) read from the device offsets; slots past the last real tile exit.
#include <algorithm>
#include <atomic>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_gemm_fp8.h"

namespace tandem::cuda {

namespace {

template <int kBM, int kBN, int kBK, int kWarpsM, int kWarpsN, int kStages, int kMinBlocks>
struct TileCfg {
  static constexpr int BM = kBM, BN = kBN, BK = kBK, kWarpsN_ = kWarpsN, kStagesN = kStages;
  static constexpr int kMinBlocksPerSm = kMinBlocks;
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kWM = BM / kWarpsM, kWN = BN / kWarpsN;  // warp tile
  static constexpr int kMI = kWM / 16, kNI = kWN / 8;           // mma tiles per warp
  // NOTE: rows padded by 16 bytes: the 8 row addresses of one ldmatrix 8x8 then fall in 8
  // distinct 16-byte bank groups (row stride 144 or 80 bytes), so ldmatrix is conflict-free.
  static constexpr int kLd = BK + 8;
  static constexpr int kStageA = BM * kLd, kStageB = BN * kLd;  // elements
  static constexpr size_t kSmemBytes = size_t{kStages} * (kStageA + kStageB) * sizeof(bf16);
  static constexpr int kChunksA = BM * BK / 8, kChunksB = BN * BK / 8;  // 16-byte chunks
  static_assert(BM % (16 * kWarpsM) == 0, "warp tile rows: multiple of 16");
  static_assert(BN % (16 * kWarpsN) == 0, "warp tile cols: multiple of 16 (ldmatrix.x4 on B)");
  static_assert(BN % (2 * kMoeGateUpInterleave) == 0, "a tile holds whole gate/up pairs");
  static_assert(kWN % (2 * kMoeGateUpInterleave) == 0, "a warp holds whole gate/up pairs");
  static_assert(BK % 16 == 0, "k step 16");
  static_assert(kChunksA % kThreads == 0 && kChunksB % kThreads == 0, "whole chunks per thread");
  static_assert(kStages >= 2, "pipeline depth");
};

using SmallTile = TileCfg<16, 32, 64, 1, 2, 6, 1>;
using MediumTile = TileCfg<64, 64, 64, 2, 2, 4, 1>;
using LargeTile = TileCfg<128, 128, 32, 2, 4, 4, 2>;
using LargeK64Tile = TileCfg<128, 128, 64, 2, 4, 3, 2>;  // half the barriers per FLOP
using Large256Tile = TileCfg<128, 256, 32, 2, 4, 4, 1>;  // 64 x 64 warp tiles: less smem/FLOP

__device__ __forceinline__ uint32_t smem_addr(void const* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes 0 fills the destination with zeros (rows/k past the end).
__device__ __forceinline__ void cp_async16(void* dst, void const* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], void const* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t const (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

// kDense (GemmLt's batch-invariant mode only): expert_offsets may be null (one dense expert of
// max_rows rows) and the plain epilogue may write fp32 (y_f32). The default kernels
// (kDense false) compile without either.
template <class Cfg, bool kSilu, bool kDense = false>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    moe_gemm_kernel(MoeGemmParams p, int n_tiles) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kLd = Cfg::kLd;
  constexpr int kStages = Cfg::kStagesN, kThreads = Cfg::kThreads;
  constexpr int kMI = Cfg::kMI, kNI = Cfg::kNI;
  extern __shared__ uint4 smem_u4[];
  __shared__ int sExpert, sRow0, sRows;
  __shared__ int64_t sXRow[BM];  // element offset of each tile row in x
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
    const int E = static_cast<int>(p.num_experts);
    int base = 0;  // row tiles of the experts before this chunk
    bool found = false;
    for (int e0 = 0; e0 < E; e0 += 32) {
      const int e = e0 + lane;
      int start = 0, count = 0;
      if (kDense && e < E && p.expert_offsets == nullptr) {  // one expert of max_rows rows
        count = static_cast<int>(p.max_rows);
      } else if (e < E) {
        start = p.expert_offsets[e];
        count = p.expert_offsets[e + 1] - start;
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
  const int n_rows = min(BN, N - n0);

  // x row of each tile row: the permuted row itself, or the token it was gathered from.
  const int gather_div = static_cast<int>(p.gather_div);
  for (int r = tid; r < rows; r += kThreads) {
    const int64_t src =
        p.gather_src != nullptr ? p.gather_src[row0 + r] / gather_div : int64_t{row0} + r;
    sXRow[r] = src * K;
  }
  __syncthreads();
  bf16 const* gW = p.w + (static_cast<int64_t>(expert) * N + n0) * K;
  bf16* sA = reinterpret_cast<bf16*>(smem_u4);
  bf16* sB = sA + kStages * Cfg::kStageA;

  const int k_tiles = (K + BK - 1) / BK;
  auto load_stage_a = [&](int stage, int kt) {
    const int k0 = kt * BK;
    bf16* sAs = sA + stage * Cfg::kStageA;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksA / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
      const bool ok = r < rows && k0 + col < K;
      cp_async16(sAs + r * kLd + col, ok ? p.x + sXRow[r] + k0 + col : p.x, ok);
    }
  };
  auto load_stage_b = [&](int stage, int kt) {
    const int k0 = kt * BK;
    bf16* sBs = sB + stage * Cfg::kStageB;
#pragma unroll
    for (int i = 0; i < Cfg::kChunksB / kThreads; ++i) {
      const int c = tid + i * kThreads;
      const int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
      const bool ok = r < n_rows && k0 + col < K;
      cp_async16(sBs + r * kLd + col, ok ? gW + static_cast<int64_t>(r) * K + k0 + col : p.w, ok);
    }
  };
  auto load_stage = [&](int stage, int kt) {
    load_stage_a(stage, kt);
    load_stage_b(stage, kt);
  };

  // 2. Prologue: kStages - 1 k tiles in flight (a group is committed even when empty so the
  // wait count below stays exact).
  if (p.pdl == MoeGemmPdl::kPrefetchWeights) {
    // Weight tiles first (they do not depend on the preceding kernel), then wait for it and
    // load x. Group 0 holds every prologue B tile and A tile 0; group s holds A tile s.
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
      if (s < k_tiles) load_stage(s, s);
      cp_async_commit();
    }
  }

  const int wm = warp / Cfg::kWarpsN_, wn = warp % Cfg::kWarpsN_;
  float acc[kMI][kNI][4];
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[mi][ni][v] = 0.f;

  // ldmatrix row addresses: A 16x16 as (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15,
  // 8-15) = a0..a3; B 16 n x 16 k as (n 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
  // = b0, b1 of n block 0, b0, b1 of n block 1.
  const int a_row = wm * Cfg::kWM + (lane & 15), a_col = (lane >> 4) * 8;
  const int b_row = wn * Cfg::kWN + (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;

  // 3. Main loop: wait for k tile kt, refill the stage consumed last iteration, compute.
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    cp_async_commit();

    bf16 const* sAs = sA + (kt % kStages) * Cfg::kStageA;
    bf16 const* sBs = sB + (kt % kStages) * Cfg::kStageB;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t rA[kMI][4], rB[kNI][2];
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi) {
        ldmatrix_x4(rA[mi], sAs + (a_row + mi * 16) * kLd + kk + a_col);
      }
#pragma unroll
      for (int nj = 0; nj < kNI / 2; ++nj) {
        uint32_t r[4];
        ldmatrix_x4(r, sBs + (b_row + nj * 16) * kLd + kk + b_col);
        rB[2 * nj][0] = r[0];
        rB[2 * nj][1] = r[1];
        rB[2 * nj + 1][0] = r[2];
        rB[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni) mma_bf16(acc[mi][ni], rA[mi], rB[ni][0], rB[ni][1]);
    }
  }
  cp_async_wait<0>();

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
template <class Cfg, bool kSilu, bool kDense = false>
void raise_smem() {
  if constexpr (Cfg::kSmemBytes > 48 * 1024) {
    static std::atomic<uint64_t> raised{0};  // bit d: done on device d
    int dev = 0;
    TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
    if (dev >= 64 || !((raised.load(std::memory_order_relaxed) >> dev) & 1u)) {
      TANDEM_CUDA_CHECK(cudaFuncSetAttribute(moe_gemm_kernel<Cfg, kSilu, kDense>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(Cfg::kSmemBytes)));
      if (dev < 64) raised.fetch_or(uint64_t{1} << dev, std::memory_order_relaxed);
    }
  }
}

template <class Cfg>
void raise_smem_both() {
  raise_smem<Cfg, false>();
  raise_smem<Cfg, true>();
  raise_smem<Cfg, false, true>();
}

template <class Cfg, bool kSilu, bool kDense = false>
void launch_tile(MoeGemmParams const& p, cudaStream_t stream) {
  const int64_t n_tiles = (p.n + Cfg::BN - 1) / Cfg::BN;
  // Row tiles: sum_e ceil(c_e / BM) <= floor(max_rows / BM) + (non-empty experts), and
  // <= max_rows (each non-empty expert has at least as many rows as tiles).
  const int64_t m_tiles =
      std::min(p.max_rows, p.max_rows / Cfg::BM + std::min(p.num_experts, p.max_rows));
  const int64_t blocks = m_tiles * n_tiles;
  TANDEM_CHECK(blocks <= INT32_MAX, "moe_gemm: grid too large: ", blocks);
  auto kernel = moe_gemm_kernel<Cfg, kSilu, kDense>;
  raise_smem<Cfg, kSilu, kDense>();
  if (p.pdl != MoeGemmPdl::kOff) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks));
    cfg.blockDim = dim3(Cfg::kThreads);
    cfg.dynamicSmemBytes = Cfg::kSmemBytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    TANDEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, static_cast<int>(n_tiles)));
  } else {
    kernel<<<static_cast<unsigned>(blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
        p, static_cast<int>(n_tiles));
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

template <class Cfg>
void launch_epilogue(MoeGemmParams const& p, cudaStream_t stream) {
  switch (p.epilogue) {
    case MoeGemmEpilogue::kPlain:
      if (p.expert_offsets == nullptr || p.y_f32 != nullptr) {
        launch_tile<Cfg, false, true>(p, stream);
      } else {
        launch_tile<Cfg, false>(p, stream);
      }
      break;
    case MoeGemmEpilogue::kSiluMul: launch_tile<Cfg, true>(p, stream); break;
    default: TANDEM_THROW(kUnsupported, "moe_gemm: unsupported epilogue");
  }
}

bool aligned16(void const* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

MoeGemmTile moe_gemm_pick_tile(int64_t max_rows, int64_t num_experts) {
  // Mean rows per expert bound: decode batches touch many experts with a few rows each.
  const int64_t mean = max_rows / std::max<int64_t>(num_experts, 1);
  if (mean <= 8) return MoeGemmTile::kSmall;
  if (mean <= 48) return MoeGemmTile::kMedium;
  return MoeGemmTile::kLarge;
}

void moe_gemm_launch(MoeGemmParams const& p, cudaStream_t stream) {
  if (p.w_fp8 != nullptr) {
    TANDEM_CHECK(p.y_f32 == nullptr, "moe_gemm: fp32 output with bf16 weights only");
    moe_gemm_detail::moe_gemm_fp8_launch(p, stream);
    return;
  }
  TANDEM_CHECK(p.expert_offsets != nullptr || p.num_experts == 1,
               "moe_gemm: expert_offsets is null with ", p.num_experts, " experts");
  TANDEM_CHECK(p.y_f32 == nullptr || p.epilogue == MoeGemmEpilogue::kPlain,
               "moe_gemm: fp32 output with the plain epilogue only");
  TANDEM_CHECK(p.max_rows >= 0 && p.num_experts >= 1 && p.n > 0 && p.k > 0,
               "moe_gemm: bad sizes: max_rows ", p.max_rows, " experts ", p.num_experts, " n ", p.n,
               " k ", p.k);
  if (p.k % 8 != 0 || p.n % 8 != 0 ||
      (p.epilogue == MoeGemmEpilogue::kSiluMul && p.n % (2 * kMoeGateUpInterleave) != 0)) {
    TANDEM_THROW(kUnsupported, "moe_gemm: unsupported n ", p.n, " / k ", p.k,
                 " (k % 8, n % 8, silu-mul n % 16)");
  }
  TANDEM_CHECK(p.n <= INT32_MAX / 2 && p.k <= INT32_MAX / 2 && p.max_rows <= INT32_MAX / 2,
               "moe_gemm: too large");
  TANDEM_CHECK(p.gather_div >= 1 && p.gather_div <= INT32_MAX, "moe_gemm: bad gather_div ",
               p.gather_div);
  TANDEM_CHECK(aligned16(p.x) && aligned16(p.w) &&
                   (p.y_f32 != nullptr ? aligned16(p.y_f32) : aligned16(p.y)),
               "moe_gemm: x, w, y must be 16-byte aligned");
  if (p.max_rows == 0) return;
  const MoeGemmTile tile =
      p.tile == MoeGemmTile::kAuto ? moe_gemm_pick_tile(p.max_rows, p.num_experts) : p.tile;
  switch (tile) {
    case MoeGemmTile::kSmall: launch_epilogue<SmallTile>(p, stream); break;
    case MoeGemmTile::kMedium: launch_epilogue<MediumTile>(p, stream); break;
    case MoeGemmTile::kLarge: launch_epilogue<LargeTile>(p, stream); break;
    case MoeGemmTile::kLargeK64: launch_epilogue<LargeK64Tile>(p, stream); break;
    case MoeGemmTile::kLarge256: launch_epilogue<Large256Tile>(p, stream); break;
    default: TANDEM_THROW(kUnsupported, "moe_gemm: unsupported tile");
  }
}

void moe_gemm_prepare() {
  raise_smem_both<SmallTile>();
  raise_smem_both<MediumTile>();
  raise_smem_both<LargeTile>();
  raise_smem_both<LargeK64Tile>();
  raise_smem_both<Large256Tile>();
  moe_gemm_detail::moe_gemm_fp8_prepare();
}

void moe_pack_gate_up_rows(void const* gate, void const* up, int64_t inter, size_t row_bytes,
                           void* packed) {
  TANDEM_CHECK(inter > 0 && row_bytes > 0 && inter % kMoeGateUpInterleave == 0,
               "moe_pack_gate_up_rows: inter must be a positive multiple of ", kMoeGateUpInterleave,
               ", got ", inter);
  constexpr int64_t G = kMoeGateUpInterleave;
  auto const* g = static_cast<uint8_t const*>(gate);
  auto const* u = static_cast<uint8_t const*>(up);
  auto* out = static_cast<uint8_t*>(packed);
  for (int64_t j = 0; j < inter / G; ++j) {
    for (int64_t i = 0; i < G; ++i) {
      std::memcpy(out + (2 * G * j + i) * row_bytes, g + (G * j + i) * row_bytes, row_bytes);
      std::memcpy(out + (2 * G * j + G + i) * row_bytes, u + (G * j + i) * row_bytes, row_bytes);
    }
  }
}

void moe_pack_gate_up(bf16 const* gate, bf16 const* up, int64_t inter, int64_t hidden,
                      bf16* packed) {
  TANDEM_CHECK(inter > 0 && hidden > 0 && inter % kMoeGateUpInterleave == 0,
               "moe_pack_gate_up: inter must be a positive multiple of ", kMoeGateUpInterleave,
               ", got ", inter);
  constexpr int64_t G = kMoeGateUpInterleave;
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(bf16);
  for (int64_t j = 0; j < inter / G; ++j) {
    for (int64_t i = 0; i < G; ++i) {
      std::memcpy(packed + (2 * G * j + i) * hidden, gate + (G * j + i) * hidden, row_bytes);
      std::memcpy(packed + (2 * G * j + G + i) * hidden, up + (G * j + i) * hidden, row_bytes);
    }
  }
}

}  // namespace tandem::cuda
