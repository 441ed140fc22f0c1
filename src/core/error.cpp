#include "core/error.h"

namespace tandem {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "invalid_argument";
    case ErrorKind::kNotFound: return "not_found";
    case ErrorKind::kIo: return "io_error";
    case ErrorKind::kOutOfResources: return "out_of_resources";
    case ErrorKind::kUnsupported: return "unsupported";
    case ErrorKind::kInternal: return "internal";
    case ErrorKind::kCuda: return "cuda_error";
  }
  return "unknown";
}

namespace {
const char* basename_of(const char* path) {
  std::string_view p(path);
  auto pos = p.rfind("src/");
  return pos == std::string_view::npos ? path : path + pos + 4;
}
}  // namespace

Error::Error(ErrorKind kind, const std::string& message, std::source_location loc)
    : std::runtime_error(std::string(basename_of(loc.file_name())) + ":" +
                         std::to_string(loc.line()) + ": " + message),
      kind_(kind),
      message_(message),
      file_(basename_of(loc.file_name())),
      line_(loc.line()) {}

}  // namespace tandem
