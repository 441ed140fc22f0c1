// --deterministic through the engine (EngineConfig::deterministic) over the CPU model, which is
// batch-invariant by construction: seeded sampled requests give the same token ids and bitwise
// the same logprobs alone, all at once, chunked at odd sizes and after prefix-cache hits
// (engine/deterministic_util.h). The GPU twins: tests/model/cuda/test_batch_invariance_cuda.cpp
// and RealEngineTest over the GPU model (tests/server/http/test_real_engine.cpp).
#include <gtest/gtest.h>

#include "engine/deterministic_util.h"
#include "golden.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

TEST(DeterministicEngine, SampledTokensAndLogprobsIndependentOfBatchChunkingAndCache) {
  auto model = Qwen3MoeCpu::load(testing::source_dir() + "/models/demo");
  testing::check_engine_invariance(*model, 12, 8000);
}

}  // namespace
}  // namespace tandem
