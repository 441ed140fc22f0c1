// The W8A8 block-scaled grouped GEMM on wgmma (moe_gemm_w8a8.h, CUTLASS sm90) beside the other
// grouped GEMMs and cuBLASLt in the same run, Qwen3-30B-A3B's experts (128, hidden 2048, inter
// 768, top-8; gate_up 2048 -> 1536, down 768 -> 2048):
//   prefill, 8192 tokens (65536 routed rows, uniform random routing): TFLOP/s of
//     W8A8 wgmma (both tiles), the bf16 grouped GEMM (moe_gemm_launch), the old W8A8 mma.sync
//     path (pre-quantized input), and cuBLASLt on the same rows as one dense matrix (bf16 GemmLt
//     and block-scaled FP8 Fp8GemmLt: what torch._scaled_mm calls for 1x128 x 128x128 scales);
//   decode, 32 / 64 / 128 / 256 tokens: microseconds and the share of the FP8 bytes roofline
//     (distinct experts' E4M3 weights + their scales + E4M3 rows + scales in + bf16 rows out,
//     over the measured copy bandwidth), beside bf16, W8A16 (the default FP8 path today) and the
//     old W8A8;
//   the fused quantizers at prefill size (share of the copy bandwidth).
// Graph-timed (bench_util.h Timer); routings cycled so the weights do not stay in L2.
//   bench_moe_w8a8 [--quick]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "backend/cuda/fp8_act_quant.h"
#include "backend/cuda/fp8_gemm.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_gemm_w8a8.h"
#include "bench_util.h"

using namespace tandem;
using namespace tandem::bench;

