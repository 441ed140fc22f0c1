// Kernels private to MoeLayer (moe_layer.cpp): the fused decode router (router dot products +
// top-k softmax + permute indices in one launch), the in-place SiLU-multiply on the packed
// gate_up output of the cuBLAS prefill paths and the row gather of the padded / cublas paths.
#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_layer.h"

namespace tandem::cuda::moe_layer_detail {

using namespace detail;

namespace {

constexpr int kRouterWarps = 4;                             // experts per CTA (one warp each)
constexpr int kMaxTopK = static_cast<int>(kRouterMaxTopK);  // unpermute's sort buffer

// Grid: ceil(E / 4) CTAs of 4 warps; warp w of CTA b computes logits[t, 4 b + w] for every token
// (fp32, lane-strided 8-element chunks, then a fixed xor-shuffle tree: deterministic). The last
// CTA to finish (atomic counter, reset by it) then does the top-k softmax of every token, with
// exactly topk_softmax_kernel's arithmetic and tie rule (greater probability, then lower
// expert id), and the permute indices (moe_permute's order: by local expert, then token-slot).
// kPerLane logits per lane (num_experts <= 32 kPerLane), top_k <= kMaxK.
template <int kPerLane, int kMaxK>
__global__ void __launch_bounds__(kRouterWarps * 32) decode_router_kernel(DecodeRouterParams p) {
  __shared__ int sLocal[kDecodeMaxSlots];
  __shared__ bool sLast;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int T = p.num_tokens, E = p.num_experts, H = p.hidden, K = p.top_k;
  // The gate_up GEMM (launched with kWaitFirst) may get resident now; it waits for this grid.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  // 1. Router logits. The first kPre 16-byte weight chunks of each lane are loaded before
  // griddepcontrol.wait (a no-op unless launched with p.pdl): the weights are constant, x is
  // the previous kernel's output.
  constexpr int kPre = 8;
  const int e = blockIdx.x * kRouterWarps + warp;
  bf16 const* gW = p.router + static_cast<int64_t>(e < E ? e : 0) * H;
  uint4 pre[kPre];
#pragma unroll
  for (int i = 0; i < kPre; ++i) {
    const int c = lane * 8 + 32 * 8 * i;
    pre[i] = e < E && c < H ? __ldg(reinterpret_cast<uint4 const*>(gW + c)) : uint4{};
  }
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  if (e < E) {
    float acc[kDecodeMaxTokens];
#pragma unroll
    for (int t = 0; t < kDecodeMaxTokens; ++t) acc[t] = 0.f;
    auto consume = [&](uint4 const& raw, int c) {
      float w[8];
      __nv_bfloat162 const* h2 = reinterpret_cast<__nv_bfloat162 const*>(&raw);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h2[i]);
        w[2 * i] = f.x;
        w[2 * i + 1] = f.y;
      }
#pragma unroll
      for (int t = 0; t < kDecodeMaxTokens; ++t) {
        if (t < T) {
          float xv[8];
          load_bf16<8>(p.x + static_cast<int64_t>(t) * H + c, xv);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[t] = fmaf(xv[i], w[i], acc[t]);
        }
      }
    };
#pragma unroll
    for (int i = 0; i < kPre; ++i) {
      const int c = lane * 8 + 32 * 8 * i;
      if (c < H) consume(pre[i], c);
    }
    // Past the preloaded chunks (hidden > 2048): unrolled so that several 16-byte weight loads
    // are in flight per lane (the router rows are normally not in L2 at decode: the experts
    // stream through it).
#pragma unroll 8
    for (int c = lane * 8 + 32 * 8 * kPre; c < H; c += 32 * 8) {
      consume(__ldg(reinterpret_cast<uint4 const*>(gW + c)), c);
    }
#pragma unroll
    for (int t = 0; t < kDecodeMaxTokens; ++t) {
      if (t < T) {
        const float v = warp_sum(acc[t]);
        if (lane == 0) p.logits[static_cast<int64_t>(t) * E + e] = v;
      }
    }
  }

  // 2. Last CTA: every logit is visible after the fence + counter.
  __threadfence();
  __syncthreads();
  if (tid == 0) sLast = atomicAdd(p.counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!sLast) return;
  __threadfence();

