// The MoE block (MoeLayer::run: router GEMM, top-k, permute, grouped gate_up + SiLU-mul,
// grouped down, unpermute) at Qwen3-30B-A3B and Qwen3-235B-A22B layer shapes for 1 to 8192
// tokens, each beside its bound measured in the same run:
//   memory roofline = (expected distinct experts touched x expert bytes + router + x + out)
//                     / copy bandwidth (1 GiB cudaMemcpyAsync D2D, read + write)
//   compute bound   = expert + router FLOPs / cuBLASLt bf16 8192^3 rate
//   bound = max of the two; %bound = bound / time.
// Expected distinct experts for T tokens routed uniformly: E (1 - (1 - k / E)^T).
// Then the grouped GEMMs alone with each tile (uniform random routing): 32 and 256 tokens
// against the memory bound, 8192 tokens (65536 rows) as TFLOP/s beside cuBLASLt on the dense
// GEMM of the same total shape and its 8192^3 rate.
//
//   bench_moe_layer [--quick]      CSV to $TANDEM_BENCH_CSV when set
//
// Method: random weights (all experts), random x (so random routing through the random
// router); x/out rotate among several sets so that small batches route to different experts
// call after call (no L2 reuse of the weights); warm-up first; the calls are captured in a
// CUDA graph and replayed; per-call time = replay time / calls, median over replays.
// The MoeLayer path (decode / mma / cublas, column "path") is the one run() picks; the cuBLAS
// prefill path syncs the stream and cannot be captured, so it is timed eagerly (events around
// back-to-back calls, host overhead included), and beside it the captured mma path
// (moe_layer_mma); at <= 8 tokens moe_layer_mma is the forced mma path beside decode. The
// padded prefill path (what auto picks when the routing is balanced) is timed the same way,
// with the forced grouped cuBLAS path beside it (moe_layer_cublas). At 8192 tokens
// cublas_grouped_* times cublasGemmGroupedBatchedEx alone (eager) beside the tiles, and
// cublas_padded_* the padded path's cublasGemmStridedBatchedEx alone (E x Mmax rows).
#include <cublas_v2.h>
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

#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_layer.h"
#include "bench_util.h"
#include "core/dtype.h"

using namespace tandem;
using namespace tandem::cuda;

namespace {

struct Model {
  const char* name;
  int64_t hidden, inter, experts, top_k;
};
constexpr Model kModels[] = {{"qwen3-30b-a3b", 2048, 768, 128, 8},
                             {"qwen3-235b-a22b", 4096, 1536, 128, 8}};
constexpr int64_t kTokens[] = {1, 8, 32, 128, 256, 2048, 8192};
constexpr int64_t kMaxTokens = 8192;

// PyTorch MoE block on the H200 (issue numbers, Qwen3-30B-A3B): tokens -> us.
double pytorch_us(Model const& m, int64_t tokens) {
  if (std::strcmp(m.name, "qwen3-30b-a3b") != 0) return 0;
  switch (tokens) {
    case 1: return 598;
    case 128: return 846;
    case 8192: return 3500;
    default: return 0;
  }
}

using bench::Buf;
// Random fills here: standard deviation `scale` (not bench::fill_bf16's [-scale, scale]).
using bench::fill_bf16_stddev;
using bench::g_rng;

struct Row {
  std::string op, model;
  int64_t tokens;
  double us, mem_us, compute_us, bytes, flops, experts_touched, pytorch;
  std::string path = "";
};

const char* path_name(MoeLayerPath p) {
  switch (p) {
    case MoeLayerPath::kAuto: return "auto";
    case MoeLayerPath::kMma: return "mma";
    case MoeLayerPath::kDecode: return "decode";
    case MoeLayerPath::kCublas: return "cublas";
    case MoeLayerPath::kPadded: return "padded";
  }
  return "?";
}

struct Bench : bench::Timer {
  double copy_Bps = 0, gemm_flops = 0;
  std::vector<Row> rows;

  // ~5 ms per replay, 15 replays (5 with --quick).
  Bench() : bench::Timer(5.0, 15) {}

