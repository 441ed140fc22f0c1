// Block-scaled FP8 GEMM (fp8_gemm.h) against a CPU reference: the activation quantizer
// bit-exact (codes and scales, zero-filled padding rows), the cuBLASLt GEMM within bf16's
// output rounding of the exact block-scaled product (relative error 1e-2) and within FP8's
// error of the unquantized fp32 product, over fresh random inputs (the seed is printed on
// failure) with poisoned outputs; CUDA-graph replay; shapes it refuses. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_gemm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "fp8_act_ref.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::DeviceBuffer;
using test_util::to_f32;

class CudaFp8Gemm : public test_util::CudaFixture<> {};

struct QuantAct {
  std::vector<uint8_t> q;  // [m_pad, k]
  std::vector<float> s;    // [k / 128, m_pad]
};

// The reference of fp8_quantize_act_launch.
QuantAct quantize_act(const std::vector<float>& x, int64_t m, int64_t k) {
  const int64_t mp = fp8_pad_m(m), groups = k / 128;
  QuantAct r{std::vector<uint8_t>(static_cast<size_t>(mp * k), 0),
             std::vector<float>(static_cast<size_t>(groups * mp), 1.0f)};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < groups; ++g) {
      r.s[static_cast<size_t>(g * mp + i)] = test_util::fp8_quantize_group_ref(
          x.data() + i * k + g * 128, 128, r.q.data() + i * k + g * 128);
    }
  }
  return r;
}

// 128x128 block quantization of W [n, k]: codes and scale_inv [ceil(n/128), k / 128].
void quantize_w(const std::vector<float>& w, int64_t n, int64_t k, std::vector<uint8_t>& q,
                std::vector<float>& s) {
  const int64_t rb = (n + 127) / 128, cb = k / 128;
  q.assign(w.size(), 0);
  s.assign(static_cast<size_t>(rb * cb), 1.0f);
  for (int64_t r = 0; r < rb; ++r) {
    for (int64_t c = 0; c < cb; ++c) {
      float amax = 0;
      for (int64_t i = r * 128; i < std::min(n, r * 128 + 128); ++i)
        for (int64_t j = c * 128; j < c * 128 + 128; ++j)
          amax = std::max(amax, std::fabs(w[static_cast<size_t>(i * k + j)]));
      const float sc = amax > 0 ? amax / 448.0f : 1.0f;
      s[static_cast<size_t>(r * cb + c)] = sc;
      for (int64_t i = r * 128; i < std::min(n, r * 128 + 128); ++i)
        for (int64_t j = c * 128; j < c * 128 + 128; ++j)
          q[static_cast<size_t>(i * k + j)] = f32_to_f8e4m3(w[static_cast<size_t>(i * k + j)] / sc);
    }
  }
}

struct Case {
  int64_t m, n, k;
};

TEST_F(CudaFp8Gemm, QuantizerAndGemmMatchCpu) {
  SCOPED_TRACE(trace());
  Fp8GemmLt gemm;
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const Case c : {Case{1, 256, 512}, Case{5, 272, 384}, Case{7, 384, 1024},
                       Case{64, 512, 2048}, Case{200, 2048, 1024}}) {
    SCOPED_TRACE("m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " +
                 std::to_string(c.k));
    const int64_t mp = fp8_pad_m(c.m);
    // Activations with outliers per row (so groups get different scales), bf16-exact.
    std::vector<float> x(static_cast<size_t>(c.m * c.k));
    for (size_t i = 0; i < x.size(); ++i)
      x[i] = bf16_to_f32(f32_to_bf16(nd(rng_) * (i % 97 == 0 ? 20.f : 1.f)));
    if (c.m > 1) std::fill(x.begin() + c.k, x.begin() + c.k + 128, 0.0f);  // an all-zero group
    std::vector<float> w(static_cast<size_t>(c.n * c.k));
    for (float& v : w) v = nd(rng_) * 0.05f;
    std::vector<uint8_t> wq;
    std::vector<float> ws;
    quantize_w(w, c.n, c.k, wq, ws);
    QuantAct ref = quantize_act(x, c.m, c.k);

    DeviceBuffer<uint16_t> dx(test_util::to_bf16(x));
    DeviceBuffer<uint8_t> dq(static_cast<size_t>(mp * c.k));
    DeviceBuffer<float> ds(static_cast<size_t>(mp * (c.k / 128)));
    dq.poison(0x7f);
    ds.poison(0xff);
    fp8_quantize_act_launch({dx.bf(), dq.ptr, ds.ptr, c.m, c.k}, stream_);
    sync();
    ASSERT_EQ(dq.download(), ref.q);
    std::vector<float> got_s = ds.download();
    ASSERT_EQ(got_s.size(), ref.s.size());
    for (size_t i = 0; i < got_s.size(); ++i) ASSERT_EQ(got_s[i], ref.s[i]) << i;

    DeviceBuffer<uint8_t> dw(wq);
    DeviceBuffer<float> dws(fp8_pack_weight_scales(ws.data(), c.n, c.k));
    DeviceBuffer<uint16_t> dy(static_cast<size_t>(mp * c.n));
    dy.poison(0xff);
    gemm.run({dq.ptr, ds.ptr, dw.ptr, dws.ptr, dy.bf(), c.m, c.n, c.k}, stream_);
    sync();
    std::vector<float> y = to_f32(dy.download());
    // The exact block-scaled product, and the unquantized one.
    std::vector<float> want(static_cast<size_t>(c.m * c.n)), fp32(want.size()), got(want.size());
    const int64_t cb = c.k / 128;
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < c.n; ++j) {
        double acc = 0, plain = 0;
        for (int64_t b = 0; b < cb; ++b) {
          double part = 0;
          for (int64_t t = b * 128; t < b * 128 + 128; ++t) {
            part += double(f8e4m3_to_f32(ref.q[static_cast<size_t>(i * c.k + t)])) *
                    double(f8e4m3_to_f32(wq[static_cast<size_t>(j * c.k + t)]));
            plain +=
                double(x[static_cast<size_t>(i * c.k + t)]) * w[static_cast<size_t>(j * c.k + t)];
          }
          acc += part * ref.s[static_cast<size_t>(b * mp + i)] *
                 ws[static_cast<size_t>((j / 128) * cb + b)];
        }
        want[static_cast<size_t>(i * c.n + j)] = static_cast<float>(acc);
        fp32[static_cast<size_t>(i * c.n + j)] = static_cast<float>(plain);
        got[static_cast<size_t>(i * c.n + j)] = y[static_cast<size_t>(i * c.n + j)];
      }
    }
    EXPECT_LE(test_util::rel_err(got, want), 1e-2);
    EXPECT_LE(test_util::rel_err(got, fp32), 8e-2);
    for (int64_t i = 0; i < c.m; ++i) {  // every row written, none from another row
      double num = 0, den = 0;
      for (int64_t j = 0; j < c.n; ++j) {
        const double d =
            got[static_cast<size_t>(i * c.n + j)] - want[static_cast<size_t>(i * c.n + j)];
        num += d * d;
        den +=
            double(want[static_cast<size_t>(i * c.n + j)]) * want[static_cast<size_t>(i * c.n + j)];
      }
      ASSERT_LE(std::sqrt(num / std::max(den, 1e-30)), 2e-2) << "row " << i;
    }
  }
  EXPECT_EQ(gemm.num_plans(), 5u);
}

