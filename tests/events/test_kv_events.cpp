// KV events in vLLM's format: the msgpack codec (field order of both encodings), the
// --kv-events-config fields, the engine's events against its prefix cache, and the ZMQ stream
// (replayed state equals the cache; a late subscriber catches up through the replay socket).
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <map>
#include <msgpack.hpp>
#include <random>
#include <set>
#include <thread>

#include "core/error.h"
#include "engine/engine.h"
#include "events/kv_event_codec.h"
#include "events/kv_event_sim.h"
#include "events/kv_events_config.h"
#include "events/zmq_publisher.h"
#include "events/zmq_subscriber.h"
#include "model/qwen3_5_moe.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

// A consumer's view: the hashes stored minus those removed, as events say, per KV cache group
// (0: pages, 1: a hybrid's state checkpoints).
struct View {
  std::mutex mu;
  std::map<int32_t, std::set<uint64_t>> held;
  std::map<int32_t, int64_t> removed;  // hashes removed, per group
  int64_t batches = 0;
  void apply(const std::vector<KvEvent>& events) {
    std::lock_guard<std::mutex> lk(mu);
    ++batches;
    for (const KvEvent& e : events) {
      if (const auto* s = std::get_if<KvBlockStored>(&e)) {
        // A consumer reproduces each hash from the tokens and the parent.
        ASSERT_EQ(s->token_ids.size(), s->block_hashes.size() * static_cast<size_t>(s->block_size));
        uint64_t parent = s->parent_hash.value_or(0);
        for (size_t i = 0; i < s->block_hashes.size(); ++i) {
          std::span<const int32_t> toks(s->token_ids.data() + i * s->block_size,
                                        static_cast<size_t>(s->block_size));
          EXPECT_EQ(BlockManager::page_hash(parent, toks), s->block_hashes[i]);
          parent = s->block_hashes[i];
          EXPECT_TRUE(held[s->group_idx].insert(s->block_hashes[i]).second) << "stored twice";
        }
      } else if (const auto* r = std::get_if<KvBlockRemoved>(&e)) {
        for (uint64_t h : r->block_hashes) {
          EXPECT_EQ(held[r->group_idx].erase(h), 1u) << "removed, not held";
          ++removed[r->group_idx];
        }
      } else {
        held.clear();  // (both groups)
      }
    }
  }
  std::set<uint64_t> get(int32_t group = kKvGroupAttention) {
    std::lock_guard<std::mutex> lk(mu);
    return held[group];
  }
  int64_t removed_of(int32_t group) {
    std::lock_guard<std::mutex> lk(mu);
    return removed[group];
  }
};

std::set<uint64_t> cached(const BlockManager& bm) {
  auto v = bm.cached_hashes();
  return {v.begin(), v.end()};
}

std::vector<KvEvent> sample_events() {
  KvBlockStored s;
  s.block_hashes = {0xfedcba9876543211ull, 42};
  s.parent_hash = 7;
  s.token_ids = {1, 2, 3, 4, 5, 6, 7, 8};
  s.block_size = 4;
  KvBlockRemoved r{{0xfedcba9876543211ull}, kKvGroupAttention};
  KvBlockStored st;  // a hybrid's state checkpoint group
  st.block_hashes = {9};
  st.block_size = 64;
  st.group_idx = kKvGroupState;
  return {KvAllBlocksCleared{}, s, r, st};
}

std::string str(const msgpack::object& o) { return {o.via.str.ptr, o.via.str.size}; }

