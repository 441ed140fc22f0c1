// The decode MoE expert GEMVs (moe_decode.h) against the CPU reference cpu::moe, on routing
// drawn on the host (distinct experts per token, random weights, the compact rows in
// moe_permute's order): fresh random inputs every run (the seed is printed on failure), act
// and out poisoned with NaN first, odd hidden / inter sizes, expert-parallel slices (tokens
// without a local expert must come out exactly zero), every chunks-per-lane variant of the down
// kernel, determinism, and the MoE layer's decode path with the kernels on vs off (also after a
// PDL producer kernel, in a captured graph).
// GPU tests skip (GTEST_SKIP) when no CUDA device is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/check.h"
#include "backend/cuda/decode_switches.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe_decode.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_layer.h"
#include "backend/cuda/norm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::DeviceBuffer;
using test_util::to_f32;

struct Case {
  int T, H, I, E, K, begin, L;
};

struct LayerDecodeCase {
  int H, I, E, K;
  std::vector<int> tokens;
};

std::string name(Case const& c) {
  return "tokens " + std::to_string(c.T) + " hidden " + std::to_string(c.H) + " inter " +
         std::to_string(c.I) + " experts " + std::to_string(c.E) + " top_k " + std::to_string(c.K) +
         " local [" + std::to_string(c.begin) + ", +" + std::to_string(c.L) + ")";
}

class MoeDecodeCuda : public test_util::CudaFixture<> {
 protected:
  Bits rand_bf16(size_t n, float scale) {
    std::uniform_real_distribution<float> d(-scale * 1.7320508f, scale * 1.7320508f);
    Bits b(n);
    for (auto& v : b) v = f32_to_bf16(d(rng_));
    return b;
  }

  // MoeLayer's decode path with the expert GEMVs vs the grouped GEMMs (below).
  void check_layer_decode(LayerDecodeCase const& lc);

