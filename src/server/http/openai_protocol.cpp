#include "server/http/openai_protocol.h"

#include <cmath>
#include <limits>

namespace tandem::openai {

namespace {

using json = Json;

constexpr int kMaxJsonDepth = 64;
constexpr int64_t kMaxN = 256;
constexpr size_t kMaxStopStrings = 64;
constexpr size_t kMaxStopTokenIds = 1024;

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean";
    case json::value_t::string: return "string";
    case json::value_t::array: return "array";
    case json::value_t::object: return "object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    case json::value_t::number_float: return "number";
    default: return "value";
  }
}

std::string in_quotes(const std::string& name) { return "'" + name + "'"; }

/// The value of `name`, or nullptr when absent or null (null means "use the default").
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

ApiError type_error(const std::string& name, const char* expected, const json& got) {
  return bad_request(in_quotes(name) + " must be " + expected + ", got " + type_name(got), name);
}

bool as_bool(const json& v, const std::string& name) {
  if (!v.is_boolean()) throw type_error(name, "a boolean", v);
  return v.get<bool>();
}

/// An integer (an integral float such as 5.0 is accepted, as pydantic does).
int64_t as_int(const json& v, const std::string& name) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) {
      throw bad_request(in_quotes(name) + " is out of range, got " + std::to_string(u), name);
    }
    return int64_t(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) throw type_error(name, "an integer", v);
    if (std::fabs(d) > 9.0e18) {
      throw bad_request(in_quotes(name) + " is out of range, got " + v.dump(), name);
    }
    return int64_t(d);
  }
  throw type_error(name, "an integer", v);
}

double as_number(const json& v, const std::string& name) {
  if (!v.is_number()) throw type_error(name, "a number", v);
  double d = v.get<double>();
  if (!std::isfinite(d)) throw bad_request(in_quotes(name) + " must be finite", name);
  return d;
}

const std::string& as_string(const json& v, const std::string& name) {
  if (!v.is_string()) throw type_error(name, "a string", v);
  return v.get_ref<const std::string&>();
}

std::string num_str(double d) {
  json j = d;
  return j.dump();
}

bool get_bool(const json& body, const char* name, bool def) {
  const json* v = field(body, name);
  return v ? as_bool(*v, name) : def;
}

/// An optional integer in [lo, hi].
std::optional<int64_t> get_int(const json& body, const char* name, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  int64_t x = as_int(*v, name);
  if (x < lo) {
    throw bad_request(
        in_quotes(name) + " must be at least " + std::to_string(lo) + ", got " + std::to_string(x),
        name);
  }
  if (x > hi) {
    throw bad_request(
        in_quotes(name) + " must be at most " + std::to_string(hi) + ", got " + std::to_string(x),
        name);
  }
  return x;
}

/// An optional number in [lo, hi] (or (lo, hi] with lo_open).
std::optional<double> get_number(const json& body, const char* name, double lo, double hi,
                                 bool lo_open = false) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  double x = as_number(*v, name);
  if (lo_open ? !(x > lo) : !(x >= lo)) {
    throw bad_request(in_quotes(name) + " must be " + (lo_open ? "greater than " : "at least ") +
                          num_str(lo) + ", got " + num_str(x),
                      name);
  }
  if (x > hi) {
    throw bad_request(in_quotes(name) + " must be at most " + num_str(hi) + ", got " + num_str(x),
                      name);
  }
  return x;
}

int32_t token_id(const json& v, const std::string& name, int64_t vocab_size) {
  int64_t id = as_int(v, name);
  if (id < 0 || id >= vocab_size) {
    throw bad_request("token id " + std::to_string(id) + " in " + in_quotes(name) +
                          " is out of vocabulary (vocab size " + std::to_string(vocab_size) + ")",
                      name);
  }
  return int32_t(id);
}

std::vector<int32_t> token_ids(const json& v, const std::string& name, int64_t vocab_size) {
  if (!v.is_array()) throw type_error(name, "an array of token ids", v);
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (const auto& x : v) ids.push_back(token_id(x, name, vocab_size));
  return ids;
}

