// Device-side random bf16 fill for real-shape benchmark models. See random_fill.h.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "core/cuda_check.h"
#include "core/error.h"
#include "model/cuda/random_fill.h"

namespace tandem::cuda {

namespace {

// splitmix64: a stateless hash of (seed, index) is enough for benchmark weights.
__device__ __forceinline__ uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void fill_kernel(__nv_bfloat16* out, int64_t n, uint64_t seed, float center,
                            float half_width) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const uint64_t h = mix(seed ^ mix(static_cast<uint64_t>(i)));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    out[i] = __float2bfloat16_rn(center + half_width * (2.0f * u - 1.0f));
  }
}

__global__ void fill_fp8_kernel(uint8_t* out, int64_t n, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const uint64_t h = mix(seed ^ mix(static_cast<uint64_t>(i)));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    out[i] = __nv_cvt_float_to_fp8(2.0f * u - 1.0f, __NV_SATFINITE, __NV_E4M3);
  }
}

__global__ void fill_f32_kernel(float* out, int64_t n, float value) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    out[i] = value;
  }
}

}  // namespace

void random_fill_fp8(void* out, int64_t n, uint64_t seed, cudaStream_t stream) {
  TANDEM_CHECK(n >= 0, "random_fill_fp8: negative size");
  if (n == 0) return;
  fill_fp8_kernel<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(out), n, seed);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void fill_f32(float* out, int64_t n, float value, cudaStream_t stream) {
  TANDEM_CHECK(n >= 0, "fill_f32: negative size");
  if (n == 0) return;
  fill_f32_kernel<<<1024, 256, 0, stream>>>(out, n, value);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void random_fill_bf16(void* out, int64_t n, uint64_t seed, float center, float half_width,
                      cudaStream_t stream) {
  TANDEM_CHECK(n >= 0, "random_fill_bf16: negative size");
  if (n == 0) return;
  fill_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(out), n, seed, center,
                                        half_width);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tandem::cuda
