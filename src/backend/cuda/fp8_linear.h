// FP8-weight linears for decode and the MoE experts (W8A16): bf16 activations x E4M3 weights
// with one f32 scale per weight row and 128-deep K block, fp32 accumulation, bf16 (or fp32)
// out. The weights stay E4M3 in device memory (half bf16's bytes); the kernels convert them to
// bf16 in registers (exactly: every E4M3 value is a bf16 value) and apply the block scale to the
// fp32 partial sum of each 128-deep K block, so the result is the bf16 / fp32 math over the
// dequantized weights W[i][j] = e4m3(q[i][j]) * scale[i][j / 128] (the CPU reference).
//
// Scale layout ("row scales"): f32 [n, ceil(k / 128)], the scale of row i and K block j. A
// checkpoint's block-FP8 weight_scale_inv [ceil(n / 128), ceil(k / 128)] expands to it by
// repeating each block row (fp8_expand_row_scales), which also makes any row slice (a TP shard
// narrower than 128 rows, the packed gate/up order of the MoE experts) a plain row gather.
//
//  - fp8_gemv_launch: y[m, n] = x[m, k] W^T for 1 <= m <= 16 (dense linears at decode) on the
//    tensor cores: 16 weight rows per block of 8 warps splitting K, 16-byte loads of 16 E4M3.
//  - the MoE grouped GEMM (moe_gemm.h) takes E4M3 experts through MoeGemmParams::w_fp8 /
//    w_scale (mma.sync bf16 with the weights converted in registers), and a dense matrix as one
//    expert without offsets (MoeGemmParams::expert_offsets null): the FP8 linear for m > 8.
//
// FP8 activations (W8A8: MoeGemmParams::fp8_activations, fp8_quantize_act_launch of
// fp8_gemm.h), DeepSeek-V3 / DeepGEMM style: the bf16 activations are quantized per token and
// 128-column group (the K blocks of the weight scales; a last partial group of k % 128
// columns is its own group): amax = max |x| over the group, s = amax / 448 (1 when amax is 0),
// q = e4m3(x * min(448 / amax, FLT_MAX)) rounded to nearest even, satfinite (fp32 operations,
// IEEE division). The MMAs multiply E4M3 by E4M3 on the FP8 tensor cores; the partial sum of
// each 128-deep K block is added to the fp32 accumulator times s_x(token, block) *
// w_scale(row, block). So the result is the bf16 / fp32 math over the dequantized weights and
// the dequantized activations e4m3(q) * s (the CPU reference: tests/backend/cuda/
// fp8_act_ref.h), which differ from the bf16 activations by E4M3's rounding (relative 2^-4 at
// most per element).
//
// MXFP8 with its own scales ("native", docs/architecture.md, "MXFP8 on the GPU"): E4M3 codes [n, k]
// and one E8M0 code per row and 32-deep K block, u8 [n, ceil(k / 32)] (the checkpoint's
// weight_scale as stored; a TP shard is a row gather, or a column slice on 32-column boundaries).
// W[i][j] = e4m3(q[i][j]) * 2^(e[i][j / 32] - 127). The kernels take them through
// Fp8GemvParams::w_e8m0 / MoeGemmParams::w_e8m0 (w_scale unused): the scale is a power of two, so
// it folds into the in-register conversion's one multiply (fp8_dequant.cuh e4m3x4_to_bf16_mx) and
// the bf16 operand is the dequantized weight exactly; no scale is applied to the sums. Needs every
// code in [kMxfp8MinCode, kMxfp8MaxCode] (the products stay normal bf16: |W| in [2^-126, 2^16));
// the loader checks (mxfp8_codes_in_range). W8A16 only (the W8A8 kernels take per-128 scales).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

/// K elements per scale.
constexpr int64_t kFp8BlockK = 128;
/// Scale columns of a row of k elements.
__host__ __device__ constexpr int64_t fp8_row_scale_cols(int64_t k) {
  return (k + kFp8BlockK - 1) / kFp8BlockK;
}

