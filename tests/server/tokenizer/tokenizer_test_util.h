// Helpers shared by the tokenizer tests: fixture paths, JSON loading, the Qwen3 files.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "server/tokenizer/tokenizer.h"

namespace tandem::testing {

/// Directory of the committed golden fixtures (tests/data/tokenizer).
inline std::filesystem::path tokenizer_data_dir() {
  return std::filesystem::path(TANDEM_SOURCE_DIR) / "tests" / "data" / "tokenizer";
}

/// Reads a whole file (fails the test when it cannot).
inline std::string read_text_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return std::move(ss).str();
}

/// Parses a committed fixture (object key order kept).
inline nlohmann::ordered_json load_fixture(const std::string& name) {
  return nlohmann::ordered_json::parse(read_text_file(tokenizer_data_dir() / name));
}

/// Where tools/fetch_qwen3_tokenizer.sh puts Qwen3's tokenizer files, or nullopt.
/// Looks at $TANDEM_QWEN3_TOKENIZER_DIR, $TANDEM_CACHE_DIR/qwen3_tokenizer,
/// ~/.cache/tandem/qwen3_tokenizer and tests/data/qwen3_tokenizer, in that order.
inline std::optional<std::filesystem::path> qwen3_tokenizer_dir() {
  std::vector<std::filesystem::path> candidates;
  if (const char* d = std::getenv("TANDEM_QWEN3_TOKENIZER_DIR")) candidates.emplace_back(d);
  if (const char* c = std::getenv("TANDEM_CACHE_DIR"))
    candidates.push_back(std::filesystem::path(c) / "qwen3_tokenizer");
  if (const char* h = std::getenv("HOME")) {
    candidates.push_back(std::filesystem::path(h) / ".cache" / "tandem" / "qwen3_tokenizer");
  }
  candidates.push_back(std::filesystem::path(TANDEM_SOURCE_DIR) / "tests" / "data" /
                       "qwen3_tokenizer");
  for (const auto& c : candidates) {
    std::error_code ec;
    if (std::filesystem::exists(c / "tokenizer.json", ec)) return c;
  }
  return std::nullopt;
}

/// The Qwen3 tokenizer, loaded once per process; nullptr when the files are absent.
inline const Tokenizer* qwen3_tokenizer() {
  static const std::unique_ptr<Tokenizer> tok = [] {
    auto dir = qwen3_tokenizer_dir();
    return dir ? Tokenizer::from_dir(dir->string()) : nullptr;
  }();
  return tok.get();
}

/// True when TANDEM_REQUIRE_QWEN3_TOKENIZER=1: a missing Qwen3 tokenizer fails instead of
/// skipping (set in CI after tools/fetch_qwen3_tokenizer.sh).
inline bool qwen3_required() {
  const char* v = std::getenv("TANDEM_REQUIRE_QWEN3_TOKENIZER");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace tandem::testing

/// Skips (or fails, when required) a test that needs the Qwen3 tokenizer files.
#define TANDEM_REQUIRE_QWEN3(tok)                                                          \
  const ::tandem::Tokenizer* tok = ::tandem::testing::qwen3_tokenizer();                   \
  if (tok == nullptr) {                                                                    \
    if (::tandem::testing::qwen3_required()) {                                             \
      FAIL() << "Qwen3 tokenizer files not found: run tools/fetch_qwen3_tokenizer.sh";     \
    }                                                                                      \
    GTEST_SKIP() << "Qwen3 tokenizer files not found: run tools/fetch_qwen3_tokenizer.sh"; \
  }
