// Sharded Qwen3-MoE against the single-process model, ranks as threads (LocalCommunicator)
// and over Gloo:
//  - prefill TP=t EP=t: logits of every prompt position within 1e-4, same greedy tokens;
//  - decode DP=d EP=d: each rank its own sequences, bit-identical logits and tokens, ranks
//    with zero tokens in a step;
//  - shard plans: head / expert / vocab ranges, KV head owners, errors for shapes that do not
//    split; a synthetic model with t = 3 and 6 (padded vocab shards, replicated KV heads).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <nlohmann/json.hpp>
#include <random>

#include "comm/gloo_comm.h"
#include "comm/local_comm.h"
#include "comm/tcp_store.h"
#include "core/error.h"
#include "engine/golden.h"
#include "forward_harness.h"
#include "model/qwen3_moe.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace tandem {
namespace {

using comm::Communicator;
using comm::run_local_group;
using namespace std::chrono_literals;

constexpr int64_t kPageSize = testing::kHarnessPageSize;

// One sequence: its tokens (prompt, then generated), its pages, how many are in the KV cache.
using testing::argmax;
using testing::Greedy;
using testing::greedy_alone;
using testing::greedy_together;
using testing::make_cache;
using testing::make_seq;
using testing::run_step;
using testing::Seq;

bool splits(const ModelConfig& c, const ShardSpec& spec) {
  try {
    ShardPlan::make(c, spec);
    return true;
  } catch (const Error&) {
    return false;
  }
}

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

// ---- Prefill TP/EP: the whole prompt, in two chunks, logits at every position. ----

struct PrefillResult {
  std::vector<float> logits;    // [prompt, vocab]
  std::vector<int32_t> tokens;  // greedy continuation (the first from the prompt's logits)
};

// One rank's part; `comm` may be null for the single model.
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
  std::vector<float> lg(r.logits.end() - v, r.logits.end());
  for (int i = 0; i < steps; ++i) {
    r.tokens.push_back(argmax(lg.data(), v));
    if (i + 1 == steps) break;
    s.tokens.push_back(r.tokens.back());
    lg = run_step(m, kv, {&s}, LogitsMode::kLast);
  }
  return r;
}

// Runs the prefill on t ranks of a local group; returns every rank's result.
std::vector<PrefillResult> prefill_tp(const std::string& dir, int t,
                                      const std::vector<int32_t>& prompt, int steps) {
  std::vector<PrefillResult> out(static_cast<size_t>(t));
  run_local_group(t, [&](Communicator& comm) {
    auto m = Qwen3MoeCpu::load(dir, ShardSpec::prefill(comm.rank(), t), &comm);
    EXPECT_EQ(m->kv_geometry(1, kPageSize).num_kv_heads, m->shard().kv_heads.size());
    out[static_cast<size_t>(comm.rank())] = prefill_and_continue(*m, prompt, steps);
  });
  return out;
}

void expect_prefill_matches(const PrefillResult& want, const std::vector<PrefillResult>& got,
                            const std::string& what) {
  SCOPED_TRACE(what);
  for (size_t r = 1; r < got.size(); ++r) {
    EXPECT_TRUE(bit_equal(got[r].logits, got[0].logits)) << "rank " << r << " differs from rank 0";
    EXPECT_EQ(got[r].tokens, got[0].tokens);
  }
  EXPECT_LE(max_abs_diff(got[0].logits, want.logits), 1e-4f);
  EXPECT_EQ(got[0].tokens, want.tokens);
}

// ---- Decode DP/EP: every rank its own sequences, lockstep steps, empty batches. ----

struct DecodeCase {
  std::vector<int32_t> prompt;
  int steps = 0;  // tokens to generate
  int rank = 0;   // the DP rank that owns it
};

