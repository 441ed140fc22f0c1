// Qwen3.5's gated attention projection on the CPU: q_proj's rows are (query, gate) per head, then
// k and v (the fused qkv weight's layout), split into their own buffers.
#pragma once

#include <cstdint>
#include <cstring>

namespace tandem {

/// qkv [n, (2 qh + 2 kvh) d] -> q, gate [n, qh, d], k, v [n, kvh, d].
inline void split_gated_qkv(const float* qkv, int64_t n, int64_t qh, int64_t kvh, int64_t d,
                            float* q, float* gate, float* k, float* v) {
  const int64_t w = (qh * 2 + 2 * kvh) * d;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = qkv + i * w;
    for (int64_t hh = 0; hh < qh; ++hh) {
      std::memcpy(q + (i * qh + hh) * d, row + hh * 2 * d, sizeof(float) * d);
      std::memcpy(gate + (i * qh + hh) * d, row + hh * 2 * d + d, sizeof(float) * d);
    }
    std::memcpy(k + i * kvh * d, row + qh * 2 * d, sizeof(float) * kvh * d);
    std::memcpy(v + i * kvh * d, row + qh * 2 * d + kvh * d, sizeof(float) * kvh * d);
  }
}

}  // namespace tandem
