// Prefix-aware routing over 2-4 prefill instances on a multi-turn chat workload (a shared
// system prompt, conversations that grow turn by turn): each instance's prefix cache is a real
// BlockManager that publishes its KV events over ZMQ; the router's PrefixIndex is built from
// them by the subscribers, and pick_prefix_aware picks. Against least-queued (the same pick
// with no cache knowledge), prefix-aware routing must compute at most 60% of the prompt tokens.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <random>
#include <thread>

#include "core/error.h"
#include "disagg/instance_api.h"
#include "engine/engine.h"
#include "events/kv_event_sim.h"
#include "events/zmq_publisher.h"
#include "events/zmq_subscriber.h"
#include "model/qwen3_5_moe.h"
#include "model/qwen3_moe.h"
#include "server/prefix_index.h"
#include "server/replica_router.h"

namespace tandem {
namespace {

struct Instance {
  std::unique_ptr<BlockManager> cache;
  std::unique_ptr<ZmqKvEventPublisher> pub;
  std::unique_ptr<ZmqKvEventSubscriber> sub;  // the router's
  int64_t queued = 0;                         // input tokens waiting
  int64_t computed = 0;
  int64_t published = 1;  // batches published (seq 0: AllBlocksCleared)
};

struct Result {
  int64_t prompt_tokens = 0, computed = 0, lost = 0;
  double hit_rate() const { return 1.0 - static_cast<double>(computed) / prompt_tokens; }
};

struct Workload {
  int conversations = 12, turns = 10;
  int system_tokens = 128, user_tokens = 32, reply_tokens = 64;
};

// Rounds of one turn of every conversation (a burst of requests, the users in a different order
// every round), each instance computing `drain` prompt tokens between bursts. The pool holds
// every conversation: what least-queued loses is only where a turn lands.
Result run(int n_instances, bool aware, const Workload& w, bool replay = true,
           int late_subscribe_round = -1) {
  const int64_t page = 16, pages = 2048, drain = 4000;
  PrefixIndex index(1 << 16);
  std::vector<Instance> inst(static_cast<size_t>(n_instances));
  Result res;
  auto subscribe = [&](int i) {
    Instance& x = inst[static_cast<size_t>(i)];
    x.sub = std::make_unique<ZmqKvEventSubscriber>(
        KvEventSubscriberConfig{x.pub->endpoint(), x.pub->replay_endpoint(), ""},
        [&index, i](int64_t, DecodedKvEventBatch&& b) { index.apply(i, b.events); },
        [&index, &res, i](int64_t, int64_t) {
          ++res.lost;
          index.forget(i);  // falls back to least-queued for it
        });
  };
  for (int i = 0; i < n_instances; ++i) {
    Instance& x = inst[static_cast<size_t>(i)];
    x.cache = std::make_unique<BlockManager>(pages, page, true);
    x.cache->events().enable(true);
    KvEventsConfig c;
    c.enable_kv_cache_events = true;
    c.publisher = "zmq";
    c.endpoint = "tcp://127.0.0.1:*";
    if (replay) c.replay_endpoint = "tcp://127.0.0.1:*";
    x.pub = std::make_unique<ZmqKvEventPublisher>(c, 0, "CPU");
    if (late_subscribe_round < 0) subscribe(i);
  }
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> tok(0, 150000);
  auto text = [&](int n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (auto& x : t) x = tok(rng);
    return t;
  };
  const std::vector<int32_t> system = text(w.system_tokens);
  std::vector<std::vector<int32_t>> conv(static_cast<size_t>(w.conversations), system);
  auto settle = [&] {  // the router has seen every batch published so far
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (auto& x : inst) {
      while (x.sub && (x.pub->sent() < x.published || x.sub->next_seq() < x.published) &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
  };
  for (int turn = 0; turn < w.turns; ++turn) {
    if (turn == late_subscribe_round) {
      for (int i = 0; i < n_instances; ++i) subscribe(i);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    // Users arrive in a different order every round.
    std::vector<size_t> order(conv.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t ci : order) {
      std::vector<int32_t>& c = conv[ci];
      const auto user = text(w.user_tokens);
      c.insert(c.end(), user.begin(), user.end());
      std::vector<int64_t> held =
          aware ? index.match(c, n_instances) : std::vector<int64_t>(inst.size(), 0);
      std::vector<PrefillCandidate> cand(inst.size());
      for (size_t i = 0; i < inst.size(); ++i) {
        cand[i].queued_tokens = inst[i].queued;
        cand[i].cached_tokens = held[i];
      }
      const int k = pick_prefix_aware(cand, static_cast<int64_t>(c.size()));
      EXPECT_GE(k, 0);
      Instance& x = inst[static_cast<size_t>(k)];
      const int64_t computed = testing_sim::prefill(*x.cache, c);
      x.queued += computed;
      x.computed += computed;
      res.prompt_tokens += static_cast<int64_t>(c.size());
      res.computed += computed;
      if (aware) index.predict(k, c);
      auto ev = x.cache->events().take();
      x.published += ev.empty() ? 0 : 1;
      x.pub->publish(std::move(ev));
      const auto reply = text(w.reply_tokens);  // (generated: not in the prefix cache)
      c.insert(c.end(), reply.begin(), reply.end());
    }
    for (auto& x : inst) x.queued = std::max<int64_t>(0, x.queued - drain);
    settle();
  }
  for (auto& x : inst) x.sub.reset();
  return res;
}

TEST(PrefixRouting, MultiTurnChatComputesFarFewerPromptTokens) {
  Workload w;
  for (int n : {2, 3, 4}) {
    const Result lq = run(n, false, w);
    const Result aware = run(n, true, w);
    std::printf(
        "prefix routing, %d prefill instances, %d conversations x %d turns: prompt tokens %lld; "
        "least-queued computes %lld (hit rate %.1f%%), prefix-aware %lld (hit rate %.1f%%): "
        "%.1f%%\n",
        n, w.conversations, w.turns, static_cast<long long>(lq.prompt_tokens),
        static_cast<long long>(lq.computed), 100 * lq.hit_rate(),
        static_cast<long long>(aware.computed), 100 * aware.hit_rate(),
        100.0 * static_cast<double>(aware.computed) / static_cast<double>(lq.computed));
    EXPECT_EQ(lq.prompt_tokens, aware.prompt_tokens);
    // Two instances: least-queued lands a turn where its conversation is half the time, so the
    // bound is looser there (this workload: about 64%); from three on, at most 60%.
    EXPECT_LE(aware.computed, (n == 2 ? 0.75 : 0.6) * static_cast<double>(lq.computed))
        << n << " instances";
    EXPECT_EQ(aware.lost, 0);
  }
}

TEST(PrefixRouting, LostEventsFallBackAndRecover) {
  Workload w;
  // No replay endpoint, and the router subscribes only at turn 2: every instance's stream
  // starts with a gap. The router forgets those instances (least-queued for them), routes on
  // without an error, and relearns from the events that follow.
  const Result lq = run(3, false, w, false);
  const Result aware = run(3, true, w, false, 2);
  EXPECT_GT(aware.lost, 0);
  EXPECT_EQ(aware.prompt_tokens, lq.prompt_tokens);
  EXPECT_LT(aware.computed, lq.computed);  // the later turns are routed by prefix again
  // A late subscriber with the replay endpoint loses nothing.
  const Result replayed = run(3, true, w, true, 2);
  EXPECT_EQ(replayed.lost, 0);
}

TEST(PrefixIndex, MatchesRunsOfPagesAndEvictsWithinItsBound) {
  PrefixIndex index(4);
  std::vector<int32_t> t(40);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(i);
  EXPECT_EQ(index.match(t, 2), (std::vector<int64_t>{0, 0}));  // cold: nothing known
  KvBlockStored s;
  s.block_size = 8;
  uint64_t parent = 0;
  for (int i = 0; i < 3; ++i) {
    parent = BlockManager::page_hash(parent, std::span<const int32_t>(t).subspan(i * 8, 8));
    s.block_hashes.push_back(parent);
  }
  index.apply(1, {s});
  EXPECT_EQ(index.match(t, 2), (std::vector<int64_t>{0, 24}));
  // A prompt of exactly 3 pages matches 2 (one token is always computed).
  EXPECT_EQ(index.match(std::span<const int32_t>(t).first(24), 2), (std::vector<int64_t>{0, 16}));
  index.apply(1, {KvBlockRemoved{{s.block_hashes[1]}, kKvGroupAttention}});
  EXPECT_EQ(index.match(t, 2), (std::vector<int64_t>{0, 8}));  // a run stops at a hole
  index.predict(0, t);  // 5 pages: over the bound of 4, the oldest go
  EXPECT_LE(index.size(), 4);
  index.forget(0);
  index.forget(1);
  EXPECT_EQ(index.size(), 0);
  // A hybrid instance resumes only at a state checkpoint (group 1).
  index.apply(0, {s});
  index.apply(0, {KvBlockStored{{s.block_hashes[0]}, std::nullopt, {}, 64, kKvGroupState}});
  EXPECT_EQ(index.match(t, 1), (std::vector<int64_t>{8}));
}

// A hybrid engine's own events (Qwen3.5 fixture: state checkpoints every 8 tokens, pages of 4)
// into the index: a prompt extending a served one matches up to the served prompt's last
// checkpoint, not its last page, which is what the engine then really reuses. An index fed only
// the pages (group 0, as before the engine published group 1) over-counts.
TEST(PrefixIndex, HybridEngineHitResumesAtItsLastCheckpoint) {
  static std::unique_ptr<Model> m = load_cpu_model(
      std::string(TANDEM_SOURCE_DIR) + "/tests/data/fixtures/qwen35_text_hd64_int2_fused");
  struct IndexSink : KvEventSink {
    PrefixIndex both, pages_only;
    void publish(std::vector<KvEvent> events) override {
      both.apply(0, events);
      std::vector<KvEvent> g0;
      for (const KvEvent& e : events) {
        const auto* s = std::get_if<KvBlockStored>(&e);
        const auto* r = std::get_if<KvBlockRemoved>(&e);
        if ((s && s->group_idx == kKvGroupState) || (r && r->group_idx == kKvGroupState)) continue;
        g0.push_back(e);
      }
      pages_only.apply(0, g0);
    }
  };
  auto sink = std::make_shared<IndexSink>();
  EngineConfig cfg;
  cfg.page_size = 4;
  cfg.num_pages = 32;
  cfg.max_model_len = 96;
  cfg.max_num_seqs = 2;
  cfg.state_checkpoint_interval = 8;
  cfg.num_state_checkpoints = 3;
  cfg.kv_events = sink;
  Engine e(*m, cfg);
  std::vector<int32_t> served(30);
  for (size_t i = 0; i < served.size(); ++i) served[i] = static_cast<int32_t>((i * 37 + 5) % 251);
  auto serve = [&](const std::string& id, const std::vector<int32_t>& prompt) {
    GenRequest r;
    r.id = id;
    r.prompt_ids = prompt;
    r.max_tokens = 2;
    r.ignore_eos = true;
    e.add(std::move(r), [](const StepOutput&) {});
    while (e.step()) {
    }
  };
  serve("a", served);
  // 7 full pages (28 tokens) cached; checkpoints after tokens 8, 16 and 24.
  std::vector<int32_t> next = served;
  for (int i = 0; i < 10; ++i) next.push_back(200 + i);
  EXPECT_EQ(sink->pages_only.match(next, 1), (std::vector<int64_t>{28}));
  EXPECT_EQ(sink->both.match(next, 1), (std::vector<int64_t>{24}));
  const int64_t hits = e.stats().prefix_cache_hits;
  serve("b", next);
  EXPECT_EQ(e.stats().prefix_cache_hits - hits, 24);  // the engine resumed where the index said
}

TEST(PrefixIndex, PickIsLeastQueuedWhenCold) {
  std::vector<PrefillCandidate> c(3);
  c[0].queued_tokens = 50;
  c[1].queued_tokens = 10;
  c[2].queued_tokens = 10;
  EXPECT_EQ(pick_prefix_aware(c, 100), 1);
  c[2].cached_tokens = 64;  // the cache outweighs 40 more queued tokens
  c[2].queued_tokens = 50;
  EXPECT_EQ(pick_prefix_aware(c, 100), 2);
  c[2].queued_tokens = 80;  // but not 70 more
  EXPECT_EQ(pick_prefix_aware(c, 100), 1);
  c[1].usable = false;
  EXPECT_EQ(pick_prefix_aware(c, 100), 2);  // 116 against 150
  for (auto& x : c) x.usable = false;
  EXPECT_EQ(pick_prefix_aware(c, 100), -1);
}

// `tandem router --replica`: colocated engines behind InstanceServers (as `tandem serve
// --control-port` runs them), their KV events subscribed to; a multi-turn chat through the
// router gives the tokens a direct engine gives, and later turns hit the replica's cache.
TEST(ReplicaRouter, FrontsColocatedReplicasByPrefix) {
  const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/tests/data/fixtures/hub_gqa_top2";
  struct Rep {
    std::shared_ptr<ZmqKvEventPublisher> pub;
    std::unique_ptr<AsyncEngine> engine;
    std::unique_ptr<InstanceServer> server;
  };
  EngineConfig ec;
  ec.page_size = 4;
  ec.max_model_len = 256;
  std::vector<Rep> reps(2);
  RouterConfig rc;
  std::vector<std::string> endpoints;
  for (auto& r : reps) {
    KvEventsConfig c;
    c.enable_kv_cache_events = true;
    c.publisher = "zmq";
    c.endpoint = "tcp://127.0.0.1:*";
    c.replay_endpoint = "tcp://127.0.0.1:*";
    r.pub = std::make_shared<ZmqKvEventPublisher>(c, 0, "CPU");
    EngineConfig e = ec;
    e.kv_events = r.pub;
    r.engine = std::make_unique<AsyncEngine>(Qwen3MoeCpu::load(dir), e);
    r.server = std::make_unique<InstanceServer>(r.engine.get(), "127.0.0.1", 0);
    endpoints.push_back("127.0.0.1:" + std::to_string(r.server->port()));
    rc.kv_events_endpoints.push_back(r.pub->endpoint());
    rc.kv_events_replay_endpoints.push_back(r.pub->replay_endpoint());
  }
  AsyncEngine reference(Qwen3MoeCpu::load(dir), ec);
  ReplicaRouter router(endpoints, rc);
  for (int i = 0; i < 500 && !router.ready(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(router.ready());

  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int32_t> ids;
    bool finished = false;
    std::string error;
  };
  auto run_one = [](EngineClient& c, const std::string& id, const std::vector<int32_t>& prompt,
                    Done& d) {
    GenRequest r;
    r.id = id;
    r.prompt_ids = prompt;
    r.max_tokens = 4;
    r.ignore_eos = true;
    r.sampling.temperature = 0;  // greedy: the same tokens wherever it runs
    c.submit(std::move(r), [&d](const StepOutput& o) {
      std::lock_guard<std::mutex> lk(d.mu);
      d.ids.insert(d.ids.end(), o.token_ids.begin(), o.token_ids.end());
      if (o.finished) {
        d.finished = true;
        d.error = o.error;
        d.cv.notify_all();
      }
    });
  };
  auto wait = [](Done& d) {
    std::unique_lock<std::mutex> lk(d.mu);
    return d.cv.wait_for(lk, std::chrono::seconds(60), [&] { return d.finished; });
  };
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> tok(0, 250);
  std::vector<int32_t> system(24);
  for (auto& t : system) t = tok(rng);
  std::vector<std::vector<int32_t>> conv(4, system);
  for (int turn = 0; turn < 3; ++turn) {
    std::vector<Done> got(conv.size()), want(conv.size());
    for (size_t c = 0; c < conv.size(); ++c) {  // a burst: every conversation's next turn
      for (int j = 0; j < 10; ++j) conv[c].push_back(tok(rng));
      run_one(router, "t" + std::to_string(turn) + "c" + std::to_string(c), conv[c], got[c]);
      run_one(reference, "r" + std::to_string(turn) + "c" + std::to_string(c), conv[c], want[c]);
    }
    for (size_t c = 0; c < conv.size(); ++c) {
      ASSERT_TRUE(wait(got[c]));
      ASSERT_TRUE(wait(want[c]));
      EXPECT_EQ(got[c].error, "");
      EXPECT_EQ(got[c].ids, want[c].ids) << "turn " << turn << " conversation " << c;
      conv[c].insert(conv[c].end(), got[c].ids.begin(), got[c].ids.end());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // (the events arrive)
  }
  int64_t hits = 0;
  for (auto& r : reps) hits += r.engine->stats().prefix_cache_hits;
  std::printf(
      "replica router: %lld prompt tokens routed, %lld held by the picked replica "
      "(index), %lld prefix-cache hit tokens on the replicas\n",
      static_cast<long long>(router.routed_prompt_tokens()),
      static_cast<long long>(router.routed_cached_tokens()), static_cast<long long>(hits));
  EXPECT_GT(router.routed_cached_tokens(), 0);
  EXPECT_GE(hits, router.routed_cached_tokens());
  // A request a replica refuses is refused through the router, by kind.
  Done d;
  try {
    run_one(router, "too-long", std::vector<int32_t>(300, 1), d);
    ADD_FAILURE() << "not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
  }
}

}  // namespace
}  // namespace tandem
