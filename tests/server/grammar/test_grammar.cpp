// Structured outputs: xgrammar grammars over the demo tokenizer. Random walks (a uniformly
// random allowed token at every step, the stop token as soon as it is allowed half the time)
// stand in for a model that would write anything: whatever the walk, the output must follow
// the grammar.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>

#include "core/error.h"
#include "engine/constraint.h"
#include "engine/sampling.h"
#include "server/grammar/grammar.h"
#include "server/parsers/chat_parser.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem::grammar {
namespace {

const Tokenizer& demo_tok() {
  static std::unique_ptr<Tokenizer> t =
      Tokenizer::from_dir(std::string(TANDEM_SOURCE_DIR) + "/models/demo");
  return *t;
}
constexpr int64_t kVocab = 8192;  // the demo model's (the tokenizer has 8128 ids)
constexpr int32_t kImEnd = 8125;

GrammarCompiler& compiler() {
  static GrammarCompiler c(demo_tok(), kVocab, {kImEnd});
  return c;
}

std::vector<int32_t> allowed(std::span<const uint32_t> mask) {
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < kVocab; ++i) {
    if (bitmask_allows(mask, i)) ids.push_back(i);
  }
  return ids;
}

/// Walks the constraint with random allowed tokens until the stop token; returns the text
/// (without the stop token). Fails the test when it does not end within max_steps.
/// `short_pick` > 0: the shortest of that many random allowed tokens (open-ended grammars such
/// as json_object then close in a few hundred tokens).
std::string walk(TokenConstraint& c, uint64_t seed, int max_steps = 400, int short_pick = 0) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(kVocab)));
  std::vector<int32_t> out;
  for (int step = 0; step < max_steps; ++step) {
    EXPECT_TRUE(c.fill_next_mask(mask)) << "step " << step << ": the grammar must restrict";
    std::vector<int32_t> ids = allowed(mask);
    EXPECT_FALSE(ids.empty());
    if (ids.empty()) break;
    // Ids past the tokenizer and special tokens other than the stop id are never allowed.
    for (int32_t id : ids) {
      EXPECT_LT(id, demo_tok().vocab_size());
      if (demo_tok().is_special(id)) EXPECT_EQ(id, kImEnd);
    }
    const bool can_stop = std::find(ids.begin(), ids.end(), kImEnd) != ids.end();
    int32_t t = can_stop && (ids.size() == 1 || rng() % 2 == 0) ? kImEnd : ids[rng() % ids.size()];
    for (int k = 1; k < short_pick && t != kImEnd; ++k) {
      const int32_t u = ids[rng() % ids.size()];
      if (u != kImEnd && demo_tok().token_bytes(u).size() < demo_tok().token_bytes(t).size()) t = u;
    }
    std::string err;
    EXPECT_TRUE(c.accept(t, err)) << err;
    if (t == kImEnd) return demo_tok().decode(out);
    out.push_back(t);
  }
  ADD_FAILURE() << "no stop within " << max_steps << " tokens: " << demo_tok().decode(out);
  return demo_tok().decode(out);
}

std::shared_ptr<TokenConstraint> constraint(const GrammarSpec& spec) {
  ConstraintOptions o;
  o.grammar = compiler().compile(spec);
  o.vocab_size = kVocab;
  return make_constraint(o);
}

const char* kPersonSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"},
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}
  },
  "required": ["name", "age", "member", "color", "tags"],
  "additionalProperties": false
})";

