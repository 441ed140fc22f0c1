// The sharded CUDA model, ranks as processes sharing this machine's GPU(s) (TANDEM_ALLOW_SHARED_
// GPU: CUDA IPC works between processes on one device): greedy generation of every GPU-shaped
// golden fixture through the engine on
//  - prefill TP=2 / EP=2: both ranks run the same requests in lockstep (heads and experts
//    split, o_proj and MoE all-reduced, vocab-parallel lm_head);
//  - decode DP=2 / EP=2: each rank its own requests (or none: zero-token steps), the MoE block
//    by our dispatch / combine inside the decode CUDA graphs;
// must reproduce the transformers tokens by the margin rule of the single-GPU golden tests
// (every step up to the first whose golden top1-top2 margin is under 0.5), and leak no page.
// The Qwen3.5 hybrid (Qwen35MoeCuda, the qwen35_* fixtures: one with replicated DeltaNet key
// heads at TP 2, one tied): prefill TP=2 logits against the one-GPU model's by the margin rule
// and the whole state gathered on the devices; decode DP=2 / EP=2 tokens against the one-GPU
// model's and the golden ones, an idle rank included; its MTP layer on decode EP ranks (a pass
// against the one-GPU model's, speculating engines fused and not, exactly K passes a step).
// Every CUDA call runs in the forked ranks (never in this process); skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/gloo_comm.h"
#include "comm/local_launcher.h"
#include "comm/tcp_store.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "engine/mtp_weights.h"
#include "model/convert.h"
#include "model/cuda/cuda_golden_util.h"
#include "model/cuda/mtp_cuda.h"
#include "model/cuda/qwen3_5_moe_cuda.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/hybrid_state.h"
#include "model/qwen3_moe.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace tandem {
namespace {

constexpr double kMarginBf16 = 0.5;

int visible_gpus() {
  static const int n = comm::run_in_child(
      [] {
        int c = 0;
        return cudaGetDeviceCount(&c) == cudaSuccess ? c : 0;
      },
      0);
  return n;
}

std::vector<std::string> dirs_for(int ranks) {
  std::vector<std::string> out;
  // The golden fixtures and the block-FP8 one (its linears stay FP8 on the GPU: the TP slices
  // of o_proj's columns and the EP experts keep their block scales).
  std::vector<std::string> dirs = testing::golden_dirs();
  dirs.push_back(testing::source_dir() + "/tests/data/fixtures_fp8/hub_fp8_block128");
  for (const auto& d : dirs) {
    const ModelConfig c = ModelConfig::from_dir(d);
    if (c.head_dim != 64 && c.head_dim != 128) continue;
    try {
      ShardPlan::make(c, ShardSpec::prefill(0, ranks));
      ShardPlan::make(c, ShardSpec::decode(0, ranks));
    } catch (const Error&) {
      continue;
    }
    out.push_back(d);
  }
  return out;
}

struct Result {
  std::vector<int32_t> ids;
  int finished = 0;
};

// Throws, naming the case and step, when a compared step differs.
int check_greedy(const testing::Golden& g, const std::vector<size_t>& cases,
                 const std::vector<Result>& results, const std::string& mode) {
  int compared = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    const auto& c = g.cases[cases[k]];
    const Result& r = results[k];
    TANDEM_CHECK(r.finished == 1, g.name, " ", mode, " case ", cases[k], ": finished ", r.finished);
    for (size_t t = 0; t < c.output_ids.size(); ++t) {
      const auto& top = c.top_logprobs[t];
      if (top.size() < 2 || top[0].logprob - top[1].logprob < kMarginBf16) break;
      TANDEM_CHECK(t < r.ids.size() && r.ids[t] == c.output_ids[t], g.name, " ", mode, " case ",
                   cases[k], " step ", t, ": got ", t < r.ids.size() ? r.ids[t] : -1, ", want ",
                   c.output_ids[t]);
      ++compared;
    }
  }
  return compared;
}

// The rank's sharded model of `dir` on its GPU (the ranks share the machine's GPUs); M:
// Qwen3MoeCuda or Qwen35MoeCuda. A single spec loads the whole model (no store needed).
template <typename M = Qwen3MoeCuda>
std::unique_ptr<M> load_rank_model(const std::string& dir, const ShardSpec& spec,
                                   const std::shared_ptr<comm::TcpStore>& store) {
  const comm::RankEnv env = comm::RankEnv::from_env();
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  o.page_size = 16;
  o.shard = spec;
  o.store = store;
  int gpus = 0;
  TANDEM_CHECK(cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 0, "no GPU in the rank");
  o.device = env.local_rank % gpus;
  return M::load(dir, o);
}

EngineConfig rank_engine_config() {
  EngineConfig cfg;
  cfg.max_num_seqs = 8;
  cfg.max_batched_tokens = 512;
  cfg.kv_cache_mb = 64;
  return cfg;
}

// Steps the engine in lockstep with the group until no rank has work (an idle decode rank's
// batches are empty). Returns the steps.
int step_in_lockstep(Engine& engine, comm::GlooCommunicator& gloo) {
  int steps = 0;
  for (;;) {
    int64_t any = engine.has_work() ? 1 : 0;
    gloo.all_reduce_sum(&any, 1, DType::kI64);
    if (any == 0) break;
    ScheduledBatch batch = engine.schedule();  // empty on an idle decode rank
    TANDEM_CHECK(engine.forward(batch), "forward failed");
    engine.complete(batch);
    ++steps;
  }
  return steps;
}

