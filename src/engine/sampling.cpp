#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace tandem {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

/// One token for the top-p search: logit, weight, id (contiguous for the quickselect).
struct Entry {
  float x;
  float w;
  int32_t id;
};

/// Per-thread scratch so a sampling step allocates nothing once warm.
struct Scratch {
  std::vector<float> x;         // [vocab] processed logits
  std::vector<float> w;         // [vocab] unnormalised probabilities exp(x - max)
  std::vector<int32_t> cand;    // [vocab] candidate token ids
  std::vector<float> cand_w;    // [vocab] candidate weights, parallel to cand
  std::vector<uint8_t> seen;    // [vocab] all zero between calls
  std::vector<int32_t> counts;  // [vocab] all zero between calls
  std::vector<Entry> entries;   // [<= vocab] wide top-p search
  std::vector<double> buckets;  // wide top-p search
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

/// exp(d) for d <= 0, flushing below -87 (where expf leaves the normal range and glibc
/// takes a slow path) to 0; such a token is 1e-38 times less likely than the best one.
inline float exp_nonpos(float d) { return d < -87.0f ? 0.0f : std::exp(d); }

/// The n best ids of [0, vocab) by (key desc, id asc), best first, into `out`. key(i) is a
/// float that is never NaN. A bounded heap scan: O(vocab) for small n, no full sort.
template <typename Key>
void select_top(size_t vocab, size_t n, Key key, std::vector<int32_t>& out) {
  n = std::min(n, vocab);
  auto before = [&](int32_t a, int32_t b) {
    const float ka = key(static_cast<size_t>(a)), kb = key(static_cast<size_t>(b));
    return ka > kb || (ka == kb && a < b);
  };
  out.resize(n);
  if (n == 0) return;
  if (n * 16 >= vocab) {  // a large share of the vocabulary: partial_sort is as good
    out.resize(vocab);
    std::iota(out.begin(), out.end(), 0);
    std::partial_sort(out.begin(), out.begin() + static_cast<ptrdiff_t>(n), out.end(), before);
    out.resize(n);
    return;
  }
  std::iota(out.begin(), out.end(), 0);
  std::make_heap(out.begin(), out.end(), before);  // front: the worst kept
  float threshold = key(static_cast<size_t>(out.front()));
  for (size_t i = n; i < vocab; ++i) {
    // NOTE: a tie with the threshold loses: i is larger than every kept id.
    if (key(i) > threshold) {
      std::pop_heap(out.begin(), out.end(), before);
      out.back() = static_cast<int32_t>(i);
      std::push_heap(out.begin(), out.end(), before);
      threshold = key(static_cast<size_t>(out.front()));
    }
  }
  std::sort_heap(out.begin(), out.end(), before);  // best first
}

/// The last (worst) token of a top-p nucleus known to hold more than a few tokens: the
/// smallest prefix, in (x desc, id asc) order, whose weight reaches `target`; -1 when that
/// is the whole vocabulary. `m` is the max of x. Expected O(vocab): buckets of the logit
/// find the bucket where the prefix weight crosses `target`, then a weighted quickselect
/// inside that bucket finds the token.
int32_t top_p_last_token(const std::vector<float>& x, const std::vector<float>& w, float m,
                         double target, std::vector<Entry>& e, std::vector<double>& mass) {
  constexpr size_t kBuckets = 1024;
  const float scale = static_cast<float>(kBuckets - 1) / 88.0f;  // exp underflows past 88
  // NOTE: bucket() is non-increasing in v, so the buckets are ranges of ranks.
  auto bucket = [&](float v) -> size_t {
    if (v == m) return 0;  // also a +inf maximum
    const float d = (m - v) * scale;
    return d < static_cast<float>(kBuckets - 1) ? static_cast<size_t>(d) : kBuckets - 1;
  };
  const size_t vocab = x.size();
  mass.assign(kBuckets, 0.0);
  for (size_t i = 0; i < vocab; ++i) mass[bucket(x[i])] += w[i];
  double cum = 0.0;  // weight of the buckets before `b`
  size_t b = 0;
  while (b < kBuckets - 1 && cum + mass[b] < target) cum += mass[b++];

  e.clear();
  for (size_t i = 0; i < vocab; ++i) {
    if (bucket(x[i]) == b) e.push_back({x[i], w[i], static_cast<int32_t>(i)});
  }
  if (e.empty()) return -1;  // rounding left the target beyond the total: keep all
  auto before = [](const Entry& p, const Entry& q) {
    return p.x > q.x || (p.x == q.x && p.id < q.id);
  };
  // Weighted quickselect: the answer's position stays in (lo, hi]; e[0, lo) weighs
  // cum - (weight before the bucket) and cum < target.
  size_t lo = 0, hi = e.size();
  while (hi - lo > 64) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(e.begin() + static_cast<ptrdiff_t>(lo),
                     e.begin() + static_cast<ptrdiff_t>(mid),
                     e.begin() + static_cast<ptrdiff_t>(hi), before);
    double part = 0.0;
    for (size_t j = lo; j < mid; ++j) part += e[j].w;
    if (cum + part < target) {
      cum += part;
      lo = mid;
    } else {
      hi = mid;
    }
  }
  std::sort(e.begin() + static_cast<ptrdiff_t>(lo), e.begin() + static_cast<ptrdiff_t>(hi), before);
  size_t keep = lo;
  while (keep < hi && (keep == 0 || cum < target)) cum += e[keep++].w;
  return e[keep - 1].id;
}

