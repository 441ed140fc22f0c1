// Random bf16 weights generated on the device, for benchmarks at real shapes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

/// out[i] = bf16(center + half_width * (2 u - 1)), u uniform in [0, 1) from a hash of
/// (seed, i): deterministic, independent of the launch shape.
void random_fill_bf16(void* out, int64_t n, uint64_t seed, float center, float half_width,
                      cudaStream_t stream);

/// out[i] = e4m3(2 u - 1) (codes; u as random_fill_bf16's): the FP8 benchmark weights, with a
/// scale of the wanted half-width (fill_f32).
void random_fill_fp8(void* out, int64_t n, uint64_t seed, cudaStream_t stream);

/// out[i] = value (f32).
void fill_f32(float* out, int64_t n, float value, cudaStream_t stream);

}  // namespace tandem::cuda
