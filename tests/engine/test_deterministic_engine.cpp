// --deterministic through the engine (EngineConfig::deterministic) over the CPU model, which is
// batch-invariant by construction: seeded sampled requests give the same token ids and
// bitwise the same logprobs (chosen and top 3) alone, all at once, with their prompts chunked at
// odd sizes and after prefix-cache hits. The GPU twin: RealEngineTest over the GPU model
// (tests/server/http/test_real_engine.cpp, deterministic) and
// tests/model/cuda/test_batch_invariance_cuda.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "engine/engine.h"
#include "golden.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

struct Out {
  std::vector<int32_t> ids;
  std::vector<float> lp;      // chosen token's logprob per step
  std::vector<float> top_lp;  // top-3 logprobs per step, flattened
  std::vector<int32_t> top_id;
  int32_t cached = -1;
  int finished = 0;
};

OutputCallback collect(Out& c) {
  return [&c](const StepOutput& o) {
    c.ids.insert(c.ids.end(), o.token_ids.begin(), o.token_ids.end());
    c.lp.insert(c.lp.end(), o.token_logprobs.begin(), o.token_logprobs.end());
    for (const auto& step : o.top_logprobs) {
      for (const TokenLogprob& t : step) {
        c.top_id.push_back(t.id);
        c.top_lp.push_back(t.logprob);
      }
    }
    if (c.cached < 0) c.cached = o.num_cached_prompt_tokens;
    if (o.finished) ++c.finished;
  };
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void drain(Engine& e) {
  for (int guard = 0; e.step(); ++guard) ASSERT_LT(guard, 100000);
}

TEST(DeterministicEngine, SampledTokensAndLogprobsIndependentOfBatchChunkingAndCache) {
  auto model = Qwen3MoeCpu::load(testing::source_dir() + "/models/demo");
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> tok(0, 8000);
  std::vector<int32_t> shared(37);
  for (auto& t : shared) t = tok(rng);
  std::vector<GenRequest> reqs;
  for (int i = 0; i < 12; ++i) {
    GenRequest r;
    r.id = "r" + std::to_string(i);
    // Every third request starts with the shared 37 tokens (prefix-cache hits once one ran).
    if (i % 3 == 0) r.prompt_ids = shared;
    const int own = 3 + 5 * i;
    for (int j = 0; j < own; ++j) r.prompt_ids.push_back(tok(rng));
    r.max_tokens = 10;
    r.ignore_eos = true;
    r.sampling.temperature = 0.9f;
    r.sampling.top_p = 0.95f;
    r.sampling.seed = 100 + i;
    r.sampling.logprobs = 3;
    reqs.push_back(r);
  }
  auto config = [](int64_t budget, bool cache) {
    EngineConfig cfg;
    cfg.deterministic = true;
    cfg.page_size = 8;
    cfg.max_model_len = 256;
    cfg.max_num_seqs = 16;
    cfg.max_batched_tokens = budget;
    cfg.enable_prefix_cache = cache;
    return cfg;
  };
  // Reference: each request alone in a fresh engine, one prompt chunk, no cache.
  std::vector<Out> ref(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    Engine e(*model, config(1024, false));
    e.add(reqs[i], collect(ref[i]));
    drain(e);
    ASSERT_EQ(ref[i].ids.size(), 10u);
    ASSERT_EQ(ref[i].top_lp.size(), 30u);
  }
  struct Run {
    const char* name;
    int64_t budget;
    bool cache, staggered;
  };
  for (const Run& run : {Run{"all at once, 1024-token steps", 1024, true, false},
                         Run{"all at once, 7-token chunks", 7, true, false},
                         Run{"staggered, 13-token chunks", 13, true, true}}) {
    SCOPED_TRACE(run.name);
    Engine e(*model, config(run.budget, run.cache));
    std::vector<Out> got(reqs.size());
    if (run.staggered) {  // one request joins every two steps: many batch compositions
      for (size_t i = 0; i < reqs.size(); ++i) {
        e.add(reqs[i], collect(got[i]));
        e.step();
        e.step();
      }
    } else {
      for (size_t i = 0; i < reqs.size(); ++i) e.add(reqs[i], collect(got[i]));
    }
    drain(e);
    int hits = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].finished, 1) << i;
      EXPECT_EQ(got[i].ids, ref[i].ids) << "request " << i;
      EXPECT_TRUE(same_bits(got[i].lp, ref[i].lp)) << "request " << i << ": chosen logprobs";
      EXPECT_EQ(got[i].top_id, ref[i].top_id) << "request " << i;
      EXPECT_TRUE(same_bits(got[i].top_lp, ref[i].top_lp)) << "request " << i << ": top logprobs";
      hits += got[i].cached > 0 ? 1 : 0;
    }
    if (run.staggered) EXPECT_GT(hits, 0) << "no prefix-cache hit happened";
  }
}

}  // namespace
}  // namespace tandem
