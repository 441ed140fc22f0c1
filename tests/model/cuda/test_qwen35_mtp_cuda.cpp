// MTP speculative decoding of the Qwen3.5 hybrid on the GPU (Qwen35MoeCuda::load_mtp, the
// published layout of model/qwen3_5_mtp.cpp), on the qwen35_* golden fixtures with random MTP
// weights (tests/engine/mtp_weights.h):
//  - the target's hidden_out (forward, forward_sample) and the MTP passes (mtp_forward: logits
//    and hidden_out) against the CPU model's (Qwen35MoeCpu) for the same batches: mixed batches
//    whose device token order (multi-token chunks first) differs from the batch order, chunks
//    reading the MTP KV written by earlier passes, and one-token passes shaped as chained drafts
//    (replaying the draft graphs of their buckets); logits rows by the teacher-forced rule of
//    test_model_cuda.cpp (median / p95 relative error; argmax where the CPU's margin exceeds
//    kMarginBf16, a few flips allowed as in test_qwen35_cuda.cpp), hidden rows by their
//    relative error;
//  - the target's verify-shaped steps (q = 2, 3, 5 tokens per sequence, all cases batched)
//    against the CPU's teacher-forced logits by the hybrid statistics of test_qwen35_cuda.cpp;
//  - lossless greedy decoding: K = 1..4, alone, batched, chunked, with prefix-cache hits, decode
//    and draft graphs on and off, with the random MTP layer's drafts (nearly always rejected:
//    every verify step rolls the DeltaNet states back) and with oracle drafts (mostly right:
//    every accepted length, the bonus token, partial rollbacks), give the tokens of the same
//    model's run without speculation up to the margin rule's horizon; the K = 0 runs match
//    golden by the margin rule;
//  - sampled requests with speculation on the device: the chi-square of CudaMtpSampling over the
//    text fixture (vocab 256), a wrong acceptance rule failing the same bound.
// Skips without a GPU.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/chi_square.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "engine/mtp_weights.h"
#include "engine/speculative.h"
#include "model/config.h"
#include "model/cuda/cuda_golden_util.h"
#include "model/cuda/qwen3_5_moe_cuda.h"
#include "model/cuda/spec_sampling_check.h"
#include "model/qwen3_5_moe.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using namespace cuda_golden;  // NOLINT: the shared rule (cuda_golden_util.h)

// test_qwen35_cuda.cpp's hybrid statistics (why they are wider: the comment there), for the
// target's hidden rows; the MTP's own logits rows (one layer, random weights) take the
// Qwen3-MoE ones plus a few flipped argmaxes (a routing decision bf16 flips moves one row).
constexpr double kHybridMedianTol = 2.5e-2;
constexpr double kHybridP95Tol = 0.2;
constexpr double kFlips = 0.05;

// Relative L2 error of each row of got vs want ([rows, width]) appended to errs.
void row_errors(const std::vector<float>& got, const std::vector<float>& want, int64_t width,
                const std::string& what, std::vector<double>& errs) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t r = 0; r * static_cast<size_t>(width) < want.size(); ++r) {
    double num = 0, den = 0;
    for (int64_t j = 0; j < width; ++j) {
      const size_t i = r * static_cast<size_t>(width) + static_cast<size_t>(j);
      ASSERT_TRUE(std::isfinite(got[i])) << what << " row " << r;
      num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
      den += double(want[i]) * want[i];
    }
    errs.push_back(std::sqrt(num / std::max(den, 1e-30)));
  }
}

class CudaQwen35Mtp : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  }
};

// Every case's tokens (prompt and output); sequence i owns pages [i * per, (i + 1) * per),
// descending, and state slot i.
struct Layout {
  std::vector<std::vector<int32_t>> toks;
  std::vector<int32_t> tables;
  int64_t per = 0;
  int64_t nc = 0;
};

