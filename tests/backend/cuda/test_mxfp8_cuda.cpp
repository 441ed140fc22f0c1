// The W8A16 kernels with native MXFP8 scales (fp8_linear.h: Fp8GemvParams::w_e8m0,
// MoeGemmParams::w_e8m0, mxfp8_dequantize_launch, MoeLayerWeights::*_e8m0) against the CPU
// reference: dequantize (W = e4m3(q) * 2^(e - 127) per row and 32 columns, exact in float)
// then the fp32 / double math over bf16 activations. Fresh random codes (every non-NaN E4M3
// code, subnormals included) and E8M0 codes spread over the native range (its ends included)
// every run (the seed is printed on failure); outputs poisoned first, elements past the output
// checked untouched. K not a multiple of 32 or 128 (a partial last scale block), skewed routing
// with empty experts. GPU tests skip (GTEST_SKIP) without a CUDA device; the range check runs
// anywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_layer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::DeviceBuffer;
using test_util::to_f32;

constexpr size_t kGuard = 64;

double rel_err(std::vector<float> const& out, std::vector<double> const& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// A random MXFP8 matrix [n, k]: E4M3 codes and E8M0 codes [n, ceil(k / 32)].
struct MxMatrix {
  int64_t n = 0, k = 0;
  std::vector<uint8_t> q, e;
  float at(int64_t r, int64_t c) const {
    return f8e4m3_to_f32(q[static_cast<size_t>(r * k + c)]) *
           std::ldexp(1.0f,
                      static_cast<int>(
                          e[static_cast<size_t>(r * mxfp8_scale_cols(k) + c / kMxfp8BlockK)]) -
                          127);
  }
};

class Mxfp8Cuda : public test_util::CudaFixture<> {
 protected:
  // E8M0 codes of very different sizes per block (a wrong block lookup shows): 2^-14 .. 2^-4,
  // and now and then the native range's ends.
  MxMatrix rand_matrix(int64_t n, int64_t k) {
    MxMatrix m;
    m.n = n;
    m.k = k;
    m.q.resize(static_cast<size_t>(n * k));
    std::uniform_int_distribution<int> code(0, 255);
    for (auto& c : m.q) {
      int v = code(rng_);
      while ((v & 0x7f) == 0x7f) v = code(rng_);
      c = static_cast<uint8_t>(v);
    }
    std::uniform_int_distribution<int> e(127 - 14, 127 - 4);
    m.e.resize(static_cast<size_t>(n * mxfp8_scale_cols(k)));
    for (auto& s : m.e) s = static_cast<uint8_t>(e(rng_));
    return m;
  }
  Bits randn_bf16(size_t n, float scale = 1.f) {
    std::normal_distribution<float> d(0.f, scale);
    Bits b(n);
    for (auto& v : b) v = f32_to_bf16(d(rng_));
    return b;
  }
};

std::vector<double> ref_gemm(Bits const& x, int64_t m, MxMatrix const& w, int64_t n) {
  std::vector<double> y(static_cast<size_t>(m * n));
  std::vector<float> wr(static_cast<size_t>(w.k));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < w.k; ++j) wr[j] = w.at(r, j);
    for (int64_t i = 0; i < m; ++i) {
      double s = 0;
      for (int64_t j = 0; j < w.k; ++j) s += double(bf16_to_f32(x[i * w.k + j])) * wr[j];
      y[static_cast<size_t>(i * n + r)] = s;
    }
  }
  return y;
}

TEST(Mxfp8Range, CodesInRange) {
  std::vector<uint8_t> e = {kMxfp8MinCode, 127, kMxfp8MaxCode};
  EXPECT_TRUE(mxfp8_codes_in_range(e.data(), 3));
  e[1] = kMxfp8MinCode - 1;
  EXPECT_FALSE(mxfp8_codes_in_range(e.data(), 3));
  e[1] = kMxfp8MaxCode + 1;
  EXPECT_FALSE(mxfp8_codes_in_range(e.data(), 3));
  EXPECT_TRUE(mxfp8_codes_in_range(e.data(), 1));
  EXPECT_EQ(mxfp8_scale_cols(32), 1);
  EXPECT_EQ(mxfp8_scale_cols(48), 2);
}

