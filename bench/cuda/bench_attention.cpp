// Paged attention on the GPU at Qwen3 shapes (head_dim 128, page 16, 4 kv heads; 32 q heads of
// Qwen3-30B-A3B, 64 of Qwen3-235B-A22B): the tensor-core prefill and split-KV decode kernels
// behind paged_attention_launch beside the first simple kernel, each beside its bound measured
// in the same run: cuBLASLt's own bf16 rate at 8192^3 for prefill (FLOPs = 4 * causal pairs *
// head_dim * q_heads), the device-to-device copy bandwidth (cudaMemcpyAsync, bytes read +
// written) for decode (bytes = the KV read + q + out).
//
//   bench_attention [--quick]       CSV to $TANDEM_BENCH_CSV when set
//
// Method as bench_ops_cuda: random inputs, enough input sets to exceed 3x the L2, warm-up,
// launches captured in a CUDA graph and replayed, median per-call time over replays.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_fa.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "core/dtype.h"

using namespace tandem;
using namespace tandem::cuda;

namespace {

constexpr int64_t kHeadDim = 128, kKvHeads = 4, kPageSize = 16;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::mt19937 g_rng(20261130);

/// Device allocation freed at exit of the benchmark scope.
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

// Random bf16 in [-scale, scale] from a 1 Mi-element host pattern copied with shifting offsets.
void fill_bf16(Buf& b, float scale = 1.0f) {
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
template <typename T>
void upload(Buf& b, std::vector<T> const& v) {
  TANDEM_CUDA_CHECK(cudaMemcpy(b.ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

struct Row {
  std::string op;
  int64_t tokens;
  std::string shape;
  double us;     // measured per call
  double bytes;  // fewest bytes the op must move
  double flops;
  double bound_us;
};

struct Bench {
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  size_t l2 = 0;
  int num_sms = 132;
  double copy_Bps = 0;    // bytes read + written per second
  double gemm_flops = 0;  // cuBLASLt bf16 8192^3
  bool quick = false;
  std::vector<Row> rows;

  /// Input/output sets needed to exceed 3x the L2 with sets of `set_bytes`.
  int sets_for(double set_bytes) const {
    const double need = 3.0 * static_cast<double>(l2) / std::max(set_bytes, 1.0);
    return static_cast<int>(std::clamp(std::ceil(need), 1.0, 64.0));
  }

  float elapsed_ms() {
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0, ev1));
    return ms;
  }

  /// Median per-call microseconds of launch(i % sets), graph-captured.
  double time_us(int sets, std::function<void(int)> const& launch) {
    for (int i = 0; i < sets; ++i) launch(i);  // warm-up: modules, cuBLASLt plans
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
    TANDEM_CUDA_CHECK(cudaEventRecord(ev0, stream));
    for (int i = 0; i < sets; ++i) launch(i);
    TANDEM_CUDA_CHECK(cudaEventRecord(ev1, stream));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(ev1));
    const double est_ms = std::max(1e-4, static_cast<double>(elapsed_ms()) / sets);
    int iters = static_cast<int>(std::clamp(3.0 / est_ms, 1.0, 256.0));  // ~3 ms per replay
    iters = std::max(sets, (iters + sets - 1) / sets * sets);
    const int reps = quick ? 5 : (est_ms * iters > 50 ? 7 : 25);
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
    for (int r = 0; r < reps + 2; ++r) {
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

  void add(std::string op, int64_t tokens, std::string shape, double us, double bytes,
           double flops) {
    const double bound = 1e6 * std::max(bytes / copy_Bps, flops > 0 ? flops / gemm_flops : 0.0);
    rows.push_back({std::move(op), tokens, std::move(shape), us, bytes, flops, bound});
    const Row& r = rows.back();
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
};

// ---------------------------------------------------------------- ceilings
void measure_ceilings(Bench& b) {
  const size_t bytes = size_t{1} << 30;
  Buf src(bytes), dst(bytes);
  fill_bf16(src);
  std::vector<double> t;
  for (int i = 0; i < 23; ++i) {
    TANDEM_CUDA_CHECK(cudaEventRecord(b.ev0, b.stream));
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, bytes, cudaMemcpyDeviceToDevice, b.stream));
    TANDEM_CUDA_CHECK(cudaEventRecord(b.ev1, b.stream));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(b.ev1));
    if (i >= 3) t.push_back(b.elapsed_ms() * 1e-3);
  }
  b.copy_Bps = 2.0 * static_cast<double>(bytes) / median(t);

  const int64_t n = 8192;
  Buf x(n * n * 2), w(n * n * 2), y(n * n * 2);
  fill_bf16(x);
  fill_bf16(w);
  GemmLt gemm;
  b.gemm_flops = 1.0;  // so that add() below does not divide by zero
  const double us = b.time_us(1, [&](int) {
    gemm.run({x.as<bf16>(), w.as<bf16>(), y.as<bf16>(), n, n, n}, b.stream);
  });
  b.gemm_flops = 2.0 * n * n * n / (us * 1e-6);
  std::printf(
      "== ceilings: copy %.0f GB/s (1 GiB cudaMemcpyAsync D2D, read + write), "
      "cuBLASLt bf16 8192^3 %.1f TFLOP/s (%.1f us)\n",
      b.copy_Bps / 1e9, b.gemm_flops / 1e12, us);
  b.add("gemm_8192^3", n, "8192x8192x8192 (the GEMM ceiling)", us, 3.0 * n * n * 2,
        2.0 * n * n * n);
}

// ---------------------------------------------------------------- attention
struct Variant {
  std::string name;
  PagedAttentionAlgo algo;
  int64_t num_prefill_tokens, kv_split;
  int prefill_variant = -1;  // >= 0: detail::paged_attention_prefill_variant (block shapes)
};

// `seqs` sequences of `ctx` cached tokens each, whose last `queries` positions are queried
// (queries == ctx: a fresh causal prefill; 1: decode).
void bench_attention(Bench& b, int64_t q_heads, int64_t seqs, int64_t ctx, int64_t queries,
                     bool with_simple) {
  const int64_t T = seqs * queries, pages_per_seq = (ctx + kPageSize - 1) / kPageSize;
  const double page_bytes = 2.0 * kKvHeads * kPageSize * kHeadDim * 2;
  const double kv_bytes = seqs * pages_per_seq * page_bytes;
  const int64_t nq = T * q_heads * kHeadDim;
  const int sets = b.sets_for(kv_bytes + 4.0 * nq);
  Buf pool(static_cast<size_t>(sets * seqs * pages_per_seq * page_bytes)), q(sets * nq * 2),
      out(sets * nq * 2), table(sets * seqs * pages_per_seq * 4), tseq(T * 4), pos(T * 4);
  fill_bf16(pool);
  fill_bf16(q);
  std::vector<int32_t> ht(sets * seqs * pages_per_seq), hseq(T), hpos(T);
  std::iota(ht.begin(), ht.end(), 0);
  std::shuffle(ht.begin(), ht.end(), g_rng);
  double pairs = 0;
  for (int64_t t = 0; t < T; ++t) {
    hseq[t] = static_cast<int32_t>(t / queries);
    hpos[t] = static_cast<int32_t>(ctx - queries + t % queries);
    pairs += hpos[t] + 1.0;
  }
  upload(table, ht);
  upload(tseq, hseq);
  upload(pos, hpos);
  const bool prefill = queries > 1;
  const int64_t split =
      prefill ? 0 : paged_attention_decode_split(T, kKvHeads, pages_per_seq, kPageSize, b.num_sms);
  const int64_t simple_split =
      prefill ? 0 : paged_attention_pick_split(T, kKvHeads, pages_per_seq, kPageSize, b.num_sms);
  std::vector<Variant> variants;
  if (prefill) {
    variants.push_back({"attn_prefill", PagedAttentionAlgo::kAuto, T, 0});
    if (with_simple) {
      variants.push_back({"attn_prefill_8w2b", PagedAttentionAlgo::kPrefill, T, 0, 1});
      variants.push_back({"attn_prefill_4w2b", PagedAttentionAlgo::kPrefill, T, 0, 2});
      variants.push_back({"attn_prefill_simple", PagedAttentionAlgo::kSimple, T, 0});
    }
  } else {
    variants.push_back({"attn_decode", PagedAttentionAlgo::kAuto, 0, split});
    if (split) variants.push_back({"attn_decode_nosplit", PagedAttentionAlgo::kAuto, 0, 0});
    if (with_simple) {
      variants.push_back({"attn_decode_simple", PagedAttentionAlgo::kSimple, 0, simple_split});
    }
  }
  const std::string shape =
      std::to_string(q_heads) + "q/4kv, " +
      (prefill ? "causal prefill 1 seq x " + std::to_string(ctx)
               : std::to_string(seqs) + " seq x " + std::to_string(ctx) + " ctx");
  for (Variant const& v : variants) {
    b.guarded(v.name, [&] {
      Buf ws(paged_attention_workspace_floats(T, q_heads, kHeadDim, pages_per_seq, kPageSize,
                                              v.kv_split) *
             4);
      const double us = b.time_us(sets, [&](int i) {
        PagedAttentionParams p{q.as<bf16>(i * nq),
                               pool.as<bf16>(),
                               table.as<int32_t>(i * seqs * pages_per_seq),
                               tseq.as<int32_t>(),
                               pos.as<int32_t>(),
                               out.as<bf16>(i * nq),
                               T,
                               q_heads,
                               kKvHeads,
                               kHeadDim,
                               kPageSize,
                               pages_per_seq,
                               1.0f / std::sqrt(static_cast<float>(kHeadDim)),
                               v.kv_split,
                               ws.as<float>()};
        p.num_prefill_tokens = v.num_prefill_tokens;
        p.algo = v.algo;
        if (v.prefill_variant >= 0) {
          cuda::detail::paged_attention_prefill_variant(p, v.prefill_variant, b.stream);
        } else {
          paged_attention_launch(p, b.stream);
        }
      });
      b.add(v.name, T, shape + (prefill ? "" : ", split " + std::to_string(v.kv_split)), us,
            kv_bytes + 4.0 * nq, 4.0 * pairs * q_heads * kHeadDim);
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) b.quick = true;
  }
  try {
    int dev = 0, count = 0;
    TANDEM_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (count == 0) {
      std::printf("no CUDA device\n");
      return 2;
    }
    cudaDeviceProp prop{};
    TANDEM_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    b.l2 = static_cast<size_t>(prop.l2CacheSize);
    b.num_sms = prop.multiProcessorCount;
    std::printf("== device: %s, %d SMs, L2 %.0f MB, %.0f GB\n", prop.name, prop.multiProcessorCount,
                b.l2 / 1e6, prop.totalGlobalMem / 1e9);
    TANDEM_CUDA_CHECK(cudaStreamCreate(&b.stream));
    TANDEM_CUDA_CHECK(cudaEventCreate(&b.ev0));
    TANDEM_CUDA_CHECK(cudaEventCreate(&b.ev1));
    measure_ceilings(b);
    std::printf("== prefill (Qwen3-30B-A3B 32q/4kv, Qwen3-235B 64q/4kv)\n");
    for (int64_t T : {2048, 8192}) {
      bench_attention(b, 32, 1, T, T, /*with_simple=*/true);
      bench_attention(b, 64, 1, T, T, /*with_simple=*/false);
    }
    std::printf("== decode (Qwen3-30B-A3B 32q/4kv)\n");
    for (int64_t ctx : {1024, 4096}) {
      for (int64_t seqs : {1, 8, 32, 128, 256}) {
        bench_attention(b, 32, seqs, ctx, 1, /*with_simple=*/seqs <= 128);
      }
    }
    std::printf("== decode (Qwen3-235B-A22B 64q/4kv: GQA 16)\n");
    for (int64_t ctx : {1024, 4096}) {
      for (int64_t seqs : {1, 8, 32, 128, 256}) {
        bench_attention(b, 64, seqs, ctx, 1, /*with_simple=*/seqs <= 8);
      }
    }
  } catch (std::exception const& e) {
    std::printf("FATAL: %s\n", e.what());
    return 1;
  }

  std::printf("\n== table (bound = max(bytes / %.0f GB/s copy, flops / %.1f TFLOP/s GEMM))\n",
              b.copy_Bps / 1e9, b.gemm_flops / 1e12);
  std::printf("%-20s %6s %10s %10s %7s %9s %9s  %s\n", "op", "tokens", "us", "bound_us", "%bound",
              "GB/s", "TFLOP/s", "shape");
  for (Row const& r : b.rows) {
    std::printf("%-20s %6lld %10.2f %10.2f %6.1f%% %9.0f %9.2f  %s\n", r.op.c_str(),
                static_cast<long long>(r.tokens), r.us, r.bound_us, 100.0 * r.bound_us / r.us,
                r.bytes / (r.us * 1e-6) / 1e9, r.flops / (r.us * 1e-6) / 1e12, r.shape.c_str());
  }
  if (const char* csv = std::getenv("TANDEM_BENCH_CSV")) {
    std::ofstream f(csv);
    f << "op,tokens,shape,us,bound_us,bytes,flops\n";
    for (Row const& r : b.rows) {
      f << r.op << "," << r.tokens << ",\"" << r.shape << "\"," << r.us << "," << r.bound_us << ","
        << r.bytes << "," << r.flops << "\n";
    }
  }
  int failed = 0;
  for (Row const& r : b.rows) failed += std::isnan(r.us) ? 1 : 0;
  return failed ? 1 : 0;
}
