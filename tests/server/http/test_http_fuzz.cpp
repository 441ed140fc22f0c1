// Thousands of random and malformed requests (fixed seed) against a live server: every one
// must get a well-formed answer (a JSON error or a success), and the server must stay healthy.
#include <cctype>
#include <iostream>
#include <random>

#include "server/http/http_test_util.h"

namespace tandem::testing {
namespace {

using json = nlohmann::json;

class Fuzzer {
 public:
  explicit Fuzzer(uint32_t seed) : rng_(seed) {}

  uint32_t below(uint32_t n) { return rng_() % n; }
  bool coin(double p = 0.5) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

  std::string random_bytes(size_t max_len) {
    std::string s(below(uint32_t(max_len) + 1), '\0');
    for (auto& c : s) c = char(below(256));
    return s;
  }

  std::string random_string() {
    switch (below(6)) {
      case 0: return "";
      case 1: return std::string(1 + below(3000), 'a' + char(below(26)));
      case 2: return "<|im_start|>user\nhi<|im_end|>";
      case 3: return "h\xc3\xa9llo \xe2\x82\xac \xf0\x9f\x98\x80";
      case 4: return "\\u0000\"\n\t";
      default: {
        std::string s;
        for (uint32_t i = 0, n = below(20); i < n; ++i) s += char(32 + below(95));
        return s;
      }
    }
  }

  json random_number() {
    switch (below(10)) {
      case 0: return 0;
      case 1: return -1;
      case 2: return int64_t(below(50));
      case 3: return std::numeric_limits<int64_t>::max();
      case 4: return std::numeric_limits<int64_t>::min();
      case 5: return std::numeric_limits<uint64_t>::max();
      case 6: return 1e300;
      case 7: return -1e-300;
      case 8: return std::uniform_real_distribution<double>(-3, 3)(rng_);
      default: return 0.5;
    }
  }

  json random_value(int depth = 0) {
    switch (below(depth > 3 ? 5 : 8)) {
      case 0: return nullptr;
      case 1: return coin();
      case 2:
      case 3: return random_number();
      case 4: return random_string();
      case 5: {
        json a = json::array();
        for (uint32_t i = 0, n = below(5); i < n; ++i) a.push_back(random_value(depth + 1));
        return a;
      }
      case 6: {
        json a = json::array();  // token ids, sometimes out of range
        for (uint32_t i = 0, n = below(8); i < n; ++i) a.push_back(int(below(1100)) - 50);
        return a;
      }
      default: {
        json o = json::object();
        for (uint32_t i = 0, n = below(4); i < n; ++i) {
          o[random_key()] = random_value(depth + 1);
        }
        return o;
      }
    }
  }

  std::string random_key() {
    static const std::vector<std::string> keys = {"model",
                                                  "prompt",
                                                  "messages",
                                                  "max_tokens",
                                                  "max_completion_tokens",
                                                  "temperature",
                                                  "top_p",
                                                  "top_k",
                                                  "min_p",
                                                  "n",
                                                  "stream",
                                                  "stream_options",
                                                  "stop",
                                                  "stop_token_ids",
                                                  "seed",
                                                  "logprobs",
                                                  "top_logprobs",
                                                  "echo",
                                                  "ignore_eos",
                                                  "min_tokens",
                                                  "presence_penalty",
                                                  "frequency_penalty",
                                                  "repetition_penalty",
                                                  "return_token_ids",
                                                  "prompt_logprobs",
                                                  "tools",
                                                  "tool_choice",
                                                  "chat_template_kwargs",
                                                  "role",
                                                  "content",
                                                  "include_usage",
                                                  "add_generation_prompt",
                                                  "continue_final_message",
                                                  "tokens",
                                                  "logit_bias",
                                                  "response_format",
                                                  "type",
                                                  "text",
                                                  "best_of",
                                                  "skip_special_tokens",
                                                  "include_stop_str_in_output",
                                                  "return_tokens_as_token_ids",
                                                  "suffix",
                                                  "user"};
    return keys[below(uint32_t(keys.size()))];
  }

  json valid_completion() {
    json j = {{"prompt", json::array({1, 2, 3})}, {"max_tokens", 1 + below(8)}};
    if (coin()) j["prompt"] = random_string().substr(0, 50);
    if (coin(0.3)) j["stream"] = true;
    return j;
  }

