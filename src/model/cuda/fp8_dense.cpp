#include "model/cuda/fp8_dense.h"

#include <vector>

#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm.h"
#include "core/error.h"

namespace tandem::cuda_model {

Fp8DenseLt::Fp8DenseLt(int64_t max_rows, int64_t max_k)
    : max_rows_(max_rows),
      max_k_(max_k),
      lt_(std::make_unique<cuda::Fp8GemmLt>()),
      xq_(static_cast<size_t>(max_rows * max_k)),
      xs_(static_cast<size_t>(max_rows * cuda::fp8_row_scale_cols(max_k)) * sizeof(float)) {}

Fp8DenseLt::Scales const& Fp8DenseLt::scales_for(const uint8_t* q, const float* row_scale,
                                                 int64_t n, int64_t k, cudaStream_t stream) {
  auto it = scales_.find(q);
  if (it != scales_.end()) return it->second;
  Scales& s = scales_[q];
  const int64_t kb = cuda::fp8_row_scale_cols(k), blocks = (n + 127) / 128;
  std::vector<float> rows(static_cast<size_t>(n * kb));
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(rows.data(), row_scale, rows.size() * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  // One value per 128-row block (the checkpoint's blocks, not cut by a shard boundary).
  std::vector<float> block(static_cast<size_t>(blocks * kb));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < kb; ++c) {
      const float v = rows[static_cast<size_t>(r * kb + c)];
      float& b = block[static_cast<size_t>((r / 128) * kb + c)];
      if (r % 128 == 0) {
        b = v;
      } else if (v != b) {
        return s;  // not block-uniform: ok stays false
      }
    }
  }
  const std::vector<float> packed = cuda::fp8_pack_weight_scales(block.data(), n, k);
  s.packed = DeviceMem(packed.size() * sizeof(float));
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(s.packed.as<float>(), packed.data(),
                                    packed.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));  // `packed` leaves scope
  s.ok = true;
  return s;
}

bool Fp8DenseLt::run(const __nv_bfloat16* x, const uint8_t* q, const float* row_scale,
                     __nv_bfloat16* y, int64_t m, int64_t n, int64_t k, cudaStream_t stream) {
  const int64_t m4 = m / 4 * 4;
  if (!lt_ok_ || k % 128 != 0 || n % 16 != 0 || m4 == 0 || m > max_rows_ || k > max_k_) {
    return false;
  }
  if (scales_.find(q) == scales_.end()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TANDEM_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) return false;
  }
  Scales const& s = scales_for(q, row_scale, n, k, stream);
  if (!s.ok) return false;
  // m4 rows: fp8_pad_m(m4) == m4, so the quantizer and the GEMM touch exactly those rows.
  cuda::fp8_quantize_act_launch({x, xq_.as<uint8_t>(), xs_.as<float>(), m4, k}, stream);
  try {
    lt_->run({xq_.as<uint8_t>(), xs_.as<float>(), q, s.packed.as<float>(), y, m4, n, k}, stream);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kUnsupported) throw;
    lt_ok_ = false;  // no block-scaled algorithm here (not Hopper, old cuBLAS): never again
    return false;
  }
  if (m > m4) {  // the last rows: the W8A8 grouped GEMM as one dense expert
    cuda::MoeGemmParams p{x + m4 * k, nullptr, y + m4 * n, nullptr, m - m4, n, k, 1};
    p.w_fp8 = q;
    p.w_scale = row_scale;
    p.fp8_activations = true;
    cuda::moe_gemm_launch(p, stream);
  }
  return true;
}

}  // namespace tandem::cuda_model
