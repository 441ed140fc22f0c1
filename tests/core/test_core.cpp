#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

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

// Exhaustive reference: the nearest of the 127 finite magnitudes, ties to the even code.
uint8_t f8e4m3_nearest(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  uint8_t best = 0;
  float best_err = a;
  for (uint8_t c = 1; c <= 0x7e; ++c) {
    const float err = std::fabs(f8e4m3_to_f32(c) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_err = err;
    }
  }
  return sign | best;
}

TEST(DType, F8E4M3DecodeAndRounding) {
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(f8e4m3_to_f32(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(f8e4m3_to_f32(0x39), 1.125f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0xff)));
  // Midpoints round to the even code; the rest to the nearest, over every magnitude.
  EXPECT_EQ(f32_to_f8e4m3(1.0625f), 0x38);                // between 1.0 (0x38) and 1.125 (0x39)
  EXPECT_EQ(f32_to_f8e4m3(1.1875f), 0x3a);                // between 1.125 and 1.25 (0x3a)
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(3.0f, -10)), 0x02);
  EXPECT_EQ(f32_to_f8e4m3(-INFINITY), 0xfe);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(-1.f, 1.f);
  std::uniform_int_distribution<int> expo(-14, 10);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::ldexp(mant(rng), expo(rng));
    ASSERT_EQ(f32_to_f8e4m3(x), f8e4m3_nearest(x)) << x;
  }
  for (uint32_t c = 0; c < 0x7f; ++c) {  // every midpoint between neighbouring codes
    const float lo = f8e4m3_to_f32(static_cast<uint8_t>(c));
    const float hi = f8e4m3_to_f32(static_cast<uint8_t>(c + 1));
    const float mid = 0.5f * (lo + hi);
    ASSERT_EQ(f32_to_f8e4m3(mid), f8e4m3_nearest(mid)) << c;
    ASSERT_EQ(f32_to_f8e4m3(-mid), f8e4m3_nearest(-mid)) << c;
  }
}

TEST(DType, E8M0Decode) {
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(1), std::ldexp(1.0f, -126));
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_EQ(e8m0_to_f32(254), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
  EXPECT_EQ(dtype_from_safetensors("F8_E4M3"), DType::kF8E4M3);
  EXPECT_EQ(dtype_from_safetensors("F8_E8M0"), DType::kE8M0);
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
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

// A process forked after the parent used the global pool (comm::run_local_ranks' ranks, `tandem
// --nprocs`) inherits the pool object but none of its worker threads: its parallel_for must still
// finish (it waited forever for them: a rank loading FP8 experts hung on the GPU).
TEST(ThreadPool, GlobalPoolWorksInAForkedChild) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer ends a child that starts threads after a multi-threaded fork";
#else
  constexpr int64_t kN = 1 << 16;
  std::atomic<int64_t> sum{0};
  ThreadPool::global().parallel_for(kN, 1, [&](int64_t b, int64_t e) { sum += e - b; });
  ASSERT_EQ(sum.load(), kN);
  if (ThreadPool::global().size() < 2)
    GTEST_SKIP() << "a pool of one thread has no workers to lose";
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(10);  // a hang ends the child with SIGALRM
    std::atomic<int64_t> mine{0};
    ThreadPool::global().parallel_for(kN, 1, [&](int64_t b, int64_t e) { mine += e - b; });
    ::_exit(mine.load() == kN && ThreadPool::global().size() >= 2 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not finish: signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's parallel_for missed items or ran serially";
  // And the parent's pool is untouched by the fork.
  sum = 0;
  ThreadPool::global().parallel_for(kN, 1, [&](int64_t b, int64_t e) { sum += e - b; });
  EXPECT_EQ(sum.load(), kN);
#endif
}

}  // namespace
}  // namespace tandem
