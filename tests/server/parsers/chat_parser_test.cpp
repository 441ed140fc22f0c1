// The reasoning and tool-call parsers on a corpus of replies: each reply is parsed whole and
// streamed split at every character boundary, one character at a time, and at the token
// boundaries of the demo and Qwen3 tokenizers (incremental detokenisation); every way must
// give the same result, and the whole-reply result must be the expected one.
#include "server/parsers/chat_parser.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "server/tokenizer/detokenizer.h"
#include "server/tokenizer/tokenizer.h"
#include "server/tokenizer/tokenizer_test_util.h"

namespace tandem::parsers {
namespace {

using ojson = nlohmann::ordered_json;

struct Call {
  std::string name;
  std::string arguments;
  bool operator==(const Call&) const = default;
};

struct Result {
  std::string reasoning;
  std::string content;
  std::vector<Call> calls;  // valid calls, in order
  std::vector<int32_t> failed;
  bool operator==(const Result&) const = default;
};

std::ostream& operator<<(std::ostream& os, const Result& r) {
  os << "{reasoning: " << ojson(r.reasoning).dump() << ", content: " << ojson(r.content).dump()
     << ", calls: [";
  for (const Call& c : r.calls) os << c.name << ojson(c.arguments).dump() << " ";
  os << "], failed: " << r.failed.size() << "}";
  return os;
}

/// Folds deltas as a client does (name from the first delta, then argument fragments), then
/// drops the failed calls (as the non-streamed reply does).
class Collector {
 public:
  void add(const ChatDelta& d) {
    r_.reasoning += d.reasoning;
    r_.content += d.content;
    for (const ToolCallDelta& t : d.tool_calls) {
      if (t.header) {
        EXPECT_EQ(size_t(t.index), calls_.size()) << "call indexes are consecutive";
        calls_.push_back({t.name, ""});
      }
      ASSERT_LT(size_t(t.index), calls_.size()) << "arguments before the call's header";
      calls_[size_t(t.index)].arguments += t.arguments;
    }
    for (int32_t f : d.failed_calls) r_.failed.push_back(f);
  }
  Result result() const {
    Result r = r_;
    for (size_t i = 0; i < calls_.size(); ++i) {
      if (std::find(r.failed.begin(), r.failed.end(), int32_t(i)) == r.failed.end()) {
        r.calls.push_back(calls_[i]);
      }
    }
    return r;
  }

 private:
  Result r_;
  std::vector<Call> calls_;
};

Result parse_pieces(const ChatParserOptions& o, const std::vector<std::string>& pieces) {
  ChatParser p(o);
  Collector c;
  for (const std::string& s : pieces) c.add(p.feed(s));
  c.add(p.finish());
  return c.result();
}

const ojson kTools = ojson::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "metric": {"type": "boolean"}, "scale": {"type": ["number", "null"]},
                   "tags": {"type": "array"}, "opts": {"type": "object"},
                   "unit": {"enum": ["C", "F"]}, "code": {"type": "string", "maxLength": 4}}}}},
  {"type": "function", "function": {"name": "count_chapters", "parameters": {"type": "object",
    "properties": {"book": {"type": "string"}}}}}
])");

struct Case {
  const char* label;
  ReasoningStart start;
  ToolFormat format;
  std::string text;
  Result expected;
  bool reasoning = true;
};

