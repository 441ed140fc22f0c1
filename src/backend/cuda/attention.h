// KV-cache write into HND pages and a simple (correct-first) paged attention kernel for GQA.
// bf16 q / KV / out, fp32 softmax and accumulation. FlashInfer replaces the attention kernel
// where it is faster. CPU references: cpu::kv_write, cpu::paged_attention.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

class PrefillAttentionPlan;  // attention_sm90.h

/// Writes new k, v rows into HND pages: pool[page, 0 (k) | 1 (v), head, slot, :].
/// slot_index < 0: the token is skipped (padding of a captured batch). head_dim 64, 128, 256.
/// kv_fp8: the pool holds E4M3 codes (1 byte an element, same layout): k and v are quantized
/// as they are written, e4m3(bf16(x) / scale) (kv_fp8.cuh; CPU: cpu::kv_fp8_quantize).
struct KvWriteParams {
  bf16 const* k;              // [num_tokens, num_kv_heads, head_dim]
  bf16 const* v;              // [num_tokens, num_kv_heads, head_dim]
  bf16* pool;                 // [num_pages, 2, num_kv_heads, page_size, head_dim] (bytes if fp8)
  int64_t const* slot_index;  // [num_tokens]: page * page_size + slot
  int64_t num_tokens, num_kv_heads, head_dim, page_size;
  bool kv_fp8 = false;
  float k_scale = 1.f, v_scale = 1.f;  // fp8: the layer's per-tensor scales
};
void kv_write_launch(KvWriteParams const& p, cudaStream_t stream);

/// Which kernel paged_attention_launch runs.
enum class PagedAttentionAlgo : int32_t {
  kAuto = 0,     // see paged_attention_launch
  kSimple = 1,   // the first CUDA-core kernel (correct for any batch; slow for prefill)
  kPrefill = 2,  // tensor-core FlashAttention-2 style kernel for every token
  kDecode = 3,   // tensor-core split-KV kernel for every token
};

/// Causal GQA attention over paged HND KV: query token t of sequence token_seq[t] at
/// position positions[t] attends to positions [0, positions[t]] of that sequence.
/// head_dim 64, 128 or 256 (256: prefill tokens via a ready prefill_plan with algo kAuto, else
/// the simple kernel; decode tokens on the tensor-core decode kernel with kAuto or kDecode);
/// group = num_q_heads / num_kv_heads in {1, 2, 4, 8, 16}; page_size a power of two. Tokens of
/// one sequence are contiguous in the batch, positions increasing. With kv_split > 0 the decode
/// kernels split each token's keys into pieces of kv_split that write fp32 partial states to
/// workspace, merged by a second kernel (flash-decoding), so a small decode batch still fills the
/// GPU. Every launch shape depends on num_tokens, num_prefill_tokens, kv_split and
/// max_pages_per_seq only (CUDA-graph safe): splits past a token's real length exit at once. kv_fp8
/// (--kv-cache-dtype fp8): the pool holds E4M3 codes (kv_write's); key = code * k_scale, value =
/// code * v_scale. The decode tokens run the tensor-core decode kernel (codes widened to fp16
/// tiles, k_scale on the scores, v_scale on the output; algo kAuto or kDecode), the prefill tokens
/// without a ready prefill_plan the simple kernel (dequantizing in registers), as every token with
/// kSimple; a ready prefill_plan (planned with kv_fp8: always its gathered path) dequantizes the
/// prefill sequences' keys into its bf16 gather workspace before FlashInfer's kernel. algo
/// kPrefill: kUnsupported.
struct PagedAttentionParams {
  bf16 const* q;               // [num_tokens, num_q_heads, head_dim]
  bf16 const* pool;            // [num_pages, 2, num_kv_heads, page_size, head_dim] (fp8: bytes)
  int32_t const* block_table;  // [num_seqs, max_pages_per_seq]
  int32_t const* token_seq;    // [num_tokens]: sequence of each query token
  int32_t const* positions;    // [num_tokens]
  bf16* out;                   // [num_tokens, num_q_heads, head_dim]
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim, page_size, max_pages_per_seq;
  float scale;                 // softmax scale, usually 1/sqrt(head_dim)
  int64_t kv_split = 0;        // keys per split, a multiple of 128; 0: no split
  float* workspace = nullptr;  // [num_tokens, num_q_heads, num_splits, head_dim + 2] when split
  /// Leading tokens [0, num_prefill_tokens) that belong to multi-token chunks (prefill); the
  /// tokens after them are decode tokens (few per sequence). -1: not known.
  int64_t num_prefill_tokens = -1;
  PagedAttentionAlgo algo = PagedAttentionAlgo::kAuto;
  /// With algo kAuto and num_prefill_tokens > 0: a ready plan of exactly these prefill tokens
  /// (attention_sm90.h) runs them on FlashInfer's Hopper kernels instead of the FA2 kernel.
  PrefillAttentionPlan const* prefill_plan = nullptr;
  bool kv_fp8 = false;
  float k_scale = 1.f, v_scale = 1.f;  // fp8: the layer's per-tensor scales
};
/// The attention entry point. With algo kAuto:
///   num_prefill_tokens >= 0: tokens [0, num_prefill_tokens) run the prefill kernel (a block
///     per 128 (token, q head) rows of one kv head, each K/V tile loaded once for them; or
///     FlashInfer's sm90 kernel through prefill_plan when it is ready), the rest the decode
///     kernel (a block per token, kv head and split of kv_split keys; each key
///     loaded once for the group's q heads).
///   num_prefill_tokens == -1 (not known): every token runs the decode kernel when
///     kv_split > 0 or num_tokens <= 256, else the prefill kernel. Both are correct for any
///     batch; the decode kernel rereads the keys for every query token, and the prefill kernel
///     walks the sequences of a tile of decode tokens one after another, so pass
///     num_prefill_tokens for mixed batches.
void paged_attention_launch(PagedAttentionParams const& p, cudaStream_t stream);

/// Splits of a launch: ceil(max_pages_per_seq * page_size / kv_split), 1 without split.
int64_t paged_attention_num_splits(int64_t max_pages_per_seq, int64_t page_size, int64_t kv_split);
/// fp32 elements of workspace a launch with kv_split needs (0 without split).
size_t paged_attention_workspace_floats(int64_t num_tokens, int64_t num_q_heads, int64_t head_dim,
                                        int64_t max_pages_per_seq, int64_t page_size,
                                        int64_t kv_split);
/// The kv_split for the tensor-core decode kernel: about 4 waves of its blocks (3 per
/// multiprocessor) for this batch, 0 when the batch alone gives that. Splits of 128 keys at
/// least, so one sequence stays below a full GPU.
int64_t paged_attention_decode_split(int64_t num_tokens, int64_t num_kv_heads,
                                     int64_t max_pages_per_seq, int64_t page_size, int num_sms);
/// A kv_split that gives about two blocks per multiprocessor for this batch (0 when the batch
/// alone fills the GPU): for decode, where num_tokens * num_kv_heads is small.
int64_t paged_attention_pick_split(int64_t num_tokens, int64_t num_kv_heads,
                                   int64_t max_pages_per_seq, int64_t page_size, int num_sms);

}  // namespace tandem::cuda
