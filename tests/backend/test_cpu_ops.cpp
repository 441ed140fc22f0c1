// Each CPU op against a straightforward double-precision reference, on fresh random
// inputs, with outputs poisoned (NaN) first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"

namespace tandem::cpu {
namespace {

std::mt19937 g_rng(12345);

std::vector<float> randn(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g_rng);
  return v;
}
std::vector<float> poisoned(size_t n) { return std::vector<float>(n, NAN); }

// ||out - ref|| / ||ref||, NaN anywhere fails.
double rel_err(const std::vector<float>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

TEST(CpuOps, Gemm) {
  for (auto [m, n, k] :
       {std::tuple{1, 37, 64}, {3, 5, 7}, {4, 16, 33}, {9, 64, 128}, {17, 3, 250}}) {
    auto a = randn(m * k), b = randn(n * k);
    auto out = poisoned(m * n);
    gemm({a.data(), b.data(), out.data(), m, n, k});
    std::vector<double> ref(m * n);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double s = 0;
        for (int l = 0; l < k; ++l) s += double(a[i * k + l]) * b[j * k + l];
        ref[i * n + j] = s;
      }
    EXPECT_LT(rel_err(out, ref), 1e-5) << m << "x" << n << "x" << k;
    // Accumulate mode adds onto the existing output.
    auto acc = out;
    gemm({a.data(), b.data(), acc.data(), m, n, k, true});
    for (auto& r : ref) r *= 2;
    EXPECT_LT(rel_err(acc, ref), 1e-5);
  }
}

TEST(CpuOps, GemmIsBatchInvariant) {
  const int m = 7, n = 19, k = 100;
  auto a = randn(m * k), b = randn(n * k);
  auto all = poisoned(m * n);
  gemm({a.data(), b.data(), all.data(), m, n, k});
  for (int i = 0; i < m; ++i) {
    auto one = poisoned(n);
    gemm({a.data() + i * k, b.data(), one.data(), 1, n, k});
    for (int j = 0; j < n; ++j) EXPECT_EQ(one[j], all[i * n + j]);  // bit-identical
  }
}

TEST(CpuOps, RmsNormAndAddRmsNorm) {
  const int rows = 5, dim = 96;
  auto x = randn(rows * dim), w = randn(dim), r = randn(rows * dim);
  auto out = poisoned(rows * dim);
  rms_norm({x.data(), w.data(), out.data(), rows, dim, 1e-6f});
  std::vector<double> ref(rows * dim);
  auto ref_norm = [&](const std::vector<double>& in) {
    for (int i = 0; i < rows; ++i) {
      double ss = 0;
      for (int j = 0; j < dim; ++j) ss += in[i * dim + j] * in[i * dim + j];
      double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
      for (int j = 0; j < dim; ++j) ref[i * dim + j] = w[j] * in[i * dim + j] * inv;
    }
  };
  ref_norm(std::vector<double>(x.begin(), x.end()));
  EXPECT_LT(rel_err(out, ref), 1e-6);

  auto res = r;
  auto out2 = poisoned(rows * dim);
  add_rms_norm({res.data(), x.data(), w.data(), out2.data(), rows, dim, 1e-6f});
  std::vector<double> sum(rows * dim);
  for (int i = 0; i < rows * dim; ++i) sum[i] = double(r[i]) + x[i];
  ref_norm(sum);
  EXPECT_LT(rel_err(out2, ref), 1e-6);
  EXPECT_LT(rel_err(res, sum), 1e-7);
}

TEST(CpuOps, QkNormRope) {
  const int t = 6, qh = 4, kvh = 2, d = 32;
  const double theta = 1e6;
  auto q = randn(t * qh * d), k = randn(t * kvh * d), qw = randn(d), kw = randn(d);
  std::vector<int32_t> pos = {0, 1, 7, 100, 513, 3000};
  auto q2 = q, k2 = k;
  qk_norm_rope(
      {q2.data(), k2.data(), qw.data(), kw.data(), pos.data(), t, qh, kvh, d, 1e-6f, theta});
  auto ref_fn = [&](const std::vector<float>& x, const std::vector<float>& w, int heads) {
    std::vector<double> out(x.size());
    for (int i = 0; i < t; ++i)
      for (int h = 0; h < heads; ++h) {
        const float* v = &x[(i * heads + h) * d];
        double ss = 0;
        for (int j = 0; j < d; ++j) ss += double(v[j]) * v[j];
        double inv = 1.0 / std::sqrt(ss / d + 1e-6);
        std::vector<double> n(d);
        for (int j = 0; j < d; ++j) n[j] = w[j] * v[j] * inv;
        for (int j = 0; j < d / 2; ++j) {
          double f = pos[i] * std::pow(theta, -2.0 * j / d);
          double c = std::cos(f), s = std::sin(f);
          out[(i * heads + h) * d + j] = n[j] * c - n[j + d / 2] * s;
          out[(i * heads + h) * d + j + d / 2] = n[j + d / 2] * c + n[j] * s;
        }
      }
    return out;
  };
  // fp32 angles at position 3000 carry ~1e-4 absolute phase error (as in transformers).
  EXPECT_LT(rel_err(q2, ref_fn(q, qw, qh)), 2e-4);
  EXPECT_LT(rel_err(k2, ref_fn(k, kw, kvh)), 2e-4);
}

TEST(CpuOps, PagedAttentionMatchesDenseCausal) {
  const int kvh = 2, qh = 8, d = 16, ps = 4, num_pages = 16;
  const std::vector<int> lens = {1, 5, 13};  // three sequences, prefill of all tokens
  const int64_t page_stride = 2 * kvh * ps * d;
  std::vector<float> pool(num_pages * page_stride, NAN);
  // Shuffled, non-contiguous page tables.
  std::vector<int32_t> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), g_rng);
  const int max_pages = 4;
  std::vector<int32_t> table(lens.size() * max_pages, 0);
  int next = 0;
  for (size_t s = 0; s < lens.size(); ++s)
    for (int p = 0; p < (lens[s] + ps - 1) / ps; ++p) table[s * max_pages + p] = perm[next++];
  int n = 0;
  for (int l : lens) n += l;
  auto q = randn(n * qh * d), k = randn(n * kvh * d), v = randn(n * kvh * d);
  std::vector<int32_t> seq, posv;
  std::vector<int64_t> slot;
  for (size_t s = 0; s < lens.size(); ++s)
    for (int i = 0; i < lens[s]; ++i) {
      seq.push_back(int32_t(s));
      posv.push_back(i);
      slot.push_back(int64_t(table[s * max_pages + i / ps]) * ps + i % ps);
    }
  kv_write({k.data(), v.data(), pool.data(), slot.data(), n, kvh, d, ps});
  auto out = poisoned(n * qh * d);
  const float scale = 1.0f / std::sqrt(float(d));
  paged_attention({q.data(), pool.data(), table.data(), seq.data(), posv.data(), out.data(), n, qh,
                   kvh, d, ps, max_pages, scale});
  std::vector<double> ref(n * qh * d, 0);
  int base = 0;
  for (size_t s = 0; s < lens.size(); ++s) {
    for (int i = 0; i < lens[s]; ++i)
      for (int h = 0; h < qh; ++h) {
        int g = h / (qh / kvh);
        std::vector<double> sc(i + 1);
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double dot = 0;
          for (int e = 0; e < d; ++e)
            dot += double(q[((base + i) * qh + h) * d + e]) * k[((base + j) * kvh + g) * d + e];
          sc[j] = dot * scale;
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (auto& x : sc) sum += (x = std::exp(x - mx));
        for (int j = 0; j <= i; ++j)
          for (int e = 0; e < d; ++e)
            ref[((base + i) * qh + h) * d + e] += sc[j] / sum * v[((base + j) * kvh + g) * d + e];
      }
    base += lens[s];
  }
  EXPECT_LT(rel_err(out, ref), 1e-5);
}

