#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace tandem {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// Per-thread scratch so a sampling step allocates nothing once warm.
struct Scratch {
  std::vector<float> x;         // [vocab] processed logits
  std::vector<float> w;         // [vocab] unnormalised probabilities exp(x - max)
  std::vector<int32_t> cand;    // [vocab] candidate token ids
  std::vector<float> cand_w;    // [vocab] candidate weights, parallel to cand
  std::vector<uint8_t> seen;    // [vocab] all zero between calls
  std::vector<int32_t> counts;  // [vocab] all zero between calls
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

/// 53 random bits -> a double in [0, 1). Spelled out (not uniform_real_distribution) so
/// draws are identical across standard libraries.
double uniform01(SamplerRng& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

/// Index of the largest value, ties -> lowest index; NaN never wins; 0 when all are -inf/NaN.
int32_t argmax(std::span<const float> x) {
  int32_t best = 0;
  float best_v = -kInf;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] > best_v) {
      best_v = x[i];
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

void check_vocab(size_t vocab) {
  TANDEM_CHECK_KIND(kInvalidArgument,
                    vocab > 0 && vocab <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                    "sampling: invalid vocabulary size ", vocab);
}

void check_ids(std::span<const int32_t> ids, size_t vocab, const char* what) {
  for (int32_t t : ids) {
    TANDEM_CHECK_KIND(kInvalidArgument, t >= 0 && static_cast<size_t>(t) < vocab, "sampling: ",
                      what, " token id ", t, " outside the vocabulary [0, ", vocab, ")");
  }
}

/// log(sum(exp(x))) in fp32 with the max subtracted; 8 partial sums in a fixed order.
float log_sum_exp(std::span<const float> x) {
  float m = -kInf;
  for (float v : x) m = v > m ? v : m;
  if (m == -kInf || m == kInf) return m;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= x.size(); i += 8) {
    for (size_t l = 0; l < 8; ++l) acc[l] += std::exp(x[i + l] - m);
  }
  for (size_t l = 0; i < x.size(); ++i, ++l) acc[l] += std::exp(x[i] - m);
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  return m + std::log(sum);
}

}  // namespace

