// --deterministic on the GPU (issue 15 item 6): the kernel choices that make every row of a
// forward bitwise independent of the other rows of its batch, of how a prompt is chunked and of
// a prefix-cache hit. Qwen3MoeCuda routes its launches through these helpers when
// CudaModelOptions::deterministic is set; without it nothing here is used.
//
// What each layer does in the mode (and why it is then row-invariant):
//   dense linears, lm_head, MoE router  GemmLt::set_batch_invariant: the mma GEMM of
//       moe_gemm.h as one dense expert for every m (one fp32 accumulator per output element
//       chained over k in a fixed order, no split-K, no m-dependent cuBLASLt algorithm or gemv);
//   MoE experts    the grouped-GEMM (mma) path for every batch (no GEMV-for-one-token, no cuBLAS
//       prefill paths), whose per-row result is tile- and count-independent; the combine sums a
//       token's experts in ascending expert id;
//   attention      every query token through the paged decode kernel without split-KV: one
//       pass over keys 0..position in the same order for a token of a prefill chunk, of a
//       cache-hit suffix, of a decode step or of a mixed step (no FlashInfer plan, no
//       batch-sized kv split);
//   norms, RoPE, embedding, top-k, sampling: per-row kernels already (block shapes from the
//       hidden / head sizes, not the row count); CUDA-graph padding rows are rows like others.
// Block-FP8 checkpoints are dequantized to bf16 at load in the mode (the bf16 kernels above).
#pragma once

#include "backend/cuda/attention.h"
#include "backend/cuda/moe_layer.h"

namespace tandem {

struct CudaModelOptions;

namespace cuda_model {

/// Throws kUnsupported naming the option for what the mode does not cover (a sharded model).
void check_deterministic(const CudaModelOptions& opts);

/// The attention launch of the mode: every token on the decode kernel, no split, no plan.
inline void make_batch_invariant(cuda::PagedAttentionParams& ap) {
  ap.kv_split = 0;
  ap.workspace = nullptr;
  ap.num_prefill_tokens = 0;
  ap.prefill_plan = nullptr;
  ap.algo = cuda::PagedAttentionAlgo::kDecode;
}

/// The MoE path of the mode (the grouped GEMMs whatever the batch), else `requested`.
inline cuda::MoeLayerPath moe_path(bool deterministic, cuda::MoeLayerPath requested) {
  return deterministic ? cuda::MoeLayerPath::kMma : requested;
}

}  // namespace cuda_model
}  // namespace tandem
