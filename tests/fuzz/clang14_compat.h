// Force-included (-include) by the clang fuzzing / sanitizer builds only: clang 14 over
// libstdc++ 12 has no std::source_location (libstdc++ needs __builtin_source_location, which
// clang has from 15 on). The two members core/error.h uses, from the builtins clang 14 has.
#pragma once

#include <version>

#if !defined(__cpp_lib_source_location) && defined(__clang__)
namespace std {
struct source_location {
  static constexpr source_location current(const char* file = __builtin_FILE(),
                                           unsigned line = __builtin_LINE()) noexcept {
    source_location l;
    l.file_ = file;
    l.line_ = line;
    return l;
  }
  constexpr const char* file_name() const noexcept { return file_; }
  constexpr unsigned line() const noexcept { return line_; }
  const char* file_ = "";
  unsigned line_ = 0;
};
}  // namespace std
#endif
