// Sharded Qwen3.5 hybrid (Qwen35MoeCpu) against the single-process model, ranks as threads
// (LocalCommunicator), on both Qwen3.5 golden fixtures:
//  - prefill TP=t EP=t (t = 2, 4 where the shapes split): logits of every prompt position within
//    1e-4 of the single model's, in two chunks (the DeltaNet state carried over), then greedy
//    decode steps; every rank the same logits bit for bit; each rank's state slot the slice of
//    the single model's (model/hybrid_state.h) within 1e-5, and the ranks' slots gathered on
//    rank 0 (gather_hybrid_state, what a TP prefill instance sends) the single model's whole
//    state within 1e-5 (fp32: the TP all-reduces sum in another order, so not bit for bit);
//  - decode DP=d EP=d: each rank its own sequences, bit-identical logits and tokens, rank 0 with
//    zero tokens in the later steps;
//  - what does not split is refused with a message naming it;
//  - block FP8 (the fixture through `tandem convert`, Qwen's -FP8 layout: attention, DeltaNet
//    in_proj_qkv / in_proj_z / out_proj, shared expert and per-expert linears F8_E4M3 with
//    128x128 weight_scale_inv): loads, near the bf16 model, and prefill TP=2 reads only its
//    slices (each element with its own block's scale) and matches the single FP8 model as above.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "comm/local_comm.h"
#include "core/error.h"
#include "engine/golden.h"
#include "forward_harness.h"
#include "model/config.h"
#include "model/convert.h"
#include "model/hybrid_state.h"
#include "model/qwen3_5_moe.h"
#include "model/safetensors.h"

