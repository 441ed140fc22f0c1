// The CPU engine against transformers, token for token (tools/make_fixtures.py).
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "engine/engine.h"
#include "golden.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

using testing::Golden;
using testing::GoldenCase;

struct Result {
  std::vector<int32_t> ids;
  std::vector<std::vector<TokenLogprob>> top;
  FinishReason reason = FinishReason::kNone;
  int finished = 0;
};

GenRequest greedy_request(const std::string& id, const GoldenCase& c) {
  GenRequest r;
  r.id = id;
  r.prompt_ids = c.prompt_ids;
  r.max_tokens = c.max_tokens;
  r.sampling.temperature = 0;
  r.sampling.logprobs = static_cast<int32_t>(c.top_logprobs.empty() ? 5 : c.top_logprobs[0].size());
  return r;
}

// Runs the cases through one engine, all submitted together (a mixed batch).
std::vector<Result> run(Model& model, const std::vector<GoldenCase>& cases, EngineConfig cfg) {
  Engine engine(model, cfg);
  std::vector<Result> results(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    engine.add(greedy_request("r" + std::to_string(i), cases[i]), [&, i](const StepOutput& o) {
      Result& r = results[i];
      r.ids.insert(r.ids.end(), o.token_ids.begin(), o.token_ids.end());
      r.top.insert(r.top.end(), o.top_logprobs.begin(), o.top_logprobs.end());
      if (o.finished) {
        r.reason = o.finish_reason;
        ++r.finished;
      }
    });
  }
  while (engine.step()) {
  }
  EXPECT_EQ(engine.blocks().num_available(), engine.blocks().num_pages()) << "leaked KV pages";
  return results;
}

void expect_matches(const Golden& g, size_t i, const GoldenCase& c, const Result& r) {
  SCOPED_TRACE(g.name + " case " + std::to_string(i));
  EXPECT_EQ(r.finished, 1);
  ASSERT_EQ(r.ids, c.output_ids);
  ASSERT_EQ(r.top.size(), c.top_logprobs.size());
  for (size_t t = 0; t < r.top.size(); ++t) {
    ASSERT_EQ(r.top[t].size(), c.top_logprobs[t].size());
    for (size_t k = 0; k < r.top[t].size(); ++k) {
      const auto& want = c.top_logprobs[t][k];
      const auto& got = r.top[t][k];
      EXPECT_NEAR(got.logprob, want.logprob, 1e-3) << "position " << t << " rank " << k;
      // Ids must agree unless two candidates are tied within tolerance.
      if (got.id != want.id) {
        bool tie = (k + 1 < c.top_logprobs[t].size() &&
                    std::fabs(c.top_logprobs[t][k + 1].logprob - want.logprob) < 1e-3) ||
                   (k > 0 && std::fabs(c.top_logprobs[t][k - 1].logprob - want.logprob) < 1e-3);
        EXPECT_TRUE(tie) << "position " << t << " rank " << k << ": id " << got.id
                         << " != " << want.id;
      }
    }
  }
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, AloneBatchedAndChunked) {
  Golden g = testing::load_golden(GetParam());
  auto model = Qwen3MoeCpu::load(g.dir);
  EngineConfig cfg;
  cfg.kv_cache_mb = 64;
  cfg.max_model_len = 1024;
  // 1. Each case alone.
  std::vector<Result> alone;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    auto r = run(*model, {g.cases[i]}, cfg);
    expect_matches(g, i, g.cases[i], r[0]);
    alone.push_back(r[0]);
  }
  // 2. All cases in one batch: bit-identical to alone (batch invariance).
  auto batched = run(*model, g.cases, cfg);
  for (size_t i = 0; i < g.cases.size(); ++i) {
    EXPECT_EQ(batched[i].ids, alone[i].ids);
    for (size_t t = 0; t < alone[i].top.size() && t < batched[i].top.size(); ++t) {
      for (size_t k = 0; k < alone[i].top[t].size(); ++k) {
        EXPECT_EQ(batched[i].top[t][k].logprob, alone[i].top[t][k].logprob);
      }
    }
  }
  // 3. Chunked prefill with a small token budget and small pages.
  EngineConfig small = cfg;
  small.max_batched_tokens = 7;
  small.page_size = 4;
  auto chunked = run(*model, g.cases, small);
  for (size_t i = 0; i < g.cases.size(); ++i) expect_matches(g, i, g.cases[i], chunked[i]);
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = std::filesystem::path(info.param).filename().string();
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest, ::testing::ValuesIn(testing::golden_dirs()),
                         param_name);

}  // namespace
}  // namespace tandem