Layout layout(const testing::Golden& g, int64_t page) {
  Layout l;
  for (const auto& c : g.cases) {
    std::vector<int32_t> t = c.prompt_ids;
    t.insert(t.end(), c.output_ids.begin(), c.output_ids.end());
    l.toks.push_back(t);
  }
  l.nc = static_cast<int64_t>(l.toks.size());
  CaseTables ct = case_tables(l.toks, page, /*descending=*/true);
  l.per = ct.per;
  l.tables = std::move(ct.tables);
  return l;
}

TEST_P(CudaQwen35Mtp, HiddenAndMtpPassesMatchTheCpuModel) {
  const std::string dir = GetParam();
  const testing::Golden g = testing::load_golden(dir);
  auto cpu = Qwen35MoeCpu::load(dir);
  cpu->load_mtp(testing::random_mtp_dir(dir));
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  o.page_size = 4;
  o.mtp_graphs = true;  // the one-token passes below replay the draft graphs
  auto gpu = Qwen35MoeCuda::load(dir, o);
  EXPECT_FALSE(gpu->has_mtp());
  gpu->load_mtp(testing::random_mtp_dir(dir));
  ASSERT_TRUE(gpu->has_mtp());
  const int64_t vocab = cpu->config().vocab_size, h = cpu->config().hidden_size;
  const Layout l = layout(g, 4);
  ASSERT_GE(l.nc, 2);
  const int64_t np = l.nc * l.per;
  auto seq = [&](int64_t i, int64_t begin, int64_t count, LogitsMode mode) {
    return ForwardSeq{l.toks[static_cast<size_t>(i)].data() + begin,
                      count,
                      begin,
                      l.tables.data() + i * l.per,
                      l.per,
                      mode,
                      static_cast<int32_t>(i)};
  };
  auto len = [&](int64_t i) { return static_cast<int64_t>(l.toks[static_cast<size_t>(i)].size()); };

  // 1. The target over every position in two mixed steps (case 0: a chunk, then its last token
  // alone; the others: half, then the rest), hidden_out on both. The CPU's hidden states (in
  // position order per case) are the MTP passes' input below.
  KvCache cpu_kv(cpu->kv_geometry(np, 4));
  cpu_kv.allocate_states(l.nc, cpu->state_slot_elems());
  KvCache gpu_kv = gpu->make_kv_cache(np, 4);
  gpu_kv.allocate_states(l.nc, gpu->state_slot_elems());
  std::vector<std::vector<float>> hidden(static_cast<size_t>(l.nc));
  std::vector<double> herrs;
  for (int step = 0; step < 2; ++step) {
    ForwardBatch b;
    for (int64_t i = 0; i < l.nc; ++i) {
      const int64_t cut = i == 0 ? len(i) - 1 : len(i) / 2;
      b.seqs.push_back(step == 0 ? seq(i, 0, cut, LogitsMode::kLast)
                                 : seq(i, cut, len(i) - cut, LogitsMode::kLast));
    }
    std::vector<float> hc, hg, logits;
    b.hidden_out = &hc;
    cpu->forward(b, cpu_kv, logits);
    b.hidden_out = &hg;
    gpu->forward(b, gpu_kv, logits);
    ASSERT_EQ(static_cast<int64_t>(hg.size()), b.num_tokens() * h);
    row_errors(hg, hc, h, g.name + " target hidden step " + std::to_string(step), herrs);
    int64_t t = 0;
    for (int64_t i = 0; i < l.nc; ++i) {
      const int64_t k = b.seqs[static_cast<size_t>(i)].num_tokens;
      auto& dst = hidden[static_cast<size_t>(i)];
      dst.insert(dst.end(), hc.begin() + t * h, hc.begin() + (t + k) * h);
      t += k;
    }
  }
  // forward_sample fills hidden_out as forward does (one more mixed step on fresh slots).
  {
    KvCache kv2 = gpu->make_kv_cache(np, 4);
    kv2.allocate_states(l.nc, gpu->state_slot_elems());
    ForwardBatch b;
    for (int64_t i = 0; i < l.nc; ++i) {
      b.seqs.push_back(seq(i, 0, i == 0 ? 1 : len(i) / 2, LogitsMode::kLast));
    }
    std::vector<float> hg;
    b.hidden_out = &hg;
    std::vector<DeviceSampling> rows(static_cast<size_t>(l.nc));
    for (auto& r : rows) r.temperature = 0.0f;
    std::vector<SampledToken> out;
    gpu->forward_sample(b, kv2, rows, out, {});
    ASSERT_EQ(out.size(), rows.size());
    std::vector<float> want;
    for (int64_t i = 0; i < l.nc; ++i) {
      const auto& src = hidden[static_cast<size_t>(i)];
      const int64_t k = b.seqs[static_cast<size_t>(i)].num_tokens;
      want.insert(want.end(), src.begin(), src.begin() + k * h);
    }
    row_errors(hg, want, h, g.name + " target hidden (forward_sample)", herrs);
  }
  {
    const auto [med, p95, worst] = error_quantiles(herrs);
    std::printf("[ %s ] target hidden rows %zu: relative error median %.2e p95 %.2e max %.2e\n",
                g.name.c_str(), herrs.size(), med, p95, worst);
    EXPECT_LT(med, kHybridMedianTol);
    EXPECT_LT(p95, kHybridP95Tol);
  }

  // 2. MTP passes over positions [0, len - 1) of every case (position t: h_t and token t + 1):
  // A mixed (case 0 one token, the others their first half, logits of all), B mixed (case 0 the
  // rest as a chunk, the others one token), then one-token passes of all the others together
  // (chained drafts' shape), each reading the MTP KV written before.
  KvCache cpu_mkv(cpu->mtp_kv_geometry(np, 4));
  KvCache gpu_mkv = gpu->make_mtp_kv_cache(np, 4);
  EXPECT_EQ(gpu_mkv.geometry().num_layers, 1);
  std::vector<int64_t> done(static_cast<size_t>(l.nc), 0);
  std::vector<double> lerrs, mherrs;
  RowStats st;
  for (int pass = 0;; ++pass) {
    ForwardBatch b;
    std::vector<float> hin;
    for (int64_t i = 0; i < l.nc; ++i) {
      const int64_t n = len(i) - 1, at = done[static_cast<size_t>(i)];
      if (at >= n) continue;
      int64_t count = 1;
      if (pass == 0 && i > 0) count = n / 2;
      if (pass == 1 && i == 0) count = n - at;
      const LogitsMode mode = count > 1 ? LogitsMode::kAll : LogitsMode::kLast;
      b.seqs.push_back({l.toks[static_cast<size_t>(i)].data() + at + 1, count, at,
                        l.tables.data() + i * l.per, l.per, mode, -1});
      const auto& src = hidden[static_cast<size_t>(i)];
      hin.insert(hin.end(), src.begin() + at * h, src.begin() + (at + count) * h);
      done[static_cast<size_t>(i)] += count;
    }
    if (b.seqs.empty()) break;
    std::vector<float> lc, lg, hc, hg;
    cpu->mtp_forward(b, hin.data(), cpu_mkv, lc, hc);
    gpu->mtp_forward(b, hin.data(), gpu_mkv, lg, hg);
    ASSERT_EQ(static_cast<int64_t>(lg.size()), b.num_logit_rows() * vocab);
    ASSERT_EQ(static_cast<int64_t>(hg.size()), b.num_logit_rows() * h);
    const std::string what = g.name + " mtp pass " + std::to_string(pass);
    const RowStats s = compare_rows_counting_flips(lg, lc, vocab, what, lerrs);
    st.checked += s.checked;
    st.flipped += s.flipped;
    row_errors(hg, hc, h, what + " hidden", mherrs);
  }
  const auto [med, p95, worst] = error_quantiles(lerrs);
  const auto [hmed, hp95, hworst] = error_quantiles(mherrs);
  std::printf(
      "[ %s ] MTP logits rows %zu: relative error median %.2e p95 %.2e max %.2e, %d argmax "
      "checks, %d flipped; hidden rows median %.2e p95 %.2e max %.2e\n",
      g.name.c_str(), lerrs.size(), med, p95, worst, st.checked, st.flipped, hmed, hp95, hworst);
  EXPECT_LT(med, kMedianTol);
  EXPECT_LT(p95, kP95Tol);
  EXPECT_LT(hmed, kMedianTol);
  EXPECT_LT(hp95, kP95Tol);
  EXPECT_GT(st.checked, 0);
  EXPECT_LE(st.flipped, kFlips * st.checked);
  // The one-token passes of two, then one sequence replayed their buckets' graphs.
  EXPECT_EQ(gpu->captured_mtp_buckets(), (std::vector<int64_t>{1, 2}));

  // Bad input: a token id out of range, a cache the model did not make.
  ForwardBatch bad;
  std::vector<int32_t> ids = {static_cast<int32_t>(vocab)};
  bad.seqs.push_back({ids.data(), 1, 0, l.tables.data(), l.per, LogitsMode::kLast, -1});
  std::vector<float> lg, hg, one(static_cast<size_t>(h), 0.0f);
  EXPECT_THROW(gpu->mtp_forward(bad, one.data(), gpu_mkv, lg, hg), Error);
  ids[0] = 1;
  EXPECT_THROW(gpu->mtp_forward(bad, one.data(), cpu_mkv, lg, hg), Error);
  EXPECT_THROW(gpu->load_mtp(dir + "/no_such_dir"), Error);
  EXPECT_TRUE(gpu->has_mtp());
}

