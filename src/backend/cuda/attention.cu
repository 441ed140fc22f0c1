// KV write into HND pages and the simple paged GQA attention kernel. See attention.h.
#include <algorithm>
#include <cmath>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_fa.h"
#include "backend/cuda/attention_sm90.h"
#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/kv_fp8.cuh"

namespace tandem::cuda {

using namespace detail;

namespace {

// ---------------------------------------------------------------- kv write
// One thread per 16-byte vector of one (token, head) row of k (and the same of v).
template <int kHeadDim>
__global__ void kv_write_kernel(KvWriteParams p) {
  constexpr int kVecs = kHeadDim / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = p.num_tokens * p.num_kv_heads * kVecs;
  if (idx >= total) return;
  const int64_t c = idx % kVecs;
  const int64_t th = idx / kVecs;  // t * num_kv_heads + h
  const int64_t h = th % p.num_kv_heads, t = th / p.num_kv_heads;
  const int64_t slot_index = p.slot_index[t];
  if (slot_index < 0) return;  // padding
  const int64_t page = slot_index / p.page_size, slot = slot_index % p.page_size;
  const int64_t kv_stride = p.num_kv_heads * p.page_size * kHeadDim;
  bf16* gK = p.pool + page * 2 * kv_stride + (h * p.page_size + slot) * kHeadDim + c * 8;
  copy_bf16<8>(gK, p.k + th * kHeadDim + c * 8);
  copy_bf16<8>(gK + kv_stride, p.v + th * kHeadDim + c * 8);
}

// The same over an FP8 pool: 8 codes per thread quantized as they are stored.
template <int kHeadDim>
__global__ void kv_write_fp8_kernel(KvWriteParams p) {
  constexpr int kVecs = kHeadDim / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = p.num_tokens * p.num_kv_heads * kVecs;
  if (idx >= total) return;
  const int64_t c = idx % kVecs;
  const int64_t th = idx / kVecs;
  const int64_t h = th % p.num_kv_heads, t = th / p.num_kv_heads;
  const int64_t slot_index = p.slot_index[t];
  if (slot_index < 0) return;
  const int64_t page = slot_index / p.page_size, slot = slot_index % p.page_size;
  const int64_t kv_stride = p.num_kv_heads * p.page_size * kHeadDim;
  uint8_t* gK = reinterpret_cast<uint8_t*>(p.pool) + page * 2 * kv_stride +
                (h * p.page_size + slot) * kHeadDim + c * 8;
  float r[8];
  load_bf16<8>(p.k + th * kHeadDim + c * 8, r);
  store_kv_fp8<8>(gK, r, p.k_scale);
  load_bf16<8>(p.v + th * kHeadDim + c * 8, r);
  store_kv_fp8<8>(gK + kv_stride, r, p.v_scale);
}

// N consecutive pool elements (bf16 or fp8 codes) at element offset `off` as fp32 (fp8:
// unscaled code values).
template <bool kFp8, int N>
__device__ __forceinline__ void load_kv(bf16 const* pool, int64_t off, float (&v)[N]) {
  if constexpr (kFp8) {
    load_kv_fp8<N>(reinterpret_cast<uint8_t const*>(pool) + off, v);
  } else {
    load_bf16<N>(pool + off, v);
  }
}

// ---------------------------------------------------------------- paged attention
constexpr int kAttnWarps = 4;

// One block per (query token, kv head), serving the kGroup q heads of that kv head.
// Warp w takes key tiles w, w + 4, ... of 32 keys; lane l scores key tile_start + l against
// the group's q (fp32 in shared memory), an online softmax per warp keeps (max, sum, acc),
// and the 4 warps merge at the end. Lane l accumulates V dims [l * kDPer, (l + 1) * kDPer).
// The merge takes kMergeGroups heads per pass: one pass for groups <= 8, two for group 16 (an
// sAcc of all 16 heads would pass the 48 KiB of static shared memory at head_dim 128); at
// head_dim 256 (Qwen3.5) 4 heads per pass.
// kFp8: the pool holds E4M3 codes; k_scale folds into q's scale, v_scale into the output.
template <int kHeadDim, int kGroup, bool kFp8>
__global__ void __launch_bounds__(kAttnWarps * 32) paged_attention_kernel(PagedAttentionParams p) {
  constexpr int kDPer = kHeadDim / 32;
  constexpr int kMaxMerge = kHeadDim == 256 ? 4 : 8;
  constexpr int kMergeGroups = kGroup < kMaxMerge ? kGroup : kMaxMerge;
  static_assert(kGroup % kMergeGroups == 0, "whole merge passes");
  __shared__ float sQ[kGroup][kHeadDim];
  __shared__ float sP[kAttnWarps][32][kGroup];
  __shared__ float sM[kAttnWarps][kGroup], sL[kAttnWarps][kGroup];
  __shared__ float sAcc[kAttnWarps][kMergeGroups][kHeadDim];

  const int64_t t = blockIdx.x / p.num_kv_heads, kvh = blockIdx.x % p.num_kv_heads;
  const int64_t split = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  // q of the group, scaled, to shared memory.
  bf16 const* gQ = p.q + (t * p.num_q_heads + kvh * kGroup) * kHeadDim;
  const float q_scale = kFp8 ? p.scale * p.k_scale : p.scale;
  for (int i = threadIdx.x; i < kGroup * kHeadDim; i += blockDim.x) {
    sQ[i / kHeadDim][i % kHeadDim] = __bfloat162float(gQ[i]) * q_scale;
  }
  __syncthreads();

  const int64_t len = static_cast<int64_t>(p.positions[t]) + 1;
  // This block's keys: [begin, end).
  const int64_t begin = p.kv_split > 0 ? split * p.kv_split : 0;
  const int64_t end = p.kv_split > 0 ? min(len, begin + p.kv_split) : len;
  int32_t const* table = p.block_table + static_cast<int64_t>(p.token_seq[t]) * p.max_pages_per_seq;
  const int64_t kv_stride = p.num_kv_heads * p.page_size * kHeadDim;
  const int64_t head_off = kvh * p.page_size * kHeadDim;  // elements; + page * 2 * kv_stride

  float m[kGroup], l[kGroup], acc[kGroup][kDPer];
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int d = 0; d < kDPer; ++d) acc[g][d] = 0.f;
  }

