// CUDA ops of the Qwen3.5 gated DeltaNet (linear attention) layer: the causal depthwise conv1d
// over the qkv channels (prefill and decode update in one launch), the gated delta rule with an
// fp32 recurrent state per value head (recurrent over the tokens of each sequence, parallel
// over sequences, value heads and value columns; the state is read and written once per
// launch) and the RMSNorm gated by silu(z). bf16 activations in, fp32 inside and in the state.
// Framework-free: a params struct in, a stream; launches are asynchronous and CUDA-graph safe
// (every launch shape depends on num_tokens, num_seqs and the model's sizes only).
// CPU references: cpu::causal_conv1d, cpu::deltanet_gates, cpu::gated_delta_rule,
// cpu::gated_rms_norm (src/backend/cpu/ops.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

/// The sequences of a batch as the DeltaNet ops see them: each sequence's tokens contiguous
/// (at least one), sequences in token order; num_tokens == num_seqs is a decode step. A sequence
/// whose slot is < 0 (padding of a captured batch) reads a zero state and writes none; a fresh one
/// (its first token is position 0) starts from zero. Its state slot s lives at `states + s *
/// state_stride` of the op's state pointer. A sequence may have no tokens (the recurrence forms:
/// nothing is read, and a state slot it has keeps its state).
struct DeltaNetSeqs {
  int32_t const* seq_begin;   // [num_seqs + 1]: first token of each sequence, then num_tokens
  int32_t const* token_seq;   // [num_tokens]: sequence of each token
  int32_t const* state_slot;  // [num_seqs]: state slot, < 0: padding
  int32_t const* fresh;       // [num_seqs]: 1: zero initial state
  int64_t num_seqs;
  // [num_seqs] or null: the slot each sequence's state after its tokens goes to (< 0: none),
  // its state_slot then only read (a speculative verify writes a spare slot and keeps the state
  // before it); null: state_slot, in place.
  int32_t const* state_slot_out = nullptr;
};

/// Depthwise causal conv1d (+ SiLU) over the new tokens of each sequence, continuing from its
/// window of kernel - 1 previous inputs, which becomes the last kernel - 1 inputs:
///   out[t, c] = silu(sum_j weight[c, j] * x'[t + j, c]),  x' = (window[c, :], x[:, c]).
/// kernel in [2, 8]. A decode step is one token per sequence.
struct CausalConv1dParams {
  bf16 const* x;       // [num_tokens, x_stride]: channels [0, channels) of each row
  bf16 const* weight;  // [channels, kernel]
  float* states;       // per slot: [channels, kernel - 1] at states + slot * state_stride
  bf16* out;           // [num_tokens, channels]; must not alias x
  DeltaNetSeqs seqs;
  int64_t num_tokens, channels, kernel, x_stride, state_stride;
  bool silu = true;
};
void causal_conv1d_launch(CausalConv1dParams const& p, cudaStream_t stream);

