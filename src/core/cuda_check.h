// Checked CUDA runtime calls: a failure throws tandem::Error(kCuda) with the call, the
// error's name and file:line. Host code only; include from CUDA targets only.
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"

#define TANDEM_CUDA_CHECK(expr)                                                         \
  do {                                                                                  \
    const cudaError_t tandem_cuda_err_ = (expr);                                        \
    if (tandem_cuda_err_ != cudaSuccess) [[unlikely]] {                                 \
      TANDEM_THROW(kCuda, #expr, " failed: ", cudaGetErrorName(tandem_cuda_err_), " (", \
                   cudaGetErrorString(tandem_cuda_err_), ")");                          \
    }                                                                                   \
  } while (0)

/// After a kernel launch: launch-configuration errors surface here, not at the next call.
#define TANDEM_CUDA_CHECK_LAUNCH() TANDEM_CUDA_CHECK(cudaGetLastError())
