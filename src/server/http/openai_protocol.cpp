#include "server/http/openai_protocol.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace tandem::openai {

namespace {

using json = Json;

constexpr int kMaxJsonDepth = 64;
constexpr int64_t kMaxN = 256;
constexpr size_t kMaxStopStrings = 64;
constexpr size_t kMaxStopTokenIds = 1024;
constexpr size_t kMaxLogitBias = 1024;

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

/// A JSON schema given as an object or as a JSON string holding one.
std::string schema_text(const json& v, const std::string& name) {
  json schema = v;
  if (v.is_string()) {
    schema = json::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (schema.is_discarded()) {
      throw bad_request(in_quotes(name) + " is not valid JSON", name);
    }
  }
  if (!schema.is_object()) throw type_error(name, "a JSON schema object", schema);
  return schema.dump();
}

/// A structural tag (xgrammar's): {"type": "structural_tag", "format": {...}}, or vLLM's older
/// {"structures": [{"begin", "schema", "end"}], "triggers": [...]} (free text in which a trigger
/// starts one of the tags), as an object or its JSON text.
std::string structural_tag_text(const json& v, const std::string& name) {
  json tag = v;
  if (v.is_string()) {
    tag = json::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (tag.is_discarded()) throw bad_request(in_quotes(name) + " is not valid JSON", name);
  }
  if (!tag.is_object()) throw type_error(name, "a structural tag object", tag);
  if (const json* f = field(tag, "format")) {
    if (!f->is_object()) throw type_error(name + ".format", "an object", *f);
    return json{{"type", "structural_tag"}, {"format", *f}}.dump();
  }
  const json* structures = field(tag, "structures");
  const json* triggers = field(tag, "triggers");
  if (!structures || !triggers) {
    throw bad_request(in_quotes(name) + " needs 'format' (or 'structures' and 'triggers')", name);
  }
  if (!structures->is_array() || structures->empty()) {
    throw type_error(name + ".structures", "a non-empty array", *structures);
  }
  if (!triggers->is_array() || triggers->empty()) {
    throw type_error(name + ".triggers", "a non-empty array of strings", *triggers);
  }
  json tags = json::array();
  for (const json& st : *structures) {
    const std::string where = name + ".structures";
    if (!st.is_object()) throw type_error(where, "an array of objects", st);
    const json* b = field(st, "begin");
    const json* e = field(st, "end");
    const json* sc = field(st, "schema");
    if (!b || !e || !sc)
      throw bad_request("each of " + in_quotes(where) + " needs 'begin', 'schema' and 'end'",
                        where);
    tags.push_back({{"type", "tag"},
                    {"begin", as_string(*b, where + ".begin")},
                    {"content",
                     {{"type", "json_schema"},
                      {"json_schema", json::parse(schema_text(*sc, where + ".schema"))}}},
                    {"end", as_string(*e, where + ".end")}});
  }
  for (const json& t : *triggers) as_string(t, name + ".triggers");
  return json{{"type", "structural_tag"},
              {"format", {{"type", "triggered_tags"}, {"triggers", *triggers}, {"tags", tags}}}}
      .dump();
}

/// response_format (OpenAI), structured_outputs and the older guided_* fields (vLLM): at most
/// one grammar per request, named by the field it came from (`structured_param`).
void parse_structured_outputs(const json& body, GenerationParams& p) {
  using grammar::GrammarKind;
  auto set = [&](grammar::GrammarSpec spec, const std::string& param) {
    if (p.structured) {
      throw bad_request("only one structured output may be given: " +
                            in_quotes(p.structured_param) + " and " + in_quotes(param),
                        param);
    }
    p.structured = std::move(spec);
    p.structured_param = param;
  };
  auto spec_of = [](GrammarKind kind) {
    grammar::GrammarSpec g;
    g.kind = kind;
    return g;
  };
  auto choices = [&](const json& v, const std::string& name) {
    if (!v.is_array() || v.empty()) throw type_error(name, "a non-empty array of strings", v);
    grammar::GrammarSpec g = spec_of(GrammarKind::kChoice);
    for (const auto& c : v) {
      if (as_string(c, name).empty()) throw bad_request("choices must not be empty", name);
      g.choices.push_back(c.get<std::string>());
    }
    return g;
  };
  auto text = [&](GrammarKind kind, const json& v, const std::string& name) {
    grammar::GrammarSpec g = spec_of(kind);
    g.text = as_string(v, name);
    if (g.text.empty()) throw bad_request(in_quotes(name) + " must not be empty", name);
    return g;
  };
  if (const json* v = field(body, "response_format")) {
    if (!v->is_object()) throw type_error("response_format", "an object", *v);
    const json* t = field(*v, "type");
    if (!t) throw bad_request("'response_format' has no 'type'", "response_format.type");
    const std::string& type = as_string(*t, "response_format.type");
    if (type == "json_object") {
      set(spec_of(GrammarKind::kJsonObject), "response_format");
    } else if (type == "json_schema") {
      const json* js = field(*v, "json_schema");
      if (!js || !js->is_object()) {
        throw bad_request("'response_format' of type json_schema needs a 'json_schema' object",
                          "response_format.json_schema");
      }
      if (const json* n = field(*js, "name")) as_string(*n, "response_format.json_schema.name");
      const json* schema = field(*js, "schema");
      if (!schema) {
        throw bad_request("'response_format.json_schema' has no 'schema'",
                          "response_format.json_schema.schema");
      }
      grammar::GrammarSpec g = spec_of(GrammarKind::kJsonSchema);
      g.text = schema_text(*schema, "response_format.json_schema.schema");
      if (const json* st = field(*js, "strict")) {
        g.strict = as_bool(*st, "response_format.json_schema.strict");
      }
      set(std::move(g), "response_format.json_schema.schema");
    } else if (type == "structural_tag") {
      grammar::GrammarSpec g = spec_of(GrammarKind::kStructuralTag);
      g.text = structural_tag_text(*v, "response_format");
      set(std::move(g), "response_format");
    } else if (type != "text") {
      throw bad_request("response_format type '" + type +
                            "' is not supported (\"text\", \"json_object\", \"json_schema\", "
                            "\"structural_tag\")",
                        "response_format.type");
    }
  }
  if (const json* so = field(body, "structured_outputs")) {
    if (!so->is_object()) throw type_error("structured_outputs", "an object", *so);
    if (const json* v = field(*so, "json")) {
      grammar::GrammarSpec g = spec_of(GrammarKind::kJsonSchema);
      g.text = schema_text(*v, "structured_outputs.json");
      set(std::move(g), "structured_outputs.json");
    }
    if (const json* v = field(*so, "regex")) {
      set(text(GrammarKind::kRegex, *v, "structured_outputs.regex"), "structured_outputs.regex");
    }
    if (const json* v = field(*so, "choice")) {
      set(choices(*v, "structured_outputs.choice"), "structured_outputs.choice");
    }
    if (const json* v = field(*so, "grammar")) {
      set(text(GrammarKind::kEbnf, *v, "structured_outputs.grammar"), "structured_outputs.grammar");
    }
    if (const json* v = field(*so, "json_object");
        v && as_bool(*v, "structured_outputs.json_object")) {
      set(spec_of(GrammarKind::kJsonObject), "structured_outputs.json_object");
    }
    if (const json* v = field(*so, "structural_tag")) {
      grammar::GrammarSpec g = spec_of(GrammarKind::kStructuralTag);
      g.text = structural_tag_text(*v, "structured_outputs.structural_tag");
      set(std::move(g), "structured_outputs.structural_tag");
    }
    if (field(*so, "whitespace_pattern")) {
      throw bad_request("'structured_outputs.whitespace_pattern' is not supported",
                        "structured_outputs.whitespace_pattern");
    }
    if (!p.structured) {
      throw bad_request(
          "'structured_outputs' needs one of 'json', 'regex', 'choice', 'grammar', "
          "'json_object', 'structural_tag'",
          "structured_outputs");
    }
  }
  if (const json* v = field(body, "guided_json")) {
    grammar::GrammarSpec g = spec_of(GrammarKind::kJsonSchema);
    g.text = schema_text(*v, "guided_json");
    set(std::move(g), "guided_json");
  }
  if (const json* v = field(body, "guided_regex")) {
    set(text(GrammarKind::kRegex, *v, "guided_regex"), "guided_regex");
  }
  if (const json* v = field(body, "guided_choice")) {
    set(choices(*v, "guided_choice"), "guided_choice");
  }
  if (const json* v = field(body, "guided_grammar")) {
    set(text(GrammarKind::kEbnf, *v, "guided_grammar"), "guided_grammar");
  }
}

/// Validates the fields both generation endpoints share.
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
    if (v->size() > kMaxLogitBias) {
      throw bad_request("at most " + std::to_string(kMaxLogitBias) + " 'logit_bias' entries",
                        "logit_bias");
    }
    for (auto it = v->begin(); it != v->end(); ++it) {
      const std::string& key = it.key();
      const bool digits = !key.empty() && key.size() <= 10 &&
                          key.find_first_not_of("0123456789") == std::string::npos;
      const int64_t id = digits ? std::stoll(key) : -1;
      if (id < 0 || id >= vocab_size) {
        throw bad_request("'logit_bias' key '" + key +
                              "' is not a token id in the vocabulary (0.." +
                              std::to_string(vocab_size - 1) + ")",
                          "logit_bias");
      }
      const double bias = as_number(it.value(), "logit_bias");
      if (bias < -100.0 || bias > 100.0) {
        throw bad_request("'logit_bias' values must be in [-100, 100], got " + num_str(bias) +
                              " for token " + key,
                          "logit_bias");
      }
      if (bias != 0.0) s.logit_bias.push_back({int32_t(id), float(bias)});
    }
  }
  if (const json* v = field(body, "user")) as_string(*v, "user");
  if (const json* v = field(body, "suffix")) {
    if (!as_string(*v, "suffix").empty()) {
      throw bad_request("'suffix' is not supported", "suffix");
    }
  }
  parse_structured_outputs(body, p);
  if (auto b = get_int(body, "thinking_token_budget", 0, std::numeric_limits<int32_t>::max())) {
    p.thinking_token_budget = int32_t(*b);
  }
  // Known fields that would change the output but are not implemented: refused, never
  // ignored (unknown fields are ignored; docs/api.md lists both).
  for (const char* name : {"allowed_token_ids", "bad_words", "truncate_prompt_tokens",
                           "logits_processors", "audio", "web_search_options"}) {
    if (const json* v = field(body, name); v && !v->is_null()) {
      throw bad_request("'" + std::string(name) + "' is not supported", name);
    }
  }
  for (const char* name : {"functions", "function_call"}) {
    if (const json* v = field(body, name); v && !v->is_null()) {
      throw bad_request("'" + std::string(name) +
                            "' (deprecated by OpenAI) is not supported: use 'tools' and "
                            "'tool_choice'",
                        name);
    }
  }
  if (const json* v = field(body, "modalities"); v && !v->is_null()) {
    if (!v->is_array()) throw type_error("modalities", "an array of strings", *v);
    for (const json& m : *v) {
      if (as_string(m, "modalities") != "text") {
        throw bad_request("only the \"text\" modality is supported", "modalities");
      }
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
      // As vLLM: arguments given as a JSON string reach the template as an object (the
      // Qwen3.5 / Qwen3-Coder templates iterate over them).
      for (auto& call : nm["tool_calls"]) {
        auto it = call["function"].find("arguments");
        if (it == call["function"].end() || !it->is_string()) continue;
        json& args = *it;
        json parsed = json::parse(args.get<std::string>(), nullptr, /*allow_exceptions=*/false);
        if (parsed.is_object()) args = std::move(parsed);
      }
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

/// tools and tool_choice: r.tools is the list the template sees (null for none or
/// tool_choice "none"), r.tool_choice "none" / "auto" / "required" / "function".
void parse_tools(const json& body, ChatRequest& r) {
  const json* tools = field(body, "tools");
  std::vector<std::string> names;
  if (tools) {
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
      if (!fname) {
        throw bad_request(in_quotes(name) + " function has no 'name'", name + ".function.name");
      }
      const std::string& n = as_string(*fname, name + ".function.name");
      if (n.empty()) {
        throw bad_request(in_quotes(name + ".function.name") + " must not be empty",
                          name + ".function.name");
      }
      if (const json* params = field(*fn, "parameters"); params && !params->is_object()) {
        throw type_error(name + ".function.parameters", "an object (a JSON schema)", *params);
      }
      if (const json* d = field(*fn, "description")) as_string(*d, name + ".function.description");
      names.push_back(n);
    }
  }
  const bool have_tools = !names.empty();
  r.tool_choice = have_tools ? "auto" : "none";
  if (const json* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      const std::string& c = tc->get_ref<const std::string&>();
      if (c != "none" && c != "auto" && c != "required") {
        throw bad_request(
            "'tool_choice' must be \"none\", \"auto\", \"required\" or "
            "{\"type\": \"function\", \"function\": {\"name\": ...}}, got '" +
                c + "'",
            "tool_choice");
      }
      r.tool_choice = c;
    } else if (tc->is_object()) {
      const json* type = field(*tc, "type");
      if (!type || as_string(*type, "tool_choice.type") != "function") {
        throw bad_request("'tool_choice' object must have type 'function'", "tool_choice.type");
      }
      const json* fn = field(*tc, "function");
      if (!fn || !fn->is_object() || !field(*fn, "name")) {
        throw bad_request("'tool_choice' must name a function: {\"function\": {\"name\": ...}}",
                          "tool_choice.function.name");
      }
      r.tool_choice = "function";
      r.tool_choice_name = as_string((*fn)["name"], "tool_choice.function.name");
      if (have_tools && std::find(names.begin(), names.end(), r.tool_choice_name) == names.end()) {
        throw bad_request(
            "'tool_choice' names function '" + r.tool_choice_name + "', which is not in 'tools'",
            "tool_choice.function.name");
      }
    } else {
      throw type_error("tool_choice", "a string or an object", *tc);
    }
    if (!have_tools && r.tool_choice != "none") {
      throw bad_request("'tool_choice' " + tc->dump() + " needs a non-empty 'tools' list",
                        "tool_choice");
    }
  }
  r.tools = have_tools && r.tool_choice != "none" ? *tools : json(nullptr);
  if (const json* v = field(body, "parallel_tool_calls")) as_bool(*v, "parallel_tool_calls");
}