// The GPU model of `dir` for the verify-step tests: 512 tokens, 8 sequences, 4-token pages.
std::unique_ptr<Qwen35MoeCuda> load_for_verify_steps(const std::string& dir, bool verify_graphs) {
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  o.page_size = 4;
  auto gpu = Qwen35MoeCuda::load(dir, o);
  gpu->set_verify_graphs(verify_graphs);
  return gpu;
}

// The target's verify-shaped steps (q tokens per sequence, logits of all, every case in one
// batch: chunks continuing the DeltaNet states and the KV mid-page) against the CPU model's
// teacher-forced logits of the same positions, by the hybrid statistics of test_qwen35_cuda.cpp.
// verify_graphs: the uniform steps replay the verify graphs (Qwen35MoeCuda::set_verify_graphs).
void expect_verify_rows_match_the_cpu(const std::string& dir, bool verify_graphs) {
  const testing::Golden g = testing::load_golden(dir);
  auto cpu = Qwen35MoeCpu::load(dir);
  auto gpu = load_for_verify_steps(dir, verify_graphs);
  const int64_t vocab = cpu->config().vocab_size;
  std::vector<double> errs;
  RowStats st;
  std::vector<std::vector<int32_t>> toks;
  for (const auto& c : g.cases) toks.push_back(teacher_forced_tokens(c));
  const auto nc = static_cast<int64_t>(toks.size());
  std::vector<std::vector<float>> want;
  for (int64_t i = 0; i < nc; ++i) {
    const auto& t = toks[static_cast<size_t>(i)];
    KvCache cpu_kv(cpu->kv_geometry(static_cast<int64_t>(t.size()) / 4 + 2, 4));
    cpu_kv.allocate_states(1, cpu->state_slot_elems());
    want.push_back(teacher_forced(*cpu, cpu_kv, t, 1 << 20, 0));
  }
  for (const int64_t q : {int64_t{2}, int64_t{3}, int64_t{5}}) {
    const std::vector<std::vector<float>> got = verify_shaped_rows(*gpu, g, toks, q);
    for (int64_t i = 0; i < nc; ++i) {
      const RowStats s = compare_rows_counting_flips(
          got[static_cast<size_t>(i)], want[static_cast<size_t>(i)], vocab,
          g.name + " verify q " + std::to_string(q) + " case " + std::to_string(i), errs);
      st.checked += s.checked;
      st.flipped += s.flipped;
    }
  }
  const auto [med, p95, worst] = error_quantiles(errs);
  std::printf(
      "[ %s ] verify rows%s %zu: relative error median %.2e p95 %.2e max %.2e, %d argmax checks, "
      "%d flipped\n",
      g.name.c_str(), verify_graphs ? " (graphs)" : "", errs.size(), med, p95, worst, st.checked,
      st.flipped);
  EXPECT_LT(med, kHybridMedianTol);
  EXPECT_LT(p95, kHybridP95Tol);
  EXPECT_GT(st.checked, 0);
  EXPECT_LE(st.flipped, kFlips * st.checked);
  if (verify_graphs) {
    EXPECT_FALSE(gpu->captured_verify_graphs().empty()) << "no verify step ran a graph";
  } else {
    EXPECT_TRUE(gpu->captured_verify_graphs().empty());
  }
}

