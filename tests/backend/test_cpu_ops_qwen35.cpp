// The Qwen3.5 CPU ops (partial RoPE, causal conv1d, DeltaNet gates, gated delta rule, gated
// RMSNorm, sigmoid gate) against double-precision references written from the formulas, on
// random inputs with outputs poisoned (NaN) first; chunked calls against one call.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/ops.h"

namespace tandem::cpu {
namespace {

std::mt19937 g_rng(4242);

std::vector<float> randn(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g_rng);
  return v;
}
std::vector<float> poisoned(size_t n) { return std::vector<float>(n, NAN); }

double max_abs_err(const std::vector<float>& out, const std::vector<double>& ref) {
  double m = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    m = std::max(m, std::fabs(out[i] - ref[i]));
  }
  return m;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }

TEST(CpuOpsQwen35, PartialRopeRotatesOnlyTheLeadingDims) {
  const int64_t n = 5, qh = 3, kvh = 1, d = 16, rot = 4;
  const double theta = 1e4;
  auto q = randn(n * qh * d), k = randn(n * kvh * d), wq = randn(d), wk = randn(d);
  std::vector<int32_t> pos = {0, 1, 7, 100, 3000};
  auto q0 = q, k0 = k;
  qk_norm_rope(
      {q.data(), k.data(), wq.data(), wk.data(), pos.data(), n, qh, kvh, d, 1e-6f, theta, rot});
  auto ref = [&](const std::vector<float>& in, const std::vector<float>& w, int64_t heads) {
    std::vector<double> out(in.size());
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t hh = 0; hh < heads; ++hh) {
        const float* x = in.data() + (t * heads + hh) * d;
        double ss = 0;
        for (int64_t i = 0; i < d; ++i) ss += double(x[i]) * x[i];
        const double inv = 1.0 / std::sqrt(ss / d + 1e-6);
        std::vector<double> y(d);
        for (int64_t i = 0; i < d; ++i) y[i] = x[i] * inv * w[i];
        double* o = out.data() + (t * heads + hh) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = y[i];
        for (int64_t i = 0; i < rot / 2; ++i) {
          const double f = pos[t] * std::pow(theta, -2.0 * i / rot);
          o[i] = y[i] * std::cos(f) - y[i + rot / 2] * std::sin(f);
          o[i + rot / 2] = y[i + rot / 2] * std::cos(f) + y[i] * std::sin(f);
        }
      }
    }
    return out;
  };
  EXPECT_LT(max_abs_err(q, ref(q0, wq, qh)), 2e-3);  // fp32 angles at position 3000
  EXPECT_LT(max_abs_err(k, ref(k0, wk, kvh)), 2e-3);
  // The pass-through dims are exactly the normed input (position 0 rotates nothing).
  auto qn = q0, kn = k0;
  std::vector<int32_t> zeros(n, 0);
  qk_norm_rope(
      {qn.data(), kn.data(), wq.data(), wk.data(), zeros.data(), n, qh, kvh, d, 1e-6f, theta, rot});
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = rot; i < d; ++i) EXPECT_EQ(q[t * qh * d + i], qn[t * qh * d + i]) << i;
  }
  // rotary_dim 0 means the whole head (the Qwen3 behaviour).
  auto qa = q0, ka = k0, qb = q0, kb = k0;
  qk_norm_rope(
      {qa.data(), ka.data(), wq.data(), wk.data(), pos.data(), n, qh, kvh, d, 1e-6f, theta});
  qk_norm_rope(
      {qb.data(), kb.data(), wq.data(), wk.data(), pos.data(), n, qh, kvh, d, 1e-6f, theta, d});
  EXPECT_EQ(qa, qb);
  EXPECT_EQ(ka, kb);
}

