// FP8-weight kernels (fp8_linear.h: fp8_gemv_launch; moe_gemm.h with MoeGemmParams::w_fp8)
// against the CPU reference: dequantize (W = e4m3(q) * scale of the row's 128x128 block, the
// float product) then the fp32 / double math over bf16 activations. Fresh random codes (every
// non-NaN E4M3 code, subnormals included), scales and inputs every run (the seed is printed on
// failure); outputs poisoned (NaN bytes) first, elements past the output checked untouched.
// Shapes include K and N not multiples of 128, skewed routing with empty experts. The single
// ops (gemv, dequantize, quantize rows) are cases of the kernel-test harness (ops/fp8_cases.cpp).
// GPU tests skip (GTEST_SKIP) without a CUDA device; the scale expansion and packing tests run
// anywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
#include "fp8_act_ref.h"
#include "weight_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::DeviceBuffer;
using test_util::to_f32;

constexpr size_t kGuard = 64;  // poisoned elements after each output, checked untouched

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ||out - ref|| / ||ref||, infinite on a non-finite output.
double rel_err(std::vector<float> const& out, std::vector<double> const& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

using test_util::Fp8Matrix;

class Fp8LinearCuda : public test_util::CudaFixture<> {
 protected:
  Fp8Matrix rand_matrix(int64_t n, int64_t k) {
    Fp8Matrix m;
    m.n = n;
    m.k = k;
    m.q.resize(static_cast<size_t>(n * k));
    std::uniform_int_distribution<int> code(0, 255);
    for (auto& c : m.q) {
      int v = code(rng_);
      while ((v & 0x7f) == 0x7f) v = code(rng_);  // no NaN codes (the loader refuses them)
      c = static_cast<uint8_t>(v);
    }
    // Scales of very different sizes per block: a wrong block lookup shows.
    std::uniform_real_distribution<float> e(-10.f, -4.f);
    m.block_scale.resize(static_cast<size_t>(cdiv(n, 128) * cdiv(k, 128)));
    for (auto& s : m.block_scale) s = std::exp2(e(rng_));
    return m;
  }
  // The grouped GEMM over skewed routing: W8A16 against the dequantized reference, or W8A8
  // (fp8_activations) against the quantized-activation one (tight) and the dequantized (loose).
  void check_moe_gemm(bool w8a8);
  // A dense matrix as one expert without offsets, W8A16 or W8A8, every tile.
  void check_dense_gemm(bool w8a8);
  Bits randn_bf16(size_t n) {
    std::normal_distribution<float> d(0.f, 1.f);
    Bits b(n);
    for (auto& v : b) v = f32_to_bf16(d(rng_));
    return b;
  }
};

// y[i][r] = sum_j x[i][j] W[r][j] over rows [r0, r0 + n) of w, x [m, w.k] as doubles.
std::vector<double> ref_gemm_d(std::vector<double> const& x, int64_t m, Fp8Matrix const& w,
                               int64_t r0, int64_t n) {
  std::vector<double> y(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < n; ++r) {
    std::vector<float> wr(static_cast<size_t>(w.k));
    for (int64_t j = 0; j < w.k; ++j) wr[j] = w.at(r0 + r, j);
    for (int64_t i = 0; i < m; ++i) {
      double s = 0;
      for (int64_t j = 0; j < w.k; ++j) s += x[static_cast<size_t>(i * w.k + j)] * wr[j];
      y[static_cast<size_t>(i * n + r)] = s;
    }
  }
  return y;
}

// Over the bf16 activations (W8A16: the dequantized model).
std::vector<double> ref_gemm(Bits const& x, int64_t m, Fp8Matrix const& w, int64_t r0, int64_t n) {
  std::vector<double> xd(x.size());
  for (size_t i = 0; i < x.size(); ++i) xd[i] = bf16_to_f32(x[i]);
  return ref_gemm_d(xd, m, w, r0, n);
}

// The activations as the W8A8 kernels see them: each row of x [m, k] quantized per 128-column
// group (fp8_act_ref.h), dequantized exactly (e4m3(q) * s in double).
std::vector<double> quantized_act(Bits const& x, int64_t m, int64_t k) {
  std::vector<double> xd(x.size());
  std::vector<float> g(128);
  std::vector<uint8_t> q(128);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c0 = 0; c0 < k; c0 += 128) {
      const int64_t w = std::min<int64_t>(128, k - c0);
      for (int64_t j = 0; j < w; ++j) g[j] = bf16_to_f32(x[i * k + c0 + j]);
      const double s = test_util::fp8_quantize_group_ref(g.data(), w, q.data());
      for (int64_t j = 0; j < w; ++j) xd[i * k + c0 + j] = double(f8e4m3_to_f32(q[j])) * s;
    }
  }
  return xd;
}