TEST_P(CudaQwen35Mtp, VerifyRowsMatchTheCpuModel) {
  expect_verify_rows_match_the_cpu(GetParam(), false);
}

// The same steps replaying the verify graphs (the default).
TEST_P(CudaQwen35Mtp, VerifyGraphRowsMatchTheCpuModel) {
  expect_verify_rows_match_the_cpu(GetParam(), true);
}

// Qwen35MoeCuda::replay_states: a verify step (eager, or its graph) keeps its DeltaNet inputs;
// replaying 1..4 of each sequence's 4 tokens from the restored states gives the states of a
// forward over those tokens alone (relative L2 per slot; bf16 in_proj rows of a different batch
// shape), far closer than the state after all 4.
void expect_replay_matches_a_prefix_forward(const std::string& dir, bool verify_graphs) {
  const testing::Golden g = testing::load_golden(dir);
  auto gpu = load_for_verify_steps(dir, verify_graphs);
  constexpr int64_t q = 4;
  std::vector<std::vector<int32_t>> toks;
  std::vector<int64_t> prompt;
  for (const auto& c : g.cases) {
    std::vector<int32_t> t = teacher_forced_tokens(c);
    if (t.size() < c.prompt_ids.size() + q || toks.size() == 4) continue;
    toks.push_back(t);
    prompt.push_back(static_cast<int64_t>(c.prompt_ids.size()));
  }
  ASSERT_FALSE(toks.empty());
  const auto nc = static_cast<int64_t>(toks.size());
  const auto [per, tables] = case_tables(toks, 4, /*descending=*/false);
  KvCache kv = gpu->make_kv_cache(nc * per, 4);
  kv.allocate_states(2 * nc, gpu->state_slot_elems());
  auto step = [&](const std::function<int64_t(int64_t)>& start,
                  const std::function<int64_t(int64_t)>& count, int32_t slot_base, bool keep,
                  LogitsMode mode) {
    ForwardBatch b;
    b.keep_recurrent_inputs = keep;
    for (int64_t i = 0; i < nc; ++i) {
      b.seqs.push_back({toks[static_cast<size_t>(i)].data() + start(i), count(i), start(i),
                        tables.data() + i * per, per, mode, static_cast<int32_t>(slot_base + i)});
    }
    std::vector<float> logits;
    gpu->forward(b, kv, logits);
  };
  auto state = [&](int64_t slot) {
    const auto s = kv.read_state(slot);
    return std::vector<float>(s.begin(), s.end());
  };
  auto rel = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
      den += double(b[i]) * b[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
  };
  auto at = [&](int64_t i) { return prompt[static_cast<size_t>(i)]; };
  auto replayed = [](int64_t i) { return 1 + i % q; };
  step([](int64_t) { return 0; }, at, 0, false, LogitsMode::kLast);  // the prompts
  std::vector<std::vector<float>> snap;
  for (int64_t i = 0; i < nc; ++i) snap.push_back(state(i));
  step(
      at, [](int64_t) { return q; }, 0, /*keep=*/true, LogitsMode::kAll);  // the verify
  std::vector<std::vector<float>> after_all;
  std::vector<StateReplay> replays;
  for (int64_t i = 0; i < nc; ++i) {
    after_all.push_back(state(i));
    kv.write_state(i, snap[static_cast<size_t>(i)].data());
    kv.write_state(nc + i, snap[static_cast<size_t>(i)].data());
    replays.push_back({static_cast<int32_t>(i), i * q, replayed(i)});
  }
  ASSERT_TRUE(gpu->replay_states(replays, kv));
  EXPECT_FALSE(gpu->replay_states(replays, kv)) << "the kept inputs replay once";
  step(at, replayed, static_cast<int32_t>(nc), false, LogitsMode::kAll);  // the reference
  for (int64_t i = 0; i < nc; ++i) {
    const std::vector<float> want = state(nc + i);
    const double err = rel(state(i), want), moved = rel(after_all[static_cast<size_t>(i)], want);
    std::printf(
        "[ %s ] replay%s of %lld tokens: state relative error %.2e (after all %lld: %.2e)\n",
        g.name.c_str(), verify_graphs ? " (verify graph)" : "", static_cast<long long>(replayed(i)),
        err, static_cast<long long>(q), moved);
    if (replayed(i) < q) {
      EXPECT_LT(err * 4, moved) << "case " << i;
    }
    EXPECT_LT(err, 2e-2) << "case " << i;
  }
  EXPECT_EQ(gpu->captured_verify_graphs().empty(), !verify_graphs);
}