// One rank: the sharded model, an engine over `cases`, steps in lockstep with the group until
// no rank has work (prefill TP: every rank the same cases). With `mtp`: speculating with K
// drafts (decode EP: the MTP layer's experts sharded, K collective MTP passes every step).
// M: the architecture; `tokens` (when set) gets each case's tokens.
template <typename M = Qwen3MoeCuda>
void run_rank(const std::string& dir, const ShardSpec& spec, const std::vector<size_t>& cases,
              int* compared, const std::string& mtp = "", int64_t k = 0,
              std::vector<Result>* tokens = nullptr, bool fused = true, bool golden_tokens = true) {
  const comm::RankEnv env = comm::RankEnv::from_env();
  auto store = std::make_shared<comm::TcpStore>(comm::TcpStoreOptions::of(env));
  comm::GlooCommunicator gloo(*store);
  const testing::Golden g = testing::load_golden(dir);
  auto model = load_rank_model<M>(dir, spec, store);
  EngineConfig cfg = rank_engine_config();
  if (!mtp.empty()) {
    model->load_mtp(mtp);
    model->set_fused_step(fused);
    TANDEM_CHECK(model->mtp_collective() == (spec.size > 1), "mtp_collective() is ",
                 model->mtp_collective());
    cfg.num_speculative_tokens = k;
  }
  Engine engine(*model, cfg);
  std::vector<Result> results(cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    GenRequest r;
    r.id = "r" + std::to_string(cases[k]);
    r.prompt_ids = g.cases[cases[k]].prompt_ids;
    r.max_tokens = g.cases[cases[k]].max_tokens;
    r.sampling.temperature = 0;
    engine.add(r, [&results, k](const StepOutput& out) {
      results[k].ids.insert(results[k].ids.end(), out.token_ids.begin(), out.token_ids.end());
      if (out.finished) ++results[k].finished;
    });
  }
  const int steps = step_in_lockstep(engine, gloo);
  TANDEM_CHECK(engine.blocks().num_available() == engine.blocks().num_pages(), "leaked KV pages");
  const std::string mode =
      std::string(shard_mode_name(spec.mode)) + " rank " + std::to_string(spec.rank);
  *compared = golden_tokens ? check_greedy(g, cases, results, mode) : 0;
  if (spec.mode == ShardMode::kDecodeDpEp && !cases.empty() && k == 0) {
    TANDEM_CHECK(!model->captured_buckets().empty(), mode, ": no decode step ran a graph");
  }
  if (k > 0 && !cases.empty()) {
    const EngineStats st = engine.stats();
    TANDEM_CHECK(st.spec_num_drafts > 0, mode, ": no drafts");
    std::fprintf(stderr, "%s %s K %lld: drafts %lld, draft tokens %lld, accepted %lld\n",
                 g.name.c_str(), mode.c_str(), static_cast<long long>(k),
                 static_cast<long long>(st.spec_num_drafts),
                 static_cast<long long>(st.spec_num_draft_tokens),
                 static_cast<long long>(st.spec_num_accepted_tokens));
  }
  std::fprintf(stderr, "%s %s: %d steps, %d tokens compared\n", g.name.c_str(), mode.c_str(), steps,
               *compared);
  if constexpr (std::is_same_v<M, Qwen35MoeCuda>) {
    // Speculating hybrids fuse their steps unless set_fused_step(false).
    TANDEM_CHECK(k == 0 || cases.empty() || fused == (model->fused_steps() > 0), mode, ": ",
                 model->fused_steps(), " fused steps");
  }
  if (tokens != nullptr) *tokens = results;
}

class CudaSharded : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (visible_gpus() == 0) GTEST_SKIP() << "no CUDA device";
    ::setenv("TANDEM_ALLOW_SHARED_GPU", "1", 1);
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  }

 public:
  void run(const std::function<void(int)>& body) {
    auto results = comm::run_local_ranks(2, body, std::chrono::seconds(300));
    EXPECT_EQ(comm::describe_failures(results), "");
  }
};

// Runs body on two ranks of t's group (the test bodies shared by suites).
void t_run(CudaSharded& t, const std::function<void(int)>& body) { t.run(body); }

TEST_P(CudaSharded, PrefillTp2GreedyMatchesTransformers) {
  const std::string dir = GetParam();
  const size_t n = testing::load_golden(dir).cases.size();
  std::vector<size_t> all(n);
  for (size_t i = 0; i < n; ++i) all[i] = i;
  run([&](int rank) {
    int compared = 0;
    run_rank(dir, ShardSpec::prefill(rank, 2), all, &compared);
    TANDEM_CHECK(compared > 0, "no step with a margin over ", kMarginBf16);
  });
}

TEST_P(CudaSharded, DecodeDp2Ep2GreedyMatchesTransformers) {
  const std::string dir = GetParam();
  const size_t n = testing::load_golden(dir).cases.size();
  // Each rank its own requests: rank 0 the even cases, rank 1 the odd ones.
  run([&](int rank) {
    std::vector<size_t> mine;
    for (size_t i = static_cast<size_t>(rank); i < n; i += 2) mine.push_back(i);
    int compared = 0;
    run_rank(dir, ShardSpec::decode(rank, 2), mine, &compared);
  });
}

TEST_P(CudaSharded, DecodeEpRankWithNothingServesItsExperts) {
  const std::string dir = GetParam();
  const size_t n = testing::load_golden(dir).cases.size();
  // Rank 1 has no request at all: it runs zero-token steps while rank 0 decodes every case.
  run([&](int rank) {
    std::vector<size_t> mine;
    if (rank == 0) {
      for (size_t i = 0; i < n; ++i) mine.push_back(i);
    }
    int compared = 0;
    run_rank(dir, ShardSpec::decode(rank, 2), mine, &compared);
    TANDEM_CHECK(rank != 0 || compared > 0, "no step with a margin over ", kMarginBf16);
  });
}

// ---- MTP on decode DP/EP: the MTP layer's MoE through the target's exchange -------------

// The demo model's trained head when it ships one, else random MTP weights (a MoE layer) for
// the first GPU-shaped fixture; written by the parent (host code), read by the ranks.
struct MtpCase {
  std::string model, mtp;
  bool random = false;
};

MtpCase mtp_case() {
  const std::string demo = testing::source_dir() + "/models/demo";
  if (std::filesystem::exists(demo + "/model-mtp.safetensors")) return {demo, demo, false};
  for (const auto& d : dirs_for(2)) {
    if (ModelConfig::from_dir(d).num_experts == 0) continue;
    const std::string mtp = (std::filesystem::temp_directory_path() /
                             ("tandem_mtpep_cuda_" + std::to_string(::getpid())))
                                .string();
    testing::write_random_mtp(d, mtp, 7);
    return {d, mtp, true};
  }
  return {};
}