// Over the quantized activations (W8A8).
std::vector<double> ref_gemm_w8a8(Bits const& x, int64_t m, Fp8Matrix const& w, int64_t r0,
                                  int64_t n) {
  return ref_gemm_d(quantized_act(x, m, w.k), m, w, r0, n);
}

// ||a - b|| / ||b|| of two references.
double ref_dist(std::vector<double> const& a, std::vector<double> const& b) {
  return rel_err(std::vector<float>(a.begin(), a.end()), b);
}

TEST(Fp8RowScales, ExpandsBlockRows) {
  const std::vector<float> blocks = {1, 2, 3, 4, 5, 6};  // [2, 3]: n 130 (2 block rows), k 300
  const auto rows = fp8_expand_row_scales(blocks.data(), 130, 300, 128);
  ASSERT_EQ(rows.size(), 130u * 3);
  EXPECT_EQ(rows[0], 1);
  EXPECT_EQ(rows[127 * 3 + 2], 3);
  EXPECT_EQ(rows[128 * 3 + 0], 4);
  EXPECT_EQ(rows[129 * 3 + 2], 6);
  EXPECT_THROW(fp8_expand_row_scales(blocks.data(), 0, 300, 128), Error);
}

TEST(Fp8RowScales, PacksGateUpRows) {
  // 16 gate rows, 16 up rows of 3 bytes: packed rows 16 j + i = gate 8 j + i, 16 j + 8 + i = up.
  std::vector<uint8_t> gate(16 * 3), up(16 * 3), packed(32 * 3);
  for (size_t i = 0; i < gate.size(); ++i) {
    gate[i] = static_cast<uint8_t>(i);
    up[i] = static_cast<uint8_t>(100 + i);
  }
  moe_pack_gate_up_rows(gate.data(), up.data(), 16, 3, packed.data());
  EXPECT_EQ(packed[0], 0);
  EXPECT_EQ(packed[8 * 3], 100);
  EXPECT_EQ(packed[16 * 3], 8 * 3);
  EXPECT_EQ(packed[31 * 3 + 2], 100 + 15 * 3 + 2);
}

