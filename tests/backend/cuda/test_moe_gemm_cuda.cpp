// The grouped expert GEMM's rejects (its cases against cpu::gemm are in the kernel-test harness,
// ops/moe_gemm_cases.cpp) and the whole MoE block (moe_layer.h) against the CPU reference:
// cpu::topk_softmax + cpu::moe. Fresh random inputs every run (the seed is printed on failure),
// outputs poisoned with NaN first. GPU tests skip (GTEST_SKIP) when no CUDA device is visible;
// the packing test runs anywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_layer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "weight_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::DeviceBuffer;
using test_util::gpu_available;
using test_util::to_bf16;
using test_util::to_f32;

// Relative error ||out - ref|| / ||ref|| below tol, and no element off by more than
// 3 tol * (|ref| + rms(ref)); on failure reports the count and the first bad (row, col).
::testing::AssertionResult close(std::vector<float> const& out, std::vector<float> const& ref,
                                 int64_t cols, double tol) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << out.size() << " vs " << ref.size();
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) den += double(ref[i]) * ref[i];
  const double rms = std::sqrt(den / std::max<size_t>(ref.size(), 1));
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double d = double(out[i]) - double(ref[i]);
    if (!std::isfinite(out[i]) || std::fabs(d) > 3 * tol * (std::fabs(ref[i]) + rms)) {
      if (bad++ == 0) first = i;
    }
    num += std::isfinite(d) ? d * d : INFINITY;
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  if (bad == 0 && rel < tol) return ::testing::AssertionSuccess();
  auto f = ::testing::AssertionFailure();
  f << "rel err " << rel << " (tol " << tol << "), " << bad << " of " << out.size()
    << " elements off";
  if (bad) {
    f << "; first at row " << first / cols << " col " << first % cols << ": " << out[first]
      << " vs ref " << ref[first];
  }
  return f;
}

class MoeCudaTest : public test_util::CudaFixture<> {
 protected:
  // Random bf16 in [-a, a], a = scale * sqrt(3) (standard deviation `scale`).
  Bits rand_bf16(size_t n, float scale = 1.0f) {
    std::uniform_real_distribution<float> d(-scale * 1.7320508f, scale * 1.7320508f);
    Bits b(n);
    for (auto& v : b) v = f32_to_bf16(d(rng_));
    return b;
  }
  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
};

using test_util::pack_all;

// ------------------------------------------------------------------------------ packing (CPU)

TEST(MoePackGateUp, InterleavesBlocksOfEightRows) {
  const int64_t inter = 24, hidden = 5;
  Bits gate(inter * hidden), up(inter * hidden), packed(2 * inter * hidden, 0);
  for (int64_t r = 0; r < inter; ++r) {
    for (int64_t c = 0; c < hidden; ++c) {
      gate[r * hidden + c] = f32_to_bf16(static_cast<float>(r * 8 + c));
      up[r * hidden + c] = f32_to_bf16(-static_cast<float>(r * 8 + c) - 1.0f);
    }
  }
  moe_pack_gate_up(reinterpret_cast<bf16 const*>(gate.data()),
                   reinterpret_cast<bf16 const*>(up.data()), inter, hidden,
                   reinterpret_cast<bf16*>(packed.data()));
  ASSERT_EQ(kMoeGateUpInterleave, 8);
  for (int64_t p = 0; p < 2 * inter; ++p) {
    const int64_t block = p / 16, within = p % 16;
    const bool is_gate = within < 8;
    const int64_t src = block * 8 + within % 8;
    for (int64_t c = 0; c < hidden; ++c) {
      const uint16_t want = is_gate ? gate[src * hidden + c] : up[src * hidden + c];
      ASSERT_EQ(packed[p * hidden + c], want) << "packed row " << p << " col " << c;
    }
  }
  EXPECT_THROW(moe_pack_gate_up(reinterpret_cast<bf16 const*>(gate.data()),
                                reinterpret_cast<bf16 const*>(up.data()), 12, hidden,
                                reinterpret_cast<bf16*>(packed.data())),
               Error);
}

