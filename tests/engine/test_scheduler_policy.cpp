// The step-time policy (Scheduler::set_step_time_target) over a synthetic step cost: the
// online model fits it, prompt chunks adapt to it, decode rows are always scheduled, prefill is
// never starved; and the queue-time / iteration-tokens histograms the engine reports.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>

#include "engine/scheduler.h"

namespace tandem {
namespace {

// A step's "true" duration: t = a + b*rows + c*row_ctx + d*prefill + e*prefill_ctx, plus f
// when the step has prompt tokens (a CUDA model's eager mixed step beside its decode graph).
struct TrueCost {
  double a = 2e-3, b = 4e-5, c = 2e-9, d = 2e-5, e = 4e-9, f = 0;
  double operator()(const StepShape& s) const {
    return a + b * s.decode_rows + c * s.decode_context + d * s.prefill_tokens +
           e * s.prefill_context + (s.prefill_tokens > 0 ? f : 0.0);
  }
};

std::unique_ptr<Sequence> make_seq(const std::string& id, int n) {
  auto s = std::make_unique<Sequence>();
  s->req.id = id;
  for (int i = 0; i < n; ++i) s->tokens.push_back(i % 97 + 1);
  s->req.prompt_ids = s->tokens;
  s->prompt_len = n;
  return s;
}

// A closed-loop load on one scheduler: `concurrency` requests of prompt_len tokens generating
// max_out tokens each; a finished one is replaced at once. The step's duration comes from the
// cost function (with +-3% noise) on a fake clock and is reported to the scheduler.
struct Sim {
  Sim(int64_t budget, double target_s, int concurrency, int prompt_len, int max_out,
      int64_t min_chunk = 64, double factor = 0, double mixed_cost = 0, bool staggered = false)
      : blocks(1 << 14, 16, false),
        sch(blocks, /*max_num_seqs=*/256, budget),
        concurrency(concurrency),
        prompt_len(prompt_len),
        max_out(max_out),
        staggered(staggered) {
    cost.f = mixed_cost;
    sch.set_step_time_target(target_s, min_chunk, factor);
    sch.set_clock([this] { return now; });
    for (int i = 0; i < concurrency; ++i) add();
  }

  // Staggered: prompt and output lengths uniform in [0.5, 1.5] x the given ones (a steady
  // load, as bench/serve_load.py --steady), else all equal (synchronised waves).
  void add() {
    const int id = next_id++;
    int p = prompt_len;
    if (staggered) p = std::uniform_int_distribution<int>(prompt_len / 2, prompt_len * 3 / 2)(rng);
    sch.add(make_seq("r" + std::to_string(id), p));
    out_len[sch.find("r" + std::to_string(id))] =
        staggered ? std::uniform_int_distribution<int>(max_out / 2, max_out * 3 / 2)(rng) : max_out;
  }

  struct Step {
    double seconds = 0;
    double target = 0;
    int64_t decode_rows = 0;
    int64_t prefill_tokens = 0;
    int64_t expected_decode_rows = 0;  // running sequences ready to decode before the step
  };

  // One step; false when there was nothing to do.
  bool step(Step& out) {
    out = {};
    for (const std::string& id : sch.live_ids()) {
      const Sequence* s = sch.find(id);
      if (s->num_computed >= s->prompt_len &&
          static_cast<int64_t>(s->tokens.size()) - s->num_computed == 1) {
        ++out.expected_decode_rows;
      }
    }
    ScheduledBatch b = sch.schedule();
    if (b.empty()) return false;
    out.target = sch.last_step_target();
    out.decode_rows = static_cast<int64_t>(b.shape.decode_rows);
    out.prefill_tokens = static_cast<int64_t>(b.shape.prefill_tokens);
    out.seconds = cost(b.shape) * (1.0 + noise(rng));
    now += out.seconds;
    sch.observe_step(b.shape, out.seconds);
    sch.commit(b);
    std::vector<std::string> done;
    for (const auto& ss : b.seqs) {
      Sequence* s = ss.seq;
      if (s->num_computed != static_cast<int64_t>(s->tokens.size())) continue;
      s->tokens.push_back(5);  // sampled
      ++generated;
      if (s->num_output() >= out_len[s]) done.push_back(s->req.id);
    }
    for (const std::string& id : done) {
      out_len.erase(sch.find(id));
      sch.remove(id);
      ++finished;
      add();
    }
    return true;
  }