std::vector<Case> corpus() {
  using RS = ReasoningStart;
  using TF = ToolFormat;
  const std::string hermes_call =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
      "\"days\": 3}}\n</tool_call>";
  return {
      {"empty think block (the demo's four newlines)",
       RS::kAuto,
       TF::kNone,
       "<think>\n\n</think>\n\nElizabeth smiled.",
       {"", "Elizabeth smiled.", {}, {}}},
      {"reasoning then content",
       RS::kAuto,
       TF::kNone,
       "<think>\nLet me think.\nStill thinking.\n</think>\n\nThe answer is 4.\n",
       {"Let me think.\nStill thinking.", "The answer is 4.\n", {}, {}}},
      {"think opened by the prompt",
       RS::kInThink,
       TF::kNone,
       "Hmm, 2+2.\n</think>\n\n4",
       {"Hmm, 2+2.", "4", {}, {}}},
      {"no </think>: all reasoning",
       RS::kInThink,
       TF::kNone,
       "I am still going and going",
       {"I am still going and going", "", {}, {}}},
      {"<think> without </think> from the reply",
       RS::kAuto,
       TF::kNone,
       "<think>\nabc </thin",
       {"abc </thin", "", {}, {}}},
      {"no think block",
       RS::kAuto,
       TF::kNone,
       "Plain <b>answer</b> here.",
       {"", "Plain <b>answer</b> here.", {}, {}}},
      {"leading whitespace, no think",
       RS::kAuto,
       TF::kNone,
       "\n  <thinking> is a word",
       {"", "\n  <thinking> is a word", {}, {}}},
      {"thinking off in the prompt",
       RS::kContent,
       TF::kNone,
       "<think>x</think>y",
       {"", "<think>x</think>y", {}, {}}},
      {"reasoning parser off",
       RS::kAuto,
       TF::kNone,
       "<think>x</think>y",
       {"", "<think>x</think>y", {}, {}},
       false},
      {"hermes: one call",
       RS::kAuto,
       TF::kHermes,
       "<think>\nI should call it.\n</think>\n\n" + hermes_call,
       {"I should call it.", "", {{"get_weather", "{\"city\": \"Paris\", \"days\": 3}"}}, {}}},
      {"hermes: content then two calls",
       RS::kContent,
       TF::kHermes,
       "Let me check.\n\n" + hermes_call +
           "\n<tool_call>\n{\"name\": \"count_chapters\", \"arguments\": {\"book\": "
           "\"Emma \\\"the\\\" novel \\u00e9 \xe2\x9c\x93\"}}\n</tool_call>",
       {"",
        "Let me check.",
        {{"get_weather", "{\"city\": \"Paris\", \"days\": 3}"},
         {"count_chapters", "{\"book\": \"Emma \\\"the\\\" novel \\u00e9 \xe2\x9c\x93\"}"}},
        {}}},
      {"hermes: tags inside argument strings",
       RS::kContent,
       TF::kHermes,
       "<tool_call>{\"name\": \"count_chapters\", \"arguments\": {\"book\": \"</tool_call> "
       "<tool_call>\", \"n\": [1, -2.5e3, true, null, {}]}}</tool_call>",
       {"",
        "",
        {{"count_chapters",
          "{\"book\": \"</tool_call> <tool_call>\", \"n\": [1, -2.5e3, true, null, {}]}"}},
        {}}},
      {"hermes: a call inside the think block stays reasoning",
       RS::kAuto,
       TF::kHermes,
       "<think>\nMaybe " + hermes_call + " no.\n</think>\n\nDone.",
       {"Maybe " + hermes_call + " no.", "Done.", {}, {}}},
      {"hermes: name after arguments",
       RS::kContent,
       TF::kHermes,
       "<tool_call>{\"arguments\": {\"book\": \"Emma\"}, \"name\": \"count_chapters\"}"
       "</tool_call>",
       {"", "", {{"count_chapters", "{\"book\": \"Emma\"}"}}, {}}},
      {"hermes: arguments as a JSON string",
       RS::kContent,
       TF::kHermes,
       "<tool_call>{\"name\": \"count_chapters\", \"arguments\": \"{\\\"book\\\": 1}\"}"
       "</tool_call>",
       {"", "", {{"count_chapters", "{\"book\": 1}"}}, {}}},
      {"hermes: no arguments, unterminated at the end",
       RS::kContent,
       TF::kHermes,
       "<tool_call>\n{\"name\": \"get_time\"}\n",
       {"", "", {{"get_time", "{}"}}, {}}},
      {"hermes: broken JSON before the arguments",
       RS::kContent,
       TF::kHermes,
       "Sure. <tool_call>{\"name\": get_weather}</tool_call> ok",
       {"", "Sure. <tool_call>{\"name\": get_weather}</tool_call> ok", {}, {}}},
      {"hermes: not JSON at all",
       RS::kContent,
       TF::kHermes,
       "a <tool_call>hello</tool_call>",
       {"", "a <tool_call>hello</tool_call>", {}, {}}},
      {"hermes: broken JSON inside the arguments",
       RS::kContent,
       TF::kHermes,
       "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": tru}}</tool_call>",
       {"", "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": tru}}</tool_call>", {}, {0}}},
      {"hermes: cut off inside the arguments",
       RS::kContent,
       TF::kHermes,
       "x\n<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"b",
       {"", "x\n<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": \"b", {}, {0}}},
      {"hermes: a broken call then a good one",
       RS::kContent,
       TF::kHermes,
       "<tool_call>{\"name\": 1}</tool_call>" + hermes_call,
       {"",
        "<tool_call>{\"name\": 1}</tool_call>",
        {{"get_weather", "{\"city\": \"Paris\", \"days\": 3}"}},
        {}}},
      {"hermes: junk after the object",
       RS::kContent,
       TF::kHermes,
       "<tool_call>{\"name\": \"f\", \"arguments\": {}}}</tool_call>",
       {"", "<tool_call>{\"name\": \"f\", \"arguments\": {}}}</tool_call>", {}, {0}}},
      {"hermes: a partial tag at the end is content",
       RS::kContent,
       TF::kHermes,
       "The end <tool_",
       {"", "The end <tool_", {}, {}}},
      {"hermes: content after the calls",
       RS::kContent,
       TF::kHermes,
       hermes_call + "\n\nThat is all.",
       {"", "That is all.", {{"get_weather", "{\"city\": \"Paris\", \"days\": 3}"}}, {}}},
      {"xml: typed parameters",
       RS::kAuto,
       TF::kQwen3Coder,
       "<think>\nok\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n"
       "<parameter=city>\nSaint-\"Malo\"\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
       "<parameter=metric>\nTrue\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
       "<parameter=tags>\n[\"a\", 2]\n</parameter>\n<parameter=opts>\n{\"x\": {\"y\": 1}}\n"
       "</parameter>\n</function>\n</tool_call>",
       {"ok",
        "Checking.",
        {{"get_weather",
          "{\"city\": \"Saint-\\\"Malo\\\"\", \"days\": 3, \"metric\": true, \"scale\": 1.5, "
          "\"tags\": [\"a\",2], \"opts\": {\"x\":{\"y\":1}}}"}},
        {}}},
      {"xml: multi-line string, code with tags, untyped parameter",
       RS::kContent,
       TF::kQwen3Coder,
       "<tool_call>\n<function=count_chapters>\n<parameter=book>\nline 1\n<b>x</b> </param\n\n"
       "</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>",
       {"",
        "",
        {{"count_chapters", "{\"book\": \"line 1\\n<b>x</b> </param\\n\", \"extra\": \"42\"}"}},
        {}}},
      {"xml: whitespace around bounded strings is layout (a grammar's), free strings keep it",
       RS::kContent,
       TF::kQwen3Coder,
       "<tool_call>\n<function=get_weather>\n<parameter=unit> \t\nF  \n</parameter>"
       "<parameter=code>\n\n a b \n\n</parameter>\n<parameter=city>\n\n Paris \n\n</parameter>\n"
       "</function>\n</tool_call>",
       {"",
        "",
        {{"get_weather", "{\"unit\": \"F\", \"code\": \"a b\", \"city\": \"\\n Paris \\n\"}"}},
        {}}},
      {"xml: a wrong type falls back to a string; two calls",
       RS::kContent,
       TF::kQwen3Coder,
       "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n"
       "</function>\n</tool_call>\n<tool_call>\n<function=count_chapters>\n</function>\n"
       "</tool_call>",
       {"", "", {{"get_weather", "{\"days\": \"three\"}"}, {"count_chapters", "{}"}}, {}}},
      {"xml: a call inside the think block stays reasoning",
       RS::kInThink,
       TF::kQwen3Coder,
       "<tool_call>\n<function=f>\n</function>\n</tool_call></think>x",
       {"<tool_call>\n<function=f>\n</function>\n</tool_call>", "x", {}, {}}},
      {"xml: broken before the function",
       RS::kContent,
       TF::kQwen3Coder,
       "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
       {"", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", {}, {}}},
      {"xml: broken after the function started",
       RS::kContent,
       TF::kQwen3Coder,
       "<tool_call>\n<function=f>\n<param=x>1</param>\n</function>\n</tool_call>",
       {"", "<tool_call>\n<function=f>\n<param=x>1</param>\n</function>\n</tool_call>", {}, {0}}},
      {"xml: cut off in a value",
       RS::kContent,
       TF::kQwen3Coder,
       "<tool_call>\n<function=f>\n<parameter=x>\nabc",
       {"", "<tool_call>\n<function=f>\n<parameter=x>\nabc", {}, {0}}},
  };
}

