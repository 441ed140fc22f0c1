#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/error.h"
#include "engine/sampling.h"

namespace tandem {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- Straightforward references -------------------------------------------------------------

/// vLLM's penalties written the obvious way: a mask and a count per vocabulary entry.
std::vector<float> ref_penalties(std::vector<float> x, const SamplingParams& p,
                                 const std::vector<int32_t>& prompt,
                                 const std::vector<int32_t>& output) {
  std::vector<int> count(x.size(), 0);
  std::vector<bool> seen(x.size(), false);
  for (int32_t t : prompt) seen[static_cast<size_t>(t)] = true;
  for (int32_t t : output) {
    seen[static_cast<size_t>(t)] = true;
    ++count[static_cast<size_t>(t)];
  }
  for (size_t v = 0; v < x.size(); ++v) {
    if (seen[v]) x[v] = x[v] > 0 ? x[v] / p.repetition_penalty : x[v] * p.repetition_penalty;
    if (count[v] > 0) {
      x[v] -= p.frequency_penalty * static_cast<float>(count[v]);
      x[v] -= p.presence_penalty;
    }
  }
  for (const LogitBias& b : p.logit_bias) x[static_cast<size_t>(b.id)] += b.bias;
  return x;
}

/// The distribution sample_token draws from, in double with a full sort:
/// penalties, temperature, top-k, top-p (on the top-k renormalised probs), min-p.
std::vector<double> ref_probs(const std::vector<float>& logits, const SamplingParams& p,
                              const std::vector<int32_t>& prompt = {},
                              const std::vector<int32_t>& output = {}) {
  std::vector<float> xf = ref_penalties(logits, p, prompt, output);
  const size_t n = xf.size();
  std::vector<double> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<double>(xf[i] / p.temperature);
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return x[a] > x[b]; });
  std::vector<bool> keep(n, true);
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < n) {
    for (size_t r = static_cast<size_t>(p.top_k); r < n; ++r) keep[order[r]] = false;
  }
  auto probs = [&] {
    double m = x[order[0]];
    std::vector<double> q(n, 0.0);
    double z = 0;
    for (size_t i = 0; i < n; ++i) {
      if (keep[i]) z += q[i] = std::exp(x[i] - m);
    }
    for (double& v : q) v /= z;
    return q;
  };
  if (p.top_p < 1.0f) {
    std::vector<double> q = probs();
    double cum = 0;
    for (size_t r = 0; r < n; ++r) {
      size_t i = order[r];
      if (!keep[i]) continue;
      if (r > 0 && cum >= p.top_p) keep[i] = false;
      cum += q[i];
    }
  }
  if (p.min_p > 0.0f) {
    std::vector<double> q = probs();
    double qmax = q[order[0]];
    for (size_t i = 0; i < n; ++i) {
      if (q[i] < p.min_p * qmax) keep[i] = false;
    }
  }
  return probs();
}

/// Pearson's chi-square of observed counts against expected probabilities; cells with
/// probability 0 must be empty.
double chi_square(const std::vector<int>& counts, const std::vector<double>& probs, int draws,
                  int* dof) {
  double chi2 = 0;
  *dof = -1;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probs[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "excluded token " << i << " was sampled";
      continue;
    }
    double e = probs[i] * draws;
    chi2 += (counts[i] - e) * (counts[i] - e) / e;
    ++*dof;
  }
  return chi2;
}

