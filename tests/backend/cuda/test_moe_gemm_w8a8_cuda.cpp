// W8A8 block-scaled grouped GEMM on wgmma (moe_gemm_w8a8.h) and the fused activation
// quantizers (fp8_act_quant.h) against their CPU references, over fresh random inputs (the
// seed is printed on failure) with poisoned outputs: odd group sizes, empty experts, a dense
// matrix (no offsets), both tiles, CUDA-graph replay with a routing changed on the device after
// capture, and the shapes the kernels refuse (K not a multiple of 128). The GEMM tests skip
// without a Hopper GPU or a build without the CUTLASS headers; the refusal tests run anywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_act_quant.h"
#include "backend/cuda/moe_gemm_w8a8.h"
#include "backend/cuda/mxfp8_w8a8.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::DeviceBuffer;
using test_util::to_f32;

class CudaMoeGemmW8A8 : public test_util::CudaFixture<> {
 protected:
  void SetUp() override {
    test_util::CudaFixture<>::SetUp();
    if (IsSkipped()) return;
    if (!MoeGemmW8A8::supported()) GTEST_SKIP() << "no sm_90 device or built without CUTLASS";
  }

  // Random E4M3 codes (no NaN).
  std::vector<uint8_t> codes(size_t n) {
    std::uniform_int_distribution<int> d(0, 255);
    std::vector<uint8_t> v(n);
    for (auto& c : v) {
      int b = d(rng_);
      while ((b & 0x7f) == 0x7f) b = d(rng_);
      c = static_cast<uint8_t>(b);
    }
    return v;
  }
  std::vector<float> scales(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> d(lo, hi);
    std::vector<float> v(n);
    for (auto& s : v) s = d(rng_);
    return v;
  }
  // Group sizes: odd, some empty, one of 1, one past a 128-row tile.
  std::vector<int32_t> offsets_for(int64_t experts, int64_t max_rows_hint) {
    std::uniform_int_distribution<int> d(0, static_cast<int>(max_rows_hint));
    std::vector<int32_t> off(experts + 1, 0);
    for (int64_t e = 0; e < experts; ++e) {
      int m = d(rng_);
      if (e % 4 == 1) m = 0;
      if (e == 2) m = 1;
      if (e == 3) m = 129;
      if (m % 2 == 0 && m > 0) m -= 1;
      off[e + 1] = off[e] + m;
    }
    return off;
  }

  // Runs one case and compares every routed row with the CPU reference; rows past the last
  // offset (slack) must still hold the poison.
  void check(MoeGemmW8A8& gemm, int64_t experts, int64_t n, int64_t k,
             std::vector<int32_t> const& off, int64_t slack, MoeGemmW8A8Tile tile, bool dense) {
    const int64_t rows = off.back() + slack;
    const int64_t kb = k / 128;
    auto xq = codes(static_cast<size_t>(rows * k));
    auto xs = scales(static_cast<size_t>(rows * kb), 0.25f, 2.0f);
    auto wq = codes(static_cast<size_t>(experts * n * k));
    auto ws = scales(static_cast<size_t>(experts * n * kb), 1e-4f, 2e-3f);
    DeviceBuffer<uint8_t> dx(xq), dw(wq);
    DeviceBuffer<float> dxs(xs), dws(ws);
    DeviceBuffer<int32_t> doff(off);
    DeviceBuffer<uint16_t> dy(static_cast<size_t>(rows * n));
    dy.poison(0xff);
    MoeGemmW8A8Params p{dx.ptr,
                        dxs.ptr,
                        dw.ptr,
                        dws.ptr,
                        dy.bf(),
                        dense ? nullptr : doff.ptr,
                        dense ? off.back() : rows,
                        n,
                        k,
                        experts};
    p.tile = tile;
    gemm.run(p, stream_);
    sync();
    std::vector<uint16_t> ref(static_cast<size_t>(rows * n), 0xffff);
    moe_gemm_w8a8_reference(xq.data(), xs.data(), wq.data(), ws.data(),
                            dense ? nullptr : off.data(), dense ? off.back() : rows, n, k, experts,
                            reinterpret_cast<__nv_bfloat16*>(ref.data()));
    const auto got = dy.download();
    const int64_t routed = off.back();
    std::vector<float> g(got.begin(), got.begin() + routed * n), r(routed * n);
    for (int64_t i = 0; i < routed * n; ++i) {
      g[i] = bf16_to_f32(got[i]);
      r[i] = bf16_to_f32(ref[i]);
    }
    EXPECT_LT(test_util::rel_err(g, r), 5e-3)
        << "experts " << experts << " n " << n << " k " << k << " tile " << static_cast<int>(tile);
    int64_t touched = 0;
    for (int64_t i = routed * n; i < rows * n; ++i) touched += got[i] != 0xffff;
    EXPECT_EQ(touched, 0) << "rows past the last offset were written";
  }
};

