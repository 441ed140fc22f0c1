// Paged KV cache in the HND layout, and the page allocator.
#pragma once

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace tandem {

/// Geometry of one rank's KV cache.
struct KvGeometry {
  int64_t num_layers = 0;
  int64_t num_pages = 0;
  int64_t num_kv_heads = 0;  // heads held locally
  int64_t page_size = 16;    // tokens per page
  int64_t head_dim = 0;
  DType dtype = DType::kF32;  // fp32 on the CPU backend, bf16 on the GPU

  /// Elements of one page of one layer: 2 (k, v) * heads * page_size * head_dim.
  int64_t page_elems() const { return 2 * num_kv_heads * page_size * head_dim; }
  /// Bytes of one page over all layers.
  int64_t page_bytes_all_layers() const {
    return page_elems() * num_layers * static_cast<int64_t>(dtype_size(dtype));
  }
};

/// Per layer a pool [num_pages, 2 (k, v), num_kv_heads, page_size, head_dim] (HND: heads
/// leading, tokens contiguous), so a head range of a page is two contiguous chunks.
class KvCache {
 public:
  /// Pools that live elsewhere (device memory of a GPU model): one base per layer, kept
  /// alive by `owner` for the cache's lifetime.
  struct External {
    std::vector<void*> layers;
    std::shared_ptr<void> owner;
    /// The device stream (cudaStream_t) on which the model writes the pools; a device
    /// transfer backend orders its reads of a layer after that layer's write on it.
    void* stream = nullptr;
    /// Hybrid models whose state slots live in device memory (both set, or neither):
    /// alloc_states returns `bytes` zeroed bytes (the returned owner frees them) for
    /// allocate_states; copy_states copies `bytes` (kind: 1 host -> device, 2 device -> host,
    /// 3 device -> device, as cudaMemcpyKind) and returns once the copy is complete, ordered
    /// after the model's work on the stream.
    std::function<std::shared_ptr<void>(size_t bytes)> alloc_states;
    std::function<void(void* dst, const void* src, size_t bytes, int kind)> copy_states;
  };

  KvCache() = default;
  /// Host fp32 pools (geometry.dtype must be kF32).
  explicit KvCache(const KvGeometry& geometry);
  /// Pools provided by the model (any dtype, usually device memory).
  KvCache(const KvGeometry& geometry, External external);

  const KvGeometry& geometry() const { return geometry_; }
  /// True for host fp32 pools (the CPU backend and the host transfer path).
  bool is_host() const { return external_.layers.empty(); }
  /// Base of layer `layer`'s host fp32 pool (throws for external pools).
  float* layer(int64_t layer);
  const float* layer(int64_t layer) const;
  /// Base of layer `layer`'s pool, host or external.
  void* layer_data(int64_t layer);
  /// External pools: the stream the model writes them on (nullptr for host pools).
  void* device_stream() const { return external_.stream; }
  /// The k (kv = 0) or v (kv = 1) rows of one head in one page: [page_size, head_dim].
  float* head_rows(int64_t layer, int64_t page, int kv, int64_t head);

  /// Hybrid models: per-sequence recurrent state slots beside the pages, fp32
  /// [num_slots, slot_elems] (the model defines a slot's layout). Allocated once, zeroed; in
  /// host memory, or in device memory when the External pools came with alloc_states.
  void allocate_states(int64_t num_slots, int64_t slot_elems);
  int64_t num_state_slots() const { return num_state_slots_; }
  int64_t state_slot_elems() const { return state_slot_elems_; }
  /// True when the state slots are in device memory.
  bool states_on_device() const { return device_states_ != nullptr; }
  /// Base of one host slot: [slot_elems] floats (throws for device slots).
  float* state(int64_t slot);
  /// Base of one slot, host or device: [slot_elems] floats.
  float* state_data(int64_t slot);
  /// Slot `src` copied into slot `dst` (host or device).
  void copy_state(int64_t src, int64_t dst);
  /// Slot `slot` set from host floats [slot_elems].
  void write_state(int64_t slot, const float* host);
  /// Slot `slot` as host floats: the slot itself, or a copy valid until the next call.
  std::span<const float> read_state(int64_t slot);

 private:
  KvGeometry geometry_;
  std::vector<HostTensor> pools_;
  External external_;
  HostTensor states_;  // [num_state_slots, state_slot_elems]
  std::shared_ptr<void> device_states_owner_;
  float* device_states_ = nullptr;  // [num_state_slots, state_slot_elems] in device memory
  std::vector<float> state_readback_;
  int64_t num_state_slots_ = 0, state_slot_elems_ = 0;
};

/// The prefix cache of hybrid models: recurrent-state checkpoints at page-aligned prompt
/// positions, keyed by the chain hash (BlockManager::page_hash) of the last page before the
/// position, held in KvCache state slots [first_slot, first_slot + capacity); the least
/// recently used one is evicted. Not thread-safe: owned by the engine thread.
class StateCheckpoints {
 public:
  StateCheckpoints(int32_t first_slot, int64_t capacity);

  int64_t size() const { return static_cast<int64_t>(map_.size()); }
  int64_t capacity() const { return capacity_; }
  /// The slot of the checkpoint after the page `hash`, or -1; a hit becomes the most recent.
  int32_t find(uint64_t hash);
  /// A slot to write the checkpoint for `hash` into, evicting the least recently used one
  /// when full (its hash into *evicted when given); -1 when `hash` already has one (or
  /// capacity is 0).
  int32_t insert(uint64_t hash, std::optional<uint64_t>* evicted = nullptr);
  /// The hashes that have a checkpoint now (tests: a consumer's view of the events).
  std::vector<uint64_t> hashes() const;

 private:
  struct Entry {
    int32_t slot;
    std::list<uint64_t>::iterator lru;
  };
  int64_t capacity_;
  std::unordered_map<uint64_t, Entry> map_;
  std::list<uint64_t> lru_;    // oldest first
  std::vector<int32_t> free_;  // slots not holding a checkpoint
};

/// Hands out state slot ids (one per running sequence of a hybrid model), lowest first. Not
/// thread-safe: owned by the engine thread.
class StateSlotAllocator {
 public:
  explicit StateSlotAllocator(int64_t num_slots);

  int64_t num_slots() const { return static_cast<int64_t>(used_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  /// A free slot, or -1 when none is left.
  int32_t allocate();
  /// Frees a slot in use (throws on a double free).
  void release(int32_t slot);

 private:
  std::vector<bool> used_;
  std::vector<int32_t> free_;  // stack; lowest ids handed out first
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
