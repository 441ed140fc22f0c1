#include "kv/kv_events.h"

namespace tandem {

void KvEventLog::stored(uint64_t hash, std::optional<uint64_t> parent, const int32_t* tokens,
                        int64_t block_size, int32_t group) {
  if (!enabled_) return;
  if (!events_.empty()) {  // continues the last store's chain: one event
    if (auto* s = std::get_if<KvBlockStored>(&events_.back());
        s != nullptr && s->group_idx == group && s->block_size == block_size && parent &&
        !s->block_hashes.empty() && s->block_hashes.back() == *parent) {
      s->block_hashes.push_back(hash);
      if (tokens != nullptr) s->token_ids.insert(s->token_ids.end(), tokens, tokens + block_size);
      return;
    }
  }
  KvBlockStored s;
  s.block_hashes.push_back(hash);
  s.parent_hash = parent;
  if (tokens != nullptr) s.token_ids.assign(tokens, tokens + block_size);
  s.block_size = block_size;
  s.group_idx = group;
  events_.emplace_back(std::move(s));
}

void KvEventLog::removed(uint64_t hash, int32_t group) {
  if (!enabled_) return;
  if (!events_.empty()) {
    if (auto* r = std::get_if<KvBlockRemoved>(&events_.back());
        r != nullptr && r->group_idx == group) {
      r->block_hashes.push_back(hash);
      return;
    }
  }
  events_.emplace_back(KvBlockRemoved{{hash}, group});
}

void KvEventLog::cleared() {
  if (!enabled_) return;
  events_.clear();  // (what came before is void anyway)
  events_.emplace_back(KvAllBlocksCleared{});
}

std::vector<KvEvent> KvEventLog::take() {
  std::vector<KvEvent> out;
  out.swap(events_);
  return out;
}

}  // namespace tandem
