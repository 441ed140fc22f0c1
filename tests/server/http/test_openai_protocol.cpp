// Unit tests of the pieces under the HTTP front: stop strings, request parsing, metrics.
#include <gtest/gtest.h>

#include <random>

#include "server/http/metrics.h"
#include "server/http/openai_protocol.h"
#include "server/http/stop_strings.h"

namespace tandem::openai {
namespace {

using json = nlohmann::json;

/// Feeds pieces; returns the emitted text.
std::string feed(StopStringMatcher& m, const std::vector<std::string>& pieces) {
  std::string out;
  for (const auto& p : pieces) out += m.push(p);
  if (!m.stopped()) out += m.flush();
  return out;
}

TEST(StopStrings, SpansPiecesAndHoldsBack) {
  StopStringMatcher m({"STOP"});
  EXPECT_EQ(m.push("abc S"), "abc ");  // "S" may start STOP
  EXPECT_EQ(m.held_back(), 1u);
  EXPECT_EQ(m.push("T"), "");
  EXPECT_EQ(m.push("OP and more"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "STOP");
  EXPECT_EQ(m.push("x"), "");
}

TEST(StopStrings, FalseStartIsReleased) {
  StopStringMatcher m({"STOP"});
  EXPECT_EQ(m.push("ST"), "");
  EXPECT_EQ(m.push("x"), "STx");
  EXPECT_EQ(m.push("S"), "");
  EXPECT_EQ(m.flush(), "S");
  EXPECT_FALSE(m.stopped());
}

TEST(StopStrings, EarliestMatchWinsAndIncludeStop) {
  StopStringMatcher m({"world", "lo w"}, /*include_stop=*/true);
  EXPECT_EQ(feed(m, {"hel", "lo wor", "ld"}), "hello w");
  EXPECT_EQ(m.matched(), "lo w");
  StopStringMatcher none;
  EXPECT_EQ(feed(none, {"a", "b"}), "ab");
}

TEST(StopStrings, RandomSplitsAgreeWithWholeText) {
  std::mt19937 rng(7);
  const std::string alphabet = "ab\xc3\xa9 ";  // includes a 2-byte character
  for (int iter = 0; iter < 2000; ++iter) {
    std::string text;
    int len = int(rng() % 30);
    for (int i = 0; i < len; ++i) {
      if (rng() % 4 == 0) {
        text += "\xc3\xa9";
      } else {
        text += alphabet[rng() % 2 == 0 ? rng() % 2 : 4];
      }
    }
    std::vector<std::string> stops = {"ab", "\xc3\xa9 a", "bb b"};
    // Reference: cut at the earliest occurrence of any stop string.
    size_t cut = std::string::npos;
    for (const auto& s : stops) cut = std::min(cut, text.find(s));
    std::string expected = cut == std::string::npos ? text : text.substr(0, cut);
    // Split at random code point boundaries.
    std::vector<std::string> pieces;
    size_t i = 0;
    while (i < text.size()) {
      size_t n = 1 + rng() % 4;
      size_t j = std::min(text.size(), i + n);
      while (j < text.size() && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80) ++j;
      pieces.push_back(text.substr(i, j - i));
      i = j;
    }
    StopStringMatcher m(stops);
    std::string got;
    for (const auto& p : pieces) {
      std::string e = m.push(p);
      // Never emits a partial character.
      if (!e.empty()) {
        EXPECT_NE(static_cast<unsigned char>(e.back()) & 0xE0, 0xC0u) << text;
      }
      got += e;
    }
    if (!m.stopped()) got += m.flush();
    EXPECT_EQ(got, expected) << "text: " << text;
    EXPECT_EQ(m.stopped(), cut != std::string::npos);
  }
}

TEST(Protocol, CompletionDefaultsAndPrompts) {
  auto r = parse_completion_request(json{{"prompt", "hi"}}, 100);
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(*r.prompts[0].text, "hi");
  EXPECT_EQ(r.params.n, 1);
  EXPECT_FALSE(r.params.max_tokens.has_value());
  EXPECT_EQ(r.params.logprobs, -1);
  EXPECT_FLOAT_EQ(r.params.sampling.temperature, 1.0f);

  r = parse_completion_request(json{{"prompt", {"a", "b"}}, {"max_tokens", 5.0}}, 100);
  EXPECT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(*r.params.max_tokens, 5);
  r = parse_completion_request(json{{"prompt", {{1, 2}, {3}}}, {"stop", "x"}}, 100);
  EXPECT_EQ(r.prompts[1].ids, std::vector<int32_t>{3});
  EXPECT_EQ(r.params.stop, std::vector<std::string>{"x"});
  r = parse_completion_request(json{{"prompt", {7}}, {"seed", -1}, {"top_k", 0}}, 100);
  EXPECT_EQ(*r.params.sampling.seed, ~uint64_t(0));
  // null means default
  r = parse_completion_request(json{{"prompt", {7}}, {"temperature", nullptr}}, 100);
  EXPECT_FLOAT_EQ(r.params.sampling.temperature, 1.0f);
}

TEST(Protocol, ErrorsNameTheParam) {
  auto param_of = [](const json& body) -> std::string {
    try {
      parse_completion_request(body, 100);
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400);
      return e.param();
    }
    return "<no error>";
  };
  EXPECT_EQ(param_of({{"prompt", {100}}}), "prompt");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"n", 1e300}}), "n");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"max_tokens", 18446744073709551615ull}}), "max_tokens");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"top_p", -0.0}}), "top_p");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"best_of", 3}}), "best_of");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"suffix", "x"}}), "suffix");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"response_format", {{"type", "xml"}}}}),
            "response_format.type");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"structured_outputs", {{"choice", {1, 2}}}}}),
            "structured_outputs.choice");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"thinking_token_budget", -2}}), "thinking_token_budget");
  // Known fields that would change the output but are not implemented: refused, not ignored.
  for (const char* name :
       {"allowed_token_ids", "bad_words", "truncate_prompt_tokens", "logits_processors", "audio",
        "web_search_options", "functions", "function_call"}) {
    EXPECT_EQ(param_of({{"prompt", {1}}, {name, {1}}}), name);
  }
  EXPECT_EQ(param_of({{"prompt", {1}}, {"modalities", {"text", "audio"}}}), "modalities");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"modalities", {"text"}}, {"functions", nullptr}}),
            "<no error>");
  EXPECT_EQ(param_of({{"prompt", {1}},
                      {"response_format", {{"type", "structural_tag"}, {"structures", 1}}}}),
            "response_format");
  EXPECT_EQ(param_of({{"prompt", {1}}, {"structured_outputs", {{"structural_tag", "{x"}}}}),
            "structured_outputs.structural_tag");
  // Accepted and ignored (no effect on the output), and unknown fields.
  EXPECT_EQ(param_of({{"prompt", {1}},
                      {"service_tier", "auto"},
                      {"prompt_cache_key", "k"},
                      {"safety_identifier", "s"},
                      {"prediction", {{"type", "content"}, {"content", "x"}}},
                      {"priority", 1},
                      {"request_id", "r"},
                      {"no_such_field", 1}}),
            "<no error>");
}

