// Text paths of the HTTP front with a tiny byte-level BPE tokenizer (tests/data/http): the fake
// engine plays a scripted token sequence, so stop strings, detokenisation, chat and
// streaming can be checked against known text.
#include "server/http/http_test_util.h"
#include "server/tokenizer/tokenizer_test_util.h"

namespace tandem::testing {
namespace {

using json = nlohmann::json;

const std::string kScript =
    "Hello world! The answer is 42.\nCaf\xc3\xa9 na\xc3\xafve END of the text.";

class HttpTextTest : public HttpServerTest {
 protected:
  void SetUp() override {
    tok0_ = Tokenizer::from_dir(http_data_dir());
    ASSERT_NE(tok0_, nullptr);
    ASSERT_EQ(int64_t(tok0_->vocab_size()), kTinyVocab);
    script_ = tok0_->encode(kScript, true);
    // Completions prompts end in ':'; chat prompts end in '\n'.
    colon_ = tok0_->encode(":", true).back();
    newline_ = tok0_->encode("\n", true).back();
    eos_script_ = tok0_->encode("ab", true);
    eos_script_.push_back(kTinyImEnd);
    FakeEngine::Options eo;
    eo.vocab = kTinyVocab;
    eo.eos = kTinyImEnd;
    eo.scripts[colon_] = script_;
    eo.scripts[newline_] = script_;
    eo.scripts[tok0_->encode("!", true).back()] = eos_script_;
    start(eo, {}, /*with_text=*/true);
  }

  /// Concatenated text of a stream (completions "text" or chat "content"), per choice.
  static std::map<int, std::string> stream_text(const std::vector<json>& events, bool chat) {
    std::map<int, std::string> out;
    for (const auto& ev : events) {
      if (!ev.is_object() || !ev.contains("choices")) continue;
      for (const auto& c : ev["choices"]) {
        int i = c["index"];
        if (chat) {
          if (c["delta"].contains("content")) out[i] += c["delta"]["content"].get<std::string>();
        } else {
          out[i] += c["text"].get<std::string>();
        }
      }
    }
    return out;
  }

