// The cases of the FP8-weight single ops of fp8_linear.h (once the gemv, dequantize and
// quantize tests of tests/backend/cuda/test_fp8_linear_cuda.cpp) against the CPU reference:
// dequantize (W = e4m3(q) * scale of the row's 128x128 block, the float product) then the
// double math over bf16 activations. Random codes (every non-NaN E4M3 code, subnormals
// included) and scales of very different sizes per block (a wrong block lookup shows); K and
// N not multiples of 128, row slices narrower than a block. The grouped / dense GEMMs (every
// tile, W8A16 and W8A8) and the MoE block stay in test_fp8_linear_cuda.cpp.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../fp8_act_ref.h"
#include "../weight_util.h"
#include "backend/cuda/fp8_linear.h"
#include "backend_ops.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tandem::cuda::backend_ops {
namespace {

using std::to_string;

constexpr size_t kGuard = 64;  // poisoned elements after each output, checked untouched

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

using test_util::Fp8Matrix;

Fp8Matrix rand_matrix(Rng& rng, int64_t n, int64_t k) {
  Fp8Matrix m;
  m.n = n;
  m.k = k;
  m.q.resize(static_cast<size_t>(n * k));
  for (auto& c : m.q) {
    int64_t v = rng.uniform(0, 255);
    while ((v & 0x7f) == 0x7f) v = rng.uniform(0, 255);  // no NaN codes (the loader refuses them)
    c = static_cast<uint8_t>(v);
  }
  // Scales of very different sizes per block: a wrong block lookup shows.
  m.block_scale.resize(static_cast<size_t>(cdiv(n, 128) * cdiv(k, 128)));
  for (auto& s : m.block_scale) s = std::exp2(rng.uniform_real(-10.f, -4.f));
  return m;
}

// y[i][r] = sum_j x[i][j] W[r0 + r][j] over the bf16 activations, as doubles.
std::vector<double> ref_gemm(Bits const& x, int64_t m, Fp8Matrix const& w, int64_t r0, int64_t n) {
  std::vector<double> y(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < n; ++r) {
    std::vector<float> wr(static_cast<size_t>(w.k));
    for (int64_t j = 0; j < w.k; ++j) wr[j] = w.at(r0 + r, j);
    for (int64_t i = 0; i < m; ++i) {
      double s = 0;
      for (int64_t j = 0; j < w.k; ++j) {
        s += double(bf16_to_f32(x[static_cast<size_t>(i * w.k + j)])) * wr[j];
      }
      y[static_cast<size_t>(i * n + r)] = s;
    }
  }
  return y;
}

// fp8_gemv_launch over rows [r0, r0 + n) of a [rows, k] matrix (the slice's codes and row
// scales only: a shard keeps its rows' block scales), bf16 out (6e-3) or fp32 out (3e-5),
// guarded or not.
class Fp8GemvCase : public OpCase {
 public:
  Fp8GemvCase(int64_t m, int64_t rows, int64_t k, int64_t r0, int64_t n, bool f32, size_t guard)
      : m_(m), rows_(rows), k_(k), r0_(r0), n_(n), f32_(f32), guard_(guard) {}
  void setup(Rng& rng) override {
    w_ = rand_matrix(rng, rows_, k_);
    x_ = rng.randn_bf16(static_cast<size_t>(m_ * k_));
    const std::vector<float> rs = w_.row_scale();
    const int64_t kb = fp8_row_scale_cols(k_);
    const std::vector<uint8_t> q(w_.q.begin() + r0_ * k_, w_.q.begin() + (r0_ + n_) * k_);
    const std::vector<float> s(rs.begin() + r0_ * kb, rs.begin() + (r0_ + n_) * kb);
    p_ = Fp8GemvParams{upload_bf16(x_), upload(q), upload(s), nullptr, m_, n_, k_};
    const size_t out = static_cast<size_t>(m_ * n_);
    if (f32_) {
      p_.y_f32 = alloc<float>(out + guard_);
      output("y fp32", DType::kF32, p_.y_f32, out).guarded(guard_).tolerance(3e-5);
    } else {
      p_.y = alloc<__nv_bfloat16>(out + guard_);
      output("y bf16", DType::kBF16, p_.y, out).guarded(guard_).tolerance(6e-3);
    }
  }
  void reference() override { outputs()[0].ref_f64 = ref_gemm(x_, m_, w_, r0_, n_); }
  void launch(cudaStream_t s) override { fp8_gemv_launch(p_, s); }
  double flops() const override { return 2.0 * m_ * n_ * k_; }

