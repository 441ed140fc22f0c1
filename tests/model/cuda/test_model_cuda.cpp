// The CUDA model against the CPU reference model and the transformers golden fixtures.
//
// bf16 weights, activations and KV on the GPU vs fp32 on the CPU: logits agree to bf16
// accuracy, not bit for bit. A routing decision whose top-k gap is below bf16's resolution can
// flip (another expert for that token), which moves a few rows by several percent; a bug moves
// most rows. So
//  - teacher-forced logits (every position of prompt + golden output) are compared row by row
//    with the CPU model's: the relative L2 error of the rows must have median under
//    kMedianTol, 95th percentile under kP95Tol and maximum under kMaxTol, and the argmax must
//    agree wherever the CPU's top1-top2 margin exceeds kMarginBf16;
//  - greedy generation through the engine (alone, batched, chunked, graphs on and off) must
//    reproduce the golden tokens at every step up to the first one whose golden top1-top2
//    margin is under kMarginBf16 (after that a bf16 engine may legitimately diverge), with the
//    chosen token's logprob within kLogprobTol (ranks 2-5 within kLowerRankTol); each
//    fixture must compare at least one step. Sampling runs on the GPU (and, in one mode, on
//    the host from copied logits).
// Fixtures whose shapes the GPU kernels do not cover (head_dim 8 / 16 / 32) must be refused at
// load with an error naming config.json and the field (checked without a GPU too).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "model/config.h"
#include "model/cuda/cuda_golden_util.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/cuda/runner.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

using namespace cuda_golden;  // NOLINT: the shared rule (cuda_golden_util.h)

bool gpu_shapes(const ModelConfig& c) { return c.head_dim == 64 || c.head_dim == 128; }

// The golden fixtures the GPU kernels cover, and the block-FP8 ones (tests/data/fixtures_fp8:
// dequantized to bf16 at load, as the CPU model dequantizes them to fp32).
std::vector<std::string> supported_dirs() {
  std::vector<std::string> out;
  for (const auto& d : testing::golden_dirs()) {
    if (gpu_shapes(ModelConfig::from_dir(d))) out.push_back(d);
  }
  namespace fs = std::filesystem;
  std::vector<std::string> fp8;
  for (const auto& e : fs::directory_iterator(testing::source_dir() + "/tests/data/fixtures_fp8")) {
    if (fs::exists(e.path() / "golden.json")) fp8.push_back(e.path().string());
  }
  std::sort(fp8.begin(), fp8.end());
  out.insert(out.end(), fp8.begin(), fp8.end());
  return out;
}

