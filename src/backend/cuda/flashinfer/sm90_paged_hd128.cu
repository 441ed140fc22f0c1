// FlashInfer's sm90 paged prefill kernel, bf16, head_dim 128, causal: the one instantiation
// (persistent scheduler; the "same schedule for all heads" one is for > 500k query rows and
// is not built: the plan's caller falls back instead).
#include "backend/cuda/flashinfer/sm90_common.cuh"

namespace tandem::cuda::flashinfer_sm90 {

cudaError_t run_paged_hd128(Args const& a, cudaStream_t stream) {
  if (a.plan.same_schedule_for_all_heads) return cudaErrorNotSupported;
  PagedParams p;
  fill_common(p, a);
  p.kv_indices = const_cast<int32_t*>(a.kv_indices);
  p.k_page_stride = a.page_stride;
  p.v_page_stride = a.page_stride;
  p.page_size = a.page_size;
  return flashinfer::BatchPrefillWithPagedKVCacheDispatched<
      128, 128, flashinfer::MaskMode::kCausal, /*LEFT_SLIDING_WINDOW=*/false,
      /*SAME_SCHEDULE_FOR_ALL_HEADS=*/false, flashinfer::StandardAttention, PagedParams>(
      p, /*enable_pdl=*/false, stream);
}

}  // namespace tandem::cuda::flashinfer_sm90
