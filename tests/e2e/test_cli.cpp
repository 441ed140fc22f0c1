// The tandem binary end to end: `tandem generate --json` reproduces transformers on every
// golden fixture, and bad input gives a clear error and exit code 1, never a crash.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "../engine/golden.h"

namespace tandem {
namespace {

struct CmdResult {
  int status = -1;
  std::string out;
};

CmdResult run(const std::string& args) {
  std::string cmd = std::string(TANDEM_BINARY_DIR) + "/tandem " + args + " 2>&1";
  CmdResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

class CliGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(CliGolden, GenerateJsonMatchesTransformers) {
  auto g = testing::load_golden(GetParam());
  for (size_t i = 0; i < g.cases.size(); ++i) {
    const auto& c = g.cases[i];
    SCOPED_TRACE(g.name + " case " + std::to_string(i));
    CmdResult r =
        run("generate --model " + g.dir + " --prompt-ids " + join(c.prompt_ids) + " --max-tokens " +
            std::to_string(c.max_tokens) + " --temperature 0 --logprobs 5 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j.at("ids").get<std::vector<int32_t>>(), c.output_ids);
    const auto& lp = j.at("logprobs");
    ASSERT_EQ(lp.size(), c.top_logprobs.size());
    for (size_t t = 0; t < lp.size(); ++t) {
      ASSERT_EQ(lp[t].size(), c.top_logprobs[t].size());
      for (size_t k = 0; k < lp[t].size(); ++k) {
        EXPECT_NEAR(lp[t][k].at(1).get<float>(), c.top_logprobs[t][k].logprob, 1e-3);
      }
      EXPECT_EQ(lp[t][0].at(0).get<int32_t>(), c.top_logprobs[t][0].id);
    }
  }
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = std::filesystem::path(info.param).filename().string();
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CliGolden, ::testing::ValuesIn(testing::golden_dirs()),
                         param_name);
// Qwen3.5 hybrid checkpoints (the CPU model is picked by config.json's model_type).
INSTANTIATE_TEST_SUITE_P(Hybrid, CliGolden, ::testing::ValuesIn(testing::hybrid_golden_dirs()),
                         param_name);

TEST(Cli, HybridModelOnTheGpuIsRefusedNamingConfigJson) {
  for (const auto& dir : testing::hybrid_golden_dirs()) {
    CmdResult r = run("generate --device cuda --model " + dir + " --prompt-ids 1,2");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find(dir + "/config.json"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("--device cuda"), std::string::npos) << r.out;
  }
}

TEST(Cli, BadInputGivesClearErrors) {
  auto fixture = testing::golden_dirs().front();
  CmdResult r = run("generate --model /nonexistent/dir --prompt-ids 1,2");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/dir"), std::string::npos) << r.out;

  r = run("generate --model " + fixture + " --prompt-ids 1,x");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("'x'"), std::string::npos) << r.out;

  r = run("generate --model " + fixture + " --prompt-ids 99999999 --max-tokens 2");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("out of range"), std::string::npos) << r.out;

  r = run("generate --model " + fixture + " --prompt-ids 1 --max-tokens 100000");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("maximum context length"), std::string::npos) << r.out;

  r = run("generate --model " + fixture);
  EXPECT_EQ(r.status, 1) << r.out;

  // A truncated checkpoint names the file.
  namespace fs = std::filesystem;
  fs::path tmp = fs::temp_directory_path() / "tandem_cli_truncated";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  for (const auto& e : fs::directory_iterator(fixture))
    fs::copy(e.path(), tmp / e.path().filename());
  for (const auto& e : fs::directory_iterator(tmp)) {
    if (e.path().extension() == ".safetensors") {
      fs::resize_file(e.path(), fs::file_size(e.path()) / 2);
      r = run("generate --model " + tmp.string() + " --prompt-ids 1,2 --max-tokens 2");
      EXPECT_EQ(r.status, 1) << r.out;
      EXPECT_NE(r.out.find(e.path().filename().string()), std::string::npos) << r.out;
      break;
    }
  }
  fs::remove_all(tmp);
}

}  // namespace
}  // namespace tandem
