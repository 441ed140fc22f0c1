// MTP speculative decoding on the GPU (Qwen3MoeCuda::load_mtp, model/cuda/mtp_cuda.h):
//  - the MTP layer's pass against the CPU model's (the same hidden states and tokens in), by the
//    teacher-forced logits rule of test_model_cuda.cpp (median / p95 / max relative error,
//    argmax where the CPU's margin exceeds kMarginBf16);
//  - the verify step's rows (K + 1 tokens per sequence, the verify graphs) against the CPU's
//    teacher-forced logits by the same rule;
//  - lossless greedy decoding: K = 1..4, alone and batched, verify steps in graphs and eager,
//    with the random MTP layer (drafts nearly always rejected) and with oracle drafts (mostly
//    right: every accepted length, the bonus token, rollbacks) give the tokens of the same
//    model's run without speculation, up to the margin rule's horizon (the golden top1-top2
//    margin), the K = 0 run itself matching golden by the margin rule.
// Random MTP weights are fine for losslessness (tests/engine/mtp_weights.h). Skips without a
// GPU; the MTP directory helper and the oracle are host code.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/chi_square.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "engine/mtp_weights.h"
#include "engine/speculative.h"
#include "model/config.h"
#include "model/cuda/cuda_golden_util.h"
#include "model/cuda/mtp_cuda.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/cuda/spec_sampling_check.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using namespace cuda_golden;  // NOLINT: the shared rule (cuda_golden_util.h)

std::vector<std::string> mtp_fixtures() {
  std::vector<std::string> out;
  for (const auto& d : testing::golden_dirs()) {
    const ModelConfig c = ModelConfig::from_dir(d);
    if ((c.head_dim == 64 || c.head_dim == 128) && !c.is_hybrid()) out.push_back(d);
  }
  return out;
}

class CudaMtp : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaMtp, MtpPassMatchesTheCpuModel) {
  const std::string dir = GetParam();
  const testing::Golden g = testing::load_golden(dir);
  auto cpu = Qwen3MoeCpu::load(dir);
  cpu->load_mtp(testing::random_mtp_dir(dir));
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  o.page_size = 4;
  o.mtp_graphs = true;  // the one-token passes below replay the draft graph
  auto gpu = Qwen3MoeCuda::load(dir, o);
  gpu->load_mtp(testing::random_mtp_dir(dir));
  ASSERT_TRUE(gpu->has_mtp());
  const int64_t vocab = cpu->config().vocab_size;
  std::vector<double> errs;
  int checked = 0;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    const auto& c = g.cases[i];
    std::vector<int32_t> tokens = c.prompt_ids;
    tokens.insert(tokens.end(), c.output_ids.begin(), c.output_ids.end());
    const auto n = static_cast<int64_t>(tokens.size()) - 1;  // positions with a next token
    const int64_t pages = n / 4 + 2;
    std::vector<int32_t> table(static_cast<size_t>(pages));
    for (int64_t p = 0; p < pages; ++p) table[static_cast<size_t>(p)] = int32_t(pages - 1 - p);
    // The target's hidden states on the CPU (the same input for both MTP passes).
    KvCache kv(cpu->kv_geometry(pages, 4));
    std::vector<float> hidden, logits;
    ForwardBatch tb;
    tb.seqs.push_back({tokens.data(), n, 0, table.data(), pages, LogitsMode::kLast});
    tb.hidden_out = &hidden;
    cpu->forward(tb, kv, logits);
    ASSERT_EQ(static_cast<int64_t>(hidden.size()), n * cpu->config().hidden_size);
    // MTP over every position (tokens t + 1), in two chunks so the second reads cached MTP KV.
    KvCache cpu_mkv(cpu->mtp_kv_geometry(pages, 4));
    KvCache gpu_mkv = gpu->make_mtp_kv_cache(pages, 4);
    std::vector<float> want, got, part, hout_c, hout_g;
    const int64_t h = cpu->config().hidden_size;
    for (int64_t begin : {int64_t{0}, n / 2}) {
      const int64_t count = begin == 0 ? n / 2 : n - n / 2;
      if (count <= 0) continue;
      ForwardBatch mb;
      mb.seqs.push_back(
          {tokens.data() + begin + 1, count, begin, table.data(), pages, LogitsMode::kAll});
      cpu->mtp_forward(mb, hidden.data() + begin * h, cpu_mkv, part, hout_c);
      want.insert(want.end(), part.begin(), part.end());
      if (begin == 0) {
        gpu->mtp_forward(mb, hidden.data() + begin * h, gpu_mkv, part, hout_g);
        got.insert(got.end(), part.begin(), part.end());
        ASSERT_EQ(hout_g.size(), hout_c.size());
        continue;
      }
      // The second chunk on the GPU one position per pass (chained-draft shaped: the graph of
      // bucket 1, captured on first use, then replayed).
      for (int64_t t = begin; t < n; ++t) {
        ForwardBatch one;
        one.seqs.push_back({tokens.data() + t + 1, 1, t, table.data(), pages, LogitsMode::kLast});
        gpu->mtp_forward(one, hidden.data() + t * h, gpu_mkv, part, hout_g);
        ASSERT_EQ(static_cast<int64_t>(part.size()), vocab);
        ASSERT_EQ(static_cast<int64_t>(hout_g.size()), h);
        got.insert(got.end(), part.begin(), part.end());
      }
    }
    checked += compare_rows(got, want, vocab, g.name + " mtp case " + std::to_string(i), errs);
  }
  const auto [med, p95, worst] = error_quantiles(errs);
  std::printf("[ %s ] MTP rows %zu: relative error median %.2e p95 %.2e max %.2e, %d argmax\n",
              g.name.c_str(), errs.size(), med, p95, worst, checked);
  EXPECT_LT(med, kMedianTol);
  EXPECT_LT(p95, kP95Tol);
  EXPECT_LT(worst, kMaxTol);
  const auto mtp_graphs = gpu->mtp()->captured_buckets();
  EXPECT_EQ(mtp_graphs, std::vector<int64_t>{1}) << "the one-token passes ran no graph";
}

