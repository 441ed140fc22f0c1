// Entry point of the Jinja interpreter used for chat templates.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace tandem::jinja {

struct Program;

/// A parsed Jinja template with the environment transformers uses for chat templates
/// (trim_blocks, lstrip_blocks, loop controls, sandboxed immutable objects). Immutable and
/// cheap to copy; render() is thread-safe.
class Template {
 public:
  /// Parses `source`. Throws Error(kInvalidArgument, "chat template: line N: ...") for
  /// syntax errors and for tags, filters or tests this engine does not support.
  explicit Template(std::string_view source);

  /// Renders with the top-level keys of `context` (a JSON object) as variables. Throws
  /// Error(kInvalidArgument, "chat template: line N: ...") for runtime errors, including
  /// raise_exception() calls of the template.
  std::string render(const nlohmann::ordered_json& context) const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace tandem::jinja
