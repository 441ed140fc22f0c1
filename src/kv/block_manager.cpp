#include "kv/block_manager.h"

#include "core/error.h"

namespace tandem {

BlockManager::BlockManager(int64_t num_pages, int64_t page_size, bool enable_prefix_cache)
    : page_size_(page_size), enabled_(enable_prefix_cache), alloc_(num_pages) {
  TANDEM_CHECK(page_size > 0 && num_pages > 0, "bad page pool");
}

uint64_t BlockManager::page_hash(uint64_t parent, std::span<const int32_t> tokens) {
  // splitmix64-style mixing over the parent hash and the ids.
  uint64_t h = parent ^ 0x9e3779b97f4a7c15ull;
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  for (int32_t t : tokens) h = mix(h + static_cast<uint32_t>(t) + 0x632be59bd9b4e019ull);
  return mix(h) | 1;  // never 0
}

int64_t BlockManager::match_prefix(std::span<const int32_t> tokens, int64_t max_pages,
                                   std::vector<int32_t>& pages, std::vector<uint64_t>& hashes) {
  if (!enabled_) return 0;
  int64_t matched = 0;
  uint64_t parent = 0;
  while (matched < max_pages && (matched + 1) * page_size_ <= static_cast<int64_t>(tokens.size())) {
    auto chunk =
        tokens.subspan(static_cast<size_t>(matched * page_size_), static_cast<size_t>(page_size_));
    uint64_t h = page_hash(parent, chunk);
    auto it = cache_.find(h);
    if (it == cache_.end() || !std::equal(chunk.begin(), chunk.end(), it->second.tokens.begin())) {
      break;
    }
    Entry& e = it->second;
    if (e.in_lru) {
      lru_.erase(e.lru);
      e.in_lru = false;
    }
    alloc_.retain(e.page);
    pages.push_back(e.page);
    hashes.push_back(h);
    parent = h;
    ++matched;
  }
  return matched;
}

bool BlockManager::allocate(int64_t n, std::vector<int32_t>& pages) {
  if (n > num_available()) return false;
  while (alloc_.num_free() < n) {  // evict least recently used cached pages
    uint64_t h = lru_.front();
    lru_.pop_front();
    auto it = cache_.find(h);
    int32_t page = it->second.page;
    page_to_hash_.erase(page);
    cache_.erase(it);
    alloc_.release(page);
    events_.removed(h, kKvGroupAttention);
  }
  bool ok = alloc_.allocate(n, pages);
  TANDEM_CHECK(ok, "allocation failed after eviction");
  return true;
}

void BlockManager::release(std::span<const int32_t> pages) {
  for (int32_t p : pages) touch_release(p);
}

void BlockManager::touch_release(int32_t page) {
  alloc_.release(page);
  // A cached page left with the cache as its only holder becomes evictable.
  if (alloc_.ref_count(page) == 1) {
    auto it = page_to_hash_.find(page);
    if (it != page_to_hash_.end()) {
      Entry& e = cache_.at(it->second);
      if (!e.in_lru) {
        e.lru = lru_.insert(lru_.end(), it->second);
        e.in_lru = true;
      }
    }
  }
}

void BlockManager::publish(int32_t page, uint64_t hash, std::span<const int32_t> tokens,
                           uint64_t parent) {
  if (!enabled_ || cache_.count(hash) || page_to_hash_.count(page)) return;
  alloc_.retain(page);  // the cache's own hold
  Entry e{page, std::vector<int32_t>(tokens.begin(), tokens.end()), {}, false};
  cache_.emplace(hash, std::move(e));
  page_to_hash_[page] = hash;
  events_.stored(hash, parent == 0 ? std::nullopt : std::optional<uint64_t>(parent), tokens.data(),
                 page_size_, kKvGroupAttention);
}

std::vector<uint64_t> BlockManager::cached_hashes() const {
  std::vector<uint64_t> out;
  out.reserve(cache_.size());
  for (const auto& [h, e] : cache_) out.push_back(h);
  return out;
}

}  // namespace tandem