ChatParserOptions options_of(const Case& c) {
  ChatParserOptions o;
  o.reasoning = c.reasoning;
  o.start = c.start;
  o.tools_format = c.format;
  o.tools = kTools;
  return o;
}

/// The valid calls' arguments are JSON objects.
void expect_valid_arguments(const Result& r, const char* label) {
  for (const Call& c : r.calls) {
    ojson j = ojson::parse(c.arguments, nullptr, false);
    EXPECT_TRUE(j.is_object()) << label << ": " << c.arguments;
  }
}

TEST(ChatParser, CorpusWholeAndAtEveryCharacterBoundary) {
  for (const Case& c : corpus()) {
    const ChatParserOptions o = options_of(c);
    const Result whole = parse_pieces(o, {c.text});
    EXPECT_EQ(whole, c.expected) << c.label;
    expect_valid_arguments(whole, c.label);
    // Two pieces, split at every byte boundary that is a character boundary.
    for (size_t i = 0; i <= c.text.size(); ++i) {
      if (i < c.text.size() && (static_cast<unsigned char>(c.text[i]) & 0xC0) == 0x80) continue;
      EXPECT_EQ(parse_pieces(o, {c.text.substr(0, i), c.text.substr(i)}), whole)
          << c.label << " split at " << i;
    }
    // One character at a time.
    std::vector<std::string> chars;
    for (size_t i = 0; i < c.text.size(); ++i) {
      if ((static_cast<unsigned char>(c.text[i]) & 0xC0) == 0x80) {
        chars.back() += c.text[i];
      } else {
        chars.emplace_back(1, c.text[i]);
      }
    }
    EXPECT_EQ(parse_pieces(o, chars), whole) << c.label << " one character at a time";
  }
}