TEST(CudaModelConfig, UnsupportedShapesAreRefusedNamingTheField) {
  int refused = 0;
  for (const auto& d : testing::golden_dirs()) {
    const ModelConfig c = ModelConfig::from_dir(d);
    if (gpu_shapes(c)) {
      EXPECT_NO_THROW(check_cuda_model_config(c, d + "/config.json")) << d;
      continue;
    }
    try {
      check_cuda_model_config(c, d + "/config.json");
      ADD_FAILURE() << d << ": head_dim " << c.head_dim << " accepted";
    } catch (const Error& e) {
      ++refused;
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
      const std::string what = e.what();
      EXPECT_NE(what.find("config.json"), std::string::npos) << what;
      EXPECT_NE(what.find("head_dim " + std::to_string(c.head_dim)), std::string::npos) << what;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GE(supported_dirs().size(), 3u);
}

// The CUDA MoE kernels' limits (backend/cuda/moe.h): Qwen3.5-397B-A17B's 512 experts / top-10
// and up to 512 / 16 pass, one more expert or one more slot is refused naming the field.
TEST(CudaModelConfig, MoeLimitsAreRefusedNamingTheField) {
  const auto dirs = supported_dirs();
  ASSERT_FALSE(dirs.empty());
  ModelConfig c = ModelConfig::from_dir(dirs.front());
  bool any_moe = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) any_moe |= c.is_moe_layer(l);
  ASSERT_TRUE(any_moe) << dirs.front();
  for (const auto& [experts, top_k] : {std::pair<int64_t, int64_t>{512, 10}, {512, 16}, {128, 8}}) {
    c.num_experts = experts;
    c.num_experts_per_tok = top_k;
    EXPECT_NO_THROW(check_cuda_model_config(c, "x/config.json")) << experts << " / " << top_k;
  }
  struct Bad {
    int64_t experts, top_k;
    std::string field;
  };
  for (const Bad& b : {Bad{513, 10, "num_experts 513"}, Bad{1024, 8, "num_experts 1024"},
                       Bad{512, 17, "num_experts_per_tok 17"}}) {
    c.num_experts = b.experts;
    c.num_experts_per_tok = b.top_k;
    try {
      check_cuda_model_config(c, "x/config.json");
      ADD_FAILURE() << b.field << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
      const std::string what = e.what();
      EXPECT_NE(what.find("x/config.json: " + b.field), std::string::npos) << what;
      EXPECT_NE(what.find("at most"), std::string::npos) << what;
    }
  }
}

// The decode graphs' batch buckets (host logic, no GPU): every bucket up to --max-num-seqs, the
// largest min(max_seqs, 512) itself, so that a full batch pads nothing and batches above 512 run
// eagerly.
TEST(CudaRunnerBuckets, UpToMaxSeqsCappedAt512) {
  using cuda_model::graph_buckets;
  EXPECT_EQ(graph_buckets(1), (std::vector<int64_t>{1}));
  EXPECT_EQ(graph_buckets(8), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(graph_buckets(10), (std::vector<int64_t>{1, 2, 4, 8, 10}));
  const std::vector<int64_t> b300 = graph_buckets(300);
  ASSERT_GE(b300.size(), 3u);
  EXPECT_EQ(b300[b300.size() - 3], 256);
  EXPECT_EQ(b300[b300.size() - 2], 288);
  EXPECT_EQ(b300.back(), 300);
  const std::vector<int64_t> b320 = graph_buckets(320);
  EXPECT_EQ(b320.back(), 320);
  EXPECT_EQ(b320[b320.size() - 2], 288);
  for (const int64_t max_seqs : {512, 600, 1024}) {
    const std::vector<int64_t> b = graph_buckets(max_seqs);
    EXPECT_EQ(b.back(), cuda_model::kMaxGraphBatch) << max_seqs;
    EXPECT_TRUE(std::is_sorted(b.begin(), b.end())) << max_seqs;
    EXPECT_EQ(std::adjacent_find(b.begin(), b.end()), b.end()) << max_seqs;
    // Above 256 a replay pads a batch by at most 20%.
    for (size_t i = 1; i < b.size(); ++i) {
      if (b[i - 1] >= 256) {
        EXPECT_LE(b[i], b[i - 1] * 6 / 5) << b[i - 1] << " -> " << b[i];
      }
    }
  }
}

// --gpu-memory-utilization: the KV budget is what is free beyond the share left unused.
TEST(CudaModelConfig, KvCacheBudgetFromGpuMemory) {
  constexpr size_t kGiB = size_t{1} << 30;
  EXPECT_EQ(kv_cache_mb_for(80 * kGiB, 140 * kGiB, 0.9), (80 * 1024) - (14 * 1024));
  EXPECT_EQ(kv_cache_mb_for(80 * kGiB, 140 * kGiB, 1.0), 80 * 1024);
  EXPECT_EQ(kv_cache_mb_for(10 * kGiB, 140 * kGiB, 0.9), 64);  // less free than kept: the floor
  for (double bad : {0.0, -0.5, 1.5}) {
    try {
      kv_cache_mb_for(80 * kGiB, 140 * kGiB, bad);
      ADD_FAILURE() << "utilization " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("--gpu-memory-utilization"), std::string::npos);
    }
  }
}

class CudaGolden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(CudaGolden, TeacherForcedLogitsMatchTheCpuModel) {
  const std::string dir = GetParam();
  const testing::Golden g = testing::load_golden(dir);
  auto cpu = Qwen3MoeCpu::load(dir);
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  o.page_size = 4;
  auto gpu = Qwen3MoeCuda::load(dir, o);
  const int64_t vocab = cpu->config().vocab_size;
  std::vector<double> errs;
  int checked = 0;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    const auto& c = g.cases[i];
    const std::vector<int32_t> tokens = teacher_forced_tokens(c);
    const int64_t pages = static_cast<int64_t>(tokens.size()) / 4 + 2;
    KvCache cpu_kv(cpu->kv_geometry(pages, 4));
    KvCache gpu_kv = gpu->make_kv_cache(pages, 4);
    const auto want = teacher_forced(*cpu, cpu_kv, tokens, 1 << 20);
    const auto got = teacher_forced(*gpu, gpu_kv, tokens, 1 << 20);
    checked += compare_rows(got, want, vocab, g.name + " case " + std::to_string(i), errs);
    // Chunks of 7 tokens over 4-token pages: a chunk continues a cached prefix mid-page.
    KvCache gpu_kv2 = gpu->make_kv_cache(pages, 4);
    const auto chunked = teacher_forced(*gpu, gpu_kv2, tokens, 7);
    checked +=
        compare_rows(chunked, want, vocab, g.name + " chunked case " + std::to_string(i), errs);
  }
  const auto [med, p95, worst] = error_quantiles(errs);
  std::printf(
      "[ %s ] teacher-forced rows %zu: relative error median %.2e p95 %.2e max %.2e, "
      "%d argmax checks%s\n",
      g.name.c_str(), errs.size(), med, p95, worst, checked,
      gpu->fp8_activations() ? " (W8A8)" : "");
  const bool w8a8 = gpu->fp8_activations();
  EXPECT_LT(med, w8a8 ? kMedianTolW8A8 : kMedianTol);
  EXPECT_LT(p95, w8a8 ? kP95TolW8A8 : kP95Tol);
  EXPECT_LT(worst, w8a8 ? kMaxTolW8A8 : kMaxTol);
  EXPECT_GT(checked, 0);
}

