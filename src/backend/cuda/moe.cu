// Router top-k softmax, SiLU-multiply, MoE permute / unpermute. See moe.h.
#include <algorithm>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/moe.h"

namespace tandem::cuda {

using namespace detail;

namespace {

// ---------------------------------------------------------------- top-k softmax
constexpr int kMaxTopK = static_cast<int>(kRouterMaxTopK);  // unpermute's sort buffer
constexpr int kTopkWarps = 4;

template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return __bfloat162float(v);
  }
}

// One warp per token; lane l holds experts l, l + 32, ... (kPerLane of them); top_k <= kMaxK.
template <typename T, int kPerLane, int kMaxK>
__global__ void __launch_bounds__(kTopkWarps * 32) topk_softmax_kernel(TopkSoftmaxParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTopkWarps + (threadIdx.x >> 5);
  if (t >= p.num_tokens) return;  // whole warp leaves together
  T const* gL = static_cast<T const*>(p.logits) + t * p.num_experts;
  float prob[kPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < p.num_experts ? to_f32(gL[e]) : -INFINITY;
    mx = fmaxf(mx, prob[i]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < p.num_experts ? expf(prob[i] - mx) : 0.f;
    sum += prob[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < p.num_experts ? prob[i] / sum : -INFINITY;  // padding never wins
  }
  // k rounds of a warp arg-max (greater probability, then lower expert id).
  float sel_w[kMaxK];
  int sel_e[kMaxK];
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) {
    sel_w[j] = 0.f;
    sel_e[j] = 0;
    if (j < p.top_k) {
      float bv = -INFINITY;
      int be = INT32_MAX;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (prob[i] > bv) {  // strict: within a lane, lower i is the lower expert id
          bv = prob[i];
          be = lane + 32 * i;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oe = __shfl_xor_sync(0xffffffffu, be, o);
        if (ov > bv || (ov == bv && oe < be)) {
          bv = ov;
          be = oe;
        }
      }
      sel_w[j] = bv;
      sel_e[j] = be;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (lane + 32 * i == be) prob[i] = -INFINITY;  // taken
      }
    }
  }
  if (lane == 0) {
    float ksum = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      if (j < p.top_k) ksum += sel_w[j];
    }
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      if (j < p.top_k) {
        p.topk_ids[t * p.top_k + j] = sel_e[j];
        p.topk_weights[t * p.top_k + j] = p.renormalize ? sel_w[j] / ksum : sel_w[j];
      }
    }
  }
}

template <typename T>
void topk_softmax_per_lane(TopkSoftmaxParams const& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.num_tokens + kTopkWarps - 1) / kTopkWarps);
  constexpr int threads = kTopkWarps * 32;
  const int64_t per_lane = (p.num_experts + 31) / 32;
  constexpr int kNarrowK = static_cast<int>(kRouterNarrowTopK);
  if (p.top_k > kNarrowK || p.num_experts > kRouterNarrowExperts) {  // the wide variant
    topk_softmax_kernel<T, static_cast<int>(kRouterMaxExperts / 32), kMaxTopK>
        <<<blocks, threads, 0, stream>>>(p);
    return;
  }
  switch (per_lane) {
    case 1: topk_softmax_kernel<T, 1, kNarrowK><<<blocks, threads, 0, stream>>>(p); break;
    case 2: topk_softmax_kernel<T, 2, kNarrowK><<<blocks, threads, 0, stream>>>(p); break;
    case 3:
    case 4: topk_softmax_kernel<T, 4, kNarrowK><<<blocks, threads, 0, stream>>>(p); break;
    case 5:
    case 6:
    case 7:
    case 8: topk_softmax_kernel<T, 8, kNarrowK><<<blocks, threads, 0, stream>>>(p); break;
    default: TANDEM_THROW(kUnsupported, "topk_softmax: unsupported num_experts ", p.num_experts);
  }
}

// ---------------------------------------------------------------- silu * mul
template <int kVec>
__global__ void silu_mul_kernel(SiluMulParams p) {
  const int64_t vecs_per_row = p.inter / kVec;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.rows * vecs_per_row) return;
  const int64_t r = idx / vecs_per_row, c = (idx % vecs_per_row) * kVec;
  bf16 const* gG = p.gate_up + r * 2 * p.inter + c;
  float rG[kVec], rU[kVec];
  load_bf16<kVec>(gG, rG);
  load_bf16<kVec>(gG + p.inter, rU);
