// FlashInfer's sm90 ragged (contiguous K/V, TMA) prefill kernel, bf16, head_dim 128, causal:
// the one instantiation (persistent scheduler, as in sm90_paged_hd128.cu).
#include "backend/cuda/flashinfer/sm90_common.cuh"

namespace tandem::cuda::flashinfer_sm90 {

cudaError_t run_ragged_hd128(Args const& a, cudaStream_t stream) {
  if (a.plan.same_schedule_for_all_heads) return cudaErrorNotSupported;
  RaggedParams p;
  fill_common(p, a);
  p.nnz_kv = a.nnz_kv;
  return flashinfer::BatchPrefillWithRaggedKVCacheDispatched<
      128, 128, flashinfer::MaskMode::kCausal, /*LEFT_SLIDING_WINDOW=*/false,
      /*SAME_SCHEDULE_FOR_ALL_HEADS=*/false, flashinfer::StandardAttention, RaggedParams>(
      p, /*enable_pdl=*/false, stream);
}

}  // namespace tandem::cuda::flashinfer_sm90
