// UTF-8 helpers shared by the tokenizer, the detokenizer and the chat template engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::utf8 {

/// U+FFFD, the replacement character, encoded as UTF-8.
inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

/// What scan() found at the start of a byte range.
enum class ScanStatus {
  kValid,       // `length` bytes form one complete, well-formed character
  kInvalid,     // `length` bytes are a maximal ill-formed subpart: one U+FFFD replaces them
  kIncomplete,  // all `length` bytes are a well-formed but truncated prefix of a character
};

/// Result of scan(): status and the number of bytes it covers (>= 1).
struct ScanResult {
  ScanStatus status;  ///< what the bytes are
  size_t length;      ///< how many bytes that covers (>= 1)
};

/// Classifies the bytes at the start of `bytes` (must be non-empty) following the Unicode
/// "maximal subpart" rule, the one Rust's from_utf8_lossy and Python's errors="replace" use.
ScanResult scan(std::string_view bytes);

/// True when `text` is well-formed UTF-8.
bool is_valid(std::string_view text);

/// Lossy conversion: every maximal ill-formed subpart (and a truncated character at the
/// end) becomes U+FFFD, exactly like Hugging Face tokenizers' String::from_utf8_lossy.
std::string sanitize(std::string_view bytes);

/// Streaming form of sanitize(): appends to `out` everything decidable in `bytes` and
/// returns how many bytes were consumed; the unconsumed tail (at most 3 bytes) is a
/// well-formed prefix of a character that may still be completed by later bytes.
size_t sanitize_prefix(std::string_view bytes, std::string& out);

/// Decodes the character at text[*pos] of well-formed UTF-8 and advances *pos past it.
char32_t next(std::string_view text, size_t* pos);

/// Appends the UTF-8 encoding of code point `cp` to `out`.
void append(std::string& out, char32_t cp);

/// Decodes well-formed UTF-8 into code points.
std::u32string to_u32(std::string_view text);

/// Encodes code points as UTF-8.
std::string from_u32(std::u32string_view text);

/// Number of code points in well-formed UTF-8 text.
size_t length(std::string_view text);

/// Python's str.isspace() for one code point (also what Python's re `\s` matches).
bool is_python_space(char32_t cp);

/// The Unicode White_Space property (Rust's char::is_whitespace).
bool is_white_space(char32_t cp);

/// True when every byte of `text` is ASCII.
bool is_ascii(std::string_view text);

}  // namespace tandem::utf8
