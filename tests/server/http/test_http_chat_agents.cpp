// Chat for agents over HTTP with the demo model's tokenizer and chat template (its <think> and
// </think> are special tokens): the fake engine plays scripted replies, and the responses
// must carry reasoning_content / tool_calls in OpenAI's shapes, streamed and not, identically.
// Also the validation of tools, tool_choice and the refused structured-output fields.
#include "server/http/http_test_util.h"
#include "server/tokenizer/tokenizer_test_util.h"

namespace tandem::testing {
namespace {

using json = nlohmann::json;

const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}},
  {"type": "function", "function": {"name": "count_chapters",
    "parameters": {"type": "object", "properties": {"book": {"type": "string"}}}}}
])");

std::string demo_dir() { return std::string(TANDEM_SOURCE_DIR) + "/models/demo"; }

/// What a client assembles from a stream (as the openai client's chunk accumulation does).
struct Streamed {
  std::string reasoning;
  std::string content;
  json calls = json::array();  // [{"id", "name", "arguments"}]
  std::string finish_reason;
  bool content_starts_with_newline = false;
};

Streamed assemble(const std::vector<json>& events) {
  Streamed s;
  for (const json& ev : events) {
    if (!ev.is_object() || !ev.contains("choices") || ev["choices"].empty()) continue;
    const json& c = ev["choices"][0];
    const json& d = c["delta"];
    if (d.contains("reasoning_content")) s.reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("content") && d["content"].is_string()) {
      const std::string piece = d["content"];
      if (s.content.empty() && !piece.empty() && piece[0] == '\n') {
        s.content_starts_with_newline = true;
      }
      s.content += piece;
    }
    if (d.contains("tool_calls")) {
      for (const json& t : d["tool_calls"]) {
        const size_t i = t["index"];
        if (t.contains("id")) {
          EXPECT_EQ(i, s.calls.size()) << "a call's first delta has its id";
          EXPECT_EQ(t["type"], "function");
          EXPECT_TRUE(t["function"].contains("name"));
          s.calls.push_back({{"id", t["id"]}, {"name", t["function"]["name"]}, {"arguments", ""}});
        }
        EXPECT_LT(i, s.calls.size()) << "arguments before the call's id and name";
        if (i >= s.calls.size()) continue;
        if (t["function"].contains("arguments")) {
          s.calls[i]["arguments"] = s.calls[i]["arguments"].get<std::string>() +
                                    t["function"]["arguments"].get<std::string>();
        }
      }
    }
    if (c["finish_reason"].is_string()) s.finish_reason = c["finish_reason"];
  }
  return s;
}

class HttpChatAgentTest : public HttpServerTest {
 protected:
  /// Starts the server with the demo tokenizer; `reply` is played (then <|im_end|>) for a
  /// prompt that renders like `messages` + `tools` (+ `suffix`, text the server appends).
  void start_with_reply(const std::string& reply, const json& messages, const json& tools,
                        const std::string& suffix = "", HttpServerConfig cfg = {}) {
    auto tok = Tokenizer::from_dir(demo_dir());
    auto tmpl = ChatTemplate::from_dir(demo_dir());
    ASSERT_TRUE(tok && tmpl);
    ChatTemplateInputs in;
    in.messages = nlohmann::ordered_json::parse(messages.dump());
    if (!tools.is_null()) in.tools = nlohmann::ordered_json::parse(tools.dump());
    in.add_generation_prompt = true;
    in.special_tokens = tok->special_tokens_map();
    const std::vector<int32_t> prompt = tok->encode(tmpl->apply(in) + suffix, true);
    im_end_ = *tok->token_to_id("<|im_end|>");
    FakeEngine::Options eo;
    eo.vocab = tok->vocab_size();
    eo.eos = im_end_;
    std::vector<int32_t> script = tok->encode(reply, true);
    script.push_back(im_end_);
    eo.scripts[prompt.back()] = script;
    demo_tok_ = std::move(tok);
    start(eo, cfg, /*with_text=*/true, demo_dir());
  }

