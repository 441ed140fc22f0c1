#include "server/http/api_handler.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>

#include "core/error.h"
#include "server/http/generation.h"
#include "server/http/json_util.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem::openai {

namespace {

const char* in_param_words(grammar::GrammarKind k) {
  switch (k) {
    case grammar::GrammarKind::kJsonObject: return "JSON object format";
    case grammar::GrammarKind::kJsonSchema: return "JSON schema";
    case grammar::GrammarKind::kRegex: return "regex";
    case grammar::GrammarKind::kChoice: return "choice";
    case grammar::GrammarKind::kEbnf: return "grammar";
    case grammar::GrammarKind::kStructuralTag: return "structural tag";
  }
  return "grammar";
}

using json = Json;

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

HttpResponse json_response(const json& j, int status = 200) {
  return {status, "application/json", dump_json(j), {}};
}

/// Compares without an early exit, so the key cannot be guessed byte by byte from timing.
bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= a[i] ^ (i < b.size() ? b[i] : 0);
  return diff == 0;
}

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

ApiError no_tokenizer(const char* what) {
  return bad_request(std::string("the model has no tokenizer: ") + what, "");
}

json model_card(const std::string& name, int64_t created, int64_t max_model_len) {
  return {{"id", name},
          {"object", "model"},
          {"created", created},
          {"owned_by", "tandem"},
          {"root", name},
          {"parent", nullptr},
          {"max_model_len", max_model_len},
          {"permission", json::array()}};
}

}  // namespace