 private:
  int64_t m_, rows_, k_, r0_, n_;
  bool f32_;
  size_t guard_;
  Fp8Matrix w_;
  Bits x_;
  Fp8GemvParams p_{};
};

// Every code through the conversion: row r holds code r in column 0, x = e_0: y[r] is the
// code's value times its scale, exactly (fp32 output). No random input.
class Fp8GemvEveryCodeCase : public OpCase {
 public:
  void setup(Rng&) override {
    w_.n = kN;
    w_.k = kK;
    w_.q.assign(static_cast<size_t>(kN * kK), 0);
    for (int64_t r = 0; r < kN; ++r) {
      w_.q[r * kK] = (r & 0x7f) == 0x7f ? 0 : static_cast<uint8_t>(r);
    }
    w_.block_scale = {0.75f, 1.0f / 1024};
    Bits x(kK, 0);
    x[0] = f32_to_bf16(1.0f);
    p_ = Fp8GemvParams{upload_bf16(x), upload(w_.q), upload(w_.row_scale()), nullptr, 1, kN, kK};
    p_.y_f32 = alloc<float>(kN);
    output("y fp32", DType::kF32, p_.y_f32, kN).exact();
  }
  void reference() override {
    std::vector<float> ref(kN);
    for (int64_t r = 0; r < kN; ++r) ref[r] = w_.at(r, 0);
    outputs()[0].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override { fp8_gemv_launch(p_, s); }

 private:
  static constexpr int64_t kN = 256, kK = 16;
  Fp8Matrix w_;
  Fp8GemvParams p_{};
};

// The prefill dequantization: bf16(e4m3 * scale), exactly the bf16 model's load.
class Fp8DequantizeCase : public OpCase {
 public:
  Fp8DequantizeCase(int64_t rows, int64_t cols) : rows_(rows), cols_(cols) {}
  void setup(Rng& rng) override {
    w_ = rand_matrix(rng, rows_, cols_);
    d_q_ = upload(w_.q);
    d_s_ = upload(w_.row_scale());
    const size_t n = static_cast<size_t>(rows_ * cols_);
    d_out_ = alloc<__nv_bfloat16>(n + kGuard);
    output("out", DType::kBF16, d_out_, n).guarded(kGuard).exact();
  }
  void reference() override {
    std::vector<float> ref(static_cast<size_t>(rows_ * cols_));
    for (int64_t r = 0; r < rows_; ++r) {
      for (int64_t c = 0; c < cols_; ++c) ref[r * cols_ + c] = w_.at(r, c);  // bf16(): exact
    }
    outputs()[0].ref = std::move(ref);
  }
  void launch(cudaStream_t s) override {
    fp8_dequantize_launch(d_q_, d_s_, rows_, cols_, d_out_, s);
  }

