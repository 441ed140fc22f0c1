// Random bf16 weights generated on the device, for benchmarks at real shapes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::cuda {

/// out[i] = bf16(center + half_width * (2 u - 1)), u uniform in [0, 1) from a hash of
/// (seed, i): deterministic, independent of the launch shape.
void random_fill_bf16(void* out, int64_t n, uint64_t seed, float center, float half_width,
                      cudaStream_t stream);

}  // namespace tandem::cuda