// The activation quantizer's reference: the group's amax lands on +-448 (code 0x7e / 0xfe), every
// element within half an E4M3 step of its value, an all-zero group gives scale 1 and zeros, a
// partial group scales by its own amax; quantized activations move a product by a few percent.
TEST(Fp8ActRef, QuantizesPerGroup) {
  std::mt19937 rng(7);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> x(128);
  std::vector<uint8_t> q(128);
  for (int rep = 0; rep < 50; ++rep) {
    const int64_t n = rep % 5 == 0 ? 16 + rep : 128;
    const float mag = std::exp2(static_cast<float>(rep % 20 - 10));
    for (int64_t j = 0; j < n; ++j) x[j] = bf16_to_f32(f32_to_bf16(d(rng) * mag));
    float amax = 0;
    int64_t arg = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), arg = j;
    }
    const float s = test_util::fp8_quantize_group_ref(x.data(), n, q.data());
    EXPECT_EQ(s, amax / 448.0f);
    EXPECT_EQ(q[arg] & 0x7f, 0x7e) << "the amax element is +-448";
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_NE(q[j] & 0x7f, 0x7f) << "NaN code";
      const double v = double(f8e4m3_to_f32(q[j])) * s;
      EXPECT_LE(std::fabs(v - x[j]), std::fabs(x[j]) * (1.0 / 16 + 1e-6) + s / 1024) << j;
    }
  }
  std::fill(x.begin(), x.end(), 0.f);
  EXPECT_EQ(test_util::fp8_quantize_group_ref(x.data(), 128, q.data()), 1.0f);
  for (uint8_t c : q) EXPECT_EQ(c & 0x7f, 0);
  // A product over quantized activations differs from the bf16 one by more than bf16 output
  // rounding (so the W8A8 tests tell the two apart) and less than the loose bound they use.
  Fp8Matrix w;
  w.n = 64;
  w.k = 272;
  w.q.resize(static_cast<size_t>(w.n * w.k));
  std::uniform_int_distribution<int> code(0, 0x7e);
  std::uniform_int_distribution<int> sign(0, 1);
  for (auto& c : w.q) c = static_cast<uint8_t>(code(rng) | (sign(rng) << 7));
  w.block_scale.assign(static_cast<size_t>(cdiv(w.n, 128) * cdiv(w.k, 128)), 1.0f / 256);
  Bits xb(static_cast<size_t>(5 * w.k));
  for (auto& v : xb) v = f32_to_bf16(d(rng));
  const double dist = ref_dist(ref_gemm_w8a8(xb, 5, w, 0, w.n), ref_gemm(xb, 5, w, 0, w.n));
  EXPECT_GT(dist, 1e-2);
  EXPECT_LT(dist, 6e-2);
}

// fp8_gemv_launch (every code, every m, row slices), fp8_dequantize_launch and
// fp8_quantize_rows_launch against the reference: the Fp8Gemv, Fp8Dequantize and
// Fp8QuantizeRows cases of the kernel-test harness (ops/fp8_cases.cpp).

TEST_F(Fp8LinearCuda, DequantizeRejectsUnsupported) {
  DeviceBuffer<uint8_t> dw(2 * 24);
  DeviceBuffer<float> ds(2);
  DeviceBuffer<uint16_t> out(2 * 24);
  EXPECT_THROW(fp8_dequantize_launch(dw.ptr, ds.ptr, 2, 24, out.bf(), stream_), Error);
}

TEST_F(Fp8LinearCuda, GemvRejectsUnsupported) {
  DeviceBuffer<uint16_t> dx(64);
  DeviceBuffer<uint8_t> dw(64);
  DeviceBuffer<float> ds(8);
  DeviceBuffer<uint16_t> dy(64);
  EXPECT_THROW(fp8_gemv_launch({dx.bf(), dw.ptr, ds.ptr, dy.bf(), 17, 2, 16}, stream_), Error);
  EXPECT_THROW(fp8_gemv_launch({dx.bf(), dw.ptr, ds.ptr, dy.bf(), 1, 2, 24}, stream_), Error);
  EXPECT_THROW(fp8_gemv_launch({dx.bf(), dw.ptr, nullptr, dy.bf(), 1, 2, 16}, stream_), Error);
  fp8_gemv_launch({dx.bf(), dw.ptr, ds.ptr, dy.bf(), 0, 2, 16}, stream_);  // m 0: nothing
}

constexpr MoeGemmTile kTiles[] = {MoeGemmTile::kAuto, MoeGemmTile::kSmall, MoeGemmTile::kMedium,
                                  MoeGemmTile::kLarge};

float silu(double g) { return static_cast<float>(g / (1.0 + std::exp(-g))); }

// Grouped GEMM with E4M3 experts, plain (down) and fused SiLU-multiply (gate_up) epilogues,
// skewed routing (empty experts, one expert with most rows), rows gathered from the tokens.
TEST_F(Fp8LinearCuda, MoeGemmMatchesReference) { check_moe_gemm(false); }

