// OpenAI request bodies -> parameters (server/http/openai_protocol.h): completions, chat
// completions (tools, tool_choice, response_format / structured outputs), responses, tokenize
// and detokenize. Bad input is an ApiError (a 400 naming the field), nothing else.
#include "core/error.h"
#include "fuzz_input.h"
#include "server/http/openai_protocol.h"

using namespace tandem;
using namespace tandem::openai;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const uint8_t which = in.byte();
  try {
    const Json body = parse_body(std::string(in.rest()));
    switch (which % 5) {
      case 0: parse_completion_request(body, 1000); break;
      case 1: parse_chat_request(body, 1000); break;
      case 2: parse_responses_request(body, 1000); break;
      case 3: parse_tokenize_request(body); break;
      default: parse_detokenize_request(body, 1000);
    }
  } catch (const ApiError&) {
  } catch (const Error&) {
  }
  return 0;
}
