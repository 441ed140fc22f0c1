// The chat-template renderer over fuzzed conversations: a chat request body is parsed as the
// server does (messages, tools, chat_template_kwargs), rendered with the demo model's Qwen3
// template and tokenized, as /v1/chat/completions does before the engine sees it.
#include <memory>
#include <string>

#include "core/error.h"
#include "fuzz_input.h"
#include "server/http/openai_protocol.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

using namespace tandem;

namespace {
struct Text {
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<ChatTemplate> tmpl;
};
const Text& text() {
  static const Text t = [] {
    const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/models/demo";
    return Text{Tokenizer::from_dir(dir), ChatTemplate::from_dir(dir)};
  }();
  return t;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Text& t = text();
  fuzz::Input in(data, size);
  const uint8_t flags = in.byte();
  try {
    const auto req = openai::parse_chat_request(openai::parse_body(std::string(in.rest())), 8192);
    ChatTemplateInputs ci;
    ci.messages = req.messages;
    ci.tools = req.tools;
    ci.add_generation_prompt = req.add_generation_prompt;
    if (req.continue_final_message) ci.continue_final_message = "content";
    ci.special_tokens = t.tok->special_tokens_map();
    if (req.chat_template_kwargs.is_object()) ci.kwargs = req.chat_template_kwargs;
    if (flags & 1) ci.kwargs["enable_thinking"] = false;
    const std::string prompt = t.tmpl->apply(ci);
    t.tok->encode(prompt, /*parse_special=*/true);
  } catch (const openai::ApiError&) {
  } catch (const Error&) {
  }
  return 0;
}
