// Tensor-core paged attention kernels behind paged_attention_launch (attention.h): a
// FlashAttention-2 style prefill kernel and a split-KV decode kernel. Host code only; the
// launcher in attention.cu validates the params before calling these.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/cuda/attention.h"

namespace tandem::cuda::detail {

/// Query tokens [0, num_tokens) of p (num_tokens given here, not p.num_tokens). A block per
/// (tile of 128 (token, q head) rows, kv head); a tile whose tokens belong to
/// several sequences walks each sequence's keys in turn. Any batch is correct; long chunks of
/// one sequence are what it is fast for.
void paged_attention_prefill(PagedAttentionParams const& p, int64_t num_tokens,
                             cudaStream_t stream);

/// Query tokens [token_begin, p.num_tokens): a block per (token, kv head, split of
/// p.kv_split keys) that loads each key once for the group's q heads. With p.kv_split > 0 the
/// splits write fp32 partials to p.workspace (layout of attention.h) and merge_splits()
/// combines them; without, a single split writes out directly. head_dim 64, 128 or 256; bf16
/// or (p.kv_fp8) E4M3 pages, widened to fp16 in shared memory, k_scale / v_scale applied to the
/// scores / output.
void paged_attention_decode(PagedAttentionParams const& p, int64_t token_begin, int num_splits,
                            cudaStream_t stream);

/// Bench only: the prefill kernel for all of p's tokens in another block shape (head_dim 128,
/// group 8): 0 the default (8 warps, no register cap), 1 (8 warps, 2 blocks/SM: 128
/// registers, small spills), 2 (4 warps, 2 blocks/SM).
void paged_attention_prefill_variant(PagedAttentionParams const& p, int variant,
                                     cudaStream_t stream);

/// Shared memory (bytes) of the prefill (head_dim 64, 128) / decode (64, 128, 256; bf16 or FP8
/// pages) blocks: for tests of the launch limits.
size_t paged_attention_prefill_smem(int64_t head_dim);
size_t paged_attention_decode_smem(int64_t head_dim, bool kv_fp8 = false);

}  // namespace tandem::cuda::detail
