// KV page ownership for the engine: allocation with ref counts, plus the prefix cache
// (full prompt pages reused by content hash).
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/kv_events.h"

namespace tandem {

class BlockManager {
 public:
  BlockManager(int64_t num_pages, int64_t page_size, bool enable_prefix_cache);

  int64_t page_size() const { return page_size_; }
  int64_t num_pages() const { return alloc_.num_pages(); }
  /// Pages that can be handed out now: free plus evictable cached pages.
  int64_t num_available() const { return alloc_.num_free() + static_cast<int64_t>(lru_.size()); }
  /// Pages held by nobody, not even the prefix cache.
  int64_t num_free() const { return alloc_.num_free(); }

  /// Chain hash of a page of tokens given the previous page's hash (0 for the first).
  static uint64_t page_hash(uint64_t parent, std::span<const int32_t> tokens);

  /// Looks up the longest run of cached full pages at the start of `tokens`, using at most
  /// max_pages pages. Appends the pages (each retained once for the caller) and their
  /// hashes; returns the number of pages matched.
  int64_t match_prefix(std::span<const int32_t> tokens, int64_t max_pages,
                       std::vector<int32_t>& pages, std::vector<uint64_t>& hashes);
  /// Allocates n pages (refcount 1), evicting least recently used cached pages if needed.
  /// Returns false and allocates nothing when even eviction cannot supply n.
  bool allocate(int64_t n, std::vector<int32_t>& pages);
  /// Drops the caller's hold on each page.
  void release(std::span<const int32_t> pages);
  /// Registers a page completely filled with `tokens` under `hash`, whose previous page's hash
  /// is `parent` (0: the first page), as page_hash chains them (no-op if disabled or already
  /// present).
  void publish(int32_t page, uint64_t hash, std::span<const int32_t> tokens, uint64_t parent = 0);

  /// The cache's block events (kv_events.h): off until enabled; the engine takes them each step.
  KvEventLog& events() { return events_; }
  /// The hashes the prefix cache holds now (tests: a consumer's view of the events must equal it).
  std::vector<uint64_t> cached_hashes() const;

  int64_t hit_tokens() const { return hit_tokens_; }
  int64_t query_tokens() const { return query_tokens_; }
  void count_query(int64_t tokens, int64_t hits) {
    query_tokens_ += tokens;
    hit_tokens_ += hits;
  }

 private:
  struct Entry {
    int32_t page;
    std::vector<int32_t> tokens;        // exact content, to rule out hash collisions
    std::list<uint64_t>::iterator lru;  // valid while only the cache holds the page
    bool in_lru = false;
  };
  void touch_release(int32_t page);

  int64_t page_size_;
  bool enabled_;
  PageAllocator alloc_;
  std::unordered_map<uint64_t, Entry> cache_;  // hash -> entry
  std::unordered_map<int32_t, uint64_t> page_to_hash_;
  std::list<uint64_t> lru_;  // hashes of cached pages held by the cache alone, oldest first
  int64_t hit_tokens_ = 0, query_tokens_ = 0;
  KvEventLog events_;
};

}  // namespace tandem
