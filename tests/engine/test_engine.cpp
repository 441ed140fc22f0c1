// Engine behaviour on a small fixture model: continuous batching, preemption, prefix cache,
// aborts, stop conditions, validation; page pool always returns to where it was.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "core/error.h"
#include "engine/engine.h"
#include "golden.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

std::string fixture_dir() { return testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2"; }

Model& model() {
  static std::unique_ptr<Model> m = Qwen3MoeCpu::load(fixture_dir());
  return *m;
}

struct Collected {
  std::vector<int32_t> ids;
  FinishReason reason = FinishReason::kNone;
  int finished = 0;
  int32_t cached = -1;
  std::vector<float> prompt_lp;
};

GenRequest make(const std::string& id, std::vector<int32_t> prompt, int max_tokens,
                float temperature = 0, uint64_t seed = 0) {
  GenRequest r;
  r.id = id;
  r.prompt_ids = std::move(prompt);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  return r;
}

std::vector<int32_t> random_prompt(std::mt19937& rng, int len) {
  std::uniform_int_distribution<int> d(0, 250);
  std::vector<int32_t> p(static_cast<size_t>(len));
  for (auto& t : p) t = d(rng);
  return p;
}

OutputCallback collect(Collected& c) {
  return [&c](const StepOutput& o) {
    c.ids.insert(c.ids.end(), o.token_ids.begin(), o.token_ids.end());
    if (c.cached < 0) c.cached = o.num_cached_prompt_tokens;
    c.prompt_lp.insert(c.prompt_lp.end(), o.prompt_token_logprobs.begin(),
                       o.prompt_token_logprobs.end());
    if (o.finished) {
      c.reason = o.finish_reason;
      ++c.finished;
    }
  };
}

void drain(Engine& e) {
  for (int guard = 0; e.step(); ++guard) ASSERT_LT(guard, 100000);
}

TEST(Engine, PreemptionUnderPagePressureKeepsOutputs) {
  std::mt19937 rng(1);
  std::vector<GenRequest> reqs;
  for (int i = 0; i < 12; ++i) {
    reqs.push_back(make("r" + std::to_string(i), random_prompt(rng, 10 + 7 * i), 20, 0.8f, i));
  }
  // Reference: plenty of pages, one at a time.
  std::vector<Collected> ref(reqs.size());
  {
    EngineConfig cfg;
    cfg.max_model_len = 256;
    Engine e(model(), cfg);
    for (size_t i = 0; i < reqs.size(); ++i) {
      e.add(reqs[i], collect(ref[i]));
      drain(e);
    }
  }
  // Tight pool: 16 pages of 8 tokens for 12 concurrent sequences forces preemption.
  EngineConfig cfg;
  cfg.max_model_len = 128;
  cfg.page_size = 8;
  cfg.num_pages = 16;
  cfg.max_batched_tokens = 32;
  Engine e(model(), cfg);
  std::vector<Collected> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) e.add(reqs[i], collect(got[i]));
  drain(e);
  EXPECT_GT(e.stats().preemptions, 0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[i].finished, 1);
    EXPECT_EQ(got[i].reason, FinishReason::kLength);
    EXPECT_EQ(got[i].ids, ref[i].ids) << "request " << i;  // seeded sampling is reproducible
  }
  EXPECT_EQ(e.blocks().num_available(), e.blocks().num_pages());
}

TEST(Engine, PrefixCacheHitsGiveSameOutput) {
  std::mt19937 rng(2);
  auto shared = random_prompt(rng, 40);
  EngineConfig cfg;
  cfg.page_size = 8;
  cfg.max_model_len = 256;
  Engine e(model(), cfg);
  Collected a, b, c;
  e.add(make("a", shared, 8), collect(a));
  drain(e);
  EXPECT_EQ(a.cached, 0);
  e.add(make("b", shared, 8), collect(b));
  drain(e);
  EXPECT_EQ(b.cached, 32);  // 4 full pages; the last token is always recomputed
  EXPECT_EQ(b.ids, a.ids);
  auto longer = shared;
  longer.push_back(5);
  longer.push_back(6);
  e.add(make("c", longer, 8), collect(c));
  drain(e);
  EXPECT_EQ(c.cached, 40);
  EXPECT_GT(e.stats().prefix_cache_hits, 0);
  // The pool is whole again once cached pages count as available.
  EXPECT_EQ(e.blocks().num_available(), e.blocks().num_pages());
}