class CudaShardedMtp : public ::testing::Test {
 protected:
  void SetUp() override {
    if (visible_gpus() == 0) GTEST_SKIP() << "no CUDA device";
    ::setenv("TANDEM_ALLOW_SHARED_GPU", "1", 1);
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    c_ = mtp_case();
    if (c_.model.empty()) GTEST_SKIP() << "no GPU-shaped MoE fixture";
  }
  void TearDown() override {
    if (c_.random) std::filesystem::remove_all(c_.mtp);
  }
  void run(const std::function<void(int)>& body) {
    auto results = comm::run_local_ranks(2, body, std::chrono::seconds(300));
    EXPECT_EQ(comm::describe_failures(results), "");
  }
  MtpCase c_;
};

// One rank's MTP passes against the CPU model's (fp32, whole) over the same hidden states and
// tokens: round 1 both ranks run a case, round 2 rank 1 runs an empty pass (its experts serve
// rank 0's tokens). Also: the rank holds only its experts (the MTP weight bytes).
TEST_F(CudaShardedMtp, DecodeEpMtpPassMatchesTheCpuModel) {
  const MtpCase mc = c_;
  run([&](int rank) {
    const comm::RankEnv env = comm::RankEnv::from_env();
    auto store = std::make_shared<comm::TcpStore>(comm::TcpStoreOptions::of(env));
    const testing::Golden g = testing::load_golden(mc.model);
    auto cpu = Qwen3MoeCpu::load(mc.model);
    cpu->load_mtp(mc.mtp);
    CudaModelOptions o;
    o.max_tokens = 512;
    o.max_seqs = 8;
    o.page_size = 16;
    o.shard = ShardSpec::decode(rank, 2);
    o.store = store;
    int gpus = 0;
    TANDEM_CHECK(cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 0, "no GPU in the rank");
    o.device = env.local_rank % gpus;
    auto gpu = Qwen3MoeCuda::load(mc.model, o);
    gpu->load_mtp(mc.mtp);
    TANDEM_CHECK(gpu->mtp_collective(), "rank ", rank, ": the MTP layer is not collective");
    // bf16 weights: everything whole but the experts, of which this rank holds E / 2.
    const ModelConfig& c = cpu->config();
    const int64_t h = c.hidden_size, d = c.head_dim, E = c.num_experts;
    const int64_t qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d;
    const int64_t elems = 2 * h * h + 5 * h + 2 * d + qkv * h + h * c.num_attention_heads * d +
                          E * h + (E / 2) * 3 * c.moe_intermediate_size * h;
    TANDEM_CHECK(gpu->mtp()->weight_bytes() == 2 * elems, "rank ", rank, ": MTP weights of ",
                 gpu->mtp()->weight_bytes(), " bytes, want ", 2 * elems, " (E / 2 experts)");
    const int64_t vocab = c.vocab_size;
    std::vector<double> errs;
    int checked = 0;
    for (int round = 0; round < 2; ++round) {
      const bool empty = round == 1 && rank == 1;
      const auto& gc = g.cases[static_cast<size_t>(round == 0 ? rank : 0) % g.cases.size()];
      std::vector<int32_t> tokens = gc.prompt_ids;
      tokens.insert(tokens.end(), gc.output_ids.begin(), gc.output_ids.end());
      const auto n = static_cast<int64_t>(tokens.size()) - 1;
      const int64_t pages = n / 16 + 2;
      std::vector<int32_t> table(static_cast<size_t>(pages));
      for (int64_t p = 0; p < pages; ++p) table[static_cast<size_t>(p)] = int32_t(pages - 1 - p);
      KvCache kv(cpu->kv_geometry(pages, 16));
      std::vector<float> hidden, logits;
      ForwardBatch tb;
      tb.seqs.push_back({tokens.data(), n, 0, table.data(), pages, LogitsMode::kLast});
      tb.hidden_out = &hidden;
      cpu->forward(tb, kv, logits);
      KvCache cpu_mkv = cpu->make_mtp_kv_cache(pages, 16);
      KvCache gpu_mkv = gpu->make_mtp_kv_cache(pages, 16);
      ForwardBatch mb;
      if (!empty) {
        mb.seqs.push_back({tokens.data() + 1, n, 0, table.data(), pages, LogitsMode::kAll});
      }
      std::vector<float> want, got, hc, hg;
      gpu->mtp_forward(mb, hidden.data(), gpu_mkv, got, hg);  // collective
      if (empty) {
        TANDEM_CHECK(got.empty() && hg.empty(), "an empty pass returned rows");
        continue;
      }
      cpu->mtp_forward(mb, hidden.data(), cpu_mkv, want, hc);
      TANDEM_CHECK(got.size() == want.size(), "rows ", got.size(), " vs ", want.size());
      for (int64_t r = 0; r < n; ++r) {
        const float* gr = got.data() + r * vocab;
        const float* wr = want.data() + r * vocab;
        double num = 0, den = 0;
        int64_t ga = 0, wa = 0;
        for (int64_t i = 0; i < vocab; ++i) {
          TANDEM_CHECK(std::isfinite(gr[i]), "row ", r, ": not finite");
          num += (double(gr[i]) - wr[i]) * (double(gr[i]) - wr[i]);
          den += double(wr[i]) * wr[i];
          if (gr[i] > gr[ga]) ga = i;
          if (wr[i] > wr[wa]) wa = i;
        }
        float second = -INFINITY;
        for (int64_t i = 0; i < vocab; ++i) {
          if (i != wa) second = std::max(second, wr[i]);
        }
        errs.push_back(std::sqrt(num / std::max(den, 1e-30)));
        if (wr[wa] - second > kMarginBf16) {
          TANDEM_CHECK(ga == wa, "rank ", rank, " round ", round, " row ", r, ": argmax ", ga,
                       ", the CPU's ", wa);
          ++checked;
        }
      }
    }
    std::sort(errs.begin(), errs.end());
    const double med = errs[errs.size() / 2], worst = errs.back();
    std::fprintf(stderr, "rank %d: MTP rows %zu, relative error median %.2e max %.2e, %d argmax\n",
                 rank, errs.size(), med, worst, checked);
    TANDEM_CHECK(med < 1.5e-2 && worst < 0.3, "rank ", rank, ": MTP logits off (median ", med,
                 ", max ", worst, ")");
  });
}

// Speculating decode EP ranks: greedy tokens by the margin rule against the golden
// continuation, K = 3 with every case on both ranks (a split by case can leave a rank only cases
// whose first golden step is under the margin: nothing compared), then K = 2 with rank 1 idle
// (its engine runs the K empty MTP passes of every step while rank 0 drafts).
TEST_F(CudaShardedMtp, DecodeDp2SpeculatingGreedyMatchesTransformers) {
  const MtpCase mc = c_;
  const size_t n = testing::load_golden(mc.model).cases.size();
  for (const auto& [k, uneven] : {std::pair<int64_t, bool>{3, false}, {2, true}}) {
    {
      SCOPED_TRACE("K " + std::to_string(k) + (uneven ? " rank 1 idle" : " both ranks"));
      run([&, k = k, uneven = uneven](int rank) {
        std::vector<size_t> mine;
        for (size_t i = 0; i < n; ++i) {
          if (!uneven || rank == 0) mine.push_back(i);
        }
        int compared = 0;
        run_rank(mc.model, ShardSpec::decode(rank, 2), mine, &compared, mc.mtp, k);
        TANDEM_CHECK(mine.empty() || compared > 0, "no step with a margin over ", kMarginBf16);
      });
    }
  }
}

// One speculating engine run of a decode EP rank over `cases` (greedy; `forced`: the engine's
// spec_forced_accept_prob, and then every case max_tokens `forced_tokens` with ignore_eos, so
// that a rank's cases end together), fused (Model::forward_verify_draft) or not
// (set_fused_step(false)): its tokens, drafts by request and tokens so far, counters and fused
// steps.
struct SpecRun {
  std::vector<Result> results;
  std::map<std::string, std::vector<int32_t>> drafts;
  EngineStats stats;
  int64_t fused_steps = 0;
};

SpecRun spec_run(Qwen3MoeCuda& model, comm::GlooCommunicator& gloo, const testing::Golden& g,
                 const std::vector<size_t>& cases, int64_t k, double forced, bool fused) {
  constexpr int32_t forced_tokens = 24;
  model.set_fused_step(fused);
  TANDEM_CHECK(model.fuses_verify_and_draft() == fused, "fuses_verify_and_draft() is ",
               model.fuses_verify_and_draft());
  SpecRun run;
  EngineConfig cfg = rank_engine_config();
  cfg.num_speculative_tokens = k;
  cfg.spec_forced_accept_prob = forced;
  cfg.spec_draft_hook = [&run](const std::string& id, std::span<const int32_t> tokens,
                               std::vector<int32_t>& drafts) {
    run.drafts[id + "@" + std::to_string(tokens.size())] = drafts;  // kept as drafted
  };
  const int64_t fused_before = model.fused_steps();
  {
    Engine engine(model, cfg);
    run.results.resize(cases.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      GenRequest r;
      r.id = "r" + std::to_string(cases[i]);
      r.prompt_ids = g.cases[cases[i]].prompt_ids;
      r.max_tokens = forced >= 0 ? forced_tokens : g.cases[cases[i]].max_tokens;
      r.ignore_eos = forced >= 0;
      r.sampling.temperature = 0;
      engine.add(r, [&run, i](const StepOutput& out) {
        run.results[i].ids.insert(run.results[i].ids.end(), out.token_ids.begin(),
                                  out.token_ids.end());
        if (out.finished) ++run.results[i].finished;
      });
    }
    step_in_lockstep(engine, gloo);
    TANDEM_CHECK(engine.blocks().num_available() == engine.blocks().num_pages(), "leaked KV pages");
    run.stats = engine.stats();
  }
  model.set_fused_step(true);
  run.fused_steps = model.fused_steps() - fused_before;
  return run;
}

// Decode EP ranks running the fused speculative step (MtpCuda::draft_after_verify on a
// collective MTP layer: the verify, pass 0 over every verify position and K - 1 chained passes,
// K exchanges, one synchronisation) against the unfused path (set_fused_step(false): the verify,
// the tokens to the host, the draft chain, empty passes up to K), with both ranks fusing, rank 0
// fusing beside an unfused rank 1, and rank 0 fusing beside an idle rank 1 (each rank decides
// alone: a step runs K exchanges either way). Every case on a busy rank, K = 3 then 2:
//  - every draft accepted (forced, the cases of a rank ending together): pass 0 covers the same
//    positions fused or not and each pass the same rows, so the tokens, the drafts and the
//    counters are the unfused run's exactly;
//  - the target's acceptance: the fused pass 0 covers every verify position (the unfused one the
//    accepted ones: other GEMM shapes), so a draft may differ by bf16 rounding at a near tie:
//    both runs' tokens by the margin rule against golden, the accepted counts within 2%, as on
//    one GPU (CudaMtp.FusedStepMatchesUnfused).
TEST_F(CudaShardedMtp, DecodeDp2FusedStepMatchesUnfused) {
  const MtpCase mc = c_;
  const size_t n = testing::load_golden(mc.model).cases.size();
  enum Layout { kBothFuse, kRank1Unfused, kRank1Idle };
  const char* const names[] = {"both ranks fuse", "rank 1 unfused", "rank 1 idle"};
  for (const Layout layout : {kBothFuse, kRank1Unfused, kRank1Idle}) {
    SCOPED_TRACE(names[layout]);
    run([&, layout](int rank) {
      const comm::RankEnv env = comm::RankEnv::from_env();
      auto store = std::make_shared<comm::TcpStore>(comm::TcpStoreOptions::of(env));
      comm::GlooCommunicator gloo(*store);
      const testing::Golden g = testing::load_golden(mc.model);
      const ShardSpec spec = ShardSpec::decode(rank, 2);
      auto model = load_rank_model(mc.model, spec, store);
      model->load_mtp(mc.mtp);
      TANDEM_CHECK(model->mtp_collective(), "rank ", rank, ": the MTP layer is not collective");
      const bool fuses = rank == 0 || layout == kBothFuse;
      std::vector<size_t> mine;
      for (size_t i = 0; i < n && !(rank == 1 && layout == kRank1Idle); ++i) mine.push_back(i);
      const std::string mode = std::string(names[layout]) + ", rank " + std::to_string(rank);
      for (const int64_t k : {3, 2}) {
        for (const double forced : {1.0, -1.0}) {
          const std::string what = mode + ", K " + std::to_string(k) +
                                   (forced >= 0 ? ", every draft accepted" : ", greedy");
          const SpecRun ref = spec_run(*model, gloo, g, mine, k, forced, false);
          const SpecRun got = spec_run(*model, gloo, g, mine, k, forced, fuses);
          TANDEM_CHECK(ref.fused_steps == 0, what, ": the unfused run fused ", ref.fused_steps,
                       " steps");
          if (mine.empty()) continue;
          TANDEM_CHECK(!fuses || got.fused_steps > 0, what, ": no step ran fused");
          TANDEM_CHECK(ref.stats.spec_num_drafts > 0, what, ": no drafts");
          const EngineStats &a = got.stats, &b = ref.stats;
          if (forced >= 0) {
            for (size_t i = 0; i < mine.size(); ++i) {
              TANDEM_CHECK(got.results[i].finished == 1 && ref.results[i].finished == 1, what,
                           " case ", mine[i], ": not finished once");
              TANDEM_CHECK(got.results[i].ids == ref.results[i].ids, what, " case ", mine[i],
                           ": the tokens differ from the unfused run's");
            }
            TANDEM_CHECK(got.drafts == ref.drafts, what, ": the drafts differ (", got.drafts.size(),
                         " drafting steps, unfused ", ref.drafts.size(), ")");
            TANDEM_CHECK(a.spec_num_drafts == b.spec_num_drafts &&
                             a.spec_num_draft_tokens == b.spec_num_draft_tokens &&
                             a.spec_num_accepted_tokens == b.spec_num_accepted_tokens &&
                             a.spec_accepted_per_pos == b.spec_accepted_per_pos,
                         what, ": counters differ: drafts ", a.spec_num_drafts, " / ",
                         b.spec_num_drafts, ", draft tokens ", a.spec_num_draft_tokens, " / ",
                         b.spec_num_draft_tokens, ", accepted ", a.spec_num_accepted_tokens, " / ",
                         b.spec_num_accepted_tokens);
            TANDEM_CHECK(a.spec_num_accepted_tokens > 0, what, ": no draft accepted");
          } else {
            check_greedy(g, mine, ref.results, what + " unfused");
            check_greedy(g, mine, got.results, what + " fused");
            const double x = static_cast<double>(a.spec_num_accepted_tokens),
                         y = static_cast<double>(b.spec_num_accepted_tokens);
            TANDEM_CHECK(std::abs(x - y) <= std::max(2.0, 0.02 * y), what, ": accepted ", x,
                         " fused, ", y, " unfused");
          }
          std::fprintf(stderr, "%s: %lld fused steps, %lld drafts, %lld accepted (unfused %lld)\n",
                       what.c_str(), static_cast<long long>(got.fused_steps),
                       static_cast<long long>(a.spec_num_drafts),
                       static_cast<long long>(a.spec_num_accepted_tokens),
                       static_cast<long long>(b.spec_num_accepted_tokens));
        }
      }
    });
  }
}

// ---- Qwen3.5 hybrid (Qwen35MoeCuda) ------------------------------------------------------

// The qwen35_* golden fixtures whose heads, DeltaNet heads, experts and shared expert split over
// `ranks` (the text one splits its key heads, the vl one replicates its one key head).
std::vector<std::string> hybrid_dirs_for(int ranks) {
  std::vector<std::string> out;
  for (const auto& d : testing::hybrid_golden_dirs()) {
    const ModelConfig c = ModelConfig::from_dir(d);
    try {
      const ShardSpec p = ShardSpec::prefill(0, ranks);
      (void)HybridSlices::of(c, ShardPlan::make(c, p), DeltaNetHeads::of(c, p));
      ShardPlan::make(c, ShardSpec::decode(0, ranks));
    } catch (const Error&) {
      continue;
    }
    out.push_back(d);
  }
  return out;
}

// The whole model on the rank's GPU: the one-GPU reference of the sharded ones.
std::unique_ptr<Qwen35MoeCuda> load_one_gpu(const std::string& dir) {
  return load_rank_model<Qwen35MoeCuda>(dir, ShardSpec::single(), nullptr);
}

// Logits rows got vs want ([rows, vocab]): every value finite, each row's relative L2 error
// into errs; where want's top-2 margin exceeds kMarginBf16 the argmaxes are compared (checked,
// flipped).
struct RowCheck {
  std::vector<double> errs;
  int checked = 0, flipped = 0;
  void add(const std::vector<float>& got, const std::vector<float>& want, int64_t vocab,
           const std::string& what) {
    TANDEM_CHECK(got.size() == want.size(), what, ": ", got.size(), " logits vs ", want.size());
    for (size_t r = 0; r * static_cast<size_t>(vocab) < want.size(); ++r) {
      const float* gr = got.data() + r * static_cast<size_t>(vocab);
      const float* wr = want.data() + r * static_cast<size_t>(vocab);
      double num = 0, den = 0;
      int64_t ga = 0, wa = 0;
      for (int64_t i = 0; i < vocab; ++i) {
        TANDEM_CHECK(std::isfinite(gr[i]), what, " row ", r, ": not finite");
        num += (double(gr[i]) - wr[i]) * (double(gr[i]) - wr[i]);
        den += double(wr[i]) * wr[i];
        if (gr[i] > gr[ga]) ga = i;
        if (wr[i] > wr[wa]) wa = i;
      }
      float second = -INFINITY;
      for (int64_t i = 0; i < vocab; ++i) {
        if (i != wa) second = std::max(second, wr[i]);
      }
      errs.push_back(std::sqrt(num / std::max(den, 1e-30)));
      if (wr[wa] - second > kMarginBf16) {
        ++checked;
        flipped += ga != wa;
      }
    }
  }
  // Median under med_tol, at most flip_share of the argmax checks flipped, some checked.
  void expect(double med_tol, const std::string& what, double flip_share = 0.05) const {
    TANDEM_CHECK(!errs.empty() && checked > 0, what, ": nothing compared");
    std::vector<double> e = errs;
    std::sort(e.begin(), e.end());
    const double med = e[e.size() / 2];
    std::fprintf(stderr,
                 "%s: rows %zu, relative error median %.2e max %.2e, %d argmax, %d flipped\n",
                 what.c_str(), e.size(), med, e.back(), checked, flipped);
    TANDEM_CHECK(med < med_tol, what, ": median relative error ", med);
    TANDEM_CHECK(flipped <= flip_share * checked, what, ": ", flipped, " of ", checked,
                 " argmax checks flipped");
  }
};

