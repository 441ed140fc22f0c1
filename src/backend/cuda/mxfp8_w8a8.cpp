// mxfp8_to_row128 (mxfp8_w8a8.h).
#include "backend/cuda/mxfp8_w8a8.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/error.h"

namespace tandem::cuda {

int64_t mxfp8_to_row128(uint8_t const* q, uint8_t const* e8m0, int64_t n, int64_t k, uint8_t* q_out,
                        float* row_scale) {
  TANDEM_CHECK_KIND(kUnsupported, k > 0 && k % 128 == 0, "mxfp8_to_row128: k (", k,
                    ") must be a positive multiple of 128");
  const int64_t sb = k / 32, kb = k / 128;
  int64_t changed = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t b = 0; b < kb; ++b) {
      uint8_t const* e = e8m0 + r * sb + b * 4;
      const int emax = std::max(std::max(e[0], e[1]), std::max(e[2], e[3]));
      row_scale[r * kb + b] = std::ldexp(1.0f, emax - 127);
      for (int s = 0; s < 4; ++s) {
        const int shift = e[s] - emax;  // <= 0
        for (int64_t j = b * 128 + s * 32; j < b * 128 + s * 32 + 32; ++j) {
          const uint8_t c = q[r * k + j];
          if (shift == 0) {
            q_out[r * k + j] = c;
            continue;
          }
          const float v = std::ldexp(f8e4m3_to_f32(c), shift);
          const uint8_t o = f32_to_f8e4m3(v);
          changed += f8e4m3_to_f32(o) != v;
          q_out[r * k + j] = o;
        }
      }
    }
  }
  return changed;
}

}  // namespace tandem::cuda
