// Capacity planning for disaggregated serving (DESIGN.md section 1, "Scaling"): prefill
// replicas follow the input token rate, decode replicas keep the batch per rank under the
// threshold that guarantees a minimum decode speed.
#pragma once

#include <cstdint>
#include <ostream>
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

/// `tandem plan --model DIR`: will one rank of a role fit a GPU (model/memory_plan.h)?
struct MemoryFitArgs {
  std::string model;           // checkpoint directory (config.json only is read)
  std::string role = "serve";  // serve (1 rank), prefill (TP = EP = ranks), decode (DP = EP)
  int ranks = 1;
  double gpu_memory_gb = 141;  // GB (1e9 bytes); 141: H200
  double gpu_memory_utilization = 0.9;
  int64_t max_model_len = 0;  // 0: max_position_embeddings
  int64_t page_size = 16;
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 0;   // 0: the role's default
  std::string kv_cache_dtype = "auto";  // auto (bf16) or fp8
  bool mxfp8_native = false;
};

/// Prints the plan of rank 0 and a JSON summary line to `out`; returns 0 when it fits, 1 when
/// not (the text then ends with the refusal: what does not fit and by how much). Throws
/// Error(kInvalidArgument) on a bad role, rank count or option, or a layout that does not split the
/// model.
int print_memory_fit(const MemoryFitArgs& args, std::ostream& out);

}  // namespace tandem
