// Routing and the OpenAI / vLLM endpoints, independent of the transport: takes a parsed
// HttpRequest and answers it on a Connection (at once, or later for a generation).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "server/grammar/grammar.h"
#include "server/http/connection.h"
#include "server/http/generation.h"
#include "server/http/http_server.h"
#include "server/http/metrics.h"
#include "server/http/openai_protocol.h"
#include "server/parsers/chat_parser.h"

namespace tandem::openai {

class ApiHandler {
 public:
  ApiHandler(const HttpServerConfig& config, std::shared_ptr<EngineGate> gate,
             const Tokenizer* tokenizer, const ChatTemplate* chat_template, ServerMetrics& metrics);

  /// Answers one request; every error becomes an OpenAI-style JSON error for this request.
  /// Runs on the connection's strand.
  void handle(const HttpRequest& req, const std::shared_ptr<Connection>& conn);

  /// The JSON error response for an ApiError (also used by the transport for 400 / 413).
  static HttpResponse error_response(const ApiError& e);

 private:
  void route(const HttpRequest& req, const std::shared_ptr<Connection>& conn);
  void check_auth(const HttpRequest& req) const;
  void check_model(const std::string& model) const;
  void completions(const HttpRequest& req, const std::shared_ptr<Connection>& conn);
  void chat_completions(const HttpRequest& req, const std::shared_ptr<Connection>& conn);
  void responses(const HttpRequest& req, const std::shared_ptr<Connection>& conn);
  /// A chat generation: the prompt rendered (plus a forced tool-call start), parsers set.
  GenerationSetup chat_setup(ChatRequest& r, const std::string& id_prefix) const;
  HttpResponse tokenize(const HttpRequest& req) const;
  HttpResponse detokenize(const HttpRequest& req) const;
  HttpResponse models() const;
  HttpResponse model(const std::string& name) const;

  /// The chat prompt as token ids (template rendered, special tokens parsed).
  std::vector<int32_t> chat_prompt_ids(const ChatRequest& r) const;
  /// The chat prompt as text (the rendered template).
  std::string chat_prompt_text(const ChatRequest& r) const;
  std::vector<int32_t> encode(const std::string& text, const char* param) const;
  const Tokenizer& require_tokenizer(const char* what) const;
  /// The request's token constraint (structured outputs, thinking budget), if any: its spec
  /// (s.constraint_spec) and, unless the engine compiles from the spec (a router), a factory
  /// for its choices (s.make_constraint). Grammar errors are 400s naming the field.
  void constrain(GenerationSetup& s, const GenerationParams& p,
                 std::optional<grammar::GrammarSpec> spec, const std::string& param,
                 grammar::ThinkStart think) const;
  grammar::GrammarCompiler& grammars() const;

  HttpServerConfig config_;
  parsers::ToolFormat tool_format_;
  std::shared_ptr<EngineGate> gate_;
  const Tokenizer* tokenizer_;
  const ChatTemplate* chat_template_;
  ServerMetrics& metrics_;
  int64_t created_;  // unix seconds at start (for /v1/models)
  mutable std::once_flag grammars_once_;
  mutable std::unique_ptr<grammar::GrammarCompiler> grammars_;  // at the first grammar
};

/// A fresh request id suffix: 16 hex digits, unique within the process.
std::string new_request_id();

}  // namespace tandem::openai