/// The checks of kPersonSchema (a validator for this one schema).
void expect_person(const std::string& text) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << "not JSON: " << text << " "
                                 << nlohmann::json(text).dump(-1, ' ', true);
  ASSERT_TRUE(j.is_object()) << text;
  EXPECT_EQ(j.size(), 5u) << text;
  ASSERT_TRUE(j.contains("name") && j["name"].is_string()) << text;
  size_t chars = 0;  // code points
  for (unsigned char ch : j["name"].get<std::string>()) chars += (ch & 0xC0) != 0x80;
  EXPECT_LE(chars, 6u) << text;
  ASSERT_TRUE(j.contains("age") && j["age"].is_number_integer()) << text;
  EXPECT_GE(j["age"].get<int64_t>(), 0) << text;
  EXPECT_LE(j["age"].get<int64_t>(), 120) << text;
  ASSERT_TRUE(j.contains("member") && j["member"].is_boolean()) << text;
  ASSERT_TRUE(j.contains("color") && j["color"].is_string()) << text;
  const std::string color = j["color"];
  EXPECT_TRUE(color == "red" || color == "green" || color == "blue") << text;
  ASSERT_TRUE(j.contains("tags") && j["tags"].is_array()) << text;
  EXPECT_LE(j["tags"].size(), 2u) << text;
  for (const auto& t : j["tags"]) EXPECT_TRUE(t.is_string()) << text;
}

TEST(Grammar, JsonSchemaWalksAlwaysValidate) {
  GrammarSpec spec{GrammarKind::kJsonSchema, kPersonSchema};
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    auto c = constraint(spec);
    expect_person(walk(*c, seed));
  }
}

TEST(Grammar, JsonObjectIsAnObject) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    auto c = constraint({GrammarKind::kJsonObject});
    std::string text = walk(*c, seed, 3000, /*short_pick=*/16);
    // Syntax only: a random walk writes numbers like 1e53663922 (valid JSON, over a double).
    // (nlohmann refuses those: exponents are cut before checking.)
    const std::string tame =
        std::regex_replace(text, std::regex("([0-9.])([eE][-+]?)[0-9]{3,}"), "$1$21");
    EXPECT_TRUE(nlohmann::json::accept(tame)) << nlohmann::json(text).dump(-1, ' ', true);
    EXPECT_EQ(text.rfind("{", 0), 0u) << text;
    EXPECT_EQ(text.back(), '}') << text;
  }
}

TEST(Grammar, RegexChoiceAndEbnf) {
  GrammarSpec re{GrammarKind::kRegex, "[a-c]{2,4}-[0-9]{3}"};
  GrammarSpec choice{GrammarKind::kChoice};
  choice.choices = {"yes", "no", "maybe \"so\""};
  GrammarSpec ebnf{GrammarKind::kEbnf,
                   "root ::= \"(\" num (\"+\" num)? \")\"\nnum ::= [1-9] [0-9]? [0-9]?"};
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    std::string a = walk(*constraint(re), seed);
    EXPECT_TRUE(std::regex_match(a, std::regex("[a-c]{2,4}-[0-9]{3}"))) << a;
    std::string b = walk(*constraint(choice), seed);
    EXPECT_TRUE(b == "yes" || b == "no" || b == "maybe \"so\"") << b;
    std::string e = walk(*constraint(ebnf), seed);
    EXPECT_TRUE(std::regex_match(e, std::regex(R"(\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2})?\))"))) << e;
  }
}

TEST(Grammar, SuffixFollowsTheGrammar) {
  GrammarSpec spec{GrammarKind::kJsonSchema,
                   R"({"type": "object", "properties": {"x": {"type": "boolean"}},
                       "required": ["x"]})"};
  spec.suffix = "\n</tool_call>";
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    std::string text = walk(*constraint(spec), seed);
    EXPECT_TRUE(text == "{\"x\": true}\n</tool_call>" || text == "{\"x\": false}\n</tool_call>")
        << text;
  }
}

TEST(Grammar, RejectsATokenOutsideTheGrammar) {
  auto c = constraint({GrammarKind::kChoice, "", {"yes"}});
  std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(kVocab)));
  ASSERT_TRUE(c->fill_next_mask(mask));
  std::vector<int32_t> bad = demo_tok().encode("no");
  ASSERT_FALSE(bitmask_allows(mask, bad[0]));
  std::string err;
  EXPECT_FALSE(c->accept(bad[0], err));
  EXPECT_NE(err.find("does not continue"), std::string::npos) << err;
}