// The same on the FP8 tensor cores with the activations quantized in the kernel: within bf16
// output rounding of the reference that quantizes them the same way, within E4M3's activation
// error of the dequantized one (which the tight check tells apart: Fp8ActRef.QuantizesPerGroup).
TEST_F(Fp8LinearCuda, W8A8MoeGemmMatchesQuantizedReference) { check_moe_gemm(true); }

void Fp8LinearCuda::check_moe_gemm(bool w8a8) {
  const int64_t E = 6, K = 272, I = 48, top_k = 2;
  const std::vector<int32_t> counts = {0, 1, 37, 0, 150, 9};
  std::vector<int32_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  const int64_t rows = offsets[E], max_rows = rows + 11;  // bound above the real rows
  const int64_t T = 120;
  std::uniform_int_distribution<int32_t> slot(0, static_cast<int32_t>(T * top_k - 1));
  std::vector<int32_t> src(static_cast<size_t>(max_rows));
  for (auto& v : src) v = slot(rng_);
  const Bits x = randn_bf16(static_cast<size_t>(T * K));
  // Down: [E, N, K] plain, N = 200 (not a multiple of 128 or of a tile).
  const int64_t N = 200;
  std::vector<Fp8Matrix> down, gate, up;
  std::vector<uint8_t> q_down, q_gu;
  std::vector<float> s_down, s_gu;
  const int64_t kb = fp8_row_scale_cols(K);
  for (int64_t e = 0; e < E; ++e) {
    down.push_back(rand_matrix(N, K));
    q_down.insert(q_down.end(), down[e].q.begin(), down[e].q.end());
    const auto rs = down[e].row_scale();
    s_down.insert(s_down.end(), rs.begin(), rs.end());
    gate.push_back(rand_matrix(I, K));
    up.push_back(rand_matrix(I, K));
    std::vector<uint8_t> pq(static_cast<size_t>(2 * I * K));
    moe_pack_gate_up_rows(gate[e].q.data(), up[e].q.data(), I, static_cast<size_t>(K), pq.data());
    q_gu.insert(q_gu.end(), pq.begin(), pq.end());
    std::vector<float> ps(static_cast<size_t>(2 * I * kb));
    const auto gs = gate[e].row_scale(), us = up[e].row_scale();
    moe_pack_gate_up_rows(gs.data(), us.data(), I, static_cast<size_t>(kb) * 4, ps.data());
    s_gu.insert(s_gu.end(), ps.begin(), ps.end());
  }
  // References.
  // ref_*: over the bf16 activations; q_*: over the quantized ones.
  std::vector<double> ref_down(static_cast<size_t>(rows * N)),
      ref_act(static_cast<size_t>(rows * I)), q_down_ref(ref_down.size()),
      q_act_ref(ref_act.size());
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const Bits xr(x.begin() + (src[r] / top_k) * K, x.begin() + (src[r] / top_k + 1) * K);
      const auto yd = ref_gemm(xr, 1, down[e], 0, N);
      std::copy(yd.begin(), yd.end(), ref_down.begin() + r * N);
      const auto yg = ref_gemm(xr, 1, gate[e], 0, I), yu = ref_gemm(xr, 1, up[e], 0, I);
      for (int64_t i = 0; i < I; ++i) ref_act[r * I + i] = silu(yg[i]) * yu[i];
      if (w8a8) {
        const auto qd = ref_gemm_w8a8(xr, 1, down[e], 0, N);
        std::copy(qd.begin(), qd.end(), q_down_ref.begin() + r * N);
        const auto qg = ref_gemm_w8a8(xr, 1, gate[e], 0, I);
        const auto qu = ref_gemm_w8a8(xr, 1, up[e], 0, I);
        for (int64_t i = 0; i < I; ++i) q_act_ref[r * I + i] = silu(qg[i]) * qu[i];
      }
    }
  }
  DeviceBuffer<uint16_t> dx(x);
  DeviceBuffer<int32_t> doff(offsets), dsrc(src);
  DeviceBuffer<uint8_t> dqd(q_down), dqg(q_gu);
  DeviceBuffer<float> dsd(s_down), dsg(s_gu);
  // W8A8 with the activations quantized in the kernel, and pre-quantized (x_fp8 / x_scale by
  // fp8_quantize_rows_launch over the tokens, gathered like x).
  DeviceBuffer<uint8_t> dxq(x.size());
  DeviceBuffer<float> dxs(static_cast<size_t>(T * kb));
  if (w8a8) fp8_quantize_rows_launch(dx.bf(), dxq.ptr, dxs.ptr, T, K, stream_);
  for (const bool prequant : w8a8 ? std::vector<bool>{false, true} : std::vector<bool>{false})
    for (const MoeGemmTile tile : kTiles) {
      SCOPED_TRACE(trace() + " tile " + std::to_string(static_cast<int>(tile)) +
                   (prequant ? " prequant" : ""));
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
        p.w_scale = silu_mul ? dsg.ptr : dsd.ptr;
        p.fp8_activations = w8a8;
        if (prequant) {
          p.x = nullptr;
          p.x_fp8 = dxq.ptr;
          p.x_scale = dxs.ptr;
        }
        moe_gemm_launch(p, stream_);
        const auto y = dy.download();
        for (size_t i = static_cast<size_t>(rows * n_out); i < y.size(); ++i) {
          ASSERT_EQ(y[i], 0xffff) << "wrote past the routed rows at " << i;
        }
        const Bits got(y.begin(), y.begin() + rows * n_out);
        const double err = rel_err(to_f32(got), silu_mul ? ref_act : ref_down);
        if (!w8a8) {
          EXPECT_LT(err, 6e-3) << (silu_mul ? "gate_up" : "down");
        } else {
          EXPECT_LT(rel_err(to_f32(got), silu_mul ? q_act_ref : q_down_ref), 5e-3)
              << (silu_mul ? "gate_up" : "down") << " vs the quantized-activation reference";
          EXPECT_LT(err, 8e-2) << (silu_mul ? "gate_up" : "down") << " vs the bf16 reference";
        }
      }
    }
}

