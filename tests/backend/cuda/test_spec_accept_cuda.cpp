// Rejection sampling of draft tokens on the GPU (src/backend/cuda/spec_accept.h):
//  - against the CPU reference (spec_accept_reference): the same accepted counts and tokens,
//    row by row, over fresh random distributions (vocab 16 .. 151936, K = 0..4, drafts drawn
//    from q, one-hot q, drafts outside p's support, p below q everywhere so the residual is
//    empty, per-sequence draft counts), outputs poisoned before each launch;
//  - by distribution (the GPU mirror of tests/engine/test_speculative.cpp's
//    SpecAcceptRule.OutputFollowsTargetDistribution): over 20000 seeded sequences with
//    overlapping p and q the first emitted token follows p (chi-square below the 1e-3
//    quantile), while the drafts themselves (always accepting) fail the same bound;
//  - the bonus token's draw is the device sampler's draw at that output position (uniform of
//    the "DRAW" tag), so it equals the reference's inverse CDF at spec_uniform.
// The GPU tests skip (GTEST_SKIP) without a CUDA device; the reference's distribution check
// and the launcher's argument checks run anywhere. The seed is printed on failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/spec_accept.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::gpu_available;
template <typename T>
using DeviceBuffer = test_util::DeviceBuffer<T, test_util::UploadCheck::kNone>;

// A random probability row: softmax of normal logits at temperature t, the tokens below the
// top `keep` (0: all) zeroed as a top-k cut leaves them, renormalised in float.
std::vector<float> random_dist(std::mt19937_64& gen, int64_t vocab, float t, int64_t keep) {
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> x(static_cast<size_t>(vocab));
  for (float& v : x) v = nd(gen) / t;
  std::vector<float> sorted = x;
  float cut = -INFINITY;
  if (keep > 0 && keep < vocab) {
    std::nth_element(sorted.begin(), sorted.begin() + (keep - 1), sorted.end(),
                     std::greater<float>());
    cut = sorted[static_cast<size_t>(keep - 1)];
  }
  const float m = *std::max_element(x.begin(), x.end());
  double sum = 0.0;
  for (float& v : x) {
    v = v >= cut ? std::exp(v - m) : 0.0f;
    sum += v;
  }
  for (float& v : x) v = static_cast<float>(v / sum);
  return x;
}

int32_t sample(const float* w, int64_t n, std::mt19937_64& gen) {
  std::discrete_distribution<int32_t> dd(w, w + n);
  return dd(gen);
}

struct Case {
  int64_t seqs, K, vocab;
  bool with_q;
  int64_t keep;  // top-k-like cut of the rows (0: none)
};

class CudaSpecAccept : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
    seed_ = std::random_device{}();
    gen_.seed(seed_);
  }
  uint64_t seed_ = 0;
  std::mt19937_64 gen_;
};