/// Streams the corpus through a tokenizer: encode, then incremental detokenisation deltas.
void check_token_boundaries(const Tokenizer& tok, const char* which) {
  for (const Case& c : corpus()) {
    const ChatParserOptions o = options_of(c);
    const Result whole = parse_pieces(o, {c.text});
    const std::vector<int32_t> ids = tok.encode(c.text, /*parse_special=*/true);
    IncrementalDetokenizer detok(tok, /*skip_special_tokens=*/false);
    std::vector<std::string> deltas;
    for (int32_t id : ids) deltas.push_back(detok.add(id));
    deltas.push_back(detok.flush());
    std::string joined;
    for (const auto& d : deltas) joined += d;
    ASSERT_EQ(joined, c.text) << which << ": " << c.label;
    EXPECT_EQ(parse_pieces(o, deltas), whole) << which << ": " << c.label;
    // Several tokens per delta too (a step that produced 3 tokens).
    std::vector<std::string> grouped;
    for (size_t i = 0; i < deltas.size(); i += 3) {
      std::string g;
      for (size_t j = i; j < std::min(deltas.size(), i + 3); ++j) g += deltas[j];
      grouped.push_back(g);
    }
    EXPECT_EQ(parse_pieces(o, grouped), whole) << which << " (3 per delta): " << c.label;
  }
}

TEST(ChatParser, CorpusAtDemoTokenBoundaries) {
  auto tok = Tokenizer::from_dir(std::string(TANDEM_SOURCE_DIR) + "/models/demo");
  ASSERT_NE(tok, nullptr);
  check_token_boundaries(*tok, "demo");
}

TEST(ChatParser, CorpusAtQwen3TokenBoundaries) {
  TANDEM_REQUIRE_QWEN3(qwen);
  check_token_boundaries(*qwen, "qwen3");
}

TEST(ChatParser, RandomTextsGiveTheSameResultAtAnySplit) {
  // Texts glued from tag fragments and JSON / XML pieces: whatever they are, the result must
  // not depend on how the text is split, and valid calls must have JSON object arguments.
  const std::vector<std::string> pieces = {
      "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_", "</thi", "{", "}", "[", "]",
      "\"name\"", "\"arguments\"", ": ", ", ", "\"get_weather\"", "\"x\\\"y\"", "12", "-3.5e2",
      "true", "null", "<function=get_weather>", "<parameter=days>", "<parameter=city>",
      "</parameter>", "</function>", "<param", "\n", " ", "  \n\n", "Emma", "\xc3\xa9", "<", ">",
      // Whole calls (so that valid ones occur), possibly cut or glued to other pieces.
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bath\"}}\n</tool_call>",
      "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, {\"b\": null}]}}</tool_call>",
      "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
      "</tool_call>",
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nBath\n</parameter>\n</function>"};
  std::mt19937 rng(7);
  size_t calls = 0, failed = 0, reasoned = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    std::string text;
    const int n = 1 + int(rng() % 24);
    for (int i = 0; i < n; ++i) text += pieces[rng() % pieces.size()];
    ChatParserOptions o;
    o.reasoning = rng() % 4 != 0;
    o.start = ReasoningStart(rng() % 3);
    o.tools_format = ToolFormat(rng() % 3);
    o.tools = kTools;
    const Result whole = parse_pieces(o, {text});
    expect_valid_arguments(whole, text.c_str());
    calls += whole.calls.size();
    failed += whole.failed.size();
    reasoned += !whole.reasoning.empty();
    std::vector<std::string> split;
    size_t i = 0;
    while (i < text.size()) {
      size_t len = 1 + rng() % 6;
      size_t j = std::min(text.size(), i + len);
      while (j < text.size() && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80) ++j;
      split.push_back(text.substr(i, j - i));
      i = j;
    }
    ASSERT_EQ(parse_pieces(o, split), whole) << ojson(text).dump();
  }
  // The corpus reached every outcome.
  EXPECT_GT(calls, 50u);
  EXPECT_GT(failed, 20u);
  EXPECT_GT(reasoned, 50u);
}

