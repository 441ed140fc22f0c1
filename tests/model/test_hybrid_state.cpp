// model/hybrid_state.h: the DeltaNet heads of a TP rank and a state slot's parts (slice / merge
// round trip, every float of a full slot held by some rank, replicated key heads equal).
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "model/hybrid_state.h"
#include "model/shard.h"

namespace tandem {
namespace {

ModelConfig hybrid(int64_t hk, int64_t hv, int64_t dk, int64_t dv, int64_t layers) {
  ModelConfig c;
  c.model_type = "qwen3_5_moe_text";
  c.num_hidden_layers = layers;
  for (int64_t l = 0; l < layers; ++l) {
    c.layer_types.push_back((l + 1) % 4 == 0 ? ModelConfig::LayerType::kFullAttention
                                             : ModelConfig::LayerType::kLinearAttention);
  }
  c.linear_num_key_heads = hk;
  c.linear_num_value_heads = hv;
  c.linear_key_head_dim = dk;
  c.linear_value_head_dim = dv;
  c.linear_conv_kernel_dim = 4;
  return c;
}

TEST(HybridState, LayoutOfTheFullSlot) {
  const ModelConfig c = hybrid(16, 32, 128, 128, 8);  // Qwen3.5-35B-A3B's DeltaNet shapes
  const HybridStateLayout l = HybridStateLayout::full(c);
  EXPECT_EQ(l.num_linear_layers, 6);
  EXPECT_EQ(l.conv_channels(), 8192);
  EXPECT_EQ(l.conv_elems(), 8192 * 3);
  EXPECT_EQ(l.recurrent_elems(), 32 * 128 * 128);
  EXPECT_EQ(l.slot_elems(), 6 * (8192 * 3 + 32 * 128 * 128));
  EXPECT_EQ(l.recurrent_offset(1), l.layer_elems() + 8192 * 3);
}

TEST(HybridState, HeadsOfTensorParallelRanks) {
  const ModelConfig c = hybrid(16, 64, 128, 128, 4);
  const DeltaNetHeads h = DeltaNetHeads::of(c, ShardSpec::prefill(1, 4));
  EXPECT_EQ(h.key_heads, (IndexRange{4, 8}));
  EXPECT_EQ(h.value_heads, (IndexRange{16, 32}));
  EXPECT_EQ(h.key_replicas, 1);
  // Decode (data-parallel) and single ranks hold every head.
  EXPECT_EQ(DeltaNetHeads::of(c, ShardSpec::decode(1, 4)), DeltaNetHeads::all(c));
  EXPECT_EQ(DeltaNetHeads::of(c, ShardSpec::single()), DeltaNetHeads::all(c));
  // More ranks than key heads: one key head each, replicated.
  const ModelConfig one = hybrid(1, 2, 32, 32, 4);
  for (int r = 0; r < 2; ++r) {
    const DeltaNetHeads p = DeltaNetHeads::of(one, ShardSpec::prefill(r, 2));
    EXPECT_EQ(p.key_heads, (IndexRange{0, 1}));
    EXPECT_EQ(p.value_heads, (IndexRange{r, r + 1}));
    EXPECT_EQ(p.key_replicas, 2);
  }
  // What does not split is refused, naming the count.
  try {
    (void)DeltaNetHeads::of(hybrid(2, 4, 16, 16, 4), ShardSpec::prefill(0, 3));
    FAIL() << "4 value heads over 3 ranks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear_num_value_heads 4"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)DeltaNetHeads::of(hybrid(4, 24, 16, 16, 4), ShardSpec::prefill(0, 6)),
               Error);  // 24 value heads split over 6, but 4 key heads neither split nor repeat
  EXPECT_NO_THROW((void)DeltaNetHeads::of(hybrid(4, 24, 16, 16, 4), ShardSpec::prefill(0, 8)));
}

TEST(HybridState, SliceAndMergeCoverTheSlot) {
  for (const auto& [hk, hv, t] : std::vector<std::tuple<int64_t, int64_t, int>>{
           {2, 4, 2}, {4, 8, 4}, {1, 2, 2}, {2, 8, 4}, {2, 4, 1}}) {
    const ModelConfig c = hybrid(hk, hv, 8, 4, 5);
    const HybridStateLayout full = HybridStateLayout::full(c);
    std::vector<float> slot(static_cast<size_t>(full.slot_elems()));
    std::iota(slot.begin(), slot.end(), 1.0f);
    std::vector<float> merged(slot.size(), 0.0f);
    for (int r = 0; r < t; ++r) {
      const DeltaNetHeads h = DeltaNetHeads::of(c, ShardSpec::prefill(r, t));
      const HybridStateLayout part = HybridStateLayout::of(c, h);
      std::vector<float> mine(static_cast<size_t>(part.slot_elems()), -1.0f);
      slice_hybrid_state(c, h, slot.data(), mine.data());
      for (float v : mine) ASSERT_GT(v, 0.0f) << "rank " << r << ": a float left unset";
      // The rank's recurrent state of its first value head is the full slot's of that head.
      EXPECT_EQ(mine[static_cast<size_t>(part.recurrent_offset(0))],
                slot[static_cast<size_t>(full.recurrent_offset(0) +
                                         h.value_heads.begin * part.key_dim * part.value_dim)]);
      merge_hybrid_state(c, h, mine.data(), merged.data());
    }
    EXPECT_EQ(merged, slot) << "hk " << hk << " hv " << hv << " t " << t;
  }
}

// The device gather's plan (hybrid_state_runs, owned only): every rank scatters its owned runs
// into a zero-filled full slot, the slots are summed; each float of the full slot must come from
// exactly one rank (a replicated key head from its first holder), so the sum is the slot.
TEST(HybridState, OwnedRunsCoverTheSlotOnce) {
  for (const auto& [hk, hv, t] : std::vector<std::tuple<int64_t, int64_t, int>>{
           {2, 4, 2}, {4, 8, 4}, {1, 2, 2}, {2, 8, 4}, {1, 4, 4}, {2, 4, 1}}) {
    const ModelConfig c = hybrid(hk, hv, 8, 4, 5);
    const HybridStateLayout full = HybridStateLayout::full(c);
    std::vector<float> slot(static_cast<size_t>(full.slot_elems()));
    std::iota(slot.begin(), slot.end(), 1.0f);
    std::vector<int> writers(slot.size(), 0);
    std::vector<float> sum(slot.size(), 0.0f);
    int key_owners = 0;
    for (int r = 0; r < t; ++r) {
      const DeltaNetHeads h = DeltaNetHeads::of(c, ShardSpec::prefill(r, t));
      const HybridStateLayout part = HybridStateLayout::of(c, h);
      std::vector<float> mine(static_cast<size_t>(part.slot_elems()));
      slice_hybrid_state(c, h, slot.data(), mine.data());
      const std::vector<StateRun> all = hybrid_state_runs(c, h);
      const std::vector<StateRun> owned = hybrid_state_runs(c, h, /*owned_only=*/true);
      // Every run of the rank's part, in order, back to back.
      int64_t next = 0;
      for (const StateRun& run : all) {
        EXPECT_EQ(run.part, next);
        next += run.count;
      }
      EXPECT_EQ(next, part.slot_elems());
      key_owners += owned.size() == all.size();
      for (const StateRun& run : owned) {
        for (int64_t i = 0; i < run.count; ++i) {
          ++writers[static_cast<size_t>(run.full + i)];
          sum[static_cast<size_t>(run.full + i)] += mine[static_cast<size_t>(run.part + i)];
        }
      }
    }
    for (size_t i = 0; i < writers.size(); ++i) {
      ASSERT_EQ(writers[i], 1) << "hk " << hk << " hv " << hv << " t " << t << ": float " << i;
    }
    EXPECT_EQ(sum, slot);
    // With replicated key heads, one holder of each writes its channels.
    EXPECT_EQ(key_owners, t > hk ? hk : t) << "hk " << hk << " t " << t;
  }
}

// The tensors' slices (HybridSlices, both models' loaders): TP ranks' rows and columns tile each
// tensor; data-parallel and single ranks take everything; an unsplittable shared expert is refused.
TEST(HybridState, SlicesTileTheTensors) {
  ModelConfig c = hybrid(2, 4, 16, 8, 4);
  c.hidden_size = 64;
  c.head_dim = 32;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 16;
  c.shared_expert_intermediate_size = 32;
  c.vocab_size = 100;
  const int64_t conv_all = 2 * 2 * 16 + 4 * 8;
  for (const int t : {1, 2, 4}) {
    std::vector<int> q(4 * 2 * 32), o(4 * 32), conv(static_cast<size_t>(conv_all)), z(4 * 8), vh(4),
        si(32);
    for (int r = 0; r < t; ++r) {
      const ShardPlan plan = ShardPlan::make(c, ShardSpec::prefill(r, t));
      const DeltaNetHeads dn = DeltaNetHeads::of(c, ShardSpec::prefill(r, t));
      const HybridSlices s = HybridSlices::of(c, plan, dn);
      auto mark = [](std::vector<int>& v, IndexRange x) {
        for (int64_t i = x.begin; i < x.end; ++i) ++v[static_cast<size_t>(i)];
      };
      mark(q, s.q_rows);
      mark(o, s.o_cols);
      mark(z, s.z_rows);
      mark(vh, s.v_heads);
      mark(si, s.shared_inter);
      mark(conv, s.conv_v);
      // q / k channels: a key head's channels on each rank holding it (t > hk: replicated).
      if (dn.key_replicas == 1 || dn.value_heads.begin % 2 == 0) {
        mark(conv, s.conv_q);
        mark(conv, s.conv_k);
      }
      EXPECT_EQ(s.conv_q.size(), dn.key_heads.size() * 16);
      EXPECT_EQ(s.conv_k.begin, 2 * 16 + s.conv_q.begin);
      EXPECT_EQ(s.z_rows.size(), s.conv_v.size());
      EXPECT_EQ(s.kv_rows.size(), plan.kv_heads.size() * 32);
      EXPECT_EQ(s.q_rows.size(), 2 * s.o_cols.size());  // (query, gate) rows per head
    }
    for (const auto* v : {&q, &o, &conv, &z, &vh, &si}) {
      for (int x : *v) ASSERT_EQ(x, 1) << "t " << t;
    }
  }
  const ShardPlan dp = ShardPlan::make(c, ShardSpec::decode(1, 2));
  const HybridSlices all = HybridSlices::of(c, dp, DeltaNetHeads::of(c, ShardSpec::decode(1, 2)));
  EXPECT_EQ(all.q_rows, (IndexRange{0, 4 * 2 * 32}));
  EXPECT_EQ(all.conv_v, (IndexRange{64, conv_all}));
  EXPECT_EQ(all.shared_inter, (IndexRange{0, 32}));
  c.shared_expert_intermediate_size = 30;
  try {
    (void)HybridSlices::of(c, ShardPlan::make(c, ShardSpec::prefill(0, 4)),
                           DeltaNetHeads::of(c, ShardSpec::prefill(0, 4)));
    FAIL() << "a shared expert of 30 over 4 ranks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shared_expert_intermediate_size 30"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tandem
