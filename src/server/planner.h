// Capacity planning for disaggregated serving (DESIGN.md section 1, "Scaling"): prefill
// replicas follow the input token rate, decode replicas keep the batch per rank under the
// threshold that guarantees a minimum decode speed.
#pragma once

#include <cstdint>
#include <string>

namespace tandem {

/// What the instances export on /metrics, aggregated over the fleet.
struct PlannerInputs {
  double input_tokens_per_s = 0;     // prompt tokens arriving per second (all prefills)
  double prefill_capacity_tps = 0;   // measured prompt tokens/s one prefill instance sustains
  double queued_input_tokens = 0;    // prompt tokens waiting in prefill queues now
  double drain_seconds = 30;         // clear the current queue within this time
  int64_t concurrent_sequences = 0;  // sequences decoding now (all decode instances)
  int64_t decode_dp = 1;             // ranks per decode instance (DP = EP = d)
  int64_t max_decode_batch = 64;     // per-rank batch threshold (--max-decode-batch)
  double target_utilisation = 0.8;   // headroom: plan for this fraction of capacity
  int64_t min_prefill = 1, min_decode = 1;
};

struct PlannerOutput {
  int64_t prefill_instances = 0;
  int64_t decode_instances = 0;
  std::string explanation;  // one line per decision, with the numbers used
};

/// prefill = ceil((input_tps + queued / drain_s) / (capacity * utilisation));
/// decode  = ceil(concurrent / (d * max_decode_batch * utilisation)); both at least their
/// minimum. Throws Error(kInvalidArgument) on a non-positive capacity, d or batch.
PlannerOutput plan_replicas(const PlannerInputs& in);

}  // namespace tandem
