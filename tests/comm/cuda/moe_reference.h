// CPU references of the MoE dispatch / combine kernels (src/comm/cuda/moe_params.h), used by
// the GPU tests (tests/comm/cuda/test_moe_cuda.cpp) and the CPU emulation
// (tests/comm/test_moe_emulated.cpp). Same orders and the same fp32 operations as the kernels
// (one fma per pair, ascending expert id, from 0; bf16 round-to-nearest-even), so bf16 results
// must match bit for bit. Also the routing generators the tests share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "comm/cuda/moe_params.h"
#include "core/dtype.h"

namespace tandem::comm::moe_ref {

using cuda::MoePayload;

inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
inline double uniform(uint64_t& s) { return static_cast<double>(splitmix(s) >> 11) * 0x1.0p-53; }

/// bf16 values in [-1, 1) (never all zeros).
inline std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  std::vector<uint16_t> v(n);
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 12345;
  for (auto& x : v) x = f32_to_bf16(static_cast<float>(uniform(s) * 2 - 1));
  return v;
}

enum class RoutingKind {
  kRandom,    // k distinct experts uniformly at random
  kSkewed,    // expert 0 in every token (slot 0), the rest random
  kAllFirst,  // every token picks experts 0..k-1: all to the first rank
  kSparse,    // only experts e % 5 == 0 are ever picked: most experts stay empty
};

inline const char* routing_name(RoutingKind k) {
  switch (k) {
    case RoutingKind::kRandom: return "random";
    case RoutingKind::kSkewed: return "skewed";
    case RoutingKind::kAllFirst: return "all-first";
    case RoutingKind::kSparse: return "sparse";
  }
  return "?";
}

/// One rank's tokens: T valid of max_tokens rows (rows >= T hold garbage routing: valid ids).
struct Tokens {
  int T = 0;
  int max_tokens = 0;
  int k = 0;
  int hidden = 0;
  std::vector<uint16_t> x;   // bf16 [max_tokens, H]
  std::vector<int32_t> ids;  // [max_tokens, k]
  std::vector<float> w;      // [max_tokens, k]
};

