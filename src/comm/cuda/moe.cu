// Launch of the MoE dispatch / combine kernels (moe_kernels.cuh).
#include <atomic>

#include "comm/cuda/check.h"
#include "comm/cuda/moe.h"
#include "comm/cuda/moe_kernels.cuh"

namespace tandem::comm::cuda {

namespace {

void check_common(int top_k, int hidden, int experts) {
  TANDEM_CHECK_KIND(kInvalidArgument, top_k >= 1 && top_k <= kMoeMaxTopK, "moe: top_k ", top_k,
                    " not in 1..", kMoeMaxTopK);
  TANDEM_CHECK_KIND(kInvalidArgument, hidden > 0 && hidden % 8 == 0, "moe: hidden ", hidden,
                    " must be a positive multiple of 8");
  TANDEM_CHECK_KIND(kInvalidArgument, experts >= 1 && experts <= kMoeMaxExperts, "moe: ", experts,
                    " experts not in 1..", kMoeMaxExperts);
}

}  // namespace

void prefill_dispatch_launch(PrefillDispatchParams const& p, int blocks, cudaStream_t stream) {
  check_common(p.top_k, p.hidden, p.local_experts);
  if (p.max_tokens <= 0) return;
  TANDEM_CHECK_KIND(kInvalidArgument, p.scratch != nullptr, "prefill_dispatch: scratch is null");
  const int tiles = (p.max_tokens + kMoePrefillTile - 1) / kMoePrefillTile;
  detail::prefill_count_kernel<<<tiles, kMoeThreads, kMoePrefillSmemBytes, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
  detail::prefill_scan_kernel<<<1, kMoeThreads, size_t(p.local_experts + 8 + kMoeThreads) * 4,
                                stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
  detail::prefill_gather_kernel<<<blocks, kMoeThreads, 1024, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
}

void prefill_combine_launch(PrefillCombineParams const& p, int blocks, cudaStream_t stream) {
  check_common(p.top_k, p.hidden, 1);
  if (p.max_tokens <= 0) return;
  detail::prefill_combine_kernel<<<blocks, kMoeThreads, 1024, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
}

void prefill_combine_all_reduce_launch(PrefillCombineParams const& c, AllReduceParams const& ar,
                                       int blocks, cudaStream_t stream) {
  check_common(c.top_k, c.hidden, 1);
  TANDEM_CHECK_KIND(kInvalidArgument, ar.world_size >= 2 && ar.world_size <= kMaxRanks,
                    "prefill_combine_all_reduce: world size ", ar.world_size);
  TANDEM_CHECK_KIND(kInvalidArgument, blocks >= 1 && blocks <= kMaxBlocks,
                    "prefill_combine_all_reduce: blocks ", blocks);
  if (c.max_tokens <= 0) return;
  detail::prefill_combine_all_reduce_kernel<<<blocks, kMoeThreads, 1024, stream>>>(c, ar);
  TANDEM_CUDA_CHECK_LAUNCH();
}

void moe_decode_launch(MoeKind kind, MoeDecodeParams const& p, int blocks, cudaStream_t stream) {
  // dispatch_send's block 0 stages the routing in more than the default 48 KiB of shared memory.
  static std::atomic<uint64_t> prepared{0};
  int dev = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if ((prepared.load() & bit) == 0) {
    TANDEM_CUDA_CHECK(cudaFuncSetAttribute(detail::moe_dispatch_send_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kMoeSendSmemBytes));
    prepared.fetch_or(bit);
  }
  switch (kind) {
    case kMoeDispatchSend:
      detail::moe_dispatch_send_kernel<<<p.send_blocks, kMoeThreads, kMoeSendSmemBytes, stream>>>(
          p);
      break;
    case kMoeDispatchRecv:
      detail::moe_dispatch_recv_kernel<<<blocks, kMoeThreads, kMoeSmemBytes, stream>>>(p);
      break;
    case kMoeCombineSend:
      detail::moe_combine_send_kernel<<<p.send_blocks, kMoeThreads, 0, stream>>>(p);
      break;
    case kMoeCombineRecv:
      detail::moe_combine_recv_kernel<<<blocks, kMoeThreads, 1024, stream>>>(p);
      break;
  }
  TANDEM_CUDA_CHECK_LAUNCH();
}

void moe_fake_expert_launch(void const* x, int32_t const* expert_offsets, int32_t const* row_expert,
                            void* out, int local_experts, int hidden, MoePayload payload,
                            int blocks, cudaStream_t stream) {
  detail::FakeExpertParams p{x, expert_offsets, row_expert, out, local_experts, hidden, payload};
  detail::fake_expert_kernel<<<blocks, kMoeThreads, 0, stream>>>(p);
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::comm::cuda