/// A bound that a correct sampler exceeds with probability below about 1e-6 (Wilson-Hilferty
/// approximation of the chi-square quantile, z = 4.75).
double chi_square_bound(int dof) {
  double k = std::max(dof, 1);
  double z = 4.75;
  double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

std::vector<int> histogram(const std::vector<float>& logits, const SamplingParams& p, int draws,
                           uint64_t seed, const std::vector<int32_t>& prompt = {},
                           const std::vector<int32_t>& output = {}) {
  SamplerRng rng(seed);
  std::vector<int> counts(logits.size(), 0);
  for (int d = 0; d < draws; ++d) {
    int32_t t = sample_token(logits, p, prompt, output, rng);
    EXPECT_GE(t, 0);
    EXPECT_LT(static_cast<size_t>(t), logits.size());
    ++counts[static_cast<size_t>(t)];
  }
  return counts;
}

void expect_matches_distribution(const std::vector<float>& logits, const SamplingParams& p,
                                 uint64_t seed, const std::vector<int32_t>& prompt = {},
                                 const std::vector<int32_t>& output = {}, int draws = 60000) {
  std::vector<double> probs = ref_probs(logits, p, prompt, output);
  std::vector<int> counts = histogram(logits, p, draws, seed, prompt, output);
  int dof = 0;
  double chi2 = chi_square(counts, probs, draws, &dof);
  EXPECT_LT(chi2, chi_square_bound(dof)) << "dof " << dof;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] > 0) {
      EXPECT_GT(counts[i], 0) << "allowed token " << i << " never sampled";
    }
  }
}

/// Logits log(p) for the given probabilities.
std::vector<float> log_of(const std::vector<double>& probs) {
  std::vector<float> x;
  for (double q : probs) x.push_back(static_cast<float>(std::log(q)));
  return x;
}

std::set<int32_t> sampled_set(const std::vector<float>& logits, const SamplingParams& p, int draws,
                              uint64_t seed) {
  std::vector<int> counts = histogram(logits, p, draws, seed);
  std::set<int32_t> out;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] > 0) out.insert(static_cast<int32_t>(i));
  }
  return out;
}

const std::vector<float> kLogits = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, -1.0f, 1.5f, 0.2f, -2.0f, 0.9f};

// ---- Greedy --------------------------------------------------------------------------------

TEST(Sampling, GreedyPicksArgmaxAndConsumesNoRandomness) {
  SamplingParams p;
  p.temperature = 0.0f;
  SamplerRng rng(123);
  const SamplerRng before = rng;
  EXPECT_EQ(sample_token(kLogits, p, {}, {}, rng), 3);
  EXPECT_EQ(rng, before);
  p.temperature = 1e-7f;  // below vLLM's 1e-5 threshold: greedy too
  EXPECT_EQ(sample_token(kLogits, p, {}, {}, rng), 3);
  EXPECT_EQ(rng, before);
  p.temperature = 0.0f;
  std::vector<float> ties = {0.5f, 2.0f, -1.0f, 2.0f, 2.0f};
  EXPECT_EQ(sample_token(ties, p, {}, {}, rng), 1);  // lowest id among equal maxima
  std::vector<float> masked = {-kInf, NAN, -3.0f, -kInf};
  EXPECT_EQ(sample_token(masked, p, {}, {}, rng), 2);
  // top-k/top-p/min-p never remove the argmax: greedy ignores them.
  p.top_k = 2;
  p.top_p = 0.1f;
  p.min_p = 0.5f;
  EXPECT_EQ(sample_token(kLogits, p, {}, {}, rng), 3);
  EXPECT_EQ(rng, before);
}

TEST(Sampling, GreedySeesPenalties) {
  SamplingParams p;
  p.temperature = 0.0f;
  SamplerRng rng(1);
  std::vector<float> x = {2.0f, 1.9f, 0.0f};
  std::vector<int32_t> out = {0};
  EXPECT_EQ(sample_token(x, p, {}, out, rng), 0);
  p.presence_penalty = 0.5f;
  EXPECT_EQ(sample_token(x, p, {}, out, rng), 1);
  p.presence_penalty = 0.0f;
  p.repetition_penalty = 1.2f;  // 2.0 / 1.2 < 1.9
  EXPECT_EQ(sample_token(x, p, out, {}, rng), 1);
}

