// Block-scaled FP8 GEMM (backend/cuda/fp8_gemm.h: cuBLASLt 1x128 activations x 128x128 weights)
// beside the bf16 cuBLASLt GEMM (gemm.h) on the same shapes in the same run: Qwen3-30B-A3B's
// fused QKV (2048 -> 5120), o_proj (4096 -> 2048), one expert's gate/up (2048 -> 1536) and
// down (768 -> 2048), lm_head (2048 -> 151936) at m = 1 / 32 / 128 / 512 / 2048 / 8192 tokens.
// Per shape: microseconds and TFLOP/s of bf16, FP8 GEMM alone, FP8 with the activation
// quantization (the separate pass a fused producer would remove), the FP8 / bf16 speed-up, and
// our W8A8 grouped GEMM as one dense expert (moe_gemm.h fp8_activations: bf16 x quantized in
// the kernel, FP8 tensor-core mma.sync) beside them.
// Graph-timed (bench_util.h Timer); the bf16 8192^3 ceiling and copy bandwidth first.
//   bench_fp8_gemm [--quick]
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/fp8_gemm.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe_gemm.h"
#include "bench_util.h"

using namespace tandem;
using namespace tandem::bench;

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  if (!open_device(&prop)) return 0;
  Timer t;
  t.create();
  for (int i = 1; i < argc; ++i) t.quick = t.quick || std::strcmp(argv[i], "--quick") == 0;
  measure_ceilings(t, [](Buf& b) { fill_bf16(b); });

  struct Shape {
    const char* name;
    int64_t n, k;
  };
  const Shape shapes[] = {{"qkv", 5120, 2048},
                          {"o_proj", 2048, 4096},
                          {"expert gate_up", 1536, 2048},
                          {"expert down", 2048, 768},
                          {"lm_head", 151936, 2048}};
  const int64_t ms[] = {1, 32, 128, 512, 2048, 8192};
  std::printf("%-15s %6s %6s %6s | %9s %7s | %9s %7s | %9s %7s | %7s %7s | %9s %7s %7s\n", "shape",
              "m", "n", "k", "bf16 us", "TF/s", "fp8 us", "TF/s", "+quant us", "TF/s", "x gemm",
              "x +q", "w8a8 us", "TF/s", "x bf16");
  cuda::GemmLt bf16;
  cuda::Fp8GemmLt fp8;
  // E4M3 weight codes (no NaN) tiled from 1 Mi random ones.
  std::vector<uint8_t> pattern(size_t{1} << 20);
  for (auto& c : pattern)
    c = static_cast<uint8_t>(g_rng() % 0x7f) | static_cast<uint8_t>(g_rng() & 0x80);
  for (const Shape& s : shapes) {
    Buf w(size_t(s.n * s.k * 2)), wq(size_t(s.n * s.k));
    Buf ws(size_t((s.n + 127) / 128 * cuda::fp8_weight_scale_ld(s.k) * 4));
    Buf wrs(size_t(s.n * cuda::fp8_row_scale_cols(s.k) * 4));  // row scales (W8A8 kernel)
    fill_bf16(w, 0.05f);
    {
      std::vector<uint8_t> codes(size_t(s.n * s.k));
      for (size_t i = 0; i < codes.size(); ++i)
        codes[i] = pattern[(i * 7 + i / pattern.size()) % pattern.size()];
      upload(wq, codes);
      std::vector<float> sc(size_t((s.n + 127) / 128 * ((s.k + 127) / 128)), 0.2f / 448.0f);
      upload(ws, cuda::fp8_pack_weight_scales(sc.data(), s.n, s.k));
      upload(wrs, cuda::fp8_expand_row_scales(sc.data(), s.n, s.k, 128));
    }
    for (int64_t m : ms) {
      const int64_t mp = cuda::fp8_pad_m(m);
      Buf x(size_t(mp * s.k * 2)), y(size_t(mp * s.n * 2));
      fill_bf16(x);
      Buf xq(size_t(mp * s.k)), xs(size_t(mp * (s.k / 128) * 4));
      const double flops = 2.0 * double(m) * double(s.n) * double(s.k);
      const double us_bf16 = t.time_us(1, [&](int) {
        bf16.run({x.as<cuda::bf16>(), w.as<cuda::bf16>(), y.as<cuda::bf16>(), m, s.n, s.k},
                 t.stream);
      });
      cuda::Fp8QuantParams qp{x.as<__nv_bfloat16>(), xq.as<uint8_t>(), xs.as<float>(), m, s.k};
      cuda::fp8_quantize_act_launch(qp, t.stream);
      cuda::Fp8GemmParams gp{xq.as<uint8_t>(),
                             xs.as<float>(),
                             wq.as<uint8_t>(),
                             ws.as<float>(),
                             y.as<__nv_bfloat16>(),
                             m,
                             s.n,
                             s.k};
      const double us_fp8 = t.time_us(1, [&](int) { fp8.run(gp, t.stream); });
      const double us_fp8q = t.time_us(1, [&](int) {
        cuda::fp8_quantize_act_launch(qp, t.stream);
        fp8.run(gp, t.stream);
      });
      cuda::MoeGemmParams mp8{
          x.as<cuda::bf16>(), nullptr, y.as<cuda::bf16>(), nullptr, m, s.n, s.k, 1};
      mp8.w_fp8 = wq.as<uint8_t>();
      mp8.w_scale = wrs.as<float>();
      mp8.fp8_activations = true;
      const double us_w8a8 = t.time_us(1, [&](int) { cuda::moe_gemm_launch(mp8, t.stream); });
      std::printf(
          "%-15s %6lld %6lld %6lld | %9.1f %7.1f | %9.1f %7.1f | %9.1f %7.1f | %7.2f %7.2f | "
          "%9.1f %7.1f %7.2f\n",
          s.name, static_cast<long long>(m), static_cast<long long>(s.n),
          static_cast<long long>(s.k), us_bf16, flops / us_bf16 * 1e-6, us_fp8,
          flops / us_fp8 * 1e-6, us_fp8q, flops / us_fp8q * 1e-6, us_bf16 / us_fp8,
          us_bf16 / us_fp8q, us_w8a8, flops / us_w8a8 * 1e-6, us_bf16 / us_w8a8);
    }
  }
  return 0;
}
