// Shared by the CUDA golden tests (tests/model/cuda/*.cpp, one binary: test_model_cuda): the
// margin rule's tolerances, the teacher-forced logits comparison and greedy generation through
// the engine against the golden fixtures. See test_model_cuda.cpp for the rule.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "engine/chi_square.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "engine/mtp_weights.h"
#include "model/convert.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/model.h"

namespace tandem::cuda_golden {

constexpr double kMedianTol = 1.5e-2;  // relative L2 error of a logits row: median,
constexpr double kP95Tol = 5e-2;       // 95th percentile,
constexpr double kMaxTol = 0.3;        // worst row
// Block FP8 with FP8 activations (W8A8, the default for block-FP8 checkpoints): the activations
// are rounded to E4M3 per token and 128 columns before each FP8 linear, so a logits row moves
// further from the bf16 / fp32 references than bf16 arithmetic alone moves it (measured on an
// H100 against the dequantized model: median 2.2e-2, p95 3.1e-2, worst 0.29).
constexpr double kMedianTolW8A8 = 3.5e-2;
constexpr double kP95TolW8A8 = 6e-2;
constexpr double kMaxTolW8A8 = 0.45;
constexpr double kMarginBf16 = 0.5;    // logit margin above which bf16 must agree on the argmax
constexpr double kLogprobTol = 0.25;   // the chosen token's logprob vs the fp32 golden one
constexpr double kLowerRankTol = 1.0;  // ranks 2-5 (a flipped routing moves them most)
// W8A8 (FP8 activations, per token per 128): the greedy tokens must still match by the margin
// rule, but the logprobs carry the activation quantization (teacher-forced rows up to
// kMaxTolW8A8 relative error). Measured on the H100 (hub_fp8_block128, batched steps): the chosen
// token's logprob 0.47 from the fp32 golden, rank 2's 1.22.
constexpr double kLogprobTolW8A8 = 0.6;
constexpr double kLowerRankTolW8A8 = 1.5;

// A parameterized test's name from its fixture directory (the last path component, every
// character but letters and digits as '_').
inline std::string fixture_test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = std::filesystem::path(info.param).filename().string();
  for (char& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

// The golden fixture `fixture` through `tandem convert --format fp8` (Qwen's -FP8 layout) into a
// new temporary directory named by `tag`, the process and the fixture, its golden.json copied
// beside it. The caller removes the directory.
inline std::string fp8_fixture_copy(const std::string& fixture, const std::string& tag) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           (tag + "_" + std::to_string(::getpid()) + "_" +
                            std::filesystem::path(fixture).filename().string()))
                              .string();
  std::filesystem::remove_all(dir);
  ConvertOptions o;
  o.in_dir = fixture;
  o.out_dir = dir;
  o.format = WeightQuant::kFp8Block;
  (void)convert_checkpoint(o);
  std::filesystem::copy_file(std::filesystem::path(fixture) / "golden.json",
                             std::filesystem::path(dir) / "golden.json");
  return dir;
}

inline bool gpu_available() {
  static const bool ok = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return n > 0;
  }();
  return ok;
}

// Argmax checks and flips of compare_logit_rows.
struct RowStats {
  int checked = 0, flipped = 0;
};

// Compares logits rows [rows, vocab]: every value finite, each row's relative L2 error appended
// to `errs`; where the reference's top-2 margin exceeds kMarginBf16, the argmaxes are compared
// (counted in checked / flipped) and `on_check(row, got_argmax, want_argmax, margin)` is called.
template <typename OnCheck>
RowStats compare_logit_rows(const std::vector<float>& got, const std::vector<float>& want,
                            int64_t vocab, const std::string& what, std::vector<double>& errs,
                            OnCheck on_check) {
  RowStats st;
  const int64_t rows = static_cast<int64_t>(want.size()) / vocab;
  EXPECT_EQ(got.size(), want.size()) << what;
  for (int64_t r = 0; r < rows && got.size() == want.size(); ++r) {
    const float* g = got.data() + r * vocab;
    const float* w = want.data() + r * vocab;
    double num = 0, den = 0;
    int64_t ga = 0, wa = 0, w2 = -1;
    bool finite = true;
    for (int64_t i = 0; i < vocab; ++i) {
      finite = finite && std::isfinite(g[i]);
      num += (double(g[i]) - w[i]) * (double(g[i]) - w[i]);
      den += double(w[i]) * w[i];
      if (g[i] > g[ga]) ga = i;
      if (w[i] > w[wa]) wa = i;
    }
    EXPECT_TRUE(finite) << what << " row " << r;
    for (int64_t i = 0; i < vocab; ++i) {
      if (i != wa && (w2 < 0 || w[i] > w[w2])) w2 = i;
    }
    errs.push_back(std::sqrt(num / std::max(den, 1e-30)));
    if (w2 >= 0 && w[wa] - w[w2] > kMarginBf16) {
      ++st.checked;
      if (ga != wa) ++st.flipped;
      on_check(r, ga, wa, w[wa] - w[w2]);
    }
  }
  return st;
}

