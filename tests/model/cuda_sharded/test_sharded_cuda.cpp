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

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "comm/gloo_comm.h"
#include "comm/local_launcher.h"
#include "comm/tcp_store.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "model/cuda/qwen3_moe_cuda.h"
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

// One rank: the sharded model, an engine over `cases`, steps in lockstep with the group until
// no rank has work (prefill TP: every rank the same cases).
void run_rank(const std::string& dir, const ShardSpec& spec, const std::vector<size_t>& cases,
              int* compared) {
  const comm::RankEnv env = comm::RankEnv::from_env();
  auto store = std::make_shared<comm::TcpStore>(comm::TcpStoreOptions::of(env));
  comm::GlooCommunicator gloo(*store);
  const testing::Golden g = testing::load_golden(dir);
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  o.page_size = 16;
  o.shard = spec;
  o.store = store;
  int gpus = 0;
  TANDEM_CHECK(cudaGetDeviceCount(&gpus) == cudaSuccess && gpus > 0, "no GPU in the rank");
  o.device = env.local_rank % gpus;
  auto model = Qwen3MoeCuda::load(dir, o);
  EngineConfig cfg;
  cfg.max_num_seqs = 8;
  cfg.max_batched_tokens = 512;
  cfg.kv_cache_mb = 64;
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
  TANDEM_CHECK(engine.blocks().num_available() == engine.blocks().num_pages(), "leaked KV pages");
  const std::string mode =
      std::string(shard_mode_name(spec.mode)) + " rank " + std::to_string(spec.rank);
  *compared = check_greedy(g, cases, results, mode);
  if (spec.mode == ShardMode::kDecodeDpEp && !cases.empty()) {
    TANDEM_CHECK(!model->captured_buckets().empty(), mode, ": no decode step ran a graph");
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
