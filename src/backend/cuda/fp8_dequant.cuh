// E4M3 -> bf16 in registers for the FP8-weight kernels (fp8_gemv.cu, moe_gemm_fp8.cu).
// Included by .cu files only.
//
// Every E4M3 value is a bf16 value: the 4 exponent and 3 mantissa bits placed in bf16's low
// exponent bits and top mantissa bits (bit 10..4) read as the value times 2^-120, subnormals
// included (E4M3's subnormals land on bf16's), so one bf16x2 multiply by 2^120 (exact: a power
// of two, no overflow) gives the value. Two codes per 32-bit word, four integer ops and one
// HMUL2 per pair. The NaN codes (0x7f, 0xff) give a large finite value (the loader refuses them).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace tandem::cuda::detail {

/// p holds two codes at bits 8..15 (low element) and 24..31 (high element), zeros elsewhere:
/// returns the bf16x2 (low, high) of their values.
__device__ __forceinline__ uint32_t e4m3_pair_to_bf16x2(uint32_t p) {
  const uint32_t biased = (p & 0x80008000u) | ((p >> 4) & 0x07f007f0u);
  const uint32_t two120 = 0x7b807b80u;  // bf16 2^120 twice
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162 const*>(&biased),
                             *reinterpret_cast<__nv_bfloat162 const*>(&two120));
  return *reinterpret_cast<uint32_t*>(&r);
}

/// Four codes (bytes 0..3 of w, byte 0 first in memory) -> bf16x2 (byte 0, byte 1) in lo and
/// (byte 2, byte 3) in hi.
__device__ __forceinline__ void e4m3x4_to_bf16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  lo = e4m3_pair_to_bf16x2(__byte_perm(w, 0u, 0x1404));
  hi = e4m3_pair_to_bf16x2(__byte_perm(w, 0u, 0x3424));
}

/// MXFP8 (fp8_linear.h, native per-32 scales): the bf16x2 multiplier 2^(e - 7) twice for the
/// E8M0 code e in [kMxfp8MinCode, kMxfp8MaxCode] (then a normal bf16). e4m3_pair_to_bf16x2's
/// 2^120 times the block's 2^(e - 127): the code's value and its power-of-two scale in one exact
/// multiply (the product is a normal bf16 for codes in that range).
__device__ __forceinline__ uint32_t e8m0_bf16x2_mul(uint32_t e) {
  const uint32_t b = (e + 120u) << 7;
  return b | (b << 16);
}

/// e4m3x4_to_bf16 with the multiplier of e8m0_bf16x2_mul: the dequantized MXFP8 values.
__device__ __forceinline__ void e4m3x4_to_bf16_mx(uint32_t w, uint32_t mul, uint32_t& lo,
                                                  uint32_t& hi) {
  auto pair = [mul](uint32_t p) {
    const uint32_t biased = (p & 0x80008000u) | ((p >> 4) & 0x07f007f0u);
    __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162 const*>(&biased),
                               *reinterpret_cast<__nv_bfloat162 const*>(&mul));
    return *reinterpret_cast<uint32_t*>(&r);
  };
  lo = pair(__byte_perm(w, 0u, 0x1404));
  hi = pair(__byte_perm(w, 0u, 0x3424));
}

}  // namespace tandem::cuda::detail