TEST(Sampling, GreedySeesLogitBias) {
  SamplingParams p;
  p.temperature = 0.0f;
  SamplerRng rng(1);
  std::vector<float> x = {2.0f, 1.9f, 0.0f};
  p.logit_bias = {{2, 100.0f}};
  EXPECT_EQ(sample_token(x, p, {}, {}, rng), 2);
  p.logit_bias = {{0, -100.0f}};
  EXPECT_EQ(sample_token(x, p, {}, {}, rng), 1);
  p.logit_bias = {{0, -0.1f}, {1, 0.1f}};  // 1.9 < 2.0
  EXPECT_EQ(sample_token(x, p, {}, {}, rng), 1);
  EXPECT_EQ(x[0], 2.0f);  // the input logits are not modified
  p.logit_bias = {{3, 1.0f}};
  EXPECT_THROW(sample_token(x, p, {}, {}, rng), Error);
  p.logit_bias = {{-1, 1.0f}};
  EXPECT_THROW(sample_token(x, p, {}, {}, rng), Error);
}

TEST(Sampling, ToDeviceSamplingOnlyWithoutHostWork) {
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 5;
  p.top_p = 0.9f;
  p.min_p = 0.1f;
  p.logprobs = 3;
  std::optional<DeviceSampling> d = to_device_sampling(p, 42, 7);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->temperature, 0.7f);
  EXPECT_EQ(d->top_k, 5);
  EXPECT_EQ(d->top_p, 0.9f);
  EXPECT_EQ(d->min_p, 0.1f);
  EXPECT_EQ(d->seed, 42u);
  EXPECT_EQ(d->counter, 7u);
  EXPECT_EQ(d->logprobs, 3);
  p.temperature = 1e-6f;
  EXPECT_EQ(to_device_sampling(p, 0, 0)->temperature, 0.0f);  // greedy
  SamplingParams q = p;
  q.logit_bias = {{1, 2.0f}};
  EXPECT_FALSE(to_device_sampling(q, 0, 0));  // biases with logprobs (of the raw logits)
  q.logprobs = -1;
  std::optional<DeviceSampling> b = to_device_sampling(q, 0, 0);
  ASSERT_TRUE(b);  // biases alone: applied on the device
  ASSERT_EQ(b->bias.size(), 1u);
  EXPECT_EQ(b->bias[0].first, 1);
  EXPECT_EQ(b->bias[0].second, 2.0f);
  EXPECT_EQ(b->mask, nullptr);
  q.logit_bias = {{1, 2.0f}, {4, -1.0f}, {1, 3.0f}};
  EXPECT_FALSE(to_device_sampling(q, 0, 0));  // a repeated id: added in order on the host
  q = p;
  q.presence_penalty = 0.1f;
  EXPECT_FALSE(to_device_sampling(q, 0, 0));
  q = p;
  q.logprobs = 21;
  EXPECT_FALSE(to_device_sampling(q, 0, 0));
}

// ---- Seeding -------------------------------------------------------------------------------

