// The expert GEMVs of a decode MoE block (<= 8 tokens, bf16 experts) as two bandwidth-oriented
// launches after the decode router (moe_layer.h, decode path), replacing the grouped GEMMs'
// 16-row tiles and the unpermute there (issue 15 item 1):
//  - gate_up: a warp per (non-empty local expert, output column j): streams the expert's packed
//    gate row and up row of j (moe_pack_gate_up order) once with 16-byte loads, dots them with
//    each of the expert's token rows of x (<= 8, read through L1), writes
//    act[row, j] = bf16(silu(gate) * up) for each of the expert's compact rows (moe_permute's
//    order: by local expert, then token-slot);
//  - down + unpermute: a warp per output column h of every token: for each non-empty local
//    expert in ascending order, the expert's down row h (read once) dotted with each of its act
//    rows, rounded to bf16 (as the grouped GEMM's output), weighted by the slot's top-k weight
//    and summed per token in that order (the unpermute's order); out[t, h] = bf16(sum), zero for
//    a token without a local expert. Deterministic (fixed shuffle trees, no atomics).
// Both are programmatic dependent launches: gate_up waits for the router before reading
// anything; down reads the routing (complete before gate_up started) and issues its first
// weight loads before waiting for gate_up. Each lets its successor launch once it has waited.
// CPU reference: cpu::moe (tests/backend/cuda/test_moe_decode_cuda.cpp).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

struct MoeDecodeParams {
  bf16 const* x;                  // [num_tokens, hidden], 16-byte aligned
  bf16 const* gate_up;            // [num_local_experts, 2 inter, hidden] packed, 16-byte aligned
  bf16 const* down;               // [num_local_experts, hidden, inter], 16-byte aligned
  int32_t const* topk_ids;        // [num_tokens, top_k]: global expert ids
  float const* topk_weights;      // [num_tokens, top_k]
  int32_t const* expert_offsets;  // [num_local_experts + 1], compact rows per local expert
  int32_t const* permuted_src;    // [num_tokens * top_k]: token-slot of each compact row
  bf16* act;                      // [num_tokens * top_k, inter] scratch, 16-byte aligned
  bf16* out;                      // [num_tokens, hidden], overwritten
  int num_tokens, hidden, inter, top_k, expert_begin, num_local_experts;
};

constexpr int kMoeDecodeMaxTokens = 8;

/// Whether the two kernels take these sizes: 1 <= num_tokens <= 8, num_tokens * top_k <= 64,
/// hidden and inter multiples of 8, inter <= 2048, 1 <= num_local_experts <= 512
/// (kRouterMaxExperts), and the pointers 16-byte aligned.
bool moe_decode_supported(MoeDecodeParams const& p);

/// Both launches (gate_up, then down + unpermute) on `stream`, programmatic dependent launches.
/// Throws kUnsupported when !moe_decode_supported(p).
void moe_decode_launch(MoeDecodeParams const& p, cudaStream_t stream);

}  // namespace tandem::cuda

namespace tandem::cuda {

// One-token decode MoE with the router's top-k inside the expert kernels (issue 15 item 1,
// decode_switches().moe_topk): after a router kernel that only writes the fp32 logits, both
// kernels below compute the top-k softmax of those logits themselves (every warp, redundantly:
// the router's arithmetic and tie rule, see moe_layer_kernels.cu), so the router needs no
// last-CTA tail (fence, counter, top-k, permute indices) and down knows its experts before
// gate_up ends.
//  - gate_up: a persistent grid (the CTAs that fit at once), each warp takes (slot j, column c)
//    items in a grid-stride loop, the next item's gate and up rows loaded while the current one
//    is reduced, x held in registers; act[j, c] = bf16(silu(gate) * up) (act rows by top-k
//    slot, not by compact row). CTA 0 writes topk_ids, topk_weights and expert_offsets (as the
//    router would) for callers that read them.
//  - down: a warp per output column h; before waiting for gate_up it computes the top-k and
//    issues the loads of its column's down rows of the slots' experts; then
//    out[h] = bf16(sum over the local slots in ascending expert id of w_j * bf16(down_e[h] .
//    act[j])): the decode path's (moe_decode_launch's) arithmetic and order, zero without a
//    local expert.
// Programmatic dependent launches (gate_up waits for the router, down for gate_up).
struct MoeDecodeTopkParams {
  bf16 const* x;            // [1, hidden], 16-byte aligned
  float const* logits;      // [1, num_experts] router logits (fp32), written by the previous kernel
  bf16 const* gate_up;      // [num_local_experts, 2 inter, hidden] packed, 16-byte aligned
  bf16 const* down;         // [num_local_experts, hidden, inter], 16-byte aligned
  int32_t* topk_ids;        // [top_k] written: global expert ids
  float* topk_weights;      // [top_k] written
  int32_t* expert_offsets;  // [num_local_experts + 1] written (compact rows per local expert)
  bf16* act;                // [top_k, inter] scratch, 16-byte aligned
  bf16* out;                // [1, hidden], overwritten
  int hidden, inter, num_experts, top_k, expert_begin, num_local_experts;
  bool renormalize;
};

/// 1 <= top_k <= 8, top_k <= num_experts <= 256, hidden and inter multiples of 8,
/// inter <= 2048, 1 <= num_local_experts <= 256, expert_begin >= 0, pointers set and aligned.
/// (Narrow routing only: with more experts or a larger top_k, e.g. Qwen3.5-397B's 512 / top-10,
/// MoeLayer's one-token decode takes the router's top-k and moe_decode_launch instead.)
bool moe_decode_topk_supported(MoeDecodeTopkParams const& p);

/// How the persistent gate_up kernel runs: kPrefetch (the next item's rows in flight while the
/// current one is reduced; one CTA per SM), kOnePerSm (one item at a time, one CTA per SM: a
/// down CTA fits beside it and streams its rows meanwhile), kTwoPerSm (one item at a time, two
/// CTAs per SM), kPrefetchL2Down (kPrefetch, and its threads prefetch the slots' down weights
/// into L2 meanwhile). The same results in every mode.
enum class MoeTopkGateUp { kPrefetch, kOnePerSm, kTwoPerSm, kPrefetchL2Down };

/// Both launches on `stream`. Throws kUnsupported when !moe_decode_topk_supported(p).
void moe_decode_topk_launch(MoeDecodeTopkParams const& p, cudaStream_t stream,
                            MoeTopkGateUp gate_up = MoeTopkGateUp::kPrefetch);

}  // namespace tandem::cuda
