// Test helper: random MTP weights (mtp.* tensors, fp32 safetensors) for a Qwen3-MoE
// checkpoint, written into a directory of their own (--speculative-config "model": DIR).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"

namespace tandem::testing {

/// Writes DIR/model.safetensors with the MTP layer of `model_dir`'s architecture: matrices
/// N(0, std^2), norms 1 + U(-0.05, 0.05). A MoE layer when the model has experts. Qwen3.5
/// hybrids get their published layout: a gated q_proj (query and gate rows per head), the
/// shared expert and its gate, zero-centred norms (U(-0.05, 0.05), loaded as 1 + w).
inline void write_random_mtp(const std::string& model_dir, const std::string& dir, uint64_t seed,
                             float std_dev = 0.05f) {
  const ModelConfig c = ModelConfig::from_dir(model_dir);
  const int64_t h = c.hidden_size, d = c.head_dim;
  std::vector<std::pair<std::string, std::vector<int64_t>>> t;  // name, shape
  std::vector<bool> norm;
  auto add = [&](const std::string& n, std::vector<int64_t> s, bool is_norm = false) {
    t.emplace_back(n, std::move(s));
    norm.push_back(is_norm);
  };
  add("mtp.fc.weight", {h, 2 * h});
  add("mtp.pre_fc_norm_embedding.weight", {h}, true);
  add("mtp.pre_fc_norm_hidden.weight", {h}, true);
  add("mtp.norm.weight", {h}, true);
  const std::string p = "mtp.layers.0.";
  add(p + "input_layernorm.weight", {h}, true);
  add(p + "post_attention_layernorm.weight", {h}, true);
  const bool hybrid = c.is_hybrid();
  add(p + "self_attn.q_proj.weight", {c.num_attention_heads * d * (hybrid ? 2 : 1), h});
  add(p + "self_attn.k_proj.weight", {c.num_key_value_heads * d, h});
  add(p + "self_attn.v_proj.weight", {c.num_key_value_heads * d, h});
  add(p + "self_attn.o_proj.weight", {h, c.num_attention_heads * d});
  add(p + "self_attn.q_norm.weight", {d}, true);
  add(p + "self_attn.k_norm.weight", {d}, true);
  if (c.num_experts > 0) {
    add(p + "mlp.gate.weight", {c.num_experts, h});
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      add(q + "gate_proj.weight", {c.moe_intermediate_size, h});
      add(q + "up_proj.weight", {c.moe_intermediate_size, h});
      add(q + "down_proj.weight", {h, c.moe_intermediate_size});
    }
    if (hybrid) {
      const int64_t si = c.shared_expert_intermediate_size;
      add(p + "mlp.shared_expert.gate_proj.weight", {si, h});
      add(p + "mlp.shared_expert.up_proj.weight", {si, h});
      add(p + "mlp.shared_expert.down_proj.weight", {h, si});
      add(p + "mlp.shared_expert_gate.weight", {1, h});
    }
  } else {
    add(p + "mlp.gate_proj.weight", {c.intermediate_size, h});
    add(p + "mlp.up_proj.weight", {c.intermediate_size, h});
    add(p + "mlp.down_proj.weight", {h, c.intermediate_size});
  }
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, std_dev);
  std::uniform_real_distribution<float> ud(-0.05f, 0.05f);
  nlohmann::json header = nlohmann::json::object();
  std::vector<float> data;
  for (size_t i = 0; i < t.size(); ++i) {
    int64_t n = 1;
    for (int64_t s : t[i].second) n *= s;
    const auto begin = static_cast<int64_t>(data.size() * sizeof(float));
    for (int64_t j = 0; j < n; ++j) {
      data.push_back(norm[i] ? (hybrid ? 0.0f : 1.0f) + ud(rng) : nd(rng));
    }
    header[t[i].first] = {
        {"dtype", "F32"}, {"shape", t[i].second}, {"data_offsets", {begin, begin + n * 4}}};
  }
  std::string hs = header.dump();
  while (hs.size() % 8 != 0) hs += ' ';
  std::filesystem::create_directories(dir);
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  const uint64_t len = hs.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(hs.data(), static_cast<std::streamsize>(hs.size()));
  out.write(reinterpret_cast<const char*>(data.data()),
            static_cast<std::streamsize>(data.size() * sizeof(float)));
}

/// write_random_mtp(model_dir, DIR, 7) into a temporary DIR of its own, once per process and
/// model (removed at exit): random MTP weights draft nearly nothing acceptable, which the
/// losslessness tests want (the output must not change anyway).
inline const std::string& random_mtp_dir(const std::string& model_dir) {
  struct Dirs : std::map<std::string, std::string> {
    ~Dirs() {
      for (const auto& [model, dir] : *this) std::filesystem::remove_all(dir);
    }
  };
  static Dirs dirs;
  std::string& d = dirs[model_dir];
  if (d.empty()) {
    d = (std::filesystem::temp_directory_path() /
         ("tandem_mtp_" + std::filesystem::path(model_dir).filename().string() + "_" +
          std::to_string(::getpid())))
            .string();
    write_random_mtp(model_dir, d, 7);
  }
  return d;
}

}  // namespace tandem::testing
