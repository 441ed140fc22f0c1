// GPU sampling: one CTA of 1024 threads per row, a few block-wide passes over the row (it is
// too large for shared memory: 151936 fp32 = 594 KiB). See sampling.h for the semantics.
// With a workspace the same decisions are made over slices of the row, several CTAs per row
// (the multi-CTA path, further down).
//
// Passes per row (single-CTA path):
//   1. stats: raw max + argmax (ties -> lowest id) and, only when logprobs are asked for, an
//      online log-sum-exp of the raw logits. Greedy rows stop here.
//   2. cut (top-k and/or top-p only): the kept set is a prefix of the order (x desc, id asc),
//      x = logit / temperature; its last element is a key T (an order-preserving uint32 of x)
//      and an id cut among the tokens of key T. fine_cut: one histogram pass (count and
//      fixed-point mass in 2048 equal-width bins of x - max over the 28.5 nats below the max;
//      every token further down has mass 0), then one gather pass of the tokens of the bins the
//      cut can fall in, sorted in shared memory, where the cut is exact. When those tokens do
//      not fit (> 2048, e.g. huge ties), the older search(): 256 key bins per level, at most 4
//      levels, plus a pass for the id cut inside a tie.
//   3. draw: the kept mass per 1024-id super-block (one pass), then the inverse CDF in id order
//      at the target floor(u * kept mass), u one Philox draw per (seed, counter): a re-read of
//      one super-block. The mass sums are exact integers, so the token does not depend on the
//      thread (or CTA) layout.
//   4. top-n logprobs: search() by count on the key of (raw - lse), then a gather of the n
//      (<= 20) tokens and a sort of those.
// NOTE: masses are fixed-point (w * 2^40 as uint64) so the shared-memory atomics that build
// them are exact and order-independent: the same inputs always give the same cut and token.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/sampling.h"

namespace tandem::cuda {

using namespace detail;

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr int kHistCopies = 8;                  // one per 4 warps: fewer same-address atomics
constexpr float kMassScale = 1099511627776.0f;  // 2^40: w in (0, 1] -> [0, 2^40]
constexpr float kGreedyBelow = 1e-5f;           // SamplingParams::greedy()
constexpr int kIdTile = 8;                      // consecutive ids per thread in the id pass
constexpr int32_t kNoId = INT32_MAX;
// Fine cut (fine_cut): kFineBins bins of d = x - m over [-kZeroBelow, 0] (the shared histogram
// arrays reused as one), at most kGatherCap tokens gathered from the bins the cut can fall in.
// Every token with d < -kZeroBelow has fixed-point weight 0: expf(-28.5) * 2^40 = 0.46 rounds
// to 0 (2^-41 = e^-28.42).
constexpr int kFineBins = kHistCopies * kBins;  // 2048
constexpr float kZeroBelow = 28.5f;
constexpr float kFineScale = static_cast<float>(kFineBins) / kZeroBelow;
constexpr int kGatherCap = 2048;
constexpr int kMaxSB = 512;  // super-blocks of the draw per CTA (sb_len)

struct Shared {
  uint32_t cnt[kHistCopies][kBins];
  unsigned long long mass[kHistCopies][kBins];
  float red_f[kWarps];
  int red_i[kWarps];
  // level-search broadcast
  uint32_t lo, hi, above_cnt, eq_cnt;
  unsigned long long above_mass, eq_mass, need;
  int found, done;
  int id_result;
  // top-n gather
  int n_gathered;
  uint32_t g_key[kMaxTopLogprobs];
  int g_id[kMaxTopLogprobs];
  // the draw
  unsigned long long red_u[kWarps];
  unsigned long long sb[kMaxSB];  // kept mass per super-block
  int find_j, find_id;
  unsigned long long find_r;
  // fine cut
  unsigned long long g_sort[kGatherCap];  // (key << 32) | ~id, sorted descending
  int f_state, f_lo, f_hi, f_bk, f_jcut;
  unsigned long long f_acnt, f_amass, f_tmass, f_massk;
};

/// Order-preserving map float -> uint32 (larger float -> larger key). NaN -> key of -inf;
/// -0 -> +0 so that equal floats have equal keys.
__device__ __forceinline__ uint32_t ordkey(float f) {
  if (f != f) f = -INFINITY;
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float load_raw(float const* p, int i) { return p[i]; }
__device__ __forceinline__ float load_raw(bf16 const* p, int i) { return __bfloat162float(p[i]); }

/// The 16 bytes `q` (4 fp32 or 8 bf16) as fp32.
template <typename T, int kVec>
__device__ __forceinline__ void unpack(uint4 q, float (&r)[kVec]) {
  if constexpr (sizeof(T) == 4) {
    r[0] = __uint_as_float(q.x);
    r[1] = __uint_as_float(q.y);
    r[2] = __uint_as_float(q.z);
    r[3] = __uint_as_float(q.w);
  } else {
    uint32_t const w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      r[2 * i] = __uint_as_float(w[i] << 16);
      r[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}

/// Calls f(i, value) once for every element of the row, 16-byte loads when aligned.
/// NOTE: 64 bytes of loads are issued before they are used, so one CTA per SM keeps
/// 64 KiB in flight (a single 16-byte load per thread would reach ~1/3 of the bandwidth).
/// The loads of a group are predicated rather than left to a remainder loop, so short rows
/// (the multi-CTA slices: a few vectors per thread) also issue them all at once. Each thread
/// visits its elements in increasing index order, or with kReverse its groups of vectors from
/// the end of the row to its start (for passes whose result does not depend on the order: the
/// part of the row read last by the pass before is the likeliest still in L2).
template <bool kReverse = false, typename T, typename F>
__device__ __forceinline__ void for_each(T const* row, int n, F&& f) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kUnroll = 4;
  int start = 0;
  if (reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    uint4 const* gV = reinterpret_cast<uint4 const*>(row);
    const int nv = n / kVec, stride = static_cast<int>(blockDim.x);
    auto group = [&](int v0) {
      uint4 q[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * stride;
        q[u] = v < nv ? gV[v] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * stride;
        if (v < nv) {
          float r[kVec];
          unpack<T, kVec>(q[u], r);
#pragma unroll
          for (int j = 0; j < kVec; ++j) f(v * kVec + j, r[j]);
        }
      }
    };
    if constexpr (kReverse) {
      const int groups = (nv + kUnroll * stride - 1) / (kUnroll * stride);
      for (int g = groups - 1; g >= 0; --g)
        group(g * kUnroll * stride + static_cast<int>(threadIdx.x));
    } else {
      for (int v0 = threadIdx.x; v0 < nv; v0 += kUnroll * stride) group(v0);
    }
    start = nv * kVec;
  }
  for (int i = start + static_cast<int>(threadIdx.x); i < n; i += blockDim.x)
    f(i, load_raw(row, i));
}

/// Calls f(ok, i, value) the same number of times in every thread (ok false past the end), so
/// f may use warp-wide intrinsics with the full mask.
template <typename T, typename F>
__device__ __forceinline__ void for_each_uniform(T const* row, int n, F&& f) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kUnroll = 4;
  const int stride = static_cast<int>(blockDim.x), tid = static_cast<int>(threadIdx.x);
  int start = 0;
  if (reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    uint4 const* gV = reinterpret_cast<uint4 const*>(row);
    const int nv = n / kVec;
    for (int v0 = 0; v0 < nv; v0 += kUnroll * stride) {
      uint4 q[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * stride + tid;
        q[u] = v < nv ? gV[v] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * stride + tid;
        float r[kVec];
        unpack<T, kVec>(q[u], r);
#pragma unroll
        for (int j = 0; j < kVec; ++j) f(v < nv, v * kVec + j, r[j]);
      }
    }
    start = nv * kVec;
  }
  for (int i0 = start; i0 < n; i0 += stride) {
    const int i = i0 + tid;
    f(i < n, i, i < n ? load_raw(row, i) : 0.0f);
  }
}

/// 64-bit sum over the warp.
__device__ __forceinline__ uint64_t warp_sum_u64(uint64_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---------------------------------------------------------------- block reductions
// NOTE: each starts with __syncthreads() (the scratch may still be read by a previous call).

/// (value desc, id asc) best over the block; every thread gets it. value is never NaN.
__device__ void block_argmax(float& v, int& id, Shared& sh) {
  auto better = [](float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); };
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, id, o);
    if (better(ov, oi, v, id)) {
      v = ov;
      id = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sh.red_f[warp] = v;
    sh.red_i[warp] = id;
  }
  __syncthreads();
  v = sh.red_f[0];
  id = sh.red_i[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) {
    if (better(sh.red_f[w], sh.red_i[w], v, id)) {
      v = sh.red_f[w];
      id = sh.red_i[w];
    }
  }
}

__device__ float block_min(float v, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.red_f[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = sh.red_f[0];
  for (int w = 1; w < static_cast<int>(blockDim.x >> 5); ++w) r = fminf(r, sh.red_f[w]);
  return r;
}

__device__ float block_max(float v, Shared& sh) { return -block_min(-v, sh); }

__device__ float block_sumf(float v, Shared& sh) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.red_f[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) r += sh.red_f[w];
  return r;
}

// ---------------------------------------------------------------- random numbers
/// Philox4x32-10 (Salmon et al. 2011).
__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}

