// An incremental JSON syntax checker: fed one character at a time, it says whether the text so
// far can still be (the start of) one JSON value, when that value is complete, and where the
// members of a top-level object begin and end, so a caller can stream a member's raw text as
// it arrives (tool-call arguments) without ever parsing a partial document.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tandem::parsers {

class JsonScanner {
 public:
  enum class Status { kMore, kDone, kError };

  /// What one character did. "Member" events are about members of the top-level object only.
  struct Step {
    Status status = Status::kMore;
    bool key_begin = false;           // the character opens a member's key string
    bool key_end = false;             // the character closes a member's key string
    bool value_begin = false;         // the character is the first of a member's value
    bool value_end = false;           // the character is the last of a member's value
    bool value_ended_before = false;  // a member's value (a number) ended just before it
  };

  /// Feeds one byte. After kDone or kError further input is an error.
  Step push(char c);

  /// Ends the input: true when the text was exactly one complete value (a top-level number
  /// ends here).
  bool finish();

  /// Nesting depth (0 at the top level).
  size_t depth() const { return stack_.size(); }

  /// Deepest nesting accepted.
  static constexpr size_t kMaxDepth = 64;

 private:
  enum class State : uint8_t {
    kValue,         // a value is expected (whitespace allowed)
    kKeyOrClose,    // right after '{': a key or '}'
    kKey,           // after ',' in an object: a key
    kColon,         // after a key: ':'
    kAfterValue,    // after a value inside a container: ',' or the closing bracket
    kValueOrClose,  // right after '[': a value or ']'
    kString,
    kNumber,
    kLiteral,
    kDone,
    kError,
  };
  enum class Num : uint8_t { kSign, kZero, kInt, kDot, kFrac, kExp, kExpSign, kExpDigits };

  void value_done(Step& s, bool by_this_char);
  Step fail(Step s) {
    state_ = State::kError;
    s.status = Status::kError;
    return s;
  }
  bool member_level() const { return stack_.size() == 1 && stack_.back() == '{'; }

  State state_ = State::kValue;
  std::vector<char> stack_;  // '{' / '['
  // Strings
  bool string_is_key_ = false;
  bool escape_ = false;
  int unicode_left_ = 0;
  // Numbers and literals
  Num num_ = Num::kSign;
  const char* literal_ = nullptr;  // the rest of "true" / "false" / "null" still expected
};

/// The JSON string literal of `s` without the quotes (s is valid UTF-8 or gets U+FFFD).
std::string json_escape(const std::string& s);

}  // namespace tandem::parsers