std::string new_request_id() {
  static const uint64_t salt = [] {
    std::random_device rd;
    return (uint64_t(rd()) << 32) ^ rd();
  }();
  static std::atomic<uint64_t> counter{0};
  // An odd multiplier is a bijection mod 2^64, so ids never repeat within a process.
  uint64_t x = (counter.fetch_add(1) * 0x9E3779B97F4A7C15ull) ^ salt;
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

ApiHandler::ApiHandler(const HttpServerConfig& config, std::shared_ptr<EngineGate> gate,
                       const Tokenizer* tokenizer, const ChatTemplate* chat_template,
                       ServerMetrics& metrics)
    : config_(config),
      tool_format_(parsers::parse_tool_format(config.tool_call_parser)),
      gate_(std::move(gate)),
      tokenizer_(tokenizer),
      chat_template_(chat_template),
      metrics_(metrics),
      created_(unix_now()) {
  TANDEM_CHECK_KIND(
      kInvalidArgument, config_.reasoning_parser == "qwen3" || config_.reasoning_parser == "none",
      "unknown reasoning parser '", config_.reasoning_parser, "' (expected qwen3 or none)");
}

HttpResponse ApiHandler::error_response(const ApiError& e) {
  HttpResponse r = json_response(e.to_json(), e.status());
  if (e.status() == 429 || e.status() == 503) r.headers.emplace_back("Retry-After", "1");
  return r;
}

void ApiHandler::handle(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  try {
    route(req, conn);
  } catch (const ApiError& e) {
    conn->respond(error_response(e));
  } catch (const Error& e) {
    switch (e.kind()) {
      case ErrorKind::kInvalidArgument:
      case ErrorKind::kUnsupported: conn->respond(error_response(bad_request(e.message()))); break;
      case ErrorKind::kNotFound:
        conn->respond(error_response(ApiError(404, e.message(), "not_found_error")));
        break;
      case ErrorKind::kOutOfResources:
        conn->respond(
            error_response(ApiError(429, e.message(), "rate_limit_error", "", "queue_full")));
        break;
      default: conn->respond(error_response(ApiError(500, e.message(), "server_error")));
    }
  } catch (const std::exception& e) {
    conn->respond(
        error_response(ApiError(500, std::string("internal error: ") + e.what(), "server_error")));
  } catch (...) {
    conn->respond(error_response(ApiError(500, "internal error", "server_error")));
  }
}

void ApiHandler::check_auth(const HttpRequest& req) const {
  if (config_.api_key.empty()) return;
  const std::string expected = "Bearer " + config_.api_key;
  if (!constant_time_equal(req.authorization, expected)) {
    throw ApiError(401,
                   req.authorization.empty() ? "Missing API key: send 'Authorization: Bearer <key>'"
                                             : "Incorrect API key provided",
                   "authentication_error", "", "invalid_api_key");
  }
}

void ApiHandler::check_model(const std::string& model) const {
  if (!model.empty() && model != config_.model_name) {
    throw ApiError(404, "The model `" + model + "` does not exist.", "not_found_error", "model",
                   "model_not_found");
  }
}

void ApiHandler::route(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  const std::string& path = req.path;
  const bool protected_path =
      starts_with(path, "/v1/") || path == "/tokenize" || path == "/detokenize";
  if (protected_path) check_auth(req);

  auto method_is = [&](const char* allowed) {
    if (req.method == allowed) return true;
    ApiError e(405,
               "Method " + req.method + " is not allowed for " + path + " (use " + allowed + ")",
               "invalid_request_error", "", "method_not_allowed");
    HttpResponse r = error_response(e);
    r.headers.emplace_back("Allow", allowed);
    conn->respond(std::move(r));
    return false;
  };

  if (path == "/health") {
    if (method_is("GET")) conn->respond({200, "application/json", "", {}});
  } else if (path == "/version") {
    if (method_is("GET")) conn->respond(json_response({{"version", "0.1.0"}}));
  } else if (path == "/metrics") {
    if (method_is("GET")) {
      conn->respond({200,
                     "text/plain; version=0.0.4; charset=utf-8",
                     metrics_.render(gate_->engine().stats()),
                     {}});
    }
  } else if (path == "/v1/models") {
    if (method_is("GET")) conn->respond(models());
  } else if (starts_with(path, "/v1/models/")) {
    if (method_is("GET")) conn->respond(model(path.substr(11)));
  } else if (path == "/v1/completions") {
    if (method_is("POST")) completions(req, conn);
  } else if (path == "/v1/chat/completions") {
    if (method_is("POST")) chat_completions(req, conn);
  } else if (path == "/v1/responses") {
    if (method_is("POST")) responses(req, conn);
  } else if (path == "/tokenize") {
    if (method_is("POST")) conn->respond(tokenize(req));
  } else if (path == "/detokenize") {
    if (method_is("POST")) conn->respond(detokenize(req));
  } else {
    throw ApiError(404, "Route not found: " + req.method + " " + path, "not_found_error", "",
                   "route_not_found");
  }
}

HttpResponse ApiHandler::models() const {
  json data =
      json::array({model_card(config_.model_name, created_, gate_->engine().max_model_len())});
  return json_response({{"object", "list"}, {"data", data}});
}

HttpResponse ApiHandler::model(const std::string& name) const {
  check_model(name.empty() ? std::string("<empty>") : name);
  return json_response(model_card(config_.model_name, created_, gate_->engine().max_model_len()));
}

const Tokenizer& ApiHandler::require_tokenizer(const char* what) const {
  if (tokenizer_ == nullptr) throw no_tokenizer(what);
  return *tokenizer_;
}

std::vector<int32_t> ApiHandler::encode(const std::string& text, const char* param) const {
  std::vector<int32_t> ids =
      require_tokenizer("send token ids instead of text").encode(text, /*parse_special=*/true);
  const int64_t vocab = gate_->engine().vocab_size();
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab) {
      throw bad_request("the tokenizer produced token id " + std::to_string(id) +
                            ", outside the model's vocabulary of " + std::to_string(vocab),
                        param);
    }
  }
  return ids;
}

std::vector<int32_t> ApiHandler::chat_prompt_ids(const ChatRequest& r) const {
  return encode(chat_prompt_text(r), "messages");
}

std::string ApiHandler::chat_prompt_text(const ChatRequest& r) const {
  const Tokenizer& tok = require_tokenizer("chat needs a tokenizer and a chat template");
  if (chat_template_ == nullptr) throw bad_request("the model has no chat template", "messages");
  ChatTemplateInputs in;
  in.messages = r.messages;
  in.tools = r.tools;
  in.add_generation_prompt = r.add_generation_prompt;
  if (r.continue_final_message) in.continue_final_message = "content";
  in.special_tokens = tok.special_tokens_map();
  if (r.chat_template_kwargs.is_object()) in.kwargs = r.chat_template_kwargs;
  // NOTE: template errors (including its raise_exception) are Error(kInvalidArgument): 400.
  return chat_template_->apply(in);
}

