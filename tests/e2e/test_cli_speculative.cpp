// `--speculative-config` end to end: tandem generate gives the same greedy tokens with and
// without it (random MTP weights), --json reports "spec", and bad configurations exit 1 with
// a message naming the problem, on generate, serve and decode alike.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "../engine/golden.h"
#include "../engine/mtp_weights.h"

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

std::string spec(int k, const std::string& model = "") {
  std::string s = "'{\"method\": \"mtp\", \"num_speculative_tokens\": " + std::to_string(k);
  if (!model.empty()) s += ", \"model\": \"" + model + "\"";
  return s + "}'";
}

TEST(CliSpeculative, GenerateSameTokensAndReportsSpec) {
  const std::string fixture = testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2";
  const std::string mtp =
      (std::filesystem::temp_directory_path() / ("tandem_cli_mtp_" + std::to_string(::getpid())))
          .string();
  testing::write_random_mtp(fixture, mtp, 5);
  const std::string base =
      "generate --model " + fixture + " --prompt-ids 1,2,3 --max-tokens 20 --temperature 0 --json";
  CmdResult a = run(base);
  ASSERT_EQ(a.status, 0) << a.out;
  const auto ja = nlohmann::json::parse(a.out);
  EXPECT_FALSE(ja.contains("spec"));
  for (int k = 1; k <= 4; ++k) {
    CmdResult b = run(base + " --speculative-config " + spec(k, mtp));
    ASSERT_EQ(b.status, 0) << b.out;
    const auto jb = nlohmann::json::parse(b.out);
    EXPECT_EQ(jb["ids"], ja["ids"]) << "K = " << k;
    ASSERT_TRUE(jb.contains("spec"));
    EXPECT_GT(jb["spec"]["steps"].get<int64_t>(), 0);
    EXPECT_GE(jb["spec"]["draft_tokens"].get<int64_t>(), jb["spec"]["steps"].get<int64_t>());
    EXPECT_LE(jb["spec"]["accepted_tokens"].get<int64_t>(),
              jb["spec"]["draft_tokens"].get<int64_t>());
  }
  std::filesystem::remove_all(mtp);
}

TEST(CliSpeculative, BadConfigsExitWithAMessage) {
  const std::string fixture = testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2";
  const std::string gen = "generate --model " + fixture + " --prompt-ids 1,2 --max-tokens 2";
  struct Case {
    std::string config, message;
  };
  const std::vector<Case> cases = {
      {"'{\"method\": \"eagle\", \"num_speculative_tokens\": 1}'", "method \"eagle\""},
      {spec(0), "num_speculative_tokens must be in [1, 4]"},
      {spec(5), "num_speculative_tokens must be in [1, 4]"},
      {"'not json'", "not a JSON object"},
      {spec(2), "no MTP weights"},
      {spec(2, "/nonexistent/mtp"), "/nonexistent/mtp"},
  };
  for (const Case& c : cases) {
    for (const std::string& cmd :
         {gen, "serve --model " + fixture + " --port 0", "decode --model " + fixture}) {
      CmdResult r = run(cmd + " --speculative-config " + c.config);
      EXPECT_EQ(r.status, 1) << cmd << " " << c.config << ": " << r.out;
      EXPECT_NE(r.out.find(c.message), std::string::npos) << cmd << ": " << r.out;
    }
  }
  // A Qwen3.5 checkpoint without mtp.* tensors (and no "model"): refused naming the tensor.
  const std::string hybrid = testing::hybrid_golden_dirs().front();
  CmdResult r =
      run("generate --model " + hybrid + " --prompt-ids 1,2 --speculative-config " + spec(2));
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("no MTP weights (tensor 'mtp.fc.weight' not found)"), std::string::npos)
      << r.out;
}

}  // namespace
}  // namespace tandem
