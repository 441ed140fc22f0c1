// Launch functions of the MoE dispatch / combine kernels (protocol: moe_params.h; device code:
// moe_kernels.cuh). Framework-free: a params struct in, a stream. CudaMoe (cuda_moe.h) owns the
// peer-mapped buffers of the decode flavour and calls these.
#pragma once

#include <cuda_runtime_api.h>

#include "comm/cuda/moe_params.h"

namespace tandem::comm::cuda {

constexpr int kMoeThreads = 256;

/// Prefill dispatch: one routing block, then a gather over `blocks` blocks. Throws
/// kInvalidArgument for shapes out of range (hidden % 8, k > kMoeMaxTopK, L > kMoeMaxExperts).
void prefill_dispatch_launch(PrefillDispatchParams const& p, int blocks, cudaStream_t stream);

/// Prefill combine: the per-token weighted local sum, every row of out written.
void prefill_combine_launch(PrefillCombineParams const& p, int blocks, cudaStream_t stream);

/// Prefill combine fused with the registered one-shot all-reduce (see
/// prefill_combine_all_reduce_kernel): c.out unused; ar: CudaComm::registered_params() with
/// output and count set. Every rank the same `blocks`, all resident (<= the comm's max_blocks).
void prefill_combine_all_reduce_launch(PrefillCombineParams const& c, AllReduceParams const& ar,
                                       int blocks, cudaStream_t stream);

/// One decode kernel. dispatch_send / combine_send run p.send_blocks blocks (every rank the
/// same); the receive kernels `blocks` blocks (any number per rank).
void moe_decode_launch(MoeKind kind, MoeDecodeParams const& p, int blocks, cudaStream_t stream);

/// Test / benchmark stand-in for the experts: out[r] = bf16(dequant(x[r]) * (1 + (e % 7) / 4)),
/// e = row_expert[r], for r < expert_offsets[L].
void moe_fake_expert_launch(void const* x, int32_t const* expert_offsets, int32_t const* row_expert,
                            void* out, int local_experts, int hidden, MoePayload payload,
                            int blocks, cudaStream_t stream);

}  // namespace tandem::comm::cuda