TEST_F(CudaMoeGemmW8A8, GroupedMatchesReference) {
  SCOPED_TRACE(trace());
  MoeGemmW8A8 gemm;
  struct Case {
    int64_t experts, n, k, rows_hint;
    MoeGemmW8A8Tile tile;
  };
  for (const Case c : {Case{8, 256, 384, 300, MoeGemmW8A8Tile::kPrefill},
                       Case{8, 256, 384, 300, MoeGemmW8A8Tile::kDecode},
                       Case{5, 144, 256, 70, MoeGemmW8A8Tile::kAuto},
                       Case{16, 384, 128, 9, MoeGemmW8A8Tile::kDecode},
                       Case{3, 528, 640, 200, MoeGemmW8A8Tile::kPrefill}}) {
    const auto off = offsets_for(c.experts, c.rows_hint);
    check(gemm, c.experts, c.n, c.k, off, 7, c.tile, false);
  }
}

TEST_F(CudaMoeGemmW8A8, DenseAndAllEmpty) {
  SCOPED_TRACE(trace());
  MoeGemmW8A8 gemm;
  check(gemm, 1, 272, 512, {0, 77}, 0, MoeGemmW8A8Tile::kPrefill, true);
  check(gemm, 1, 272, 512, {0, 77}, 0, MoeGemmW8A8Tile::kDecode, true);
  // Every expert empty: nothing written.
  check(gemm, 6, 128, 256, std::vector<int32_t>(7, 0), 5, MoeGemmW8A8Tile::kDecode, false);
  check(gemm, 6, 128, 256, std::vector<int32_t>(7, 0), 5, MoeGemmW8A8Tile::kPrefill, false);
}

