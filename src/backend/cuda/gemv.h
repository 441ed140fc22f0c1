// Small-m GEMM ("gemv") for decode: y[m, n] = alpha * x[m, k] W[n, k]^T with 1 <= m <= 8, bf16 x
// and W (W in the Hugging Face [out, in] layout), fp32 accumulation, bf16 or fp32 output.
// Bandwidth-oriented: a warp streams whole rows of W with 16-byte loads (8 in flight per lane),
// multiplies them by the m rows of x (read through L1), warp-reduces; no atomics, so the result
// is deterministic. Framework-free: a params struct in, a stream; the launch is asynchronous and
// CUDA-graph safe. GemmLt (gemm.h) times it beside cuBLASLt for m <= 8 and keeps the faster.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

/// Same layout and field order as GemmParams (minus beta: the output is only written).
struct GemvParams {
  bf16 const* x;  // [m, k], 16-byte aligned
  bf16 const* w;  // [n, k], 16-byte aligned
  bf16* y;        // [m, n]
  int64_t m, n, k;
  float alpha = 1.0f;
  float* y_f32 = nullptr;  // when set, the output is fp32 here ([m, n]) and y is unused
  /// A programmatic dependent launch: each warp issues its first weight loads, then waits for
  /// the previous kernel in the stream (griddepcontrol.wait) before reading x, then lets the
  /// next kernel launch. GemmLt sets it when decode_switches().gemv_pdl is on.
  bool pdl = false;
};

constexpr int64_t kGemvMaxM = 8;

/// True when gemv_launch accepts p: 1 <= m <= kGemvMaxM, n >= 1, k >= 8 and k % 8 == 0, x and w
/// 16-byte aligned, the output naturally aligned.
bool gemv_supported(GemvParams const& p);

/// Launches the kernel; m == 0 is a no-op. Throws kUnsupported when !gemv_supported(p).
void gemv_launch(GemvParams const& p, cudaStream_t stream);

}  // namespace tandem::cuda
