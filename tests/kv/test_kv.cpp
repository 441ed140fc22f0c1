#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <vector>

#include "core/error.h"
#include "kv/block_manager.h"
#include "kv/kv_cache.h"

namespace tandem {
namespace {

TEST(KvCache, HndLayoutHeadRangesAreContiguous) {
  KvGeometry g{2, 3, 4, 8, 16};
  KvCache kv(g);
  // page p, k/v, head h starts at ((p * 2 + kv) * heads + h) * page_size * head_dim.
  float* base = kv.layer(1);
  EXPECT_EQ(kv.head_rows(1, 2, 1, 3) - base, ((2 * 2 + 1) * 4 + 3) * 8 * 16);
  // Heads [1, 3) of the k half of page 1 are one contiguous run.
  EXPECT_EQ(kv.head_rows(0, 1, 0, 2) - kv.head_rows(0, 1, 0, 1), 8 * 16);
}

TEST(PageAllocator, AllocFreeRefcounts) {
  PageAllocator a(4);
  std::vector<int32_t> p;
  ASSERT_TRUE(a.allocate(3, p));
  EXPECT_EQ(a.num_free(), 1);
  EXPECT_FALSE(a.allocate(2, p));  // all or nothing
  EXPECT_EQ(p.size(), 3u);
  a.retain(p[0]);
  a.release(p[0]);
  EXPECT_EQ(a.num_free(), 1);
  a.release(p[0]);
  EXPECT_EQ(a.num_free(), 2);
  EXPECT_THROW(a.release(p[0]), Error);  // double free is caught
}

TEST(BlockManager, PrefixCacheHitEvictAndExactContent) {
  BlockManager bm(6, 4, true);
  std::vector<int32_t> prompt(10);
  std::iota(prompt.begin(), prompt.end(), 100);
  std::vector<int32_t> pages;
  std::vector<uint64_t> hashes;
  EXPECT_EQ(bm.match_prefix(prompt, 8, pages, hashes), 0);
  ASSERT_TRUE(bm.allocate(3, pages));
  // Publish the two full pages.
  uint64_t h0 = BlockManager::page_hash(0, std::span(prompt).subspan(0, 4));
  uint64_t h1 = BlockManager::page_hash(h0, std::span(prompt).subspan(4, 4));
  bm.publish(pages[0], h0, std::span(prompt).subspan(0, 4));
  bm.publish(pages[1], h1, std::span(prompt).subspan(4, 4));
  bm.release(pages);
  EXPECT_EQ(bm.num_free(), 4);       // two pages held by the cache alone
  EXPECT_EQ(bm.num_available(), 6);  // ... but evictable

  std::vector<int32_t> p2;
  std::vector<uint64_t> h2;
  EXPECT_EQ(bm.match_prefix(prompt, 8, p2, h2), 2);
  EXPECT_EQ(p2[0], pages[0]);
  EXPECT_EQ(p2[1], pages[1]);
  // Capped by max_pages.
  std::vector<int32_t> p3;
  std::vector<uint64_t> h3;
  EXPECT_EQ(bm.match_prefix(prompt, 1, p3, h3), 1);
  bm.release(p3);
  // A different second page matches only the first.
  auto other = prompt;
  other[5] = 7;
  std::vector<int32_t> p4;
  std::vector<uint64_t> h4;
  EXPECT_EQ(bm.match_prefix(other, 8, p4, h4), 1);
  bm.release(p4);
  bm.release(p2);
  // Allocating everything evicts the cached pages.
  std::vector<int32_t> all;
  ASSERT_TRUE(bm.allocate(6, all));
  EXPECT_EQ(std::set<int32_t>(all.begin(), all.end()).size(), 6u);
  std::vector<int32_t> p5;
  std::vector<uint64_t> h5;
  EXPECT_EQ(bm.match_prefix(prompt, 8, p5, h5), 0);
  bm.release(all);
  EXPECT_EQ(bm.num_free(), 6);
}

TEST(BlockManager, DisabledCacheNeverMatches) {
  BlockManager bm(4, 2, false);
  std::vector<int32_t> t = {1, 2, 3, 4}, pages;
  std::vector<uint64_t> h;
  ASSERT_TRUE(bm.allocate(2, pages));
  bm.publish(pages[0], BlockManager::page_hash(0, std::span(t).subspan(0, 2)),
             std::span(t).subspan(0, 2));
  bm.release(pages);
  EXPECT_EQ(bm.num_free(), 4);
  EXPECT_EQ(bm.match_prefix(t, 4, pages, h), 0);
}

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

TEST(StateSlots, AllocateLowestFirstReleaseAndDoubleFree) {
  StateSlotAllocator a(3);
  EXPECT_EQ(a.num_slots(), 3);
  EXPECT_EQ(a.allocate(), 0);
  EXPECT_EQ(a.allocate(), 1);
  EXPECT_EQ(a.allocate(), 2);
  EXPECT_EQ(a.allocate(), -1);  // exhausted
  EXPECT_EQ(a.num_free(), 0);
  a.release(1);
  EXPECT_EQ(a.num_free(), 1);
  EXPECT_EQ(a.allocate(), 1);
  a.release(2);
  EXPECT_THROW(a.release(2), Error);
  EXPECT_THROW(a.release(7), Error);
  StateSlotAllocator none(0);
  EXPECT_EQ(none.allocate(), -1);
}

TEST(StateSlots, KvCacheStatesAreZeroedAndSeparate) {
  KvCache kv(KvGeometry{1, 2, 1, 4, 8});
  EXPECT_EQ(kv.num_state_slots(), 0);
  EXPECT_THROW(kv.state(0), Error);
  kv.allocate_states(3, 5);
  EXPECT_EQ(kv.num_state_slots(), 3);
  EXPECT_EQ(kv.state_slot_elems(), 5);
  for (int s = 0; s < 3; ++s) {
    for (int i = 0; i < 5; ++i) EXPECT_EQ(kv.state(s)[i], 0.0f);
  }
  kv.state(1)[4] = 2.0f;
  EXPECT_EQ(kv.state(2)[0], 0.0f);
  EXPECT_EQ(kv.state(0) + 5, kv.state(1));
  EXPECT_THROW(kv.state(3), Error);
  EXPECT_THROW(kv.allocate_states(0, 5), Error);
}

TEST(StateSlots, HostSlotsCopyWriteRead) {
  KvCache kv(KvGeometry{1, 2, 1, 4, 8});
  kv.allocate_states(3, 4);
  EXPECT_FALSE(kv.states_on_device());
  const float v[4] = {1, 2, 3, 4};
  kv.write_state(2, v);
  kv.copy_state(2, 0);
  const auto r = kv.read_state(0);
  ASSERT_EQ(r.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r[i], v[i]);
  EXPECT_EQ(kv.state(1)[0], 0.0f);
  EXPECT_EQ(kv.state_data(1), kv.state(1));
}

// Device state slots (a GPU model's): allocated and copied through the External hooks. Here
// the "device" is host memory and the hooks record each copy's kind.
TEST(StateSlots, DeviceSlotsGoThroughTheHooks) {
  std::vector<int> kinds;
  size_t allocated = 0;
  float pool_data[16] = {};
  KvCache::External ext;
  ext.layers = {pool_data};
  ext.alloc_states = [&](size_t bytes) {
    allocated = bytes;
    return std::shared_ptr<void>(new float[bytes / sizeof(float)](),
                                 [](void* p) { delete[] static_cast<float*>(p); });
  };
  ext.copy_states = [&](void* dst, const void* src, size_t bytes, int kind) {
    kinds.push_back(kind);
    std::memcpy(dst, src, bytes);
  };
  KvCache kv(KvGeometry{1, 1, 1, 4, 2}, ext);
  kv.allocate_states(3, 4);
  EXPECT_TRUE(kv.states_on_device());
  EXPECT_EQ(allocated, 3 * 4 * sizeof(float));
  EXPECT_THROW(kv.state(0), Error);  // no host view of device slots
  const float v[4] = {5, 6, 7, 8};
  kv.write_state(1, v);
  kv.copy_state(1, 2);
  const auto r = kv.read_state(2);
  ASSERT_EQ(r.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r[i], v[i]);
  EXPECT_EQ(kinds, (std::vector<int>{1, 3, 2}));
  EXPECT_EQ(kv.state_data(2), kv.state_data(0) + 8);
  EXPECT_THROW(kv.copy_state(1, 3), Error);
  // One hook without the other is refused.
  KvCache::External half;
  half.layers = {pool_data};
  half.alloc_states = ext.alloc_states;
  EXPECT_THROW(KvCache(KvGeometry{1, 1, 1, 4, 2}, half), Error);
}

TEST(StateSlots, CheckpointsFindInsertAndEvictLeastRecentlyUsed) {
  StateCheckpoints c(/*first_slot=*/4, /*capacity=*/2);
  EXPECT_EQ(c.find(11), -1);
  const int32_t a = c.insert(11), b = c.insert(22);
  EXPECT_EQ(std::set<int32_t>({a, b}), std::set<int32_t>({4, 5}));
  EXPECT_EQ(c.insert(11), -1);  // already checkpointed
  EXPECT_EQ(c.find(11), a);     // 11 becomes the most recent: 22 is evicted next
  EXPECT_EQ(c.insert(33), b);
  EXPECT_EQ(c.find(22), -1);
  EXPECT_EQ(c.find(11), a);
  EXPECT_EQ(c.find(33), b);
  EXPECT_EQ(c.size(), 2);
  // The evicted hash is reported (the KV events' BlockRemoved of group 1).
  std::optional<uint64_t> evicted;
  EXPECT_EQ(c.insert(44, &evicted), a);  // 11 is the least recent now
  EXPECT_EQ(evicted, std::optional<uint64_t>(11));
  evicted.reset();
  EXPECT_EQ(c.insert(44, &evicted), -1);
  EXPECT_FALSE(evicted.has_value());
  auto held = c.hashes();
  EXPECT_EQ(std::set<uint64_t>(held.begin(), held.end()), std::set<uint64_t>({33, 44}));
  StateCheckpoints none(0, 0);
  EXPECT_EQ(none.insert(1), -1);
}

}  // namespace
}  // namespace tandem