TEST_P(CudaGolden, GreedyMatchesTransformers) {
  const std::string dir = GetParam();
  const testing::Golden g = testing::load_golden(dir);
  struct Mode {
    const char* name;
    bool graphs, together;
    int64_t budget, page;
    bool host_sampling = false;
  };
  const Mode modes[] = {{"alone+graphs", true, false, 1024, 16},
                        {"batched+graphs", true, true, 1024, 16},
                        {"chunked+graphs", true, true, 7, 4},
                        {"batched eager", false, true, 1024, 16},
                        {"batched+graphs, host sampling", true, true, 1024, 16, true}};
  for (const Mode& m : modes) {
    CudaModelOptions o;
    o.max_tokens = m.budget;
    o.max_seqs = 8;
    o.page_size = m.page;
    o.cuda_graphs = m.graphs;
    auto gpu = Qwen3MoeCuda::load(dir, o);
    EngineConfig cfg;
    cfg.max_num_seqs = 8;
    cfg.max_batched_tokens = m.budget;
    cfg.page_size = m.page;
    cfg.kv_cache_mb = 64;
    HostSampled host(*gpu);
    Model& model = m.host_sampling ? static_cast<Model&>(host) : *gpu;
    const auto results = run_engine(model, g.cases, cfg, m.together);
    const int compared =
        compare_greedy(g, results, m.name, /*lower_ranks=*/true, gpu->fp8_activations());
    EXPECT_GT(compared, 0) << g.name << " " << m.name << ": no step with a margin over "
                           << kMarginBf16;
    if (m.graphs) {
      EXPECT_FALSE(gpu->captured_buckets().empty()) << "no decode step ran a graph";
    }
    std::printf("[ %s ] %s: %d greedy steps compared\n", g.name.c_str(), m.name, compared);
  }
}

