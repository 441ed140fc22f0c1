#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <random>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace tandem {
namespace {

TEST(Error, CarriesLocationAndKind) {
  try {
    TANDEM_CHECK_KIND(kNotFound, 1 == 2, "tensor ", "x", " missing");
    FAIL() << "did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
    EXPECT_EQ(e.message(), "tensor x missing");
    EXPECT_NE(std::string(e.what()).find("test_core.cpp:"), std::string::npos) << e.what();
    EXPECT_GT(e.line(), 0u);
  }
}

TEST(DType, Bf16RoundTripAndRounding) {
  std::mt19937 rng(1);
  std::normal_distribution<float> dist(0.f, 10.f);
  for (int i = 0; i < 10000; ++i) {
    float x = dist(rng);
    float y = bf16_to_f32(f32_to_bf16(x));
    EXPECT_LE(std::fabs(x - y), std::fabs(x) * (1.0f / 256.0f)) << x;
  }
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, F16RoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint16_t v = static_cast<uint16_t>(h);
    float f = f16_to_f32(v);
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_f16(f), v) << std::hex << h;
  }
}

TEST(DType, F8E4M3RoundTrip) {
  for (uint32_t c = 0; c < 256; ++c) {
    float f = f8e4m3_to_f32(static_cast<uint8_t>(c));
    if (std::isnan(f)) continue;
    uint8_t back = f32_to_f8e4m3(f);
    if (f == 0.0f) {
      EXPECT_EQ(back & 0x7f, 0);
    } else {
      EXPECT_EQ(back, c) << c;
    }
  }
  EXPECT_EQ(f8e4m3_to_f32(f32_to_f8e4m3(1000.f)), 448.f);
}

TEST(Tensor, ShapeAndExpect) {
  HostTensor t(DType::kBF16, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.view().nbytes(), 48u);
  EXPECT_EQ(t.shape().str(), "[2, 3, 4]");
  EXPECT_NO_THROW(t.view().expect(DType::kBF16, {2, 3, 4}, "t"));
  EXPECT_THROW(t.view().expect(DType::kF32, {2, 3, 4}, "t"), Error);
  EXPECT_THROW(t.view().expect(DType::kBF16, {2, 12}, "t"), Error);
}

TEST(ThreadPool, CoversRangeOnceAndPropagatesErrors) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
  EXPECT_THROW(pool.parallel_for(100, 1,
                                 [&](int64_t b, int64_t) {
                                   if (b > 0) TANDEM_THROW(kInternal, "boom");
                                 }),
               Error);
  // The pool still works after an error.
  std::atomic<int> total{0};
  pool.parallel_for(10, 1, [&](int64_t b, int64_t e) { total += static_cast<int>(e - b); });
  EXPECT_EQ(total.load(), 10);
}

}  // namespace
}  // namespace tandem
