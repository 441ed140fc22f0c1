// Qwen3.5 hybrid MoE: config.json as published (both layouts), bad input naming config.json or
// the tensor, and forward properties on the golden fixtures (chunked prefill equals one prefill,
// state slots are independent, a chunk at position 0 resets the state).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "core/error.h"
#include "model/config.h"
#include "model/convert.h"
#include "model/qwen3_5_moe.h"

namespace tandem {
namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

std::string source_dir() {
  const char* env = std::getenv("TANDEM_SOURCE_DIR");
  return env ? env : TANDEM_SOURCE_DIR;
}
std::string fixture(const std::string& name) {
  return source_dir() + "/tests/data/fixtures/" + name;
}
const char* kText = "qwen35_text_hd64_int2_fused";
const char* kVl = "qwen35_vl_hd256_int4_tied_bf16";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The published Qwen3.5-35B-A3B config.json's language part (vision_config abridged).
Json published_config() {
  return Json::parse(R"({
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "image_token_id": 248056,
    "model_type": "qwen3_5_moe",
    "text_config": {
      "attention_bias": false, "attention_dropout": 0.0, "attn_output_gate": true,
      "bos_token_id": 248044, "dtype": "bfloat16", "eos_token_id": 248044,
      "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
      "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
      "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
      "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
      "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
      "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": false,
      "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8,
      "num_hidden_layers": 40, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
      "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
      "use_cache": true, "vocab_size": 248320,
      "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                          "rope_type": "default", "rope_theta": 10000000,
                          "partial_rotary_factor": 0.25}
    },
    "tie_word_embeddings": false,
    "transformers_version": "4.57.0.dev0",
    "video_token_id": 248057,
    "vision_config": {"deepstack_visual_indexes": [], "depth": 27, "hidden_size": 1152},
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053
  })");
}

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

/// A copy of a fixture directory under the temp dir, removed on destruction.
class FixtureCopy {
 public:
  explicit FixtureCopy(const std::string& name) {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("tandem_qwen35_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::copy(fixture(name), path_, fs::copy_options::recursive);
  }
  ~FixtureCopy() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string dir() const { return path_.string(); }
  std::string config_path() const { return (path_ / "config.json").string(); }
  Json config() const { return Json::parse(read_file(config_path())); }
  void write_config(const Json& j) const { std::ofstream(config_path()) << j.dump(2); }
  /// Renames a tensor in the safetensors header (same length: the offsets stay valid).
  void rename_tensor(const std::string& from, const std::string& to) const {
    ASSERT_EQ(from.size(), to.size());
    const std::string path = (path_ / "model.safetensors").string();
    std::string bytes = read_file(path);
    const size_t at = bytes.find("\"" + from + "\"");
    ASSERT_NE(at, std::string::npos) << from;
    bytes.replace(at + 1, from.size(), to);
    std::ofstream(path, std::ios::binary) << bytes;
  }

 private:
  fs::path path_;
};

TEST(Qwen35Config, PublishedImageTextConfig) {
  ModelConfig c = ModelConfig::from_json(published_config().dump(), "/ckpt/config.json");
  EXPECT_EQ(c.model_type, "qwen3_5_moe");
  EXPECT_TRUE(c.is_hybrid());
  EXPECT_EQ(c.weight_prefix, "model.language_model.");
  EXPECT_EQ(c.hidden_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 40);
  ASSERT_EQ(c.layer_types.size(), 40u);
  for (int l = 0; l < 40; ++l) {
    EXPECT_EQ(c.layer_types[l], (l + 1) % 4 == 0 ? ModelConfig::LayerType::kFullAttention
                                                 : ModelConfig::LayerType::kLinearAttention)
        << l;
  }
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.rotary_dim(), 64);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.linear_num_key_heads, 16);
  EXPECT_EQ(c.linear_num_value_heads, 32);
  EXPECT_EQ(c.linear_key_head_dim, 128);
  EXPECT_EQ(c.linear_value_head_dim, 128);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.moe_intermediate_size, 512);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_TRUE(c.attn_output_gate);
  EXPECT_EQ(c.mtp_num_hidden_layers, 1);
  EXPECT_EQ(c.ssm_state_dtype, DType::kF32);
  EXPECT_EQ(c.dtype, DType::kBF16);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{248044});
  EXPECT_EQ(c.max_position_embeddings, 262144);
  for (int l = 0; l < 40; ++l) EXPECT_TRUE(c.is_moe_layer(l));
}

