// spec_replay_plan_launch / accepted_state_copy_launch (spec_replay.h). The plan is one small
// block (a prefix sum over the sequences, then their handful of tokens each); the copy is a plain
// device copy of the slots of the sequences that accepted every draft, each block first reading
// whether its sequence did.
#include "backend/cuda/check.h"
#include "backend/cuda/spec_replay.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kPlanThreads = 256;
constexpr int64_t kMaxPlanSeqs = 4096;

// The tokens sequence s replays (spec_replay.h): a + 1 when it rejected a draft and has a slot.
__device__ __forceinline__ int32_t replay_count(int32_t const* accepted, int32_t const* seq_begin,
                                                int32_t const* state_slot, int64_t s) {
  const int32_t k = seq_begin[s + 1] - seq_begin[s] - 1, a = accepted[s];
  return a < k && state_slot[s] >= 0 ? a + 1 : 0;
}

// True when sequence s takes its spare slot's state: every one of its k >= 1 drafts accepted.
__device__ __forceinline__ bool takes_spare(AcceptedStateCopyParams const& p, int64_t s) {
  const int32_t k = p.seq_begin[s + 1] - p.seq_begin[s] - 1;
  return k >= 1 && p.accepted[s] == k && p.state_slot[s] >= 0 && p.spare_slot[s] >= 0;
}

__global__ void __launch_bounds__(kPlanThreads) spec_replay_plan_kernel(SpecReplayPlanParams p) {
  __shared__ int32_t offset[kMaxPlanSeqs + 1];
  const auto S = static_cast<int32_t>(p.seqs);
  for (int32_t s = threadIdx.x; s < S; s += kPlanThreads) {
    offset[s + 1] = replay_count(p.accepted, p.seq_begin, p.state_slot, s);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // a few hundred sequences: serial is a microsecond
    offset[0] = 0;
    for (int32_t s = 0; s < S; ++s) offset[s + 1] += offset[s];
  }
  __syncthreads();
  const int32_t total = offset[S], tokens = p.seq_begin[S];
  for (int32_t s = threadIdx.x; s < S; s += kPlanThreads) {
    const int32_t o = offset[s], n = offset[s + 1] - o, b = p.seq_begin[s];
    p.dn_begin[s] = o;
    p.dn_slot[s] = n > 0 ? p.state_slot[s] : -1;
    p.dn_fresh[s] = 0;
    for (int32_t j = 0; j < n; ++j) {
      p.ids[o + j] = b + j;
      p.dn_token_seq[o + j] = s;
    }
  }
  for (int32_t t = total + static_cast<int32_t>(threadIdx.x); t < tokens; t += kPlanThreads) {
    p.ids[t] = 0;  // padding: any kept row
    p.dn_token_seq[t] = S;
  }
  for (auto s = static_cast<int32_t>(S + threadIdx.x); s < p.out_seqs; s += kPlanThreads) {
    p.dn_begin[s] = s == S ? total : tokens;
    p.dn_slot[s] = -1;
    p.dn_fresh[s] = 0;
  }
  if (threadIdx.x == 0) p.dn_begin[p.out_seqs] = tokens;
}

constexpr int kCopyThreads = 256;
constexpr unsigned kCopyBlocksPerSeq = 128;

template <bool kVec4>
__global__ void __launch_bounds__(kCopyThreads)
    accepted_state_copy_kernel(AcceptedStateCopyParams p) {
  const int64_t s = blockIdx.y;
  if (!takes_spare(p, s)) return;
  const float* src = p.states + static_cast<int64_t>(p.spare_slot[s]) * p.slot_stride;
  float* dst = p.states + static_cast<int64_t>(p.state_slot[s]) * p.slot_stride;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kCopyThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  if constexpr (kVec4) {
    const auto* s4 = reinterpret_cast<const float4*>(src);
    auto* d4 = reinterpret_cast<float4*>(dst);
    for (int64_t i = first; i < p.slot_elems / 4; i += step) d4[i] = s4[i];
  } else {
    for (int64_t i = first; i < p.slot_elems; i += step) dst[i] = src[i];
  }
}

}  // namespace

void spec_replay_plan_launch(SpecReplayPlanParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument,
                    p.seqs >= 0 && p.seqs <= kMaxPlanSeqs && p.out_seqs >= p.seqs + 1,
                    "spec_replay_plan: ", p.seqs, " sequences (at most ", kMaxPlanSeqs, "), ",
                    p.out_seqs, " replay sequences (at least one more)");
  if (p.seqs == 0) return;
  TANDEM_CHECK_KIND(kInvalidArgument,
                    p.accepted && p.seq_begin && p.state_slot && p.ids && p.dn_begin &&
                        p.dn_token_seq && p.dn_slot && p.dn_fresh,
                    "spec_replay_plan: a null input or output");
  spec_replay_plan_kernel<<<1, kPlanThreads, 0, stream>>>(p);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void accepted_state_copy_launch(AcceptedStateCopyParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      p.seqs >= 0 && p.seqs <= 65535 && p.slot_elems >= 0 && p.slot_stride >= p.slot_elems,
      "accepted_state_copy: ", p.seqs, " sequences, ", p.slot_elems, " floats per slot, stride ",
      p.slot_stride);
  if (p.seqs == 0 || p.slot_elems == 0) return;
  TANDEM_CHECK_KIND(kInvalidArgument,
                    p.accepted && p.seq_begin && p.state_slot && p.spare_slot && p.states,
                    "accepted_state_copy: a null input");
  const bool vec4 = p.slot_elems % 4 == 0 && p.slot_stride % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(p.states) % 16 == 0;
  const dim3 grid(kCopyBlocksPerSeq, static_cast<unsigned>(p.seqs));
  if (vec4) {
    accepted_state_copy_kernel<true><<<grid, kCopyThreads, 0, stream>>>(p);
  } else {
    accepted_state_copy_kernel<false><<<grid, kCopyThreads, 0, stream>>>(p);
  }
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tandem::cuda
