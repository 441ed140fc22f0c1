// One /v1/completions or /v1/chat/completions request in flight: submits its choices to the
// engine, turns engine outputs into text (incremental detokenisation, stop strings,
// logprobs) and answers as one JSON response or as a stream of SSE chunks.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/request.h"
#include "server/http/connection.h"
#include "server/http/metrics.h"
#include "server/http/openai_protocol.h"
#include "server/http/stop_strings.h"
#include "server/parsers/chat_parser.h"

namespace tandem {
class Tokenizer;
class IncrementalDetokenizer;
}  // namespace tandem

namespace tandem::openai {

/// A validated, tokenised generation request.
struct GenerationSetup {
  bool chat = false;
  bool responses = false;  // /v1/responses (chat = true too): one choice, Responses output
  Json responses_body;     // the request (fields echoed in the response object)
  std::string id;          // "cmpl-..." / "chatcmpl-..."; engine ids are "<id>-<choice index>"
  std::string model;       // served model name
  int64_t created = 0;     // unix seconds
  GenerationParams params;
  struct Prompt {
    std::vector<int32_t> ids;
    std::string text;  // the prompt as text (for echo); "" without a tokenizer
  };
  std::vector<Prompt> prompts;
  /// Chat: reasoning / tool-call parsing of each choice's text (none: plain content).
  std::optional<parsers::ChatParserOptions> parser;
  /// Structured outputs / thinking budget: a fresh constraint per choice (null: none, or the
  /// engine builds it from the spec).
  std::function<std::shared_ptr<TokenConstraint>()> make_constraint;
  std::string constraint_spec;  // its wire form (GenRequest::constraint_spec; "": none)
};

/// What a generation needs from the server; all must outlive the server's io threads.
struct GenerationContext {
  std::shared_ptr<EngineGate> gate;
  const Tokenizer* tokenizer = nullptr;  // may be null
  ServerMetrics* metrics = nullptr;
};

class Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(GenerationSetup setup, GenerationContext ctx, const std::shared_ptr<Connection>& conn);
  ~Generation();

  /// Checks lengths and submits every choice; on failure throws ApiError with nothing left
  /// running. Then starts the stream (stream=true) and watches for a disconnect.
  /// Call on the connection's strand.
  void start();

 private:
  struct Choice;

  void on_output(size_t index, const StepOutput& out);
  void on_disconnect();
  void add_token(Choice& c, const StepOutput& out, size_t k);
  /// Text after stop strings: through the chat parser (when there is one) into the choice.
  void push_text(Choice& c, const std::string& text);
  void apply_delta(Choice& c, parsers::ChatDelta&& d);
  Json message_json(const Choice& c) const;
  Json delta_json(Choice& c) const;
  // /v1/responses
  void emit_responses(Choice& c, Connection& conn);
  void responses_event(Connection& conn, Json ev);
  /// Closes the open output item (its *.done events).
  void responses_close_item(Choice& c, Connection& conn);
  Json responses_output(const Choice& c) const;  // non-streamed output items
  Json response_json(const std::string& status, Json output) const;
  void finish_choice(Choice& c, const std::string& reason, Json stop_reason);
  void fail(const std::string& message, int32_t retry_after_s = 0);
  int64_t output_tokens() const;
  void emit_chunk(Choice& c);
  void complete();
  void abort_all();

  std::string token_text(int32_t id) const;
  Json token_bytes(int32_t id) const;
  Json chat_logprob_entry(int32_t id, float logprob, const std::vector<TokenLogprob>* top) const;
  void add_completion_logprob(Choice& c, int32_t id, std::optional<float> logprob,
                              const std::vector<TokenLogprob>* top, bool include_sampled);
  Json vllm_prompt_logprobs(const Choice& c, const StepOutput& out) const;
  Json usage_json() const;
  Json chunk_envelope() const;
  Json final_choice_json(const Choice& c) const;

  GenerationSetup setup_;
  GenerationContext ctx_;
  std::weak_ptr<Connection> conn_;
  std::vector<std::unique_ptr<Choice>> choices_;
  size_t num_finished_ = 0;
  int32_t max_tokens_param_ = 0;  // the effective max_tokens (largest over the prompts)
  bool done_ = false;             // answered (or client gone): later outputs are ignored
  std::chrono::steady_clock::time_point start_time_;
  /// Special tokens the chat parser needs to see as text even with skip_special_tokens
  /// (e.g. the demo model's <think> / </think>): id -> text.
  std::vector<std::pair<int32_t, std::string>> parser_tags_;
  // /v1/responses streaming state
  int64_t resp_seq_ = 0;
  bool resp_started_ = false;
  Json resp_items_ = Json::array();  // output items so far (the open one last)
  bool resp_open_ = false;           // resp_items_.back() is still streaming
  int32_t resp_open_call_ = -1;      // the open item's tool call index (function_call)
};

}  // namespace tandem::openai
