// Qwen3.5 hybrid state slots and their TP parts. See hybrid_state.h.
#include "model/hybrid_state.h"

#include <algorithm>
#include <cstring>

#include "comm/communicator.h"
#include "core/error.h"

namespace tandem {

DeltaNetHeads DeltaNetHeads::all(const ModelConfig& c) {
  DeltaNetHeads h;
  h.key_heads = {0, c.linear_num_key_heads};
  h.value_heads = {0, c.linear_num_value_heads};
  return h;
}

DeltaNetHeads DeltaNetHeads::of(const ModelConfig& c, const ShardSpec& spec) {
  TANDEM_CHECK_KIND(kInvalidArgument, spec.size >= 1 && spec.rank >= 0 && spec.rank < spec.size,
                    "bad shard: rank ", spec.rank, " of ", spec.size);
  if (spec.mode != ShardMode::kPrefillTpEp || spec.size == 1) return all(c);
  const int64_t t = spec.size, r = spec.rank;
  const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  TANDEM_CHECK_KIND(kInvalidArgument, hk > 0 && hv % hk == 0, "linear_num_value_heads ", hv,
                    " is not a multiple of linear_num_key_heads ", hk);
  TANDEM_CHECK_KIND(kInvalidArgument, hv % t == 0, "linear_num_value_heads ", hv,
                    " do not split over ", t, " tensor-parallel ranks");
  TANDEM_CHECK_KIND(kInvalidArgument, hk % t == 0 || t % hk == 0, "linear_num_key_heads ", hk,
                    " do not split over (or replicate onto) ", t, " tensor-parallel ranks");
  DeltaNetHeads h;
  const int64_t v_per = hv / t, rep = hv / hk;
  h.value_heads = {r * v_per, (r + 1) * v_per};
  if (hk % t == 0) {
    h.key_heads = {r * (hk / t), (r + 1) * (hk / t)};
  } else {  // t > hk: one key head, held by t / hk ranks
    const int64_t k = h.value_heads.begin / rep;
    h.key_heads = {k, k + 1};
    h.key_replicas = t / hk;
  }
  return h;
}

HybridStateLayout HybridStateLayout::of(const ModelConfig& c, const DeltaNetHeads& heads) {
  HybridStateLayout l;
  for (auto t : c.layer_types) l.num_linear_layers += t == ModelConfig::LayerType::kLinearAttention;
  l.key_heads = heads.key_heads.size();
  l.value_heads = heads.value_heads.size();
  l.key_dim = c.linear_key_head_dim;
  l.value_dim = c.linear_value_head_dim;
  l.conv_window = std::max<int64_t>(0, c.linear_conv_kernel_dim - 1);
  return l;
}

namespace {

// Calls copy(full_offset, part_offset, floats) for every contiguous run of a rank's part.
template <typename F>
void for_each_run(const ModelConfig& c, const DeltaNetHeads& heads, F&& copy) {
  for (const StateRun& r : hybrid_state_runs(c, heads)) copy(r.full, r.part, r.count);
}

}  // namespace

std::vector<StateRun> hybrid_state_runs(const ModelConfig& c, const DeltaNetHeads& heads,
                                        bool owned_only) {
  const HybridStateLayout full = HybridStateLayout::full(c), part = HybridStateLayout::of(c, heads);
  const int64_t dk = full.key_dim, dv = full.value_dim, w = full.conv_window;
  const int64_t hk = full.key_heads;
  const int64_t kb = heads.key_heads.begin, vb = heads.value_heads.begin;
  // A replicated key head's first holder: its value heads start the key head's group.
  const int64_t group = hk > 0 ? full.value_heads / hk : 1;
  const bool keys = !owned_only || heads.key_replicas <= 1 || vb % group == 0;
  std::vector<StateRun> runs;
  for (int64_t l = 0; l < full.num_linear_layers; ++l) {
    // Conv window: [channels, w] per channel; the rank's channels are three contiguous runs.
    const int64_t fc = full.conv_offset(l), pc = part.conv_offset(l);
    const int64_t kc = part.key_heads * dk, vc = part.value_heads * dv;
    if (keys) {
      runs.push_back({fc + kb * dk * w, pc, kc * w});                       // q channels
      runs.push_back({fc + (hk * dk + kb * dk) * w, pc + kc * w, kc * w});  // k channels
    }
    runs.push_back({fc + (2 * hk * dk + vb * dv) * w, pc + 2 * kc * w, vc * w});  // v channels
    // Recurrent: [value heads, dk, dv], the rank's heads contiguous.
    runs.push_back({full.recurrent_offset(l) + vb * dk * dv, part.recurrent_offset(l),
                    part.value_heads * dk * dv});
  }
  return runs;
}

HybridSlices HybridSlices::of(const ModelConfig& c, const ShardPlan& plan,
                              const DeltaNetHeads& dn) {
  const int64_t d = c.head_dim, hk = c.linear_num_key_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t si = c.shared_expert_intermediate_size;
  HybridSlices s;
  s.q_rows = {plan.q_heads.begin * 2 * d, plan.q_heads.end * 2 * d};
  s.kv_rows = {plan.kv_heads.begin * d, plan.kv_heads.end * d};
  s.o_cols = {plan.q_heads.begin * d, plan.q_heads.end * d};
  s.conv_q = {dn.key_heads.begin * dk, dn.key_heads.end * dk};
  s.conv_k = {hk * dk + s.conv_q.begin, hk * dk + s.conv_q.end};
  s.conv_v = {2 * hk * dk + dn.value_heads.begin * dv, 2 * hk * dk + dn.value_heads.end * dv};
  s.z_rows = {dn.value_heads.begin * dv, dn.value_heads.end * dv};
  s.v_heads = dn.value_heads;
  s.shared_inter = {0, si};
  if (plan.tensor_parallel() && plan.spec.size > 1) {
    const int64_t t = plan.spec.size, r = plan.spec.rank;
    TANDEM_CHECK_KIND(kInvalidArgument, si % t == 0, shard_mode_name(plan.spec.mode),
                      ": shared_expert_intermediate_size ", si, " does not split over ", t,
                      " ranks");
    s.shared_inter = {r * si / t, (r + 1) * si / t};
  }
  return s;
}

void slice_hybrid_state(const ModelConfig& c, const DeltaNetHeads& heads, const float* full_slot,
                        float* part_slot) {
  for_each_run(c, heads, [&](int64_t f, int64_t p, int64_t n) {
    if (n > 0) std::memcpy(part_slot + p, full_slot + f, sizeof(float) * static_cast<size_t>(n));
  });
}

void merge_hybrid_state(const ModelConfig& c, const DeltaNetHeads& heads, const float* part_slot,
                        float* full_slot) {
  for_each_run(c, heads, [&](int64_t f, int64_t p, int64_t n) {
    if (n > 0) std::memcpy(full_slot + f, part_slot + p, sizeof(float) * static_cast<size_t>(n));
  });
}

std::vector<float> gather_hybrid_state(comm::Communicator& comm, const ModelConfig& c,
                                       std::span<const float> part, int root) {
  const int t = comm.world_size(), me = comm.rank();
  auto heads_of = [&](int r) { return DeltaNetHeads::of(c, ShardSpec::prefill(r, t)); };
  auto elems_of = [&](int r) { return HybridStateLayout::of(c, heads_of(r)).slot_elems(); };
  TANDEM_CHECK_KIND(kInvalidArgument, static_cast<int64_t>(part.size()) == elems_of(me), "rank ",
                    me, " of ", t, ": a recurrent state part of ", part.size(),
                    " floats, its DeltaNet heads hold ", elems_of(me));
  // NOTE: a tag of its own, so a state never meets another message between the same ranks.
  constexpr uint32_t kStateTag = 0x5a7e;
  if (me != root) {
    comm.send(part.data(), static_cast<int64_t>(part.size() * sizeof(float)), root, kStateTag);
    return {};
  }
  std::vector<float> full(static_cast<size_t>(HybridStateLayout::full(c).slot_elems()), 0.f);
  std::vector<float> buf;
  for (int r = 0; r < t; ++r) {
    const float* p = part.data();
    if (r != me) {
      buf.resize(static_cast<size_t>(elems_of(r)));
      comm.recv(buf.data(), static_cast<int64_t>(buf.size() * sizeof(float)), r, kStateTag);
      p = buf.data();
    }
    merge_hybrid_state(c, heads_of(r), p, full.data());
  }
  return full;
}

}  // namespace tandem