/// The chat fields shared by /v1/chat/completions and /tokenize.
void parse_chat_messages(const json& body, ChatRequest& r) {
  const json* messages = field(body, "messages");
  if (!messages) throw bad_request("'messages' is required", "messages");
  r.messages = normalise_messages(*messages);
  parse_tools(body, r);
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
  if (const json* v = field(body, "reasoning_effort")) {
    const std::string& e = as_string(*v, "reasoning_effort");
    if (e != "none" && e != "minimal" && e != "low" && e != "medium" && e != "high" &&
        e != "xhigh") {
      throw bad_request(
          "'reasoning_effort' must be none, minimal, low, medium, high or xhigh, got '" + e + "'",
          "reasoning_effort");
    }
    // Passed to the template as a variable; "none" also turns Qwen3's thinking off.
    if (!r.chat_template_kwargs.contains("reasoning_effort")) {
      r.chat_template_kwargs["reasoning_effort"] = e;
    }
    if (e == "none" && !r.chat_template_kwargs.contains("enable_thinking")) {
      r.chat_template_kwargs["enable_thinking"] = false;
    }
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

namespace {

/// Text of a Responses content: a string or parts of type input_text / output_text / text.
std::string responses_text(const json& content, const std::string& name) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) throw type_error(name, "a string or an array of content parts", content);
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string pname = name + "[" + std::to_string(i) + "]";
    if (!part.is_object()) throw type_error(pname, "an object", part);
    const json* type = field(part, "type");
    const std::string t = type ? as_string(*type, pname + ".type") : "";
    if (t != "input_text" && t != "output_text" && t != "text") {
      throw bad_request("content part type '" + t + "' is not supported (text only)",
                        pname + ".type");
    }
    const json* tx = field(part, "text");
    if (!tx) throw bad_request(in_quotes(pname) + " has no 'text'", pname + ".text");
    if (!text.empty()) text += "\n";
    text += as_string(*tx, pname + ".text");
  }
  return text;
}

}  // namespace