// compare_logit_rows where a flipped argmax fails the test. Returns the number of argmax checks.
inline int compare_rows(const std::vector<float>& got, const std::vector<float>& want,
                        int64_t vocab, const std::string& what, std::vector<double>& errs) {
  return compare_logit_rows(got, want, vocab, what, errs,
                            [&](int64_t r, int64_t ga, int64_t wa, float margin) {
                              EXPECT_EQ(ga, wa) << what << " row " << r << " margin " << margin;
                            })
      .checked;
}

// compare_logit_rows where a flipped argmax is printed, not failed: the caller bounds the share
// (RowStats::flipped of RowStats::checked).
inline RowStats compare_rows_counting_flips(const std::vector<float>& got,
                                            const std::vector<float>& want, int64_t vocab,
                                            const std::string& what, std::vector<double>& errs) {
  return compare_logit_rows(
      got, want, vocab, what, errs, [&](int64_t r, int64_t ga, int64_t wa, float margin) {
        if (ga == wa) return;
        std::printf("  %s row %lld: argmax %lld, reference %lld (margin %.3f)\n", what.c_str(),
                    static_cast<long long>(r), static_cast<long long>(ga),
                    static_cast<long long>(wa), margin);
      });
}

inline double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

// The median, 95th percentile and worst of the rows' relative errors.
struct ErrorQuantiles {
  double med, p95, worst;
};
inline ErrorQuantiles error_quantiles(const std::vector<double>& errs) {
  return {quantile(errs, 0.5), quantile(errs, 0.95), quantile(errs, 1.0)};
}

// Drafts from the golden continuations of requests "r<i>" (testing::oracle_drafts), for the
// speculative tests' run_engine.
inline EngineConfig::SpecHookFn oracle(const std::vector<testing::GoldenCase>& cases,
                                       int64_t vocab) {
  std::map<std::string, std::vector<int32_t>> full;
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<int32_t> t = cases[i].prompt_ids;
    t.insert(t.end(), cases[i].output_ids.begin(), cases[i].output_ids.end());
    full["r" + std::to_string(i)] = t;
  }
  return testing::oracle_drafts(std::move(full), vocab);
}

// A golden case as one teacher-forced sequence: the prompt and every output token but the last.
inline std::vector<int32_t> teacher_forced_tokens(const testing::GoldenCase& c) {
  std::vector<int32_t> tokens = c.prompt_ids;
  tokens.insert(tokens.end(), c.output_ids.begin(), c.output_ids.end() - 1);
  return tokens;
}

// Block tables for the token lists `toks` (pages of `page` tokens): case i owns pages
// [i * per, (i + 1) * per), per = longest / page + 2, ascending or descending.
struct CaseTables {
  int64_t per = 0;
  std::vector<int32_t> tables;  // [cases * per]
};
inline CaseTables case_tables(const std::vector<std::vector<int32_t>>& toks, int64_t page,
                              bool descending) {
  size_t longest = 0;
  for (const auto& t : toks) longest = std::max(longest, t.size());
  CaseTables c;
  c.per = static_cast<int64_t>(longest) / page + 2;
  c.tables.resize(toks.size() * static_cast<size_t>(c.per));
  std::iota(c.tables.begin(), c.tables.end(), 0);
  if (descending) std::reverse(c.tables.begin(), c.tables.end());
  return c;
}

