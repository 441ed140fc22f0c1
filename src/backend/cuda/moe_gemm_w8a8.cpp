// MoeGemmW8A8 (moe_gemm_w8a8.h): checks, tile choice, the CPU reference. The kernels live in
// src/backend/cuda/cutlass/ (built only when the CUTLASS headers were fetched:
// TANDEM_HAS_CUTLASS_W8A8).
#include "backend/cuda/moe_gemm_w8a8.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "backend/cuda/check.h"
#include "core/dtype.h"
#include "core/error.h"

#if TANDEM_HAS_CUTLASS_W8A8
#include "backend/cuda/cutlass/w8a8_runner.h"
#endif

namespace tandem::cuda {

namespace w8a8_detail {
#if !TANDEM_HAS_CUTLASS_W8A8
class Runner {};
#endif
}  // namespace w8a8_detail

struct MoeGemmW8A8::Impl {
  std::unique_ptr<w8a8_detail::Runner> prefill, decode;
};

MoeGemmW8A8::MoeGemmW8A8() : impl_(std::make_unique<Impl>()) {}
MoeGemmW8A8::~MoeGemmW8A8() = default;

bool MoeGemmW8A8::supported() {
#if TANDEM_HAS_CUTLASS_W8A8
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

MoeGemmW8A8Tile moe_gemm_w8a8_pick_tile(int64_t max_rows, int64_t num_experts) {
  const int64_t e = num_experts > 0 ? num_experts : 1;
  return max_rows <= 32 * e ? MoeGemmW8A8Tile::kDecode : MoeGemmW8A8Tile::kPrefill;
}

void MoeGemmW8A8::prepare(int64_t num_experts) {
#if TANDEM_HAS_CUTLASS_W8A8
  TANDEM_CHECK_KIND(kUnsupported, supported(),
                    "moe_gemm_w8a8: needs an sm_90 (Hopper) device and a build with CUTLASS");
  if (!impl_->prefill) impl_->prefill = w8a8_detail::make_prefill_runner();
  if (!impl_->decode) impl_->decode = w8a8_detail::make_decode_runner();
  impl_->prefill->prepare(num_experts);
  impl_->decode->prepare(num_experts);
#else
  (void)num_experts;
  TANDEM_CHECK_KIND(kUnsupported, false,
                    "moe_gemm_w8a8: not built (the CUTLASS headers were not fetched at configure "
                    "time: scripts/fetch_flashinfer.sh)");
#endif
}

void MoeGemmW8A8::run(MoeGemmW8A8Params const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kUnsupported, p.k > 0 && p.k % 128 == 0, "moe_gemm_w8a8: k (", p.k,
                    ") must be a positive multiple of 128");
  TANDEM_CHECK_KIND(kUnsupported, p.n > 0 && p.n % 16 == 0, "moe_gemm_w8a8: n (", p.n,
                    ") must be a positive multiple of 16");
  TANDEM_CHECK_KIND(kInvalidArgument, p.num_experts >= 1, "moe_gemm_w8a8: num_experts (",
                    p.num_experts, ") must be >= 1");
  TANDEM_CHECK_KIND(kInvalidArgument, p.expert_offsets != nullptr || p.num_experts == 1,
                    "moe_gemm_w8a8: expert_offsets may be null only with num_experts 1");
  TANDEM_CHECK_KIND(kInvalidArgument, p.max_rows >= 0 && p.max_rows < (int64_t{1} << 31),
                    "moe_gemm_w8a8: max_rows (", p.max_rows, ") out of range");
  TANDEM_CHECK_KIND(kInvalidArgument, p.n < (int64_t{1} << 20) && p.k < (int64_t{1} << 20),
                    "moe_gemm_w8a8: n / k out of range");
  if (p.max_rows == 0) return;
  auto aligned = [](void const* ptr, uintptr_t a) {
    return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % a == 0;
  };
  TANDEM_CHECK_KIND(kInvalidArgument, aligned(p.x, 16), "moe_gemm_w8a8: x must be 16-byte aligned");
  TANDEM_CHECK_KIND(kInvalidArgument, aligned(p.w, 16), "moe_gemm_w8a8: w must be 16-byte aligned");
  TANDEM_CHECK_KIND(kInvalidArgument, aligned(p.y, 16), "moe_gemm_w8a8: y must be 16-byte aligned");
  TANDEM_CHECK_KIND(kInvalidArgument, aligned(p.x_scale, 4) && aligned(p.w_scale, 4),
                    "moe_gemm_w8a8: x_scale and w_scale must be set and 4-byte aligned");
#if TANDEM_HAS_CUTLASS_W8A8
  prepare(p.num_experts);
  MoeGemmW8A8Tile tile = p.tile;
  if (tile == MoeGemmW8A8Tile::kAuto) tile = moe_gemm_w8a8_pick_tile(p.max_rows, p.num_experts);
  (tile == MoeGemmW8A8Tile::kDecode ? impl_->decode : impl_->prefill)->run(p, stream);
#else
  (void)stream;
  prepare(p.num_experts);
#endif
}

void moe_gemm_w8a8_reference(uint8_t const* x, float const* x_scale, uint8_t const* w,
                             float const* w_scale, int32_t const* offsets, int64_t max_rows,
                             int64_t n, int64_t k, int64_t num_experts, __nv_bfloat16* y) {
  TANDEM_CHECK_KIND(kInvalidArgument, k % 128 == 0, "moe_gemm_w8a8_reference: k % 128 != 0");
  const int64_t kb = k / 128;
  std::vector<float> lut(256);
  for (int i = 0; i < 256; ++i) lut[i] = f8e4m3_to_f32(static_cast<uint8_t>(i));
  std::vector<float> xr(k);
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t r0 = offsets ? offsets[e] : 0;
    const int64_t r1 = offsets ? offsets[e + 1] : max_rows;
    uint8_t const* we = w + e * n * k;
    float const* se = w_scale + e * n * kb;
    for (int64_t r = r0; r < r1 && r < max_rows; ++r) {
      for (int64_t j = 0; j < k; ++j) xr[j] = lut[x[r * k + j]];
      for (int64_t i = 0; i < n; ++i) {
        float acc = 0.f;
        for (int64_t b = 0; b < kb; ++b) {
          float part = 0.f;
          for (int64_t j = b * 128; j < b * 128 + 128; ++j) part += xr[j] * lut[we[i * k + j]];
          acc += part * (x_scale[r * kb + b] * se[i * kb + b]);
        }
        const uint16_t h = f32_to_bf16(acc);
        std::memcpy(static_cast<void*>(&y[r * n + i]), &h, 2);
      }
    }
  }
}

}  // namespace tandem::cuda
