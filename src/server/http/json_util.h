// JSON output helpers for the HTTP front.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace tandem::openai {

/// Compact JSON; invalid UTF-8 (e.g. a token that is half a character) becomes U+FFFD
/// instead of throwing.
inline std::string dump_json(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace tandem::openai
