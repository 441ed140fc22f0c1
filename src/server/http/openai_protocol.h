// OpenAI (and vLLM-extension) request parsing: JSON bodies of /v1/completions,
// /v1/chat/completions, /tokenize and /detokenize are validated once here and turned into
// plain structs. Every invalid input throws ApiError(400) naming the field.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/sampling.h"
#include "server/grammar/grammar.h"
#include "server/http/api_error.h"

namespace tandem::openai {

/// Request and response JSON keeps key order (it shows in chat templates' `tojson`).
using Json = nlohmann::ordered_json;

/// Most top logprobs a request may ask for (OpenAI's limit).
inline constexpr int32_t kMaxLogprobs = 20;

/// Generation options shared by completions and chat completions.
struct GenerationParams {
  std::string model;  // "" when the request named none
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage: a final usage chunk
  bool continuous_usage = false;      // stream_options.continuous_usage_stats: usage in every chunk
  int32_t n = 1;                      // choices per prompt
  std::optional<int32_t> max_tokens;  // none: up to the model length
  int32_t min_tokens = 0;
  SamplingParams sampling;  // logprobs / prompt_logprobs are filled by the handler
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  int32_t logprobs = -1;  // top-N per output token (completions int, chat top_logprobs); -1 off
  int32_t prompt_logprobs = -1;             // vLLM: top-N per prompt token; -1 off
  bool echo = false;                        // completions: the prompt is prepended to the output
  bool return_token_ids = false;            // vLLM: token ids in the response
  bool return_tokens_as_token_ids = false;  // vLLM: logprob tokens as "token_id:<id>"
  // Structured outputs (response_format, structured_outputs, guided_*): the grammar and the
  // field it came from (400s name it).
  std::optional<grammar::GrammarSpec> structured;
  std::string structured_param;
  int32_t thinking_token_budget = -1;  // vLLM: think-block tokens before </think>; -1: none
};

/// A completions prompt before tokenisation: text or token ids.
struct PromptInput {
  std::optional<std::string> text;  // set for a text prompt
  std::vector<int32_t> ids;         // set for a token-id prompt
};

struct CompletionRequest {
  GenerationParams params;
  std::vector<PromptInput> prompts;  // one choice group per prompt
};

struct ChatRequest {
  GenerationParams params;
  Json messages;  // normalised: content is a string (or null)
  Json tools;     // null or an array of tool definitions (null when tool_choice is "none")
  std::string tool_choice = "none";  // "none", "auto", "required" or "function" (named)
  std::string tool_choice_name;      // tool_choice "function": the function's name
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  Json chat_template_kwargs = Json::object();
};

/// Parses the body of POST /v1/completions. Token ids are checked against vocab_size.
CompletionRequest parse_completion_request(const Json& body, int64_t vocab_size);

/// Parses the body of POST /v1/chat/completions.
ChatRequest parse_chat_request(const Json& body, int64_t vocab_size);

/// POST /v1/responses, as a chat request (input items become messages; instructions a
/// system message; flat function tools become chat tools) plus the body (echoed back).
struct ResponsesRequest {
  ChatRequest chat;
  Json body;
};
ResponsesRequest parse_responses_request(const Json& body, int64_t vocab_size);

/// POST /tokenize: either a prompt or chat messages.
struct TokenizeRequest {
  std::string model;
  std::optional<std::string> prompt;
  std::optional<ChatRequest> chat;  // when the body has "messages"
  bool return_token_strs = false;
};
TokenizeRequest parse_tokenize_request(const Json& body);

/// POST /detokenize: token ids.
struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};
DetokenizeRequest parse_detokenize_request(const Json& body, int64_t vocab_size);

/// Parses a request body; malformed JSON or a non-object throws ApiError(400).
Json parse_body(const std::string& body);

}  // namespace tandem::openai
