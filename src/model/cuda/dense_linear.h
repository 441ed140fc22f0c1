// The dense linears the CUDA models keep in block FP8 (attention, DeltaNet, shared-expert and
// dense-MLP projections of block-FP8 checkpoints): their device memory, their upload (each rank
// its rows / columns), their random fill, and y = x W^T by the step's rows m:
//   m <= cuda::kFp8GemvMaxM (decode)   fp8_gemv: the E4M3 weight read once (W8A16);
//   m >= kLtMinRows with FP8 activations  cuBLASLt's block-scaled W8A8 GEMM (fp8_dense.h);
//   otherwise                          the weight dequantized into a bf16 scratch, then GemmLt.
// Shared by Qwen3MoeCuda and Qwen35MoeCuda (a linear without an FP8 copy runs GemmLt on its bf16
// weight). Host code.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/gemm.h"
#include "model/cuda/cuda_mem.h"
#include "model/cuda/fp8_dense.h"
#include "model/quant.h"
#include "model/shard.h"

namespace tandem::cuda_model {

/// One linear's FP8 weight (backend/cuda/fp8_linear.h): E4M3 codes [n, k] and row scales [n,
/// ceil(k / 128)], or native MXFP8's E8M0 codes [n, ceil(k / 32)] in place of the scales. Null
/// when the linear is bf16.
struct Fp8Mat {
  uint8_t* q = nullptr;
  float* s = nullptr;
  uint8_t* e = nullptr;
  explicit operator bool() const { return q != nullptr; }
};

class Fp8Linears {
 public:
  /// Rows of W8A8 through cuBLASLt from here on (prefill); below, W8A16 (measured:
  /// bench_fp8_linear, docs/perf.md).
  static constexpr int64_t kLtMinRows = 512;

  /// mx_native: the weights keep MXFP8's per-32 E8M0 scales (W8A16 only).
  explicit Fp8Linears(bool mx_native = false) : mx_native_(mx_native) {}

  /// `count` matrices [n, k] back to back (one allocation each for codes and scales); out: an
  /// output projection (random_fill's smaller scale).
  Fp8Mat alloc(int64_t count, int64_t n, int64_t k, bool out);
  bool empty() const { return allocs_.empty(); }
  /// Matrices allocated (alloc calls).
  int64_t count() const { return static_cast<int64_t>(allocs_.size()); }
  /// Device bytes of every FP8 matrix (codes and scales).
  int64_t bytes() const;

  /// Rows rr x columns cr of the [rows, cols] tensor `name` into dst from its row `row0`: an
  /// F8_E4M3 tensor's codes and row scales as stored (WeightReader::read_fp8_codes, or its
  /// E8M0 codes for native MXFP8); a bf16 / fp32 one quantized here to E4M3 per 128x128 block
  /// of the slice (quantize_fp8_block), for a linear whose rows mix both (Qwen3.5's DeltaNet
  /// in_proj: its b / a rows are bf16 in an FP8 checkpoint).
  void upload(const WeightReader& wr, Uploader& up, const Fp8Mat& dst, int64_t row0,
              const std::string& name, int64_t rows, int64_t cols, IndexRange rr,
              IndexRange cr) const;
  /// Rows [row0, row0 + count) of dst ([.., k]) zero (padding rows: codes 0, scales 1).
  void zero_rows(Uploader& up, const Fp8Mat& dst, int64_t row0, int64_t count, int64_t k) const;

  /// Random weights (benchmarks): codes of U(-1, 1), the scale `a` (1e-3 a for an output
  /// projection); `key` advanced once per matrix, as the bf16 weights' fill does.
  void random_fill(uint64_t& key, float a, cudaStream_t stream) const;

  /// Before the first run(): the bf16 scratch for the largest n x k dequantized (max_nk
  /// elements; 0: none), and with fp8_act and t_cap >= kLtMinRows the cuBLASLt path for up to
  /// t_cap rows of up to max_k columns.
  void prepare(int64_t max_nk, int64_t t_cap, int64_t max_k, bool fp8_act);

  /// y[m, n] = x[m, k] W^T: w when w8 is null, else the FP8 weight by m (see the top).
  /// Asynchronous on `stream`, capturable (the cuBLASLt path declines a new weight inside a
  /// capture and falls back to the scratch). One scratch: calls on two streams must not
  /// overlap on the scratch path (m above the gemv's).
  void run(const cuda::bf16* x, const cuda::bf16* w, const Fp8Mat& w8, cuda::bf16* y, int64_t m,
           int64_t n, int64_t k, cuda::GemmLt& gemm, cudaStream_t stream);

 private:
  struct Alloc {
    Fp8Mat m;
    int64_t codes, scales;
    bool out;
  };
  bool mx_native_;
  bool fp8_act_ = false;
  std::vector<DeviceMem> mem_;
  std::vector<Alloc> allocs_;
  DeviceMem dq_;
  std::unique_ptr<Fp8DenseLt> lt_;
};

}  // namespace tandem::cuda_model