void apply_penalties(std::span<float> logits, const SamplingParams& params,
                     std::span<const int32_t> prompt, std::span<const int32_t> output) {
  const size_t vocab = logits.size();
  const bool rep = params.repetition_penalty != 1.0f;
  const bool freq_pres = params.frequency_penalty != 0.0f || params.presence_penalty != 0.0f;
  if (!rep && !freq_pres) return;
  check_vocab(vocab);
  if (rep) check_ids(prompt, vocab, "prompt");
  check_ids(output, vocab, "output");

  Scratch& s = scratch();
  if (rep) {
    if (s.seen.size() < vocab) s.seen.resize(vocab, 0);
    const float r = params.repetition_penalty;
    auto penalise = [&](int32_t t) {
      if (s.seen[static_cast<size_t>(t)]) return;
      s.seen[static_cast<size_t>(t)] = 1;
      float& v = logits[static_cast<size_t>(t)];
      v = v > 0.0f ? v / r : v * r;
    };
    for (int32_t t : prompt) penalise(t);
    for (int32_t t : output) penalise(t);
    for (int32_t t : prompt) s.seen[static_cast<size_t>(t)] = 0;
    for (int32_t t : output) s.seen[static_cast<size_t>(t)] = 0;
  }
  if (freq_pres) {
    if (s.counts.size() < vocab) s.counts.resize(vocab, 0);
    for (int32_t t : output) ++s.counts[static_cast<size_t>(t)];
    for (int32_t t : output) {
      int32_t& c = s.counts[static_cast<size_t>(t)];
      if (c == 0) continue;  // already applied (a repeated token)
      float& v = logits[static_cast<size_t>(t)];
      v -= params.frequency_penalty * static_cast<float>(c);
      v -= params.presence_penalty;
      c = 0;
    }
  }
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& params,
                     std::span<const int32_t> prompt, std::span<const int32_t> output,
                     SamplerRng& rng) {
  const size_t vocab = logits.size();
  check_vocab(vocab);
  Scratch& s = scratch();
  std::vector<float>& x = s.x;
  x.assign(logits.begin(), logits.end());
  apply_penalties(x, params, prompt, output);
  if (params.greedy()) return argmax(x);

  // Temperature; NaN -> -inf so every comparison below is a strict weak order.
  const float temp = params.temperature;
  float m = -kInf;
  for (float& v : x) {
    v = std::isnan(v) ? -kInf : v / temp;
    m = v > m ? v : m;
  }
  if (m == -kInf) return argmax(x);  // everything masked: nothing to draw from
  // exp(x - max); a +inf logit takes all the mass (shared among the +inf ones).
  auto weight = [m](float v) { return m == kInf ? (v == kInf ? 1.0f : 0.0f) : std::exp(v - m); };
  // Descending logit, ties -> lower id.
  auto by_logit = [&x](int32_t a, int32_t b) {
    float xa = x[static_cast<size_t>(a)], xb = x[static_cast<size_t>(b)];
    return xa > xb || (xa == xb && a < b);
  };

  std::vector<int32_t>& cand = s.cand;
  std::vector<float>& cw = s.cand_w;
  cand.resize(vocab);
  cw.resize(vocab);
  std::iota(cand.begin(), cand.end(), 0);
  size_t n = vocab;  // candidates: cand[0, n), weights cw[0, n)
  const bool use_top_k = params.top_k > 0 && static_cast<size_t>(params.top_k) < vocab;
  const bool use_top_p = params.top_p < 1.0f;

  if (use_top_k) {
    // top-k: the k best, sorted, without sorting the whole vocabulary.
    n = static_cast<size_t>(params.top_k);
    std::partial_sort(cand.begin(), cand.begin() + static_cast<ptrdiff_t>(n), cand.end(),
                      by_logit);
    for (size_t j = 0; j < n; ++j) cw[j] = weight(x[static_cast<size_t>(cand[j])]);
    if (use_top_p) {
      // top-p over the renormalised top-k distribution: keep j while the mass before it
      // is below top_p (the smallest prefix reaching top_p; at least one token).
      double z = 0.0;
      for (size_t j = 0; j < n; ++j) z += cw[j];
      const double target = static_cast<double>(params.top_p) * z;
      double cum = 0.0;
      size_t keep = 0;
      while (keep < n && (keep == 0 || cum < target)) cum += cw[keep++];
      n = keep;
    }
  } else {
    std::vector<float>& w = s.w;
    w.resize(vocab);
    double z = 0.0;
    for (size_t i = 0; i < vocab; ++i) {
      w[i] = weight(x[i]);
      z += w[i];
    }
    if (use_top_p) {
      // Keep the K best tokens, K the smallest count whose mass reaches top_p (K >= 1).
      // Usually K is small: sort the best 64 first. Otherwise a weighted quickselect finds
      // K in expected O(vocab) without sorting: K stays in (lo, hi], mass(best lo) < target.
      const double target = static_cast<double>(params.top_p) * z;
      auto mass = [&](size_t from, size_t to) {
        double m_sum = 0.0;
        for (size_t j = from; j < to; ++j) m_sum += w[static_cast<size_t>(cand[j])];
        return m_sum;
      };
      const size_t head = std::min<size_t>(vocab, 64);
      std::partial_sort(cand.begin(), cand.begin() + static_cast<ptrdiff_t>(head), cand.end(),
                        by_logit);
      double cum = 0.0;
      size_t keep = 0;
      while (keep < head && (keep == 0 || cum < target)) {
        cum += w[static_cast<size_t>(cand[keep++])];
      }
      if (keep == head && cum < target && head < vocab) {
        size_t lo = head, hi = vocab;
        while (hi - lo > 64) {
          const size_t mid = lo + (hi - lo) / 2;
          std::nth_element(cand.begin() + static_cast<ptrdiff_t>(lo),
                           cand.begin() + static_cast<ptrdiff_t>(mid),
                           cand.begin() + static_cast<ptrdiff_t>(hi), by_logit);
          const double m_lo_mid = mass(lo, mid);
          if (cum + m_lo_mid < target) {
            cum += m_lo_mid;
            lo = mid;
          } else {
            hi = mid;
          }
        }
        std::sort(cand.begin() + static_cast<ptrdiff_t>(lo),
                  cand.begin() + static_cast<ptrdiff_t>(hi), by_logit);
        keep = lo;
        while (keep < hi && cum < target) cum += w[static_cast<size_t>(cand[keep++])];
        // NOTE: nth_element leaves cand[0, keep) in a library-specific order; rebuild the
        // kept set in id order so a seed gives the same token with any standard library.
        const int32_t worst = cand[keep - 1];
        n = 0;
        for (size_t i = 0; i < vocab; ++i) {
          const auto id = static_cast<int32_t>(i);
          if (!by_logit(worst, id)) {  // id ranks at or before the worst kept token
            cand[n] = id;
            cw[n] = w[i];
            ++n;
          }
        }
      } else {
        n = keep;
        for (size_t j = 0; j < n; ++j) cw[j] = w[static_cast<size_t>(cand[j])];
      }
    } else {
      std::copy(w.begin(), w.end(), cw.begin());  // cand is the identity
    }
  }

  // min-p: keep p >= min_p * p_max, i.e. weight >= min_p (the kept maximum has weight 1).
  if (params.min_p > 0.0f) {
    size_t out = 0;
    for (size_t j = 0; j < n; ++j) {
      if (cw[j] >= params.min_p) {
        cand[out] = cand[j];
        cw[out] = cw[j];
        ++out;
      }
    }
    n = out;
    if (n == 0) return argmax(x);  // unreachable unless min_p > 1
  }

  // One categorical draw over the kept candidates, in their order.
  double z = 0.0;
  for (size_t j = 0; j < n; ++j) z += cw[j];
  const double target = uniform01(rng) * z;
  double cum = 0.0;
  int32_t last_positive = cand[0];
  for (size_t j = 0; j < n; ++j) {
    if (cw[j] <= 0.0f) continue;
    cum += cw[j];
    last_positive = cand[j];
    if (target < cum) return cand[j];
  }
  return last_positive;  // rounding: target landed on the total
}

float token_logprob(std::span<const float> logits, int32_t token) {
  check_vocab(logits.size());
  TANDEM_CHECK_KIND(kInvalidArgument, token >= 0 && static_cast<size_t>(token) < logits.size(),
                    "token_logprob: token id ", token, " outside the vocabulary [0, ",
                    logits.size(), ")");
  return logits[static_cast<size_t>(token)] - log_sum_exp(logits);
}

std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, int32_t n) {
  if (n <= 0) return {};
  check_vocab(logits.size());
  const float lse = log_sum_exp(logits);
  const size_t k = std::min(static_cast<size_t>(n), logits.size());
  auto lp = [&](int32_t id) {
    float v = logits[static_cast<size_t>(id)] - lse;
    return std::isnan(v) ? -kInf : v;
  };
  std::vector<int32_t>& ids = scratch().cand;
  ids.resize(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(k), ids.end(),
                    [&](int32_t a, int32_t b) {
                      float la = lp(a), lb = lp(b);
                      return la > lb || (la == lb && a < b);
                    });
  std::vector<TokenLogprob> out(k);
  for (size_t j = 0; j < k; ++j) out[j] = {ids[j], logits[static_cast<size_t>(ids[j])] - lse};
  return out;
}

}  // namespace tandem
