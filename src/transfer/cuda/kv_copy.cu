#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "transfer/cuda/kv_copy.h"

namespace tandem::transfer::cuda {

namespace {

__device__ __host__ inline int64_t pool_index(int64_t page, int kv, int64_t head, int64_t slot,
                                              int64_t heads, int64_t page_size, int64_t head_dim) {
  return (((page * 2 + kv) * heads + head) * page_size + slot) * head_dim;
}

// One thread per 16 bytes; consecutive threads walk consecutive tokens of one (k|v, head), so
// reads and writes stay contiguous inside a page.
__global__ void kv_copy_kernel(KvCopyParams p) {
  const int64_t vec_per_row = p.head_dim / 8;
  const int64_t ntok = p.token_end - p.token_begin;
  const int64_t total = ntok * 2 * p.num_heads * vec_per_row;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t v = i % vec_per_row;
    const int64_t r = i / vec_per_row;
    const int64_t tok = p.token_begin + r % ntok;
    const int64_t kvh = r / ntok;
    const int64_t h = kvh % p.num_heads;
    const int kv = static_cast<int>(kvh / p.num_heads);
    const int64_t sp = p.src_table[tok / p.src_page_size], dp = p.dst_table[tok / p.dst_page_size];
    const int64_t s = pool_index(sp, kv, p.src_head_offset + h, tok % p.src_page_size, p.src_heads,
                                 p.src_page_size, p.head_dim);
    const int64_t d = pool_index(dp, kv, p.dst_head_offset + h, tok % p.dst_page_size, p.dst_heads,
                                 p.dst_page_size, p.head_dim);
    reinterpret_cast<uint4*>(p.dst + d)[v] = reinterpret_cast<const uint4*>(p.src + s)[v];
  }
}

void check(const KvCopyParams& p) {
  TANDEM_CHECK_KIND(kInvalidArgument, p.head_dim > 0 && p.head_dim % 8 == 0, "kv_copy: head_dim ",
                    p.head_dim, " is not a multiple of 8");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    p.num_heads > 0 && p.src_head_offset >= 0 && p.dst_head_offset >= 0 &&
                        p.src_head_offset + p.num_heads <= p.src_heads &&
                        p.dst_head_offset + p.num_heads <= p.dst_heads,
                    "kv_copy: heads [", p.src_head_offset, ", +", p.num_heads, ") of ", p.src_heads,
                    " -> [", p.dst_head_offset, ", +", p.num_heads, ") of ", p.dst_heads);
  TANDEM_CHECK_KIND(kInvalidArgument,
                    p.token_begin >= 0 && p.token_begin <= p.token_end && p.src_page_size > 0 &&
                        p.dst_page_size > 0,
                    "kv_copy: bad token range or page size");
}

}  // namespace

void kv_copy_launch(const KvCopyParams& p, void* stream) {
  check(p);
  const int64_t total = (p.token_end - p.token_begin) * 2 * p.num_heads * (p.head_dim / 8);
  if (total == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 132 * 16);
  kv_copy_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      p);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void kv_copy_reference(const KvCopyParams& p) {
  check(p);
  for (int64_t tok = p.token_begin; tok < p.token_end; ++tok) {
    const int64_t sp = p.src_table[tok / p.src_page_size], dp = p.dst_table[tok / p.dst_page_size];
    for (int kv = 0; kv < 2; ++kv) {
      for (int64_t h = 0; h < p.num_heads; ++h) {
        const int64_t s = pool_index(sp, kv, p.src_head_offset + h, tok % p.src_page_size,
                                     p.src_heads, p.src_page_size, p.head_dim);
        const int64_t d = pool_index(dp, kv, p.dst_head_offset + h, tok % p.dst_page_size,
                                     p.dst_heads, p.dst_page_size, p.head_dim);
        std::copy(p.src + s, p.src + s + p.head_dim, p.dst + d);
      }
    }
  }
}

}  // namespace tandem::transfer::cuda