TEST(CpuOps, TopkSoftmax) {
  const int t = 20, e = 16;
  for (int k : {1, 2, 8}) {
    for (bool renorm : {false, true}) {
      auto logits = randn(t * e, 2.f);
      std::vector<int32_t> ids(t * k, -1);
      std::vector<float> w(t * k, NAN);
      topk_softmax({logits.data(), ids.data(), w.data(), t, e, k, renorm});
      for (int i = 0; i < t; ++i) {
        std::vector<double> p(e);
        double mx = *std::max_element(&logits[i * e], &logits[i * e] + e), sum = 0;
        for (int j = 0; j < e; ++j) sum += (p[j] = std::exp(double(logits[i * e + j]) - mx));
        std::vector<int> order(e);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
        double ksum = 0;
        for (int j = 0; j < k; ++j) ksum += p[order[j]] / sum;
        for (int j = 0; j < k; ++j) {
          EXPECT_EQ(ids[i * k + j], order[j]);
          double want = p[order[j]] / sum / (renorm ? ksum : 1.0);
          EXPECT_NEAR(w[i * k + j], want, 1e-6);
        }
      }
    }
  }
}

TEST(CpuOps, MoeMatchesPerTokenReference) {
  const int t = 9, h = 24, inter = 12, e = 6, k = 2;
  std::vector<std::vector<float>> gu(e), dn(e);
  std::vector<const float*> gup(e), dnp(e);
  for (int i = 0; i < e; ++i) {
    gu[i] = randn(2 * inter * h, 0.3f);
    dn[i] = randn(h * inter, 0.3f);
    gup[i] = gu[i].data();
    dnp[i] = dn[i].data();
  }
  auto x = randn(t * h);
  // Skewed routing: expert 0 gets every token; expert 5 gets none.
  std::vector<int32_t> ids(t * k);
  std::vector<float> w(t * k);
  std::uniform_int_distribution<int> pick(1, 4);
  for (int i = 0; i < t; ++i) {
    ids[i * k] = 0;
    ids[i * k + 1] = pick(g_rng);
    w[i * k] = 0.7f;
    w[i * k + 1] = 0.3f;
  }
  for (int begin : {0, 3}) {  // all experts local, or an EP shard [3, 6)
    int local = begin == 0 ? e : 3;
    auto out = poisoned(t * h);
    moe({x.data(), ids.data(), w.data(), gup.data() + begin, dnp.data() + begin, out.data(), t, h,
         inter, k, begin, local});
    std::vector<double> ref(t * h, 0);
    for (int i = 0; i < t; ++i)
      for (int j = 0; j < k; ++j) {
        int ex = ids[i * k + j];
        if (ex < begin || ex >= begin + local) continue;
        std::vector<double> act(inter);
        for (int a = 0; a < inter; ++a) {
          double g = 0, u = 0;
          for (int b = 0; b < h; ++b) {
            g += double(gu[ex][a * h + b]) * x[i * h + b];
            u += double(gu[ex][(inter + a) * h + b]) * x[i * h + b];
          }
          act[a] = g / (1 + std::exp(-g)) * u;
        }
        for (int b = 0; b < h; ++b) {
          double y = 0;
          for (int a = 0; a < inter; ++a) y += double(dn[ex][b * inter + a]) * act[a];
          ref[i * h + b] += w[i * k + j] * y;
        }
      }
    EXPECT_LT(rel_err(out, ref), 1e-5) << "expert_begin " << begin;
  }
}

TEST(CpuOps, EmbeddingRejectsOutOfRangeIds) {
  std::vector<float> table = randn(10 * 4), out = poisoned(2 * 4);
  std::vector<int32_t> ids = {3, 9};
  embedding({ids.data(), table.data(), out.data(), 2, 4, 10});
  for (int j = 0; j < 4; ++j) EXPECT_EQ(out[4 + j], table[9 * 4 + j]);
  ids[1] = 10;
  EXPECT_ANY_THROW(embedding({ids.data(), table.data(), out.data(), 2, 4, 10}));
}

}  // namespace
}  // namespace tandem::cpu
