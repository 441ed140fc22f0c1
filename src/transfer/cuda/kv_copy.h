// Copies head runs of a request's KV pages from one HND pool into one or more others (device
// memory, possibly a peer's: CUDA IPC), token by token, so the sides may differ in page size,
// in the heads they hold and in page ids: the device path of the transfer engine's head split /
// merge (transfer/head_map.h). One launch serves up to kKvCopyMaxDests destinations (a split
// to several decode ranks, or the prompts of several requests, is one kernel per layer).
// Framework-free: a params struct in, a stream. CPU reference: kv_copy_reference (same params over
// host memory).
#pragma once

#include <cstdint>

namespace tandem::transfer::cuda {

constexpr int kKvCopyMaxDests = 8;

/// Where one destination's heads go, from which source pages and tokens. Pools are
/// [num_pages, 2 (k, v), heads, page_size, head_dim] of elem_bytes each (bf16; fp8 E4M3 codes:
/// opaque bytes, half the bytes a row).
struct KvCopyDest {
  const int32_t* src_table = nullptr;  // [ceil(token_end / src_page_size)] source page of a slot
  int64_t token_begin = 0;             // prompt positions [token_begin, token_end) move
  int64_t token_end = 0;
  uint16_t* dst = nullptr;             // destination layer pool (bf16 bits)
  const int32_t* dst_table = nullptr;  // [ceil(token_end / dst_page_size)] page of each slot
  int32_t dst_heads = 0;               // heads of the destination pool
  int32_t dst_head_offset = 0;         // destination pool index of the first head moved
  int32_t src_head_offset = 0;         // source pool index of the first head moved
  int32_t num_heads = 0;               // heads moved
  int32_t dst_page_size = 0;
};

/// One layer's copy to every destination (of one request or several: each destination has its
/// own source pages and tokens).
struct KvCopyParams {
  const uint16_t* src = nullptr;  // source layer pool (bf16 bits)
  int32_t src_heads = 0;          // heads of the source pool
  int32_t src_page_size = 0;
  int32_t head_dim = 0;  // head_dim * elem_bytes a multiple of 16 (16-byte rows)
  int32_t num_dests = 0;
  int32_t elem_bytes = 2;  // 2: bf16 (the pointers' uint16_t), 1: fp8
  KvCopyDest dests[kKvCopyMaxDests];
};

/// Launches the copy on `stream` (a cudaStream_t). Throws kInvalidArgument for rows that are not
/// a multiple of 16 bytes, a head range outside a pool, or more than kKvCopyMaxDests dests.
void kv_copy_launch(const KvCopyParams& p, void* stream);

/// The same copy on host memory (the test's reference).
void kv_copy_reference(const KvCopyParams& p);

}  // namespace tandem::transfer::cuda
