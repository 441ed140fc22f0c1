// JSON output helpers for the HTTP front.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace tandem::openai {

/// Compact JSON; invalid UTF-8 (e.g. a token that is half a character) becomes U+FFFD
/// instead of throwing.
template <typename BasicJson>
std::string dump_json(const BasicJson& j) {
  return j.dump(-1, ' ', false, BasicJson::error_handler_t::replace);
}

}  // namespace tandem::openai
