// Output digests of the mma.sync grouped GEMMs (moe_gemm.h): every variant (bf16 weights,
// W8A16 with per-128 and MXFP8 scales, W8A8 with in-kernel and pre-quantized activations) x
// tile x epilogue x PDL mode x gather, routed and dense, over fixed inputs (a fixed seed).
// Prints one FNV-1a digest per case and one over all of them, for comparing two builds' outputs
// bit for bit (a kernel refactor that must not change numerics): run both, diff the lines
// starting "MOE_GEMM_DIGEST". Checks only that every launch runs and that the rows past the
// routed ones stay untouched; the numerics against the CPU are test_moe_gemm_cuda.cpp's and
// test_fp8_linear_cuda.cpp's. Skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm.h"
#include "core/dtype.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::DeviceBuffer;

uint64_t fnv1a(void const* data, size_t bytes, uint64_t h = 1469598103934665603ull) {
  auto const* b = static_cast<uint8_t const*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

enum class Variant { kBf16, kW8A16, kMxfp8, kW8A8, kW8A8PreQ };

class MoeGemmDigestCuda : public test_util::CudaFixture<> {};

TEST_F(MoeGemmDigestCuda, PrintsOutputDigests) {
  std::mt19937 rng(20261207);  // fixed: the same inputs in every build
  constexpr int64_t K = 400, N = 96, E = 5, kTokens = 90, kTopK = 2;
  const std::vector<int32_t> counts = {37, 0, 130, 5, 1};  // skewed, one empty expert
  std::vector<int32_t> offsets(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  const int64_t routed = offsets[E], max_rows = routed + 7;  // rows past the routed ones
  ASSERT_LE(routed, kTokens * kTopK);
  const int64_t kDenseRows = 150;
  const int64_t x_rows = std::max<int64_t>(max_rows, kDenseRows);

  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> code(0, 255);
  auto e4m3 = [&] {
    int v = code(rng);
    while ((v & 0x7f) == 0x7f) v = code(rng);  // no NaN codes
    return static_cast<uint8_t>(v);
  };
  std::vector<uint16_t> x(static_cast<size_t>(x_rows * K)), w(static_cast<size_t>(E * N * K));
  for (auto& v : x) v = f32_to_bf16(nd(rng));
  for (auto& v : w) v = f32_to_bf16(0.1f * nd(rng));
  std::vector<uint8_t> w8(static_cast<size_t>(E * N * K)), x8(static_cast<size_t>(x_rows * K));
  for (auto& v : w8) v = e4m3();
  for (auto& v : x8) v = e4m3();
  std::uniform_real_distribution<float> ex(-10.f, -4.f);
  std::vector<float> w_scale(static_cast<size_t>(E * N * fp8_row_scale_cols(K)));
  std::vector<float> x_scale(static_cast<size_t>(x_rows * fp8_row_scale_cols(K)));
  for (auto& s : w_scale) s = std::exp2(ex(rng));
  for (auto& s : x_scale) s = std::exp2(ex(rng) + 6.f);
  std::uniform_int_distribution<int> e8(110, 124);
  std::vector<uint8_t> w_e8m0(static_cast<size_t>(E * N * mxfp8_scale_cols(K)));
  for (auto& c : w_e8m0) c = static_cast<uint8_t>(e8(rng));
  std::vector<int32_t> gather(static_cast<size_t>(max_rows));
  std::uniform_int_distribution<int32_t> src(0, kTokens * kTopK - 1);
  for (auto& g : gather) g = src(rng);

  DeviceBuffer<uint16_t> d_x(x), d_w(w);
  DeviceBuffer<uint8_t> d_w8(w8), d_x8(x8), d_e8(w_e8m0);
  DeviceBuffer<float> d_ws(w_scale), d_xs(x_scale);
  DeviceBuffer<int32_t> d_off(offsets), d_gather(gather);
  DeviceBuffer<uint16_t> d_y(static_cast<size_t>(x_rows * N));
  DeviceBuffer<float> d_yf(static_cast<size_t>(x_rows * N));

  uint64_t all = 1469598103934665603ull;
  int cases = 0;
  auto run = [&](std::string const& name, MoeGemmParams p, bool f32_out) {
    const size_t out_elems = static_cast<size_t>(x_rows * N);
    TANDEM_CUDA_CHECK(cudaMemset(d_y.ptr, 0xAB, out_elems * sizeof(uint16_t)));
    TANDEM_CUDA_CHECK(cudaMemset(d_yf.ptr, 0xAB, out_elems * sizeof(float)));
    moe_gemm_launch(p, stream_);
    sync();
    const int64_t cols = p.epilogue == MoeGemmEpilogue::kSiluMul ? N / 2 : N;
    const int64_t used = p.expert_offsets != nullptr ? routed : p.max_rows;
    uint64_t h = 0;
    if (f32_out) {
      auto y = d_yf.download();
      h = fnv1a(y.data(), static_cast<size_t>(used * cols) * sizeof(float));
      for (size_t i = static_cast<size_t>(used * cols); i < y.size(); ++i) {
        uint32_t bits = 0;
        std::memcpy(&bits, &y[i], sizeof bits);
        ASSERT_EQ(bits, 0xABABABABu) << name << " wrote past row " << used;
      }
    } else {
      auto y = d_y.download();
      h = fnv1a(y.data(), static_cast<size_t>(used * cols) * sizeof(uint16_t));
      for (size_t i = static_cast<size_t>(used * cols); i < y.size(); ++i) {
        ASSERT_EQ(y[i], 0xABAB) << name << " wrote past row " << used;
      }
    }
    std::printf("MOE_GEMM_DIGEST %-44s %s\n", name.c_str(), hex(h).c_str());
    all = fnv1a(&h, sizeof h, all);
    ++cases;
  };

  const char* variant_names[] = {"bf16", "w8a16", "mxfp8", "w8a8", "w8a8_preq"};
  const char* pdl_names[] = {"off", "wait", "prefetch"};
  for (Variant v :
       {Variant::kBf16, Variant::kW8A16, Variant::kMxfp8, Variant::kW8A8, Variant::kW8A8PreQ}) {
    MoeGemmParams base{};
    base.x = reinterpret_cast<bf16 const*>(d_x.ptr);
    base.w = reinterpret_cast<bf16 const*>(d_w.ptr);
    base.y = reinterpret_cast<bf16*>(d_y.ptr);
    base.n = N;
    base.k = K;
    if (v != Variant::kBf16) {
      base.w_fp8 = d_w8.ptr;
      if (v == Variant::kMxfp8) {
        base.w_e8m0 = d_e8.ptr;
      } else {
        base.w_scale = d_ws.ptr;
      }
      base.fp8_activations = v == Variant::kW8A8 || v == Variant::kW8A8PreQ;
      if (v == Variant::kW8A8PreQ) {
        base.x_fp8 = d_x8.ptr;
        base.x_scale = d_xs.ptr;
      }
    }
    std::vector<MoeGemmTile> tiles = {MoeGemmTile::kSmall, MoeGemmTile::kMedium,
                                      MoeGemmTile::kLarge};
    if (v == Variant::kBf16) {
      tiles.push_back(MoeGemmTile::kLargeK64);
      tiles.push_back(MoeGemmTile::kLarge256);
    }
    for (MoeGemmTile tile : tiles) {
      const std::string prefix = std::string(variant_names[static_cast<int>(v)]) + "/tile" +
                                 std::to_string(static_cast<int>(tile));
      // Routed: every epilogue, PDL mode, with and without the fused gather.
      for (auto epi : {MoeGemmEpilogue::kPlain, MoeGemmEpilogue::kSiluMul}) {
        for (int pdl = 0; pdl < 3; ++pdl) {
          for (bool gathered : {false, true}) {
            MoeGemmParams p = base;
            p.expert_offsets = d_off.ptr;
            p.max_rows = max_rows;
            p.num_experts = E;
            p.epilogue = epi;
            p.tile = tile;
            p.pdl = static_cast<MoeGemmPdl>(pdl);
            if (gathered) {
              p.gather_src = d_gather.ptr;
              p.gather_div = kTopK;
            }
            run(prefix + (epi == MoeGemmEpilogue::kSiluMul ? "/silu" : "/plain") + "/pdl_" +
                    pdl_names[pdl] + (gathered ? "/gather" : ""),
                p, false);
          }
        }
      }
      // Dense: one expert without offsets (bf16 weights: bf16 and fp32 out).
      for (bool f32 : {false, true}) {
        if (f32 && v != Variant::kBf16) continue;
        MoeGemmParams p = base;
        p.max_rows = kDenseRows;
        p.num_experts = 1;
        p.tile = tile;
        if (f32) p.y_f32 = d_yf.ptr;
        run(prefix + "/dense" + (f32 ? "_f32" : ""), p, f32);
      }
    }
  }
  std::printf("MOE_GEMM_DIGEST all(%d cases) %s\n", cases, hex(all).c_str());
}

}  // namespace
}  // namespace tandem::cuda