// The target's verify step (K + 1 tokens per sequence, logits of all; a captured graph when
// the batch is uniform) against the CPU model's teacher-forced logits of the same positions, by
// the teacher-forced rule: every position after the prompt is computed as a row of a verify
// step, one sequence alone and all cases together.
TEST_P(CudaMtp, VerifyRowsMatchTheCpuModel) {
  const std::string dir = GetParam();
  const testing::Golden g = testing::load_golden(dir);
  auto cpu = Qwen3MoeCpu::load(dir);
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  o.page_size = 4;
  auto gpu = Qwen3MoeCuda::load(dir, o);
  const int64_t vocab = cpu->config().vocab_size;
  std::vector<double> errs;
  int checked = 0;
  for (const int64_t q : {int64_t{2}, int64_t{3}, int64_t{5}}) {
    std::vector<std::vector<int32_t>> toks;
    for (const auto& c : g.cases) toks.push_back(teacher_forced_tokens(c));
    const auto nc = static_cast<int64_t>(toks.size());
    const std::vector<std::vector<float>> got = verify_shaped_rows(*gpu, g, toks, q);
    for (int64_t i = 0; i < nc; ++i) {
      const auto& t = toks[static_cast<size_t>(i)];
      KvCache cpu_kv(cpu->kv_geometry(static_cast<int64_t>(t.size()) / 4 + 2, 4));
      const auto want = teacher_forced(*cpu, cpu_kv, t, 1 << 20);
      checked += compare_rows(
          got[static_cast<size_t>(i)], want, vocab,
          g.name + " verify q " + std::to_string(q) + " case " + std::to_string(i), errs);
    }
  }
  EXPECT_FALSE(gpu->captured_verify_graphs().empty()) << "no verify step ran a graph";
  const auto [med, p95, worst] = error_quantiles(errs);
  std::printf(
      "[ %s ] verify rows %zu: relative error median %.2e p95 %.2e max %.2e, %d argmax checks\n",
      g.name.c_str(), errs.size(), med, p95, worst, checked);
  EXPECT_LT(med, kMedianTol);
  EXPECT_LT(p95, kP95Tol);
  EXPECT_LT(worst, kMaxTol);
  EXPECT_GT(checked, 0);
}

