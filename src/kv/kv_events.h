// What the prefix cache reports as it changes: the block events of vLLM's KV-event stream
// (vllm/distributed/kv_events.py: BlockStored, BlockRemoved, AllBlocksCleared), as plain
// structs. The cache records them into a KvEventLog; the engine hands each step's events to a
// KvEventSink (events/ publishes them over ZMQ as msgpack), so this layer knows no transport.
#pragma once

#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

namespace tandem {

/// KV cache groups of a model, vLLM's `group_idx`: 0 the paged KV of the full-attention layers
/// (every model), 1 the recurrent-state checkpoints of a hybrid model's prefix cache (the
/// state after the page with that hash is held; vLLM's "mamba" group).
constexpr int32_t kKvGroupAttention = 0;
constexpr int32_t kKvGroupState = 1;

/// Full pages entered the prefix cache: block_hashes[i] is the chain hash of the i-th page
/// (BlockManager::page_hash), parent_hash the page before the first (none: the prompt's first
/// page), token_ids the pages' tokens, concatenated.
struct KvBlockStored {
  std::vector<uint64_t> block_hashes;
  std::optional<uint64_t> parent_hash;
  std::vector<int32_t> token_ids;
  int64_t block_size = 0;
  int32_t group_idx = kKvGroupAttention;
};

/// Pages left the prefix cache (evicted).
struct KvBlockRemoved {
  std::vector<uint64_t> block_hashes;
  int32_t group_idx = kKvGroupAttention;
};

/// Everything this instance held is gone (start-up, or a consumer must forget its view).
struct KvAllBlocksCleared {};

using KvEvent = std::variant<KvBlockStored, KvBlockRemoved, KvAllBlocksCleared>;

/// Collects events in order while enabled; consecutive stores that continue one chain (and
/// consecutive removals) of a group merge into one event, as vLLM emits one BlockStored per
/// request and step. Not thread-safe: owned by the engine thread.
class KvEventLog {
 public:
  void enable(bool on) { enabled_ = on; }
  bool enabled() const { return enabled_; }
  void stored(uint64_t hash, std::optional<uint64_t> parent, const int32_t* tokens,
              int64_t block_size, int32_t group);
  void removed(uint64_t hash, int32_t group);
  void cleared();
  bool empty() const { return events_.empty(); }
  /// The events since the last take, oldest first.
  std::vector<KvEvent> take();

 private:
  bool enabled_ = false;
  std::vector<KvEvent> events_;
};

/// Where an engine sends each step's events. publish() must not block (the engine step calls
/// it); implementations queue and send on their own thread.
class KvEventSink {
 public:
  virtual ~KvEventSink() = default;
  virtual void publish(std::vector<KvEvent> events) = 0;
};

}  // namespace tandem
