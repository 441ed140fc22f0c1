// Element types and scalar conversions shared by every backend.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace tandem {

enum class DType : uint8_t {
  kF32,
  kF16,
  kBF16,
  kF8E4M3,  // OCP FP8 E4M3 (fn: no infinities)
  kE8M0,    // MX scale: 8-bit exponent, value 2^(e-127)
  kI32,
  kI64,
};

/// Size of one element in bytes.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kF16: return 2;
    case DType::kBF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kE8M0: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

/// Lower-case name ("bf16").
std::string_view dtype_name(DType t);
/// Parses a safetensors dtype string ("BF16", "F32", "F8_E4M3", ...). Throws on unknown.
DType dtype_from_safetensors(std::string_view s);

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

/// Round to nearest even, NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float f8e4m3_to_f32(uint8_t v);
uint8_t f32_to_f8e4m3(float f);  // round to nearest even, saturating to +-448
inline float e8m0_to_f32(uint8_t e) {
  return e == 0xff ? f32_from_bits(0x7fc00000u)
                   : (e == 0 ? f32_from_bits(0x00400000u) : f32_from_bits(uint32_t(e) << 23));
}

}  // namespace tandem