// Every code times every scale class: row r holds code r % 256 in column 0 with E8M0 code
// kMin, 127 or kMax; x = e_0: y[r] is the dequantized value exactly (fp32 output).
TEST_F(Mxfp8Cuda, GemvConvertsEveryCodeExactly) {
  const int64_t n = 768, k = 16;
  MxMatrix w;
  w.n = n;
  w.k = k;
  w.q.assign(static_cast<size_t>(n * k), 0);
  w.e.resize(static_cast<size_t>(n));
  const uint8_t ends[3] = {kMxfp8MinCode, 127, kMxfp8MaxCode};
  for (int64_t r = 0; r < n; ++r) {
    const int c = static_cast<int>(r % 256);
    w.q[r * k] = (c & 0x7f) == 0x7f ? 0 : static_cast<uint8_t>(c);
    w.e[r] = ends[r / 256];
  }
  Bits x(k, 0);
  x[0] = f32_to_bf16(1.0f);
  DeviceBuffer<uint16_t> dx(x);
  DeviceBuffer<uint8_t> dw(w.q), de(w.e);
  DeviceBuffer<float> dy(n);
  dy.poison(0xff);
  Fp8GemvParams p{dx.bf(), dw.ptr, nullptr, nullptr, 1, n, k, dy.ptr};
  p.w_e8m0 = de.ptr;
  fp8_gemv_launch(p, stream_);
  const auto y = dy.download();
  for (int64_t r = 0; r < n; ++r) {
    ASSERT_EQ(y[r], w.at(r, 0)) << "code 0x" << std::hex << r % 256 << " e8m0 " << std::dec
                                << int(w.e[r]);
  }
}

TEST_F(Mxfp8Cuda, GemvMatchesReference) {
  struct Shape {
    int64_t n, k;
  };
  for (const Shape s :
       {Shape{1, 16}, Shape{37, 144}, Shape{300, 1040}, Shape{129, 2048}, Shape{64, 4112}}) {
    const MxMatrix w = rand_matrix(s.n, s.k);
    DeviceBuffer<uint8_t> dw(w.q), de(w.e);
    for (int64_t m = 1; m <= kFp8GemvMaxM; m += (m < 3 ? 1 : 5)) {
      SCOPED_TRACE(trace() + " m " + std::to_string(m) + " n " + std::to_string(s.n) + " k " +
                   std::to_string(s.k));
      const Bits x = randn_bf16(static_cast<size_t>(m * s.k));
      const auto ref = ref_gemm(x, m, w, s.n);
      DeviceBuffer<uint16_t> dx(x);
      const size_t out = static_cast<size_t>(m * s.n);
      DeviceBuffer<uint16_t> dy(out + kGuard);
      dy.poison(0xff);
      Fp8GemvParams p{dx.bf(), dw.ptr, nullptr, dy.bf(), m, s.n, s.k};
      p.w_e8m0 = de.ptr;
      fp8_gemv_launch(p, stream_);
      const auto y = dy.download();
      for (size_t i = out; i < out + kGuard; ++i) ASSERT_EQ(y[i], 0xffff) << "wrote past y";
      EXPECT_LT(rel_err(to_f32(Bits(y.begin(), y.begin() + out)), ref), 6e-3);
      DeviceBuffer<float> dyf(out + kGuard);
      dyf.poison(0xff);
      p.y = nullptr;
      p.y_f32 = dyf.ptr;
      fp8_gemv_launch(p, stream_);
      const auto yf = dyf.download();
      for (size_t i = out; i < out + kGuard; ++i) ASSERT_TRUE(std::isnan(yf[i]));
      EXPECT_LT(rel_err(std::vector<float>(yf.begin(), yf.begin() + out), ref), 3e-5);
    }
  }
}

