// Fp8DenseLt (model/cuda/fp8_dense.h: the W8A8 dense linear at prefill sizes through cuBLASLt's
// block-scaled FP8 GEMM) against the CPU reference that quantizes the activations the same way
// (backend/cuda/fp8_act_ref.h), and within E4M3's activation error of the dequantized one. Fresh
// random codes, block scales and inputs (the seed is printed on failure), poisoned outputs
// checked past the rows; row counts not multiples of 4 (the last rows through the W8A8 grouped
// GEMM); the cases it refuses (row scales cut inside a block, too few rows, k % 128). Skips
// without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_test_util.h"
#include "backend/cuda/fp8_act_ref.h"
#include "backend/cuda/fp8_linear.h"
#include "core/dtype.h"
#include "model/cuda/fp8_dense.h"

namespace tandem::cuda_model {
namespace {

using cuda::test_util::Bits;
using cuda::test_util::DeviceBuffer;

class Fp8DenseLtCuda : public cuda::test_util::CudaFixture<> {};

// y[i][r] = sum_j xa[i][j] * e4m3(q[r][j]) * block_scale(r, j), xa the activations as doubles.
std::vector<double> ref(std::vector<double> const& xa, int64_t m, std::vector<uint8_t> const& q,
                        std::vector<float> const& bs, int64_t n, int64_t k) {
  const int64_t kb = k / 128;
  std::vector<double> y(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < n; ++r) {
    std::vector<double> w(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) {
      w[j] = f8e4m3_to_f32(q[r * k + j]) * bs[(r / 128) * kb + j / 128];
    }
    for (int64_t i = 0; i < m; ++i) {
      double s = 0;
      for (int64_t j = 0; j < k; ++j) s += xa[i * k + j] * w[j];
      y[i * n + r] = s;
    }
  }
  return y;
}

double rel(std::vector<float> const& got, std::vector<double> const& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

TEST_F(Fp8DenseLtCuda, MatchesQuantizedReference) {
  const int64_t n = 272, k = 384, kb = k / 128;  // a partial last row block
  std::vector<uint8_t> q(static_cast<size_t>(n * k));
  std::uniform_int_distribution<int> code(0, 0x7e), sign(0, 1);
  for (auto& c : q) c = static_cast<uint8_t>(code(rng_) | (sign(rng_) << 7));
  std::uniform_real_distribution<float> e(-12.f, -6.f);
  std::vector<float> bs(static_cast<size_t>(((n + 127) / 128) * kb));
  for (auto& v : bs) v = std::exp2(e(rng_));
  const std::vector<float> rs = cuda::fp8_expand_row_scales(bs.data(), n, k, 128);
  DeviceBuffer<uint8_t> dq(q);
  DeviceBuffer<float> drs(rs);
  Fp8DenseLt lt(700, 512);
  std::normal_distribution<float> d(0.f, 1.f);
  for (const int64_t m : {4, 7, 130, 601}) {
    SCOPED_TRACE(trace() + " m " + std::to_string(m));
    Bits x(static_cast<size_t>(m * k));
    for (auto& v : x) v = f32_to_bf16(d(rng_));
    std::vector<double> xq(x.size()), xb(x.size());
    std::vector<float> g(128);
    std::vector<uint8_t> gq(128);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t c0 = 0; c0 < k; c0 += 128) {
        for (int64_t j = 0; j < 128; ++j) g[j] = bf16_to_f32(x[i * k + c0 + j]);
        const double s = cuda::test_util::fp8_quantize_group_ref(g.data(), 128, gq.data());
        for (int64_t j = 0; j < 128; ++j) {
          xq[i * k + c0 + j] = double(f8e4m3_to_f32(gq[j])) * s;
          xb[i * k + c0 + j] = g[j];
        }
      }
    }
    DeviceBuffer<uint16_t> dx(x), dy(static_cast<size_t>(m * n) + 64);
    dy.poison(0xff);
    ASSERT_TRUE(lt.run(dx.bf(), dq.ptr, drs.ptr, dy.bf(), m, n, k, stream_));
    const auto y = dy.download();
    for (size_t i = static_cast<size_t>(m * n); i < y.size(); ++i) ASSERT_EQ(y[i], 0xffff);
    const auto got = cuda::test_util::to_f32(Bits(y.begin(), y.begin() + m * n));
    EXPECT_LT(rel(got, ref(xq, m, q, bs, n, k)), 5e-3) << "vs the quantized reference";
    EXPECT_LT(rel(got, ref(xb, m, q, bs, n, k)), 8e-2) << "vs the bf16 reference";
  }
}

TEST_F(Fp8DenseLtCuda, RefusesWhatItCannotRun) {
  const int64_t n = 256, k = 256, kb = 2;
  std::vector<float> rs(static_cast<size_t>(n * kb), 0.01f);
  rs[5 * kb] = 0.02f;  // row 5 differs from row 0 of its block: a shard cut inside a block
  DeviceBuffer<uint8_t> dq(static_cast<size_t>(n * k));
  DeviceBuffer<float> drs(rs), drs_ok(std::vector<float>(rs.size(), 0.01f));
  DeviceBuffer<uint16_t> dx(static_cast<size_t>(64 * k)), dy(static_cast<size_t>(64 * n));
  Fp8DenseLt lt(64, 256);
  EXPECT_FALSE(lt.run(dx.bf(), dq.ptr, drs.ptr, dy.bf(), 8, n, k, stream_));
  EXPECT_FALSE(lt.run(dx.bf(), dq.ptr, drs.ptr, dy.bf(), 8, n, k, stream_));  // cached: still no
  DeviceBuffer<uint8_t> dq2(static_cast<size_t>(n * k));
  EXPECT_FALSE(lt.run(dx.bf(), dq2.ptr, drs_ok.ptr, dy.bf(), 3, n, k, stream_));    // m < 4
  EXPECT_FALSE(lt.run(dx.bf(), dq2.ptr, drs_ok.ptr, dy.bf(), 65, n, k, stream_));   // > max_rows
  EXPECT_FALSE(lt.run(dx.bf(), dq2.ptr, drs_ok.ptr, dy.bf(), 8, n, 240, stream_));  // k % 128
}

}  // namespace
}  // namespace tandem::cuda_model