TEST(CpuOpsQwen35, CausalConv1dMatchesReferenceAndChunksEqualOneCall) {
  const int64_t n = 11, ch = 37, kw = 4;
  auto x = randn(n * ch), w = randn(ch * kw);
  // Reference: zero history, out[t, c] = silu(sum_j w[c, j] x[t + j - (kw - 1), c]).
  std::vector<double> ref(n * ch);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < ch; ++c) {
      double acc = 0;
      for (int64_t j = 0; j < kw; ++j) {
        const int64_t s = t + j - (kw - 1);
        if (s >= 0) acc += double(w[c * kw + j]) * x[s * ch + c];
      }
      ref[t * ch + c] = silu(acc);
    }
  }
  std::vector<float> state(ch * (kw - 1), 0.f), out = poisoned(n * ch);
  causal_conv1d({x.data(), w.data(), state.data(), out.data(), n, ch, kw});
  EXPECT_LT(max_abs_err(out, ref), 1e-5);
  // The state holds the last kw - 1 inputs per channel.
  for (int64_t c = 0; c < ch; ++c) {
    for (int64_t j = 0; j < kw - 1; ++j) {
      EXPECT_EQ(state[c * (kw - 1) + j], x[(n - (kw - 1) + j) * ch + c]);
    }
  }
  // Chunks of 1, 2 (shorter than the window), 1 (decode steps) and the rest, bit-identical.
  std::vector<float> st2(ch * (kw - 1), 0.f), out2 = poisoned(n * ch);
  int64_t t0 = 0;
  for (int64_t len : {1, 2, 1, 7}) {
    causal_conv1d({x.data() + t0 * ch, w.data(), st2.data(), out2.data() + t0 * ch, len, ch, kw});
    t0 += len;
  }
  ASSERT_EQ(t0, n);
  EXPECT_EQ(out2, out);
  EXPECT_EQ(st2, state);
  // Without SiLU.
  std::vector<float> st3(ch * (kw - 1), 0.f), out3 = poisoned(n * ch);
  causal_conv1d({x.data(), w.data(), st3.data(), out3.data(), n, ch, kw, /*silu=*/false});
  EXPECT_NEAR(out3[5 * ch + 3] / (1.0 + std::exp(-out3[5 * ch + 3])), out[5 * ch + 3], 1e-5);
}

TEST(CpuOpsQwen35, DeltaNetGates) {
  const int64_t rows = 6, heads = 4, stride = 10;
  auto ab = randn(rows * stride, 3.0f), a_log = randn(heads), dt = randn(heads);
  ab[2 * stride + 4 + 1] = 40.0f;  // softplus's linear region
  auto beta = poisoned(rows * heads), g = poisoned(rows * heads);
  deltanet_gates({ab.data(), ab.data() + 4, a_log.data(), dt.data(), beta.data(), g.data(), rows,
                  heads, stride});
  std::vector<double> rb(rows * heads), rg(rows * heads);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      rb[r * heads + h] = sigmoid(ab[r * stride + h]);
      const double xa = double(ab[r * stride + 4 + h]) + dt[h];
      rg[r * heads + h] = -std::exp(double(a_log[h])) * std::log1p(std::exp(xa));
    }
  }
  EXPECT_LT(max_abs_err(beta, rb), 1e-6);
  EXPECT_LT(max_abs_err(g, rg), 1e-4);
  for (float v : g) EXPECT_LE(v, 0.f);
}

