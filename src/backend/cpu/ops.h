// CPU reference ops: framework-free, raw pointers and a params struct each, fp32 compute.
// These are the reference every other backend is tested against, and the CPU backend's
// implementation (multithreaded over ThreadPool::global()).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tandem::cpu {

/// out[m, n] = sum_k a[m, k] * b[n, k]  (b in the Hugging Face [out, in] layout).
struct GemmParams {
  const float* a;  // [m, k]
  const float* b;  // [n, k]
  float* out;      // [m, n]
  int64_t m, n, k;
  bool accumulate = false;  // out += instead of out =
};
void gemm(const GemmParams& p);

/// out[t, :] = table[ids[t], :]
struct EmbeddingParams {
  const int32_t* ids;  // [num_tokens]
  const float* table;  // [vocab, hidden]
  float* out;          // [num_tokens, hidden]
  int64_t num_tokens, hidden, vocab;
};
void embedding(const EmbeddingParams& p);

/// out = x / sqrt(mean(x^2) + eps) * weight, per row. x and out may alias.
struct RmsNormParams {
  const float* x;       // [rows, dim]
  const float* weight;  // [dim]
  float* out;           // [rows, dim]
  int64_t rows, dim;
  float eps;
};
void rms_norm(const RmsNormParams& p);

/// Fused residual add + RMSNorm: residual += x; out = rms_norm(residual).
struct AddRmsNormParams {
  float* residual;      // [rows, dim], updated in place
  const float* x;       // [rows, dim]
  const float* weight;  // [dim]
  float* out;           // [rows, dim]
  int64_t rows, dim;
  float eps;
};
void add_rms_norm(const AddRmsNormParams& p);

/// Per-head RMSNorm of q and k (Qwen3 q_norm / k_norm) followed by RoPE (rotate-half
/// convention, inv_freq = theta^(-2i/head_dim)), in place.
struct QkNormRopeParams {
  float* q;                  // [num_tokens, num_q_heads, head_dim]
  float* k;                  // [num_tokens, num_kv_heads, head_dim]
  const float* q_weight;     // [head_dim], nullptr: no norm
  const float* k_weight;     // [head_dim], nullptr: no norm
  const int32_t* positions;  // [num_tokens]
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim;
  float eps;
  double rope_theta;
  int64_t rotary_dim = 0;  // partial RoPE on the first rotary_dim dims (even); 0: head_dim
};
void qk_norm_rope(const QkNormRopeParams& p);

/// FP8 KV cache (--kv-cache-dtype fp8; the reference of backend/cuda/kv_fp8.cuh): the E4M3 code
/// of x for a layer's k or v scale, e4m3(bf16(x) / scale) rounded to nearest even and saturated
/// to +-448 (as vLLM's fp8 cache, the value first rounded to what the bf16 cache would hold),
/// and a code's value, code * scale.
uint8_t kv_fp8_quantize(float x, float scale);
inline float kv_fp8_dequantize(uint8_t code, float scale) { return f8e4m3_to_f32(code) * scale; }
/// Quantizes n values to codes, and the inverse (out = dequantized codes).
void kv_fp8_quantize(const float* x, uint8_t* codes, int64_t n, float scale);
void kv_fp8_dequantize(const uint8_t* codes, float* out, int64_t n, float scale);

/// Writes new k, v rows into HND pages: pool[page, 0 (k) | 1 (v), head, slot, :].
/// kv_fp8: each value goes through the FP8 cache, kv_fp8_dequantize(kv_fp8_quantize(x)), so
/// the fp32 pool holds exactly what a GPU's FP8 pool dequantizes to (the CPU model's FP8 KV).
struct KvWriteParams {
  const float* k;             // [num_tokens, num_kv_heads, head_dim]
  const float* v;             // [num_tokens, num_kv_heads, head_dim]
  float* pool;                // [num_pages, 2, num_kv_heads, page_size, head_dim]
  const int64_t* slot_index;  // [num_tokens]: page * page_size + slot
  int64_t num_tokens, num_kv_heads, head_dim, page_size;
  bool kv_fp8 = false;
  float k_scale = 1.f, v_scale = 1.f;
};
void kv_write(const KvWriteParams& p);

