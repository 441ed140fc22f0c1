// CPU reference of the FP8 activation quantization (fp8_linear.h, "FP8 activations"): per
// token and 128-column group, s = amax / 448 (1 for an all-zero group), q = e4m3(x * (448 /
// amax)) rounded to nearest even, satfinite; the fp32 operations the kernels do (the FP8
// tensor-core grouped GEMM's in-kernel quantizer and fp8_quantize_act_launch).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace tandem::cuda::test_util {

/// x[0, n) (n <= 128: one group, a partial last group included) -> q[0, n), returns s.
inline float fp8_quantize_group_ref(float const* x, int64_t n, uint8_t* q) {
  float amax = 0.f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float s = amax > 0.f ? amax / 448.0f : 1.0f;
  const float inv = amax > 0.f ? std::min(448.0f / amax, FLT_MAX) : 1.0f;
  for (int64_t j = 0; j < n; ++j) q[j] = f32_to_f8e4m3(x[j] * inv);
  return s;
}

}  // namespace tandem::cuda::test_util