// One DP rank: prefills its own sequences together, then decodes them greedily; keeps calling
// forward (empty batch) once its sequences are done, for as many steps as the longest case.
// Returns, per case it owns, the greedy result.
std::vector<std::pair<size_t, Greedy>> decode_rank(Model& m, const std::vector<DecodeCase>& cases,
                                                   int rank) {
  int max_steps = 0;
  int64_t max_len = 1;
  std::vector<size_t> mine;
  for (size_t i = 0; i < cases.size(); ++i) {
    max_steps = std::max(max_steps, cases[i].steps);
    max_len =
        std::max<int64_t>(max_len, static_cast<int64_t>(cases[i].prompt.size()) + cases[i].steps);
    if (cases[i].rank == rank) mine.push_back(i);
  }
  KvCache kv = make_cache(m, static_cast<int64_t>(mine.size()), max_len);
  std::vector<Seq> seqs;
  for (size_t j = 0; j < mine.size(); ++j)
    seqs.push_back(make_seq(static_cast<int64_t>(j), max_len, cases[mine[j]].prompt));
  std::vector<std::pair<size_t, Greedy>> results;
  std::vector<int> steps;
  for (size_t i : mine) {
    results.push_back({i, {}});
    steps.push_back(cases[i].steps);
  }
  std::vector<Greedy*> out;
  for (auto& r : results) out.push_back(&r.second);
  greedy_together(m, kv, seqs, steps, max_steps, out);
  return results;
}

// Cases of a golden fixture spread round-robin over `world` ranks; rank 0's sequences stop
// early so it runs empty steps while the others still decode.
std::vector<DecodeCase> decode_cases(const testing::Golden& g, int world) {
  std::vector<DecodeCase> cases;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    DecodeCase c;
    c.prompt = g.cases[i].prompt_ids;
    c.rank = static_cast<int>(i % static_cast<size_t>(world));
    c.steps = c.rank == 0 ? std::min(3, g.cases[i].max_tokens) : g.cases[i].max_tokens;
    cases.push_back(c);
  }
  return cases;
}

void expect_decode_matches(Model& single, const std::vector<DecodeCase>& cases,
                           const std::vector<std::vector<std::pair<size_t, Greedy>>>& per_rank,
                           const std::string& what) {
  SCOPED_TRACE(what);
  size_t seen = 0;
  for (const auto& rank_results : per_rank) {
    for (const auto& [i, got] : rank_results) {
      ++seen;
      Greedy want = greedy_alone(single, cases[i].prompt, cases[i].steps);
      EXPECT_EQ(got.tokens, want.tokens) << "case " << i;
      ASSERT_EQ(got.logits.size(), want.logits.size());
      for (size_t s = 0; s < want.logits.size(); ++s) {
        EXPECT_TRUE(bit_equal(got.logits[s], want.logits[s])) << "case " << i << " step " << s;
      }
    }
  }
  EXPECT_EQ(seen, cases.size());
}

std::vector<std::vector<std::pair<size_t, Greedy>>> decode_dp(
    const std::string& dir, int world, const std::vector<DecodeCase>& cases) {
  std::vector<std::vector<std::pair<size_t, Greedy>>> out(static_cast<size_t>(world));
  run_local_group(world, [&](Communicator& comm) {
    auto m = Qwen3MoeCpu::load(dir, ShardSpec::decode(comm.rank(), world), &comm);
    out[static_cast<size_t>(comm.rank())] = decode_rank(*m, cases, comm.rank());
  });
  return out;
}

// ---- Golden fixtures. ----

class ShardedGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(ShardedGolden, PrefillTensorParallelMatchesSingle) {
  testing::Golden g = testing::load_golden(GetParam());
  auto single = Qwen3MoeCpu::load(g.dir);
  // The longest prompt (the multi-page one).
  const testing::GoldenCase* longest = &g.cases[0];
  for (const auto& c : g.cases) {
    if (c.prompt_ids.size() > longest->prompt_ids.size()) longest = &c;
  }
  const int steps = 3;
  PrefillResult want = prefill_and_continue(*single, longest->prompt_ids, steps);
  // The single model itself agrees with transformers on the first tokens.
  EXPECT_EQ(want.tokens,
            std::vector<int32_t>(longest->output_ids.begin(), longest->output_ids.begin() + steps));
  int tested = 0;
  for (int t : {2, 4}) {
    if (!splits(single->config(), ShardSpec::prefill(0, t))) continue;
    ++tested;
    expect_prefill_matches(want, prefill_tp(g.dir, t, longest->prompt_ids, steps),
                           g.name + " TP=" + std::to_string(t));
  }
  EXPECT_GE(tested, 1) << "no tensor-parallel layout fits " << g.name;
}

