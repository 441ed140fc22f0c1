// W8A8 block-scaled MoE grouped GEMM on Hopper's FP8 tensor cores (wgmma), built on CUTLASS 3.x's
// sm90 pointer-array grouped GEMM with blockwise scaling (the CUTLASS tree of the FlashInfer
// wheel, scripts/fetch_flashinfer.sh): TMA loads, a producer warp and consumer warpgroups
// (warp-specialised), persistent CTAs over a grouped tile scheduler, fp32 accumulation with
// both scales applied when each 128-deep K block's partial sum is promoted into the fp32
// accumulator (the FP8 tensor core's own accumulator never spans more than one K block).
//
//   y[rows of e] = dequant(x[rows of e]) dequant(W_e)^T,   bf16 out
//   dequant(x)[r][c] = e4m3(x[r][c]) * x_scale[r][c / 128]          (per token, 128 columns)
//   dequant(W_e)[i][j] = e4m3(w[e][i][j]) * w_scale[e][i][j / 128]    (row scales, fp8_linear.h)
//
// Weight scales are per row and 128 columns ("row scales", the layout the W8A16 kernels and the
// FP8 expert loader already use): a block-FP8 checkpoint's 128 x 128 weight_scale_inv repeated
// per row (fp8_expand_row_scales; the same scale for every element, so the same numerics as
// 128 x 128 blocks), and any row permutation of the experts (moe_pack_gate_up's gate/up
// interleave, a TP shard) stays a row gather. The same kernels serve MXFP8 through
// mxfp8_to_row128 (mxfp8_w8a8.h: per-32 power-of-two scales folded into a per-row 128-column
// power-of-two scale at load, exact for all but a few tiny codes). The price against 128 x 128
// scales: 4 bytes per 128 weights (3%) more read at decode, one more multiply per accumulator
// at each promotion.
//
// Layout ("contiguous grouped"): rows grouped by expert (moe_permute order), expert e owning
// rows [offsets[e], offsets[e + 1]) with the offsets on the device. A small setup kernel turns
// the offsets into the per-group problem shapes, pointers, strides and scale layouts in device
// memory, so a launch never synchronises with the host and is CUDA-graph safe: the same layout
// serves prefill (thousands of rows per expert) and decode (a few rows per expert, replayed
// inside the decode graph with the routing's device-side counts). Experts with no rows cost
// nothing (the scheduler skips groups without tiles).
//
// Tiles: kPrefill 128 x 128 x 128, two consumer warpgroups sharing a tile (cooperative);
// kDecode 64 x 128 x 128, two consumer warpgroups on alternate tiles (ping-pong) so one's
// epilogue overlaps the other's main loop, less wasted MMA work when experts have few rows.
// kAuto picks kDecode when max_rows / num_experts <= 32.
//
// Activations come from the fused quantizers of fp8_act_quant.h (RMSNorm -> FP8, the MoE
// gather -> FP8, SiLU-and-mul -> FP8), never a separate pass. The gate_up projection writes
// gate and up (bf16, [rows, 2 * inter]: halves, or moe_pack_gate_up's interleave of 8) and
// silu_mul_quantize_fp8_launch turns them into the down projection's E4M3 input; see that
// header.
//
// CPU reference: moe_gemm_w8a8_reference (below).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace tandem::cuda {

enum class MoeGemmW8A8Tile { kAuto, kPrefill, kDecode };

struct MoeGemmW8A8Params {
  uint8_t const* x;               // [max_rows, k] E4M3, rows grouped by expert, 16-byte aligned
  float const* x_scale;           // [max_rows, k / 128] row-major (fp8_act_quant.h)
  uint8_t const* w;               // [num_experts, n, k] E4M3 (each expert's [out, in])
  float const* w_scale;           // [num_experts, n, k / 128] row scales (same row order as w)
  __nv_bfloat16* y;               // [max_rows, n], 16-byte aligned
  int32_t const* expert_offsets;  // [num_experts + 1] on the device, offsets[num_experts] <=
                                  // max_rows; null with num_experts 1: dense over max_rows rows
  int64_t max_rows, n, k, num_experts;
  MoeGemmW8A8Tile tile = MoeGemmW8A8Tile::kAuto;
};

/// Owns the per-group argument arrays and the CUTLASS workspace; one per stream (a launch
/// rewrites the arrays, stream-ordered). Not thread safe.
class MoeGemmW8A8 {
 public:
  MoeGemmW8A8();
  ~MoeGemmW8A8();
  MoeGemmW8A8(MoeGemmW8A8 const&) = delete;
  MoeGemmW8A8& operator=(MoeGemmW8A8 const&) = delete;

  /// True when the kernels were built (CUTLASS headers found at configure time) and the current
  /// device is sm_90 (Hopper).
  static bool supported();

  /// Sets up the kernels for up to num_experts groups (workspace, argument arrays, the
  /// kernels' shared memory limits) outside any graph capture; run() does it on first use.
  void prepare(int64_t num_experts);

  /// Requirements (checked, kUnsupported / kInvalidArgument naming the field): k % 128 == 0
  /// (K not a multiple of 128 is refused), n % 16 == 0, x / w / y 16-byte aligned, scales
  /// 4-byte aligned, num_experts >= 1. max_rows == 0 launches nothing. Rows at and past
  /// offsets[num_experts] of y are left untouched. Asynchronous; capturable once prepare()
  /// ran for this num_experts.
  void run(MoeGemmW8A8Params const& p, cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The tile kAuto picks.
MoeGemmW8A8Tile moe_gemm_w8a8_pick_tile(int64_t max_rows, int64_t num_experts);

/// CPU reference (host memory, same layouts; offsets host-side, null: dense): for every row r
/// of expert e and column i, y[r][i] = bf16(sum over K blocks b of s_x(r, b) * w_scale[e][i][b] *
/// sum_{j in b} e4m3(x[r][j]) * e4m3(w[e][i][j])), the inner sums exact in fp32 (products of
/// two E4M3 values are exact in fp32; the order of the 128 additions is the only difference
/// from the kernel). Rows past offsets[num_experts] are not written.
void moe_gemm_w8a8_reference(uint8_t const* x, float const* x_scale, uint8_t const* w,
                             float const* w_scale, int32_t const* offsets, int64_t max_rows,
                             int64_t n, int64_t k, int64_t num_experts, __nv_bfloat16* y);

}  // namespace tandem::cuda