TEST(Protocol, ChatMessagesNormalised) {
  json body = {
      {"messages",
       {{{"role", "developer"}, {"content", "be brief"}},
        {{"role", "user"},
         {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}},
        {{"role", "assistant"},
         {"content", nullptr},
         {"tool_calls",
          {{{"type", "function"}, {"function", {{"name", "f"}, {"arguments", "{}"}}}}}}},
        {{"role", "tool"}, {"content", "42"}, {"tool_call_id", "c1"}}}},
      {"logprobs", true},
      {"max_completion_tokens", 7},
      {"max_tokens", 9},
      {"chat_template_kwargs", {{"enable_thinking", false}}}};
  auto r = parse_chat_request(body, 100);
  EXPECT_EQ(r.messages[0]["role"], "system");
  EXPECT_EQ(r.messages[1]["content"], "a\nb");
  EXPECT_TRUE(r.messages[2]["content"].is_null());
  EXPECT_EQ(r.messages[3]["tool_call_id"], "c1");
  EXPECT_EQ(r.params.logprobs, 0);
  EXPECT_EQ(*r.params.max_tokens, 7);
  EXPECT_EQ(r.chat_template_kwargs["enable_thinking"], false);
  EXPECT_TRUE(r.add_generation_prompt);

  EXPECT_THROW(
      parse_chat_request(
          json{{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}}, 100),
      ApiError);
  EXPECT_THROW(parse_chat_request(json{{"messages", {{{"role", "user"}}}}}, 100), ApiError);
}

TEST(Protocol, BodyParsing) {
  EXPECT_THROW(parse_body(""), ApiError);
  EXPECT_THROW(parse_body("nul"), ApiError);
  EXPECT_THROW(parse_body("\"str\""), ApiError);
  EXPECT_THROW(parse_body("{\"a\": 1e999}"), ApiError);
  EXPECT_THROW(parse_body(std::string(1000, '[') + std::string(1000, ']')), ApiError);
  std::string deep = "{\"a\":" + std::string(100, '[') + std::string(100, ']') + "}";
  EXPECT_THROW(parse_body(deep), ApiError);
  EXPECT_NO_THROW(parse_body("{\"a\": [[[1]]]}"));
}

TEST(Metrics, HistogramBuckets) {
  Histogram h({0.1, 1.0});
  h.observe(0.05);
  h.observe(0.5);
  h.observe(5.0);
  std::string out;
  h.render(out, "x", "help");
  EXPECT_NE(out.find("x_bucket{le=\"0.1\"} 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"1\"} 2\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"+Inf\"} 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_count 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_sum 5.55\n"), std::string::npos) << out;
}

}  // namespace
}  // namespace tandem::openai