namespace tandem {
namespace {

using comm::Communicator;
using comm::run_local_group;

constexpr int64_t kPageSize = testing::kHarnessPageSize;

// One sequence: its tokens (prompt, then generated), its pages, its state slot, how many of its
// tokens are in the cache.
using testing::argmax;
using testing::Greedy;
using testing::greedy_alone;
using testing::greedy_together;
using testing::make_cache;
using testing::make_seq;
using testing::run_step;
using testing::Seq;

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0.f;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Whether the model splits this way (every check load() makes before reading weights).
bool splits(const ModelConfig& c, const ShardSpec& spec) {
  try {
    (void)ShardPlan::make(c, spec);
    (void)DeltaNetHeads::of(c, spec);
    return spec.mode != ShardMode::kPrefillTpEp ||
           c.shared_expert_intermediate_size % spec.size == 0;
  } catch (const Error&) {
    return false;
  }
}

// ---- Prefill TP/EP. ----

struct PrefillResult {
  std::vector<float> logits;    // [prompt, vocab], then one row per decode step
  std::vector<int32_t> tokens;  // greedy continuation
  std::vector<float> state;     // the sequence's state slot after the prompt
};

PrefillResult prefill_and_continue(Model& m, const std::vector<int32_t>& prompt, int steps) {
  const int64_t v = m.config().vocab_size, len = static_cast<int64_t>(prompt.size());
  const int64_t max_len = len + steps;
  KvCache kv = make_cache(m, 1, max_len);
  Seq s = make_seq(0, max_len, prompt);
  PrefillResult r;
  const int64_t split = std::max<int64_t>(1, len / 3);  // chunked prefill: start_pos > 0
  r.logits = run_step(m, kv, {&s}, LogitsMode::kAll, split);
  if (split < len) {
    std::vector<float> rest = run_step(m, kv, {&s}, LogitsMode::kAll);
    r.logits.insert(r.logits.end(), rest.begin(), rest.end());
  }
  r.state.assign(kv.state(0), kv.state(0) + kv.state_slot_elems());
  std::vector<float> lg(r.logits.end() - v, r.logits.end());
  for (int i = 0; i < steps; ++i) {
    r.tokens.push_back(argmax(lg.data(), v));
    if (i + 1 == steps) break;
    s.tokens.push_back(r.tokens.back());
    lg = run_step(m, kv, {&s}, LogitsMode::kLast);
    r.logits.insert(r.logits.end(), lg.begin(), lg.end());
  }
  return r;
}

class ShardedQwen35 : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardedQwen35, PrefillTensorParallelMatchesSingle) {
  const testing::Golden g = testing::load_golden(GetParam());
  auto single = Qwen35MoeCpu::load(g.dir);
  const testing::GoldenCase* longest = &g.cases[0];
  for (const auto& c : g.cases) {
    if (c.prompt_ids.size() > longest->prompt_ids.size()) longest = &c;
  }
  const int steps = 4;
  const PrefillResult want = prefill_and_continue(*single, longest->prompt_ids, steps);
  EXPECT_EQ(want.tokens,
            std::vector<int32_t>(longest->output_ids.begin(), longest->output_ids.begin() + steps))
      << "the single model disagrees with transformers";
  int tested = 0;
  for (int t : {2, 4}) {
    if (!splits(single->config(), ShardSpec::prefill(0, t))) continue;
    ++tested;
    SCOPED_TRACE(g.name + " TP=" + std::to_string(t));
    std::vector<PrefillResult> got(static_cast<size_t>(t));
    std::vector<DeltaNetHeads> heads(static_cast<size_t>(t));
    std::vector<std::vector<float>> gathered(static_cast<size_t>(t));
    run_local_group(t, [&](Communicator& comm) {
      auto m = Qwen35MoeCpu::load(g.dir, ShardSpec::prefill(comm.rank(), t), &comm);
      EXPECT_EQ(m->kv_geometry(1, kPageSize).num_kv_heads, m->shard().kv_heads.size());
      EXPECT_EQ(m->state_slot_elems(), m->state_layout().slot_elems());
      const auto r = static_cast<size_t>(comm.rank());
      heads[r] = m->deltanet_heads();
      got[r] = prefill_and_continue(*m, longest->prompt_ids, steps);
      gathered[r] = gather_hybrid_state(comm, m->config(), got[r].state, 0);
    });
    // Rank 0 holds the whole state after the prompt, as the single model's; the others none.
    EXPECT_EQ(gathered[0].size(), want.state.size());
    EXPECT_LE(max_abs_diff(gathered[0], want.state), 1e-5f) << "the gathered state";
    for (int r = 1; r < t; ++r) EXPECT_TRUE(gathered[static_cast<size_t>(r)].empty()) << r;
    for (int r = 0; r < t; ++r) {
      const PrefillResult& p = got[static_cast<size_t>(r)];
      if (r > 0) {
        EXPECT_TRUE(bit_equal(p.logits, got[0].logits)) << "rank " << r << " differs from rank 0";
      }
      EXPECT_LE(max_abs_diff(p.logits, want.logits), 1e-4f) << "rank " << r;
      EXPECT_EQ(p.tokens, want.tokens) << "rank " << r;
      // The rank's state slot is its slice of the single model's.
      const DeltaNetHeads& hd = heads[static_cast<size_t>(r)];
      std::vector<float> slice(
          static_cast<size_t>(HybridStateLayout::of(single->config(), hd).slot_elems()));
      slice_hybrid_state(single->config(), hd, want.state.data(), slice.data());
      EXPECT_LE(max_abs_diff(p.state, slice), 1e-5f) << "rank " << r << " state";
    }
  }
  EXPECT_GE(tested, 1) << "no tensor-parallel layout fits " << g.name;
}

// ---- Decode DP/EP. ----

TEST_P(ShardedQwen35, DecodeDataParallelMatchesSingleExactly) {
  const testing::Golden g = testing::load_golden(GetParam());
  auto single = Qwen35MoeCpu::load(g.dir);
  int tested = 0;
  for (int world : {2, 4}) {
    if (!splits(single->config(), ShardSpec::decode(0, world))) continue;
    ++tested;
    SCOPED_TRACE(g.name + " DP=" + std::to_string(world));
    // Cases round-robin over the ranks; rank 0's stop after 2 tokens (then it runs empty steps
    // while the others still decode and need its experts).
    struct Case {
      std::vector<int32_t> prompt;
      int steps;
      int rank;
    };
    std::vector<Case> cases;
    int max_steps = 0;
    for (size_t i = 0; i < g.cases.size(); ++i) {
      const int rank = static_cast<int>(i % static_cast<size_t>(world));
      const int steps = rank == 0 ? 2 : std::min(6, g.cases[i].max_tokens);
      cases.push_back({g.cases[i].prompt_ids, steps, rank});
      max_steps = std::max(max_steps, steps);
    }
    std::vector<std::vector<std::pair<size_t, Greedy>>> per_rank(static_cast<size_t>(world));
    run_local_group(world, [&](Communicator& comm) {
      // Through the dispatching loader (what an instance's model factory would call).
      std::unique_ptr<Model> model =
          load_cpu_model(g.dir, ShardSpec::decode(comm.rank(), world), &comm);
      auto* m = dynamic_cast<Qwen35MoeCpu*>(model.get());
      ASSERT_NE(m, nullptr);
      EXPECT_EQ(m->deltanet_heads(), DeltaNetHeads::all(m->config()));
      std::vector<size_t> mine;
      int64_t max_len = 1;
      for (size_t i = 0; i < cases.size(); ++i) {
        max_len =
            std::max<int64_t>(max_len, static_cast<int64_t>(cases[i].prompt.size()) + max_steps);
        if (cases[i].rank == comm.rank()) mine.push_back(i);
      }
      KvCache kv = make_cache(*m, static_cast<int64_t>(mine.size()), max_len);
      std::vector<Seq> seqs;
      auto& out = per_rank[static_cast<size_t>(comm.rank())];
      std::vector<int> steps;
      for (size_t j = 0; j < mine.size(); ++j) {
        seqs.push_back(make_seq(static_cast<int64_t>(j), max_len, cases[mine[j]].prompt));
        out.push_back({mine[j], {}});
        steps.push_back(cases[mine[j]].steps);
      }
      std::vector<Greedy*> got;
      for (auto& r : out) got.push_back(&r.second);
      greedy_together(*m, kv, seqs, steps, max_steps, got);
    });
    size_t seen = 0;
    for (const auto& rank_results : per_rank) {
      for (const auto& [i, got] : rank_results) {
        ++seen;
        const Greedy want = greedy_alone(*single, cases[i].prompt, cases[i].steps);
        EXPECT_EQ(got.tokens, want.tokens) << "case " << i;
        ASSERT_EQ(got.logits.size(), want.logits.size());
        for (size_t s = 0; s < want.logits.size(); ++s) {
          EXPECT_TRUE(bit_equal(got.logits[s], want.logits[s])) << "case " << i << " step " << s;
        }
      }
    }
    EXPECT_EQ(seen, cases.size());
  }
  EXPECT_GE(tested, 1) << "no expert-parallel layout fits " << g.name;
}

TEST_P(ShardedQwen35, WhatDoesNotSplitIsRefused) {
  const testing::Golden g = testing::load_golden(GetParam());
  const ModelConfig c = ModelConfig::from_dir(g.dir);
  // Three ranks split neither the 8 experts nor the heads of either fixture.
  run_local_group(3, [&](Communicator& comm) {
    try {
      (void)Qwen35MoeCpu::load(g.dir, ShardSpec::prefill(comm.rank(), 3), &comm);
      ADD_FAILURE() << "TP=3 accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("do not split over 3"), std::string::npos) << e.what();
    }
  });
  EXPECT_THROW((void)Qwen35MoeCpu::load(g.dir, ShardSpec::prefill(0, 2), nullptr), Error);
  // A tensor-parallel rank holds a slice of the heads and the vocabulary: no MTP layer there
  // (a decode DP rank replicates them: tests/disagg/test_speculative_ep.cpp).
  if (splits(c, ShardSpec::prefill(0, 2))) {
    run_local_group(2, [&](Communicator& comm) {
      auto m = Qwen35MoeCpu::load(g.dir, ShardSpec::prefill(comm.rank(), 2), &comm);
      try {
        m->load_mtp(g.dir);
        ADD_FAILURE() << "MTP on a TP rank accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
        EXPECT_NE(std::string(e.what()).find("tensor-parallel"), std::string::npos) << e.what();
      }
    });
  }
  // Value heads that do not split over the TP group are named.
  const int t = static_cast<int>(c.linear_num_value_heads) * 2;
  if (c.num_experts % t == 0 && c.num_attention_heads % t == 0) {
    try {
      (void)DeltaNetHeads::of(c, ShardSpec::prefill(0, t));
      ADD_FAILURE() << "value heads over " << t << " ranks accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("linear_num_value_heads"), std::string::npos)
          << e.what();
    }
  }
}

// ---- Block FP8 (Qwen's -FP8 layout). ----

// `dir` converted to block FP8 into a fresh temporary directory (removed by the destructor).
struct Fp8Copy {
  std::string dir;
  explicit Fp8Copy(const std::string& src) {
    dir = (std::filesystem::temp_directory_path() /
           ("tandem_q35fp8_" + std::to_string(::getpid()) + "_" +
            std::filesystem::path(src).filename().string()))
              .string();
    std::filesystem::remove_all(dir);
    ConvertOptions o;
    o.in_dir = src;
    o.out_dir = dir;
    o.format = WeightQuant::kFp8Block;
    (void)convert_checkpoint(o);
  }
  ~Fp8Copy() { std::filesystem::remove_all(dir); }
};

TEST_P(ShardedQwen35, BlockFp8LoadsShardedAsSingle) {
  const testing::Golden g = testing::load_golden(GetParam());
  const Fp8Copy fp8(g.dir);
  const ModelConfig c = ModelConfig::from_dir(fp8.dir);
  ASSERT_EQ(c.quant.method, WeightQuant::kFp8Block);
  EXPECT_EQ(c.quant.block_rows, 128);
  // The layout: the linears Qwen quantizes are F8_E4M3 with their scales; the rest as stored.
  {
    const Checkpoint ck(fp8.dir);
    int64_t linear_layer = -1, experts_f8 = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      if (c.layer_types[static_cast<size_t>(l)] == ModelConfig::LayerType::kLinearAttention) {
        linear_layer = l;
        break;
      }
    }
    ASSERT_GE(linear_layer, 0);
    const std::string a = c.weight_prefix + "layers." + std::to_string(linear_layer) + ".";
    for (const char* t : {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                          "linear_attn.out_proj", "mlp.shared_expert.down_proj"}) {
      EXPECT_EQ(ck.get(a + t + ".weight").dtype, DType::kF8E4M3) << t;
      EXPECT_EQ(ck.get(a + t + ".weight_scale_inv").dtype, DType::kF32) << t;
    }
    for (const char* t :
         {"linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight",
          "linear_attn.conv1d.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight"}) {
      EXPECT_NE(ck.get(a + t).dtype, DType::kF8E4M3) << t;
    }
    for (const std::string& n : ck.names()) {
      if (n.find(".mlp.experts.") != std::string::npos && ck.get(n).dtype == DType::kF8E4M3)
        ++experts_f8;
      if (n.rfind("mtp.", 0) == 0) EXPECT_NE(ck.get(n).dtype, DType::kF8E4M3) << n;
    }
    // Experts stored one tensor per expert are quantized; fused 3D ones stay as stored.
    const bool fused = ck.has(a + "mlp.experts.gate_up_proj");
    EXPECT_EQ(experts_f8 > 0, !fused);
  }
  auto single = Qwen35MoeCpu::load(fp8.dir);
  auto bf16 = Qwen35MoeCpu::load(g.dir);
  const testing::GoldenCase* longest = &g.cases[0];
  for (const auto& gc : g.cases) {
    if (gc.prompt_ids.size() > longest->prompt_ids.size()) longest = &gc;
  }
  const int steps = 3;
  const PrefillResult want = prefill_and_continue(*single, longest->prompt_ids, steps);
  // Near the unquantized model (E4M3 keeps 3 mantissa bits: a few percent).
  const PrefillResult ref = prefill_and_continue(*bf16, longest->prompt_ids, steps);
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.logits.size() && i < want.logits.size(); ++i) {
    num += (double(want.logits[i]) - ref.logits[i]) * (double(want.logits[i]) - ref.logits[i]);
    den += double(ref.logits[i]) * ref.logits[i];
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  // (The tiny random fixtures' logits are small and every linear of 4 layers rounds: measured
  // 0.05-0.2; a wrong scale or layout gives ~1.)
  std::fprintf(stderr, "%s: FP8 logits vs bf16: relative L2 %.3f\n", g.name.c_str(), rel);
  EXPECT_GT(rel, 0.0) << "the FP8 model equals the bf16 one: nothing was quantized";
  EXPECT_LT(rel, 0.35) << "the FP8 model is far from the bf16 one";
  const int t = 2;
  if (!splits(c, ShardSpec::prefill(0, t))) GTEST_SKIP() << "TP=2 does not split " << g.name;
  std::vector<PrefillResult> got(static_cast<size_t>(t));
  std::vector<std::vector<float>> gathered(static_cast<size_t>(t));
  run_local_group(t, [&](Communicator& comm) {
    auto m = Qwen35MoeCpu::load(fp8.dir, ShardSpec::prefill(comm.rank(), t), &comm);
    const auto r = static_cast<size_t>(comm.rank());
    got[r] = prefill_and_continue(*m, longest->prompt_ids, steps);
    gathered[r] = gather_hybrid_state(comm, m->config(), got[r].state, 0);
  });
  EXPECT_LE(max_abs_diff(gathered[0], want.state), 1e-5f) << "the gathered state";
  for (int r = 0; r < t; ++r) {
    const PrefillResult& p = got[static_cast<size_t>(r)];
    EXPECT_LE(max_abs_diff(p.logits, want.logits), 1e-4f) << "rank " << r;
    EXPECT_EQ(p.tokens, want.tokens) << "rank " << r;
  }
  // Decode DP=2 / EP=2 ranks load their experts' FP8 tensors and agree with the single model.
  std::vector<std::vector<float>> dp(static_cast<size_t>(t));
  run_local_group(t, [&](Communicator& comm) {
    auto m = Qwen35MoeCpu::load(fp8.dir, ShardSpec::decode(comm.rank(), t), &comm);
    dp[static_cast<size_t>(comm.rank())] = prefill_and_continue(*m, longest->prompt_ids, 1).logits;
  });
  const std::vector<float> first(want.logits.begin(),
                                 want.logits.begin() + static_cast<std::ptrdiff_t>(dp[0].size()));
  for (int r = 0; r < t; ++r) {
    EXPECT_LE(max_abs_diff(dp[static_cast<size_t>(r)], first), 1e-4f) << "decode rank " << r;
  }
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = std::filesystem::path(info.param).filename().string();
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ShardedQwen35,
                         ::testing::ValuesIn(testing::hybrid_golden_dirs()), param_name);

}  // namespace
}  // namespace tandem
