// The small-m GEMM kernel (gemv.h) in a programmatic dependent launch and its rejects, and GemmLt
// with it as a tuning candidate (gemm.h): the checks of several launches or captures. One launch
// against cpu::gemm per shape is the Gemv cases of the kernel-test harness (ops/gemv_cases.cpp).
// Fresh random inputs every run (the seed is printed on failure); outputs poisoned (NaN bytes)
// first and checked fully written with the bytes after them untouched; relative error
// ||out - ref|| / ||ref||: bf16 outputs 1e-2, fp32 outputs 2e-6 sqrt(k) (fp32 accumulation in
// another order than the reference). Every test skips (GTEST_SKIP) when no CUDA device is visible.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/norm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::gpu_available;
using test_util::to_f32;

constexpr double kTolBf16 = 1e-2;
double tol_f32(int64_t k) { return 2e-6 * std::sqrt(static_cast<double>(k)); }
constexpr size_t kGuard = 64;  // poisoned elements after each output, checked untouched

/// Device memory of `bytes`, freed on scope exit.
struct DeviceBytes {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBytes(size_t b) : bytes(b) {
    TANDEM_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(b, 16)));
  }
  ~DeviceBytes() { (void)cudaFree(ptr); }
  DeviceBytes(DeviceBytes const&) = delete;
  DeviceBytes& operator=(DeviceBytes const&) = delete;
  template <typename T>
  void upload(std::vector<T> const& host) {
    ASSERT_LE(host.size() * sizeof(T), bytes);
    TANDEM_CUDA_CHECK(
        cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  template <typename T>
  std::vector<T> download(size_t count) const {
    std::vector<T> host(count);
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    TANDEM_CUDA_CHECK(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison() { TANDEM_CUDA_CHECK(cudaMemset(ptr, 0xff, bytes)); }
  bf16* bf(size_t elem_offset = 0) const { return static_cast<bf16*>(ptr) + elem_offset; }
  float* f32() const { return static_cast<float*>(ptr); }
};

// ||out - ref|| / ||ref|| over the first ref.size() elements; non-finite output: infinity
// (no size expectation, unlike test_util::rel_err's default).
double rel_err(std::vector<float> const& out, std::vector<float> const& ref) {
  return test_util::rel_err(out, ref, test_util::SizeCheck::kNone);
}

class CudaGemv : public test_util::CudaFixture<> {
 protected:
  Bits randn_bf16(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.f, scale);
    Bits b(n);
    for (auto& v : b) v = f32_to_bf16(d(rng_));
    return b;
  }

  /// The output (bf16 or fp32) as fp32, checking that the kGuard elements after m*n are
  /// untouched (all bytes 0xff).
  std::vector<float> output(DeviceBytes const& y, size_t count, bool f32) {
    std::vector<float> out(count);
    if (f32) {
      std::vector<float> h = y.download<float>(count + kGuard);
      std::copy(h.begin(), h.begin() + count, out.begin());
      for (size_t i = count; i < h.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &h[i], 4);
        EXPECT_EQ(u, 0xffffffffu) << "written past the output at " << i;
      }
    } else {
      Bits h = y.download<uint16_t>(count + kGuard);
      for (size_t i = 0; i < count; ++i) out[i] = bf16_to_f32(h[i]);
      for (size_t i = count; i < h.size(); ++i) {
        EXPECT_EQ(h[i], 0xffffu) << "written past the output at " << i;
      }
    }
    return out;
  }
};

// ------------------------------------------------------------------------------ gemv_launch

// gemv_launch against cpu::gemm for every m, n, k, output dtype (and alpha, determinism): the
// Gemv cases of tests/backend/cuda/ops/gemv_cases.cpp (Cuda/BackendOps.Check/Gemv_*).

// The programmatic dependent launch: x produced by the kernel before it (an RMSNorm, itself a
// PDL launch), poisoned with NaN before each round, so a gemv reading x before its wait would
// come out non-finite; eagerly and in a captured graph, several rounds each.
TEST_F(CudaGemv, PdlLaunchWaitsForTheProducer) {
  SCOPED_TRACE(trace());
  for (int64_t m : {1, 3, 8}) {
    for (int64_t n : {7, 5120}) {
      const int64_t k = m == 3 ? 4096 : 2048;
      SCOPED_TRACE("m " + std::to_string(m) + " n " + std::to_string(n) + " k " +
                   std::to_string(k));
      Bits a = randn_bf16(m * k), g = randn_bf16(k, 0.2f), w = randn_bf16(n * k);
      for (auto& v : g) v = f32_to_bf16(1.0f + bf16_to_f32(v));
      // CPU: x = bf16(rms_norm(a) * g), y = x W^T.
      std::vector<float> af = to_f32(a), gf = to_f32(g), xf(m * k), wf = to_f32(w), ref(m * n);
      cpu::rms_norm({af.data(), gf.data(), xf.data(), m, k, 1e-6f});
      for (auto& v : xf) v = bf16_to_f32(f32_to_bf16(v));
      cpu::gemm({xf.data(), wf.data(), ref.data(), m, n, k});
      DeviceBytes d_a(a.size() * 2), d_g(g.size() * 2), d_w(w.size() * 2), d_x(m * k * 2),
          d_y((m * n + kGuard) * 2);
      d_a.upload(a);
      d_g.upload(g);
      d_w.upload(w);
      GemvParams p{d_x.bf(), d_w.bf(), d_y.bf(), m, n, k};
      p.pdl = true;
      auto step = [&] {
        rms_norm_launch({d_a.bf(), d_g.bf(), d_x.bf(), m, k, 1e-6f}, stream_);
        gemv_launch(p, stream_);
      };
      for (int round = 0; round < 5; ++round) {
        d_x.poison();
        d_y.poison();
        step();
        EXPECT_LT(rel_err(output(d_y, m * n, false), ref), kTolBf16) << "eager round " << round;
      }
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      step();
      TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
      TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int round = 0; round < 5; ++round) {
        d_x.poison();
        d_y.poison();
        TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
        EXPECT_LT(rel_err(output(d_y, m * n, false), ref), kTolBf16) << "replay " << round;
      }
      (void)cudaGraphExecDestroy(exec);
      (void)cudaGraphDestroy(graph);
    }
  }
}

