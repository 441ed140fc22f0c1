// Added tokens (special and not) of tokenizer.json, matched in the text before BPE runs.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tandem {

class Normalizer;

/// One entry of tokenizer.json's "added_tokens".
struct AddedToken {
  int32_t id = 0;            ///< token id
  std::string content;       ///< the exact text of the token
  bool special = false;      ///< control token: skipped by decode(skip_special), not parsed
                             ///< when encode(parse_special = false)
  bool single_word = false;  ///< only matches when not touching word characters
  bool lstrip = false;       ///< absorbs whitespace on its left
  bool rstrip = false;       ///< absorbs whitespace on its right
  bool normalized = false;   ///< matched on normalized text (else on the raw input)
};

/// Finds added tokens in text with leftmost-longest matching (HF's aho-corasick set-up).
class AddedVocabulary {
 public:
  /// One piece of split(): an added token match, or a stretch of plain text (id < 0).
  struct Piece {
    size_t begin;  ///< byte offset in the text
    size_t end;    ///< one past the last byte
    int32_t id;    ///< the token id, or -1 for plain text
  };

  /// Indexes `tokens`; contents of normalized tokens are matched after `normalizer`.
  AddedVocabulary(std::vector<AddedToken> tokens, const Normalizer& normalizer);

  /// Cuts `text` into pieces covering it in order. `normalized_pass` selects the tokens
  /// with normalized = true (text already normalized) or false (raw text). Special tokens
  /// are only recognized when `parse_special`; otherwise their text stays plain.
  void split(std::string_view text, bool normalized_pass, bool parse_special,
             std::vector<Piece>& out) const;

  /// True when some token has normalized = true (a second matching pass is needed).
  bool has_normalized_tokens() const { return !tries_[1].nodes.empty(); }

  /// All added tokens, in the order of tokenizer.json.
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t token = -1;  // index into tokens_ when a token ends here
  };
  struct Trie {
    std::vector<Node> nodes;  // nodes[0] is the root when non-empty
    std::array<bool, 256> first_byte{};
    void insert(std::string_view key, int32_t token);
  };
  std::vector<AddedToken> tokens_;
  std::array<Trie, 2> tries_;  // [0]: raw-text tokens, [1]: normalized tokens
};

}  // namespace tandem
