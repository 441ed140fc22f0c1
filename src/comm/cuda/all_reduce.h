// Launch functions of the custom all-reduce kernels (protocol: all_reduce_params.h; device
// code: all_reduce_kernels.cuh). Framework-free: a params struct in, a stream.
#pragma once

#include <cuda_runtime_api.h>

#include "comm/cuda/all_reduce_params.h"
#include "core/dtype.h"

namespace tandem::comm::cuda {

/// How many blocks of `threads` threads of this kernel fit on the device at once (all blocks
/// of a launch must be resident: they spin on each other across GPUs).
int all_reduce_max_resident_blocks(AllReduceKernel kind, DType dtype, int world_size,
                                   bool registered, int threads);

/// Enqueues the all-reduce on stream. Pointers 16-byte aligned; dtype kBF16 or kF32;
/// world_size 2..16 (throws kUnsupported otherwise). shape from all_reduce_shape().
void all_reduce_launch(AllReduceParams const& params, DType dtype, AllReduceKernel kind,
                       bool registered, AllReduceShape shape, cudaStream_t stream);

}  // namespace tandem::comm::cuda
