// Checked CUDA runtime and NCCL calls: a failure throws tandem::Error(kCuda) with the call,
// the error's name and file:line. (To move to core/ once the CUDA backend lands its own.)
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"

#ifndef TANDEM_CUDA_CHECK
#define TANDEM_CUDA_CHECK(expr)                                                         \
  do {                                                                                  \
    const cudaError_t tandem_cuda_err_ = (expr);                                        \
    if (tandem_cuda_err_ != cudaSuccess) [[unlikely]] {                                 \
      TANDEM_THROW(kCuda, #expr, " failed: ", cudaGetErrorName(tandem_cuda_err_), " (", \
                   cudaGetErrorString(tandem_cuda_err_), ")");                          \
    }                                                                                   \
  } while (0)
#endif

/// After a kernel launch: launch-configuration errors surface here, not at the next call.
#ifndef TANDEM_CUDA_CHECK_LAUNCH
#define TANDEM_CUDA_CHECK_LAUNCH() TANDEM_CUDA_CHECK(cudaGetLastError())
#endif

#define TANDEM_NCCL_CHECK(expr)                                                           \
  do {                                                                                    \
    const ncclResult_t tandem_nccl_res_ = (expr);                                         \
    if (tandem_nccl_res_ != ncclSuccess) [[unlikely]] {                                   \
      TANDEM_THROW(kCuda, #expr, " failed: ", ncclGetErrorString(tandem_nccl_res_), " (", \
                   ncclGetLastError(nullptr), ")");                                       \
    }                                                                                     \
  } while (0)
