// The cases of the bf16 grouped expert GEMM (moe_gemm.h; once TEST_F(MoeGemmCuda,
// MatchesCpuReference) of tests/backend/cuda/test_moe_gemm_cuda.cpp) against cpu::gemm per
// expert (+ cpu::silu_mul on the unpacked gate/up output): every routing of the table x plain,
// SiLU-mul and SiLU-mul with the fused row gather x every tile (whatever the host would pick)
// x every PDL mode (a PDL launch preceded by the same GEMM into a scratch output, so the
// dependent may start while it runs). Output rows past the routed ones must stay untouched;
// x rows past them hold NaN (never read). Tolerance: relative error 1e-2 and no element off by
// more than 3e-2 (|ref| + rms(ref)).
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "../weight_util.h"
#include "backend/cpu/ops.h"
#include "backend/cuda/moe_gemm.h"
#include "backend_ops.h"
#include "core/dtype.h"

namespace tandem::cuda::backend_ops {
namespace {

using std::to_string;

// Random bf16 in [-a, a], a = scale * sqrt(3) (standard deviation `scale`).
Bits rand_bf16(Rng& rng, size_t n, float scale = 1.0f) {
  return rng.uniform_bf16(n, -scale * 1.7320508f, scale * 1.7320508f);
}

using test_util::pack_all;

struct Routing {
  std::string name;
  int64_t n, k;
  std::function<std::vector<int32_t>(Rng&)> counts;  // rows per expert
  int64_t slack;                                     // max_rows - routed rows
};

std::function<std::vector<int32_t>(Rng&)> fixed(std::vector<int32_t> c) {
  return [c](Rng&) { return c; };
}

std::function<std::vector<int32_t>(Rng&)> random_counts(int64_t E, int64_t lo, int64_t hi) {
  return [=](Rng& rng) {
    std::vector<int32_t> c(E);
    for (auto& v : c) v = static_cast<int32_t>(rng.uniform(lo, hi));
    return c;
  };
}

class MoeGemmCase : public OpCase {
 public:
  MoeGemmCase(Routing c, MoeGemmEpilogue epi, bool gather, MoeGemmTile tile, MoeGemmPdl pdl)
      : c_(std::move(c)), epi_(epi), gather_(gather), tile_(tile), pdl_(pdl) {}
  void setup(Rng& rng) override {
    const bool silu = epi_ == MoeGemmEpilogue::kSiluMul;
    counts_ = c_.counts(rng);
    const int64_t E = static_cast<int64_t>(counts_.size()), N = c_.n, K = c_.k;
    offsets_.assign(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) offsets_[e + 1] = offsets_[e] + counts_[e];
    total_ = offsets_[E];
    const int64_t max_rows = total_ + c_.slack;
    out_cols_ = silu ? N / 2 : N;
    x_ = rand_bf16(rng, max_rows * K);
    for (int64_t i = total_ * K; i < max_rows * K; ++i) x_[i] = 0xffff;  // never read
    constexpr int64_t kDiv = 3;
    const int64_t tokens = total_ / 2 + 1;
    const Bits x_tokens = rand_bf16(rng, tokens * K);
    std::vector<int32_t> gather_src(std::max<int64_t>(max_rows, 1), 0x7f7f7f7f);  // tail: unused
    if (gather_) {
      for (int64_t i = 0; i < total_; ++i) {
        const int64_t t = rng.uniform(0, tokens - 1);
        gather_src[i] = static_cast<int32_t>(t * kDiv + rng.uniform(0, kDiv - 1));
        std::copy_n(x_tokens.begin() + t * K, K, x_.begin() + i * K);  // the reference's rows
      }
    }
    // Weights: HF [E, N, K]; for silu_mul the first N/2 rows of each expert are gate, the rest
    // up, and the device gets them packed.
    w_ = rand_bf16(rng, E * N * K, 1.0f / std::sqrt(static_cast<float>(K)));
    Bits w_dev = w_;
    if (silu) {
      const int64_t I = N / 2;
      Bits gate(E * I * K), up(E * I * K);
      for (int64_t e = 0; e < E; ++e) {
        std::copy_n(w_.begin() + e * N * K, I * K, gate.begin() + e * I * K);
        std::copy_n(w_.begin() + e * N * K + I * K, I * K, up.begin() + e * I * K);
      }
      w_dev = pack_all(gate, up, E, I, K);
    }
    __nv_bfloat16* d_y = alloc<__nv_bfloat16>(max_rows * out_cols_);
    p_ = MoeGemmParams{upload_bf16(gather_ ? x_tokens : x_),
                       upload_bf16(w_dev),
                       d_y,
                       upload(offsets_),
                       max_rows,
                       N,
                       K,
                       E,
                       epi_,
                       tile_};
    if (gather_) {
      p_.gather_src = upload(gather_src);
      p_.gather_div = kDiv;
    }
    p_.pdl = pdl_;
    scratch_ = alloc<__nv_bfloat16>(max_rows * out_cols_);
    output("y", DType::kBF16, d_y, max_rows * out_cols_).per_element();
  }
  void reference() override {
    const int64_t E = static_cast<int64_t>(counts_.size()), N = c_.n, K = c_.k;
    const bool silu = epi_ == MoeGemmEpilogue::kSiluMul;
    std::vector<float> xf = to_f32(x_), wf = to_f32(w_), ref(p_.max_rows * out_cols_, 0.f);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = counts_[e];
      if (m == 0) continue;
      std::vector<float> y(m * N);
      cpu::gemm({xf.data() + offsets_[e] * K, wf.data() + e * N * K, y.data(), m, N, K});
      if (silu) {
        cpu::silu_mul({y.data(), ref.data() + offsets_[e] * out_cols_, m, N / 2});
      } else {
        std::copy(y.begin(), y.end(), ref.begin() + offsets_[e] * out_cols_);
      }
    }
    Output& o = outputs()[0];
    o.ref = std::move(ref);
    // Rows past the routed ones must not be written.
    o.mask.assign(o.count, Elem::kUntouched);
    std::fill(o.mask.begin(), o.mask.begin() + total_ * out_cols_, Elem::kCompare);
  }
  void launch(cudaStream_t s) override {
    if (pdl_ != MoeGemmPdl::kOff) {
      MoeGemmParams q = p_;
      q.pdl = MoeGemmPdl::kOff;
      q.y = scratch_;
      moe_gemm_launch(q, s);
    }
    moe_gemm_launch(p_, s);
  }
  double flops() const override {
    return 2.0 * total_ * c_.n * c_.k * (pdl_ != MoeGemmPdl::kOff ? 2 : 1);
  }

