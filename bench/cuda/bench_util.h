// Helpers shared by the CUDA benchmarks (bench_ops_cuda, bench_attention, bench_moe_layer,
// bench_sampling, bench_model_cuda; one executable each, so the inline variables below are one
// per benchmark): device buffers, random bf16 fills, medians, CUDA-event and CUDA-graph timing,
// the ceilings (1 GiB D2D copy bandwidth, cuBLASLt bf16 8192^3 rate), CSV to $TANDEM_BENCH_CSV,
// and the op / tokens / bound table of bench_ops_cuda and bench_attention.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "core/dtype.h"

namespace tandem::bench {

/// The benchmark's random source (fills, routing, shuffles), seeded the same in every run.
inline std::mt19937 g_rng(20261130);

/// Median; the mean of the middle two for an even count.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The upper median v[n / 2] (no averaging); 0 when empty (bench_model_cuda's).
inline double upper_median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// Device allocation (at least 16 bytes) freed at exit of the benchmark scope.
struct Buf {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit Buf(size_t b) : bytes(b) {
    TANDEM_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(b, 16)));
  }
  ~Buf() { (void)cudaFree(ptr); }
  Buf(Buf const&) = delete;
  Buf& operator=(Buf const&) = delete;
  template <typename T>
  T* as(size_t elem_offset = 0) const {
    return reinterpret_cast<T*>(ptr) + elem_offset;
  }
};

/// Random bf16 in [-scale, scale] from a 1 Mi-element host pattern (drawn from g_rng on the
/// first call) copied with shifting offsets.
inline void fill_bf16(Buf& b, float scale = 1.0f) {
  static std::vector<uint16_t> pattern = [] {
    std::vector<uint16_t> p(size_t{1} << 20);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    for (auto& v : p) v = f32_to_bf16(d(g_rng));
    return p;
  }();
  std::vector<uint16_t> scaled(pattern.size());
  for (size_t i = 0; i < pattern.size(); ++i)
    scaled[i] = f32_to_bf16(bf16_to_f32(pattern[i]) * scale);
  const size_t n = b.bytes / 2;
  size_t done = 0, shift = 0;
  while (done < n) {
    const size_t chunk = std::min(n - done, scaled.size() - shift);
    TANDEM_CUDA_CHECK(
        cudaMemcpy(b.as<uint16_t>(done), scaled.data() + shift, chunk * 2, cudaMemcpyHostToDevice));
    done += chunk;
    shift = (shift + 7919) % (scaled.size() / 2);
  }
}

/// Random bf16 with standard deviation `stddev` (uniform, drawn from g_rng on every call):
/// 32 MiB from the host, then device copies of it at shifting offsets (fast for many GB).
inline void fill_bf16_stddev(Buf& b, float stddev) {
  const size_t n = b.bytes / 2, chunk = std::min<size_t>(n, size_t{16} << 20);
  std::vector<uint16_t> h(chunk);
  std::uniform_real_distribution<float> d(-stddev * 1.7320508f, stddev * 1.7320508f);
  for (auto& v : h) v = f32_to_bf16(d(g_rng));
  TANDEM_CUDA_CHECK(cudaMemcpy(b.ptr, h.data(), chunk * 2, cudaMemcpyHostToDevice));
  size_t done = chunk, shift = 0;
  while (done < n) {
    shift = chunk > 1 ? (shift + 7919) % (chunk / 2) : 0;
    const size_t len = std::min(n - done, chunk - shift);
    TANDEM_CUDA_CHECK(
        cudaMemcpy(b.as<uint16_t>(done), b.as<uint16_t>(shift), len * 2, cudaMemcpyDeviceToDevice));
    done += len;
  }
}

