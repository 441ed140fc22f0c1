// GPU sampling (src/backend/cuda/sampling.h) against the CPU sampler (src/engine/sampling.h).
// The GPU draws from another random stream than the CPU, so sampled tokens are checked by
// distribution: every token must lie in the kept set that a plain sort-based reference of the
// CPU semantics computes (the reference itself is checked against sample_token), and a
// chi-square test over 20k draws compares the token frequencies with the reference
// probabilities. Greedy tokens and logprobs are compared with the CPU directly. Fresh random
// inputs every run (the seed is printed on failure); outputs poisoned before each launch.
// Every test runs twice: the single-CTA path (no workspace) and the multi-CTA path (a
// workspace), and every launch also runs the other path on the same inputs and requires the
// same tokens row by row (the paths share the kept set and the random stream) and the same
// top-n ids (up to near-ties in logprob).
// Every test skips (GTEST_SKIP) when no CUDA device is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/sampling.h"
#include "backend/cuda/token_bitmask.h"
#include "core/dtype.h"
#include "cuda_test_util.h"
#include "engine/sampling.h"

namespace tandem::cuda {
namespace {

using test_util::gpu_available;
// upload() copies `count` elements without checking the host size here.
template <typename T>
using DeviceBuffer = test_util::DeviceBuffer<T, test_util::UploadCheck::kNone>;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kTop = kMaxTopLogprobs;

/// The kept tokens and their probabilities under the CPU semantics, by a plain full sort:
/// temperature, top-k, top-p over the top-k renormalised mass, min-p, weight > 0.
struct RefDist {
  std::vector<int32_t> ids;
  std::vector<double> p;
  bool contains(int32_t id) const { return std::find(ids.begin(), ids.end(), id) != ids.end(); }
};

RefDist ref_dist(std::span<const float> logits, SamplingRowParams const& rp) {
  const size_t vocab = logits.size();
  std::vector<float> x(vocab);
  float m = -kInf;
  for (size_t i = 0; i < vocab; ++i) {
    x[i] = std::isnan(logits[i]) ? -kInf : logits[i] / rp.temperature;
    m = std::max(m, x[i]);
  }
  auto argmax = [&] {
    return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
  };
  if (m == -kInf) return {{argmax()}, {1.0}};
  std::vector<float> w(vocab);
  for (size_t i = 0; i < vocab; ++i) {
    const float d = m == kInf ? (x[i] == kInf ? 0.f : -kInf) : x[i] - m;
    w[i] = d < -87.0f ? 0.0f : std::exp(d);
  }
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[a] > x[b]; });
  size_t n = vocab;
  if (rp.top_k > 0 && static_cast<size_t>(rp.top_k) < vocab) n = static_cast<size_t>(rp.top_k);
  if (rp.top_p < 1.0f) {
    double z = 0;
    for (size_t j = 0; j < n; ++j) z += w[order[j]];
    const double target = static_cast<double>(rp.top_p) * z;
    double cum = 0;
    size_t keep = 0;
    while (keep < n && (keep == 0 || cum < target)) cum += w[order[keep++]];
    n = keep;
  }
  RefDist r;
  double total = 0;
  for (size_t j = 0; j < n; ++j) {
    const float wj = w[order[j]];
    if (wj > 0.0f && (rp.min_p <= 0.0f || wj >= rp.min_p)) {
      r.ids.push_back(order[j]);
      r.p.push_back(wj);
      total += wj;
    }
  }
  if (r.ids.empty()) return {{argmax()}, {1.0}};
  for (double& p : r.p) p /= total;
  return r;
}

SamplingParams to_cpu(SamplingRowParams const& rp) {
  SamplingParams s;
  s.temperature = rp.temperature;
  s.top_k = rp.top_k;
  s.top_p = rp.top_p;
  s.min_p = rp.min_p;
  return s;
}

std::string describe(SamplingRowParams const& rp) {
  std::ostringstream os;
  os << "temp " << rp.temperature << " top_k " << rp.top_k << " top_p " << rp.top_p << " min_p "
     << rp.min_p << " seed " << rp.seed << " counter " << rp.counter;
  return os.str();
}

class CudaSampling : public test_util::CudaFixture<::testing::TestWithParam<bool>> {
 protected:
  std::string trace() const {
    return "test seed " + std::to_string(seed_) + (multi() ? " multi-CTA" : " single-CTA");
  }
  static bool multi() { return GetParam(); }

