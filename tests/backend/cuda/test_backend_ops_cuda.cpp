// Every case of the kernel-test harness (tests/backend/cuda/ops/backend_ops.h) as its own
// parameterised test, Cuda/BackendOps.Check/<Op>_<shape>: select by op or shape with
// --gtest_filter (e.g. '*/RmsNorm_*', '*Gemv_m1_*'). Each run draws a fresh seed, printed on
// failure with the case; --gtest_random_seed=N runs with seed N instead (to reproduce a failure).
// Every GPU test skips (GTEST_SKIP) when no CUDA device is visible: CI has none.
//
// Below them, the checks that are not one op on one set of inputs: the rejects-unsupported
// checks, the split pick (host only), GemmLt's plan cache, and the router -> permute ->
// unpermute step replayed in a CUDA graph.
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/norm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "ops/backend_ops.h"

namespace tandem::cuda {
namespace {

using backend_ops::CaseInfo;
using backend_ops::registry;
using test_util::Bits;
using test_util::DeviceBuffer;
using test_util::gpu_available;
using test_util::rel_err;
using test_util::to_bf16;
using test_util::to_f32;

// ------------------------------------------------------------------------------ the cases

class BackendOps : public ::testing::TestWithParam<size_t> {};

TEST_P(BackendOps, Check) {
  CaseInfo const& info = registry()[GetParam()];
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const int32_t flag = GTEST_FLAG_GET(random_seed);
  const uint32_t seed =
      flag != 0 ? static_cast<uint32_t>(flag) : (std::random_device{}() & 0x7fffffffu) | 1u;
  cudaStream_t stream = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamCreate(&stream));
  std::unique_ptr<backend_ops::OpCase> c = info.make();
  const backend_ops::CheckResult r = backend_ops::check_case(*c, seed, stream);
  c.reset();
  (void)cudaStreamDestroy(stream);
  for (std::string const& f : r.failures) {
    ADD_FAILURE() << info.op << " " << info.shape << ", seed " << seed
                  << " (--gtest_random_seed=" << seed << "): " << f;
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, BackendOps, ::testing::Range<size_t>(0, registry().size()),
                         [](::testing::TestParamInfo<size_t> const& p) {
                           return registry()[p.param].name();
                         });

// Host only: the registry lists every ported op, with valid unique names.
TEST(BackendOpsHost, RegistryListsEveryOp) {
  std::map<std::string, int> per_op;
  std::set<std::string> names;
  for (CaseInfo const& c : registry()) {
    ++per_op[c.op];
    EXPECT_TRUE(names.insert(c.name()).second) << c.name();
    for (char ch : c.name()) {
      EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(ch)) || ch == '_') << c.name();
    }
    EXPECT_TRUE(static_cast<bool>(c.make)) << c.name();
  }
  const std::map<std::string, int> expected = {
      {"Embedding", 9},     {"RmsNorm", 24},    {"AddRmsNorm", 12},     {"QkNormRope", 24},
      {"QkvPrep", 12},      {"KvWrite", 8},     {"PagedAttention", 15}, {"TopkSoftmax", 288},
      {"SiluMul", 9},       {"MoePermute", 18}, {"Gemm", 10},           {"MoeLayer", 2},
      {"Gemv", 193},        {"Fp8Gemv", 164},   {"Fp8Dequantize", 1},   {"Fp8QuantizeRows", 3},
      {"MoeGemm", 28 * 18},
  };
  EXPECT_EQ(per_op, expected);
}

// Host only: the bulk random fills have the asked mean, spread and range, and a seed
// reproduces them.
TEST(BackendOpsHost, RngFills) {
  backend_ops::Rng a(7), b(7);
  const std::vector<float> v = a.randn(100001, 2.0f, 1.0f);
  EXPECT_EQ(v, b.randn(100001, 2.0f, 1.0f));
  double sum = 0, sq = 0;
  for (float x : v) {
    ASSERT_TRUE(std::isfinite(x));
    sum += x;
    sq += double(x) * x;
  }
  const double mean = sum / v.size(), sd = std::sqrt(sq / v.size() - mean * mean);
  EXPECT_NEAR(mean, 1.0, 0.03);
  EXPECT_NEAR(sd, 2.0, 0.03);
  const Bits u = a.uniform_bf16(100001, -3.0f, 3.0f);
  double usum = 0;
  for (uint16_t x : u) {
    const float f = bf16_to_f32(x);
    ASSERT_GE(f, -3.0f);
    ASSERT_LE(f, 3.0f);
    usum += f;
  }
  EXPECT_NEAR(usum / u.size(), 0.0, 0.03);
  EXPECT_NE(a.randn(8), b.randn(8)) << "the stream moves on";
}

