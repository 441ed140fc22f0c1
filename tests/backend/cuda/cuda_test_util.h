// Helpers shared by the CUDA backend tests (tests/backend/cuda/*.cpp, one binary:
// test_backend_cuda): GPU detection, a typed device buffer, bf16 bit patterns, the relative
// error, and the fixture base (skip without a GPU, seeded RNG, a stream). Inline functions and
// templates in tandem::cuda::test_util (not `testing`, which would hide gtest's ::testing
// inside tandem::cuda), so that every file shares one definition.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tandem::cuda::test_util {

/// Whether a CUDA device is present (computed once).
inline bool gpu_available() {
  static const bool ok = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return n > 0;
  }();
  return ok;
}

/// What DeviceBuffer::upload does when the host vector's size differs from the buffer's:
/// a gtest fatal failure (ASSERT_EQ, returns from upload without copying), an exception
/// (TANDEM_CHECK), or nothing (copies `count` elements, the host vector must hold them).
enum class UploadCheck { kAssert, kThrow, kNone };

/// `count` elements of T on the device (at least one element allocated).
template <typename T, UploadCheck kCheck = UploadCheck::kAssert>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(n) {
    TANDEM_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceBuffer(std::vector<T> const& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { (void)cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
  void upload(std::vector<T> const& host) {
    if constexpr (kCheck == UploadCheck::kAssert) {
      ASSERT_EQ(host.size(), count);
    } else if constexpr (kCheck == UploadCheck::kThrow) {
      TANDEM_CHECK(host.size() == count, "upload size");
    }
    if (count)
      TANDEM_CUDA_CHECK(cudaMemcpy(ptr, host.data(), count * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count);
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    if (count)
      TANDEM_CUDA_CHECK(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  /// Fills every byte (0xff: NaN for bf16 / fp32; 0x7f: 0x7f7f7f7f for int32).
  void poison(int byte) {
    TANDEM_CUDA_CHECK(cudaMemset(ptr, byte, std::max<size_t>(count, 1) * sizeof(T)));
  }
  __nv_bfloat16* bf() const { return reinterpret_cast<__nv_bfloat16*>(ptr); }  // cuda::bf16
};

using Bits = std::vector<uint16_t>;  // bf16 bit patterns on the host

inline std::vector<float> to_f32(Bits const& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_f32(b[i]);
  return f;
}
inline Bits to_bf16(std::vector<float> const& f) {
  Bits b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = f32_to_bf16(f[i]);
  return b;
}

/// Whether rel_err first expects out and ref to have the same size (EXPECT_EQ).
enum class SizeCheck { kExpect, kNone };

/// ||out - ref|| / ||ref|| over the elements of `ref`; infinite when an output is not
/// finite. kExpect: EXPECT_EQ(out.size(), ref.size()) first, then the elements of `out`.
inline double rel_err(std::vector<float> const& out, std::vector<float> const& ref,
                      SizeCheck check = SizeCheck::kExpect) {
  if (check == SizeCheck::kExpect) {
    EXPECT_EQ(out.size(), ref.size());
  }
  const size_t n = check == SizeCheck::kExpect ? out.size() : ref.size();
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    const double d = double(out[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num / std::max(den, 1e-30));
}
inline double rel_err(Bits const& out, std::vector<float> const& ref,
                      SizeCheck check = SizeCheck::kExpect) {
  return rel_err(to_f32(out), ref, check);
}

/// Fixture base: skips without a GPU, seeds rng_ from std::random_device (trace() names the
/// seed), creates stream_.
template <class Base = ::testing::Test>
class CudaFixture : public Base {
 protected:
  void SetUp() override {
    if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    TANDEM_CUDA_CHECK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  void sync() { TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  std::string trace() const { return "seed " + std::to_string(seed_); }

  uint32_t seed_ = 0;
  std::mt19937 rng_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace tandem::cuda::test_util
