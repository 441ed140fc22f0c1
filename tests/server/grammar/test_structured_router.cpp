// Structured outputs through the router (disaggregated serving, CPU roles, the demo model):
// the HTTP front over a Router over a prefill instance and a decode instance (DP=2), both
// behind their control servers (every request crosses the wire codec). The front only checks
// the grammar; the prefill instance compiles it for token 1 and the decode rank for the rest.
//  - json_schema, regex, choice, EBNF, tool_choice "required" and a thinking budget give
//    valid output, token for token the colocated server's with the same seed, streamed or not;
//  - bad grammars are 400s naming the field at the router's front;
//  - an instance without a grammar engine refuses a constrained request with a 400;
//  - every request releases its constraints on both instances.
#include <gtest/gtest.h>

#include <chrono>
#include <regex>
#include <thread>

#include "disagg/decode_instance.h"
#include "disagg/instance_api.h"
#include "disagg/prefill_instance.h"
#include "engine/engine.h"
#include "model/qwen3_moe.h"
#include "server/grammar/grammar.h"
#include "server/grammar/person_schema.h"
#include "server/http/http_client.h"
#include "server/http/http_server.h"
#include "server/router.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem {
namespace {

using nlohmann::json;
using testing::HttpClient;
using testing::HttpResult;
using testing::sse_events;

std::string demo_dir() { return std::string(TANDEM_SOURCE_DIR) + "/models/demo"; }

EngineConfig small_engine() {
  EngineConfig cfg;
  cfg.max_num_seqs = 8;
  cfg.kv_cache_mb = 32;
  return cfg;
}

// Router -> remote prefill (TP=1) and remote decode (DP=2), with the front on top.
struct Cluster {
  explicit Cluster(bool grammar_engine) {
    const std::string dir = demo_dir();
    PrefillInstanceConfig pc;
    pc.model_dir = dir;
    pc.engine = small_engine();
    DecodeInstanceConfig dc;
    dc.model_dir = dir;
    dc.dp = 2;
    dc.engine = small_engine();
    if (grammar_engine) {
      pc.engine.constraint_factory = grammar::instance_constraint_factory(dir);
      dc.engine.constraint_factory = grammar::instance_constraint_factory(dir);
    }
    prefill = std::make_unique<PrefillInstance>(pc);
    decode = std::make_unique<DecodeInstance>(dc);
    prefill_server = std::make_unique<InstanceServer>(nullptr, prefill.get(), "127.0.0.1", 0);
    decode_server = std::make_unique<InstanceServer>(decode.get(), nullptr, "127.0.0.1", 0);
    remote_prefill =
        std::make_unique<RemotePrefill>("127.0.0.1:" + std::to_string(prefill_server->port()));
    remote_decode =
        std::make_unique<RemoteDecode>("127.0.0.1:" + std::to_string(decode_server->port()));
    router = std::make_unique<Router>(std::vector<PrefillClient*>{remote_prefill.get()},
                                      std::vector<DecodeClient*>{remote_decode.get()});
    tok = Tokenizer::from_dir(dir);
    tmpl = ChatTemplate::from_dir(dir);
    HttpServerConfig hc;
    hc.host = "127.0.0.1";
    hc.port = 0;
    hc.model_name = "demo";
    server = std::make_unique<HttpServer>(hc, *router, tok.get(), tmpl.get());
    server->start();
  }
  ~Cluster() {
    server.reset();
    router.reset();
    remote_decode.reset();
    remote_prefill.reset();
    decode_server.reset();
    prefill_server.reset();
    prefill.reset();
    decode.reset();
  }
  std::unique_ptr<PrefillInstance> prefill;
  std::unique_ptr<DecodeInstance> decode;
  std::unique_ptr<InstanceServer> prefill_server, decode_server;
  std::unique_ptr<RemotePrefill> remote_prefill;
  std::unique_ptr<RemoteDecode> remote_decode;
  std::unique_ptr<Router> router;
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<ChatTemplate> tmpl;
  std::unique_ptr<HttpServer> server;
};

class StructuredRouterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new Cluster(/*grammar_engine=*/true);
    const std::string dir = demo_dir();
    EngineConfig cfg = small_engine();
    colocated_engine_ = new AsyncEngine(Qwen3MoeCpu::load(dir), cfg);
    HttpServerConfig hc;
    hc.host = "127.0.0.1";
    hc.port = 0;
    hc.model_name = "demo";
    colocated_ = new HttpServer(hc, *colocated_engine_, cluster_->tok.get(), cluster_->tmpl.get());
    colocated_->start();
  }
  static void TearDownTestSuite() {
    delete colocated_;
    delete colocated_engine_;
    delete cluster_;
  }
  void TearDown() override { expect_idle(); }

  static std::string url(const HttpServer& s, const std::string& path) {
    return "http://127.0.0.1:" + std::to_string(s.port()) + path;
  }
  /// The request through the router and through the colocated server: both 200, same body
  /// but for ids and timestamps. Returns the router's reply.
  json both(const std::string& path, json body) {
    body["model"] = "demo";
    if (path == "/v1/chat/completions" && !body.contains("messages")) {
      body["messages"] = {{{"role", "user"}, {"content", "Tell me about Emma."}}};
    }
    HttpResult r = client_.post(url(*cluster_->server, path), body);
    HttpResult c = client_.post(url(*colocated_, path), body);
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(c.status, 200) << c.body;
    if (r.status != 200 || c.status != 200) return json::object();
    if (body.value("stream", false)) {
      EXPECT_EQ(stream_text(r), stream_text(c));
      return json{{"text", stream_text(r)}};
    }
    json a = r.json(), b = c.json();
    for (json* j : {&a, &b}) {  // tool call ids are random
      for (auto& ch : (*j)["choices"]) {
        if (!ch.contains("message") || !ch["message"].contains("tool_calls")) continue;
        for (auto& tc : ch["message"]["tool_calls"]) tc.erase("id");
      }
    }
    EXPECT_EQ(a["choices"], b["choices"])
        << "router:    " << a.dump() << "\ncolocated: " << b.dump();
    return a;
  }
  /// The streamed content / text and tool-call arguments, concatenated.
  static std::string stream_text(const HttpResult& r) {
    std::string out;
    for (const auto& ev : sse_events(r.body)) {
      if (!ev.contains("choices") || ev["choices"].empty()) continue;
      const json& ch = ev["choices"][0];
      if (ch.contains("text") && ch["text"].is_string()) out += ch["text"].get<std::string>();
      if (!ch.contains("delta")) continue;
      const json& d = ch["delta"];
      if (d.contains("content") && d["content"].is_string()) out += d["content"].get<std::string>();
      if (d.contains("tool_calls")) {
        for (const auto& tc : d["tool_calls"]) {
          if (tc.contains("function") && tc["function"].contains("arguments")) {
            out += tc["function"]["arguments"].get<std::string>();
          }
        }
      }
    }
    return out;
  }
  static void expect_idle() {
    DecodeLoad l;
    EngineStats st;
    for (int i = 0; i < 500; ++i) {
      l = cluster_->decode->load();
      st = cluster_->decode->stats();
      if (l.total_batch() == 0 && st.kv_pages_free == st.kv_pages_total &&
          cluster_->prefill->load().queued_input_tokens == 0 && grammar::live_constraints() == 0) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(l.total_batch(), 0);
    EXPECT_EQ(st.kv_pages_free, st.kv_pages_total);
    EXPECT_EQ(grammar::live_constraints(), 0);
  }

  static Cluster* cluster_;
  static AsyncEngine* colocated_engine_;
  static HttpServer* colocated_;
  HttpClient client_;
};
Cluster* StructuredRouterTest::cluster_ = nullptr;
AsyncEngine* StructuredRouterTest::colocated_engine_ = nullptr;
HttpServer* StructuredRouterTest::colocated_ = nullptr;

