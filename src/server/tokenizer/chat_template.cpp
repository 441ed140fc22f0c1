#include "server/tokenizer/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "server/tokenizer/jinja_value.h"

namespace tandem {
namespace {

constexpr std::string_view kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";
constexpr const char* kReasoningFields[] = {"reasoning_content", "thinking", "reasoning"};

std::optional<std::string> read_text(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK_KIND(kIo, in.good(), path.string(), ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  return std::move(ss).str();
}

// True when `j` nests at most `max_depth` levels (checked iteratively: copying or converting
// a deeper value would recurse too deep).
bool depth_at_most(const nlohmann::ordered_json& j, int max_depth) {
  std::vector<std::pair<const nlohmann::ordered_json*, int>> stack{{&j, 0}};
  while (!stack.empty()) {
    const auto [node, depth] = stack.back();
    stack.pop_back();
    if (!node->is_structured()) continue;
    if (depth >= max_depth) return false;
    for (const auto& child : *node) stack.emplace_back(&child, depth + 1);
  }
  return true;
}

// transformers' _normalize_chat_messages + _alias_reasoning_fields for one message.
nlohmann::ordered_json normalize_message(const nlohmann::ordered_json& message, size_t index) {
  TANDEM_CHECK_KIND(kInvalidArgument, message.is_object(),
                    "chat messages must be objects, message ", index, " is ", message.type_name());
  nlohmann::ordered_json m = nlohmann::ordered_json::object();
  for (auto it = message.begin(); it != message.end(); ++it) {
    if (!it.value().is_null()) m[it.key()] = it.value();
  }
  const nlohmann::ordered_json* reasoning = nullptr;
  for (const char* key : kReasoningFields) {
    auto it = m.find(key);
    if (it != m.end()) {
      reasoning = &*it;
      break;
    }
  }
  if (reasoning == nullptr) return m;
  // {"thinking": reasoning, **message, "reasoning_content": reasoning}
  const nlohmann::ordered_json value = *reasoning;
  nlohmann::ordered_json aliased = nlohmann::ordered_json::object();
  aliased["thinking"] = value;
  for (auto it = m.begin(); it != m.end(); ++it) aliased[it.key()] = it.value();
  aliased["reasoning_content"] = value;
  return aliased;
}

std::string rstrip_ascii_space(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\n' || s.back() == '\t' ||
                        s.back() == '\r' || s.back() == '\f' || s.back() == '\v')) {
    s.pop_back();
  }
  return s;
}

std::string strip_ascii_space(const std::string& s) {
  size_t b = 0;
  while (b < s.size() && std::string_view(" \n\t\r\f\v").find(s[b]) != std::string_view::npos) ++b;
  return rstrip_ascii_space(s.substr(b));
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source)
    : source_(std::make_shared<const std::string>(source)), template_(source) {}

std::unique_ptr<ChatTemplate> ChatTemplate::from_dir(const std::string& dir) {
  const std::filesystem::path root(dir);
  if (std::optional<std::string> jinja = read_text(root / "chat_template.jinja")) {
    return std::make_unique<ChatTemplate>(*jinja);
  }
  const std::filesystem::path config_path = root / "tokenizer_config.json";
  std::optional<std::string> text = read_text(config_path);
  if (!text) return nullptr;
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(*text);
  } catch (const nlohmann::json::exception& e) {
    TANDEM_THROW(kIo, config_path.string(), ": malformed JSON: ", e.what());
  }
  auto it = config.find("chat_template");
  if (!config.is_object() || it == config.end() || it->is_null()) return nullptr;
  if (it->is_string()) return std::make_unique<ChatTemplate>(it->get<std::string>());
  TANDEM_CHECK_KIND(kInvalidArgument, it->is_array(), config_path.string(),
                    ": chat_template: expected a string or a list of {name, template}");
  for (const auto& entry : *it) {
    if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
        entry["template"].is_string()) {
      return std::make_unique<ChatTemplate>(entry["template"].get<std::string>());
    }
  }
  return nullptr;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  return template_.render(context);
}

std::string ChatTemplate::render(const nlohmann::json& context) const {
  return template_.render(nlohmann::ordered_json::parse(context.dump()));
}