TEST_P(CudaGolden, BadInputsThrowWithoutPoisoningTheModel) {
  const std::string dir = GetParam();
  CudaModelOptions o;
  o.max_tokens = 64;
  o.max_seqs = 4;
  auto gpu = Qwen3MoeCuda::load(dir, o);
  KvCache kv = gpu->make_kv_cache(16, 16);
  std::vector<int32_t> table = {3};
  std::vector<int32_t> bad = {1, static_cast<int32_t>(gpu->config().vocab_size)};
  ForwardBatch b;
  b.seqs.push_back({bad.data(), 2, 0, table.data(), 1, LogitsMode::kLast});
  std::vector<float> logits;
  try {
    gpu->forward(b, kv, logits);
    ADD_FAILURE() << "out-of-range token id accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  }
  std::vector<int32_t> long_tokens(65, 1);
  std::vector<int32_t> table5 = {0, 1, 2, 3, 4};
  ForwardBatch b2;
  b2.seqs.push_back({long_tokens.data(), 65, 0, table5.data(), 5, LogitsMode::kLast});
  EXPECT_THROW(gpu->forward(b2, kv, logits), Error);
  const ModelConfig& c = gpu->config();
  KvCache host(KvGeometry{c.num_hidden_layers, 4, c.num_key_value_heads, 16, c.head_dim});
  std::vector<int32_t> ok = {1, 2};
  ForwardBatch b3;
  b3.seqs.push_back({ok.data(), 2, 0, table.data(), 1, LogitsMode::kLast});
  EXPECT_THROW(gpu->forward(b3, host, logits), Error);
  // The model still works after the errors.
  gpu->forward(b3, kv, logits);
  ASSERT_EQ(static_cast<int64_t>(logits.size()), gpu->config().vocab_size);
  for (float v : logits) ASSERT_TRUE(std::isfinite(v));
}

// Decode batches above 256 replay graphs (cuda_golden_util.h).
TEST_P(CudaGolden, DecodeGraphsAboveBatch256MatchEager) {
  expect_decode_graphs_above_256_match_eager<Qwen3MoeCuda>(GetParam());
}

// Seeded sampling on the GPU is reproducible; penalties (host path) and sampling (device path)
// mix in one batch.
TEST_P(CudaGolden, SeededSamplingRepeatsAndPenaltiesMix) {
  const std::string dir = GetParam();
  const testing::Golden g = testing::load_golden(dir);
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  auto gpu = Qwen3MoeCuda::load(dir, o);
  EngineConfig cfg;
  cfg.max_num_seqs = 8;
  cfg.kv_cache_mb = 64;
  auto run = [&](bool with_penalty) {
    Engine engine(*gpu, cfg);
    std::vector<std::vector<int32_t>> ids(3);
    for (int i = 0; i < 3; ++i) {
      GenRequest r;
      r.id = "s" + std::to_string(i);
      r.prompt_ids = g.cases[0].prompt_ids;
      r.max_tokens = 16;
      r.ignore_eos = true;
      r.sampling.temperature = 0.8f;
      r.sampling.top_p = 0.9f;
      r.sampling.top_k = i == 2 ? 5 : 0;
      r.sampling.seed = 1234 + static_cast<uint64_t>(i);
      r.sampling.logprobs = 2;
      if (with_penalty && i == 1) r.sampling.repetition_penalty = 1.3f;
      engine.add(r, [&ids, i](const StepOutput& out) {
        EXPECT_TRUE(out.error.empty()) << out.error;
        ids[static_cast<size_t>(i)].insert(ids[static_cast<size_t>(i)].end(), out.token_ids.begin(),
                                           out.token_ids.end());
      });
    }
    while (engine.step()) {
    }
    EXPECT_EQ(engine.blocks().num_available(), engine.blocks().num_pages());
    return ids;
  };
  const auto a = run(false), b = run(false), c = run(true);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(a[static_cast<size_t>(i)].size(), 16u);
    EXPECT_EQ(a[static_cast<size_t>(i)], b[static_cast<size_t>(i)]) << "seeded request " << i;
    for (int32_t id : c[static_cast<size_t>(i)]) {
      EXPECT_TRUE(id >= 0 && id < gpu->config().vocab_size);
    }
  }
}

