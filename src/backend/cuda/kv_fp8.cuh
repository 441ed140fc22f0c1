// FP8 (E4M3) KV cache elements in registers (--kv-cache-dtype fp8): the quantization the KV
// writes fuse (a value rounded to bf16 as the bf16 cache would hold it, divided by the layer's
// k or v scale, rounded to nearest even and saturated to +-448, as vLLM's fp8 cache) and the
// loads the attention kernels dequantize from (the code's value; the kernels apply the scale).
// CPU reference: cpu::kv_fp8_quantize / cpu::kv_fp8_dequantize. Included by .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace tandem::cuda::detail {

/// One value's E4M3 code: e4m3(bf16(v) / scale).
__device__ __forceinline__ uint8_t kv_fp8_quantize(float v, float scale) {
  const float b = __bfloat162float(__float2bfloat16_rn(v));
  return static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(__fdiv_rn(b, scale), __NV_SATFINITE, __NV_E4M3));
}

/// Stores N values as N consecutive codes (N bytes aligned).
template <int N>
__device__ __forceinline__ void store_kv_fp8(uint8_t* p, float const (&v)[N], float scale) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8 || N == 16, "vector width");
  alignas(N < 16 ? N : 16) uint8_t b[N];
#pragma unroll
  for (int i = 0; i < N; ++i) b[i] = kv_fp8_quantize(v[i], scale);
  if constexpr (N == 1) {
    *p = b[0];
  } else {
    using Raw = std::conditional_t<
        N == 16, uint4,
        std::conditional_t<N == 8, uint2, std::conditional_t<N == 4, uint32_t, uint16_t>>>;
    *reinterpret_cast<Raw*>(p) = *reinterpret_cast<Raw const*>(b);
  }
}

/// One code's value (exact in fp32).
__device__ __forceinline__ float kv_fp8_value(uint8_t c) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
  return __half2float(__half(h));
}

/// Loads N consecutive codes (N bytes aligned) as their fp32 values (unscaled).
template <int N>
__device__ __forceinline__ void load_kv_fp8(uint8_t const* p, float (&v)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 8 || N == 16, "vector width");
  if constexpr (N == 1) {
    v[0] = kv_fp8_value(*p);
  } else {
    using Raw = std::conditional_t<
        N == 16, uint4,
        std::conditional_t<N == 8, uint2, std::conditional_t<N == 4, uint32_t, uint16_t>>>;
    const Raw raw = *reinterpret_cast<Raw const*>(p);
    __nv_fp8x2_storage_t const* c2 = reinterpret_cast<__nv_fp8x2_storage_t const*>(&raw);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(c2[i], __NV_E4M3);
      const float2 f = __half22float2(__half2(h2));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
}

/// 4 consecutive codes (a 32-bit word, the lowest address in the low byte) as 4 fp16 values in
/// two words (the lower element in the low half): the same exact values as kv_fp8_value, for
/// the tensor-core decode kernel's fp16 tiles (every E4M3 value is a normal fp16 or zero).
__device__ __forceinline__ uint2 kv_fp8x4_to_half(uint32_t c) {
  uint2 r;
  const __half2_raw lo =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(c & 0xffffu), __NV_E4M3);
  const __half2_raw hi =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(c >> 16), __NV_E4M3);
  r.x = static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(lo.y) << 16);
  r.y = static_cast<uint32_t>(hi.x) | (static_cast<uint32_t>(hi.y) << 16);
  return r;
}

}  // namespace tandem::cuda::detail