template <typename T>
void upload(Buf& b, std::vector<T> const& v) {
  TANDEM_CUDA_CHECK(cudaMemcpy(b.ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

/// fn() timed alone between two events on `stream`, warmup + samples times; the last
/// `samples` times in milliseconds.
inline std::vector<double> event_samples_ms(cudaStream_t stream, cudaEvent_t ev0, cudaEvent_t ev1,
                                            int warmup, int samples,
                                            std::function<void()> const& fn) {
  std::vector<double> t;
  for (int i = 0; i < warmup + samples; ++i) {
    TANDEM_CUDA_CHECK(cudaEventRecord(ev0, stream));
    fn();
    TANDEM_CUDA_CHECK(cudaEventRecord(ev1, stream));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(ev1));
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
    if (i >= warmup) t.push_back(ms);
  }
  return t;
}

/// A stream, two events and the per-call timing of launch(i % sets) over `sets` input sets:
/// warm-up, an estimate, then ~replay_ms worth of calls per replay, the median over replays.
struct Timer {
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  bool quick = false;
  // Replays (after 2 discarded in time_us): 5 with quick, else `reps`, or `long_reps` when
  // long_replay_ms > 0 and one replay takes longer than that.
  double replay_ms = 3.0;
  int reps = 15;
  double long_replay_ms = 0;
  int long_reps = 0;
  bool owns_stream = false;

  Timer() = default;
  Timer(double replay_ms_, int reps_, double long_replay_ms_ = 0, int long_reps_ = 0)
      : replay_ms(replay_ms_),
        reps(reps_),
        long_replay_ms(long_replay_ms_),
        long_reps(long_reps_) {}
  ~Timer() {
    if (ev0) (void)cudaEventDestroy(ev0);
    if (ev1) (void)cudaEventDestroy(ev1);
    if (owns_stream && stream) (void)cudaStreamDestroy(stream);
  }
  Timer(Timer const&) = delete;
  Timer& operator=(Timer const&) = delete;

  /// The events (on the current device).
  void create_events() {
    TANDEM_CUDA_CHECK(cudaEventCreate(&ev0));
    TANDEM_CUDA_CHECK(cudaEventCreate(&ev1));
  }
  /// A stream of its own and the events.
  void create() {
    TANDEM_CUDA_CHECK(cudaStreamCreate(&stream));
    owns_stream = true;
    create_events();
  }

  float elapsed_ms() {
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
    return ms;
  }

  /// Calls per replay for launch(i % sets) (a multiple of sets), after the warm-up and the
  /// estimate; est_ms: the estimated time of one call.
  int iters_for(int sets, std::function<void(int)> const& launch, double* est_ms) {
    for (int i = 0; i < sets; ++i) launch(i);  // warm-up: modules, cuBLASLt plans, attributes
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
    TANDEM_CUDA_CHECK(cudaEventRecord(ev0, stream));
    for (int i = 0; i < sets; ++i) launch(i);
    TANDEM_CUDA_CHECK(cudaEventRecord(ev1, stream));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(ev1));
    *est_ms = std::max(1e-4, static_cast<double>(elapsed_ms()) / sets);
    int iters = static_cast<int>(std::clamp(replay_ms / *est_ms, 1.0, 256.0));
    return std::max(sets, (iters + sets - 1) / sets * sets);
  }
  int reps_for(double replay_est_ms) const {
    if (quick) return 5;
    return long_replay_ms > 0 && replay_est_ms > long_replay_ms ? long_reps : reps;
  }

  /// Median per-call microseconds of launch(i % sets), graph-captured.
  double time_us(int sets, std::function<void(int)> const& launch) {
    double est_ms = 0;
    const int iters = iters_for(sets, launch, &est_ms);
    const int n_reps = reps_for(est_ms * iters);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      for (int i = 0; i < iters; ++i) launch(i % sets);
    } catch (...) {
      (void)cudaStreamEndCapture(stream, &graph);
      if (graph) (void)cudaGraphDestroy(graph);
      throw;
    }
    TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<double> per_call;
    for (int r = 0; r < n_reps + 2; ++r) {
      TANDEM_CUDA_CHECK(cudaEventRecord(ev0, stream));
      TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      TANDEM_CUDA_CHECK(cudaEventRecord(ev1, stream));
      TANDEM_CUDA_CHECK(cudaEventSynchronize(ev1));
      if (r >= 2) per_call.push_back(1e3 * elapsed_ms() / iters);
    }
    TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
    return median(per_call);
  }

  /// Median per-call microseconds of launch(i % sets), not captured (for what syncs).
  double time_eager_us(int sets, std::function<void(int)> const& launch) {
    double est_ms = 0;
    const int iters = iters_for(sets, launch, &est_ms);
    const int n_reps = reps_for(est_ms * iters);
    std::vector<double> per_call;
    for (int r = 0; r < n_reps; ++r) {
      TANDEM_CUDA_CHECK(cudaEventRecord(ev0, stream));
      for (int i = 0; i < iters; ++i) launch(i % sets);
      TANDEM_CUDA_CHECK(cudaEventRecord(ev1, stream));
      TANDEM_CUDA_CHECK(cudaEventSynchronize(ev1));
      per_call.push_back(1e3 * elapsed_ms() / iters);
    }
    return median(per_call);
  }
};