/// The FP8 write of CUDA's kv_write_launch on host memory: codes of k and v into an E4M3 pool
/// [num_pages, 2, num_kv_heads, page_size, head_dim] (bytes); p.pool is ignored.
void kv_write_fp8(const KvWriteParams& p, uint8_t* pool);
/// An E4M3 pool dequantized to fp32 (k rows times k_scale, v rows times v_scale), the same
/// layout: paged_attention over it is the reference of the FP8 paged attention.
void kv_pool_dequantize_fp8(const uint8_t* pool, float* out, int64_t num_pages,
                            int64_t num_kv_heads, int64_t page_size, int64_t head_dim,
                            float k_scale, float v_scale);

/// Causal GQA attention over paged HND KV. Query token t of sequence s at position
/// pos[t] attends to positions [0, pos[t]] of that sequence.
struct PagedAttentionParams {
  const float* q;              // [num_tokens, num_q_heads, head_dim]
  const float* pool;           // [num_pages, 2, num_kv_heads, page_size, head_dim]
  const int32_t* block_table;  // [num_seqs, max_pages_per_seq]
  const int32_t* token_seq;    // [num_tokens]: sequence of each query token
  const int32_t* positions;    // [num_tokens]
  float* out;                  // [num_tokens, num_q_heads, head_dim]
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, page_size, max_pages_per_seq;
  float scale;
};
void paged_attention(const PagedAttentionParams& p);

/// Router: softmax over experts of logits, top-k (ties -> lower expert id), optional
/// renormalisation of the k weights.
struct TopkSoftmaxParams {
  const float* logits;  // [num_tokens, num_experts]
  int32_t* topk_ids;    // [num_tokens, top_k]
  float* topk_weights;  // [num_tokens, top_k]
  int64_t num_tokens, num_experts, top_k;
  bool renormalize;
};
void topk_softmax(const TopkSoftmaxParams& p);

/// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]
struct SiluMulParams {
  const float* gate_up;  // [rows, 2 * inter]
  float* out;            // [rows, inter]
  int64_t rows, inter;
};
void silu_mul(const SiluMulParams& p);

/// One SwiGLU MLP per expert, applied to the tokens routed to it and accumulated with the
/// router weights: out[t] = sum_j w[t, j] * down_e(silu(gate_e x) * up_e x), e = ids[t, j].
/// Experts outside [expert_begin, expert_begin + num_local_experts) are skipped (EP).
struct MoeParams {
  const float* x;                 // [num_tokens, hidden]
  const int32_t* topk_ids;        // [num_tokens, top_k]
  const float* topk_weights;      // [num_tokens, top_k]
  const float* const* w_gate_up;  // [num_local_experts] -> [2 * inter, hidden]
  const float* const* w_down;     // [num_local_experts] -> [hidden, inter]
  float* out;                     // [num_tokens, hidden], overwritten
  int64_t num_tokens, hidden, inter, top_k, expert_begin, num_local_experts;
};
void moe(const MoeParams& p);

// ---- Qwen3.5 hybrid layers (gated DeltaNet, gated attention, shared expert) -----------------

/// Depthwise causal conv1d with optional SiLU over one sequence's new tokens, continuing from
/// the kernel - 1 previous inputs in `state`:
///   out[t, c] = silu(sum_j weight[c, j] * x'[t + j, c]),  x' = (state[c, :], x[:, c])
/// and state becomes the last kernel - 1 inputs of x'. Zeros in state start a new sequence.
/// Prefill in chunks equals one prefill; a decode step is num_tokens == 1.
struct CausalConv1dParams {
  const float* x;       // [num_tokens, channels]
  const float* weight;  // [channels, kernel]
  float* state;         // [channels, kernel - 1], in/out
  float* out;           // [num_tokens, channels]; must not alias x
  int64_t num_tokens, channels, kernel;
  bool silu = true;
};
void causal_conv1d(const CausalConv1dParams& p);