TEST_P(CudaMtp, GreedyLosslessForK1To4) {
  const std::string dir = GetParam();
  const testing::Golden g = testing::load_golden(dir);
  struct Mode {
    const char* name;
    bool graphs, together, oracle;
  };
  const Mode modes[] = {{"alone+graphs", true, false, false},
                        {"batched+graphs", true, true, false},
                        {"batched eager", false, true, false},
                        {"batched+graphs, oracle drafts", true, true, true},
                        {"alone+graphs, oracle drafts", true, false, true}};
  for (const bool graphs : {true, false}) {
    CudaModelOptions o;
    o.max_tokens = 1024;
    o.max_seqs = 8;
    o.page_size = 16;
    o.cuda_graphs =
        graphs;  // with graphs: the draft passes in graphs too (mtp_graphs, the default)
    auto gpu = Qwen3MoeCuda::load(dir, o);
    gpu->load_mtp(testing::random_mtp_dir(dir));
    EngineConfig base;
    base.max_num_seqs = 8;
    base.max_batched_tokens = 1024;
    base.page_size = 16;
    base.kv_cache_mb = 64;
    // The references: no speculation, alone and batched, on this model. Against golden by the
    // margin rule on the tokens and the chosen logprobs (ranks 2-5 are test_model_cuda's).
    std::map<bool, std::vector<Result>> ref;
    for (const bool together : {false, true}) {
      ref[together] = run_engine(*gpu, g.cases, base, together);
      const int compared =
          compare_greedy(g, ref[together], together ? "batched, K = 0" : "alone, K = 0",
                         /*lower_ranks=*/false);
      EXPECT_GT(compared, 0) << g.name;
    }
    for (const Mode& m : modes) {
      if (m.graphs != graphs) continue;
      for (int64_t k = 1; k <= kMaxSpeculativeTokens; ++k) {
        const std::string what = std::string(m.name) + ", K = " + std::to_string(k);
        EngineConfig cfg = base;
        cfg.num_speculative_tokens = k;
        if (m.oracle) cfg.spec_draft_hook = oracle(g.cases, gpu->config().vocab_size);
        const auto results = run_engine(*gpu, g.cases, cfg, m.together);
        const int compared = compare_to_reference(g, results, ref[m.together], what);
        EXPECT_GT(compared, 0) << g.name << " " << what;
        std::printf("[ %s ] %s: %d greedy steps compared with K = 0\n", g.name.c_str(),
                    what.c_str(), compared);
      }
    }
    if (graphs) {
      EXPECT_FALSE(gpu->captured_verify_graphs().empty()) << "no verify step ran a graph";
      EXPECT_FALSE(gpu->mtp()->captured_buckets().empty()) << "no draft pass ran a graph";
    } else {
      EXPECT_TRUE(gpu->captured_verify_graphs().empty());
      EXPECT_TRUE(gpu->mtp()->captured_buckets().empty()) << "draft graphs with graphs off";
    }
  }
}

// The setup of the chain and fused-step comparisons: the golden cases with max_tokens shortened
// unevenly (some sequences end inside a chain), the model with a random MTP layer, 8 sequences
// of 16-token pages.

// The draft chain on the device (MtpCuda::draft_chain) against pass-by-pass drafting through
// the host (cuda_golden_util.h); uneven max_tokens make sequences ride along past their K (no
// KV written).
TEST_P(CudaMtp, DraftChainEqualsPassByPass) {
  SpecComparison<Qwen3MoeCuda> sc(GetParam());
  expect_draft_chain_equals_pass_by_pass(*sc.gpu, sc.g, sc.cases, sc.base);
  EXPECT_FALSE(sc.gpu->mtp()->captured_buckets().empty()) << "no draft pass ran a graph";
}