TEST_F(CudaSpecAccept, MatchesTheReference) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const Case cases[] = {{1, 1, 16, true, 0},       {7, 3, 16, true, 4},   {33, 4, 1000, true, 0},
                        {33, 4, 1000, false, 50},  {5, 0, 1000, true, 0}, {3, 2, 151936, true, 0},
                        {2, 4, 151936, false, 20}, {64, 2, 256, true, 8}};
  int64_t total_rows = 0, total_accepted = 0, total_rejected = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE("seqs " + std::to_string(c.seqs) + " K " + std::to_string(c.K) + " vocab " +
                 std::to_string(c.vocab) + (c.with_q ? " q" : " one-hot q"));
    const auto V = static_cast<size_t>(c.vocab);
    std::vector<float> p(static_cast<size_t>(c.seqs * (c.K + 1)) * V);
    std::vector<float> q;
    if (c.with_q) q.resize(static_cast<size_t>(c.seqs * c.K) * V);
    std::vector<int32_t> drafts(static_cast<size_t>(c.seqs * c.K));
    std::vector<SpecAcceptRow> rows(static_cast<size_t>(c.seqs));
    std::uniform_real_distribution<float> temp(0.3f, 1.5f);
    for (int64_t s = 0; s < c.seqs; ++s) {
      const int kind = static_cast<int>(gen_() % 4);  // 3: p = q / 2 (the residual is empty)
      for (int64_t j = 0; j <= c.K; ++j) {
        const std::vector<float> pj = random_dist(gen_, c.vocab, temp(gen_), c.keep);
        std::copy(pj.begin(), pj.end(),
                  p.begin() + static_cast<int64_t>((s * (c.K + 1) + j) * c.vocab));
        if (j == c.K) break;
        const size_t di = static_cast<size_t>(s * c.K + j);
        std::vector<float> qj;
        if (c.with_q) {
          // Overlapping q: p mixed with another distribution (kind 0: q = p).
          const std::vector<float> o = random_dist(gen_, c.vocab, temp(gen_), 0);
          const float a = kind == 0 ? 1.0f : (kind == 1 ? 0.7f : 0.2f);
          qj.resize(V);
          for (size_t i = 0; i < V; ++i) qj[i] = a * pj[i] + (1.0f - a) * o[i];
          if (kind == 3) {  // p below q everywhere
            for (size_t i = 0; i < V; ++i) {
              p[static_cast<size_t>((s * (c.K + 1) + j) * c.vocab) + i] = 0.5f * qj[i];
            }
          }
          std::copy(qj.begin(), qj.end(), q.begin() + static_cast<int64_t>(di * V));
          drafts[di] = sample(qj.data(), c.vocab, gen_);
        } else {
          // Deterministic drafts: p's mode, a random token, or one outside p's support.
          drafts[di] =
              kind == 0 ? static_cast<int32_t>(std::max_element(pj.begin(), pj.end()) - pj.begin())
                        : static_cast<int32_t>(gen_() % V);
        }
      }
      rows[static_cast<size_t>(s)].seed = gen_();
      rows[static_cast<size_t>(s)].counter = gen_() % 100000;
      rows[static_cast<size_t>(s)].num_drafts =
          static_cast<int32_t>(s % 5 == 4 ? gen_() % (c.K + 1) : c.K);
    }
    std::vector<int32_t> want_tokens, want_acc;
    spec_accept_reference(p, q, drafts, rows, c.K, c.vocab, want_tokens, want_acc);

    DeviceBuffer<float> dp(p), dq(q);
    DeviceBuffer<int32_t> dd(drafts);
    DeviceBuffer<SpecAcceptRow> dr(rows);
    DeviceBuffer<int32_t> dt(static_cast<size_t>(c.seqs * (c.K + 1)));
    DeviceBuffer<int32_t> da(static_cast<size_t>(c.seqs));
    dt.poison(0x7f);
    da.poison(0x7f);
    SpecAcceptParams prm{
        dp.ptr, c.with_q ? dq.ptr : nullptr, dd.ptr, dr.ptr, dt.ptr, da.ptr, c.seqs, c.K, c.vocab};
    spec_accept_launch(prm, nullptr);
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<int32_t> got_tokens = dt.download(), got_acc = da.download();
    ASSERT_EQ(got_acc, want_acc);
    ASSERT_EQ(got_tokens, want_tokens);
    for (int64_t s = 0; s < c.seqs; ++s) {
      const int32_t a = want_acc[static_cast<size_t>(s)];
      total_accepted += a;
      total_rejected += a < rows[static_cast<size_t>(s)].num_drafts;
      // The emitted tokens are the accepted drafts, then one token with mass in its row.
      for (int32_t j = 0; j < a; ++j) {
        EXPECT_EQ(got_tokens[static_cast<size_t>(s * (c.K + 1) + j)],
                  drafts[static_cast<size_t>(s * c.K + j)]);
      }
      const int32_t last = got_tokens[static_cast<size_t>(s * (c.K + 1) + a)];
      ASSERT_GE(last, 0);
      ASSERT_LT(last, c.vocab);
      EXPECT_GT(p[static_cast<size_t>((s * (c.K + 1) + a) * c.vocab + last)], 0.0f)
          << "sequence " << s << " emitted a token outside its row's support";
    }
    total_rows += c.seqs;
  }
  // Both branches ran (acceptance and rejection), so the comparison covered the draws.
  EXPECT_GT(total_accepted, 0);
  EXPECT_GT(total_rejected, 0);
  std::printf("spec_accept: %lld sequences, %lld drafts accepted, %lld rejections\n",
              static_cast<long long>(total_rows), static_cast<long long>(total_accepted),
              static_cast<long long>(total_rejected));
}