TEST_F(CudaGemv, RejectsUnsupportedOperands) {
  DeviceBytes d_x(9 * 64 * 2 + 32), d_w(16 * 64 * 2 + 32), d_y(9 * 16 * 4);
  auto expect_unsupported = [&](GemvParams const& p, char const* what) {
    EXPECT_FALSE(gemv_supported(p)) << what;
    try {
      gemv_launch(p, stream_);
      ADD_FAILURE() << what << ": no exception";
    } catch (Error const& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << what << ": " << e.what();
    }
  };
  expect_unsupported({d_x.bf(), d_w.bf(), d_y.bf(), 9, 16, 64}, "m 9");
  expect_unsupported({d_x.bf(), d_w.bf(), d_y.bf(), 1, 16, 60}, "k 60");
  expect_unsupported({d_x.bf(1), d_w.bf(), d_y.bf(), 1, 16, 64}, "x 2-byte aligned");
  expect_unsupported({d_x.bf(), d_w.bf(4), d_y.bf(), 1, 16, 64}, "w 8-byte aligned");
  gemv_launch({d_x.bf(), d_w.bf(), d_y.bf(), 0, 16, 64}, stream_);  // m 0: nothing to do
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// ------------------------------------------------------------------------------ GemmLt

struct Shape {
  int64_t m, n, k;
  bool f32;
};

// m <= 8: the tuned result (cuBLAS or gemv, whichever won) matches the reference, on the tuning
// call and later ones; then a CUDA graph captured after tuning replays on new inputs.
TEST_F(CudaGemv, GemmLtTunedAndGraphReplay) {
  SCOPED_TRACE(trace());
  for (bool enabled : {true, false}) {
    GemmLt gemm;
    gemm.set_gemv_enabled(enabled);
    for (Shape s :
         {Shape{1, 5120, 2048, false}, Shape{1, 2048, 4096, false}, Shape{1, 128, 2048, true},
          Shape{1, 7, 64, false}, Shape{8, 5120, 2048, false}, Shape{4, 128, 2048, true}}) {
      SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                   std::to_string(s.k) + (s.f32 ? " fp32 out" : " bf16 out") +
                   (enabled ? "" : ", gemv disabled"));
      const double tol = s.f32 ? tol_f32(s.k) : kTolBf16;
      Bits x = randn_bf16(s.m * s.k), w = randn_bf16(s.n * s.k);
      std::vector<float> xf = to_f32(x), wf = to_f32(w), ref(s.m * s.n);
      cpu::gemm({xf.data(), wf.data(), ref.data(), s.m, s.n, s.k});
      DeviceBytes d_x(x.size() * 2), d_w(w.size() * 2), d_y((s.m * s.n + kGuard) * 4);
      d_x.upload(x);
      d_w.upload(w);
      GemmParams p{d_x.bf(), d_w.bf(), s.f32 ? nullptr : d_y.bf(), s.m, s.n, s.k};
      if (s.f32) p.y_f32 = d_y.f32();
      for (int call = 0; call < 2; ++call) {  // the tuning call, then the chosen path
        d_y.poison();
        gemm.run(p, stream_);
        EXPECT_LT(rel_err(output(d_y, s.m * s.n, s.f32), ref), tol) << "call " << call;
      }
      // Capture after tuning, replay on new inputs.
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      gemm.run(p, stream_);
      TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
      TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      x = randn_bf16(s.m * s.k);
      xf = to_f32(x);
      d_x.upload(x);
      cpu::gemm({xf.data(), wf.data(), ref.data(), s.m, s.n, s.k});
      for (int rep = 0; rep < 2; ++rep) {
        d_y.poison();
        TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
        EXPECT_LT(rel_err(output(d_y, s.m * s.n, s.f32), ref), tol) << "replay " << rep;
      }
      TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
      TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
    }
    std::cout << "[ gemv ] GemmLt" << (enabled ? "" : " (gemv disabled)") << ": gemv won "
              << gemm.num_gemv_plans() << " of " << gemm.num_plans() << " plans\n";
    if (!enabled) {
      EXPECT_EQ(gemm.num_gemv_plans(), 0u);
    }
  }
}