const json& kPerson = testing::person_schema();
using testing::expect_person;

TEST_F(StructuredRouterTest, JsonSchemaValidatesAndEqualsColocated) {
  for (int seed = 1; seed <= 3; ++seed) {
    json body = {{"temperature", 1.0},
                 {"seed", seed},
                 {"max_tokens", 120},
                 {"response_format",
                  {{"type", "json_schema"},
                   {"json_schema", {{"name", "person"}, {"schema", kPerson}, {"strict", true}}}}}};
    json j = both("/v1/chat/completions", body);
    ASSERT_TRUE(j.contains("choices")) << j.dump();
    const json& c = j["choices"][0];
    ASSERT_TRUE(c["message"]["content"].is_string()) << j.dump();
    expect_person(c["message"]["content"]);
    EXPECT_EQ(c["finish_reason"], "stop") << j.dump();
    body["stream"] = true;
    EXPECT_EQ(both("/v1/chat/completions", body)["text"], c["message"]["content"]);
  }
}

TEST_F(StructuredRouterTest, RegexChoiceAndGrammarOverCompletions) {
  auto complete = [&](json body, int seed) {
    body["prompt"] = "Emma said";
    body["temperature"] = 1.0;
    body["max_tokens"] = 60;
    body["seed"] = seed;
    json j = both("/v1/completions", body);
    return j.contains("choices") ? j["choices"][0]["text"].get<std::string>() : "";
  };
  for (int seed = 1; seed <= 2; ++seed) {
    const std::string re =
        complete({{"structured_outputs", {{"regex", "[a-c]{2,5}-[0-9]{2}"}}}}, seed);
    EXPECT_TRUE(std::regex_match(re, std::regex("[a-c]{2,5}-[0-9]{2}"))) << re;
    const std::string c = complete({{"guided_choice", {"Emma", "Mr. Knightley", "Harriet"}}}, seed);
    EXPECT_TRUE(c == "Emma" || c == "Mr. Knightley" || c == "Harriet") << c;
    const char* ebnf = "root ::= \"[\" item (\", \" item)? \"]\"\nitem ::= [0-9] | \"x\"";
    const std::string g = complete({{"structured_outputs", {{"grammar", ebnf}}}}, seed);
    EXPECT_TRUE(std::regex_match(g, std::regex(R"(\[([0-9]|x)(, ([0-9]|x))?\])"))) << g;
    expect_person(complete({{"guided_json", kPerson}}, seed));
  }
}

