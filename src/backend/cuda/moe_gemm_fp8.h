// Internal: the FP8-weight grouped GEMM behind moe_gemm_launch (moe_gemm.h, MoeGemmParams::w_fp8).
#pragma once

#include <cuda_runtime_api.h>

#include "backend/cuda/moe_gemm.h"

namespace tandem::cuda::moe_gemm_detail {

/// moe_gemm_launch for p.w_fp8 != nullptr (checks its own requirements).
void moe_gemm_fp8_launch(MoeGemmParams const& p, cudaStream_t stream);
/// The FP8 tiles' shared memory limits (moe_gemm_prepare).
void moe_gemm_fp8_prepare();

/// The W8A8 kernels (moe_gemm_fp8a.cu) for p.fp8_activations, p checked by moe_gemm_fp8_launch.
void moe_gemm_w8a8_launch(MoeGemmParams const& p, MoeGemmTile tile, cudaStream_t stream);
void moe_gemm_w8a8_prepare();

}  // namespace tandem::cuda::moe_gemm_detail
