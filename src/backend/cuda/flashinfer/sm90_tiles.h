// Tuning variants of the ragged head_dim 128 kernel (sm90.h's Args): wider key tiles than
// FlashInfer's causal default of 128 (its non-causal configurations use 192). Causal masking
// stays right: the kernel masks the last key tile and then ceil(CTA_Q / CTA_KV) more.
#pragma once

#include "backend/cuda/flashinfer/sm90.h"

namespace tandem::cuda::flashinfer_sm90 {

cudaError_t run_ragged_hd128_kv176(Args const& a, cudaStream_t stream);
cudaError_t run_ragged_hd128_kv192(Args const& a, cudaStream_t stream);

}  // namespace tandem::cuda::flashinfer_sm90