TEST(MoeGemmPickTile, ByMeanRowsPerExpert) {
  EXPECT_EQ(moe_gemm_pick_tile(8, 128), MoeGemmTile::kSmall);      // 1 token, top-8
  EXPECT_EQ(moe_gemm_pick_tile(1024, 128), MoeGemmTile::kSmall);   // 128 tokens
  EXPECT_EQ(moe_gemm_pick_tile(2048, 128), MoeGemmTile::kMedium);  // 256 tokens
  EXPECT_EQ(moe_gemm_pick_tile(65536, 128), MoeGemmTile::kLarge);  // 8192 tokens
  EXPECT_EQ(moe_gemm_pick_tile(0, 128), MoeGemmTile::kSmall);
}

// ------------------------------------------------------------------------------ grouped GEMM

// Every routing x epilogue x tile x PDL mode against cpu::gemm: the MoeGemm cases of the
// kernel-test harness (ops/moe_gemm_cases.cpp).

class MoeGemmCuda : public MoeCudaTest {};

TEST_F(MoeGemmCuda, RejectsUnsupportedShapes) {
  DeviceBuffer<uint16_t> buf(1024);
  DeviceBuffer<int32_t> off(2);
  MoeGemmParams p{buf.bf(), buf.bf(), buf.bf(), off.ptr, 4, 64, 60, 1};
  EXPECT_THROW(moe_gemm_launch(p, stream_), Error);  // k % 8
  p.k = 64;
  p.n = 24;
  p.epilogue = MoeGemmEpilogue::kSiluMul;
  EXPECT_THROW(moe_gemm_launch(p, stream_), Error);  // silu-mul n % 16
  p.x = buf.bf() + 1;
  p.n = 32;
  EXPECT_THROW(moe_gemm_launch(p, stream_), Error);  // alignment
}

// ------------------------------------------------------------------------------ MoE layer

struct LayerCase {
  int64_t tokens, hidden, inter, experts, top_k, begin, local;
  bool renorm;
};