  std::vector<float> randn(size_t n, float scale) {
    std::normal_distribution<float> d(0.f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }

  struct Out {
    std::vector<int32_t> tokens;
    std::vector<float> logprobs;
    std::vector<int32_t> top_ids;
    std::vector<float> top_lp;
  };

  /// Runs sample_launch on `logits` ([rows, vocab] fp32 values; rounded to bf16 first when
  /// `bf16`, in which case `logits` is updated to the rounded values the GPU sees).
  /// Also runs the other path and expects the same tokens and top ids, row by row.
  Out run(std::vector<float>& logits, std::vector<SamplingRowParams> const& rp, int64_t vocab,
          bool bf16) {
    Out o = run_path(logits, rp, vocab, bf16, multi());
    Out other = run_path(logits, rp, vocab, bf16, !multi());
    for (size_t r = 0; r < rp.size(); ++r) {
      if (o.tokens[r] != other.tokens[r]) {
        ADD_FAILURE() << "paths disagree at row " << r << " " << describe(rp[r]) << ": "
                      << o.tokens[r] << " vs " << other.tokens[r] << " (vocab " << vocab
                      << (bf16 ? " bf16)" : " fp32)");
        break;
      }
    }
    // Top-n: the same ids, except that the paths' log-sum-exp may differ in the last bits, so
    // two logits 1 ulp apart may tie in logprob on one path only: a differing id must then
    // carry (nearly) the same logprob on both paths.
    int bad = 0;
    for (size_t j = 0; j < o.top_ids.size() && bad < 5; ++j) {
      if (o.top_ids[j] == other.top_ids[j]) continue;
      if (std::fabs(o.top_lp[j] - other.top_lp[j]) <= 1e-5f) continue;
      ++bad;
      ADD_FAILURE() << "top ids differ between the paths at row " << j / kTop << " slot "
                    << j % kTop << ": " << o.top_ids[j] << " (" << o.top_lp[j] << ") vs "
                    << other.top_ids[j] << " (" << other.top_lp[j] << ")";
    }
    return o;
  }

  Out run_path(std::vector<float>& logits, std::vector<SamplingRowParams> const& rp, int64_t vocab,
               bool bf16, bool with_workspace) {
    const int64_t rows = static_cast<int64_t>(rp.size());
    EXPECT_EQ(logits.size(), static_cast<size_t>(rows * vocab));
    std::vector<uint16_t> lb;
    if (bf16) {
      lb.resize(logits.size());
      for (size_t i = 0; i < logits.size(); ++i) {
        lb[i] = f32_to_bf16(logits[i]);
        logits[i] = bf16_to_f32(lb[i]);
      }
    }
    DeviceBuffer<float> d_lf(bf16 ? 0 : logits.size());
    DeviceBuffer<uint16_t> d_lb(bf16 ? logits.size() : 0);
    if (bf16) {
      d_lb.upload(lb);
    } else {
      d_lf.upload(logits);
    }
    DeviceBuffer<SamplingRowParams> d_rp(rp);
    DeviceBuffer<int32_t> d_tok(rows), d_top_ids(rows * kTop);
    DeviceBuffer<float> d_lp(rows), d_top_lp(rows * kTop);
    d_tok.poison(0x7f);
    d_top_ids.poison(0x7f);
    d_lp.poison(0x7f);  // 3.4e38: neither NaN nor a plausible logprob
    d_top_lp.poison(0x7f);
    DeviceBuffer<uint8_t> d_ws(with_workspace ? sample_workspace_bytes(rows, vocab) : 0);
    d_ws.poison(0x5a);  // the kernel needs no initialised workspace
    SampleParams p{bf16 ? static_cast<void const*>(d_lb.ptr) : d_lf.ptr,
                   bf16 ? DType::kBF16 : DType::kF32,
                   d_rp.ptr,
                   d_tok.ptr,
                   d_lp.ptr,
                   d_top_ids.ptr,
                   d_top_lp.ptr,
                   rows,
                   vocab,
                   with_workspace ? static_cast<void*>(d_ws.ptr) : nullptr};
    sample_launch(p, stream_);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return {d_tok.download(), d_lp.download(), d_top_ids.download(), d_top_lp.download()};
  }

  /// Checks tokens (greedy rows exactly, others in the reference kept set), the chosen
  /// logprob and the top logprobs against the CPU, row by row.
  void check_rows(std::vector<float> const& logits, std::vector<SamplingRowParams> const& rp,
                  int64_t vocab, Out const& o) {
    for (size_t r = 0; r < rp.size(); ++r) {
      SCOPED_TRACE("row " + std::to_string(r) + " " + describe(rp[r]));
      std::span<const float> row(logits.data() + r * vocab, static_cast<size_t>(vocab));
      const int32_t tok = o.tokens[r];
      ASSERT_TRUE(tok >= 0 && tok < vocab) << "token " << tok;
      if (rp[r].temperature < 1e-5f) {
        SamplerRng rng(1);
        const int32_t cpu = sample_token(row, to_cpu(rp[r]), {}, {}, rng);
        EXPECT_EQ(tok, cpu) << "greedy: logit " << row[tok] << " vs cpu " << row[cpu];
      } else {
        const RefDist ref = ref_dist(row, rp[r]);
        EXPECT_TRUE(ref.contains(tok))
            << "token " << tok << " (logit " << row[tok] << ") outside the kept set of "
            << ref.ids.size() << " tokens; kept logits [" << row[ref.ids.front()] << " .. "
            << row[ref.ids.back()] << "]";
      }
      if (rp[r].want_logprob) {
        const float cpu = token_logprob(row, tok);
        EXPECT_NEAR(o.logprobs[r], cpu, 1e-4f) << "chosen logprob, token " << tok;
      } else {
        EXPECT_TRUE(std::isnan(o.logprobs[r])) << "logprob not asked for: " << o.logprobs[r];
      }
      const int n = std::min<int>(rp[r].n_top, static_cast<int>(vocab));
      const std::vector<TokenLogprob> cpu_top = top_logprobs(row, n);
      for (int j = 0; j < kTop; ++j) {
        const int32_t id = o.top_ids[r * kTop + j];
        const float lp = o.top_lp[r * kTop + j];
        if (j < n) {
          EXPECT_EQ(id, cpu_top[j].id)
              << "top " << j << " (gpu logprob " << lp << ", cpu " << cpu_top[j].logprob << ")";
          EXPECT_NEAR(lp, cpu_top[j].logprob, 1e-4f) << "top " << j << " id " << id;
        } else {
          EXPECT_EQ(id, -1) << "unused top slot " << j;
          EXPECT_EQ(lp, -kInf) << "unused top slot " << j;
        }
      }
    }
  }
};

SamplingRowParams greedy_row(int n_top, bool lp) {
  SamplingRowParams r;
  r.temperature = 0.f;
  r.n_top = n_top;
  r.want_logprob = lp ? 1 : 0;
  return r;
}

// ------------------------------------------------------------------------------ greedy

TEST_P(CudaSampling, GreedyAndLogprobs) {
  SCOPED_TRACE(trace());
  for (bool bf16 : {false, true}) {
    for (int64_t vocab : {151936, 5003, 37, 1}) {
      SCOPED_TRACE("vocab " + std::to_string(vocab) + (bf16 ? " bf16" : " fp32"));
      const int64_t rows = 9;
      std::vector<float> logits = randn(rows * vocab, 3.0f);
      std::vector<SamplingRowParams> rp;
      for (int64_t r = 0; r < rows; ++r)
        rp.push_back(greedy_row(static_cast<int>(r * 3 % 21), r % 2));
      if (vocab > 10) {
        float* r1 = logits.data() + 1 * vocab;  // a tie for the max: the lower id wins
        const float mx = *std::max_element(r1, r1 + vocab);
        r1[vocab - 1] = mx + 1.0f;
        r1[vocab / 2] = mx + 1.0f;
        float* r2 = logits.data() + 2 * vocab;  // NaN and -inf never win
        r2[0] = std::numeric_limits<float>::quiet_NaN();
        r2[3] = -kInf;
        float* r3 = logits.data() + 3 * vocab;  // everything -inf: token 0
        std::fill(r3, r3 + vocab, -kInf);
        rp[3].want_logprob = 0;
        rp[3].n_top = 0;
        rp[2].n_top = 0;  // NaN: the CPU top-n keeps it last, but its lse is NaN
        rp[2].want_logprob = 0;
      }
      Out o = run(logits, rp, vocab, bf16);
      check_rows(logits, rp, vocab, o);
    }
  }
}

// ------------------------------------------------------------------------------ kept sets

TEST_P(CudaSampling, TokensInKeptSet) {
  SCOPED_TRACE(trace());
  const float temps[] = {0.7f, 1.0f, 1.5f};
  const int32_t ks[] = {0, 1, 5, 50, 1000, 0};
  const float ps[] = {1.0f, 0.9f, 0.5f, 0.99f, 0.3f};
  const float mins[] = {0.0f, 0.0f, 0.05f, 0.2f};
  for (bool bf16 : {false, true}) {
    for (int64_t vocab : {151936, 5000, 64}) {
      SCOPED_TRACE("vocab " + std::to_string(vocab) + (bf16 ? " bf16" : " fp32"));
      const int64_t rows = 24;
      std::vector<float> logits(rows * vocab);
      std::vector<SamplingRowParams> rp(rows);
      for (int64_t r = 0; r < rows; ++r) {
        // Scales from flat (wide nuclei, many tokens per key bin) to peaked.
        const float scale = 0.3f + 1.5f * static_cast<float>(r % 5);
        std::vector<float> v = randn(vocab, scale);
        std::copy(v.begin(), v.end(), logits.begin() + r * vocab);
        SamplingRowParams& p = rp[r];
        p.temperature = r % 7 == 6 ? 0.0f : temps[r % 3];
        p.top_k = ks[r % 6];
        p.top_p = ps[(r / 2) % 5];
        p.min_p = mins[(r / 3) % 4];
        p.seed = rng_();
        p.counter = static_cast<uint64_t>(r) * 1000003u;
        p.want_logprob = r % 2;
        p.n_top = static_cast<int32_t>(r % 4 == 0 ? 20 : r % 5);
      }
      for (int rep = 0; rep < 3; ++rep) {
        for (auto& p : rp) ++p.counter;
        Out o = run(logits, rp, vocab, bf16);
        check_rows(logits, rp, vocab, o);
      }
      // The reference agrees with the CPU sampler itself.
      for (int64_t r = 0; r < rows; ++r) {
        if (rp[r].temperature < 1e-5f) continue;
        std::span<const float> row(logits.data() + r * vocab, static_cast<size_t>(vocab));
        const RefDist ref = ref_dist(row, rp[r]);
        SamplerRng rng(seed_ + r);
        for (int i = 0; i < 3; ++i) {
          const int32_t t = sample_token(row, to_cpu(rp[r]), {}, {}, rng);
          EXPECT_TRUE(ref.contains(t)) << "reference vs CPU sampler, row " << r << " "
                                       << describe(rp[r]) << ": cpu token " << t;
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------ distribution

/// Pearson chi-square of `counts` against `p` (bins with expected < 5 pooled); fails when the
/// statistic exceeds df + 6 sqrt(2 df) + 10 (p ~ 1e-6 or less) or a count falls outside p's
/// support.
::testing::AssertionResult chi_square(std::vector<int64_t> const& counts, RefDist const& ref,
                                      int64_t draws) {
  std::vector<double> expect(counts.size(), 0.0);
  for (size_t j = 0; j < ref.ids.size(); ++j) expect[ref.ids[j]] = ref.p[j] * draws;
  double stat = 0, pool_o = 0, pool_e = 0;
  int df = -1;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expect[i] == 0.0) {
      if (counts[i] != 0)
        return ::testing::AssertionFailure()
               << counts[i] << " draws of token " << i << " outside the kept set";
      continue;
    }
    if (expect[i] < 5.0) {
      pool_o += counts[i];
      pool_e += expect[i];
      continue;
    }
    stat += (counts[i] - expect[i]) * (counts[i] - expect[i]) / expect[i];
    ++df;
  }
  if (pool_e > 0) {
    stat += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
    ++df;
  }
  if (df <= 0) return ::testing::AssertionSuccess();
  const double limit = df + 6.0 * std::sqrt(2.0 * df) + 10.0;
  if (stat <= limit) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os << "chi2 " << stat << " > " << limit << " (df " << df << "); token: count / expected:";
  for (size_t j = 0; j < std::min<size_t>(ref.ids.size(), 12); ++j)
    os << " " << ref.ids[j] << ":" << counts[ref.ids[j]] << "/" << ref.p[j] * draws;
  return ::testing::AssertionFailure() << os.str();
}

TEST_P(CudaSampling, ChiSquare) {
  SCOPED_TRACE(trace());
  const int64_t draws = 20000;
  struct Case {
    float temp;
    int32_t k;
    float p, min_p;
    bool ties;  // logits on a coarse grid: cuts inside tied groups
  };
  const Case cases[] = {{1.0f, 0, 1.0f, 0.0f, false}, {0.8f, 10, 1.0f, 0.0f, false},
                        {1.0f, 0, 0.8f, 0.0f, false}, {1.2f, 20, 0.7f, 0.05f, false},
                        {1.0f, 0, 1.0f, 0.1f, false}, {1.0f, 7, 1.0f, 0.0f, true},
                        {1.0f, 0, 0.6f, 0.0f, true},  {0.9f, 12, 0.9f, 0.0f, true}};
  // Layouts: 64 tokens, all draws in one launch (the single-CTA kernel either way); 64 live
  // tokens spread over a 2048 vocabulary (the rest -inf) drawn 125 rows per launch, so that the
  // multi-CTA path splits each row over several CTAs (cuts and ties across slices).
  struct Layout {
    int64_t vocab, launch_rows;
  };
  for (Layout const lay : {Layout{64, draws}, Layout{2048, 125}}) {
    const int64_t vocab = lay.vocab;
    for (bool bf16 : {false, true}) {
      for (Case const& c : cases) {
        std::vector<float> one(vocab, -kInf);
        {
          std::vector<float> live = randn(64, 1.5f);
          std::vector<int64_t> pos(vocab);
          std::iota(pos.begin(), pos.end(), 0);
          std::shuffle(pos.begin(), pos.end(), rng_);
          for (int j = 0; j < 64; ++j) one[pos[j]] = live[j];
        }
        if (c.ties)
          for (float& v : one) v = std::round(v * 2.0f) / 2.0f;
        const uint64_t seed = rng_();
        SamplingRowParams base;
        base.temperature = c.temp;
        base.top_k = c.k;
        base.top_p = c.p;
        base.min_p = c.min_p;
        base.seed = seed;
        SCOPED_TRACE(describe(base) + (c.ties ? " ties" : "") + (bf16 ? " bf16" : " fp32") +
                     " vocab " + std::to_string(vocab));
        std::vector<int64_t> counts(vocab, 0), cpu_counts(vocab, 0);
        std::vector<float> row_used;
        for (int64_t r0 = 0; r0 < draws; r0 += lay.launch_rows) {
          const int64_t rows = std::min(lay.launch_rows, draws - r0);
          std::vector<float> logits(rows * vocab);
          std::vector<SamplingRowParams> rp(rows, base);
          for (int64_t r = 0; r < rows; ++r) {
            std::copy(one.begin(), one.end(), logits.begin() + r * vocab);
            rp[r].counter = static_cast<uint64_t>(r0 + r);
          }
          Out o = run(logits, rp, vocab, bf16);
          if (row_used.empty()) row_used.assign(logits.begin(), logits.begin() + vocab);
          for (int32_t t : o.tokens) {
            ASSERT_TRUE(t >= 0 && t < vocab) << "token " << t;
            ++counts[t];
          }
        }
        std::span<const float> row(row_used.data(), static_cast<size_t>(vocab));
        const RefDist ref = ref_dist(row, base);
        EXPECT_TRUE(chi_square(counts, ref, draws)) << "GPU";
        SamplerRng rng(seed);
        for (int64_t i = 0; i < draws; ++i)
          ++cpu_counts[sample_token(row, to_cpu(base), {}, {}, rng)];
        EXPECT_TRUE(chi_square(cpu_counts, ref, draws)) << "CPU sampler vs the reference";
      }
    }
  }
}

// ------------------------------------------------------------------------------ determinism

TEST_P(CudaSampling, SeededAndBatchInvariant) {
  SCOPED_TRACE(trace());
  const int64_t vocab = 151936, rows = 8;
  std::vector<float> base = randn(vocab, 1.0f);  // flat: many plausible tokens
  std::vector<float> logits(rows * vocab);
  std::vector<SamplingRowParams> rp(rows);
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(base.begin(), base.end(), logits.begin() + r * vocab);
    rp[r].temperature = 1.0f;
    rp[r].top_p = r % 2 ? 0.95f : 1.0f;
    rp[r].top_k = r % 4 == 3 ? 500 : 0;
    rp[r].seed = 12345;
    rp[r].counter = 7;
  }
  Out a = run(logits, rp, vocab, false);
  Out b = run(logits, rp, vocab, false);
  EXPECT_EQ(a.tokens, b.tokens) << "same inputs, same tokens";
  // The same (seed, counter, params) at another row with other neighbours: same token.
  std::vector<SamplingRowParams> rev(rp.rbegin(), rp.rend());
  Out c = run(logits, rev, vocab, false);
  for (int64_t r = 0; r < rows; ++r)
    EXPECT_EQ(c.tokens[rows - 1 - r], a.tokens[r]) << "row " << r << " moved";
  // Rows with identical params and (seed, counter) agree; other counters differ somewhere.
  EXPECT_EQ(a.tokens[0], a.tokens[2]);
  for (auto& p : rp) p.counter = 8;
  std::vector<int32_t> seen;
  for (int i = 0; i < 4; ++i) {
    for (auto& p : rp) ++p.counter;
    seen.push_back(run(logits, rp, vocab, false).tokens[0]);
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_GT(std::unique(seen.begin(), seen.end()) - seen.begin(), 1)
      << "4 counters on a flat 152k distribution gave one token";
}

TEST_P(CudaSampling, GraphReplayMatches) {
  SCOPED_TRACE(trace());
  const int64_t vocab = 151936, rows = 4;
  std::vector<float> logits = randn(rows * vocab, 2.0f);
  std::vector<SamplingRowParams> rp(rows);
  for (int64_t r = 0; r < rows; ++r) {
    rp[r].temperature = r == 0 ? 0.0f : 0.9f;
    rp[r].top_k = r == 2 ? 40 : 0;
    rp[r].top_p = r == 3 ? 0.9f : 1.0f;
    rp[r].seed = 99;
    rp[r].counter = static_cast<uint64_t>(r);
    rp[r].want_logprob = 1;
    rp[r].n_top = 5;
  }
  Out direct = run(logits, rp, vocab, false);
  DeviceBuffer<float> d_l(logits);
  DeviceBuffer<SamplingRowParams> d_rp(rp);
  DeviceBuffer<int32_t> d_tok(rows), d_ids(rows * kTop);
  DeviceBuffer<float> d_lp(rows), d_tlp(rows * kTop);
  d_tok.poison(0x7f);
  DeviceBuffer<uint8_t> d_ws(multi() ? sample_workspace_bytes(rows, vocab) : 0);
  SampleParams p{d_l.ptr,   DType::kF32,
                 d_rp.ptr,  d_tok.ptr,
                 d_lp.ptr,  d_ids.ptr,
                 d_tlp.ptr, rows,
                 vocab,     multi() ? static_cast<void*>(d_ws.ptr) : nullptr};
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  sample_launch(p, stream_);
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {  // replays reuse the workspace
    d_tok.poison(0x7f);
    d_ids.poison(0x7f);
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(d_tok.download(), direct.tokens) << "replay " << rep;
    EXPECT_EQ(d_ids.download(), direct.top_ids) << "replay " << rep;
  }
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}

// Both paths on inputs that stress the multi-CTA cut: logits on a coarse grid (huge ties that
// span every slice, so top-k / top-p cuts fall inside a tie), flat and peaked rows, many
// counters; tokens and top ids must be identical (run() compares them) and in the kept set.
TEST_P(CudaSampling, PathsAgreeOnTies) {
  SCOPED_TRACE(trace());
  for (int64_t vocab : {151936, 5003, 1000}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const int64_t rows = 6;
    std::vector<float> logits(rows * vocab);
    std::vector<SamplingRowParams> rp(rows);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<float> v = randn(vocab, r % 2 ? 1.5f : 4.0f);
      for (float& x : v) x = std::round(x * 2.0f) / 2.0f;
      std::copy(v.begin(), v.end(), logits.begin() + r * vocab);
      rp[r].temperature = r == 5 ? 0.0f : 1.0f;
      rp[r].top_k = r % 3 == 0 ? 50 : (r == 4 ? 3000 : 0);
      rp[r].top_p = r % 3 == 1 ? 0.7f : (r == 2 ? 0.95f : 1.0f);
      rp[r].min_p = r == 4 ? 0.01f : 0.0f;
      rp[r].seed = rng_();
      rp[r].want_logprob = 1;
      rp[r].n_top = r % 2 ? 20 : 7;
    }
    for (int rep = 0; rep < 8; ++rep) {
      for (auto& p : rp) p.counter = static_cast<uint64_t>(rep) * 977u;
      Out o = run(logits, rp, vocab, rep % 2 == 1);
      check_rows(logits, rp, vocab, o);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// ------------------------------------------------------------------------------ masks + biases

/// The CUDA models' processing of a constrained / biased row, on the device: the sparse biases
/// (apply_logit_bias_launch), then the packed mask (apply_token_bitmask_launch), in place.
/// Returns the processed logits; expects them equal to the CPU's (apply_token_bitmask, then the
/// biases of apply_penalties, as the engine's host path does).
std::vector<float> process_rows(std::vector<float> const& logits, std::vector<uint32_t> const& mask,
                                std::vector<std::vector<LogitBias>> const& biases, int64_t vocab,
                                cudaStream_t stream) {
  const auto rows = static_cast<int64_t>(biases.size());
  const int64_t words = (vocab + 31) / 32;
  std::vector<float> want = logits;
  std::vector<LogitBiasEntry> entries;
  for (int64_t r = 0; r < rows; ++r) {
    std::span<float> row(want.data() + r * vocab, static_cast<size_t>(vocab));
    apply_token_bitmask(
        row, std::span<const uint32_t>(mask.data() + r * words, static_cast<size_t>(words)));
    SamplingParams sp;
    sp.logit_bias = biases[static_cast<size_t>(r)];
    apply_penalties(row, sp, {}, {});
    for (const LogitBias& b : biases[static_cast<size_t>(r)])
      entries.push_back({static_cast<int32_t>(r), b.id, b.bias});
  }
  DeviceBuffer<float> d_l(logits);
  DeviceBuffer<LogitBiasEntry> d_e(entries);
  std::vector<int32_t> mask_i(mask.begin(), mask.end());
  DeviceBuffer<int32_t> d_m(mask_i);
  apply_logit_bias_launch({d_l.ptr, d_e.ptr, static_cast<int64_t>(entries.size()), vocab}, stream);
  TokenBitmaskParams mp{};
  mp.logits = d_l.ptr;
  mp.dtype = DType::kF32;
  mp.bitmask = d_m.ptr;
  mp.mask_row = nullptr;
  mp.rows = rows;
  mp.vocab = vocab;
  mp.words = words;
  apply_token_bitmask_launch(mp, stream);
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> got = d_l.download();
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] == want[i]) continue;
    ADD_FAILURE() << "device mask + biases differ from the CPU's at row " << i / vocab << " id "
                  << i % vocab << ": " << got[i] << " vs " << want[i];
    break;
  }
  return want;
}

bool allowed(std::vector<uint32_t> const& mask, int64_t words, int64_t r, int32_t id) {
  return ((mask[static_cast<size_t>(r * words + id / 32)] >> (id % 32)) & 1u) != 0;
}

// Masked and biased rows (structured outputs, logit_bias) through the device processing and
// sample_launch: every token allowed, greedy equal to the CPU sampler, sampled tokens in the
// reference kept set; rows with all tokens masked but one, sparse masks, biases of +-100 on
// masked and allowed tokens, odd vocabularies; then a chi-square over 20k draws of one masked +
// biased row.
TEST_P(CudaSampling, MaskedAndBiasedRows) {
  SCOPED_TRACE(trace());
  for (int64_t vocab : {151936, 5003, 33}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    const int64_t rows = 12, words = (vocab + 31) / 32;
    std::vector<float> logits = randn(rows * vocab, 2.0f);
    std::vector<uint32_t> mask(static_cast<size_t>(rows * words), 0u);
    std::vector<std::vector<LogitBias>> biases(rows);
    std::vector<SamplingRowParams> rp(rows);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
    std::uniform_real_distribution<float> bias(-100.0f, 100.0f);
    for (int64_t r = 0; r < rows; ++r) {
      uint32_t* mw = mask.data() + r * words;
      switch (r % 4) {
        case 0:  // about half allowed
          for (int64_t w = 0; w < words; ++w) mw[w] = static_cast<uint32_t>(rng_());
          break;
        case 1: {  // all masked but one
          const int32_t id = pick(rng_);
          mw[id / 32] = 1u << (id % 32);
          break;
        }
        case 2:  // sparse (1 in 8)
          for (int64_t w = 0; w < words; ++w)
            mw[w] = static_cast<uint32_t>(rng_() & rng_() & rng_());
          break;
        default:  // unmasked: biases only
          for (int64_t w = 0; w < words; ++w) mw[w] = 0xffffffffu;
      }
      mw[0] |= 1u;  // token 0 always allowed (a non-empty set in every row)
      std::vector<int32_t> ids;
      for (int j = 0; j < static_cast<int>(r % 5) * 2; ++j) {
        const int32_t id = pick(rng_);
        if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
      }
      for (int32_t id : ids) biases[r].push_back({id, bias(rng_)});
      if (r % 3 == 2 && vocab > 40) biases[r].push_back({3 * static_cast<int32_t>(r), 100.0f});
      SamplingRowParams& p = rp[r];
      p.temperature = r % 3 == 0 ? 0.0f : 0.8f;
      p.top_k = r % 2 ? 20 : 0;
      p.top_p = r % 5 == 1 ? 0.9f : 1.0f;
      p.min_p = r % 6 == 2 ? 0.05f : 0.0f;
      p.seed = rng_();
      p.want_logprob = r % 2;
      p.n_top = r % 4 == 0 ? 5 : 0;
    }
    // Duplicate (row, id) pairs would race on the device: the biases above are distinct per row.
    for (auto& b : biases) {
      std::sort(b.begin(), b.end(),
                [](LogitBias const& x, LogitBias const& y) { return x.id < y.id; });
      b.erase(std::unique(b.begin(), b.end(),
                          [](LogitBias const& x, LogitBias const& y) { return x.id == y.id; }),
              b.end());
    }
    std::vector<float> processed = process_rows(logits, mask, biases, vocab, stream_);
    for (int rep = 0; rep < 3; ++rep) {
      for (int64_t r = 0; r < rows; ++r) rp[r].counter = static_cast<uint64_t>(rep * 100 + r);
      Out o = run(processed, rp, vocab, false);
      check_rows(processed, rp, vocab, o);
      for (int64_t r = 0; r < rows; ++r)
        EXPECT_TRUE(allowed(mask, words, r, o.tokens[r]))
            << "row " << r << " token " << o.tokens[r] << " is masked";
      if (::testing::Test::HasFailure()) return;
    }
  }
  // Chi-square: 64 allowed tokens of 2048 (8 of them biased), 16 masked tokens biased by +50.
  const int64_t vocab = 2048, words = vocab / 32, draws = 20000, launch_rows = 125;
  std::vector<float> one = randn(vocab, 1.5f);
  std::vector<uint32_t> mask1(words, 0u);
  std::vector<int32_t> pos(vocab);
  std::iota(pos.begin(), pos.end(), 0);
  std::shuffle(pos.begin(), pos.end(), rng_);
  std::vector<LogitBias> b1;
  for (int j = 0; j < 64; ++j) mask1[pos[j] / 32] |= 1u << (pos[j] % 32);
  for (int j = 0; j < 8; ++j) b1.push_back({pos[j], j % 2 ? 2.0f : -1.5f});
  for (int j = 64; j < 80; ++j) b1.push_back({pos[j], 50.0f});
  std::vector<float> processed1 = process_rows(one, mask1, {b1}, vocab, stream_);
  SamplingRowParams base;
  base.temperature = 0.9f;
  base.top_k = 30;
  base.top_p = 0.95f;
  base.seed = rng_();
  SCOPED_TRACE(describe(base) + " masked + biased, vocab 2048");
  std::vector<int64_t> counts(vocab, 0);
  for (int64_t r0 = 0; r0 < draws; r0 += launch_rows) {
    const int64_t rows = std::min(launch_rows, draws - r0);
    std::vector<float> logits(rows * vocab);
    std::vector<SamplingRowParams> rp(rows, base);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy(processed1.begin(), processed1.end(), logits.begin() + r * vocab);
      rp[r].counter = static_cast<uint64_t>(r0 + r);
    }
    Out o = run(logits, rp, vocab, false);
    for (int32_t t : o.tokens) {
      ASSERT_TRUE(t >= 0 && t < vocab && allowed(mask1, words, 0, t)) << "token " << t;
      ++counts[t];
    }
  }
  const RefDist ref =
      ref_dist(std::span<const float>(processed1.data(), static_cast<size_t>(vocab)), base);
  EXPECT_TRUE(chi_square(counts, ref, draws));
}

INSTANTIATE_TEST_SUITE_P(, CudaSampling, ::testing::Bool(),
                         [](::testing::TestParamInfo<bool> const& i) {
                           return std::string(i.param ? "MultiCta" : "SingleCta");
                         });

}  // namespace
}  // namespace tandem::cuda
