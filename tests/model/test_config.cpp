#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "model/config.h"

namespace tandem {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

constexpr const char* kOrigin = "/ckpt/Qwen3-30B-A3B/config.json";

// Qwen/Qwen3-30B-A3B config.json as published on the hub.
Json hub_config() {
  return Json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": false,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": true,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": false,
    "rms_norm_eps": 1e-06,
    "rope_scaling": null,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": null,
    "tie_word_embeddings": false,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": true,
    "use_sliding_window": false,
    "vocab_size": 151936
  })");
}

// The same model as transformers 5 saves it.
Json tf5_config() {
  return Json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": false,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": true,
    "num_attention_heads": 32,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "num_local_experts": 128,
    "output_router_logits": false,
    "pad_token_id": null,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001,
    "sliding_window": null,
    "tie_word_embeddings": false,
    "transformers_version": "5.24.0",
    "use_cache": true,
    "use_sliding_window": false,
    "vocab_size": 151936
  })");
}

ModelConfig parse(const Json& j) { return ModelConfig::from_json(j.dump(), kOrigin); }

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.architecture, b.architecture);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.decoder_sparse_step, b.decoder_sparse_step);
  EXPECT_EQ(a.mlp_only_layers, b.mlp_only_layers);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
}

/// A fresh directory under the system temp dir, removed on destruction.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("tandem_test_config_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string path() const { return path_.string(); }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
  }

 private:
  fs::path path_;
};

/// Runs f, expects a tandem::Error of `kind` whose message holds every one of `needles`.
void expect_error(const std::function<void()>& f, ErrorKind kind,
                  const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << needles[0];
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& n : needles) {
      EXPECT_NE(e.message().find(n), std::string::npos) << "'" << n << "' not in: " << e.what();
    }
  }
}

TEST(ModelConfig, HubSpelling) {
  ModelConfig c = parse(hub_config());
  EXPECT_EQ(c.model_type, "qwen3_moe");
  EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_EQ(c.num_hidden_layers, 48);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 128);  // not hidden / heads (= 64)
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.max_position_embeddings, 40960);
  EXPECT_EQ(c.dtype, DType::kBF16);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});
  EXPECT_EQ(c.bos_token_id, 151643);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) EXPECT_TRUE(c.is_moe_layer(l)) << l;
}

TEST(ModelConfig, BothSpellingsAgree) {
  expect_same(parse(hub_config()), parse(tf5_config()));

  // rope_theta only at the top level, rope_parameters without a theta, legacy "type" key.
  Json j = tf5_config();
  j["rope_parameters"] = {{"rope_type", "default"}};
  j["rope_theta"] = 1000000.0;
  expect_same(parse(hub_config()), parse(j));
  j = hub_config();
  j["rope_scaling"] = {{"type", "default"}};
  expect_same(parse(hub_config()), parse(j));
  // The dict's theta wins over the top-level one (transformers' priority).
  j = tf5_config();
  j["rope_theta"] = 5.0;
  EXPECT_DOUBLE_EQ(parse(j).rope_theta, 1e6);
  // Both dtype keys, agreeing.
  j = hub_config();
  j["dtype"] = "bfloat16";
  EXPECT_EQ(parse(j).dtype, DType::kBF16);
  j["dtype"] = j["torch_dtype"] = "float16";
  EXPECT_EQ(parse(j).dtype, DType::kF16);
  j["dtype"] = j["torch_dtype"] = "float32";
  EXPECT_EQ(parse(j).dtype, DType::kF32);
}

TEST(ModelConfig, TransformersDefaults) {
  // Qwen3MoeConfig defaults (transformers 5.24) for every missing field.
  ModelConfig c = parse(Json{{"model_type", "qwen3_moe"}});
  EXPECT_EQ(c.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.intermediate_size, 6144);
  EXPECT_EQ(c.moe_intermediate_size, 768);
  EXPECT_EQ(c.num_hidden_layers, 24);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 64);  // hidden / heads when absent
  EXPECT_EQ(c.num_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.decoder_sparse_step, 1);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_FALSE(c.norm_topk_prob);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_EQ(c.dtype, DType::kBF16);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.bos_token_id, -1);

  Json j = {{"model_type", "qwen3_moe"}, {"hidden_size", 1024},        {"num_attention_heads", 8},
            {"num_key_value_heads", 2},  {"mlp_only_layers", nullptr}, {"eos_token_id", nullptr}};
  c = parse(j);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_TRUE(c.mlp_only_layers.empty());
  EXPECT_TRUE(c.eos_token_ids.empty());
}

