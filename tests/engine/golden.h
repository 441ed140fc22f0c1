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

/// Every fixture directory (tests/data/fixtures/*) plus the demo model when present.
inline std::vector<std::string> golden_dirs() {
  std::vector<std::string> dirs;
  namespace fs = std::filesystem;
  for (const auto& e : fs::directory_iterator(source_dir() + "/tests/data/fixtures")) {
    if (fs::exists(e.path() / "golden.json")) dirs.push_back(e.path().string());
  }
  std::sort(dirs.begin(), dirs.end());
  if (fs::exists(source_dir() + "/models/demo/golden.json")) {
    dirs.push_back(source_dir() + "/models/demo");
  }
  return dirs;
}

}  // namespace tandem::testing
