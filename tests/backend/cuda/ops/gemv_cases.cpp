// The cases of the small-m GEMM kernel (gemv.h; once TEST_F(CudaGemv, MatchesCpuGemm) and
// AlphaAndDeterminism of tests/backend/cuda/test_gemv_cuda.cpp) against cpu::gemm: every m of
// 1..kGemvMaxM, n from 1 to 5120, k 64 / 2048 / 4096, bf16 and fp32 outputs, each output
// followed by 64 guard elements that must stay poison. Tolerances: bf16 1e-2, fp32 2e-6 sqrt(k)
// (fp32 accumulation in another order than the reference). The graph / PDL / GemmLt tuning
// tests stay in test_gemv_cuda.cpp (several launches or captures, not one op).
#include <cmath>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/gemv.h"
#include "backend_ops.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tandem::cuda::backend_ops {
namespace {

using std::to_string;

constexpr size_t kGuard = 64;  // poisoned elements after each output, checked untouched

double tol_f32(int64_t k) { return 2e-6 * std::sqrt(static_cast<double>(k)); }

// y[m, n] = alpha x W^T, bf16 or fp32 out; `repeats` relaunches must give the same bytes.
class GemvCase : public OpCase {
 public:
  GemvCase(int64_t m, int64_t n, int64_t k, bool f32, float alpha = 1.0f, int repeats = 0)
      : m_(m), n_(n), k_(k), f32_(f32), alpha_(alpha), repeats_(repeats) {}
  void setup(Rng& rng) override {
    x_ = rng.randn_bf16(m_ * k_);
    w_ = rng.randn_bf16(n_ * k_);
    p_ = GemvParams{upload_bf16(x_), upload_bf16(w_), nullptr, m_, n_, k_, alpha_};
    const size_t count = m_ * n_;
    if (f32_) {
      p_.y_f32 = alloc<float>(count + kGuard);
      output("y fp32", DType::kF32, p_.y_f32, count).guarded(kGuard).tolerance(tol_f32(k_));
    } else {
      p_.y = alloc<__nv_bfloat16>(count + kGuard);
      output("y bf16", DType::kBF16, p_.y, count).guarded(kGuard);
    }
    TANDEM_CHECK(gemv_supported(p_), "gemv_supported");
  }
  void reference() override {
    std::vector<float> xf = to_f32(x_), wf = to_f32(w_), ref(m_ * n_);
    cpu::gemm({xf.data(), wf.data(), ref.data(), m_, n_, k_});
    for (auto& v : ref) v *= alpha_;
    outputs()[0].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override { gemv_launch(p_, s); }
  double flops() const override { return 2.0 * m_ * n_ * k_; }
  int deterministic_repeats() const override { return repeats_; }

 private:
  int64_t m_, n_, k_;
  bool f32_;
  float alpha_;
  int repeats_;
  Bits x_, w_;
  GemvParams p_{};
};

template <typename... A>
auto make_gemv(A... a) {
  return [=] { return std::unique_ptr<OpCase>(new GemvCase(a...)); };
}

}  // namespace

void register_gemv_cases(std::vector<CaseInfo>& r) {
  for (int64_t k : {64, 2048, 4096}) {
    for (int64_t n : {1, 7, 128, 5120}) {
      for (int64_t m = 1; m <= kGemvMaxM; ++m) {
        for (bool f32 : {false, true}) {
          add_case(r, "Gemv",
                   "m" + to_string(m) + "_n" + to_string(n) + "_k" + to_string(k) +
                       (f32 ? "_f32" : "_bf16"),
                   make_gemv(m, n, k, f32));
        }
      }
    }
  }
  // alpha 0.25 into fp32, and three more launches bitwise the same.
  add_case(r, "Gemv", "m3_n5120_k2048_f32_alpha0p25_deterministic",
           make_gemv(int64_t{3}, int64_t{5120}, int64_t{2048}, true, 0.25f, 3));
}

}  // namespace tandem::cuda::backend_ops
