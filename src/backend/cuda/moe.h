// MoE pieces: router softmax + top-k, SiLU-multiply, token permutation (group token-slots by
// expert) and weighted unpermutation. The expert GEMMs run between permute and unpermute
// (dense cuBLASLt per expert for now, a grouped GEMM later).
// CPU references: cpu::topk_softmax, cpu::silu_mul, cpu::moe (the composition).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

/// Limits of the routed-MoE kernels (router top-k, permute / unpermute, the decode router and
/// expert GEMVs, MoeLayer): Qwen3.5-397B-A17B's 512 experts, top-10, fit. Up to 256 experts and
/// top-8 (Qwen3-MoE, Qwen3.5-35B / 122B) every kernel runs its narrow variant (fewer registers,
/// unchanged); past either the wide one (32 x 16 experts per warp, top-16).
constexpr int64_t kRouterMaxExperts = 512, kRouterMaxTopK = 16;
constexpr int64_t kRouterNarrowExperts = 256, kRouterNarrowTopK = 8;

/// Router: fp32 softmax over experts, top-k (ties -> lower expert id), optional
/// renormalisation of the k weights. logits bf16 or fp32; num_experts <= kRouterMaxExperts,
/// top_k <= kRouterMaxTopK.
struct TopkSoftmaxParams {
  void const* logits;   // [num_tokens, num_experts] of logits_dtype
  int32_t* topk_ids;    // [num_tokens, top_k]
  float* topk_weights;  // [num_tokens, top_k]
  int64_t num_tokens, num_experts, top_k;
  bool renormalize;
  DType logits_dtype = DType::kBF16;
};
void topk_softmax_launch(TopkSoftmaxParams const& p, cudaStream_t stream);

/// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i], fp32 inside.
struct SiluMulParams {
  bf16 const* gate_up;  // [rows, 2 * inter]
  bf16* out;            // [rows, inter]
  int64_t rows, inter;
};
void silu_mul_launch(SiluMulParams const& p, cudaStream_t stream);

/// Groups the token-slots (t, j) routed to local experts [expert_begin, expert_begin +
/// num_local_experts) by expert; within an expert, rows keep token order (deterministic).
/// Row counts stay on the device (CUDA-graph safe): rows at and past
/// expert_offsets[num_local_experts] of permuted_x / permuted_src are left untouched.
/// num_local_experts <= kRouterMaxExperts.
struct MoePermuteParams {
  bf16 const* x;            // [num_tokens, hidden]
  int32_t const* topk_ids;  // [num_tokens, top_k]: global expert ids
  bf16* permuted_x;         // [num_tokens * top_k, hidden]; nullptr: indices only
  int32_t* expert_counts;   // [num_local_experts]
  int32_t* expert_offsets;  // [num_local_experts + 1]: exclusive scan, last = routed rows
  int32_t* permuted_src;    // [num_tokens * top_k]: token-slot t * top_k + j of each row
  int32_t* slot_row;        // [num_tokens, top_k]: row of each token-slot, -1: not local
  int32_t* workspace;       // [moe_permute_workspace_elems(...)]
  int64_t num_tokens, hidden, top_k, expert_begin, num_local_experts;
};
/// int32 elements of workspace that moe_permute_launch needs.
size_t moe_permute_workspace_elems(int64_t num_tokens, int64_t top_k, int64_t num_local_experts);
void moe_permute_launch(MoePermuteParams const& p, cudaStream_t stream);

/// out[t] = sum over the token's local slots, in ascending expert order, of
/// topk_weights[t, j] * permuted_y[slot_row[t, j]]; fp32 sum, stored as out_dtype (bf16 or
/// fp32). Tokens with no local slot get zeros. top_k <= kRouterMaxTopK.
struct MoeUnpermuteParams {
  bf16 const* permuted_y;     // [num_tokens * top_k, hidden]: expert outputs, permuted order
  int32_t const* topk_ids;    // [num_tokens, top_k]
  float const* topk_weights;  // [num_tokens, top_k]
  int32_t const* slot_row;    // [num_tokens, top_k] from moe_permute_launch
  void* out;                  // [num_tokens, hidden] of out_dtype, overwritten
  int64_t num_tokens, hidden, top_k;
  DType out_dtype = DType::kBF16;
};
void moe_unpermute_launch(MoeUnpermuteParams const& p, cudaStream_t stream);

}  // namespace tandem::cuda
