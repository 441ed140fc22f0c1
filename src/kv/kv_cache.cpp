#include "kv/kv_cache.h"

#include <algorithm>

#include "core/error.h"

namespace tandem {

KvCache::KvCache(const KvGeometry& g) : geometry_(g) {
  TANDEM_CHECK(g.num_layers > 0 && g.num_pages > 0 && g.num_kv_heads > 0 && g.page_size > 0 &&
                   g.head_dim > 0,
               "bad KV geometry");
  TANDEM_CHECK(g.dtype == DType::kF32, "host KV pools are fp32");
  pools_.reserve(static_cast<size_t>(g.num_layers));
  for (int64_t l = 0; l < g.num_layers; ++l) {
    pools_.emplace_back(DType::kF32,
                        Shape{g.num_pages, 2, g.num_kv_heads, g.page_size, g.head_dim});
  }
}

KvCache::KvCache(const KvGeometry& g, External external)
    : geometry_(g), external_(std::move(external)) {
  TANDEM_CHECK(static_cast<int64_t>(external_.layers.size()) == g.num_layers && g.num_layers > 0,
               "external KV pools: ", external_.layers.size(), " for ", g.num_layers, " layers");
  TANDEM_CHECK(!external_.alloc_states == !external_.copy_states,
               "external KV pools: alloc_states and copy_states come together");
}

float* KvCache::layer(int64_t layer) {
  TANDEM_CHECK(is_host(), "the KV cache is not in host memory");
  return pools_[static_cast<size_t>(layer)].ptr<float>();
}

const float* KvCache::layer(int64_t layer) const {
  TANDEM_CHECK(is_host(), "the KV cache is not in host memory");
  return pools_[static_cast<size_t>(layer)].ptr<float>();
}

void* KvCache::layer_data(int64_t layer) {
  if (!is_host()) return external_.layers[static_cast<size_t>(layer)];
  return pools_[static_cast<size_t>(layer)].ptr<float>();
}

float* KvCache::head_rows(int64_t layer, int64_t page, int kv, int64_t head) {
  const auto& g = geometry_;
  return this->layer(layer) + page * g.page_elems() +
         ((static_cast<int64_t>(kv) * g.num_kv_heads + head) * g.page_size) * g.head_dim;
}

void KvCache::allocate_states(int64_t num_slots, int64_t slot_elems) {
  TANDEM_CHECK(num_slots > 0 && slot_elems > 0, "bad state slots: ", num_slots, " x ", slot_elems);
  if (external_.alloc_states) {
    device_states_owner_ =
        external_.alloc_states(static_cast<size_t>(num_slots * slot_elems) * sizeof(float));
    device_states_ = static_cast<float*>(device_states_owner_.get());
    TANDEM_CHECK(device_states_ != nullptr, "device state slots: allocation failed");
  } else {
    states_ = HostTensor(DType::kF32, {num_slots, slot_elems});
    std::fill(states_.ptr<float>(), states_.ptr<float>() + num_slots * slot_elems, 0.0f);
  }
  num_state_slots_ = num_slots;
  state_slot_elems_ = slot_elems;
}

float* KvCache::state(int64_t slot) {
  TANDEM_CHECK(!states_on_device(), "the state slots are in device memory");
  return state_data(slot);
}

float* KvCache::state_data(int64_t slot) {
  TANDEM_CHECK(slot >= 0 && slot < num_state_slots_, "state slot ", slot, " outside [0, ",
               num_state_slots_, ")");
  float* base = states_on_device() ? device_states_ : states_.ptr<float>();
  return base + slot * state_slot_elems_;
}

void KvCache::copy_state(int64_t src, int64_t dst) {
  const size_t bytes = static_cast<size_t>(state_slot_elems_) * sizeof(float);
  if (states_on_device()) {
    external_.copy_states(state_data(dst), state_data(src), bytes, 3);
  } else {
    std::copy_n(state(src), state_slot_elems_, state(dst));
  }
}

void KvCache::write_state(int64_t slot, const float* host) {
  const size_t bytes = static_cast<size_t>(state_slot_elems_) * sizeof(float);
  if (states_on_device()) {
    external_.copy_states(state_data(slot), host, bytes, 1);
  } else {
    std::copy_n(host, state_slot_elems_, state(slot));
  }
}

std::span<const float> KvCache::read_state(int64_t slot) {
  const auto n = static_cast<size_t>(state_slot_elems_);
  if (!states_on_device()) return {state(slot), n};
  state_readback_.resize(n);
  external_.copy_states(state_readback_.data(), state_data(slot), n * sizeof(float), 2);
  return {state_readback_.data(), n};
}

StateCheckpoints::StateCheckpoints(int32_t first_slot, int64_t capacity) : capacity_(capacity) {
  TANDEM_CHECK(first_slot >= 0 && capacity >= 0, "bad state checkpoints: ", capacity, " from slot ",
               first_slot);
  for (int64_t i = capacity - 1; i >= 0; --i) free_.push_back(first_slot + static_cast<int32_t>(i));
}

int32_t StateCheckpoints::find(uint64_t hash) {
  auto it = map_.find(hash);
  if (it == map_.end()) return -1;
  lru_.splice(lru_.end(), lru_, it->second.lru);
  return it->second.slot;
}

int32_t StateCheckpoints::insert(uint64_t hash, std::optional<uint64_t>* evicted) {
  if (capacity_ == 0 || map_.count(hash)) return -1;
  if (free_.empty()) {  // evict the least recently used checkpoint
    if (evicted != nullptr) *evicted = lru_.front();
    auto old = map_.find(lru_.front());
    free_.push_back(old->second.slot);
    map_.erase(old);
    lru_.pop_front();
  }
  const int32_t slot = free_.back();
  free_.pop_back();
  map_.emplace(hash, Entry{slot, lru_.insert(lru_.end(), hash)});
  return slot;
}

std::vector<uint64_t> StateCheckpoints::hashes() const { return {lru_.begin(), lru_.end()}; }

StateSlotAllocator::StateSlotAllocator(int64_t num_slots)
    : used_(static_cast<size_t>(num_slots), false) {
  for (int64_t s = num_slots - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
}

int32_t StateSlotAllocator::allocate() {
  if (free_.empty()) return -1;
  int32_t s = free_.back();
  free_.pop_back();
  used_[static_cast<size_t>(s)] = true;
  return s;
}

void StateSlotAllocator::release(int32_t slot) {
  TANDEM_CHECK(slot >= 0 && slot < num_slots() && used_[static_cast<size_t>(slot)],
               "double free of state slot ", slot);
  used_[static_cast<size_t>(slot)] = false;
  free_.push_back(slot);
}

PageAllocator::PageAllocator(int64_t num_pages) : refs_(static_cast<size_t>(num_pages), 0) {
  free_.reserve(static_cast<size_t>(num_pages));
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

bool PageAllocator::allocate(int64_t n, std::vector<int32_t>& out) {
  if (n > num_free()) return false;
  for (int64_t i = 0; i < n; ++i) {
    int32_t p = free_.back();
    free_.pop_back();
    refs_[static_cast<size_t>(p)] = 1;
    out.push_back(p);
  }
  return true;
}

void PageAllocator::retain(int32_t page) {
  TANDEM_CHECK(page >= 0 && page < num_pages() && refs_[static_cast<size_t>(page)] > 0,
               "retain of a free page ", page);
  ++refs_[static_cast<size_t>(page)];
}

void PageAllocator::release(int32_t page) {
  TANDEM_CHECK(page >= 0 && page < num_pages() && refs_[static_cast<size_t>(page)] > 0,
               "double free of page ", page);
  if (--refs_[static_cast<size_t>(page)] == 0) free_.push_back(page);
}

}  // namespace tandem
