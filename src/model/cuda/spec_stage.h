// The host half of a fused speculative step's device work, shared by the CUDA models
// (Model::forward_verify_draft): spec_advance's inputs (backend/cuda/spec_advance.h) staged from
// the verify batch in one pinned upload, its outputs in device buffers, and the accepted counts'
// copy back. The buffers grow on demand and are reused by the next step, which the step's one
// synchronisation separates from this one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/spec_advance.h"
#include "model/cuda/cuda_mem.h"
#include "model/forward_batch.h"

namespace tandem::cuda_model {

class SpecAdvanceStage {
 public:
  /// Uploads the verify tokens of `verify` (its sequences in the order the kernel sees them),
  /// their offsets, starts and block tables, `forced` ([seqs]) and the per-sequence int32 arrays
  /// of `extra` (each [seqs]; their device copies at extra(i)) on `stream`. Returns spec_advance's
  /// params for `passes` chained passes: inputs, and the outputs accepted, chain_pos, chain_slots,
  /// mtp_ids and mtp_rows in this stage's device buffers (a caller may point the last two
  /// elsewhere); `sampled` is left to the caller.
  cuda::SpecAdvanceParams stage(const ForwardBatch& verify, const std::vector<int32_t>& forced,
                                int64_t passes, int64_t page_size,
                                const std::vector<std::vector<int32_t>>& extra,
                                cudaStream_t stream);
  /// Device copy of stage()'s extra[i].
  const int32_t* extra(size_t i) const { return extra_.at(i); }
  /// Queues the accepted counts' copy to the host; host_accepted() holds them once the stream
  /// got there.
  void accepted_to_host(cudaStream_t stream);
  const int32_t* host_accepted() const { return out_.host.as<int32_t>(); }

 private:
  struct Buffers {  // device, and pinned for the copies
    DeviceMem dev;
    PinnedMem host;
    void grow(size_t bytes);
  };
  Buffers in_, out_;
  std::vector<const int32_t*> extra_;
  int64_t seqs_ = 0;
};

}  // namespace tandem::cuda_model
