// The CPU engine against transformers, token for token (tools/make_fixtures.py).
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "engine/engine.h"
#include "golden.h"
#include "model/qwen3_5_moe.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

using testing::Golden;
using testing::GoldenCase;

struct Result {
  std::vector<int32_t> ids;
  std::vector<std::vector<TokenLogprob>> top;
  FinishReason reason = FinishReason::kNone;
  int finished = 0;
};

GenRequest greedy_request(const std::string& id, const GoldenCase& c) {
  GenRequest r;
  r.id = id;
  r.prompt_ids = c.prompt_ids;
  r.max_tokens = c.max_tokens;
  r.sampling.temperature = 0;
  r.sampling.logprobs = static_cast<int32_t>(c.top_logprobs.empty() ? 5 : c.top_logprobs[0].size());
  return r;
}

// Runs the cases through one engine, all submitted together (a mixed batch).
std::vector<Result> run(Model& model, const std::vector<GoldenCase>& cases, EngineConfig cfg,
                        int64_t* preemptions = nullptr) {
  Engine engine(model, cfg);
  std::vector<Result> results(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    engine.add(greedy_request("r" + std::to_string(i), cases[i]), [&, i](const StepOutput& o) {
      Result& r = results[i];
      r.ids.insert(r.ids.end(), o.token_ids.begin(), o.token_ids.end());
      r.top.insert(r.top.end(), o.top_logprobs.begin(), o.top_logprobs.end());
      if (o.finished) {
        r.reason = o.finish_reason;
        ++r.finished;
      }
    });
  }
  while (engine.step()) {
  }
  EXPECT_EQ(engine.blocks().num_available(), engine.blocks().num_pages()) << "leaked KV pages";
  if (preemptions) *preemptions = engine.stats().preemptions;
  return results;
}

void expect_matches(const Golden& g, size_t i, const GoldenCase& c, const Result& r,
                    double tol = 1e-3) {
  SCOPED_TRACE(g.name + " case " + std::to_string(i));
  EXPECT_EQ(r.finished, 1);
  ASSERT_EQ(r.ids, c.output_ids);
  ASSERT_EQ(r.top.size(), c.top_logprobs.size());
  for (size_t t = 0; t < r.top.size(); ++t) {
    ASSERT_EQ(r.top[t].size(), c.top_logprobs[t].size());
    for (size_t k = 0; k < r.top[t].size(); ++k) {
      const auto& want = c.top_logprobs[t][k];
      const auto& got = r.top[t][k];
      EXPECT_NEAR(got.logprob, want.logprob, tol) << "position " << t << " rank " << k;
      // Ids must agree unless two candidates are tied within tolerance.
      if (got.id != want.id) {
        bool tie = (k + 1 < c.top_logprobs[t].size() &&
                    std::fabs(c.top_logprobs[t][k + 1].logprob - want.logprob) < tol) ||
                   (k > 0 && std::fabs(c.top_logprobs[t][k - 1].logprob - want.logprob) < tol);
        EXPECT_TRUE(tie) << "position " << t << " rank " << k << ": id " << got.id
                         << " != " << want.id;
      }
    }
  }
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, AloneBatchedAndChunked) {
  Golden g = testing::load_golden(GetParam());
  auto model = Qwen3MoeCpu::load(g.dir);
  EngineConfig cfg;
  cfg.kv_cache_mb = 64;
  cfg.max_model_len = 1024;
  // 1. Each case alone.
  std::vector<Result> alone;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    auto r = run(*model, {g.cases[i]}, cfg);
    expect_matches(g, i, g.cases[i], r[0]);
    alone.push_back(r[0]);
  }
  // 2. All cases in one batch: bit-identical to alone (batch invariance).
  auto batched = run(*model, g.cases, cfg);
  for (size_t i = 0; i < g.cases.size(); ++i) {
    EXPECT_EQ(batched[i].ids, alone[i].ids);
    for (size_t t = 0; t < alone[i].top.size() && t < batched[i].top.size(); ++t) {
      for (size_t k = 0; k < alone[i].top[t].size(); ++k) {
        EXPECT_EQ(batched[i].top[t][k].logprob, alone[i].top[t][k].logprob);
      }
    }
  }
  // 3. Chunked prefill with a small token budget and small pages.
  EngineConfig small = cfg;
  small.max_batched_tokens = 7;
  small.page_size = 4;
  auto chunked = run(*model, g.cases, small);
  for (size_t i = 0; i < g.cases.size(); ++i) expect_matches(g, i, g.cases[i], chunked[i]);
}