  for (int64_t tile = begin + static_cast<int64_t>(warp) * 32; tile < end;
       tile += kAttnWarps * 32) {
    const int64_t j = tile + lane;
    const bool valid = j < end;
    float s[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) s[g] = 0.f;
    int64_t key_off = 0;  // this lane's key row, relative to gKHead (V: + kv_stride)
    if (valid) {
      const int64_t page = table[j / p.page_size];
      key_off = page * 2 * kv_stride + (j % p.page_size) * kHeadDim;
#pragma unroll 4
      for (int c = 0; c < kHeadDim / 8; ++c) {
        float rK[8];
        load_kv<kFp8, 8>(p.pool, head_off + key_off + c * 8, rK);
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
#pragma unroll
          for (int e = 0; e < 8; ++e) s[g] += rK[e] * sQ[g][c * 8 + e];
        }
      }
    }
    // Online softmax update; the tile's first key is always valid, so m stays finite.
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const float sg = valid ? s[g] : -INFINITY;
      const float m_new = fmaxf(m[g], warp_max(sg));
      const float corr = expf(m[g] - m_new);
      const float pj = valid ? expf(sg - m_new) : 0.f;
      l[g] = l[g] * corr + warp_sum(pj);
#pragma unroll
      for (int d = 0; d < kDPer; ++d) acc[g][d] *= corr;
      m[g] = m_new;
      sP[warp][lane][g] = pj;
    }
    __syncwarp();
    // P V: key jj's row offset comes from lane jj; a full tile is unrolled so that several
    // V loads are in flight at once.
    const int64_t v_lane_off = head_off + kv_stride + lane * kDPer;
    auto accumulate_v = [&](int jj) {
      const int64_t off = __shfl_sync(0xffffffffu, key_off, jj);
      float rV[kDPer];
      load_kv<kFp8, kDPer>(p.pool, v_lane_off + off, rV);
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const float pg = sP[warp][jj][g];
#pragma unroll
        for (int d = 0; d < kDPer; ++d) acc[g][d] += pg * rV[d];
      }
    };
    if (end - tile >= 32) {
#pragma unroll 8
      for (int jj = 0; jj < 32; ++jj) accumulate_v(jj);
    } else {
      const int nkeys = static_cast<int>(end - tile);
      for (int jj = 0; jj < nkeys; ++jj) accumulate_v(jj);
    }
    __syncwarp();
  }

  // Merge the warps' partial softmax states, heads [g0, g0 + kMergeGroups) per pass.
  bf16* gO = p.out + (t * p.num_q_heads + kvh * kGroup) * kHeadDim;
  const int64_t num_splits = gridDim.y;