  // Runs one case and checks out (and act) against the CPU. Returns out's bits.
  Bits run_case(Case const& c) {
    const int T = c.T, H = c.H, I = c.I, K = c.K, L = c.L, S = T * K;
    Bits x = rand_bf16(size_t(T) * H, 1.0f);
    Bits gate = rand_bf16(size_t(L) * I * H, 1.0f / std::sqrt(float(H)));
    Bits up = rand_bf16(size_t(L) * I * H, 1.0f / std::sqrt(float(H)));
    Bits down = rand_bf16(size_t(L) * H * I, 1.0f / std::sqrt(float(I)));
    Bits packed(gate.size() * 2);
    for (int e = 0; e < L; ++e) {
      moe_pack_gate_up(reinterpret_cast<bf16 const*>(gate.data() + size_t(e) * I * H),
                       reinterpret_cast<bf16 const*>(up.data() + size_t(e) * I * H), I, H,
                       reinterpret_cast<bf16*>(packed.data() + size_t(e) * 2 * I * H));
    }
    // Routing: K distinct experts per token, positive weights summing to 1.
    std::vector<int32_t> ids(S);
    std::vector<float> tw(S);
    std::vector<int> all(c.E);
    std::iota(all.begin(), all.end(), 0);
    std::uniform_real_distribution<float> wd(0.05f, 1.f);
    for (int t = 0; t < T; ++t) {
      std::shuffle(all.begin(), all.end(), rng_);
      float sum = 0;
      for (int j = 0; j < K; ++j) {
        ids[t * K + j] = all[j];
        tw[t * K + j] = wd(rng_);
        sum += tw[t * K + j];
      }
      for (int j = 0; j < K; ++j) tw[t * K + j] /= sum;
    }
    // Compact rows: by local expert, then slot (moe_permute's order).
    std::vector<int32_t> off(L + 1, 0), src;
    for (int e = 0; e < L; ++e) {
      off[e] = static_cast<int32_t>(src.size());
      for (int s = 0; s < S; ++s) {
        if (ids[s] - c.begin == e) src.push_back(s);
      }
    }
    off[L] = static_cast<int32_t>(src.size());
    src.resize(std::max<size_t>(src.size(), 1));
    DeviceBuffer<uint16_t> d_x(x), d_gu(packed), d_down(down), d_act(size_t(S) * I),
        d_out(size_t(T) * H);
    DeviceBuffer<int32_t> d_ids(ids), d_off(off), d_src(src);
    DeviceBuffer<float> d_tw(tw);
    d_act.poison(0xff);
    d_out.poison(0xff);
    MoeDecodeParams p{d_x.bf(),  d_gu.bf(), d_down.bf(), d_ids.ptr,  d_tw.ptr,
                      d_off.ptr, d_src.ptr, d_act.bf(),  d_out.bf(), T,
                      H,         I,         K,           c.begin,    L};
    EXPECT_TRUE(moe_decode_supported(p));
    moe_decode_launch(p, stream_);
    sync();
    Bits out = d_out.download();
    // CPU: cpu::moe wants [2I, H] = gate rows then up rows per expert.
    std::vector<float> xf = to_f32(x), gf = to_f32(gate), uf = to_f32(up), df = to_f32(down);
    std::vector<std::vector<float>> gu(L), dn(L);
    std::vector<float const*> pgu(L), pdn(L);
    for (int e = 0; e < L; ++e) {
      gu[e].assign(gf.begin() + size_t(e) * I * H, gf.begin() + size_t(e + 1) * I * H);
      gu[e].insert(gu[e].end(), uf.begin() + size_t(e) * I * H, uf.begin() + size_t(e + 1) * I * H);
      dn[e].assign(df.begin() + size_t(e) * H * I, df.begin() + size_t(e + 1) * H * I);
      pgu[e] = gu[e].data();
      pdn[e] = dn[e].data();
    }
    std::vector<float> ref(size_t(T) * H);
    cpu::moe({xf.data(), ids.data(), tw.data(), pgu.data(), pdn.data(), ref.data(), T, H, I, K,
              c.begin, L});
    // Per token: rows without a local expert exactly zero, the others close (bf16 act and
    // down outputs on top of the bf16 result).
    std::vector<float> of = to_f32(out);
    for (int t = 0; t < T; ++t) {
      bool local = false;
      for (int j = 0; j < K; ++j)
        local |= ids[t * K + j] >= c.begin && ids[t * K + j] < c.begin + L;
      std::vector<float> o(of.begin() + size_t(t) * H, of.begin() + size_t(t + 1) * H);
      std::vector<float> r(ref.begin() + size_t(t) * H, ref.begin() + size_t(t + 1) * H);
      if (!local) {
        EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](float v) { return v == 0.f; }))
            << "token " << t << " has no local expert";
      } else {
        EXPECT_LT(test_util::rel_err(o, r), 2e-2) << "token " << t;
      }
    }
    // act of every compact row: silu(gate . x) * (up . x) of its token.
    Bits act = d_act.download();
    double num = 0, den = 0;
    for (int r = 0; r < off[L]; ++r) {
      const int s = src[r], t = s / K, e = ids[s] - c.begin;
      for (int j = 0; j < I; ++j) {
        double g = 0, u = 0;
        for (int k = 0; k < H; ++k) {
          g += double(xf[size_t(t) * H + k]) * gu[e][size_t(j) * H + k];
          u += double(xf[size_t(t) * H + k]) * gu[e][size_t(I + j) * H + k];
        }
        const double want = g / (1.0 + std::exp(-g)) * u;
        const double got = bf16_to_f32(act[size_t(r) * I + j]);
        if (!std::isfinite(got)) {
          ADD_FAILURE() << "act row " << r << " col " << j << " not written";
          return out;
        }
        num += (got - want) * (got - want);
        den += want * want;
      }
    }
    if (off[L] > 0) {
      EXPECT_LT(std::sqrt(num / std::max(den, 1e-30)), 1e-2) << "act";
    }
    return out;
  }
};

TEST_F(MoeDecodeCuda, MatchesCpuMoe) {
  SCOPED_TRACE(trace());
  const std::vector<Case> cases = {
      {1, 2048, 768, 16, 8, 0, 16},  // Qwen3-30B-A3B widths (fewer experts: host time), batch 1
      {8, 2048, 768, 24, 8, 0, 24},  // batch 8: 64 slots, experts shared by several tokens
      {3, 136, 72, 16, 4, 0, 16},    // odd chunk counts (17 per hidden row, 9 per inter row)
      {2, 512, 1536, 64, 8, 0, 64},  // Qwen3-235B-A22B's expert width: 6 chunks per lane
      {4, 200, 2048, 8, 2, 0, 8},    // inter 2048: 8 chunks per lane
      {5, 264, 264, 24, 3, 0, 24},   // 33 chunks: 2 per lane, the second mostly idle
      {8, 64, 8, 256, 8, 0, 256},    // 256 local experts, inter 8 (1 chunk)
      {6, 256, 128, 32, 4, 8, 16},   // expert-parallel slice
      {3, 128, 64, 64, 2, 60, 4},    // EP slice most tokens miss: zero rows
      {7, 1032, 200, 40, 9, 0, 40},  // top-9 (63 slots), hidden 1032
      // Qwen3.5-397B-A17B routing (512 experts, top-10): more than 256 local experts (two
      // passes of the down kernel's expert listing), its expert width with fewer experts, odd k,
      // top-16.
      {6, 512, 64, 512, 10, 0, 512},    // 60 slots over 512 local experts
      {1, 1024, 1024, 12, 10, 0, 12},   // inter 1024 (397B's): 4 chunks per lane
      {2, 512, 256, 512, 10, 500, 12},  // EP slice at the top of 512: mostly zero rows
      {5, 136, 72, 400, 7, 0, 400},     // top-7 over 400 local experts, odd chunk counts
      {3, 200, 72, 300, 11, 260, 40},   // top-11, expert ids past 256, EP slice
      {4, 64, 16, 512, 16, 0, 512},     // top-16: 64 slots
  };
  for (Case const& c : cases) {
    SCOPED_TRACE(name(c));
    run_case(c);
  }
}

