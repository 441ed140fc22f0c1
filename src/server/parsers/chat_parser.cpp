#include "server/parsers/chat_parser.h"

#include <algorithm>

#include "core/error.h"

namespace tandem::parsers {

namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";
constexpr size_t kMaxNameBytes = 256;

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

/// Length of the longest proper suffix of `s` that is a proper prefix of `tag`.
size_t partial_tag(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

/// `s` is a proper prefix of `tag` (more input could still complete it).
bool could_become(std::string_view s, std::string_view tag) {
  return s.size() < tag.size() && tag.substr(0, s.size()) == s;
}

std::string rstrip_ws(std::string_view s) {
  size_t n = s.size();
  while (n > 0 && is_ws(s[n - 1])) --n;
  return std::string(s.substr(0, n));
}

std::string strip_ws(std::string_view s) {
  size_t b = 0;
  while (b < s.size() && is_ws(s[b])) ++b;
  return rstrip_ws(s.substr(b));
}

size_t leading_ws(std::string_view s) {
  size_t n = 0;
  while (n < s.size() && is_ws(s[n])) ++n;
  return n;
}

}  // namespace

void ChatDelta::append(ChatDelta&& o) {
  reasoning += o.reasoning;
  content += o.content;
  for (ToolCallDelta& tc : o.tool_calls) {
    if (!tc.header && !tool_calls.empty() && tool_calls.back().index == tc.index) {
      tool_calls.back().arguments += tc.arguments;
    } else {
      tool_calls.push_back(std::move(tc));
    }
  }
  failed_calls.insert(failed_calls.end(), o.failed_calls.begin(), o.failed_calls.end());
}

// ---------------------------------------------------------------------------------------------
// Reasoning

ReasoningParser::ReasoningParser(ReasoningStart start)
    : state_(start == ReasoningStart::kAuto      ? State::kAuto
             : start == ReasoningStart::kInThink ? State::kThinkLead
                                                 : State::kContent) {}

void ReasoningParser::feed(std::string_view text, ChatDelta& out) {
  buf_ += text;
  run(out, /*final=*/false);
}

void ReasoningParser::finish(ChatDelta& out) { run(out, /*final=*/true); }

void ReasoningParser::run(ChatDelta& out, bool final) {
  while (true) {
    switch (state_) {
      case State::kAuto: {
        const size_t i = leading_ws(buf_);
        const std::string_view rest = std::string_view(buf_).substr(i);
        if (starts_with(rest, kThinkOpen)) {
          buf_.erase(0, i + kThinkOpen.size());
          state_ = State::kThinkLead;
          continue;
        }
        if (!final && could_become(rest, kThinkOpen)) return;  // whitespace or "<thi"
        state_ = State::kContent;
        continue;
      }
      case State::kThinkLead:
      case State::kContentLead: {
        buf_.erase(0, leading_ws(buf_));
        if (buf_.empty()) return;
        state_ = state_ == State::kThinkLead ? State::kThink : State::kContent;
        continue;
      }
      case State::kThink: {
        const size_t p = buf_.find(kThinkClose);
        if (p != std::string::npos) {
          out.reasoning += rstrip_ws(std::string_view(buf_).substr(0, p));
          buf_.erase(0, p + kThinkClose.size());
          state_ = State::kContentLead;
          continue;
        }
        if (final) {
          out.reasoning += rstrip_ws(buf_);
          buf_.clear();
          return;
        }
        // Hold a possible "</think>" prefix and the whitespace before it.
        size_t h = buf_.size() - partial_tag(buf_, kThinkClose);
        while (h > 0 && is_ws(buf_[h - 1])) --h;
        out.reasoning.append(buf_, 0, h);
        buf_.erase(0, h);
        return;
      }
      case State::kContent:
        out.content += buf_;
        buf_.clear();
        return;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tool calls

ToolCallParser::ToolCallParser(ToolFormat format, ojson tools)
    : format_(format), tools_(std::move(tools)) {}

void ToolCallParser::feed(std::string_view text, ChatDelta& out) {
  buf_ += text;
  run(out, /*final=*/false);
}

void ToolCallParser::finish(ChatDelta& out) { run(out, /*final=*/true); }

void ToolCallParser::begin_call(ChatDelta& out, const std::string& name) {
  ToolCallDelta d;
  d.index = next_index_++;
  d.header = true;
  d.name = name;
  out.tool_calls.push_back(std::move(d));
  call_started_ = true;
}

void ToolCallParser::args(ChatDelta& out, const std::string& text) {
  if (text.empty()) return;
  const int32_t index = next_index_ - 1;
  if (!out.tool_calls.empty() && out.tool_calls.back().index == index) {
    out.tool_calls.back().arguments += text;
  } else {
    ToolCallDelta d;
    d.index = index;
    d.arguments = text;
    out.tool_calls.push_back(std::move(d));
  }
}

void ToolCallParser::end_call() {
  raw_.clear();
  call_started_ = false;
  json_ = JsonScanner();
  json_text_.clear();
  key_.clear();
  name_.clear();
  have_name_ = have_args_ = streaming_args_ = args_is_string_ = false;
  args_raw_.clear();
  function_.clear();
  param_.clear();
  param_type_.clear();
  value_.clear();
  value_started_ = false;
  num_params_ = 0;
}

void ToolCallParser::fail_call(ChatDelta& out) {
  out.content += raw_;
  if (call_started_) out.failed_calls.push_back(next_index_ - 1);
  end_call();
  state_ = State::kText;
  after_call_ = false;
}

const ojson* ToolCallParser::param_schema(const std::string& param) const {
  if (!tools_.is_array()) return nullptr;
  for (const ojson& t : tools_) {
    const ojson* fn = t.contains("function") ? &t["function"] : nullptr;
    if (!fn || !fn->is_object() || fn->value("name", ojson()) != ojson(function_)) continue;
    if (!fn->contains("parameters")) return nullptr;
    const ojson& params = (*fn)["parameters"];
    if (!params.is_object() || !params.contains("properties")) return nullptr;
    const ojson& props = params["properties"];
    if (!props.is_object() || !props.contains(param) || !props[param].is_object()) return nullptr;
    return &props[param];
  }
  return nullptr;
}

bool ToolCallParser::trims_string(const std::string& param) const {
  const ojson* p = param_schema(param);
  if (!p) return false;
  for (const char* k : {"enum", "const", "pattern", "format", "minLength", "maxLength"}) {
    if (p->contains(k)) return true;
  }
  return false;
}

std::string ToolCallParser::param_type(const std::string& param) const {
  const ojson* ps = param_schema(param);
  if (!ps) return "string";
  const ojson& p = *ps;
  auto type_of = [](const ojson& s) -> std::string {
    if (!s.is_object() || !s.contains("type")) return "";
    const ojson& ty = s["type"];
    if (ty.is_string()) return ty.get<std::string>();
    if (ty.is_array()) {
      for (const ojson& x : ty) {
        if (x.is_string() && x != "null") return x.get<std::string>();
      }
    }
    return "";
  };
  std::string ty = type_of(p);
  for (const char* alt : {"anyOf", "oneOf"}) {
    if (!ty.empty()) break;
    if (p.contains(alt) && p[alt].is_array()) {
      for (const ojson& s : p[alt]) {
        ty = type_of(s);
        if (!ty.empty() && ty != "null") break;
        ty.clear();
      }
    }
  }
  return ty.empty() ? "string" : ty;
}

std::string ToolCallParser::typed_value(const std::string& raw, const std::string& type) const {
  const std::string v = strip_ws(raw);
  const std::string as_string = "\"" + json_escape(raw) + "\"";
  if (type == "boolean") {
    std::string lower = v;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    return lower == "true" || lower == "false" ? lower : as_string;
  }
  if (type == "null") return v == "null" || v == "None" ? "null" : as_string;
  ojson j = ojson::parse(v, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return as_string;
  if (type == "integer") return j.is_number_integer() || j.is_number_unsigned() ? v : as_string;
  if (type == "number") return j.is_number() ? v : as_string;
  if (type == "object" && j.is_object())
    return j.dump(-1, ' ', false, ojson::error_handler_t::replace);
  if (type == "array" && j.is_array())
    return j.dump(-1, ' ', false, ojson::error_handler_t::replace);
  return as_string;
}

bool ToolCallParser::step_json(ChatDelta& out, char c) {
  json_text_ += c;
  const size_t pos = json_text_.size() - 1;
  const JsonScanner::Step s = json_.push(c);
  if (s.status == JsonScanner::Status::kError) return false;
  if (s.value_ended_before && key_ == "name") return false;  // a number as the name
  if (s.key_begin) key_begin_ = pos;
  // NOTE: the scanner checked the syntax; parse() can still refuse ill-formed UTF-8.
  auto parse = [](const std::string& text) {
    return ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  };
  if (s.key_end) {
    const ojson k = parse(json_text_.substr(key_begin_, pos - key_begin_ + 1));
    if (!k.is_string()) return false;
    key_ = k.get<std::string>();
  }
  const bool is_args = key_ == "arguments" || key_ == "parameters";
  if (s.value_begin) {
    value_begin_ = pos;
    if (is_args) {
      if (have_args_) return false;  // twice
      if (c == '{') {
        if (have_name_) {
          begin_call(out, name_);
          streaming_args_ = true;
        }
      } else if (c == '"') {
        args_is_string_ = true;
      } else {
        return false;  // arguments must be an object (or a JSON string of one)
      }
    }
  }
  if (streaming_args_) {
    args(out, std::string(1, c));
  } else if (is_args && !have_args_ && (s.value_begin || !args_raw_.empty())) {
    args_raw_ += c;
  }
  if (s.value_end) {
    if (key_ == "name") {
      if (have_name_) return false;
      const ojson n = parse(json_text_.substr(value_begin_, pos - value_begin_ + 1));
      if (!n.is_string() || n.get<std::string>().empty()) return false;
      name_ = n.get<std::string>();
      have_name_ = true;
    } else if (is_args) {
      have_args_ = true;
      streaming_args_ = false;
    }
  }
  if (s.status == JsonScanner::Status::kDone) {
    if (!have_name_) return false;
    if (!call_started_) {
      begin_call(out, name_);
      std::string a = have_args_ ? args_raw_ : "{}";
      if (args_is_string_) {
        const ojson decoded = parse(a);
        if (!decoded.is_string()) return false;
        a = decoded.get<std::string>();
      }
      args(out, a);
    }
    state_ = State::kClose;
  }
  return true;
}

void ToolCallParser::run(ChatDelta& out, bool final) {
  auto take = [&](size_t n) {
    raw_.append(buf_, 0, n);
    buf_.erase(0, n);
  };
  const bool hermes = format_ == ToolFormat::kHermes;
  while (true) {
    switch (state_) {
      case State::kText: {
        if (after_call_) {
          buf_.erase(0, leading_ws(buf_));
          if (buf_.empty()) return;
          after_call_ = false;
        }
        const size_t p = buf_.find(kCallOpen);
        if (p != std::string::npos) {
          std::string before = rstrip_ws(std::string_view(buf_).substr(0, p));
          out.content += before;
          buf_.erase(0, before.size());
          take(buf_.find(kCallOpen) + kCallOpen.size());  // the whitespace comes back on failure
          state_ = State::kOpen;
          continue;
        }
        if (final) {
          out.content += buf_;
          buf_.clear();
          return;
        }
        size_t h = buf_.size() - partial_tag(buf_, kCallOpen);
        while (h > 0 && is_ws(buf_[h - 1])) --h;
        out.content.append(buf_, 0, h);
        buf_.erase(0, h);
        return;
      }

      case State::kOpen: {
        take(leading_ws(buf_));
        if (buf_.empty()) {
          if (!final) return;
          fail_call(out);
          continue;
        }
        if (hermes) {
          if (buf_[0] != '{') {
            fail_call(out);
            continue;
          }
          state_ = State::kJson;
          continue;
        }
        if (starts_with(buf_, kFunctionOpen)) {
          take(kFunctionOpen.size());
          state_ = State::kFuncName;
          continue;
        }
        if (!final && could_become(buf_, kFunctionOpen)) return;
        fail_call(out);
        continue;
      }

      case State::kJson: {
        size_t i = 0;
        bool ok = true;
        while (i < buf_.size() && state_ == State::kJson) {
          const char c = buf_[i++];
          raw_ += c;
          if (!step_json(out, c)) {
            ok = false;
            break;
          }
        }
        buf_.erase(0, i);
        if (!ok) {
          fail_call(out);
          continue;
        }
        if (state_ == State::kJson) {
          if (!final) return;
          fail_call(out);  // the reply ended inside the JSON
        }
        continue;
      }

      case State::kFuncName:
      case State::kParamName: {
        const size_t q = buf_.find('>');
        const size_t nl = buf_.find('\n');
        if (q == std::string::npos || (nl != std::string::npos && nl < q) || q > kMaxNameBytes) {
          if (!final && q == std::string::npos && nl == std::string::npos &&
              buf_.size() <= kMaxNameBytes) {
            return;
          }
          fail_call(out);
          continue;
        }
        const std::string name = strip_ws(std::string_view(buf_).substr(0, q));
        take(q + 1);
        if (name.empty()) {
          fail_call(out);
          continue;
        }
        if (state_ == State::kFuncName) {
          function_ = name;
          begin_call(out, function_);
          state_ = State::kFuncBody;
        } else {
          param_ = name;
          param_type_ = param_type(param_);
          trim_value_ = param_type_ == "string" && trims_string(param_);
          std::string head = num_params_ == 0 ? "{" : ", ";
          head += "\"" + json_escape(param_) + "\": ";
          if (param_type_ == "string") head += "\"";
          args(out, head);
          ++num_params_;
          value_.clear();
          value_started_ = false;
          state_ = State::kParamValue;
        }
        continue;
      }

      case State::kFuncBody: {
        take(leading_ws(buf_));
        if (starts_with(buf_, kParamOpen)) {
          take(kParamOpen.size());
          state_ = State::kParamName;
          continue;
        }
        if (starts_with(buf_, kFunctionClose)) {
          take(kFunctionClose.size());
          args(out, num_params_ == 0 ? "{}" : "}");
          state_ = State::kClose;
          continue;
        }
        if (!final && (could_become(buf_, kParamOpen) || could_become(buf_, kFunctionClose))) {
          return;
        }
        fail_call(out);
        continue;
      }

      case State::kParamValue: {
        const bool is_string = param_type_ == "string";
        if (!value_started_) {
          if (trim_value_) take(leading_ws(buf_));
          if (buf_.empty()) {
            if (!final) return;
            fail_call(out);
            continue;
          }
          if (buf_[0] == '\n') take(1);  // one newline after the tag is layout
          value_started_ = true;
        }
        const size_t p = buf_.find(kParamClose);
        if (p != std::string::npos) {
          std::string v = buf_.substr(0, p);
          if (trim_value_) {
            while (!v.empty() && is_ws(v.back())) v.pop_back();
          } else if (!v.empty() && v.back() == '\n') {
            v.pop_back();  // and one before the closing tag
          }
          take(p + kParamClose.size());
          if (is_string) {
            args(out, json_escape(v) + "\"");
          } else {
            value_ += v;
            args(out, typed_value(value_, param_type_));
          }
          state_ = State::kFuncBody;
          continue;
        }
        if (final) {
          fail_call(out);
          continue;
        }
        size_t h = buf_.size() - partial_tag(buf_, kParamClose);
        if (trim_value_) {
          while (h > 0 && is_ws(buf_[h - 1])) --h;  // trailing whitespace may be layout
        } else if (h > 0 && buf_[h - 1] == '\n') {
          --h;
        }
        const std::string piece = buf_.substr(0, h);
        take(h);
        if (is_string) {
          args(out, json_escape(piece));
        } else {
          value_ += piece;
        }
        return;
      }

      case State::kClose: {
        take(leading_ws(buf_));
        if (starts_with(buf_, kCallClose)) {
          take(kCallClose.size());
          end_call();
          state_ = State::kText;
          after_call_ = true;
          continue;
        }
        if (buf_.empty() || (!final && could_become(buf_, kCallClose))) {
          if (!final) return;
          end_call();  // the reply ended after a complete call: accepted
          state_ = State::kText;
          after_call_ = true;
          continue;
        }
        fail_call(out);
        continue;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------

ChatParser::ChatParser(ChatParserOptions options) : options_(std::move(options)) {
  if (options_.reasoning) reasoning_ = std::make_unique<ReasoningParser>(options_.start);
  if (options_.tools_format != ToolFormat::kNone) {
    tools_ = std::make_unique<ToolCallParser>(options_.tools_format, options_.tools);
    if (!options_.prime.empty()) tools_->feed(options_.prime, primed_);
  }
}

ChatDelta ChatParser::feed(std::string_view text) {
  ChatDelta r;
  if (!primed_sent_) {
    primed_sent_ = true;
    r = std::move(primed_);
  }
  std::string content;
  if (reasoning_) {
    ChatDelta tmp;
    reasoning_->feed(text, tmp);
    r.reasoning = std::move(tmp.reasoning);
    content = std::move(tmp.content);
  } else {
    content = std::string(text);
  }
  if (tools_) {
    tools_->feed(content, r);
  } else {
    r.content += content;
  }
  return r;
}

ChatDelta ChatParser::finish() {
  ChatDelta r;
  if (!primed_sent_) {
    primed_sent_ = true;
    r = std::move(primed_);
  }
  std::string content;
  if (reasoning_) {
    ChatDelta tmp;
    reasoning_->finish(tmp);
    r.reasoning = std::move(tmp.reasoning);
    content = std::move(tmp.content);
  }
  if (tools_) {
    tools_->feed(content, r);
    tools_->finish(r);
  } else {
    r.content += content;
  }
  return r;
}

ReasoningStart reasoning_start_for_prompt(std::string_view prompt, bool thinking_disabled) {
  if (thinking_disabled) return ReasoningStart::kContent;
  const size_t open = prompt.rfind(kThinkOpen);
  const size_t close = prompt.rfind(kThinkClose);
  if (open != std::string_view::npos && (close == std::string_view::npos || open > close)) {
    return ReasoningStart::kInThink;
  }
  if (close != std::string_view::npos && leading_ws(prompt.substr(close + kThinkClose.size())) ==
                                             prompt.size() - close - kThinkClose.size()) {
    return ReasoningStart::kContent;  // the template closed an (empty) think block
  }
  return ReasoningStart::kAuto;
}

ToolFormat parse_tool_format(const std::string& name) {
  if (name == "hermes") return ToolFormat::kHermes;
  if (name == "qwen3_coder" || name == "qwen3_xml") return ToolFormat::kQwen3Coder;
  if (name == "none") return ToolFormat::kNone;
  TANDEM_THROW(kInvalidArgument, "unknown tool-call parser '", name,
               "' (expected hermes, qwen3_coder or none)");
}

ToolFormat tool_format_for_model_type(const std::string& model_type) {
  if (model_type.rfind("qwen3_5", 0) == 0 || model_type.rfind("qwen3_next", 0) == 0) {
    return ToolFormat::kQwen3Coder;
  }
  return ToolFormat::kHermes;
}

}  // namespace tandem::parsers
