// The CPU model is batch-invariant by construction (every row's GEMMs, norms, attention and
// MoE in a fixed per-row order, whatever the batch): --deterministic on the CPU is that. A
// request's logits rows must be bitwise the same alone, batched with random others, chunked
// and after a prefix-cache hit (tests/model/invariance_util.h; the GPU twin is
// tests/model/cuda/test_batch_invariance_cuda.cpp).
#include <gtest/gtest.h>

#include "model/invariance_util.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

TEST(CpuBatchInvariance, LogitsRowsIndependentOfBatchChunkingAndCacheHits) {
  auto model = Qwen3MoeCpu::load(std::string(TANDEM_SOURCE_DIR) + "/models/demo");
  const int64_t page = 16, vocab = model->config().vocab_size;
  KvCache kv = model->make_kv_cache(1024, page);
  const testing::InvarianceRequest req = testing::invariance_request(vocab, 45, 6, 7);
  std::vector<float> alone;
  for (const auto& [name, sched] : testing::invariance_schedules(6)) {
    SCOPED_TRACE(name);
    const std::vector<float> got = testing::invariance_trace(*model, kv, page, req, sched);
    ASSERT_EQ(got.size(), static_cast<size_t>(vocab) * (1 + req.decode.size()));
    if (alone.empty()) {
      alone = got;
      continue;
    }
    testing::expect_same_bits(alone, got, vocab, name);
  }
}

}  // namespace
}  // namespace tandem
