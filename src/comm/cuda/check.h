// Checked CUDA runtime (core/cuda_check.h) and NCCL calls. Host code only.
#pragma once

#include "core/cuda_check.h"

#define TANDEM_NCCL_CHECK(expr)                                                           \
  do {                                                                                    \
    const ncclResult_t tandem_nccl_res_ = (expr);                                         \
    if (tandem_nccl_res_ != ncclSuccess) [[unlikely]] {                                   \
      TANDEM_THROW(kCuda, #expr, " failed: ", ncclGetErrorString(tandem_nccl_res_), " (", \
                   ncclGetLastError(nullptr), ")");                                       \
    }                                                                                     \
  } while (0)