TEST_P(ShardedGolden, DecodeDataParallelMatchesSingleExactly) {
  testing::Golden g = testing::load_golden(GetParam());
  auto single = Qwen3MoeCpu::load(g.dir);
  int tested = 0;
  for (int world : {2, 4}) {
    if (!splits(single->config(), ShardSpec::decode(0, world))) continue;
    ++tested;
    auto cases = decode_cases(g, world);
    expect_decode_matches(*single, cases, decode_dp(g.dir, world, cases),
                          g.name + " DP=" + std::to_string(world));
  }
  EXPECT_GE(tested, 1) << "no expert-parallel layout fits " << g.name;
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = std::filesystem::path(info.param).filename().string();
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ShardedGolden, ::testing::ValuesIn(testing::golden_dirs()),
                         param_name);

// Block-FP8 checkpoints (tools/make_fp8_fixtures.py): TP=2 splits a 128-row KV scale block
// between the ranks, TP=4 gives each rank 64 query rows of a block and replicated 64-row KV heads;
// the weights and their scale blocks are split together.
std::vector<std::string> fp8_golden_dirs() {
  std::vector<std::string> dirs;
  for (const auto& e :
       std::filesystem::directory_iterator(testing::source_dir() + "/tests/data/fixtures_fp8")) {
    if (std::filesystem::exists(e.path() / "golden.json")) dirs.push_back(e.path().string());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

INSTANTIATE_TEST_SUITE_P(Fp8Fixtures, ShardedGolden, ::testing::ValuesIn(fp8_golden_dirs()),
                         param_name);

// ---- Over Gloo (ranks as threads, loopback TCP). ----

void run_gloo_group(int world, const std::function<void(Communicator&)>& body) {
  auto options = [](int rank, int w, int port) {
    comm::TcpStoreOptions o;
    o.port = port;
    o.rank = rank;
    o.world_size = w;
    o.timeout = 30s;
    return o;
  };
  comm::GlooOptions go;
  go.timeout = 60s;
  auto root = std::make_unique<comm::TcpStore>(options(0, world, 0));
  const int port = root->port();
  std::vector<std::future<void>> others;
  for (int r = 1; r < world; ++r) {
    others.push_back(std::async(std::launch::async, [&, r] {
      comm::TcpStore store(options(r, world, port));
      comm::GlooCommunicator c(store, go);
      body(c);
    }));
  }
  std::exception_ptr err;
  try {
    comm::GlooCommunicator c(*root, go);
    body(c);
  } catch (...) {
    err = std::current_exception();
  }
  for (auto& f : others) f.get();
  root.reset();
  if (err) std::rethrow_exception(err);
}

TEST(ShardedGloo, PrefillAndDecodeOverGloo) {
  const std::string dir = testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2";
  testing::Golden g = testing::load_golden(dir);
  auto single = Qwen3MoeCpu::load(dir);
  const auto& prompt = g.cases[1].prompt_ids;
  // Prefill TP=2: same bits as over the LocalCommunicator (both sum in rank order).
  std::vector<PrefillResult> gloo(2);
  run_gloo_group(2, [&](Communicator& comm) {
    auto m = Qwen3MoeCpu::load(dir, ShardSpec::prefill(comm.rank(), 2), &comm);
    gloo[static_cast<size_t>(comm.rank())] = prefill_and_continue(*m, prompt, 2);
  });
  std::vector<PrefillResult> local = prefill_tp(dir, 2, prompt, 2);
  expect_prefill_matches(prefill_and_continue(*single, prompt, 2), gloo, "gloo TP=2");
  EXPECT_TRUE(bit_equal(gloo[0].logits, local[0].logits));
  // Decode DP=2: exact tokens.
  auto cases = decode_cases(g, 2);
  std::vector<std::vector<std::pair<size_t, Greedy>>> out(2);
  run_gloo_group(2, [&](Communicator& comm) {
    auto m = Qwen3MoeCpu::load(dir, ShardSpec::decode(comm.rank(), 2), &comm);
    out[static_cast<size_t>(comm.rank())] = decode_rank(*m, cases, comm.rank());
  });
  expect_decode_matches(*single, cases, out, "gloo DP=2");
}

// ---- Shard plans. ----

ModelConfig small_config(int64_t q_heads, int64_t kv_heads, int64_t experts, int64_t vocab) {
  ModelConfig c;
  c.vocab_size = vocab;
  c.hidden_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = q_heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 8;
  c.num_experts = experts;
  c.num_experts_per_tok = 2;
  return c;
}

TEST(ShardPlan, RangesAndKvOwners) {
  ModelConfig c = small_config(8, 2, 16, 250);
  ShardPlan single = ShardPlan::make(c, ShardSpec::single());
  EXPECT_EQ(single.q_heads, (IndexRange{0, 8}));
  EXPECT_EQ(single.experts, (IndexRange{0, 16}));
  EXPECT_EQ(single.vocab, (IndexRange{0, 250}));
  // TP=2: one KV head each, both send.
  ShardPlan p1 = ShardPlan::make(c, ShardSpec::prefill(1, 2));
  EXPECT_EQ(p1.q_heads, (IndexRange{4, 8}));
  EXPECT_EQ(p1.kv_heads, (IndexRange{1, 2}));
  EXPECT_EQ(p1.kv_replicas, 1);
  EXPECT_EQ(p1.experts, (IndexRange{8, 16}));
  EXPECT_EQ(p1.vocab, (IndexRange{125, 250}));
  EXPECT_EQ(p1.kv_head_owner(0), 0);
  EXPECT_EQ(p1.kv_head_owner(1), 1);
  EXPECT_TRUE(p1.sends_kv());
  // TP=4 over 2 KV heads: pairs of ranks replicate a head; the first of each pair sends.
  for (int r = 0; r < 4; ++r) {
    ShardPlan p = ShardPlan::make(c, ShardSpec::prefill(r, 4));
    EXPECT_EQ(p.q_heads, (IndexRange{2 * r, 2 * r + 2}));
    EXPECT_EQ(p.kv_heads, (IndexRange{r / 2, r / 2 + 1}));
    EXPECT_EQ(p.kv_replicas, 2);
    EXPECT_EQ(p.sends_kv(), r % 2 == 0) << r;
    EXPECT_EQ(p.vocab_rows, 63);  // ceil(250 / 4): the last shard is padded
    EXPECT_EQ(p.vocab, (IndexRange{std::min(250, 63 * r), std::min(250, 63 * (r + 1))}));
  }
  EXPECT_EQ(ShardPlan::make(c, ShardSpec::prefill(3, 4)).kv_head_owner(1), 2);
  // Decode: heads and vocabulary replicated, experts split.
  ShardPlan d = ShardPlan::make(c, ShardSpec::decode(3, 4));
  EXPECT_EQ(d.q_heads, (IndexRange{0, 8}));
  EXPECT_EQ(d.kv_heads, (IndexRange{0, 2}));
  EXPECT_EQ(d.experts, (IndexRange{12, 16}));
  EXPECT_EQ(d.vocab, (IndexRange{0, 250}));
  EXPECT_TRUE(d.sends_kv());
}

TEST(ShardPlan, ScaleBlocksOfAShard) {
  // A 64-row KV head of a 128-row block, one straddling two, whole blocks, empty.
  EXPECT_EQ(block_range({64, 128}, 128), (IndexRange{0, 1}));
  EXPECT_EQ(block_range({0, 64}, 128), (IndexRange{0, 1}));
  EXPECT_EQ(block_range({100, 200}, 128), (IndexRange{0, 2}));
  EXPECT_EQ(block_range({256, 512}, 128), (IndexRange{2, 4}));
  EXPECT_EQ(block_range({300, 300}, 128), (IndexRange{2, 2}));
  EXPECT_EQ(block_range({5, 37}, 32), (IndexRange{0, 2}));
  EXPECT_THROW(block_range({5, 3}, 32), Error);
}

TEST(ShardPlan, ClearErrorsWhenTheModelDoesNotSplit) {
  auto message = [](const ModelConfig& c, const ShardSpec& s) {
    try {
      ShardPlan::make(c, s);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      return std::string(e.message());
    }
    return std::string("no error");
  };
  EXPECT_EQ(
      message(small_config(8, 2, 6, 100), ShardSpec::decode(0, 4)),
      "decode DP/EP: 6 experts do not split over 4 ranks (expert parallelism needs E % 4 == 0)");
  EXPECT_EQ(message(small_config(6, 2, 12, 100), ShardSpec::prefill(0, 4)),
            "prefill TP/EP: 6 query heads do not split over 4 ranks");
  EXPECT_EQ(message(small_config(12, 3, 12, 100), ShardSpec::prefill(0, 2)),
            "prefill TP/EP: 3 KV heads do not split over 2 ranks");
  EXPECT_EQ(message(small_config(12, 4, 12, 100), ShardSpec::prefill(0, 6)),
            "prefill TP/EP: 4 KV heads cannot be replicated evenly over 6 ranks");
  EXPECT_EQ(message(small_config(8, 2, 16, 100), ShardSpec::prefill(2, 2)),
            "prefill TP/EP: rank 2 outside a group of 2");
  EXPECT_EQ(message(small_config(8, 2, 16, 100), ShardSpec{ShardMode::kSingle, 0, 2}),
            "single mode takes a group of 1, got 2");
  // The model load refuses a communicator that does not match the spec.
  const std::string dir = testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2";
  EXPECT_THROW(Qwen3MoeCpu::load(dir, ShardSpec::prefill(0, 2), nullptr), Error);
  run_local_group(2, [&](Communicator& comm) {
    EXPECT_THROW(Qwen3MoeCpu::load(dir, ShardSpec::prefill(1 - comm.rank(), 2), &comm), Error);
    EXPECT_THROW(Qwen3MoeCpu::load(dir, ShardSpec::decode(comm.rank(), 4), &comm), Error);
  });
}

// ---- A synthetic checkpoint for layouts the fixtures lack: t = 3 and 6, vocab 100. ----

class SyntheticModel {
 public:
  // 6 query heads over 3 KV heads, 6 experts (top-2), layer 1 dense, vocab 100.
  explicit SyntheticModel(bool tied) {
    dir_ = (std::filesystem::temp_directory_path() /
            ("tandem_sharded_" + std::to_string(::getpid()) + (tied ? "_tied" : "_untied")))
               .string();
    std::filesystem::create_directories(dir_);
    const int64_t v = 100, h = 48, d = 8, qh = 6, kvh = 3, e = 6, inter = 32, moe_inter = 16;
    nlohmann::json cfg = {{"architectures", {"Qwen3MoeForCausalLM"}},
                          {"model_type", "qwen3_moe"},
                          {"vocab_size", v},
                          {"hidden_size", h},
                          {"intermediate_size", inter},
                          {"moe_intermediate_size", moe_inter},
                          {"num_hidden_layers", 2},
                          {"num_attention_heads", qh},
                          {"num_key_value_heads", kvh},
                          {"head_dim", d},
                          {"num_experts", e},
                          {"num_experts_per_tok", 2},
                          {"decoder_sparse_step", 1},
                          {"mlp_only_layers", {1}},
                          {"norm_topk_prob", true},
                          {"tie_word_embeddings", tied},
                          {"rms_norm_eps", 1e-6},
                          {"rope_theta", 10000.0},
                          {"max_position_embeddings", 512},
                          {"torch_dtype", "float32"},
                          {"bos_token_id", 1},
                          {"eos_token_id", 2}};
    std::ofstream(dir_ + "/config.json") << cfg.dump(2);
    std::mt19937 rng(tied ? 11 : 12);
    std::normal_distribution<float> nd(0.f, 0.2f);
    std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {
        {"model.embed_tokens.weight", {v, h}}, {"model.norm.weight", {h}}};
    if (!tied) specs.push_back({"lm_head.weight", {v, h}});
    for (int l = 0; l < 2; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      specs.push_back({p + "input_layernorm.weight", {h}});
      specs.push_back({p + "post_attention_layernorm.weight", {h}});
      specs.push_back({p + "self_attn.q_norm.weight", {d}});
      specs.push_back({p + "self_attn.k_norm.weight", {d}});
      specs.push_back({p + "self_attn.q_proj.weight", {qh * d, h}});
      specs.push_back({p + "self_attn.k_proj.weight", {kvh * d, h}});
      specs.push_back({p + "self_attn.v_proj.weight", {kvh * d, h}});
      specs.push_back({p + "self_attn.o_proj.weight", {h, qh * d}});
      if (l == 0) {
        specs.push_back({p + "mlp.gate.weight", {e, h}});
        for (int x = 0; x < e; ++x) {
          const std::string ep = p + "mlp.experts." + std::to_string(x) + ".";
          specs.push_back({ep + "gate_proj.weight", {moe_inter, h}});
          specs.push_back({ep + "up_proj.weight", {moe_inter, h}});
          specs.push_back({ep + "down_proj.weight", {h, moe_inter}});
        }
      } else {
        specs.push_back({p + "mlp.gate_proj.weight", {inter, h}});
        specs.push_back({p + "mlp.up_proj.weight", {inter, h}});
        specs.push_back({p + "mlp.down_proj.weight", {h, inter}});
      }
    }
    nlohmann::json header = nlohmann::json::object();
    std::vector<float> data;
    for (const auto& [name, shape] : specs) {
      int64_t numel = 1;
      for (int64_t s : shape) numel *= s;
      const bool norm = name.find("norm") != std::string::npos;
      const size_t off = data.size() * 4;
      for (int64_t i = 0; i < numel; ++i) data.push_back(norm ? 1.f + nd(rng) * 0.1f : nd(rng));
      header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {off, data.size() * 4}}};
    }
    std::string hs = header.dump();
    const uint64_t hlen = hs.size();
    std::ofstream f(dir_ + "/model.safetensors", std::ios::binary);
    f.write(reinterpret_cast<const char*>(&hlen), 8);
    f.write(hs.data(), static_cast<std::streamsize>(hs.size()));
    f.write(reinterpret_cast<const char*>(data.data()),
            static_cast<std::streamsize>(data.size() * 4));
  }
  ~SyntheticModel() { std::filesystem::remove_all(dir_); }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
};

