// Dispatch and launch of the all-reduce kernels (all_reduce_kernels.cuh).
#include "comm/cuda/all_reduce.h"
#include "comm/cuda/all_reduce_kernels.cuh"
#include "comm/cuda/check.h"

namespace tandem::comm::cuda {

namespace {

using detail::one_shot_kernel;
using detail::two_shot_kernel;

// ---- dispatch -------------------------------------------------------------------------------

using KernelFn = void (*)(const AllReduceParams);

template <typename T, int N>
KernelFn pick(AllReduceKernel kind, bool registered) {
  if (kind == AllReduceKernel::kOneShot)
    return registered ? one_shot_kernel<T, N, true> : one_shot_kernel<T, N, false>;
  return registered ? two_shot_kernel<T, N, true> : two_shot_kernel<T, N, false>;
}

template <typename T>
KernelFn pick_n(AllReduceKernel kind, bool registered, int n) {
  switch (n) {
    case 2: return pick<T, 2>(kind, registered);
    case 3: return pick<T, 3>(kind, registered);
    case 4: return pick<T, 4>(kind, registered);
    case 5: return pick<T, 5>(kind, registered);
    case 6: return pick<T, 6>(kind, registered);
    case 7: return pick<T, 7>(kind, registered);
    case 8: return pick<T, 8>(kind, registered);
    case 9: return pick<T, 9>(kind, registered);
    case 10: return pick<T, 10>(kind, registered);
    case 11: return pick<T, 11>(kind, registered);
    case 12: return pick<T, 12>(kind, registered);
    case 13: return pick<T, 13>(kind, registered);
    case 14: return pick<T, 14>(kind, registered);
    case 15: return pick<T, 15>(kind, registered);
    case 16: return pick<T, 16>(kind, registered);
    default: TANDEM_THROW(kUnsupported, "all-reduce: unsupported world_size: ", n, " (2..16)");
  }
}

KernelFn pick_kernel(AllReduceKernel kind, DType dtype, bool registered, int n) {
  switch (dtype) {
    case DType::kBF16: return pick_n<__nv_bfloat16>(kind, registered, n);
    case DType::kF32: return pick_n<float>(kind, registered, n);
    default:
      TANDEM_THROW(kUnsupported, "all-reduce: unsupported dtype: ", dtype_name(dtype),
                   " (bf16, f32)");
  }
}

}  // namespace

int all_reduce_max_resident_blocks(AllReduceKernel kind, DType dtype, int world_size,
                                   bool registered, int threads) {
  KernelFn fn = pick_kernel(kind, dtype, registered, world_size);
  int device = 0;
  TANDEM_CUDA_CHECK(cudaGetDevice(&device));
  int sms = 0;
  TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int per_sm = 0;
  TANDEM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, reinterpret_cast<void const*>(fn), threads, 0));
  return per_sm * sms;
}

void all_reduce_launch(AllReduceParams const& params, DType dtype, AllReduceKernel kind,
                       bool registered, AllReduceShape shape, cudaStream_t stream) {
  KernelFn fn = pick_kernel(kind, dtype, registered, params.world_size);
  fn<<<shape.blocks, shape.threads, 0, stream>>>(params);
  TANDEM_CUDA_CHECK_LAUNCH();
}

}  // namespace tandem::comm::cuda
