#include "disagg/prompt_hidden_cache.h"

#include <algorithm>

#include "core/error.h"
#include "kv/block_manager.h"

namespace tandem {

PromptHiddenCache::PromptHiddenCache(int64_t page_size, int64_t hidden_size, int64_t max_bytes)
    : page_size_(page_size), hidden_size_(hidden_size), max_pages_(0) {
  TANDEM_CHECK(page_size > 0 && hidden_size > 0 && max_bytes >= 0, "PromptHiddenCache: page size ",
               page_size, ", hidden size ", hidden_size, ", budget ", max_bytes);
  max_pages_ = max_bytes / page_bytes();
}

const PromptHiddenCache::Entry* PromptHiddenCache::find(uint64_t hash,
                                                        std::span<const int32_t> tokens) {
  auto it = entries_.find(hash);
  if (it == entries_.end() || !std::equal(tokens.begin(), tokens.end(), it->second.tokens.begin(),
                                          it->second.tokens.end())) {
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return &it->second;
}

void PromptHiddenCache::keep(uint64_t hash, std::span<const int32_t> tokens, const float* rows) {
  if (max_pages_ == 0) return;
  if (find(hash, tokens) != nullptr) return;  // kept already (now the most recent)
  auto it = entries_.find(hash);
  if (it != entries_.end()) {  // a collision: the newer page stays
    lru_.erase(it->second.lru);
    entries_.erase(it);
  }
  while (static_cast<int64_t>(entries_.size()) >= max_pages_) {
    entries_.erase(lru_.back());
    lru_.pop_back();
  }
  lru_.push_front(hash);
  Entry& e = entries_[hash];
  e.tokens.assign(tokens.begin(), tokens.end());
  e.rows.assign(rows, rows + page_size_ * hidden_size_);
  e.lru = lru_.begin();
}

int64_t PromptHiddenCache::complete(std::span<const int32_t> prompt,
                                    transfer::PromptHidden& hidden) {
  const int64_t ps = page_size_, h = hidden_size_, n = static_cast<int64_t>(prompt.size());
  TANDEM_CHECK(hidden.begin >= 0 && hidden.begin <= n &&
                   static_cast<int64_t>(hidden.rows.size()) == (n - hidden.begin) * h,
               "PromptHiddenCache: ", hidden.rows.size(), " floats from position ", hidden.begin,
               " for a prompt of ", n, " tokens");
  const int64_t full = n / ps;
  std::vector<uint64_t> hashes(static_cast<size_t>(full));
  uint64_t parent = 0;
  auto page = [&](int64_t j) { return prompt.subspan(static_cast<size_t>(j * ps), ps); };
  for (int64_t j = 0; j < full; ++j) {
    parent = hashes[static_cast<size_t>(j)] = BlockManager::page_hash(parent, page(j));
  }
  // 1. The kept pages right before the computed rows, back to the first one missing.
  int64_t filled = 0;
  if (hidden.begin > 0 && hidden.begin % ps == 0) {
    const int64_t end = hidden.begin / ps;
    std::vector<const Entry*> found;
    for (int64_t j = end - 1; j >= 0; --j) {
      const Entry* e = find(hashes[static_cast<size_t>(j)], page(j));
      if (e == nullptr) break;
      found.push_back(e);
    }
    if (!found.empty()) {
      std::vector<float> rows;
      rows.reserve(found.size() * static_cast<size_t>(ps * h) + hidden.rows.size());
      for (auto e = found.rbegin(); e != found.rend(); ++e) {
        rows.insert(rows.end(), (*e)->rows.begin(), (*e)->rows.end());
      }
      rows.insert(rows.end(), hidden.rows.begin(), hidden.rows.end());
      filled = static_cast<int64_t>(found.size()) * ps;
      hidden.begin -= filled;
      hidden.rows = std::move(rows);
    }
  }
  // 2. Every full page the rows cover, for the prompts after this one.
  for (int64_t j = (hidden.begin + ps - 1) / ps; j < full; ++j) {
    keep(hashes[static_cast<size_t>(j)], page(j), hidden.rows.data() + (j * ps - hidden.begin) * h);
  }
  return filled;
}

}  // namespace tandem