TEST(ShardedSynthetic, OddGroupSizesPaddedVocabReplicatedKv) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    SyntheticModel sm(tied);
    auto single = Qwen3MoeCpu::load(sm.dir());
    std::vector<int32_t> prompt;
    for (int i = 0; i < 37; ++i) prompt.push_back((i * 37 + 5) % 100);
    PrefillResult want = prefill_and_continue(*single, prompt, 4);
    // TP=3: one KV head per rank, vocab shards of 34 (the last one 32 rows).
    expect_prefill_matches(want, prefill_tp(sm.dir(), 3, prompt, 4), "TP=3");
    // TP=6: KV heads replicated over pairs, one expert per rank, vocab shards of 17.
    expect_prefill_matches(want, prefill_tp(sm.dir(), 6, prompt, 4), "TP=6");
    // DP=3: two experts per rank, three sequences on rank 1, none on rank 2.
    std::vector<DecodeCase> cases;
    for (int i = 0; i < 4; ++i) {
      DecodeCase c;
      for (int j = 0; j < 3 + 9 * i; ++j) c.prompt.push_back((j * 13 + i * 7 + 3) % 100);
      c.rank = i == 0 ? 0 : 1;
      c.steps = 2 + 2 * i;
      cases.push_back(c);
    }
    expect_decode_matches(*single, cases, decode_dp(sm.dir(), 3, cases), "DP=3");
  }
}

}  // namespace
}  // namespace tandem