/// Bytes read + written per second of cudaMemcpyAsync D2D of src to dst (src.bytes): median
/// (`med`) of `samples` copies after `warmup` untimed ones.
inline double measure_copy_Bps(Timer& t, Buf const& src, Buf& dst, int warmup, int samples,
                               double (*med)(std::vector<double>) = median) {
  std::vector<double> ms = event_samples_ms(t.stream, t.ev0, t.ev1, warmup, samples, [&] {
    TANDEM_CUDA_CHECK(
        cudaMemcpyAsync(dst.ptr, src.ptr, src.bytes, cudaMemcpyDeviceToDevice, t.stream));
  });
  for (double& v : ms) v *= 1e-3;
  return 2.0 * static_cast<double>(src.bytes) / med(ms);
}

struct Ceilings {
  double copy_Bps = 0;    // bytes read + written per second
  double gemm_flops = 0;  // cuBLASLt bf16 8192^3
  double gemm_us = 0;
};

/// The ceilings as bench_ops_cuda, bench_attention and bench_moe_layer measure them: 1 GiB
/// copied D2D (3 + 20 copies, median), cuBLASLt bf16 8192^3 graph-timed with t.time_us; the
/// buffers filled by `fill`. Prints the "== ceilings" line.
inline Ceilings measure_ceilings(Timer& t, std::function<void(Buf&)> const& fill) {
  Ceilings c;
  const size_t bytes = size_t{1} << 30;
  Buf src(bytes), dst(bytes);
  fill(src);
  c.copy_Bps = measure_copy_Bps(t, src, dst, 3, 20);
  const int64_t n = 8192;
  Buf x(n * n * 2), w(n * n * 2), y(n * n * 2);
  fill(x);
  fill(w);
  cuda::GemmLt gemm;
  c.gemm_us = t.time_us(1, [&](int) {
    gemm.run({x.as<cuda::bf16>(), w.as<cuda::bf16>(), y.as<cuda::bf16>(), n, n, n}, t.stream);
  });
  c.gemm_flops = 2.0 * n * n * n / (c.gemm_us * 1e-6);
  std::printf(
      "== ceilings: copy %.0f GB/s (1 GiB cudaMemcpyAsync D2D, read + write), "
      "cuBLASLt bf16 8192^3 %.1f TFLOP/s (%.1f us)\n",
      c.copy_Bps / 1e9, c.gemm_flops / 1e12, c.gemm_us);
  return c;
}

/// Device 0's properties, after printing the "== device" line; false (after printing
/// "no CUDA device") when there is none.
inline bool open_device(cudaDeviceProp* prop) {
  int count = 0;
  TANDEM_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (count == 0) {
    std::printf("no CUDA device\n");
    return false;
  }
  *prop = cudaDeviceProp{};
  TANDEM_CUDA_CHECK(cudaGetDeviceProperties(prop, 0));
  std::printf("== device: %s, %d SMs, L2 %.0f MB, %.0f GB\n", prop->name, prop->multiProcessorCount,
              prop->l2CacheSize / 1e6, prop->totalGlobalMem / 1e9);
  return true;
}

/// Writes `header` then write_row(file, row) for each row to $TANDEM_BENCH_CSV when set.
template <typename Row, typename WriteRow>
void write_csv(std::vector<Row> const& rows, char const* header, WriteRow const& write_row) {
  if (const char* csv = std::getenv("TANDEM_BENCH_CSV")) {
    std::ofstream f(csv);
    f << header;
    for (Row const& r : rows) write_row(f, r);
  }
}

/// Rows whose time is NaN (failed measurements).
template <typename Row>
int count_failed(std::vector<Row> const& rows) {
  int failed = 0;
  for (Row const& r : rows) failed += std::isnan(r.us) ? 1 : 0;
  return failed;
}

// ------------------------------------------------ op rows against the two ceilings
// bench_ops_cuda and bench_attention: bound = max(bytes / copy bandwidth, flops / GEMM rate).

