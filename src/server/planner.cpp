#include "server/planner.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "model/memory_plan.h"

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

int print_memory_fit(const MemoryFitArgs& a, std::ostream& out) {
  MemoryPlanOptions o;
  if (a.role == "serve") {
    o.mode = ShardMode::kSingle;
    TANDEM_CHECK_KIND(kInvalidArgument, a.ranks == 1,
                      "plan --role serve runs on 1 rank, not --ranks ", a.ranks);
  } else if (a.role == "prefill") {
    o.mode = ShardMode::kPrefillTpEp;
  } else if (a.role == "decode") {
    o.mode = ShardMode::kDecodeDpEp;
  } else {
    TANDEM_THROW(kInvalidArgument, "plan --role must be serve, prefill or decode, not '", a.role,
                 "'");
  }
  TANDEM_CHECK_KIND(kInvalidArgument, a.kv_cache_dtype == "auto" || a.kv_cache_dtype == "fp8",
                    "plan --kv-cache-dtype must be auto or fp8, not '", a.kv_cache_dtype, "'");
  o.ranks = a.ranks;
  o.gpu_memory_bytes = a.gpu_memory_gb * 1e9;
  o.gpu_memory_utilization = a.gpu_memory_utilization;
  o.max_model_len = a.max_model_len;
  o.page_size = a.page_size;
  o.max_num_seqs = a.max_num_seqs;
  o.max_num_batched_tokens = a.max_num_batched_tokens;
  o.kv_cache_bytes_per_elem = a.kv_cache_dtype == "fp8" ? 1 : 2;
  o.mxfp8_native = a.mxfp8_native;
  ModelConfig c = ModelConfig::from_dir(a.model);
  // (ModelConfig reads quantization_config for both architectures; the top level's whatever
  // the model_type, as before.)
  if (!c.quant.quantized()) c.quant = QuantConfig::from_dir(a.model);
  const MemoryPlan m = plan_memory(c, o);
  out << m.describe(c);
  nlohmann::json j = {{"fits", m.fits},
                      {"role", a.role},
                      {"ranks", a.ranks},
                      {"weight_bytes", m.weights.total()},
                      {"activation_bytes", m.activations},
                      {"kv_state_bytes", m.kv_state_bytes},
                      {"kv_bytes_per_token", m.kv_bytes_per_token},
                      {"state_bytes_per_seq", m.state_bytes_per_seq},
                      {"max_batch", m.max_batch},
                      {"max_context", m.max_context}};
  if (!m.fits) j["refusal"] = m.refusal;
  out << j.dump() << "\n";
  return m.fits ? 0 : 1;
}

}  // namespace tandem