TEST(Grammar, BadGrammarsThrowInvalidArgument) {
  auto expect_bad = [](const GrammarSpec& spec) {
    try {
      compiler().compile(spec);
      ADD_FAILURE() << "compiled: " << spec.text;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      EXPECT_FALSE(std::string(e.what()).empty());
    }
  };
  expect_bad({GrammarKind::kJsonSchema, R"({"type": "no such type"})"});
  expect_bad({GrammarKind::kJsonSchema, R"({"type": "object", "properties": 5})"});
  expect_bad({GrammarKind::kRegex, "(unclosed"});
  expect_bad({GrammarKind::kEbnf, "root ::= undefined_rule"});
  expect_bad({GrammarKind::kEbnf, "not a grammar"});
}

TEST(Grammar, CompiledGrammarsAreCached) {
  GrammarCompiler c(demo_tok(), kVocab, {kImEnd}, /*cache_capacity=*/2);
  GrammarSpec a{GrammarKind::kRegex, "a+"}, b{GrammarKind::kRegex, "b+"},
      d{GrammarKind::kRegex, "d+"};
  auto ga = c.compile(a);
  EXPECT_EQ(c.compile(a), ga);  // the same compiled grammar
  EXPECT_EQ(c.cache_hits(), 1);
  GrammarSpec a2 = a;
  a2.suffix = "!";  // a different key
  EXPECT_NE(c.compile(a2), ga);
  c.compile(b);
  c.compile(d);  // capacity 2: a is evicted
  EXPECT_EQ(c.cache_size(), 2u);
  const int64_t hits = c.cache_hits();
  EXPECT_NE(c.compile(a), ga);
  EXPECT_EQ(c.cache_hits(), hits);
}

TEST(Grammar, GrammarStartsAfterThinkEnd) {
  const int32_t think = compiler().think_start_id(), end = compiler().think_end_id();
  ASSERT_GE(think, 0);
  ASSERT_GE(end, 0);
  std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(kVocab)));
  std::vector<int32_t> words = demo_tok().encode("anything at all");
  for (ThinkStart start : {ThinkStart::kInThink, ThinkStart::kAuto}) {
    ConstraintOptions o;
    o.grammar = compiler().compile({GrammarKind::kChoice, "", {"yes"}});
    o.think = start;
    o.think_start_id = think;
    o.think_end_id = end;
    o.vocab_size = kVocab;
    auto c = make_constraint(o);
    std::string err;
    if (start == ThinkStart::kAuto) {  // the first token may open the think block
      ASSERT_TRUE(c->fill_next_mask(mask));
      EXPECT_TRUE(bitmask_allows(mask, think));
      EXPECT_FALSE(bitmask_allows(mask, words[0]));
      ASSERT_TRUE(c->accept(think, err));
    }
    for (int32_t w : words) {  // reasoning is free
      EXPECT_FALSE(c->fill_next_mask(mask));
      ASSERT_TRUE(c->accept(w, err)) << err;
    }
    ASSERT_TRUE(c->accept(end, err));
    EXPECT_EQ(walk(*c, 7), "yes");
  }
  // kAuto without a think block: the grammar from the first token.
  ConstraintOptions o;
  o.grammar = compiler().compile({GrammarKind::kChoice, "", {"yes"}});
  o.think = ThinkStart::kAuto;
  o.think_start_id = think;
  o.think_end_id = end;
  auto c = make_constraint(o);
  std::string err;
  EXPECT_FALSE(c->accept(words[0], err));
}

TEST(Grammar, ThinkingBudgetForcesThinkEnd) {
  const int32_t end = compiler().think_end_id();
  std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(kVocab)));
  for (int32_t budget : {0, 3}) {
    ConstraintOptions o;  // no grammar: the budget alone
    o.think = ThinkStart::kInThink;
    o.think_start_id = compiler().think_start_id();
    o.think_end_id = end;
    o.thinking_budget = budget;
    o.vocab_size = kVocab;
    auto c = make_constraint(o);
    std::string err;
    for (int32_t i = 0; i < budget; ++i) {
      EXPECT_FALSE(c->fill_next_mask(mask)) << i;
      ASSERT_TRUE(c->accept(100 + i, err));
    }
    ASSERT_TRUE(c->fill_next_mask(mask));
    EXPECT_EQ(allowed(mask), std::vector<int32_t>{end});
    ASSERT_TRUE(c->accept(end, err));
    EXPECT_FALSE(c->fill_next_mask(mask));  // after the block: free again
  }
}

