// Errors: TANDEM_CHECK throws a typed tandem::Error that carries file:line.
// Library code never exits; errors are caught at the request boundary.
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tandem {

/// What went wrong, coarse enough to map onto an HTTP status at the boundary.
enum class ErrorKind {
  kInvalidArgument,  // bad user input (request field, CLI flag): HTTP 400
  kNotFound,         // missing file, tensor, model, route: HTTP 404
  kIo,               // read/parse failure of a file on disk
  kOutOfResources,   // no KV pages, queue full: HTTP 429/503
  kUnsupported,      // valid but not implemented (e.g. an unknown architecture)
  kInternal,         // a broken invariant: a bug
  kCuda,             // CUDA / NCCL / cuBLAS failure
};

const char* error_kind_name(ErrorKind kind);

/// The one exception type of Tandem. what() is "file:line: message".
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message,
        std::source_location loc = std::source_location::current());

  ErrorKind kind() const { return kind_; }
  /// The message without the location prefix (for user-facing errors).
  const std::string& message() const { return message_; }
  const char* file() const { return file_; }
  unsigned line() const { return line_; }

 private:
  ErrorKind kind_;
  std::string message_;
  const char* file_;
  unsigned line_;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  if constexpr (sizeof...(Args) == 0) {
    return {};
  } else {
    std::ostringstream os;
    (os << ... << args);
    return os.str();
  }
}
}  // namespace detail

}  // namespace tandem

/// TANDEM_CHECK(cond, "message", values...): throws Error(kInternal) when cond is false.
#define TANDEM_CHECK(cond, ...)                                                                    \
  do {                                                                                             \
    if (!(cond)) [[unlikely]] {                                                                    \
      throw ::tandem::Error(::tandem::ErrorKind::kInternal,                                        \
                            ::tandem::detail::concat("check failed: " #cond ": ", ##__VA_ARGS__)); \
    }                                                                                              \
  } while (0)

/// TANDEM_CHECK_KIND(kind, cond, "message", values...): the same with a chosen kind;
/// the message is user facing (no "check failed" prefix).
#define TANDEM_CHECK_KIND(kind, cond, ...)                                                     \
  do {                                                                                         \
    if (!(cond)) [[unlikely]] {                                                                \
      throw ::tandem::Error(::tandem::ErrorKind::kind, ::tandem::detail::concat(__VA_ARGS__)); \
    }                                                                                          \
  } while (0)

/// TANDEM_THROW(kind, "message", values...): unconditional.
#define TANDEM_THROW(kind, ...) \
  throw ::tandem::Error(::tandem::ErrorKind::kind, ::tandem::detail::concat(__VA_ARGS__))