TEST_F(MoeDecodeCuda, IsDeterministic) {
  SCOPED_TRACE(trace());
  // Same inputs twice: the same seed draws the same case.
  const Case c{8, 2048, 768, 16, 8, 0, 16};
  const uint32_t seed = seed_;
  rng_.seed(seed);
  Bits a = run_case(c);
  rng_.seed(seed);
  Bits b = run_case(c);
  EXPECT_EQ(a, b);
}

TEST_F(MoeDecodeCuda, RejectsUnsupported) {
  DeviceBuffer<uint16_t> buf(1 << 16);
  DeviceBuffer<int32_t> ib(256);
  DeviceBuffer<float> fb(256);
  MoeDecodeParams p{buf.bf(), buf.bf(), buf.bf(), ib.ptr, fb.ptr, ib.ptr, ib.ptr, buf.bf(),
                    buf.bf(), 1,        64,       64,     2,      0,      8};
  EXPECT_TRUE(moe_decode_supported(p));
  MoeDecodeParams q = p;
  q.num_tokens = 9;  // more than 8 tokens
  EXPECT_FALSE(moe_decode_supported(q));
  EXPECT_THROW(moe_decode_launch(q, stream_), Error);
  q = p;
  q.inter = 4;
  EXPECT_FALSE(moe_decode_supported(q));
  q = p;
  q.inter = 2056;
  EXPECT_FALSE(moe_decode_supported(q));
  q = p;
  q.x = buf.bf() + 1;  // unaligned
  EXPECT_FALSE(moe_decode_supported(q));
  q = p;
  q.num_tokens = 8;
  q.top_k = 9;  // 72 slots
  EXPECT_FALSE(moe_decode_supported(q));
  q = p;
  q.num_tokens = 7;
  q.top_k = 10;  // 70 slots
  EXPECT_FALSE(moe_decode_supported(q));
  q = p;
  q.num_local_experts = 512;
  EXPECT_TRUE(moe_decode_supported(q));
  q.num_local_experts = 513;
  EXPECT_FALSE(moe_decode_supported(q));
}

// The MoE layer's decode path (router kernel + these two) against the same layer with the
// grouped GEMMs + unpermute (decode_switches().moe_gemv off), Qwen3-30B-A3B widths, and
// Qwen3.5-397B-A17B's routing (512 experts, top-10: the wide router) and top-13 of 300 at
// smaller widths.
TEST_F(MoeDecodeCuda, LayerDecodePathMatchesGroupedGemms) {
  SCOPED_TRACE(trace());
  for (LayerDecodeCase const& lc :
       {LayerDecodeCase{2048, 768, 64, 8, {1, 2, 5, 8}},
        LayerDecodeCase{512, 128, 512, 10, {1, 3, 6}}, LayerDecodeCase{264, 64, 300, 13, {1, 4}}}) {
    check_layer_decode(lc);
  }
}