// ------------------------------------------------------------------------------ the rest

// Exact comparison that reports the number of differing elements and the first one.
template <typename T>
::testing::AssertionResult same(std::vector<T> const& out, std::vector<T> const& ref) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << out.size() << " vs " << ref.size();
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!(out[i] == ref[i])) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << out.size() << " elements differ; first ["
                                       << first << "]: " << +out[first] << " vs " << +ref[first];
}

class CudaOps : public test_util::CudaFixture<> {
 protected:
  Bits randn_bf16(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng_);
    return to_bf16(v);
  }
};

TEST_F(CudaOps, QkNormRopeRejectsHeadDim96) {
  QkNormRopeParams p{};
  p.num_tokens = 1;
  p.num_q_heads = p.num_kv_heads = 1;
  p.head_dim = 96;
  try {
    qk_norm_rope_launch(p, stream_);
    FAIL() << "no throw";
  } catch (Error const& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(e.message().find("unsupported head_dim 96"), std::string::npos) << e.what();
  }
}

// Host-only: runs without a GPU too.
TEST(CudaOpsHost, PagedAttentionPickSplit) {
  // Decode of one sequence with a 4096-token context on 132 SMs: splits of 128 keys give the
  // 4 kv heads 128 blocks; a large batch needs no split.
  const int64_t split = paged_attention_pick_split(1, 4, 256, 16, 132);
  EXPECT_EQ(split, 128);
  EXPECT_EQ(paged_attention_num_splits(256, 16, split), 32);
  EXPECT_EQ(paged_attention_num_splits(256, 16, paged_attention_pick_split(32, 4, 256, 16, 132)),
            3);
  EXPECT_EQ(paged_attention_pick_split(512, 4, 256, 16, 132), 0);
  EXPECT_EQ(paged_attention_num_splits(256, 16, 0), 1);
  EXPECT_EQ(paged_attention_workspace_floats(3, 32, 128, 256, 16, 0), 0u);
}

TEST_F(CudaOps, PagedAttentionRejectsUnsupported) {
  PagedAttentionParams p{};
  p.num_tokens = 1;
  p.page_size = 16;
  p.max_pages_per_seq = 1;
  p.num_q_heads = 12;
  p.num_kv_heads = 4;  // group 3
  p.head_dim = 128;
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.num_q_heads = 8;
  p.head_dim = 96;
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.head_dim = 128;
  p.num_q_heads = 128;
  p.num_kv_heads = 4;  // group 32
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.num_q_heads = 32;
  p.kv_split = 100;  // not a multiple of 128
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
}

TEST_F(CudaOps, TopkSoftmaxRejectsUnsupported) {
  TopkSoftmaxParams p{};
  p.num_tokens = 1;
  p.num_experts = 513;
  p.top_k = 8;
  EXPECT_THROW(topk_softmax_launch(p, stream_), Error);
  p.num_experts = 512;
  p.top_k = 17;
  EXPECT_THROW(topk_softmax_launch(p, stream_), Error);
  p.num_experts = 9;
  p.top_k = 10;  // more than the experts
  EXPECT_THROW(topk_softmax_launch(p, stream_), Error);
  p.num_experts = 128;
  p.top_k = 8;
  p.logits_dtype = DType::kF16;
  EXPECT_THROW(topk_softmax_launch(p, stream_), Error);
}

TEST_F(CudaOps, MoePermuteRejectsTooManyExperts) {
  MoePermuteParams p{};
  p.num_tokens = 1;
  p.top_k = 1;
  p.hidden = 8;
  p.num_local_experts = 513;
  EXPECT_THROW(moe_permute_launch(p, stream_), Error);
}

