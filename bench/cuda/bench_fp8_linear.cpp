// FP8-weight linears (backend/cuda/fp8_linear.h) beside the bf16 ones in the same run, at
// Qwen3-30B-A3B's shapes:
//   dense: fused QKV (2048 -> 5120), o_proj (4096 -> 2048) at m = 1 / 4 / 8 / 16 / 32 / 128: bf16
//     GemmLt (gemv kernel or cuBLASLt, whichever its tuning picks) vs FP8 W8A16 (fp8_gemv_launch
//     for m <= 16; above, dequantized to bf16, then GemmLt) vs W8A8 (the FP8 tensor-core grouped
//     GEMM as one dense expert, activations quantized in the kernel);
//   MoE grouped GEMM: 128 experts, gate_up (2048 -> 2 x 768, SiLU-multiply) and down (768 ->
//     2048) for 1 / 8 / 32 / 128 tokens x top-8 (uniform random routing; weight bytes and their
//     share of the copy bandwidth, the HBM roofline) and 512 / 2048 / 8192 tokens (TFLOP/s):
//     moe_gemm_launch bf16 vs FP8 W8A16 vs FP8 W8A8;
//   MoE layer (MoeLayer::run: router, top-k, both GEMMs, unpermute) at 1 / 8 / 32 / 128 tokens
//     (graphs) and 2048 (eager; W8A8 on the mma path, the others on the cuBLAS paths):
//     bf16, W8A16, W8A8, and W8A8's share of its FP8 roofline (the distinct experts' E4M3 bytes
//     and scales + the bf16 router, over the copy bandwidth).
//   --mxfp8: only MXFP8's two GPU paths at decode shapes, W8A16: the kernels with native per-32
//     E8M0 scales (w_e8m0) vs the same codes with per-128 row scales (what the block path
//     requantizes to): dense gemv m = 1 / 8 / 16 and the grouped GEMM at 1 / 8 / 32 / 128 tokens.
// Graph-timed (bench_util.h Timer) over enough weight sets / routings to exceed L2.
//   bench_fp8_linear [--quick] [--mxfp8]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_layer.h"
#include "bench_util.h"

using namespace tandem;
using namespace tandem::bench;