  /// Posts non-streaming and streaming; returns (message, finish_reason) and the stream.
  std::pair<json, Streamed> both(json body) {
    body["max_tokens"] = 200;
    auto r = post("/v1/chat/completions", body);
    EXPECT_EQ(r.status, 200) << r.body;
    json choice = r.json()["choices"][0];
    body["stream"] = true;
    auto s = post("/v1/chat/completions", body);
    EXPECT_EQ(s.status, 200) << s.body;
    return {choice, assemble(sse_events(s.body))};
  }

  std::unique_ptr<Tokenizer> demo_tok_;
  int32_t im_end_ = 0;
};

const json kUser = json::array({{{"role", "user"}, {"content", "Who is Emma?"}}});

TEST_F(HttpChatAgentTest, EmptyThinkBlockLeavesNoNewlines) {
  // The demo model's chat replies start with an empty think block (special tokens).
  start_with_reply("<think>\n\n</think>\n\nEmma Woodhouse, handsome, clever.", kUser, nullptr);
  auto [choice, s] = both({{"messages", kUser}});
  EXPECT_EQ(choice["message"]["content"], "Emma Woodhouse, handsome, clever.");
  EXPECT_TRUE(choice["message"]["reasoning_content"].is_null());
  EXPECT_FALSE(choice["message"].contains("tool_calls"));
  EXPECT_EQ(choice["finish_reason"], "stop");
  EXPECT_EQ(s.content, "Emma Woodhouse, handsome, clever.");
  EXPECT_FALSE(s.content_starts_with_newline);
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.finish_reason, "stop");

  // With the reasoning parser off (and skip_special_tokens), the old text comes back.
  HttpServerConfig cfg;
  cfg.reasoning_parser = "none";
  server_.reset();
  engine_.reset();
  start_with_reply("<think>\n\n</think>\n\nEmma.", kUser, nullptr, "", cfg);
  auto r = post("/v1/chat/completions", {{"messages", kUser}});
  EXPECT_EQ(r.json()["choices"][0]["message"]["content"], "\n\n\n\nEmma.");
  EXPECT_FALSE(r.json()["choices"][0]["message"].contains("reasoning_content"));
}

TEST_F(HttpChatAgentTest, ReasoningContent) {
  start_with_reply("<think>\nShe is the heroine.\nOf Emma.\n</think>\n\nThe heroine.", kUser,
                   nullptr);
  auto [choice, s] = both({{"messages", kUser}});
  EXPECT_EQ(choice["message"]["reasoning_content"], "She is the heroine.\nOf Emma.");
  EXPECT_EQ(choice["message"]["content"], "The heroine.");
  EXPECT_EQ(s.reasoning, "She is the heroine.\nOf Emma.");
  EXPECT_EQ(s.content, "The heroine.");
  // skip_special_tokens false: the tags are text anyway; same split.
  auto r = post("/v1/chat/completions", {{"messages", kUser}, {"skip_special_tokens", false}});
  EXPECT_EQ(r.json()["choices"][0]["message"]["reasoning_content"],
            "She is the heroine.\nOf Emma.");
  // A reply cut off inside the think block is all reasoning; content null.
  r = post("/v1/chat/completions", {{"messages", kUser}, {"max_tokens", 4}});
  json m = r.json()["choices"][0]["message"];
  EXPECT_TRUE(m["content"].is_null()) << m;
  EXPECT_TRUE(m["reasoning_content"].is_string()) << m;
  EXPECT_EQ(r.json()["choices"][0]["finish_reason"], "length");
  // reasoning_effort is accepted ("none" turns thinking off in the template).
  r = post("/v1/chat/completions", {{"messages", kUser}, {"reasoning_effort", "none"}});
  ASSERT_EQ(r.status, 200) << r.body;
  std::string prompt = demo_tok_->decode(engine_->submitted().back().prompt_ids, false);
  EXPECT_NE(prompt.find("<think>\n\n</think>\n\n"), std::string::npos) << prompt;
  EXPECT_EQ(post("/v1/chat/completions", {{"messages", kUser}, {"reasoning_effort", "max"}}).status,
            400);
}

