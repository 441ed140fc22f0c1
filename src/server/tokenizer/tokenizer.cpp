#include "server/tokenizer/tokenizer.h"

#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "server/tokenizer/bpe.h"
#include "server/tokenizer/pre_tokenizer.h"
#include "server/tokenizer/utf8.h"

namespace tandem {
namespace {

constexpr uint8_t kPresent = 1;
constexpr uint8_t kSpecial = 2;
constexpr uint8_t kAdded = 4;

// Reads a whole file; nullopt when it does not exist.
std::optional<std::string> read_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK_KIND(kIo, in.good(), path.string(), ": cannot open file");
  std::ostringstream ss;
  ss << in.rdbuf();
  TANDEM_CHECK_KIND(kIo, !in.bad(), path.string(), ": read failed");
  return std::move(ss).str();
}

nlohmann::json parse_json(std::string_view text, const std::string& where) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TANDEM_THROW(kIo, where, ": malformed JSON: ", e.what());
  }
}

// A special-token field of tokenizer_config.json: a string, {"content": ...}, or null.
std::optional<std::string> token_field(const nlohmann::json& config, const char* key,
                                       const std::string& where) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  TANDEM_THROW(kInvalidArgument, where, ": field '", key,
               "' must be a string, an object with a string 'content', or null");
}

bool added_flag(const nlohmann::json& token, const char* key, const std::string& where) {
  auto it = token.find(key);
  if (it == token.end() || it->is_null()) return false;
  TANDEM_CHECK_KIND(kInvalidArgument, it->is_boolean(), where, ".", key, ": expected a boolean");
  return it->get<bool>();
}

// Bytes that HF's ByteLevel decoder produces for one token: each character mapped back to
// its byte, or the token's own UTF-8 when some character is not a byte character.
std::string byte_level_decode(std::string_view token) {
  std::string bytes;
  bytes.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    const int b = byte_level_byte(utf8::next(token, &pos));
    if (b < 0) return std::string(token);
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

}  // namespace

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::from_dir(const std::string& dir) {
  const std::filesystem::path root(dir);
  const std::filesystem::path json_path = root / "tokenizer.json";
  std::optional<std::string> json_text = read_file(json_path);
  if (!json_text) return nullptr;
  const std::filesystem::path config_path = root / "tokenizer_config.json";
  const std::optional<std::string> config_text = read_file(config_path);

  std::unique_ptr<Tokenizer> tok = from_json(*json_text, {}, json_path.string());
  json_text.reset();
  if (config_text)
    tok->load_config(parse_json(*config_text, config_path.string()), config_path.string());
  const std::filesystem::path jinja_path = root / "chat_template.jinja";
  if (std::optional<std::string> jinja = read_file(jinja_path))
    tok->chat_template_ = std::move(*jinja);
  return tok;
}