// Prefill: bf16(e4m3 * 2^(e - 127)), exactly the bf16 model's load of the dequantized weights.
TEST_F(Mxfp8Cuda, DequantizeMatchesTheLoad) {
  const MxMatrix w = rand_matrix(130, 400);
  DeviceBuffer<uint8_t> dw(w.q), de(w.e);
  DeviceBuffer<uint16_t> out(static_cast<size_t>(w.n * w.k) + kGuard);
  out.poison(0xff);
  mxfp8_dequantize_launch(dw.ptr, de.ptr, w.n, w.k, out.bf(), stream_);
  const auto got = out.download();
  for (int64_t r = 0; r < w.n; ++r) {
    for (int64_t c = 0; c < w.k; ++c) {
      ASSERT_EQ(got[r * w.k + c], f32_to_bf16(w.at(r, c))) << r << "," << c;
    }
  }
  for (size_t i = static_cast<size_t>(w.n * w.k); i < got.size(); ++i) ASSERT_EQ(got[i], 0xffff);
  EXPECT_THROW(mxfp8_dequantize_launch(dw.ptr, nullptr, 2, 32, out.bf(), stream_), Error);
}

constexpr MoeGemmTile kTiles[] = {MoeGemmTile::kAuto, MoeGemmTile::kSmall, MoeGemmTile::kMedium,
                                  MoeGemmTile::kLarge};

float silu(double g) { return static_cast<float>(g / (1.0 + std::exp(-g))); }

// Grouped GEMM with MXFP8 experts, plain (down) and fused SiLU-multiply (gate_up, rows and
// E8M0 rows packed alike), skewed routing (empty experts, one with most rows), gathered rows.
TEST_F(Mxfp8Cuda, MoeGemmMatchesReference) {
  const int64_t E = 6, K = 272, I = 48, top_k = 2, N = 200;
  const std::vector<int32_t> counts = {0, 1, 37, 0, 150, 9};
  std::vector<int32_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  const int64_t rows = offsets[E], max_rows = rows + 11, T = 120;
  std::uniform_int_distribution<int32_t> slot(0, static_cast<int32_t>(T * top_k - 1));
  std::vector<int32_t> src(static_cast<size_t>(max_rows));
  for (auto& v : src) v = slot(rng_);
  const Bits x = randn_bf16(static_cast<size_t>(T * K));
  const int64_t ke = mxfp8_scale_cols(K);
  std::vector<MxMatrix> down, gate, up;
  std::vector<uint8_t> q_down, q_gu, e_down, e_gu;
  for (int64_t e = 0; e < E; ++e) {
    down.push_back(rand_matrix(N, K));
    q_down.insert(q_down.end(), down[e].q.begin(), down[e].q.end());
    e_down.insert(e_down.end(), down[e].e.begin(), down[e].e.end());
    gate.push_back(rand_matrix(I, K));
    up.push_back(rand_matrix(I, K));
    std::vector<uint8_t> pq(static_cast<size_t>(2 * I * K)), pe(static_cast<size_t>(2 * I * ke));
    moe_pack_gate_up_rows(gate[e].q.data(), up[e].q.data(), I, static_cast<size_t>(K), pq.data());
    moe_pack_gate_up_rows(gate[e].e.data(), up[e].e.data(), I, static_cast<size_t>(ke), pe.data());
    q_gu.insert(q_gu.end(), pq.begin(), pq.end());
    e_gu.insert(e_gu.end(), pe.begin(), pe.end());
  }
  std::vector<double> ref_down(static_cast<size_t>(rows * N)),
      ref_act(static_cast<size_t>(rows * I));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const Bits xr(x.begin() + (src[r] / top_k) * K, x.begin() + (src[r] / top_k + 1) * K);
      const auto yd = ref_gemm(xr, 1, down[e], N);
      std::copy(yd.begin(), yd.end(), ref_down.begin() + r * N);
      const auto yg = ref_gemm(xr, 1, gate[e], I), yu = ref_gemm(xr, 1, up[e], I);
      for (int64_t i = 0; i < I; ++i) ref_act[r * I + i] = silu(yg[i]) * yu[i];
    }
  }
  DeviceBuffer<uint16_t> dx(x);
  DeviceBuffer<int32_t> doff(offsets), dsrc(src);
  DeviceBuffer<uint8_t> dqd(q_down), dqg(q_gu), ded(e_down), deg(e_gu);
  for (const MoeGemmTile tile : kTiles) {
    SCOPED_TRACE(trace() + " tile " + std::to_string(static_cast<int>(tile)));
    for (const bool silu_mul : {false, true}) {
      const int64_t n_out = silu_mul ? I : N;
      DeviceBuffer<uint16_t> dy(static_cast<size_t>(max_rows * n_out) + kGuard);
      dy.poison(0xff);
      MoeGemmParams p{
          dx.bf(),  nullptr,  dy.bf(),
          doff.ptr, max_rows, silu_mul ? 2 * I : N,
          K,        E,        silu_mul ? MoeGemmEpilogue::kSiluMul : MoeGemmEpilogue::kPlain,
          tile};
      p.gather_src = dsrc.ptr;
      p.gather_div = top_k;
      p.w_fp8 = silu_mul ? dqg.ptr : dqd.ptr;
      p.w_e8m0 = silu_mul ? deg.ptr : ded.ptr;
      moe_gemm_launch(p, stream_);
      const auto y = dy.download();
      for (size_t i = static_cast<size_t>(rows * n_out); i < y.size(); ++i) {
        ASSERT_EQ(y[i], 0xffff) << "wrote past the routed rows at " << i;
      }
      const Bits got(y.begin(), y.begin() + rows * n_out);
      EXPECT_LT(rel_err(to_f32(got), silu_mul ? ref_act : ref_down), 6e-3)
          << (silu_mul ? "gate_up" : "down");
      // W8A8 takes per-128 scales only: refused.
      p.fp8_activations = true;
      EXPECT_THROW(moe_gemm_launch(p, stream_), Error);
    }
  }
}