#pragma unroll
  for (int g0 = 0; g0 < kGroup; g0 += kMergeGroups) {
    if (g0 > 0) __syncthreads();  // every thread has read the previous pass's sAcc
#pragma unroll
    for (int gg = 0; gg < kMergeGroups; ++gg) {
      const int g = g0 + gg;
      if (lane == 0) {
        sM[warp][g] = m[g];
        sL[warp][g] = l[g];
      }
#pragma unroll
      for (int d = 0; d < kDPer; ++d) sAcc[warp][gg][lane * kDPer + d] = acc[g][d];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kMergeGroups * kHeadDim; i += blockDim.x) {
      const int gg = i / kHeadDim, g = g0 + gg, d = i % kHeadDim;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) mx = fmaxf(mx, sM[w][g]);
      float num = 0.f, den = 0.f;
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float f = sM[w][g] == -INFINITY ? 0.f : expf(sM[w][g] - mx);
        num += f * sAcc[w][gg][d];
        den += f * sL[w][g];
      }
      if constexpr (kFp8) num *= p.v_scale;
      if (p.kv_split > 0) {
        // Partial state of this split: acc (relative to mx), mx, den. An empty split (begin
        // >= len) leaves mx = -inf, den = 0, acc = 0.
        float* gW = p.workspace +
                    ((t * p.num_q_heads + kvh * kGroup + g) * num_splits + split) * (kHeadDim + 2);
        gW[d] = num;
        if (d == 0) {
          gW[kHeadDim] = mx;
          gW[kHeadDim + 1] = den;
        }
      } else {
        gO[g0 * kHeadDim + i] = __float2bfloat16_rn(num / den);
      }
    }
  }
}

// One block of kHeadDim threads per (token, q head): merges the splits' partial states.
template <int kHeadDim>
__global__ void __launch_bounds__(kHeadDim)
    paged_attention_merge_kernel(PagedAttentionParams p, int num_splits) {
  const int64_t tq = blockIdx.x;  // t * num_q_heads + h
  const int d = threadIdx.x;
  float const* gW = p.workspace + tq * num_splits * (kHeadDim + 2);
  float mx = -INFINITY;
  for (int s = 0; s < num_splits; ++s) mx = fmaxf(mx, gW[s * (kHeadDim + 2) + kHeadDim]);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    float const* gS = gW + s * (kHeadDim + 2);
    const float ms = gS[kHeadDim];
    if (ms == -INFINITY) continue;  // empty split
    const float f = expf(ms - mx);
    num += f * gS[d];
    den += f * gS[kHeadDim + 1];
  }
  p.out[tq * kHeadDim + d] = __float2bfloat16_rn(num / den);
}

template <int kHeadDim, bool kFp8>
void paged_attention_group_t(PagedAttentionParams const& p, int group, dim3 blocks,
                             cudaStream_t stream) {
  constexpr int threads = kAttnWarps * 32;
  switch (group) {
    case 1: paged_attention_kernel<kHeadDim, 1, kFp8><<<blocks, threads, 0, stream>>>(p); break;
    case 2: paged_attention_kernel<kHeadDim, 2, kFp8><<<blocks, threads, 0, stream>>>(p); break;
    case 4: paged_attention_kernel<kHeadDim, 4, kFp8><<<blocks, threads, 0, stream>>>(p); break;
    case 8: paged_attention_kernel<kHeadDim, 8, kFp8><<<blocks, threads, 0, stream>>>(p); break;
    case 16: paged_attention_kernel<kHeadDim, 16, kFp8><<<blocks, threads, 0, stream>>>(p); break;
    default: TANDEM_THROW(kUnsupported, "paged_attention: unsupported GQA group size ", group);
  }
}