// tool_choice "required" / named for the Qwen3-Coder XML form: whatever the walk, the reply
// after the primed "<tool_call>\n" is one call the XML parser reads, of the right function, with
// arguments valid against its schema (typed: integers and booleans as JSON, strings raw).
const nlohmann::ordered_json kXmlTools = nlohmann::ordered_json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"enum": ["Highbury", "London"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "metric": {"type": "boolean"}},
    "required": ["city", "days"], "additionalProperties": false}}},
  {"type": "function", "function": {"name": "count_chapters", "parameters": {
    "type": "object",
    "properties": {"book": {"type": "string", "maxLength": 10}},
    "required": ["book"], "additionalProperties": false}}}
])");

void expect_valid_xml_call(const std::string& reply, const std::string& only) {
  parsers::ChatParserOptions o;
  o.tools_format = parsers::ToolFormat::kQwen3Coder;
  o.tools = kXmlTools;
  o.prime = "<tool_call>\n";
  parsers::ChatParser p(o);
  parsers::ChatDelta d = p.feed(reply);
  d.append(p.finish());
  SCOPED_TRACE("reply: " + reply);
  EXPECT_TRUE(d.content.empty()) << d.content;
  EXPECT_TRUE(d.failed_calls.empty());
  ASSERT_EQ(p.num_calls(), 1);
  std::string name, args;
  for (const auto& c : d.tool_calls) {
    if (c.header) name = c.name;
    args += c.arguments;
  }
  if (!only.empty()) EXPECT_EQ(name, only);
  nlohmann::json a = nlohmann::json::parse(args, nullptr, false);
  ASSERT_TRUE(a.is_object()) << args;
  if (name == "get_weather") {
    ASSERT_TRUE(a.contains("city") && a["city"].is_string()) << args;
    EXPECT_TRUE(a["city"] == "Highbury" || a["city"] == "London") << args;
    ASSERT_TRUE(a.contains("days") && a["days"].is_number_integer()) << args;
    EXPECT_GE(a["days"].get<int>(), 1);
    EXPECT_LE(a["days"].get<int>(), 7);
    if (a.contains("metric")) EXPECT_TRUE(a["metric"].is_boolean()) << args;
    EXPECT_LE(a.size(), 3u) << args;
  } else {
    ASSERT_EQ(name, "count_chapters");
    ASSERT_TRUE(a.contains("book") && a["book"].is_string()) << args;
    const std::string book = a["book"];
    EXPECT_LE(std::count_if(book.begin(), book.end(), [](char ch) { return (ch & 0xC0) != 0x80; }),
              10)
        << args;  // (code points)
    EXPECT_EQ(a.size(), 1u) << args;
  }
}

TEST(Grammar, XmlToolCallWalksParseAndValidate) {
  std::set<std::string> names;
  for (const std::string only : {"", "count_chapters", "get_weather"}) {
    for (uint64_t seed = 1; seed <= 12; ++seed) {
      const std::string reply =
          walk(*constraint(xml_tool_call_grammar(kXmlTools, only)), seed, 600, /*short_pick=*/8);
      expect_valid_xml_call(reply, only);
      if (only.empty()) names.insert(reply.substr(0, reply.find('>')));
    }
  }
  EXPECT_EQ(names.size(), 2u);  // "required" picks either tool
  // A parser-compatible reply the grammar accepts token by token: the documented layout.
  const std::string layout =
      "<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n<parameter=days>\n3\n"
      "</parameter>\n</function>\n</tool_call>";
  auto c = constraint(xml_tool_call_grammar(kXmlTools, ""));
  std::string err;
  for (int32_t id : demo_tok().encode(layout)) ASSERT_TRUE(c->accept(id, err)) << err;
  std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(kVocab)));
  ASSERT_TRUE(c->fill_next_mask(mask));
  EXPECT_EQ(allowed(mask), std::vector<int32_t>{kImEnd});  // the call is complete
  expect_valid_xml_call(layout, "get_weather");
}

