#include "model/lm_head.h"

#include <algorithm>
#include <cstring>

#include "backend/cpu/ops.h"
#include "comm/communicator.h"

namespace tandem {

void cpu_lm_head(const ModelConfig& c, const ShardPlan& plan, comm::Communicator* comm,
                 const float* head, const float* last, int64_t r, std::vector<float>& logits) {
  const int64_t h = c.hidden_size, v = c.vocab_size;
  logits.resize(static_cast<size_t>(r * v));
  if (!plan.tensor_parallel()) {
    cpu::gemm({last, head, logits.data(), r, v, h});
    return;
  }
  const int64_t vl = plan.vocab.size(), vp = plan.vocab_rows, t = plan.spec.size;
  std::vector<float> local(static_cast<size_t>(r * vl));  // [r, vl]
  if (vl > 0) cpu::gemm({last, head, local.data(), r, vl, h});
  std::vector<float> padded(static_cast<size_t>(r * vp), 0.f);  // [r, vp]
  for (int64_t i = 0; i < r; ++i) {
    std::memcpy(padded.data() + i * vp, local.data() + i * vl, sizeof(float) * vl);
  }
  std::vector<float> all(static_cast<size_t>(t * r * vp));  // [t, r, vp]
  comm->all_gather(padded.data(), all.data(), r * vp, DType::kF32);
  for (int64_t q = 0; q < t; ++q) {
    const int64_t v0 = std::min(v, q * vp), count = std::min(v, v0 + vp) - v0;
    for (int64_t i = 0; i < r && count > 0; ++i) {
      std::memcpy(logits.data() + i * v + v0, all.data() + (q * r + i) * vp, sizeof(float) * count);
    }
  }
}

}  // namespace tandem