  std::unique_ptr<Tokenizer> tok0_;
  std::vector<int32_t> script_;
  std::vector<int32_t> eos_script_;
  int32_t colon_ = 0;
  int32_t newline_ = 0;
};

TEST_F(HttpTextTest, CompletionText) {
  auto r = post("/v1/completions",
                {{"prompt", "Say:"}, {"max_tokens", script_.size()}, {"return_token_ids", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  json c = r.json()["choices"][0];
  EXPECT_EQ(c["text"], kScript);
  EXPECT_EQ(c["finish_reason"], "length");
  EXPECT_EQ(c["token_ids"].get<std::vector<int32_t>>(), script_);
  EXPECT_EQ(c["prompt_token_ids"].get<std::vector<int32_t>>(), tok0_->encode("Say:", true));
  EXPECT_EQ(r.json()["usage"]["prompt_tokens"], tok0_->encode("Say:", true).size());
  // echo puts the prompt first
  r = post("/v1/completions", {{"prompt", "Say:"}, {"max_tokens", 5}, {"echo", true}});
  EXPECT_EQ(
      r.json()["choices"][0]["text"],
      "Say:" + tok0_->decode(std::vector<int32_t>(script_.begin(), script_.begin() + 5), true));
}

TEST_F(HttpTextTest, StopStringsStreamingEqualsNonStreaming) {
  struct Case {
    json stop;
    bool include;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"END", false, kScript.substr(0, kScript.find("END"))},
      {"ld! T", false, "Hello wor"},  // spans tokens
      {json::array({"zzz", "\xc3\xa9 n"}), false, kScript.substr(0, kScript.find("\xc3\xa9 n"))},
      {"answer", true, "Hello world! The answer"},
      {"Hello", false, ""},
      {"no such text", false, kScript},
  };
  for (const bool chat : {false, true}) {
    for (const auto& k : cases) {
      json body = {{"max_tokens", script_.size()},
                   {"stop", k.stop},
                   {"include_stop_str_in_output", k.include}};
      if (chat) {
        body["messages"] = {{{"role", "user"}, {"content", "go"}}};
      } else {
        body["prompt"] = "Say:";
      }
      const std::string path = chat ? "/v1/chat/completions" : "/v1/completions";
      auto full = post(path, body);
      ASSERT_EQ(full.status, 200) << full.body;
      json c = full.json()["choices"][0];
      std::string text = chat ? c["message"]["content"] : c["text"];
      EXPECT_EQ(text, k.expected) << k.stop.dump() << " chat=" << chat;
      const bool matched = k.expected != kScript;
      EXPECT_EQ(c["finish_reason"], matched ? "stop" : "length") << k.stop.dump();
      if (matched) {
        EXPECT_TRUE(c["stop_reason"].is_string());
      }

      body["stream"] = true;
      auto s = post(path, body);
      ASSERT_EQ(s.status, 200);
      auto events = sse_events(s.body);
      EXPECT_EQ(stream_text(events, chat)[0], k.expected) << k.stop.dump() << " chat=" << chat;
      // No chunk ever carries a partial character (the detokenizer and hold-back see to it).
      for (const auto& ev : events) {
        EXPECT_EQ(ev.dump().find("\\ufffd"), std::string::npos) << ev.dump();
      }
    }
  }
  // Stop-string finishes abort the engine request (the fake engine records the abort).
  EXPECT_TRUE(engine_->wait_idle());
  EXPECT_FALSE(engine_->aborted().empty());
}

TEST_F(HttpTextTest, ChatCompletion) {
  json body = {{"model", "test-model"},
               {"messages",
                {{{"role", "system"}, {"content", "You are terse."}},
                 {{"role", "user"}, {"content", "hi"}}}},
               {"max_completion_tokens", script_.size()},
               {"logprobs", true},
               {"top_logprobs", 2}};
  auto r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = r.json();
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  const json& c = j["choices"][0];
  EXPECT_EQ(c["message"]["role"], "assistant");
  EXPECT_EQ(c["message"]["content"], kScript);
  const json& content = c["logprobs"]["content"];
  ASSERT_EQ(content.size(), script_.size());
  std::string bytes;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& e = content[i];
    EXPECT_TRUE(e["token"].is_string());
    EXPECT_FLOAT_EQ(e["logprob"].get<float>(), FakeEngine::fake_logprob(script_[i]));
    EXPECT_EQ(e["top_logprobs"].size(), 2u);
    EXPECT_TRUE(e["top_logprobs"][0].contains("bytes"));
    for (int b : e["bytes"]) bytes += char(b);
  }
  EXPECT_EQ(bytes, kScript);  // token bytes add up to the text
  // The prompt is the rendered template.
  auto sub = engine_->submitted();
  std::string prompt = tok0_->decode(sub.back().prompt_ids, false);
  EXPECT_EQ(prompt,
            "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n");

  // Streaming: a role chunk first, then content; same text; usage at the end.
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  auto s = post("/v1/chat/completions", body);
  auto events = sse_events(s.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(events[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(stream_text(events, true)[0], kScript);
  EXPECT_EQ(events[events.size() - 3]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(events[events.size() - 2]["usage"]["completion_tokens"], script_.size());
  size_t streamed_logprobs = 0;
  for (const auto& ev : events) {
    if (ev.is_object() && ev.contains("choices") && !ev["choices"].empty() &&
        ev["choices"][0]["logprobs"].is_object()) {
      streamed_logprobs += ev["choices"][0]["logprobs"]["content"].size();
    }
  }
  EXPECT_EQ(streamed_logprobs, script_.size());
}

TEST_F(HttpTextTest, ChatTemplateKwargsAndContinue) {
  json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
               {"max_tokens", 2},
               {"chat_template_kwargs", {{"enable_thinking", false}}}};
  ASSERT_EQ(post("/v1/chat/completions", body).status, 200);
  std::string prompt = tok0_->decode(engine_->submitted().back().prompt_ids, false);
  EXPECT_NE(prompt.find("<think>\n\n</think>\n\n"), std::string::npos) << prompt;

  body = {{"messages",
           {{{"role", "user"}, {"content", "hi"}}, {{"role", "assistant"}, {"content", "Sure:"}}}},
          {"max_tokens", 2},
          {"add_generation_prompt", false},
          {"continue_final_message", true}};
  ASSERT_EQ(post("/v1/chat/completions", body).status, 200);
  prompt = tok0_->decode(engine_->submitted().back().prompt_ids, false);
  EXPECT_EQ(prompt, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nSure:");
}

TEST_F(HttpTextTest, EosIsNotInTheText) {
  // The "!" prompt plays "ab" + <|im_end|> (the fake EOS).
  for (bool skip : {true, false}) {
    auto r = post("/v1/completions", {{"prompt", "Go!"},
                                      {"max_tokens", 10},
                                      {"skip_special_tokens", skip},
                                      {"return_token_ids", true}});
    json c = r.json()["choices"][0];
    EXPECT_EQ(c["text"], "ab");
    EXPECT_EQ(c["finish_reason"], "stop");
    EXPECT_EQ(c["token_ids"].get<std::vector<int32_t>>(), eos_script_);
  }
  auto r = post("/v1/completions", {{"prompt", "Go!"},
                                    {"max_tokens", 10},
                                    {"skip_special_tokens", false},
                                    {"include_stop_str_in_output", true}});
  EXPECT_EQ(r.json()["choices"][0]["text"], "ab<|im_end|>");
}

TEST_F(HttpTextTest, TokenizeDetokenize) {
  auto r = post("/tokenize", {{"prompt", "Hello world<|im_end|>"}, {"return_token_strs", true}});
  ASSERT_EQ(r.status, 200) << r.body;
  json j = r.json();
  auto ids = j["tokens"].get<std::vector<int32_t>>();
  EXPECT_EQ(ids, tok0_->encode("Hello world<|im_end|>", true));
  EXPECT_EQ(ids.back(), kTinyImEnd);  // special tokens are parsed
  EXPECT_EQ(j["count"], ids.size());
  EXPECT_EQ(j["max_model_len"], 4096);
  EXPECT_EQ(j["token_strs"].size(), ids.size());

  auto d = post("/detokenize", {{"tokens", ids}});
  ASSERT_EQ(d.status, 200) << d.body;
  EXPECT_EQ(d.json()["prompt"], "Hello world<|im_end|>");
  EXPECT_EQ(post("/detokenize", {{"tokens", {kTinyVocab}}}).status, 400);
  EXPECT_EQ(post("/detokenize", {{"tokens", "abc"}}).status, 400);

  auto m = post("/tokenize", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  ASSERT_EQ(m.status, 200) << m.body;
  EXPECT_EQ(tok0_->decode(m.json()["tokens"].get<std::vector<int32_t>>(), false),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(post("/tokenize", {{"model", "other"}, {"prompt", "x"}}).status, 404);
  EXPECT_EQ(post("/tokenize", json::object()).status, 400);
}

TEST_F(HttpTextTest, ManyChoicesWithText) {
  auto r = post("/v1/completions",
                {{"prompt", {"A:", "B:"}}, {"n", 3}, {"max_tokens", 20}, {"stop", "wor"}});
  ASSERT_EQ(r.status, 200) << r.body;
  json j = r.json();
  ASSERT_EQ(j["choices"].size(), 6u);
  for (const auto& c : j["choices"]) {
    EXPECT_EQ(c["text"], "Hello ");
    EXPECT_EQ(c["finish_reason"], "stop");
    EXPECT_EQ(c["stop_reason"], "wor");
  }
}

}  // namespace
}  // namespace tandem::testing

namespace tandem::testing {
namespace {

// The real Qwen3 tokenizer and chat template (when tools/fetch_qwen3_tokenizer.sh has run).
class HttpQwen3Test : public HttpServerTest {};

TEST_F(HttpQwen3Test, ChatWithToolsAndThinkingOff) {
  TANDEM_REQUIRE_QWEN3(qwen);
  const int32_t im_end = *qwen->token_to_id("<|im_end|>");
  const int32_t newline = qwen->encode("</think>\n\n").back();  // the prompt's last token
  FakeEngine::Options eo;
  eo.vocab = qwen->vocab_size();
  eo.eos = im_end;
  std::vector<int32_t> reply = qwen->encode("Hello there! \xe4\xbd\xa0\xe5\xa5\xbd");
  reply.push_back(im_end);
  eo.scripts[newline] = reply;
  start(eo, {}, /*with_text=*/true, qwen3_tokenizer_dir()->string());

  json body = {
      {"messages",
       {{{"role", "system"}, {"content", "Be nice."}}, {{"role", "user"}, {"content", "Hi"}}}},
      {"tools",
       {{{"type", "function"},
         {"function",
          {{"name", "get_time"},
           {"description", "Current time"},
           {"parameters", {{"type", "object"}, {"properties", json::object()}}}}}}}},
      {"chat_template_kwargs", {{"enable_thinking", false}}},
      {"max_tokens", 50}};
  auto r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  json c = r.json()["choices"][0];
  EXPECT_EQ(c["message"]["content"], "Hello there! \xe4\xbd\xa0\xe5\xa5\xbd");
  EXPECT_EQ(c["finish_reason"], "stop");
  std::string prompt = qwen->decode(engine_->submitted().back().prompt_ids);
  EXPECT_EQ(prompt.rfind("<|im_start|>system\nBe nice.\n\n# Tools", 0), 0u) << prompt;
  EXPECT_NE(prompt.find("\"name\": \"get_time\""), std::string::npos) << prompt;
  const std::string tail =
      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
  ASSERT_GE(prompt.size(), tail.size());
  EXPECT_EQ(prompt.substr(prompt.size() - tail.size()), tail) << prompt;

  // Streaming gives the same text; a stop string inside the CJK characters' bytes is exact.
  body["stream"] = true;
  body["stop"] = "\xe5\xa5\xbd";
  auto s = post("/v1/chat/completions", body);
  std::string text;
  for (const auto& ev : sse_events(s.body)) {
    if (ev.is_object() && !ev["choices"].empty() && ev["choices"][0]["delta"].contains("content")) {
      text += ev["choices"][0]["delta"]["content"].get<std::string>();
    }
  }
  EXPECT_EQ(text, "Hello there! \xe4\xbd\xa0");
}

}  // namespace
}  // namespace tandem::testing
