// One /v1/completions or /v1/chat/completions request in flight: submits its choices to the
// engine, turns engine outputs into text (incremental detokenisation, stop strings,
// logprobs) and answers as one JSON response or as a stream of SSE chunks.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/request.h"
#include "server/http/connection.h"
#include "server/http/metrics.h"
#include "server/http/openai_protocol.h"
#include "server/http/stop_strings.h"

namespace tandem {
class Tokenizer;
class IncrementalDetokenizer;
}  // namespace tandem

namespace tandem::openai {

/// A validated, tokenised generation request.
struct GenerationSetup {
  bool chat = false;
  std::string id;       // "cmpl-..." / "chatcmpl-..."; engine ids are "<id>-<choice index>"
  std::string model;    // served model name
  int64_t created = 0;  // unix seconds
  GenerationParams params;
  struct Prompt {
    std::vector<int32_t> ids;
    std::string text;  // the prompt as text (for echo); "" without a tokenizer
  };
  std::vector<Prompt> prompts;
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
  void finish_choice(Choice& c, const std::string& reason, Json stop_reason);
  void fail(const std::string& message);
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
  bool done_ = false;  // answered (or client gone): later outputs are ignored
  std::chrono::steady_clock::time_point start_time_;
};

}  // namespace tandem::openai