/// The gated delta rule on the conv output, the gates computed from the projection:
///   beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias) per token and value head;
///   q, k L2-normalised (x / sqrt(sum x^2 + 1e-6)), q scaled by 1 / sqrt(k_dim); value head h
///   reads q/k head h / (num_v_heads / num_k_heads); per token
///   S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q   (S: [k_dim, v_dim], fp32).
/// k_dim 16, 32, 64 or 128 (kUnsupported otherwise); v_dim at most 256.
/// A decode step (one token per sequence) and short chunks (short_chunk_tokens): the recurrence,
/// 4 warps per 32 value columns splitting the state's rows. Prefill (k_dim 64 or 128, more than
/// short_chunk_tokens tokens per sequence on average): the chunked form on tensor cores (chunks of
/// 64 tokens: the WY representation of each chunk in parallel, then the chunks of a sequence in
/// order, the state fp32 in the accumulators, bf16 operands: bf16-level error); with `sequential`
/// (or k_dim 16 / 32) the recurrence over the tokens, a warp holding its columns' state slice in
/// registers (fp32 throughout). `workspace` holds the normalised q, k, the gates and the chunked
/// form's intermediates.
struct GatedDeltaRuleParams {
  bf16 const* qkv;       // [num_tokens, qkv_stride]: q [hk, dk] | k [hk, dk] | v [hv, dv]
  bf16 const* b;         // [num_tokens, ab_stride]: columns [0, num_v_heads)
  bf16 const* a;         // [num_tokens, ab_stride]: columns [0, num_v_heads)
  float const* a_log;    // [num_v_heads]
  float const* dt_bias;  // [num_v_heads]
  float* states;         // per slot: [num_v_heads, k_dim, v_dim] at states + slot * state_stride
  float* out;            // [num_tokens, num_v_heads, v_dim]
  float* workspace;      // gated_delta_rule_workspace_floats(...)
  DeltaNetSeqs seqs;
  int64_t num_tokens, num_k_heads, num_v_heads, k_dim, v_dim, qkv_stride, ab_stride, state_stride;
  bool sequential = false;  // prefill by the per-token recurrence (reference, benchmarks)
  // A prefill batch of at most this many tokens per sequence on average (speculative verify
  // steps: K + 1 <= 5) takes the per-token recurrence too, in the decode step's blocks: the
  // chunked form pads each sequence to a 64-token chunk, so at a few tokens per sequence the
  // blocks are faster than both it and the one-warp recurrence (bench_deltanet --verify,
  // docs/perf.md). 0: the chunked form whenever it applies.
  int64_t short_chunk_tokens = 8;
  // Benchmarks only: the chunked form stops after its first `stages` kernels (1: the q / k norm
  // and gates, 2: + the per-chunk WY kernel, 3: + the sequence-order state kernel, all).
  int stages = 3;
  // Benchmarks and tests only: the WY kernel in its first shared-memory layout (every tile in its
  // own place: 97 KB, 2 blocks per SM, vs 52 KB and 4); the same results bit for bit.
  bool wide_wy = false;
  // Benchmarks and tests only: the sequence-order state kernel's shape. 0: by the grid's size: 2
  // when the blocks of 32 value columns per (value head, sequence) are at least two per SM, else
  // 1. 1: 32 columns x 4 warps (the first shape), 2: 64 columns x 8 warps (2 cp.async stages).
  int state_variant = 0;
  // Opt-in, not yet measured: the chunked form's q / k prep with 4 heads per warp (4 loads in
  // flight per lane instead of 1).
  bool prep_heads4 = false;
  // Opt-in, not yet measured: the WY kernel's T = (I + A)^-1 blockwise by all four warps (16 x 16
  // diagonal blocks by substitution, then the off-diagonal blocks by products; fp32) instead of
  // the 64-row substitution on two warps. Compact layout only.
  bool wy_blocked_inverse = false;
  // Benchmarks only, wrong results: the WY kernel with T = I - A instead of the substitution
  // (its cost without the serial part; compact layout).
  bool wy_probe_no_substitution = false;
  // A decode step as one kernel (the delta-rule kernel normalises q / k and computes the gates
  // itself, no prep launch). Qwen35MoeCuda sets it (set_fused_deltanet_decode).
  bool fused_decode = false;
  // Benchmarks and tests: short chunks (at most short_chunk_tokens tokens per sequence on
  // average) by the one-warp recurrence (a warp per (32 / (k_dim / 16)) columns, 16 state rows
  // per lane, strided state reads) instead of the decode step's blocks (4 warps per 32 columns
  // splitting the rows, coalesced state rows), the default.
  bool short_chunks_by_warp = false;
  // Only the states are wanted (a speculative step's state replay): the recurrence forms skip
  // each sequence without a state slot outright, writing no output for its tokens (a launch of
  // a fixed shape padded with many such tokens then costs what its real sequences do); the
  // chunked and the fused decode forms ignore it.
  bool states_only = false;
};
void gated_delta_rule_launch(GatedDeltaRuleParams const& p, cudaStream_t stream);
/// Benchmarks: resident blocks per SM of the chunked form's kernels at k_dim 128 and v_dim
/// (cudaOccupancyMaxActiveBlocksPerMultiprocessor after the launches' shared-memory settings):
/// [0] the WY kernel, [1] its wide layout, [2] / [3] the state kernel's shapes 1 / 2.
void gated_delta_rule_occupancy(int64_t v_dim, int (&blocks)[4]);
/// fp32 elements of GatedDeltaRuleParams::workspace for num_tokens tokens.
size_t gated_delta_rule_workspace_floats(int64_t num_tokens, int64_t num_k_heads,
                                         int64_t num_v_heads, int64_t k_dim, int64_t v_dim);

/// RMSNorm gated by silu, per row of `dim` (rows = tokens * heads):
///   out = weight * x / sqrt(mean(x^2) + eps) * silu(gate), fp32 in, bf16 out.
/// Row r = t * heads + h reads its gate at gate + t * gate_stride + h * dim.
struct GatedRmsNormParams {
  float const* x;       // [rows, dim]
  bf16 const* gate;     // see above
  float const* weight;  // [dim] (plain weight)
  bf16* out;            // [rows, dim]
  int64_t rows, dim, heads, gate_stride;
  float eps;
};
void gated_rms_norm_launch(GatedRmsNormParams const& p, cudaStream_t stream);

}  // namespace tandem::cuda