TEST_P(CudaQwen35Mtp, ReplayStatesMatchAPrefixForward) {
  expect_replay_matches_a_prefix_forward(GetParam(), false);
}

TEST_P(CudaQwen35Mtp, ReplayStatesAfterAVerifyGraphMatchAPrefixForward) {
  expect_replay_matches_a_prefix_forward(GetParam(), true);
}

// The draft chain on the device (Qwen35MoeCuda::mtp_draft_chain: the default) against
// pass-by-pass drafting through the host (cuda_golden_util.h).
TEST_P(CudaQwen35Mtp, DraftChainEqualsPassByPass) {
  SpecComparison<Qwen35MoeCuda> sc(GetParam());
  sc.base.state_checkpoint_interval = 16;
  EXPECT_TRUE(sc.gpu->mtp_drafts_on_device()) << "on by default";
  expect_draft_chain_equals_pass_by_pass(*sc.gpu, sc.g, sc.cases, sc.base);
  EXPECT_FALSE(sc.gpu->captured_mtp_buckets().empty()) << "no draft pass ran a graph";
}

// The fused step (Qwen35MoeCuda::forward_verify_draft: the default; the rejected drafts'
// DeltaNet states restored and replayed on the device from the accepted counts there) against
// the unfused one (the engine's rollback), cuda_golden_util.h.
TEST_P(CudaQwen35Mtp, FusedStepMatchesUnfused) {
  SpecComparison<Qwen35MoeCuda> sc(GetParam());
  sc.base.state_checkpoint_interval = 16;
  expect_fused_step_matches_unfused(sc);
}