namespace {

void fill_fp8(Buf& b) {
  std::vector<uint8_t> p(size_t{1} << 20);
  std::uniform_int_distribution<int> d(0, 255);
  for (auto& v : p) {
    int c = d(g_rng);
    while ((c & 0x7f) == 0x7f) c = d(g_rng);
    v = static_cast<uint8_t>(c);
  }
  for (size_t done = 0; done < b.bytes; done += p.size()) {
    const size_t chunk = std::min(b.bytes - done, p.size());
    TANDEM_CUDA_CHECK(cudaMemcpy(b.as<uint8_t>(done), p.data(), chunk, cudaMemcpyHostToDevice));
  }
}

void fill_scales(Buf& b) {
  std::vector<float> s(b.bytes / 4);
  std::uniform_real_distribution<float> d(1e-3f, 1e-2f);
  for (auto& v : s) v = d(g_rng);
  upload(b, s);
}

struct Routing {
  std::unique_ptr<Buf> off;
  double distinct = 0;
};

Routing make_routing(int64_t E, int64_t T, int64_t top_k) {
  std::vector<int32_t> count(E, 0);
  std::set<int64_t> used;
  std::vector<int64_t> ids(E);
  for (int64_t tok = 0; tok < T; ++tok) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), g_rng);
    for (int64_t j = 0; j < top_k; ++j) {
      ++count[ids[j]];
      used.insert(ids[j]);
    }
  }
  std::vector<int32_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + count[e];
  Routing r;
  r.off = std::make_unique<Buf>(off.size() * 4);
  upload(*r.off, off);
  r.distinct = static_cast<double>(used.size());
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  if (!open_device(&prop)) return 0;
  Timer t;
  t.create();
  for (int i = 1; i < argc; ++i) t.quick = t.quick || std::strcmp(argv[i], "--quick") == 0;
  if (!cuda::MoeGemmW8A8::supported()) {
    std::printf("MoeGemmW8A8 not supported here (needs sm_90 and a build with CUTLASS)\n");
    return 0;
  }
  const Ceilings ceil = measure_ceilings(t, [](Buf& b) { fill_bf16(b); });
  const double hbm = ceil.copy_Bps;

  const int64_t E = 128, H = 2048, I = 768, top_k = 8;
  // Weights: E4M3 + row scales (every FP8 path), bf16.
  Buf gu8(static_cast<size_t>(E * 2 * I * H)), dn8(static_cast<size_t>(E * H * I));
  Buf gur(static_cast<size_t>(E * 2 * I * (H / 128)) * 4),
      dnr(static_cast<size_t>(E * H * (I / 128)) * 4);
  Buf gu16(static_cast<size_t>(E * 2 * I * H) * 2), dn16(static_cast<size_t>(E * H * I) * 2);
  fill_fp8(gu8);
  fill_fp8(dn8);
  fill_scales(gur);
  fill_scales(dnr);
  fill_bf16(gu16, 0.05f);
  fill_bf16(dn16, 0.05f);
  cuda::MoeGemmW8A8 w8a8;
  w8a8.prepare(E);
  cuda::GemmLt gemm16;
  cuda::Fp8GemmLt gemm8;

  struct Shape {
    const char* name;
    int64_t n, k;
    Buf *w8, *wr, *w16;
  };
  const Shape shapes[2] = {{"gate_up", 2 * I, H, &gu8, &gur, &gu16},
                           {"down", H, I, &dn8, &dnr, &dn16}};

  // ---- prefill ----
  {
    const int64_t T = t.quick ? 2048 : 8192, rows = T * top_k;
    std::printf(
        "\n== prefill: %lld tokens x top-%lld = %lld rows over %lld experts (TFLOP/s; dense: the "
        "same rows as one matrix)\n",
        static_cast<long long>(T), static_cast<long long>(top_k), static_cast<long long>(rows),
        static_cast<long long>(E));
    std::printf("%-8s | %9s %7s | %9s %7s | %9s %7s | %9s %7s | %9s %7s | %9s %7s\n", "gemm",
                "w8a8 us", "TF/s", "w8a8dec", "TF/s", "bf16 us", "TF/s", "oldw8a8", "TF/s",
                "lt bf16", "TF/s", "lt fp8", "TF/s");
    Routing r = make_routing(E, T, top_k);
    const int64_t maxk = H;
    Buf xq(static_cast<size_t>(rows * maxk)), xs(static_cast<size_t>(rows * (maxk / 128)) * 4),
        x16(static_cast<size_t>(rows * maxk) * 2), y(static_cast<size_t>(rows * H) * 2);
    fill_fp8(xq);
    fill_scales(xs);
    fill_bf16(x16);
    // The cuBLASLt FP8 activation scales are K-block major: a buffer of its own.
    Buf xs_lt(static_cast<size_t>(cuda::fp8_pad_m(rows) * (maxk / 128)) * 4);
    fill_scales(xs_lt);
    Buf wsc_lt(static_cast<size_t>(((2 * I + 127) / 128) * cuda::fp8_weight_scale_ld(H)) * 4);
    fill_scales(wsc_lt);
    for (const Shape& s : shapes) {
      const double flops = 2.0 * static_cast<double>(rows) * s.n * s.k;
      auto run8 = [&](cuda::MoeGemmW8A8Tile tile) {
        return t.time_us(1, [&](int) {
          cuda::MoeGemmW8A8Params p{xq.as<uint8_t>(),
                                    xs.as<float>(),
                                    s.w8->as<uint8_t>(),
                                    s.wr->as<float>(),
                                    y.as<cuda::bf16>(),
                                    r.off->as<int32_t>(),
                                    rows,
                                    s.n,
                                    s.k,
                                    E};
          p.tile = tile;
          w8a8.run(p, t.stream);
        });
      };
      const double us8 = run8(cuda::MoeGemmW8A8Tile::kPrefill);
      const double us8d = run8(cuda::MoeGemmW8A8Tile::kDecode);
      const double us16 = t.time_us(1, [&](int) {
        cuda::moe_gemm_launch({x16.as<cuda::bf16>(), s.w16->as<cuda::bf16>(), y.as<cuda::bf16>(),
                               r.off->as<int32_t>(), rows, s.n, s.k, E},
                              t.stream);
      });
      const double usold = t.time_us(1, [&](int) {
        cuda::MoeGemmParams p{nullptr, nullptr, y.as<cuda::bf16>(), r.off->as<int32_t>(), rows, s.n,
                              s.k,     E};
        p.w_fp8 = s.w8->as<uint8_t>();
        p.w_scale = s.wr->as<float>();
        p.fp8_activations = true;
        p.x_fp8 = xq.as<uint8_t>();
        p.x_scale = xs.as<float>();
        cuda::moe_gemm_launch(p, t.stream);
      });
      // Dense: the first expert's weights over all rows (the same FLOPs, no grouping).
      const double uslt16 = t.time_us(1, [&](int) {
        gemm16.run(
            {x16.as<cuda::bf16>(), s.w16->as<cuda::bf16>(), y.as<cuda::bf16>(), rows, s.n, s.k},
            t.stream);
      });
      double uslt8 = NAN;
      try {
        uslt8 = t.time_us(1, [&](int) {
          gemm8.run({xq.as<uint8_t>(), xs_lt.as<float>(), s.w8->as<uint8_t>(), wsc_lt.as<float>(),
                     y.as<cuda::bf16>(), rows, s.n, s.k},
                    t.stream);
        });
      } catch (std::exception const& e) {
        std::printf("(cuBLASLt fp8: %s)\n", e.what());
      }
      auto tf = [&](double us) { return flops / us * 1e-6; };
      std::printf(
          "%-8s | %9.1f %7.0f | %9.1f %7.0f | %9.1f %7.0f | %9.1f %7.0f | %9.1f %7.0f | %9.1f "
          "%7.0f\n",
          s.name, us8, tf(us8), us8d, tf(us8d), us16, tf(us16), usold, tf(usold), uslt16,
          tf(uslt16), uslt8, tf(uslt8));
    }

    // Fused quantizers at this size.
    Buf src(static_cast<size_t>(rows) * 4), cnt(4);
    {
      std::vector<int32_t> v(rows);
      std::iota(v.begin(), v.end(), 0);
      std::shuffle(v.begin(), v.end(), g_rng);
      upload(src, v);
      upload(cnt, std::vector<int32_t>{static_cast<int32_t>(rows)});
    }
    Buf gu(static_cast<size_t>(rows * 2 * I) * 2), normw(static_cast<size_t>(H) * 2);
    fill_bf16(gu, 2.0f);
    fill_bf16(normw, 1.0f);
    const double us_g = t.time_us(1, [&](int) {
      cuda::fp8_gather_quantize_launch(
          {x16.as<cuda::bf16>(), src.as<int32_t>(), top_k, cnt.as<int32_t>(), xq.as<uint8_t>(),
           xs.as<float>(), rows, H},
          t.stream);
    });
    const double us_s = t.time_us(1, [&](int) {
      cuda::silu_mul_quantize_fp8_launch(
          {gu.as<cuda::bf16>(), cnt.as<int32_t>(), xq.as<uint8_t>(), xs.as<float>(), rows, I},
          t.stream);
    });
    const double us_n = t.time_us(1, [&](int) {
      cuda::rms_norm_quantize_fp8_launch(
          {x16.as<cuda::bf16>(), nullptr, normw.as<cuda::bf16>(), y.as<cuda::bf16>(),
           xq.as<uint8_t>(), xs.as<float>(), T, H, 1e-6f},
          t.stream);
    });
    // Bytes: gather reads T bf16 rows (from L2 after the first of each token's top_k copies:
    // counted once) and writes rows E4M3; silu reads 2 I bf16, writes I E4M3; norm reads and
    // writes a bf16 row and writes E4M3.
    const double b_g = T * H * 2.0 + rows * H * (1.0 + 4.0 / 128);
    const double b_s = rows * I * (4.0 + 1.0 + 4.0 / 128);
    const double b_n = T * H * (2.0 + 2.0 + 1.0 + 4.0 / 128);
    std::printf(
        "fused quant: gather %lld x %lld %.1f us (%.0f%% of copy bw), silu_mul %lld x %lld %.1f "
        "us (%.0f%%), rms_norm %lld x %lld %.1f us (%.0f%%)\n",
        static_cast<long long>(rows), static_cast<long long>(H), us_g,
        100 * b_g / (us_g * 1e-6) / hbm, static_cast<long long>(rows), static_cast<long long>(I),
        us_s, 100 * b_s / (us_s * 1e-6) / hbm, static_cast<long long>(T), static_cast<long long>(H),
        us_n, 100 * b_n / (us_n * 1e-6) / hbm);
  }

  // ---- decode ----
  std::printf(
      "\n== decode: grouped GEMM at T tokens x top-8 (us; %%roof: W8A8's FP8 bytes over the copy "
      "bandwidth, %.0f GB/s)\n",
      hbm / 1e9);
  std::printf("%-8s %4s %6s | %8s %6s | %8s %6s | %8s | %8s | %8s | %6s\n", "gemm", "T", "exp",
              "w8a8dec", "%roof", "w8a8pre", "%roof", "bf16", "w8a16", "oldw8a8", "x bf16");
  for (const int64_t T : {32, 64, 128, 256}) {
    const int64_t rows = T * top_k;
    const int sets = 16;
    std::vector<Routing> rs;
    double distinct = 0;
    for (int s = 0; s < sets; ++s) {
      rs.push_back(make_routing(E, T, top_k));
      distinct += rs.back().distinct / sets;
    }
    Buf xq(static_cast<size_t>(rows * H)), xs(static_cast<size_t>(rows * (H / 128)) * 4),
        x16(static_cast<size_t>(rows * H) * 2), y(static_cast<size_t>(rows * H) * 2);
    fill_fp8(xq);
    fill_scales(xs);
    fill_bf16(x16);
    for (const Shape& s : shapes) {
      auto run8 = [&](cuda::MoeGemmW8A8Tile tile) {
        return t.time_us(sets, [&](int i) {
          cuda::MoeGemmW8A8Params p{xq.as<uint8_t>(),
                                    xs.as<float>(),
                                    s.w8->as<uint8_t>(),
                                    s.wr->as<float>(),
                                    y.as<cuda::bf16>(),
                                    rs[i].off->as<int32_t>(),
                                    rows,
                                    s.n,
                                    s.k,
                                    E};
          p.tile = tile;
          w8a8.run(p, t.stream);
        });
      };
      const double usd = run8(cuda::MoeGemmW8A8Tile::kDecode);
      const double usp = run8(cuda::MoeGemmW8A8Tile::kPrefill);
      const double us16 = t.time_us(sets, [&](int i) {
        cuda::moe_gemm_launch({x16.as<cuda::bf16>(), s.w16->as<cuda::bf16>(), y.as<cuda::bf16>(),
                               rs[i].off->as<int32_t>(), rows, s.n, s.k, E},
                              t.stream);
      });
      auto old = [&](bool act8) {
        return t.time_us(sets, [&](int i) {
          cuda::MoeGemmParams p{x16.as<cuda::bf16>(),
                                nullptr,
                                y.as<cuda::bf16>(),
                                rs[i].off->as<int32_t>(),
                                rows,
                                s.n,
                                s.k,
                                E};
          p.w_fp8 = s.w8->as<uint8_t>();
          p.w_scale = s.wr->as<float>();
          if (act8) {
            p.fp8_activations = true;
            p.x_fp8 = xq.as<uint8_t>();
            p.x_scale = xs.as<float>();
          }
          cuda::moe_gemm_launch(p, t.stream);
        });
      };
      const double us_w8a16 = old(false), us_old = old(true);
      // The roofline counts 128 x 128 block scales (the least a block-FP8 checkpoint needs);
      // the kernels read row scales (3% more).
      const double bytes = distinct * (s.n * s.k + (s.n / 128) * (s.k / 128) * 4.0) +
                           rows * (s.k * (1.0 + 4.0 / 128) + s.n * 2.0);
      auto roof = [&](double us) { return 100 * bytes / (us * 1e-6) / hbm; };
      std::printf(
          "%-8s %4lld %6.1f | %8.2f %5.0f%% | %8.2f %5.0f%% | %8.2f | %8.2f | %8.2f | %6.2f\n",
          s.name, static_cast<long long>(T), distinct, usd, roof(usd), usp, roof(usp), us16,
          us_w8a16, us_old, us16 / std::min(usd, usp));
    }
  }
  return 0;
}
