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