// Results bit-identical (ids and every top logprob).
void expect_identical(const Result& a, const Result& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.finished, 1);
  EXPECT_EQ(a.ids, b.ids);
  ASSERT_EQ(a.top.size(), b.top.size());
  for (size_t t = 0; t < a.top.size(); ++t) {
    ASSERT_EQ(a.top[t].size(), b.top[t].size());
    for (size_t k = 0; k < a.top[t].size(); ++k) {
      EXPECT_EQ(a.top[t][k].id, b.top[t][k].id);
      EXPECT_EQ(a.top[t][k].logprob, b.top[t][k].logprob) << "position " << t << " rank " << k;
    }
  }
}

// Qwen3.5 hybrid fixtures (tools/make_qwen35_fixtures.py): the model picked by model_type,
// logprobs within 1e-4 of transformers; batched decode, chunked prefill and preemption
// reproduce the unbatched tokens bit for bit (the recurrent state travels exactly).
class HybridGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HybridGoldenTest, AloneBatchedChunkedAndPreempted) {
  Golden g = testing::load_golden(GetParam());
  auto model = load_cpu_model(g.dir);
  ASSERT_GT(model->state_slot_elems(), 0);
  EngineConfig cfg;
  cfg.kv_cache_mb = 64;
  cfg.max_model_len = 1024;
  cfg.max_num_seqs = 8;
  std::vector<Result> alone;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    auto r = run(*model, {g.cases[i]}, cfg);
    expect_matches(g, i, g.cases[i], r[0], 1e-4);
    alone.push_back(r[0]);
  }
  auto batched = run(*model, g.cases, cfg);
  for (size_t i = 0; i < g.cases.size(); ++i) expect_identical(batched[i], alone[i], "batched");

  EngineConfig small = cfg;  // chunked prefill: 7 tokens a step, pages of 4
  small.max_batched_tokens = 7;
  small.page_size = 4;
  auto chunked = run(*model, g.cases, small);
  for (size_t i = 0; i < g.cases.size(); ++i) expect_identical(chunked[i], alone[i], "chunked");

  // Preemption: a pool just large enough for the longest case alone, all cases at once, so
  // running sequences are preempted (state slot freed) and recomputed from a zero state.
  EngineConfig tight = small;
  int64_t longest = 0;
  for (const auto& c : g.cases) {
    longest = std::max<int64_t>(longest, static_cast<int64_t>(c.prompt_ids.size()) + c.max_tokens);
  }
  tight.max_model_len = longest;
  tight.num_pages = (longest + tight.page_size - 1) / tight.page_size + 2;
  tight.max_batched_tokens = 64;
  int64_t preemptions = 0;
  auto preempted = run(*model, g.cases, tight, &preemptions);
  EXPECT_GT(preemptions, 0);
  for (size_t i = 0; i < g.cases.size(); ++i) {
    expect_identical(preempted[i], alone[i], "preempted");
  }

  // Prefix cache (state checkpoints every 8 tokens): each prompt run twice in one engine, and
  // a prompt sharing only a prefix with a cached one, equal a cold engine's results.
  {
    EngineConfig pc = cfg;
    pc.page_size = 4;
    pc.state_checkpoint_interval = 8;
    pc.max_batched_tokens = 48;
    Engine engine(*model, pc);
    std::vector<GoldenCase> order = g.cases;
    for (const auto& c : g.cases) order.push_back(c);
    GoldenCase shared = g.cases.back();  // the longest prompt, cut and given a new tail
    shared.prompt_ids.resize(shared.prompt_ids.size() / 2 + 3);
    for (size_t k = shared.prompt_ids.size() - 3; k < shared.prompt_ids.size(); ++k) {
      shared.prompt_ids[k] = static_cast<int32_t>((shared.prompt_ids[k] + 7) % 100);
    }
    order.push_back(shared);
    std::vector<Result> got(order.size());
    for (size_t i = 0; i < order.size(); ++i) {  // one after the other: each can hit the last
      engine.add(greedy_request("p" + std::to_string(i), order[i]), [&, i](const StepOutput& o) {
        got[i].ids.insert(got[i].ids.end(), o.token_ids.begin(), o.token_ids.end());
        got[i].top.insert(got[i].top.end(), o.top_logprobs.begin(), o.top_logprobs.end());
        if (o.finished) ++got[i].finished;
      });
      while (engine.step()) {
      }
    }
    // The repeated longest prompt alone resumes from its deepest checkpoint.
    const int64_t longest_prompt = static_cast<int64_t>(g.cases.back().prompt_ids.size());
    EXPECT_GE(engine.stats().prefix_cache_hits, (longest_prompt - 1) / 8 * 8);
    for (size_t i = 0; i < g.cases.size(); ++i) {
      expect_identical(got[i], alone[i], "prefix cache, first run");
      expect_identical(got[g.cases.size() + i], alone[i], "prefix cache, repeated");
    }
    EngineConfig cold = cfg;
    cold.enable_prefix_cache = false;
    auto want = run(*model, {shared}, cold);
    expect_identical(got.back(), want[0], "prefix cache, shared prefix");
  }

  // One state slot: a request aborted mid-prefill gives it back at once; the next request
  // gets it (from a zero state) and reproduces its tokens.
  {
    EngineConfig one = small;
    one.max_num_seqs = 1;
    Engine engine(*model, one);
    const GoldenCase& longest = g.cases.back();
    Result aborted, next;
    engine.add(greedy_request("gone", longest), [&](const StepOutput& o) {
      if (o.finished) aborted.reason = o.finish_reason;
    });
    ASSERT_TRUE(engine.step());  // 7 of its prompt tokens
    engine.abort("gone");
    EXPECT_EQ(aborted.reason, FinishReason::kAbort);
    EXPECT_EQ(engine.stats().running, 0);
    engine.add(greedy_request("next", longest), [&](const StepOutput& o) {
      next.ids.insert(next.ids.end(), o.token_ids.begin(), o.token_ids.end());
      next.top.insert(next.top.end(), o.top_logprobs.begin(), o.top_logprobs.end());
      if (o.finished) ++next.finished;
    });
    while (engine.step()) {
    }
    expect_identical(next, alone.back(), "after an abort");
    EXPECT_EQ(engine.blocks().num_available(), engine.blocks().num_pages());
  }

  // Disaggregated decode: the prompt prefilled by a plain forward elsewhere (its own KV cache
  // and state slot); the decode engine gets the attention layers' KV pages, the recurrent
  // state and the first token, and continues exactly like the colocated run.
  for (size_t i = 0; i < g.cases.size(); ++i) {
    SCOPED_TRACE("prefilled case " + std::to_string(i));
    const GoldenCase& c = g.cases[i];
    const int64_t len = static_cast<int64_t>(c.prompt_ids.size()), ps = 8;
    KvCache src = model->make_kv_cache(64, ps);
    src.allocate_states(2, model->state_slot_elems());
    std::vector<int32_t> src_pages;
    for (int64_t p = 0; p < (len + ps - 1) / ps; ++p) {
      src_pages.push_back(static_cast<int32_t>(63 - p));
    }
    std::vector<float> logits;
    ForwardBatch b;
    b.seqs.push_back({c.prompt_ids.data(), len, 0, src_pages.data(),
                      static_cast<int64_t>(src_pages.size()), LogitsMode::kLast, 1});
    model->forward(b, src, logits);
    const int32_t first =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(first, c.output_ids[0]);
    EngineConfig dcfg = cfg;
    dcfg.page_size = ps;
    Engine e(*model, dcfg);
    std::vector<int32_t> dst_pages;
    ASSERT_TRUE(e.reserve_pages(len, dst_pages));
    const int64_t page_elems = src.geometry().page_elems();
    for (int64_t l = 0; l < src.geometry().num_layers; ++l) {
      for (size_t p = 0; p < dst_pages.size(); ++p) {
        std::copy_n(src.layer(l) + src_pages[p] * page_elems, page_elems,
                    e.kv_cache().layer(l) + dst_pages[p] * page_elems);
      }
    }
    std::vector<float> state(src.state(1), src.state(1) + src.state_slot_elems());
    EXPECT_THROW(e.add_prefilled(greedy_request("bad", c), nullptr, {}, first, 0.0f, {}), Error);
    Result dis;
    e.add_prefilled(
        greedy_request("d", c),
        [&](const StepOutput& o) {
          dis.ids.insert(dis.ids.end(), o.token_ids.begin(), o.token_ids.end());
          if (o.finished) ++dis.finished;
        },
        dst_pages, first, 0.0f, state);
    ASSERT_EQ(e.sequence_state("d").size(), 0u);  // not admitted yet: no slot
    ASSERT_TRUE(e.step());
    EXPECT_EQ(e.sequence_state("d").size(), state.size());
    while (e.step()) {
    }
    EXPECT_EQ(dis.ids, c.output_ids);
    EXPECT_EQ(dis.finished, 1);
    EXPECT_EQ(e.blocks().num_available(), e.blocks().num_pages());

    // The same through a reserved state slot that a device transfer fills
    // (TransferDescriptor::dst_state_slot): the sequence runs in that slot and frees it.
    const int64_t free_slots = e.num_free_state_slots();
    const int32_t slot = e.reserve_state_slot();
    ASSERT_GE(slot, 0);
    EXPECT_EQ(e.num_free_state_slots(), free_slots - 1);
    e.kv_cache().write_state(slot, state.data());
    std::vector<int32_t> pages2;
    ASSERT_TRUE(e.reserve_pages(len, pages2));
    for (int64_t l = 0; l < src.geometry().num_layers; ++l) {
      for (size_t p = 0; p < pages2.size(); ++p) {
        std::copy_n(src.layer(l) + src_pages[p] * page_elems, page_elems,
                    e.kv_cache().layer(l) + pages2[p] * page_elems);
      }
    }
    // Both a host state and a slot, or a slot out of range: refused.
    EXPECT_THROW(
        e.add_prefilled(greedy_request("bad", c), nullptr, pages2, first, 0.0f, state, {}, 0, slot),
        Error);
    EXPECT_THROW(e.add_prefilled(greedy_request("bad", c), nullptr, pages2, first, 0.0f, {}, {}, 0,
                                 static_cast<int32_t>(e.kv_cache().num_state_slots())),
                 Error);
    Result via_slot;
    e.add_prefilled(
        greedy_request("s", c),
        [&](const StepOutput& o) {
          via_slot.ids.insert(via_slot.ids.end(), o.token_ids.begin(), o.token_ids.end());
          if (o.finished) ++via_slot.finished;
        },
        pages2, first, 0.0f, {}, {}, 0, slot);
    while (e.step()) {
    }
    EXPECT_EQ(via_slot.ids, c.output_ids);
    EXPECT_EQ(e.num_free_state_slots(), free_slots);
    EXPECT_EQ(e.blocks().num_available(), e.blocks().num_pages());
    e.release_state_slot(e.reserve_state_slot());  // a reservation given back
    EXPECT_EQ(e.num_free_state_slots(), free_slots);
  }

  // Two state slots for three requests: admission waits for a slot.
  EngineConfig two = cfg;
  two.max_num_seqs = 2;
  auto queued = run(*model, g.cases, two);
  for (size_t i = 0; i < g.cases.size(); ++i) expect_identical(queued[i], alone[i], "two slots");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HybridGoldenTest,
                         ::testing::ValuesIn(testing::hybrid_golden_dirs()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = std::filesystem::path(info.param).filename().string();
                           for (auto& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

// A hybrid's prefix-cache state checkpoints, not given, take at most a quarter of what the live
// states leave of a budget-sized cache (a large hybrid's state is tens of MB a sequence); given,
// or with the pages given, as asked; live states that do not fit are refused with the remedy.
TEST(HybridStateBudget, DefaultCheckpointsTakeAQuarterOfWhatTheLiveStatesLeave) {
  auto model =
      load_cpu_model(testing::source_dir() + "/tests/data/fixtures/qwen35_text_hd64_int2_fused");
  const int64_t slot = model->state_slot_elems() * 4;
  ASSERT_GT(slot, 0);
  EngineConfig cfg;
  cfg.max_model_len = 128;
  cfg.max_num_seqs = 64;
  cfg.kv_cache_mb = 2;
  const int64_t budget = 2 << 20, live = 64 * slot;
  ASSERT_LT(live, budget);
  const int64_t want = std::min<int64_t>(64, (budget - live) / 4 / slot);
  ASSERT_LT(want, 64) << "the budget must be too small for one checkpoint per sequence";
  {
    Engine e(*model, cfg);
    EXPECT_EQ(e.config().num_state_checkpoints, std::max<int64_t>(want, 1));
    EXPECT_GE(e.config().num_pages * e.config().page_size, cfg.max_model_len);
  }
  {
    EngineConfig given = cfg;
    given.num_state_checkpoints = 5;
    Engine e(*model, given);
    EXPECT_EQ(e.config().num_state_checkpoints, 5);
  }
  {
    EngineConfig pages = cfg;
    pages.num_pages = 64;
    Engine e(*model, pages);
    EXPECT_EQ(e.config().num_state_checkpoints, 64);  // max_num_seqs
  }
  EngineConfig crowded = cfg;
  crowded.max_num_seqs = budget / slot + 1;
  try {
    Engine e(*model, crowded);
    ADD_FAILURE() << "live states over the budget were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lower --max-num-seqs"), std::string::npos) << e.what();
  }
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = std::filesystem::path(info.param).filename().string();
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenTest, ::testing::ValuesIn(testing::golden_dirs()),
                         param_name);

}  // namespace
}  // namespace tandem