// A plan first seen during capture is not tuned: cuBLAS's heuristic pick, as before; operands
// gemv does not take (x 8-byte aligned) go to cuBLAS too.
TEST_F(CudaGemv, GemmLtUntunedCaptureAndUnalignedUseCublas) {
  SCOPED_TRACE(trace());
  const int64_t m = 1, n = 2048, k = 4096;
  Bits x = randn_bf16(k + 8), w = randn_bf16(n * k);
  std::vector<float> xf = to_f32(x), wf = to_f32(w), ref(n), ref4(n);
  cpu::gemm({xf.data(), wf.data(), ref.data(), m, n, k});
  cpu::gemm({xf.data() + 4, wf.data(), ref4.data(), m, n, k});
  DeviceBytes d_x(x.size() * 2), d_w(w.size() * 2), d_y((n + kGuard) * 4);
  d_x.upload(x);
  d_w.upload(w);
  GemmLt gemm;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  gemm.run({d_x.bf(), d_w.bf(), d_y.bf(), m, n, k}, stream_);
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  d_y.poison();
  TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  EXPECT_LT(rel_err(output(d_y, n, false), ref), kTolBf16);
  TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
  d_y.poison();
  gemm.run({d_x.bf(), d_w.bf(), d_y.bf(), m, n, k}, stream_);  // eager now: still untuned
  EXPECT_LT(rel_err(output(d_y, n, false), ref), kTolBf16);
  d_y.poison();
  gemm.run({d_x.bf(4), d_w.bf(), d_y.bf(), m, n, k}, stream_);  // x 8-byte aligned: tuned cuBLAS
  EXPECT_LT(rel_err(output(d_y, n, false), ref4), kTolBf16);
  EXPECT_EQ(gemm.num_plans(), 2u);
  EXPECT_EQ(gemm.num_gemv_plans(), 0u);
}

