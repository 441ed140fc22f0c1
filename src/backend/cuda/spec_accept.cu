// Rejection sampling of draft tokens on the GPU (spec_accept.h): one CTA per sequence, its
// K + 1 target rows in order. The acceptance test reads two floats; a rejection (or the bonus
// token) makes one draw over the row: each thread owns a contiguous id range, sums its
// fixed-point weights (exact integers), an exclusive scan over the threads finds the range that
// holds the target, and that thread walks its range. So the token is the first id, in id order,
// whose running mass exceeds the target, whatever the layout (spec_accept_ref.cpp does the same
// walk on the host).
#include <cstdint>

#include "backend/cuda/check.h"
#include "backend/cuda/spec_accept.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kThreads = 512;
constexpr float kMassScale = 1099511627776.0f;  // 2^40 (sampling.cu's fixed point)

/// Philox4x32-10 (Salmon et al. 2011), sampling.cu's.
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

/// 53 uniform bits of (seed, counter, tag), sampling.cu's layout.
__device__ __forceinline__ uint64_t uniform53(uint64_t seed, uint64_t counter, uint32_t tag) {
  const uint4 r =
      philox(make_uint4(0xffffffffu, static_cast<uint32_t>(counter),
                        static_cast<uint32_t>(counter >> 32), tag),
             make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
  return (static_cast<uint64_t>(r.x >> 6) << 27) | (r.y >> 5);
}

/// round(w * 2^40) for a probability; anything outside [0, 1] or NaN: 0.
__device__ __forceinline__ uint64_t fixed(float w) {
  return (w > 0.0f && w <= 1.0f) ? __float2ull_rn(w * kMassScale) : 0ull;
}

struct Shared {
  unsigned long long warp_sums[kThreads / 32];
  unsigned long long total;
  int token;
};

/// The weights of a draw: max(0, p - q) (residual; q one-hot at `draft` when q is null), or p.
struct Weights {
  float const* p;
  float const* q;
  int draft;
  bool residual;
  __device__ __forceinline__ uint64_t operator()(int i) const {
    float w = p[i];
    if (residual) w = fmaxf(0.0f, w - (q != nullptr ? q[i] : (i == draft ? 1.0f : 0.0f)));
    return fixed(w);
  }
};

/// Exclusive prefix of `v` over the block (thread order) and the block total.
__device__ uint64_t block_exclusive_scan(uint64_t v, uint64_t& total, Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint64_t incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  __syncthreads();  // the previous call's readers are done
  if (lane == 31) sh.warp_sums[warp] = incl;
  __syncthreads();
  uint64_t before = 0, all = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    const uint64_t s = sh.warp_sums[w];
    if (w < warp) before += s;
    all += s;
  }
  total = all;
  return before + incl - v;
}

/// The draw over `w` at the target floor(u * total) of (seed, counter)'s "DRAW" uniform;
/// -1 when every weight is 0. Every thread gets the token.
template <typename W>
__device__ int draw(W const& w, int n, uint64_t seed, uint64_t counter, Shared& sh) {
  const int per = (n + kThreads - 1) / kThreads;
  const int lo = min(n, static_cast<int>(threadIdx.x) * per), hi = min(n, lo + per);
  uint64_t mine = 0;
  for (int i = lo; i < hi; ++i) mine += w(i);
  uint64_t total = 0;
  const uint64_t before = block_exclusive_scan(mine, total, sh);
  if (threadIdx.x == 0) sh.token = -1;
  __syncthreads();
  if (total > 0) {
    const uint64_t target = __umul64hi(uniform53(seed, counter, kDrawTag) << 11, total);
    if (target >= before && target < before + mine) {  // this thread's range holds it
      uint64_t run = before;
      for (int i = lo; i < hi; ++i) {
        run += w(i);
        if (run > target) {
          sh.token = i;
          break;
        }
      }
    }
  }
  __syncthreads();
  return sh.token;
}

__global__ void __launch_bounds__(kThreads) spec_accept_kernel(SpecAcceptParams p) {
  __shared__ Shared sh;
  const int64_t s = blockIdx.x;
  const int n = static_cast<int>(p.vocab);
  const int K = static_cast<int>(p.K);
  const SpecAcceptRow row = p.rows[s];
  const int k = row.num_drafts < 0 ? 0 : (row.num_drafts > K ? K : row.num_drafts);
  int32_t* out = p.tokens + s * (K + 1);
  for (int j = static_cast<int>(threadIdx.x); j <= K; j += blockDim.x) out[j] = -1;
  __syncthreads();
  int accepted = 0;
  int token = -1;
  for (int j = 0; j <= k; ++j) {
    float const* pj = p.p + (s * (K + 1) + j) * p.vocab;
    if (j == k) {  // every draft accepted: the bonus token from p_k
      token = draw(Weights{pj, nullptr, 0, false}, n, row.seed, row.counter + j, sh);
      break;
    }
    float const* qj = p.q != nullptr ? p.q + (s * K + j) * p.vocab : nullptr;
    int d = p.drafts[s * K + j];
    d = d < 0 ? 0 : (d >= n ? n - 1 : d);
    const double pd = pj[d];
    const double qd = qj != nullptr ? static_cast<double>(qj[d]) : 1.0;
    const double u = static_cast<double>(uniform53(row.seed, row.counter + j, kAcceptTag)) *
                     1.1102230246251565e-16;  // 2^-53
    if (__dmul_rn(u, qd) < pd) {
      if (threadIdx.x == 0) out[j] = d;
      ++accepted;
      continue;
    }
    token = draw(Weights{pj, qj, d, true}, n, row.seed, row.counter + j, sh);
    if (token < 0) token = draw(Weights{pj, nullptr, 0, false}, n, row.seed, row.counter + j, sh);
    break;
  }
  if (threadIdx.x == 0) {
    out[accepted] = token < 0 ? 0 : token;  // nothing with mass anywhere: token 0
    p.num_accepted[s] = accepted;
  }
}

}  // namespace

void spec_accept_launch(SpecAcceptParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument, p.seqs >= 0 && p.K >= 0 && p.K <= 64, "spec_accept: ", p.seqs,
                    " sequences, K ", p.K, " (0..64)");
  TANDEM_CHECK_KIND(kInvalidArgument, p.vocab >= 1 && p.vocab <= (int64_t{1} << 23),
                    "spec_accept: vocab ", p.vocab, " outside [1, 2^23]");
  if (p.seqs == 0) return;
  TANDEM_CHECK_KIND(kInvalidArgument,
                    p.p != nullptr && p.rows != nullptr && p.tokens != nullptr &&
                        p.num_accepted != nullptr && (p.K == 0 || p.drafts != nullptr),
                    "spec_accept: a null input or output");
  spec_accept_kernel<<<static_cast<unsigned>(p.seqs), kThreads, 0, stream>>>(p);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tandem::cuda