// Router -> permute -> unpermute captured once in a CUDA graph and replayed on new inputs:
// row counts live on the device, so nothing in the step needs the host. With the permuted x
// itself as the "expert output", the renormalised weights sum to 1 and out == x.
TEST_F(CudaOps, MoePermuteReplaysInCudaGraph) {
  SCOPED_TRACE(trace());
  const int64_t tokens = 50, experts = 128, top_k = 8, hidden = 64, slots = tokens * top_k;
  DeviceBuffer<uint16_t> d_logits(tokens * experts), d_x(tokens * hidden), d_px(slots * hidden);
  DeviceBuffer<int32_t> d_ids(slots), d_counts(experts), d_offsets(experts + 1), d_src(slots),
      d_slot_row(slots), d_ws(moe_permute_workspace_elems(tokens, top_k, experts));
  DeviceBuffer<float> d_w(slots), d_out(tokens * hidden);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  topk_softmax_launch(
      {d_logits.ptr, d_ids.ptr, d_w.ptr, tokens, experts, top_k, true, DType::kBF16}, stream_);
  moe_permute_launch({d_x.bf(), d_ids.ptr, d_px.bf(), d_counts.ptr, d_offsets.ptr, d_src.ptr,
                      d_slot_row.ptr, d_ws.ptr, tokens, hidden, top_k, 0, experts},
                     stream_);
  moe_unpermute_launch({d_px.bf(), d_ids.ptr, d_w.ptr, d_slot_row.ptr, d_out.ptr, tokens, hidden,
                        top_k, DType::kF32},
                       stream_);
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    SCOPED_TRACE("replay " + std::to_string(rep));
    Bits logits = randn_bf16(tokens * experts, 2.0f), x = randn_bf16(tokens * hidden);
    d_logits.upload(logits);
    d_x.upload(x);
    d_out.poison(0xff);
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    sync();
    std::vector<float> lf = to_f32(logits), w(slots);
    std::vector<int32_t> ids(slots);
    cpu::topk_softmax({lf.data(), ids.data(), w.data(), tokens, experts, top_k, true});
    EXPECT_TRUE(same(d_ids.download(), ids));
    EXPECT_LT(rel_err(d_out.download(), to_f32(x)), 1e-5);
  }
  TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
}

// GemmLt's plan cache over the Gemm cases' shapes (each with beta 0 and 1: ten plans), reused
// for a repeated shape, and a new plan for rows 1.. of x and y (16-byte aligned pointers only),
// as the per-expert GEMMs of a permuted batch get; that result against the reference.
TEST_F(CudaOps, GemmLtPlanCache) {
  SCOPED_TRACE(trace());
  GemmLt gemm;
  struct Shape {
    int64_t m, n, k;
  };
  for (Shape s : {Shape{1, 5120, 2048}, Shape{37, 200, 72}, Shape{300, 128, 2048}, Shape{8, 96, 40},
                  Shape{257, 512, 1024}}) {
    SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                 std::to_string(s.k));
    DeviceBuffer<uint16_t> d_x(randn_bf16(s.m * s.k)), d_w(randn_bf16(s.n * s.k)),
        d_y(randn_bf16(s.m * s.n));
    gemm.run({d_x.bf(), d_w.bf(), d_y.bf(), s.m, s.n, s.k}, stream_);
    gemm.run({d_x.bf(), d_w.bf(), d_y.bf(), s.m, s.n, s.k, 1.0f, 1.0f}, stream_);
    sync();
  }
  EXPECT_EQ(gemm.num_plans(), 10u);
  // Cached plans are reused.
  Bits x = randn_bf16(37 * 72), w = randn_bf16(200 * 72);
  DeviceBuffer<uint16_t> d_x(x), d_w(w), d_y(37 * 200);
  gemm.run({d_x.bf(), d_w.bf(), d_y.bf(), 37, 200, 72}, stream_);
  sync();
  EXPECT_EQ(gemm.num_plans(), 10u);
  // Rows 1.. of x and y: 16-byte aligned pointers only (a new plan for that alignment).
  d_y.poison(0xff);
  gemm.run({d_x.bf() + 72, d_w.bf(), d_y.bf() + 200, 36, 200, 72}, stream_);
  std::vector<float> xf = to_f32(x), wf = to_f32(w), ref(37 * 200);
  cpu::gemm({xf.data(), wf.data(), ref.data(), 37, 200, 72});
  std::vector<float> y = to_f32(d_y.download());
  EXPECT_LT(rel_err(std::vector<float>(y.begin() + 200, y.end()),
                    std::vector<float>(ref.begin() + 200, ref.end())),
            1e-2);
  EXPECT_EQ(gemm.num_plans(), 11u);
}

}  // namespace
}  // namespace tandem::cuda
