#include "disagg/lockstep.h"

namespace tandem {

bool agree_any(comm::Communicator& comm, bool mine) {
  return sum_over_ranks(comm, mine ? 1 : 0) > 0;
}

int64_t sum_over_ranks(comm::Communicator& comm, int64_t mine) {
  comm.all_reduce_sum(&mine, 1, DType::kI64);
  return mine;
}

void broadcast_bytes(comm::Communicator& comm, std::vector<uint8_t>& bytes, int root) {
  int64_t n = static_cast<int64_t>(bytes.size());
  comm.broadcast(&n, 1, DType::kI64, root);
  // NOTE: sent as int32 words (no byte dtype in the communicator); the tail is padding.
  const int64_t words = (n + 3) / 4;
  bytes.resize(static_cast<size_t>(words * 4));
  if (words > 0) comm.broadcast(bytes.data(), words, DType::kI32, root);
  bytes.resize(static_cast<size_t>(n));
}

}  // namespace tandem
