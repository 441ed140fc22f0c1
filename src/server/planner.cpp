#include "server/planner.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/error.h"

namespace tandem {

PlannerOutput plan_replicas(const PlannerInputs& in) {
  TANDEM_CHECK_KIND(kInvalidArgument, in.prefill_capacity_tps > 0,
                    "prefill capacity (tokens/s per instance) must be positive");
  TANDEM_CHECK_KIND(kInvalidArgument, in.decode_dp > 0 && in.max_decode_batch > 0,
                    "decode dp and max_decode_batch must be positive");
  TANDEM_CHECK_KIND(kInvalidArgument, in.target_utilisation > 0 && in.target_utilisation <= 1,
                    "target utilisation must be in (0, 1]");
  TANDEM_CHECK_KIND(kInvalidArgument, in.drain_seconds > 0, "drain_seconds must be positive");
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      in.input_tokens_per_s >= 0 && in.queued_input_tokens >= 0 && in.concurrent_sequences >= 0,
      "observed load must not be negative");
  PlannerOutput out;
  std::ostringstream why;
  const double demand = in.input_tokens_per_s + in.queued_input_tokens / in.drain_seconds;
  const double per_prefill = in.prefill_capacity_tps * in.target_utilisation;
  out.prefill_instances =
      std::max(in.min_prefill, static_cast<int64_t>(std::ceil(demand / per_prefill - 1e-9)));
  why << "prefill: (" << in.input_tokens_per_s << " tok/s + " << in.queued_input_tokens
      << " queued / " << in.drain_seconds << " s) / (" << in.prefill_capacity_tps << " x "
      << in.target_utilisation << ") -> " << out.prefill_instances << "\n";
  const double per_decode =
      static_cast<double>(in.decode_dp * in.max_decode_batch) * in.target_utilisation;
  out.decode_instances = std::max(
      in.min_decode, static_cast<int64_t>(std::ceil(
                         static_cast<double>(in.concurrent_sequences) / per_decode - 1e-9)));
  why << "decode: " << in.concurrent_sequences << " sequences / (" << in.decode_dp << " ranks x "
      << in.max_decode_batch << " x " << in.target_utilisation << ") -> " << out.decode_instances
      << "\n";
  out.explanation = why.str();
  return out;
}

}  // namespace tandem
