// CPU reference ops: framework-free, raw pointers and a params struct each, fp32 compute.
// These are the reference every other backend is tested against, and the CPU backend's
// implementation (multithreaded over ThreadPool::global()).
#pragma once

#include <cstdint>

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
};
void qk_norm_rope(const QkNormRopeParams& p);

/// Writes new k, v rows into HND pages: pool[page, 0 (k) | 1 (v), head, slot, :].
struct KvWriteParams {
  const float* k;             // [num_tokens, num_kv_heads, head_dim]
  const float* v;             // [num_tokens, num_kv_heads, head_dim]
  float* pool;                // [num_pages, 2, num_kv_heads, page_size, head_dim]
  const int64_t* slot_index;  // [num_tokens]: page * page_size + slot
  int64_t num_tokens, num_kv_heads, head_dim, page_size;
};
void kv_write(const KvWriteParams& p);

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

}  // namespace tandem::cpu
