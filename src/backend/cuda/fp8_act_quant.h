// Activation quantization fused into the kernel that produces the activation, for the W8A8
// grouped GEMM (moe_gemm_w8a8.h): every output is E4M3 codes q [rows, dim] plus scales
// [rows, dim / 128] row-major, per token and 128-column group, the FP8 activation numerics of
// fp8_linear.h: amax over the group, s = amax / 448 (1 for an all-zero group), q = e4m3(v *
// min(448 / amax, FLT_MAX)) rounded to nearest even, satfinite, where v is the bf16 value the
// bf16 op would have produced (so the FP8 input is exactly the bf16 model's activation,
// quantized once). dim % 128 == 0 throughout (K not a multiple of 128 is refused).
//
//  - rms_norm_quantize_fp8_launch: (residual add +) RMSNorm -> bf16 out (optional, for the
//    router / shared expert) and FP8 + scales; one block per row.
//  - fp8_gather_quantize_launch: the MoE permute's gather -> FP8: row i of the output is token
//    src[i] / div of x, so the grouped rows are never materialised in bf16.
//  - silu_mul_quantize_fp8_launch: the gate_up GEMM's output [rows, 2 * inter] (gate and up
//    halves, or moe_pack_gate_up's interleave) -> silu(gate) * up (rounded to bf16 as the bf16 MoE
//    does) -> FP8 + scales for the down projection. The row count may come from the device
//    (row_count, e.g. the expert offsets' last entry), so a decode graph replays it with any
//    routing.
// Asynchronous, CUDA-graph safe. CPU references: the *_reference functions below (host memory,
// the same fp32 math; the GPU's expf and the order of the mean-square sum may move a bf16
// value by one ulp, hence a code by one step).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

struct RmsNormFp8Params {
  __nv_bfloat16 const* x;        // [rows, dim]
  __nv_bfloat16* residual;       // [rows, dim] or null: with it, residual = bf16(residual + x)
                                 // (in place) and the norm is taken of the new residual
  __nv_bfloat16 const* weight;   // [dim]
  __nv_bfloat16* out = nullptr;  // [rows, dim] bf16 normed values, optional
  uint8_t* q;                    // [rows, dim] E4M3
  float* scale;                  // [rows, dim / 128]
  int64_t rows, dim;             // dim % 128 == 0, dim <= 8192
  float eps;
};
void rms_norm_quantize_fp8_launch(RmsNormFp8Params const& p, cudaStream_t stream);

struct Fp8GatherQuantParams {
  __nv_bfloat16 const* x;              // [tokens, k]
  int32_t const* src;                  // [rows] on the device: output row i is x[src[i] / div]
  int64_t div = 1;                     // top_k when src is moe_permute's permuted_src
  int32_t const* row_count = nullptr;  // device scalar: rows at and past it are skipped
  uint8_t* q;                          // [rows, k]
  float* scale;                        // [rows, k / 128]
  int64_t rows, k;                     // rows: host upper bound
};
void fp8_gather_quantize_launch(Fp8GatherQuantParams const& p, cudaStream_t stream);

struct SiluMulFp8Params {
  __nv_bfloat16 const* gate_up;        // [rows, 2 * inter]: see interleave
  int32_t const* row_count = nullptr;  // device scalar: rows at and past it are skipped
  uint8_t* q;                          // [rows, inter]
  float* scale;                        // [rows, inter / 128]
  int64_t rows, inter;                 // rows: host upper bound; inter % 128 == 0
  // Column order of gate_up: 0: gate columns [0, inter), up [inter, 2 inter); 8
  // (kMoeGateUpInterleave): moe_pack_gate_up's blocks, columns 16 j .. 16 j + 7 gate 8 j ..,
  // 16 j + 8 .. 16 j + 15 up 8 j .. (the packed expert weights' row order).
  int64_t interleave = 0;
};
void silu_mul_quantize_fp8_launch(SiluMulFp8Params const& p, cudaStream_t stream);

// ---- CPU references (host pointers; device-side fields are host pointers here too) ----
void rms_norm_quantize_fp8_reference(RmsNormFp8Params const& p);
void fp8_gather_quantize_reference(Fp8GatherQuantParams const& p);
void silu_mul_quantize_fp8_reference(SiluMulFp8Params const& p);

}  // namespace tandem::cuda