/// floor(u * total) for the row's one uniform u in [0, 1) (53 bits of Philox on (seed,
/// counter)): the draw's target, in [0, total) when total > 0.
__device__ __forceinline__ uint64_t draw_target(uint64_t seed, uint64_t counter, uint64_t total) {
  const uint4 r =
      philox(make_uint4(0xffffffffu, static_cast<uint32_t>(counter),
                        static_cast<uint32_t>(counter >> 32), 0x44524157u),
             make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
  const uint64_t u53 = (static_cast<uint64_t>(r.x >> 6) << 27) | (r.y >> 5);
  return __umul64hi(u53 << 11, total);
}

// ---------------------------------------------------------------- universes
struct Elem {
  bool valid;    // takes part in the search / draw
  uint32_t key;  // ordkey of the value that orders the tokens
  float d;       // x - max (sampling only)
  float w;       // exp(d), flushed to 0 below -87 as the CPU does (sampling only)
  uint64_t wfp;  // w in fixed point (sampling only)
};

/// Sampling: x = logit / temperature; weight exp(x - m); tokens of weight 0 never count.
/// kV2 (the single-CTA kernel): x / 1 == x exactly, so at temperature 1 (a uniform branch) the
/// IEEE division, with its slow-path call that keeps the compiler from interleaving tokens, is
/// skipped; expf without a branch. The same values either way (the multi-CTA path: false).
template <bool kV2>
struct SampleUniverseT {
  float temp, m;
  __device__ __forceinline__ float scaled(float v) const {
    if (v != v) return -INFINITY;
    if (kV2) return temp == 1.0f ? v : v / temp;
    return v / temp;
  }
  __device__ __forceinline__ uint32_t key(float v) const { return ordkey(scaled(v)); }
  __device__ __forceinline__ Elem operator()(float v) const {
    const float x = scaled(v);
    float d;
    if (m == INFINITY) {
      d = x == INFINITY ? 0.0f : -INFINITY;  // the +inf tokens share all the mass
    } else {
      d = x - m;
    }
    // NOTE (kV2): expf of the clamped d and a select, not a branch around expf: the same
    // weight (d is never NaN here), and the tokens of a thread interleave without branches.
    const float w =
        kV2 ? (d < -87.0f ? 0.0f : expf(fmaxf(d, -87.0f))) : (d < -87.0f ? 0.0f : expf(d));
    return {w > 0.0f, ordkey(x), d, w, __float2ull_rn(w * kMassScale)};
  }
};
using SampleUniverse = SampleUniverseT<false>;

/// Top-n logprobs: every token, ordered by raw - lse (NaN last).
struct LogprobUniverse {
  float lse;
  __device__ __forceinline__ uint32_t key(float v) const { return ordkey(v - lse); }
  __device__ __forceinline__ Elem operator()(float v) const {
    return {true, ordkey(v - lse), 0.f, 0.f, 0ull};
  }
};

// ---------------------------------------------------------------- cut search
struct SearchResult {
  bool found;  // false: fewer than `need` in the whole range (keep everything)
  uint32_t key;
  uint32_t above_cnt, eq_cnt;  // tokens with key > T, == T
  uint64_t above_mass, eq_mass;
  uint64_t need;  // the target used (mass targets are resolved at the first level)
};

/// The largest key T in [lo, hi] with A(key >= T) >= need, A the count (kByMass false) or the
/// fixed-point mass of the valid tokens. When frac > 0 the mass target is
/// ceil(frac * total mass in [lo, hi]) instead of `need`.
template <bool kByMass, bool kWithMass, typename T, typename U>
__device__ SearchResult search(T const* row, int n, U const& u, uint32_t lo, uint32_t hi,
                               uint64_t need, float frac, Shared& sh) {
  uint32_t above_cnt = 0;
  uint64_t above_mass = 0;
  bool first = true;
  for (;;) {
    const uint32_t width = static_cast<uint32_t>((static_cast<uint64_t>(hi) - lo) / kBins + 1);
    __syncthreads();  // the previous level's readers are done with the histogram
    for (int j = threadIdx.x; j < kHistCopies * kBins; j += blockDim.x) {
      (&sh.cnt[0][0])[j] = 0;
      if (kWithMass) (&sh.mass[0][0])[j] = 0;
    }
    __syncthreads();
    const int copy = (threadIdx.x >> 5) & (kHistCopies - 1);
    const int lane = threadIdx.x & 31;
    // NOTE: most tokens of a row share a few bins at the first level; lanes of a warp that hit
    // the same bin add once (warp-aggregated), which keeps same-address atomics rare. When the
    // bins of a warp are many and spread, plain atomics are cheaper and do not collide.
    for_each_uniform(row, n, [&](bool ok, int, float v) {
      int b = -1;
      uint64_t wfp = 0;
      if (ok) {
        const uint32_t k = u.key(v);  // cheap: the weight (expf) only for keys in range
        if (k >= lo && k <= hi) {
          const Elem e = u(v);
          if (e.valid) {
            b = static_cast<int>((e.key - lo) / width);
            wfp = e.wfp;
          }
        }
      }
      if (__ballot_sync(0xffffffffu, b >= 0) == 0) return;  // uniform over the warp
      const unsigned peers = __match_any_sync(0xffffffffu, b);
      const unsigned leaders = __ballot_sync(0xffffffffu, (peers & ((1u << lane) - 1u)) == 0u);
      if (__popc(leaders) <= 8) {
        for (unsigned todo = leaders; todo != 0; todo &= todo - 1u) {
          const int l = __ffs(todo) - 1;
          const int gb = __shfl_sync(0xffffffffu, b, l);
          uint64_t sum = 0;
          if (kWithMass) sum = warp_sum_u64(((peers >> l) & 1u) ? wfp : 0);
          if (lane == l && gb >= 0) {
            atomicAdd(&sh.cnt[copy][gb], static_cast<uint32_t>(__popc(peers)));
            if (kWithMass) atomicAdd(&sh.mass[copy][gb], static_cast<unsigned long long>(sum));
          }
        }
      } else if (b >= 0) {
        atomicAdd(&sh.cnt[copy][b], 1u);
        if (kWithMass) atomicAdd(&sh.mass[copy][b], static_cast<unsigned long long>(wfp));
      }
    });
    __syncthreads();
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
      uint32_t c = 0;
      unsigned long long ms = 0;
      for (int k = 0; k < kHistCopies; ++k) {
        c += sh.cnt[k][j];
        if (kWithMass) ms += sh.mass[k][j];
      }
      sh.cnt[0][j] = c;
      if (kWithMass) sh.mass[0][j] = ms;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int nbins = static_cast<int>((static_cast<uint64_t>(hi) - lo) / width + 1);
      if (first && kByMass && frac > 0.0f) {
        unsigned long long total = 0;
        for (int b = 0; b < nbins; ++b) total += sh.mass[0][b];
        need = static_cast<uint64_t>(ceil(static_cast<double>(frac) * static_cast<double>(total)));
        if (need == 0) need = 1;
      }
      int b = nbins - 1;
      for (; b >= 0; --b) {
        const uint64_t a = kByMass ? above_mass + sh.mass[0][b] : above_cnt + sh.cnt[0][b];
        if (a >= need) break;
        above_cnt += sh.cnt[0][b];
        if (kWithMass) above_mass += sh.mass[0][b];
      }
      sh.need = need;
      sh.above_cnt = above_cnt;
      sh.above_mass = above_mass;
      if (b < 0) {
        sh.found = 0;
        sh.done = 1;
      } else {
        const uint32_t new_lo = lo + static_cast<uint32_t>(b) * width;
        const uint64_t new_hi = static_cast<uint64_t>(new_lo) + width - 1;
        sh.found = 1;
        sh.done = width == 1;
        sh.lo = new_lo;
        sh.hi = new_hi < hi ? static_cast<uint32_t>(new_hi) : hi;
        sh.eq_cnt = sh.cnt[0][b];
        sh.eq_mass = kWithMass ? sh.mass[0][b] : 0;
      }
    }
    __syncthreads();
    first = false;
    need = sh.need;
    above_cnt = sh.above_cnt;
    above_mass = sh.above_mass;
    if (sh.done) {
      SearchResult r{sh.found != 0, sh.lo, above_cnt, sh.eq_cnt, above_mass, sh.eq_mass, need};
      return r;
    }
    lo = sh.lo;
    hi = sh.hi;
  }
}

/// The id of the r-th (1-based) valid token, in id order, whose key is `key`.
template <typename T, typename U>
__device__ int nth_id(T const* row, int n, U const& u, uint32_t key, uint32_t r, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int tile = static_cast<int>(blockDim.x) * kIdTile;
  uint32_t seen = 0;
  for (int base = 0; base < n; base += tile) {
    const int i0 = base + static_cast<int>(threadIdx.x) * kIdTile;  // ids [i0, i0 + kIdTile)
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < kIdTile; ++j) {
      if (i0 + j < n) {
        const float v = load_raw(row, i0 + j);
        if (u.key(v) == key && u(v).valid) mine |= 1u << j;
      }
    }
    const int c = __popc(mine);
    // Exclusive prefix of c over the threads (thread order is id order).
    int incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    __syncthreads();
    if (lane == 31) sh.red_i[warp] = incl;
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < nwarps; ++w) {
      if (w < warp) before += sh.red_i[w];
      total += sh.red_i[w];
    }
    before += incl - c;
    if (seen + static_cast<uint32_t>(total) >= r) {  // uniform over the block
      if (threadIdx.x == 0) sh.id_result = kNoId;
      __syncthreads();
      uint32_t at = seen + static_cast<uint32_t>(before);
      for (int j = 0; j < kIdTile; ++j) {
        if ((mine >> j) & 1u) {
          if (++at == r) sh.id_result = i0 + j;
        }
      }
      __syncthreads();
      return sh.id_result;
    }
    seen += static_cast<uint32_t>(total);
  }
  return kNoId;  // r beyond the tie count: keep every tie
}

/// Resolves a search result into (key, id cut): kept = key > T, or key == T and id <= cut.
template <typename T, typename U>
__device__ int tie_cut(T const* row, int n, U const& u, uint32_t key, uint32_t r, uint32_t eq_cnt,
                       Shared& sh) {
  return r >= eq_cnt ? kNoId : nth_id(row, n, u, key, r, sh);
}

// ---------------------------------------------------------------- the draw
// Inverse CDF over the kept tokens in id order: the row's one uniform u gives the target
// floor(u * M), M the kept fixed-point mass, and the token is the first id whose running kept
// mass (id order, inclusive) exceeds it. The running mass is an exact integer sum, so the token
// depends only on the kept set, the weights and (seed, counter): never on how the row is split
// over threads or CTAs. Each token is drawn with probability wfp / M (wfp = w * 2^40 rounded).

/// The fixed-point weight of token i (value v) when kept, else 0. Kept: after the cut (key >
/// cut_key, or key == cut_key and id <= cut_id), weight > 0, and w >= min_p.
template <class U>
struct KeepT {
  U u;
  uint32_t cut_key;
  int cut_id;
  float min_p;
  __device__ __forceinline__ uint64_t operator()(int i, float v) const {
    const uint32_t k = u.key(v);
    if (k < cut_key || (k == cut_key && i > cut_id)) return 0;
    const Elem e = u(v);
    if (!(e.d >= -kZeroBelow)) return 0;  // weight 0 in fixed point (also -inf, NaN)
    if (min_p > 0.0f && !(e.w >= min_p)) return 0;
    return e.wfp;
  }
};
using Keep = KeepT<SampleUniverse>;

/// Ids per super-block for a range of n ids: a multiple of 1024, at most kMaxSB super-blocks.
__device__ __forceinline__ int sb_len(int n) {
  const int per = (n + kMaxSB - 1) / kMaxSB;
  return max(1024, (per + 1023) / 1024 * 1024);
}

__device__ uint64_t block_sum_u64(uint64_t v, Shared& sh) {
  v = warp_sum_u64(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.red_u[threadIdx.x >> 5] = v;
  __syncthreads();
  uint64_t r = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) r += sh.red_u[w];
  return r;
}

/// Exclusive prefix of v over the threads (thread order); `total` gets the block's sum.
__device__ uint64_t block_excl_u64(uint64_t v, uint64_t& total, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint64_t incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  __syncthreads();
  if (lane == 31) sh.red_u[warp] = incl;
  __syncthreads();
  uint64_t before = 0, tot = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
    const uint64_t x = sh.red_u[w];
    if (w < warp) before += x;
    tot += x;
  }
  total = tot;
  return before + incl - v;
}

/// The kept mass of each super-block of row[0, n) (ids offset + i) into sh.sb; returns the
/// total (every thread). One warp per super-block, 4 vector loads in flight per lane.
template <typename T, typename K>
__device__ uint64_t sb_masses(T const* row, int n, int offset, int SB, K const& keep, Shared& sh,
                              bool reverse = false) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kU = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = static_cast<int>(blockDim.x >> 5);
  const int nsb = (n + SB - 1) / SB;
  const bool aligned = reinterpret_cast<uintptr_t>(row) % 16 == 0;
  // NOTE: with `reverse` (the single-CTA kernel) the super-blocks go from the end of the row to its
  // start, the reverse of the pass before (for_each, ascending): the part read last is the
  // likeliest still in L2.
  for (int j0 = warp; j0 < nsb; j0 += nwarps) {
    const int j = reverse ? nsb - 1 - j0 : j0;
    const int b0 = j * SB, len = min(SB, n - b0);
    T const* src = row + b0;
    uint64_t s = 0;
    int start = 0;
    if (aligned) {
      uint4 const* gV = reinterpret_cast<uint4 const*>(src);
      const int nv = len / kVec;
      for (int v0 = lane; v0 < nv; v0 += 32 * kU) {
        uint4 q[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int vv = v0 + 32 * u;
          q[u] = vv < nv ? gV[vv] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int vv = v0 + 32 * u;
          if (vv < nv) {
            float r[kVec];
            unpack<T, kVec>(q[u], r);
#pragma unroll
            for (int e = 0; e < kVec; ++e) s += keep(offset + b0 + vv * kVec + e, r[e]);
          }
        }
      }
      start = nv * kVec;
    }
    for (int i = start + lane; i < len; i += 32) s += keep(offset + b0 + i, load_raw(src, i));
    s = warp_sum_u64(s);
    if (lane == 0) sh.sb[j] = s;
  }
  __syncthreads();
  uint64_t t = 0;
  for (int j = threadIdx.x; j < nsb; j += blockDim.x) t += sh.sb[j];
  return block_sum_u64(t, sh);
}

/// The id (offset + i) of the kept token of row[0, n) at which the running kept mass (id
/// order) first exceeds `target` (< the total of the sb_masses() call whose sh.sb it reads).
/// kNoId only if the two disagree (never).
template <typename T, typename K>
__device__ int sb_find(T const* row, int n, int offset, int SB, K const& keep, uint64_t target,
                       Shared& sh) {
  const int nsb = (n + SB - 1) / SB;
  __syncthreads();
  if (threadIdx.x < 32) {
    constexpr int kPer = kMaxSB / 32;
    const int lane = static_cast<int>(threadIdx.x);
    if (lane == 0) {
      sh.find_id = kNoId;
      sh.find_j = 0;
      sh.find_r = 0;
    }
    uint64_t c = 0;
    for (int e = 0; e < kPer; ++e) {
      const int j = lane * kPer + e;
      if (j < nsb) c += sh.sb[j];
    }
    uint64_t incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint64_t t = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += t;
    }
    __syncwarp();
    const uint64_t excl = incl - c;
    if (excl <= target && target < incl) {  // exactly one lane
      uint64_t acc = excl;
      int j = lane * kPer;
      for (; j < lane * kPer + kPer - 1; ++j) {
        if (target < acc + sh.sb[j]) break;
        acc += sh.sb[j];
      }
      sh.find_j = j;
      sh.find_r = target - acc;
    }
  }
  __syncthreads();
  const int j = sh.find_j;
  const uint64_t r = sh.find_r;
  const int b0 = j * SB, len = min(SB, n - b0);
  const int per = (len + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int i0 = static_cast<int>(threadIdx.x) * per, i1 = min(len, i0 + per);
  uint64_t mine = 0;
  for (int i = i0; i < i1; ++i) mine += keep(offset + b0 + i, load_raw(row, b0 + i));
  uint64_t total = 0;
  const uint64_t before = block_excl_u64(mine, total, sh);
  if (before <= r && r < before + mine) {  // exactly one thread
    uint64_t acc = before;
    for (int i = i0; i < i1; ++i) {
      acc += keep(offset + b0 + i, load_raw(row, b0 + i));
      if (acc > r) {
        sh.find_id = offset + b0 + i;
        break;
      }
    }
  }
  __syncthreads();
  const int id = sh.find_id;
  __syncthreads();
  return id;
}

// ---------------------------------------------------------------- the fine cut
// The cut of top-k / top-p (the same (cut_key, cut_id) as search() + tie_cut()) from two
// passes: a histogram of count (and mass) over kFineBins equal-width bins of d = x - m in
// [-kZeroBelow, 0] (no token below has mass, so the top-p cut is always in range, and a top-k
// cut below the range keeps every token that has mass), then a gather of the tokens of the bins
// the cut can fall in, sorted by (key desc, id asc) in shared memory. The bin of a token is a
// monotone function of its key, so a bin holds a contiguous key range and ties share a bin.

/// NOTE: t = (d + kZeroBelow) * kFineScale is in [0, 2^23), where t + 2^23 rounded toward
/// zero is 2^23 + floor(t): the truncation of static_cast<int>(t) on the FP32 pipe instead of an
/// F2I (the conversion pipe, 1/8 of the FP32 rate, which expf and the fixed-point weight use).
__device__ __forceinline__ int fine_bin(float d) {  // d in [-kZeroBelow, 0]
  const float t = (d + kZeroBelow) * kFineScale;
  return min(kFineBins - 1, __float_as_int(__fadd_rz(t, 8388608.0f)) - 0x4b000000);
}

/// The weight of a gathered token from its key: the same float operations as SampleUniverse.
__device__ __forceinline__ uint64_t wfp_of_key(uint32_t key, float m) {
  const float x = __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
  const float d = x - m;
  const float w = d < -87.0f ? 0.0f : expf(d);
  return __float2ull_rn(w * kMassScale);
}

__device__ __forceinline__ uint64_t need_of(float p, uint64_t mass) {
  const uint64_t need =
      static_cast<uint64_t>(ceil(static_cast<double>(p) * static_cast<double>(mass)));
  return need == 0 ? 1 : need;
}

struct BinPick {
  int b;           // the largest bin with A(bins >= b) >= need; -1: none
  uint64_t above;  // A(bins > b)
};

/// Warp 0 (all 32 lanes): the bin where the count (or mass) from the top reaches `need`.
/// Lane l owns bins [64 l, 64 l + 64).
__device__ BinPick pick_bin(bool by_mass, uint64_t need, Shared& sh) {
  constexpr int kPer = kFineBins / 32;
  uint32_t const* cnt = &sh.cnt[0][0];
  unsigned long long const* mass = &sh.mass[0][0];
  const int lane = static_cast<int>(threadIdx.x & 31);
  uint64_t own = 0;
  for (int e = 0; e < kPer; ++e) {
    const int b = lane * kPer + e;
    own += by_mass ? static_cast<uint64_t>(mass[b]) : static_cast<uint64_t>(cnt[b]);
  }
  uint64_t suf = own;  // inclusive suffix over lanes [lane, 32): non-increasing in lane
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t t = __shfl_down_sync(0xffffffffu, suf, o);
    if (lane + o < 32) suf += t;
  }
  const unsigned ok = __ballot_sync(0xffffffffu, suf >= need);
  if (ok == 0u) return {-1, 0};
  const int L = 31 - __clz(ok);
  int b = -1;
  uint64_t above = 0;
  if (lane == L) {
    uint64_t a = suf - own;
    for (int e = kPer - 1; e >= 0; --e) {
      const int bb = L * kPer + e;
      const uint64_t x = by_mass ? static_cast<uint64_t>(mass[bb]) : static_cast<uint64_t>(cnt[bb]);
      if (a + x >= need) {
        b = bb;
        break;
      }
      a += x;
    }
    above = a;
  }
  b = __shfl_sync(0xffffffffu, b, L);
  above = __shfl_sync(0xffffffffu, above, L);
  return {b, above};
}

/// The histogram pass: count (and fixed-point mass) per fine bin.
/// NOTE: a 64-bit shared atomicAdd is a compare-and-swap loop in SASS (ATOMS.CAST.SPIN.64);
/// the mass goes in as two 32-bit halves instead (native ATOMS.ADD): the low word, whose
/// wrap-around the adding thread sees in the old value and carries into the high word, which
/// most tokens (w < 2^-8) leave alone. The sums are the same exact integers.
template <bool kWithMass, typename T>
__device__ void fine_hist(T const* row, int n, SampleUniverseT<true> const& u, Shared& sh) {
  static_assert(sizeof(sh.mass) == 2 * kFineBins * sizeof(uint32_t));
  uint32_t* cnt = &sh.cnt[0][0];
  unsigned long long* mass = &sh.mass[0][0];
  __syncthreads();
  for (int j = threadIdx.x; j < kFineBins; j += blockDim.x) {
    cnt[j] = 0;
    if (kWithMass) mass[j] = 0;
  }
  __syncthreads();
  uint32_t* mlo = reinterpret_cast<uint32_t*>(mass);  // [kFineBins] low words, then high words
  uint32_t* mhi = mlo + kFineBins;
  for_each<true>(row, n, [&](int, float v) {  // the reverse of the stats pass
    const Elem e = u(v);
    if (!(e.d >= -kZeroBelow)) return;
    const int b = fine_bin(e.d);
    atomicAdd(&cnt[b], 1u);
    if (kWithMass) {
      const uint32_t lw = static_cast<uint32_t>(e.wfp);
      const uint32_t old = atomicAdd(&mlo[b], lw);
      const uint32_t hw = static_cast<uint32_t>(e.wfp >> 32) + (old + lw < old ? 1u : 0u);
      if (hw != 0) atomicAdd(&mhi[b], hw);
    }
  });
  __syncthreads();
  if (kWithMass) {  // the halves back into 64-bit bins, in place (read all, then write)
    constexpr int kPer = (kFineBins + kThreads - 1) / kThreads;
    unsigned long long m[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int j = static_cast<int>(threadIdx.x) + e * static_cast<int>(blockDim.x);
      m[e] = j < kFineBins ? (static_cast<unsigned long long>(mhi[j]) << 32) | mlo[j] : 0ull;
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int j = static_cast<int>(threadIdx.x) + e * static_cast<int>(blockDim.x);
      if (j < kFineBins) mass[j] = m[e];
    }
    __syncthreads();
  }
}

/// The draw pass of a cut row fused with the gather: returns the weight of the tokens above
/// the gathered bins (kept whatever the cut inside them, min_p applied), 0 for the others, and
/// appends the tokens of bins [lo, hi] to sh.g_sort.
struct GatherKeep {
  SampleUniverseT<true> u;
  int lo, hi;
  float min_p;
  Shared* sh;
  // NOTE: the weight (expf, the 64-bit conversion) only for the tokens above the gathered bins:
  // under a top-k cut that is almost none. The same floats as SampleUniverse (d >= -28.5 here,
  // so expf(d) is its weight).
  __device__ __forceinline__ uint64_t operator()(int i, float v) const {
    const float x = u.scaled(v);
    const float d = u.m == INFINITY ? (x == INFINITY ? 0.0f : -INFINITY) : x - u.m;
    if (!(d >= -kZeroBelow)) return 0;
    const int b = fine_bin(d);
    if (b > hi) {
      const float w = expf(d);
      return (min_p > 0.0f && !(w >= min_p)) ? 0 : __float2ull_rn(w * kMassScale);
    }
    if (b >= lo) {
      const int slot = atomicAdd(&sh->n_gathered, 1);
      if (slot < kGatherCap)
        sh->g_sort[slot] = (static_cast<unsigned long long>(ordkey(x)) << 32) |
                           static_cast<unsigned long long>(0xffffffffu - static_cast<uint32_t>(i));
    }
    return 0;
  }
};

/// The top-k / top-p cut by the fine bins (see above); m finite. False when the gather would
/// exceed kGatherCap (the caller then runs search()).
/// With `masses` (state 1, the usual case) the gather pass is also the draw's mass pass: on
/// return sh.sb holds the kept mass per super-block of SB ids (as sb_masses() with Keep{u,
/// cut_key, cut_id, min_p}) and *masses is set; otherwise the caller runs sb_masses().
template <typename T>
__device__ bool fine_cut(T const* row, int n, SampleUniverseT<true> const& u,
                         SamplingRowParams const& rp, bool use_k, bool use_p, uint32_t& cut_key,
                         int& cut_id, int SB, bool& masses, Shared& sh) {
  masses = false;
  if (use_p) {
    fine_hist<true>(row, n, u, sh);
  } else {
    fine_hist<false>(row, n, u, sh);
  }
  uint32_t const* cnt = &sh.cnt[0][0];
  unsigned long long const* mass = &sh.mass[0][0];
  const uint64_t k = use_k ? static_cast<uint64_t>(rp.top_k) : 0;
  if (threadIdx.x < 32) {
    constexpr int kPer = kFineBins / 32;
    const int lane = static_cast<int>(threadIdx.x);
    int bk = -1, lo = 0, hi = -1;
    uint64_t tmass = 0;
    if (use_p) {
      for (int e = 0; e < kPer; ++e) tmass += mass[lane * kPer + e];
      tmass = warp_sum_u64(tmass);
    }
    if (use_k) bk = pick_bin(false, k, sh).b;  // -1: fewer than k tokens with mass
    if (use_p) {
      uint64_t need_lo, need_hi;
      if (bk >= 0) {
        uint64_t am = 0;  // mass of the bins above bk
        for (int e = 0; e < kPer; ++e) {
          const int b = lane * kPer + e;
          if (b > bk) am += mass[b];
        }
        am = warp_sum_u64(am);
        need_lo = need_of(rp.top_p, am);
        need_hi = need_of(rp.top_p, am + mass[bk]);
      } else {
        need_lo = need_hi = need_of(rp.top_p, tmass);
      }
      const int b_hi = pick_bin(true, need_lo, sh).b;
      const int b_lo = pick_bin(true, need_hi, sh).b;
      lo = bk >= 0 ? bk : b_lo;
      hi = max(b_hi, lo);
    } else if (bk >= 0) {
      lo = hi = bk;
    }
    uint64_t ac = 0, am = 0, gc = 0;
    for (int e = 0; e < kPer; ++e) {
      const int b = lane * kPer + e;
      if (b > hi) {
        ac += cnt[b];
        if (use_p) am += mass[b];
      } else if (b >= lo) {
        gc += cnt[b];
      }
    }
    ac = warp_sum_u64(ac);
    am = warp_sum_u64(am);
    gc = warp_sum_u64(gc);
    if (lane == 0) {
      sh.f_state = hi < 0 || lo < 0 ? 0 : (gc > static_cast<uint64_t>(kGatherCap) ? 2 : 1);
      sh.f_lo = lo;
      sh.f_hi = hi;
      sh.f_bk = bk;
      sh.f_acnt = ac;
      sh.f_amass = am;
      sh.f_tmass = tmass;
      sh.f_jcut = -1;
      sh.f_massk = 0;
      sh.n_gathered = 0;
    }
  }
  __syncthreads();
  const int state = sh.f_state, lo = sh.f_lo, hi = sh.f_hi, bk = sh.f_bk;
  const uint64_t acnt = sh.f_acnt, amass = sh.f_amass, tmass = sh.f_tmass;
  if (state == 2) return false;
  if (state == 0) {  // a top-k cut below the range, no top-p: every token with mass is kept
    cut_key = 0;
    cut_id = kNoId;
    return true;
  }
  // The gather, and the kept mass of the tokens above the gathered bins per super-block.
  (void)sb_masses(row, n, 0, SB, GatherKeep{{u.temp, u.m}, lo, hi, rp.min_p, &sh}, sh,
                  /*reverse=*/false);
  const int G = min(sh.n_gathered, kGatherCap);
  int np = 1;
  while (np < G) np <<= 1;
  for (int j = G + static_cast<int>(threadIdx.x); j < np; j += blockDim.x) sh.g_sort[j] = 0;
  __syncthreads();
  // Bitonic sort, descending.
  for (int k2 = 2; k2 <= np; k2 <<= 1) {
    for (int j2 = k2 >> 1; j2 > 0; j2 >>= 1) {
      for (int i = threadIdx.x; i < np; i += blockDim.x) {
        const int ixj = i ^ j2;
        if (ixj > i) {
          const unsigned long long a = sh.g_sort[i], b = sh.g_sort[ixj];
          if ((i & k2) == 0 ? a < b : a > b) {
            sh.g_sort[i] = b;
            sh.g_sort[ixj] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  // Running mass over the sorted tokens: thread t owns [t per, t per + per).
  const int per = (np + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int j0 = static_cast<int>(threadIdx.x) * per, j1 = min(G, j0 + per);
  uint64_t mine = 0;
  for (int j = j0; j < j1; ++j) mine += wfp_of_key(static_cast<uint32_t>(sh.g_sort[j] >> 32), u.m);
  uint64_t gtotal = 0;
  const uint64_t before = block_excl_u64(mine, gtotal, sh);
  const int jk = bk >= 0 ? static_cast<int>(k - 1 - acnt) : -1;  // the k-th token
  int jc = jk;
  if (use_p) {
    uint64_t need;
    if (bk >= 0) {
      if (jk >= j0 && jk < j1) {
        uint64_t acc = before;
        for (int j = j0; j <= jk; ++j)
          acc += wfp_of_key(static_cast<uint32_t>(sh.g_sort[j] >> 32), u.m);
        sh.f_massk = amass + acc;
      }
      __syncthreads();
      need = need_of(rp.top_p, sh.f_massk);
    } else {
      need = need_of(rp.top_p, tmass);
    }
    // The first sorted token at which the mass from the top reaches `need`.
    if (amass + before < need && need <= amass + before + mine) {
      uint64_t acc = amass + before;
      for (int j = j0; j < j1; ++j) {
        acc += wfp_of_key(static_cast<uint32_t>(sh.g_sort[j] >> 32), u.m);
        if (acc >= need) {
          sh.f_jcut = j;
          break;
        }
      }
    }
    __syncthreads();
    jc = sh.f_jcut;
  }
  if (jc < 0 || jc >= G) return false;  // defensive: the histogram and the gather disagree
  const unsigned long long c = sh.g_sort[jc];
  cut_key = static_cast<uint32_t>(c >> 32);
  cut_id = static_cast<int>(0xffffffffu - static_cast<uint32_t>(c & 0xffffffffu));
  // The gathered tokens the cut keeps (sorted positions <= jc) join their super-blocks' mass.
  for (int j = threadIdx.x; j <= jc; j += blockDim.x) {
    const unsigned long long g = sh.g_sort[j];
    const uint32_t key = static_cast<uint32_t>(g >> 32);
    const int id = static_cast<int>(0xffffffffu - static_cast<uint32_t>(g & 0xffffffffu));
    const float x = __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
    const float d = x - u.m;
    const float w = d < -87.0f ? 0.0f : expf(d);
    if (rp.min_p > 0.0f && !(w >= rp.min_p)) continue;
    const uint64_t wfp = __float2ull_rn(w * kMassScale);
    if (wfp != 0) atomicAdd(&sh.sb[id / SB], static_cast<unsigned long long>(wfp));
  }
  __syncthreads();
  masses = true;
  return true;
}

// ---------------------------------------------------------------- the kernel
template <typename T>
__global__ void __launch_bounds__(kThreads) sample_kernel(SampleParams p) {
  __shared__ Shared sh;
  const int64_t row_idx = blockIdx.x;
  const int n = static_cast<int>(p.vocab);
  T const* row = static_cast<T const*>(p.logits) + row_idx * p.vocab;
  const SamplingRowParams rp = p.row_params[row_idx];
  const bool want_top = rp.n_top > 0 && p.top_ids != nullptr && p.top_logprobs != nullptr;
  const bool want_lp = rp.want_logprob != 0 && p.logprobs != nullptr;
  const bool want_lse = want_top || want_lp;

  // 1. stats: argmax (each thread visits its ids in increasing order, so a strict > keeps the
  // lowest id of a tie; NaN never compares greater), and the log-sum-exp when asked for.
  float rmax = -INFINITY, lm = -INFINITY, ls = 0.f;
  int rarg = kNoId;
  if (want_lse) {
    for_each(row, n, [&](int i, float v) {
      if (v > rmax) {
        rmax = v;
        rarg = i;
      }
      if (v > -INFINITY) {  // not NaN or -inf
        if (v > lm) {
          ls = (lm == -INFINITY ? 0.f : ls * expf(lm - v)) + 1.0f;
          lm = v;
        } else {
          ls += expf(v - lm);
        }
      }
    });
  } else {
    for_each(row, n, [&](int i, float v) {
      if (v > rmax) {
        rmax = v;
        rarg = i;
      }
    });
  }
  block_argmax(rmax, rarg, sh);
  float lse = NAN;
  if (want_lse) {
    const float gm = block_max(lm, sh);
    const float part = (lm == -INFINITY || isinf(gm)) ? 0.f : ls * expf(lm - gm);
    const float s = block_sumf(part, sh);
    lse = isinf(gm) ? gm : gm + logf(s);
  }

  // 2-3. the token
  int token = rarg;
  const float m = rmax / rp.temperature;
  if (!(rp.temperature < kGreedyBelow) && m > -INFINITY) {
    const SampleUniverseT<true> u{rp.temperature, m};
    const uint32_t klo = 0, khi = ordkey(m);  // any range holding every valid key
    uint32_t cut_key = 0;
    int cut_id = kNoId;
    const bool use_k = rp.top_k > 0 && rp.top_k < n;
    const bool use_p = rp.top_p < 1.0f;
    const int SB = sb_len(n);
    bool masses = false;  // sh.sb already holds the kept masses (fine_cut's fused pass)
    if ((use_k || use_p) &&
        !(m < INFINITY && fine_cut(row, n, u, rp, use_k, use_p, cut_key, cut_id, SB, masses, sh))) {
      masses = false;
      cut_key = 0;
      cut_id = kNoId;
      bool cut = false;
      uint32_t r_cut = 0, eq_cut = 0, lo = klo;
      uint64_t mass_k = 0;
      if (use_k) {
        const SearchResult s =
            search<false, true>(row, n, u, klo, khi, static_cast<uint64_t>(rp.top_k), 0.f, sh);
        if (s.found) {
          cut = true;
          cut_key = s.key;
          r_cut = static_cast<uint32_t>(rp.top_k) - s.above_cnt;
          eq_cut = s.eq_cnt;
          mass_k = s.above_mass + r_cut * (s.eq_mass / s.eq_cnt);
          lo = s.key;
        } else {
          mass_k = s.above_mass;  // every token with weight: the total
        }
      }
      if (use_p) {
        uint64_t need = 0;
        float frac = rp.top_p;
        if (use_k) {
          need = need_of(rp.top_p, mass_k);
          frac = 0.f;
        }
        const SearchResult s = search<true, true>(row, n, u, lo, khi, need, frac, sh);
        if (s.found) {
          const uint64_t w_tie = s.eq_mass / s.eq_cnt;  // tied tokens weigh the same
          const uint64_t rem = s.need - s.above_mass;   // > 0, else a higher bin was chosen
          uint64_t r = w_tie > 0 ? (rem + w_tie - 1) / w_tie : s.eq_cnt;
          r = r < 1 ? 1 : (r > s.eq_cnt ? s.eq_cnt : r);
          if (cut && s.key == cut_key && r > r_cut) r = r_cut;
          cut = true;
          cut_key = s.key;
          r_cut = static_cast<uint32_t>(r);
          eq_cut = s.eq_cnt;
        }
      }
      if (cut) cut_id = tie_cut(row, n, u, cut_key, r_cut, eq_cut, sh);
    }
    // The draw over the kept tokens. Nothing kept (min_p > 1): the argmax, as the CPU.
    const KeepT<SampleUniverseT<true>> keep{u, cut_key, cut_id, rp.min_p};
    uint64_t total = 0;
    if (masses) {
      const int nsb = (n + SB - 1) / SB;
      uint64_t t = 0;
      for (int j = threadIdx.x; j < nsb; j += blockDim.x) t += sh.sb[j];
      total = block_sum_u64(t, sh);
    } else {
      total = sb_masses(row, n, 0, SB, keep, sh, /*reverse=*/true);
    }
    if (total > 0) {
      const int id = sb_find(row, n, 0, SB, keep, draw_target(rp.seed, rp.counter, total), sh);
      if (id != kNoId) token = id;
    }
  }
  if (token == kNoId) token = 0;  // everything NaN / -inf: token 0, as the CPU

  if (threadIdx.x == 0) {
    p.tokens[row_idx] = token;
    if (p.logprobs != nullptr) p.logprobs[row_idx] = want_lp ? load_raw(row, token) - lse : NAN;
  }

  // 4. top-n logprobs
  if (p.top_ids == nullptr || p.top_logprobs == nullptr) return;
  int32_t* gIds = p.top_ids + row_idx * kMaxTopLogprobs;
  float* gLp = p.top_logprobs + row_idx * kMaxTopLogprobs;
  int nt = 0;
  if (want_top) {
    nt = rp.n_top < kMaxTopLogprobs ? rp.n_top : kMaxTopLogprobs;
    nt = nt < n ? nt : n;
    const LogprobUniverse u{lse};
    const uint32_t klo = 0, khi = 0xffffffffu;  // the full key range is always right
    const SearchResult s =
        search<false, false>(row, n, u, klo, khi, static_cast<uint64_t>(nt), 0.f, sh);
    uint32_t cut_key = 0;
    int cut_id = kNoId;
    if (s.found) {
      cut_key = s.key;
      cut_id = tie_cut(row, n, u, s.key, static_cast<uint32_t>(nt) - s.above_cnt, s.eq_cnt, sh);
    }
    __syncthreads();
    if (threadIdx.x == 0) sh.n_gathered = 0;
    __syncthreads();
    for_each(row, n, [&](int i, float v) {
      const uint32_t k = u.key(v);
      if (k > cut_key || (k == cut_key && i <= cut_id)) {
        const int slot = atomicAdd(&sh.n_gathered, 1);
        if (slot < kMaxTopLogprobs) {
          sh.g_key[slot] = k;
          sh.g_id[slot] = i;
        }
      }
    });
    __syncthreads();
    if (threadIdx.x == 0) {
      const int g = sh.n_gathered < nt ? sh.n_gathered : nt;
      // Insertion sort of <= 20 by (key desc, id asc).
      for (int a = 1; a < g; ++a) {
        const uint32_t k = sh.g_key[a];
        const int id = sh.g_id[a];
        int b = a - 1;
        while (b >= 0 && (sh.g_key[b] < k || (sh.g_key[b] == k && sh.g_id[b] > id))) {
          sh.g_key[b + 1] = sh.g_key[b];
          sh.g_id[b + 1] = sh.g_id[b];
          --b;
        }
        sh.g_key[b + 1] = k;
        sh.g_id[b + 1] = id;
      }
      nt = g;
      sh.n_gathered = g;
    }
    __syncthreads();
    nt = sh.n_gathered;
    if (static_cast<int>(threadIdx.x) < nt) {
      const int id = sh.g_id[threadIdx.x];
      gIds[threadIdx.x] = id;
      gLp[threadIdx.x] = load_raw(row, id) - lse;
    }
  }
  for (int j = nt + static_cast<int>(threadIdx.x); j < kMaxTopLogprobs; j += blockDim.x) {
    gIds[j] = -1;
    gLp[j] = -INFINITY;
  }
}

// ---------------------------------------------------------------- the multi-CTA path
// Each row is split over S CTAs (blockIdx.x = row * S + slice), each over a contiguous slice
// of the vocabulary (a multiple of 64 ids). The CTAs of a row meet at row barriers (an
// arrival counter in the workspace; the grid is capped at the resident CTAs, so they all run at
// once) and every decision is made by each CTA from the same global data, so they all take the
// same branches:
//   - stats: per-slice partials (argmax, mins, log-sum-exp), combined in a fixed order;
//   - each histogram level: per-CTA shared histogram, then integer atomics into the row's
//     global histogram (exact, so the same sums as the single-CTA path), barrier, then the
//     same bin choice as the single-CTA path;
//   - a tie at the cut: per-slice counts, then the slice holding the r-th tie finds its id;
//     the other slices keep all (earlier r) or none (later r) of their ties;
//   - the draw: per-slice kept masses, prefix over the slices in slice order (exact integers),
//     then the slice that holds the target finds the token in its slice: the same token;
//   - top-n: the kept (<= 20) tokens are appended to a per-row list, sorted by slice 0.
// Histograms rotate over 3 buffers: level L adds into buf[L % 3]; after its barrier slice 0
// zeroes buf[(L + 2) % 3] (last read before that barrier, next added to after the next one).
constexpr int kMaxSlices = 64;
constexpr int kSliceAlign = 64;  // ids; keeps 16-byte loads aligned
constexpr int kMultiThreads = 256;
constexpr int kMultiMinBlocks = 3;  // per SM: <= 80 registers

struct SlicePart {
  float rmax;
  int rarg;
  float rmin_all, rmin_fin, lm, ls;
  uint32_t tie[2];
  unsigned long long kept;  // the slice's kept mass (the draw)
};

struct RowHeader {  // zeroed by sample_launch before every kernel
  uint32_t arrived;
  uint32_t gathered;
  uint32_t pad[14];
};
static_assert(sizeof(RowHeader) == 64);

struct RowWork {
  unsigned long long mass[3][kBins];
  uint32_t cnt[3][kBins];
  uint32_t g_key[kMaxTopLogprobs];
  int g_id[kMaxTopLogprobs];
  SlicePart part[kMaxSlices];
};

struct Ctx {
  RowHeader* hdr;
  RowWork* ws;
  int S, slice, b0, nloc;
  uint32_t nbar;  // barriers passed
  int lvl;        // histogram levels done
};

__device__ __forceinline__ uint32_t ld_acquire(uint32_t const* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// All CTAs of the row: writes before it (by any of them) are visible after it (read them with
/// __ldcg or atomics: L1 is not coherent).
__device__ __forceinline__ void row_barrier(Ctx& c) {
  __syncthreads();
  ++c.nbar;
  if (c.S > 1 && threadIdx.x == 0) {
    __threadfence();
    atomicAdd(&c.hdr->arrived, 1u);
    const uint32_t target = c.nbar * static_cast<uint32_t>(c.S);
    // The grid is capped at the resident CTAs, so the wait is short; should the row's CTAs
    // ever not be co-resident, trap after ~2 s rather than hang the stream.
    uint64_t t0 = 0;
    for (uint32_t polls = 1; ld_acquire(&c.hdr->arrived) < target; ++polls) {
      if ((polls & 1023u) == 0) {
        const uint64_t now = globaltimer_ns();
        if (t0 == 0) {
          t0 = now;
        } else if (now - t0 > 2000000000ull) {
          __trap();
        }
      }
    }
    __threadfence();
  }
  __syncthreads();
}

/// search() over the row's slices (same arguments, same result in every CTA of the row).
template <bool kByMass, bool kWithMass, typename T, typename U>
__device__ SearchResult search_multi(T const* srow, int nloc, U const& u, uint32_t lo, uint32_t hi,
                                     uint64_t need, float frac, Shared& sh, Ctx& c) {
  uint32_t above_cnt = 0;
  uint64_t above_mass = 0;
  bool first = true;
  for (;;) {
    const uint32_t width = static_cast<uint32_t>((static_cast<uint64_t>(hi) - lo) / kBins + 1);
    __syncthreads();
    for (int j = threadIdx.x; j < kHistCopies * kBins; j += blockDim.x) {
      (&sh.cnt[0][0])[j] = 0;
      if (kWithMass) (&sh.mass[0][0])[j] = 0;
    }
    __syncthreads();
    const int copy = (threadIdx.x >> 5) & (kHistCopies - 1);
    const int lane = threadIdx.x & 31;
    for_each_uniform(srow, nloc, [&](bool ok, int, float v) {
      int b = -1;
      uint64_t wfp = 0;
      if (ok) {
        const uint32_t k = u.key(v);
        if (k >= lo && k <= hi) {
          const Elem e = u(v);
          if (e.valid) {
            b = static_cast<int>((e.key - lo) / width);
            wfp = e.wfp;
          }
        }
      }
      if (__ballot_sync(0xffffffffu, b >= 0) == 0) return;
      const unsigned peers = __match_any_sync(0xffffffffu, b);
      const unsigned leaders = __ballot_sync(0xffffffffu, (peers & ((1u << lane) - 1u)) == 0u);
      if (__popc(leaders) <= 8) {
        for (unsigned todo = leaders; todo != 0; todo &= todo - 1u) {
          const int l = __ffs(todo) - 1;
          const int gb = __shfl_sync(0xffffffffu, b, l);
          uint64_t sum = 0;
          if (kWithMass) sum = warp_sum_u64(((peers >> l) & 1u) ? wfp : 0);
          if (lane == l && gb >= 0) {
            atomicAdd(&sh.cnt[copy][gb], static_cast<uint32_t>(__popc(peers)));
            if (kWithMass) atomicAdd(&sh.mass[copy][gb], static_cast<unsigned long long>(sum));
          }
        }
      } else if (b >= 0) {
        atomicAdd(&sh.cnt[copy][b], 1u);
        if (kWithMass) atomicAdd(&sh.mass[copy][b], static_cast<unsigned long long>(wfp));
      }
    });
    __syncthreads();
    const int buf = c.lvl % 3;
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
      uint32_t cn = 0;
      unsigned long long ms = 0;
      for (int k = 0; k < kHistCopies; ++k) {
        cn += sh.cnt[k][j];
        if (kWithMass) ms += sh.mass[k][j];
      }
      if (cn != 0) atomicAdd(&c.ws->cnt[buf][j], cn);
      if (kWithMass && ms != 0) atomicAdd(&c.ws->mass[buf][j], ms);
    }
    row_barrier(c);
    if (c.slice == 0) {
      const int zb = (c.lvl + 2) % 3;
      for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
        c.ws->cnt[zb][j] = 0;
        c.ws->mass[zb][j] = 0;
      }
    }
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
      sh.cnt[0][j] = __ldcg(&c.ws->cnt[buf][j]);
      if (kWithMass) sh.mass[0][j] = __ldcg(&c.ws->mass[buf][j]);
    }
    ++c.lvl;
    __syncthreads();
    // The bin choice of search(), by warp 0: lane l owns bins [8 l, 8 l + 8); the suffix sums
    // over the lanes find the lane that holds the largest bin b with A(key >= bin b) >= need
    // (the suffix is non-increasing in b; bins past nbins are empty), then that lane walks its
    // 8 bins from the top exactly as search() does.
    if (threadIdx.x < 32) {
      const int lane = static_cast<int>(threadIdx.x);
      uint32_t c8 = 0;
      unsigned long long m8 = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c8 += sh.cnt[0][8 * lane + j];
        if (kWithMass) m8 += sh.mass[0][8 * lane + j];
      }
      if (first && kByMass && frac > 0.0f) {
        const unsigned long long total = warp_sum_u64(m8);
        need = static_cast<uint64_t>(ceil(static_cast<double>(frac) * static_cast<double>(total)));
        if (need == 0) need = 1;
      }
      uint32_t sc = c8;  // inclusive suffix over lanes [lane, 32)
      unsigned long long sm = m8;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t tc = __shfl_down_sync(0xffffffffu, sc, o);
        const unsigned long long tm = __shfl_down_sync(0xffffffffu, sm, o);
        if (lane + o < 32) {
          sc += tc;
          sm += tm;
        }
      }
      const uint64_t suffix = kByMass ? above_mass + sm : above_cnt + sc;
      const unsigned ok = __ballot_sync(0xffffffffu, suffix >= need);
      if (ok == 0u) {
        if (lane == 0) {
          sh.need = need;
          sh.above_cnt = above_cnt + sc;
          sh.above_mass = above_mass + (kWithMass ? sm : 0ull);
          sh.found = 0;
          sh.done = 1;
        }
      } else if (lane == 31 - __clz(ok)) {
        uint32_t a_cnt = above_cnt + (sc - c8);
        uint64_t a_mass = above_mass + (kWithMass ? sm - m8 : 0ull);
        int b = 8 * lane + 7;
        for (; b > 8 * lane; --b) {
          const uint64_t a = kByMass ? a_mass + sh.mass[0][b] : a_cnt + sh.cnt[0][b];
          if (a >= need) break;
          a_cnt += sh.cnt[0][b];
          if (kWithMass) a_mass += sh.mass[0][b];
        }
        sh.need = need;
        sh.above_cnt = a_cnt;
        sh.above_mass = a_mass;
        const uint32_t new_lo = lo + static_cast<uint32_t>(b) * width;
        const uint64_t new_hi = static_cast<uint64_t>(new_lo) + width - 1;
        sh.found = 1;
        // Count-only searches (top-n logprobs) also stop when the whole bin is kept: the result
        // then reads "key >= new_lo, eq_cnt tokens at the cut, all kept" (r = eq_cnt), the
        // same kept set as narrowing down to the last key. (Not with masses: top-k's tie
        // weight eq_mass / eq_cnt feeds top-p and must be the weight of one key.)
        sh.done = width == 1 || (!kWithMass && a_cnt + sh.cnt[0][b] == need);
        sh.lo = new_lo;
        sh.hi = new_hi < hi ? static_cast<uint32_t>(new_hi) : hi;
        sh.eq_cnt = sh.cnt[0][b];
        sh.eq_mass = kWithMass ? sh.mass[0][b] : 0;
      }
    }
    __syncthreads();
    first = false;
    need = sh.need;
    above_cnt = sh.above_cnt;
    above_mass = sh.above_mass;
    if (sh.done) {
      SearchResult r{sh.found != 0, sh.lo, above_cnt, sh.eq_cnt, above_mass, sh.eq_mass, need};
      return r;
    }
    lo = sh.lo;
    hi = sh.hi;
  }
}

/// Sum over the block of a uint32 (every thread gets it).
__device__ uint32_t block_sum_u32(uint32_t v, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh.red_i[threadIdx.x >> 5] = static_cast<int>(v);
  __syncthreads();
  uint32_t r = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w)
    r += static_cast<uint32_t>(sh.red_i[w]);
  return r;
}

/// tie_cut() over the slices, as seen by this slice: an id cut that keeps exactly the tied
/// tokens of this slice that the single-CTA cut keeps (b0 - 1: none, kNoId: all).
template <typename T, typename U>
__device__ int tie_cut_multi(T const* srow, int nloc, U const& u, uint32_t key, uint32_t r,
                             uint32_t eq_cnt, int which, Shared& sh, Ctx& c) {
  if (r >= eq_cnt) return kNoId;  // uniform over the row
  uint32_t mine = 0;
  for_each(srow, nloc, [&](int, float v) {
    if (u.key(v) == key && u(v).valid) ++mine;
  });
  mine = block_sum_u32(mine, sh);
  if (threadIdx.x == 0) c.ws->part[c.slice].tie[which] = mine;
  row_barrier(c);
  // Ties in the slices before this one.
  uint32_t before = 0;
  if (threadIdx.x < 32) {
    for (int s = static_cast<int>(threadIdx.x); s < c.slice; s += 32)
      before += __ldcg(&c.ws->part[s].tie[which]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) before += __shfl_xor_sync(0xffffffffu, before, o);
    if (threadIdx.x == 0) sh.above_cnt = before;
  }
  __syncthreads();
  before = sh.above_cnt;
  __syncthreads();
  if (r <= before) return c.b0 - 1;
  if (r > before + mine) return kNoId;
  const int id = nth_id(srow, nloc, u, key, r - before, sh);  // uniform over the block
  return id == kNoId ? kNoId : id + c.b0;
}

template <typename T>
__global__ void __launch_bounds__(kMultiThreads, kMultiMinBlocks)
    sample_multi_kernel(SampleParams p, int S, int slice_len) {
  __shared__ Shared sh;
  const int64_t row_idx = blockIdx.x / S;
  const int slice = static_cast<int>(blockIdx.x % S);
  const int n = static_cast<int>(p.vocab);
  Ctx c;
  c.hdr = reinterpret_cast<RowHeader*>(p.workspace) + row_idx;
  c.ws = reinterpret_cast<RowWork*>(reinterpret_cast<RowHeader*>(p.workspace) + p.rows) + row_idx;
  c.S = S;
  c.slice = slice;
  c.b0 = slice * slice_len;
  c.nloc = min(slice_len, n - c.b0);
  c.nbar = 0;
  c.lvl = 0;
  T const* row = static_cast<T const*>(p.logits) + row_idx * p.vocab;
  T const* srow = row + c.b0;
  const int nloc = c.nloc;
  const SamplingRowParams rp = p.row_params[row_idx];
  const bool want_top = rp.n_top > 0 && p.top_ids != nullptr && p.top_logprobs != nullptr;
  const bool want_lp = rp.want_logprob != 0 && p.logprobs != nullptr;
  const bool want_lse = want_top || want_lp;

  if (slice == 0) {  // histogram buffers 0 and 1 (see above)
    for (int j = threadIdx.x; j < 2 * kBins; j += blockDim.x) {
      (&c.ws->cnt[0][0])[j] = 0;
      (&c.ws->mass[0][0])[j] = 0;
    }
  }

  // 1. stats of the slice
  float rmax = -INFINITY, rmin_all = INFINITY, rmin_fin = INFINITY, lm = -INFINITY, ls = 0.f;
  int rarg = kNoId;
  for_each(srow, nloc, [&](int il, float v) {
    const int i = il + c.b0;
    const float vv = v != v ? -INFINITY : v;
    if (vv > rmax || (vv == rmax && i < rarg)) {
      rmax = vv;
      rarg = i;
    }
    rmin_all = fminf(rmin_all, vv);
    if (isfinite(vv)) rmin_fin = fminf(rmin_fin, vv);
    if (want_lse && vv > -INFINITY) {
      if (vv > lm) {
        ls = (lm == -INFINITY ? 0.f : ls * expf(lm - vv)) + 1.0f;
        lm = vv;
      } else {
        ls += expf(vv - lm);
      }
    }
  });
  block_argmax(rmax, rarg, sh);
  rmin_all = block_min(rmin_all, sh);
  rmin_fin = block_min(rmin_fin, sh);
  if (want_lse) {
    const float gm = block_max(lm, sh);
    const float part = (lm == -INFINITY || isinf(gm)) ? 0.f : ls * expf(lm - gm);
    ls = block_sumf(part, sh);
    lm = gm;
  }
  if (threadIdx.x == 0) {
    SlicePart& sp = c.ws->part[slice];
    sp.rmax = rmax;
    sp.rarg = rarg;
    sp.rmin_all = rmin_all;
    sp.rmin_fin = rmin_fin;
    sp.lm = lm;
    sp.ls = ls;
  }
  row_barrier(c);
  // Combine the slices (warp 0, a fixed order: the same values in every CTA of the row).
  float lse = NAN;
  if (threadIdx.x < 32) {
    float gmax = -INFINITY, gmin_all = INFINITY, gmin_fin = INFINITY, glm = -INFINITY;
    int garg = kNoId;
    float lms[2] = {-INFINITY, -INFINITY}, lss[2] = {0.f, 0.f};
    for (int k = 0; k < 2; ++k) {
      const int s = static_cast<int>(threadIdx.x) + 32 * k;
      if (s >= S) continue;
      SlicePart const& sp = c.ws->part[s];
      const float v = __ldcg(&sp.rmax);
      const int id = __ldcg(&sp.rarg);
      if (v > gmax || (v == gmax && id < garg)) {
        gmax = v;
        garg = id;
      }
      gmin_all = fminf(gmin_all, __ldcg(&sp.rmin_all));
      gmin_fin = fminf(gmin_fin, __ldcg(&sp.rmin_fin));
      lms[k] = __ldcg(&sp.lm);
      lss[k] = __ldcg(&sp.ls);
      glm = fmaxf(glm, lms[k]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, gmax, o);
      const int oi = __shfl_xor_sync(0xffffffffu, garg, o);
      if (ov > gmax || (ov == gmax && oi < garg)) {
        gmax = ov;
        garg = oi;
      }
      gmin_all = fminf(gmin_all, __shfl_xor_sync(0xffffffffu, gmin_all, o));
      gmin_fin = fminf(gmin_fin, __shfl_xor_sync(0xffffffffu, gmin_fin, o));
      glm = fmaxf(glm, __shfl_xor_sync(0xffffffffu, glm, o));
    }
    if (want_lse) {
      float sum = 0.f;
      for (int k = 0; k < 2; ++k)
        sum += (lms[k] == -INFINITY || isinf(glm)) ? 0.f : lss[k] * expf(lms[k] - glm);
      sum = warp_sum(sum);
      lse = isinf(glm) ? glm : glm + logf(sum);
    }
    if (threadIdx.x == 0) {
      sh.red_f[0] = gmax;
      sh.red_i[0] = garg;
      sh.red_f[1] = gmin_all;
      sh.red_f[2] = gmin_fin;
      sh.red_f[3] = lse;
    }
  }
  __syncthreads();
  rmax = sh.red_f[0];
  rarg = sh.red_i[0];
  rmin_all = sh.red_f[1];
  rmin_fin = sh.red_f[2];
  lse = sh.red_f[3];
  __syncthreads();

  // 2-3. the token (written by slice 0, or by the slice that draws it)
  int token = rarg;
  bool writer = slice == 0;
  const float m = rmax / rp.temperature;
  if (!(rp.temperature < kGreedyBelow) && m > -INFINITY) {
    const SampleUniverse u{rp.temperature, m};
    const uint32_t klo = ordkey(fminf(rmin_fin, rmax) / rp.temperature), khi = ordkey(m);
    uint32_t cut_key = 0;
    int cut_id = kNoId;
    const bool use_k = rp.top_k > 0 && rp.top_k < n;
    const bool use_p = rp.top_p < 1.0f;
    if (use_k || use_p) {
      bool cut = false;
      uint32_t r_cut = 0, eq_cut = 0, lo = klo;
      uint64_t mass_k = 0;
      if (use_k) {
        const SearchResult s = search_multi<false, true>(
            srow, nloc, u, klo, khi, static_cast<uint64_t>(rp.top_k), 0.f, sh, c);
        if (s.found) {
          cut = true;
          cut_key = s.key;
          r_cut = static_cast<uint32_t>(rp.top_k) - s.above_cnt;
          eq_cut = s.eq_cnt;
          mass_k = s.above_mass + r_cut * (s.eq_mass / s.eq_cnt);
          lo = s.key;
        } else {
          mass_k = s.above_mass;
        }
      }
      if (use_p) {
        uint64_t need = 0;
        float frac = rp.top_p;
        if (use_k) {
          need = static_cast<uint64_t>(
              ceil(static_cast<double>(rp.top_p) * static_cast<double>(mass_k)));
          if (need == 0) need = 1;
          frac = 0.f;
        }
        const SearchResult s = search_multi<true, true>(srow, nloc, u, lo, khi, need, frac, sh, c);
        if (s.found) {
          const uint64_t w_tie = s.eq_mass / s.eq_cnt;
          const uint64_t rem = s.need - s.above_mass;
          uint64_t r = w_tie > 0 ? (rem + w_tie - 1) / w_tie : s.eq_cnt;
          r = r < 1 ? 1 : (r > s.eq_cnt ? s.eq_cnt : r);
          if (cut && s.key == cut_key && r > r_cut) r = r_cut;
          cut = true;
          cut_key = s.key;
          r_cut = static_cast<uint32_t>(r);
          eq_cut = s.eq_cnt;
        }
      }
      if (cut) cut_id = tie_cut_multi(srow, nloc, u, cut_key, r_cut, eq_cut, 0, sh, c);
    }
    // The draw: each slice's kept mass, then the slice holding the target finds the token.
    const Keep keep{u, cut_key, cut_id, rp.min_p};
    const int SB = sb_len(nloc);
    const uint64_t mine = sb_masses(srow, nloc, c.b0, SB, keep, sh);
    if (threadIdx.x == 0) c.ws->part[slice].kept = mine;
    row_barrier(c);
    if (threadIdx.x < 32) {  // slice order; exact integer sums: the same in every CTA
      uint64_t t = 0, bef = 0;
      for (int s = static_cast<int>(threadIdx.x); s < S; s += 32) {
        const uint64_t x = __ldcg(&c.ws->part[s].kept);
        t += x;
        if (s < slice) bef += x;
      }
      t = warp_sum_u64(t);
      bef = warp_sum_u64(bef);
      if (threadIdx.x == 0) {
        sh.f_tmass = t;
        sh.f_massk = bef;
      }
    }
    __syncthreads();
    const uint64_t total = sh.f_tmass, before = sh.f_massk;
    __syncthreads();
    if (total > 0) {  // else nothing kept (min_p > 1): the argmax, as the CPU
      const uint64_t target = draw_target(rp.seed, rp.counter, total);
      writer = before <= target && target < before + mine;
      if (writer) {
        const int id = sb_find(srow, nloc, c.b0, SB, keep, target - before, sh);
        if (id != kNoId) token = id;
      }
    }
  }
  if (token == kNoId) token = 0;

  if (writer && threadIdx.x == 0) {
    p.tokens[row_idx] = token;
    if (p.logprobs != nullptr) p.logprobs[row_idx] = want_lp ? load_raw(row, token) - lse : NAN;
  }

  // 4. top-n logprobs
  if (p.top_ids == nullptr || p.top_logprobs == nullptr) return;
  int32_t* gIds = p.top_ids + row_idx * kMaxTopLogprobs;
  float* gLp = p.top_logprobs + row_idx * kMaxTopLogprobs;
  int nt = 0;
  if (want_top) {
    nt = rp.n_top < kMaxTopLogprobs ? rp.n_top : kMaxTopLogprobs;
    nt = nt < n ? nt : n;
    const LogprobUniverse u{lse};
    uint32_t klo = ordkey(rmin_all - lse), khi = ordkey(rmax - lse);
    if (klo > khi) {
      klo = 0;
      khi = 0xffffffffu;
    }
    const SearchResult s =
        search_multi<false, false>(srow, nloc, u, klo, khi, static_cast<uint64_t>(nt), 0.f, sh, c);
    uint32_t cut_key = 0;
    int cut_id = kNoId;
    if (s.found) {
      cut_key = s.key;
      cut_id = tie_cut_multi(srow, nloc, u, s.key, static_cast<uint32_t>(nt) - s.above_cnt,
                             s.eq_cnt, 1, sh, c);
    }
    for_each(srow, nloc, [&](int il, float v) {
      const int i = il + c.b0;
      const uint32_t k = u.key(v);
      if (k > cut_key || (k == cut_key && i <= cut_id)) {
        const uint32_t slot = atomicAdd(&c.hdr->gathered, 1u);
        if (slot < static_cast<uint32_t>(kMaxTopLogprobs)) {
          c.ws->g_key[slot] = k;
          c.ws->g_id[slot] = i;
        }
      }
    });
    row_barrier(c);
    if (slice != 0) return;
    if (threadIdx.x == 0) {
      const uint32_t got = atomicAdd(&c.hdr->gathered, 0u);
      int g = static_cast<int>(got < static_cast<uint32_t>(nt) ? got : static_cast<uint32_t>(nt));
      for (int a = 0; a < g; ++a) {
        sh.g_key[a] = __ldcg(&c.ws->g_key[a]);
        sh.g_id[a] = __ldcg(&c.ws->g_id[a]);
      }
      for (int a = 1; a < g; ++a) {
        const uint32_t k = sh.g_key[a];
        const int id = sh.g_id[a];
        int b = a - 1;
        while (b >= 0 && (sh.g_key[b] < k || (sh.g_key[b] == k && sh.g_id[b] > id))) {
          sh.g_key[b + 1] = sh.g_key[b];
          sh.g_id[b + 1] = sh.g_id[b];
          --b;
        }
        sh.g_key[b + 1] = k;
        sh.g_id[b + 1] = id;
      }
      sh.n_gathered = g;
    }
    __syncthreads();
    nt = sh.n_gathered;
    if (static_cast<int>(threadIdx.x) < nt) {
      const int id = sh.g_id[threadIdx.x];
      gIds[threadIdx.x] = id;
      gLp[threadIdx.x] = load_raw(row, id) - lse;
    }
  }
  if (slice != 0) return;
  for (int j = nt + static_cast<int>(threadIdx.x); j < kMaxTopLogprobs; j += blockDim.x) {
    gIds[j] = -1;
    gLp[j] = -INFINITY;
  }
}

struct MultiPlan {
  int S, slice_len;
};

/// Slices per row: as many as the device runs at once over all rows (at most kMaxSlices), so
/// the whole grid is resident at once (the row barriers need it); at least 1.
MultiPlan multi_plan(int64_t rows, int64_t vocab, int resident) {
  int64_t S = std::min<int64_t>(std::max<int64_t>(resident / rows, 1), kMaxSlices);
  int64_t len = (vocab + S - 1) / S;
  len = (len + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  S = (vocab + len - 1) / len;
  return {static_cast<int>(S), static_cast<int>(len)};
}

/// CTAs of sample_multi_kernel<T> that the device runs at once (cached per device).
template <typename T>
int resident_ctas() {
  static int cache[64] = {};
  int dev = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && cache[dev] > 0) return cache[dev];
  int sms = 0, per_sm = 0;
  TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  TANDEM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sample_multi_kernel<T>,
                                                                  kMultiThreads, 0));
  const int r = std::max(1, sms * std::max(per_sm, 1));
  if (dev < 64) cache[dev] = r;
  return r;
}

}  // namespace

size_t sample_workspace_bytes(int64_t rows, int64_t vocab) {
  (void)vocab;
  return rows <= 0 ? 0 : static_cast<size_t>(rows) * (sizeof(RowHeader) + sizeof(RowWork));
}

void sample_launch(SampleParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.rows >= 0, "sample: rows ", p.rows);
  TANDEM_CHECK(p.vocab > 0 && p.vocab <= (int64_t{1} << 23), "sample: unsupported vocab ", p.vocab,
               " (1 .. 2^23)");
  if (p.rows == 0) return;
  TANDEM_CHECK(p.rows <= INT32_MAX, "sample: too many rows ", p.rows);
  TANDEM_CHECK(p.logits != nullptr && p.row_params != nullptr && p.tokens != nullptr,
               "sample: null logits / row_params / tokens");
  // With a workspace: the multi-CTA path, unless there are so many rows that a row gets a
  // single slice (S = 1), where the 1024-thread single-CTA kernel is the faster one (same
  // tokens either way).
  if (p.workspace != nullptr && (p.dtype == DType::kF32 || p.dtype == DType::kBF16)) {
    TANDEM_CHECK(reinterpret_cast<uintptr_t>(p.workspace) % 8 == 0,
                 "sample: workspace not 8-byte aligned");
    const bool f32 = p.dtype == DType::kF32;
    const MultiPlan mp =
        multi_plan(p.rows, p.vocab, f32 ? resident_ctas<float>() : resident_ctas<bf16>());
    if (mp.S > 1) {
      TANDEM_CUDA_CHECK(
          cudaMemsetAsync(p.workspace, 0, static_cast<size_t>(p.rows) * sizeof(RowHeader), stream));
      const unsigned blocks = static_cast<unsigned>(p.rows * mp.S);
      if (f32) {
        sample_multi_kernel<float><<<blocks, kMultiThreads, 0, stream>>>(p, mp.S, mp.slice_len);
      } else {
        sample_multi_kernel<bf16><<<blocks, kMultiThreads, 0, stream>>>(p, mp.S, mp.slice_len);
      }
      TANDEM_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  const unsigned blocks = static_cast<unsigned>(p.rows);
  switch (p.dtype) {
    case DType::kF32: sample_kernel<float><<<blocks, kThreads, 0, stream>>>(p); break;
    case DType::kBF16: sample_kernel<bf16><<<blocks, kThreads, 0, stream>>>(p); break;
    default:
      TANDEM_THROW(kUnsupported, "sample: unsupported logits dtype ", static_cast<int>(p.dtype));
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
