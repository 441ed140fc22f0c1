// Grouped expert GEMM with E4M3 weights (W8A16). See moe_gemm.h (MoeGemmParams::w_fp8) and
// fp8_linear.h.
//
// moe_gemm_kernel.cuh's kernel (grid layout, row-tile scan, gather, pipeline, PDL, epilogues)
// with the operand policy Fp8WeightOps below; what differs from the bf16 one (moe_gemm.cu) is
// the weight operand:
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
#include <cstdlib>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_dequant.cuh"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm_fp8.h"
#include "backend/cuda/moe_gemm_kernel.cuh"
#include "core/env.h"

namespace tandem::cuda::moe_gemm_detail {

namespace {

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  // Not volatile: a pure function of its operands, free to be scheduled around the loads.
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// bf16 x and E4M3 weights with per-128 (kMx false: p.w_scale) or MXFP8 per-32 (kMx: p.w_e8m0)
// scales (moe_gemm_kernel.cuh's operand policy). Shape::kWarpsK 2: two warps per warp tile,
// one per 64-deep half of every K tile (twice the warps per SM for the latency-bound decode
// shapes), their sums added through shared memory.
template <class Shape, bool kMx>
struct Fp8WeightOps {
  using Cfg = Shape;
  static constexpr bool kNoOffsets = true, kXRowTimesK = true;
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kStages = Cfg::kStagesN;
  static constexpr int kMI = Cfg::kMI, kNI = Cfg::kNI;
  static constexpr int kLdA = BK + 8;  // bf16 elements (272 bytes: 16 mod 128)
  static constexpr int kStageABytes = BM * kLdA * 2, kStageBBytes = BN * BK;  // bytes
  static constexpr size_t kSmemBytes = size_t{kStages} * (kStageABytes + kStageBBytes);
  static_assert(Cfg::kWarpsK_ == 1 || Cfg::kWarpsK_ == 2, "K halves per tile");
  static_assert(BK == kFp8BlockK, "one K tile per scale block");

  MoeGemmParams const& p;
  MoeTile t;
  int KB, KE;
  uint8_t const* gW;
  float const* gS;
  uint8_t const* gE;
  bf16* sA;
  uint8_t* sB;
  float sc[kNI][2];        // the scales of this thread's columns (n = 8 ni + 2 t + j), block
  float blk[kMI][kNI][4];  // the current K tile's sums