// The batch-invariant mode (set_batch_invariant, --deterministic): matches the reference, and
// every row is bitwise the same computed alone (m 1), inside m rows of any size (the small,
// medium and large tiles), after other rows (x offset) and inside a CUDA graph; beta != 0 is
// refused.
TEST_F(CudaGemv, GemmLtBatchInvariantRowsDoNotDependOnM) {
  SCOPED_TRACE(trace());
  GemmLt gemm;
  gemm.set_batch_invariant(true);
  for (Shape s : {Shape{300, 5120, 2048, false}, Shape{300, 128, 2048, true},
                  Shape{200, 1000, 264, true}, Shape{140, 2048, 768, false}}) {
    SCOPED_TRACE("n " + std::to_string(s.n) + " k " + std::to_string(s.k) +
                 (s.f32 ? " fp32 out" : " bf16 out"));
    const size_t es = s.f32 ? 4 : 2;
    Bits x = randn_bf16(s.m * s.k), w = randn_bf16(s.n * s.k);
    std::vector<float> xf = to_f32(x), wf = to_f32(w), ref(s.m * s.n);
    cpu::gemm({xf.data(), wf.data(), ref.data(), s.m, s.n, s.k});
    DeviceBytes d_x(x.size() * 2), d_w(w.size() * 2), d_y((s.m * s.n + kGuard) * 4);
    d_x.upload(x);
    d_w.upload(w);
    auto run = [&](int64_t row0, int64_t m) {  // rows [row0, row0 + m) into y[0, m)
      GemmParams p{d_x.bf(row0 * s.k), d_w.bf(), s.f32 ? nullptr : d_y.bf(), m, s.n, s.k};
      if (s.f32) p.y_f32 = d_y.f32();
      d_y.poison();
      gemm.run(p, stream_);
      return d_y.download<uint8_t>(static_cast<size_t>(m * s.n) * es);
    };
    const std::vector<uint8_t> all = run(0, s.m);
    EXPECT_LT(rel_err(output(d_y, s.m * s.n, s.f32), ref), s.f32 ? tol_f32(s.k) : kTolBf16);
    const size_t row_bytes = static_cast<size_t>(s.n) * es;
    for (int64_t m : {int64_t{1}, int64_t{3}, int64_t{16}, int64_t{17}, int64_t{48}, int64_t{100},
                      int64_t{129}}) {
      for (int64_t row0 : {int64_t{0}, s.m - m}) {
        const std::vector<uint8_t> part = run(row0, m);
        for (int64_t r = 0; r < m; ++r) {
          ASSERT_EQ(std::memcmp(part.data() + r * row_bytes, all.data() + (row0 + r) * row_bytes,
                                row_bytes),
                    0)
              << "row " << row0 + r << " computed in " << m << " rows from row " << row0
              << " differs from the " << s.m << "-row result";
        }
      }
    }
    // A captured graph gives the same bits.
    GemmParams p{d_x.bf(), d_w.bf(), s.f32 ? nullptr : d_y.bf(), 5, s.n, s.k};
    if (s.f32) p.y_f32 = d_y.f32();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    gemm.run(p, stream_);
    TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    d_y.poison();
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    const std::vector<uint8_t> g = d_y.download<uint8_t>(5 * row_bytes);
    EXPECT_EQ(std::memcmp(g.data(), all.data(), 5 * row_bytes), 0) << "graph replay";
    TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  EXPECT_EQ(gemm.num_plans(), 0u) << "the invariant mode made cuBLASLt plans";
  // beta != 0 (accumulating into y) is not covered: refused, not silently wrong.
  DeviceBytes d_x(64 * 2), d_w(64 * 64 * 2), d_y(64 * 2);
  GemmParams p{d_x.bf(), d_w.bf(), d_y.bf(), 1, 64, 64};
  p.beta = 1.0f;
  try {
    gemm.run(p, stream_);
    ADD_FAILURE() << "beta 1 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
  }
}

}  // namespace
}  // namespace tandem::cuda
