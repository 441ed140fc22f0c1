// CPU references of the fused activation quantizers (fp8_act_quant.h): the same fp32 math on
// the host, bf16 rounding where the kernels round, the FP8 activation numerics per 128-column
// group.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cuda/fp8_act_quant.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

float ld(__nv_bfloat16 const* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return bf16_to_f32(h);
}
void st(__nv_bfloat16* p, float v) {
  const uint16_t h = f32_to_bf16(v);
  std::memcpy(static_cast<void*>(p), &h, 2);
}
float rb(float v) { return bf16_to_f32(f32_to_bf16(v)); }

// v[0, 128) -> q[0, 128), returns the scale.
float quantize_group(float const* v, uint8_t* q) {
  float amax = 0.f;
  for (int j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float s = amax > 0.f ? amax / 448.0f : 1.0f;
  const float inv = amax > 0.f ? std::min(448.0f / amax, FLT_MAX) : 1.0f;
  for (int j = 0; j < 128; ++j) q[j] = f32_to_f8e4m3(v[j] * inv);
  return s;
}

void quantize_row(float const* v, int64_t dim, uint8_t* q, float* scale) {
  for (int64_t g = 0; g < dim / 128; ++g) scale[g] = quantize_group(v + g * 128, q + g * 128);
}

}  // namespace

void rms_norm_quantize_fp8_reference(RmsNormFp8Params const& p) {
  TANDEM_CHECK(p.dim % 128 == 0, "rms_norm_quantize_fp8_reference: dim % 128 != 0");
  std::vector<float> v(p.dim), o(p.dim);
  for (int64_t r = 0; r < p.rows; ++r) {
    float ss = 0.f;
    for (int64_t i = 0; i < p.dim; ++i) {
      float x = ld(p.x + r * p.dim + i);
      if (p.residual != nullptr) {
        x = rb(ld(p.residual + r * p.dim + i) + x);
        st(p.residual + r * p.dim + i, x);
      }
      v[i] = x;
      ss += x * x;
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(p.dim) + p.eps);
    for (int64_t i = 0; i < p.dim; ++i) {
      o[i] = rb(ld(p.weight + i) * (v[i] * inv));
      if (p.out != nullptr) st(p.out + r * p.dim + i, o[i]);
    }
    quantize_row(o.data(), p.dim, p.q + r * p.dim, p.scale + r * (p.dim / 128));
  }
}

void fp8_gather_quantize_reference(Fp8GatherQuantParams const& p) {
  TANDEM_CHECK(p.k % 128 == 0, "fp8_gather_quantize_reference: k % 128 != 0");
  const int64_t rows = p.row_count ? std::min<int64_t>(p.rows, *p.row_count) : p.rows;
  std::vector<float> v(p.k);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = p.src[r] / p.div;
    for (int64_t i = 0; i < p.k; ++i) v[i] = ld(p.x + t * p.k + i);
    quantize_row(v.data(), p.k, p.q + r * p.k, p.scale + r * (p.k / 128));
  }
}

void silu_mul_quantize_fp8_reference(SiluMulFp8Params const& p) {
  TANDEM_CHECK(p.inter % 128 == 0, "silu_mul_quantize_fp8_reference: inter % 128 != 0");
  const int64_t rows = p.row_count ? std::min<int64_t>(p.rows, *p.row_count) : p.rows;
  std::vector<float> v(p.inter);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < p.inter; ++i) {
      int64_t gi = i, ui = p.inter + i;
      if (p.interleave > 0) {
        gi = (i / p.interleave) * 2 * p.interleave + i % p.interleave;
        ui = gi + p.interleave;
      }
      const float g = ld(p.gate_up + r * 2 * p.inter + gi);
      const float u = ld(p.gate_up + r * 2 * p.inter + ui);
      v[i] = rb(g / (1.0f + std::exp(-g)) * u);
    }
    quantize_row(v.data(), p.inter, p.q + r * p.inter, p.scale + r * (p.inter / 128));
  }
}

}  // namespace tandem::cuda