// A dense matrix as one expert without offsets, every tile.
TEST_F(Mxfp8Cuda, DenseGemmMatchesReference) {
  const MxMatrix w = rand_matrix(264, 1040);
  DeviceBuffer<uint8_t> dw(w.q), de(w.e);
  for (const int64_t m : {1, 9, 70, 300}) {
    for (const MoeGemmTile tile : kTiles) {
      SCOPED_TRACE(trace() + " m " + std::to_string(m) + " tile " +
                   std::to_string(static_cast<int>(tile)));
      const Bits x = randn_bf16(static_cast<size_t>(m * w.k));
      DeviceBuffer<uint16_t> dx(x);
      DeviceBuffer<uint16_t> dy(static_cast<size_t>(m * w.n) + kGuard);
      dy.poison(0xff);
      MoeGemmParams p{dx.bf(), nullptr, dy.bf(), nullptr, m, w.n, w.k, 1};
      p.tile = tile;
      p.w_fp8 = dw.ptr;
      p.w_e8m0 = de.ptr;
      moe_gemm_launch(p, stream_);
      const auto y = dy.download();
      for (size_t i = static_cast<size_t>(m * w.n); i < y.size(); ++i) ASSERT_EQ(y[i], 0xffff);
      EXPECT_LT(rel_err(to_f32(Bits(y.begin(), y.begin() + m * w.n)), ref_gemm(x, m, w, w.n)),
                6e-3);
    }
  }
}

