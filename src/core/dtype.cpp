#include "core/dtype.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace tandem {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kF8E4M3: return "f8e4m3";
    case DType::kE8M0: return "e8m0";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "?";
}

DType dtype_from_safetensors(std::string_view s) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  if (s == "F8_E4M3") return DType::kF8E4M3;
  if (s == "F8_E8M0" || s == "E8M0" || s == "U8") return DType::kE8M0;
  if (s == "I32") return DType::kI32;
  if (s == "I64") return DType::kI64;
  TANDEM_THROW(kUnsupported, "unsupported safetensors dtype '", s, "'");
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  if (exp == 0) {
    if (man == 0) return f32_from_bits(sign);
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (a < 0x38800000u) {                                               // subnormal / zero
    float v = f32_from_bits(a);
    uint32_t m = static_cast<uint32_t>(std::nearbyint(std::ldexp(v, 24)));
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}

float f8e4m3_to_f32(uint8_t v) {
  uint32_t sign = v & 0x80u;
  uint32_t exp = (v >> 3) & 0xf;
  uint32_t man = v & 0x7;
  float r;
  if (exp == 0xf && man == 0x7) return f32_from_bits(0x7fc00000u);
  if (exp == 0) {
    r = std::ldexp(static_cast<float>(man), -9);
  } else {
    r = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, static_cast<int>(exp) - 7);
  }
  return sign ? -r : r;
}

uint8_t f32_to_f8e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint32_t u = f32_bits(f);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x43e00000u) return sign | 0x7e;  // |f| >= 448 (and inf): saturate
  if (a < 0x3c800000u) {
    // Below 2^-6, E4M3's smallest normal: subnormals m * 2^-9. Scaling by 2^9 is exact and
    // nearbyint rounds to nearest even (default mode); m == 8 is the smallest normal, 0x08.
    const auto m = static_cast<uint32_t>(std::nearbyint(f32_from_bits(a) * 512.0f));
    return static_cast<uint8_t>(sign | m);
  }
  // Normal: keep 3 of the 23 mantissa bits, rounding to nearest even (a carry into the
  // exponent is the correct result); rebias 127 -> 7.
  const uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  const uint32_t e = (r >> 23) - 120u;
  const uint32_t code = (e << 3) | ((r >> 20) & 7u);
  return static_cast<uint8_t>(sign | std::min<uint32_t>(code, 0x7eu));
}

}  // namespace tandem