std::unique_ptr<Tokenizer> Tokenizer::from_json(std::string_view tokenizer_json,
                                                std::string_view tokenizer_config_json,
                                                const std::string& source) {
  const nlohmann::json j = parse_json(tokenizer_json, source);
  TANDEM_CHECK_KIND(kInvalidArgument, j.is_object(), source, ": expected a JSON object");
  std::unique_ptr<Tokenizer> tok(new Tokenizer());

  auto get = [&](const char* key) -> const nlohmann::json& {
    static const nlohmann::json null_json;
    auto it = j.find(key);
    return it == j.end() ? null_json : *it;
  };
  tok->normalizer_ = Normalizer::from_json(get("normalizer"), source + ": normalizer");
  tok->pre_tokenizer_ = PreTokenizer::from_json(get("pre_tokenizer"), source + ": pre_tokenizer");
  TANDEM_CHECK_KIND(kUnsupported, tok->pre_tokenizer_->has_byte_level(), source,
                    ": pre_tokenizer: only byte-level BPE is supported (no ByteLevel step found)");
  const nlohmann::json& decoder = get("decoder");
  bool byte_level_decoder = decoder.is_object() && decoder.value("type", "") == "ByteLevel";
  if (decoder.is_object() && decoder.value("type", "") == "Sequence") {
    auto list = decoder.find("decoders");
    byte_level_decoder = list != decoder.end() && list->is_array() && list->size() == 1 &&
                         (*list)[0].is_object() && (*list)[0].value("type", "") == "ByteLevel";
  }
  TANDEM_CHECK_KIND(kUnsupported, byte_level_decoder, source,
                    ": decoder: only the ByteLevel decoder is supported, got ", decoder.dump());
  TANDEM_CHECK_KIND(kInvalidArgument, j.contains("model"), source, ": missing field 'model'");
  tok->model_ = BpeModel::from_json(j["model"], source);

  std::vector<AddedToken> added;
  const nlohmann::json& added_json = get("added_tokens");
  if (!added_json.is_null()) {
    TANDEM_CHECK_KIND(kInvalidArgument, added_json.is_array(), source,
                      ": added_tokens: expected an array");
    for (size_t i = 0; i < added_json.size(); ++i) {
      const std::string at = source + ": added_tokens[" + std::to_string(i) + "]";
      const nlohmann::json& t = added_json[i];
      TANDEM_CHECK_KIND(kInvalidArgument, t.is_object(), at, ": expected an object");
      auto id = t.find("id");
      TANDEM_CHECK_KIND(kInvalidArgument, id != t.end() && id->is_number_integer(), at,
                        ".id: expected an integer");
      TANDEM_CHECK_KIND(kInvalidArgument, id->get<int64_t>() >= 0 && id->get<int64_t>() < (1 << 30),
                        at, ".id: out of range");
      auto content = t.find("content");
      TANDEM_CHECK_KIND(kInvalidArgument, content != t.end() && content->is_string(), at,
                        ".content: expected a string");
      AddedToken token;
      token.id = static_cast<int32_t>(id->get<int64_t>());
      token.content = content->get<std::string>();
      token.special = added_flag(t, "special", at);
      token.single_word = added_flag(t, "single_word", at);
      token.lstrip = added_flag(t, "lstrip", at);
      token.rstrip = added_flag(t, "rstrip", at);
      token.normalized = added_flag(t, "normalized", at);
      added.push_back(std::move(token));
    }
  }

  int64_t size = tok->model_->id_limit();
  for (const AddedToken& t : added) size = std::max<int64_t>(size, int64_t{t.id} + 1);
  tok->token_bytes_.resize(static_cast<size_t>(size));
  tok->flags_.assign(static_cast<size_t>(size), 0);
  for (int64_t id = 0; id < tok->model_->id_limit(); ++id) {
    const std::string& token = tok->model_->id_to_token(static_cast<int32_t>(id));
    if (token.empty()) continue;
    tok->token_bytes_[id] = byte_level_decode(token);
    tok->flags_[id] = kPresent;
  }
  for (const AddedToken& t : added) {
    // NOTE: like HF, a normalized added token decodes to its normalized content.
    tok->token_bytes_[t.id] = byte_level_decode(
        t.normalized ? tok->normalizer_->normalize(utf8::sanitize(t.content)) : t.content);
    tok->flags_[t.id] = kPresent | kAdded | (t.special ? kSpecial : 0);
  }
  tok->added_ = std::make_unique<AddedVocabulary>(std::move(added), *tok->normalizer_);

  if (!tokenizer_config_json.empty()) {
    tok->load_config(parse_json(tokenizer_config_json, "tokenizer_config.json"),
                     "tokenizer_config.json");
  }
  return tok;
}

void Tokenizer::load_config(const nlohmann::json& config, const std::string& where) {
  TANDEM_CHECK_KIND(kInvalidArgument, config.is_object(), where, ": expected a JSON object");
  bos_token_ = token_field(config, "bos_token", where);
  eos_token_ = token_field(config, "eos_token", where);
  pad_token_ = token_field(config, "pad_token", where);
  unk_token_ = token_field(config, "unk_token", where);
  if (auto it = config.find("model_max_length"); it != config.end() && it->is_number()) {
    const double v = it->get<double>();
    if (v < 9.2e18) model_max_length_ = static_cast<int64_t>(v);
  }
  auto tmpl = config.find("chat_template");
  if (tmpl == config.end() || tmpl->is_null()) return;
  if (tmpl->is_string()) {
    chat_template_ = tmpl->get<std::string>();
    return;
  }
  TANDEM_CHECK_KIND(kInvalidArgument, tmpl->is_array(), where,
                    ": chat_template: expected a string or a list of {name, template}");
  for (size_t i = 0; i < tmpl->size(); ++i) {
    const nlohmann::json& entry = (*tmpl)[i];
    TANDEM_CHECK_KIND(kInvalidArgument,
                      entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                          entry.contains("template") && entry["template"].is_string(),
                      where, ": chat_template[", i,
                      "]: expected {\"name\": str, \"template\": str}");
    named_chat_templates_[entry["name"].get<std::string>()] = entry["template"].get<std::string>();
  }
  if (auto it = named_chat_templates_.find("default"); it != named_chat_templates_.end()) {
    chat_template_ = it->second;
  }
}