const std::string kCallReply =
    "<think>\nI should look it up.\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": "
    "\"get_weather\", \"arguments\": {\"city\": \"Highbury \\\"\xc3\xa9\\\"\", \"days\": "
    "2}}\n</tool_call>\n<tool_call>\n{\"name\": \"count_chapters\", \"arguments\": {\"book\": "
    "\"Emma\"}}\n</tool_call>";

TEST_F(HttpChatAgentTest, ToolCalls) {
  start_with_reply(kCallReply, kUser, kTools);
  auto [choice, s] = both({{"messages", kUser}, {"tools", kTools}});
  const json& m = choice["message"];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(m["content"], "Let me check.");
  EXPECT_EQ(m["reasoning_content"], "I should look it up.");
  ASSERT_EQ(m["tool_calls"].size(), 2u) << m;
  const json& c0 = m["tool_calls"][0];
  EXPECT_EQ(c0["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(c0["type"], "function");
  EXPECT_EQ(c0["function"]["name"], "get_weather");
  json args = json::parse(c0["function"]["arguments"].get<std::string>());
  EXPECT_EQ(args["city"], "Highbury \"\xc3\xa9\"");
  EXPECT_EQ(args["days"], 2);
  EXPECT_EQ(m["tool_calls"][1]["function"]["name"], "count_chapters");
  EXPECT_NE(m["tool_calls"][0]["id"], m["tool_calls"][1]["id"]);

  // The stream assembles to the same reply.
  EXPECT_EQ(s.finish_reason, "tool_calls");
  EXPECT_EQ(s.content, "Let me check.");
  EXPECT_EQ(s.reasoning, "I should look it up.");
  ASSERT_EQ(s.calls.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(s.calls[i]["name"], m["tool_calls"][i]["function"]["name"]);
    EXPECT_EQ(s.calls[i]["arguments"], m["tool_calls"][i]["function"]["arguments"]);
  }

  // tool_choice "none": no tools in the prompt, no parsing.
  auto r = post("/v1/chat/completions",
                {{"messages", kUser}, {"tools", kTools}, {"tool_choice", "none"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_FALSE(r.json()["choices"][0]["message"].contains("tool_calls"));
  EXPECT_NE(r.json()["choices"][0]["message"]["content"].get<std::string>().find("<tool_call>"),
            std::string::npos);
}

TEST_F(HttpChatAgentTest, NextTurnWithToolResults) {
  start_with_reply("It is sunny.", kUser, kTools);
  json messages = kUser;
  messages.push_back(
      {{"role", "assistant"},
       {"content", nullptr},
       {"tool_calls",
        {{{"id", "call_1"},
          {"type", "function"},
          {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Bath\"}"}}}}}}});
  messages.push_back({{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny"}});
  auto r =
      post("/v1/chat/completions", {{"messages", messages}, {"tools", kTools}, {"max_tokens", 5}});
  ASSERT_EQ(r.status, 200) << r.body;
  std::string prompt = demo_tok_->decode(engine_->submitted().back().prompt_ids, false);
  EXPECT_NE(prompt.find("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
                        "\"Bath\"}}\n</tool_call>"),
            std::string::npos)
      << prompt;
  EXPECT_NE(prompt.find("<tool_response>\nsunny\n</tool_response>"), std::string::npos) << prompt;
}

TEST_F(HttpChatAgentTest, NamedToolChoiceStartsInsideTheCall) {
  // The prompt opens the call; a grammar forces the named function and its arguments (the
  // fake engine plays the reply; tests/server/grammar check the grammar with a real model).
  start_with_reply("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bath\"}}\n</tool_call>",
                   kUser, kTools, "<think>\n\n</think>\n\n<tool_call>\n");
  json choice_named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  auto [choice, s] = both({{"messages", kUser}, {"tools", kTools}, {"tool_choice", choice_named}});
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << choice;
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Bath\"}");
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  ASSERT_EQ(s.calls.size(), 1u);
  EXPECT_EQ(s.calls[0]["arguments"], "{\"city\": \"Bath\"}");
}

TEST_F(HttpChatAgentTest, BrokenCallIsContent) {
  const std::string reply =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": Bath}}\n</tool_call>";
  start_with_reply("<think>\n\n</think>\n\n" + reply, kUser, kTools);
  auto [choice, s] = both({{"messages", kUser}, {"tools", kTools}});
  EXPECT_EQ(choice["message"]["content"], reply);
  EXPECT_FALSE(choice["message"].contains("tool_calls"));
  EXPECT_EQ(choice["finish_reason"], "stop");
  // The stream gave the call's header before the arguments broke; its text follows as content.
  EXPECT_EQ(s.content, reply);
  EXPECT_EQ(s.finish_reason, "stop");
}

TEST_F(HttpChatAgentTest, Validation) {
  start_with_reply("x", kUser, nullptr);
  auto param = [&](json body) {
    body["messages"] = kUser;
    auto r = post("/v1/chat/completions", body);
    EXPECT_EQ(r.status, 400) << body.dump() << " -> " << r.body;
    json j = json::parse(r.body, nullptr, false);
    return j.is_object() && j["error"]["param"].is_string() ? j["error"]["param"].get<std::string>()
                                                            : std::string("<none>");
  };
  json nameless = {{{"type", "function"}, {"function", {{"description", "x"}}}}};
  EXPECT_EQ(param({{"tools", nameless}}), "tools[0].function.name");
  EXPECT_EQ(param({{"tools", {{{"type", "function"}, {"function", {{"name", ""}}}}}}}),
            "tools[0].function.name");
  EXPECT_EQ(param({{"tools",
                    {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", 3}}}}}}}),
            "tools[0].function.parameters");
  EXPECT_EQ(param({{"tools", kTools}, {"tool_choice", 5}}), "tool_choice");
  EXPECT_EQ(param({{"tools", kTools}, {"tool_choice", "bogus"}}), "tool_choice");
  EXPECT_EQ(param({{"tool_choice", "required"}}), "tool_choice");
  EXPECT_EQ(param({{"tool_choice", "auto"}}), "tool_choice");
  EXPECT_EQ(param({{"tools", kTools},
                   {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}),
            "tool_choice.function.name");
  EXPECT_EQ(param({{"tools", kTools}, {"tool_choice", {{"type", "function"}}}}),
            "tool_choice.function.name");
  EXPECT_EQ(
      param({{"tools", kTools}, {"tool_choice", {{"type", "x"}, {"function", {{"name", "f"}}}}}}),
      "tool_choice.type");
  EXPECT_EQ(param({{"reasoning_effort", 3}}), "reasoning_effort");
  EXPECT_EQ(param({{"guided_json", "{not json"}}), "guided_json");
  EXPECT_EQ(param({{"structured_outputs", {{"json", {{"type", "nonsense"}}}}}}),
            "structured_outputs.json");
  EXPECT_EQ(param({{"guided_regex", "(a+"}}), "guided_regex");
  EXPECT_EQ(param({{"response_format", {{"type", "json_schema"}}}}), "response_format.json_schema");
  EXPECT_EQ(param({{"tools", kTools}, {"tool_choice", "required"}, {"guided_regex", "a"}}),
            "guided_regex");
  // Accepted.
  for (json tc : {json("none"), json("auto"), json("required"),
                  json{{"type", "function"}, {"function", {{"name", "count_chapters"}}}}}) {
    auto r = post("/v1/chat/completions",
                  {{"messages", kUser}, {"tools", kTools}, {"tool_choice", tc}, {"max_tokens", 2}});
    EXPECT_EQ(r.status, 200) << tc << " " << r.body;
  }
  EXPECT_EQ(post("/v1/chat/completions",
                 {{"messages", kUser}, {"tool_choice", "none"}, {"max_tokens", 2}})
                .status,
            200);
}

/// Responses API SSE: "event: TYPE\ndata: {...}" blocks; checks the event name is data.type.
std::vector<json> response_events(const std::string& body) {
  std::vector<json> events;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    const std::string block = body.substr(pos, end - pos);
    pos = end + 2;
    const size_t nl = block.find('\n');
    if (block.rfind("event: ", 0) != 0 || nl == std::string::npos) continue;
    EXPECT_EQ(block.compare(nl + 1, 6, "data: "), 0) << block;
    json ev = json::parse(block.substr(nl + 7));
    EXPECT_EQ(ev["type"], block.substr(7, nl - 7));
    events.push_back(std::move(ev));
  }
  return events;
}

TEST_F(HttpChatAgentTest, ResponsesText) {
  json messages = {{{"role", "system"}, {"content", "Be brief."}},
                   {{"role", "user"}, {"content", "Who is Emma?"}}};
  start_with_reply("<think>\nHeroine.\n</think>\n\nEmma Woodhouse.", messages, nullptr);
  json body = {{"input", "Who is Emma?"},
               {"instructions", "Be brief."},
               {"max_output_tokens", 100},
               {"metadata", {{"k", "v"}}}};
  auto r = post("/v1/responses", body);
  ASSERT_EQ(r.status, 200) << r.body;
  json j = r.json();
  EXPECT_EQ(j["object"], "response");
  EXPECT_EQ(j["id"].get<std::string>().rfind("resp_", 0), 0u);
  EXPECT_EQ(j["status"], "completed");
  EXPECT_EQ(j["instructions"], "Be brief.");
  EXPECT_EQ(j["metadata"]["k"], "v");
  ASSERT_EQ(j["output"].size(), 2u) << j;
  EXPECT_EQ(j["output"][0]["type"], "reasoning");
  EXPECT_EQ(j["output"][0]["content"][0]["text"], "Heroine.");
  EXPECT_EQ(j["output"][1]["type"], "message");
  EXPECT_EQ(j["output"][1]["role"], "assistant");
  EXPECT_EQ(j["output"][1]["content"][0]["type"], "output_text");
  EXPECT_EQ(j["output"][1]["content"][0]["text"], "Emma Woodhouse.");
  EXPECT_GT(j["usage"]["input_tokens"].get<int>(), 0);
  EXPECT_EQ(j["usage"]["total_tokens"].get<int>(),
            j["usage"]["input_tokens"].get<int>() + j["usage"]["output_tokens"].get<int>());
  std::string prompt = demo_tok_->decode(engine_->submitted().back().prompt_ids, false);
  EXPECT_EQ(
      prompt.rfind("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho is Emma?", 0),
      0u)
      << prompt;

  body["stream"] = true;
  auto s = post("/v1/responses", body);
  ASSERT_EQ(s.status, 200);
  std::vector<json> ev = response_events(s.body);
  ASSERT_GE(ev.size(), 4u);
  EXPECT_EQ(ev[0]["type"], "response.created");
  EXPECT_EQ(ev[0]["response"]["status"], "in_progress");
  EXPECT_EQ(ev.back()["type"], "response.completed");
  std::string text, reasoning, done_text;
  for (size_t i = 0; i < ev.size(); ++i) {
    EXPECT_EQ(ev[i]["sequence_number"], i);
    if (ev[i]["type"] == "response.output_text.delta") text += ev[i]["delta"].get<std::string>();
    if (ev[i]["type"] == "response.reasoning_text.delta")
      reasoning += ev[i]["delta"].get<std::string>();
    if (ev[i]["type"] == "response.output_text.done") done_text = ev[i]["text"];
  }
  EXPECT_EQ(text, "Emma Woodhouse.");
  EXPECT_EQ(done_text, text);
  EXPECT_EQ(reasoning, "Heroine.");
  auto without_ids = [](json items) {
    for (json& item : items) item.erase("id");
    return items;
  };
  EXPECT_EQ(without_ids(ev.back()["response"]["output"]), without_ids(j["output"]));
  EXPECT_EQ(s.body.find("[DONE]"), std::string::npos);  // the Responses stream has no [DONE]
}

TEST_F(HttpChatAgentTest, ResponsesFunctionCalls) {
  start_with_reply(kCallReply, kUser, kTools);
  json tools = json::array();
  for (const json& t : kTools) {
    json flat = t["function"];
    flat["type"] = "function";
    tools.push_back(flat);
  }
  json body = {
      {"input",
       {{{"role", "user"}, {"content", {{{"type", "input_text"}, {"text", "Who is Emma?"}}}}}}},
      {"tools", tools}};
  auto r = post("/v1/responses", body);
  ASSERT_EQ(r.status, 200) << r.body;
  json out = r.json()["output"];
  ASSERT_EQ(out.size(), 4u) << out;  // reasoning, message, two calls
  EXPECT_EQ(out[1]["content"][0]["text"], "Let me check.");
  EXPECT_EQ(out[2]["type"], "function_call");
  EXPECT_EQ(out[2]["name"], "get_weather");
  EXPECT_EQ(out[2]["call_id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(json::parse(out[2]["arguments"].get<std::string>())["days"], 2);
  EXPECT_EQ(out[3]["name"], "count_chapters");

  body["stream"] = true;
  std::vector<json> ev = response_events(post("/v1/responses", body).body);
  std::map<int, std::string> args;
  std::map<int, std::string> done_args;
  for (const json& e : ev) {
    if (e["type"] == "response.function_call_arguments.delta")
      args[e["output_index"]] += e["delta"].get<std::string>();
    if (e["type"] == "response.function_call_arguments.done")
      done_args[e["output_index"]] = e["arguments"];
  }
  ASSERT_EQ(args.size(), 2u);
  EXPECT_EQ(args[2], out[2]["arguments"]);
  EXPECT_EQ(args[3], out[3]["arguments"]);
  EXPECT_EQ(done_args, args);
  json final_out = ev.back()["response"]["output"];
  ASSERT_EQ(final_out.size(), 4u);
  EXPECT_EQ(final_out[2]["arguments"], out[2]["arguments"]);

  // The next turn: the call and its output as input items.
  json next = {{"input",
                {{{"role", "user"}, {"content", "Who is Emma?"}},
                 {{"type", "function_call"},
                  {"call_id", "call_9"},
                  {"name", "get_weather"},
                  {"arguments", "{\"city\": \"Bath\"}"}},
                 {{"type", "function_call_output"}, {"call_id", "call_9"}, {"output", "rain"}}}},
               {"tools", tools},
               {"max_output_tokens", 3}};
  ASSERT_EQ(post("/v1/responses", next).status, 200);
  std::string prompt = demo_tok_->decode(engine_->submitted().back().prompt_ids, false);
  EXPECT_NE(prompt.find("<tool_response>\nrain\n</tool_response>"), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bath\"}}"),
            std::string::npos)
      << prompt;
}

TEST_F(HttpChatAgentTest, ResponsesValidation) {
  start_with_reply("x", kUser, nullptr);
  auto param = [&](json body) {
    auto r = post("/v1/responses", body);
    EXPECT_EQ(r.status, 400) << body.dump() << " -> " << r.body;
    json j = json::parse(r.body, nullptr, false);
    return j.is_object() && j["error"]["param"].is_string() ? j["error"]["param"].get<std::string>()
                                                            : std::string("<none>");
  };
  EXPECT_EQ(param(json::object()), "input");
  EXPECT_EQ(param({{"input", 5}}), "input");
  EXPECT_EQ(param({{"input", "x"}, {"tools", {{{"type", "function"}}}}}), "tools[0].name");
  EXPECT_EQ(param({{"input", "x"}, {"tools", {{{"type", "web_search"}}}}}), "tools[0].type");
  EXPECT_EQ(param({{"input", "x"}, {"previous_response_id", "resp_1"}}), "previous_response_id");
  EXPECT_EQ(param({{"input", "x"}, {"max_output_tokens", 0}}), "max_output_tokens");
  EXPECT_EQ(param({{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}}}}}}),
            "text.format.schema");
  EXPECT_EQ(param({{"input", "x"}, {"text", {{"format", {{"type", "xml"}}}}}}), "text.format");
  EXPECT_EQ(param({{"input", {{{"type", "message"}, {"role", "wizard"}, {"content", "x"}}}}}),
            "input");
  EXPECT_EQ(param({{"input", "x"}, {"tool_choice", "required"}}), "tool_choice");
  EXPECT_EQ(post("/v1/responses", {{"input", "x"}, {"max_output_tokens", 2}}).status, 200);
}

// The real Qwen3 tokenizer (<think> and <tool_call> are added, non-special tokens).
class HttpQwen3AgentTest : public HttpServerTest {};

TEST_F(HttpQwen3AgentTest, ReasoningAndToolCall) {
  TANDEM_REQUIRE_QWEN3(qwen);
  const int32_t im_end = *qwen->token_to_id("<|im_end|>");
  auto tmpl = ChatTemplate::from_dir(qwen3_tokenizer_dir()->string());
  ASSERT_NE(tmpl, nullptr);
  ChatTemplateInputs in;
  in.messages = nlohmann::ordered_json::parse(kUser.dump());
  in.tools = nlohmann::ordered_json::parse(kTools.dump());
  in.add_generation_prompt = true;
  in.special_tokens = qwen->special_tokens_map();
  const std::vector<int32_t> prompt = qwen->encode(tmpl->apply(in));
  FakeEngine::Options eo;
  eo.vocab = qwen->vocab_size();
  eo.eos = im_end;
  std::vector<int32_t> reply = qwen->encode(
      "<think>\nThe user asks; \xe4\xbd\xa0\xe5\xa5\xbd.\n</think>\n\n<tool_call>\n{\"name\": "
      "\"count_chapters\", \"arguments\": {\"book\": \"\xe4\xbd\xa0\"}}\n</tool_call>");
  reply.push_back(im_end);
  eo.scripts[prompt.back()] = reply;
  start(eo, {}, /*with_text=*/true, qwen3_tokenizer_dir()->string());
  json body = {{"messages", kUser}, {"tools", kTools}, {"max_tokens", 200}};
  auto r = post("/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  json m = r.json()["choices"][0]["message"];
  EXPECT_EQ(m["reasoning_content"], "The user asks; \xe4\xbd\xa0\xe5\xa5\xbd.");
  EXPECT_TRUE(m["content"].is_null());
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  EXPECT_EQ(m["tool_calls"][0]["function"]["arguments"], "{\"book\": \"\xe4\xbd\xa0\"}");
  body["stream"] = true;
  Streamed s = assemble(sse_events(post("/v1/chat/completions", body).body));
  EXPECT_EQ(s.reasoning, m["reasoning_content"]);
  ASSERT_EQ(s.calls.size(), 1u);
  EXPECT_EQ(s.calls[0]["arguments"], m["tool_calls"][0]["function"]["arguments"]);
  EXPECT_EQ(s.finish_reason, "tool_calls");
}

}  // namespace
}  // namespace tandem::testing