TEST(Engine, AbortFreesPagesAtOnceAtAnyPoint) {
  std::mt19937 rng(3);
  EngineConfig cfg;
  cfg.page_size = 4;
  cfg.max_model_len = 256;
  cfg.max_batched_tokens = 16;
  cfg.enable_prefix_cache = false;
  for (int abort_after = 0; abort_after < 8; ++abort_after) {
    Engine e(model(), cfg);
    Collected x, y;
    e.add(make("x", random_prompt(rng, 50), 30), collect(x));
    e.add(make("y", random_prompt(rng, 5), 30), collect(y));
    for (int s = 0; s < abort_after; ++s) e.step();
    e.abort("x");
    e.abort("x");        // twice is harmless
    e.abort("unknown");  // unknown is harmless
    EXPECT_EQ(x.finished, 1);
    EXPECT_EQ(x.reason, FinishReason::kAbort);
    drain(e);
    EXPECT_EQ(y.reason, FinishReason::kLength);
    EXPECT_EQ(e.blocks().num_free(), e.blocks().num_pages());
  }
}

TEST(Engine, StopTokenIdsMinTokensAndEos) {
  EngineConfig cfg;
  cfg.max_model_len = 256;
  Engine e(model(), cfg);
  std::mt19937 rng(4);
  auto prompt = random_prompt(rng, 6);
  Collected free_run;
  e.add(make("f", prompt, 10), collect(free_run));
  drain(e);
  ASSERT_EQ(free_run.ids.size(), 10u);
  // Stopping on the 4th greedy token.
  auto r = make("s", prompt, 10);
  r.stop_token_ids = {free_run.ids[3]};
  Collected s;
  e.add(r, collect(s));
  drain(e);
  auto first = std::find(free_run.ids.begin(), free_run.ids.end(), free_run.ids[3]);
  EXPECT_EQ(s.ids, std::vector<int32_t>(free_run.ids.begin(), first + 1));
  EXPECT_EQ(s.reason, FinishReason::kStop);
  // min_tokens suppresses the stop id until enough tokens exist.
  auto m = make("m", prompt, 10);
  m.stop_token_ids = {free_run.ids[0]};
  m.min_tokens = 3;
  Collected mc;
  e.add(m, collect(mc));
  drain(e);
  EXPECT_GE(mc.ids.size(), 3u);
  for (size_t i = 0; i + 1 < std::min<size_t>(mc.ids.size(), 3); ++i) {
    EXPECT_NE(mc.ids[i], free_run.ids[0]);
  }
}

TEST(Engine, PromptLogprobsMatchFullForward) {
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.max_batched_tokens = 5;  // prompt logprobs gathered across chunks
  Engine e(model(), cfg);
  std::mt19937 rng(5);
  auto prompt = random_prompt(rng, 17);
  auto r = make("p", prompt, 2);
  r.sampling.prompt_logprobs = 0;
  Collected c;
  e.add(r, collect(c));
  drain(e);
  ASSERT_EQ(c.prompt_lp.size(), prompt.size() - 1);
  // Each prompt logprob equals the one a greedy run of the shorter prefix would report.
  for (size_t i : {size_t(1), size_t(8), prompt.size() - 1}) {
    auto pre =
        make("q" + std::to_string(i), std::vector<int32_t>(prompt.begin(), prompt.begin() + i), 1);
    pre.ignore_eos = true;
    pre.sampling.logprobs = 0;
    float lp = 0;
    bool seen = false;
    Engine e2(model(), cfg);
    // Read prompt[i]'s logprob from the full distribution (top-n over the whole vocab).
    pre.sampling.logprobs = static_cast<int32_t>(model().config().vocab_size);
    e2.add(pre, [&](const StepOutput& o) {
      for (const auto& t : o.top_logprobs[0]) {
        if (t.id == prompt[i]) {
          lp = t.logprob;
          seen = true;
        }
      }
    });
    drain(e2);
    ASSERT_TRUE(seen);
    EXPECT_NEAR(c.prompt_lp[i - 1], lp, 1e-5) << i;
  }
}

TEST(Engine, ValidationErrors) {
  EngineConfig cfg;
  cfg.max_model_len = 64;
  cfg.max_waiting = 2;
  Engine e(model(), cfg);
  auto expect_kind = [&](GenRequest r, ErrorKind kind, const char* needle) {
    try {
      e.add(r, nullptr);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& err) {
      EXPECT_EQ(err.kind(), kind);
      EXPECT_NE(err.message().find(needle), std::string::npos) << err.message();
    }
  };
  expect_kind(make("a", {}, 4), ErrorKind::kInvalidArgument, "empty");
  expect_kind(make("a", {1, 999999}, 4), ErrorKind::kInvalidArgument, "out of range");
  expect_kind(make("a", {1, 2}, 0), ErrorKind::kInvalidArgument, "max_tokens");
  expect_kind(make("a", std::vector<int32_t>(60, 1), 10), ErrorKind::kInvalidArgument, "64");
  e.add(make("w1", {1}, 2), nullptr);
  e.add(make("w2", {1}, 2), nullptr);
  expect_kind(make("w3", {1}, 2), ErrorKind::kOutOfResources, "queue");
  expect_kind(make("w1", {1}, 2), ErrorKind::kOutOfResources, "queue");
  drain(e);
  EXPECT_NO_THROW(e.add(make("w1", {1}, 2), nullptr));
  EXPECT_THROW(e.add(make("w1", {1}, 2), nullptr), Error);  // duplicate live id
  drain(e);
}