void ApiHandler::completions(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  const json body = parse_body(req.body);
  CompletionRequest r = parse_completion_request(body, gate_->engine().vocab_size());
  check_model(r.params.model);
  if (!tokenizer_ && !r.params.stop.empty()) throw no_tokenizer("stop strings need one");

  GenerationSetup s;
  s.chat = false;
  s.id = "cmpl-" + new_request_id();
  s.model = config_.model_name;
  s.created = unix_now();
  for (auto& p : r.prompts) {
    GenerationSetup::Prompt prompt;
    if (p.text) {
      if (!tokenizer_) throw no_tokenizer("send the prompt as token ids");
      prompt.ids = encode(*p.text, "prompt");
      prompt.text = std::move(*p.text);
    } else {
      prompt.ids = std::move(p.ids);
      if (tokenizer_ && r.params.echo) {
        prompt.text = tokenizer_->decode(prompt.ids, /*skip_special=*/false);
      }
    }
    s.prompts.push_back(std::move(prompt));
  }
  constrain(s, r.params, r.params.structured, r.params.structured_param,
            grammar::ThinkStart::kContent);
  s.params = std::move(r.params);
  GenerationContext ctx{gate_, tokenizer_, &metrics_};
  std::make_shared<Generation>(std::move(s), std::move(ctx), conn)->start();
}

grammar::GrammarCompiler& ApiHandler::grammars() const {
  std::call_once(grammars_once_, [&] {
    const Tokenizer& tok = require_tokenizer("structured outputs need one");
    grammars_ = std::make_unique<grammar::GrammarCompiler>(tok, gate_->engine().vocab_size(),
                                                           gate_->engine().eos_token_ids());
  });
  return *grammars_;
}

void ApiHandler::constrain(GenerationSetup& s, const GenerationParams& p,
                           std::optional<grammar::GrammarSpec> spec, const std::string& param,
                           grammar::ThinkStart think) const {
  const bool budget = p.thinking_token_budget >= 0 && think != grammar::ThinkStart::kContent;
  if (!spec && !budget) return;
  if (!tokenizer_) throw no_tokenizer("structured outputs need one");
  const EngineClient& engine = gate_->engine();
  if (!engine.supports_constraints()) {
    throw bad_request("structured outputs and thinking_token_budget are not supported here",
                      spec ? param : "thinking_token_budget");
  }
  grammar::ConstraintRequest cr;
  cr.grammar = std::move(spec);
  cr.think = think;
  cr.thinking_budget = budget ? p.thinking_token_budget : -1;
  auto invalid = [&](const Error& e) {
    return bad_request(
        std::string("invalid ") + in_param_words(cr.grammar->kind) + ": " + e.message(), param);
  };
  s.constraint_spec = grammar::encode_constraint_request(cr);
  if (engine.constraints_from_spec()) {
    // A router: the instances compile where they sample; here the spec is only checked.
    const std::optional<int32_t> end = tokenizer_->token_to_id("</think>");
    if (budget && !end) {
      throw bad_request("'thinking_token_budget' needs a tokenizer with a </think> token",
                        "thinking_token_budget");
    }
    if (cr.grammar) {
      try {
        grammar::validate(*cr.grammar);
      } catch (const Error& e) {
        throw invalid(e);
      }
    }
    return;
  }
  grammar::GrammarCompiler& gc = grammars();
  if (budget && gc.think_end_id() < 0) {
    throw bad_request("'thinking_token_budget' needs a tokenizer with a </think> token",
                      "thinking_token_budget");
  }
  grammar::ConstraintOptions o;
  try {
    o = grammar::constraint_options(gc, cr);
  } catch (const Error& e) {
    throw invalid(e);
  }
  s.make_constraint = [o] { return grammar::make_constraint(o); };
}

void ApiHandler::chat_completions(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  const json body = parse_body(req.body);
  ChatRequest r = parse_chat_request(body, gate_->engine().vocab_size());
  check_model(r.params.model);
  GenerationSetup s = chat_setup(r, "chatcmpl-");
  GenerationContext ctx{gate_, tokenizer_, &metrics_};
  std::make_shared<Generation>(std::move(s), std::move(ctx), conn)->start();
}

void ApiHandler::responses(const HttpRequest& req, const std::shared_ptr<Connection>& conn) {
  const json body = parse_body(req.body);
  ResponsesRequest r = parse_responses_request(body, gate_->engine().vocab_size());
  check_model(r.chat.params.model);
  GenerationSetup s = chat_setup(r.chat, "resp_");
  s.responses = true;
  s.responses_body = std::move(r.body);
  GenerationContext ctx{gate_, tokenizer_, &metrics_};
  std::make_shared<Generation>(std::move(s), std::move(ctx), conn)->start();
}