ResponsesRequest parse_responses_request(const json& body, int64_t vocab_size) {
  ResponsesRequest out;
  json chat = json::object();
  json messages = json::array();
  if (const json* v = field(body, "instructions")) {
    messages.push_back({{"role", "system"}, {"content", as_string(*v, "instructions")}});
  }
  const json* input = field(body, "input");
  if (!input) throw bad_request("'input' is required", "input");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
  } else if (input->is_array()) {
    for (size_t i = 0; i < input->size(); ++i) {
      const json& item = (*input)[i];
      const std::string name = "input[" + std::to_string(i) + "]";
      if (!item.is_object()) throw type_error(name, "an object", item);
      const json* type_v = field(item, "type");
      const std::string type = type_v ? as_string(*type_v, name + ".type") : "message";
      if (type == "message") {
        const json* role = field(item, "role");
        if (!role) throw bad_request(in_quotes(name) + " has no 'role'", name + ".role");
        const json* content = field(item, "content");
        if (!content) throw bad_request(in_quotes(name) + " has no 'content'", name + ".content");
        messages.push_back({{"role", as_string(*role, name + ".role")},
                            {"content", responses_text(*content, name + ".content")}});
      } else if (type == "function_call") {
        const json* call_id = field(item, "call_id");
        const json* fname = field(item, "name");
        const json* args = field(item, "arguments");
        if (!call_id || !fname || !args) {
          throw bad_request(in_quotes(name) + " (function_call) needs call_id, name and arguments",
                            name);
        }
        json call = {{"id", as_string(*call_id, name + ".call_id")},
                     {"type", "function"},
                     {"function",
                      {{"name", as_string(*fname, name + ".name")},
                       {"arguments", as_string(*args, name + ".arguments")}}}};
        // Consecutive calls belong to one assistant turn.
        if (!messages.empty() && messages.back()["role"] == "assistant" &&
            messages.back().contains("tool_calls")) {
          messages.back()["tool_calls"].push_back(std::move(call));
        } else if (!messages.empty() && messages.back()["role"] == "assistant") {
          messages.back()["tool_calls"] = json::array({std::move(call)});
        } else {
          messages.push_back({{"role", "assistant"},
                              {"content", nullptr},
                              {"tool_calls", json::array({std::move(call)})}});
        }
      } else if (type == "function_call_output") {
        const json* call_id = field(item, "call_id");
        const json* output = field(item, "output");
        if (!call_id || !output) {
          throw bad_request(in_quotes(name) + " (function_call_output) needs call_id and output",
                            name);
        }
        messages.push_back({{"role", "tool"},
                            {"tool_call_id", as_string(*call_id, name + ".call_id")},
                            {"content", responses_text(*output, name + ".output")}});
      } else if (type == "reasoning") {
        continue;  // earlier reasoning is not shown to the model again (as Qwen3's template)
      } else {
        throw bad_request("input item type '" + type + "' is not supported", name + ".type");
      }
    }
  } else {
    throw type_error("input", "a string or an array of input items", *input);
  }
  chat["messages"] = std::move(messages);

  if (const json* tools = field(body, "tools")) {
    if (!tools->is_array()) throw type_error("tools", "an array", *tools);
    json list = json::array();
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string name = "tools[" + std::to_string(i) + "]";
      if (!t.is_object()) throw type_error(name, "an object", t);
      const json* type = field(t, "type");
      if (!type || as_string(*type, name + ".type") != "function") {
        throw bad_request(in_quotes(name) +
                              " must have type 'function' (built-in tools are not "
                              "supported)",
                          name + ".type");
      }
      const json* fname = field(t, "name");
      if (!fname) throw bad_request(in_quotes(name) + " has no 'name'", name + ".name");
      if (as_string(*fname, name + ".name").empty()) {
        throw bad_request(in_quotes(name + ".name") + " must not be empty", name + ".name");
      }
      json fn = {{"name", *fname}};
      for (const char* k : {"description", "parameters", "strict"}) {
        if (const json* v = field(t, k)) fn[k] = *v;
      }
      list.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    chat["tools"] = std::move(list);
  }
  if (const json* tc = field(body, "tool_choice")) {
    if (tc->is_object() && field(*tc, "name") && !field(*tc, "function")) {
      chat["tool_choice"] = {{"type", tc->value("type", json("function"))},
                             {"function", {{"name", (*tc)["name"]}}}};
    } else {
      chat["tool_choice"] = *tc;
    }
  }
  if (const json* v = field(body, "max_output_tokens")) chat["max_completion_tokens"] = *v;
  if (const json* r = field(body, "reasoning")) {
    if (!r->is_object()) throw type_error("reasoning", "an object", *r);
    if (const json* e = field(*r, "effort")) chat["reasoning_effort"] = *e;
  }
  if (const json* t = field(body, "text")) {
    if (!t->is_object()) throw type_error("text", "an object", *t);
    if (const json* f = field(*t, "format")) {
      chat["response_format"] = *f;
      // The Responses API flattens json_schema: {"type", "name", "schema", "strict"}.
      if (f->is_object() && f->value("type", json()) == "json_schema" &&
          !f->contains("json_schema")) {
        json js = json::object();
        for (const char* k : {"name", "schema", "strict", "description"}) {
          if (f->contains(k)) js[k] = (*f)[k];
        }
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", js}};
      }
    }
  }
  if (field(body, "previous_response_id")) {
    throw bad_request(
        "'previous_response_id' is not supported (responses are not stored): send "
        "the conversation in 'input'",
        "previous_response_id");
  }
  if (const json* v = field(body, "store")) as_bool(*v, "store");
  if (const json* v = field(body, "metadata"); v && !v->is_object()) {
    throw type_error("metadata", "an object", *v);
  }
  for (const char* k :
       {"model", "stream", "temperature", "top_p", "top_k", "min_p", "seed", "parallel_tool_calls",
        "user", "chat_template_kwargs", "top_logprobs", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "stop", "logit_bias", "skip_special_tokens"}) {
    if (const json* v = field(body, k)) chat[k] = *v;
  }
  if (const json* v = field(body, "top_logprobs"); v && !v->is_null()) chat["logprobs"] = true;
  try {
    out.chat = parse_chat_request(chat, vocab_size);
  } catch (const ApiError& e) {
    // Chat field names that differ in the Responses API.
    std::string param = e.param();
    if (param.rfind("messages", 0) == 0) param = "input";
    if (param == "max_completion_tokens") param = "max_output_tokens";
    if (param == "reasoning_effort") param = "reasoning.effort";
    if (param.rfind("response_format.json_schema.", 0) == 0) {
      param = "text.format." + param.substr(std::string("response_format.json_schema.").size());
    } else if (param.rfind("response_format", 0) == 0) {
      param = "text.format";
    }
    throw ApiError(e.status(), e.message(), e.type(), param, e.code());
  }
  if (out.chat.params.structured_param.rfind("response_format", 0) == 0) {
    out.chat.params.structured_param = "text.format.schema";
  }
  if (out.chat.params.n != 1) throw bad_request("'n' must be 1 for responses", "n");
  out.body = body;
  return out;
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