// The fused step (the default: Model::forward_verify_draft, MtpCuda::draft_after_verify: the
// verify, its sampler, the acceptance kernel and the draft chain on the stream with one
// synchronisation) against the unfused one (cuda_golden_util.h).
TEST_P(CudaMtp, FusedStepMatchesUnfused) {
  SpecComparison<Qwen3MoeCuda> sc(GetParam());
  expect_fused_step_matches_unfused(sc);
}

// Sampled requests with speculation on the device (engine device_rows: deterministic MTP
// drafts, each verify row drawn by the device sampler with its output position's counter,
// accepted while the draw equals the draft). Over a small-vocabulary fixture, 3000 seeded
// 3-token continuations at temperature 0.8 / top-k 4 with K = 2 follow the distribution of the
// same model's non-speculative sampling: the chi-square of tests/engine/test_speculative.cpp,
// with deterministic drafts (the most frequent continuation, often accepted) and with the random
// MTP layer's drafts; always accepting (forced acceptance at p = 1) fails the same bound. The
// same seeds mostly give the very same tokens (the draws are the non-speculative ones; only
// the verify rows' logit rounding differs).
TEST(CudaMtpSampling, DistributionEqualsNonSpeculative) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir =
      testing::source_dir() + "/tests/data/fixtures/hub_mqa_hd128";  // vocab 256
  CudaModelOptions o;
  o.max_tokens = 2048;
  o.max_seqs = 128;
  o.page_size = 16;
  o.mtp_graphs = true;
  auto gpu = Qwen3MoeCuda::load(dir, o);
  gpu->load_mtp(testing::random_mtp_dir(dir));
  const testing::Golden g = testing::load_golden(dir);
  expect_spec_sampling_matches(*gpu, g, 0);
}

// CudaModelOptions::mtp_graphs (the default) with EngineConfig::warm_up and K = 3 (as tandem
// serve runs it): the verify graph of every decode bucket up to max_num_seqs (4 tokens per
// sequence) and the draft pass graph of every bucket are captured before the first request, and
// decoding afterwards (draft passes in graphs) gives the tokens of the default model (draft
// passes eager, no warm-up).
TEST(CudaMtpWarmUp, CapturesTheVerifyGraphsOfK) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = testing::source_dir() + "/tests/data/fixtures/hub_mqa_hd128";
  const testing::Golden g = testing::load_golden(dir);
  CudaModelOptions o;
  o.max_tokens = 1024;
  o.max_seqs = 8;
  o.page_size = 16;
  o.mtp_graphs = true;  // the switch under test (the default)
  EngineConfig cfg;
  cfg.max_num_seqs = 8;
  cfg.max_batched_tokens = 1024;
  cfg.page_size = 16;
  cfg.kv_cache_mb = 64;
  cfg.num_speculative_tokens = 3;
  CudaModelOptions eager = o;
  eager.mtp_graphs = false;  // draft passes eager, verify graphs on first use
  auto cold = Qwen3MoeCuda::load(dir, eager);
  cold->load_mtp(testing::random_mtp_dir(dir));
  const auto want = run_engine(*cold, g.cases, cfg, /*together=*/true);
  auto gpu = Qwen3MoeCuda::load(dir, o);
  gpu->load_mtp(testing::random_mtp_dir(dir));
  {
    EngineConfig w = cfg;
    w.warm_up = true;
    Engine engine(*gpu, w);
  }
  const auto buckets = gpu->captured_buckets();
  ASSERT_FALSE(buckets.empty());
  const auto verify = gpu->captured_verify_graphs();
  for (const int64_t b : buckets) {
    EXPECT_NE(std::find(verify.begin(), verify.end(), std::make_pair(b, int64_t{4})), verify.end())
        << "bucket " << b << " has no verify graph of 4 tokens per sequence";
  }
  EXPECT_EQ(gpu->mtp()->captured_buckets(), buckets) << "the draft passes' graphs";
  EngineConfig w = cfg;
  w.warm_up = true;
  const auto got = run_engine(*gpu, g.cases, w, /*together=*/true);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].ids, want[i].ids) << "case " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaMtp, ::testing::ValuesIn(mtp_fixtures()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = fs::path(info.param).filename().string();
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

}  // namespace
}  // namespace tandem
