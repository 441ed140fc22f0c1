// Structured outputs with MTP speculative decoding (the demo model with random MTP weights):
// a constrained request speculates, its drafts masked by the grammar advanced along them and
// each verified position masked with the state after the tokens before it.
//  - greedy: the output is token for token the non-speculative constrained output, for
//    K = 1..4, alone and batched with unconstrained requests, and grammar-valid;
//  - the masked drafts are accepted where the grammar leaves one choice (random weights would
//    almost never be: the drafts follow the grammar);
//  - oracle drafts (the reference continuation, some replaced by random tokens the grammar
//    refuses) are accepted or rejected exactly as the target says;
//  - sampled requests stay grammar-valid;
//  - the constraint rolls back what the drafts advanced (undo of think phases included).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "engine/engine.h"
#include "engine/mtp_weights.h"
#include "model/qwen3_moe.h"
#include "server/grammar/grammar.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string demo_dir() { return std::string(TANDEM_SOURCE_DIR) + "/models/demo"; }

struct Fixture {
  Fixture() {
    mtp = (fs::temp_directory_path() / ("tandem_so_mtp_" + std::to_string(::getpid()))).string();
    testing::write_random_mtp(demo_dir(), mtp, 3);
    model = Qwen3MoeCpu::load(demo_dir());
    model->load_mtp(mtp);
    tok = Tokenizer::from_dir(demo_dir());
    std::vector<int32_t> eos;
    for (int64_t id : model->config().eos_token_ids) eos.push_back(static_cast<int32_t>(id));
    compiler = std::make_unique<grammar::GrammarCompiler>(*tok, model->config().vocab_size, eos);
  }
  ~Fixture() { fs::remove_all(mtp); }
  std::string mtp;
  std::unique_ptr<Qwen3MoeCpu> model;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<grammar::GrammarCompiler> compiler;
};

Fixture& fx() {
  static Fixture f;
  return f;
}

const char* kPerson = R"({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "member": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]}},
  "required": ["name", "age", "member", "color"], "additionalProperties": false})";

struct Case {
  std::string label;
  grammar::GrammarSpec spec;
  std::function<void(const std::string&)> check;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  c.push_back(
      {"json_schema", {grammar::GrammarKind::kJsonSchema, kPerson}, [](const std::string& t) {
         json j = json::parse(t, nullptr, false);
         ASSERT_TRUE(j.is_object()) << t;
         EXPECT_EQ(j.size(), 4u) << t;
         EXPECT_TRUE(j["age"].is_number_integer()) << t;
         EXPECT_TRUE(j["member"].is_boolean()) << t;
         EXPECT_TRUE(j["color"] == "red" || j["color"] == "green" || j["color"] == "blue");
       }});
  c.push_back({"regex",
               {grammar::GrammarKind::kRegex, "(yes|no), [a-z]{3,8} [0-9]{2}"},
               [](const std::string& t) {
                 EXPECT_TRUE(std::regex_match(t, std::regex("(yes|no), [a-z]{3,8} [0-9]{2}"))) << t;
               }});
  grammar::GrammarSpec choice{grammar::GrammarKind::kChoice};
  choice.choices = {"Emma Woodhouse", "Mr. Knightley", "Harriet Smith"};
  c.push_back({"choice", choice, [](const std::string& t) {
                 EXPECT_TRUE(t == "Emma Woodhouse" || t == "Mr. Knightley" || t == "Harriet Smith")
                     << t;
               }});
  return c;
}

struct Out {
  std::vector<int32_t> ids;
  FinishReason reason = FinishReason::kNone;
  std::string error;
};

GenRequest request(const std::string& id, std::vector<int32_t> prompt, float temperature,
                   uint64_t seed) {
  GenRequest r;
  r.id = id;
  r.prompt_ids = std::move(prompt);
  r.max_tokens = 60;
  r.sampling.temperature = temperature;
  r.sampling.seed = seed;
  return r;
}