/// K elements per E8M0 scale (MXFP8).
constexpr int64_t kMxfp8BlockK = 32;
/// E8M0 columns of a row of k elements.
__host__ __device__ constexpr int64_t mxfp8_scale_cols(int64_t k) {
  return (k + kMxfp8BlockK - 1) / kMxfp8BlockK;
}
/// The E8M0 codes the native MXFP8 kernels take (see above).
constexpr int kMxfp8MinCode = 10, kMxfp8MaxCode = 134;
/// True when every code of e8m0[0, count) is in [kMxfp8MinCode, kMxfp8MaxCode] (host).
bool mxfp8_codes_in_range(uint8_t const* e8m0, int64_t count);

/// Block scales [ceil(n / block_rows), ceil(k / 128)] (row-major) -> row scales [n, ceil(k / 128)]
/// (host). block_rows: the checkpoint's block height (128 for Qwen's block FP8).
std::vector<float> fp8_expand_row_scales(const float* block_scales, int64_t n, int64_t k,
                                         int64_t block_rows);

struct Fp8GemvParams {
  bf16 const* x;         // [m, k], 16-byte aligned
  uint8_t const* w;      // [n, k] E4M3, 16-byte aligned
  float const* w_scale;  // [n, ceil(k / 128)] row scales
  bf16* y;               // [m, n]
  int64_t m, n, k;
  float* y_f32 = nullptr;  // when set, the output is fp32 here ([m, n]) and y is unused
  // MXFP8 (native): when set, the E8M0 codes [n, ceil(k / 32)] and w_scale is unused.
  uint8_t const* w_e8m0 = nullptr;
};

constexpr int64_t kFp8GemvMaxM = 16;

/// True when fp8_gemv_launch accepts p: 1 <= m <= 16, n >= 1, k >= 16 and k % 16 == 0, x and w
/// 16-byte aligned, w_scale (or w_e8m0) and the output set.
bool fp8_gemv_supported(Fp8GemvParams const& p);

/// m == 0 is a no-op; throws kUnsupported when !fp8_gemv_supported(p). Asynchronous,
/// CUDA-graph safe, deterministic (no atomics).
void fp8_gemv_launch(Fp8GemvParams const& p, cudaStream_t stream);

/// out[r][c] = bf16(e4m3(q[r][c]) * row_scale[r][c / 128]) (the fp32 product rounded to bf16:
/// what the bf16 model loads), for the bf16 GEMMs of prefill-sized batches. q [rows, cols],
/// out [rows, cols] bf16, cols % 16 == 0, q and out 16-byte aligned. Asynchronous, capturable.
void fp8_dequantize_launch(uint8_t const* q, float const* row_scale, int64_t rows, int64_t cols,
                           bf16* out, cudaStream_t stream);

/// out[r][c] = bf16(e4m3(q[r][c]) * 2^(e8m0[r][c / 32] - 127)) (exact for codes in the native
/// range): the MXFP8 weights for the bf16 GEMMs of prefill-sized batches. e8m0 [rows, ceil(cols /
/// 32)]; otherwise as fp8_dequantize_launch.
void mxfp8_dequantize_launch(uint8_t const* q, uint8_t const* e8m0, int64_t rows, int64_t cols,
                             bf16* out, cudaStream_t stream);

/// The FP8 activation numerics above over x [m, k] (bf16, 8-byte aligned): q [m, k] E4M3 (4-byte
/// aligned) and scale [m, ceil(k / 128)] row-major (a last partial group of k % 128 columns is
/// its own group), for the W8A8 grouped GEMM's pre-quantized input (MoeGemmParams::x_fp8).
/// k % 16 == 0. One warp per group; asynchronous, capturable.
void fp8_quantize_rows_launch(bf16 const* x, uint8_t* q, float* scale, int64_t m, int64_t k,
                              cudaStream_t stream);

}  // namespace tandem::cuda
