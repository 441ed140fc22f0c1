// An NCCL communicator bootstrapped through the group's TcpStore (rank 0 makes the
// ncclUniqueId and publishes it). Used for large messages, fallbacks and baselines.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <string_view>

#include "comm/tcp_store.h"
#include "core/dtype.h"

namespace tandem::comm {

/// NCCL's data type for a Tandem dtype; throws kUnsupported for types NCCL lacks.
ncclDataType_t nccl_dtype(DType dtype);

class NcclComm {
 public:
  /// Collective: every rank calls it with the same key. The current CUDA device must be set.
  /// Forces NCCL_NVLS_ENABLE=0 first (NVLink multicast is never used here).
  NcclComm(TcpStore& store, std::string_view key);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  /// Sum all-reduce of count elements; input may equal output. Capturable in CUDA graphs.
  void all_reduce(void const* input, void* output, size_t count, DType dtype, cudaStream_t stream);

  ncclComm_t get() const { return comm_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
};

/// The NCCL library's version at run time, e.g. 22803 for 2.28.3.
int nccl_runtime_version();

}  // namespace tandem::comm