// Every case's teacher-forced tokens through `model` with all cases in each step: the prompts
// (their prompt lengths) first, then verify-shaped steps of q tokens for every case still
// running (uniform while every case has q tokens left: a verify graph's shape). Case i owns 4-token
// pages [i * per, (i + 1) * per) in descending order and, for a model with recurrent state, state
// slot i. Returns each case's logits rows, all positions ([tokens, vocab]).
inline std::vector<std::vector<float>> verify_shaped_rows(
    Model& model, const testing::Golden& g, const std::vector<std::vector<int32_t>>& toks,
    int64_t q) {
  const int64_t vocab = model.config().vocab_size;
  const auto nc = static_cast<int64_t>(toks.size());
  const auto [per, tables] = case_tables(toks, 4, /*descending=*/true);
  KvCache kv = model.make_kv_cache(nc * per, 4);
  const bool states = model.state_slot_elems() > 0;
  if (states) kv.allocate_states(nc, model.state_slot_elems());
  std::vector<std::vector<float>> got(static_cast<size_t>(nc));
  std::vector<int64_t> done(static_cast<size_t>(nc));
  std::vector<float> part;
  for (int64_t step = 0;; ++step) {
    ForwardBatch b;
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < nc; ++i) {
      const auto n = static_cast<int64_t>(toks[static_cast<size_t>(i)].size());
      const int64_t start = done[static_cast<size_t>(i)];
      if (start >= n) continue;
      const int64_t count =
          step == 0 ? static_cast<int64_t>(g.cases[static_cast<size_t>(i)].prompt_ids.size())
                    : std::min(q, n - start);
      b.seqs.push_back({toks[static_cast<size_t>(i)].data() + start, count, start,
                        tables.data() + i * per, per, LogitsMode::kAll,
                        states ? static_cast<int32_t>(i) : -1});
      idx.push_back(i);
    }
    if (b.seqs.empty()) break;
    model.forward(b, kv, part);
    int64_t row = 0;
    for (size_t j = 0; j < idx.size(); ++j) {
      const int64_t cnt = b.seqs[j].num_tokens;
      auto& dst = got[static_cast<size_t>(idx[j])];
      dst.insert(dst.end(), part.begin() + row * vocab, part.begin() + (row + cnt) * vocab);
      done[static_cast<size_t>(idx[j])] += cnt;
      row += cnt;
    }
  }
  return got;
}

// `nseq` sequences at once (sequence i is golden case i % cases, teacher-forced; its own pages of
// 16 tokens and, for a model with recurrent state, state slot i): the prompts prefilled whole,
// at most max_tokens tokens a step, then `steps` decode steps of every sequence together (one
// token each).
// Returns the decode steps' logits rows, [steps * nseq, vocab], step-major. A decode batch of
// nseq replays the graph of the smallest bucket >= nseq when the model captures graphs.
inline std::vector<float> many_sequence_decode_rows(Model& model, const testing::Golden& g,
                                                    int64_t nseq, int64_t steps,
                                                    int64_t max_tokens) {
  constexpr int64_t kPage = 16;
  const auto nc = static_cast<int64_t>(g.cases.size());
  std::vector<std::vector<int32_t>> toks;
  size_t longest = 0;
  for (int64_t i = 0; i < nseq; ++i) {
    toks.push_back(teacher_forced_tokens(g.cases[static_cast<size_t>(i % nc)]));
    const size_t prompt = g.cases[static_cast<size_t>(i % nc)].prompt_ids.size();
    EXPECT_GE(toks.back().size(), prompt + static_cast<size_t>(steps)) << "case " << i % nc;
    longest = std::max(longest, toks.back().size());
  }
  const int64_t per = static_cast<int64_t>(longest) / kPage + 2;
  std::vector<int32_t> tables(static_cast<size_t>(nseq * per));
  std::iota(tables.begin(), tables.end(), 0);
  KvCache kv = model.make_kv_cache(nseq * per, kPage);
  const bool states = model.state_slot_elems() > 0;
  if (states) kv.allocate_states(nseq, model.state_slot_elems());
  auto seq = [&](int64_t i, int64_t start, int64_t count) {
    return ForwardSeq{toks[static_cast<size_t>(i)].data() + start,
                      count,
                      start,
                      tables.data() + i * per,
                      per,
                      LogitsMode::kLast,
                      states ? static_cast<int32_t>(i) : -1};
  };
  std::vector<float> part, rows;
  for (int64_t i = 0; i < nseq;) {  // prefill steps of whole prompts, at most max_tokens each
    ForwardBatch b;
    int64_t tokens = 0;
    for (; i < nseq; ++i) {
      const auto len = static_cast<int64_t>(g.cases[static_cast<size_t>(i % nc)].prompt_ids.size());
      if (!b.seqs.empty() && tokens + len > max_tokens) break;
      b.seqs.push_back(seq(i, 0, len));
      tokens += len;
    }
    model.forward(b, kv, part);
  }
  for (int64_t s = 0; s < steps; ++s) {
    ForwardBatch b;
    for (int64_t i = 0; i < nseq; ++i) {
      const auto len = static_cast<int64_t>(g.cases[static_cast<size_t>(i % nc)].prompt_ids.size());
      b.seqs.push_back(seq(i, len + s, 1));
    }
    model.forward(b, kv, part);
    rows.insert(rows.end(), part.begin(), part.end());
  }
  return rows;
}

