// Paged KV cache in the HND layout, and the page allocator.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace tandem {

/// Geometry of one rank's KV cache.
struct KvGeometry {
  int64_t num_layers = 0;
  int64_t num_pages = 0;
  int64_t num_kv_heads = 0;  // heads held locally
  int64_t page_size = 16;    // tokens per page
  int64_t head_dim = 0;

  /// Floats of one page of one layer: 2 (k, v) * heads * page_size * head_dim.
  int64_t page_elems() const { return 2 * num_kv_heads * page_size * head_dim; }
};

/// Per layer a pool [num_pages, 2 (k, v), num_kv_heads, page_size, head_dim] (HND: heads
/// leading, tokens contiguous), so a head range of a page is two contiguous chunks.
class KvCache {
 public:
  KvCache() = default;
  explicit KvCache(const KvGeometry& geometry);

  const KvGeometry& geometry() const { return geometry_; }
  /// Base of layer `layer`'s pool.
  float* layer(int64_t layer) { return pools_[static_cast<size_t>(layer)].ptr<float>(); }
  const float* layer(int64_t layer) const {
    return pools_[static_cast<size_t>(layer)].ptr<float>();
  }
  /// The k (kv = 0) or v (kv = 1) rows of one head in one page: [page_size, head_dim].
  float* head_rows(int64_t layer, int64_t page, int kv, int64_t head);

 private:
  KvGeometry geometry_;
  std::vector<HostTensor> pools_;
};

/// Hands out page ids with reference counts (a page shared by the prefix cache has more
/// than one holder). Not thread-safe: owned by the engine thread.
class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);

  int64_t num_pages() const { return static_cast<int64_t>(refs_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  /// Allocates n pages with refcount 1; returns false (allocating nothing) if short.
  bool allocate(int64_t n, std::vector<int32_t>& out);
  /// Adds a holder to a live page.
  void retain(int32_t page);
  /// Drops a holder; the page is free again at zero.
  void release(int32_t page);
  int32_t ref_count(int32_t page) const { return refs_[static_cast<size_t>(page)]; }

 private:
  std::vector<int32_t> refs_;
  std::vector<int32_t> free_;  // stack; lowest ids handed out first
};

}  // namespace tandem
