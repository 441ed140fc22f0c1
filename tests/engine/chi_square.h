// The sampling tests' two-sample chi-square (speculative decoding against non-speculative
// sampling; tests/engine/test_speculative.cpp and the CUDA model tests).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace tandem::testing {

/// Two-sample chi-square statistic (equal sample sizes) over the continuations' counts, and
/// its degrees of freedom.
inline std::pair<double, int64_t> chi_square(const std::map<std::vector<int32_t>, int64_t>& a,
                                             const std::map<std::vector<int32_t>, int64_t>& b) {
  std::map<std::vector<int32_t>, std::pair<int64_t, int64_t>> all;
  for (const auto& [k, v] : a) all[k].first = v;
  for (const auto& [k, v] : b) all[k].second = v;
  double x2 = 0.0;
  for (const auto& [k, v] : all) {
    const double d = double(v.first - v.second);
    x2 += d * d / double(v.first + v.second);
  }
  return {x2, static_cast<int64_t>(all.size()) - 1};
}

/// The chi-square quantile at 1 - 1e-3 (Wilson-Hilferty).
inline double chi_square_bound(int64_t df) {
  const double z = 3.09, k = double(df);
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

/// The most frequent continuation in `counts` (the first of equals).
inline std::vector<int32_t> most_frequent(const std::map<std::vector<int32_t>, int64_t>& counts) {
  std::vector<int32_t> mode;
  int64_t best = 0;
  for (const auto& [ids, n] : counts) {
    if (n > best) {
      best = n;
      mode = ids;
    }
  }
  return mode;
}

/// An EngineConfig::spec_draft_hook drafting the continuation `mode` (deterministic drafts,
/// often accepted) after a prompt of `prompt_len` tokens; past its end the MTP's drafts stay.
inline auto drafts_from(std::vector<int32_t> mode, size_t prompt_len) {
  return [mode = std::move(mode), prompt_len](const std::string&, std::span<const int32_t> tokens,
                                              std::vector<int32_t>& drafts) {
    for (size_t m = 0; m < drafts.size(); ++m) {
      const size_t i = tokens.size() - prompt_len + m;
      if (i < mode.size()) drafts[m] = mode[i];
    }
  };
}

/// An EngineConfig::spec_draft_hook from known continuations: request id -> its whole token
/// sequence (prompt, then output); an id's wave prefix up to its first '-' is dropped. Each draft
/// is the continuation's token (mostly right: every accepted length, bonus tokens, rollbacks),
/// replaced by a random one with probability 0.3 from a seeded stream of the hook's own.
inline auto oracle_drafts(std::map<std::string, std::vector<int32_t>> full, int64_t vocab) {
  auto want = std::make_shared<const std::map<std::string, std::vector<int32_t>>>(std::move(full));
  auto rng = std::make_shared<std::mt19937_64>(11);
  return [want, rng, vocab](const std::string& id, std::span<const int32_t> tokens,
                            std::vector<int32_t>& drafts) {
    const auto& t = want->at(id.substr(id.find('-') + 1));
    for (size_t m = 0; m < drafts.size(); ++m) {
      const size_t pos = tokens.size() + m;
      if (pos < t.size()) drafts[m] = t[pos];
      if ((*rng)() % 10 < 3) drafts[m] = static_cast<int32_t>((*rng)() % vocab);
    }
  };
}

}  // namespace tandem::testing