template <int kHeadDim>
void paged_attention_group(PagedAttentionParams const& p, int group, int num_splits,
                           cudaStream_t stream) {
  const dim3 blocks(static_cast<unsigned>(p.num_tokens * p.num_kv_heads),
                    static_cast<unsigned>(num_splits));
  if (p.kv_fp8) {
    paged_attention_group_t<kHeadDim, true>(p, group, blocks, stream);
  } else {
    paged_attention_group_t<kHeadDim, false>(p, group, blocks, stream);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
  if (p.kv_split > 0) {
    paged_attention_merge_kernel<kHeadDim>
        <<<static_cast<unsigned>(p.num_tokens * p.num_q_heads), kHeadDim, 0, stream>>>(p,
                                                                                       num_splits);
  }
}

}  // namespace

int64_t paged_attention_num_splits(int64_t max_pages_per_seq, int64_t page_size, int64_t kv_split) {
  if (kv_split <= 0) return 1;
  return (max_pages_per_seq * page_size + kv_split - 1) / kv_split;
}

size_t paged_attention_workspace_floats(int64_t num_tokens, int64_t num_q_heads, int64_t head_dim,
                                        int64_t max_pages_per_seq, int64_t page_size,
                                        int64_t kv_split) {
  if (kv_split <= 0) return 0;
  return static_cast<size_t>(num_tokens * num_q_heads *
                             paged_attention_num_splits(max_pages_per_seq, page_size, kv_split) *
                             (head_dim + 2));
}

int64_t paged_attention_pick_split(int64_t num_tokens, int64_t num_kv_heads,
                                   int64_t max_pages_per_seq, int64_t page_size, int num_sms) {
  const int64_t blocks = num_tokens * num_kv_heads, target = 2 * static_cast<int64_t>(num_sms);
  const int64_t max_len = max_pages_per_seq * page_size;
  if (blocks >= target || max_len <= 128) return 0;
  const int64_t splits = (target + blocks - 1) / blocks;
  int64_t split = (max_len + splits - 1) / splits;
  split = std::max<int64_t>(128, (split + 127) / 128 * 128);
  return split >= max_len ? 0 : split;
}

int64_t paged_attention_decode_split(int64_t num_tokens, int64_t num_kv_heads,
                                     int64_t max_pages_per_seq, int64_t page_size, int num_sms) {
  const int64_t blocks = num_tokens * num_kv_heads, target = 12 * static_cast<int64_t>(num_sms);
  const int64_t max_len = max_pages_per_seq * page_size;
  if (blocks >= target || max_len <= 128) return 0;
  const int64_t splits = (target + blocks - 1) / blocks;
  int64_t split = (max_len + splits - 1) / splits;
  split = std::max<int64_t>(128, (split + 127) / 128 * 128);
  return split >= max_len ? 0 : split;
}