#pragma unroll
  for (int j = 0; j < kVec; ++j) rG[j] = rG[j] / (1.0f + expf(-rG[j])) * rU[j];
  store_bf16<kVec>(p.out + r * p.inter + c, rG);
}

// ---------------------------------------------------------------- permute
// The permute kernels come in two widths: kMaxE = 256 (up to 256 local experts) and 512.
constexpr int kPermuteThreads = 1024;  // token-slots per block of the histogram/place kernels
// Per-warp expert counts of the place kernel (<= 32 each): int at 256 experts (32 KB), 16-bit at
// 512 (32 KB of static shared memory as well; ints would take 64 KB).
template <int kMaxE>
using WarpCount = std::conditional_t<(kMaxE > 256), uint16_t, int>;

__device__ __forceinline__ int local_expert(MoePermuteParams const& p, int64_t slot) {
  const int64_t e = static_cast<int64_t>(p.topk_ids[slot]) - p.expert_begin;
  return e >= 0 && e < p.num_local_experts ? static_cast<int>(e) : -1;
}

// Per block of 1024 token-slots: histogram over local experts -> hist[block][expert].
template <int kMaxE>
__global__ void __launch_bounds__(kPermuteThreads) moe_hist_kernel(MoePermuteParams p) {
  __shared__ int sH[kMaxE];
  const int E = static_cast<int>(p.num_local_experts);
  for (int e = threadIdx.x; e < E; e += blockDim.x) sH[e] = 0;
  __syncthreads();
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kPermuteThreads + threadIdx.x;
  if (slot < p.num_tokens * p.top_k) {
    const int e = local_expert(p, slot);
    if (e >= 0) atomicAdd(&sH[e], 1);
  }
  __syncthreads();
  int32_t* gHist = p.workspace + static_cast<int64_t>(blockIdx.x) * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) gHist[e] = sH[e];
}

// One block of kMaxE threads: counts, offsets (exclusive scan over experts) and each block's
// base row per expert: base[b][e] = offsets[e] + sum_{b' < b} hist[b'][e].
template <int kMaxE>
__global__ void __launch_bounds__(kMaxE) moe_scan_kernel(MoePermuteParams p, int num_blocks) {
  __shared__ int sScan[kMaxE];
  const int E = static_cast<int>(p.num_local_experts);
  const int e = threadIdx.x;
  int32_t const* gHist = p.workspace;
  int32_t* gBase = p.workspace + static_cast<int64_t>(num_blocks) * E;
  int count = 0;
  if (e < E) {
    for (int b = 0; b < num_blocks; ++b) {
      gBase[static_cast<int64_t>(b) * E + e] = count;  // block prefix within the expert
      count += gHist[static_cast<int64_t>(b) * E + e];
    }
  }
  // Inclusive Hillis-Steele scan of counts over the experts.
  sScan[e] = count;
  __syncthreads();
  for (int o = 1; o < kMaxE; o <<= 1) {
    const int v = e >= o ? sScan[e - o] : 0;
    __syncthreads();
    sScan[e] += v;
    __syncthreads();
  }
  const int offset = sScan[e] - count;  // exclusive
  if (e < E) {
    p.expert_counts[e] = count;
    p.expert_offsets[e] = offset;
    for (int b = 0; b < num_blocks; ++b) gBase[static_cast<int64_t>(b) * E + e] += offset;
  }
  if (e == E - 1) p.expert_offsets[E] = sScan[e];
}

// Per block of 1024 token-slots: stable rank within the block (warp match + per-warp counts),
// then row = base[block][expert] + rank.
template <int kMaxE>
__global__ void __launch_bounds__(kPermuteThreads)
    moe_place_kernel(MoePermuteParams p, int num_blocks) {
  constexpr int kWarps = kPermuteThreads / 32;
  __shared__ WarpCount<kMaxE> sWarpCount[kWarps][kMaxE];
  const int E = static_cast<int>(p.num_local_experts);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kWarps * kMaxE; i += blockDim.x) {
    (&sWarpCount[0][0])[i] = 0;
  }
  __syncthreads();
  const int64_t num_slots = p.num_tokens * p.top_k;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kPermuteThreads + threadIdx.x;
  const int e = slot < num_slots ? local_expert(p, slot) : -1;
  const unsigned peers = __match_any_sync(0xffffffffu, e);
  const int rank_in_warp = __popc(peers & ((1u << lane) - 1u));
  if (e >= 0 && rank_in_warp == 0) {
    sWarpCount[warp][e] = static_cast<WarpCount<kMaxE>>(__popc(peers));
  }
  __syncthreads();
  if (slot >= num_slots) return;
  if (e < 0) {
    p.slot_row[slot] = -1;
    return;
  }
  int row = p.workspace[static_cast<int64_t>(num_blocks + blockIdx.x) * E + e] + rank_in_warp;
  for (int w = 0; w < warp; ++w) row += sWarpCount[w][e];
  p.permuted_src[row] = static_cast<int32_t>(slot);
  p.slot_row[slot] = row;
}