  __device__ __forceinline__ Fp8WeightOps(MoeGemmParams const& p_, MoeTile const& t_)
      : p(p_), t(t_) {
    KB = static_cast<int>(fp8_row_scale_cols(p.k));
    const int64_t row = static_cast<int64_t>(t.expert) * t.N + t.n0;
    gW = p.w_fp8 + row * t.K;
    gS = kMx ? nullptr : p.w_scale + row * KB;
    KE = static_cast<int>(mxfp8_scale_cols(p.k));
    gE = kMx ? p.w_e8m0 + row * KE : nullptr;
    sA = reinterpret_cast<bf16*>(t.smem);
    sB = t.smem + kStages * kStageABytes;
  }
  __device__ __forceinline__ void load_a(int stage, int kt) {
    load_x_bf16<Cfg, kLdA>(sA + stage * (BM * kLdA), p, t, kt * BK);
  }
  // Swizzled: chunk ^ 4 on odd rows, so that rows g and g + 1 of one read fall in different
  // banks.
  __device__ __forceinline__ void load_b(int stage, int kt) {
    load_w_e4m3<Cfg, 4>(sB + stage * kStageBBytes, gW, p, t, kt * BK);
  }
  __device__ __forceinline__ void load_scales(int kb) {
    if constexpr (kMx) {
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni) sc[ni][0] = sc[ni][1] = 1.f;
    } else {
      load_w_scales<Cfg>(sc, gS, KB, kb, t);
    }
  }
  __device__ __forceinline__ void begin() {
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
        for (int v = 0; v < 4; ++v) blk[mi][ni][v] = 0.f;
    load_scales(0);
  }
  __device__ __forceinline__ void compute(int stage, int kt, int k_tiles,
                                          float (&acc)[kMI][kNI][4]) {
    const int g = t.lane >> 2, tq = t.lane & 3;
    const int a_row = t.wm * Cfg::kWM + g;  // + 16 mi (+ 8)
    const int b_row = t.wn * Cfg::kWN + g;  // + 8 ni
    bf16 const* sAs = sA + stage * (BM * kLdA);
    uint8_t const* sBs = sB + stage * kStageBBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the two 64-deep halves of the tile
      if (Cfg::kWarpsK_ == 2 && h != t.wk) continue;
      uint4 bq[kNI];
      uint32_t bmul[kNI];  // kMx: the conversion multiplier of row r's 32-deep block
#pragma unroll
      for (int ni = 0; ni < kNI; ++ni) {
        const int r = b_row + ni * 8;
        bq[ni] = lds128(sBs + r * BK + (((4 * h + tq) ^ ((r & 1) << 2)) * 16));
        if constexpr (kMx) {
          const int kcol = kt * BK + 64 * h + 16 * tq;
          const bool ok = r < t.n_rows && kcol < t.K;
          bmul[ni] = detail::e8m0_bf16x2_mul(
              ok ? __ldg(gE + static_cast<int64_t>(r) * KE + kcol / kMxfp8BlockK) : 127u);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint4 a[kMI][2];
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi) {
          const int col = 64 * h + tq * 16 + half * 8;
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
  __device__ __forceinline__ bool finish(float (&acc)[kMI][kNI][4]) {
    if constexpr (Cfg::kWarpsK_ == 2) {
      // The second K half's sums to the first's warps (the stages are free once all arrived).
      __syncthreads();
      float* red = reinterpret_cast<float*>(t.smem);
      constexpr int kPer = kMI * kNI * 4;
      if (t.wk == 1) {
#pragma unroll
        for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
          for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
            for (int v = 0; v < 4; ++v) {
              red[(t.wt * kPer + (mi * kNI + ni) * 4 + v) * 32 + t.lane] = acc[mi][ni][v];
            }
      }
      __syncthreads();
      if (t.wk == 1) return false;
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int ni = 0; ni < kNI; ++ni)
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            acc[mi][ni][v] += red[(t.wt * kPer + (mi * kNI + ni) * 4 + v) * 32 + t.lane];
          }
    }
    return true;
  }
};

template <int kBM, int kBN, int kWarpsM, int kWarpsN, int kStages, int kMinBlocks, int kWarpsK = 1>
using Fp8Tile = MmaTileShape<kBM, kBN, 128, kWarpsM, kWarpsN, kStages, kMinBlocks, kWarpsK>;
using Fp8Small = Fp8Tile<16, 32, 1, 2, 6, 1>;
using Fp8SmallK2 = Fp8Tile<16, 32, 1, 2, 6, 1, 2>;
using Fp8Medium = Fp8Tile<64, 64, 2, 2, 3, 1>;
using Fp8Large = Fp8Tile<128, 128, 2, 4, 3, 1>;

template <class Cfg, bool kSilu>
void raise_smem() {
  moe_gemm_raise_smem<Fp8WeightOps<Cfg, false>, kSilu>();
  moe_gemm_raise_smem<Fp8WeightOps<Cfg, true>, kSilu>();
}

template <class Cfg, bool kSilu>
void launch_tile(MoeGemmParams const& p, cudaStream_t stream) {
  const int64_t m_tiles = moe_gemm_m_tiles(p, Cfg::BM, true);
  if (p.w_e8m0 != nullptr) {
    moe_gemm_launch_mma<Fp8WeightOps<Cfg, true>, kSilu>(p, m_tiles, "moe_gemm (fp8)", stream);
  } else {
    moe_gemm_launch_mma<Fp8WeightOps<Cfg, false>, kSilu>(p, m_tiles, "moe_gemm (fp8)", stream);
  }
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
