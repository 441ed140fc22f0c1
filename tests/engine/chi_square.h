// The sampling tests' two-sample chi-square (speculative decoding against non-speculative
// sampling; tests/engine/test_speculative.cpp and the CUDA model tests).
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
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

}  // namespace tandem::testing