class MoeLayerCuda : public MoeCudaTest {
 protected:
  struct Weights {
    Bits router, gate, up, down;  // HF layouts, local experts only for gate/up/down
    std::unique_ptr<DeviceBuffer<uint16_t>> d_router, d_gate_up, d_down;
    MoeLayerWeights dev() const { return {d_router->bf(), d_gate_up->bf(), d_down->bf()}; }
  };
  // Router rows scaled to norm 1 (logits of equal spread for every expert): balanced routing,
  // as trained routers give, so the padded path's 2x bound is met at prefill sizes.
  static void normalize_router_rows(Bits& router, int64_t H) {
    const int64_t E = static_cast<int64_t>(router.size()) / H;
    for (int64_t e = 0; e < E; ++e) {
      double n2 = 0;
      for (int64_t i = 0; i < H; ++i)
        n2 += double(bf16_to_f32(router[e * H + i])) * bf16_to_f32(router[e * H + i]);
      const float inv = n2 > 0 ? static_cast<float>(1.0 / std::sqrt(n2)) : 0.f;
      for (int64_t i = 0; i < H; ++i)
        router[e * H + i] = f32_to_bf16(bf16_to_f32(router[e * H + i]) * inv);
    }
  }
  Weights make_weights(LayerCase const& c) {
    Weights w;
    const int64_t H = c.hidden, I = c.inter, L = c.local;
    w.router = rand_bf16(c.experts * H, 1.0f / std::sqrt(static_cast<float>(H)));
    normalize_router_rows(w.router, H);
    w.gate = rand_bf16(L * I * H, 1.0f / std::sqrt(static_cast<float>(H)));
    w.up = rand_bf16(L * I * H, 1.0f / std::sqrt(static_cast<float>(H)));
    w.down = rand_bf16(L * H * I, 1.0f / std::sqrt(static_cast<float>(I)));
    w.d_router = std::make_unique<DeviceBuffer<uint16_t>>(w.router);
    w.d_gate_up = std::make_unique<DeviceBuffer<uint16_t>>(pack_all(w.gate, w.up, L, I, H));
    w.d_down = std::make_unique<DeviceBuffer<uint16_t>>(w.down);
    return w;
  }
  // Checks the layer's last run: router logits vs cpu::gemm, top-k vs cpu::topk_softmax on
  // the device logits, out vs cpu::moe with the device routing.
  void verify(LayerCase const& c, Weights const& w, MoeLayer const& layer, Bits const& x,
              Bits const& out) {
    const int64_t T = c.tokens, H = c.hidden, I = c.inter, L = c.local, S = T * c.top_k;
    std::vector<float> xf = to_f32(x), rf = to_f32(w.router), ref_logits(T * c.experts);
    cpu::gemm({xf.data(), rf.data(), ref_logits.data(), T, c.experts, H});
    std::vector<float> logits(T * c.experts);
    std::vector<int32_t> ids(S);
    std::vector<float> tw(S);
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    TANDEM_CUDA_CHECK(cudaMemcpy(logits.data(), layer.router_logits(), logits.size() * 4,
                                 cudaMemcpyDeviceToHost));
    TANDEM_CUDA_CHECK(cudaMemcpy(ids.data(), layer.topk_ids(), S * 4, cudaMemcpyDeviceToHost));
    TANDEM_CUDA_CHECK(cudaMemcpy(tw.data(), layer.topk_weights(), S * 4, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(close(logits, ref_logits, c.experts, 1e-2)) << "router logits";
    std::vector<int32_t> ref_ids(S);
    std::vector<float> ref_tw(S), lf = logits;
    cpu::topk_softmax({lf.data(), ref_ids.data(), ref_tw.data(), T, c.experts, c.top_k, c.renorm});
    EXPECT_EQ(ids, ref_ids) << "top-k ids";
    EXPECT_TRUE(close(tw, ref_tw, c.top_k, 1e-5)) << "top-k weights";
    // cpu::moe wants [2I, H] = gate rows then up rows per expert.
    std::vector<std::vector<float>> gu(L), dn(L);
    std::vector<float const*> pgu(L), pdn(L);
    std::vector<float> gf = to_f32(w.gate), uf = to_f32(w.up), df = to_f32(w.down);
    for (int64_t e = 0; e < L; ++e) {
      gu[e].assign(gf.begin() + e * I * H, gf.begin() + (e + 1) * I * H);
      gu[e].insert(gu[e].end(), uf.begin() + e * I * H, uf.begin() + (e + 1) * I * H);
      dn[e].assign(df.begin() + e * H * I, df.begin() + (e + 1) * H * I);
      pgu[e] = gu[e].data();
      pdn[e] = dn[e].data();
    }
    std::vector<float> ref(T * H);
    cpu::moe({xf.data(), ids.data(), tw.data(), pgu.data(), pdn.data(), ref.data(), T, H, I,
              c.top_k, c.begin, L});
    bool any_local = false;
    for (int32_t id : ids) any_local |= id >= c.begin && id < c.begin + L;
    if (!any_local) {
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](uint16_t v) { return v == 0; }));
    } else {
      // bf16 intermediates (act, down output) on top of the bf16 result.
      EXPECT_TRUE(close(to_f32(out), ref, H, 2e-2)) << "layer output";
    }
  }
};

std::string path_name(MoeLayerPath p) {
  switch (p) {
    case MoeLayerPath::kAuto: return "auto";
    case MoeLayerPath::kMma: return "mma";
    case MoeLayerPath::kDecode: return "decode";
    case MoeLayerPath::kCublas: return "cublas";
    case MoeLayerPath::kPadded: return "padded";
  }
  return "?";
}

