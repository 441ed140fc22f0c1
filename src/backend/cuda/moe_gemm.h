// Grouped GEMM over the experts of a MoE layer: y[rows of e] = x[rows of e] W_e^T, rows grouped
// by expert (moe_permute_launch order) with the row offsets on the device, so one launch serves
// any routing and is CUDA-graph safe. bf16 in and out, fp32 accumulation (mma.sync m16n8k16,
// ldmatrix, cp.async multi-stage pipeline).
//
// Two epilogues: plain (down_proj) and fused SiLU-multiply (gate_up -> act). The fused one
// needs the gate and up rows of each expert interleaved in blocks of kMoeGateUpInterleave
// rows (moe_pack_gate_up), so that the thread holding gate[r, i] in its accumulators also
// holds up[r, i].
//
// Tile choice (host side, from max_rows / num_experts, the mean rows per expert bound):
//   small  16 x 32 x 64,  6 stages, 2 warps:  mean <= 8 (decode; weights streamed once, many
//                                              CTAs per expert so a few experts fill the GPU)
//   medium 64 x 64 x 64,  4 stages, 4 warps:  mean <= 48
//   large  128 x 128 x 32, 4 stages, 8 warps: above (prefill; compute-bound)
//   (large_k64 128 x 128 x 64, 3 stages, and large256 128 x 256 x 32, 4 stages, 1 CTA/SM:
//    never picked; benchmarked beside large for tuning)
// An expert with more rows than the tile height gets several row tiles; a row tile past an
// expert's real row count exits at once, so experts with no rows cost one tiny CTA per N tile.
// CPU reference: cpu::gemm per expert (+ cpu::silu_mul on the unpacked gate_up output).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

/// Gate and up rows alternate in blocks of this many rows in the packed gate_up weight.
constexpr int64_t kMoeGateUpInterleave = 8;

enum class MoeGemmEpilogue {
  kPlain,    // y[r, n] = acc[r, n]
  kSiluMul,  // y[r, i] = silu(gate[r, i]) * up[r, i], w packed by moe_pack_gate_up
};

enum class MoeGemmPdl { kOff, kWaitFirst, kPrefetchWeights };

enum class MoeGemmTile { kAuto, kSmall, kMedium, kLarge, kLargeK64, kLarge256 };