TEST(Sampling, SeededDrawsAreReproducible) {
  std::vector<float> x(1000);
  std::mt19937 gen(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& v : x) v = nd(gen);
  SamplingParams p;
  p.temperature = 1.0f;
  auto draw = [&](uint64_t seed) {
    SamplerRng rng(seed);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(sample_token(x, p, {}, out, rng));
    return out;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
  // One 64-bit draw per sampled token: the stream position is predictable.
  SamplerRng a(9), b(9);
  sample_token(x, p, {}, {}, a);
  b.discard(1);
  EXPECT_EQ(a, b);
}

// ---- Distribution --------------------------------------------------------------------------

TEST(Sampling, TemperatureMatchesSoftmax) {
  SamplingParams p;
  for (float t : {1.0f, 0.7f, 1.8f}) {
    SCOPED_TRACE(t);
    p.temperature = t;
    expect_matches_distribution(kLogits, p, 1000 + static_cast<uint64_t>(t * 10));
  }
}

TEST(Sampling, ChiSquareDetectsAWrongDistribution) {
  // The test above can fail: samples at temperature 0.7 do not pass for temperature 1.
  SamplingParams drawn, claimed;
  drawn.temperature = 0.7f;
  const int draws = 60000;
  std::vector<int> counts = histogram(kLogits, drawn, draws, 77);
  int dof = 0;
  double chi2 = chi_square(counts, ref_probs(kLogits, claimed), draws, &dof);
  EXPECT_GT(chi2, chi_square_bound(dof));
}

TEST(Sampling, FiltersMatchReferenceDistribution) {
  struct Case {
    const char* what;
    int32_t top_k;
    float top_p;
    float min_p;
    float temperature;
  };
  for (const Case& c :
       {Case{"top_k", 4, 1.0f, 0.0f, 1.0f}, Case{"top_p", 0, 0.8f, 0.0f, 1.0f},
        Case{"min_p", 0, 1.0f, 0.2f, 1.0f}, Case{"top_k+top_p", 6, 0.75f, 0.0f, 0.8f},
        Case{"all three", 7, 0.9f, 0.15f, 1.3f}}) {
    SCOPED_TRACE(c.what);
    SamplingParams p;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.min_p = c.min_p;
    p.temperature = c.temperature;
    expect_matches_distribution(kLogits, p, 4242);
  }
}

TEST(Sampling, PenalisedSamplingMatchesReference) {
  SamplingParams p;
  p.repetition_penalty = 1.4f;
  p.presence_penalty = 0.3f;
  p.frequency_penalty = 0.2f;
  p.top_k = 8;
  expect_matches_distribution(kLogits, p, 99, /*prompt=*/{3, 6, 6}, /*output=*/{0, 3, 3, 9});
}

TEST(Sampling, BiasedSamplingMatchesReference) {
  SamplingParams p;
  p.logit_bias = {{1, 2.5f}, {5, -100.0f}, {9, 1.0f}, {0, -0.5f}};
  p.top_k = 7;
  p.presence_penalty = 0.25f;
  expect_matches_distribution(kLogits, p, 314, /*prompt=*/{}, /*output=*/{1, 2});
}

TEST(Sampling, TopKExactSet) {
  SamplingParams p;
  p.top_k = 3;
  EXPECT_EQ(sampled_set(kLogits, p, 5000, 1), (std::set<int32_t>{0, 3, 6}));
  p.top_k = 1;
  EXPECT_EQ(sampled_set(kLogits, p, 200, 1), (std::set<int32_t>{3}));
  p.top_k = 100;  // larger than the vocabulary: no filter
  EXPECT_EQ(sampled_set(kLogits, p, 20000, 1).size(), kLogits.size());
  // Ties at the cut go to the lower ids.
  std::vector<float> flat = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  p.top_k = 2;
  EXPECT_EQ(sampled_set(flat, p, 2000, 2), (std::set<int32_t>{0, 1}));
}

TEST(Sampling, TopPExactSet) {
  // Sorted probabilities 0.4, 0.3, 0.2, 0.1 on ids 2, 0, 3, 1.
  std::vector<float> x = log_of({0.3, 0.1, 0.4, 0.2});
  SamplingParams p;
  p.top_p = 0.65f;  // 0.4 < 0.65 -> take the 0.3; 0.7 >= 0.65 -> stop
  EXPECT_EQ(sampled_set(x, p, 5000, 3), (std::set<int32_t>{0, 2}));
  p.top_p = 0.75f;
  EXPECT_EQ(sampled_set(x, p, 5000, 3), (std::set<int32_t>{0, 2, 3}));
  p.top_p = 0.35f;
  EXPECT_EQ(sampled_set(x, p, 2000, 3), (std::set<int32_t>{2}));
  p.top_p = 0.0f;  // always at least one token
  EXPECT_EQ(sampled_set(x, p, 200, 3), (std::set<int32_t>{2}));
  p.top_p = 0.95f;
  EXPECT_EQ(sampled_set(x, p, 5000, 3), (std::set<int32_t>{0, 1, 2, 3}));
  // top-p after top-k uses the renormalised top-k distribution: top-2 gives 4/7, 3/7.
  p.top_k = 2;
  p.top_p = 0.55f;
  EXPECT_EQ(sampled_set(x, p, 2000, 3), (std::set<int32_t>{2}));
  p.top_p = 0.6f;
  EXPECT_EQ(sampled_set(x, p, 5000, 3), (std::set<int32_t>{0, 2}));
}

TEST(Sampling, MinPExactSet) {
  std::vector<float> x = log_of({0.3, 0.1, 0.4, 0.2});
  SamplingParams p;
  p.min_p = 0.6f;  // threshold 0.24
  EXPECT_EQ(sampled_set(x, p, 5000, 4), (std::set<int32_t>{0, 2}));
  p.min_p = 0.3f;  // threshold 0.12
  EXPECT_EQ(sampled_set(x, p, 5000, 4), (std::set<int32_t>{0, 2, 3}));
  p.min_p = 1.0f;
  EXPECT_EQ(sampled_set(x, p, 200, 4), (std::set<int32_t>{2}));
  // min-p is relative to the max, so it is unchanged by temperature-free renormalisation
  // after top-k, but temperature moves it: at t=2 the ratios are sqrt'ed.
  p.min_p = 0.6f;
  p.temperature = 2.0f;  // ratios sqrt(3/4)=.87, sqrt(1/2)=.71, sqrt(1/4)=.5
  EXPECT_EQ(sampled_set(x, p, 5000, 4), (std::set<int32_t>{0, 2, 3}));
}

TEST(Sampling, MaskedTokensNeverSampled) {
  std::vector<float> x = {0.0f, -kInf, 1.0f, NAN, 0.5f};
  SamplingParams p;
  EXPECT_EQ(sampled_set(x, p, 5000, 6), (std::set<int32_t>{0, 2, 4}));
  p.top_p = 0.999f;
  EXPECT_EQ(sampled_set(x, p, 5000, 6), (std::set<int32_t>{0, 2, 4}));
  std::vector<float> inf = {0.0f, kInf, 3.0f, kInf};
  p = {};
  EXPECT_EQ(sampled_set(inf, p, 2000, 6), (std::set<int32_t>{1, 3}));
}

TEST(Sampling, WideTopP) {
  // More than 64 tokens in the nucleus: the bucket + quickselect search. 500 equal tokens
  // (the even ids) of mass 1/500 each: top_p 0.501 keeps exactly the 251 lowest even ids.
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = i % 2 == 0 ? 0.0f : -50.0f;
  SamplingParams p;
  p.top_p = 0.501f;
  std::set<int32_t> want;
  for (int32_t i = 0; i <= 500; i += 2) want.insert(i);
  EXPECT_EQ(sampled_set(x, p, 8000, 8), want);

  // Distinct logits: the whole distribution matches the reference (blocks of 16 in the draw).
  std::mt19937 gen(17);
  std::uniform_real_distribution<float> u(-3.0f, 0.0f);
  std::vector<float> y(400);
  for (float& v : y) v = u(gen);
  for (float top_p : {0.7f, 0.97f}) {
    SCOPED_TRACE(top_p);
    p.top_p = top_p;
    expect_matches_distribution(y, p, 18, {}, {}, 30000);
  }
  p.top_p = 1.0f;  // and with no filter at all
  expect_matches_distribution(y, p, 19, {}, {}, 30000);
}

TEST(Sampling, FullVocabulary) {
  // Qwen3 vocabulary size; a few strong tokens on a random tail.
  const size_t vocab = 151936;
  std::vector<float> x(vocab);
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> tail(-2.0f, 0.0f);
  for (float& v : x) v = tail(gen);
  x[100] = 12.0f;
  x[5000] = 11.5f;
  x[77777] = 11.0f;
  x[151935] = 10.5f;
  SamplingParams p;
  p.top_p = 0.5f;  // masses ~.39, ~.24, ...: keeps ids 100 and 5000
  EXPECT_EQ(sampled_set(x, p, 200, 12), (std::set<int32_t>{100, 5000}));
  p.top_p = 1.0f;
  p.top_k = 3;
  EXPECT_EQ(sampled_set(x, p, 300, 12), (std::set<int32_t>{100, 5000, 77777}));

  // A wide top-p set (grows the sorted prefix several times): every sample lies inside
  // the reference set (up to two ranks of float-vs-double slack at the boundary).
  p = {};
  p.top_p = 0.95f;
  std::vector<double> probs = ref_probs(x, p);
  std::vector<size_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return x[a] > x[b]; });
  std::vector<size_t> rank(vocab);
  for (size_t r = 0; r < vocab; ++r) rank[order[r]] = r;
  size_t cut = 0;
  while (cut < vocab && probs[order[cut]] > 0) ++cut;
  EXPECT_GT(cut, 1000u);
  EXPECT_LT(cut, vocab);
  SamplerRng rng(13);
  int tail_hits = 0;
  for (int d = 0; d < 150; ++d) {
    int32_t t = sample_token(x, p, {}, {}, rng);
    EXPECT_LT(rank[static_cast<size_t>(t)], cut + 2) << t;
    tail_hits += rank[static_cast<size_t>(t)] >= 4;
  }
  EXPECT_GT(tail_hits, 0);
}

