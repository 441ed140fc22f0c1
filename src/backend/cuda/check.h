// Checked CUDA runtime and cuBLAS(Lt) calls: a failure throws tandem::Error(kCuda) with the
// call, the error's name and file:line. Host code only.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core/error.h"

// NOTE: the same definition as src/comm/cuda/check.h (both guarded), so either can be
// included first.
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

#ifndef TANDEM_CUBLAS_CHECK
#define TANDEM_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                            \
    const cublasStatus_t tandem_cublas_st_ = (expr);                                              \
    if (tandem_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                \
      TANDEM_THROW(kCuda, #expr, " failed: cublas status ", static_cast<int>(tandem_cublas_st_)); \
    }                                                                                             \
  } while (0)
#endif