/// DeltaNet gates per token and value head: beta = sigmoid(b),
/// g = -exp(a_log) * softplus(a + dt_bias) (softplus linear above 20, as torch).
struct DeltaNetGatesParams {
  const float* b;        // [rows, heads] (row stride `stride`)
  const float* a;        // [rows, heads] (row stride `stride`)
  const float* a_log;    // [heads]
  const float* dt_bias;  // [heads]
  float* beta;           // [rows, heads]
  float* g;              // [rows, heads]
  int64_t rows, heads;
  int64_t stride = 0;  // floats between rows of a and b; 0: heads
};
void deltanet_gates(const DeltaNetGatesParams& p);

/// The gated delta rule over one sequence's new tokens, token by token, with an fp32 state
/// per value head. q and k are L2-normalised (x / sqrt(sum x^2 + 1e-6)) when l2norm_qk, q is
/// scaled by 1 / sqrt(k_dim); value head h reads q/k head h / (num_v_heads / num_k_heads).
/// Per token: S = exp(g) S;  S += k (beta (v - S^T k))^T;  out = S^T q  (S: [k_dim, v_dim]).
struct GatedDeltaRuleParams {
  const float* q;     // [num_tokens, num_k_heads, k_dim] (row stride `stride`)
  const float* k;     // [num_tokens, num_k_heads, k_dim] (row stride `stride`)
  const float* v;     // [num_tokens, num_v_heads, v_dim] (row stride `stride`)
  const float* g;     // [num_tokens, num_v_heads], log decay (<= 0)
  const float* beta;  // [num_tokens, num_v_heads]
  float* state;       // [num_v_heads, k_dim, v_dim], in/out (zeros: a new sequence)
  float* out;         // [num_tokens, num_v_heads, v_dim]
  int64_t num_tokens, num_k_heads, num_v_heads, k_dim, v_dim;
  int64_t stride = 0;  // floats between tokens of q, k and v; 0: dense per tensor
  bool l2norm_qk = true;
};
void gated_delta_rule(const GatedDeltaRuleParams& p);
/// The same rule in chunks of `chunk` tokens (the WY / UT form prefill kernels use): per chunk
/// with cumulative decays G, A = strictly-lower beta_i k_i.k_j exp(G_i - G_j), U = (I + A)^-1
/// (beta v), W = (I + A)^-1 (beta k exp(G)), V' = U - W S, out = exp(G) q S + causal
/// (q k^T exp(G_i - G_j)) V', S = exp(G_last) S + (k exp(G_last - G))^T V'. Equal to
/// gated_delta_rule up to rounding; the reference for chunked GPU kernels.
void gated_delta_rule_chunked(const GatedDeltaRuleParams& p, int64_t chunk = 64);

/// RMSNorm gated by silu: out = weight * rms_norm(x) * silu(gate), per row (plain weight).
struct GatedRmsNormParams {
  const float* x;       // [rows, dim]
  const float* gate;    // [rows, dim]
  const float* weight;  // [dim]
  float* out;           // [rows, dim]; may alias x
  int64_t rows, dim;
  float eps;
};
void gated_rms_norm(const GatedRmsNormParams& p);

/// out[r, i] = x[r, i] * sigmoid(gate[r * gate_stride + (per_row ? 0 : i)]) (or out += it):
/// the attention output gate (per element) and the shared expert's gate (one per row).
struct SigmoidGateParams {
  const float* x;     // [rows, dim]
  const float* gate;  // [rows, gate_stride]
  float* out;         // [rows, dim]; may alias x unless accumulate
  int64_t rows, dim, gate_stride;
  bool per_row = false;
  bool accumulate = false;
};
void sigmoid_gate(const SigmoidGateParams& p);

}  // namespace tandem::cpu
