#include "server/prefix_index.h"

#include <algorithm>

#include "core/error.h"
#include "kv/block_manager.h"

namespace tandem {

PrefixIndex::PrefixIndex(int64_t max_blocks) : max_blocks_(max_blocks) {
  TANDEM_CHECK_KIND(kInvalidArgument, max_blocks > 0, "the prefix index needs room for a block");
}

void PrefixIndex::touch(Map& m, Map::iterator it) {
  std::list<uint64_t>& lru = &m == &pages_ ? lru_pages_ : lru_states_;
  lru.splice(lru.end(), lru, it->second.lru);
}

void PrefixIndex::add(Map& m, uint64_t hash, int instance) {
  std::list<uint64_t>& lru = &m == &pages_ ? lru_pages_ : lru_states_;
  auto it = m.find(hash);
  if (it == m.end()) {
    it = m.emplace(hash, Entry{0, lru.insert(lru.end(), hash)}).first;
  } else {
    touch(m, it);
  }
  it->second.holders |= uint64_t{1} << instance;
}

void PrefixIndex::remove(Map& m, uint64_t hash, int instance) {
  auto it = m.find(hash);
  if (it == m.end()) return;
  it->second.holders &= ~(uint64_t{1} << instance);
  if (it->second.holders == 0) {
    (&m == &pages_ ? lru_pages_ : lru_states_).erase(it->second.lru);
    m.erase(it);
  }
}

void PrefixIndex::evict() {
  while (static_cast<int64_t>(pages_.size()) > max_blocks_) {
    pages_.erase(lru_pages_.front());
    lru_pages_.pop_front();
  }
  while (static_cast<int64_t>(states_.size()) > max_blocks_) {
    states_.erase(lru_states_.front());
    lru_states_.pop_front();
  }
}

void PrefixIndex::apply(int instance, const std::vector<KvEvent>& events) {
  if (instance < 0 || instance >= kMaxInstances) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (const KvEvent& e : events) {
    if (const auto* s = std::get_if<KvBlockStored>(&e)) {
      if (s->group_idx == kKvGroupState) {
        hybrid_ |= uint64_t{1} << instance;
        for (uint64_t h : s->block_hashes) add(states_, h, instance);
      } else if (s->group_idx == kKvGroupAttention) {
        if (block_size_ == 0) block_size_ = s->block_size;
        if (s->block_size != block_size_) continue;  // (one page size across the instances)
        for (uint64_t h : s->block_hashes) add(pages_, h, instance);
      }
    } else if (const auto* r = std::get_if<KvBlockRemoved>(&e)) {
      Map& m = r->group_idx == kKvGroupState ? states_ : pages_;
      for (uint64_t h : r->block_hashes) remove(m, h, instance);
    } else {
      const uint64_t bit = uint64_t{1} << instance;
      for (Map* m : {&pages_, &states_}) {
        for (auto it = m->begin(); it != m->end();) {
          it->second.holders &= ~bit;
          if (it->second.holders == 0) {
            (m == &pages_ ? lru_pages_ : lru_states_).erase(it->second.lru);
            it = m->erase(it);
          } else {
            ++it;
          }
        }
      }
    }
  }
  evict();
}

void PrefixIndex::forget(int instance) { apply(instance, {KvAllBlocksCleared{}}); }

void PrefixIndex::predict(int instance, std::span<const int32_t> tokens) {
  if (instance < 0 || instance >= kMaxInstances) return;
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t bs = block_size_;
  if (bs <= 0) return;
  uint64_t parent = 0;
  for (int64_t i = 0; (i + 1) * bs <= static_cast<int64_t>(tokens.size()); ++i) {
    parent = BlockManager::page_hash(
        parent, tokens.subspan(static_cast<size_t>(i * bs), static_cast<size_t>(bs)));
    add(pages_, parent, instance);
  }
  evict();
}

std::vector<int64_t> PrefixIndex::match(std::span<const int32_t> tokens, int n) {
  std::vector<int64_t> out(static_cast<size_t>(std::max(n, 0)), 0);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t bs = block_size_;
  if (bs <= 0 || tokens.size() < 2) return out;
  const int64_t max_pages = (static_cast<int64_t>(tokens.size()) - 1) / bs;
  const int m = std::min(n, kMaxInstances);
  uint64_t alive = m >= 64 ? ~uint64_t{0} : (uint64_t{1} << m) - 1;  // still matching
  uint64_t parent = 0;
  for (int64_t i = 0; i < max_pages && alive != 0; ++i) {
    parent = BlockManager::page_hash(
        parent, tokens.subspan(static_cast<size_t>(i * bs), static_cast<size_t>(bs)));
    auto it = pages_.find(parent);
    const uint64_t held = it == pages_.end() ? 0 : it->second.holders & alive;
    if (held != 0) touch(pages_, it);
    auto st = states_.find(parent);
    const uint64_t ckpt = st == states_.end() ? 0 : st->second.holders;
    for (int k = 0; k < m; ++k) {
      const uint64_t bit = uint64_t{1} << k;
      if (!(held & bit)) continue;
      // A hybrid resumes only at a state checkpoint; an attention-only model at any page.
      if (!(hybrid_ & bit) || (ckpt & bit)) out[static_cast<size_t>(k)] = (i + 1) * bs;
    }
    alive = held;
  }
  return out;
}

int64_t PrefixIndex::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(pages_.size());
}

int64_t PrefixIndex::block_size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return block_size_;
}

int pick_prefix_aware(const std::vector<PrefillCandidate>& c, int64_t prompt_tokens) {
  int best = -1;
  int64_t best_cost = 0;
  for (size_t i = 0; i < c.size(); ++i) {
    if (!c[i].usable) continue;
    const int64_t cost =
        std::max<int64_t>(prompt_tokens - c[i].cached_tokens, 0) + c[i].queued_tokens;
    if (best < 0 || cost < best_cost ||
        (cost == best_cost && c[i].queued_tokens < c[static_cast<size_t>(best)].queued_tokens)) {
      best = static_cast<int>(i);
      best_cost = cost;
    }
  }
  return best;
}

}  // namespace tandem