// Decode batches above 256 replay graphs (buckets 288 to 512): with --max-num-seqs 320, 300
// sequences decode together through the graph of bucket 320 (20 padding sequences), and their
// logits rows match the same steps run eagerly by the margin rule. M: the CUDA model class.
template <typename M>
void expect_decode_graphs_above_256_match_eager(const std::string& dir) {
  const testing::Golden g = testing::load_golden(dir);
  constexpr int64_t kSeqs = 300, kMaxSeqs = 320, kSteps = 2;
  std::vector<float> rows[2];
  for (const bool graphs : {true, false}) {
    CudaModelOptions o;
    o.max_tokens = 1024;
    o.max_seqs = kMaxSeqs;
    o.page_size = 16;
    o.cuda_graphs = graphs;
    auto gpu = M::load(dir, o);
    rows[graphs ? 0 : 1] = many_sequence_decode_rows(*gpu, g, kSeqs, kSteps, o.max_tokens);
    if (graphs) {
      const auto b = gpu->captured_buckets();
      EXPECT_NE(std::find(b.begin(), b.end(), int64_t{320}), b.end())
          << "300 sequences did not replay bucket 320";
    } else {
      EXPECT_TRUE(gpu->captured_buckets().empty());
    }
  }
  const int64_t vocab = ModelConfig::from_dir(dir).vocab_size;
  ASSERT_EQ(rows[0].size(), static_cast<size_t>(kSeqs * kSteps * vocab));
  std::vector<double> errs;
  const int checked = compare_rows(rows[0], rows[1], vocab, g.name + " graphs vs eager", errs);
  const auto [med, p95, worst] = error_quantiles(errs);
  std::printf("[ %s ] %lld sequences, graphs vs eager: median %.2e p95 %.2e max %.2e, %d checks\n",
              g.name.c_str(), static_cast<long long>(kSeqs), med, p95, worst, checked);
  EXPECT_LT(med, kMedianTol);
  EXPECT_LT(p95, kP95Tol);
  EXPECT_LT(worst, kMaxTol);
  EXPECT_GT(checked, 0);
}