/// Sum of n floats in double with 4 independent accumulators (no serial add chain).
double sum(const float* v, size_t n) {
  double a[4] = {0.0, 0.0, 0.0, 0.0};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (size_t l = 0; l < 4; ++l) a[l] += v[i + l];
  }
  for (; i < n; ++i) a[0] += v[i];
  return (a[0] + a[1]) + (a[2] + a[3]);
}

void check_vocab(size_t vocab) {
  TANDEM_CHECK_KIND(kInvalidArgument,
                    vocab > 0 && vocab <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                    "sampling: invalid vocabulary size ", vocab);
}

void check_ids(std::span<const int32_t> ids, size_t vocab, const char* what) {
  for (int32_t t : ids) {
    TANDEM_CHECK_KIND(kInvalidArgument, t >= 0 && static_cast<size_t>(t) < vocab,
                      "sampling: ", what, " token id ", t, " outside the vocabulary [0, ", vocab,
                      ")");
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
    for (size_t l = 0; l < 8; ++l) acc[l] += exp_nonpos(x[i + l] - m);
  }
  for (size_t l = 0; i < x.size(); ++i, ++l) acc[l] += exp_nonpos(x[i] - m);
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  return m + std::log(sum);
}

}  // namespace

void apply_penalties(std::span<float> logits, const SamplingParams& params,
                     std::span<const int32_t> prompt, std::span<const int32_t> output) {
  const size_t vocab = logits.size();
  const bool rep = params.repetition_penalty != 1.0f;
  const bool freq_pres = params.frequency_penalty != 0.0f || params.presence_penalty != 0.0f;
  if (!rep && !freq_pres && params.logit_bias.empty()) return;
  check_vocab(vocab);
  for (const LogitBias& b : params.logit_bias) {
    TANDEM_CHECK_KIND(kInvalidArgument, b.id >= 0 && static_cast<size_t>(b.id) < vocab,
                      "logit_bias token id ", b.id, " is outside the vocabulary of ", vocab);
  }
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
  for (const LogitBias& b : params.logit_bias) logits[static_cast<size_t>(b.id)] += b.bias;
}

std::optional<DeviceSampling> to_device_sampling(const SamplingParams& p, uint64_t seed,
                                                 uint64_t counter) {
  const bool penalties =
      p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f;
  if (penalties || p.logprobs > 20) return std::nullopt;
  if (!p.logit_bias.empty()) {
    // Logprobs describe the raw logits, which the device overwrites: the host path. So do
    // duplicate ids (added in order on the host; they would race on the device).
    if (p.logprobs >= 0) return std::nullopt;
    std::vector<int32_t> ids;
    ids.reserve(p.logit_bias.size());
    for (const LogitBias& b : p.logit_bias) ids.push_back(b.id);
    std::sort(ids.begin(), ids.end());
    if (std::adjacent_find(ids.begin(), ids.end()) != ids.end()) return std::nullopt;
  }
  DeviceSampling d;
  d.bias.reserve(p.logit_bias.size());
  for (const LogitBias& b : p.logit_bias) d.bias.emplace_back(b.id, b.bias);
  d.temperature = p.greedy() ? 0.0f : p.temperature;
  d.top_k = p.top_k;
  d.top_p = p.top_p;
  d.min_p = p.min_p;
  d.seed = seed;
  d.counter = counter;
  d.logprobs = p.logprobs;
  return d;
}

void apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> mask) {
  const size_t n = logits.size();
  for (size_t w = 0; w * 32 < n; ++w) {
    const uint32_t bits = w < mask.size() ? mask[w] : 0u;
    if (bits == 0xFFFFFFFFu) continue;
    const size_t end = std::min(n, w * 32 + 32);
    for (size_t i = w * 32; i < end; ++i) {
      if (((bits >> (i - w * 32)) & 1u) == 0) logits[i] = -std::numeric_limits<float>::infinity();
    }
  }
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& params,
                     std::span<const int32_t> prompt, std::span<const int32_t> output,
                     SamplerRng& rng) {
  const size_t vocab = logits.size();
  check_vocab(vocab);
  Scratch& s = scratch();
  std::vector<float>& x = s.x;  // [vocab] penalised, tempered logits
  std::span<const float> src = logits;
  if (params.needs_host_logits()) {
    x.assign(logits.begin(), logits.end());
    apply_penalties(x, params, prompt, output);
    src = x;
  }
  if (params.greedy()) return argmax(src);

  // Temperature; NaN -> -inf so every comparison below is a strict weak order.
  x.resize(vocab);
  const float temp = params.temperature;
  float m = -kInf;
  for (size_t i = 0; i < vocab; ++i) {
    const float v = std::isnan(src[i]) ? -kInf : src[i] / temp;
    x[i] = v;
    m = v > m ? v : m;
  }
  if (m == -kInf) return argmax(x);  // everything masked: nothing to draw from
  // exp(x - max); a +inf logit takes all the mass (shared among the +inf ones).
  auto weight = [m](float v) { return m == kInf ? (v == kInf ? 1.0f : 0.0f) : exp_nonpos(v - m); };
  // Descending logit, ties -> lower id: the one order every filter uses.
  auto by_logit = [&x](int32_t a, int32_t b) {
    const float xa = x[static_cast<size_t>(a)], xb = x[static_cast<size_t>(b)];
    return xa > xb || (xa == xb && a < b);
  };
  auto key = [&x](size_t i) { return x[i]; };

  std::vector<int32_t>& cand = s.cand;  // kept token ids: cand[0, n)
  std::vector<float>& cw = s.cand_w;    // their weights: cw[0, n)
  cw.resize(vocab);
  size_t n = 0;
  bool identity = false;  // the kept set is the whole vocabulary: cand / cw unused
  const bool use_top_k = params.top_k > 0 && static_cast<size_t>(params.top_k) < vocab;
  const bool use_top_p = params.top_p < 1.0f;

  if (use_top_k) {
    // top-k: the k best, sorted, without sorting the vocabulary.
    select_top(vocab, static_cast<size_t>(params.top_k), key, cand);
    n = cand.size();
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
    std::vector<float>& w = s.w;  // [vocab]
    w.resize(vocab);
    for (size_t i = 0; i < vocab; ++i) w[i] = weight(x[i]);
    const double z = sum(w.data(), vocab);
    if (use_top_p) {
      // Keep the K best tokens, K the smallest count whose mass reaches top_p (K >= 1).
      // K is usually small: try the best 64 first.
      const double target = static_cast<double>(params.top_p) * z;
      select_top(vocab, std::min<size_t>(vocab, 64), key, cand);
      double cum = 0.0;
      size_t keep = 0;
      while (keep < cand.size() && (keep == 0 || cum < target)) {
        cum += w[static_cast<size_t>(cand[keep++])];
      }
      if (cum >= target || cand.size() == vocab) {
        n = keep;
        for (size_t j = 0; j < n; ++j) cw[j] = w[static_cast<size_t>(cand[j])];
      } else {
        // A wide nucleus: find its last token, then list the kept set in id order.
        const int32_t worst = top_p_last_token(x, w, m, target, s.entries, s.buckets);
        cand.resize(vocab);
        for (size_t i = 0; i < vocab; ++i) {
          const auto id = static_cast<int32_t>(i);
          if (worst < 0 || !by_logit(worst, id)) {  // at or before the last kept token
            cand[n] = id;
            cw[n] = w[i];
            ++n;
          }
        }
      }
    } else {
      identity = true;  // every token, in id order, weights in w
      n = vocab;
    }
  }
  const float* kept_w = identity ? s.w.data() : cw.data();
  auto kept_id = [&](size_t j) { return identity ? static_cast<int32_t>(j) : cand[j]; };

  // min-p: keep p >= min_p * p_max, i.e. weight >= min_p (the kept maximum has weight 1).
  if (params.min_p > 0.0f) {
    cand.resize(vocab);
    size_t out = 0;
    for (size_t j = 0; j < n; ++j) {
      if (kept_w[j] >= params.min_p) {  // NOTE: out <= j, so compacting in place is safe
        const float wj = kept_w[j];
        cand[out] = kept_id(j);
        cw[out] = wj;
        ++out;
      }
    }
    n = out;
    identity = false;
    kept_w = cw.data();
    if (n == 0) return argmax(x);  // only when min_p > 1
  }

  // One categorical draw over the kept tokens, in their (deterministic) order.
  const double target = uniform01(rng) * sum(kept_w, n);
  double cum = 0.0;
  size_t start = 0;
  // Skip whole blocks of 16 below the target; walk one by one from the block that holds it.
  for (; start + 16 <= n; start += 16) {
    const double block = sum(kept_w + start, 16);
    if (cum + block > target) break;
    cum += block;
  }
  for (size_t j = start; j < n; ++j) {
    if (kept_w[j] <= 0.0f) continue;
    cum += kept_w[j];
    if (target < cum) return kept_id(j);
  }
  // Rounding: the target landed on the total. The last token with weight.
  for (size_t j = n; j-- > 0;) {
    if (kept_w[j] > 0.0f) return kept_id(j);
  }
  return kept_id(0);
}

