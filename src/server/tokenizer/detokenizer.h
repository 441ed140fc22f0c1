// Incremental detokenization for streaming: token ids in, complete UTF-8 text out.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace tandem {

class Tokenizer;

/// Turns a stream of token ids into text, one id at a time. It never emits part of a UTF-8
/// character: bytes are held back until the character completes. For any id sequence the
/// concatenation of all add() results and flush() equals Tokenizer::decode(ids, skip_special).
/// Not thread-safe (one per request); the Tokenizer must outlive it.
class IncrementalDetokenizer {
 public:
  /// Starts an empty stream. `skip_special_tokens` drops special added tokens from the text.
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens = false);

  /// Feeds one id; returns the text it completes (possibly empty). Ill-formed byte sequences
  /// become U+FFFD as soon as they are known to be ill-formed.
  std::string add(int32_t id);

  /// Feeds several ids; returns the text they complete.
  std::string add(std::span<const int32_t> ids);

  /// Ends the stream: returns U+FFFD for held-back bytes of an unfinished character (or
  /// nothing), and resets the stream.
  std::string flush();

  /// Number of bytes held back (0..3), waiting for the rest of a character.
  size_t pending_bytes() const { return pending_.size(); }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;  // raw bytes not yet emitted: a well-formed prefix of one character
};

}  // namespace tandem