// ---- Penalties -----------------------------------------------------------------------------

TEST(Sampling, PenaltiesMatchReference) {
  std::mt19937 gen(3);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> x(64);
  for (float& v : x) v = nd(gen);
  x[5] = 0.0f;
  std::vector<int32_t> prompt = {1, 5, 5, 7, 9, 9, 9, 63};
  std::vector<int32_t> output = {2, 7, 7, 7, 10, 1, 0, 0};
  struct Case {
    float rep, pres, freq;
  };
  for (const Case& c : {Case{1.3f, 0.0f, 0.0f}, Case{0.7f, 0.0f, 0.0f}, Case{1.0f, 0.8f, 0.0f},
                        Case{1.0f, 0.0f, 0.45f}, Case{1.0f, -1.5f, -0.3f}, Case{1.25f, 0.6f, 0.35f},
                        Case{1.0f, 0.0f, 0.0f}}) {
    SamplingParams p;
    p.repetition_penalty = c.rep;
    p.presence_penalty = c.pres;
    p.frequency_penalty = c.freq;
    std::vector<float> got = x;
    apply_penalties(got, p, prompt, output);
    std::vector<float> want = ref_penalties(x, p, prompt, output);
    for (size_t i = 0; i < x.size(); ++i) {
      EXPECT_EQ(got[i], want[i]) << "token " << i << " rep " << c.rep << " pres " << c.pres
                                 << " freq " << c.freq;
    }
  }
  // Spot values: presence/frequency only on output tokens, repetition on both.
  SamplingParams p;
  p.presence_penalty = 1.0f;
  p.frequency_penalty = 0.5f;
  std::vector<float> y = {1.0f, 1.0f, 1.0f, 1.0f};
  apply_penalties(y, p, std::vector<int32_t>{3}, std::vector<int32_t>{0, 0, 2});
  EXPECT_EQ(y, (std::vector<float>{1.0f - 1.0f - 1.0f, 1.0f, 1.0f - 0.5f - 1.0f, 1.0f}));
  p = {};
  p.repetition_penalty = 2.0f;
  y = {4.0f, -4.0f, 4.0f, 0.0f};
  apply_penalties(y, p, std::vector<int32_t>{0, 1}, std::vector<int32_t>{3, 3});
  EXPECT_EQ(y, (std::vector<float>{2.0f, -8.0f, 4.0f, 0.0f}));
}