// The chi-square quantile at 1 - 1e-3 (Wilson-Hilferty), as tests/engine/chi_square.h.
double bound(int64_t df) {
  const double z = 3.09, k = double(df);
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

double chi2(const std::vector<int64_t>& counts, const std::vector<float>& p, int64_t n,
            int64_t& df) {
  double x2 = 0.0;
  df = -1;
  for (size_t i = 0; i < p.size(); ++i) {
    const double e = double(p[i]) * double(n);
    if (e <= 0.0) {
      if (counts[i] > 0) return INFINITY;  // a token outside the support
      continue;
    }
    x2 += (double(counts[i]) - e) * (double(counts[i]) - e) / e;
    ++df;
  }
  return x2;
}

// The distribution check's inputs: kSeqs sequences of K = 2 drafts over vocab 8, p and q fixed
// and overlapping, drafts drawn from q (or always token 1: deterministic drafts), seeds fresh.
struct DistCase {
  static constexpr int64_t kSeqs = 20000, kV = 8, K = 2;
  std::vector<float> pj = {0.30f, 0.25f, 0.15f, 0.10f, 0.08f, 0.07f, 0.05f, 0.0f};
  std::vector<float> qj = {0.05f, 0.10f, 0.40f, 0.05f, 0.10f, 0.0f, 0.10f, 0.20f};
  std::vector<float> p, q;
  std::vector<int32_t> drafts;
  std::vector<SpecAcceptRow> rows;
  DistCase(bool with_q, std::mt19937_64& gen) : rows(kSeqs) {
    for (int64_t s = 0; s < kSeqs; ++s) {
      for (int64_t j = 0; j <= K; ++j) p.insert(p.end(), pj.begin(), pj.end());
      for (int64_t j = 0; j < K; ++j) {
        if (with_q) q.insert(q.end(), qj.begin(), qj.end());
        drafts.push_back(with_q ? sample(qj.data(), kV, gen) : 1);
      }
      rows[static_cast<size_t>(s)] = {gen(), static_cast<uint64_t>(s), static_cast<int32_t>(K)};
    }
  }
  // The first emitted token and the second (given the first accepted) follow p; the drafts
  // themselves (always accepting) do not.
  void check(const std::vector<int32_t>& tokens, const std::vector<int32_t>& acc,
             const char* what) const {
    std::vector<int64_t> first(kV, 0), second(kV, 0), always(kV, 0);
    int64_t n_second = 0;
    for (int64_t s = 0; s < kSeqs; ++s) {
      const int32_t t0 = tokens[static_cast<size_t>(s * (K + 1))];
      ASSERT_GE(t0, 0);
      ASSERT_LT(t0, kV);
      ++first[static_cast<size_t>(t0)];
      ++always[static_cast<size_t>(drafts[static_cast<size_t>(s * K)])];
      if (acc[static_cast<size_t>(s)] >= 1) {
        const int32_t t1 = tokens[static_cast<size_t>(s * (K + 1) + 1)];
        ASSERT_GE(t1, 0);
        ASSERT_LT(t1, kV);
        ++second[static_cast<size_t>(t1)];
        ++n_second;
      }
    }
    int64_t df = 0, df2 = 0, dfw = 0;
    const double x2 = chi2(first, pj, kSeqs, df);
    const double x2s = chi2(second, pj, n_second, df2);
    const double x2w = chi2(always, pj, kSeqs, dfw);
    EXPECT_LT(x2, bound(df)) << "df " << df;
    EXPECT_LT(x2s, bound(df2)) << "second position, df " << df2;
    EXPECT_GT(n_second, kSeqs / 10);
    EXPECT_GT(x2w, bound(std::max<int64_t>(dfw, 1)));  // accepting every draft: not p
    std::printf(
        "spec_accept %s: first token chi-square %.1f (df %lld, bound %.1f), second %.1f "
        "over %lld, always-accept %.1f\n",
        what, x2, static_cast<long long>(df), bound(df), x2s, static_cast<long long>(n_second),
        x2w);
  }
};

TEST_F(CudaSpecAccept, FirstTokenFollowsTheTarget) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  for (const bool with_q : {true, false}) {
    SCOPED_TRACE(with_q ? "drafts from q" : "deterministic drafts");
    const DistCase c(with_q, gen_);
    constexpr int64_t kSeqs = DistCase::kSeqs, K = DistCase::K;
    DeviceBuffer<float> dp(c.p), dq(c.q);
    DeviceBuffer<int32_t> dd(c.drafts);
    DeviceBuffer<SpecAcceptRow> dr(c.rows);
    DeviceBuffer<int32_t> dt(static_cast<size_t>(kSeqs * (K + 1)));
    DeviceBuffer<int32_t> da(static_cast<size_t>(kSeqs));
    dt.poison(0x7f);
    da.poison(0x7f);
    spec_accept_launch(
        {dp.ptr, with_q ? dq.ptr : nullptr, dd.ptr, dr.ptr, dt.ptr, da.ptr, kSeqs, K, DistCase::kV},
        nullptr);
    c.check(dt.download(), da.download(), with_q ? "device, q" : "device, one-hot q");
  }
}

