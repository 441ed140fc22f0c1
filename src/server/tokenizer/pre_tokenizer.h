// The text-side stages of a Hugging Face tokenizer.json pipeline: the normalizer (NFC and
// friends) and the pre-tokenizer (Split regex, ByteLevel, Digits) that cuts text into words
// for BPE. Both are built from the json and immutable afterwards.
#pragma once

#include <array>
#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

class Regex;

/// GPT-2's byte -> printable character table (`bytes_to_unicode`), as UTF-8 strings.
const std::array<std::string, 256>& byte_level_alphabet();

/// Inverse of byte_level_alphabet(): byte value for a code point, or -1 when the code point
/// is not one of the 256 byte characters.
int byte_level_byte(char32_t cp);

/// The "normalizer" stage: a sequence of NFC / NFD / NFKC / NFKD / Lowercase steps.
class Normalizer {
 public:
  /// Builds from tokenizer.json's "normalizer" value (null gives the identity). `where`
  /// names the file for error messages. Throws Error(kUnsupported) for other types.
  static std::unique_ptr<Normalizer> from_json(const nlohmann::json& j, const std::string& where);

  /// Normalizes well-formed UTF-8 text.
  std::string normalize(std::string_view text) const;

  /// True when normalize() returns its input unchanged for every input.
  bool is_identity() const { return steps_.empty(); }

 private:
  enum class Step { kNfc, kNfd, kNfkc, kNfkd, kLowercase };
  void add(const nlohmann::json& j, const std::string& where);
  std::vector<Step> steps_;
};

/// How a Split pre-tokenizer treats the pattern's matches (HF SplitDelimiterBehavior).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

/// The "pre_tokenizer" stage. Byte-level BPE needs a ByteLevel step somewhere in it.
class PreTokenizer {
 public:
  /// Builds from tokenizer.json's "pre_tokenizer" value. Supports Sequence, Split (Regex or
  /// String pattern, all behaviors, invert), ByteLevel (add_prefix_space, use_regex) and
  /// Digits. Throws Error(kUnsupported) for other types, Error(kInvalidArgument) for bad
  /// fields (naming `where` and the field).
  static std::unique_ptr<PreTokenizer> from_json(const nlohmann::json& j, const std::string& where);
  ~PreTokenizer();

  /// Cuts normalized text into words, appended to `words` in order. Words view `text` or
  /// strings appended to `storage` (for words that gained a prefix space).
  void split(std::string_view text, std::vector<std::string_view>& words,
             std::deque<std::string>& storage) const;

  /// True when the pipeline contains a ByteLevel step (required by the BPE model here).
  bool has_byte_level() const { return has_byte_level_; }

 private:
  struct Step;
  PreTokenizer();
  void add(const nlohmann::json& j, const std::string& where);
  std::vector<Step> steps_;
  bool has_byte_level_ = false;
};

}  // namespace tandem