TEST(KvEventCodec, ArrayEncodingHasVllmFieldOrder) {
  KvEventBatchInfo info;
  info.ts = 12.5;
  info.data_parallel_rank = 3;
  info.medium = "GPU";
  info.encoding = KvEventEncoding::kArray;
  const std::string payload = encode_kv_event_batch(sample_events(), info);
  msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object& b = oh.get();
  ASSERT_EQ(b.type, msgpack::type::ARRAY);
  ASSERT_EQ(b.via.array.size, 3u);  // [ts, events, data_parallel_rank]
  EXPECT_DOUBLE_EQ(b.via.array.ptr[0].via.f64, 12.5);
  EXPECT_EQ(b.via.array.ptr[2].via.u64, 3u);
  const msgpack::object* ev = b.via.array.ptr[1].via.array.ptr;
  ASSERT_EQ(ev[0].via.array.size, 1u);
  EXPECT_EQ(str(ev[0].via.array.ptr[0]), "AllBlocksCleared");
  // ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  //  lora_name, extra_keys, group_idx, kv_cache_spec_kind]
  const msgpack::object* s = ev[1].via.array.ptr;
  ASSERT_EQ(ev[1].via.array.size, 11u);
  EXPECT_EQ(str(s[0]), "BlockStored");
  EXPECT_EQ(s[1].via.array.ptr[0].via.u64, 0xfedcba9876543211ull);
  EXPECT_EQ(s[2].via.u64, 7u);
  EXPECT_EQ(s[3].via.array.size, 8u);
  EXPECT_EQ(s[4].via.u64, 4u);
  EXPECT_EQ(s[5].type, msgpack::type::NIL);
  EXPECT_EQ(str(s[6]), "GPU");
  EXPECT_EQ(s[7].type, msgpack::type::NIL);
  EXPECT_EQ(s[8].type, msgpack::type::NIL);
  EXPECT_EQ(s[9].via.u64, 0u);
  EXPECT_EQ(str(s[10]), "full_attention");
  // ["BlockRemoved", block_hashes, medium, group_idx]
  const msgpack::object* r = ev[2].via.array.ptr;
  ASSERT_EQ(ev[2].via.array.size, 4u);
  EXPECT_EQ(str(r[0]), "BlockRemoved");
  EXPECT_EQ(str(r[2]), "GPU");
  EXPECT_EQ(str(ev[3].via.array.ptr[10]), "mamba");
}

TEST(KvEventCodec, MapEncodingIsTaggedByType) {
  KvEventBatchInfo info;
  info.encoding = KvEventEncoding::kMap;
  const std::string payload = encode_kv_event_batch(sample_events(), info);
  msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
  const msgpack::object* ev = oh.get().via.array.ptr[1].via.array.ptr;
  ASSERT_EQ(ev[1].type, msgpack::type::MAP);
  EXPECT_EQ(str(ev[1].via.map.ptr[0].key), "type");
  EXPECT_EQ(str(ev[1].via.map.ptr[0].val), "BlockStored");
  EXPECT_EQ(str(ev[1].via.map.ptr[1].key), "block_hashes");
  EXPECT_EQ(str(ev[1].via.map.ptr[8].key), "group_idx");
}

TEST(KvEventCodec, RoundTripsBothEncodings) {
  for (auto enc : {KvEventEncoding::kArray, KvEventEncoding::kMap}) {
    KvEventBatchInfo info;
    info.encoding = enc;
    info.data_parallel_rank = 1;
    const auto in = sample_events();
    DecodedKvEventBatch out = decode_kv_event_batch(encode_kv_event_batch(in, info));
    ASSERT_EQ(out.events.size(), in.size());
    EXPECT_EQ(out.data_parallel_rank, 1);
    const auto& s = std::get<KvBlockStored>(out.events[1]);
    const auto& si = std::get<KvBlockStored>(in[1]);
    EXPECT_EQ(s.block_hashes, si.block_hashes);
    EXPECT_EQ(s.parent_hash, si.parent_hash);
    EXPECT_EQ(s.token_ids, si.token_ids);
    EXPECT_EQ(s.block_size, si.block_size);
    EXPECT_EQ(std::get<KvBlockRemoved>(out.events[2]).block_hashes,
              std::get<KvBlockRemoved>(in[2]).block_hashes);
    EXPECT_EQ(std::get<KvBlockStored>(out.events[3]).group_idx, kKvGroupState);
  }
  EXPECT_THROW(decode_kv_event_batch("\xc1"), Error);
  EXPECT_THROW(decode_kv_event_batch(std::string("\x92\x01\x02", 3)), Error);  // events not a list
}