// S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T;  o_t = S_t^T q_t, per value
// head, with q, k L2-normalised and q scaled by 1/sqrt(dk).
std::vector<double> delta_rule_reference(const std::vector<float>& q, const std::vector<float>& k,
                                         const std::vector<float>& v, const std::vector<float>& g,
                                         const std::vector<float>& beta, int64_t n, int64_t hk,
                                         int64_t hv, int64_t dk, int64_t dv,
                                         std::vector<double>& state) {
  std::vector<double> out(n * hv * dv);
  for (int64_t h = 0; h < hv; ++h) {
    const int64_t kh = h / (hv / hk);
    double* S = state.data() + h * dk * dv;
    for (int64_t t = 0; t < n; ++t) {
      std::vector<double> qt(dk), kt(dk);
      double qs = 0, ks = 0;
      for (int64_t i = 0; i < dk; ++i) {
        qt[i] = q[(t * hk + kh) * dk + i];
        kt[i] = k[(t * hk + kh) * dk + i];
        qs += qt[i] * qt[i];
        ks += kt[i] * kt[i];
      }
      for (int64_t i = 0; i < dk; ++i) {
        qt[i] /= std::sqrt(qs + 1e-6) * std::sqrt(double(dk));
        kt[i] /= std::sqrt(ks + 1e-6);
      }
      const double a = std::exp(double(g[t * hv + h])), b = beta[t * hv + h];
      // M = I - b k k^T;  S = a M S + b k v^T
      std::vector<double> next(dk * dv);
      for (int64_t i = 0; i < dk; ++i) {
        for (int64_t j = 0; j < dv; ++j) {
          double ms = 0;
          for (int64_t r = 0; r < dk; ++r) {
            const double m = (i == r ? 1.0 : 0.0) - b * kt[i] * kt[r];
            ms += m * S[r * dv + j];
          }
          next[i * dv + j] = a * ms + b * kt[i] * v[(t * hv + h) * dv + j];
        }
      }
      std::copy(next.begin(), next.end(), S);
      for (int64_t j = 0; j < dv; ++j) {
        double o = 0;
        for (int64_t i = 0; i < dk; ++i) o += S[i * dv + j] * qt[i];
        out[(t * hv + h) * dv + j] = o;
      }
    }
  }
  return out;
}

TEST(CpuOpsQwen35, GatedDeltaRuleMatchesMatrixFormAndChunksEqualOneCall) {
  const int64_t n = 9, hk = 2, hv = 4, dk = 8, dv = 6;
  auto q = randn(n * hk * dk), k = randn(n * hk * dk), v = randn(n * hv * dv);
  auto g = randn(n * hv, 0.5f), beta = randn(n * hv);
  for (auto& x : g) x = -std::fabs(x);
  for (auto& b : beta) b = static_cast<float>(sigmoid(b));
  auto s0 = randn(hv * dk * dv, 0.3f);  // a non-zero initial state (a continued sequence)

  std::vector<double> ref_state(s0.begin(), s0.end());
  auto ref = delta_rule_reference(q, k, v, g, beta, n, hk, hv, dk, dv, ref_state);
  auto state = s0;
  auto out = poisoned(n * hv * dv);
  gated_delta_rule({q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(), out.data(),
                    n, hk, hv, dk, dv});
  EXPECT_LT(max_abs_err(out, ref), 1e-5);
  EXPECT_LT(max_abs_err(state, ref_state), 1e-5);

  // Token by token (decode) and in two chunks: bit-identical to one call.
  auto st2 = s0;
  auto out2 = poisoned(n * hv * dv);
  int64_t t0 = 0;
  for (int64_t len : {1, 1, 4, 3}) {
    gated_delta_rule({q.data() + t0 * hk * dk, k.data() + t0 * hk * dk, v.data() + t0 * hv * dv,
                      g.data() + t0 * hv, beta.data() + t0 * hv, st2.data(),
                      out2.data() + t0 * hv * dv, len, hk, hv, dk, dv});
    t0 += len;
  }
  EXPECT_EQ(out2, out);
  EXPECT_EQ(st2, state);

  // Interleaved q | k | v rows (the conv output) through `stride`.
  const int64_t row = 2 * hk * dk + hv * dv;
  std::vector<float> packed(n * row);
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(q.data() + t * hk * dk, hk * dk, packed.data() + t * row);
    std::copy_n(k.data() + t * hk * dk, hk * dk, packed.data() + t * row + hk * dk);
    std::copy_n(v.data() + t * hv * dv, hv * dv, packed.data() + t * row + 2 * hk * dk);
  }
  auto st3 = s0;
  auto out3 = poisoned(n * hv * dv);
  gated_delta_rule({packed.data(), packed.data() + hk * dk, packed.data() + 2 * hk * dk, g.data(),
                    beta.data(), st3.data(), out3.data(), n, hk, hv, dk, dv, row});
  EXPECT_EQ(out3, out);
}

