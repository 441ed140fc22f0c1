// The tandem binary end to end: `tandem generate --json` reproduces transformers on every
// golden fixture, and bad input gives a clear error and exit code 1, never a crash.
#include <gtest/gtest.h>
#include <unistd.h>

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

// Qwen3.5 hybrids run on the GPU (Qwen35MoeCuda): with a GPU they generate, without one the
// CLI says so in one line and exits 1 (no crash, no hang).
TEST(Cli, HybridModelOnTheGpuRunsOrSaysWhyNot) {
  for (const auto& dir : testing::hybrid_golden_dirs()) {
    CmdResult r = run("generate --device cuda --temperature 0 --model " + dir +
                      " --prompt-ids 1,2 --max-tokens 3");
    if (r.status == 0) {
      EXPECT_NE(r.out.find("3 tokens"), std::string::npos) << r.out;
    } else {
      EXPECT_EQ(r.status, 1) << r.out;
      EXPECT_NE(r.out.find("--device cuda"), std::string::npos) << r.out;
    }
  }
}

// --deterministic (docs/api.md): on the CPU the model is batch-invariant already, so a seeded
// sampled generation is the same with and without it; a Qwen3.5 hybrid on the GPU is refused
// in one line (or, on a build without CUDA, the GPU itself is).
TEST(Cli, DeterministicFlag) {
  const auto fixture = testing::golden_dirs().front();
  const std::string args = "generate --model " + fixture +
                           " --prompt-ids 1,2,3,4,5 --max-tokens 8 --temperature 0.9 --seed 7 "
                           "--logprobs 3 --ignore-eos --json";
  CmdResult plain = run(args), det = run(args + " --deterministic");
  ASSERT_EQ(plain.status, 0) << plain.out;
  ASSERT_EQ(det.status, 0) << det.out;
  EXPECT_EQ(nlohmann::json::parse(det.out), nlohmann::json::parse(plain.out));
  for (const auto& dir : testing::hybrid_golden_dirs()) {
    CmdResult r = run("generate --device cuda --deterministic --model " + dir +
                      " --prompt-ids 1,2 --max-tokens 3");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_TRUE(r.out.find("--deterministic") != std::string::npos ||
                r.out.find("--device cuda") != std::string::npos)
        << r.out;
    break;  // one is enough
  }
}

