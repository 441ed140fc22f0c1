#include "model/cuda/dense_linear.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cuda/fp8_linear.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "model/cuda/mxfp8_weights.h"
#include "model/cuda/random_fill.h"

namespace tandem::cuda_model {

Fp8Mat Fp8Linears::alloc(int64_t count, int64_t n, int64_t k, bool out) {
  const int64_t codes = count * n * k,
                scales = count * n *
                         (mx_native_ ? cuda::mxfp8_scale_cols(k) : cuda::fp8_row_scale_cols(k));
  mem_.emplace_back(static_cast<size_t>(codes));
  Fp8Mat m;
  m.q = mem_.back().as<uint8_t>();
  if (mx_native_) {
    mem_.emplace_back(static_cast<size_t>(scales));
    m.e = mem_.back().as<uint8_t>();
  } else {
    mem_.emplace_back(static_cast<size_t>(scales) * sizeof(float));
    m.s = mem_.back().as<float>();
  }
  allocs_.push_back({m, codes, scales, out});
  return m;
}

int64_t Fp8Linears::bytes() const {
  int64_t b = 0;
  for (const DeviceMem& d : mem_) b += static_cast<int64_t>(d.size());
  return b;
}

void Fp8Linears::upload(const WeightReader& wr, Uploader& up, const Fp8Mat& dst, int64_t row0,
                        const std::string& name, int64_t rows, int64_t cols, IndexRange rr,
                        IndexRange cr) const {
  const int64_t w = cr.size(), kb = cuda::fp8_row_scale_cols(w);
  std::vector<uint8_t> q(static_cast<size_t>(rr.size() * w));
  if (dst.e != nullptr) {
    const int64_t ke = cuda::mxfp8_scale_cols(w);
    std::vector<uint8_t> e8(static_cast<size_t>(rr.size() * ke));
    read_mxfp8_for_gpu(wr, name, rows, cols, rr, cr, q.data(), e8.data());
    up.put(dst.q + row0 * w, q.data(), q.size());
    up.put(dst.e + row0 * ke, e8.data(), e8.size());
    return;
  }
  std::vector<float> sc(static_cast<size_t>(rr.size() * kb));
  if (wr.is_quantized(name)) {
    wr.read_fp8_codes(name, rows, cols, rr, cr, q.data(), sc.data());
  } else {
    // Quantized here, per 128x128 block of the slice (the scales expanded to one per row).
    std::vector<float> f(static_cast<size_t>(rr.size() * w));
    wr.read(name, rows, cols, rr, cr, f.data());
    const int64_t rb = (rr.size() + 127) / 128;
    std::vector<float> block(static_cast<size_t>(rb * kb));
    quantize_fp8_block(f.data(), rr.size(), w, q.data(), block.data());
    for (int64_t r = 0; r < rr.size(); ++r) {
      std::copy_n(block.begin() + (r / 128) * kb, kb, sc.begin() + r * kb);
    }
  }
  up.put(dst.q + row0 * w, q.data(), q.size());
  up.put(dst.s + row0 * kb, sc.data(), sc.size() * sizeof(float));
}

void Fp8Linears::zero_rows(Uploader& up, const Fp8Mat& dst, int64_t row0, int64_t count,
                           int64_t k) const {
  if (count <= 0) return;
  TANDEM_CHECK(dst.s != nullptr, "Fp8Linears::zero_rows: block-FP8 weights only");
  const std::vector<uint8_t> q(static_cast<size_t>(count * k), 0);
  const int64_t kb = cuda::fp8_row_scale_cols(k);
  const std::vector<float> sc(static_cast<size_t>(count * kb), 1.0f);
  up.put(dst.q + row0 * k, q.data(), q.size());
  up.put(dst.s + row0 * kb, sc.data(), sc.size() * sizeof(float));
}

void Fp8Linears::random_fill(uint64_t& key, float a, cudaStream_t stream) const {
  for (const Alloc& f : allocs_) {
    cuda::random_fill_fp8(f.m.q, f.codes, ++key, stream);
    const float sc = f.out ? 1e-3f * a : a;
    if (f.m.e != nullptr) {  // native MXFP8: the power of two nearest the scale
      const int code = std::clamp(127 + static_cast<int>(std::lround(std::log2(sc))),
                                  cuda::kMxfp8MinCode, cuda::kMxfp8MaxCode);
      TANDEM_CUDA_CHECK(cudaMemsetAsync(f.m.e, code, static_cast<size_t>(f.scales), stream));
    } else {
      cuda::fill_f32(f.m.s, f.scales, sc, stream);
    }
  }
}

void Fp8Linears::prepare(int64_t max_nk, int64_t t_cap, int64_t max_k, bool fp8_act) {
  fp8_act_ = fp8_act;
  if (max_nk > 0) dq_ = DeviceMem(static_cast<size_t>(max_nk) * sizeof(cuda::bf16));
  if (max_nk > 0 && fp8_act && !mx_native_ && t_cap >= kLtMinRows) {
    lt_ = std::make_unique<Fp8DenseLt>(t_cap, max_k);
  }
}

void Fp8Linears::run(const cuda::bf16* x, const cuda::bf16* w, const Fp8Mat& w8, cuda::bf16* y,
                     int64_t m, int64_t n, int64_t k, cuda::GemmLt& gemm, cudaStream_t stream) {
  if (!w8) {
    gemm.run({x, w, y, m, n, k}, stream);
    return;
  }
  if (m == 0) return;
  if (m <= cuda::kFp8GemvMaxM) {
    cuda::Fp8GemvParams gp{x, w8.q, w8.s, y, m, n, k};
    gp.w_e8m0 = w8.e;
    cuda::fp8_gemv_launch(gp, stream);
    return;
  }
  // W8A8 at prefill sizes: cuBLASLt's block-scaled FP8 GEMM. Between the gemv's rows and
  // kLtMinRows the dequantized bf16 GEMM stays (measured faster than the W8A8 grouped GEMM as
  // one dense expert: bench_fp8_linear, docs/perf.md).
  if (fp8_act_ && m >= kLtMinRows && lt_ && lt_->run(x, w8.q, w8.s, y, m, n, k, stream)) return;
  // Above the gemv's m: dequantized into the scratch, then the bf16 GEMM (measured faster than
  // the W8A16 grouped GEMM as one dense expert from m = 32 on: bench_fp8_linear).
  TANDEM_CHECK(static_cast<size_t>(n * k) * sizeof(cuda::bf16) <= dq_.size(),
               "Fp8Linears::run: the scratch holds ", dq_.size() / sizeof(cuda::bf16),
               " elements, not ", n * k, " (prepare() first)");
  if (w8.e != nullptr) {
    cuda::mxfp8_dequantize_launch(w8.q, w8.e, n, k, dq_.as<cuda::bf16>(), stream);
  } else {
    cuda::fp8_dequantize_launch(w8.q, w8.s, n, k, dq_.as<cuda::bf16>(), stream);
  }
  gemm.run({x, dq_.as<cuda::bf16>(), y, m, n, k}, stream);
}

}  // namespace tandem::cuda_model