// Block FP8 kept FP8 on the device (the default) against the same checkpoint dequantized to
// bf16 at load (CudaModelOptions::fp8_weights false): every quantized linear stays FP8 (half the
// bytes), and the teacher-forced logits agree as two bf16 models do (whole prompts: the FP8
// grouped GEMM for the dense linears; chunks of 7 and 1 tokens: the FP8 gemv and the decode MoE
// path). The golden tests above run the FP8 model against the CPU and transformers.
TEST(CudaFp8, KeepsFp8AndMatchesTheDequantizedModel) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = testing::source_dir() + "/tests/data/fixtures_fp8/hub_fp8_block128";
  const testing::Golden g = testing::load_golden(dir);
  CudaModelOptions o;
  o.max_tokens = 512;
  o.max_seqs = 8;
  o.page_size = 4;
  // W8A8 (the default) and W8A16 (TANDEM_CUDA_FP8_ACT=0: bf16 activations, the dequantized
  // numerics, so the bf16 bounds hold).
  auto fp8 = Qwen3MoeCuda::load(dir, o);
  setenv("TANDEM_CUDA_FP8_ACT", "0", 1);
  auto w8a16 = Qwen3MoeCuda::load(dir, o);
  unsetenv("TANDEM_CUDA_FP8_ACT");
  EXPECT_TRUE(fp8->fp8_activations());
  EXPECT_FALSE(w8a16->fp8_activations());
  o.fp8_weights = false;
  auto bf16 = Qwen3MoeCuda::load(dir, o);
  const ModelConfig& c = fp8->config();
  // qkv, o, gate_up and down of every layer (the experts of a layer count once per GEMM) but
  // the fixture's modules_to_not_convert (layer 2's o_proj stays bf16).
  EXPECT_EQ(fp8->fp8_linears(), 4 * c.num_hidden_layers - 1);
  EXPECT_EQ(w8a16->fp8_linears(), 4 * c.num_hidden_layers - 1);
  EXPECT_EQ(bf16->fp8_linears(), 0);
  EXPECT_LT(fp8->weight_bytes(), bf16->weight_bytes());
  for (Qwen3MoeCuda* m : {fp8.get(), w8a16.get()}) {
    const bool w8a8 = m->fp8_activations();
    std::vector<double> errs;
    int checked = 0;
    for (size_t i = 0; i < g.cases.size(); ++i) {
      const auto& cs = g.cases[i];
      const std::vector<int32_t> tokens = teacher_forced_tokens(cs);
      const int64_t pages = static_cast<int64_t>(tokens.size()) / 4 + 2;
      for (const int64_t chunk : {int64_t{1} << 20, int64_t{7}, int64_t{1}}) {
        KvCache kv8 = m->make_kv_cache(pages, 4), kv16 = bf16->make_kv_cache(pages, 4);
        const auto got = teacher_forced(*m, kv8, tokens, chunk);
        const auto want = teacher_forced(*bf16, kv16, tokens, chunk);
        checked +=
            compare_rows(got, want, c.vocab_size,
                         "case " + std::to_string(i) + " chunk " + std::to_string(chunk), errs);
      }
    }
    const auto [med, p95, worst] = error_quantiles(errs);
    std::printf(
        "[ fp8 %s vs dequantized ] rows %zu: relative error median %.2e p95 %.2e max %.2e\n",
        w8a8 ? "W8A8" : "W8A16", errs.size(), med, p95, worst);
    EXPECT_LT(med, w8a8 ? kMedianTolW8A8 : kMedianTol);
    EXPECT_LT(p95, w8a8 ? kP95TolW8A8 : kP95Tol);
    EXPECT_LT(worst, w8a8 ? kMaxTolW8A8 : kMaxTol);
    EXPECT_GT(checked, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaGolden, ::testing::ValuesIn(supported_dirs()),
                         fixture_test_name);

}  // namespace
}  // namespace tandem
