// A fixture that runs an HttpServer on a loopback port over the fake engine.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "server/http/fake_engine.h"
#include "server/http/http_client.h"
#include "server/http/http_server.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem::testing {

/// The tiny byte-level BPE tokenizer of the text tests: 273 BPE tokens + 3 specials.
inline std::string http_data_dir() { return std::string(TANDEM_SOURCE_DIR) + "/tests/data/http"; }
inline constexpr int64_t kTinyVocab = 276;
inline constexpr int32_t kTinyImEnd = 275;

class HttpServerTest : public ::testing::Test {
 protected:
  /// Starts a server; with_text loads the tokenizer and chat template of text_dir (default:
  /// the tiny one).
  void start(FakeEngine::Options eo = {}, HttpServerConfig cfg = {}, bool with_text = false,
             const std::string& text_dir = "");
  void TearDown() override {
    server_.reset();
    engine_.reset();
  }

  std::string url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(server_->port()) + path;
  }
  HttpResult post(const std::string& path, const nlohmann::json& body,
                  const std::vector<std::string>& headers = {}) {
    return client_.post(url(path), body, headers);
  }
  HttpResult get(const std::string& path) { return client_.get(url(path)); }

  std::unique_ptr<FakeEngine> engine_;
  std::unique_ptr<Tokenizer> tok_;
  std::unique_ptr<ChatTemplate> tmpl_;
  std::unique_ptr<HttpServer> server_;
  HttpClient client_;
};

}  // namespace tandem::testing