/// Options common to both generation endpoints.
void parse_common(const json& body, GenerationParams& p, int64_t vocab_size) {
  if (const json* v = field(body, "model")) p.model = as_string(*v, "model");
  p.stream = get_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) throw type_error("stream_options", "an object", *so);
    if (!p.stream) {
      throw bad_request("'stream_options' can only be set when 'stream' is true", "stream_options");
    }
    p.include_usage = get_bool(*so, "include_usage", false);
    p.continuous_usage = get_bool(*so, "continuous_usage_stats", false);
  }
  p.n = int32_t(get_int(body, "n", 1, kMaxN).value_or(1));
  if (auto best_of = get_int(body, "best_of", 1, kMaxN); best_of && *best_of != p.n) {
    throw bad_request("'best_of' other than n is not supported", "best_of");
  }
  if (get_bool(body, "use_beam_search", false)) {
    throw bad_request("beam search is not supported", "use_beam_search");
  }
  p.min_tokens =
      int32_t(get_int(body, "min_tokens", 0, std::numeric_limits<int32_t>::max()).value_or(0));
  if (p.max_tokens && p.min_tokens > *p.max_tokens) {
    throw bad_request("'min_tokens' (" + std::to_string(p.min_tokens) +
                          ") must be at most the maximum number of tokens (" +
                          std::to_string(*p.max_tokens) + ")",
                      "min_tokens");
  }

  SamplingParams& s = p.sampling;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (auto t = get_number(body, "temperature", 0.0, kInf)) s.temperature = float(*t);
  if (auto t = get_number(body, "top_p", 0.0, 1.0, /*lo_open=*/true)) s.top_p = float(*t);
  if (auto k = get_int(body, "top_k", -1, std::numeric_limits<int32_t>::max())) {
    s.top_k = *k <= 0 ? 0 : int32_t(*k);
  }
  if (auto m = get_number(body, "min_p", 0.0, 1.0)) s.min_p = float(*m);
  if (auto r = get_number(body, "repetition_penalty", 0.0, kInf, /*lo_open=*/true)) {
    s.repetition_penalty = float(*r);
  }
  if (auto r = get_number(body, "presence_penalty", -2.0, 2.0)) s.presence_penalty = float(*r);
  if (auto r = get_number(body, "frequency_penalty", -2.0, 2.0)) s.frequency_penalty = float(*r);
  if (const json* v = field(body, "seed")) {
    if (v->is_number_unsigned()) {
      s.seed = v->get<uint64_t>();
    } else {
      s.seed = uint64_t(as_int(*v, "seed"));
    }
  }

  if (const json* v = field(body, "stop")) {
    if (v->is_string()) {
      p.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      if (v->size() > kMaxStopStrings) {
        throw bad_request("at most " + std::to_string(kMaxStopStrings) + " stop strings", "stop");
      }
      for (const auto& x : *v) p.stop.push_back(as_string(x, "stop"));
    } else {
      throw type_error("stop", "a string or an array of strings", *v);
    }
    for (const auto& s : p.stop) {
      if (s.empty()) throw bad_request("stop strings must not be empty", "stop");
    }
  }
  if (const json* v = field(body, "stop_token_ids")) {
    p.stop_token_ids = token_ids(*v, "stop_token_ids", vocab_size);
    if (p.stop_token_ids.size() > kMaxStopTokenIds) {
      throw bad_request("too many stop_token_ids", "stop_token_ids");
    }
  }
  p.ignore_eos = get_bool(body, "ignore_eos", false);
  p.include_stop_str_in_output = get_bool(body, "include_stop_str_in_output", false);
  p.skip_special_tokens = get_bool(body, "skip_special_tokens", true);
  get_bool(body, "spaces_between_special_tokens", true);  // accepted, no effect
  get_bool(body, "add_special_tokens", true);             // Qwen adds none: no effect
  p.return_token_ids = get_bool(body, "return_token_ids", false);
  p.return_tokens_as_token_ids = get_bool(body, "return_tokens_as_token_ids", false);
  p.prompt_logprobs = int32_t(get_int(body, "prompt_logprobs", 0, kMaxLogprobs).value_or(-1));

  if (const json* v = field(body, "logit_bias")) {
    if (!v->is_object()) throw type_error("logit_bias", "an object", *v);
    if (!v->empty()) throw bad_request("'logit_bias' is not supported", "logit_bias");
  }
  if (const json* v = field(body, "user")) as_string(*v, "user");
  if (const json* v = field(body, "suffix")) {
    if (!as_string(*v, "suffix").empty()) {
      throw bad_request("'suffix' is not supported", "suffix");
    }
  }
  if (const json* v = field(body, "response_format")) {
    if (!v->is_object()) throw type_error("response_format", "an object", *v);
    const json* t = field(*v, "type");
    if (!t || as_string(*t, "response_format.type") != "text") {
      throw bad_request("only response_format {\"type\": \"text\"} is supported",
                        "response_format");
    }
  }
}

/// max_tokens (completions) or max_completion_tokens (chat, preferred).
void parse_max_tokens(const json& body, GenerationParams& p, bool chat) {
  constexpr int64_t kHi = std::numeric_limits<int64_t>::max();
  std::optional<int64_t> m;
  if (chat) m = get_int(body, "max_completion_tokens", 1, kHi);
  if (!m) m = get_int(body, "max_tokens", 1, kHi);
  if (m) {
    // Anything over int32 can never fit a model; the length check names the numbers.
    p.max_tokens = int32_t(std::min<int64_t>(*m, std::numeric_limits<int32_t>::max()));
  }
}

/// Text of a message's content: a string, null, or an array of {"type": "text"} parts.
json normalise_content(const json& content, const std::string& name) {
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array()) throw type_error(name, "a string or an array of content parts", content);
  std::string text;
  bool first = true;
  for (const auto& part : content) {
    if (!part.is_object()) throw type_error(name, "an array of content parts", part);
    const json* type = field(part, "type");
    if (!type) throw bad_request("content part without 'type' in " + in_quotes(name), name);
    const std::string& t = as_string(*type, name + ".type");
    if (t != "text") {
      throw bad_request("content part type '" + t + "' is not supported (text only)", name);
    }
    const json* tx = field(part, "text");
    if (!tx) throw bad_request("text content part without 'text' in " + in_quotes(name), name);
    if (!first) text += "\n";
    text += as_string(*tx, name + ".text");
    first = false;
  }
  return text;
}

json normalise_messages(const json& messages) {
  if (!messages.is_array()) throw type_error("messages", "an array", messages);
  if (messages.empty()) throw bad_request("'messages' must not be empty", "messages");
  json out = json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    std::string name = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw type_error(name, "an object", m);
    const json* role_v = field(m, "role");
    if (!role_v) throw bad_request(in_quotes(name) + " has no 'role'", name + ".role");
    std::string role = as_string(*role_v, name + ".role");
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
      throw bad_request("unknown role '" + role + "' in " + in_quotes(name) +
                            " (expected system, developer, user, assistant or tool)",
                        name + ".role");
    }
    json nm = {{"role", role}};
    auto it = m.find("content");
    json content = it == m.end() ? json() : normalise_content(*it, name + ".content");
    bool has_tool_calls = false;
    if (const json* tc = field(m, "tool_calls")) {
      if (role != "assistant") {
        throw bad_request("only assistant messages may have 'tool_calls'", name + ".tool_calls");
      }
      if (!tc->is_array()) throw type_error(name + ".tool_calls", "an array", *tc);
      for (const auto& call : *tc) {
        if (!call.is_object()) throw type_error(name + ".tool_calls", "an array of objects", call);
        const json* fn = field(call, "function");
        if (!fn || !fn->is_object()) {
          throw bad_request("tool call without a 'function' object", name + ".tool_calls");
        }
        const json* fname = field(*fn, "name");
        if (!fname) throw bad_request("tool call function without 'name'", name + ".tool_calls");
        as_string(*fname, name + ".tool_calls.function.name");
      }
      nm["tool_calls"] = *tc;
      has_tool_calls = !tc->empty();
    }
    if (content.is_null() && !(role == "assistant")) {
      throw bad_request(in_quotes(name) + " (" + role + ") must have 'content'", name + ".content");
    }
    if (content.is_null() && !has_tool_calls) content = "";
    nm["content"] = content;
    for (const char* key : {"name", "tool_call_id", "reasoning_content"}) {
      if (const json* v = field(m, key)) nm[key] = as_string(*v, name + "." + key);
    }
    out.push_back(std::move(nm));
  }
  return out;
}

json normalise_tools(const json& body) {
  const json* tools = field(body, "tools");
  if (!tools) return nullptr;
  if (!tools->is_array()) throw type_error("tools", "an array", *tools);
  for (size_t i = 0; i < tools->size(); ++i) {
    const json& t = (*tools)[i];
    std::string name = "tools[" + std::to_string(i) + "]";
    if (!t.is_object()) throw type_error(name, "an object", t);
    const json* type = field(t, "type");
    if (!type || as_string(*type, name + ".type") != "function") {
      throw bad_request(in_quotes(name) + " must have type 'function'", name + ".type");
    }
    const json* fn = field(t, "function");
    if (!fn || !fn->is_object()) {
      throw bad_request(in_quotes(name) + " must have a 'function' object", name + ".function");
    }
    const json* fname = field(*fn, "name");
    if (!fname) throw bad_request(in_quotes(name) + " function has no 'name'", name + ".function");
    as_string(*fname, name + ".function.name");
  }
  if (tools->empty()) return nullptr;
  if (const json* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      const std::string& c = tc->get_ref<const std::string&>();
      if (c == "none") return nullptr;
      if (c != "auto") {
        throw bad_request("tool_choice '" + c + "' is not supported (none or auto)", "tool_choice");
      }
    } else {
      throw bad_request("only tool_choice \"none\" and \"auto\" are supported", "tool_choice");
    }
  }
  return *tools;
}