TEST(KvEventsConfig, VllmFieldsDefaultsAndErrors) {
  KvEventsConfig c = parse_kv_events_config(R"({"enable_kv_cache_events": true})");
  EXPECT_TRUE(c.active());
  EXPECT_EQ(c.publisher, "zmq");
  EXPECT_EQ(c.endpoint, "tcp://*:5557");
  EXPECT_FALSE(c.replay_endpoint);
  EXPECT_EQ(c.buffer_steps, 10000);
  EXPECT_EQ(c.hwm, 100000);
  EXPECT_EQ(c.max_queue_size, 100000);
  EXPECT_EQ(c.encoding, KvEventEncoding::kMap);
  c = parse_kv_events_config(
      R"({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000",
          "replay_endpoint": "tcp://*:6001", "buffer_steps": 5, "hwm": 10,
          "max_queue_size": 7, "topic": "kv", "encoding": "array"})");
  EXPECT_EQ(*c.replay_endpoint, "tcp://*:6001");
  EXPECT_EQ(c.topic, "kv");
  EXPECT_EQ(c.encoding, KvEventEncoding::kArray);
  EXPECT_FALSE(parse_kv_events_config(R"({"enable_kv_cache_events": false})").active());
  EXPECT_FALSE(
      parse_kv_events_config(R"({"enable_kv_cache_events": true, "publisher": "null"})").active());
  for (const char* bad :
       {"[]", "{", R"({"enable_kv_cache_event": true})", R"({"publisher": "kafka"})",
        R"({"buffer_steps": -1})", R"({"endpoint": "http://x:1"})"}) {
    EXPECT_THROW(parse_kv_events_config(bad), Error) << bad;
  }
  EXPECT_EQ(offset_endpoint_port("tcp://*:5557", 2), "tcp://*:5559");
  EXPECT_EQ(offset_endpoint_port("inproc://cache", 1), "inproc://cache_dp1");
}

// The engine's own events (a recording sink) against its prefix cache, with evictions.
struct RecordingSink : KvEventSink {
  View view;
  void publish(std::vector<KvEvent> events) override { view.apply(events); }
};

// Twelve requests sharing a 12-token prefix with tails of 9-18 tokens (3 tokens out each), run
// one by one to completion on `e`; `after(i)` is called once request i finished.
void run_shared_prefix_requests(Engine& e, uint32_t seed, const std::string& prefix,
                                const std::function<void(int)>& after) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, 250);
  std::vector<int32_t> shared(12);
  for (auto& t : shared) t = tok(rng);
  for (int i = 0; i < 12; ++i) {
    GenRequest r;
    r.id = prefix + std::to_string(i);
    r.prompt_ids = shared;
    for (int j = 0; j < 9 + 3 * (i % 4); ++j) r.prompt_ids.push_back(tok(rng));
    r.max_tokens = 3;
    r.ignore_eos = true;
    e.add(std::move(r), [](const StepOutput&) {});
    while (e.step()) {
    }
    after(i);
  }
}

TEST(KvEvents, EngineEventsMirrorItsPrefixCache) {
  static std::unique_ptr<Model> m =
      Qwen3MoeCpu::load(std::string(TANDEM_SOURCE_DIR) + "/tests/data/fixtures/hub_gqa_top2");
  auto sink = std::make_shared<RecordingSink>();
  EngineConfig cfg;
  cfg.page_size = 4;
  cfg.num_pages = 24;  // a few prompts' worth: later prompts evict earlier pages
  cfg.max_model_len = 96;
  cfg.max_num_seqs = 2;
  cfg.kv_events = sink;
  Engine e(*m, cfg);
  int64_t stored_any = 0;
  run_shared_prefix_requests(e, 5, "r", [&](int i) {
    EXPECT_EQ(sink->view.get(), cached(e.blocks())) << "after request " << i;
    stored_any += static_cast<int64_t>(sink->view.get().size());
  });
  EXPECT_GT(stored_any, 0);
  EXPECT_LT(e.blocks().num_free(), cfg.num_pages);  // (the cache holds pages: a real test)
}