void kv_write_launch(KvWriteParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0 && p.num_kv_heads > 0 && p.page_size > 0, "kv_write: bad sizes");
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) {
    TANDEM_THROW(kUnsupported, "kv_write: unsupported head_dim ", p.head_dim);
  }
  TANDEM_CHECK(aligned_to(16, p.k, p.v, p.pool), "kv_write: pointers must be 16-byte aligned");
  if (p.num_tokens == 0) return;
  const int64_t total = p.num_tokens * p.num_kv_heads * (p.head_dim / 8);
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  TANDEM_CHECK(blocks <= INT32_MAX, "kv_write: too large");
  const auto grid = static_cast<unsigned>(blocks);
  if (p.kv_fp8) {
    TANDEM_CHECK_KIND(kInvalidArgument, p.k_scale > 0.f && p.v_scale > 0.f,
                      "kv_write: fp8 scales must be positive");
    switch (p.head_dim) {
      case 64: kv_write_fp8_kernel<64><<<grid, threads, 0, stream>>>(p); break;
      case 128: kv_write_fp8_kernel<128><<<grid, threads, 0, stream>>>(p); break;
      case 256: kv_write_fp8_kernel<256><<<grid, threads, 0, stream>>>(p); break;
      default: TANDEM_THROW(kUnsupported, "kv_write: unsupported head_dim ", p.head_dim);
    }
    TANDEM_CUDA_CHECK_LAUNCH();
    return;
  }
  switch (p.head_dim) {
    case 64: kv_write_kernel<64><<<grid, threads, 0, stream>>>(p); break;
    case 128: kv_write_kernel<128><<<grid, threads, 0, stream>>>(p); break;
    case 256: kv_write_kernel<256><<<grid, threads, 0, stream>>>(p); break;
    default: TANDEM_THROW(kUnsupported, "kv_write: unsupported head_dim ", p.head_dim);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void paged_attention_launch(PagedAttentionParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(
      p.num_tokens >= 0 && p.num_kv_heads > 0 && p.page_size > 0 && p.max_pages_per_seq > 0,
      "paged_attention: bad sizes");
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) {
    TANDEM_THROW(kUnsupported, "paged_attention: unsupported head_dim ", p.head_dim);
  }
  if (p.num_q_heads % p.num_kv_heads != 0) {
    TANDEM_THROW(kUnsupported, "paged_attention: num_q_heads ", p.num_q_heads,
                 " not a multiple of num_kv_heads ", p.num_kv_heads);
  }
  const int64_t group = p.num_q_heads / p.num_kv_heads;
  TANDEM_CHECK(aligned_to(16, p.pool), "paged_attention: pool must be 16-byte aligned");
  if (group != 1 && group != 2 && group != 4 && group != 8 && group != 16) {
    TANDEM_THROW(kUnsupported, "paged_attention: unsupported GQA group size ", group);
  }
  TANDEM_CHECK(p.kv_split <= 0 || (p.kv_split % 128 == 0 && p.workspace != nullptr),
               "paged_attention: kv_split ", p.kv_split,
               " must be a multiple of 128 with a workspace");
  if (p.num_tokens == 0) return;
  TANDEM_CHECK(p.num_tokens * p.num_q_heads <= INT32_MAX, "paged_attention: too large");
  const int64_t num_splits =
      paged_attention_num_splits(p.max_pages_per_seq, p.page_size, p.kv_split);
  TANDEM_CHECK(num_splits <= 65535, "paged_attention: too many splits ", num_splits);
  TANDEM_CHECK(p.num_prefill_tokens >= -1 && p.num_prefill_tokens <= p.num_tokens,
               "paged_attention: num_prefill_tokens ", p.num_prefill_tokens, " of ", p.num_tokens);
  // head_dim 256 (Qwen3.5) and FP8 pools (no prefill kernel of ours there): with algo kAuto,
  // the prefill tokens on FlashInfer's sm90 kernel through a ready plan (else the simple
  // kernel) and the decode tokens on the tensor-core decode kernel (with num_prefill_tokens
  // unknown: every token on it when kv_split > 0 or num_tokens <= 256, as the bf16 path, else
  // every token on the simple kernel); kDecode: every token on the decode kernel; kSimple, and
  // kPrefill at head_dim 256 (bf16): every token on the simple kernel. kAuto keeps the simple
  // kernel where the tensor-core one cannot run (page_size not a power of two, q / out not
  // aligned).
  if (p.kv_fp8) {
    TANDEM_CHECK_KIND(kUnsupported, p.algo != PagedAttentionAlgo::kPrefill,
                      "paged_attention: an FP8 KV cache runs algo kAuto, kDecode or kSimple");
    TANDEM_CHECK_KIND(kInvalidArgument, p.k_scale > 0.f && p.v_scale > 0.f,
                      "paged_attention: fp8 scales must be positive");
  }
  if (p.head_dim == 256 || p.kv_fp8) {
    if (p.algo == PagedAttentionAlgo::kDecode) {
      detail::paged_attention_decode(p, 0, static_cast<int>(num_splits), stream);
      return;
    }
    const bool tensor_core = (p.page_size & (p.page_size - 1)) == 0 &&
                             aligned_to(16, p.q, p.pool) && aligned_to(4, p.out);
    const bool automatic = p.algo == PagedAttentionAlgo::kAuto;
    const int64_t num_prefill = automatic && p.prefill_plan != nullptr && p.prefill_plan->ready()
                                    ? std::max<int64_t>(p.num_prefill_tokens, 0)
                                    : 0;
    // Tokens [decode_begin, num_tokens) on the decode kernel.
    int64_t decode_begin = p.num_tokens;
    if (automatic && tensor_core) {
      constexpr int64_t kDecodeMaxTokens = 256;
      decode_begin = p.num_prefill_tokens >= 0                              ? p.num_prefill_tokens
                     : (p.kv_split > 0 || p.num_tokens <= kDecodeMaxTokens) ? 0
                                                                            : p.num_tokens;
    }
    if (num_prefill > 0) p.prefill_plan->run(p, stream);
    if (decode_begin > num_prefill) {
      // The simple kernel over tokens [num_prefill, decode_begin); its split partials take the
      // workspace rows of tokens [0, decode_begin - num_prefill), below the decode kernel's.
      PagedAttentionParams rest = p;
      rest.q += num_prefill * p.num_q_heads * p.head_dim;
      rest.out += num_prefill * p.num_q_heads * p.head_dim;
      rest.token_seq += num_prefill;
      rest.positions += num_prefill;
      rest.num_tokens = decode_begin - num_prefill;
      rest.num_prefill_tokens = 0;
      switch (p.head_dim) {
        case 64:
          paged_attention_group<64>(rest, static_cast<int>(group), static_cast<int>(num_splits),
                                    stream);
          break;
        case 128:
          paged_attention_group<128>(rest, static_cast<int>(group), static_cast<int>(num_splits),
                                     stream);
          break;
        default:
          paged_attention_group<256>(rest, static_cast<int>(group), static_cast<int>(num_splits),
                                     stream);
      }
      TANDEM_CUDA_CHECK_LAUNCH();
    }
    detail::paged_attention_decode(p, decode_begin, static_cast<int>(num_splits), stream);
    return;
  }
  switch (p.algo) {
    case PagedAttentionAlgo::kSimple: break;
    case PagedAttentionAlgo::kPrefill:
      detail::paged_attention_prefill(p, p.num_tokens, stream);
      return;
    case PagedAttentionAlgo::kDecode:
      detail::paged_attention_decode(p, 0, static_cast<int>(num_splits), stream);
      return;
    case PagedAttentionAlgo::kAuto: {
      constexpr int64_t kDecodeMaxTokens = 256;
      const int64_t num_prefill = p.num_prefill_tokens >= 0 ? p.num_prefill_tokens
                                  : (p.kv_split > 0 || p.num_tokens <= kDecodeMaxTokens)
                                      ? 0
                                      : p.num_tokens;
      if (p.prefill_plan != nullptr && p.prefill_plan->ready() && num_prefill > 0) {
        p.prefill_plan->run(p, stream);
      } else {
        detail::paged_attention_prefill(p, num_prefill, stream);
      }
      detail::paged_attention_decode(p, num_prefill, static_cast<int>(num_splits), stream);
      return;
    }
    default: TANDEM_THROW(kUnsupported, "paged_attention: unknown algo ", static_cast<int>(p.algo));
  }
  switch (p.head_dim) {
    case 64:
      paged_attention_group<64>(p, static_cast<int>(group), static_cast<int>(num_splits), stream);
      break;
    case 128:
      paged_attention_group<128>(p, static_cast<int>(group), static_cast<int>(num_splits), stream);
      break;
    default: TANDEM_THROW(kUnsupported, "paged_attention: unsupported head_dim ", p.head_dim);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda
