// The engine's token constraints: the mask is applied before sampling (on the host), the
// sampled token reported after, the mask filled on the worker thread, a rejected token or a
// failing mask ends that request alone with an error, and a finished or aborted request
// releases its constraint.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "core/error.h"
#include "engine/engine.h"
#include "golden.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

Model& model() {
  static std::unique_ptr<Model> m =
      Qwen3MoeCpu::load(testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2");
  return *m;
}

/// Allows exactly the next token of a script (then anything); records what it saw.
class ScriptConstraint : public TokenConstraint {
 public:
  explicit ScriptConstraint(std::vector<int32_t> script, int reject_at = -1, int throw_at = -1)
      : script_(std::move(script)), reject_at_(reject_at), throw_at_(throw_at) {}
  bool fill_next_mask(std::span<uint32_t> mask) override {
    fill_threads.push_back(std::this_thread::get_id());
    if (static_cast<int>(accepted.size()) == throw_at_) throw std::runtime_error("boom");
    if (accepted.size() >= script_.size()) return false;
    std::fill(mask.begin(), mask.end(), 0u);
    const int32_t t = script_[accepted.size()];
    mask[static_cast<size_t>(t) / 32] |= 1u << (t % 32);
    return true;
  }
  bool accept(int32_t token, std::string& error) override {
    if (static_cast<int>(accepted.size()) == reject_at_) {
      error = "rejected " + std::to_string(token);
      return false;
    }
    accepted.push_back(token);
    return true;
  }
  std::vector<int32_t> accepted;
  std::vector<std::thread::id> fill_threads;

 private:
  std::vector<int32_t> script_;
  int reject_at_, throw_at_;
};

struct Result {
  std::vector<int32_t> ids;
  FinishReason reason = FinishReason::kNone;
  std::string error;
  int finished = 0;
};

GenRequest make(const std::string& id, int max_tokens, uint64_t seed) {
  GenRequest r;
  r.id = id;
  r.prompt_ids = {5, 17, 42, 99, 3, 8};
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.sampling.temperature = 1.0f;  // random: the constraint must do the work
  r.sampling.seed = seed;
  return r;
}

OutputCallback collect(Result& r) {
  return [&r](const StepOutput& o) {
    r.ids.insert(r.ids.end(), o.token_ids.begin(), o.token_ids.end());
    if (o.finished) {
      r.reason = o.finish_reason;
      r.error = o.error;
      ++r.finished;
    }
  };
}

void drain(Engine& e) {
  for (int guard = 0; e.step(); ++guard) ASSERT_LT(guard, 10000);
}

EngineConfig config() {
  EngineConfig cfg;
  cfg.max_model_len = 128;
  return cfg;
}

TEST(EngineConstraint, MaskedRowsFollowTheScriptOthersAreUntouched) {
  // The unconstrained request alone, for reference.
  Result ref;
  {
    Engine e(model(), config());
    e.add(make("free", 10, 7), collect(ref));
    drain(e);
  }
  std::mt19937 rng(5);
  const int64_t vocab = model().config().vocab_size;
  Engine e(model(), config());
  std::vector<std::shared_ptr<ScriptConstraint>> cs;
  std::vector<Result> got(4);
  std::vector<std::vector<int32_t>> scripts;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> script;
    for (int k = 0; k < 10; ++k) script.push_back(static_cast<int32_t>(rng() % vocab));
    scripts.push_back(script);
    cs.push_back(std::make_shared<ScriptConstraint>(script));
    GenRequest r = make("c" + std::to_string(i), 10, 100 + i);
    r.constraint = cs.back();
    e.add(std::move(r), collect(got[i]));
  }
  Result free;
  e.add(make("free", 10, 7), collect(free));
  drain(e);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(got[i].reason, FinishReason::kLength);
    EXPECT_EQ(got[i].ids, scripts[i]);
    EXPECT_EQ(cs[i]->accepted, scripts[i]);
    for (auto id : cs[i]->fill_threads) EXPECT_NE(id, std::this_thread::get_id());  // worker
  }
  EXPECT_EQ(free.ids, ref.ids);  // the masks stay in their own rows
}

TEST(EngineConstraint, RejectedTokenOrFailingMaskEndsOnlyThatRequest) {
  Engine e(model(), config());
  Result a, b, c;
  GenRequest ra = make("a", 8, 1), rb = make("b", 8, 2), rc = make("c", 8, 3);
  ra.constraint = std::make_shared<ScriptConstraint>(std::vector<int32_t>{}, /*reject_at=*/2);
  rb.constraint = std::make_shared<ScriptConstraint>(std::vector<int32_t>{}, -1, /*throw_at=*/3);
  e.add(std::move(ra), collect(a));
  e.add(std::move(rb), collect(b));
  e.add(std::move(rc), collect(c));
  drain(e);
  EXPECT_EQ(a.reason, FinishReason::kError);
  EXPECT_EQ(a.ids.size(), 2u);
  EXPECT_NE(a.error.find("rejected"), std::string::npos) << a.error;
  EXPECT_EQ(b.reason, FinishReason::kError);
  EXPECT_EQ(b.ids.size(), 3u);
  EXPECT_NE(b.error.find("boom"), std::string::npos) << b.error;
  EXPECT_EQ(c.reason, FinishReason::kLength);
  EXPECT_EQ(c.ids.size(), 8u);
  EXPECT_EQ(e.blocks().num_available(), e.blocks().num_pages());
}