 private:
  int64_t rows_, cols_;
  Fp8Matrix w_;
  uint8_t* d_q_ = nullptr;
  float* d_s_ = nullptr;
  __nv_bfloat16* d_out_ = nullptr;
};

// fp8_quantize_rows_launch: codes and row-major scales bit for bit against the CPU reference,
// a partial last group (k % 128 != 0), an all-zero row (scale 1, codes 0) and a tiny one.
class Fp8QuantizeRowsCase : public OpCase {
 public:
  explicit Fp8QuantizeRowsCase(int64_t k) : k_(k) {}
  void setup(Rng& rng) override {
    const int64_t kb = fp8_row_scale_cols(k_);
    x_ = rng.randn_bf16(static_cast<size_t>(kM * k_));
    for (int64_t j = 0; j < k_; ++j) x_[5 * k_ + j] = 0;  // an all-zero row: scale 1, codes 0
    for (int64_t j = 0; j < k_; ++j) {
      x_[7 * k_ + j] = f32_to_bf16(bf16_to_f32(x_[7 * k_ + j]) * 1e-6f);
    }
    d_x_ = upload_bf16(x_);
    d_q_ = alloc<uint8_t>(static_cast<size_t>(kM * k_) + kGuard);
    d_s_ = alloc<float>(static_cast<size_t>(kM * kb) + kGuard);
    output("codes", DType::kF8E4M3, d_q_, static_cast<size_t>(kM * k_)).guarded(kGuard);
    output("scales", DType::kF32, d_s_, static_cast<size_t>(kM * kb)).guarded(kGuard).exact();
  }
  void reference() override {
    const int64_t kb = fp8_row_scale_cols(k_);
    std::vector<uint8_t> q(static_cast<size_t>(kM * k_));
    std::vector<float> sc(static_cast<size_t>(kM * kb)), g(128);
    for (int64_t i = 0; i < kM; ++i) {
      for (int64_t c0 = 0; c0 < k_; c0 += 128) {
        const int64_t w = std::min<int64_t>(128, k_ - c0);
        for (int64_t j = 0; j < w; ++j) g[j] = bf16_to_f32(x_[i * k_ + c0 + j]);
        sc[i * kb + c0 / 128] = test_util::fp8_quantize_group_ref(g.data(), w, &q[i * k_ + c0]);
      }
    }
    outputs()[0].ref_u8 = std::move(q);
    outputs()[1].ref = std::move(sc);
  }
  void launch(cudaStream_t s) override { fp8_quantize_rows_launch(d_x_, d_q_, d_s_, kM, k_, s); }

 private:
  static constexpr int64_t kM = 37;
  int64_t k_;
  Bits x_;
  __nv_bfloat16* d_x_ = nullptr;
  uint8_t* d_q_ = nullptr;
  float* d_s_ = nullptr;
};

template <typename C, typename... A>
auto make(A... a) {
  return [=] { return std::unique_ptr<OpCase>(new C(a...)); };
}

}  // namespace

void register_fp8_cases(std::vector<CaseInfo>& r) {
  add_case(r, "Fp8Gemv", "every_code_n256_k16_f32", make<Fp8GemvEveryCodeCase>());
  struct Nk {
    int64_t n, k;
  };
  for (Nk s : {Nk{1, 16}, Nk{37, 144}, Nk{300, 1040}, Nk{129, 2048}, Nk{64, 4112}}) {
    for (int64_t m = 1; m <= kFp8GemvMaxM; ++m) {
      for (bool f32 : {false, true}) {
        add_case(r, "Fp8Gemv",
                 "m" + to_string(m) + "_n" + to_string(s.n) + "_k" + to_string(s.k) +
                     (f32 ? "_f32" : "_bf16"),
                 make<Fp8GemvCase>(m, s.n, s.k, int64_t{0}, s.n, f32, kGuard));
      }
    }
  }
  // A shard of rows narrower than a block (and one straddling two blocks) of a 320 x 400
  // matrix keeps the scales of its rows' blocks.
  for (auto [r0, n] : {std::pair<int64_t, int64_t>{64, 32}, {100, 64}, {250, 70}}) {
    add_case(r, "Fp8Gemv", "m3_rows" + to_string(r0) + "p" + to_string(n) + "_of320_k400_f32",
             make<Fp8GemvCase>(int64_t{3}, int64_t{320}, int64_t{400}, r0, n, true, size_t{0}));
  }
  add_case(r, "Fp8Dequantize", "rows130_cols400",
           make<Fp8DequantizeCase>(int64_t{130}, int64_t{400}));
  for (int64_t k : {16, 272, 2048}) {
    add_case(r, "Fp8QuantizeRows", "m37_k" + to_string(k), make<Fp8QuantizeRowsCase>(k));
  }
}

}  // namespace tandem::cuda::backend_ops
