// The error a request handler throws to answer one request with an OpenAI-style error:
// {"error": {"message", "type", "param", "code"}} and an HTTP status.
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace tandem::openai {

class ApiError : public std::runtime_error {
 public:
  /// status: HTTP status; type: OpenAI error type ("invalid_request_error", ...);
  /// param: the offending request field ("" for none); code: short machine code ("" for none).
  ApiError(int status, std::string message, std::string type, std::string param = {},
           std::string code = {})
      : std::runtime_error(message),
        status_(status),
        message_(std::move(message)),
        type_(std::move(type)),
        param_(std::move(param)),
        code_(std::move(code)) {}

  int status() const { return status_; }
  const std::string& message() const { return message_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }

  /// {"error": {...}} with null for an empty param / code.
  nlohmann::ordered_json to_json() const {
    nlohmann::ordered_json e = {
        {"message", message_}, {"type", type_}, {"param", nullptr}, {"code", nullptr}};
    if (!param_.empty()) e["param"] = param_;
    if (!code_.empty()) e["code"] = code_;
    return nlohmann::ordered_json{{"error", std::move(e)}};
  }

 private:
  int status_;
  std::string message_;
  std::string type_;
  std::string param_;
  std::string code_;
};

/// 400 invalid_request_error naming the offending field.
inline ApiError bad_request(std::string message, std::string param = {}) {
  return ApiError(400, std::move(message), "invalid_request_error", std::move(param));
}

}  // namespace tandem::openai