// Captured once, replayed after the routing (device offsets) changed: the graph reads the new
// counts, no host synchronisation.
TEST_F(CudaMoeGemmW8A8, GraphReplayReadsDeviceOffsets) {
  SCOPED_TRACE(trace());
  // rows: room for offsets_for's routing (expert 3 always takes 129 rows).
  const int64_t experts = 12, n = 256, k = 256, rows = 256, kb = k / 128;
  MoeGemmW8A8 gemm;
  gemm.prepare(experts);
  auto xq = codes(static_cast<size_t>(rows * k));
  auto xs = scales(static_cast<size_t>(rows * kb), 0.25f, 2.0f);
  auto wq = codes(static_cast<size_t>(experts * n * k));
  auto ws = scales(static_cast<size_t>(experts * n * kb), 1e-4f, 2e-3f);
  DeviceBuffer<uint8_t> dx(xq), dw(wq);
  DeviceBuffer<float> dxs(xs), dws(ws);
  DeviceBuffer<int32_t> doff(static_cast<size_t>(experts + 1));
  DeviceBuffer<uint16_t> dy(static_cast<size_t>(rows * n));
  doff.upload(offsets_for(experts, 6));
  MoeGemmW8A8Params p{dx.ptr, dxs.ptr, dw.ptr, dws.ptr, dy.bf(), doff.ptr, rows, n, k, experts};
  p.tile = MoeGemmW8A8Tile::kDecode;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  gemm.run(p, stream_);
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < 2; ++round) {
    auto off = offsets_for(experts, 7);
    ASSERT_LE(off.back(), rows);
    doff.upload(off);
    dy.poison(0xff);
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    sync();
    std::vector<uint16_t> ref(static_cast<size_t>(rows * n), 0xffff);
    moe_gemm_w8a8_reference(xq.data(), xs.data(), wq.data(), ws.data(), off.data(), rows, n, k,
                            experts, reinterpret_cast<__nv_bfloat16*>(ref.data()));
    const auto got = dy.download();
    std::vector<float> g(off.back() * n), r(off.back() * n);
    for (int64_t i = 0; i < off.back() * n; ++i) {
      g[i] = bf16_to_f32(got[i]);
      r[i] = bf16_to_f32(ref[i]);
    }
    EXPECT_LT(test_util::rel_err(g, r), 5e-3) << "round " << round;
    int64_t touched = 0;
    for (int64_t i = off.back() * n; i < rows * n; ++i) touched += got[i] != 0xffff;
    EXPECT_EQ(touched, 0);
  }
  TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
}

// Checked before anything touches the device: runs without a GPU too.
TEST(MoeGemmW8A8Checks, RefusesKNotMultipleOf128) {
  MoeGemmW8A8 gemm;
  MoeGemmW8A8Params p{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 16, 256, 200, 4};
  try {
    gemm.run(p, nullptr);
    FAIL() << "k = 200 accepted";
  } catch (Error const& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("k (200)"), std::string::npos) << e.what();
  }
  p.k = 256;
  p.n = 100;
  EXPECT_THROW(gemm.run(p, nullptr), Error);
  SiluMulFp8Params s{nullptr, nullptr, nullptr, nullptr, 4, 200};
  EXPECT_THROW(silu_mul_quantize_fp8_launch(s, nullptr), Error);
  Fp8GatherQuantParams gq{};
  gq.k = 96;
  gq.rows = 1;
  EXPECT_THROW(fp8_gather_quantize_launch(gq, nullptr), Error);
  RmsNormFp8Params rn{};
  rn.dim = 200;
  rn.rows = 1;
  EXPECT_THROW(rms_norm_quantize_fp8_launch(rn, nullptr), Error);
}

// ---- fused quantizers ----

class CudaFp8ActQuant : public test_util::CudaFixture<> {
 protected:
  Bits random_bf16(size_t n, float scale) {
    std::normal_distribution<float> d(0.f, scale);
    Bits b(n);
    for (auto& v : b) v = f32_to_bf16(d(rng_));
    return b;
  }
  // Codes equal except where the bf16 input moved by an ulp (GPU expf / sum order): at most
  // 1 in 500, and the dequantized values within 1e-2 relative overall.
  static void expect_close(std::vector<uint8_t> const& q, std::vector<float> const& s,
                           std::vector<uint8_t> const& rq, std::vector<float> const& rs,
                           int64_t rows, int64_t dim, bool exact) {
    int64_t diff = 0;
    std::vector<float> a(rows * dim), b(rows * dim);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < dim; ++i) {
        const size_t j = static_cast<size_t>(r * dim + i);
        diff += q[j] != rq[j];
        a[j] = f8e4m3_to_f32(q[j]) * s[r * (dim / 128) + i / 128];
        b[j] = f8e4m3_to_f32(rq[j]) * rs[r * (dim / 128) + i / 128];
      }
    }
    if (exact) {
      EXPECT_EQ(diff, 0);
    } else {
      EXPECT_LE(diff, rows * dim / 500);
    }
    EXPECT_LT(test_util::rel_err(a, b), 1e-2);
  }
};

