// Per-kernel timings of the CUDA backend ops at Qwen3-30B-A3B shapes (hidden 2048, 32 q / 4 kv
// heads, head_dim 128, 128 experts top-8, expert width 768) for 1, 32, 128 and 8192 tokens,
// each beside its bound measured in the same run: the device-to-device copy bandwidth
// (cudaMemcpyAsync, bytes read + written) for memory-bound ops, and cuBLASLt's own bf16 rate
// at 8192^3 for the GEMMs. bound = max(bytes / copy bandwidth, flops / GEMM rate).
//
//   bench_ops_cuda [--quick] [--gemv]   CSV to $TANDEM_BENCH_CSV when set
//   (--gemv: the ceilings and the small-m GEMM section only)
//
// Method: inputs are random (never zeros); each op rotates among enough input/output sets to
// exceed 3x the L2 (a set larger than that is used alone); warm-up launches first; the
// launches are captured in a CUDA graph and replayed, per-call time = replay time / launches,
// median over replays. Decode attention: one query per sequence, 4096-token context each;
// at 8192 tokens it is one causal prefill sequence (CUDA cores, so far below the GEMM bound).
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
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/norm.h"
#include "core/dtype.h"

using namespace tandem;
using namespace tandem::cuda;

namespace {

// Qwen3-30B-A3B.
constexpr int64_t kHidden = 2048, kQHeads = 32, kKvHeads = 4, kHeadDim = 128;
constexpr int64_t kExperts = 128, kTopK = 8, kInter = 768, kVocab = 151936;
constexpr int64_t kPageSize = 16, kDecodeContext = 4096;

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

// ---------------------------------------------------------------- ops
void bench_tokens(Bench& b, int64_t T) {
  const int64_t H = kHidden;
  std::string hs = "hidden " + std::to_string(H);

  b.guarded("embedding", [&] {
    Buf table(kVocab * H * 2);
    fill_bf16(table);
    const int sets = b.sets_for(2.0 * T * H * 2);
    Buf ids(sets * T * 4), out(sets * T * H * 2);
    std::vector<int32_t> h(sets * T);
    for (auto& v : h) v = std::uniform_int_distribution<int32_t>(0, kVocab - 1)(g_rng);
    upload(ids, h);
    double us = b.time_us(sets, [&](int i) {
      embedding_launch(
          {ids.as<int32_t>(i * T), table.as<bf16>(), out.as<bf16>(i * T * H), T, H, kVocab},
          b.stream);
    });
    b.add("embedding", T, "vocab 151936, " + hs, us, 2.0 * T * H * 2, 0);
  });

  b.guarded("rms_norm", [&] {
    const int sets = b.sets_for(2.0 * T * H * 2);
    Buf x(sets * T * H * 2), out(sets * T * H * 2), w(H * 2);
    fill_bf16(x, 3.0f);
    fill_bf16(w);
    double us = b.time_us(sets, [&](int i) {
      rms_norm_launch({x.as<bf16>(i * T * H), w.as<bf16>(), out.as<bf16>(i * T * H), T, H, 1e-6f},
                      b.stream);
    });
    b.add("rms_norm", T, hs, us, 2.0 * T * H * 2 + H * 2, 0);
  });

  b.guarded("add_rms_norm", [&] {
    const int sets = b.sets_for(3.0 * T * H * 2);
    Buf res(sets * T * H * 2), x(sets * T * H * 2), out(sets * T * H * 2), w(H * 2);
    fill_bf16(res, 3.0f);
    fill_bf16(x, 0.01f);
    fill_bf16(w);
    double us = b.time_us(sets, [&](int i) {
      add_rms_norm_launch({res.as<bf16>(i * T * H), x.as<bf16>(i * T * H), w.as<bf16>(),
                           out.as<bf16>(i * T * H), T, H, 1e-6f},
                          b.stream);
    });
    b.add("add_rms_norm", T, hs, us, 4.0 * T * H * 2 + H * 2, 0);
  });

  b.guarded("qk_norm_rope", [&] {
    const int64_t nq = T * kQHeads * kHeadDim, nk = T * kKvHeads * kHeadDim;
    const int sets = b.sets_for((nq + nk) * 2.0);
    Buf q(sets * nq * 2), k(sets * nk * 2), qw(kHeadDim * 2), kw(kHeadDim * 2), pos(T * 4);
    fill_bf16(q);
    fill_bf16(k);
    fill_bf16(qw);
    fill_bf16(kw);
    std::vector<int32_t> hp(T);
    std::iota(hp.begin(), hp.end(), 100);
    upload(pos, hp);
    double us = b.time_us(sets, [&](int i) {
      qk_norm_rope_launch({q.as<bf16>(i * nq), k.as<bf16>(i * nk), qw.as<bf16>(), kw.as<bf16>(),
                           pos.as<int32_t>(), T, kQHeads, kKvHeads, kHeadDim, 1e-6f, 1e6},
                          b.stream);
    });
    b.add("qk_norm_rope", T, "32 q + 4 kv heads x 128, in place", us, 2.0 * (nq + nk) * 2, 0);
  });

  b.guarded("kv_write", [&] {
    const int64_t n = T * kKvHeads * kHeadDim;
    const int sets = b.sets_for(4.0 * n * 2);
    const int64_t slots_per_set = (T + kPageSize - 1) / kPageSize * kPageSize;
    const int64_t pages = sets * slots_per_set / kPageSize;
    Buf k(sets * n * 2), v(sets * n * 2), pool(pages * 2 * kKvHeads * kPageSize * kHeadDim * 2),
        slots(sets * T * 8);
    fill_bf16(k);
    fill_bf16(v);
    std::vector<int64_t> hs_(sets * T);
    for (int s = 0; s < sets; ++s) {
      std::vector<int64_t> perm(slots_per_set);
      std::iota(perm.begin(), perm.end(), s * slots_per_set);
      std::shuffle(perm.begin(), perm.end(), g_rng);
      std::copy(perm.begin(), perm.begin() + T, hs_.begin() + s * T);
    }
    upload(slots, hs_);
    double us = b.time_us(sets, [&](int i) {
      kv_write_launch({k.as<bf16>(i * n), v.as<bf16>(i * n), pool.as<bf16>(),
                       slots.as<int64_t>(i * T), T, kKvHeads, kHeadDim, kPageSize},
                      b.stream);
    });
    b.add("kv_write", T, "4 kv heads x 128, page 16", us, 4.0 * n * 2 + T * 8, 0);
  });

  b.guarded("topk_softmax", [&] {
    const int sets = b.sets_for(T * kExperts * 2.0);
    Buf logits(sets * T * kExperts * 2), ids(sets * T * kTopK * 4), w(sets * T * kTopK * 4);
    fill_bf16(logits, 4.0f);
    double us = b.time_us(sets, [&](int i) {
      topk_softmax_launch({logits.as<bf16>(i * T * kExperts), ids.as<int32_t>(i * T * kTopK),
                           w.as<float>(i * T * kTopK), T, kExperts, kTopK, true, DType::kBF16},
                          b.stream);
    });
    b.add("topk_softmax", T, "128 experts, top 8, renorm", us, T * kExperts * 2.0 + T * kTopK * 8.0,
          0);
  });

  b.guarded("silu_mul", [&] {
    const int64_t R = T * kTopK;
    const int sets = b.sets_for(R * 3.0 * kInter * 2);
    Buf gu(sets * R * 2 * kInter * 2), out(sets * R * kInter * 2);
    fill_bf16(gu, 3.0f);
    double us = b.time_us(sets, [&](int i) {
      silu_mul_launch({gu.as<bf16>(i * R * 2 * kInter), out.as<bf16>(i * R * kInter), R, kInter},
                      b.stream);
    });
    b.add("silu_mul", T, "rows T*8, inter 768", us, R * 3.0 * kInter * 2, 0);
  });

  // Routing shared by permute / unpermute: top-8 distinct experts per token, uniform.
  std::vector<int32_t> route(T * kTopK);
  {
    std::vector<int32_t> all(kExperts);
    std::iota(all.begin(), all.end(), 0);
    for (int64_t t = 0; t < T; ++t) {
      std::shuffle(all.begin(), all.end(), g_rng);
      std::copy(all.begin(), all.begin() + kTopK, route.begin() + t * kTopK);
    }
  }
  const int64_t S = T * kTopK;
  b.guarded("moe_permute", [&] {
    const int sets = b.sets_for((T + S) * H * 2.0);
    const size_t ws_elems = moe_permute_workspace_elems(T, kTopK, kExperts);
    Buf x(sets * T * H * 2), px(sets * S * H * 2), ids(T * kTopK * 4), counts(kExperts * 4),
        offsets((kExperts + 1) * 4), src(S * 4), slot_row(S * 4), ws(ws_elems * 4);
    fill_bf16(x);
    upload(ids, route);
    double us = b.time_us(sets, [&](int i) {
      moe_permute_launch({x.as<bf16>(i * T * H), ids.as<int32_t>(), px.as<bf16>(i * S * H),
                          counts.as<int32_t>(), offsets.as<int32_t>(), src.as<int32_t>(),
                          slot_row.as<int32_t>(), ws.as<int32_t>(), T, H, kTopK, 0, kExperts},
                         b.stream);
    });
    b.add("moe_permute", T, "128 experts, top 8, " + hs, us, (T + S) * H * 2.0 + S * 12.0, 0);
  });

  b.guarded("moe_unpermute", [&] {
    const int sets = b.sets_for((T + S) * H * 2.0);
    Buf y(sets * S * H * 2), out(sets * T * H * 2), ids(S * 4), w(S * 4), slot_row(S * 4);
    fill_bf16(y);
    upload(ids, route);
    std::vector<float> hw(S, 0.125f);
    upload(w, hw);
    std::vector<int32_t> rows(S);
    std::iota(rows.begin(), rows.end(), 0);
    std::shuffle(rows.begin(), rows.end(), g_rng);
    upload(slot_row, rows);
    double us = b.time_us(sets, [&](int i) {
      moe_unpermute_launch(
          {y.as<bf16>(i * S * H), ids.as<int32_t>(), w.as<float>(), slot_row.as<int32_t>(),
           out.as<bf16>(i * T * H), T, H, kTopK, DType::kBF16},
          b.stream);
    });
    b.add("moe_unpermute", T, "top 8, " + hs + ", bf16 out", us, (T + S) * H * 2.0 + S * 12.0, 0);
  });

  struct G {
    const char* name;
    int64_t m, n, k;
  };
  GemmLt gemm;
  for (G g : {G{"gemm_qkv", T, (kQHeads + 2 * kKvHeads) * kHeadDim, H},
              G{"gemm_o_proj", T, H, kQHeads * kHeadDim}, G{"gemm_router", T, kExperts, H},
              G{"gemm_expert_gate_up", std::max<int64_t>(1, S / kExperts), 2 * kInter, H}}) {
    b.guarded(g.name, [&] {
      const double set_bytes = (g.m * g.k + g.n * g.k + g.m * g.n) * 2.0;
      const int sets = b.sets_for(set_bytes);
      Buf x(sets * g.m * g.k * 2), w(sets * g.n * g.k * 2), y(sets * g.m * g.n * 2);
      fill_bf16(x);
      fill_bf16(w, 0.05f);
      double us = b.time_us(sets, [&](int i) {
        gemm.run({x.as<bf16>(i * g.m * g.k), w.as<bf16>(i * g.n * g.k), y.as<bf16>(i * g.m * g.n),
                  g.m, g.n, g.k},
                 b.stream);
      });
      b.add(g.name, T, std::to_string(g.m) + "x" + std::to_string(g.n) + "x" + std::to_string(g.k),
            us, set_bytes, 2.0 * g.m * g.n * g.k);
    });
  }

  b.guarded("paged_attention", [&] {
    const bool prefill = T > 1024;
    const int64_t seqs = prefill ? 1 : T, ctx = prefill ? T : kDecodeContext;
    const int64_t pages_per_seq = (ctx + kPageSize - 1) / kPageSize;
    const double page_bytes = 2.0 * kKvHeads * kPageSize * kHeadDim * 2;
    const double kv_bytes = seqs * pages_per_seq * page_bytes;
    const int sets = prefill ? 1 : b.sets_for(kv_bytes);
    const int64_t pages = sets * seqs * pages_per_seq;
    Buf pool(static_cast<size_t>(pages * page_bytes)), q(sets * T * kQHeads * kHeadDim * 2),
        out(sets * T * kQHeads * kHeadDim * 2), table(sets * seqs * pages_per_seq * 4), tseq(T * 4),
        pos(T * 4);
    fill_bf16(pool);
    fill_bf16(q);
    std::vector<int32_t> ht(sets * seqs * pages_per_seq), hseq(T), hpos(T);
    std::iota(ht.begin(), ht.end(), 0);
    std::shuffle(ht.begin(), ht.end(), g_rng);
    for (int64_t t = 0; t < T; ++t) {
      hseq[t] = prefill ? 0 : static_cast<int32_t>(t);
      hpos[t] = prefill ? static_cast<int32_t>(t) : static_cast<int32_t>(ctx - 1);
    }
    upload(table, ht);
    upload(tseq, hseq);
    upload(pos, hpos);
    const int64_t nq = T * kQHeads * kHeadDim;
    const double pairs = prefill ? 0.5 * T * (T + 1) : double(T) * ctx;
    // Without split, then (decode only) with the split paged_attention_pick_split chooses.
    const int64_t split =
        prefill ? 0 : paged_attention_pick_split(T, kKvHeads, pages_per_seq, kPageSize, b.num_sms);
    for (int64_t kv_split : {int64_t{0}, split}) {
      Buf ws(paged_attention_workspace_floats(T, kQHeads, kHeadDim, pages_per_seq, kPageSize,
                                              kv_split) *
             4);
      double us = b.time_us(sets, [&](int i) {
        PagedAttentionParams p{q.as<bf16>(i * nq),
                               pool.as<bf16>(),
                               table.as<int32_t>(i * seqs * pages_per_seq),
                               tseq.as<int32_t>(),
                               pos.as<int32_t>(),
                               out.as<bf16>(i * nq),
                               T,
                               kQHeads,
                               kKvHeads,
                               kHeadDim,
                               kPageSize,
                               pages_per_seq,
                               0.0883883f,
                               kv_split,
                               ws.as<float>()};
        paged_attention_launch(p, b.stream);
      });
      std::string shape = prefill
                              ? "causal prefill, 1 seq x 8192"
                              : "decode, 4096 ctx/seq, GQA 8, split " + std::to_string(kv_split);
      b.add(kv_split ? "paged_attention_split" : "paged_attention", T, shape, us,
            kv_bytes + 2.0 * nq * 2, 4.0 * pairs * kQHeads * kHeadDim);
      if (split == 0) break;
    }
  });
}

// ---------------------------------------------------------------- small-m GEMM
// The decode GEMMs at m = 1 and 8: the gemv kernel alone, GemmLt with cuBLASLt only (tuned),
// and GemmLt as built (tuned with gemv as one more candidate; the winner in the shape column).
// bytes = W + x + y: the weights dominate, so the bound is ~ weight bytes / copy bandwidth.
void bench_small_m(Bench& b) {
  struct G {
    const char* name;
    int64_t n, k;
    bool f32;
  };
  for (int64_t m : {1, 8}) {
    for (G g : {G{"qkv", (kQHeads + 2 * kKvHeads) * kHeadDim, kHidden, false},
                G{"o_proj", kHidden, kQHeads * kHeadDim, false},
                G{"router", kExperts, kHidden, true}, G{"lm_head", kVocab, kHidden, true}}) {
      const std::string shape = std::to_string(m) + "x" + std::to_string(g.n) + "x" +
                                std::to_string(g.k) + (g.f32 ? " fp32 out" : "");
      const double ysz = g.f32 ? 4.0 : 2.0;
      const double set_bytes = (m * g.k + g.n * g.k) * 2.0 + m * g.n * ysz;
      const double flops = 2.0 * m * g.n * g.k;
      const int sets = b.sets_for(set_bytes);
      Buf x(sets * m * g.k * 2), w(sets * g.n * g.k * 2),
          y(static_cast<size_t>(sets * m * g.n * ysz));
      fill_bf16(x);
      fill_bf16(w, 0.05f);
      auto params = [&](int i) {
        GemmParams p{x.as<bf16>(i * m * g.k), w.as<bf16>(i * g.n * g.k), nullptr, m, g.n, g.k};
        if (g.f32) {
          p.y_f32 = y.as<float>(i * m * g.n);
        } else {
          p.y = y.as<bf16>(i * m * g.n);
        }
        return p;
      };
      b.guarded(std::string("gemv_") + g.name, [&] {
        double us = b.time_us(sets, [&](int i) {
          GemmParams p = params(i);
          gemv_launch({p.x, p.w, p.y, p.m, p.n, p.k, p.alpha, p.y_f32}, b.stream);
        });
        b.add(std::string("gemv_") + g.name, m, shape, us, set_bytes, flops);
      });
      b.guarded(std::string("gemm_cublas_") + g.name, [&] {
        GemmLt gemm;
        gemm.set_gemv_enabled(false);
        double us = b.time_us(sets, [&](int i) { gemm.run(params(i), b.stream); });
        b.add(std::string("gemm_cublas_") + g.name, m, shape, us, set_bytes, flops);
      });
      b.guarded(std::string("gemm_tuned_") + g.name, [&] {
        GemmLt gemm;
        double us = b.time_us(sets, [&](int i) { gemm.run(params(i), b.stream); });
        b.add(std::string("gemm_tuned_") + g.name, m,
              shape + (gemm.num_gemv_plans() ? " (gemv)" : " (cublas)"), us, set_bytes, flops);
      });
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  bool gemv_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) b.quick = true;
    if (std::strcmp(argv[i], "--gemv") == 0) gemv_only = true;
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
    for (int64_t T : {1, 32, 128, 8192}) {
      if (gemv_only) break;
      std::printf("== %lld tokens\n", static_cast<long long>(T));
      bench_tokens(b, T);
    }
    std::printf("== small-m GEMM (gemv kernel, GemmLt cuBLAS only, GemmLt tuned)\n");
    bench_small_m(b);
  } catch (std::exception const& e) {
    std::printf("FATAL: %s\n", e.what());
    return 1;
  }

  // The table last.
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
