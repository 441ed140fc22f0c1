// The CPU reference of spec_accept_launch (spec_accept.h): the same rule, random stream, fixed
// point and id-order walk, written plainly (one loop per row), so the tokens are the same.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cuda/spec_accept.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

struct U4 {
  uint32_t x, y, z, w;
};

U4 philox_host(U4 c, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t{0xD2511F53u} * c.x, p1 = uint64_t{0xCD9E8D57u} * c.z;
    const auto hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const auto hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = {hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

uint64_t bits53(uint64_t seed, uint64_t counter, uint32_t tag) {
  const U4 r = philox_host(
      {0xffffffffu, static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), tag},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (uint64_t{r.x >> 6} << 27) | (r.y >> 5);
}

uint64_t fixed(float w) {
  if (!(w > 0.0f && w <= 1.0f)) return 0;
  return static_cast<uint64_t>(std::nearbyint(static_cast<double>(w * 1099511627776.0f)));
}

// The draw of spec_accept.h over fixed-point weights; -1 when all are 0.
int32_t draw(const std::vector<uint64_t>& w, uint64_t seed, uint64_t counter) {
  uint64_t total = 0;
  for (uint64_t x : w) total += x;
  if (total == 0) return -1;
  const uint64_t target = static_cast<uint64_t>(
      (static_cast<unsigned __int128>(bits53(seed, counter, kDrawTag) << 11) * total) >> 64);
  uint64_t run = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    run += w[i];
    if (run > target) return static_cast<int32_t>(i);
  }
  return -1;  // unreachable: target < total
}

}  // namespace

double spec_uniform(uint64_t seed, uint64_t counter, uint32_t tag) {
  return static_cast<double>(bits53(seed, counter, tag)) * 0x1.0p-53;
}

void spec_accept_reference(std::vector<float> const& p, std::vector<float> const& q,
                           std::vector<int32_t> const& drafts,
                           std::vector<SpecAcceptRow> const& rows, int64_t K, int64_t vocab,
                           std::vector<int32_t>& tokens, std::vector<int32_t>& num_accepted) {
  const auto seqs = static_cast<int64_t>(rows.size());
  const auto V = static_cast<size_t>(vocab);
  TANDEM_CHECK(p.size() == static_cast<size_t>(seqs * (K + 1)) * V &&
                   (q.empty() || q.size() == static_cast<size_t>(seqs * K) * V) &&
                   drafts.size() == static_cast<size_t>(seqs * K),
               "spec_accept_reference: sizes");
  tokens.assign(static_cast<size_t>(seqs * (K + 1)), -1);
  num_accepted.assign(static_cast<size_t>(seqs), 0);
  std::vector<uint64_t> w(V);
  for (int64_t s = 0; s < seqs; ++s) {
    const SpecAcceptRow& row = rows[static_cast<size_t>(s)];
    const int64_t k = std::min<int64_t>(std::max<int64_t>(row.num_drafts, 0), K);
    int32_t* out = tokens.data() + s * (K + 1);
    int32_t accepted = 0, token = -1;
    for (int64_t j = 0; j <= k; ++j) {
      const float* pj = p.data() + static_cast<size_t>(s * (K + 1) + j) * V;
      const auto counter = row.counter + static_cast<uint64_t>(j);
      if (j == k) {
        for (size_t i = 0; i < V; ++i) w[i] = fixed(pj[i]);
        token = draw(w, row.seed, counter);
        break;
      }
      const float* qj = q.empty() ? nullptr : q.data() + static_cast<size_t>(s * K + j) * V;
      const int32_t d =
          std::min<int32_t>(std::max<int32_t>(drafts[static_cast<size_t>(s * K + j)], 0),
                            static_cast<int32_t>(vocab - 1));
      const double pd = pj[d];
      const double qd = qj != nullptr ? static_cast<double>(qj[d]) : 1.0;
      if (spec_uniform(row.seed, counter, kAcceptTag) * qd < pd) {
        out[accepted++] = d;
        continue;
      }
      for (size_t i = 0; i < V; ++i) {
        const float qi = qj != nullptr ? qj[i] : (static_cast<int32_t>(i) == d ? 1.0f : 0.0f);
        w[i] = fixed(std::fmax(0.0f, pj[i] - qi));
      }
      token = draw(w, row.seed, counter);
      if (token < 0) {
        for (size_t i = 0; i < V; ++i) w[i] = fixed(pj[i]);
        token = draw(w, row.seed, counter);
      }
      break;
    }
    out[accepted] = token < 0 ? 0 : token;
    num_accepted[static_cast<size_t>(s)] = accepted;
  }
}

}  // namespace tandem::cuda