// The prefill path run() must have taken (kPadded or kCublas) given the expert counts of its
// last run (MoeLayer's rule: every local expert padded to Mmax = max count rounded up to 64;
// padded when the rows fit the buffers, sized for 2 max_tokens top_k + 64 local experts,
// and, unless forced, L Mmax <= 2 routed rows).
MoeLayerPath expected_prefill_path(MoeLayer const& layer, int64_t max_tokens, int64_t top_k,
                                   int64_t L, bool forced_padded,
                                   int64_t* max_count_out = nullptr) {
  std::vector<int32_t> off(L + 1);
  TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
  TANDEM_CUDA_CHECK(
      cudaMemcpy(off.data(), layer.expert_offsets(), (L + 1) * 4, cudaMemcpyDeviceToHost));
  int64_t mx = 0;
  for (int64_t e = 0; e < L; ++e) mx = std::max<int64_t>(mx, off[e + 1] - off[e]);
  if (max_count_out) *max_count_out = mx;
  const int64_t routed = off[L], m_pad = (mx + 63) / 64 * 64, slots = max_tokens * top_k;
  const int64_t cap = std::max(slots, 2 * slots + 64 * L);
  const bool fits = L * m_pad <= cap, balanced = L * m_pad <= 2 * routed;
  return routed > 0 && fits && (forced_padded || balanced) ? MoeLayerPath::kPadded
                                                           : MoeLayerPath::kCublas;
}

// Every case on every path: auto (checked against pick_path), then each forced path where it
// can run (decode: <= 8 tokens; cublas and padded: the layer has its buffers, i.e. max_tokens *
// top_k >= 64 * local experts), which must then be the path taken (padded: or cublas where
// the routing does not allow it, see expected_prefill_path).
TEST_F(MoeLayerCuda, MatchesCpuMoe) {
  SCOPED_TRACE(trace());
  const std::vector<LayerCase> cases = {
      {0, 256, 128, 16, 4, 0, 16, true},
      {1, 256, 128, 16, 4, 0, 16, true},
      {2, 256, 128, 16, 4, 0, 16, true},
      {8, 256, 128, 16, 4, 4, 8, true},  // EP slice
      {37, 256, 128, 16, 4, 0, 16, false},
      {300, 256, 128, 16, 4, 4, 8, true},     // EP slice
      {5, 2048, 768, 16, 8, 0, 16, true},     // Qwen3-30B-A3B widths, fewer experts
      {8, 2048, 768, 128, 8, 0, 128, true},   // Qwen3-30B-A3B decode, batch 8 (64 slots)
      {2, 256, 128, 200, 8, 0, 200, false},   // 200 experts: 7 per lane in the top-k
      {600, 128, 64, 8, 2, 0, 8, true},       // 150 rows per expert: the large tile / cuBLAS
      {64, 128, 64, 128, 8, 0, 128, true},    // 128 experts, 4 rows each on average
      {4096, 128, 64, 128, 8, 0, 128, true},  // 256 rows per expert: padded by default
      {4096, 128, 64, 16, 2, 0, 16, true},    // 512 rows per expert: padded (Mmax 640)
      {2000, 128, 64, 16, 4, 4, 8, false},    // EP slice at prefill size
      // Qwen3.5-397B-A17B routing (512 experts, top-10; the wide router / permute kernels),
      // odd k, top-16, at smaller widths.
      {1, 512, 128, 512, 10, 0, 512, true},      // decode, one token
      {6, 256, 64, 512, 10, 0, 512, true},       // decode, 60 slots
      {7, 256, 64, 512, 10, 0, 512, true},       // 70 slots: past the decode path
      {3, 256, 64, 300, 7, 0, 300, false},       // top-7 of 300
      {4, 128, 64, 512, 16, 0, 512, true},       // top-16, 64 slots
      {300, 128, 64, 512, 10, 0, 512, true},     // prefill, mma
      {4096, 128, 64, 512, 10, 0, 512, true},    // 80 rows per expert: padded / cuBLAS
      {200, 256, 64, 512, 11, 128, 300, false},  // EP slice of 300 local experts, top-11
  };
  for (LayerCase const& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " hidden " + std::to_string(c.hidden) +
                 " inter " + std::to_string(c.inter) + " experts " + std::to_string(c.experts) +
                 " top_k " + std::to_string(c.top_k) + " local [" + std::to_string(c.begin) +
                 ", +" + std::to_string(c.local) + ")");
    Weights w = make_weights(c);
    MoeLayer layer(c.tokens + 3, c.hidden, c.inter, c.experts, c.top_k, c.begin, c.local, c.renorm);
    GemmLt gemm;
    Bits x = rand_bf16(c.tokens * c.hidden);
    DeviceBuffer<uint16_t> d_x(x), d_out(c.tokens * c.hidden);
    const bool cublas_possible = (c.tokens + 3) * c.top_k >= 64 * c.local;
    std::vector<MoeLayerPath> paths = {MoeLayerPath::kAuto, MoeLayerPath::kMma};
    if (c.tokens <= 8 && c.tokens * c.top_k <= 64) paths.push_back(MoeLayerPath::kDecode);
    if (cublas_possible) {
      paths.push_back(MoeLayerPath::kCublas);
      paths.push_back(MoeLayerPath::kPadded);
    }
    for (MoeLayerPath path : paths) {
      SCOPED_TRACE("path " + path_name(path));
      layer.set_path(path);
      d_out.poison(0xff);
      layer.run(w.dev(), d_x.bf(), d_out.bf(), c.tokens, gemm, stream_);
      sync();
      if (c.tokens == 0) continue;
      MoeLayerPath want = path == MoeLayerPath::kAuto ? layer.pick_path(c.tokens) : path;
      if (want == MoeLayerPath::kPadded) {
        want = expected_prefill_path(layer, c.tokens + 3, c.top_k, c.local,
                                     path == MoeLayerPath::kPadded);
      }
      EXPECT_EQ(path_name(layer.last_path()), path_name(want));
      verify(c, w, layer, x, d_out.download());
    }
  }
}