// One block per permuted row: permuted_x[row] = x[permuted_src[row] / top_k].
template <int kVec>
__global__ void moe_gather_kernel(MoePermuteParams p) {
  const int64_t row = blockIdx.x;
  if (row >= p.expert_offsets[p.num_local_experts]) return;
  const int64_t t = p.permuted_src[row] / p.top_k;
  bf16 const* gSrc = p.x + t * p.hidden;
  bf16* gDst = p.permuted_x + row * p.hidden;
  for (int64_t i = threadIdx.x * kVec; i < p.hidden; i += blockDim.x * kVec) {
    copy_bf16<kVec>(gDst + i, gSrc + i);
  }
}

// ---------------------------------------------------------------- unpermute
// One block per token; the token's local slots sorted by expert id in shared memory.
template <int kVec, typename TOut>
__global__ void moe_unpermute_kernel(MoeUnpermuteParams p) {
  __shared__ int sRow[kMaxTopK];
  __shared__ float sW[kMaxTopK];
  __shared__ int sN;
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {
    int ids[kMaxTopK];
    int n = 0;
    for (int j = 0; j < p.top_k; ++j) {
      const int row = p.slot_row[t * p.top_k + j];
      if (row < 0) continue;
      const int id = p.topk_ids[t * p.top_k + j];
      const float w = p.topk_weights[t * p.top_k + j];
      int pos = n++;
      while (pos > 0 && ids[pos - 1] > id) {  // insertion sort by expert id
        ids[pos] = ids[pos - 1];
        sRow[pos] = sRow[pos - 1];
        sW[pos] = sW[pos - 1];
        --pos;
      }
      ids[pos] = id;
      sRow[pos] = row;
      sW[pos] = w;
    }
    sN = n;
  }
  __syncthreads();
  const int n = sN;
  TOut* gOut = static_cast<TOut*>(p.out) + t * p.hidden;
  for (int64_t i = threadIdx.x * kVec; i < p.hidden; i += blockDim.x * kVec) {
    float acc[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] = 0.f;
    for (int j = 0; j < n; ++j) {
      float rY[kVec];
      load_bf16<kVec>(p.permuted_y + static_cast<int64_t>(sRow[j]) * p.hidden + i, rY);
      const float w = sW[j];
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[v] += w * rY[v];
    }
    if constexpr (std::is_same_v<TOut, float>) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) gOut[i + v] = acc[v];
    } else {
      store_bf16<kVec>(gOut + i, acc);
    }
  }
}

template <typename TOut>
void moe_unpermute_vec(MoeUnpermuteParams const& p, int vec, cudaStream_t stream) {
  const int threads = row_threads((p.hidden + vec - 1) / vec, 256);
  const unsigned blocks = static_cast<unsigned>(p.num_tokens);
  switch (vec) {
    case 8: moe_unpermute_kernel<8, TOut><<<blocks, threads, 0, stream>>>(p); break;
    case 1: moe_unpermute_kernel<1, TOut><<<blocks, threads, 0, stream>>>(p); break;
    default: TANDEM_THROW(kUnsupported, "moe_unpermute: unsupported vector width ", vec);
  }
}

}  // namespace

void topk_softmax_launch(TopkSoftmaxParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0, "topk_softmax: bad num_tokens ", p.num_tokens);
  if (p.num_experts < 1 || p.num_experts > kRouterMaxExperts) {
    TANDEM_THROW(kUnsupported, "topk_softmax: unsupported num_experts ", p.num_experts, " (1..",
                 kRouterMaxExperts, ")");
  }
  if (p.top_k < 1 || p.top_k > kMaxTopK || p.top_k > p.num_experts) {
    TANDEM_THROW(kUnsupported, "topk_softmax: unsupported top_k ", p.top_k, " (1..", kMaxTopK,
                 " and at most num_experts)");
  }
  if (p.num_tokens == 0) return;
  switch (p.logits_dtype) {
    case DType::kBF16: topk_softmax_per_lane<bf16>(p, stream); break;
    case DType::kF32: topk_softmax_per_lane<float>(p, stream); break;
    default:
      TANDEM_THROW(kUnsupported, "topk_softmax: unsupported logits dtype ",
                   dtype_name(p.logits_dtype));
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void silu_mul_launch(SiluMulParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.rows >= 0 && p.inter > 0, "silu_mul: bad sizes");
  if (p.rows == 0) return;
  const int vec = p.inter % 8 == 0 && aligned_to(16, p.gate_up, p.out) ? 8 : 1;
  const int64_t total = p.rows * (p.inter / vec);
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  TANDEM_CHECK(blocks <= INT32_MAX, "silu_mul: too large");
  switch (vec) {
    case 8: silu_mul_kernel<8><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p); break;
    case 1: silu_mul_kernel<1><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p); break;
    default: TANDEM_THROW(kUnsupported, "silu_mul: unsupported vector width ", vec);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

