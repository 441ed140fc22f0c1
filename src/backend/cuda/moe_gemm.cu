// Grouped expert GEMM with bf16 weights. See moe_gemm.h; the kernel (tile scheduling, gather,
// pipeline, epilogue) is moe_gemm_kernel.cuh's, with the bf16 operands below: both operands come
// by cp.async into padded bf16 stages and go to mma.sync m16n8k16 through ldmatrix.
#include <algorithm>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_gemm_fp8.h"
#include "backend/cuda/moe_gemm_kernel.cuh"

namespace tandem::cuda {

namespace {

using namespace moe_gemm_detail;

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

// bf16 x and bf16 weights (moe_gemm_kernel.cuh's operand policy).
template <class Shape>
struct Bf16Ops {
  using Cfg = Shape;
  static constexpr bool kNoOffsets = false, kXRowTimesK = true;
  static constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, kThreads = Cfg::kThreads;
  static constexpr int kMI = Cfg::kMI, kNI = Cfg::kNI;
  // NOTE: rows padded by 16 bytes: the 8 row addresses of one ldmatrix 8x8 then fall in 8
  // distinct 16-byte bank groups (row stride 144 or 80 bytes), so ldmatrix is conflict-free.
  static constexpr int kLd = BK + 8;
  static constexpr int kStageA = BM * kLd, kStageB = BN * kLd;  // elements
  static constexpr size_t kSmemBytes = size_t{Cfg::kStagesN} * (kStageA + kStageB) * sizeof(bf16);
  static constexpr int kChunksB = BN * BK / 8;  // 16-byte chunks
  static_assert(BN % (16 * Cfg::kWarpsN_) == 0, "warp tile cols: multiple of 16 (ldmatrix.x4)");
  static_assert(BN % (2 * kMoeGateUpInterleave) == 0, "a tile holds whole gate/up pairs");
  static_assert(BK % 16 == 0, "k step 16");
  static_assert(kChunksB % kThreads == 0, "whole chunks per thread");
  static_assert(Cfg::kWarpsK_ == 1, "one warp per warp tile");

  MoeGemmParams const& p;
  MoeTile t;
  bf16 const* gW;
  bf16* sA;
  bf16* sB;

  __device__ __forceinline__ Bf16Ops(MoeGemmParams const& p_, MoeTile const& t_)
      : p(p_), t(t_), gW(p_.w + (static_cast<int64_t>(t_.expert) * t_.N + t_.n0) * t_.K) {
    sA = reinterpret_cast<bf16*>(t.smem);
    sB = sA + Cfg::kStagesN * kStageA;
  }
  __device__ __forceinline__ void load_a(int stage, int kt) {
    load_x_bf16<Cfg, kLd>(sA + stage * kStageA, p, t, kt * BK);
  }
  __device__ __forceinline__ void load_b(int stage, int kt) {
    const int k0 = kt * BK;
    bf16* sBs = sB + stage * kStageB;
#pragma unroll
    for (int i = 0; i < kChunksB / kThreads; ++i) {
      const int c = t.tid + i * kThreads;
      const int r = c / (BK / 8), col = (c % (BK / 8)) * 8;
      const bool ok = r < t.n_rows && k0 + col < t.K;
      cp_async16(sBs + r * kLd + col, ok ? gW + static_cast<int64_t>(r) * t.K + k0 + col : p.w, ok);
    }
  }
  __device__ __forceinline__ void begin() {}
  __device__ __forceinline__ void compute(int stage, int, int, float (&acc)[kMI][kNI][4]) {
    // ldmatrix row addresses: A 16x16 as (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15,
    // 8-15) = a0..a3; B 16 n x 16 k as (n 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
    // = b0, b1 of n block 0, b0, b1 of n block 1.
    const int lane = t.lane;
    const int a_row = t.wm * Cfg::kWM + (lane & 15), a_col = (lane >> 4) * 8;
    const int b_row = t.wn * Cfg::kWN + (lane & 7) + ((lane >> 4) << 3);
    const int b_col = ((lane >> 3) & 1) * 8;
    bf16 const* sAs = sA + stage * kStageA;
    bf16 const* sBs = sB + stage * kStageB;
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
  __device__ __forceinline__ bool finish(float (&)[kMI][kNI][4]) { return true; }
};

using SmallTile = Bf16Ops<MmaTileShape<16, 32, 64, 1, 2, 6, 1>>;
using MediumTile = Bf16Ops<MmaTileShape<64, 64, 64, 2, 2, 4, 1>>;
using LargeTile = Bf16Ops<MmaTileShape<128, 128, 32, 2, 4, 4, 2>>;
using LargeK64Tile = Bf16Ops<MmaTileShape<128, 128, 64, 2, 4, 3, 2>>;  // half the barriers/FLOP
using Large256Tile = Bf16Ops<MmaTileShape<128, 256, 32, 2, 4, 4, 1>>;  // 64 x 64 warp tiles

template <class Cfg>
void raise_smem_both() {
  moe_gemm_raise_smem<Cfg, false>();
  moe_gemm_raise_smem<Cfg, true>();
  moe_gemm_raise_smem<Cfg, false, true>();
}

template <class Cfg, bool kSilu, bool kDense = false>
void launch_tile(MoeGemmParams const& p, cudaStream_t stream) {
  moe_gemm_launch_mma<Cfg, kSilu, kDense>(p, moe_gemm_m_tiles(p, Cfg::BM, false), "moe_gemm",
                                          stream);
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
