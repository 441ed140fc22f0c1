// Dense GEMM through cuBLASLt: y = alpha * x W^T + beta * y, bf16 in and out, fp32
// accumulation. W in the Hugging Face [out, in] layout.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace tandem::cuda {

using bf16 = __nv_bfloat16;

struct GemmParams {
  bf16 const* x;  // [m, k]
  bf16 const* w;  // [n, k]
  bf16* y;        // [m, n]
  int64_t m, n, k;
  float alpha = 1.0f;
  float beta = 0.0f;       // 0: y is only written
  float* y_f32 = nullptr;  // when set, the output is fp32 here ([m, n]) and y is unused
};

/// Owns a cuBLASLt handle and workspace on the current device and caches one matmul plan
/// (descriptors + heuristic algorithm) per (m, n, k, beta != 0, pointer alignment, out dtype). Not
/// thread safe; one per stream. run() is CUDA-graph capturable once the shape's plan exists (call
/// it once first, with pointers of the same alignment).
class GemmLt {
 public:
  explicit GemmLt(size_t workspace_bytes = size_t{32} << 20);
  ~GemmLt();
  GemmLt(GemmLt const&) = delete;
  GemmLt& operator=(GemmLt const&) = delete;

  /// The first call of a shape with m <= kTuneMaxM and beta 0 times the heuristic's candidate
  /// algorithms on its operands (synchronising the stream once) unless the stream is being
  /// captured; later calls and captures use the fastest. For m <= kGemvMaxM (gemv.h), beta 0
  /// and operands gemv_launch accepts, the gemv kernel is one more candidate.
  void run(GemmParams const& p, cudaStream_t stream);
  static constexpr int64_t kTuneMaxM = 256;
  /// Number of cached plans (shapes seen).
  size_t num_plans() const { return plans_.size(); }
  /// Number of cached plans whose tuning picked the gemv kernel.
  size_t num_gemv_plans() const;
  /// Whether plans created from now on may time (and pick) the gemv kernel (default true).
  void set_gemv_enabled(bool on) { gemv_enabled_ = on; }
  /// Batch-invariant mode (--deterministic): every run() goes to one kernel whose row results
  /// do not depend on m (moe_gemm.h's mma GEMM as one dense expert: a fixed k order, no
  /// split-K, no m-dependent algorithm), so a row's bits are the same alone or in any batch.
  /// beta must be 0; k % 8, n % 8 and 16-byte aligned x, w, y (kUnsupported otherwise).
  void set_batch_invariant(bool on) { batch_invariant_ = on; }
  bool batch_invariant() const { return batch_invariant_; }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    std::vector<cublasLtMatmulAlgo_t> candidates;  // heuristic's top picks, until timed
    bool tune_pending = false;    // the first call times the candidates (or not, if captured)
    bool gemv_candidate = false;  // the gemv kernel qualifies and is timed too
    bool use_gemv = false;        // the gemv kernel won the timing
  };
  // Times the candidates on the call's own operands and keeps the fastest.
  void tune(Plan& plan, GemmParams const& p, void* y, cudaStream_t stream);
  Plan& plan_for(int64_t m, int64_t n, int64_t k, bool beta, uint32_t align, bool f32_out);
  // The batch-invariant mode's GEMM (set_batch_invariant).
  void run_invariant(GemmParams const& p, cudaStream_t stream);
  bool gemv_enabled_ = true;
  bool batch_invariant_ = false;

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int64_t, int64_t, int64_t, bool, uint32_t, bool>, Plan> plans_;
};

}  // namespace tandem::cuda