 private:
  Routing c_;
  MoeGemmEpilogue epi_;
  bool gather_;
  MoeGemmTile tile_;
  MoeGemmPdl pdl_;
  std::vector<int32_t> counts_, offsets_;
  int64_t total_ = 0, out_cols_ = 0;
  Bits x_, w_;
  MoeGemmParams p_{};
  __nv_bfloat16* scratch_ = nullptr;
};

char const* tile_name(MoeGemmTile t) {
  switch (t) {
    case MoeGemmTile::kAuto: return "auto";
    case MoeGemmTile::kSmall: return "small";
    case MoeGemmTile::kMedium: return "medium";
    case MoeGemmTile::kLarge: return "large";
    case MoeGemmTile::kLargeK64: return "largek64";
    case MoeGemmTile::kLarge256: return "large256";
  }
  return "unknown";
}

char const* pdl_name(MoeGemmPdl p) {
  switch (p) {
    case MoeGemmPdl::kOff: return "nopdl";
    case MoeGemmPdl::kWaitFirst: return "pdlwait";
    case MoeGemmPdl::kPrefetchWeights: return "pdlprefetch";
  }
  return "unknown";
}

}  // namespace

void register_moe_gemm_cases(std::vector<CaseInfo>& r) {
  std::vector<int32_t> one_row(128, 0);
  one_row[77] = 1;  // 1 token, 1 local slot
  auto skewed130 = [](Rng& rng) {
    std::vector<int32_t> c = random_counts(130, 0, 3)(rng);
    c[129] = 70;
    return c;
  };
  const std::vector<Routing> routings = {
      {"decode_random", 256, 512, random_counts(16, 0, 4), 7},
      {"prefill_uneven", 384, 256, fixed({300, 0, 513, 129}), 0},
      {"all_to_one", 192, 136, fixed({0, 0, 300, 0}), 5},  // k not a multiple of 32/64
      {"one_row", 256, 512, fixed(one_row), 7},
      {"no_rows", 64, 64, fixed(std::vector<int32_t>(8, 0)), 16},
      {"130_experts_skewed", 64, 64, skewed130, 3},
      {"rows_just_past_tiles", 128, 64, fixed({17, 65, 129, 1, 16, 64, 128}), 0},
      {"qwen3_30b_decode", 1536, 2048, random_counts(12, 0, 9), 0},
      {"qwen3_30b_down", 2048, 768, random_counts(12, 0, 40), 0},
  };
  struct Variant {
    MoeGemmEpilogue epi;
    bool gather;
    char const* name;
  };
  auto add = [&](Routing const& c, Variant v) {
    for (MoeGemmTile tile : {MoeGemmTile::kAuto, MoeGemmTile::kSmall, MoeGemmTile::kMedium,
                             MoeGemmTile::kLarge, MoeGemmTile::kLargeK64, MoeGemmTile::kLarge256}) {
      for (MoeGemmPdl pdl :
           {MoeGemmPdl::kOff, MoeGemmPdl::kWaitFirst, MoeGemmPdl::kPrefetchWeights}) {
        add_case(r, "MoeGemm",
                 c.name + "_n" + to_string(c.n) + "_k" + to_string(c.k) + "_" + v.name + "_" +
                     tile_name(tile) + "_" + pdl_name(pdl),
                 [=] {
                   return std::unique_ptr<OpCase>(new MoeGemmCase(c, v.epi, v.gather, tile, pdl));
                 });
      }
    }
  };
  for (Routing const& c : routings) {
    add(c, {MoeGemmEpilogue::kPlain, false, "plain"});
    add(c, {MoeGemmEpilogue::kSiluMul, false, "silu"});
    add(c, {MoeGemmEpilogue::kSiluMul, true, "silu_gather"});
  }
  // n a multiple of 8 but not of 16 or of any tile width: plain only.
  add({"odd_n", 200, 72, fixed({17, 1, 40}), 2}, {MoeGemmEpilogue::kPlain, false, "plain"});
}

}  // namespace tandem::cuda::backend_ops