// One sequence's logits rows in two chunks (the KV and the DeltaNet state continue) on state
// slot 1 of `kv`.
std::vector<float> two_chunks(Model& m, KvCache& kv, const std::vector<int32_t>& tokens) {
  const auto n = static_cast<int64_t>(tokens.size());
  return cuda_golden::teacher_forced(m, kv, tokens, (n + 1) / 2, 1);
}

// `cases` of g greedy through an engine over a model of this rank alone.
std::vector<Result> run_alone(Model& model, const testing::Golden& g,
                              const std::vector<size_t>& cases) {
  Engine engine(model, rank_engine_config());
  std::vector<Result> results(cases.size());
  for (size_t k = 0; k < cases.size(); ++k) {
    GenRequest r;
    r.id = "r" + std::to_string(cases[k]);
    r.prompt_ids = g.cases[cases[k]].prompt_ids;
    r.max_tokens = g.cases[cases[k]].max_tokens;
    r.sampling.temperature = 0;
    engine.add(r, [&results, k](const StepOutput& out) {
      results[k].ids.insert(results[k].ids.end(), out.token_ids.begin(), out.token_ids.end());
      if (out.finished) ++results[k].finished;
    });
  }
  while (engine.step()) {
  }
  TANDEM_CHECK(engine.blocks().num_available() == engine.blocks().num_pages(), "leaked KV pages");
  return results;
}

// got's tokens are want's at every step up to the first golden margin under kMarginBf16.
void check_same_tokens(const testing::Golden& g, const std::vector<size_t>& cases,
                       const std::vector<Result>& got, const std::vector<Result>& want,
                       const std::string& what) {
  for (size_t k = 0; k < cases.size(); ++k) {
    const auto& c = g.cases[cases[k]];
    for (size_t t = 0; t < c.output_ids.size(); ++t) {
      const auto& top = c.top_logprobs[t];
      if (top.size() < 2 || top[0].logprob - top[1].logprob < kMarginBf16) break;
      TANDEM_CHECK(
          t < got[k].ids.size() && t < want[k].ids.size() && got[k].ids[t] == want[k].ids[t],
          g.name, " ", what, " case ", cases[k], " step ", t, ": ",
          t < got[k].ids.size() ? got[k].ids[t] : -1, ", one GPU ",
          t < want[k].ids.size() ? want[k].ids[t] : -1);
    }
  }
}

class CudaShardedQwen35 : public CudaSharded {};

// Prefill TP=2 (both ranks the same sequence, in two chunks) against the one-GPU model on the
// same rank: the logits rows by the hybrid margin rule; the whole state gathered on the devices
// (gather_state) is, sliced back to each rank's heads, that rank's own part bit for bit (the
// root's copy; each rank is root once), and within tolerance of the one-GPU model's state; the
// same gather left on the device (gather_state_device, what rank 0 sends over CUDA IPC) holds
// it bit for bit on every rank. fp8_layers >= 0: that many layers keep FP8 experts on both.
void prefill_tp2_matches_one_gpu(CudaSharded& t, const std::string& dir, int64_t fp8_layers) {
  t_run(t, [&](int rank) {
    const comm::RankEnv env = comm::RankEnv::from_env();
    auto store = std::make_shared<comm::TcpStore>(comm::TcpStoreOptions::of(env));
    const testing::Golden g = testing::load_golden(dir);
    const ShardSpec spec = ShardSpec::prefill(rank, 2);
    auto tp = load_rank_model<Qwen35MoeCuda>(dir, spec, store);
    auto one = load_one_gpu(dir);
    const ModelConfig& c = one->config();
    if (fp8_layers >= 0) {
      TANDEM_CHECK(tp->fp8_expert_layers() == fp8_layers && one->fp8_expert_layers() == fp8_layers,
                   "FP8 expert layers ", tp->fp8_expert_layers(), " / ", one->fp8_expert_layers(),
                   ", want ", fp8_layers);
    }
    const DeltaNetHeads heads = DeltaNetHeads::of(c, spec);
    const HybridStateLayout full = HybridStateLayout::full(c),
                            part = HybridStateLayout::of(c, heads);
    TANDEM_CHECK(
        tp->state_slot_elems() == part.slot_elems() && one->state_slot_elems() == full.slot_elems(),
        "state slots of ", tp->state_slot_elems(), " / ", one->state_slot_elems(), " floats, want ",
        part.slot_elems(), " / ", full.slot_elems());
    TANDEM_CHECK(
        tp->kv_geometry(4, 16).num_kv_heads == std::max<int64_t>(1, c.num_key_value_heads / 2),
        "KV heads per rank");
    RowCheck rows;
    double state_err = 0;  // the largest relative L2 error of a gathered state, and where
    std::string state_where;
    for (size_t i = 0; i < g.cases.size(); ++i) {
      const std::vector<int32_t> tokens = cuda_golden::teacher_forced_tokens(g.cases[i]);
      const int64_t pages = static_cast<int64_t>(tokens.size()) / 16 + 2;
      KvCache kv_tp = tp->make_kv_cache(pages, 16);
      kv_tp.allocate_states(2, tp->state_slot_elems());
      KvCache kv_one = one->make_kv_cache(pages, 16);
      kv_one.allocate_states(2, one->state_slot_elems());
      const std::vector<float> want = two_chunks(*one, kv_one, tokens);
      const std::vector<float> got = two_chunks(*tp, kv_tp, tokens);  // collective
      const std::string what =
          g.name + " rank " + std::to_string(rank) + " case " + std::to_string(i);
      rows.add(got, want, c.vocab_size, what);
      // The whole state, gathered to each rank in turn.
      const std::span<const float> mine_span = kv_tp.read_state(1);
      const std::vector<float> mine(mine_span.begin(), mine_span.end());
      const std::span<const float> ref_span = kv_one.read_state(1);
      const std::vector<float> ref(ref_span.begin(), ref_span.end());
      std::vector<float> mine_whole;  // gathered with this rank as the root
      for (int root = 0; root < 2; ++root) {
        std::vector<float> whole{1.0f};
        TANDEM_CHECK(tp->gather_state(kv_tp, 1, root, whole), what, ": gather_state declined");
        if (root != rank) {
          TANDEM_CHECK(whole.empty(), what, ": a non-root rank got a state");
          continue;
        }
        TANDEM_CHECK(static_cast<int64_t>(whole.size()) == full.slot_elems(), what, ": ",
                     whole.size(), " floats gathered");
        std::vector<float> back(mine.size(), -1.0f);
        slice_hybrid_state(c, heads, whole.data(), back.data());
        TANDEM_CHECK(back == mine, what, ": the gathered state sliced back differs from the part");
        double num = 0, den = 0;
        for (size_t j = 0; j < ref.size(); ++j) {
          num += (double(whole[j]) - ref[j]) * (double(whole[j]) - ref[j]);
          den += double(ref[j]) * ref[j];
        }
        const double err = std::sqrt(num / std::max(den, 1e-30));
        std::fprintf(stderr, "%s: the gathered state is off the one-GPU one by %.4f\n",
                     what.c_str(), err);
        if (err > state_err) {
          state_err = err;
          state_where = what;
        }
        mine_whole = whole;
      }
      // The same gather left on the device (collective: every rank), equal to the host one.
      const float* dev = tp->gather_state_device(kv_tp, 1);
      TANDEM_CHECK(dev != nullptr && tp->gathers_state_on_device(), what,
                   ": gather_state_device declined");
      std::vector<float> on_dev(mine_whole.size());
      TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
      TANDEM_CUDA_CHECK(
          cudaMemcpy(on_dev.data(), dev, on_dev.size() * sizeof(float), cudaMemcpyDeviceToHost));
      TANDEM_CHECK(!on_dev.empty() && on_dev == mine_whole, what,
                   ": the state gathered on the device differs");
    }
    // FP8 experts with FP8 activations (W8A8, the default): each rank's residual stream differs
    // from the one-GPU model's by the all-reduce's bf16 rounding, and the per-token E4M3
    // quantization of the experts' inputs magnifies it: the W8A8 tolerances of the golden
    // tests (cuda_golden_util.h), twice the flips.
    const bool w8a8 = fp8_layers > 0 && tp->fp8_activations();
    rows.expect(w8a8 ? cuda_golden::kMedianTolW8A8 : 2.5e-2,
                g.name + " prefill TP rank " + std::to_string(rank), w8a8 ? 0.1 : 0.05);
    // The state against the one-GPU model's, after the logits (both reported). The recurrent
    // state integrates every token's k / v through the layers, so a reduction order's bf16
    // rounding (and a routing near-tie it flips) stays in it: bf16 within 5%; the FP8 model
    // within 8% (0.0508 measured on qwen35_vl_hd256_int4_tied_bf16 on an H100, whose experts
    // are FP8 under TP=2, while its logits pass the same row check as bf16). A wrong slice or
    // a missing head is off by O(1).
    // With FP8 activations (W8A8) the experts' inputs are rounded to E4M3 on top: 12%.
    const double tol = w8a8 ? 0.12 : fp8_layers >= 0 ? 8e-2 : 5e-2;
    TANDEM_CHECK(state_err < tol, state_where, ": the gathered state is off the one-GPU one by ",
                 state_err, " (tolerance ", tol, ")");
  });
}