TEST_F(StructuredRouterTest, ToolChoiceRequiredAndThinkingBudget) {
  const json tools = json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
      "type": "object",
      "properties": {"city": {"enum": ["Highbury", "London"]},
                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
      "required": ["city", "days"], "additionalProperties": false}}}])");
  for (int seed = 1; seed <= 2; ++seed) {
    json j = both("/v1/chat/completions", {{"temperature", 1.0},
                                           {"seed", seed},
                                           {"max_tokens", 80},
                                           {"tools", tools},
                                           {"tool_choice", "required"}});
    ASSERT_TRUE(j.contains("choices")) << j.dump();
    const json& c = j["choices"][0];
    EXPECT_EQ(c["finish_reason"], "tool_calls") << j.dump();
    ASSERT_EQ(c["message"]["tool_calls"].size(), 1u) << j.dump();
    const json& fn = c["message"]["tool_calls"][0]["function"];
    EXPECT_EQ(fn["name"], "get_weather");
    json args = json::parse(fn["arguments"].get<std::string>(), nullptr, false);
    ASSERT_TRUE(args.is_object()) << j.dump();
    EXPECT_TRUE(args["city"] == "Highbury" || args["city"] == "London") << j.dump();
    EXPECT_TRUE(args["days"].is_number_integer()) << j.dump();
  }
  // The bias opens a think block and keeps it open: only the budget closes it, on the decode
  // instance (token 1 is <think>, sampled by the prefill instance).
  constexpr int32_t kThink = 8126, kThinkEnd = 8127;
  for (int budget : {0, 3}) {
    json j =
        both("/v1/chat/completions",
             {{"temperature", 1.0},
              {"seed", 5},
              {"max_tokens", 40},
              {"return_token_ids", true},
              {"logit_bias", {{std::to_string(kThink), 100}, {std::to_string(kThinkEnd), -100}}},
              {"thinking_token_budget", budget},
              {"structured_outputs", {{"choice", {"alpha", "beta gamma"}}}}});
    ASSERT_TRUE(j.contains("choices")) << j.dump();
    std::vector<int32_t> ids = j["choices"][0]["token_ids"];
    ASSERT_GE(ids.size(), size_t(budget) + 2) << j.dump();
    EXPECT_EQ(ids[0], kThink);
    EXPECT_EQ(ids[size_t(budget) + 1], kThinkEnd) << j.dump();
    const std::string content = j["choices"][0]["message"]["content"];
    EXPECT_TRUE(content == "alpha" || content == "beta gamma") << j.dump();
  }
}

TEST_F(StructuredRouterTest, BadGrammarsAre400sAtTheFront) {
  auto post = [&](json body) {
    body["model"] = "demo";
    body["messages"] = {{{"role", "user"}, {"content", "Hi"}}};
    return client_.post(url(*cluster_->server, "/v1/chat/completions"), body);
  };
  struct Case {
    json field;
    std::string param;
  };
  for (const Case& c :
       {Case{{{"response_format",
               {{"type", "json_schema"},
                {"json_schema", {{"name", "x"}, {"schema", {{"type", "no-such-type"}}}}}}}},
             "response_format.json_schema.schema"},
        Case{{{"structured_outputs", {{"regex", "(unclosed"}}}}, "structured_outputs.regex"},
        Case{{{"structured_outputs", {{"grammar", "root ::= nope"}}}},
             "structured_outputs.grammar"}}) {
    HttpResult r = post(c.field);
    EXPECT_EQ(r.status, 400) << r.body;
    if (r.status == 400) EXPECT_EQ(r.json()["error"]["param"], c.param) << r.body;
  }
}

TEST(StructuredRouter, InstanceWithoutGrammarEngineRefuses) {
  Cluster cluster(/*grammar_engine=*/false);
  HttpClient client;
  json body = {{"model", "demo"},
               {"messages", {{{"role", "user"}, {"content", "Hi"}}}},
               {"max_tokens", 8},
               {"response_format", {{"type", "json_object"}}}};
  HttpResult r = client.post(
      "http://127.0.0.1:" + std::to_string(cluster.server->port()) + "/v1/chat/completions", body);
  EXPECT_EQ(r.status, 400) << r.body;
  EXPECT_NE(r.body.find("structured outputs are not available"), std::string::npos) << r.body;
  body.erase("response_format");  // the unconstrained request is served
  r = client.post(
      "http://127.0.0.1:" + std::to_string(cluster.server->port()) + "/v1/chat/completions", body);
  EXPECT_EQ(r.status, 200) << r.body;
}

}  // namespace
}  // namespace tandem