TEST(Grammar, StructuralTagWalksFollowTheTag) {
  GrammarSpec spec{GrammarKind::kStructuralTag};
  spec.text = R"({"type": "structural_tag", "format": {"type": "sequence", "elements": [
      {"type": "const_string", "value": "Answer: "},
      {"type": "tag", "begin": "<n>", "content": {"type": "json_schema",
       "json_schema": {"type": "integer", "minimum": 0, "maximum": 99}}, "end": "</n>"}]}})";
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    const std::string text = walk(*constraint(spec), seed);
    EXPECT_TRUE(std::regex_match(text, std::regex(R"(Answer: <n>[0-9]{1,2}</n>)"))) << text;
  }
  GrammarSpec bad{GrammarKind::kStructuralTag};
  bad.text = R"({"type": "structural_tag", "format": {"type": "no_such_format"}})";
  EXPECT_THROW(compiler().compile(bad), Error);
  EXPECT_THROW(validate(bad), Error);
}

TEST(Grammar, ConstraintSpecRoundTripsAndValidates) {
  ConstraintRequest r;
  r.grammar = GrammarSpec{GrammarKind::kChoice};
  r.grammar->choices = {"a", "b \"c\""};
  r.grammar->strict = false;
  r.grammar->suffix = "\n";
  r.think = ThinkStart::kAuto;
  r.thinking_budget = 7;
  const ConstraintRequest g = decode_constraint_request(encode_constraint_request(r));
  ASSERT_TRUE(g.grammar);
  EXPECT_EQ(g.grammar->key(), r.grammar->key());
  EXPECT_EQ(g.think, ThinkStart::kAuto);
  EXPECT_EQ(g.thinking_budget, 7);
  EXPECT_FALSE(decode_constraint_request(encode_constraint_request({})).grammar);
  EXPECT_THROW(decode_constraint_request("{not json"), Error);
  EXPECT_THROW(decode_constraint_request(R"({"think": "sideways", "thinking_budget": -1})"), Error);
  EXPECT_THROW(validate({GrammarKind::kRegex, "(unclosed"}), Error);
  EXPECT_NO_THROW(validate({GrammarKind::kRegex, "a+"}));
  // The instance's factory: the demo model's tokenizer and config, a fresh state per call.
  ConstraintFactory f =
      instance_constraint_factory(std::string(TANDEM_SOURCE_DIR) + "/models/demo");
  ConstraintRequest yes;
  yes.grammar = GrammarSpec{GrammarKind::kRegex, "yes"};
  auto a = f(encode_constraint_request(yes)), b = f(encode_constraint_request(yes));
  EXPECT_NE(a, b);
  std::string err;
  for (int32_t id : demo_tok().encode("yes")) ASSERT_TRUE(a->accept(id, err)) << err;
  EXPECT_FALSE(a->accept(demo_tok().encode("s")[0], err));
  std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(kVocab)));
  ASSERT_TRUE(a->fill_next_mask(mask));
  EXPECT_TRUE(bitmask_allows(mask, kImEnd));  // the end, one of the model's EOS ids
  ASSERT_TRUE(b->fill_next_mask(mask));       // b is still at the start
  EXPECT_FALSE(bitmask_allows(mask, kImEnd));
  EXPECT_THROW(f("{}"), Error);
}

TEST(Grammar, ConstraintsAreReleased) {
  const int64_t before = live_constraints();
  {
    auto a = constraint({GrammarKind::kJsonObject});
    auto b = constraint({GrammarKind::kJsonObject});
    EXPECT_EQ(live_constraints(), before + 2);
  }
  EXPECT_EQ(live_constraints(), before);
}