TEST(Sampling, PenaltiesRejectOutOfRangeIds) {
  SamplingParams p;
  p.repetition_penalty = 1.1f;
  std::vector<float> y(4, 0.0f);
  EXPECT_THROW(apply_penalties(y, p, std::vector<int32_t>{4}, {}), Error);
  EXPECT_THROW(apply_penalties(y, p, {}, std::vector<int32_t>{-1}), Error);
  // The scratch state stays clean after an error: a later call is still exact.
  std::vector<float> z = {1.0f, 1.0f, 1.0f, 1.0f};
  apply_penalties(z, p, std::vector<int32_t>{1}, {});
  EXPECT_EQ(z, (std::vector<float>{1.0f, 1.0f / 1.1f, 1.0f, 1.0f}));
}

// ---- Logprobs ------------------------------------------------------------------------------

TEST(Sampling, LogprobsAreLogSoftmaxOfRawLogits) {
  double m = *std::max_element(kLogits.begin(), kLogits.end());
  double z = 0;
  for (float v : kLogits) z += std::exp(v - m);
  for (int32_t t = 0; t < static_cast<int32_t>(kLogits.size()); ++t) {
    double want = kLogits[static_cast<size_t>(t)] - m - std::log(z);
    EXPECT_NEAR(token_logprob(kLogits, t), want, 1e-6);
  }
  std::vector<TokenLogprob> all = top_logprobs(kLogits, 100);
  ASSERT_EQ(all.size(), kLogits.size());
  double sum = 0;
  for (size_t j = 0; j < all.size(); ++j) {
    sum += std::exp(static_cast<double>(all[j].logprob));
    EXPECT_EQ(all[j].logprob, token_logprob(kLogits, all[j].id));
    if (j > 0) {
      EXPECT_GE(all[j - 1].logprob, all[j].logprob);
    }
  }
  EXPECT_NEAR(sum, 1.0, 1e-6);
  std::vector<TokenLogprob> top3 = top_logprobs(kLogits, 3);
  ASSERT_EQ(top3.size(), 3u);
  EXPECT_EQ(top3[0].id, 3);
  EXPECT_EQ(top3[1].id, 6);
  EXPECT_EQ(top3[2].id, 0);
  EXPECT_TRUE(top_logprobs(kLogits, 0).empty());
  EXPECT_THROW(token_logprob(kLogits, 10), Error);
  EXPECT_THROW(token_logprob(kLogits, -1), Error);
}