TEST_F(CudaFp8ActQuant, RmsNormQuantizeMatchesReference) {
  SCOPED_TRACE(trace());
  for (const bool with_residual : {false, true}) {
    for (const int64_t dim : {128, 640, 2048, 8192}) {
      const int64_t rows = 37;
      Bits x = random_bf16(rows * dim, 1.0f), res = random_bf16(rows * dim, 2.0f),
           w = random_bf16(dim, 0.5f);
      DeviceBuffer<uint16_t> dx(x), dres(res), dw(w), dout(rows * dim);
      DeviceBuffer<uint8_t> dq(rows * dim);
      DeviceBuffer<float> ds(rows * dim / 128);
      dout.poison(0xff);
      dq.poison(0xff);
      ds.poison(0xff);
      RmsNormFp8Params p{dx.bf(), with_residual ? dres.bf() : nullptr,
                         dw.bf(), dout.bf(),
                         dq.ptr,  ds.ptr,
                         rows,    dim,
                         1e-6f};
      rms_norm_quantize_fp8_launch(p, stream_);
      sync();
      Bits rout(rows * dim), rres = res;
      std::vector<uint8_t> rq(rows * dim);
      std::vector<float> rs(rows * dim / 128);
      RmsNormFp8Params rp{reinterpret_cast<__nv_bfloat16 const*>(x.data()),
                          with_residual ? reinterpret_cast<__nv_bfloat16*>(rres.data()) : nullptr,
                          reinterpret_cast<__nv_bfloat16 const*>(w.data()),
                          reinterpret_cast<__nv_bfloat16*>(rout.data()),
                          rq.data(),
                          rs.data(),
                          rows,
                          dim,
                          1e-6f};
      rms_norm_quantize_fp8_reference(rp);
      expect_close(dq.download(), ds.download(), rq, rs, rows, dim, false);
      EXPECT_LT(test_util::rel_err(to_f32(dout.download()), to_f32(rout)), 1e-2);
      if (with_residual) {
        EXPECT_EQ(dres.download(), rres);  // bf16(residual + x): exact
      }
    }
  }
}

TEST_F(CudaFp8ActQuant, GatherQuantizeMatchesReference) {
  SCOPED_TRACE(trace());
  const int64_t tokens = 29, top_k = 8, k = 768, rows = tokens * top_k + 5;
  Bits x = random_bf16(tokens * k, 3.0f);
  std::vector<int32_t> src(rows);
  std::iota(src.begin(), src.end(), 0);
  std::shuffle(src.begin(), src.begin() + tokens * top_k, rng_);
  const int32_t count = static_cast<int32_t>(tokens * top_k);
  DeviceBuffer<uint16_t> dx(x);
  DeviceBuffer<int32_t> dsrc(src), dcount(std::vector<int32_t>{count});
  DeviceBuffer<uint8_t> dq(rows * k);
  DeviceBuffer<float> ds(rows * k / 128);
  dq.poison(0x7f);
  ds.poison(0xff);
  Fp8GatherQuantParams p{dx.bf(), dsrc.ptr, top_k, dcount.ptr, dq.ptr, ds.ptr, rows, k};
  fp8_gather_quantize_launch(p, stream_);
  sync();
  std::vector<uint8_t> rq(rows * k, 0x7f);
  std::vector<float> rs(rows * k / 128);
  Fp8GatherQuantParams rp{reinterpret_cast<__nv_bfloat16 const*>(x.data()),
                          src.data(),
                          top_k,
                          &count,
                          rq.data(),
                          rs.data(),
                          rows,
                          k};
  fp8_gather_quantize_reference(rp);
  const auto q = dq.download();
  const auto s = ds.download();
  expect_close(q, s, rq, rs, count, k, true);
  // Rows past the device count untouched.
  for (int64_t i = count * k; i < rows * k; ++i) ASSERT_EQ(q[i], 0x7f) << i;
}