TEST(Grammar, HostBitmaskMatchesAReference) {
  std::mt19937_64 rng(3);
  for (int64_t vocab : {1, 31, 32, 33, 1000, 8192}) {
    std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(vocab)));
    for (auto& w : mask) w = static_cast<uint32_t>(rng());
    if (vocab == 1000) std::fill(mask.begin(), mask.end(), 0xFFFFFFFFu);
    std::vector<float> logits(static_cast<size_t>(vocab));
    for (auto& x : logits) x = static_cast<float>(rng() % 1000) / 10.0f;
    std::vector<float> want = logits;
    for (int64_t i = 0; i < vocab; ++i) {
      if (!((mask[size_t(i / 32)] >> (i % 32)) & 1u)) want[size_t(i)] = -INFINITY;
    }
    apply_token_bitmask(logits, mask);
    EXPECT_EQ(logits, want) << vocab;
  }
}

// ---- Bounded numbers (issue 34): a constrained number cannot run to max_tokens. ----

/// Whether the grammar takes `text` whole, token by token, and may stop after it.
bool accepts(const GrammarSpec& spec, const std::string& text) {
  auto c = constraint(spec);
  std::string err;
  for (int32_t id : demo_tok().encode(text)) {
    if (!c->accept(id, err)) return false;
  }
  std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(kVocab)));
  c->fill_next_mask(mask);
  return bitmask_allows(mask, kImEnd);
}

/// A model that loves numbers (the demo model loops on digits): at every step the allowed
/// token with the most digits (the most 1s: the longest numbers of a range), else one with '.',
/// 'e', 'E', '+' or '-' (the fraction and the exponent), else the stop token, else the shortest.
/// Fails the test when it does not stop within max_steps.
std::string digit_walk(TokenConstraint& c, int max_steps = 300) {
  std::vector<uint32_t> mask(static_cast<size_t>(bitmask_words(kVocab)));
  std::vector<int32_t> out;
  for (int step = 0; step < max_steps; ++step) {
    EXPECT_TRUE(c.fill_next_mask(mask));
    const std::vector<int32_t> ids = allowed(mask);
    if (ids.empty()) break;
    auto score = [&](int32_t id) {
      if (id == kImEnd) return 1'000;
      const std::string_view b = demo_tok().token_bytes(id);
      int digits = 0, ones = 0, marks = 0;
      for (char ch : b) {
        digits += ch >= '0' && ch <= '9';
        ones += ch == '1';
        marks += std::string_view(".eE+-").find(ch) != std::string_view::npos;
      }
      if (digits > 0) return 100'000 + digits * 100 + ones * 10 - static_cast<int>(b.size());
      if (marks > 0) return 10'000 - static_cast<int>(b.size());
      return -static_cast<int>(b.size());
    };
    const int32_t t = *std::max_element(ids.begin(), ids.end(),
                                        [&](int32_t a, int32_t b) { return score(a) < score(b); });
    std::string err;
    EXPECT_TRUE(c.accept(t, err)) << err;
    if (t == kImEnd) return demo_tok().decode(out);
    out.push_back(t);
  }
  ADD_FAILURE() << "no stop within " << max_steps << " tokens: " << demo_tok().decode(out);
  return demo_tok().decode(out);
}

/// The JSON number texts in `text` (outside strings: the tests' outputs have none inside).
std::vector<std::string> number_texts(const std::string& text) {
  std::vector<std::string> out;
  static const std::regex kNum(R"(-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), kNum); it != std::sregex_iterator();
       ++it) {
    out.push_back(it->str());
  }
  return out;
}

struct NumberParts {
  size_t int_digits = 0, fraction_digits = 0, exponent_digits = 0;
};
NumberParts parts_of(const std::string& n) {
  std::smatch m;
  EXPECT_TRUE(
      std::regex_match(n, m, std::regex(R"(-?([0-9]+)(?:\.([0-9]+))?(?:[eE][-+]?([0-9]+))?)")))
      << n;
  return {static_cast<size_t>(m[1].length()), static_cast<size_t>(m[2].length()),
          static_cast<size_t>(m[3].length())};
}

