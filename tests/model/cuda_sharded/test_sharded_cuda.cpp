// The sharded CUDA model, ranks as processes sharing this machine's GPU(s) (TANDEM_ALLOW_SHARED_
// GPU: CUDA IPC works between processes on one device): greedy generation of every GPU-shaped
// golden fixture through the engine on
//  - prefill TP=2 / EP=2: both ranks run the same requests in lockstep (heads and experts
//    split, o_proj and MoE all-reduced, vocab-parallel lm_head);
//  - decode DP=2 / EP=2: each rank its own requests (or none: zero-token steps), the MoE block
//    by our dispatch / combine inside the decode CUDA graphs;
// must reproduce the transformers tokens by the margin rule of the single-GPU golden tests
// (every step up to the first whose golden top1-top2 margin is under 0.5), and leak no page.
// Every CUDA call runs in the forked ranks (never in this process); skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "comm/gloo_comm.h"
#include "comm/local_launcher.h"
#include "comm/tcp_store.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "engine/mtp_weights.h"
#include "model/cuda/mtp_cuda.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/qwen3_moe.h"
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

// The rank's sharded model of `dir` on its GPU (the ranks share the machine's GPUs).
std::unique_ptr<Qwen3MoeCuda> load_rank_model(const std::string& dir, const ShardSpec& spec,
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
  return Qwen3MoeCuda::load(dir, o);
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
void run_rank(const std::string& dir, const ShardSpec& spec, const std::vector<size_t>& cases,
              int* compared, const std::string& mtp = "", int64_t k = 0) {
  const comm::RankEnv env = comm::RankEnv::from_env();
  auto store = std::make_shared<comm::TcpStore>(comm::TcpStoreOptions::of(env));
  comm::GlooCommunicator gloo(*store);
  const testing::Golden g = testing::load_golden(dir);
  auto model = load_rank_model(dir, spec, store);
  EngineConfig cfg = rank_engine_config();
  if (!mtp.empty()) {
    model->load_mtp(mtp);
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
  *compared = check_greedy(g, cases, results, mode);
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
}

class CudaSharded : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (visible_gpus() == 0) GTEST_SKIP() << "no CUDA device";
    ::setenv("TANDEM_ALLOW_SHARED_GPU", "1", 1);
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  }
  void run(const std::function<void(int)>& body) {
    auto results = comm::run_local_ranks(2, body, std::chrono::seconds(300));
    EXPECT_EQ(comm::describe_failures(results), "");
  }
};

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
// (TANDEM_SPEC_FUSED=0): its tokens, drafts by request and tokens so far, counters and fused
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
  if (fused) {
    ::unsetenv("TANDEM_SPEC_FUSED");
  } else {
    ::setenv("TANDEM_SPEC_FUSED", "0", 1);
  }
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
  ::unsetenv("TANDEM_SPEC_FUSED");
  run.fused_steps = model.fused_steps() - fused_before;
  return run;
}

// Decode EP ranks running the fused speculative step (MtpCuda::draft_after_verify on a
// collective MTP layer: the verify, pass 0 over every verify position and K - 1 chained passes,
// K exchanges, one synchronisation) against the unfused path (TANDEM_SPEC_FUSED=0: the verify,
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
