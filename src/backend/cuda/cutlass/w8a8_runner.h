// Internal: the CUTLASS sm90 instantiations behind MoeGemmW8A8 (moe_gemm_w8a8.h). One
// instantiation per translation unit (moe_gemm_w8a8_prefill.cu, moe_gemm_w8a8_decode.cu), each
// minutes of nvcc: built in a job pool of one, like the FlashInfer kernels.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "backend/cuda/moe_gemm_w8a8.h"

namespace tandem::cuda::w8a8_detail {

class Runner {
 public:
  virtual ~Runner() = default;
  /// Allocates the argument arrays for `groups` groups and the workspace, initialises the
  /// kernel's parameters (host work only: TMA descriptor templates, shared memory limits).
  virtual void prepare(int64_t groups) = 0;
  /// Fills the argument arrays from p (one setup kernel) and launches the GEMM, on `stream`.
  /// p is checked by the caller.
  virtual void run(MoeGemmW8A8Params const& p, cudaStream_t stream) = 0;
};

std::unique_ptr<Runner> make_prefill_runner();  // 128 x 128 x 128 cooperative
std::unique_ptr<Runner> make_decode_runner();   // 64 x 128 x 128 ping-pong

}  // namespace tandem::cuda::w8a8_detail