/// The chat fields shared by /v1/chat/completions and /tokenize.
void parse_chat_messages(const json& body, ChatRequest& r) {
  const json* messages = field(body, "messages");
  if (!messages) throw bad_request("'messages' is required", "messages");
  r.messages = normalise_messages(*messages);
  r.tools = normalise_tools(body);
  r.add_generation_prompt = get_bool(body, "add_generation_prompt", true);
  r.continue_final_message = get_bool(body, "continue_final_message", false);
  if (r.continue_final_message && r.add_generation_prompt) {
    throw bad_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                      "continue_final_message");
  }
  if (r.continue_final_message && r.messages.back()["role"] != "assistant") {
    throw bad_request("'continue_final_message' needs a final assistant message",
                      "continue_final_message");
  }
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) throw type_error("chat_template_kwargs", "an object", *kw);
    r.chat_template_kwargs = *kw;
  }
  if (field(body, "chat_template")) {
    throw bad_request("a per-request 'chat_template' is not supported", "chat_template");
  }
}

}  // namespace

json parse_body(const std::string& body) {
  if (body.empty()) throw bad_request("the request body is empty (a JSON object is expected)");
  json j;
  try {
    j = json::parse(body, [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxJsonDepth) {
        throw bad_request("JSON nested deeper than " + std::to_string(kMaxJsonDepth));
      }
      return true;
    });
  } catch (const json::exception& e) {
    throw bad_request(std::string("malformed JSON: ") + e.what());
  }
  if (!j.is_object()) {
    throw bad_request(std::string("the request body must be a JSON object, got ") + type_name(j));
  }
  return j;
}

CompletionRequest parse_completion_request(const json& body, int64_t vocab_size) {
  CompletionRequest r;
  GenerationParams& p = r.params;
  parse_max_tokens(body, p, /*chat=*/false);
  parse_common(body, p, vocab_size);
  p.echo = get_bool(body, "echo", false);
  p.logprobs = int32_t(get_int(body, "logprobs", 0, kMaxLogprobs).value_or(-1));

  const json* prompt = field(body, "prompt");
  if (!prompt) throw bad_request("'prompt' is required", "prompt");
  if (prompt->is_string()) {
    r.prompts.push_back({prompt->get<std::string>(), {}});
  } else if (prompt->is_array()) {
    if (prompt->empty()) throw bad_request("'prompt' must not be empty", "prompt");
    const json& first = (*prompt)[0];
    if (first.is_number()) {
      r.prompts.push_back({std::nullopt, token_ids(*prompt, "prompt", vocab_size)});
    } else if (first.is_string()) {
      for (const auto& x : *prompt) r.prompts.push_back({as_string(x, "prompt"), {}});
    } else if (first.is_array()) {
      for (const auto& x : *prompt) {
        r.prompts.push_back({std::nullopt, token_ids(x, "prompt", vocab_size)});
      }
    } else {
      throw type_error("prompt", "a string, an array of strings or of token ids", first);
    }
  } else {
    throw type_error("prompt", "a string or an array", *prompt);
  }
  if (int64_t(r.prompts.size()) * p.n > 4096) {
    throw bad_request("too many choices: number of prompts times n is over 4096", "n");
  }
  return r;
}

ChatRequest parse_chat_request(const json& body, int64_t vocab_size) {
  ChatRequest r;
  GenerationParams& p = r.params;
  parse_max_tokens(body, p, /*chat=*/true);
  parse_common(body, p, vocab_size);
  parse_chat_messages(body, r);
  bool logprobs = get_bool(body, "logprobs", false);
  auto top = get_int(body, "top_logprobs", 0, kMaxLogprobs);
  if (top && *top > 0 && !logprobs) {
    throw bad_request("'top_logprobs' needs 'logprobs' to be true", "top_logprobs");
  }
  if (logprobs) p.logprobs = int32_t(top.value_or(0));
  return r;
}

TokenizeRequest parse_tokenize_request(const json& body) {
  TokenizeRequest r;
  if (const json* v = field(body, "model")) r.model = as_string(*v, "model");
  r.return_token_strs = get_bool(body, "return_token_strs", false);
  get_bool(body, "add_special_tokens", true);
  if (field(body, "messages")) {
    ChatRequest chat;
    parse_chat_messages(body, chat);
    r.chat = std::move(chat);
  } else if (const json* p = field(body, "prompt")) {
    r.prompt = as_string(*p, "prompt");
  } else {
    throw bad_request("'prompt' or 'messages' is required", "prompt");
  }
  return r;
}

DetokenizeRequest parse_detokenize_request(const json& body, int64_t vocab_size) {
  DetokenizeRequest r;
  if (const json* v = field(body, "model")) r.model = as_string(*v, "model");
  const json* t = field(body, "tokens");
  if (!t) throw bad_request("'tokens' is required", "tokens");
  r.tokens = token_ids(*t, "tokens", vocab_size);
  return r;
}

}  // namespace tandem::openai