TEST_F(CudaFp8Gemm, GraphReplayAndRefusedShapes) {
  SCOPED_TRACE(trace());
  const int64_t m = 32, n = 512, k = 1024, mp = fp8_pad_m(m);
  std::uniform_int_distribution<int> code(0, 0x7e);
  std::vector<uint8_t> xq(static_cast<size_t>(mp * k)), wq(static_cast<size_t>(n * k));
  for (auto& v : xq) v = static_cast<uint8_t>(code(rng_) | (rng_() & 0x80));
  for (auto& v : wq) v = static_cast<uint8_t>(code(rng_) | (rng_() & 0x80));
  std::vector<float> xs(static_cast<size_t>(mp * (k / 128)), 0.01f),
      ws(static_cast<size_t>(4 * 8), 0.02f);
  DeviceBuffer<uint8_t> dx(xq), dw(wq);
  DeviceBuffer<float> dxs(xs), dws(fp8_pack_weight_scales(ws.data(), n, k));
  DeviceBuffer<uint16_t> y1(static_cast<size_t>(mp * n)), y2(static_cast<size_t>(mp * n));
  Fp8GemmLt gemm;
  gemm.run({dx.ptr, dxs.ptr, dw.ptr, dws.ptr, y1.bf(), m, n, k}, stream_);  // plan first
  y2.poison(0xff);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  gemm.run({dx.ptr, dxs.ptr, dw.ptr, dws.ptr, y2.bf(), m, n, k}, stream_);
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  sync();
  EXPECT_EQ(y1.download(), y2.download());
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
  auto kind_of = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::kInternal;
  };
  EXPECT_EQ(kind_of([&] {
              gemm.run({dx.ptr, dxs.ptr, dw.ptr, dws.ptr, y1.bf(), m, n, 1000}, stream_);
            }),
            ErrorKind::kUnsupported);
  EXPECT_EQ(kind_of([&] {
              gemm.run({dx.ptr, dxs.ptr, dw.ptr, dws.ptr, y1.bf(), m, 500, k}, stream_);
            }),
            ErrorKind::kUnsupported);
  EXPECT_EQ(kind_of([&] {
              fp8_quantize_act_launch({y1.bf(), dx.ptr, dxs.ptr, m, 1000}, stream_);
            }),
            ErrorKind::kUnsupported);
}

TEST(Fp8GemmLayout, PackedWeightScales) {
  // [ceil(300/128) = 3, 5] -> rows of 8 (5 K blocks padded to a multiple of 4), zero padding.
  std::vector<float> s(15);
  for (size_t i = 0; i < s.size(); ++i) s[i] = float(i + 1);
  std::vector<float> p = fp8_pack_weight_scales(s.data(), 300, 640);
  ASSERT_EQ(p.size(), 24u);
  EXPECT_EQ(fp8_weight_scale_ld(640), 8);
  EXPECT_EQ(fp8_weight_scale_ld(512), 4);
  EXPECT_EQ(fp8_pad_m(1), 4);
  EXPECT_EQ(fp8_pad_m(8), 8);
  EXPECT_EQ(p[0], 1.f);
  EXPECT_EQ(p[4], 5.f);
  EXPECT_EQ(p[5], 0.f);
  EXPECT_EQ(p[8], 6.f);
  EXPECT_EQ(p[16 + 4], 15.f);
}

}  // namespace
}  // namespace tandem::cuda