  BlockManager blocks;
  Scheduler sch;
  TrueCost cost;
  int concurrency, prompt_len, max_out;
  bool staggered = false;
  std::map<const Sequence*, int> out_len;
  int next_id = 0;
  double now = 0;
  int64_t generated = 0, finished = 0;
  std::mt19937 rng{7};
  std::uniform_real_distribution<double> noise{-0.03, 0.03};
};

double pct(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

TEST(StepCostModel, RecoversTheCostFromMeasuredSteps) {
  const TrueCost truth;
  StepCostModel m;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> rows(0, 128), ctx(1, 2048), pre(0, 2048);
  for (int i = 0; i < 300; ++i) {
    StepShape s;
    const int r = rows(rng);
    for (int k = 0; k < r; ++k) s.add(ctx(rng), 1, true);
    const int p = i % 3 == 0 ? 0 : pre(rng);
    if (p > 0) s.add(ctx(rng), p, false);
    m.observe(s, truth(s));
  }
  ASSERT_TRUE(m.ready());
  const auto c = m.coefficients();
  EXPECT_NEAR(c[0], truth.a, 0.05 * truth.a);
  EXPECT_NEAR(c[1], truth.b, 0.05 * truth.b);
  EXPECT_NEAR(c[3], truth.d, 0.05 * truth.d);
  EXPECT_NEAR(c[4], truth.e, 0.05 * truth.e);
  StepShape probe;
  for (int k = 0; k < 100; ++k) probe.add(1000, 1, true);
  probe.add(300, 700, false);
  EXPECT_NEAR(m.predict(probe), truth(probe), 0.01 * truth(probe));
  // prefill_tokens_within inverts prefill_cost.
  const double budget = 0.01;
  const int64_t n = m.prefill_tokens_within(budget, 500);
  EXPECT_LE(m.prefill_cost(500, n), budget * (1 + 1e-9));
  EXPECT_GT(m.prefill_cost(500, n + 1), budget);
  EXPECT_EQ(m.prefill_tokens_within(0.0, 500), 0);
}

TEST(StepCostModel, SeparatesTheMixedStepCost) {
  // Decode-only steps (a graph) and mixed steps (eager, f = 3 ms more): the fit finds f, and
  // a decode-only step is predicted without it.
  TrueCost truth;
  truth.f = 3e-3;
  StepCostModel m;
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> rows(1, 128), ctx(1, 2048), pre(1, 2048);
  for (int i = 0; i < 300; ++i) {
    StepShape s;
    const int r = rows(rng);
    for (int k = 0; k < r; ++k) s.add(ctx(rng), 1, true);
    if (i % 3 == 0) s.add(ctx(rng), pre(rng), false);
    m.observe(s, truth(s));
  }
  const auto c = m.coefficients();
  ASSERT_EQ(c.size(), 6u);
  EXPECT_NEAR(c[5], truth.f, 0.05 * truth.f);
  EXPECT_NEAR(m.mixed_cost(), truth.f, 0.05 * truth.f);
  EXPECT_NEAR(c[0], truth.a, 0.05 * truth.a);
  StepShape decode;
  for (int k = 0; k < 64; ++k) decode.add(1000, 1, true);
  EXPECT_NEAR(m.predict(decode), truth(decode), 0.01 * truth(decode));
  StepShape mixed = decode;
  mixed.add(0, 512, false);
  EXPECT_NEAR(m.predict(mixed), truth(mixed), 0.01 * truth(mixed));
}

TEST(StepCostModel, CoefficientsStayNonNegative) {
  // Step time independent of the prefill context, with noise: the fit must not go negative
  // (a negative term would let chunks grow without bound).
  StepCostModel m;
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> noise(-0.2, 0.2);
  std::uniform_int_distribution<int> pre(1, 512), ctx(0, 4096);
  for (int i = 0; i < 200; ++i) {
    StepShape s;
    s.add(ctx(rng), pre(rng), false);
    m.observe(s, 1e-3 + 1e-5 * s.prefill_tokens * (1 + noise(rng)));
  }
  for (double c : m.coefficients()) EXPECT_GE(c, 0.0);
  EXPECT_GT(m.prefill_cost(0, 100), 0.0);
}

TEST(SchedulerPolicy, StepsMeetTheTargetAndDecodeRowsAlwaysRun) {
  const double target = 0.010;  // 10 ms; decode of ~32 rows alone is ~3.5 ms
  for (bool on : {false, true}) {
    Sim sim(/*budget=*/2048, on ? target : 0.0, /*concurrency=*/32, /*prompt_len=*/600,
            /*max_out=*/48);
    std::vector<double> late;  // after the model is ready
    int over = 0;
    Sim::Step st;
    for (int i = 0; i < 1500 && sim.step(st); ++i) {
      EXPECT_EQ(st.decode_rows, st.expected_decode_rows) << "step " << i << " on " << on;
      if (i < 20) continue;
      late.push_back(st.seconds);
      if (st.seconds > target * 1.1) ++over;
      if (on) EXPECT_DOUBLE_EQ(st.target, target);
    }
    ASSERT_GT(late.size(), 1000u);
    if (on) {
      // Within the target, but for the steps the 64-token floor alone pushes over it.
      EXPECT_LE(over, static_cast<int>(late.size() / 50)) << "steps over the target";
      EXPECT_LE(pct(late, 0.99), 3.0 * pct(late, 0.5));
    } else {
      // The token budget alone: whole prompts in one step, far over the target (what the
      // policy is for; this also shows the check above can fail).
      EXPECT_GT(over, static_cast<int>(late.size() / 20));
    }
    EXPECT_GT(sim.finished, 500);
  }
}

TEST(SchedulerPolicy, ThroughputStaysNearThePolicyOffRun) {
  // Same closed-loop load, same true cost: output tokens per simulated second with the
  // policy within 10% of the token budget's.
  // This load is prefill-bound (a prompt costs 12 ms, a decode step of 32 rows 3.3 ms).
  auto rate = [](double target, double factor = 0) {
    Sim sim(2048, target, 32, 600, 48, /*min_chunk=*/64, factor);
    Sim::Step st;
    for (int i = 0; i < 3000 && sim.step(st); ++i) {
    }
    return static_cast<double>(sim.generated) / sim.now;
  };
  const double off = rate(0.0), on = rate(0.010), autot = rate(-1.0), f3 = rate(-1.0, 3.0);
  std::printf("closed-loop output tok/s: off %.0f, 10 ms %.0f, auto %.0f, factor 3 %.0f\n", off, on,
              autot, f3);
  EXPECT_GT(on, 0.9 * off) << "off " << off << " on " << on;
  EXPECT_GT(autot, 0.9 * off) << "off " << off << " auto " << autot;
  EXPECT_GT(f3, 0.9 * off) << "off " << off << " factor 3 " << f3;
}

TEST(SchedulerPolicy, DecodeFactorMeetsTheRatioAtTheOffRunsThroughput) {
  // The relative target (auto, factor 3: a step at most 3x the predicted decode-only step
  // over the live sequences) with an eager mixed-step cost, on a steady load (staggered
  // lengths) and on synchronised waves: output tok/s within 10% of the policy off, and on the
  // steady load step p99 <= 3x p50 (one sample per decode row, as ITL). Off, the same loads
  // miss the ratio (so the check can fail).
  constexpr double kFactor = 3.0;
  for (bool staggered : {true, false}) {
    auto run = [&](double target, double factor, double& ratio) {
      // About the H200 8-layer figures: decode step 2 + 0.02 * rows ms, 3.5 us per prompt token.
      Sim sim(/*budget=*/8192, target, /*concurrency=*/128, /*prompt_len=*/1024, /*max_out=*/256,
              /*min_chunk=*/16, factor, /*mixed_cost=*/2e-3, staggered);
      sim.cost.b = 2e-5;
      sim.cost.d = 3.5e-6;
      std::vector<double> per_row;  // a step's time once per decode row: the ITL samples
      Sim::Step st;
      for (int i = 0; i < 6000 && sim.step(st); ++i) {
        if (i < 600) continue;
        for (int64_t r = 0; r < st.decode_rows; ++r) per_row.push_back(st.seconds);
      }
      ratio = pct(per_row, 0.99) / pct(per_row, 0.5);
      return static_cast<double>(sim.generated) / sim.now;
    };
    double r_off = 0, r_on = 0;
    const double off = run(0.0, 0.0, r_off), on = run(-1.0, kFactor, r_on);
    std::printf("%s: off %.0f tok/s, ITL p99/p50 %.2f; factor %.1f %.0f tok/s, %.2f\n",
                staggered ? "steady" : "waves", off, r_off, kFactor, on, r_on);
    EXPECT_GT(on, 0.9 * off) << (staggered ? "steady" : "waves");
    // Waves: the few rows decoding while a wave's prompts prefill see the 3x steps, and they
    // are about 1% of the samples (3.02 here): the ratio is met on the steady load only.
    EXPECT_LE(r_on, staggered ? 3.0 : 3.5) << (staggered ? "steady" : "waves");
    EXPECT_GT(r_off, 4.0) << (staggered ? "steady" : "waves");
  }
}

TEST(SchedulerPolicy, ChunksAdaptToTheCost) {
  // Twice, with prefill 4x dearer the second time: prompt tokens per step follow the cost,
  // decode rows stay scheduled, and both runs meet the target.
  auto mean_prefill = [](double per_token) {
    Sim sim(4096, 0.012, 16, 2000, 400, /*min_chunk=*/16);
    sim.cost.d = per_token;
    Sim::Step st;
    double sum = 0;
    int n = 0;
    for (int i = 0; i < 1500 && sim.step(st); ++i) {
      EXPECT_EQ(st.decode_rows, st.expected_decode_rows);
      if (i < 50 || st.prefill_tokens == 0) continue;
      EXPECT_LE(st.seconds, 0.012 * 1.15 + per_token * 16) << "step " << i;
      sum += static_cast<double>(st.prefill_tokens);
      ++n;
    }
    EXPECT_GT(n, 100);
    return sum / n;
  };
  const double cheap = mean_prefill(1e-5), dear = mean_prefill(4e-5);
  EXPECT_GT(cheap, 2.0 * dear) << "cheap " << cheap << " dear " << dear;
}

TEST(SchedulerPolicy, PrefillIsNeverStarved) {
  // The decode rows alone take longer than the target: every step still computes the floor
  // (64 prompt tokens), so a waiting prompt gets admitted and reaches its first token.
  BlockManager blocks(4096, 16, false);
  Scheduler sch(blocks, 64, 4096);
  sch.set_step_time_target(0.001, 64);
  TrueCost cost;
  cost.a = 5e-3;  // > the 1 ms target
  int64_t steps = 0;
  auto run = [&](int n) {
    for (int i = 0; i < n; ++i, ++steps) {
      ScheduledBatch b = sch.schedule();
      ASSERT_FALSE(b.empty());
      sch.observe_step(b.shape, cost(b.shape));
      sch.commit(b);
      for (const auto& ss : b.seqs) {
        if (ss.seq->num_computed == static_cast<int64_t>(ss.seq->tokens.size())) {
          ss.seq->tokens.push_back(3);
        }
      }
    }
  };
  for (int i = 0; i < 8; ++i) {  // 8 short prompts, one a step: decoding, the model fit
    sch.add(make_seq("d" + std::to_string(i), 32));
    run(1);
  }
  run(4);
  ASSERT_TRUE(sch.cost_model().ready());
  sch.add(make_seq("long", 1000));
  Sequence* s = sch.find("long");
  for (int i = 0; i < 16 && s->num_output() == 0; ++i) {
    const int64_t before = s->num_computed;
    run(1);
    if (s->num_output() == 0) {
      EXPECT_GE(s->num_computed - before, 62) << "step " << i;  // 64 (less the last token's)
    }
  }
  EXPECT_GT(s->num_output(), 0) << "the prompt never finished: computed " << s->num_computed;
}

TEST(SchedulerPolicy, RampsUpUntilTheModelIsReady) {
  // No fit yet: prompt tokens per step double from the floor (16, 32, 64, 128); then (4
  // prefill steps seen) the model sizes them: a 1 us target leaves the floor alone.
  BlockManager blocks(1024, 16, false);
  Scheduler sch(blocks, 8, 512);
  sch.set_step_time_target(1e-6, 16);
  sch.add(make_seq("a", 400));
  std::vector<int64_t> chunks;
  for (int i = 0; i < 6; ++i) {
    ScheduledBatch b = sch.schedule();
    ASSERT_EQ(b.seqs.size(), 1u);
    EXPECT_EQ(sch.last_step_target(), i < 4 ? 0.0 : 1e-6) << i;
    chunks.push_back(b.seqs[0].num_tokens);
    sch.observe_step(b.shape, 1e-3 * static_cast<double>(b.seqs[0].num_tokens));
    sch.commit(b);
  }
  EXPECT_EQ(chunks, (std::vector<int64_t>{16, 32, 64, 128, 16, 16}));
  EXPECT_THROW(sch.set_step_time_target(NAN), Error);
  EXPECT_THROW(sch.set_step_time_target(0.01, 0), Error);
}

TEST(SchedulerPolicy, VerifiesDraftsAsTheTokenBudgetDoes) {
  // MTP drafts: a decode row with drafts is verified (the last token and its drafts) under the
  // policy too.
  BlockManager blocks(256, 16, false);
  Scheduler sch(blocks, 8, 512);
  sch.set_step_time_target(0.010, 16);
  TrueCost cost;
  for (int i = 1; i <= 4; ++i) {  // a fit from synthetic steps
    StepShape sh;
    sh.add(0, 64 * i, false);
    sh.add(100, 1, true);
    sch.observe_step(sh, cost(sh));
  }
  ASSERT_TRUE(sch.cost_model().ready());
  sch.add(make_seq("a", 8));
  ScheduledBatch b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_EQ(b.seqs[0].num_tokens, 8);
  sch.commit(b);
  Sequence* s = sch.find("a");
  s->tokens.push_back(40);
  s->spec.tokens = {40, 41, 42};
  b = sch.schedule();
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_TRUE(b.seqs[0].verify);
  EXPECT_EQ(b.seqs[0].num_tokens, 3);
  EXPECT_EQ(b.seqs[0].logits, LogitsMode::kAll);
  EXPECT_EQ(b.forward.seqs[0].tokens, s->spec.tokens.data());
  EXPECT_EQ(b.shape.decode_rows, 3);
}

TEST(SchedulerMetrics, QueueTimeAndIterationTokens) {
  BlockManager blocks(64, 4, false);
  Scheduler sch(blocks, /*max_num_seqs=*/1, /*max_batched_tokens=*/100);
  double now = 10.0;
  sch.set_clock([&] { return now; });
  sch.add(make_seq("a", 5));
  sch.add(make_seq("b", 7));  // waits for a (one running sequence at most)
  now = 10.5;
  ScheduledBatch b = sch.schedule();  // a: queued 0.5 s, 5 tokens
  sch.commit(b);
  b.seqs[0].seq->tokens.push_back(1);
  now = 11.0;
  b = sch.schedule();  // a decodes: 1 token
  sch.commit(b);
  sch.remove("a");
  now = 13.0;
  b = sch.schedule();  // b: queued 3 s, 7 tokens
  sch.commit(b);
  const HistogramCounts& q = sch.queue_time();
  EXPECT_EQ(q.count, 2u);
  EXPECT_NEAR(q.sum, 3.5, 1e-12);
  ASSERT_EQ(q.buckets.size(), kQueueTimeBounds.size() + 1);
  // 0.5 s in the bucket (0.3, 0.5], 3 s in (2.5, 5].
  std::map<double, uint64_t> by_bound;
  for (size_t i = 0; i < kQueueTimeBounds.size(); ++i) by_bound[kQueueTimeBounds[i]] = q.buckets[i];
  EXPECT_EQ(by_bound[0.5], 1u);
  EXPECT_EQ(by_bound[5.0], 1u);
  const HistogramCounts& it = sch.iteration_tokens();
  EXPECT_EQ(it.count, 3u);
  EXPECT_DOUBLE_EQ(it.sum, 13.0);
  EXPECT_EQ(it.buckets[0], 1u);  // 1 token: le 1
  EXPECT_EQ(it.buckets[1], 2u);  // 5 and 7: le 8
  // Preempted and readmitted: queued once only.
  now = 20.0;
  b = sch.schedule();
  EXPECT_EQ(sch.queue_time().count, 2u);
}

}  // namespace
}  // namespace tandem
