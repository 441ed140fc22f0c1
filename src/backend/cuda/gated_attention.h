// CUDA ops of the Qwen3.5 gated attention layer and its MoE block that the Qwen3 ops lack:
// the attention prologue with the (query, gate) q_proj layout, partial RoPE and head_dim 256;
// the sigmoid output gate; the shared expert's sigmoid gate. bf16 in and out, fp32 inside.
// Framework-free: a params struct in, a stream; launches are asynchronous and CUDA-graph safe.
// CPU references: cpu::qk_norm_rope (rotary_dim), cpu::kv_write, cpu::sigmoid_gate.
// NOTE: Qwen3.5's zero-centred (1 + w) RMSNorm weights are passed as 1 + w (the model adds
// the 1 when it loads them); these ops apply the weight as given.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

/// The gated attention prologue in one launch: splits a fused row
/// [q heads: (query [head_dim] | gate [head_dim]) each | k heads | v heads], applies the
/// per-head q/k RMSNorm and RoPE on the first rotary_dim dims (rotate-half within them,
/// inv_freq = 1 / theta^(2i/rotary_dim) in fp32), writes q to q_out, the gate to gate_out and
/// k, v into the paged HND KV cache. slot_index < 0: k, v not written (padding). kv_fp8: the
/// pool holds E4M3 codes, k and v quantized as kv_write_launch's (attention.h).
/// head_dim 64, 128 or 256; rotary_dim even, <= head_dim.
struct GatedQkvPrepParams {
  bf16 const* qkv;            // [num_tokens, (2 * num_q_heads + 2 * num_kv_heads) * head_dim]
  bf16* q_out;                // [num_tokens, num_q_heads, head_dim]
  bf16* gate_out;             // [num_tokens, num_q_heads, head_dim]
  bf16* pool;                 // [num_pages, 2, num_kv_heads, page_size, head_dim]
  int64_t const* slot_index;  // [num_tokens]: page * page_size + slot
  bf16 const* q_weight;       // [head_dim]
  bf16 const* k_weight;       // [head_dim]
  int32_t const* positions;   // [num_tokens]
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, page_size, rotary_dim;
  float eps;
  double rope_theta;
  bool kv_fp8 = false;
  float k_scale = 1.f, v_scale = 1.f;
};
void gated_qkv_prep_launch(GatedQkvPrepParams const& p, cudaStream_t stream);

/// out[i] = x[i] * sigmoid(gate[i]) over `count` elements (the attention output gate). out
/// may alias x.
struct SigmoidMulParams {
  bf16 const* x;
  bf16 const* gate;
  bf16* out;
  int64_t count;
};
void sigmoid_mul_launch(SigmoidMulParams const& p, cudaStream_t stream);

/// The shared expert's gate, per row: y[r] = bf16(y[r] + sigmoid(dot(xn[r], w)) * s[r]).
struct SharedExpertGateParams {
  bf16 const* xn;  // [rows, hidden]: the MoE block's input
  bf16 const* w;   // [hidden]: shared_expert_gate.weight
  bf16 const* s;   // [rows, hidden]: the shared expert's output
  bf16* y;         // [rows, hidden]: the routed experts' output, updated in place
  int64_t rows, hidden;
};
void shared_expert_gate_launch(SharedExpertGateParams const& p, cudaStream_t stream);

}  // namespace tandem::cuda