TEST_F(MoeLayerCuda, PicksPaths) {
  // Qwen3-30B-A3B: decode up to 8 tokens, cuBLAS from 1024 tokens (64 rows per expert).
  MoeLayer layer(8192, 2048, 768, 128, 8, 0, 128, true);
  EXPECT_EQ(layer.pick_path(1), MoeLayerPath::kDecode);
  EXPECT_EQ(layer.pick_path(8), MoeLayerPath::kDecode);
  EXPECT_EQ(layer.pick_path(9), MoeLayerPath::kMma);
  EXPECT_EQ(layer.pick_path(1023), MoeLayerPath::kMma);
  EXPECT_EQ(layer.pick_path(1024), MoeLayerPath::kPadded);  // or kCublas when skewed
  // Too small for the cuBLAS buffers: never cuBLAS.
  MoeLayer small(256, 2048, 768, 128, 8, 0, 128, true);
  EXPECT_EQ(small.pick_path(256), MoeLayerPath::kMma);
  // Qwen3.5-397B-A17B's routing (512 experts, top-10): decode up to 64 slots (6 tokens), cuBLAS
  // from 64 rows per expert (3277 tokens).
  MoeLayer wide(4096, 256, 128, 512, 10, 0, 512, true);
  EXPECT_EQ(wide.pick_path(1), MoeLayerPath::kDecode);
  EXPECT_EQ(wide.pick_path(6), MoeLayerPath::kDecode);
  EXPECT_EQ(wide.pick_path(7), MoeLayerPath::kMma);
  EXPECT_EQ(wide.pick_path(3276), MoeLayerPath::kMma);
  EXPECT_EQ(wide.pick_path(3277), MoeLayerPath::kPadded);
  MoeLayer top16(8, 256, 128, 512, 16, 0, 512, true);
  EXPECT_EQ(top16.pick_path(4), MoeLayerPath::kDecode);
  EXPECT_EQ(top16.pick_path(5), MoeLayerPath::kMma);
}