// One sequence, all positions' logits, in chunks of `chunk` tokens.
inline std::vector<float> teacher_forced(Model& model, KvCache& kv,
                                         const std::vector<int32_t>& tokens, int64_t chunk,
                                         int32_t state_slot = -1) {
  const int64_t n = static_cast<int64_t>(tokens.size()), page = kv.geometry().page_size;
  std::vector<int32_t> table(static_cast<size_t>((n + page - 1) / page));
  std::iota(table.begin(), table.end(), 0);
  std::reverse(table.begin(), table.end());  // non-contiguous, descending pages
  std::vector<float> all, part;
  for (int64_t begin = 0; begin < n; begin += chunk) {
    ForwardBatch b;
    ForwardSeq s;
    s.tokens = tokens.data() + begin;
    s.num_tokens = std::min(chunk, n - begin);
    s.start_pos = begin;
    s.block_table = table.data();
    s.num_pages = static_cast<int64_t>(table.size());
    s.logits = LogitsMode::kAll;
    s.state_slot = state_slot;  // hybrid models
    b.seqs.push_back(s);
    model.forward(b, kv, part);
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

// The GPU model with host sampling (logits copied back), the path requests with penalties or
// prompt logprobs take.
class HostSampled final : public Model {
 public:
  explicit HostSampled(Model& m) : m_(m) {}
  const ModelConfig& config() const override { return m_.config(); }
  KvGeometry kv_geometry(int64_t pages, int64_t page) const override {
    return m_.kv_geometry(pages, page);
  }
  KvCache make_kv_cache(int64_t pages, int64_t page) override {
    return m_.make_kv_cache(pages, page);
  }
  int64_t state_slot_elems() const override { return m_.state_slot_elems(); }  // hybrids
  void forward(const ForwardBatch& b, KvCache& kv, std::vector<float>& logits) override {
    m_.forward(b, kv, logits);
  }

 private:
  Model& m_;
};

struct Result {
  std::vector<int32_t> ids;
  std::vector<std::vector<TokenLogprob>> top;
  int finished = 0;
};

// `stats` (when set) gets the engine's counters after the run.
inline std::vector<Result> run_engine(Model& model, const std::vector<testing::GoldenCase>& cases,
                                      EngineConfig cfg, bool together,
                                      EngineStats* stats = nullptr) {
  Engine engine(model, cfg);
  std::vector<Result> results(cases.size());
  auto add = [&](size_t i) {
    GenRequest r;
    r.id = "r" + std::to_string(i);
    r.prompt_ids = cases[i].prompt_ids;
    r.max_tokens = cases[i].max_tokens;
    r.sampling.temperature = 0;
    r.sampling.logprobs = 5;
    engine.add(r, [&results, i](const StepOutput& o) {
      Result& res = results[i];
      res.ids.insert(res.ids.end(), o.token_ids.begin(), o.token_ids.end());
      res.top.insert(res.top.end(), o.top_logprobs.begin(), o.top_logprobs.end());
      if (o.finished) ++res.finished;
    });
  };
  if (together) {
    for (size_t i = 0; i < cases.size(); ++i) add(i);
    while (engine.step()) {
    }
  } else {
    for (size_t i = 0; i < cases.size(); ++i) {
      add(i);
      while (engine.step()) {
      }
    }
  }
  EXPECT_EQ(engine.blocks().num_available(), engine.blocks().num_pages()) << "leaked KV pages";
  if (stats != nullptr) *stats = engine.stats();
  return results;
}

// Steps compared: up to the first golden step whose top1-top2 margin is under kMarginBf16.
// lower_ranks false: ranks 2-5 are not compared (the chosen token's logprob still is).
inline int compare_greedy(const testing::Golden& g, const std::vector<Result>& results,
                          const std::string& mode, bool lower_ranks = true, bool w8a8 = false) {
  const double tol0 = w8a8 ? kLogprobTolW8A8 : kLogprobTol;
  const double tol_lower = w8a8 ? kLowerRankTolW8A8 : kLowerRankTol;
  int compared = 0;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    const auto& c = g.cases[i];
    const Result& r = results[i];
    SCOPED_TRACE(g.name + " " + mode + " case " + std::to_string(i));
    EXPECT_EQ(r.finished, 1);
    for (size_t t = 0; t < c.output_ids.size(); ++t) {
      const auto& top = c.top_logprobs[t];
      if (top.size() < 2 || top[0].logprob - top[1].logprob < kMarginBf16) break;
      const bool same = t < r.ids.size() && r.ids[t] == c.output_ids[t] && t < r.top.size() &&
                        r.top[t].size() == top.size();
      EXPECT_TRUE(same) << "step " << t << ": got "
                        << (t < r.ids.size() ? std::to_string(r.ids[t]) : "nothing") << ", want "
                        << c.output_ids[t];
      if (!same) break;  // the rest of the case diverges
      for (size_t k = 0; k < (lower_ranks ? top.size() : 1); ++k) {
        // Lower ranks may swap when they are close; compare each golden id's logprob.
        for (const auto& e : r.top[t]) {
          if (e.id == top[k].id) {
            EXPECT_NEAR(e.logprob, top[k].logprob, k == 0 ? tol0 : tol_lower)
                << "step " << t << " rank " << k;
          }
        }
      }
      ++compared;
    }
  }
  return compared;
}

// Lossless: a speculative run gives the tokens of the run without speculation (K = 0, the same
// model and mode), at every step up to the first one whose golden top1-top2 margin is under
// kMarginBf16 (the margin rule), with the chosen token's logprob within kLogprobTol. Returns the
// steps compared.
inline int compare_to_reference(const testing::Golden& g, const std::vector<Result>& got,
                                const std::vector<Result>& ref, const std::string& what) {
  int compared = 0;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    SCOPED_TRACE(g.name + " " + what + " case " + std::to_string(i));
    const auto& c = g.cases[i];
    const Result& r = got[i];
    const Result& w = ref[i];
    EXPECT_EQ(r.finished, 1);
    for (size_t t = 0; t < c.output_ids.size(); ++t) {
      const auto& top = c.top_logprobs[t];
      if (top.size() < 2 || top[0].logprob - top[1].logprob < kMarginBf16) break;
      if (t >= w.ids.size() || w.ids[t] != c.output_ids[t]) break;  // the reference diverged
      const bool same = t < r.ids.size() && r.ids[t] == w.ids[t] && t < r.top.size() &&
                        !r.top[t].empty() && t < w.top.size() && !w.top[t].empty();
      EXPECT_TRUE(same) << "step " << t << ": got "
                        << (t < r.ids.size() ? std::to_string(r.ids[t]) : "nothing")
                        << ", without speculation " << w.ids[t];
      if (!same) break;
      EXPECT_NEAR(r.top[t][0].logprob, w.top[t][0].logprob, kLogprobTol) << "step " << t;
      ++compared;
    }
  }
  return compared;
}