std::shared_ptr<TokenConstraint> constraint(const grammar::GrammarSpec& spec) {
  grammar::ConstraintOptions o;
  o.grammar = fx().compiler->compile(spec);
  o.vocab_size = fx().compiler->vocab_size();
  return grammar::make_constraint(o);
}

/// Runs the requests (constrained by `spec` where `constrained[i]`) through one engine.
std::vector<Out> run(const std::vector<GenRequest>& reqs, const std::vector<bool>& constrained,
                     const grammar::GrammarSpec& spec, EngineConfig cfg, EngineStats* stats) {
  cfg.max_model_len = 512;
  cfg.kv_cache_mb = 16;
  Engine e(*fx().model, cfg);
  std::vector<Out> outs(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    GenRequest r = reqs[i];
    if (constrained[i]) r.constraint = constraint(spec);
    Out& o = outs[i];
    e.add(std::move(r), [&o](const StepOutput& s) {
      o.ids.insert(o.ids.end(), s.token_ids.begin(), s.token_ids.end());
      if (s.finished) {
        o.reason = s.finish_reason;
        o.error = s.error;
      }
    });
  }
  for (int guard = 0; e.step(); ++guard) EXPECT_LT(guard, 5000);
  EXPECT_EQ(e.blocks().num_available(), e.blocks().num_pages()) << "leaked KV pages";
  if (stats) *stats = e.stats();
  return outs;
}

std::string text(const Out& o) {
  std::vector<int32_t> ids = o.ids;
  if (o.reason == FinishReason::kStop && !ids.empty()) ids.pop_back();  // the EOS
  return fx().tok->decode(ids);
}

std::vector<GenRequest> prompts(float temperature) {
  std::vector<GenRequest> reqs;
  const char* texts[] = {"Emma said", "It is a truth universally acknowledged", "Mr. Knightley",
                         "The weather at Hartfield"};
  for (int i = 0; i < 4; ++i) {
    reqs.push_back(request("r" + std::to_string(i), fx().tok->encode(texts[i]), temperature,
                           100 + static_cast<uint64_t>(i)));
  }
  return reqs;
}

TEST(StructuredSpec, GreedyEqualsNonSpeculativeForK1To4) {
  const std::vector<GenRequest> reqs = prompts(0.0f);
  const std::vector<bool> constrained = {true, false, true, true};  // one free row in the batch
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.label);
    const std::vector<Out> want = run(reqs, constrained, c.spec, EngineConfig{}, nullptr);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_TRUE(want[i].error.empty()) << want[i].error;
      if (constrained[i]) {
        EXPECT_EQ(want[i].reason, FinishReason::kStop) << c.label << " " << i;
        c.check(text(want[i]));
      }
    }
    for (int64_t k = 1; k <= 4; ++k) {
      EngineConfig cfg;
      cfg.num_speculative_tokens = k;
      EngineStats st;
      const std::vector<Out> got = run(reqs, constrained, c.spec, cfg, &st);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ(got[i].ids, want[i].ids) << c.label << " K=" << k << " request " << i;
        EXPECT_EQ(got[i].reason, want[i].reason);
        EXPECT_TRUE(got[i].error.empty()) << got[i].error;
      }
      EXPECT_GT(st.spec_num_drafts, 0) << "constrained requests speculate";
      // Masked drafts follow the grammar: where it leaves one choice they are accepted.
      if (c.label == "json_schema") EXPECT_GT(st.spec_num_accepted_tokens, 0) << "K=" << k;
    }
  }
}

