#include "comm/cuda/nccl_comm.h"

#include <cstdio>
#include <cstring>
#include <string>

#include "comm/cuda/check.h"
#include "comm/local_launcher.h"

namespace tandem::comm {

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    default: TANDEM_THROW(kUnsupported, "NCCL: unsupported dtype: ", dtype_name(dtype));
  }
}

NcclComm::NcclComm(TcpStore& store, std::string_view key)
    : rank_(store.rank()), world_size_(store.world_size()) {
  disable_nvlink_multicast_env();
  ncclUniqueId id;
  const std::string id_key = std::string(key) + "/unique_id";
  if (rank_ == 0) {
    TANDEM_NCCL_CHECK(ncclGetUniqueId(&id));
    store.set(id_key, std::span(reinterpret_cast<const uint8_t*>(&id), sizeof(id)));
  } else {
    auto v = store.get(id_key);
    TANDEM_CHECK(v.size() == sizeof(id), "bad ncclUniqueId size ", v.size());
    std::memcpy(&id, v.data(), sizeof(id));
  }
  TANDEM_NCCL_CHECK(ncclCommInitRank(&comm_, world_size_, id, rank_));
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr) return;
  ncclResult_t r = ncclCommDestroy(comm_);
  if (r != ncclSuccess) std::fprintf(stderr, "ncclCommDestroy: %s\n", ncclGetErrorString(r));
}

void NcclComm::all_reduce(void const* input, void* output, size_t count, DType dtype,
                          cudaStream_t stream) {
  TANDEM_NCCL_CHECK(ncclAllReduce(input, output, count, nccl_dtype(dtype), ncclSum, comm_, stream));
}

int nccl_runtime_version() {
  int v = 0;
  TANDEM_NCCL_CHECK(ncclGetVersion(&v));
  return v;
}

}  // namespace tandem::comm