struct LosslessMode {
  const char* name;
  bool graphs, together;
  int64_t budget, page;
  bool twice = false;  // every prompt a second time in the same engine: prefix-cache hits
  bool oracle = false;
  bool verify_graphs = false;  // Qwen35MoeCuda::set_verify_graphs
  bool replay = true;          // EngineConfig::spec_state_replay
};

void expect_greedy_lossless(const std::string& dir, const std::vector<LosslessMode>& modes) {
  const testing::Golden g = testing::load_golden(dir);
  for (const LosslessMode& m : modes) {
    CudaModelOptions o;
    o.max_tokens = m.budget;
    o.max_seqs = 8;
    o.page_size = m.page;
    o.cuda_graphs = m.graphs;
    auto gpu = Qwen35MoeCuda::load(dir, o);
    gpu->load_mtp(testing::random_mtp_dir(dir));
    gpu->set_verify_graphs(m.verify_graphs);
    EngineConfig base;
    base.max_num_seqs = 8;
    base.max_batched_tokens = m.budget;
    base.page_size = m.page;
    base.kv_cache_mb = 64;
    base.state_checkpoint_interval = 16;
    std::vector<testing::GoldenCase> cases = g.cases;
    if (m.twice) cases.insert(cases.end(), g.cases.begin(), g.cases.end());
    testing::Golden gg = g;
    gg.cases = cases;
    // The reference: no speculation, against golden by the margin rule (tokens and the chosen
    // logprobs).
    const auto ref = run_engine(*gpu, cases, base, m.together);
    const int ref_compared =
        compare_greedy(gg, ref, std::string(m.name) + ", K = 0", /*lower_ranks=*/false);
    EXPECT_GT(ref_compared, 0) << g.name << " " << m.name;
    for (int64_t k = 1; k <= kMaxSpeculativeTokens; ++k) {
      const std::string what = std::string(m.name) + ", K = " + std::to_string(k);
      EngineConfig cfg = base;
      cfg.num_speculative_tokens = k;
      cfg.spec_state_replay = m.replay;
      if (m.oracle) cfg.spec_draft_hook = oracle(cases, gpu->config().vocab_size);
      EngineStats st;
      const auto results = run_engine(*gpu, cases, cfg, m.together, &st);
      const int compared = compare_to_reference(gg, results, ref, what);
      EXPECT_GT(compared, 0) << g.name << " " << what;
      EXPECT_GT(st.spec_num_drafts, 0) << what;
      EXPECT_LE(st.spec_num_accepted_tokens, st.spec_num_draft_tokens) << what;
      if (m.oracle) {  // mostly right: accepted runs, bonus tokens and partial rollbacks
        EXPECT_GT(st.spec_num_accepted_tokens, 0) << what;
        EXPECT_LT(st.spec_num_accepted_tokens, st.spec_num_draft_tokens) << what;
      }
      std::printf("[ %s ] %s: %d greedy steps compared with K = 0, %lld of %lld drafts accepted\n",
                  g.name.c_str(), what.c_str(), compared,
                  static_cast<long long>(st.spec_num_accepted_tokens),
                  static_cast<long long>(st.spec_num_draft_tokens));
    }
    if (m.graphs) {  // (every step of a run may verify: drafts are not cut at max_tokens)
      EXPECT_FALSE(gpu->captured_buckets().empty() && gpu->captured_verify_graphs().empty())
          << "no decode or verify step ran a graph";
      EXPECT_FALSE(gpu->captured_mtp_buckets().empty()) << "no draft pass ran a graph";
    } else {
      EXPECT_TRUE(gpu->captured_buckets().empty());
      EXPECT_TRUE(gpu->captured_mtp_buckets().empty()) << "draft graphs with graphs off";
    }
    EXPECT_EQ(!gpu->captured_verify_graphs().empty(), m.verify_graphs && m.graphs) << m.name;
  }
}