TEST(CpuOpsQwen35, ChunkedGatedDeltaRuleEqualsRecurrent) {
  for (auto [n, chunk] : {std::pair<int64_t, int64_t>{50, 16}, {7, 64}, {33, 1}, {64, 64}}) {
    SCOPED_TRACE(std::to_string(n) + " tokens, chunks of " + std::to_string(chunk));
    const int64_t hk = 2, hv = 4, dk = 16, dv = 8;
    auto q = randn(n * hk * dk), k = randn(n * hk * dk), v = randn(n * hv * dv);
    auto g = randn(n * hv, 0.3f), beta = randn(n * hv);
    for (auto& x : g) x = -std::fabs(x);
    for (auto& b : beta) b = static_cast<float>(sigmoid(b));
    auto s0 = randn(hv * dk * dv, 0.3f);
    auto st_rec = s0, st_chk = s0;
    auto out_rec = poisoned(n * hv * dv), out_chk = poisoned(n * hv * dv);
    gated_delta_rule({q.data(), k.data(), v.data(), g.data(), beta.data(), st_rec.data(),
                      out_rec.data(), n, hk, hv, dk, dv});
    gated_delta_rule_chunked({q.data(), k.data(), v.data(), g.data(), beta.data(), st_chk.data(),
                              out_chk.data(), n, hk, hv, dk, dv},
                             chunk);
    EXPECT_LT(max_abs_err(out_chk, std::vector<double>(out_rec.begin(), out_rec.end())), 1e-4);
    EXPECT_LT(max_abs_err(st_chk, std::vector<double>(st_rec.begin(), st_rec.end())), 1e-4);
  }
}

TEST(CpuOpsQwen35, GatedRmsNorm) {
  const int64_t rows = 5, dim = 24;
  auto x = randn(rows * dim), z = randn(rows * dim), w = randn(dim);
  auto out = poisoned(rows * dim);
  gated_rms_norm({x.data(), z.data(), w.data(), out.data(), rows, dim, 1e-6f});
  std::vector<double> ref(rows * dim);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
    const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
    for (int64_t i = 0; i < dim; ++i) {
      ref[r * dim + i] = w[i] * x[r * dim + i] * inv * silu(z[r * dim + i]);
    }
  }
  EXPECT_LT(max_abs_err(out, ref), 1e-5);
  auto inplace = x;  // out may alias x
  gated_rms_norm({inplace.data(), z.data(), w.data(), inplace.data(), rows, dim, 1e-6f});
  EXPECT_EQ(inplace, out);
}

TEST(CpuOpsQwen35, SigmoidGatePerElementAndPerRow) {
  const int64_t rows = 4, dim = 10;
  auto x = randn(rows * dim), gate = randn(rows * dim), row_gate = randn(rows * 3);
  auto out = poisoned(rows * dim);
  sigmoid_gate({x.data(), gate.data(), out.data(), rows, dim, dim});
  std::vector<double> ref(rows * dim);
  for (int64_t i = 0; i < rows * dim; ++i) ref[i] = x[i] * sigmoid(gate[i]);
  EXPECT_LT(max_abs_err(out, ref), 1e-6);
  // Per row (the shared expert's gate: column 0 of a [rows, 3] tensor), accumulated.
  auto acc = randn(rows * dim);
  auto base = acc;
  sigmoid_gate({x.data(), row_gate.data(), acc.data(), rows, dim, 3, /*per_row=*/true,
                /*accumulate=*/true});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < dim; ++i)
      ref[r * dim + i] = base[r * dim + i] + x[r * dim + i] * sigmoid(row_gate[r * 3]);
  }
  EXPECT_LT(max_abs_err(acc, ref), 1e-6);
}

}  // namespace
}  // namespace tandem::cpu