namespace {

void fill_fp8(Buf& b) {
  static std::vector<uint8_t> pattern = [] {
    std::vector<uint8_t> p(size_t{1} << 20);
    std::uniform_int_distribution<int> d(0, 255);
    for (auto& v : p) {
      int c = d(g_rng);
      while ((c & 0x7f) == 0x7f) c = d(g_rng);
      v = static_cast<uint8_t>(c);
    }
    return p;
  }();
  size_t done = 0;
  while (done < b.bytes) {
    const size_t chunk = std::min(b.bytes - done, pattern.size());
    TANDEM_CUDA_CHECK(
        cudaMemcpy(b.as<uint8_t>(done), pattern.data(), chunk, cudaMemcpyHostToDevice));
    done += chunk;
  }
}

void fill_scales(Buf& b) {
  std::vector<float> s(b.bytes / 4);
  std::uniform_real_distribution<float> d(1e-3f, 1e-2f);
  for (auto& v : s) v = d(g_rng);
  upload(b, s);
}

// E8M0 codes of 2^-10 .. 2^-7 (the fill_scales range, in the native kernels' range).
void fill_e8m0(Buf& b) {
  std::vector<uint8_t> s(b.bytes);
  std::uniform_int_distribution<int> d(127 - 10, 127 - 7);
  for (auto& v : s) v = static_cast<uint8_t>(d(g_rng));
  upload(b, s);
}

// --mxfp8: native per-32 E8M0 scales vs per-128 row scales over the same codes (W8A16).
void bench_mxfp8(Timer& t, double hbm, size_t l2_multiple) {
  std::printf(
      "\n== MXFP8 on the GPU, W8A16: native per-32 E8M0 scales (w_e8m0) vs per-128 row scales "
      "(the block path's layout); GB/s of E4M3 codes + scales\n");
  std::printf("%-8s %5s | %9s %7s %6s | %9s %7s %6s | %8s\n", "case", "m/tok", "block us", "GB/s",
              "%hbm", "native us", "GB/s", "%hbm", "nat/blk");
  struct Dense {
    const char* name;
    int64_t n, k;
  };
  for (const Dense d : {Dense{"qkv", 5120, 2048}, Dense{"o_proj", 2048, 4096}}) {
    const size_t wb8 = static_cast<size_t>(d.n * d.k);
    const int sets = static_cast<int>(std::max<size_t>(2, l2_multiple / wb8 + 1));
    std::vector<std::unique_ptr<Buf>> w8, s8, e8;
    for (int i = 0; i < sets; ++i) {
      w8.push_back(std::make_unique<Buf>(wb8));
      fill_fp8(*w8.back());
      s8.push_back(
          std::make_unique<Buf>(static_cast<size_t>(d.n * cuda::fp8_row_scale_cols(d.k)) * 4));
      fill_scales(*s8.back());
      e8.push_back(std::make_unique<Buf>(static_cast<size_t>(d.n * cuda::mxfp8_scale_cols(d.k))));
      fill_e8m0(*e8.back());
    }
    for (const int64_t m : {1, 8, 16}) {
      Buf x(static_cast<size_t>(m * d.k) * 2), y(static_cast<size_t>(m * d.n) * 2);
      fill_bf16(x);
      auto run = [&](bool mx) {
        return t.time_us(sets, [&](int i) {
          cuda::Fp8GemvParams p{x.as<cuda::bf16>(),
                                w8[i]->as<uint8_t>(),
                                s8[i]->as<float>(),
                                y.as<cuda::bf16>(),
                                m,
                                d.n,
                                d.k};
          if (mx) p.w_e8m0 = e8[i]->as<uint8_t>();
          cuda::fp8_gemv_launch(p, t.stream);
        });
      };
      const double ub = run(false), un = run(true);
      const double bb = wb8 * (1 + 4.0 / 128), bn = wb8 * (1 + 1.0 / 32);
      std::printf("%-8s %5lld | %9.2f %7.0f %5.0f%% | %9.2f %7.0f %5.0f%% | %8.3f\n", d.name,
                  static_cast<long long>(m), ub, bb / ub * 1e-3, 100 * bb / (ub * 1e-6) / hbm, un,
                  bn / un * 1e-3, 100 * bn / (un * 1e-6) / hbm, un / ub);
    }
  }
  const int64_t E = 128, H = 2048, I = 768, top_k = 8;
  Buf gu8(static_cast<size_t>(E * 2 * I * H)), dn8(static_cast<size_t>(E * H * I));
  Buf gus(static_cast<size_t>(E * 2 * I * cuda::fp8_row_scale_cols(H)) * 4);
  Buf dns(static_cast<size_t>(E * H * cuda::fp8_row_scale_cols(I)) * 4);
  Buf gue(static_cast<size_t>(E * 2 * I * cuda::mxfp8_scale_cols(H)));
  Buf dne(static_cast<size_t>(E * H * cuda::mxfp8_scale_cols(I)));
  fill_fp8(gu8);
  fill_fp8(dn8);
  fill_scales(gus);
  fill_scales(dns);
  fill_e8m0(gue);
  fill_e8m0(dne);
  for (const int64_t T : {1, 8, 32, 128}) {
    const int64_t rows = T * top_k;
    const int sets = 16;
    std::vector<std::unique_ptr<Buf>> offs;
    double distinct = 0;
    for (int s = 0; s < sets; ++s) {
      std::vector<int32_t> count(E, 0);
      std::set<int64_t> used;
      for (int64_t tok = 0; tok < T; ++tok) {
        std::vector<int64_t> ids(E);
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), g_rng);
        for (int64_t j = 0; j < top_k; ++j) {
          ++count[ids[j]];
          used.insert(ids[j]);
        }
      }
      std::vector<int32_t> off(E + 1, 0);
      for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + count[e];
      offs.push_back(std::make_unique<Buf>(off.size() * 4));
      upload(*offs.back(), off);
      distinct += static_cast<double>(used.size()) / sets;
    }
    Buf x(static_cast<size_t>(rows * H) * 2), act(static_cast<size_t>(rows * I) * 2),
        y(static_cast<size_t>(rows * H) * 2);
    fill_bf16(x);
    fill_bf16(act);
    for (const bool is_gu : {true, false}) {
      const int64_t n = is_gu ? 2 * I : H, k = is_gu ? H : I;
      auto run = [&](bool mx) {
        return t.time_us(sets, [&](int s) {
          cuda::MoeGemmParams p{
              is_gu ? x.as<cuda::bf16>() : act.as<cuda::bf16>(),
              nullptr,
              is_gu ? act.as<cuda::bf16>() : y.as<cuda::bf16>(),
              offs[s]->as<int32_t>(),
              rows,
              n,
              k,
              E,
              is_gu ? cuda::MoeGemmEpilogue::kSiluMul : cuda::MoeGemmEpilogue::kPlain};
          p.w_fp8 = is_gu ? gu8.as<uint8_t>() : dn8.as<uint8_t>();
          if (mx) {
            p.w_e8m0 = is_gu ? gue.as<uint8_t>() : dne.as<uint8_t>();
          } else {
            p.w_scale = is_gu ? gus.as<float>() : dns.as<float>();
          }
          cuda::moe_gemm_launch(p, t.stream);
        });
      };
      const double ub = run(false), un = run(true);
      const double wb8 = distinct * static_cast<double>(n * k);
      const double bb = wb8 * (1 + 4.0 / 128), bn = wb8 * (1 + 1.0 / 32);
      std::printf("%-8s %5lld | %9.2f %7.0f %5.0f%% | %9.2f %7.0f %5.0f%% | %8.3f\n",
                  is_gu ? "gate_up" : "down", static_cast<long long>(T), ub, bb / ub * 1e-3,
                  100 * bb / (ub * 1e-6) / hbm, un, bn / un * 1e-3, 100 * bn / (un * 1e-6) / hbm,
                  un / ub);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  if (!open_device(&prop)) return 0;
  Timer t;
  t.create();
  bool mx_only = false;
  for (int i = 1; i < argc; ++i) {
    t.quick = t.quick || std::strcmp(argv[i], "--quick") == 0;
    mx_only = mx_only || std::strcmp(argv[i], "--mxfp8") == 0;
  }
  const Ceilings ceil = measure_ceilings(t, [](Buf& b) { fill_bf16(b); });
  // A copy reads and writes: the HBM rate is about copy_Bps.
  const double hbm = ceil.copy_Bps;
  const size_t l2_multiple = size_t{4} * static_cast<size_t>(prop.l2CacheSize);
  if (mx_only) {
    bench_mxfp8(t, hbm, l2_multiple);
    return 0;
  }

  std::printf(
      "\n== dense linears: bf16 GemmLt vs FP8 W8A16 (gemv for m <= 16, dequantize + bf16 GEMM "
      "above) vs FP8 W8A8 (tensor-core grouped GEMM, one dense expert)\n");
  std::printf("%-8s %5s | %9s %7s | %9s %7s %6s | %6s | %9s %7s %6s | %6s | %11s | %9s %6s\n",
              "shape", "m", "bf16 us", "GB/s", "w8a16 us", "GB/s", "%hbm", "x bf16", "w8a8 us",
              "GB/s", "%hbm", "x bf16", "w8a8 med us", "w8a8pq us", "x bf16");
  struct Dense {
    const char* name;
    int64_t n, k;
  };
  cuda::GemmLt gemm;
  for (const Dense d : {Dense{"qkv", 5120, 2048}, Dense{"o_proj", 2048, 4096}}) {
    const size_t wb16 = static_cast<size_t>(d.n * d.k) * 2, wb8 = wb16 / 2;
    const int sets = static_cast<int>(std::max<size_t>(2, l2_multiple / wb8 + 1));
    std::vector<std::unique_ptr<Buf>> w16, w8, s8;
    for (int i = 0; i < sets; ++i) {
      w16.push_back(std::make_unique<Buf>(wb16));
      fill_bf16(*w16.back(), 0.05f);
      w8.push_back(std::make_unique<Buf>(wb8));
      fill_fp8(*w8.back());
      s8.push_back(
          std::make_unique<Buf>(static_cast<size_t>(d.n * cuda::fp8_row_scale_cols(d.k)) * 4));
      fill_scales(*s8.back());
    }
    Buf dq(wb16);
    for (const int64_t m : {1, 4, 8, 16, 32, 128, 256}) {
      Buf x(static_cast<size_t>(m * d.k) * 2), y(static_cast<size_t>(m * d.n) * 2);
      fill_bf16(x);
      const double us16 = t.time_us(sets, [&](int i) {
        gemm.run({x.as<cuda::bf16>(), w16[i]->as<cuda::bf16>(), y.as<cuda::bf16>(), m, d.n, d.k},
                 t.stream);
      });
      const double us8 = t.time_us(sets, [&](int i) {
        if (m <= cuda::kFp8GemvMaxM) {
          cuda::fp8_gemv_launch({x.as<cuda::bf16>(), w8[i]->as<uint8_t>(), s8[i]->as<float>(),
                                 y.as<cuda::bf16>(), m, d.n, d.k},
                                t.stream);
        } else {  // the model's choice above the gemv: dequantize, then the bf16 GEMM
          cuda::fp8_dequantize_launch(w8[i]->as<uint8_t>(), s8[i]->as<float>(), d.n, d.k,
                                      dq.as<cuda::bf16>(), t.stream);
          gemm.run({x.as<cuda::bf16>(), dq.as<cuda::bf16>(), y.as<cuda::bf16>(), m, d.n, d.k},
                   t.stream);
        }
      });
      auto w8a8 = [&](cuda::MoeGemmTile tile) {
        return t.time_us(sets, [&](int i) {
          cuda::MoeGemmParams p{
              x.as<cuda::bf16>(), nullptr, y.as<cuda::bf16>(), nullptr, m, d.n, d.k, 1};
          p.w_fp8 = w8[i]->as<uint8_t>();
          p.w_scale = s8[i]->as<float>();
          p.fp8_activations = true;
          p.tile = tile;
          cuda::moe_gemm_launch(p, t.stream);
        });
      };
      const double usa8 = w8a8(cuda::MoeGemmTile::kAuto);
      const double usa8m = w8a8(cuda::MoeGemmTile::kMedium);  // the tile choice, measured
      // Pre-quantized activations: the quantization pass + the GEMM loading E4M3.
      Buf xq(static_cast<size_t>(m * d.k)),
          xs(static_cast<size_t>(m * cuda::fp8_row_scale_cols(d.k)) * 4);
      const double uspq = t.time_us(sets, [&](int i) {
        cuda::fp8_quantize_rows_launch(x.as<cuda::bf16>(), xq.as<uint8_t>(), xs.as<float>(), m, d.k,
                                       t.stream);
        cuda::MoeGemmParams p{nullptr, nullptr, y.as<cuda::bf16>(), nullptr, m, d.n, d.k, 1};
        p.w_fp8 = w8[i]->as<uint8_t>();
        p.w_scale = s8[i]->as<float>();
        p.fp8_activations = true;
        p.x_fp8 = xq.as<uint8_t>();
        p.x_scale = xs.as<float>();
        cuda::moe_gemm_launch(p, t.stream);
      });
      const double bw16 = wb16 / (us16 * 1e-6), bw8 = wb8 / (us8 * 1e-6),
                   bwa8 = wb8 / (usa8 * 1e-6);
      std::printf(
          "%-8s %5lld | %9.2f %7.0f | %9.2f %7.0f %5.0f%% | %6.2f | %9.2f %7.0f %5.0f%% | "
          "%6.2f | %11.2f | %9.2f %6.2f\n",
          d.name, static_cast<long long>(m), us16, bw16 / 1e9, us8, bw8 / 1e9, 100 * bw8 / hbm,
          us16 / us8, usa8, bwa8 / 1e9, 100 * bwa8 / hbm, us16 / usa8, usa8m, uspq, us16 / uspq);
    }
  }

  std::printf(
      "\n== MoE grouped GEMM, 128 experts, top-8: bf16 vs FP8 W8A16 vs FP8 W8A8 (weights of each "
      "distinct expert read once; TFLOP/s of the routed rows)\n");
  std::printf("%-8s %5s %7s | %9s %7s %6s | %9s %7s %6s %6s | %6s | %9s %7s %6s %6s | %6s\n",
              "gemm", "tok", "experts", "bf16 us", "GB/s", "TF/s", "w8a16 us", "GB/s", "%hbm",
              "TF/s", "x bf16", "w8a8 us", "GB/s", "%hbm", "TF/s", "x bf16");
  const int64_t E = 128, H = 2048, I = 768, top_k = 8;
  Buf gu16(static_cast<size_t>(E * 2 * I * H) * 2), dn16(static_cast<size_t>(E * H * I) * 2);
  Buf gu8(static_cast<size_t>(E * 2 * I * H)), dn8(static_cast<size_t>(E * H * I));
  Buf gus(static_cast<size_t>(E * 2 * I * cuda::fp8_row_scale_cols(H)) * 4);
  Buf dns(static_cast<size_t>(E * H * cuda::fp8_row_scale_cols(I)) * 4);
  fill_bf16(gu16, 0.05f);
  fill_bf16(dn16, 0.05f);
  fill_fp8(gu8);
  fill_fp8(dn8);
  fill_scales(gus);
  fill_scales(dns);
  for (const int64_t T : {1, 8, 32, 128, 512, 2048, 8192}) {
    if (t.quick && T > 2048) continue;
    const int64_t rows = T * top_k;
    // Routings cycled (so the experts of one call are not all in L2); prefill sizes touch all.
    const int sets = T <= 128 ? 16 : 2;
    std::vector<std::unique_ptr<Buf>> offs;
    std::vector<double> distinct;
    for (int s = 0; s < sets; ++s) {
      std::vector<int32_t> count(E, 0);
      std::set<int64_t> used;
      for (int64_t tok = 0; tok < T; ++tok) {
        std::vector<int64_t> ids(E);
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), g_rng);
        for (int64_t j = 0; j < top_k; ++j) {
          ++count[ids[j]];
          used.insert(ids[j]);
        }
      }
      std::vector<int32_t> off(E + 1, 0);
      for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + count[e];
      offs.push_back(std::make_unique<Buf>(off.size() * 4));
      upload(*offs.back(), off);
      distinct.push_back(static_cast<double>(used.size()));
    }
    const double mean_experts = std::accumulate(distinct.begin(), distinct.end(), 0.0) / sets;
    Buf x(static_cast<size_t>(rows * H) * 2), act(static_cast<size_t>(rows * I) * 2),
        y(static_cast<size_t>(rows * H) * 2);
    fill_bf16(x);
    fill_bf16(act);
    for (const bool is_gu : {true, false}) {
      const int64_t n = is_gu ? 2 * I : H, k = is_gu ? H : I;
      auto params = [&](int s, bool fp8) {
        cuda::MoeGemmParams p{
            is_gu ? x.as<cuda::bf16>() : act.as<cuda::bf16>(),
            is_gu ? gu16.as<cuda::bf16>() : dn16.as<cuda::bf16>(),
            is_gu ? act.as<cuda::bf16>() : y.as<cuda::bf16>(),
            offs[s]->as<int32_t>(),
            rows,
            n,
            k,
            E,
            is_gu ? cuda::MoeGemmEpilogue::kSiluMul : cuda::MoeGemmEpilogue::kPlain};
        if (fp8) {
          p.w = nullptr;
          p.w_fp8 = is_gu ? gu8.as<uint8_t>() : dn8.as<uint8_t>();
          p.w_scale = is_gu ? gus.as<float>() : dns.as<float>();
        }
        return p;
      };
      const double us16 =
          t.time_us(sets, [&](int s) { cuda::moe_gemm_launch(params(s, false), t.stream); });
      const double us8 =
          t.time_us(sets, [&](int s) { cuda::moe_gemm_launch(params(s, true), t.stream); });
      const double usa8 = t.time_us(sets, [&](int s) {
        cuda::MoeGemmParams p = params(s, true);
        p.fp8_activations = true;
        cuda::moe_gemm_launch(p, t.stream);
      });
      Buf xq(static_cast<size_t>(rows * k)),
          xs(static_cast<size_t>(rows * cuda::fp8_row_scale_cols(k)) * 4);
      const double uspq = t.time_us(sets, [&](int s) {
        cuda::MoeGemmParams p = params(s, true);
        cuda::fp8_quantize_rows_launch(p.x, xq.as<uint8_t>(), xs.as<float>(), rows, k, t.stream);
        p.fp8_activations = true;
        p.x_fp8 = xq.as<uint8_t>();
        p.x_scale = xs.as<float>();
        cuda::moe_gemm_launch(p, t.stream);
      });
      const double wbytes8 = mean_experts * static_cast<double>(n * k);
      const double flops = 2.0 * static_cast<double>(rows * n * k);
      const double bw16 = 2 * wbytes8 / (us16 * 1e-6), bw8 = wbytes8 / (us8 * 1e-6),
                   bwa8 = wbytes8 / (usa8 * 1e-6);
      std::printf(
          "%-8s %5lld %7.1f | %9.2f %7.0f %6.1f | %9.2f %7.0f %5.0f%% %6.1f | %6.2f | %9.2f %7.0f "
          "%5.0f%% %6.1f | %6.2f | pq %9.2f %5.0f%% %6.2f\n",
          is_gu ? "gate_up" : "down", static_cast<long long>(T), mean_experts, us16, bw16 / 1e9,
          flops / us16 * 1e-6, us8, bw8 / 1e9, 100 * bw8 / hbm, flops / us8 * 1e-6, us16 / us8,
          usa8, bwa8 / 1e9, 100 * bwa8 / hbm, flops / usa8 * 1e-6, us16 / usa8, uspq,
          100 * wbytes8 / (uspq * 1e-6) / hbm, us16 / uspq);
    }
  }

  std::printf(
      "\n== MoE layer (router, top-k, gate_up, down, unpermute), 128 experts, top-8: bf16 vs FP8 "
      "W8A16 vs W8A8; roofline: distinct experts' E4M3 bytes + scales + bf16 router over the copy "
      "bandwidth\n");
  std::printf("%5s %7s | %9s | %9s %6s | %9s %6s | %9s %6s | %9s %6s %6s\n", "tok", "experts",
              "bf16 us", "w8a16 us", "x bf16", "w8a8 us", "x bf16", "w8a8pq us", "x bf16",
              "roof us", "%roof", "%roof pq");
  {
    Buf router(static_cast<size_t>(E * H) * 2);
    fill_bf16(router, 0.02f);
    const cuda::MoeLayerWeights w16{router.as<cuda::bf16>(), gu16.as<cuda::bf16>(),
                                    dn16.as<cuda::bf16>()};
    const cuda::MoeLayerWeights w8{router.as<cuda::bf16>(), nullptr,         nullptr,
                                   gu8.as<uint8_t>(),       gus.as<float>(), dn8.as<uint8_t>(),
                                   dns.as<float>()};
    constexpr int64_t kLayerMax = 2048;
    cuda::MoeLayer layer(kLayerMax, H, I, E, top_k, 0, E, true);
    const double expert_bytes8 =
        3.0 * H * I + 4.0 * (2 * I * cuda::fp8_row_scale_cols(H) + H * cuda::fp8_row_scale_cols(I));
    // 2048 tokens (prefill): eager, so that bf16 and W8A16 take the cuBLAS paths run() picks
    // (W8A16 dequantizing the layer's experts first, as the model does now); W8A8 on the mma
    // path (set_fp8_prefill_dequant(false)).
    for (const int64_t T : {1, 8, 32, 128, 2048}) {
      const bool prefill = T > 128;
      const int sets = prefill ? 2 : 16;
      Buf x(static_cast<size_t>(sets * T * H) * 2), out(static_cast<size_t>(sets * T * H) * 2);
      fill_bf16(x);
      auto run = [&](cuda::MoeLayerWeights const& w) {
        auto launch = [&](int i) {
          layer.run(w, x.as<cuda::bf16>(i * T * H), out.as<cuda::bf16>(i * T * H), T, gemm,
                    t.stream);
        };
        return prefill ? t.time_eager_us(sets, launch) : t.time_us(sets, launch);
      };
      const double us16 = run(w16);
      layer.set_fp8_activations(false);
      const double us8 = run(w8);
      layer.set_fp8_activations(true, false);  // quantized in the GEMM kernels
      layer.set_fp8_prefill_dequant(false);
      const double usa8 = run(w8);
      layer.set_fp8_activations(true, true);  // one quantization pass before each GEMM
      const double uspq = run(w8);
      layer.set_fp8_prefill_dequant(true);
      layer.set_fp8_activations(false);
      const double touched = E * (1.0 - std::pow(1.0 - double(top_k) / E, double(T)));
      const double roof_us = 1e6 * (touched * expert_bytes8 + E * H * 2.0) / hbm;
      std::printf(
          "%5lld %7.1f | %9.2f | %9.2f %6.2f | %9.2f %6.2f | %9.2f %6.2f | %9.2f %5.0f%% %5.0f%%\n",
          static_cast<long long>(T), touched, us16, us8, us16 / us8, usa8, us16 / usa8, uspq,
          us16 / uspq, roof_us, 100 * roof_us / usa8, 100 * roof_us / uspq);
    }
  }
  return 0;
}
