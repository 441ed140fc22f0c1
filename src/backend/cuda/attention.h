// KV-cache write into HND pages and a simple (correct-first) paged attention kernel for GQA.
// bf16 q / KV / out, fp32 softmax and accumulation. FlashInfer replaces the attention kernel
// where it is faster. CPU references: cpu::kv_write, cpu::paged_attention.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

/// Writes new k, v rows into HND pages: pool[page, 0 (k) | 1 (v), head, slot, :].
/// slot_index < 0: the token is skipped (padding of a captured batch). head_dim 64 or 128.
struct KvWriteParams {
  bf16 const* k;              // [num_tokens, num_kv_heads, head_dim]
  bf16 const* v;              // [num_tokens, num_kv_heads, head_dim]
  bf16* pool;                 // [num_pages, 2, num_kv_heads, page_size, head_dim]
  int64_t const* slot_index;  // [num_tokens]: page * page_size + slot
  int64_t num_tokens, num_kv_heads, head_dim, page_size;
};
void kv_write_launch(KvWriteParams const& p, cudaStream_t stream);

/// Causal GQA attention over paged HND KV: query token t of sequence token_seq[t] at
/// position positions[t] attends to positions [0, positions[t]] of that sequence.
/// head_dim 64 or 128; group = num_q_heads / num_kv_heads in {1, 2, 4, 8}.
/// One block per (token, kv head, split of kv_split keys); with kv_split > 0 the splits write
/// fp32 partial states to workspace and a second kernel merges them (flash-decoding), so a
/// small decode batch still fills the GPU. Fine for decode; slow for long prefill.
struct PagedAttentionParams {
  bf16 const* q;               // [num_tokens, num_q_heads, head_dim]
  bf16 const* pool;            // [num_pages, 2, num_kv_heads, page_size, head_dim]
  int32_t const* block_table;  // [num_seqs, max_pages_per_seq]
  int32_t const* token_seq;    // [num_tokens]: sequence of each query token
  int32_t const* positions;    // [num_tokens]
  bf16* out;                   // [num_tokens, num_q_heads, head_dim]
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, page_size, max_pages_per_seq;
  float scale;                 // softmax scale, usually 1/sqrt(head_dim)
  int64_t kv_split = 0;        // keys per split, a multiple of 128; 0: no split
  float* workspace = nullptr;  // [num_tokens, num_q_heads, num_splits, head_dim + 2] when split
};
void paged_attention_launch(PagedAttentionParams const& p, cudaStream_t stream);

/// Splits of a launch: ceil(max_pages_per_seq * page_size / kv_split), 1 without split.
int64_t paged_attention_num_splits(int64_t max_pages_per_seq, int64_t page_size, int64_t kv_split);
/// fp32 elements of workspace a launch with kv_split needs (0 without split).
size_t paged_attention_workspace_floats(int64_t num_tokens, int64_t num_q_heads, int64_t head_dim,
                                        int64_t max_pages_per_seq, int64_t page_size,
                                        int64_t kv_split);
/// A kv_split that gives about two blocks per multiprocessor for this batch (0 when the batch
/// alone fills the GPU): for decode, where num_tokens * num_kv_heads is small.
int64_t paged_attention_pick_split(int64_t num_tokens, int64_t num_kv_heads,
                                   int64_t max_pages_per_seq, int64_t page_size, int num_sms);

}  // namespace tandem::cuda
