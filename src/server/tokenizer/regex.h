// A compiled PCRE2 regular expression (UTF + Unicode properties, JIT when available),
// used for the pre-tokenizer's Split patterns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct pcre2_real_code_8;

namespace tandem {

/// An immutable regex; matching is thread-safe (each thread gets its own match state).
class Regex {
 public:
  /// Compiles `pattern` with PCRE2_UTF | PCRE2_UCP. `\s` and `\S` are matched as the
  /// Unicode White_Space set, as Oniguruma (HF tokenizers' engine) does. Throws
  /// Error(kInvalidArgument) with PCRE2's message when the pattern does not compile.
  explicit Regex(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// Appends the [begin, end) byte offsets of every non-overlapping, non-empty match in
  /// `text`, left to right. `text` must be well-formed UTF-8 (it is not re-checked).
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& matches) const;

  /// The pattern as given.
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  pcre2_real_code_8* code_ = nullptr;
  bool jit_ = false;
};

}  // namespace tandem
