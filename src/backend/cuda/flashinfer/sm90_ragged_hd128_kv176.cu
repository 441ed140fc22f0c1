// FlashInfer's sm90 ragged prefill kernel, bf16, head_dim 128, causal, with 176-key tiles
// (sm90_tiles.h): FlashInfer's kernel traits, our tile choice.
#include "backend/cuda/flashinfer/sm90_common.cuh"
#include "backend/cuda/flashinfer/sm90_tiles.h"

namespace tandem::cuda::flashinfer_sm90 {

cudaError_t run_ragged_hd128_kv176(Args const& a, cudaStream_t stream) {
  if (a.plan.same_schedule_for_all_heads) return cudaErrorNotSupported;
  RaggedParams p;
  fill_common(p, a);
  p.nnz_kv = a.nnz_kv;
  using Traits = flashinfer::AttentionKernelTraits<
      /*USE_TMA_LOAD_KV=*/true, 128, 128, /*CTA_Q_=*/128, /*CTA_KV_=*/176, /*NUM_STAGES_=*/2, Bf16,
      Bf16, Bf16, int32_t, flashinfer::StandardAttention>;
  const cudaError_t st = flashinfer::BatchPrefillWithRaggedKVCacheKernelTraitsDispatched<
      Traits, /*LEFT_SLIDING_WINDOW=*/false, /*CAUSAL=*/true,
      /*SAME_SCHEDULE_FOR_ALL_HEADS=*/false>(p, stream);
  return st != cudaSuccess ? st : cudaGetLastError();
}

}  // namespace tandem::cuda::flashinfer_sm90
