// The reasoning and tool-call parsers over arbitrary model output (server/parsers): Hermes JSON
// and Qwen3-Coder XML calls, <think> blocks, with and without a primed call. The parsers
// promise results that do not depend on where the deltas split the text: the reply fed whole
// and fed in the pieces the input chooses must give the same reasoning, content and calls.
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "fuzz_input.h"
#include "server/parsers/chat_parser.h"

using namespace tandem;
using namespace tandem::parsers;

namespace {

const nlohmann::ordered_json& tools() {
  static const nlohmann::ordered_json t = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                     "metric": {"type": "boolean"}, "unit": {"type": "string", "enum": ["c", "f"]},
                     "extra": {"type": "object"}, "when": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])");
  return t;
}

ChatDelta run(const ChatParserOptions& o, const std::string& text,
              const std::vector<size_t>& cuts) {
  ChatParser p(o);
  ChatDelta all;
  size_t at = 0;
  for (size_t cut : cuts) {
    // (deltas are whole UTF-8 characters, as the incremental detokenizer gives them)
    while (cut < text.size() && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) ++cut;
    if (cut <= at || cut >= text.size()) continue;
    all.append(p.feed(std::string_view(text).substr(at, cut - at)));
    at = cut;
  }
  all.append(p.feed(std::string_view(text).substr(at)));
  all.append(p.finish());
  return all;
}

std::string calls_of(const ChatDelta& d) {
  std::string s;
  for (const auto& c : d.tool_calls)
    s += std::to_string(c.index) + "|" + c.name + "|" + c.arguments + "\n";
  for (int32_t f : d.failed_calls) s += "failed " + std::to_string(f) + "\n";
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const uint8_t mode = in.byte();
  ChatParserOptions o;
  o.reasoning = mode & 1;
  o.start = static_cast<ReasoningStart>((mode >> 1) % 3);
  o.tools_format = static_cast<ToolFormat>((mode >> 3) % 3);
  o.tools = tools();
  if (mode & 0x20) {
    o.prime = o.tools_format == ToolFormat::kQwen3Coder ? "<tool_call>\n<function=get_weather>\n"
                                                        : "<tool_call>\n{\"name\": \"f\", ";
  }
  std::vector<size_t> cuts;
  const size_t ncuts = in.byte() % 16;
  size_t at = 0;
  for (size_t i = 0; i < ncuts; ++i) cuts.push_back(at += 1 + in.byte() % 24);
  const std::string text(in.rest());
  try {
    const ChatDelta whole = run(o, text, {});
    const ChatDelta pieces = run(o, text, cuts);
    if (whole.reasoning != pieces.reasoning || whole.content != pieces.content ||
        calls_of(whole) != calls_of(pieces)) {
      std::abort();  // the split changed the result
    }
  } catch (const Error&) {
  }
  return 0;
}