std::string ChatTemplate::apply(const ChatTemplateInputs& inputs) const {
  TANDEM_CHECK_KIND(kInvalidArgument, inputs.messages.is_array(), "chat messages must be a list");
  TANDEM_CHECK_KIND(kInvalidArgument, !inputs.messages.empty(),
                    "cannot apply the chat template to an empty conversation");
  TANDEM_CHECK_KIND(kInvalidArgument, inputs.tools.is_null() || inputs.tools.is_array(),
                    "tools must be a list of JSON schemas");
  TANDEM_CHECK_KIND(kInvalidArgument, inputs.documents.is_null() || inputs.documents.is_array(),
                    "documents must be a list");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    inputs.special_tokens.is_object() && inputs.kwargs.is_object(),
                    "special_tokens and kwargs must be JSON objects");
  for (const auto* part : {&inputs.messages, &inputs.tools, &inputs.documents, &inputs.kwargs}) {
    TANDEM_CHECK_KIND(kInvalidArgument, depth_at_most(*part, jinja::Value::kMaxJsonDepth),
                      "chat template inputs are nested too deeply");
  }
  const bool continue_final = !inputs.continue_final_message.empty();
  TANDEM_CHECK_KIND(kInvalidArgument, !(continue_final && inputs.add_generation_prompt),
                    "continue_final_message and add_generation_prompt are not compatible");

  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  for (size_t i = 0; i < inputs.messages.size(); ++i) {
    messages.push_back(normalize_message(inputs.messages[i], i));
  }

  std::string final_text;
  if (continue_final) {
    const std::string& field = inputs.continue_final_message;
    nlohmann::ordered_json& last = messages.back();
    auto it = last.find(field);
    TANDEM_CHECK_KIND(kInvalidArgument, it != last.end(),
                      "continue_final_message is set but the final message has no \"", field,
                      "\" to continue");
    std::vector<std::string> fields{field};
    bool is_reasoning = false;
    for (const char* r : kReasoningFields) is_reasoning = is_reasoning || field == r;
    if (is_reasoning) {
      fields.clear();
      for (const char* r : kReasoningFields) {
        if (last.contains(r) && last[r] == *it) fields.emplace_back(r);
      }
    }
    bool mentioned = false;
    for (const std::string& f : fields)
      mentioned = mentioned || source_->find(f) != std::string::npos;
    TANDEM_CHECK_KIND(kInvalidArgument, mentioned, "continue_final_message is set to \"", field,
                      "\" but this is not an accepted field in the chat_template");
    if (it->is_array()) {
      bool found = false;
      for (auto block = it->rbegin(); block != it->rend() && !found; ++block) {
        if (block->is_object() && block->contains("text") && (*block)["text"].is_string()) {
          final_text = (*block)["text"].get<std::string>();
          (*block)["text"] = final_text + std::string(kContinueTag);
          found = true;
        }
      }
      TANDEM_CHECK_KIND(kInvalidArgument, found,
                        "continue_final_message is set but we could not find any text to continue "
                        "in the final message");
    } else {
      TANDEM_CHECK_KIND(kInvalidArgument, it->is_string(), "continue_final_message: field \"",
                        field, "\" must be a string or a list of content blocks");
      final_text = it->get<std::string>();
      for (const std::string& f : fields) last[f] = final_text + std::string(kContinueTag);
    }
  }

  nlohmann::ordered_json context = nlohmann::ordered_json::object();
  context["messages"] = std::move(messages);
  context["tools"] = inputs.tools;
  context["documents"] = inputs.documents;
  context["add_generation_prompt"] = inputs.add_generation_prompt;
  for (const auto* extra : {&inputs.special_tokens, &inputs.kwargs}) {
    for (auto it = extra->begin(); it != extra->end(); ++it) {
      TANDEM_CHECK_KIND(kInvalidArgument,
                        it.key() != "messages" && it.key() != "tools" && it.key() != "documents" &&
                            it.key() != "add_generation_prompt",
                        "chat template kwargs cannot override '", it.key(), "'");
      context[it.key()] = it.value();
    }
  }
  std::string rendered = template_.render(context);

  if (continue_final) {
    const std::string tag = strip_ascii_space(std::string(kContinueTag));
    TANDEM_CHECK_KIND(kInvalidArgument,
                      rendered.find(strip_ascii_space(final_text)) != std::string::npos &&
                          rendered.find(tag) != std::string::npos,
                      "continue_final_message is set but the final message does not appear in the "
                      "chat after applying the chat template");
    const size_t at = rendered.rfind(tag);
    if (rendered.compare(at, kContinueTag.size(), kContinueTag) == 0) {
      rendered.resize(at);
    } else {
      rendered = rstrip_ascii_space(rendered.substr(0, at));
    }
  }
  return rendered;
}

}  // namespace tandem