inline Tokens make_tokens(int T, int max_tokens, int k, int hidden, int experts, RoutingKind kind,
                          uint64_t seed) {
  Tokens t;
  t.T = T;
  t.max_tokens = max_tokens;
  t.k = k;
  t.hidden = hidden;
  t.x = random_bf16(size_t(max_tokens) * hidden, seed);
  t.ids.resize(size_t(max_tokens) * k);
  t.w.resize(size_t(max_tokens) * k);
  uint64_t s = seed * 7919 + 3;
  std::vector<int> pool;
  for (int e = 0; e < experts; ++e)
    if (kind != RoutingKind::kSparse || e % 5 == 0) pool.push_back(e);
  if (static_cast<int>(pool.size()) < k)
    for (int e = 0; e < experts && static_cast<int>(pool.size()) < k; ++e)
      if (e % 5 != 0) pool.push_back(e);
  for (int r = 0; r < max_tokens; ++r) {
    std::vector<int> chosen;
    if (kind == RoutingKind::kAllFirst) {
      for (int j = 0; j < k; ++j) chosen.push_back(j);
      std::reverse(chosen.begin(), chosen.end());  // slot order != expert order
    } else {
      if (kind == RoutingKind::kSkewed) chosen.push_back(0);
      while (static_cast<int>(chosen.size()) < k) {
        const int e = pool[splitmix(s) % pool.size()];
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      // shuffle slot order
      for (int j = k - 1; j > 0; --j) std::swap(chosen[j], chosen[splitmix(s) % (j + 1)]);
    }
    for (int j = 0; j < k; ++j) {
      t.ids[size_t(r) * k + j] = chosen[j];
      t.w[size_t(r) * k + j] = static_cast<float>(0.05 + uniform(s));
    }
  }
  return t;
}

inline float bf(uint16_t h) { return bf16_to_f32(h); }

// ---- prefill -----------------------------------------------------------------------------------

struct PrefillRouted {
  std::vector<int32_t> offsets;  // [L + 1]
  std::vector<int32_t> row_token, row_slot;
  std::vector<float> row_weight;
  std::vector<int32_t> slot_row;  // [max_tokens, k]
  std::vector<uint16_t> rows;     // bf16 [rows, H]
};

inline PrefillRouted prefill_dispatch(const Tokens& in, int begin, int L) {
  PrefillRouted r;
  const int k = in.k;
  r.offsets.assign(L + 1, 0);
  r.slot_row.assign(size_t(in.max_tokens) * k, -1);
  for (int e = 0; e < L; ++e) {
    r.offsets[e] = static_cast<int32_t>(r.row_token.size());
    for (int t = 0; t < in.T; ++t)
      for (int j = 0; j < k; ++j)
        if (in.ids[size_t(t) * k + j] == begin + e) {
          r.slot_row[size_t(t) * k + j] = static_cast<int32_t>(r.row_token.size());
          r.row_token.push_back(t);
          r.row_slot.push_back(j);
          r.row_weight.push_back(in.w[size_t(t) * k + j]);
          r.rows.insert(r.rows.end(), in.x.begin() + size_t(t) * in.hidden,
                        in.x.begin() + size_t(t + 1) * in.hidden);
        }
  }
  r.offsets[L] = static_cast<int32_t>(r.row_token.size());
  return r;
}

/// Slots of token t sorted by ascending expert id, among those with keep(j).
template <class Keep>
std::vector<int> slot_order(const int32_t* ids, int k, Keep keep) {
  std::vector<int> js;
  for (int j = 0; j < k; ++j)
    if (keep(j)) js.push_back(j);
  std::sort(js.begin(), js.end(), [&](int a, int b) { return ids[a] < ids[b]; });
  return js;
}

/// fp32 partial [max_tokens, H] (rows >= T and tokens with no local pair: 0).
inline std::vector<float> prefill_combine(const Tokens& in, const PrefillRouted& r,
                                          const std::vector<uint16_t>& expert_out) {
  const int k = in.k, H = in.hidden;
  std::vector<float> out(size_t(in.max_tokens) * H, 0.f);
  for (int t = 0; t < in.T; ++t) {
    const int32_t* srow = r.slot_row.data() + size_t(t) * k;
    for (int j :
         slot_order(in.ids.data() + size_t(t) * k, k, [&](int j) { return srow[j] >= 0; })) {
      const float w = in.w[size_t(t) * k + j];
      const uint16_t* o = expert_out.data() + size_t(srow[j]) * H;
      for (int i = 0; i < H; ++i)
        out[size_t(t) * H + i] = std::fma(w, bf(o[i]), out[size_t(t) * H + i]);
    }
  }
  return out;
}

// ---- decode ------------------------------------------------------------------------------------

/// fp8 payload row of a bf16 row (the kernel's bytes: H e4m3, then H/128 fp32 scales, padded).
inline std::vector<uint8_t> quantize_row(const uint16_t* x, int H) {
  std::vector<uint8_t> row(cuda::moe_row_bytes(MoePayload::kFP8, H), 0);
  for (int g = 0; g < H / cuda::kMoeFp8Group; ++g) {
    float amax = 0.f;
    for (int i = 0; i < cuda::kMoeFp8Group; ++i)
      amax = std::max(amax, std::fabs(bf(x[g * cuda::kMoeFp8Group + i])));
    const float scale = amax / 448.f;
    const float inv = amax > 0.f ? 448.f / amax : 0.f;
    for (int i = 0; i < cuda::kMoeFp8Group; ++i)
      row[g * cuda::kMoeFp8Group + i] = f32_to_f8e4m3(bf(x[g * cuda::kMoeFp8Group + i]) * inv);
    std::memcpy(row.data() + H + 4 * g, &scale, 4);
  }
  return row;
}

inline float dequant(const uint8_t* row, int H, MoePayload payload, int i) {
  if (payload == MoePayload::kBF16) {
    uint16_t h;
    std::memcpy(&h, row + 2 * i, 2);
    return bf(h);
  }
  float scale;
  std::memcpy(&scale, row + H + 4 * (i / cuda::kMoeFp8Group), 4);
  return f8e4m3_to_f32(row[i]) * scale;
}

/// What rank d receives from dispatch_recv.
struct DecodeRecv {
  std::vector<int32_t> offsets;  // [L + 1]
  std::vector<int32_t> row_src, row_token, row_slot, row_expert;
  std::vector<float> row_weight;
  std::vector<uint8_t> rows;  // [rows, row_bytes]
  int num_rows() const { return static_cast<int>(row_src.size()); }
};

inline DecodeRecv decode_dispatch(const std::vector<Tokens>& ranks, int d, int E,
                                  MoePayload payload) {
  const int N = static_cast<int>(ranks.size());
  const int L = E / N, k = ranks[0].k, H = ranks[0].hidden;
  const size_t rb = cuda::moe_row_bytes(payload, H);
  DecodeRecv r;
  r.offsets.assign(L + 1, 0);
  for (int e = 0; e < L; ++e) {
    r.offsets[e] = r.num_rows();
    for (int s = 0; s < N; ++s) {
      const Tokens& in = ranks[s];
      for (int t = 0; t < in.T; ++t)
        for (int j = 0; j < k; ++j)
          if (in.ids[size_t(t) * k + j] == d * L + e) {
            r.row_src.push_back(s);
            r.row_token.push_back(t);
            r.row_slot.push_back(j);
            r.row_expert.push_back(d * L + e);
            r.row_weight.push_back(in.w[size_t(t) * k + j]);
            const uint16_t* x = in.x.data() + size_t(t) * H;
            if (payload == MoePayload::kBF16) {
              const size_t at = r.rows.size();
              r.rows.resize(at + rb);
              std::memcpy(r.rows.data() + at, x, rb);
            } else {
              auto q = quantize_row(x, H);
              r.rows.insert(r.rows.end(), q.begin(), q.end());
            }
          }
    }
  }
  r.offsets[L] = r.num_rows();
  return r;
}

/// The fake expert of moe_fake_expert_launch on rows [0, rows) of a packed buffer.
inline std::vector<uint16_t> fake_expert(const uint8_t* rows, const int32_t* row_expert, int n,
                                         int H, MoePayload payload) {
  const size_t rb = cuda::moe_row_bytes(payload, H);
  std::vector<uint16_t> out(size_t(n) * H);
  for (int r = 0; r < n; ++r) {
    const float f = 1.f + static_cast<float>(row_expert[r] % 7) * 0.25f;
    for (int i = 0; i < H; ++i)
      out[size_t(r) * H + i] = f32_to_bf16(dequant(rows + r * rb, H, payload, i) * f);
  }
  return out;
}

/// Home rank s's combine output (fp32 before the final rounding) [T_s, H], given every rank's
/// received rows and expert outputs.
inline std::vector<float> decode_combine(const std::vector<Tokens>& ranks, int s, int E,
                                         const std::vector<DecodeRecv>& recv,
                                         const std::vector<std::vector<uint16_t>>& expert_out) {
  const int N = static_cast<int>(ranks.size());
  const int L = E / N, k = ranks[0].k, H = ranks[0].hidden;
  const Tokens& in = ranks[s];
  std::map<std::tuple<int, int>, std::pair<int, int>> where;  // (t, j) -> (rank, row)
  for (int d = 0; d < N; ++d)
    for (int r = 0; r < recv[d].num_rows(); ++r)
      if (recv[d].row_src[r] == s) where[{recv[d].row_token[r], recv[d].row_slot[r]}] = {d, r};
  std::vector<float> out(size_t(in.T) * H, 0.f);
  for (int t = 0; t < in.T; ++t) {
    for (int j : slot_order(in.ids.data() + size_t(t) * k, k, [](int) { return true; })) {
      auto [d, r] = where.at({t, j});
      (void)L;
      const float w = in.w[size_t(t) * k + j];
      const uint16_t* o = expert_out[d].data() + size_t(r) * H;
      for (int i = 0; i < H; ++i)
        out[size_t(t) * H + i] = std::fma(w, bf(o[i]), out[size_t(t) * H + i]);
    }
  }
  return out;
}

inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = f32_to_bf16(v[i]);
  return o;
}

}  // namespace tandem::comm::moe_ref
