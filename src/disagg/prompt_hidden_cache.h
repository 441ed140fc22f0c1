// The final hidden states of prompt pages a prefill instance computed, kept for later prompts
// whose leading pages its prefix cache serves: those positions are not computed again, so
// without this a speculating decode instance would get no hidden state for them (and its MTP
// layer would attend to zeros there). A page's hidden states depend only on the tokens up to
// its end, so the cache is content-addressed like the prefix cache (BlockManager::page_hash
// chain hashes, the page's own tokens checked) and independent of page ids and eviction there;
// least recently used pages go first within a byte budget. Not thread-safe (rank 0's loop).
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "transfer/transfer.h"

namespace tandem {

class PromptHiddenCache {
 public:
  /// max_bytes: the budget of the kept rows (f32, page_size * hidden_size per page); 0 keeps
  /// nothing.
  PromptHiddenCache(int64_t page_size, int64_t hidden_size, int64_t max_bytes);

  /// `hidden` holds the rows of positions [hidden.begin, prompt.size()). Prepends the kept rows
  /// of the full pages before hidden.begin, as far back as every page is kept (hidden.begin a
  /// page boundary), then keeps the full pages the rows cover. Returns the positions filled in.
  int64_t complete(std::span<const int32_t> prompt, transfer::PromptHidden& hidden);

  int64_t pages() const { return static_cast<int64_t>(entries_.size()); }
  int64_t bytes() const { return pages() * page_bytes(); }

 private:
  struct Entry {
    std::vector<int32_t> tokens;  // the page's, to rule out hash collisions
    std::vector<float> rows;      // [page_size, hidden_size]
    std::list<uint64_t>::iterator lru;
  };
  int64_t page_bytes() const {
    return page_size_ * hidden_size_ * static_cast<int64_t>(sizeof(float));
  }
  const Entry* find(uint64_t hash, std::span<const int32_t> tokens);
  void keep(uint64_t hash, std::span<const int32_t> tokens, const float* rows);

  int64_t page_size_, hidden_size_, max_pages_;
  std::unordered_map<uint64_t, Entry> entries_;
  std::list<uint64_t> lru_;  // most recently used first
};

}  // namespace tandem