TEST(EngineConstraint, FinishedAndAbortedRequestsReleaseTheirConstraint) {
  Engine e(model(), config());
  auto done = std::make_shared<ScriptConstraint>(std::vector<int32_t>{1, 2, 3});
  auto aborted = std::make_shared<ScriptConstraint>(std::vector<int32_t>{4, 5, 6});
  std::weak_ptr<ScriptConstraint> wd = done, wa = aborted;
  Result rd, ra;
  GenRequest a = make("done", 3, 1), b = make("aborted", 50, 2);
  a.constraint = std::move(done);
  b.constraint = std::move(aborted);
  e.add(std::move(a), collect(rd));
  e.add(std::move(b), collect(ra));
  for (int i = 0; i < 3; ++i) e.step();
  e.abort("aborted");
  drain(e);
  EXPECT_EQ(rd.ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(ra.reason, FinishReason::kAbort);
  EXPECT_TRUE(wd.expired());
  EXPECT_TRUE(wa.expired());
}

// A request from a router carries its constraint as a spec: the engine builds it with its
// factory (here: the spec is the script, "7,8,9"), in add() and in add_prefilled() (which
// advances it past the prefill's first token); without a factory it is refused.
TEST(EngineConstraint, SpecBuiltByTheFactoryWhereTheRequestSamples) {
  std::vector<std::shared_ptr<ScriptConstraint>> built;
  EngineConfig cfg = config();
  cfg.constraint_factory = [&](const std::string& spec) -> std::shared_ptr<TokenConstraint> {
    std::vector<int32_t> script;
    for (size_t at = 0; at < spec.size();) {
      const size_t comma = std::min(spec.find(',', at), spec.size());
      script.push_back(std::stoi(spec.substr(at, comma - at)));
      at = comma + 1;
    }
    built.push_back(std::make_shared<ScriptConstraint>(script));
    return built.back();
  };
  Engine e(model(), cfg);
  Result a, b;
  GenRequest ra = make("a", 3, 1);
  ra.constraint_spec = "7,8,9";
  e.add(std::move(ra), collect(a));
  std::vector<int32_t> pages;
  ASSERT_TRUE(e.reserve_pages(6, pages));
  GenRequest rb = make("b", 3, 2);
  rb.constraint_spec = "4,5,6";
  e.add_prefilled(std::move(rb), collect(b), pages, /*first_token=*/4, 0.0f);
  drain(e);
  ASSERT_EQ(built.size(), 2u);
  EXPECT_EQ(a.ids, (std::vector<int32_t>{7, 8, 9}));
  EXPECT_EQ(b.ids, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(built[1]->accepted, (std::vector<int32_t>{4, 5, 6}));

  Engine plain(model(), config());
  GenRequest rc = make("c", 3, 3);
  rc.constraint_spec = "1";
  try {
    plain.validate(rc);
    ADD_FAILURE() << "a spec without a factory was accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(err.message().find("structured outputs"), std::string::npos) << err.message();
  }
}

TEST(MaskWorker, EveryJobFilledOnceBySeveralThreads) {
  for (int threads : {1, 3}) {
    MaskWorker w(/*vocab=*/100, threads);
    for (int round = 0; round < 20; ++round) {
      const int n = round % 7;  // 0 jobs too
      std::vector<std::shared_ptr<ScriptConstraint>> cs;
      std::vector<std::vector<uint32_t>> masks(static_cast<size_t>(n));
      std::unique_ptr<bool[]> active(new bool[static_cast<size_t>(n) + 1]());
      std::vector<std::string> errors(static_cast<size_t>(n));
      std::vector<MaskWorker::Job> jobs;
      for (int i = 0; i < n; ++i) {
        cs.push_back(std::make_shared<ScriptConstraint>(std::vector<int32_t>{i + 1}));
        jobs.push_back(
            {cs.back().get(), &masks[size_t(i)], &active[size_t(i)], &errors[size_t(i)]});
      }
      w.start(std::move(jobs));
      w.wait();
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(cs[size_t(i)]->fill_threads.size(), 1u);
        ASSERT_EQ(masks[size_t(i)].size(), 4u);
        EXPECT_TRUE(active[size_t(i)]);
        EXPECT_EQ(masks[size_t(i)][0], 1u << (i + 1));
      }
    }
  }
}

}  // namespace
}  // namespace tandem
