// Golden fixtures written by tools/make_fixtures.py (transformers, fp32 greedy).
#pragma once

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/sampling.h"

namespace tandem::testing {

struct GoldenCase {
  std::vector<int32_t> prompt_ids;
  int32_t max_tokens = 0;
  std::vector<int32_t> output_ids;
  std::vector<std::vector<TokenLogprob>> top_logprobs;  // per generated token
};

struct Golden {
  std::string dir;
  std::string name;
  std::vector<GoldenCase> cases;
};

inline std::string source_dir() {
  const char* env = std::getenv("TANDEM_SOURCE_DIR");
  return env ? env : TANDEM_SOURCE_DIR;
}

inline Golden load_golden(const std::string& dir) {
  std::ifstream in(dir + "/golden.json");
  nlohmann::json j = nlohmann::json::parse(in);
  Golden g;
  g.dir = dir;
  g.name = std::filesystem::path(dir).filename().string();
  for (const auto& c : j.at("cases")) {
    GoldenCase gc;
    gc.prompt_ids = c.at("prompt_ids").get<std::vector<int32_t>>();
    gc.max_tokens = c.at("max_tokens").get<int32_t>();
    gc.output_ids = c.at("output_ids").get<std::vector<int32_t>>();
    for (const auto& pos : c.at("top_logprobs")) {
      std::vector<TokenLogprob> row;
      for (const auto& e : pos) row.push_back({e.at(0).get<int32_t>(), e.at(1).get<float>()});
      gc.top_logprobs.push_back(row);
    }
    g.cases.push_back(std::move(gc));
  }
  return g;
}

/// Qwen3.5 hybrid fixtures (tests/data/fixtures/qwen35_*, tools/make_qwen35_fixtures.py).
inline bool is_hybrid_fixture(const std::filesystem::path& dir) {
  return dir.filename().string().rfind("qwen35_", 0) == 0;
}

/// Every Qwen3-MoE fixture directory (tests/data/fixtures/*, not the hybrid ones) plus the
/// demo model when present.
inline std::vector<std::string> golden_dirs() {
  std::vector<std::string> dirs;
  namespace fs = std::filesystem;
  for (const auto& e : fs::directory_iterator(source_dir() + "/tests/data/fixtures")) {
    if (fs::exists(e.path() / "golden.json") && !is_hybrid_fixture(e.path())) {
      dirs.push_back(e.path().string());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  if (fs::exists(source_dir() + "/models/demo/golden.json")) {
    dirs.push_back(source_dir() + "/models/demo");
  }
  return dirs;
}

/// The Qwen3.5 hybrid fixtures.
inline std::vector<std::string> hybrid_golden_dirs() {
  std::vector<std::string> dirs;
  namespace fs = std::filesystem;
  for (const auto& e : fs::directory_iterator(source_dir() + "/tests/data/fixtures")) {
    if (fs::exists(e.path() / "golden.json") && is_hybrid_fixture(e.path())) {
      dirs.push_back(e.path().string());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

}  // namespace tandem::testing