// A speculation comparison's setup on the GPU model M (Qwen3MoeCuda, Qwen35MoeCuda) with its
// random MTP layer: the golden cases with uneven max_tokens (chains that run past their end).
template <class M>
struct SpecComparison {
  testing::Golden g;
  std::vector<testing::GoldenCase> cases;
  std::unique_ptr<M> gpu;
  EngineConfig base;
  explicit SpecComparison(const std::string& dir) : g(testing::load_golden(dir)), cases(g.cases) {
    for (size_t i = 0; i < cases.size(); ++i) {
      cases[i].max_tokens = std::max<int32_t>(2, cases[i].max_tokens - static_cast<int32_t>(i % 3));
    }
    CudaModelOptions o;
    o.max_tokens = 1024;
    o.max_seqs = 8;
    o.page_size = 16;
    gpu = M::load(dir, o);
    gpu->load_mtp(testing::random_mtp_dir(dir));
    base.max_num_seqs = 8;
    base.max_batched_tokens = 1024;
    base.page_size = 16;
    base.kv_cache_mb = 64;
  }
};

// The draft chain on the device (Model::mtp_draft_chain: the default) against pass-by-pass
// drafting through the host (M::set_device_chain(false)), the fused step off: every pass gets
// the same bf16 inputs either way, so the drafts are the same, hence the tokens and the
// acceptance counts; K = 2 and 4, the MTP's own drafts and an oracle's.
template <class M>
void expect_draft_chain_equals_pass_by_pass(M& gpu, const testing::Golden& g,
                                            const std::vector<testing::GoldenCase>& cases,
                                            const EngineConfig& base) {
  struct Restore {
    M& m;
    ~Restore() {
      m.set_device_chain(true);
      m.set_fused_step(true);
    }
  } restore{gpu};
  gpu.set_fused_step(false);  // the chain itself (the fused step: its own test)
  for (const int64_t k : {2, 4}) {
    for (const bool good : {false, true}) {
      const std::string what =
          std::string(good ? "oracle drafts" : "MTP drafts") + ", K = " + std::to_string(k);
      EngineConfig cfg = base;
      cfg.num_speculative_tokens = k;
      EngineStats by_pass, chained;
      gpu.set_device_chain(false);
      ASSERT_FALSE(gpu.mtp_drafts_on_device());
      if (good) cfg.spec_draft_hook = oracle(cases, gpu.config().vocab_size);
      const auto ref = run_engine(gpu, cases, cfg, /*together=*/true, &by_pass);
      gpu.set_device_chain(true);
      ASSERT_TRUE(gpu.mtp_drafts_on_device());
      if (good) cfg.spec_draft_hook = oracle(cases, gpu.config().vocab_size);
      const auto res = run_engine(gpu, cases, cfg, /*together=*/true, &chained);
      for (size_t i = 0; i < cases.size(); ++i) {
        EXPECT_EQ(res[i].ids, ref[i].ids) << g.name << " " << what << " case " << i;
      }
      EXPECT_GT(chained.spec_num_drafts, 0) << what;
      EXPECT_EQ(chained.spec_num_drafts, by_pass.spec_num_drafts) << what;
      EXPECT_EQ(chained.spec_num_draft_tokens, by_pass.spec_num_draft_tokens) << what;
      EXPECT_EQ(chained.spec_num_accepted_tokens, by_pass.spec_num_accepted_tokens) << what;
      std::printf("[ %s ] %s: %lld drafts, %lld accepted, chain == pass by pass\n", g.name.c_str(),
                  what.c_str(), static_cast<long long>(chained.spec_num_drafts),
                  static_cast<long long>(chained.spec_num_accepted_tokens));
    }
  }
}