TEST(ModelConfig, DenseLayerRule) {
  Json j = hub_config();
  j["num_hidden_layers"] = 8;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {0, 3};
  ModelConfig c = parse(j);
  // (l not in mlp_only_layers) and (num_experts > 0 and (l + 1) % decoder_sparse_step == 0)
  std::vector<bool> want = {false, true, false, false, false, true, false, true};
  for (int64_t l = 0; l < 8; ++l) EXPECT_EQ(c.is_moe_layer(l), want[static_cast<size_t>(l)]) << l;

  j["decoder_sparse_step"] = 3;
  j["mlp_only_layers"] = Json::array();
  c = parse(j);
  want = {false, false, true, false, false, true, false, false};
  for (int64_t l = 0; l < 8; ++l) EXPECT_EQ(c.is_moe_layer(l), want[static_cast<size_t>(l)]) << l;

  j["decoder_sparse_step"] = 1;
  j["num_experts"] = 0;  // no experts: every layer dense
  c = parse(j);
  for (int64_t l = 0; l < 8; ++l) EXPECT_FALSE(c.is_moe_layer(l)) << l;
}

TEST(ModelConfig, FromDirWithGenerationConfig) {
  TempDir dir;
  dir.write("config.json", hub_config().dump(2));
  ModelConfig c = ModelConfig::from_dir(dir.path());
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{151645});  // config.json's

  dir.write("generation_config.json",
            R"({"bos_token_id": 151643, "do_sample": true,
                "eos_token_id": [151645, 151643], "temperature": 0.6})");
  c = ModelConfig::from_dir(dir.path());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  EXPECT_EQ(c.bos_token_id, 151643);

  dir.write("generation_config.json", R"({"eos_token_id": 7})");
  EXPECT_EQ(ModelConfig::from_dir(dir.path()).eos_token_ids, std::vector<int64_t>{7});

  dir.write("generation_config.json", R"({"temperature": 0.7})");  // no eos: config.json's
  EXPECT_EQ(ModelConfig::from_dir(dir.path()).eos_token_ids, std::vector<int64_t>{151645});

  dir.write("generation_config.json", R"({"eos_token_id": "x"})");
  expect_error([&] { ModelConfig::from_dir(dir.path()); }, ErrorKind::kInvalidArgument,
               {"generation_config.json", "eos_token_id"});
  dir.write("generation_config.json", R"({"eos_token_id": [1, )");
  expect_error([&] { ModelConfig::from_dir(dir.path()); }, ErrorKind::kIo,
               {"generation_config.json"});
}

TEST(ModelConfig, FromDirMissingOrBadFile) {
  TempDir dir;
  expect_error([&] { ModelConfig::from_dir(dir.path()); }, ErrorKind::kNotFound,
               {dir.path(), "config.json"});
  dir.write("config.json", "{\"model_type\": \"qwen3_moe\",");
  expect_error([&] { ModelConfig::from_dir(dir.path()); }, ErrorKind::kIo,
               {dir.path() + "/config.json", "invalid JSON"});
}

struct BadCase {
  const char* what;
  std::function<void(Json&)> edit;
  ErrorKind kind;
  std::vector<std::string> needles;  // besides the file name
};