const char* kIntAndNumber = R"({"type": "object", "properties": {
    "n": {"type": "integer", "description": "a count"}, "x": {"type": "number"}},
    "required": ["n", "x"]})";

TEST(BoundedNumbers, ADigitLovingModelStopsAtInt64AndBoundedFloats) {
  const std::string text = digit_walk(*constraint({GrammarKind::kJsonSchema, kIntAndNumber}));
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  ASSERT_TRUE(j.is_object()) << text;
  ASSERT_TRUE(j["n"].is_number_integer()) << text;  // parsed as an int64 / uint64
  const std::vector<std::string> nums = number_texts(text);
  ASSERT_EQ(nums.size(), 2u) << text;
  const NumberParts n = parts_of(nums[0]), x = parts_of(nums[1]);
  // The walk pushes every part to its bound: 19 digits of 1 (the int64 range; a sign first when
  // the vocabulary's best token there carries one), then the float's 19 integer, 17 fraction and
  // 3 exponent digits.
  EXPECT_EQ(nums[0].substr(nums[0].rfind('-') == 0 ? 1 : 0), std::string(19, '1')) << text;
  EXPECT_EQ(n.int_digits, 19u) << text;
  EXPECT_EQ(x.int_digits, 19u) << text;
  EXPECT_EQ(x.fraction_digits, 17u) << text;
  EXPECT_EQ(x.exponent_digits, 3u) << text;
}

TEST(BoundedNumbers, EveryValidFormStillPasses) {
  const GrammarSpec integer{GrammarKind::kJsonSchema, R"({"type": "integer"})"};
  for (const char* ok : {"0", "7", "-1", "42", "9223372036854775807", "-9223372036854775808",
                         "1000000000000000000"}) {
    EXPECT_TRUE(accepts(integer, ok)) << ok;
  }
  for (const char* bad : {"9223372036854775808", "-9223372036854775809", "12345678901234567890",
                          "01", "-0", "1.0", "1e3", "+1"}) {
    EXPECT_FALSE(accepts(integer, bad)) << bad;
  }
  const GrammarSpec number{GrammarKind::kJsonSchema, R"({"type": "number"})"};
  for (const char* ok :
       {"0", "-0", "12", "-12", "0.5", "-3.25", "1e5", "1E-7", "-2.5e+308", "6.02214076e23",
        "1234567890123456789", "0.12345678901234567", "1.5e-300", "0.30000000000000004"}) {
    EXPECT_TRUE(accepts(number, ok)) << ok;
  }
  for (const char* bad : {"1.", ".5", "01", "1e", "1e+", "12345678901234567890",
                          "0.123456789012345678", "1e1234", "--1", "NaN"}) {
    EXPECT_FALSE(accepts(number, bad)) << bad;
  }
}

