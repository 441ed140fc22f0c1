// Host-side weights shared by the CUDA kernel tests and the kernel-test harness's cases: a
// block-FP8 matrix with its dequantized reference, and the grouped GEMM's packed gate_up layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm.h"
#include "core/dtype.h"

namespace tandem::cuda::test_util {

/// A random E4M3 matrix [n, k] with its block scales [ceil(n / 128), ceil(k / 128)].
struct Fp8Matrix {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> q;
  std::vector<float> block_scale;
  std::vector<float> row_scale() const {
    return fp8_expand_row_scales(block_scale.data(), n, k, 128);
  }
  /// Dequantized element: e4m3(q) * scale as float (the CPU model's load).
  float at(int64_t r, int64_t c) const {
    return f8e4m3_to_f32(q[static_cast<size_t>(r * k + c)]) *
           block_scale[static_cast<size_t>((r / 128) * ((k + 127) / 128) + c / 128)];
  }
};

/// Packs E experts' HF gate [E, I, H] and up [E, I, H] (bf16 bits) into [E, 2I, H].
inline std::vector<uint16_t> pack_all(std::vector<uint16_t> const& gate,
                                      std::vector<uint16_t> const& up, int64_t E, int64_t I,
                                      int64_t H) {
  std::vector<uint16_t> packed(gate.size() * 2);
  for (int64_t e = 0; e < E; ++e) {
    moe_pack_gate_up(reinterpret_cast<bf16 const*>(gate.data() + e * I * H),
                     reinterpret_cast<bf16 const*>(up.data() + e * I * H), I, H,
                     reinterpret_cast<bf16*>(packed.data() + e * 2 * I * H));
  }
  return packed;
}

}  // namespace tandem::cuda::test_util