TEST(Qwen35Config, BlockFp8QuantizationConfig) {
  // Qwen's -FP8 checkpoints: quantization_config at the top level of the image-text config.
  Json j = published_config();
  EXPECT_EQ(ModelConfig::from_json(j.dump(), "/ckpt/config.json").quant.method, WeightQuant::kNone);
  j["quantization_config"] = {{"quant_method", "fp8"},
                              {"fmt", "e4m3"},
                              {"activation_scheme", "dynamic"},
                              {"weight_block_size", {128, 128}},
                              {"modules_to_not_convert", {"lm_head", "model.visual"}}};
  const ModelConfig c = ModelConfig::from_json(j.dump(), "/ckpt/config.json");
  EXPECT_EQ(c.quant.method, WeightQuant::kFp8Block);
  EXPECT_EQ(c.quant.block_rows, 128);
  EXPECT_EQ(c.quant.block_cols, 128);
  EXPECT_EQ(c.quant.not_converted, (std::vector<std::string>{"lm_head", "model.visual"}));
  // Inside text_config (the fallback), and refused like Qwen3-MoE's when unsupported.
  Json t = published_config();
  t["text_config"]["quantization_config"] = j["quantization_config"];
  EXPECT_EQ(ModelConfig::from_json(t.dump(), "/ckpt/config.json").quant.method,
            WeightQuant::kFp8Block);
  j["quantization_config"]["weight_block_size"] = {64, 64};
  EXPECT_THROW((void)ModelConfig::from_json(j.dump(), "/ckpt/config.json"), Error);
  // The DeltaNet linears Qwen quantizes are linears to `tandem convert`; the MTP layer is not.
  EXPECT_EQ(linear_kind("model.language_model.layers.0.linear_attn.in_proj_qkv.weight"),
            "linear_attn.in_proj_qkv");
  EXPECT_EQ(linear_kind("model.layers.2.linear_attn.out_proj.weight"), "linear_attn.out_proj");
  EXPECT_EQ(linear_kind("model.layers.2.linear_attn.in_proj_b.weight"), "");
  EXPECT_EQ(linear_kind("model.layers.2.mlp.shared_expert.up_proj.weight"),
            "shared_expert.up_proj");
  EXPECT_EQ(linear_kind("mtp.layers.0.mlp.experts.3.up_proj.weight"), "");
}