struct OpRow {
  std::string op;
  int64_t tokens;
  std::string shape;
  double us;     // measured per call
  double bytes;  // fewest bytes the op must move
  double flops;
  double bound_us;
};

struct OpBench : Timer {
  size_t l2 = 0;
  int num_sms = 132;
  double copy_Bps = 0;    // bytes read + written per second
  double gemm_flops = 0;  // cuBLASLt bf16 8192^3
  std::vector<OpRow> rows;

  // ~3 ms per replay; 25 replays, 7 when one replay takes over 50 ms.
  OpBench() : Timer(3.0, 25, 50.0, 7) {}

  /// Input/output sets needed to exceed 3x the L2 with sets of `set_bytes`.
  int sets_for(double set_bytes) const {
    const double need = 3.0 * static_cast<double>(l2) / std::max(set_bytes, 1.0);
    return static_cast<int>(std::clamp(std::ceil(need), 1.0, 64.0));
  }

  /// The device line, l2 and num_sms, the stream and events; false without a device.
  bool open() {
    cudaDeviceProp prop{};
    if (!open_device(&prop)) return false;
    l2 = static_cast<size_t>(prop.l2CacheSize);
    num_sms = prop.multiProcessorCount;
    create();
    return true;
  }

  void add(std::string op, int64_t tokens, std::string shape, double us, double bytes,
           double flops) {
    const double bound = 1e6 * std::max(bytes / copy_Bps, flops > 0 ? flops / gemm_flops : 0.0);
    rows.push_back({std::move(op), tokens, std::move(shape), us, bytes, flops, bound});
    const OpRow& r = rows.back();
    std::printf("%-22s %6lld  %-34s %10.2f us  bound %9.2f us  %5.1f%%\n", r.op.c_str(),
                static_cast<long long>(r.tokens), r.shape.c_str(), r.us, r.bound_us,
                100.0 * r.bound_us / r.us);
    std::fflush(stdout);
  }

  /// Runs one measurement, reporting a failure as a row instead of ending the run.
  void guarded(std::string const& what, std::function<void()> const& fn) {
    try {
      fn();
    } catch (std::exception const& e) {
      std::printf("FAILED %s: %s\n", what.c_str(), e.what());
      rows.push_back({what + " FAILED", 0, e.what(), NAN, 0, 0, NAN});
      (void)cudaGetLastError();
      (void)cudaDeviceSynchronize();
    }
  }

  /// The ceilings (pattern-filled buffers), then the GEMM ceiling as the first row.
  void measure_ceilings() {
    const Ceilings c = bench::measure_ceilings(*this, [](Buf& b) { fill_bf16(b); });
    copy_Bps = c.copy_Bps;
    gemm_flops = c.gemm_flops;
    const int64_t n = 8192;
    add("gemm_8192^3", n, "8192x8192x8192 (the GEMM ceiling)", c.gemm_us, 3.0 * n * n * 2,
        2.0 * n * n * n);
  }

  /// The "== table", the CSV; the exit code (1 when a measurement failed).
  int finish() const {
    std::printf("\n== table (bound = max(bytes / %.0f GB/s copy, flops / %.1f TFLOP/s GEMM))\n",
                copy_Bps / 1e9, gemm_flops / 1e12);
    std::printf("%-20s %6s %10s %10s %7s %9s %9s  %s\n", "op", "tokens", "us", "bound_us", "%bound",
                "GB/s", "TFLOP/s", "shape");
    for (OpRow const& r : rows) {
      std::printf("%-20s %6lld %10.2f %10.2f %6.1f%% %9.0f %9.2f  %s\n", r.op.c_str(),
                  static_cast<long long>(r.tokens), r.us, r.bound_us, 100.0 * r.bound_us / r.us,
                  r.bytes / (r.us * 1e-6) / 1e9, r.flops / (r.us * 1e-6) / 1e12, r.shape.c_str());
    }
    write_csv(rows, "op,tokens,shape,us,bound_us,bytes,flops\n",
              [](std::ofstream& f, OpRow const& r) {
                f << r.op << "," << r.tokens << ",\"" << r.shape << "\"," << r.us << ","
                  << r.bound_us << "," << r.bytes << "," << r.flops << "\n";
              });
    return count_failed(rows) ? 1 : 0;
  }
};

}  // namespace tandem::bench