std::optional<std::string> Tokenizer::named_chat_template(const std::string& name) const {
  auto it = named_chat_templates_.find(name);
  if (it == named_chat_templates_.end()) return std::nullopt;
  return it->second;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::string repaired;
  if (!utf8::is_valid(text)) {
    repaired = utf8::sanitize(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<AddedVocabulary::Piece> pieces;
  std::vector<AddedVocabulary::Piece> normalized_pieces;
  std::vector<std::string_view> words;
  std::deque<std::string> storage;
  std::string normalized;
  added_->split(text, /*normalized_pass=*/false, parse_special, pieces);
  for (const auto& piece : pieces) {
    if (piece.id >= 0) {
      ids.push_back(piece.id);
      continue;
    }
    std::string_view segment = text.substr(piece.begin, piece.end - piece.begin);
    if (!normalizer_->is_identity()) {
      normalized = normalizer_->normalize(segment);
      segment = normalized;
    }
    normalized_pieces.clear();
    if (added_->has_normalized_tokens()) {
      added_->split(segment, /*normalized_pass=*/true, parse_special, normalized_pieces);
    } else {
      normalized_pieces.push_back({0, segment.size(), -1});
    }
    for (const auto& np : normalized_pieces) {
      if (np.id >= 0) {
        ids.push_back(np.id);
        continue;
      }
      words.clear();
      storage.clear();
      pre_tokenizer_->split(segment.substr(np.begin, np.end - np.begin), words, storage);
      for (std::string_view word : words) model_->encode_word(word, ids);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= flags_.size() || !(flags_[id] & kPresent)) continue;
    if (skip_special && (flags_[id] & kSpecial)) continue;
    bytes += token_bytes_[id];
  }
  if (utf8::is_valid(bytes)) return bytes;
  return utf8::sanitize(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& t : added_->tokens()) {
    if (t.content == token) return t.id;
  }
  return model_->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= flags_.size() || !(flags_[id] & kPresent)) return {};
  if (flags_[id] & kAdded) {
    for (const AddedToken& t : added_->tokens()) {
      if (t.id == id)
        return t.normalized ? normalizer_->normalize(utf8::sanitize(t.content)) : t.content;
    }
  }
  return model_->id_to_token(id);
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= token_bytes_.size()) return {};
  return token_bytes_[id];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < flags_.size() && (flags_[id] & kSpecial);
}

const std::vector<AddedToken>& Tokenizer::added_tokens() const { return added_->tokens(); }

std::vector<int32_t> Tokenizer::special_token_ids() const {
  std::vector<int32_t> ids;
  for (size_t id = 0; id < flags_.size(); ++id) {
    if (flags_[id] & kSpecial) ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

std::optional<int32_t> Tokenizer::eos_token_id() const {
  return eos_token_ ? token_to_id(*eos_token_) : std::nullopt;
}

std::optional<int32_t> Tokenizer::bos_token_id() const {
  return bos_token_ ? token_to_id(*bos_token_) : std::nullopt;
}

std::optional<int32_t> Tokenizer::pad_token_id() const {
  return pad_token_ ? token_to_id(*pad_token_) : std::nullopt;
}

nlohmann::ordered_json Tokenizer::special_tokens_map() const {
  nlohmann::ordered_json map = nlohmann::ordered_json::object();
  if (bos_token_) map["bos_token"] = *bos_token_;
  if (eos_token_) map["eos_token"] = *eos_token_;
  if (unk_token_) map["unk_token"] = *unk_token_;
  if (pad_token_) map["pad_token"] = *pad_token_;
  return map;
}

}  // namespace tandem
