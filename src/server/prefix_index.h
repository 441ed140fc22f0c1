// The router's approximate view of what each prefill instance (or colocated replica) holds in
// its prefix cache, built from the instances' KV events (events/zmq_subscriber), and the
// prefix-aware pick over it (in the spirit of Dynamo's KV router and SGLang's cache-aware
// policy): the instance with the least expected work, the prompt tokens it would compute
// (prompt minus the prefix it holds) plus the input tokens already queued there.
//
// The index maps a page's chain hash (BlockManager::page_hash, the hash the events carry) to the
// set of instances that hold it; a prompt's pages are hashed the same way and an instance's
// match is its run of held pages from the first. Bounded: at most max_blocks hashes, the least
// recently stored or matched evicted first (the view is approximate anyway: an evicted entry
// only costs a hit). An instance whose events were lost is forgotten (it matches nothing: the
// pick falls back to least-queued for it) until its events build it up again.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "kv/kv_events.h"

namespace tandem {

class PrefixIndex {
 public:
  static constexpr int kMaxInstances = 64;
  explicit PrefixIndex(int64_t max_blocks = int64_t{1} << 20);

  /// Applies one instance's events in order (instance in [0, kMaxInstances); others ignored).
  void apply(int instance, const std::vector<KvEvent>& events);
  /// Drops everything known of an instance (its events were lost, or it left).
  void forget(int instance);
  /// The router placed `tokens` on `instance`: its full pages are entered as held before the
  /// instance's own events confirm them (so a burst of one conversation stays together).
  void predict(int instance, std::span<const int32_t> tokens);
  /// For each instance in [0, n): how many leading tokens of `tokens` it holds, at most
  /// len - 1 (one token is always computed), in whole pages; a hybrid instance's match stops
  /// at its deepest state checkpoint.
  std::vector<int64_t> match(std::span<const int32_t> tokens, int n);

  int64_t size() const;
  /// Pages seen: the page size of the instances' events (0 until one arrived).
  int64_t block_size() const;

 private:
  struct Entry {
    uint64_t holders = 0;  // bit i: instance i
    std::list<uint64_t>::iterator lru;
  };
  using Map = std::unordered_map<uint64_t, Entry>;
  void add(Map& m, uint64_t hash, int instance);
  void remove(Map& m, uint64_t hash, int instance);
  void touch(Map& m, Map::iterator it);
  void evict();

  int64_t max_blocks_;
  mutable std::mutex mu_;
  int64_t block_size_ = 0;
  Map pages_;            // group 0: KV pages
  Map states_;           // group 1: a hybrid's state checkpoints (after the page with that hash)
  uint64_t hybrid_ = 0;  // instances that reported state checkpoints
  std::list<uint64_t> lru_pages_, lru_states_;  // oldest first
};

/// One candidate of the prefix-aware pick.
struct PrefillCandidate {
  int64_t queued_tokens = 0;  // input tokens queued there (its load plus placements since)
  int64_t cached_tokens = 0;  // of this prompt, held there (PrefixIndex::match)
  bool usable = true;
};

/// The candidate with the least (prompt_tokens - cached_tokens) + queued_tokens; ties go to the
/// one with less queued, then the first. With no cached tokens anywhere this is least-queued.
/// Returns -1 when none is usable.
int pick_prefix_aware(const std::vector<PrefillCandidate>& candidates, int64_t prompt_tokens);

}  // namespace tandem