void token_distribution(std::span<const float> logits, const SamplingParams& params,
                        std::span<const int32_t> prompt, std::span<const int32_t> output,
                        std::vector<float>& probs) {
  const size_t vocab = logits.size();
  check_vocab(vocab);
  std::vector<float> x(logits.begin(), logits.end());  // [vocab] penalised, then tempered
  if (params.needs_host_logits()) apply_penalties(x, params, prompt, output);
  probs.assign(vocab, 0.0f);
  if (params.greedy()) {
    probs[static_cast<size_t>(argmax(x))] = 1.0f;
    return;
  }
  float m = -kInf;
  for (float& v : x) {
    v = std::isnan(v) ? -kInf : v / params.temperature;
    m = v > m ? v : m;
  }
  if (m == -kInf) {
    probs[static_cast<size_t>(argmax(x))] = 1.0f;
    return;
  }
  auto weight = [m](float v) { return m == kInf ? (v == kInf ? 1.0f : 0.0f) : exp_nonpos(v - m); };
  const bool use_top_k = params.top_k > 0 && static_cast<size_t>(params.top_k) < vocab;
  const bool use_top_p = params.top_p < 1.0f;
  // The kept tokens and their weights, in sample_token's order.
  std::vector<int32_t> ids;
  std::vector<float> w;
  if (use_top_k || use_top_p) {
    ids.resize(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&x](int32_t a, int32_t b) {
      return x[static_cast<size_t>(a)] > x[static_cast<size_t>(b)];
    });  // descending logit, ties -> lower id
    if (use_top_k) ids.resize(static_cast<size_t>(params.top_k));
    for (int32_t id : ids) w.push_back(weight(x[static_cast<size_t>(id)]));
    if (use_top_p) {
      double z = 0.0;
      if (use_top_k) {
        for (float v : w) z += v;
      } else {
        std::vector<float> all(vocab);
        for (size_t i = 0; i < vocab; ++i) all[i] = weight(x[i]);
        z = sum(all.data(), vocab);
      }
      const double target = static_cast<double>(params.top_p) * z;
      double cum = 0.0;
      size_t keep = 0;
      while (keep < ids.size() && (keep == 0 || cum < target)) cum += w[keep++];
      ids.resize(keep);
      w.resize(keep);
    }
  } else {
    ids.resize(vocab);
    std::iota(ids.begin(), ids.end(), 0);
    for (size_t i = 0; i < vocab; ++i) w.push_back(weight(x[i]));
  }
  if (params.min_p > 0.0f) {
    size_t out = 0;
    for (size_t j = 0; j < ids.size(); ++j) {
      if (w[j] >= params.min_p) {
        ids[out] = ids[j];
        w[out] = w[j];
        ++out;
      }
    }
    ids.resize(out);
    w.resize(out);
    if (out == 0) {
      probs[static_cast<size_t>(argmax(x))] = 1.0f;
      return;
    }
  }
  const double z = sum(w.data(), w.size());
  for (size_t j = 0; j < ids.size(); ++j) {
    probs[static_cast<size_t>(ids[j])] = static_cast<float>(static_cast<double>(w[j]) / z);
  }
}

double uniform_draw(SamplerRng& rng) { return uniform01(rng); }

int32_t sample_from_weights(std::span<const float> weights, SamplerRng& rng) {
  const double total = sum(weights.data(), weights.size());
  const double target = uniform01(rng) * total;
  if (!(total > 0.0)) return -1;
  double cum = 0.0;
  for (size_t j = 0; j < weights.size(); ++j) {
    if (weights[j] <= 0.0f) continue;
    cum += weights[j];
    if (target < cum) return static_cast<int32_t>(j);
  }
  for (size_t j = weights.size(); j-- > 0;) {  // rounding: the last token with weight
    if (weights[j] > 0.0f) return static_cast<int32_t>(j);
  }
  return -1;
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
  // Ordered by the logprob itself (ties -> lower id), NaN last.
  auto key = [&](size_t i) {
    const float v = logits[i] - lse;
    return std::isnan(v) ? -kInf : v;
  };
  std::vector<int32_t>& ids = scratch().cand;
  select_top(logits.size(), static_cast<size_t>(n), key, ids);
  std::vector<TokenLogprob> out(ids.size());
  for (size_t j = 0; j < ids.size(); ++j) {
    out[j] = {ids[j], logits[static_cast<size_t>(ids[j])] - lse};
  }
  return out;
}

}  // namespace tandem
