// Chat templates: renders a model's Jinja chat template (tokenizer_config.json's
// chat_template or chat_template.jinja) exactly as transformers' apply_chat_template does.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "server/tokenizer/jinja.h"

namespace tandem {

/// Arguments of ChatTemplate::apply(), mirroring transformers' apply_chat_template().
struct ChatTemplateInputs {
  /// The conversation: OpenAI-style message objects ({"role": ..., "content": ...,
  /// "tool_calls": ..., "reasoning_content": ...}).
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  /// Tool JSON schemas, or null for no tools (the template then sees `tools` = None).
  nlohmann::ordered_json tools;
  /// RAG documents, or null.
  nlohmann::ordered_json documents;
  /// Append the header that starts the assistant's reply.
  bool add_generation_prompt = false;
  /// Empty: off. Otherwise the field of the final message to leave open for the model to
  /// continue ("content", or "reasoning_content"); transformers' continue_final_message.
  std::string continue_final_message;
  /// Special tokens passed as variables (Tokenizer::special_tokens_map(): bos_token, ...).
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  /// Extra template variables (chat_template_kwargs), e.g. {"enable_thinking": false};
  /// these override special_tokens on a name clash.
  nlohmann::ordered_json kwargs = nlohmann::ordered_json::object();
};

/// A compiled chat template. Immutable, cheap to copy, thread-safe.
class ChatTemplate {
 public:
  /// Parses the template. Throws Error(kInvalidArgument, "chat template: line N: ...") on
  /// syntax errors and on Jinja features this engine does not support.
  explicit ChatTemplate(std::string_view source);

  /// The template of a model directory: chat_template.jinja when present, else the
  /// chat_template of tokenizer_config.json (the "default" entry of a named list);
  /// nullptr when the directory has neither. Throws Error(kIo) for unreadable or
  /// malformed files, Error(kInvalidArgument) for a template that does not parse.
  static std::unique_ptr<ChatTemplate> from_dir(const std::string& dir);

  /// Renders with the keys of `context` (a JSON object) as the template's variables, with
  /// no preprocessing. Object key order is kept (it shows in `tojson` output).
  std::string render(const nlohmann::ordered_json& context) const;

  /// As above for a plain nlohmann::json (its object keys are sorted, so `tojson` output
  /// orders keys alphabetically).
  std::string render(const nlohmann::json& context) const;

  /// transformers' apply_chat_template(..., tokenize=False): drops null-valued message
  /// fields, fills reasoning_content/thinking aliases, passes messages, tools, documents,
  /// add_generation_prompt, special tokens and kwargs, and handles continue_final_message.
  /// Throws Error(kInvalidArgument) for invalid inputs and template errors (including the
  /// template's own raise_exception messages).
  std::string apply(const ChatTemplateInputs& inputs) const;

  /// The template source.
  const std::string& source() const { return *source_; }

 private:
  std::shared_ptr<const std::string> source_;
  jinja::Template template_;
};

}  // namespace tandem