// --kv-cache-dtype fp8 (vLLM's): the GPU models' FP8 KV cache; the CPU model keeps fp32 KV,
// so --device cpu refuses it in one line naming the option; an unknown dtype is a usage error.
TEST(Cli, KvCacheDtypeFp8IsRefusedOnTheCpu) {
  const auto fixture = testing::golden_dirs().front();
  for (const char* cmd : {"generate --prompt-ids 1,2 --max-tokens 2", "serve --port 0"}) {
    CmdResult r = run(std::string(cmd) + " --model " + fixture + " --kv-cache-dtype fp8");
    EXPECT_EQ(r.status, 1) << cmd << ": " << r.out;
    EXPECT_NE(r.out.find("--kv-cache-dtype fp8 needs --device cuda"), std::string::npos)
        << cmd << ": " << r.out;
  }
  CmdResult bad = run("generate --model " + fixture + " --prompt-ids 1 --kv-cache-dtype fp16");
  EXPECT_NE(bad.status, 0) << bad.out;
  CmdResult ok =
      run("generate --model " + fixture + " --prompt-ids 1,2 --max-tokens 2 --kv-cache-dtype auto");
  EXPECT_EQ(ok.status, 0) << ok.out;
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

// `tandem plan --model`: the memory fit of a role from config.json alone (Qwen3.5-397B-A17B's
// published shapes, no weights); the replica mode still works; neither mode's inputs: an error.
TEST(Cli, PlanMemoryFit) {
  namespace fs = std::filesystem;
  auto write_config = [](const fs::path& dir, bool fp8) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    nlohmann::json c = {{"architectures", {"Qwen3_5MoeForCausalLM"}},
                        {"model_type", "qwen3_5_moe_text"},
                        {"hidden_size", 4096},
                        {"num_hidden_layers", 60},
                        {"full_attention_interval", 4},
                        {"num_attention_heads", 32},
                        {"num_key_value_heads", 2},
                        {"head_dim", 256},
                        {"linear_num_key_heads", 16},
                        {"linear_num_value_heads", 64},
                        {"linear_key_head_dim", 128},
                        {"linear_value_head_dim", 128},
                        {"linear_conv_kernel_dim", 4},
                        {"num_experts", 512},
                        {"num_experts_per_tok", 10},
                        {"moe_intermediate_size", 1024},
                        {"shared_expert_intermediate_size", 1024},
                        {"vocab_size", 248320},
                        {"max_position_embeddings", 262144},
                        {"rms_norm_eps", 1e-6},
                        {"rope_parameters", {{"rope_theta", 1e7}, {"partial_rotary_factor", 0.25}}},
                        {"tie_word_embeddings", false},
                        {"dtype", "bfloat16"}};
    if (fp8) {
      c["quantization_config"] = {{"quant_method", "fp8"},
                                  {"fmt", "e4m3"},
                                  {"activation_scheme", "dynamic"},
                                  {"weight_block_size", {128, 128}}};
    }
    std::ofstream(dir / "config.json") << c.dump(2);
  };
  const fs::path fp8 = fs::temp_directory_path() / "tandem_cli_plan_fp8";
  const fs::path bf16 = fs::temp_directory_path() / "tandem_cli_plan_bf16";
  write_config(fp8, true);
  write_config(bf16, false);
  CmdResult r =
      run("plan --model " + fp8.string() + " --role decode --ranks 16 --max-model-len 32768");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("\"fits\":true"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("32 experts"), std::string::npos) << r.out;  // 512 / 16 per rank
  EXPECT_NE(r.out.find("weights block FP8"), std::string::npos) << r.out;
  r = run("plan --model " + bf16.string());  // serve: one GPU
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("does not fit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("exceed the rank's budget"), std::string::npos) << r.out;
  r = run("plan --model " + fp8.string() + " --role decode --ranks 3");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("experts do not split over 3 ranks"), std::string::npos) << r.out;
  r = run("plan --model " + fp8.string() + " --role serve --ranks 2");
  EXPECT_EQ(r.status, 1) << r.out;
  r = run("plan");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("give --model DIR"), std::string::npos) << r.out;
  r = run("plan --input-tps 100 --prefill-capacity-tps 50 --concurrent-seqs 10");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("\"prefill_instances\":3"), std::string::npos) << r.out;
  fs::remove_all(fp8);
  fs::remove_all(bf16);
}

// --help-env lists the environment registry (core/env.h) and exits 0; a bad value of a declared
// variable stops the command with an error that names it.
TEST(Cli, HelpEnvAndBadEnvironmentValue) {
  CmdResult r = run("--help-env");
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* name : {"TANDEM_NUM_THREADS", "RANK", "WORLD_SIZE", "TANDEM_AR_MAX_BYTES",
                           "TANDEM_CUDA_FP8", "OPENAI_API_KEY"}) {
    EXPECT_NE(r.out.find(name), std::string::npos) << name << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("Under evaluation (issue 29)"), std::string::npos) << r.out;
  const auto fixture = testing::golden_dirs().front();
  CmdResult bad;
  {
    std::string cmd = "env TANDEM_AR_MAX_BYTES=12Q " + std::string(TANDEM_BINARY_DIR) +
                      "/tandem generate --model " + fixture + " --prompt-ids 1 --max-tokens 1 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) bad.out.append(buf.data(), n);
    const int st = pclose(p);
    bad.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  }
  EXPECT_EQ(bad.status, 1) << bad.out;
  EXPECT_NE(bad.out.find("TANDEM_AR_MAX_BYTES='12Q'"), std::string::npos) << bad.out;
}