TEST_P(CudaShardedQwen35, PrefillTp2LogitsAndStateMatchOneGpu) {
  prefill_tp2_matches_one_gpu(*this, GetParam(), -1);
}

// Decode DP=2 / EP=2 (each rank its own cases; then rank 1 idle, its zero-token steps serving
// its experts): every rank's tokens are the one-GPU model's and the golden ones by the margin
// rule; its decode steps ran graphs.
// golden_tokens: the tokens against the golden (transformers) ones too.
void decode_dp2_matches_one_gpu(CudaSharded& t, const std::string& dir, bool golden_tokens) {
  const size_t n = testing::load_golden(dir).cases.size();
  for (const bool idle : {false, true}) {
    SCOPED_TRACE(idle ? "rank 1 idle" : "both ranks");
    t_run(t, [&](int rank) {
      std::vector<size_t> mine;
      for (size_t i = 0; i < n; ++i) {
        if (idle ? rank == 0 : i % 2 == static_cast<size_t>(rank)) mine.push_back(i);
      }
      int compared = 0;
      std::vector<Result> got;
      run_rank<Qwen35MoeCuda>(dir, ShardSpec::decode(rank, 2), mine, &compared, "", 0, &got,
                              /*fused=*/true, golden_tokens);
      const testing::Golden g = testing::load_golden(dir);
      auto one = load_one_gpu(dir);
      check_same_tokens(g, mine, got, run_alone(*one, g, mine),
                        "decode EP rank " + std::to_string(rank));
      TANDEM_CHECK(!golden_tokens || !idle || rank != 0 || compared > 0,
                   "no step with a margin over ", kMarginBf16);
    });
  }
}

TEST_P(CudaShardedQwen35, DecodeDp2Ep2TokensMatchOneGpu) {
  decode_dp2_matches_one_gpu(*this, GetParam(), true);
}

// Block FP8 in Qwen's -FP8 layout: the fixture through `tandem convert` (in the parent, on the
// CPU; the golden prompts copied beside it). The routed experts stay FP8 on the device (every
// layer where they are stored one tensor per expert; fused 3D ones stay as stored) and so do the
// dense linears, each rank reading its own rows / columns: prefill TP=2 and decode DP=2 / EP=2
// match the one-GPU FP8 model by the same rules (not the bf16 golden tokens).
class CudaShardedQwen35Fp8 : public CudaSharded {
 protected:
  void SetUp() override {
    CudaSharded::SetUp();
    if (IsSkipped()) return;
    fp8_ = cuda_golden::fp8_fixture_copy(GetParam(), "tandem_q35fp8");
    const ModelConfig c = ModelConfig::from_dir(fp8_);
    const Checkpoint ck(fp8_);
    layers_ =
        ck.has(c.weight_prefix + "layers.0.mlp.experts.gate_up_proj") ? 0 : c.num_hidden_layers;
  }
  void TearDown() override {
    if (!fp8_.empty()) std::filesystem::remove_all(fp8_);
  }
  std::string fp8_;
  int64_t layers_ = 0;
};

TEST_P(CudaShardedQwen35Fp8, PrefillTp2LogitsAndStateMatchOneGpu) {
  prefill_tp2_matches_one_gpu(*this, fp8_, layers_);
}

TEST_P(CudaShardedQwen35Fp8, DecodeDp2Ep2TokensMatchOneGpu) {
  decode_dp2_matches_one_gpu(*this, fp8_, false);
}

