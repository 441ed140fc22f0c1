// Checked CUDA runtime (core/cuda_check.h) and cuBLAS(Lt) calls. Host code only.
#pragma once

#include <cublasLt.h>

#include "core/cuda_check.h"

#define TANDEM_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                            \
    const cublasStatus_t tandem_cublas_st_ = (expr);                                              \
    if (tandem_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                                \
      TANDEM_THROW(kCuda, #expr, " failed: cublas status ", static_cast<int>(tandem_cublas_st_)); \
    }                                                                                             \
  } while (0)