// The whole MoE block with MXFP8 experts against the same block over their dequantized bf16
// weights: decode path, mma path, and a prefill batch on the cuBLAS paths (bit for bit: the
// experts dequantized on the device are the bf16 weights).
TEST_F(Mxfp8Cuda, MoeLayerMatchesDequantizedBf16) {
  const int64_t H = 256, I = 96, E = 16, top_k = 4, max_tokens = 600;
  const int64_t keh = mxfp8_scale_cols(H);
  std::vector<uint8_t> q_gu, q_dn, e_gu, e_dn;
  Bits gu16, dn16;
  for (int64_t e = 0; e < E; ++e) {
    MxMatrix g = rand_matrix(I, H), u = rand_matrix(I, H), d = rand_matrix(H, I);
    std::vector<uint8_t> pq(static_cast<size_t>(2 * I * H)), pe(static_cast<size_t>(2 * I * keh));
    moe_pack_gate_up_rows(g.q.data(), u.q.data(), I, static_cast<size_t>(H), pq.data());
    moe_pack_gate_up_rows(g.e.data(), u.e.data(), I, static_cast<size_t>(keh), pe.data());
    q_gu.insert(q_gu.end(), pq.begin(), pq.end());
    e_gu.insert(e_gu.end(), pe.begin(), pe.end());
    q_dn.insert(q_dn.end(), d.q.begin(), d.q.end());
    e_dn.insert(e_dn.end(), d.e.begin(), d.e.end());
    Bits gb(static_cast<size_t>(I * H)), ub(gb.size()), pb(2 * gb.size());
    for (int64_t r = 0; r < I; ++r) {
      for (int64_t c = 0; c < H; ++c) {
        gb[r * H + c] = f32_to_bf16(g.at(r, c));
        ub[r * H + c] = f32_to_bf16(u.at(r, c));
      }
    }
    moe_pack_gate_up(reinterpret_cast<bf16 const*>(gb.data()),
                     reinterpret_cast<bf16 const*>(ub.data()), I, H,
                     reinterpret_cast<bf16*>(pb.data()));
    gu16.insert(gu16.end(), pb.begin(), pb.end());
    for (int64_t r = 0; r < H; ++r) {
      for (int64_t c = 0; c < I; ++c) dn16.push_back(f32_to_bf16(d.at(r, c)));
    }
  }
  const Bits router = randn_bf16(static_cast<size_t>(E * H));
  DeviceBuffer<uint16_t> drouter(router), dgu16(gu16), ddn16(dn16);
  DeviceBuffer<uint8_t> dqgu(q_gu), dqdn(q_dn), degu(e_gu), dedn(e_dn);
  MoeLayerWeights w16{drouter.bf(), dgu16.bf(), ddn16.bf()};
  MoeLayerWeights w8{drouter.bf(), nullptr, nullptr, dqgu.ptr, nullptr, dqdn.ptr, nullptr};
  w8.gate_up_e8m0 = degu.ptr;
  w8.down_e8m0 = dedn.ptr;
  MoeLayer layer(max_tokens, H, I, E, top_k, 0, E, true);
  GemmLt gemm;
  for (const int64_t T : {1, 5, 8, 40, 600}) {
    SCOPED_TRACE(trace() + " tokens " + std::to_string(T));
    const Bits x = randn_bf16(static_cast<size_t>(T * H), 0.25f);
    DeviceBuffer<uint16_t> dx(x), out16(static_cast<size_t>(T * H)),
        out8(static_cast<size_t>(T * H));
    out16.poison(0xff);
    out8.poison(0xff);
    layer.run(w16, dx.bf(), out16.bf(), T, gemm, stream_);
    const MoeLayerPath bf16_path = layer.last_path();
    layer.run(w8, dx.bf(), out8.bf(), T, gemm, stream_);
    EXPECT_EQ(layer.last_path(), bf16_path);
    const auto ref16 = out16.download();
    const auto got8 = out8.download();
    if (bf16_path == MoeLayerPath::kCublas || bf16_path == MoeLayerPath::kPadded) {
      EXPECT_EQ(got8, ref16) << "prefill path " << static_cast<int>(bf16_path);
    }
    const auto ref = to_f32(ref16);
    const std::vector<double> refd(ref.begin(), ref.end());
    EXPECT_LT(rel_err(to_f32(got8), refd), 1e-2);
    if (T == 600) {  // the MXFP8 grouped GEMM at prefill size instead
      layer.set_fp8_prefill_dequant(false);
      out8.poison(0xff);
      layer.run(w8, dx.bf(), out8.bf(), T, gemm, stream_);
      EXPECT_EQ(layer.last_path(), MoeLayerPath::kMma);
      EXPECT_LT(rel_err(to_f32(out8.download()), refd), 1e-2);
      layer.set_fp8_prefill_dequant(true);
    }
  }
}

}  // namespace
}  // namespace tandem::cuda
