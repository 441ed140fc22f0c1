#include "model/shard.h"

#include "comm/communicator.h"
#include "core/error.h"

namespace tandem {

void check_shard_communicator(const ShardSpec& shard, const comm::Communicator* comm) {
  if (shard.mode == ShardMode::kSingle) return;
  TANDEM_CHECK_KIND(kInvalidArgument, comm != nullptr, shard_mode_name(shard.mode),
                    " needs a communicator");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    comm->world_size() == shard.size && comm->rank() == shard.rank, "shard rank ",
                    shard.rank, " of ", shard.size, " does not match the communicator's rank ",
                    comm->rank(), " of ", comm->world_size());
}

std::string_view shard_mode_name(ShardMode mode) {
  switch (mode) {
    case ShardMode::kSingle: return "single";
    case ShardMode::kPrefillTpEp: return "prefill TP/EP";
    case ShardMode::kDecodeDpEp: return "decode DP/EP";
  }
  return "?";
}

namespace {

bool has_moe_layer(const ModelConfig& c) {
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.is_moe_layer(l)) return true;
  }
  return false;
}

}  // namespace

ShardPlan ShardPlan::make(const ModelConfig& c, const ShardSpec& spec) {
  const int64_t t = spec.size, r = spec.rank;
  const std::string_view mode = shard_mode_name(spec.mode);
  TANDEM_CHECK_KIND(kInvalidArgument, t >= 1 && r >= 0 && r < t, mode, ": rank ", r,
                    " outside a group of ", t);
  TANDEM_CHECK_KIND(kInvalidArgument, spec.mode != ShardMode::kSingle || t == 1,
                    "single mode takes a group of 1, got ", t);
  const int64_t qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  const int64_t experts = has_moe_layer(c) ? c.num_experts : 0;
  ShardPlan p;
  p.spec = spec;
  p.q_heads = {0, qh};
  p.kv_heads = {0, kvh};
  p.experts = {0, experts};
  p.vocab = {0, c.vocab_size};
  p.vocab_rows = c.vocab_size;
  if (spec.mode == ShardMode::kSingle) return p;

  // Experts: contiguous blocks of E / t (both parallel modes).
  TANDEM_CHECK_KIND(kInvalidArgument, experts % t == 0, mode, ": ", experts,
                    " experts do not split over ", t, " ranks (expert parallelism needs E % ", t,
                    " == 0)");
  p.experts = {r * experts / t, (r + 1) * experts / t};
  if (spec.mode == ShardMode::kDecodeDpEp) return p;

  // Prefill: heads and vocabulary split as well.
  TANDEM_CHECK_KIND(kInvalidArgument, qh % t == 0, mode, ": ", qh,
                    " query heads do not split over ", t, " ranks");
  if (t <= kvh) {
    TANDEM_CHECK_KIND(kInvalidArgument, kvh % t == 0, mode, ": ", kvh,
                      " KV heads do not split over ", t, " ranks");
    p.kv_heads = {r * kvh / t, (r + 1) * kvh / t};
  } else {
    TANDEM_CHECK_KIND(kInvalidArgument, t % kvh == 0, mode, ": ", kvh,
                      " KV heads cannot be replicated evenly over ", t, " ranks");
    p.kv_replicas = t / kvh;
    p.kv_heads = {r * kvh / t, r * kvh / t + 1};
  }
  p.q_heads = {r * qh / t, (r + 1) * qh / t};
  p.vocab_rows = (c.vocab_size + t - 1) / t;
  p.vocab = {std::min(c.vocab_size, r * p.vocab_rows),
             std::min(c.vocab_size, (r + 1) * p.vocab_rows)};
  return p;
}

IndexRange block_range(IndexRange r, int64_t block) {
  TANDEM_CHECK(block > 0 && r.begin >= 0 && r.begin <= r.end, "block_range: bad range [", r.begin,
               ", ", r.end, ") or block ", block);
  const int64_t b = r.begin / block;
  return r.size() == 0 ? IndexRange{b, b} : IndexRange{b, (r.end + block - 1) / block};
}

int ShardPlan::kv_head_owner(int64_t head) const {
  if (spec.mode != ShardMode::kPrefillTpEp) return spec.rank;
  const int64_t t = spec.size;
  const int64_t kvh = kv_replicas > 1 ? t / kv_replicas : kv_heads.size() * t;
  TANDEM_CHECK(head >= 0 && head < kvh, "KV head ", head, " out of range [0, ", kvh, ")");
  if (kv_replicas > 1) return static_cast<int>(head * kv_replicas);  // first of its replicas
  return static_cast<int>(head / kv_heads.size());
}

}  // namespace tandem