TEST(BoundedNumbers, ExplicitBoundsAreKept) {
  auto schema = [](const char* s) { return GrammarSpec{GrammarKind::kJsonSchema, s}; };
  const GrammarSpec both = schema(R"({"type": "integer", "minimum": -5, "maximum": 1000})");
  for (const char* ok : {"-5", "0", "37", "1000"}) EXPECT_TRUE(accepts(both, ok)) << ok;
  for (const char* bad : {"-6", "1001", "10000"}) EXPECT_FALSE(accepts(both, bad)) << bad;
  EXPECT_EQ(digit_walk(*constraint(both)), "111");  // (a fourth 1 would pass 1000)
  // One side from the schema, the other the int64 bound.
  const GrammarSpec lower = schema(R"({"type": "integer", "exclusiveMinimum": 9})");
  for (const char* ok : {"10", "9223372036854775807"}) EXPECT_TRUE(accepts(lower, ok)) << ok;
  for (const char* bad : {"9", "-1", "9223372036854775808"}) {
    EXPECT_FALSE(accepts(lower, bad)) << bad;
  }
  const GrammarSpec upper = schema(R"({"type": "integer", "maximum": -3})");
  for (const char* ok : {"-3", "-9223372036854775808"}) EXPECT_TRUE(accepts(upper, ok)) << ok;
  for (const char* bad : {"-2", "0", "-9223372036854775809"}) {
    EXPECT_FALSE(accepts(upper, bad)) << bad;
  }
  const GrammarSpec unit = schema(R"({"type": "number", "minimum": 0, "maximum": 1.5})");
  for (const char* ok : {"0", "1.5", "0.25", "1"}) EXPECT_TRUE(accepts(unit, ok)) << ok;
  for (const char* bad : {"-0.5", "1.6", "2"}) EXPECT_FALSE(accepts(unit, bad)) << bad;
  const GrammarSpec positive = schema(R"({"type": "number", "minimum": 0})");
  for (const char* ok : {"0", "12.5", "1000000"}) EXPECT_TRUE(accepts(positive, ok)) << ok;
  for (const char* bad : {"-1", "-0.5"}) EXPECT_FALSE(accepts(positive, bad)) << bad;
  const std::string p = digit_walk(*constraint(positive));
  EXPECT_LE(std::stod(p), 1e18) << p;  // the open side closed
  // The rewrite reaches nested schemas, $defs and type arrays; property order is kept.
  const GrammarSpec nested = schema(R"({"type": "object", "properties": {
      "z": {"type": ["integer", "null"]}, "a": {"type": "array", "items": {"$ref": "#/$defs/i"}}},
      "required": ["z", "a"], "$defs": {"i": {"type": "integer"}}})");
  EXPECT_TRUE(accepts(nested, R"({"z": -9223372036854775808, "a": [1, 9223372036854775807]})"));
  EXPECT_TRUE(accepts(nested, R"({"z": null, "a": []})"));
  EXPECT_FALSE(accepts(nested, R"({"z": 9223372036854775808, "a": []})"));
  EXPECT_FALSE(accepts(nested, R"({"z": 1, "a": [92233720368547758070]})"));
  EXPECT_FALSE(accepts(nested, R"({"a": [], "z": 1})"));
}

TEST(BoundedNumbers, JsonObjectValuesAndToolArgumentsAreBounded) {
  const GrammarSpec object{GrammarKind::kJsonObject};
  EXPECT_TRUE(
      accepts(object, R"({"a": 1.5e10, "b": [-3, 0.25], "c": {"d": 1234567890123456789}})"));
  EXPECT_FALSE(accepts(object, R"({"a": 12345678901234567890})"));
  EXPECT_FALSE(accepts(object, R"({"a": 0.123456789012345678})"));
  EXPECT_FALSE(accepts(object, R"({"a": 1e1000})"));
  const nlohmann::ordered_json tools = nlohmann::ordered_json::parse(R"([{"type": "function",
      "function": {"name": "f", "parameters": {"type": "object", "properties": {
      "n": {"type": "integer"}, "x": {"type": "number"}}, "required": ["n", "x"]}}}])");
  for (const GrammarSpec& call :
       {hermes_tool_call_grammar(tools, ""), xml_tool_call_grammar(tools, "f")}) {
    const std::string text = digit_walk(*constraint(call));
    const std::vector<std::string> nums = number_texts(text);
    ASSERT_EQ(nums.size(), 2u) << text;
    const NumberParts n = parts_of(nums[0]), x = parts_of(nums[1]);
    EXPECT_LE(n.int_digits, 19u) << text;
    EXPECT_EQ(n.fraction_digits + n.exponent_digits, 0u) << text;
    EXPECT_LE(x.int_digits, 19u) << text;
    EXPECT_LE(x.fraction_digits, 17u) << text;
    EXPECT_LE(x.exponent_digits, 3u) << text;
  }
}

}  // namespace
}  // namespace tandem::grammar