TEST(Cli, HelpShowsEveryDefault) {
  struct Want {
    const char* cmd;
    std::vector<std::pair<std::string, std::string>> flags;  // flag, its default
  };
  for (const Want& w : std::vector<Want>{
           {"router",
            {{"--max-queue", "=256"},
             {"--queue-timeout", "=30"},
             {"--drain-seconds", "=30"},
             {"--http-idle-timeout", "=120"},
             {"--http-header-timeout", "=30"},
             {"--resolve-interval", "=10"},
             {"--port", "=8000"}}},
           {"serve", {{"--port", "=8000"}, {"--drain-seconds", "=30"}, {"--page-size", "="}}},
           {"decode", {{"--max-decode-batch", "=32"}, {"--dp", "=1"}}},
           {"prefill", {{"--tp", "=1"}}},
       }) {
    CmdResult r = run(std::string(w.cmd) + " --help");
    ASSERT_EQ(r.status, 0) << r.out;
    for (const auto& [flag, def] : w.flags) {
      const size_t at = r.out.find("  " + flag + " ");
      ASSERT_NE(at, std::string::npos) << w.cmd << " " << flag << "\n" << r.out;
      const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
      EXPECT_NE(line.find(def), std::string::npos) << w.cmd << ": " << line;
    }
  }
}

// An install moved elsewhere still finds its demo model next to the binary.
TEST(Cli, RelocatableInstallFindsTheDemoModel) {
  namespace fs = std::filesystem;
  const fs::path prefix = fs::temp_directory_path() / ("tandem-prefix-" + std::to_string(getpid()));
  fs::remove_all(prefix);
  fs::create_directories(prefix / "bin");
  fs::create_directories(prefix / "share" / "tandem");
  fs::copy_file(fs::path(TANDEM_BINARY_DIR) / "tandem", prefix / "bin" / "tandem");
  fs::permissions(prefix / "bin" / "tandem", fs::perms::owner_all);
  fs::copy(fs::path(TANDEM_SOURCE_DIR) / "models" / "demo", prefix / "share" / "tandem" / "demo",
           fs::copy_options::recursive);
  const fs::path moved = prefix.string() + "-moved";
  fs::remove_all(moved);
  fs::rename(prefix, moved);
  auto run_in = [&](const std::string& args) {
    CmdResult r;
    FILE* p = popen(((moved / "bin" / "tandem").string() + " " + args + " 2>&1").c_str(), "r");
    std::array<char, 4096> buf;
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
    int st = pclose(p);
    r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    return r;
  };
  CmdResult help = run_in("generate --help");
  EXPECT_NE(help.out.find((moved / "share" / "tandem" / "demo").string()), std::string::npos)
      << help.out;
  CmdResult gen = run_in("generate --prompt-ids 1,2,3 --max-tokens 3 --temperature 0 --json");
  EXPECT_EQ(gen.status, 0) << gen.out;
  EXPECT_EQ(nlohmann::json::parse(gen.out).at("ids").size(), 3u);
  fs::remove_all(moved);
}

// tandem convert: the block-FP8 fixture to MXFP8 (progress line, error table), which
// `tandem generate` then serves; bad arguments exit 1 with a message.
TEST(Cli, ConvertToMxfp8ThenGenerate) {
  namespace fs = std::filesystem;
  const std::string src = testing::source_dir() + "/tests/data/fixtures_fp8/hub_fp8_block128";
  const fs::path out = fs::temp_directory_path() / ("tandem_cli_mxfp8_" + std::to_string(getpid()));
  fs::remove_all(out);
  CmdResult r = run("convert --format mxfp8 --model " + src + " --out " + out.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("100%"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("experts.down_proj"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(out / "hf_quant_config.json"));
  auto g = testing::load_golden(src);
  r = run("generate --model " + out.string() + " --prompt-ids " + join(g.cases[1].prompt_ids) +
          " --max-tokens 5 --temperature 0 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("ids").size(), 5u);
  r = run("convert --format mxfp8 --model " + src + " --out " + out.string());
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("not empty"), std::string::npos) << r.out;
  r = run("convert --format int4 --model " + src + " --out " + out.string() + "_x");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("--format must be mxfp8 or fp8"), std::string::npos) << r.out;
  r = run("convert --format fp8 --model /nonexistent/dir --out " + out.string() + "_y");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/dir"), std::string::npos) << r.out;
  fs::remove_all(out);
}

}  // namespace
}  // namespace tandem