// A dense matrix as one expert without offsets (the FP8 linear above the gemv's m).
TEST_F(Fp8LinearCuda, DenseGemmMatchesReference) { check_dense_gemm(false); }
TEST_F(Fp8LinearCuda, W8A8DenseGemmMatchesQuantizedReference) { check_dense_gemm(true); }

void Fp8LinearCuda::check_dense_gemm(bool w8a8) {
  const Fp8Matrix w = rand_matrix(264, 1040);
  DeviceBuffer<uint8_t> dw(w.q);
  DeviceBuffer<float> ds(w.row_scale());
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
      p.w_scale = ds.ptr;
      p.fp8_activations = w8a8;
      moe_gemm_launch(p, stream_);
      const auto y = dy.download();
      for (size_t i = static_cast<size_t>(m * w.n); i < y.size(); ++i) ASSERT_EQ(y[i], 0xffff);
      const auto got = to_f32(Bits(y.begin(), y.begin() + m * w.n));
      if (!w8a8) {
        EXPECT_LT(rel_err(got, ref_gemm(x, m, w, 0, w.n)), 6e-3);
      } else {
        const auto refq = ref_gemm_w8a8(x, m, w, 0, w.n);
        EXPECT_LT(rel_err(got, refq), 5e-3);
        EXPECT_LT(rel_err(got, ref_gemm(x, m, w, 0, w.n)), 8e-2);
        // Pre-quantized: the same numerics.
        DeviceBuffer<uint8_t> dxq(x.size());
        DeviceBuffer<float> dxs(static_cast<size_t>(m * fp8_row_scale_cols(w.k)));
        fp8_quantize_rows_launch(dx.bf(), dxq.ptr, dxs.ptr, m, w.k, stream_);
        dy.poison(0xff);
        p.x = nullptr;
        p.x_fp8 = dxq.ptr;
        p.x_scale = dxs.ptr;
        moe_gemm_launch(p, stream_);
        const auto y2 = dy.download();
        for (size_t i = static_cast<size_t>(m * w.n); i < y2.size(); ++i) ASSERT_EQ(y2[i], 0xffff);
        EXPECT_LT(rel_err(to_f32(Bits(y2.begin(), y2.begin() + m * w.n)), refq), 5e-3)
            << "prequant";
      }
    }
  }
}