TEST_P(CudaQwen35Mtp, GreedyLosslessForK1To4) {
  expect_greedy_lossless(
      GetParam(), {{"alone+graphs", true, false, 1024, 16},
                   {"batched+graphs", true, true, 1024, 16},
                   {"batched+graphs, oracle drafts", true, true, 1024, 16, false, true},
                   {"alone+graphs, oracle drafts", true, false, 1024, 16, false, true},
                   {"alone twice (prefix cache)+graphs", true, false, 1024, 16, true},
                   {"chunked+graphs, oracle drafts", true, true, 7, 4, false, true},
                   {"batched eager", false, true, 1024, 16},
                   {"batched eager, oracle drafts", false, true, 1024, 16, false, true},
                   {"batched+graphs, oracle drafts, rollback by forward", true, true, 1024, 16,
                    false, true, false, false}});
}

// The same with the verify steps in graphs (the default; GreedyLosslessForK1To4 runs them eager).
TEST_P(CudaQwen35Mtp, GreedyLosslessWithVerifyGraphs) {
  expect_greedy_lossless(
      GetParam(),
      {{"alone+verify graphs", true, false, 1024, 16, false, false, true},
       {"batched+verify graphs", true, true, 1024, 16, false, false, true},
       {"batched+verify graphs, oracle drafts", true, true, 1024, 16, false, true, true},
       {"alone twice (prefix cache)+verify graphs, oracle drafts", true, false, 1024, 16, true,
        true, true}});
}

