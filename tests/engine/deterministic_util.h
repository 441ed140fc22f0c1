// --deterministic through the engine, shared by the CPU test (tests/engine, CI) and the GPU
// one (tests/model/cuda): seeded sampled requests (temperature 0.9, top-p 0.95, top-3 logprobs)
// must give the same token ids and bitwise the same logprobs alone (each in a fresh engine, one
// prompt chunk, no prefix cache) and all at once, with prompts chunked at odd sizes, and joining
// one by one with prefix-cache hits (every third request shares a 37-token prefix).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace tandem::testing {

struct DetOut {
  std::vector<int32_t> ids;
  std::vector<float> lp;      // the chosen token's logprob per step
  std::vector<float> top_lp;  // top-3 logprobs per step, flattened
  std::vector<int32_t> top_id;
  int32_t cached = -1;
  int finished = 0;
};

inline OutputCallback det_collect(DetOut& c) {
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

inline bool det_same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline void det_drain(Engine& e) {
  for (int guard = 0; e.step(); ++guard) ASSERT_LT(guard, 100000);
}

// `num_requests` requests over `model` (vocabulary ids below `max_id`); EXPECTs the invariance.
inline void check_engine_invariance(Model& model, int num_requests, int32_t max_id) {
  std::mt19937 rng(9);
  std::uniform_int_distribution<int> tok(0, max_id);
  std::vector<int32_t> shared(37);
  for (auto& t : shared) t = tok(rng);
  std::vector<GenRequest> reqs;
  for (int i = 0; i < num_requests; ++i) {
    GenRequest r;
    r.id = "r" + std::to_string(i);
    if (i % 3 == 0) r.prompt_ids = shared;  // prefix-cache hits once one of them ran
    const int own = 3 + (5 * i) % 60;
    for (int j = 0; j < own; ++j) r.prompt_ids.push_back(tok(rng));
    r.max_tokens = 10;
    r.ignore_eos = true;
    r.sampling.temperature = 0.9f;
    r.sampling.top_p = 0.95f;
    r.sampling.seed = 100 + i;
    r.sampling.logprobs = 3;
    reqs.push_back(r);
  }
  auto config = [&](int64_t budget, bool cache) {
    EngineConfig cfg;
    cfg.deterministic = true;
    cfg.page_size = 16;
    cfg.max_model_len = 256;
    cfg.max_num_seqs = num_requests;
    cfg.max_batched_tokens = budget;
    cfg.enable_prefix_cache = cache;
    cfg.kv_cache_mb = 64;
    return cfg;
  };
  std::vector<DetOut> ref(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    Engine e(model, config(1024, false));
    e.add(reqs[i], det_collect(ref[i]));
    det_drain(e);
    ASSERT_EQ(ref[i].ids.size(), 10u);
    ASSERT_EQ(ref[i].top_lp.size(), 30u);
  }
  struct Run {
    const char* name;
    int64_t budget;
    bool staggered;
  };
  for (const Run& run : {Run{"all at once, 1024-token steps", 1024, false},
                         Run{"all at once, 7-token chunks", 7, false},
                         Run{"staggered, 13-token chunks", 13, true}}) {
    SCOPED_TRACE(run.name);
    Engine e(model, config(run.budget, true));
    std::vector<DetOut> got(reqs.size());
    if (run.staggered) {  // one request joins every two steps: many batch compositions
      for (size_t i = 0; i < reqs.size(); ++i) {
        e.add(reqs[i], det_collect(got[i]));
        e.step();
        e.step();
      }
    } else {
      for (size_t i = 0; i < reqs.size(); ++i) e.add(reqs[i], det_collect(got[i]));
    }
    det_drain(e);
    int hits = 0;
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].finished, 1) << i;
      EXPECT_EQ(got[i].ids, ref[i].ids) << "request " << i;
      EXPECT_TRUE(det_same_bits(got[i].lp, ref[i].lp)) << "request " << i << ": chosen logprobs";
      EXPECT_EQ(got[i].top_id, ref[i].top_id) << "request " << i;
      EXPECT_TRUE(det_same_bits(got[i].top_lp, ref[i].top_lp))
          << "request " << i << ": top logprobs";
      hits += got[i].cached > 0 ? 1 : 0;
    }
    if (run.staggered) {
      EXPECT_GT(hits, 0) << "no prefix-cache hit happened";
    }
  }
}

}  // namespace tandem::testing