TEST(ModelConfig, ErrorsNameFileAndField) {
  using K = ErrorKind;
  const std::vector<BadCase> cases = {
      {"unknown model_type",
       [](Json& j) { j["model_type"] = "llama"; },
       K::kUnsupported,
       {"model_type", "llama"}},
      {"unknown architecture",
       [](Json& j) { j["architectures"] = {"Qwen3MoeForSequenceClassification"}; },
       K::kUnsupported,
       {"architectures", "Qwen3MoeForSequenceClassification"}},
      {"missing model_type",
       [](Json& j) { j.erase("model_type"); },
       K::kInvalidArgument,
       {"model_type", "missing"}},
      {"model_type not a string",
       [](Json& j) { j["model_type"] = 3; },
       K::kInvalidArgument,
       {"model_type"}},
      {"string size",
       [](Json& j) { j["hidden_size"] = "2048"; },
       K::kInvalidArgument,
       {"hidden_size", "integer", "string"}},
      {"float size",
       [](Json& j) { j["num_hidden_layers"] = 48.5; },
       K::kInvalidArgument,
       {"num_hidden_layers"}},
      {"null size",
       [](Json& j) { j["vocab_size"] = nullptr; },
       K::kInvalidArgument,
       {"vocab_size"}},
      {"bool as int",
       [](Json& j) { j["norm_topk_prob"] = 1; },
       K::kInvalidArgument,
       {"norm_topk_prob", "boolean"}},
      {"string theta",
       [](Json& j) { j["rope_theta"] = "1e6"; },
       K::kInvalidArgument,
       {"rope_theta"}},
      {"bad mlp_only_layers",
       [](Json& j) { j["mlp_only_layers"] = {1.5}; },
       K::kInvalidArgument,
       {"mlp_only_layers"}},
      {"mlp_only_layers not a list",
       [](Json& j) { j["mlp_only_layers"] = 3; },
       K::kInvalidArgument,
       {"mlp_only_layers"}},
      {"mlp_only_layers out of range",
       [](Json& j) { j["mlp_only_layers"] = {48}; },
       K::kInvalidArgument,
       {"mlp_only_layers", "48"}},
      {"bad eos", [](Json& j) { j["eos_token_id"] = "x"; }, K::kInvalidArgument, {"eos_token_id"}},
      {"eos outside vocab",
       [](Json& j) {
         j["eos_token_id"] = {1, 999999};
       },
       K::kInvalidArgument,
       {"eos_token_id", "999999"}},
      {"heads not divisible",
       [](Json& j) { j["num_key_value_heads"] = 5; },
       K::kInvalidArgument,
       {"num_attention_heads", "num_key_value_heads"}},
      {"top-k > experts",
       [](Json& j) { j["num_experts_per_tok"] = 129; },
       K::kInvalidArgument,
       {"num_experts_per_tok", "num_experts"}},
      {"top-k zero",
       [](Json& j) { j["num_experts_per_tok"] = 0; },
       K::kInvalidArgument,
       {"num_experts_per_tok"}},
      {"negative experts",
       [](Json& j) { j["num_experts"] = -1; },
       K::kInvalidArgument,
       {"num_experts"}},
      {"experts disagree",
       [](Json& j) { j["num_local_experts"] = 64; },
       K::kInvalidArgument,
       {"num_experts", "num_local_experts"}},
      {"zero hidden", [](Json& j) { j["hidden_size"] = 0; }, K::kInvalidArgument, {"hidden_size"}},
      {"negative layers",
       [](Json& j) { j["num_hidden_layers"] = -2; },
       K::kInvalidArgument,
       {"num_hidden_layers"}},
      {"zero heads",
       [](Json& j) { j["num_attention_heads"] = 0; },
       K::kInvalidArgument,
       {"num_attention_heads"}},
      {"zero kv heads",
       [](Json& j) { j["num_key_value_heads"] = 0; },
       K::kInvalidArgument,
       {"num_key_value_heads"}},
      {"zero head_dim", [](Json& j) { j["head_dim"] = 0; }, K::kInvalidArgument, {"head_dim"}},
      {"zero expert width",
       [](Json& j) { j["moe_intermediate_size"] = 0; },
       K::kInvalidArgument,
       {"moe_intermediate_size"}},
      {"zero vocab", [](Json& j) { j["vocab_size"] = 0; }, K::kInvalidArgument, {"vocab_size"}},
      {"zero sparse step",
       [](Json& j) { j["decoder_sparse_step"] = 0; },
       K::kInvalidArgument,
       {"decoder_sparse_step"}},
      {"zero eps", [](Json& j) { j["rms_norm_eps"] = 0.0; }, K::kInvalidArgument, {"rms_norm_eps"}},
      {"zero theta", [](Json& j) { j["rope_theta"] = 0.0; }, K::kInvalidArgument, {"rope_theta"}},
      {"yarn rope_scaling",
       [](Json& j) {
         j["rope_scaling"] = {
             {"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
       },
       K::kUnsupported,
       {"rope_scaling", "yarn"}},
      {"legacy linear rope_scaling",
       [](Json& j) {
         j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
       },
       K::kUnsupported,
       {"rope_scaling", "linear"}},
      {"yarn rope_parameters",
       [](Json& j) {
         j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
       },
       K::kUnsupported,
       {"rope_parameters", "yarn"}},
      {"rope_scaling not an object",
       [](Json& j) { j["rope_scaling"] = "yarn"; },
       K::kInvalidArgument,
       {"rope_scaling"}},
      {"attention bias",
       [](Json& j) { j["attention_bias"] = true; },
       K::kUnsupported,
       {"attention_bias"}},
      {"sliding window",
       [](Json& j) { j["use_sliding_window"] = true; },
       K::kUnsupported,
       {"use_sliding_window"}},
      {"activation",
       [](Json& j) { j["hidden_act"] = "gelu"; },
       K::kUnsupported,
       {"hidden_act", "gelu"}},
      {"dtype",
       [](Json& j) { j["torch_dtype"] = "int8"; },
       K::kUnsupported,
       {"torch_dtype", "int8"}},
      {"dtypes disagree",
       [](Json& j) { j["dtype"] = "float16"; },
       K::kInvalidArgument,
       {"dtype", "torch_dtype"}},
  };
  for (const BadCase& bc : cases) {
    SCOPED_TRACE(bc.what);
    Json j = hub_config();
    bc.edit(j);
    std::vector<std::string> needles = bc.needles;
    needles.push_back(kOrigin);
    expect_error([&] { parse(j); }, bc.kind, needles);
  }
}

TEST(ModelConfig, MalformedJson) {
  expect_error([] { ModelConfig::from_json("{\"model_type\": ", kOrigin); }, ErrorKind::kIo,
               {kOrigin, "invalid JSON"});
  expect_error([] { ModelConfig::from_json("[1, 2]", kOrigin); }, ErrorKind::kInvalidArgument,
               {kOrigin, "object"});
  expect_error([] { ModelConfig::from_json("", kOrigin); }, ErrorKind::kIo, {kOrigin});
}

}  // namespace
}  // namespace tandem