  // 3. Top-k softmax, one warp per token (copy of topk_softmax_kernel's body).
  for (int t = warp; t < T; t += kRouterWarps) {
    float const* gL = p.logits + static_cast<int64_t>(t) * E;
    float prob[kPerLane];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int ee = lane + 32 * i;
      prob[i] = ee < E ? __ldcg(gL + ee) : -INFINITY;
      mx = fmaxf(mx, prob[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int ee = lane + 32 * i;
      prob[i] = ee < E ? expf(prob[i] - mx) : 0.f;
      sum += prob[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int ee = lane + 32 * i;
      prob[i] = ee < E ? prob[i] / sum : -INFINITY;
    }
    float sel_w[kMaxK];
    int sel_e[kMaxK];
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      sel_w[j] = 0.f;
      sel_e[j] = 0;
      if (j < K) {
        float bv = -INFINITY;
        int be = INT32_MAX;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          if (prob[i] > bv) {
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
          if (lane + 32 * i == be) prob[i] = -INFINITY;
        }
      }
    }
    if (lane == 0) {
      float ksum = 0.f;
#pragma unroll
      for (int j = 0; j < kMaxK; ++j) {
        if (j < K) ksum += sel_w[j];
      }
#pragma unroll
      for (int j = 0; j < kMaxK; ++j) {
        if (j < K) {
          p.topk_ids[t * K + j] = sel_e[j];
          p.topk_weights[t * K + j] = p.renormalize ? sel_w[j] / ksum : sel_w[j];
          const int le = sel_e[j] - p.expert_begin;
          sLocal[t * K + j] = le >= 0 && le < p.num_local_experts ? le : -1;
        }
      }
    }
  }
  __syncthreads();

  // 4. Permute indices. S <= 64 slots, so every output is an O(S) count per thread.
  const int S = T * K, L = p.num_local_experts;
  for (int le = tid; le <= L; le += blockDim.x) {
    int before = 0, count = 0;
    for (int s = 0; s < S; ++s) {
      const int v = sLocal[s];
      before += v >= 0 && v < le;
      count += v == le;
    }
    p.expert_offsets[le] = before;
    if (le < L) p.expert_counts[le] = count;
  }
  for (int s = tid; s < S; s += blockDim.x) {
    const int v = sLocal[s];
    if (v < 0) {
      p.slot_row[s] = -1;
      continue;
    }
    int row = 0;
    for (int s2 = 0; s2 < S; ++s2) {
      const int u = sLocal[s2];
      row += (u >= 0 && u < v) || (u == v && s2 < s);
    }
    p.permuted_src[row] = s;
    p.slot_row[s] = row;
  }
  if (tid == 0) *p.counter = 0u;  // ready for the next launch (stream order)
}

// In place on the packed gate_up rows [rows, 2 inter] (blocks of 8 gate then 8 up columns):
// row r columns [0, inter) become silu(gate) * up. Thread (j, y) handles column block j of
// row blockIdx.x * blockDim.y + y; all reads of a CTA happen before its writes (__syncthreads),
// and the CTA owns whole rows, so the overlap of the read and written columns is safe.
__global__ void silu_mul_packed_kernel(bf16* gu, int64_t rows, int64_t inter) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int j = threadIdx.x;
  const bool ok = r < rows;
  float g[8], u[8];
  bf16* row = gu + r * 2 * inter;
  if (ok) {
    load_bf16<8>(row + 16 * j, g);
    load_bf16<8>(row + 16 * j + 8, u);
#pragma unroll
    for (int i = 0; i < 8; ++i) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
  __syncthreads();
  if (ok) store_bf16<8>(row + 8 * j, g);
}

// moe_unpermute_kernel (moe.cu) for bf16 out, hidden % 8 == 0, as a programmatic dependent
// launch after the down GEMM: the routing (slot_row, topk ids and weights, complete before the
// down GEMM started) is read and sorted first, then griddepcontrol.wait before reading
// permuted_y. Same arithmetic and summation order (ascending expert id).
__global__ void unpermute_pdl_kernel(UnpermutePdlParams p) {
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
      while (pos > 0 && ids[pos - 1] > id) {
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
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  __syncthreads();
  const int n = sN;
  bf16* gOut = p.out + t * p.hidden;
  for (int64_t i = threadIdx.x * 8; i < p.hidden; i += blockDim.x * 8) {
    float acc[8];
#pragma unroll
    for (int v = 0; v < 8; ++v) acc[v] = 0.f;
    for (int j = 0; j < n; ++j) {
      float rY[8];
      load_bf16<8>(p.permuted_y + static_cast<int64_t>(sRow[j]) * p.hidden + i, rY);
      const float w = sW[j];
#pragma unroll
      for (int v = 0; v < 8; ++v) acc[v] += w * rY[v];
    }
    store_bf16<8>(gOut + i, acc);
  }
}

// Grid (rows_per_expert, num_local_experts): block (i, e) fills destination row i of expert e
// (see prefill_gather_launch).
template <int kVec>
__global__ void prefill_gather_kernel(PrefillGatherParams p) {
  const int e = blockIdx.y;
  const int64_t i = blockIdx.x;
  const int64_t begin = p.offsets[e], count = p.offsets[e + 1] - begin;
  if (!p.padded && i >= count) return;
  const int64_t dst_row = p.padded ? e * p.rows_per_expert + i : begin + i;
  bf16* gDst = p.rows + dst_row * p.hidden;
  if (i >= count) {  // padding: zeros (finite GEMM outputs; never read)
    for (int64_t c = threadIdx.x * kVec; c < p.hidden; c += blockDim.x * kVec) {
      if constexpr (kVec == 8) {
        *reinterpret_cast<uint4*>(gDst + c) = make_uint4(0u, 0u, 0u, 0u);
      } else {
#pragma unroll
        for (int v = 0; v < kVec; ++v) gDst[c + v] = __float2bfloat16(0.f);
      }
    }
    return;
  }
  const int32_t slot = p.permuted_src[begin + i];
  if (p.padded && threadIdx.x == 0) p.slot_row[slot] = static_cast<int32_t>(dst_row);
  bf16 const* gSrc = p.x + (slot / p.top_k) * p.hidden;
  for (int64_t c = threadIdx.x * kVec; c < p.hidden; c += blockDim.x * kVec) {
    copy_bf16<kVec>(gDst + c, gSrc + c);
  }
}

}  // namespace

void prefill_gather_launch(PrefillGatherParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.hidden > 0 && p.top_k >= 1 && p.num_local_experts >= 1 &&
                   p.num_local_experts <= 65535 && p.rows_per_expert >= 0 &&
                   p.rows_per_expert <= INT32_MAX,
               "prefill_gather: unsupported sizes");
  if (p.rows_per_expert == 0) return;
  const int vec = p.hidden % 8 == 0 && aligned_to(16, p.x, p.rows) ? 8 : 1;
  const dim3 grid(static_cast<unsigned>(p.rows_per_expert),
                  static_cast<unsigned>(p.num_local_experts));
  const int threads = row_threads((p.hidden + vec - 1) / vec, 256);
  if (vec == 8) {
    prefill_gather_kernel<8><<<grid, threads, 0, stream>>>(p);
  } else {
    prefill_gather_kernel<1><<<grid, threads, 0, stream>>>(p);
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void unpermute_pdl_launch(UnpermutePdlParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 0 && p.num_tokens <= INT32_MAX && p.hidden % 8 == 0 &&
                   p.top_k >= 1 && p.top_k <= kMaxTopK && aligned_to(16, p.permuted_y, p.out),
               "unpermute_pdl: unsupported sizes or alignment");
  if (p.num_tokens == 0) return;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(p.num_tokens));
  cfg.blockDim = dim3(row_threads(p.hidden / 8, 256));
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  TANDEM_CUDA_CHECK(cudaLaunchKernelEx(&cfg, unpermute_pdl_kernel, p));
  TANDEM_CUDA_CHECK_LAUNCH();
}

