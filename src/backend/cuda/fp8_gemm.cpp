// cuBLASLt block-scaled FP8 GEMM with cached plans. See fp8_gemm.h.
#include "backend/cuda/fp8_gemm.h"

#include "backend/cuda/check.h"
#include "core/error.h"

namespace tandem::cuda {

std::vector<float> fp8_pack_weight_scales(const float* scale_inv, int64_t n, int64_t k) {
  const int64_t rows = (n + 127) / 128, cols = (k + 127) / 128, ld = fp8_weight_scale_ld(k);
  std::vector<float> out(static_cast<size_t>(rows * ld), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[static_cast<size_t>(r * ld + c)] = scale_inv[r * cols + c];
    }
  }
  return out;
}

Fp8GemmLt::Fp8GemmLt(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  TANDEM_CUBLAS_CHECK(cublasLtCreate(&handle_));
  TANDEM_CUDA_CHECK(cudaMalloc(&scale_placeholder_, 256));
  if (workspace_bytes_ > 0) TANDEM_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

Fp8GemmLt::~Fp8GemmLt() {
  // NOTE: destructors do not throw; errors here are ignored.
  for (auto& [key, plan] : plans_) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.op);
  }
  if (workspace_) cudaFree(workspace_);
  if (scale_placeholder_) cudaFree(scale_placeholder_);
  if (handle_) cublasLtDestroy(handle_);
}

// Row-major y[m, n] = x[m, k] W[n, k]^T in cuBLASLt's column-major view ("TN", as gemm.cpp):
// A = W as [k, n] (ld k) transposed with the 128x128 block scales, B = x as [k, m_pad] (ld k)
// with the 1x128 scales, C = D = y as [n, m_pad] (ld n).
Fp8GemmLt::Plan& Fp8GemmLt::plan_for(int64_t m_pad, int64_t n, int64_t k) {
  auto key = std::make_tuple(m_pad, n, k);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan plan;
  auto destroy = [&] {
    if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
    if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
    if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
    if (plan.op) cublasLtMatmulDescDestroy(plan.op);
  };
  cublasStatus_t st = cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  const cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, size_t size) {
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulDescSetAttribute(plan.op, attr, v, size);
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa));
  set(CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb));
  set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode));
  // NOTE: the heuristic answers INVALID_VALUE for block scales without scale pointers (seen on
  // the H200 with cuBLASLt 13.1): set placeholders; run() sets the real ones per call.
  const void* placeholder = scale_placeholder_;
  set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &placeholder, sizeof(placeholder));
  set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &placeholder, sizeof(placeholder));
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_8F_E4M3, static_cast<uint64_t>(k),
                                    static_cast<uint64_t>(n), k);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_8F_E4M3, static_cast<uint64_t>(k),
                                    static_cast<uint64_t>(m_pad), k);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_16BF, static_cast<uint64_t>(n),
                                    static_cast<uint64_t>(m_pad), n);
  }
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t result = {};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceCreate(&pref);
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &workspace_bytes_, sizeof(workspace_bytes_));
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle_, plan.op, plan.a, plan.b, plan.c, plan.c, pref, 1,
                                        &result, &found);
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy();
    TANDEM_THROW(kUnsupported, "fp8 gemm: no cuBLASLt block-scaled FP8 algorithm for m ", m_pad,
                 " n ", n, " k ", k, " (status ", static_cast<int>(st),
                 "; needs Hopper and cuBLAS >= 12.9)");
  }
  plan.algo = result.algo;
  return plans_.emplace(key, plan).first->second;
}

void Fp8GemmLt::run(Fp8GemmParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument, p.m >= 0 && p.n > 0 && p.k > 0, "fp8 gemm: bad sizes m ", p.m,
                    " n ", p.n, " k ", p.k);
  TANDEM_CHECK_KIND(kUnsupported, p.k % 128 == 0 && p.n % 16 == 0, "fp8 gemm: k (", p.k,
                    ") must be a multiple of 128 and n (", p.n, ") of 16");
  if (p.m == 0) return;
  const int64_t m_pad = fp8_pad_m(p.m);
  Plan& plan = plan_for(m_pad, p.n, p.k);
  // The scale pointers change per call: descriptor attributes, set on the host (capturable).
  const void* a_scale = p.w_scale;
  const void* b_scale = p.x_scale;
  TANDEM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                     &a_scale, sizeof(a_scale)));
  TANDEM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                     &b_scale, sizeof(b_scale)));
  const float alpha = 1.0f, beta = 0.0f;
  TANDEM_CUBLAS_CHECK(cublasLtMatmul(handle_, plan.op, &alpha, p.w, plan.a, p.x, plan.b, &beta, p.y,
                                     plan.c, p.y, plan.c, &plan.algo, workspace_, workspace_bytes_,
                                     stream));
}

}  // namespace tandem::cuda