void MoeDecodeCuda::check_layer_decode(LayerDecodeCase const& lc) {
  const int H = lc.H, I = lc.I, E = lc.E, K = lc.K;
  Bits router = rand_bf16(size_t(E) * H, 1.0f / std::sqrt(float(H)));
  Bits gate = rand_bf16(size_t(E) * I * H, 1.0f / std::sqrt(float(H)));
  Bits up = rand_bf16(size_t(E) * I * H, 1.0f / std::sqrt(float(H)));
  Bits down = rand_bf16(size_t(E) * H * I, 1.0f / std::sqrt(float(I)));
  Bits packed(gate.size() * 2);
  for (int e = 0; e < E; ++e) {
    moe_pack_gate_up(reinterpret_cast<bf16 const*>(gate.data() + size_t(e) * I * H),
                     reinterpret_cast<bf16 const*>(up.data() + size_t(e) * I * H), I, H,
                     reinterpret_cast<bf16*>(packed.data() + size_t(e) * 2 * I * H));
  }
  DeviceBuffer<uint16_t> d_router(router), d_gu(packed), d_down(down);
  MoeLayerWeights w{d_router.bf(), d_gu.bf(), d_down.bf()};
  GemmLt gemm;
  const DecodeSwitches saved = decode_switches();
  decode_switches().moe_gemv_max_tokens = 8;
  for (int T : lc.tokens) {
    SCOPED_TRACE("tokens " + std::to_string(T) + " experts " + std::to_string(E) + " top_k " +
                 std::to_string(K));
    MoeLayer layer(8, H, I, E, K, 0, E, true);
    layer.set_path(MoeLayerPath::kDecode);
    Bits x = rand_bf16(size_t(T) * H, 1.0f);
    DeviceBuffer<uint16_t> d_x(x), d_a(size_t(T) * H), d_b(size_t(T) * H);
    d_a.poison(0xff);
    d_b.poison(0xff);
    decode_switches().moe_gemv = true;
    layer.run(w, d_x.bf(), d_a.bf(), T, gemm, stream_);
    decode_switches().moe_gemv = false;
    layer.run(w, d_x.bf(), d_b.bf(), T, gemm, stream_);
    decode_switches().moe_gemv = saved.moe_gemv;
    sync();
    EXPECT_EQ(layer.last_path(), MoeLayerPath::kDecode);
    std::vector<float> a = to_f32(d_a.download()), b = to_f32(d_b.download());
    EXPECT_LT(test_util::rel_err(a, b), 1e-2);
  }
  decode_switches() = saved;
}

// The decode step's order: the MoE input produced by an RMSNorm (a PDL launch that lets its
// successor start early), then the layer with every decode switch on (router PDL with early
// weight loads, the expert GEMVs), poisoned input and output each round, eagerly and in a
// captured graph; against the same layer with every switch off.
TEST_F(MoeDecodeCuda, AfterAProducerKernelInAGraph) {
  SCOPED_TRACE(trace());
  const int H = 2048, I = 768, E = 64, K = 8, T = 1;
  Bits router = rand_bf16(size_t(E) * H, 1.0f / std::sqrt(float(H)));
  Bits packed = rand_bf16(size_t(E) * 2 * I * H, 1.0f / std::sqrt(float(H)));
  Bits down = rand_bf16(size_t(E) * H * I, 1.0f / std::sqrt(float(I)));
  Bits a = rand_bf16(size_t(T) * H, 1.0f), g = rand_bf16(H, 0.1f);
  for (auto& v : g) v = f32_to_bf16(1.0f + bf16_to_f32(v));
  DeviceBuffer<uint16_t> d_router(router), d_gu(packed), d_down(down), d_a(a), d_g(g),
      d_x(size_t(T) * H), d_out(size_t(T) * H), d_ref(size_t(T) * H);
  MoeLayerWeights w{d_router.bf(), d_gu.bf(), d_down.bf()};
  GemmLt gemm;
  MoeLayer layer(8, H, I, E, K, 0, E, true);
  const DecodeSwitches saved = decode_switches();
  auto step = [&](bf16* out) {
    rms_norm_launch({d_a.bf(), d_g.bf(), d_x.bf(), T, H, 1e-6f}, stream_);
    layer.run(w, d_x.bf(), out, T, gemm, stream_);
  };
  decode_switches() = DecodeSwitches::all_off();
  d_ref.poison(0xff);
  step(d_ref.bf());
  sync();
  std::vector<float> ref = to_f32(d_ref.download());
  decode_switches() = DecodeSwitches::all_on();
  for (int round = 0; round < 3; ++round) {
    d_x.poison(0xff);
    d_out.poison(0xff);
    step(d_out.bf());
    sync();
    EXPECT_LT(test_util::rel_err(to_f32(d_out.download()), ref), 1e-2) << "eager " << round;
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  step(d_out.bf());
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  decode_switches() = saved;
  for (int round = 0; round < 5; ++round) {
    d_x.poison(0xff);
    d_out.poison(0xff);
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    sync();
    EXPECT_LT(test_util::rel_err(to_f32(d_out.download()), ref), 1e-2) << "replay " << round;
  }
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace tandem::cuda