  json valid_chat() {
    json msgs = json::array();
    for (uint32_t i = 0, n = 1 + below(3); i < n; ++i) {
      msgs.push_back(
          {{"role", i % 2 ? "assistant" : "user"}, {"content", random_string().substr(0, 40)}});
    }
    json j = {{"messages", msgs}, {"max_tokens", 1 + below(8)}};
    if (coin(0.3)) j["stream"] = true;
    return j;
  }

  /// A body: mutated valid request, random JSON, truncated JSON, raw bytes or deep nesting.
  std::string body_for(bool chat) {
    json base = chat ? valid_chat() : valid_completion();
    switch (below(8)) {
      case 0: return random_bytes(200);
      case 1: {
        std::string s = base.dump();
        return s.substr(0, below(uint32_t(s.size())));
      }
      case 2: return random_value().dump();
      case 3: {
        int d = int(below(3000));
        return std::string(size_t(d), '[') + std::string(size_t(below(uint32_t(d) + 1)), ']');
      }
      default: {
        for (uint32_t i = 0, n = 1 + below(4); i < n; ++i) base[random_key()] = random_value();
        if (chat && coin(0.5) && base["messages"].is_array() && !base["messages"].empty()) {
          json& m = base["messages"][below(uint32_t(base["messages"].size()))];
          if (m.is_object()) m[random_key()] = random_value();
        }
        return base.dump(-1, ' ', false, json::error_handler_t::replace);
      }
    }
  }

 private:
  std::mt19937 rng_;
};

class HttpFuzzTest : public HttpServerTest {};

TEST_F(HttpFuzzTest, RandomBodiesNeverBreakTheServer) {
  FakeEngine::Options eo;
  eo.vocab = kTinyVocab;
  eo.max_model_len = 64;  // keeps valid requests short
  eo.step = std::chrono::microseconds(100);
  start(eo, {}, /*with_text=*/true);
  Fuzzer fz(12345);
  HttpClient c;
  const std::vector<std::string> paths = {"/v1/completions", "/v1/chat/completions", "/tokenize",
                                          "/detokenize"};
  int ok = 0;
  int errors = 0;
  constexpr int kRequests = 3000;
  for (int i = 0; i < kRequests; ++i) {
    const std::string& path = paths[fz.below(uint32_t(paths.size()))];
    std::string body = fz.body_for(path == "/v1/chat/completions");
    auto r = c.request("POST", url(path), body, {}, 10000);
    ASSERT_EQ(r.code, CURLE_OK) << "request " << i << " to " << path << " body " << body;
    ASSERT_TRUE(r.status == 200 || r.status == 400 || r.status == 404 || r.status == 413)
        << r.status << " for " << path << " body " << body << " -> " << r.body;
    if (r.status == 200) {
      ++ok;
      if (r.headers.find("text/event-stream") != std::string::npos) {
        auto events = sse_events(r.body);
        ASSERT_FALSE(events.empty());
        EXPECT_EQ(events.back(), "[DONE]");
      } else {
        EXPECT_TRUE(json::accept(r.body)) << r.body;
      }
    } else {
      ++errors;
      json j = json::parse(r.body, nullptr, false);
      ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
      EXPECT_TRUE(j["error"]["message"].is_string());
    }
  }
  std::cout << "[fuzz] " << ok << " answered 200, " << errors << " errors\n";
  EXPECT_GT(ok, 100);
  EXPECT_GT(errors, 1000);
  EXPECT_EQ(c.get(url("/health")).status, 200);
  EXPECT_TRUE(engine_->wait_idle());
  // Wrong methods and paths with random bodies, on fresh connections.
  for (int i = 0; i < 200; ++i) {
    HttpClient fresh;
    static const char* methods[] = {"GET", "PUT", "DELETE", "PATCH", "POST"};
    std::string path = "/" + fz.random_string().substr(0, 10);
    for (size_t k = 1; k < path.size(); ++k) {
      if (!std::isalnum(static_cast<unsigned char>(path[k]))) path[k] = 'x';
    }
    auto r = fresh.request(methods[fz.below(5)], url(path), fz.random_bytes(100));
    EXPECT_EQ(r.code, CURLE_OK);
    EXPECT_TRUE(r.status >= 400 && r.status < 500) << r.status << " " << path;
  }
  EXPECT_EQ(c.get(url("/health")).status, 200);
}

}  // namespace
}  // namespace tandem::testing