  void add(Row r) {
    const double bound = std::max(r.mem_us, r.compute_us);
    std::printf(
        "%-16s %-16s %6lld %10.2f us  mem %9.2f  compute %9.2f  %%bound %5.1f%%  %7.0f GB/s"
        "  %7.1f TFLOP/s  experts %5.1f",
        r.op.c_str(), r.model.c_str(), static_cast<long long>(r.tokens), r.us, r.mem_us,
        r.compute_us, 100.0 * bound / r.us, r.bytes / (r.us * 1e-6) / 1e9,
        r.flops / (r.us * 1e-6) / 1e12, r.experts_touched);
    if (!r.path.empty()) std::printf("  path %s", r.path.c_str());
    if (r.pytorch > 0) std::printf("  pytorch %.0f us: %.1fx", r.pytorch, r.pytorch / r.us);
    std::printf("\n");
    std::fflush(stdout);
    rows.push_back(std::move(r));
  }

  void guarded(std::string const& what, std::function<void()> const& fn) {
    try {
      fn();
    } catch (std::exception const& e) {
      std::printf("FAILED %s: %s\n", what.c_str(), e.what());
      rows.push_back({what + " FAILED", e.what(), 0, NAN, 0, 0, 0, 0, 0, 0});
      (void)cudaGetLastError();
      (void)cudaDeviceSynchronize();
    }
  }
};

void measure_ceilings(Bench& b) {
  const bench::Ceilings c = bench::measure_ceilings(b, [](Buf& x) { fill_bf16_stddev(x, 1.0f); });
  b.copy_Bps = c.copy_Bps;
  b.gemm_flops = c.gemm_flops;
}

void bench_model(Bench& b, Model const& m) {
  const int64_t H = m.hidden, I = m.inter, E = m.experts, K = m.top_k;
  const double expert_bytes = 3.0 * H * I * 2;
  std::printf("== %s: hidden %lld, inter %lld, %lld experts, top-%lld (%.1f MB per expert)\n",
              m.name, static_cast<long long>(H), static_cast<long long>(I),
              static_cast<long long>(E), static_cast<long long>(K), expert_bytes / 1e6);
  Buf router(E * H * 2), gate_up(E * 2 * I * H * 2), down(E * H * I * 2);
  fill_bf16_stddev(router, 1.0f / std::sqrt(static_cast<float>(H)));
  fill_bf16_stddev(gate_up, 1.0f / std::sqrt(static_cast<float>(H)));  // packing is irrelevant here
  fill_bf16_stddev(down, 1.0f / std::sqrt(static_cast<float>(I)));
  const MoeLayerWeights w{router.as<bf16>(), gate_up.as<bf16>(), down.as<bf16>()};
  MoeLayer layer(kMaxTokens, H, I, E, K, 0, E, true);
  GemmLt gemm;

  for (int64_t T : kTokens) {
    b.guarded(std::string("moe_layer ") + m.name + " " + std::to_string(T), [&] {
      // Enough x sets that the experts of one call are mostly not those of the last one.
      const int sets = T <= 8 ? 16 : (T <= 256 ? 4 : 1);
      Buf x(sets * T * H * 2), out(sets * T * H * 2);
      fill_bf16_stddev(x, 1.0f);
      auto launch = [&](int i) {
        layer.run(w, x.as<bf16>(i * T * H), out.as<bf16>(i * T * H), T, gemm, b.stream);
      };
      const double touched = E * (1.0 - std::pow(1.0 - double(K) / E, double(T)));
      const double bytes = touched * expert_bytes + E * H * 2.0 + 2.0 * T * H * 2;
      const double flops = 2.0 * T * K * 3.0 * H * I + 2.0 * T * E * H;
      auto row = [&](const char* op, double us, MoeLayerPath path, double pytorch) {
        b.add({op, m.name, T, us, 1e6 * bytes / b.copy_Bps, 1e6 * flops / b.gemm_flops, bytes,
               flops, touched, pytorch, path_name(path)});
      };
      layer.set_path(MoeLayerPath::kAuto);
      const MoeLayerPath picked = layer.pick_path(T);
      if (picked == MoeLayerPath::kCublas || picked == MoeLayerPath::kPadded) {
        const double us = b.time_eager_us(sets, launch);
        row("moe_layer", us, layer.last_path(), pytorch_us(m, T));
        if (layer.last_path() == MoeLayerPath::kPadded) {  // the grouped cuBLAS path beside it
          layer.set_path(MoeLayerPath::kCublas);
          const double us_cublas = b.time_eager_us(sets, launch);
          row("moe_layer_cublas", us_cublas, layer.last_path(), 0);
          layer.set_path(MoeLayerPath::kAuto);
        }
        const double us_mma = b.time_us(sets, launch);  // captured: falls back to mma
        row("moe_layer_mma", us_mma, layer.last_path(), 0);
      } else {
        const double us = b.time_us(sets, launch);
        row("moe_layer", us, layer.last_path(), pytorch_us(m, T));
        if (picked == MoeLayerPath::kDecode) {
          layer.set_path(MoeLayerPath::kMma);
          const double us_mma = b.time_us(sets, launch);
          row("moe_layer_mma", us_mma, layer.last_path(), 0);
          layer.set_path(MoeLayerPath::kAuto);
        }
      }
    });
  }

  // Grouped GEMMs alone: every tile at a few decode sizes (weights streamed: GB/s matters)
  // and the prefill tiles at 8192 tokens (TFLOP/s matters), beside dense cuBLASLt.
  const std::vector<MoeGemmTile> decode_tiles = {MoeGemmTile::kSmall, MoeGemmTile::kMedium};
  const std::vector<MoeGemmTile> prefill_tiles = {MoeGemmTile::kLarge, MoeGemmTile::kLargeK64,
                                                  MoeGemmTile::kLarge256};
  for (int64_t T : {int64_t{32}, int64_t{256}, kMaxTokens}) {
    b.guarded(std::string("moe_gemm ") + m.name + " " + std::to_string(T), [&] {
      const int64_t R = T * K;
      std::vector<int32_t> counts(E, 0), all(E);
      std::iota(all.begin(), all.end(), 0);
      for (int64_t t = 0; t < T; ++t) {
        std::shuffle(all.begin(), all.end(), g_rng);
        for (int64_t j = 0; j < K; ++j) ++counts[all[j]];
      }
      const double touched = std::count_if(counts.begin(), counts.end(), [](int c) { return c; });
      std::vector<int32_t> offsets(E + 1, 0);
      std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
      // gu: the dense and cuBLAS grouped outputs of both GEMMs ([R, 2I] and [R, H]).
      Buf off((E + 1) * 4), xr(R * H * 2), act(R * I * 2), y(R * H * 2),
          gu(R * std::max(2 * I, H) * 2);
      TANDEM_CUDA_CHECK(
          cudaMemcpy(off.ptr, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
      fill_bf16_stddev(xr, 1.0f);
      fill_bf16_stddev(act, 1.0f);
      struct G {
        const char* op;
        bf16 const *x, *w;
        bf16* y;
        int64_t n, k;
        MoeGemmEpilogue epi;
      };
      const bool prefill = T == kMaxTokens;
      for (G g : {G{"gate_up", xr.as<bf16>(), gate_up.as<bf16>(), act.as<bf16>(), 2 * I, H,
                    MoeGemmEpilogue::kSiluMul},
                  G{"down", act.as<bf16>(), down.as<bf16>(), y.as<bf16>(), H, I,
                    MoeGemmEpilogue::kPlain}}) {
        const double flops = 2.0 * R * g.n * g.k;
        const double bytes = (R * g.k + touched * g.n * g.k + R * g.n) * 2.0;
        double dense_us = 0;
        if (prefill) {  // cuBLASLt on the dense GEMM of the same total shape
          dense_us = b.time_us(1, [&](int) {
            gemm.run({g.x, g.w, gu.as<bf16>(), R, g.n, g.k}, b.stream);
          });
          b.add({std::string("cublas_dense_") + g.op, m.name, T, dense_us, 1e6 * bytes / b.copy_Bps,
                 1e6 * flops / b.gemm_flops, bytes, flops, 1, 0});
        }
        for (MoeGemmTile tile : prefill ? prefill_tiles : decode_tiles) {
          const double us = b.time_us(1, [&](int) {
            moe_gemm_launch({g.x, g.w, g.y, off.as<int32_t>(), R, g.n, g.k, E, g.epi, tile},
                            b.stream);
          });
          const char* tname = tile == MoeGemmTile::kSmall      ? "small"
                              : tile == MoeGemmTile::kMedium   ? "medium"
                              : tile == MoeGemmTile::kLarge    ? "large"
                              : tile == MoeGemmTile::kLargeK64 ? "large_k64"
                                                               : "large256";
          b.add({std::string("moe_gemm_") + g.op + "_" + tname, m.name, T, us,
                 1e6 * bytes / b.copy_Bps, 1e6 * flops / b.gemm_flops, bytes, flops, touched, 0});
          if (prefill) {
            std::printf(
                "   -> %.1f TFLOP/s = %.1f%% of cuBLASLt 8192^3, %.1f%% of cuBLASLt dense "
                "same shape\n",
                flops / us * 1e-6, 100.0 * (flops / (us * 1e-6)) / b.gemm_flops,
                100.0 * dense_us / us);
          }
        }
        if (prefill) {
          // cublasGemmGroupedBatchedEx, one group per non-empty expert, as MoeLayer's cublas
          // path runs it (gate_up output unpacked [R, 2I] here, no SiLU), timed eagerly.
          std::vector<int> gm, gn, gk, gld_a, gld_b, gld_c, gsize;
          std::vector<void*> ptrs;
          std::vector<int64_t> nonempty;
          for (int64_t e = 0; e < E; ++e) {
            if (counts[e] > 0) nonempty.push_back(e);
          }
          const int G = static_cast<int>(nonempty.size());
          ptrs.resize(3 * G);
          for (int i = 0; i < G; ++i) {
            const int64_t e = nonempty[i];
            ptrs[i] = const_cast<bf16*>(g.w) + e * g.n * g.k;
            ptrs[G + i] = const_cast<bf16*>(g.x) + offsets[e] * g.k;
            ptrs[2 * G + i] = gu.as<bf16>(offsets[e] * g.n);
            gn.push_back(counts[e]);
          }
          gm.assign(G, static_cast<int>(g.n));
          gk.assign(G, static_cast<int>(g.k));
          gld_a.assign(G, static_cast<int>(g.k));
          gld_b.assign(G, static_cast<int>(g.k));
          gld_c.assign(G, static_cast<int>(g.n));
          gsize.assign(G, 1);
          std::vector<float> alpha(G, 1.0f), beta(G, 0.0f);
          std::vector<cublasOperation_t> ta(G, CUBLAS_OP_T), tb(G, CUBLAS_OP_N);
          Buf d_ptrs(3 * G * sizeof(void*));
          TANDEM_CUDA_CHECK(
              cudaMemcpy(d_ptrs.ptr, ptrs.data(), 3 * G * sizeof(void*), cudaMemcpyHostToDevice));
          cublasHandle_t h = nullptr;
          TANDEM_CUBLAS_CHECK(cublasCreate(&h));
          TANDEM_CUBLAS_CHECK(cublasSetStream(h, b.stream));
          void** dp = d_ptrs.as<void*>();
          double us = 0;
          try {
            us = b.time_eager_us(1, [&](int) {
              TANDEM_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
                  h, ta.data(), tb.data(), gm.data(), gn.data(), gk.data(), alpha.data(),
                  const_cast<void const* const*>(dp), CUDA_R_16BF, gld_a.data(),
                  const_cast<void const* const*>(dp + G), CUDA_R_16BF, gld_b.data(), beta.data(),
                  dp + 2 * G, CUDA_R_16BF, gld_c.data(), G, gsize.data(), CUBLAS_COMPUTE_32F));
            });
          } catch (...) {
            (void)cublasDestroy(h);
            throw;
          }
          b.add({std::string("cublas_grouped_") + g.op, m.name, T, us, 1e6 * bytes / b.copy_Bps,
                 1e6 * flops / b.gemm_flops, bytes, flops, touched, 0});
          std::printf("   -> %.1f TFLOP/s = %.1f%% of cuBLASLt dense same shape\n",
                      flops / us * 1e-6, 100.0 * dense_us / us);
          // MoeLayer's padded path: every expert's rows padded to Mmax (largest count rounded
          // up to 64), one cublasGemmStridedBatchedEx over all experts, timed eagerly.
          // TFLOP/s counts the routed rows only (padding is overhead).
          const int64_t max_count = *std::max_element(counts.begin(), counts.end());
          const int64_t m_pad = (max_count + 63) / 64 * 64;
          Buf xp(E * m_pad * g.k * 2), yp(E * m_pad * g.n * 2);
          fill_bf16_stddev(xp, 1.0f);
          const float one = 1.0f, zero = 0.0f;
          double us_pad = 0;
          try {
            us_pad = b.time_eager_us(1, [&](int) {
              TANDEM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
                  h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(g.n), static_cast<int>(m_pad),
                  static_cast<int>(g.k), &one, g.w, CUDA_R_16BF, static_cast<int>(g.k), g.n * g.k,
                  xp.ptr, CUDA_R_16BF, static_cast<int>(g.k), m_pad * g.k, &zero, yp.ptr,
                  CUDA_R_16BF, static_cast<int>(g.n), m_pad * g.n, static_cast<int>(E),
                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            });
          } catch (...) {
            (void)cublasDestroy(h);
            throw;
          }
          (void)cublasDestroy(h);
          b.add({std::string("cublas_padded_") + g.op, m.name, T, us_pad, 1e6 * bytes / b.copy_Bps,
                 1e6 * flops / b.gemm_flops, bytes, flops, touched, 0});
          std::printf(
              "   -> %.1f TFLOP/s routed (%.1f with padding: Mmax %lld, %.2fx the routed rows) = "
              "%.1f%% of cuBLASLt dense same shape\n",
              flops / us_pad * 1e-6, flops * double(E * m_pad) / double(R) / us_pad * 1e-6,
              static_cast<long long>(m_pad), double(E * m_pad) / double(R),
              100.0 * dense_us / us_pad);
        }
      }
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
    cudaDeviceProp prop{};
    if (!bench::open_device(&prop)) return 2;
    b.create();
    measure_ceilings(b);
    for (Model const& m : kModels) bench_model(b, m);
  } catch (std::exception const& e) {
    std::printf("FATAL: %s\n", e.what());
    return 1;
  }

  std::printf(
      "\n== table (bound = max(mem = bytes / %.0f GB/s copy, compute = flops / %.1f "
      "TFLOP/s GEMM))\n",
      b.copy_Bps / 1e9, b.gemm_flops / 1e12);
  std::printf("%-22s %-16s %6s %10s %10s %10s %7s %9s %8s %10s %s\n", "op", "model", "tokens", "us",
              "mem_us", "comp_us", "%bound", "TFLOP/s", "experts", "vs_pytorch", "path");
  for (Row const& r : b.rows) {
    const double bound = std::max(r.mem_us, r.compute_us);
    std::printf("%-22s %-16s %6lld %10.2f %10.2f %10.2f %6.1f%% %9.2f %8.1f", r.op.c_str(),
                r.model.c_str(), static_cast<long long>(r.tokens), r.us, r.mem_us, r.compute_us,
                100.0 * bound / r.us, r.flops / (r.us * 1e-6) / 1e12, r.experts_touched);
    if (r.pytorch > 0) {
      std::printf(" %9.1fx", r.pytorch / r.us);
    } else {
      std::printf(" %10s", "");
    }
    if (!r.path.empty()) std::printf(" %s", r.path.c_str());
    std::printf("\n");
  }
  bench::write_csv(b.rows,
                   "op,model,tokens,us,mem_bound_us,compute_bound_us,bytes,flops,experts_touched,"
                   "pytorch_us,path\n",
                   [](std::ofstream& f, Row const& r) {
                     f << r.op << "," << r.model << "," << r.tokens << "," << r.us << ","
                       << r.mem_us << "," << r.compute_us << "," << r.bytes << "," << r.flops << ","
                       << r.experts_touched << "," << r.pytorch << "," << r.path << "\n";
                   });
  return bench::count_failed(b.rows) ? 1 : 0;
}