size_t moe_permute_workspace_elems(int64_t num_tokens, int64_t top_k, int64_t num_local_experts) {
  const int64_t blocks = (num_tokens * top_k + kPermuteThreads - 1) / kPermuteThreads;
  return static_cast<size_t>(2 * std::max<int64_t>(blocks, 1) * num_local_experts);
}

void moe_permute_launch(MoePermuteParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0 && p.top_k >= 1 && p.hidden > 0, "moe_permute: bad sizes");
  if (p.num_local_experts < 1 || p.num_local_experts > kRouterMaxExperts) {
    TANDEM_THROW(kUnsupported, "moe_permute: unsupported num_local_experts ", p.num_local_experts,
                 " (1..", kRouterMaxExperts, ")");
  }
  const int64_t num_slots = p.num_tokens * p.top_k;
  TANDEM_CHECK(num_slots <= INT32_MAX / 2, "moe_permute: too many token-slots ", num_slots);
  const int num_blocks =
      static_cast<int>(std::max<int64_t>((num_slots + kPermuteThreads - 1) / kPermuteThreads, 1));
  auto indices = [&](auto max_e) {
    constexpr int kMaxE = decltype(max_e)::value;
    moe_hist_kernel<kMaxE><<<num_blocks, kPermuteThreads, 0, stream>>>(p);
    TANDEM_CUDA_CHECK_LAUNCH();
    moe_scan_kernel<kMaxE><<<1, kMaxE, 0, stream>>>(p, num_blocks);
    TANDEM_CUDA_CHECK_LAUNCH();
    moe_place_kernel<kMaxE><<<num_blocks, kPermuteThreads, 0, stream>>>(p, num_blocks);
    TANDEM_CUDA_CHECK_LAUNCH();
  };
  if (p.num_local_experts <= kRouterNarrowExperts) {
    indices(std::integral_constant<int, static_cast<int>(kRouterNarrowExperts)>{});
  } else {
    indices(std::integral_constant<int, static_cast<int>(kRouterMaxExperts)>{});
  }
  if (p.permuted_x == nullptr || num_slots == 0) return;
  const int vec = p.hidden % 8 == 0 && aligned_to(16, p.x, p.permuted_x) ? 8 : 1;
  const int threads = row_threads((p.hidden + vec - 1) / vec, 256);
  switch (vec) {
    case 8:
      moe_gather_kernel<8><<<static_cast<unsigned>(num_slots), threads, 0, stream>>>(p);
      break;
    case 1:
      moe_gather_kernel<1><<<static_cast<unsigned>(num_slots), threads, 0, stream>>>(p);
      break;
    default: TANDEM_THROW(kUnsupported, "moe_permute: unsupported vector width ", vec);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void moe_unpermute_launch(MoeUnpermuteParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0 && p.hidden > 0, "moe_unpermute: bad sizes");
  if (p.top_k < 1 || p.top_k > kMaxTopK) {
    TANDEM_THROW(kUnsupported, "moe_unpermute: unsupported top_k ", p.top_k, " (1..", kMaxTopK,
                 ")");
  }
  if (p.num_tokens == 0) return;
  TANDEM_CHECK(p.num_tokens <= INT32_MAX, "moe_unpermute: too many tokens");
  const int vec = p.hidden % 8 == 0 && aligned_to(16, p.permuted_y, p.out) ? 8 : 1;
  switch (p.out_dtype) {
    case DType::kBF16: moe_unpermute_vec<bf16>(p, vec, stream); break;
    case DType::kF32: moe_unpermute_vec<float>(p, vec, stream); break;
    default:
      TANDEM_THROW(kUnsupported, "moe_unpermute: unsupported out dtype ", dtype_name(p.out_dtype));
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
