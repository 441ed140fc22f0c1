// Copies between a request's paged HND KV (its block table) and the dense, page-size-free
// layout the transfer engine moves: one layer's head run over a token range as
//   [2 (k, v), num_heads, token_end - token_begin, head_dim] fp32.
// The two sides may use different page sizes: each side converts its own pages, so token
// ranges are re-paged in flight. Every copy is a run of whole rows (per head, per page).
#pragma once

#include <cstdint>
#include <span>

#include "kv/kv_cache.h"

namespace tandem::transfer {

/// Floats of one packed piece: 2 * num_heads * num_tokens * head_dim.
inline int64_t packed_layer_elems(int64_t num_heads, int64_t num_tokens, int64_t head_dim) {
  return 2 * num_heads * num_tokens * head_dim;
}

/// Gathers tokens [token_begin, token_end) of local heads [head_offset, head_offset +
/// num_heads) of `layer` from the pages `pages` (token t lives in pages[t / page_size], slot
/// t % page_size) into `out`. Checks the ranges against the cache's geometry.
void pack_layer(const KvCache& cache, int64_t layer, std::span<const int32_t> pages,
                int64_t head_offset, int64_t num_heads, int64_t token_begin, int64_t token_end,
                float* out);

/// The inverse: scatters `in` into the pages. Touches only the rows of those tokens and
/// heads; the rest of each page (other heads, other slots) is left as it was.
void unpack_layer(const float* in, KvCache& cache, int64_t layer, std::span<const int32_t> pages,
                  int64_t head_offset, int64_t num_heads, int64_t token_begin, int64_t token_end);

}  // namespace tandem::transfer