// More experts or a larger top-k than the kernels take: refused at construction, naming both.
TEST_F(MoeLayerCuda, RejectsTooManyExperts) {
  for (auto [experts, top_k] : {std::pair<int64_t, int64_t>{513, 8}, {512, 17}}) {
    try {
      MoeLayer layer(8, 64, 32, experts, top_k, 0, experts, true);
      ADD_FAILURE() << experts << " experts, top_k " << top_k << " accepted";
    } catch (Error const& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
      EXPECT_NE(std::string(e.what()).find("at most 512 experts, top_k 16"), std::string::npos)
          << e.what();
    }
  }
}

// Captured once for a fixed token count, replayed on fresh inputs: the routing changes, the
// graph does not.
TEST_F(MoeLayerCuda, ReplaysInCudaGraph) {
  SCOPED_TRACE(trace());
  // Decode (fused router, 1 and 8 tokens), small tile, and prefill-like (large tile, over 48 KB
  // of shared memory; cuBLAS for the eager call, which the capture must not take).
  struct GraphCase {
    LayerCase c;
    MoeLayerPath eager, captured;
  };
  for (GraphCase const& g :
       {GraphCase{{1, 256, 128, 16, 4, 0, 16, true}, MoeLayerPath::kDecode, MoeLayerPath::kDecode},
        GraphCase{{8, 256, 128, 16, 4, 4, 8, true}, MoeLayerPath::kDecode, MoeLayerPath::kDecode},
        GraphCase{{20, 256, 128, 16, 4, 0, 16, true}, MoeLayerPath::kMma, MoeLayerPath::kMma},
        GraphCase{{200, 128, 64, 8, 2, 0, 8, true}, MoeLayerPath::kCublas, MoeLayerPath::kMma}}) {
    LayerCase const& c = g.c;
    SCOPED_TRACE("tokens " + std::to_string(c.tokens));
    Weights w = make_weights(c);
    MoeLayer layer(256, c.hidden, c.inter, c.experts, c.top_k, c.begin, c.local, c.renorm);
    GemmLt gemm;
    DeviceBuffer<uint16_t> d_x(c.tokens * c.hidden), d_out(c.tokens * c.hidden);
    Bits x0 = rand_bf16(c.tokens * c.hidden);
    d_x.upload(x0);
    // Forced (the path auto would pick for 200 tokens is mma): the capture must still take mma.
    layer.set_path(g.eager);
    layer.run(w.dev(), d_x.bf(), d_out.bf(), c.tokens, gemm, stream_);  // cuBLASLt plan
    sync();
    EXPECT_EQ(path_name(layer.last_path()), path_name(g.eager));
    verify(c, w, layer, x0, d_out.download());
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    layer.run(w.dev(), d_x.bf(), d_out.bf(), c.tokens, gemm, stream_);
    TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    EXPECT_EQ(path_name(layer.last_path()), path_name(g.captured));
    TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
      SCOPED_TRACE("replay " + std::to_string(rep));
      Bits x = rand_bf16(c.tokens * c.hidden);
      d_x.upload(x);
      d_out.poison(0xff);
      TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
      sync();
      verify(c, w, layer, x, d_out.download());
    }
    TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

// Prefill routing the padded path must handle or refuse: skewed (experts 0-3 with logits of 3x
// the spread take ~30% of the tokens each, over 4x the mean: padding to that exceeds the
// buffers, so auto and forced padded fall back to cublas), and one expert with no rows (zero router
// row: its logit 0 never makes the top 8 of 128; padded, forced and, when balanced, auto).
TEST_F(MoeLayerCuda, PaddedPathRouting) {
  SCOPED_TRACE(trace());
  const LayerCase c{4096, 128, 64, 128, 8, 0, 128, true};
  for (bool skewed : {true, false}) {
    SCOPED_TRACE(skewed ? "skewed" : "expert 5 empty");
    Weights w = make_weights(c);
    for (int64_t i = 0; i < c.hidden; ++i) {
      if (skewed) {
        for (int64_t e = 0; e < 4; ++e) {
          uint16_t& v = w.router[e * c.hidden + i];
          v = f32_to_bf16(3.0f * bf16_to_f32(v));
        }
      } else {
        w.router[5 * c.hidden + i] = 0;
      }
    }
    w.d_router->upload(w.router);
    MoeLayer layer(c.tokens, c.hidden, c.inter, c.experts, c.top_k, c.begin, c.local, c.renorm);
    GemmLt gemm;
    Bits x = rand_bf16(c.tokens * c.hidden);
    DeviceBuffer<uint16_t> d_x(x), d_out(c.tokens * c.hidden);
    EXPECT_EQ(path_name(layer.pick_path(c.tokens)), "padded");
    for (MoeLayerPath path : {MoeLayerPath::kAuto, MoeLayerPath::kPadded}) {
      SCOPED_TRACE("path " + path_name(path));
      layer.set_path(path);
      d_out.poison(0xff);
      layer.run(w.dev(), d_x.bf(), d_out.bf(), c.tokens, gemm, stream_);
      sync();
      int64_t max_count = 0;
      const MoeLayerPath want = expected_prefill_path(layer, c.tokens, c.top_k, c.local,
                                                      path == MoeLayerPath::kPadded, &max_count);
      EXPECT_EQ(path_name(layer.last_path()), path_name(want));
      if (skewed) {
        EXPECT_GT(max_count, 3 * c.tokens * c.top_k / c.local) << "routing not skewed";
        EXPECT_EQ(path_name(layer.last_path()), "cublas");
      } else {
        std::vector<int32_t> off(c.local + 1);
        TANDEM_CUDA_CHECK(
            cudaMemcpy(off.data(), layer.expert_offsets(), off.size() * 4, cudaMemcpyDeviceToHost));
        EXPECT_EQ(off[6] - off[5], 0) << "expert 5 got rows";
        if (path == MoeLayerPath::kPadded) {
          EXPECT_EQ(path_name(layer.last_path()), "padded");
        }
      }
      verify(c, w, layer, x, d_out.download());
    }
  }
}

// The decode path's output is bitwise reproducible run to run (no float atomics).
TEST_F(MoeLayerCuda, DecodeIsDeterministic) {
  SCOPED_TRACE(trace());
  const LayerCase c{8, 2048, 768, 128, 8, 0, 128, true};
  Weights w = make_weights(c);
  MoeLayer layer(8, c.hidden, c.inter, c.experts, c.top_k, c.begin, c.local, c.renorm);
  GemmLt gemm;
  DeviceBuffer<uint16_t> d_x(rand_bf16(c.tokens * c.hidden)), d_out(c.tokens * c.hidden);
  Bits first;
  for (int rep = 0; rep < 5; ++rep) {
    d_out.poison(0xff);
    layer.run(w.dev(), d_x.bf(), d_out.bf(), c.tokens, gemm, stream_);
    sync();
    ASSERT_EQ(path_name(layer.last_path()), "decode");
    Bits out = d_out.download();
    if (rep == 0) {
      first = out;
    } else {
      EXPECT_TRUE(out == first) << "run " << rep << " differs";
    }
  }
}

TEST_F(MoeLayerCuda, RejectsTooManyTokens) {
  MoeLayer layer(4, 64, 32, 8, 2, 0, 8, true);
  GemmLt gemm;
  DeviceBuffer<uint16_t> d_x(5 * 64), d_out(5 * 64), d_w(8 * 64 * 64);
  MoeLayerWeights w{d_w.bf(), d_w.bf(), d_w.bf()};
  EXPECT_THROW(layer.run(w, d_x.bf(), d_out.bf(), 5, gemm, stream_), Error);
}

}  // namespace
}  // namespace tandem::cuda
