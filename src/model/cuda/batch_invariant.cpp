// The --deterministic mode's checks. See batch_invariant.h.
#include "model/cuda/batch_invariant.h"

#include "core/error.h"
#include "model/cuda/qwen3_moe_cuda.h"

namespace tandem::cuda_model {

void check_deterministic(const CudaModelOptions& opts) {
  if (!opts.deterministic) return;
  TANDEM_CHECK_KIND(kUnsupported, opts.shard.size <= 1,
                    "--deterministic: a sharded GPU model (TP / DP-EP ranks, size ",
                    opts.shard.size, ") is not supported; run it on one GPU");
}

}  // namespace tandem::cuda_model