// The fused step (Model::forward_verify_draft: the default) against the unfused one
// (M::set_fused_step(false): verify, host acceptance, then the chain). Its pass 0 runs over every
// verify position (the unfused one over the accepted ones), so a draft may differ by bf16
// rounding at a near tie: the tokens are compared by the margin rule and the oracle's accepted
// counts within 2% (forced acceptance, which the benchmarks run fused, is covered by the
// kernels' tests: these requests ask for logprobs, which forced acceptance takes to the host).
// Uneven max_tokens (SpecComparison): chains that run past their end. M::fused_steps() counts
// the fused steps.
template <class M>
void expect_fused_step_matches_unfused(SpecComparison<M>& sc) {
  auto& [g, cases, gpu, base] = sc;
  struct Restore {
    M& m;
    ~Restore() { m.set_fused_step(true); }
  } restore{*gpu};
  for (const int64_t k : {1, 3, 4}) {
    for (const int mode : {0, 1}) {  // MTP drafts, oracle drafts
      const char* names[] = {"MTP drafts", "oracle drafts"};
      const std::string what = std::string(names[mode]) + ", K = " + std::to_string(k);
      EngineConfig cfg = base;
      cfg.num_speculative_tokens = k;
      EngineStats unfused_stats, fused_stats;
      gpu->set_fused_step(false);
      ASSERT_FALSE(gpu->fuses_verify_and_draft());
      if (mode == 1) cfg.spec_draft_hook = oracle(cases, gpu->config().vocab_size);
      const auto ref = run_engine(*gpu, cases, cfg, /*together=*/true, &unfused_stats);
      gpu->set_fused_step(true);
      ASSERT_TRUE(gpu->fuses_verify_and_draft());
      const int64_t before = gpu->fused_steps();
      if (mode == 1) cfg.spec_draft_hook = oracle(cases, gpu->config().vocab_size);
      const auto res = run_engine(*gpu, cases, cfg, /*together=*/true, &fused_stats);
      EXPECT_GT(gpu->fused_steps(), before) << what << ": no step ran fused";
      const int compared = compare_to_reference(g, res, ref, what);
      EXPECT_GT(compared, 0) << g.name << " " << what;
      for (size_t i = 0; i < cases.size(); ++i) {
        EXPECT_EQ(res[i].ids.size(), ref[i].ids.size()) << g.name << " " << what << " case " << i;
      }
      const double a = static_cast<double>(fused_stats.spec_num_accepted_tokens),
                   b = static_cast<double>(unfused_stats.spec_num_accepted_tokens);
      if (mode == 1) {
        EXPECT_GT(a, 0) << what;
        EXPECT_LT(a, static_cast<double>(fused_stats.spec_num_draft_tokens)) << what;
        EXPECT_LE(std::abs(a - b), std::max(2.0, 0.02 * b)) << what;
      }
      std::printf(
          "[ %s ] %s: fused %lld drafts, %.0f accepted; unfused %lld drafts, %.0f accepted\n",
          g.name.c_str(), what.c_str(), static_cast<long long>(fused_stats.spec_num_drafts), a,
          static_cast<long long>(unfused_stats.spec_num_drafts), b);
    }
  }
}

}  // namespace tandem::cuda_golden
