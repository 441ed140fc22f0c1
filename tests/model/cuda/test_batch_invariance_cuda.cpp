// --deterministic on the GPU (CudaModelOptions::deterministic, model/cuda/batch_invariant.h): a
// request's logits rows bitwise the same alone, batched with random others (decode graphs of
// several buckets, eager mixed steps with prompt chunks), chunked at odd sizes and after a
// prefix-cache hit (tests/model/invariance_util.h, the CPU twin in tests/model). Over the demo
// model and over a random model of Qwen3-30B-A3B's layer shapes (GQA 32 / 4, head_dim 128, 128
// experts top-8, the real vocabulary), so that the GEMMs see their small, medium and large
// tiles. The default mode's result on the same schedules is printed beside (it differs on most
// GPUs: what the mode removes). Skips without a GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "core/error.h"
#include "engine/deterministic_util.h"
#include "model/cuda/batch_invariant.h"
#include "model/cuda/cuda_golden_util.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/invariance_util.h"

namespace tandem {
namespace {

using cuda_golden::gpu_available;

ModelConfig qwen3_30b_layers(int64_t layers) {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 4096;
  return c;
}

CudaModelOptions options(bool deterministic) {
  CudaModelOptions o;
  o.max_tokens = 2048;
  o.max_seqs = 16;
  o.page_size = 16;
  o.graph_max_context = 1024;
  o.deterministic = deterministic;
  return o;
}

// Runs every schedule; returns how many differed from "alone" (EXPECTs none when `strict`).
int check_schedules(Qwen3MoeCuda& model, int64_t prompt_len, bool strict) {
  const int64_t page = 16, vocab = model.config().vocab_size;
  KvCache kv = model.make_kv_cache(2048, page);
  const testing::InvarianceRequest req = testing::invariance_request(vocab, prompt_len, 8, 11);
  std::vector<float> alone;
  int differ = 0;
  for (const auto& [name, sched] : testing::invariance_schedules(12)) {
    SCOPED_TRACE(name);
    const std::vector<float> got = testing::invariance_trace(model, kv, page, req, sched);
    EXPECT_EQ(got.size(), static_cast<size_t>(vocab) * (1 + req.decode.size()));
    if (alone.empty()) {
      alone = got;
      continue;
    }
    if (got != alone || std::memcmp(got.data(), alone.data(), got.size() * sizeof(float)) != 0) {
      ++differ;
      if (strict) testing::expect_same_bits(alone, got, vocab, name);
    }
  }
  return differ;
}

TEST(CudaBatchInvariance, DemoModelRowsIndependentOfBatchChunkingAndCacheHits) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = testing::source_dir() + "/models/demo";
  {
    auto model = Qwen3MoeCuda::load(dir, options(true));
    EXPECT_EQ(check_schedules(*model, 45, true), 0);
    EXPECT_FALSE(model->captured_buckets().empty()) << "no decode step ran as a graph";
    EXPECT_EQ(model->last_moe_path(), "mma");
  }
  auto plain = Qwen3MoeCuda::load(dir, options(false));
  std::printf("default mode (demo model): %d of 6 schedules differ from alone\n",
              check_schedules(*plain, 45, false));
}

TEST(CudaBatchInvariance, Qwen3_30bShapesRowsIndependentOfBatchChunkingAndCacheHits) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig c = qwen3_30b_layers(2);
  {
    auto model = Qwen3MoeCuda::random(c, options(true), 5);
    EXPECT_EQ(check_schedules(*model, 150, true), 0);
    EXPECT_FALSE(model->captured_buckets().empty()) << "no decode step ran as a graph";
  }
  auto plain = Qwen3MoeCuda::random(c, options(false), 5);
  std::printf("default mode (30B shapes, 2 layers): %d of 6 schedules differ from alone\n",
              check_schedules(*plain, 150, false));
}

// Through the engine (engine/deterministic_util.h): 64 seeded sampled requests with top-3
// logprobs alone, all at once (decode graphs up to bucket 64, device sampling), chunked and
// with prefix-cache hits: the same tokens, bitwise the same logprobs (the GPU side of
// RealEngineTest.SixtyFourConcurrentStreamsMatchSolo without the HTTP layer).
TEST(CudaBatchInvariance, EngineSampledTokensAndLogprobsMatchSolo) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  CudaModelOptions o = options(true);
  o.max_seqs = 64;
  auto model = Qwen3MoeCuda::load(testing::source_dir() + "/models/demo", o);
  testing::check_engine_invariance(*model, 64, 8000);
}

TEST(CudaBatchInvariance, ShardedModelIsRefused) {
  CudaModelOptions o = options(true);
  o.shard = ShardSpec::decode(0, 2);
  try {
    cuda_model::check_deterministic(o);
    ADD_FAILURE() << "a sharded deterministic model was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("--deterministic"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tandem
