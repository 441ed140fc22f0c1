#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda_check.h"
#include "core/error.h"
#include "transfer/cuda/kv_copy.h"

namespace tandem::transfer::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kBatch = 4;  // 16-byte loads in flight per thread before the stores

// One block per (source page slot, k|v, destination): the slot's tokens of every moved head.
// Within a head the source rows are contiguous; each destination row is found through its
// page table (page sizes may differ). 32-bit index math except the pool offsets.
__global__ void __launch_bounds__(kThreads) kv_copy_kernel(const __grid_constant__ KvCopyParams p) {
  const KvCopyDest& d = p.dests[blockIdx.z];
  const int sps = p.src_page_size, dps = d.dst_page_size, vpr = (p.head_dim * p.elem_bytes) >> 4;
  const int64_t slot = d.token_begin / sps + blockIdx.x;
  if (d.token_end <= d.token_begin || slot * sps >= d.token_end) return;  // (grid: longest dest)
  const int kv = static_cast<int>(blockIdx.y);
  const int t0 = static_cast<int>(max(slot * sps, d.token_begin));
  const int t1 = static_cast<int>(min((slot + 1) * sps, d.token_end));
  const int per_head = (t1 - t0) * vpr;
  const int total = per_head * d.num_heads;
  const int64_t sp = d.src_table[slot];
  const uint4* src = reinterpret_cast<const uint4*>(p.src) +
                     ((sp * 2 + kv) * p.src_heads + d.src_head_offset) * int64_t{sps} * vpr;
  const int first = t0 - static_cast<int>(slot) * sps;  // row of t0 in the source page
  for (int base = threadIdx.x; base < total; base += kThreads * kBatch) {
    uint4 v[kBatch];
    int idx[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      idx[j] = base + j * kThreads;
      if (idx[j] < total) {
        const int h = idx[j] / per_head, r = idx[j] - h * per_head;
        const int tl = r / vpr, c = r - tl * vpr;
        v[j] = src[(h * sps + first + tl) * vpr + c];
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (idx[j] < total) {
        const int h = idx[j] / per_head, r = idx[j] - h * per_head;
        const int tl = r / vpr, c = r - tl * vpr;
        const int t = t0 + tl;
        const int64_t dp = d.dst_table[t / dps];
        uint4* dst =
            reinterpret_cast<uint4*>(d.dst) +
            (((dp * 2 + kv) * d.dst_heads + d.dst_head_offset + h) * int64_t{dps} + t % dps) * vpr;
        dst[c] = v[j];
      }
    }
  }
}

void check(const KvCopyParams& p) {
  TANDEM_CHECK_KIND(kInvalidArgument, p.elem_bytes == 1 || p.elem_bytes == 2,
                    "kv_copy: elements of ", p.elem_bytes, " bytes (1 or 2)");
  TANDEM_CHECK_KIND(kInvalidArgument, p.head_dim > 0 && p.head_dim * p.elem_bytes % 16 == 0,
                    "kv_copy: head_dim ", p.head_dim, " of ", p.elem_bytes,
                    "-byte elements is not a multiple of 16 bytes");
  TANDEM_CHECK_KIND(kInvalidArgument, p.num_dests >= 0 && p.num_dests <= kKvCopyMaxDests,
                    "kv_copy: ", p.num_dests, " destinations (at most ", kKvCopyMaxDests, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, p.src_page_size > 0, "kv_copy: bad source page size");
  for (int i = 0; i < p.num_dests; ++i) {
    const KvCopyDest& d = p.dests[i];
    TANDEM_CHECK_KIND(kInvalidArgument, d.token_begin >= 0 && d.token_begin <= d.token_end,
                      "kv_copy: bad token range [", d.token_begin, ", ", d.token_end, ")");
    TANDEM_CHECK_KIND(kInvalidArgument,
                      d.num_heads > 0 && d.src_head_offset >= 0 && d.dst_head_offset >= 0 &&
                          d.src_head_offset + d.num_heads <= p.src_heads &&
                          d.dst_head_offset + d.num_heads <= d.dst_heads && d.dst_page_size > 0,
                      "kv_copy: heads [", d.src_head_offset, ", +", d.num_heads, ") of ",
                      p.src_heads, " -> [", d.dst_head_offset, ", +", d.num_heads, ") of ",
                      d.dst_heads);
  }
}

}  // namespace

void kv_copy_launch(const KvCopyParams& p, void* stream) {
  check(p);
  int64_t slots = 0;
  for (int i = 0; i < p.num_dests; ++i) {
    const KvCopyDest& d = p.dests[i];
    if (d.token_end > d.token_begin) {
      slots = std::max(slots,
                       (d.token_end - 1) / p.src_page_size - d.token_begin / p.src_page_size + 1);
    }
  }
  if (slots == 0) return;
  const dim3 grid(static_cast<unsigned>(slots), 2, static_cast<unsigned>(p.num_dests));
  kv_copy_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void kv_copy_reference(const KvCopyParams& p) {
  check(p);
  const int64_t hd = p.head_dim * p.elem_bytes;  // bytes of a row
  const auto* src = reinterpret_cast<const uint8_t*>(p.src);
  for (int i = 0; i < p.num_dests; ++i) {
    const KvCopyDest& d = p.dests[i];
    for (int64_t tok = d.token_begin; tok < d.token_end; ++tok) {
      const int64_t sp = d.src_table[tok / p.src_page_size],
                    dp = d.dst_table[tok / d.dst_page_size];
      for (int kv = 0; kv < 2; ++kv) {
        for (int64_t h = 0; h < d.num_heads; ++h) {
          const int64_t s =
              (((sp * 2 + kv) * p.src_heads + d.src_head_offset + h) * p.src_page_size +
               tok % p.src_page_size) *
              hd;
          const int64_t o =
              (((dp * 2 + kv) * d.dst_heads + d.dst_head_offset + h) * d.dst_page_size +
               tok % d.dst_page_size) *
              hd;
          std::copy(src + s, src + s + hd, reinterpret_cast<uint8_t*>(d.dst) + o);
        }
      }
    }
  }
}

}  // namespace tandem::transfer::cuda