// The CPU reference alone (runs without a GPU): the same distribution check.
TEST(SpecAcceptReference, FirstTokenFollowsTheTarget) {
  std::mt19937_64 gen(std::random_device{}());
  for (const bool with_q : {true, false}) {
    SCOPED_TRACE(with_q ? "drafts from q" : "deterministic drafts");
    const DistCase c(with_q, gen);
    std::vector<int32_t> tokens, acc;
    spec_accept_reference(c.p, c.q, c.drafts, c.rows, DistCase::K, DistCase::kV, tokens, acc);
    c.check(tokens, acc, with_q ? "reference, q" : "reference, one-hot q");
  }
}

// The bonus token (every draft accepted) is the draw of the device sampler's stream at its
// output position: the inverse CDF of p_K at spec_uniform(seed, counter + K, kDrawTag).
TEST_F(CudaSpecAccept, BonusTokenIsTheSamplersDrawAtItsPosition) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  constexpr int64_t kSeqs = 256, kV = 64, K = 3;
  std::vector<float> p, q;
  std::vector<int32_t> drafts;
  std::vector<SpecAcceptRow> rows(kSeqs);
  std::vector<std::vector<float>> bonus_rows;
  for (int64_t s = 0; s < kSeqs; ++s) {
    for (int64_t j = 0; j <= K; ++j) {
      std::vector<float> pj = random_dist(gen_, kV, 1.0f, 0);
      if (j < K) {  // q = p: every draft accepted (u * q(d) < p(d) for u < 1)
        q.insert(q.end(), pj.begin(), pj.end());
        drafts.push_back(sample(pj.data(), kV, gen_));
      } else {
        bonus_rows.push_back(pj);
      }
      p.insert(p.end(), pj.begin(), pj.end());
    }
    rows[static_cast<size_t>(s)] = {gen_(), gen_() % 1000, static_cast<int32_t>(K)};
  }
  DeviceBuffer<float> dp(p), dq(q);
  DeviceBuffer<int32_t> dd(drafts);
  DeviceBuffer<SpecAcceptRow> dr(rows);
  DeviceBuffer<int32_t> dt(static_cast<size_t>(kSeqs * (K + 1)));
  DeviceBuffer<int32_t> da(static_cast<size_t>(kSeqs));
  dt.poison(0x7f);
  da.poison(0x7f);
  spec_accept_launch({dp.ptr, dq.ptr, dd.ptr, dr.ptr, dt.ptr, da.ptr, kSeqs, K, kV}, nullptr);
  const std::vector<int32_t> tokens = dt.download(), acc = da.download();
  for (int64_t s = 0; s < kSeqs; ++s) {
    ASSERT_EQ(acc[static_cast<size_t>(s)], K) << "sequence " << s;
    // The inverse CDF by doubles at the uniform (ties at a boundary have probability ~2^-40).
    const auto& pj = bonus_rows[static_cast<size_t>(s)];
    const double u = spec_uniform(rows[static_cast<size_t>(s)].seed,
                                  rows[static_cast<size_t>(s)].counter + K, kDrawTag);
    double total = 0.0;
    for (float v : pj) total += std::nearbyint(double(v) * 0x1.0p40);
    double run = 0.0;
    int32_t want = -1;
    for (int64_t i = 0; i < kV && want < 0; ++i) {
      run += std::nearbyint(double(pj[static_cast<size_t>(i)]) * 0x1.0p40);
      if (run > std::floor(u * total)) want = static_cast<int32_t>(i);
    }
    EXPECT_EQ(tokens[static_cast<size_t>(s * (K + 1) + K)], want) << "sequence " << s;
  }
}

// Host-side checks: no GPU needed.
TEST(SpecAcceptLaunch, BadShapesAreRefused) {
  SpecAcceptParams p{};
  p.seqs = 1;
  p.K = 1;
  p.vocab = (int64_t{1} << 23) + 1;
  EXPECT_THROW(spec_accept_launch(p, nullptr), Error);
  p.vocab = 16;
  EXPECT_THROW(spec_accept_launch(p, nullptr), Error);  // null pointers
  p.K = -1;
  EXPECT_THROW(spec_accept_launch(p, nullptr), Error);
}

}  // namespace
}  // namespace tandem::cuda