TEST(Qwen35Config, TextOnlyLayoutAndFixtures) {
  Json text = published_config()["text_config"];
  text["architectures"] = {"Qwen3_5MoeForCausalLM"};
  ModelConfig c = ModelConfig::from_json(text.dump(), "/ckpt/config.json");
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_EQ(c.layer_types.size(), 40u);

  ModelConfig t = ModelConfig::from_dir(fixture(kText));
  EXPECT_EQ(t.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(t.num_hidden_layers, 4);
  EXPECT_EQ(t.layer_types[0], ModelConfig::LayerType::kLinearAttention);
  EXPECT_EQ(t.layer_types[1], ModelConfig::LayerType::kFullAttention);
  EXPECT_EQ(t.rotary_dim(), 16);
  ModelConfig v = ModelConfig::from_dir(fixture(kVl));
  EXPECT_EQ(v.model_type, "qwen3_5_moe");
  EXPECT_TRUE(v.tie_word_embeddings);
  EXPECT_EQ(v.head_dim, 256);
  EXPECT_EQ(v.layer_types[3], ModelConfig::LayerType::kFullAttention);
  EXPECT_EQ(v.layer_types[2], ModelConfig::LayerType::kLinearAttention);
  EXPECT_EQ(v.mtp_num_hidden_layers, 1);
}

TEST(Qwen35Config, BadInputNamesConfigJsonAndField) {
  const std::string origin = "/ckpt/Qwen3.5/config.json";
  auto parse_with = [&](const std::function<void(Json&)>& edit) {
    Json j = published_config();
    edit(j["text_config"]);
    return [j, origin] { ModelConfig::from_json(j.dump(), origin); };
  };
  Json types = Json::array();
  for (int l = 0; l < 40; ++l) types.push_back(l == 5 ? "sliding_attention" : "linear_attention");
  expect_error(parse_with([&](Json& t) { t["layer_types"] = types; }), ErrorKind::kUnsupported,
               {origin, "text_config.layer_types", "sliding_attention", "entry 5"});
  expect_error(parse_with([](Json& t) { t["layer_types"] = {"full_attention"}; }),
               ErrorKind::kInvalidArgument, {origin, "text_config.layer_types", "40 layers"});
  expect_error(parse_with([](Json& t) { t["mamba_ssm_dtype"] = "bfloat16"; }),
               ErrorKind::kUnsupported, {origin, "text_config.mamba_ssm_dtype", "bfloat16"});
  expect_error(parse_with([](Json& t) { t["mamba_ssm_dtype"] = "int4"; }), ErrorKind::kUnsupported,
               {origin, "mamba_ssm_dtype", "int4"});
  expect_error(parse_with([](Json& t) { t["attn_output_gate"] = false; }), ErrorKind::kUnsupported,
               {origin, "text_config.attn_output_gate"});
  expect_error(parse_with([](Json& t) { t["linear_num_value_heads"] = 24; }),
               ErrorKind::kInvalidArgument, {origin, "text_config.linear_num_value_heads"});
  expect_error(parse_with([](Json& t) { t["rope_parameters"]["rope_type"] = "yarn"; }),
               ErrorKind::kUnsupported, {origin, "rope_type", "yarn"});
  expect_error(parse_with([](Json& t) { t["hidden_size"] = "x"; }), ErrorKind::kInvalidArgument,
               {origin, "text_config.hidden_size"});
  Json no_text = published_config();
  no_text.erase("text_config");
  expect_error([&] { ModelConfig::from_json(no_text.dump(), origin); }, ErrorKind::kInvalidArgument,
               {origin, "text_config"});
  Json arch = published_config();
  arch["architectures"] = {"Qwen3_5MoeForSomething"};
  expect_error([&] { ModelConfig::from_json(arch.dump(), origin); }, ErrorKind::kUnsupported,
               {origin, "architectures", "Qwen3_5MoeForSomething"});
}

TEST(Qwen35Model, BadCheckpointNamesTheTensorOrConfig) {
  {  // A DeltaNet tensor missing (renamed away).
    FixtureCopy f(kText);
    f.rename_tensor("model.layers.2.linear_attn.A_log", "model.layers.2.linear_attn.A_loX");
    expect_error([&] { Qwen35MoeCpu::load(f.dir()); }, ErrorKind::kNotFound,
                 {"model.layers.2.linear_attn.A_log"});
  }
  {
    FixtureCopy f(kVl);
    f.rename_tensor("model.language_model.layers.0.linear_attn.conv1d.weight",
                    "model.language_model.layers.0.linear_attn.conv1d.weighX");
    expect_error([&] { load_cpu_model(f.dir()); }, ErrorKind::kNotFound,
                 {"model.language_model.layers.0.linear_attn.conv1d.weight"});
  }
  {  // An unsupported layer type.
    FixtureCopy f(kText);
    Json j = f.config();
    j["layer_types"][2] = "mamba";
    f.write_config(j);
    expect_error([&] { load_cpu_model(f.dir()); }, ErrorKind::kUnsupported,
                 {f.config_path(), "layer_types", "mamba"});
  }
  {  // A state dtype we do not keep.
    FixtureCopy f(kVl);
    Json j = f.config();
    j["text_config"]["mamba_ssm_dtype"] = "float16";
    f.write_config(j);
    expect_error([&] { load_cpu_model(f.dir()); }, ErrorKind::kUnsupported,
                 {f.config_path(), "text_config.mamba_ssm_dtype", "float16"});
  }
  // The Qwen3-MoE class refuses a hybrid checkpoint, naming config.json.
  expect_error([&] { Qwen3MoeCpu::load(fixture(kText)); }, ErrorKind::kUnsupported,
               {"config.json", "qwen3_5_moe_text"});
}

// One forward over `seqs` chunks of the same prompt; returns the last row's logits.
struct Runner {
  Model& model;
  KvCache kv;
  explicit Runner(Model& m, int64_t pages = 256, int64_t page_size = 4)
      : model(m), kv(m.make_kv_cache(pages, page_size)) {
    kv.allocate_states(4, m.state_slot_elems());
  }
  std::vector<float> prefill(const std::vector<int32_t>& ids, const std::vector<int64_t>& chunks,
                             int32_t slot, int32_t first_page) {
    const int64_t ps = kv.geometry().page_size;
    std::vector<int32_t> table;
    for (int64_t p = 0; p < (static_cast<int64_t>(ids.size()) + ps - 1) / ps; ++p) {
      table.push_back(first_page + static_cast<int32_t>(p));
    }
    std::vector<float> logits;
    int64_t pos = 0;
    for (int64_t len : chunks) {
      ForwardBatch b;
      b.seqs.push_back({ids.data() + pos, len, pos, table.data(),
                        static_cast<int64_t>(table.size()), LogitsMode::kLast, slot});
      model.forward(b, kv, logits);
      pos += len;
    }
    EXPECT_EQ(pos, static_cast<int64_t>(ids.size()));
    return logits;
  }
};

TEST(Qwen35Model, ChunkedPrefillEqualsOnePrefillAndSlotsAreIndependent) {
  for (const char* name : {kText, kVl}) {
    SCOPED_TRACE(name);
    auto model = load_cpu_model(fixture(name));
    ASSERT_GT(model->state_slot_elems(), 0);
    std::vector<int32_t> ids;
    for (int i = 0; i < 37; ++i) ids.push_back((i * 7 + 3) % 200);
    Runner r(*model);
    auto one = r.prefill(ids, {37}, 0, 0);
    auto chunked = r.prefill(ids, {1, 5, 4, 16, 11}, 1, 20);
    ASSERT_EQ(one.size(), static_cast<size_t>(model->config().vocab_size));
    EXPECT_EQ(one, chunked);  // bit-identical: the recurrent rule carries the state exactly
    // Slot 0 re-used from position 0: its old state is discarded.
    auto again = r.prefill(ids, {20, 17}, 0, 40);
    EXPECT_EQ(again, one);
    // A different prompt in slot 2 does not disturb slot 1 (continue slot 1 by one token).
    std::vector<int32_t> other(ids.rbegin(), ids.rend());
    auto o = r.prefill(other, {37}, 2, 60);
    EXPECT_NE(o, one);
    std::vector<int32_t> ext = ids;
    ext.push_back(5);
    auto full = r.prefill(ext, {38}, 3, 80);
    std::vector<float> step;
    {
      std::vector<int32_t> table;
      for (int p = 0; p < 10; ++p) table.push_back(20 + p);
      ForwardBatch b;
      b.seqs.push_back({ext.data() + 37, 1, 37, table.data(), 10, LogitsMode::kLast, 1});
      model->forward(b, r.kv, step);
    }
    EXPECT_EQ(step, full);
  }
}

// Model::replay_states: the state after a prefix of the last forward's chunks, from the inputs
// that forward kept, equals a forward over that prefix from the same state.
TEST(Qwen35Model, ReplayStatesEqualsAForwardOverThePrefix) {
  for (const char* name : {kText, kVl}) {
    SCOPED_TRACE(name);
    auto model = load_cpu_model(fixture(name));
    Runner r(*model);
    std::vector<int32_t> a, b;
    for (int i = 0; i < 25; ++i) a.push_back((i * 7 + 3) % 200);
    for (int i = 0; i < 17; ++i) b.push_back((i * 11 + 5) % 200);
    r.prefill({a.begin(), a.begin() + 20}, {20}, 0, 0);
    r.prefill({b.begin(), b.begin() + 13}, {13}, 1, 10);
    auto state = [&](int32_t slot) {
      const auto s = r.kv.read_state(slot);
      return std::vector<float>(s.begin(), s.end());
    };
    const std::vector<float> snap_a = state(0), snap_b = state(1);
    std::vector<int32_t> table_a = {0, 1, 2, 3, 4, 5, 6}, table_b = {10, 11, 12, 13, 14};
    auto verify = [&](int32_t slot_a, int64_t na, int32_t slot_b, int64_t nb, bool keep) {
      ForwardBatch fb;
      fb.keep_recurrent_inputs = keep;
      fb.seqs.push_back({a.data() + 20, na, 20, table_a.data(), 7, LogitsMode::kAll, slot_a});
      fb.seqs.push_back({b.data() + 13, nb, 13, table_b.data(), 5, LogitsMode::kAll, slot_b});
      std::vector<float> logits;
      model->forward(fb, r.kv, logits);
    };
    verify(0, 5, 1, 4, /*keep=*/true);
    const std::vector<float> after_all = state(0);
    r.kv.write_state(0, snap_a.data());
    r.kv.write_state(1, snap_b.data());
    ASSERT_TRUE(model->replay_states({{0, 0, 3}, {1, 5, 1}}, r.kv));
    EXPECT_FALSE(model->replay_states({{0, 0, 3}}, r.kv)) << "the kept inputs replay once";
    const std::vector<float> got_a = state(0), got_b = state(1);
    // The reference: the same states in slots 2 and 3, forward over the prefixes only.
    r.kv.write_state(2, snap_a.data());
    r.kv.write_state(3, snap_b.data());
    verify(2, 3, 3, 1, /*keep=*/false);
    EXPECT_FALSE(model->replay_states({{2, 0, 1}}, r.kv)) << "that forward kept nothing";
    const std::vector<float> want_a = state(2), want_b = state(3);
    double worst = 0, moved = 0;
    for (size_t i = 0; i < want_a.size(); ++i) {
      worst = std::max<double>(worst, std::fabs(got_a[i] - want_a[i]));
      worst = std::max<double>(worst, std::fabs(got_b[i] - want_b[i]));
      moved = std::max<double>(moved, std::fabs(after_all[i] - want_a[i]));
    }
    EXPECT_LE(worst, 1e-5);
    EXPECT_GT(moved, 1e-3) << "the two extra tokens change the state (the test can fail)";
    // Rows that start no chunk, or past it, are refused.
    verify(0, 5, 1, 4, /*keep=*/true);
    EXPECT_THROW(model->replay_states({{0, 0, 6}}, r.kv), Error);
  }
}

TEST(Qwen35Model, KvGeometryCoversTheFullAttentionLayersOnly) {
  auto model = Qwen35MoeCpu::load(fixture(kVl));
  EXPECT_EQ(model->num_attention_layers(), 1);
  EXPECT_EQ(model->num_linear_layers(), 3);
  KvGeometry g = model->kv_geometry(8, 16);
  EXPECT_EQ(g.num_layers, 1);
  EXPECT_EQ(g.head_dim, 256);
  EXPECT_EQ(g.num_kv_heads, 2);
  const auto& c = model->config();
  const int64_t conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                           c.linear_num_value_heads * c.linear_value_head_dim;
  EXPECT_EQ(model->state_slot_elems(),
            3 * (conv_dim * 3 +
                 c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim));
  // Forward without state slots is refused, not a crash.
  KvCache kv = model->make_kv_cache(8, 16);
  std::vector<int32_t> ids = {1, 2, 3}, table = {0};
  ForwardBatch b;
  b.seqs.push_back({ids.data(), 3, 0, table.data(), 1, LogitsMode::kLast, 0});
  std::vector<float> logits;
  EXPECT_THROW(model->forward(b, kv, logits), Error);
}

}  // namespace
}  // namespace tandem