// EngineConfig::warm_up with K = 3 (as tandem serve runs it): the draft pass graph of every
// bucket up to max_num_seqs is captured before the first request, and decoding afterwards gives
// the tokens of the run without speculation (the margin rule) and of a model whose draft passes
// run eagerly.
TEST(CudaQwen35MtpWarmUp, CapturesTheDraftGraphs) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir =
      testing::source_dir() + "/tests/data/fixtures/qwen35_vl_hd256_int4_tied_bf16";
  const testing::Golden g = testing::load_golden(dir);
  CudaModelOptions o;
  o.max_tokens = 1024;
  o.max_seqs = 8;
  o.page_size = 16;
  o.mtp_graphs = true;
  EngineConfig cfg;
  cfg.max_num_seqs = 8;
  cfg.max_batched_tokens = 1024;
  cfg.page_size = 16;
  cfg.kv_cache_mb = 64;
  CudaModelOptions eager = o;
  eager.mtp_graphs = false;
  auto cold = Qwen35MoeCuda::load(dir, eager);
  cold->load_mtp(testing::random_mtp_dir(dir));
  const auto ref = run_engine(*cold, g.cases, cfg, /*together=*/true);
  EXPECT_GT(compare_greedy(g, ref, "K = 0", /*lower_ranks=*/false), 0);
  cfg.num_speculative_tokens = 3;
  const auto want = run_engine(*cold, g.cases, cfg, /*together=*/true);
  EXPECT_TRUE(cold->captured_mtp_buckets().empty()) << "draft graphs with mtp_graphs off";
  auto gpu = Qwen35MoeCuda::load(dir, o);
  gpu->load_mtp(testing::random_mtp_dir(dir));
  EngineConfig w = cfg;
  w.warm_up = true;
  { Engine engine(*gpu, w); }
  EXPECT_EQ(gpu->captured_mtp_buckets(), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(gpu->captured_buckets(), (std::vector<int64_t>{1, 2, 4, 8})) << "the decode graphs";
  const std::vector<std::pair<int64_t, int64_t>> verify = {{1, 4}, {2, 4}, {4, 4}, {8, 4}};
  EXPECT_EQ(gpu->captured_verify_graphs(), verify) << "the verify graphs (K + 1 = 4 tokens)";
  const auto got = run_engine(*gpu, g.cases, w, /*together=*/true);
  const int a = compare_to_reference(g, got, ref, "warm draft graphs, K = 3");
  const int b = compare_to_reference(g, want, ref, "eager draft passes, K = 3");
  EXPECT_GT(a, 0);
  EXPECT_GT(b, 0);
  std::printf("[ %s ] warm-up: %d / %d greedy steps compared with K = 0 (draft graphs / eager)\n",
              g.name.c_str(), a, b);
}

// Sampled requests with speculation on the device (CudaMtpSampling's test for the Qwen3-MoE
// target, here over the Qwen3.5 text fixture, vocab 256): 3000 seeded 3-token continuations at
// temperature 0.8 / top-k 4 with K = 2 follow the distribution of the same model's
// non-speculative sampling (chi-square with a fixed seed), with deterministic drafts (the most
// frequent continuation, often accepted: DeltaNet rollbacks of partial acceptances) and with the
// random MTP layer's drafts; always accepting (forced acceptance at p = 1) fails the same bound.
TEST(CudaQwen35MtpSampling, DistributionEqualsNonSpeculative) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir =
      testing::source_dir() + "/tests/data/fixtures/qwen35_text_hd64_int2_fused";
  CudaModelOptions o;
  o.max_tokens = 2048;
  o.max_seqs = 128;
  o.page_size = 16;
  auto gpu = Qwen35MoeCuda::load(dir, o);
  gpu->load_mtp(testing::random_mtp_dir(dir));
  const testing::Golden g = testing::load_golden(dir);
  expect_spec_sampling_matches(*gpu, g, 1);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaQwen35Mtp,
                         ::testing::ValuesIn(testing::hybrid_golden_dirs()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = fs::path(info.param).filename().string();
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

}  // namespace
}  // namespace tandem