TEST_F(CudaFp8ActQuant, SiluMulQuantizeMatchesReference) {
  SCOPED_TRACE(trace());
  for (const int64_t interleave : {0, 8}) {
    for (const int64_t inter : {128, 768, 1536}) {
      SCOPED_TRACE("interleave " + std::to_string(interleave));
      const int64_t rows = 53, live = 41;
      Bits gu = random_bf16(rows * 2 * inter, 2.0f);
      DeviceBuffer<uint16_t> dgu(gu);
      DeviceBuffer<int32_t> dcount(std::vector<int32_t>{static_cast<int32_t>(live)});
      DeviceBuffer<uint8_t> dq(rows * inter);
      DeviceBuffer<float> ds(rows * inter / 128);
      dq.poison(0x7f);
      ds.poison(0xff);
      SiluMulFp8Params p{dgu.bf(), dcount.ptr, dq.ptr, ds.ptr, rows, inter, interleave};
      silu_mul_quantize_fp8_launch(p, stream_);
      sync();
      std::vector<uint8_t> rq(rows * inter, 0x7f);
      std::vector<float> rs(rows * inter / 128);
      const int32_t count = static_cast<int32_t>(live);
      SiluMulFp8Params rp{reinterpret_cast<__nv_bfloat16 const*>(gu.data()),
                          &count,
                          rq.data(),
                          rs.data(),
                          rows,
                          inter,
                          interleave};
      silu_mul_quantize_fp8_reference(rp);
      const auto q = dq.download();
      expect_close(q, ds.download(), rq, rs, live, inter, false);
      for (int64_t i = live * inter; i < rows * inter; ++i) ASSERT_EQ(q[i], 0x7f) << i;
    }
  }
}

// The chain the MoE layer runs on FP8: gather -> FP8, gate_up GEMM, SiLU-mul -> FP8, down GEMM,
// against the same chain on the CPU references.
TEST_F(CudaMoeGemmW8A8, ChainMatchesReference) {
  SCOPED_TRACE(trace());
  const int64_t experts = 6, tokens = 23, top_k = 2, hidden = 256, inter = 256;
  const int64_t rows = tokens * top_k;
  std::normal_distribution<float> nd(0.f, 1.f);
  Bits x(tokens * hidden);
  for (auto& v : x) v = f32_to_bf16(nd(rng_));
  // Routing grouped by expert: src = token * top_k + slot.
  std::vector<std::vector<int32_t>> by(experts);
  std::uniform_int_distribution<int> de(0, static_cast<int>(experts) - 2);  // last one empty
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t s = 0; s < top_k; ++s) by[de(rng_)].push_back(static_cast<int32_t>(t * top_k + s));
  std::vector<int32_t> src, off{0};
  for (auto const& v : by) {
    src.insert(src.end(), v.begin(), v.end());
    off.push_back(static_cast<int32_t>(src.size()));
  }
  auto gw = codes(experts * 2 * inter * hidden), dw = codes(experts * hidden * inter);
  auto gs = scales(experts * 2 * inter * (hidden / 128), 1e-4f, 1e-3f);
  auto ds_ = scales(experts * hidden * (inter / 128), 1e-4f, 1e-3f);
  DeviceBuffer<uint16_t> dx(x), dgu(rows * 2 * inter), dy(rows * hidden);
  DeviceBuffer<int32_t> dsrc(src), doff(off);
  DeviceBuffer<uint8_t> dxq(rows * hidden), dhq(rows * inter), dgw(gw), ddw(dw);
  DeviceBuffer<float> dxs(rows * hidden / 128), dhs(rows * inter / 128), dgs(gs), dds(ds_);
  dy.poison(0xff);
  MoeGemmW8A8 gemm;
  fp8_gather_quantize_launch(
      {dx.bf(), dsrc.ptr, top_k, doff.ptr + experts, dxq.ptr, dxs.ptr, rows, hidden}, stream_);
  gemm.run(
      {dxq.ptr, dxs.ptr, dgw.ptr, dgs.ptr, dgu.bf(), doff.ptr, rows, 2 * inter, hidden, experts},
      stream_);
  silu_mul_quantize_fp8_launch({dgu.bf(), doff.ptr + experts, dhq.ptr, dhs.ptr, rows, inter},
                               stream_);
  gemm.run({dhq.ptr, dhs.ptr, ddw.ptr, dds.ptr, dy.bf(), doff.ptr, rows, hidden, inter, experts},
           stream_);
  sync();
  // CPU chain.
  std::vector<uint8_t> xq(rows * hidden), hq(rows * inter);
  std::vector<float> xs(rows * hidden / 128), hs(rows * inter / 128);
  Bits gu(rows * 2 * inter), y(rows * hidden);
  const int32_t count = off.back();
  fp8_gather_quantize_reference({reinterpret_cast<__nv_bfloat16 const*>(x.data()), src.data(),
                                 top_k, &count, xq.data(), xs.data(), rows, hidden});
  moe_gemm_w8a8_reference(xq.data(), xs.data(), gw.data(), gs.data(), off.data(), rows, 2 * inter,
                          hidden, experts, reinterpret_cast<__nv_bfloat16*>(gu.data()));
  silu_mul_quantize_fp8_reference({reinterpret_cast<__nv_bfloat16 const*>(gu.data()), &count,
                                   hq.data(), hs.data(), rows, inter});
  moe_gemm_w8a8_reference(hq.data(), hs.data(), dw.data(), ds_.data(), off.data(), rows, hidden,
                          inter, experts, reinterpret_cast<__nv_bfloat16*>(y.data()));
  EXPECT_LT(test_util::rel_err(to_f32(dy.download()), to_f32(y)), 3e-2);
}

}  // namespace
}  // namespace tandem::cuda

