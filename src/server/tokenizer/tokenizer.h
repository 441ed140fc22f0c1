// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json (+ tokenizer_config.json):
// the Qwen2/Qwen3 pipeline (NFC, Split regex, ByteLevel, BPE, ByteLevel decoder) and the
// GPT-2 style one (ByteLevel pre-tokenizer with its own regex).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "server/tokenizer/added_vocabulary.h"
#include "server/tokenizer/detokenizer.h"  // IncrementalDetokenizer goes with every Tokenizer

namespace tandem {

class AddedVocabulary;
class BpeModel;
class Normalizer;
class PreTokenizer;

/// An immutable tokenizer; encode() and decode() are thread-safe.
class Tokenizer {
 public:
  /// Loads `dir`/tokenizer.json and, when present, `dir`/tokenizer_config.json and
  /// `dir`/chat_template.jinja. Returns nullptr when `dir` has no tokenizer.json. Throws
  /// Error(kIo) when a file cannot be read or is not JSON, Error(kInvalidArgument) naming
  /// the file and field when a field is malformed, Error(kUnsupported) for pipeline stages
  /// this implementation does not have.
  static std::unique_ptr<Tokenizer> from_dir(const std::string& dir);

  /// Builds from the texts of tokenizer.json and tokenizer_config.json (empty: none).
  /// `source` names the tokenizer.json in error messages.
  static std::unique_ptr<Tokenizer> from_json(std::string_view tokenizer_json,
                                              std::string_view tokenizer_config_json = {},
                                              const std::string& source = "tokenizer.json");
  ~Tokenizer();

  /// Token ids of `text` (no BOS/EOS is added: the chat template writes those). Added
  /// tokens are matched first; special ones only when `parse_special`, otherwise their text
  /// is tokenized as plain text (HF `split_special_tokens`). Ill-formed UTF-8 in `text` is
  /// replaced by U+FFFD first.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;

  /// Text of `ids` (HF decode with clean_up_tokenization_spaces = false). Ids outside the
  /// vocabulary are skipped; special tokens too when `skip_special`. Bytes that do not form
  /// UTF-8 become U+FFFD.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  /// Number of ids: one past the largest id of the vocabulary and the added tokens
  /// (Python's len(tokenizer)).
  int64_t vocab_size() const { return static_cast<int64_t>(token_bytes_.size()); }

  /// Id of a token given by its vocabulary spelling (byte-level characters, e.g. "Ġthe") or
  /// by an added token's content.
  std::optional<int32_t> token_to_id(std::string_view token) const;

  /// Vocabulary spelling of `id` (an added token's content for added tokens, normalized
  /// when the token is marked normalized, as HF does); empty for an id that has no token.
  std::string id_to_token(int32_t id) const;

  /// The raw bytes that `id` contributes to decode() output before UTF-8 repair (may be a
  /// partial UTF-8 character); empty for an id that has no token.
  std::string_view token_bytes(int32_t id) const;

  /// True when `id` is an added token marked special.
  bool is_special(int32_t id) const;

  /// Added tokens (special and not), in tokenizer.json order.
  const std::vector<AddedToken>& added_tokens() const;

  /// Ids of the special added tokens, ascending.
  std::vector<int32_t> special_token_ids() const;

  /// bos_token from tokenizer_config.json, when set.
  const std::optional<std::string>& bos_token() const { return bos_token_; }
  /// eos_token from tokenizer_config.json, when set.
  const std::optional<std::string>& eos_token() const { return eos_token_; }
  /// pad_token from tokenizer_config.json, when set.
  const std::optional<std::string>& pad_token() const { return pad_token_; }
  /// unk_token from tokenizer_config.json, when set.
  const std::optional<std::string>& unk_token() const { return unk_token_; }
  /// Id of eos_token(), when it is set and in the vocabulary.
  std::optional<int32_t> eos_token_id() const;
  /// Id of bos_token(), when it is set and in the vocabulary.
  std::optional<int32_t> bos_token_id() const;
  /// Id of pad_token(), when it is set and in the vocabulary.
  std::optional<int32_t> pad_token_id() const;

  /// transformers' `special_tokens_map`: {"bos_token": ..., "eos_token": ..., ...} with
  /// the tokens that are set; chat templates receive these as variables.
  nlohmann::ordered_json special_tokens_map() const;

  /// The default chat template: chat_template.jinja when the directory has one, else
  /// tokenizer_config.json's chat_template (the "default" entry of a named list); empty
  /// when there is none.
  const std::string& chat_template() const { return chat_template_; }

  /// A named chat template of tokenizer_config.json (e.g. "tool_use"), when present.
  std::optional<std::string> named_chat_template(const std::string& name) const;

  /// model_max_length from tokenizer_config.json, when set.
  std::optional<int64_t> model_max_length() const { return model_max_length_; }

 private:
  Tokenizer();
  void load_config(const nlohmann::json& config, const std::string& where);

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<AddedVocabulary> added_;
  std::vector<std::string> token_bytes_;  // [vocab_size] decoder output bytes of each id
  std::vector<uint8_t> flags_;            // [vocab_size] kPresent | kSpecial | kAdded
  std::optional<std::string> bos_token_, eos_token_, pad_token_, unk_token_;
  std::string chat_template_;
  std::map<std::string, std::string> named_chat_templates_;
  std::optional<int64_t> model_max_length_;
};

}  // namespace tandem