// A hybrid (Qwen3.5: gated DeltaNet + attention layers): its prefix cache's recurrent-state
// checkpoints are published as group 1 ("mamba"), each under the chain hash of the page it
// follows; the events replayed equal the engine's checkpoints after every request, through
// stores and evictions of both groups.
TEST(KvEvents, HybridStateCheckpointEventsMirrorItsCheckpoints) {
  static std::unique_ptr<Model> m = load_cpu_model(
      std::string(TANDEM_SOURCE_DIR) + "/tests/data/fixtures/qwen35_text_hd64_int2_fused");
  ASSERT_GT(m->state_slot_elems(), 0);
  auto sink = std::make_shared<RecordingSink>();
  EngineConfig cfg;
  cfg.page_size = 4;
  cfg.num_pages = 24;
  cfg.max_model_len = 96;
  cfg.max_num_seqs = 2;
  cfg.state_checkpoint_interval = 8;  // a checkpoint every second page
  cfg.num_state_checkpoints = 3;      // few: later prompts evict earlier checkpoints
  cfg.kv_events = sink;
  Engine e(*m, cfg);
  ASSERT_NE(e.state_checkpoints(), nullptr);
  int64_t stored_any = 0;
  run_shared_prefix_requests(e, 11, "h", [&](int i) {
    EXPECT_EQ(sink->view.get(kKvGroupAttention), cached(e.blocks())) << "after request " << i;
    const auto ck = e.state_checkpoints()->hashes();
    EXPECT_EQ(sink->view.get(kKvGroupState), std::set<uint64_t>(ck.begin(), ck.end()))
        << "after request " << i;
    stored_any += static_cast<int64_t>(sink->view.get(kKvGroupState).size());
  });
  EXPECT_GT(stored_any, 0);
  EXPECT_EQ(e.state_checkpoints()->size(), 3);
  EXPECT_GT(sink->view.removed_of(kKvGroupState), 0);  // checkpoints were evicted
  EXPECT_GT(sink->view.removed_of(kKvGroupAttention), 0);
  EXPECT_GT(e.stats().prefix_cache_hits, 0);  // (the shared prefix resumed at a checkpoint)
}

void wait_for(const std::function<bool()>& done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(done()) << "timed out";
}

KvEventsConfig loopback_config(bool replay) {
  KvEventsConfig c;
  c.enable_kv_cache_events = true;
  c.publisher = "zmq";
  c.endpoint = "tcp://127.0.0.1:*";
  if (replay) c.replay_endpoint = "tcp://127.0.0.1:*";
  c.topic = "kv@test";
  return c;
}

// Prompts sharing prefixes on a small pool, so that pages are stored, hit and evicted.
std::vector<std::vector<int32_t>> workload(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, 1000);
  std::vector<std::vector<int32_t>> sys(3, std::vector<int32_t>(32));
  for (auto& s : sys)
    for (auto& t : s) t = tok(rng);
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> p = sys[static_cast<size_t>(i % 3)];
    for (int j = 0; j < 20 + (i * 7) % 40; ++j) p.push_back(tok(rng));
    out.push_back(std::move(p));
  }
  return out;
}

