// Parsing of chat replies as they stream: Qwen3's <think>...</think> reasoning and tool calls
// (Hermes-style JSON or Qwen3-Coder / Qwen3.5 XML) split out of the text.
//
// Each parser is fed text deltas (whole UTF-8 characters, as the incremental detokenizer
// gives them) and returns what became certain: reasoning, content, tool-call deltas. It holds
// back only what might still turn out to be a tag (or whitespace that a tag would drop), and
// its decisions depend on the text alone, never on where the deltas split it: feeding a reply
// in any pieces and concatenating the outputs gives what feeding it whole gives.
//
//   ChatParser p(options);
//   ChatDelta d = p.feed(text_delta);   // per detokenised delta
//   ChatDelta e = p.finish();           // at the end of the reply
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "server/parsers/json_scanner.h"

namespace tandem::parsers {

/// What the reply starts in, known from the rendered prompt.
enum class ReasoningStart {
  kAuto,     // a reply that opens with <think> reasons until </think>; otherwise content
  kInThink,  // the prompt opened <think> (e.g. Qwen3.5's template): reasoning until </think>
  kContent,  // the prompt closed the think block or thinking is off: all content
};

enum class ToolFormat {
  kNone,
  kHermes,      // <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen3)
  kQwen3Coder,  // <tool_call><function=NAME><parameter=P>v</parameter></function></tool_call>
};

/// A piece of one tool call. The first delta of call `index` carries the name (header);
/// later ones carry argument text. Concatenating a call's `arguments` gives its JSON text.
struct ToolCallDelta {
  int32_t index = 0;
  bool header = false;  // first delta of the call: `name` is set
  std::string name;
  std::string arguments;
};

struct ChatDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  /// Calls whose header was already given but that turned out malformed (or were cut off):
  /// their whole text is in `content` of this delta. A non-streamed reply drops them.
  std::vector<int32_t> failed_calls;

  bool empty() const {
    return reasoning.empty() && content.empty() && tool_calls.empty() && failed_calls.empty();
  }
  /// Appends `o` (merging argument fragments of the same call).
  void append(ChatDelta&& o);
};

/// Splits <think>...</think> off the text. Leading whitespace of the reasoning and of the
/// content after </think>, and trailing whitespace before </think>, are dropped (what is left
/// of an empty think block is nothing). A reply with no </think> is all reasoning.
class ReasoningParser {
 public:
  explicit ReasoningParser(ReasoningStart start);
  /// Appends to out.reasoning / out.content.
  void feed(std::string_view text, ChatDelta& out);
  void finish(ChatDelta& out);

 private:
  enum class State { kAuto, kThinkLead, kThink, kContentLead, kContent };
  void run(ChatDelta& out, bool final);

  State state_;
  std::string buf_;
};

/// Finds tool calls in content text. Text outside calls is content (whitespace around calls
/// is dropped). A call whose syntax breaks, or that the reply leaves unfinished, is returned as
/// content: before its header was given as plain content, after it via failed_calls.
class ToolCallParser {
 public:
  /// tools: the request's tool list (for the XML form's parameter types; may be null).
  ToolCallParser(ToolFormat format, nlohmann::ordered_json tools);
  void feed(std::string_view text, ChatDelta& out);
  void finish(ChatDelta& out);
  /// Calls whose header has been given (including failed ones).
  int32_t num_calls() const { return next_index_; }

 private:
  enum class State {
    kText,        // content, looking for <tool_call>
    kOpen,        // after <tool_call>: whitespace, then '{' (Hermes) or <function= (XML)
    kJson,        // Hermes: the call's JSON object
    kFuncName,    // XML: the function name up to '>'
    kFuncBody,    // XML: whitespace, then <parameter= or </function>
    kParamName,   // XML: the parameter name up to '>'
    kParamValue,  // XML: the value up to </parameter>
    kClose,       // whitespace, then </tool_call> (the reply may also end here)
  };

  void run(ChatDelta& out, bool final);
  /// The call so far turns out malformed: its text becomes content.
  void fail_call(ChatDelta& out);
  void begin_call(ChatDelta& out, const std::string& name);
  void end_call();
  void args(ChatDelta& out, const std::string& text);
  bool step_json(ChatDelta& out, char c);
  void finish_hermes_json(ChatDelta& out);
  /// The current function's schema of a parameter (null: unknown).
  const nlohmann::ordered_json* param_schema(const std::string& param) const;
  std::string param_type(const std::string& param) const;
  /// A string parameter with enum / const / pattern / format / length bounds: whitespace
  /// around its value is layout (grammars put it there: xgrammar's qwen_xml), so it is
  /// dropped; a free string keeps all but one newline after the tag and one before the end.
  bool trims_string(const std::string& param) const;
  std::string typed_value(const std::string& raw, const std::string& type) const;

  ToolFormat format_;
  nlohmann::ordered_json tools_;
  State state_ = State::kText;
  std::string buf_;          // unconsumed input
  std::string raw_;          // the current call's text from <tool_call> (for failures)
  bool after_call_ = false;  // strip whitespace before more content
  int32_t next_index_ = 0;
  bool call_started_ = false;  // the current call's header was given
  // Hermes
  JsonScanner json_;
  std::string json_text_;
  size_t key_begin_ = 0;
  std::string key_;
  size_t value_begin_ = 0;
  std::string name_;
  bool have_name_ = false;
  bool have_args_ = false;
  bool streaming_args_ = false;
  std::string args_raw_;  // Hermes arguments held until the object ends (name after them)
  bool args_is_string_ = false;
  // XML
  std::string function_;
  std::string param_;
  std::string param_type_;
  std::string value_;  // a non-string value held until </parameter>
  bool value_started_ = false;
  bool trim_value_ = false;  // trims_string(param_)
  int32_t num_params_ = 0;
};

struct ChatParserOptions {
  bool reasoning = false;  // split <think> (the qwen3 reasoning parser)
  ReasoningStart start = ReasoningStart::kAuto;
  ToolFormat tools_format = ToolFormat::kNone;  // kNone: no tool parsing
  nlohmann::ordered_json tools;
  /// Tool-call text the prompt already ends with (tool_choice "required" / named: the reply
  /// starts inside a call); the parser starts after it.
  std::string prime;
};

/// Reasoning first, then tool calls in the content (a <tool_call> in the think block stays
/// reasoning).
class ChatParser {
 public:
  explicit ChatParser(ChatParserOptions options);
  ChatDelta feed(std::string_view text);
  ChatDelta finish();
  int32_t num_calls() const { return tools_ ? tools_->num_calls() : 0; }

 private:
  ChatParserOptions options_;
  std::unique_ptr<ReasoningParser> reasoning_;
  std::unique_ptr<ToolCallParser> tools_;
  ChatDelta primed_;  // what the prime gave (a named call's header): out with the first delta
  bool primed_sent_ = false;
};

/// The reasoning start a rendered prompt implies (the text after its last </think> or
/// <think>); thinking_disabled: chat_template_kwargs enable_thinking is false.
ReasoningStart reasoning_start_for_prompt(std::string_view prompt, bool thinking_disabled);

/// Parses a --tool-call-parser / --reasoning-parser value; throws Error(kInvalidArgument).
ToolFormat parse_tool_format(const std::string& name);
/// The tool-call format of a model family (config.json model_type).
ToolFormat tool_format_for_model_type(const std::string& model_type);

}  // namespace tandem::parsers