TEST(Sampling, TopLogprobsTiesGoToLowerIds) {
  std::vector<float> x = {1.0f, 3.0f, 3.0f, 0.0f, 3.0f, 3.0f};
  std::vector<TokenLogprob> top = top_logprobs(x, 3);
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].id, 1);
  EXPECT_EQ(top[1].id, 2);
  EXPECT_EQ(top[2].id, 4);
  EXPECT_EQ(top[0].logprob, top[2].logprob);
  std::vector<float> masked = {-kInf, 0.0f, 0.0f};
  EXPECT_EQ(token_logprob(masked, 0), -kInf);
  EXPECT_NEAR(token_logprob(masked, 1), std::log(0.5), 1e-7);
}

TEST(Sampling, LogprobsFullVocabulary) {
  const size_t vocab = 151936;
  std::vector<float> x(vocab);
  std::mt19937 gen(21);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  for (float& v : x) v = nd(gen);
  x[777] = 30.0f;
  x[778] = 30.0f;
  double m = 30.0, z = 0;
  for (float v : x) z += std::exp(static_cast<double>(v) - m);
  const double lse = m + std::log(z);
  std::vector<TokenLogprob> top = top_logprobs(x, 20);
  ASSERT_EQ(top.size(), 20u);
  EXPECT_EQ(top[0].id, 777);
  EXPECT_EQ(top[1].id, 778);
  for (size_t j = 0; j < top.size(); ++j) {
    EXPECT_NEAR(top[j].logprob, x[static_cast<size_t>(top[j].id)] - lse, 1e-4);
    if (j > 0) {
      EXPECT_GE(top[j - 1].logprob, top[j].logprob);
    }
  }
  double sum = 0;
  for (size_t i = 0; i < vocab; i += 1) sum += std::exp(static_cast<double>(x[i]) - lse);
  EXPECT_NEAR(sum, 1.0, 1e-9);  // the reference itself
  std::vector<TokenLogprob> all = top_logprobs(x, static_cast<int32_t>(vocab));
  double got = 0;
  for (const TokenLogprob& t : all) got += std::exp(static_cast<double>(t.logprob));
  EXPECT_NEAR(got, 1.0, 1e-4);
  EXPECT_NEAR(token_logprob(x, 12345), x[12345] - lse, 1e-4);
}

}  // namespace
}  // namespace tandem
