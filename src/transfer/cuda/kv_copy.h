// Copies a head run of a request's KV pages from one HND pool into another (device memory,
// possibly a peer's: CUDA IPC), token by token, so the two sides may differ in page size, in
// the heads they hold and in page ids: the device path of the transfer engine's head split /
// merge (transfer/head_map.h). Framework-free: a params struct in, a stream.
// CPU reference: kv_copy_reference (same params over host memory).
#pragma once

#include <cstdint>

namespace tandem::transfer::cuda {

/// One layer's copy. Pools are bf16 [num_pages, 2 (k, v), heads, page_size, head_dim].
struct KvCopyParams {
  const uint16_t* src;       // source layer pool (bf16 bits)
  uint16_t* dst;             // destination layer pool (bf16 bits)
  const int32_t* src_table;  // [ceil(token_end / src_page_size)] source page of each page slot
  const int32_t* dst_table;  // [ceil(token_end / dst_page_size)]
  int64_t token_begin = 0;   // prompt positions [token_begin, token_end) move
  int64_t token_end = 0;
  int32_t src_heads = 0;        // heads of the source pool
  int32_t dst_heads = 0;        // heads of the destination pool
  int32_t src_head_offset = 0;  // source pool index of the first head moved
  int32_t dst_head_offset = 0;  // destination pool index of the first head moved
  int32_t num_heads = 0;        // heads moved
  int32_t src_page_size = 0;
  int32_t dst_page_size = 0;
  int32_t head_dim = 0;  // multiple of 8 (16-byte rows)
};

/// Launches the copy on `stream` (a cudaStream_t). Throws kInvalidArgument for a head_dim that
/// is not a multiple of 8 or an empty / inverted range of heads.
void kv_copy_launch(const KvCopyParams& p, void* stream);

/// The same copy on host memory (the test's reference).
void kv_copy_reference(const KvCopyParams& p);

}  // namespace tandem::transfer::cuda