TEST(StructuredSpec, OracleDraftsAcceptedOrRejectedAsTheTargetSays) {
  const std::vector<GenRequest> reqs = prompts(0.0f);
  const std::vector<bool> constrained(reqs.size(), true);
  const Case c = cases()[0];
  const std::vector<Out> want = run(reqs, constrained, c.spec, EngineConfig{}, nullptr);
  std::map<std::string, std::vector<int32_t>> full;
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::vector<int32_t> t = reqs[i].prompt_ids;
    t.insert(t.end(), want[i].ids.begin(), want[i].ids.end());
    full[reqs[i].id] = t;
  }
  auto rng = std::make_shared<std::mt19937_64>(5);
  const int64_t vocab = fx().model->config().vocab_size;
  for (int64_t k : {2, 4}) {
    EngineConfig cfg;
    cfg.num_speculative_tokens = k;
    cfg.spec_draft_hook = [&full, rng, vocab](const std::string& id,
                                              std::span<const int32_t> tokens,
                                              std::vector<int32_t>& drafts) {
      const auto& w = full.at(id);
      for (size_t m = 0; m < drafts.size(); ++m) {
        const size_t pos = tokens.size() + m;
        if (pos < w.size()) drafts[m] = w[pos];
        if ((*rng)() % 10 < 2) drafts[m] = static_cast<int32_t>((*rng)() % vocab);
      }
    };
    EngineStats st;
    const std::vector<Out> got = run(reqs, constrained, c.spec, cfg, &st);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].ids, want[i].ids) << "K=" << k << " request " << i;
      EXPECT_TRUE(got[i].error.empty()) << got[i].error;
    }
    EXPECT_GT(st.spec_num_accepted_tokens, st.spec_num_draft_tokens / 3) << "K=" << k;
  }
}

TEST(StructuredSpec, SampledRequestsStayValid) {
  const std::vector<GenRequest> reqs = prompts(1.0f);
  const std::vector<bool> constrained(reqs.size(), true);
  for (const Case& c : cases()) {
    EngineConfig cfg;
    cfg.num_speculative_tokens = 3;
    EngineStats st;
    const std::vector<Out> got = run(reqs, constrained, c.spec, cfg, &st);
    for (const Out& o : got) {
      EXPECT_TRUE(o.error.empty()) << c.label << ": " << o.error;
      if (o.reason == FinishReason::kStop) c.check(text(o));
    }
    EXPECT_GT(st.spec_num_drafts, 0);
  }
}

TEST(StructuredSpec, RollbackUndoesDraftsThroughTheThinkBlock) {
  grammar::ConstraintOptions o;
  o.grammar = fx().compiler->compile({grammar::GrammarKind::kRegex, "ab"});
  o.vocab_size = fx().compiler->vocab_size();
  o.think = grammar::ThinkStart::kAuto;
  o.think_start_id = fx().compiler->think_start_id();
  o.think_end_id = fx().compiler->think_end_id();
  o.thinking_budget = 1;
  ASSERT_GE(o.think_end_id, 0);
  auto c = grammar::make_constraint(o);
  ASSERT_TRUE(c->can_rollback());
  const int64_t vocab = fx().compiler->vocab_size();
  std::vector<uint32_t> start(static_cast<size_t>(bitmask_words(vocab))), mask = start;
  ASSERT_TRUE(c->fill_next_mask(start));
  const std::vector<int32_t> a = fx().tok->encode("a"), b = fx().tok->encode("b");
  std::string err;
  // <think> x </think> a: four tokens through every phase, then undone.
  const int32_t x = a[0];
  for (int32_t t : {o.think_start_id, x, o.think_end_id, a[0]})
    ASSERT_TRUE(c->accept(t, err)) << err;
  c->rollback(4);
  ASSERT_TRUE(c->fill_next_mask(mask));
  EXPECT_EQ(mask, start);  // back at the first token: <think> or the grammar
  // The budget counts again from zero: after <think> x, only </think>.
  ASSERT_TRUE(c->accept(o.think_start_id, err));
  ASSERT_TRUE(c->accept(x, err));
  ASSERT_TRUE(c->fill_next_mask(mask));
  EXPECT_TRUE(bitmask_allows(mask, o.think_end_id));
  EXPECT_FALSE(bitmask_allows(mask, x));
  ASSERT_TRUE(c->accept(o.think_end_id, err));
  ASSERT_TRUE(c->accept(a[0], err));
  EXPECT_FALSE(c->accept(a[0], err));  // "aa" is refused and changes nothing
  ASSERT_TRUE(c->accept(b[0], err)) << err;
  c->rollback(1);
  ASSERT_TRUE(c->accept(b[0], err)) << err;
}

}  // namespace
}  // namespace tandem