// Qwen3.5's MTP layer on decode EP ranks (random MTP weights in the published layout, written
// by the parent for each fixture).
class CudaShardedQwen35Mtp : public CudaSharded {
 protected:
  void SetUp() override {
    CudaSharded::SetUp();
    if (IsSkipped()) return;
    mtp_ = (std::filesystem::temp_directory_path() /
            ("tandem_q35mtp_ep_" + std::to_string(::getpid())))
               .string();
    testing::write_random_mtp(GetParam(), mtp_, 11);
  }
  void TearDown() override {
    if (!mtp_.empty()) std::filesystem::remove_all(mtp_);
  }
  std::string mtp_;
};

// One MTP pass of an EP rank (its MTP experts E / 2, through the exchange) against the one-GPU
// model's over the same hidden states and tokens: round 1 both ranks run a case, round 2 rank 1
// an empty pass (its experts serve rank 0's tokens).
TEST_P(CudaShardedQwen35Mtp, MtpPassMatchesOneGpu) {
  const std::string dir = GetParam(), mtp = mtp_;
  run([&](int rank) {
    const comm::RankEnv env = comm::RankEnv::from_env();
    auto store = std::make_shared<comm::TcpStore>(comm::TcpStoreOptions::of(env));
    const testing::Golden g = testing::load_golden(dir);
    auto ep = load_rank_model<Qwen35MoeCuda>(dir, ShardSpec::decode(rank, 2), store);
    ep->load_mtp(mtp);
    TANDEM_CHECK(ep->mtp_collective(), "rank ", rank, ": the MTP layer is not collective");
    auto one = load_one_gpu(dir);
    one->load_mtp(mtp);
    TANDEM_CHECK(!one->mtp_collective(), "the one-GPU MTP layer is collective");
    const ModelConfig& c = one->config();
    RowCheck rows;
    for (int round = 0; round < 2; ++round) {
      const bool empty = round == 1 && rank == 1;
      const auto& gc = g.cases[static_cast<size_t>(round == 0 ? rank : 0) % g.cases.size()];
      std::vector<int32_t> tokens = gc.prompt_ids;
      tokens.insert(tokens.end(), gc.output_ids.begin(), gc.output_ids.end());
      const auto n = static_cast<int64_t>(tokens.size()) - 1;
      const int64_t pages = n / 16 + 2;
      std::vector<int32_t> table(static_cast<size_t>(pages));
      for (int64_t p = 0; p < pages; ++p) table[static_cast<size_t>(p)] = int32_t(pages - 1 - p);
      KvCache kv = one->make_kv_cache(pages, 16);
      kv.allocate_states(1, one->state_slot_elems());
      std::vector<float> hidden, logits;
      ForwardBatch tb;
      tb.seqs.push_back({tokens.data(), n, 0, table.data(), pages, LogitsMode::kLast, 0});
      tb.hidden_out = &hidden;
      one->forward(tb, kv, logits);
      KvCache one_mkv = one->make_mtp_kv_cache(pages, 16);
      KvCache ep_mkv = ep->make_mtp_kv_cache(pages, 16);
      ForwardBatch mb;
      if (!empty) {
        mb.seqs.push_back({tokens.data() + 1, n, 0, table.data(), pages, LogitsMode::kAll});
      }
      std::vector<float> want, got, hw, hg;
      ep->mtp_forward(mb, hidden.data(), ep_mkv, got, hg);  // collective
      if (empty) {
        TANDEM_CHECK(got.empty() && hg.empty(), "an empty pass returned rows");
        continue;
      }
      one->mtp_forward(mb, hidden.data(), one_mkv, want, hw);
      rows.add(got, want, c.vocab_size, g.name + " rank " + std::to_string(rank));
    }
    rows.expect(1.5e-2, g.name + " MTP pass, EP rank " + std::to_string(rank));
  });
}

// Speculating decode EP ranks (K collective MTP passes a step): greedy tokens by the margin rule
// against the golden continuation; K = 2 with the fused step (forward_verify_draft on an EP
// rank: the verify graph, the state settle, K exchanges), with both ranks busy and with rank 1
// idle (its K empty passes a step), then K = 3 unfused (set_fused_step(false): the draft chain).
TEST_P(CudaShardedQwen35Mtp, DecodeDp2SpeculatingGreedyMatchesTransformers) {
  const std::string dir = GetParam(), mtp = mtp_;
  const size_t n = testing::load_golden(dir).cases.size();
  struct Layout {
    int64_t k;
    bool idle, fused;
  };
  for (const Layout l : {Layout{2, false, true}, Layout{2, true, true}, Layout{3, false, false}}) {
    SCOPED_TRACE("K " + std::to_string(l.k) + (l.idle ? ", rank 1 idle" : ", both ranks") +
                 (l.fused ? ", fused" : ", unfused"));
    run([&](int rank) {
      std::vector<size_t> mine;
      for (size_t i = 0; i < n; ++i) {
        if (!l.idle || rank == 0) mine.push_back(i);
      }
      int compared = 0;
      run_rank<Qwen35MoeCuda>(dir, ShardSpec::decode(rank, 2), mine, &compared, mtp, l.k, nullptr,
                              l.fused);
      TANDEM_CHECK(mine.empty() || compared > 0, "no step with a margin over ", kMarginBf16);
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaShardedQwen35, ::testing::ValuesIn(hybrid_dirs_for(2)),
                         [](const auto& info) {
                           return std::filesystem::path(info.param).filename().string();
                         });
INSTANTIATE_TEST_SUITE_P(Fixtures, CudaShardedQwen35Fp8, ::testing::ValuesIn(hybrid_dirs_for(2)),
                         [](const auto& info) {
                           return std::filesystem::path(info.param).filename().string();
                         });
INSTANTIATE_TEST_SUITE_P(Fixtures, CudaShardedQwen35Mtp, ::testing::ValuesIn(hybrid_dirs_for(2)),
                         [](const auto& info) {
                           return std::filesystem::path(info.param).filename().string();
                         });

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaSharded, ::testing::ValuesIn(dirs_for(2)),
                         [](const auto& info) {
                           std::string s = std::filesystem::path(info.param).filename().string();
                           for (char& ch : s) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return s;
                         });

}  // namespace
}  // namespace tandem