GenerationSetup ApiHandler::chat_setup(ChatRequest& r, const std::string& id_prefix) const {
  GenerationSetup s;
  s.chat = true;
  s.id = id_prefix + new_request_id();
  s.model = config_.model_name;
  s.created = unix_now();
  std::string prompt = chat_prompt_text(r);
  parsers::ChatParserOptions po;
  po.reasoning = config_.reasoning_parser == "qwen3";
  const auto thinking = r.chat_template_kwargs.find("enable_thinking");
  const bool thinking_off =
      thinking != r.chat_template_kwargs.end() && thinking->is_boolean() && !thinking->get<bool>();
  po.start = parsers::reasoning_start_for_prompt(prompt, thinking_off);
  std::optional<grammar::GrammarSpec> spec = r.params.structured;
  std::string spec_param = r.params.structured_param;
  if (!r.tools.is_null() && tool_format_ != parsers::ToolFormat::kNone) {
    po.tools_format = tool_format_;
    po.tools = r.tools;
    if (r.tool_choice == "required" || r.tool_choice == "function") {
      if (spec) {
        throw bad_request("'" + spec_param + "' cannot be combined with tool_choice \"" +
                              r.tool_choice + "\" (the call is forced by its own grammar)",
                          spec_param);
      }
      // The reply starts inside a call, after an empty think block; a grammar forces the
      // call (one of the tools, or the named one), its arguments valid against the tool's
      // schema, and its end. Hermes: {"name", "arguments"} JSON; qwen3_coder: the XML form.
      if (po.start == parsers::ReasoningStart::kInThink) prompt += "\n</think>\n\n";
      if (po.start == parsers::ReasoningStart::kAuto) prompt += "<think>\n\n</think>\n\n";
      po.start = parsers::ReasoningStart::kContent;
      const std::string prefix = "<tool_call>\n";
      const std::string only = r.tool_choice == "function" ? r.tool_choice_name : "";
      spec = tool_format_ == parsers::ToolFormat::kHermes
                 ? grammar::hermes_tool_call_grammar(r.tools, only)
                 : grammar::xml_tool_call_grammar(r.tools, only);
      spec_param = "tools";
      prompt += prefix;
      po.prime = prefix;
    }
  }
  s.prompts.push_back({encode(prompt, "messages"), ""});
  grammar::ThinkStart think = grammar::ThinkStart::kContent;
  if (po.reasoning && po.start == parsers::ReasoningStart::kInThink) {
    think = grammar::ThinkStart::kInThink;
  } else if (po.reasoning && po.start == parsers::ReasoningStart::kAuto) {
    think = grammar::ThinkStart::kAuto;
  }
  constrain(s, r.params, spec, spec_param, think);
  if (po.reasoning || po.tools_format != parsers::ToolFormat::kNone) s.parser = std::move(po);
  s.params = std::move(r.params);
  s.params.echo = false;
  return s;
}

HttpResponse ApiHandler::tokenize(const HttpRequest& req) const {
  const json body = parse_body(req.body);
  TokenizeRequest r = parse_tokenize_request(body);
  check_model(r.model);
  const Tokenizer& tok = require_tokenizer("/tokenize needs one");
  std::vector<int32_t> ids = r.chat ? chat_prompt_ids(*r.chat) : encode(*r.prompt, "prompt");
  json out = {
      {"count", ids.size()}, {"max_model_len", gate_->engine().max_model_len()}, {"tokens", ids}};
  if (r.return_token_strs) {
    json strs = json::array();
    for (int32_t id : ids) strs.push_back(tok.id_to_token(id));
    out["token_strs"] = std::move(strs);
  }
  return json_response(out);
}

HttpResponse ApiHandler::detokenize(const HttpRequest& req) const {
  const json body = parse_body(req.body);
  const Tokenizer& tok = require_tokenizer("/detokenize needs one");
  DetokenizeRequest r = parse_detokenize_request(body, int64_t(tok.vocab_size()));
  check_model(r.model);
  return json_response({{"prompt", tok.decode(r.tokens, /*skip_special=*/false)}});
}

}  // namespace tandem::openai
