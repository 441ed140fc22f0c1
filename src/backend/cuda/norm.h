// Token-wise CUDA ops of the Qwen3 layer: embedding gather, RMSNorm (plain and fused with the
// residual add), and the per-head q/k RMSNorm fused with RoPE. bf16 in and out, fp32 inside.
// Framework-free: a params struct in, a stream; launches are asynchronous and CUDA-graph safe.
// CPU references: src/backend/cpu/ops.h (same semantics, fp32).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

/// out[t, :] = table[ids[t], :]. NOTE: ids are trusted (validated at the request boundary);
/// an id outside [0, vocab) traps on the device.
struct EmbeddingParams {
  int32_t const* ids;  // [num_tokens]
  bf16 const* table;   // [vocab, hidden]
  bf16* out;           // [num_tokens, hidden]
  int64_t num_tokens, hidden, vocab;
};
void embedding_launch(EmbeddingParams const& p, cudaStream_t stream);

/// out = x / sqrt(mean(x^2) + eps) * weight per row, computed in fp32, rounded once to bf16.
/// x and out may alias.
struct RmsNormParams {
  bf16 const* x;       // [rows, dim]
  bf16 const* weight;  // [dim]
  bf16* out;           // [rows, dim]
  int64_t rows, dim;
  float eps;
};
void rms_norm_launch(RmsNormParams const& p, cudaStream_t stream);

/// Fused residual add + RMSNorm: residual = bf16(residual + x); out = rms_norm(residual)
/// (the norm reads the rounded residual it stored). out may alias x, not residual.
struct AddRmsNormParams {
  bf16* residual;      // [rows, dim], updated in place
  bf16 const* x;       // [rows, dim]
  bf16 const* weight;  // [dim]
  bf16* out;           // [rows, dim]
  int64_t rows, dim;
  float eps;
};
void add_rms_norm_launch(AddRmsNormParams const& p, cudaStream_t stream);

/// Per-head RMSNorm of q and k (Qwen3 q_norm / k_norm) followed by RoPE (rotate-half,
/// inv_freq = 1 / theta^(2i/head_dim) in fp32 as transformers computes it), in place.
/// head_dim 64 or 128 (kUnsupported otherwise).
struct QkNormRopeParams {
  bf16* q;                   // [num_tokens, num_q_heads, head_dim]
  bf16* k;                   // [num_tokens, num_kv_heads, head_dim]
  bf16 const* q_weight;      // [head_dim], nullptr: no norm
  bf16 const* k_weight;      // [head_dim], nullptr: no norm
  int32_t const* positions;  // [num_tokens]
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim;
  float eps;
  double rope_theta;
};
void qk_norm_rope_launch(QkNormRopeParams const& p, cudaStream_t stream);

/// The attention prologue in one launch: splits a fused qkv row [q heads | k heads | v heads],
/// applies the per-head q/k RMSNorm + RoPE of qk_norm_rope_launch, writes q to q_out and k, v
/// into the paged HND KV cache (as kv_write_launch). slot_index < 0: the token's k, v are not
/// written (padding rows of a captured batch). head_dim 64 or 128. kv_fp8: the pool holds E4M3
/// codes, k (after norm and RoPE) and v quantized as kv_write_launch's (attention.h).
struct QkvPrepParams {
  bf16 const* qkv;            // [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]
  bf16* q_out;                // [num_tokens, num_q_heads, head_dim]
  bf16* pool;                 // [num_pages, 2, num_kv_heads, page_size, head_dim]
  int64_t const* slot_index;  // [num_tokens]: page * page_size + slot
  bf16 const* q_weight;       // [head_dim], nullptr: no norm
  bf16 const* k_weight;       // [head_dim], nullptr: no norm
  int32_t const* positions;   // [num_tokens]
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, page_size;
  float eps;
  double rope_theta;
  bool kv_fp8 = false;
  float k_scale = 1.f, v_scale = 1.f;
};
void qkv_prep_launch(QkvPrepParams const& p, cudaStream_t stream);

}  // namespace tandem::cuda