namespace tandem::cuda {
namespace {

// MXFP8 -> per-row 128-column power-of-two scales (CPU; runs without a GPU): exact where the
// shifted value stays normal, at most half a subnormal step of the block scale off below.
TEST(Mxfp8Row128, ShiftIsExactOutsideTheSubnormalTail) {
  const uint32_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int64_t n = 9, k = 384;
  std::uniform_int_distribution<int> db(0, 255), de(118, 130);
  std::vector<uint8_t> q(n * k), e(n * (k / 32)), qo(n * k);
  for (auto& c : q) {
    int b = db(rng);
    while ((b & 0x7f) == 0x7f) b = db(rng);
    c = static_cast<uint8_t>(b);
  }
  for (auto& c : e) c = static_cast<uint8_t>(de(rng));
  std::vector<float> rs(n * (k / 128));
  const int64_t changed = mxfp8_to_row128(q.data(), e.data(), n, k, qo.data(), rs.data());
  int64_t diff = 0;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < k; ++j) {
      const float s = rs[r * (k / 128) + j / 128];
      const double mx =
          f8e4m3_to_f32(q[r * k + j]) * std::ldexp(1.0, e[r * (k / 32) + j / 32] - 127);
      const double got = f8e4m3_to_f32(qo[r * k + j]) * double(s);
      if (got != mx) {
        ++diff;
        EXPECT_LT(std::fabs(mx), std::ldexp(double(s), -6)) << r << " " << j;
        EXPECT_LE(std::fabs(got - mx), std::ldexp(double(s), -10)) << r << " " << j;
      }
    }
  }
  EXPECT_EQ(diff, changed);
  EXPECT_GT(changed, 0);  // exponents differ by up to 12: some tiny codes must round
  // One exponent per 128 columns: the codes pass through.
  for (auto& c : e) c = 125;
  EXPECT_EQ(mxfp8_to_row128(q.data(), e.data(), n, k, qo.data(), rs.data()), 0);
  EXPECT_EQ(qo, q);
  EXPECT_THROW(mxfp8_to_row128(q.data(), e.data(), n, 96, qo.data(), rs.data()), Error);
}

}  // namespace
}  // namespace tandem::cuda