struct MoeGemmParams {
  bf16 const* x;                  // [max_rows, k]: rows grouped by expert (see gather_src)
  bf16 const* w;                  // [num_experts, n, k]; kSiluMul: n = 2 * inter, packed
  bf16* y;                        // [max_rows, n] (kPlain) or [max_rows, n / 2] (kSiluMul)
  int32_t const* expert_offsets;  // [num_experts + 1] on the device: rows of expert e are
                                  // [offsets[e], offsets[e + 1]); offsets[num_experts] <= max_rows.
                                  // Null with num_experts 1: a dense matrix over max_rows
                                  // rows (the FP8 linear for m > 8; GemmLt's batch-invariant
                                  // mode, bf16)
  int64_t max_rows;               // host-side upper bound on the routed rows (tokens * top_k)
  int64_t n, k, num_experts;
  MoeGemmEpilogue epilogue = MoeGemmEpilogue::kPlain;
  MoeGemmTile tile = MoeGemmTile::kAuto;  // forced tiles are for tests and benchmarks
  // Fused gather: when set, row i of the grouped x is x[gather_src[i] / gather_div] (x is then
  // the un-permuted [num_tokens, k] activations, gather_src = moe_permute's permuted_src,
  // gather_div = top_k), which saves materialising the permuted copy.
  int32_t const* gather_src = nullptr;  // [max_rows]
  int64_t gather_div = 1;
  // Programmatic dependent launch (cudaLaunchAttributeProgrammaticStreamSerialization): the
  // kernel may start while the preceding kernel on the stream still runs (every moe_gemm
  // kernel, and MoeLayer's decode router, let their dependents start early).
  //   kWaitFirst: waits for the preceding kernel (griddepcontrol.wait) before reading anything;
  //     hides the launch latency only.
  //   kPrefetchWeights: reads expert_offsets and gather_src and streams its first weight tiles,
  //     then waits before reading x. So only x may be produced by the preceding kernel;
  //     expert_offsets and gather_src must be complete before that kernel started (e.g. the
  //     down GEMM after gate_up).
  MoeGemmPdl pdl = MoeGemmPdl::kOff;
  // FP8 experts (fp8_linear.h): when w_fp8 is set, w is unused and the weights are E4M3
  // [num_experts, n, k] (kSiluMul: packed as moe_pack_gate_up packs rows) with row scales
  // w_scale [num_experts, n, ceil(k / 128)] (the same row order); k % 16 == 0. The weights are
  // converted to bf16 in registers, the scales applied per 128-deep K block in fp32.
  uint8_t const* w_fp8 = nullptr;
  float const* w_scale = nullptr;
  // MXFP8 (native, fp8_linear.h): with w_fp8, E8M0 codes [num_experts, n, ceil(k / 32)] in
  // w_scale's place (w_scale unused), folded into the in-register conversion. W8A16 only.
  uint8_t const* w_e8m0 = nullptr;
  // With w_fp8 (W8A8, moe_gemm_fp8a.cu): the bf16 x rows are quantized to E4M3 per row and
  // 128-column group inside the kernel (fp8_linear.h: fp8 activation numerics) and the MMAs
  // run on the FP8 tensor cores, both scales applied per 128-deep K block in fp32. Off: the
  // weights are converted to bf16 (W8A16, the dequantized model's numerics).
  bool fp8_activations = false;
  // With fp8_activations: x already quantized (fp8_quantize_rows_launch): E4M3 rows [.., k] and
  // their scales [.., ceil(k / 128)] indexed like x's rows (gather_src included); x is then
  // unused. The kernel loads E4M3 straight into shared memory (no in-kernel quant pass).
  uint8_t const* x_fp8 = nullptr;
  float const* x_scale = nullptr;
  // bf16 weights, kPlain: when set, the output is fp32 here ([max_rows, n]) and y is unused
  // (GemmLt's batch-invariant mode: router logits, lm_head).
  float* y_f32 = nullptr;
};

/// Every output element is one fp32 accumulator chained over k in ascending 16-deep steps
/// whatever the tile, the row count or the other rows (no split-K): a row's result does not
/// depend on the batch (GemmLt's batch-invariant mode relies on it).
/// Rows at and past offsets[num_experts] of y are left untouched. Requirements (checked):
/// k % 8 == 0, n % 8 == 0 (kSiluMul: n % 16 == 0), x, w, y 16-byte aligned.
/// max_rows may be 0 (nothing is launched).
void moe_gemm_launch(MoeGemmParams const& p, cudaStream_t stream);

/// Raises the shared memory limits of every tile's kernels on the current device (what the
/// first launch of a tile otherwise does), so that no first launch happens inside a graph
/// capture. Idempotent, cheap after the first call per device.
void moe_gemm_prepare();

/// The tile moe_gemm_launch picks for kAuto.
MoeGemmTile moe_gemm_pick_tile(int64_t max_rows, int64_t num_experts);

/// moe_pack_gate_up on rows of `row_bytes` bytes (E4M3 codes: hidden bytes; their row scales:
/// ceil(hidden / 128) floats).
void moe_pack_gate_up_rows(void const* gate, void const* up, int64_t inter, size_t row_bytes,
                           void* packed);

/// Packs one expert's Hugging Face gate_proj [inter, hidden] and up_proj [inter, hidden] into
/// packed [2 * inter, hidden]: rows 16 j .. 16 j + 7 are gate rows 8 j .. 8 j + 7, rows
/// 16 j + 8 .. 16 j + 15 are up rows 8 j .. 8 j + 7. Host memory; inter % 8 == 0.
void moe_pack_gate_up(bf16 const* gate, bf16 const* up, int64_t inter, int64_t hidden,
                      bf16* packed);

}  // namespace tandem::cuda