void decode_router_launch(DecodeRouterParams const& p, cudaStream_t stream) {
  TANDEM_CHECK(p.num_tokens >= 1 && p.num_tokens <= kDecodeMaxTokens &&
                   p.num_tokens * p.top_k <= kDecodeMaxSlots && p.top_k >= 1 &&
                   p.top_k <= kMaxTopK && p.top_k <= p.num_experts && p.num_experts >= 1 &&
                   p.num_experts <= kRouterMaxExperts && p.hidden % 8 == 0,
               "decode_router: unsupported sizes (tokens ", p.num_tokens, ", experts ",
               p.num_experts, ", top_k ", p.top_k, ", hidden ", p.hidden, ")");
  const unsigned blocks = static_cast<unsigned>((p.num_experts + kRouterWarps - 1) / kRouterWarps);
  constexpr int threads = kRouterWarps * 32;
  auto launch = [&](auto kernel) {
    if (p.pdl) {
      TANDEM_CUDA_CHECK(launch_pdl(kernel, dim3(blocks), dim3(threads), 0, stream, p));
    } else {
      kernel<<<blocks, threads, 0, stream>>>(p);
    }
  };
  constexpr int kNarrowK = static_cast<int>(kRouterNarrowTopK);
  if (p.top_k > kNarrowK || p.num_experts > kRouterNarrowExperts) {  // the wide variant
    launch(decode_router_kernel<static_cast<int>(kRouterMaxExperts / 32), kMaxTopK>);
  } else {
    switch ((p.num_experts + 31) / 32) {
      case 1: launch(decode_router_kernel<1, kNarrowK>); break;
      case 2: launch(decode_router_kernel<2, kNarrowK>); break;
      case 3:
      case 4: launch(decode_router_kernel<4, kNarrowK>); break;
      default: launch(decode_router_kernel<8, kNarrowK>); break;
    }
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void silu_mul_packed_launch(bf16* gate_up, int64_t rows, int64_t inter, cudaStream_t stream) {
  TANDEM_CHECK(inter % kMoeGateUpInterleave == 0 && inter / 8 <= 1024,
               "silu_mul_packed: bad inter ", inter);
  if (rows == 0) return;
  const int bx = static_cast<int>(inter / 8);
  const int by = std::max(1, 256 / bx);
  const int64_t blocks = (rows + by - 1) / by;
  TANDEM_CHECK(blocks <= INT32_MAX, "silu_mul_packed: too many rows");
  silu_mul_packed_kernel<<<static_cast<unsigned>(blocks), dim3(bx, by), 0, stream>>>(gate_up, rows,
                                                                                     inter);
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::cuda::moe_layer_detail
