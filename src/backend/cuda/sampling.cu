// GPU sampling: one CTA of 1024 threads per row, a few block-wide passes over the row (it is
// too large for shared memory: 151936 fp32 = 594 KiB). See sampling.h for the semantics.
//
// Passes per row:
//   1. stats: raw max + argmax (ties -> lowest id), raw min, and (when logprobs are asked for)
//      an online log-sum-exp of the raw logits. Greedy rows stop here.
//   2. cut search (top-k and/or top-p only): the kept set is a prefix of the order
//      (x desc, id asc), x = logit / temperature. We find its last element as a key T (an
//      order-preserving uint32 of x) plus, when T is shared by several tokens, an id cut.
//      Each level histograms the keys still in range into 256 equal-width key bins (count and
//      fixed-point mass), picks the bin where the running count / mass reaches the target,
//      and narrows the range to it: at most 4 levels, then one pass to find the r-th id among
//      the tied tokens if the cut falls inside a tie.
//   3. draw: an exponential race over the kept tokens (argmax of log w - log E, E ~ Exp(1)
//      from Philox on (seed, counter, id)) is one categorical draw with probabilities w / sum w
//      and needs no prefix sum, so it is one parallel pass and the same token whatever the
//      thread layout.
//   4. top-n logprobs: the same cut search by count on the key of (raw - lse), then a gather
//      of the n (<= 20) tokens and a sort of those.
// NOTE: masses are fixed-point (w * 2^40 as uint64) so the shared-memory atomics that build
// them are exact and order-independent: the same inputs always give the same cut.
#include <cstdint>

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
template <typename T, typename F>
__device__ __forceinline__ void for_each(T const* row, int n, F&& f) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kUnroll = 4;
  int start = 0;
  if (reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    uint4 const* gV = reinterpret_cast<uint4 const*>(row);
    const int nv = n / kVec, stride = static_cast<int>(blockDim.x);
    int v = threadIdx.x;
    for (; v + (kUnroll - 1) * stride < nv; v += kUnroll * stride) {
      uint4 q[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) q[u] = gV[v + u * stride];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float r[kVec];
        unpack<T, kVec>(q[u], r);
#pragma unroll
        for (int j = 0; j < kVec; ++j) f((v + u * stride) * kVec + j, r[j]);
      }
    }
    for (; v < nv; v += stride) {
      float r[kVec];
      unpack<T, kVec>(gV[v], r);
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(v * kVec + j, r[j]);
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

/// Exp(1) variate for token `id` of draw (seed, counter); one Philox block serves 4 ids.
__device__ __forceinline__ float exp_variate(uint64_t seed, uint64_t counter, int id) {
  const uint4 r =
      philox(make_uint4(static_cast<uint32_t>(id) >> 2, static_cast<uint32_t>(counter),
                        static_cast<uint32_t>(counter >> 32), 0x53414d50u),
             make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
  const int j = id & 3;
  const uint32_t b = j == 0 ? r.x : j == 1 ? r.y : j == 2 ? r.z : r.w;
  // v in [2^-24, 1 - 2^-24], both exact in fp32: E in [6e-8, 16.6], never 0 or inf.
  const float v = (static_cast<float>(b >> 9) + 0.5f) * 0x1p-23f;
  return -log1pf(-v);
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
struct SampleUniverse {
  float temp, m;
  __device__ __forceinline__ uint32_t key(float v) const {
    return ordkey(v != v ? -INFINITY : v / temp);
  }
  __device__ __forceinline__ Elem operator()(float v) const {
    const float x = v != v ? -INFINITY : v / temp;
    float d;
    if (m == INFINITY) {
      d = x == INFINITY ? 0.0f : -INFINITY;  // the +inf tokens share all the mass
    } else {
      d = x - m;
    }
    const float w = d < -87.0f ? 0.0f : expf(d);
    return {w > 0.0f, ordkey(x), d, w, __float2ull_rn(w * kMassScale)};
  }
};

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

  // 1. stats
  float rmax = -INFINITY, rmin_all = INFINITY, rmin_fin = INFINITY, lm = -INFINITY, ls = 0.f;
  int rarg = kNoId;
  for_each(row, n, [&](int i, float v) {
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
          need = static_cast<uint64_t>(
              ceil(static_cast<double>(rp.top_p) * static_cast<double>(mass_k)));
          if (need == 0) need = 1;
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
    // The exponential race over the kept tokens.
    float best = -INFINITY;
    int best_id = kNoId;
    const float min_p = rp.min_p;
    for_each(row, n, [&](int i, float v) {
      const uint32_t k = u.key(v);
      if (k < cut_key || (k == cut_key && i > cut_id)) return;
      const Elem e = u(v);
      if (!e.valid || (min_p > 0.0f && !(e.w >= min_p))) return;
      const float score = e.d - logf(exp_variate(rp.seed, rp.counter, i));
      if (score > best || (score == best && i < best_id)) {
        best = score;
        best_id = i;
      }
    });
    block_argmax(best, best_id, sh);
    // Nothing kept (min_p > 1): the argmax, as the CPU.
    if (best_id != kNoId) token = best_id;
  }
  if (token == kNoId) token = 0;  // defensive: empty row is rejected on the host

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
    uint32_t klo = ordkey(rmin_all - lse), khi = ordkey(rmax - lse);
    if (klo > khi) {  // only with infinite lse; the full key range is always right
      klo = 0;
      khi = 0xffffffffu;
    }
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

}  // namespace

void sample_launch(SampleParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.rows >= 0, "sample: rows ", p.rows);
  TANDEM_CHECK(p.vocab > 0 && p.vocab <= (int64_t{1} << 23), "sample: unsupported vocab ", p.vocab,
               " (1 .. 2^23)");
  if (p.rows == 0) return;
  TANDEM_CHECK(p.rows <= INT32_MAX, "sample: too many rows ", p.rows);
  TANDEM_CHECK(p.logits != nullptr && p.row_params != nullptr && p.tokens != nullptr,
               "sample: null logits / row_params / tokens");
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