TEST(KvEvents, ZmqStreamReplaysToTheCacheState) {
  BlockManager bm(40, 8, true);
  bm.events().enable(true);
  ZmqKvEventPublisher pub(loopback_config(true), 0, "CPU");
  View view;
  ZmqKvEventSubscriber sub(
      {pub.endpoint(), pub.replay_endpoint(), "kv@test"},
      [&](int64_t, DecodedKvEventBatch&& b) { view.apply(b.events); }, nullptr);
  // (the SUB connects: a batch published before it does is dropped by ZMQ, and with nothing
  // after it to show the gap the subscriber would wait; seen once under a loaded ctest -j2)
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  int64_t removed = 0, published = 1;  // (seq 0: AllBlocksCleared)
  for (const auto& p : workload(60, 1)) {
    testing_sim::prefill(bm, p);
    auto ev = bm.events().take();
    for (const auto& e : ev) removed += std::holds_alternative<KvBlockRemoved>(e) ? 1 : 0;
    published += ev.empty() ? 0 : 1;  // (an empty batch is not sent)
    pub.publish(std::move(ev));
    wait_for([&] { return pub.sent() == published && sub.next_seq() == published; });
    ASSERT_EQ(view.get(), cached(bm));
  }
  EXPECT_GT(removed, 0);  // evictions happened
  EXPECT_EQ(sub.lost(), 0);
}

TEST(KvEvents, LateSubscriberCatchesUpThroughReplay) {
  BlockManager bm(40, 8, true);
  bm.events().enable(true);
  ZmqKvEventPublisher pub(loopback_config(true), 0, "CPU");
  auto prompts = workload(30, 2);
  int64_t published = 1;
  for (size_t i = 0; i + 1 < prompts.size(); ++i) {  // nobody listens yet
    testing_sim::prefill(bm, prompts[i]);
    auto ev = bm.events().take();
    published += ev.empty() ? 0 : 1;
    pub.publish(std::move(ev));
  }
  wait_for([&] { return pub.sent() == published; });
  View view;
  ZmqKvEventSubscriber sub(
      {pub.endpoint(), pub.replay_endpoint(), "kv@test"},
      [&](int64_t, DecodedKvEventBatch&& b) { view.apply(b.events); }, nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // (the SUB connects)
  testing_sim::prefill(bm, prompts.back());
  auto last = bm.events().take();  // (a batch with no block if that prompt stored nothing)
  if (last.empty()) last.push_back(KvBlockStored{{}, std::nullopt, {}, 8, kKvGroupAttention});
  pub.publish(std::move(last));
  ++published;
  wait_for([&] { return pub.sent() == published && sub.next_seq() == published; });
  EXPECT_GT(sub.replayed(), 0);
  EXPECT_EQ(sub.lost(), 0);
  EXPECT_EQ(view.get(), cached(bm));
}

TEST(KvEvents, WithoutReplayALateSubscriberReportsTheLoss) {
  BlockManager bm(40, 8, true);
  bm.events().enable(true);
  ZmqKvEventPublisher pub(loopback_config(false), 0, "CPU");
  auto prompts = workload(5, 3);
  int64_t published = 1;
  for (const auto& p : prompts) {
    testing_sim::prefill(bm, p);
    auto ev = bm.events().take();
    published += ev.empty() ? 0 : 1;
    pub.publish(std::move(ev));
  }
  wait_for([&] { return pub.sent() == published; });
  int64_t lost_calls = 0;
  View view;
  ZmqKvEventSubscriber sub(
      {pub.endpoint(), "", "kv@test"},
      [&](int64_t, DecodedKvEventBatch&& b) { view.apply(b.events); },
      [&](int64_t, int64_t) { ++lost_calls; });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  pub.publish({KvBlockStored{{}, std::nullopt, {}, 8, kKvGroupAttention}});
  wait_for([&] { return pub.sent() == published + 1 && sub.next_seq() == published + 1; });
  EXPECT_EQ(lost_calls, 1);
  EXPECT_EQ(sub.lost(), published);
}

TEST(KvEvents, FullQueueDropsAndClearsTheConsumersView) {
  KvEventsConfig c = loopback_config(false);
  c.max_queue_size = 1;
  ZmqKvEventPublisher pub(c, 0, "CPU");
  for (int i = 0; i < 2000; ++i) {  // far faster than the thread sends: some are dropped
    pub.publish({KvBlockStored{{static_cast<uint64_t>(i + 1)}, std::nullopt, {}, 0, 0}});
  }
  wait_for([&] { return pub.sent() + pub.dropped() == 2001; });
  EXPECT_GT(pub.dropped(), 0);
}

}  // namespace
}  // namespace tandem