TEST(AsyncEngine, ConcurrentRequestsMatchSolo) {
  auto owned = Qwen3MoeCpu::load(fixture_dir());
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.max_num_seqs = 64;
  AsyncEngine engine(std::move(owned), cfg);
  std::mt19937 rng(6);
  const int n = 64;
  std::vector<GenRequest> reqs;
  for (int i = 0; i < n; ++i)
    reqs.push_back(
        make("c" + std::to_string(i), random_prompt(rng, 3 + i % 20), 6 + i % 5, 0.7f, 100 + i));
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Collected> got(n);
  int done = 0;
  for (int i = 0; i < n; ++i) {
    engine.submit(reqs[i], [&, i](const StepOutput& o) {
      std::lock_guard<std::mutex> lock(mu);
      collect(got[i])(o);
      if (o.finished) {
        ++done;
        cv.notify_all();
      }
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return done == n; }));
  }
  // Solo runs of a few of them give the same tokens.
  Engine solo(model(), cfg);
  for (int i : {0, 17, 63}) {
    Collected c;
    solo.add(reqs[i], collect(c));
    drain(solo);
    EXPECT_EQ(got[i].ids, c.ids) << i;
  }
  for (int i = 0; i < 200; ++i) {
    auto st = engine.stats();
    if (st.kv_pages_free == st.kv_pages_total && st.running == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto st = engine.stats();
  EXPECT_EQ(st.kv_pages_free, st.kv_pages_total);
  EXPECT_EQ(st.running + st.waiting, 0);
}

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

// Disaggregated decode in one process: prefill on one KV cache, copy the pages into pages
// the decode engine reserved (what the transfer engine does), continue there; the tokens
// equal a colocated run.
TEST(Engine, PrefilledRequestsContinueLikeColocated) {
  std::mt19937 rng(7);
  EngineConfig cfg;
  cfg.max_model_len = 256;
  cfg.page_size = 8;
  for (int len : {1, 8, 29}) {
    auto prompt = random_prompt(rng, len);
    Collected colo;
    {
      Engine e(model(), cfg);
      e.add(make("c", prompt, 10), collect(colo));
      drain(e);
    }
    // Prefill side: a plain forward over the prompt into its own cache.
    const auto& mc = model().config();
    KvCache src(model().kv_geometry(8, cfg.page_size));
    std::vector<int32_t> src_pages = {5, 2, 7, 0};
    std::vector<float> logits;
    ForwardBatch b;
    b.seqs.push_back({prompt.data(), len, 0, src_pages.data(), 4, LogitsMode::kLast});
    model().forward(b, src, logits);
    int32_t first =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    // Decode side: reserve, "transfer", admit.
    Engine e(model(), cfg);
    std::vector<int32_t> dst_pages;
    ASSERT_TRUE(e.reserve_pages(len, dst_pages));
    const int64_t page_elems = src.geometry().page_elems();
    for (int64_t l = 0; l < mc.num_hidden_layers; ++l) {
      for (size_t p = 0; p < dst_pages.size(); ++p) {
        std::copy_n(src.layer(l) + src_pages[p] * page_elems, page_elems,
                    e.kv_cache().layer(l) + dst_pages[p] * page_elems);
      }
    }
    Collected dis;
    e.add_prefilled(make("d", prompt, 10), collect(dis), dst_pages, first, 0.0f);
    drain(e);
    EXPECT_EQ(dis.ids, colo.ids) << "prompt length " << len;
    EXPECT_EQ(dis.finished, 1);
    EXPECT_EQ(e.blocks().num_available(), e.blocks().num_pages());
  }
  // Reserved pages can be given back (a failed transfer).
  Engine e(model(), cfg);
  std::vector<int32_t> pages;
  ASSERT_TRUE(e.reserve_pages(100, pages));
  EXPECT_LT(e.blocks().num_available(), e.blocks().num_pages());
  e.release_pages(pages);
  EXPECT_EQ(e.blocks().num_available(), e.blocks().num_pages());
}

}  // namespace
}  // namespace tandem
