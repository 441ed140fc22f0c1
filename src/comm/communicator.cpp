#include "comm/communicator.h"

#include "core/error.h"

namespace tandem::comm {

void Communicator::all_to_all(const void* in, void* out, int64_t count, DType dtype) {
  std::vector<int64_t> counts(static_cast<size_t>(world_size()), count);
  all_to_all_v(in, counts, out, counts, dtype);
}

void Communicator::send_blob(std::span<const uint8_t> blob, int peer, uint32_t tag) {
  const int64_t size = static_cast<int64_t>(blob.size());
  send(&size, sizeof(size), peer, tag);
  if (size > 0) send(blob.data(), size, peer, tag);
}

std::vector<uint8_t> Communicator::recv_blob(int peer, uint32_t tag) {
  int64_t size = 0;
  recv(&size, sizeof(size), peer, tag);
  TANDEM_CHECK(size >= 0, "bad blob size ", size, " from rank ", peer);
  std::vector<uint8_t> blob(static_cast<size_t>(size));
  if (size > 0) recv(blob.data(), size, peer, tag);
  return blob;
}

namespace {
template <typename T>
void add_typed(void* dst, const void* src, int64_t n) {
  T* d = static_cast<T*>(dst);
  const T* s = static_cast<const T*>(src);
  for (int64_t i = 0; i < n; ++i) d[i] += s[i];
}
}  // namespace

void add_into(void* dst, const void* src, int64_t n, DType dtype) {
  switch (dtype) {
    case DType::kF32: return add_typed<float>(dst, src, n);
    case DType::kI32: return add_typed<int32_t>(dst, src, n);
    case DType::kI64: return add_typed<int64_t>(dst, src, n);
    default:
      TANDEM_THROW(kUnsupported, "all_reduce_sum: unsupported dtype ", dtype_name(dtype),
                   " (f32, i32, i64 only)");
  }
}

}  // namespace tandem::comm