// The whole MoE block with FP8 experts against the same block over their dequantized bf16
// weights (the bf16 block is tested against cpu::moe in test_moe_gemm_cuda.cpp): the decode
// path (<= 8 tokens), the mma path, and a prefill batch that picks the cuBLAS paths with bf16
// weights (FP8 runs the mma path there). Same router, so the same routing; the outputs differ
// by the bf16 rounding of the dequantized weights only.
TEST_F(Fp8LinearCuda, MoeLayerMatchesDequantizedBf16) {
  const int64_t H = 256, I = 96, E = 16, top_k = 4, max_tokens = 600;
  std::vector<uint8_t> q_gu, q_dn;
  std::vector<float> s_gu, s_dn;
  Bits gu16, dn16;
  const int64_t kbh = fp8_row_scale_cols(H);
  for (int64_t e = 0; e < E; ++e) {
    Fp8Matrix g = rand_matrix(I, H), u = rand_matrix(I, H), d = rand_matrix(H, I);
    // Small codes' scales: keep the products moderate (bf16 activations in and out).
    std::vector<uint8_t> pq(static_cast<size_t>(2 * I * H));
    moe_pack_gate_up_rows(g.q.data(), u.q.data(), I, static_cast<size_t>(H), pq.data());
    q_gu.insert(q_gu.end(), pq.begin(), pq.end());
    std::vector<float> ps(static_cast<size_t>(2 * I * kbh));
    const auto gs = g.row_scale(), us = u.row_scale();
    moe_pack_gate_up_rows(gs.data(), us.data(), I, static_cast<size_t>(kbh) * 4, ps.data());
    s_gu.insert(s_gu.end(), ps.begin(), ps.end());
    q_dn.insert(q_dn.end(), d.q.begin(), d.q.end());
    const auto ds = d.row_scale();
    s_dn.insert(s_dn.end(), ds.begin(), ds.end());
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
  DeviceBuffer<uint8_t> dqgu(q_gu), dqdn(q_dn);
  DeviceBuffer<float> dsgu(s_gu), dsdn(s_dn);
  MoeLayerWeights w16{drouter.bf(), dgu16.bf(), ddn16.bf()};
  MoeLayerWeights w8{drouter.bf(), nullptr, nullptr, dqgu.ptr, dsgu.ptr, dqdn.ptr, dsdn.ptr};
  MoeLayer layer(max_tokens, H, I, E, top_k, 0, E, true);
  GemmLt gemm;
  for (const int64_t T : {1, 5, 8, 40, 600}) {
    SCOPED_TRACE(trace() + " tokens " + std::to_string(T));
    // Unit-variance x scaled down: the random codes' values reach 448 times their scale.
    Bits x = randn_bf16(static_cast<size_t>(T * H));
    for (auto& v : x) v = f32_to_bf16(bf16_to_f32(v) * 0.25f);
    DeviceBuffer<uint16_t> dx(x), out16(static_cast<size_t>(T * H)),
        out8(static_cast<size_t>(T * H));
    out16.poison(0xff);
    out8.poison(0xff);
    layer.run(w16, dx.bf(), out16.bf(), T, gemm, stream_);
    const MoeLayerPath bf16_path = layer.last_path();
    layer.run(w8, dx.bf(), out8.bf(), T, gemm, stream_);
    EXPECT_EQ(layer.last_path(), bf16_path);
    const auto ref = to_f32(out16.download());
    const auto got8 = out8.download();
    if (bf16_path == MoeLayerPath::kCublas || bf16_path == MoeLayerPath::kPadded) {
      // The experts dequantized on the device are the bf16 weights: the same result, bit for bit.
      EXPECT_EQ(got8, out16.download()) << "prefill path " << static_cast<int>(bf16_path);
    }
    std::vector<double> refd(ref.begin(), ref.end());
    EXPECT_LT(rel_err(to_f32(got8), refd), 1e-2);
    // W8A8 on the decode and mma paths: within the activations' E4M3 error of the bf16 block;
    // in-kernel and pre-quantized activations: the same numerics, the same bits.
    Bits w8a8_bits[2];
    bool wgmma = false;
    for (const bool prequant : {false, true}) {
      layer.set_fp8_activations(true, prequant);
      wgmma = wgmma || layer.fp8_wgmma();
      out8.poison(0xff);
      layer.run(w8, dx.bf(), out8.bf(), T, gemm, stream_);
      w8a8_bits[prequant] = out8.download();
      if (layer.last_path() == MoeLayerPath::kDecode || layer.last_path() == MoeLayerPath::kMma) {
        EXPECT_LT(rel_err(to_f32(w8a8_bits[prequant]), refd), 8e-2) << "w8a8 " << prequant;
        EXPECT_NE(w8a8_bits[prequant], got8) << "w8a8 ran the w8a16 kernels";
      }
    }
    // (The wgmma GEMMs round gate/up to bf16 before the SiLU-mul: close, not the same bits.)
    if (!wgmma &&
        (layer.last_path() == MoeLayerPath::kDecode || layer.last_path() == MoeLayerPath::kMma)) {
      EXPECT_EQ(w8a8_bits[0], w8a8_bits[1]) << "in-kernel vs pre-quantized activations";
    }
    layer.set_fp8_activations(false);
    if (T == 600) {  // the FP8 grouped GEMM at prefill size instead
      layer.set_fp8_prefill_dequant(false);
      out8.poison(0xff);
      layer.run(w8, dx.bf(), out8.bf(), T, gemm, stream_);
      EXPECT_EQ(layer.last_path(), MoeLayerPath::kMma);
      EXPECT_LT(rel_err(to_f32(out8.download()), refd), 1e-2);
      for (const bool prequant : {false, true}) {
        layer.set_fp8_activations(true, prequant);
        out8.poison(0xff);
        layer.run(w8, dx.bf(), out8.bf(), T, gemm, stream_);
        EXPECT_LT(rel_err(to_f32(out8.download()), refd), 8e-2) << "w8a8 prefill " << prequant;
      }
      layer.set_fp8_activations(false);
      layer.set_fp8_prefill_dequant(true);
    }
  }
}

TEST_F(Fp8LinearCuda, MoeGemmRejectsUnsupported) {
  DeviceBuffer<uint16_t> dx(1024), dy(1024);
  DeviceBuffer<uint8_t> dw(1024);
  DeviceBuffer<float> ds(64);
  DeviceBuffer<int32_t> doff(std::vector<int32_t>{0, 1, 2});
  MoeGemmParams p{dx.bf(), nullptr, dy.bf(), doff.ptr, 2, 16, 24, 2};  // k % 16 != 0
  p.w_fp8 = dw.ptr;
  p.w_scale = ds.ptr;
  EXPECT_THROW(moe_gemm_launch(p, stream_), Error);
  p.k = 32;
  p.w_scale = nullptr;
  EXPECT_THROW(moe_gemm_launch(p, stream_), Error);
  p.w_scale = ds.ptr;
  p.expert_offsets = nullptr;  // no offsets with 2 experts
  EXPECT_THROW(moe_gemm_launch(p, stream_), Error);
}

}  // namespace
}  // namespace tandem::cuda
