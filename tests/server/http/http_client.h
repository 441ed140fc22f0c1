// A small libcurl client for the HTTP tests (loopback only).
#pragma once

#include <curl/curl.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tandem::testing {

struct HttpResult {
  CURLcode code = CURLE_OK;  // transport result
  long status = 0;           // HTTP status (0 when none arrived)
  std::string body;
  std::string headers;
  nlohmann::json json() const { return nlohmann::json::parse(body); }
};

/// One curl handle; reusing it keeps the connection alive between requests.
class HttpClient {
 public:
  HttpClient() {
    static const bool init = [] { return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }();
    (void)init;
    curl_ = curl_easy_init();
  }
  ~HttpClient() { curl_easy_cleanup(curl_); }
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  /// on_data (optional) sees each received piece; returning false drops the connection.
  HttpResult request(const std::string& method, const std::string& url,
                     const std::string& body = "", const std::vector<std::string>& headers = {},
                     long timeout_ms = 20000,
                     std::function<bool(const std::string&)> on_data = nullptr) {
    HttpResult r;
    Sink sink{&r.body, std::move(on_data)};
    curl_easy_reset(curl_);
    curl_easy_setopt(curl_, CURLOPT_URL, url.c_str());
    curl_easy_setopt(curl_, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl_, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(curl_, CURLOPT_WRITEFUNCTION, &Sink::write);
    curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(curl_, CURLOPT_HEADERFUNCTION, &header_cb);
    curl_easy_setopt(curl_, CURLOPT_HEADERDATA, &r.headers);
    if (method == "GET") {
      curl_easy_setopt(curl_, CURLOPT_HTTPGET, 1L);
    } else {
      curl_easy_setopt(curl_, CURLOPT_CUSTOMREQUEST, method.c_str());
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, body.data());
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDSIZE_LARGE, curl_off_t(body.size()));
    }
    curl_slist* list = nullptr;
    list = curl_slist_append(list, "Content-Type: application/json");
    for (const auto& h : headers) list = curl_slist_append(list, h.c_str());
    curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, list);
    r.code = curl_easy_perform(curl_);
    curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &r.status);
    curl_slist_free_all(list);
    return r;
  }

  HttpResult get(const std::string& url, const std::vector<std::string>& headers = {}) {
    return request("GET", url, "", headers);
  }
  HttpResult post(const std::string& url, const std::string& body,
                  const std::vector<std::string>& headers = {}) {
    return request("POST", url, body, headers);
  }
  HttpResult post(const std::string& url, const nlohmann::json& body,
                  const std::vector<std::string>& headers = {}) {
    return request("POST", url, body.dump(), headers);
  }

 private:
  struct Sink {
    std::string* body;
    std::function<bool(const std::string&)> on_data;
    static size_t write(char* p, size_t size, size_t n, void* ud) {
      auto* s = static_cast<Sink*>(ud);
      std::string piece(p, size * n);
      s->body->append(piece);
      if (s->on_data && !s->on_data(piece)) return 0;  // abort the transfer
      return size * n;
    }
  };
  static size_t header_cb(char* p, size_t size, size_t n, void* ud) {
    static_cast<std::string*>(ud)->append(p, size * n);
    return size * n;
  }

  CURL* curl_ = nullptr;
};

/// The JSON payloads of an SSE body ("data: {...}\n\n" ... "data: [DONE]\n\n");
/// [DONE] is returned as the string "[DONE]".
inline std::vector<nlohmann::json> sse_events(const std::string& body) {
  std::vector<nlohmann::json> events;
  size_t pos = 0;
  while (pos < body.size()) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) end = body.size();
    std::string ev = body.substr(pos, end - pos);
    pos = end + 2;
    if (ev.rfind("data: ", 0) != 0) continue;
    std::string data = ev.substr(6);
    if (data == "[DONE]") {
      events.emplace_back("[DONE]");
    } else {
      events.push_back(nlohmann::json::parse(data));
    }
  }
  return events;
}

}  // namespace tandem::testing
