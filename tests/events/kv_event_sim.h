// A prefill instance's prefix cache driven as the scheduler drives it (match the prompt's
// cached pages, allocate the rest, publish its full pages, release), for tests of the event
// stream and of routing without a model.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kv/block_manager.h"

namespace tandem::testing_sim {

/// Prefills `prompt` on `bm`; returns the prompt tokens computed (not served by the cache).
inline int64_t prefill(BlockManager& bm, std::span<const int32_t> prompt) {
  const int64_t ps = bm.page_size();
  const auto n = static_cast<int64_t>(prompt.size());
  std::vector<int32_t> pages;
  std::vector<uint64_t> hashes;
  const int64_t hit = bm.match_prefix(prompt, (n - 1) / ps, pages, hashes);
  bm.count_query(n, hit * ps);
  const int64_t need = (n + ps - 1) / ps - hit;
  if (!bm.allocate(need, pages)) {  // (the tests size pools so that one prompt always fits)
    bm.release(pages);
    return n;
  }
  for (int64_t i = hit; i < n / ps; ++i) {
    const uint64_t parent = i == 0 ? 0 : hashes.back();
    auto toks = prompt.subspan(static_cast<size_t>(i * ps), static_cast<size_t>(ps));
    const uint64_t h = BlockManager::page_hash(parent, toks);
    bm.publish(pages[static_cast<size_t>(i)], h, toks, parent);
    hashes.push_back(h);
  }
  bm.release(pages);
  return n - hit * ps;
}

}  // namespace tandem::testing_sim