TEST(ChatParser, ArgumentsStreamAsTheyArrive) {
  // A long argument string is not held back: each delta's part comes out at once.
  ChatParserOptions o;
  o.tools_format = ToolFormat::kHermes;
  ChatParser p(o);
  ChatDelta d = p.feed("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"text\": \"abc");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_TRUE(d.tool_calls[0].header);
  EXPECT_EQ(d.tool_calls[0].name, "f");
  EXPECT_EQ(d.tool_calls[0].arguments, "{\"text\": \"abc");
  d = p.feed("def");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_FALSE(d.tool_calls[0].header);
  EXPECT_EQ(d.tool_calls[0].arguments, "def");

  o.tools_format = ToolFormat::kQwen3Coder;
  ChatParser x(o);
  d = x.feed("<tool_call>\n<function=f>\n<parameter=text>\nabc");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0].arguments, "{\"text\": \"abc");
  d = x.feed("def\n");  // the newline may be the one before </parameter>: held
  EXPECT_EQ(d.tool_calls.at(0).arguments, "def");
  d = x.feed("</parameter>\n</function>");
  EXPECT_EQ(d.tool_calls.at(0).arguments, "\"}");
}

TEST(ChatParser, ReasoningStartFromThePrompt) {
  EXPECT_EQ(reasoning_start_for_prompt("<|im_start|>assistant\n", false), ReasoningStart::kAuto);
  EXPECT_EQ(reasoning_start_for_prompt("<|im_start|>assistant\n<think>\n", false),
            ReasoningStart::kInThink);
  EXPECT_EQ(reasoning_start_for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n", false),
            ReasoningStart::kContent);
  EXPECT_EQ(reasoning_start_for_prompt("<think>a</think>b<|im_start|>assistant\n", false),
            ReasoningStart::kAuto);
  EXPECT_EQ(reasoning_start_for_prompt("<|im_start|>assistant\n", true), ReasoningStart::kContent);
  EXPECT_EQ(parse_tool_format("hermes"), ToolFormat::kHermes);
  EXPECT_EQ(parse_tool_format("qwen3_coder"), ToolFormat::kQwen3Coder);
  EXPECT_THROW(parse_tool_format("bogus"), tandem::Error);
  EXPECT_EQ(tool_format_for_model_type("qwen3_moe"), ToolFormat::kHermes);
  EXPECT_EQ(tool_format_for_model_type("qwen3_5_moe"), ToolFormat::kQwen3Coder);
}

TEST(JsonScanner, AcceptsAndRejects) {
  auto check = [](const std::string& s) {
    JsonScanner j;
    for (char c : s) {
      if (j.push(c).status == JsonScanner::Status::kError) return false;
    }
    return j.finish();
  };
  for (const char* ok : {"{}", "[]", "{\"a\": [1, 2.5, -0, 1e-3, true, false, null, \"\\u00e9\"]}",
                         "\"x\"", "0", "-12.5E+3", " {\"a\":{\"b\":[{}]}} "}) {
    EXPECT_TRUE(check(ok)) << ok;
    EXPECT_TRUE(!ojson::parse(ok, nullptr, false).is_discarded()) << ok;
  }
  for (const char* bad : {"{", "{\"a\"}", "{\"a\":}", "[1,]", "{,}", "01", "1.", "-", "tru",
                          "\"\\x\"", "\"\\u12g4\"", "{\"a\":1}}", "[1 2]", "{'a': 1}", "nul"}) {
    EXPECT_FALSE(check(bad)) << bad;
    EXPECT_TRUE(ojson::parse(bad, nullptr, false).is_discarded()) << bad;
  }
}

}  // namespace
}  // namespace tandem::parsers
