#include "transfer/kv_pack.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace tandem::transfer {

namespace {

void check_ranges(const KvGeometry& g, int64_t layer, std::span<const int32_t> pages,
                  int64_t head_offset, int64_t num_heads, int64_t token_begin, int64_t token_end) {
  TANDEM_CHECK(layer >= 0 && layer < g.num_layers, "layer ", layer, " of ", g.num_layers);
  TANDEM_CHECK(head_offset >= 0 && num_heads >= 0 && head_offset + num_heads <= g.num_kv_heads,
               "heads [", head_offset, ", ", head_offset + num_heads, ") of ", g.num_kv_heads);
  TANDEM_CHECK(token_begin >= 0 && token_begin <= token_end &&
                   static_cast<int64_t>(pages.size()) * g.page_size >= token_end,
               pages.size(), " pages of ", g.page_size, " tokens cannot hold tokens [", token_begin,
               ", ", token_end, ")");
}

// Calls fn(pool_offset, packed_offset, floats) for each contiguous run of rows.
template <typename Fn>
void for_each_run(const KvGeometry& g, std::span<const int32_t> pages, int64_t head_offset,
                  int64_t num_heads, int64_t token_begin, int64_t token_end, Fn&& fn) {
  const int64_t d = g.head_dim, p = g.page_size, n = token_end - token_begin;
  for (int64_t kv = 0; kv < 2; ++kv) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t packed_base = (kv * num_heads + h) * n * d;
      for (int64_t t = token_begin; t < token_end;) {
        const int64_t page = pages[static_cast<size_t>(t / p)];
        TANDEM_CHECK(page >= 0 && page < g.num_pages, "page id ", page, " of ", g.num_pages);
        const int64_t slot = t % p;
        const int64_t rows = std::min(p - slot, token_end - t);
        const int64_t pool_off =
            page * g.page_elems() + ((kv * g.num_kv_heads + head_offset + h) * p + slot) * d;
        fn(pool_off, packed_base + (t - token_begin) * d, rows * d);
        t += rows;
      }
    }
  }
}

}  // namespace

void pack_layer(const KvCache& cache, int64_t layer, std::span<const int32_t> pages,
                int64_t head_offset, int64_t num_heads, int64_t token_begin, int64_t token_end,
                float* out) {
  const KvGeometry& g = cache.geometry();
  check_ranges(g, layer, pages, head_offset, num_heads, token_begin, token_end);
  const float* pool = cache.layer(layer);
  for_each_run(g, pages, head_offset, num_heads, token_begin, token_end,
               [&](int64_t pool_off, int64_t packed_off, int64_t n) {
                 std::memcpy(out + packed_off, pool + pool_off, static_cast<size_t>(n) * 4);
               });
}

void unpack_layer(const float* in, KvCache& cache, int64_t layer, std::span<const int32_t> pages,
                  int64_t head_offset, int64_t num_heads, int64_t token_begin, int64_t token_end) {
  const KvGeometry& g = cache.geometry();
  check_ranges(g, layer, pages, head_offset, num_heads, token_begin, token_end);
  float* pool = cache.layer(layer);
  for_each_run(g, pages, head_offset, num_heads, token_begin, token_end,
               [&](int64_t pool_off, int64_t packed_off, int64_t n) {
                 std::memcpy(pool + pool_off, in + packed_off, static_cast<size_t>(n) * 4);
               });
}

}  // namespace tandem::transfer
