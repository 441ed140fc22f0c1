// Writes a Hugging Face style Qwen3-MoE or Qwen3.5-MoE checkpoint of random bf16 (or block-FP8)
// weights at real shapes, for loading / memory / speed work without downloading a model:
// config.json, generation_config.json, model.safetensors.index.json and
// model-0000i-of-0000N.safetensors shards of at most --shard-gb GB, tensor names as the hub's
// Qwen3MoeForCausalLM, or (a qwen3.5 preset) as Qwen3_5MoeForConditionalGeneration's language model
// (image-text layout, model.language_model.*, no vision tower; MTP weights with --mtp).
//
//   make_random_checkpoint --out DIR [--preset qwen3-30b-a3b|qwen3-235b-a22b|qwen3.5-35b-a3b|
//       qwen3.5-122b-a10b|qwen3.5-397b-a17b] [--layers N]
//       [--hidden H] [--intermediate I] [--moe-intermediate M] [--experts E] [--top-k K]
//       [--heads Q] [--kv-heads KV] [--head-dim D] [--vocab V] [--max-position P]
//       [--rope-theta T] [--rms-norm-eps EPS] [--tie-word-embeddings] [--no-norm-topk-prob]
//       [--seed S] [--shard-gb G] [--threads T] [--mtp] [--config-only] [--format bf16|fp8]
//   Qwen3.5 only: [--full-attention-interval N] [--linear-key-heads H] [--linear-value-heads H]
//       [--linear-key-dim D] [--linear-value-dim D] [--shared-intermediate I]
//
// --config-only: config.json and generation_config.json only (no weights), e.g. to check a
// preset's shapes.
// --mtp: also an MTP layer (mtp.fc, mtp.pre_fc_norm_{embedding,hidden}, mtp.layers.0.* as a
// decoder layer, full attention for Qwen3.5, mtp.norm), for speculative decoding benchmarks.
// --format fp8: the checkpoint `tandem convert --format fp8` makes of the bf16 one, written
// directly: the linears convert quantizes (model/convert.h's linear_kind: attention, DeltaNet
// in_proj_qkv / in_proj_z / out_proj, experts, shared expert; not the MTP layer) as F8_E4M3
// weights plus F32 weight_scale_inv [ceil(N / 128), ceil(K / 128)], the rest bf16 as without
// it, config.json with convert's quantization_config (model/convert.h's converted_config_json).
// Values: matrices N(0, 0.02^2) (Irwin-Hall approximation: 4 uniforms), norms 1 + U(-0.05, 0.05)
// (Qwen3.5's zero-centred (1 + w) norms U(-0.05, 0.05), A_log log U(1, 16)). FP8: each 128x128
// block's scale_inv 2.06e-4 x U(0.75, 1.25) (so that the largest matrix value, 2 sqrt(3) 0.02,
// stays within E4M3's 448), the codes the same matrix values (the bf16 checkpoint's, before
// rounding) divided by it and rounded to E4M3 (finite: never the NaN codes 0x7f / 0xff): the
// dequantized weights are the bf16 checkpoint's to E4M3's precision, and every other tensor
// is the bf16 checkpoint's.
// Each 1 Mi-element chunk of each tensor has its own generator seeded from (seed, tensor, chunk),
// so the output is identical for any thread count. Threads fill chunks and pwrite() them into
// pre-sized shard files: the speed is the disk's (about 30 GB/s of generation on 16 cores).
// Standard library + POSIX, and libtandem_model for convert's rules (linear_kind, the config); the
// safetensors header JSON is written by hand.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"
#include "model/convert.h"

namespace {

struct Config {
  int64_t hidden = 2048, intermediate = 6144, moe_intermediate = 768, experts = 128, top_k = 8;
  int64_t layers = 48, heads = 32, kv_heads = 4, head_dim = 128, vocab = 151936;
  int64_t max_position = 40960;
  double rope_theta = 1e6, rms_norm_eps = 1e-6;
  bool tie = false, norm_topk_prob = true;
  bool mtp = false;
  // Qwen3.5 hybrid (gated DeltaNet + gated attention, shared expert).
  bool qwen35 = false;
  int64_t full_interval = 4, lin_k_heads = 16, lin_v_heads = 32, lin_k_dim = 128, lin_v_dim = 128;
  int64_t conv_kernel = 4, shared_intermediate = 512;
};

Config preset(std::string const& name) {
  Config c;  // qwen3-30b-a3b
  if (name == "qwen3-30b-a3b") return c;
  if (name == "qwen3-235b-a22b") {
    c.hidden = 4096;
    c.layers = 94;
    c.moe_intermediate = 1536;
    c.intermediate = 12288;
    c.heads = 64;
    c.kv_heads = 4;
    return c;
  }
  if (name == "qwen3.5-35b-a3b" || name == "qwen3.5-122b-a10b" || name == "qwen3.5-397b-a17b") {
    // Qwen/Qwen3.5-35B-A3B's published config.json (text_config).
    c.qwen35 = true;
    c.hidden = 2048;
    c.layers = 40;
    c.experts = 256;
    c.top_k = 8;
    c.moe_intermediate = 512;
    c.shared_intermediate = 512;
    c.intermediate = 512;
    c.heads = 16;
    c.kv_heads = 2;
    c.head_dim = 256;
    c.vocab = 248320;
    c.max_position = 262144;
    c.rope_theta = 1e7;
    // The two larger ones as their published config.json's text_config (huggingface.co/Qwen/
    // Qwen3.5-122B-A10B and Qwen3.5-397B-A17B, as mirrored in Megatron-Bridge / slime model
    // scripts): 32 query / 2 KV heads of 256, 16 key / 64 value linear heads of 128, experts
    // and the shared expert of 1024; vocab, rope and the 3:1 layer pattern as the 35B.
    if (name == "qwen3.5-122b-a10b" || name == "qwen3.5-397b-a17b") {
      const bool big = name == "qwen3.5-397b-a17b";
      c.hidden = big ? 4096 : 3072;
      c.layers = big ? 60 : 48;
      c.experts = big ? 512 : 256;
      c.top_k = big ? 10 : 8;
      c.moe_intermediate = 1024;
      c.shared_intermediate = 1024;
      c.intermediate = 1024;
      c.heads = 32;
      c.kv_heads = 2;
      c.lin_v_heads = 64;
    }
    return c;
  }
  throw std::invalid_argument(
      "unknown --preset '" + name +
      "' (qwen3-30b-a3b, qwen3-235b-a22b, qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b)");
}

// kFp8Matrix: a matrix's E4M3 codes, kScaleInv: its block scales (--format fp8); the others bf16.
enum class Init { kMatrix, kNorm, kZeroNorm, kALog, kFp8Matrix, kScaleInv };

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  Init init;
  int shard = 0;
  uint64_t offset = 0;  // within the shard's data section
  // The generator's tensor id: its index in the bf16 list (so that --format fp8 writes the bf16
  // checkpoint's values); a scale tensor: its weight's id + kScaleId.
  uint32_t id = 0;
  int64_t cols = 0;  // kFp8Matrix / kScaleInv: the weight's columns (K)
  uint64_t numel() const {
    uint64_t n = 1;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    return n;
  }
  uint64_t elem_bytes() const {
    return init == Init::kFp8Matrix ? 1 : init == Init::kScaleInv ? 4 : 2;
  }
  const char* dtype() const {
    return init == Init::kFp8Matrix ? "F8_E4M3" : init == Init::kScaleInv ? "F32" : "BF16";
  }
  uint64_t bytes() const { return numel() * elem_bytes(); }
};

constexpr uint32_t kScaleId = 1u << 22;

// Qwen3.5: every full_interval-th layer is gated full attention, the others gated DeltaNet;
// every layer a routed MoE with a shared expert.
std::vector<Tensor> qwen35_tensor_list(Config const& c) {
  std::vector<Tensor> t;
  const std::string root = "model.language_model.";
  const int64_t h = c.hidden, key_dim = c.lin_k_heads * c.lin_k_dim;
  const int64_t value_dim = c.lin_v_heads * c.lin_v_dim, conv_dim = 2 * key_dim + value_dim;
  t.push_back({root + "embed_tokens.weight", {c.vocab, h}, Init::kMatrix});
  // Layer l of the model; l == c.layers: the MTP layer (--mtp), a full-attention one.
  for (int64_t l = 0; l < c.layers + (c.mtp ? 1 : 0); ++l) {
    const bool mtp = l == c.layers;
    const std::string p =
        mtp ? std::string("mtp.layers.0.") : root + "layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", {h}, Init::kZeroNorm});
    if (mtp || (l + 1) % c.full_interval == 0) {
      const std::string a = p + "self_attn.";
      t.push_back({a + "q_proj.weight", {c.heads * c.head_dim * 2, h}, Init::kMatrix});
      t.push_back({a + "k_proj.weight", {c.kv_heads * c.head_dim, h}, Init::kMatrix});
      t.push_back({a + "v_proj.weight", {c.kv_heads * c.head_dim, h}, Init::kMatrix});
      t.push_back({a + "o_proj.weight", {h, c.heads * c.head_dim}, Init::kMatrix});
      t.push_back({a + "q_norm.weight", {c.head_dim}, Init::kZeroNorm});
      t.push_back({a + "k_norm.weight", {c.head_dim}, Init::kZeroNorm});
    } else {
      const std::string a = p + "linear_attn.";
      t.push_back({a + "in_proj_qkv.weight", {conv_dim, h}, Init::kMatrix});
      t.push_back({a + "in_proj_z.weight", {value_dim, h}, Init::kMatrix});
      t.push_back({a + "in_proj_b.weight", {c.lin_v_heads, h}, Init::kMatrix});
      t.push_back({a + "in_proj_a.weight", {c.lin_v_heads, h}, Init::kMatrix});
      t.push_back({a + "conv1d.weight", {conv_dim, 1, c.conv_kernel}, Init::kMatrix});
      t.push_back({a + "dt_bias", {c.lin_v_heads}, Init::kNorm});
      t.push_back({a + "A_log", {c.lin_v_heads}, Init::kALog});
      t.push_back({a + "norm.weight", {c.lin_v_dim}, Init::kNorm});
      t.push_back({a + "out_proj.weight", {h, value_dim}, Init::kMatrix});
    }
    t.push_back({p + "post_attention_layernorm.weight", {h}, Init::kZeroNorm});
    t.push_back({p + "mlp.gate.weight", {c.experts, h}, Init::kMatrix});
    for (int64_t e = 0; e < c.experts; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      t.push_back({q + "gate_proj.weight", {c.moe_intermediate, h}, Init::kMatrix});
      t.push_back({q + "up_proj.weight", {c.moe_intermediate, h}, Init::kMatrix});
      t.push_back({q + "down_proj.weight", {h, c.moe_intermediate}, Init::kMatrix});
    }
    const std::string sh = p + "mlp.shared_expert.";
    t.push_back({sh + "gate_proj.weight", {c.shared_intermediate, h}, Init::kMatrix});
    t.push_back({sh + "up_proj.weight", {c.shared_intermediate, h}, Init::kMatrix});
    t.push_back({sh + "down_proj.weight", {h, c.shared_intermediate}, Init::kMatrix});
    t.push_back({p + "mlp.shared_expert_gate.weight", {1, h}, Init::kMatrix});
  }
  t.push_back({root + "norm.weight", {h}, Init::kZeroNorm});
  if (!c.tie) t.push_back({"lm_head.weight", {c.vocab, h}, Init::kMatrix});
  if (c.mtp) {  // the published layout's other MTP tensors (zero-centred norms)
    t.push_back({"mtp.fc.weight", {h, 2 * h}, Init::kMatrix});
    t.push_back({"mtp.pre_fc_norm_embedding.weight", {h}, Init::kZeroNorm});
    t.push_back({"mtp.pre_fc_norm_hidden.weight", {h}, Init::kZeroNorm});
    t.push_back({"mtp.norm.weight", {h}, Init::kZeroNorm});
  }
  return t;
}

std::vector<Tensor> tensor_list(Config const& c) {
  if (c.qwen35) return qwen35_tensor_list(c);
  std::vector<Tensor> t;
  t.push_back({"model.embed_tokens.weight", {c.vocab, c.hidden}, Init::kMatrix});
  for (int64_t l = 0; l < c.layers + (c.mtp ? 1 : 0); ++l) {
    // The MTP layer (--mtp) is one more decoder layer under mtp.layers.0.
    const std::string p =
        l < c.layers ? "model.layers." + std::to_string(l) + "." : std::string("mtp.layers.0.");
    t.push_back({p + "input_layernorm.weight", {c.hidden}, Init::kNorm});
    t.push_back({p + "self_attn.q_proj.weight", {c.heads * c.head_dim, c.hidden}, Init::kMatrix});
    t.push_back(
        {p + "self_attn.k_proj.weight", {c.kv_heads * c.head_dim, c.hidden}, Init::kMatrix});
    t.push_back(
        {p + "self_attn.v_proj.weight", {c.kv_heads * c.head_dim, c.hidden}, Init::kMatrix});
    t.push_back({p + "self_attn.o_proj.weight", {c.hidden, c.heads * c.head_dim}, Init::kMatrix});
    t.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, Init::kNorm});
    t.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, Init::kNorm});
    t.push_back({p + "post_attention_layernorm.weight", {c.hidden}, Init::kNorm});
    t.push_back({p + "mlp.gate.weight", {c.experts, c.hidden}, Init::kMatrix});
    for (int64_t e = 0; e < c.experts; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      t.push_back({q + "gate_proj.weight", {c.moe_intermediate, c.hidden}, Init::kMatrix});
      t.push_back({q + "up_proj.weight", {c.moe_intermediate, c.hidden}, Init::kMatrix});
      t.push_back({q + "down_proj.weight", {c.hidden, c.moe_intermediate}, Init::kMatrix});
    }
  }
  t.push_back({"model.norm.weight", {c.hidden}, Init::kNorm});
  if (!c.tie) t.push_back({"lm_head.weight", {c.vocab, c.hidden}, Init::kMatrix});
  if (c.mtp) {
    t.push_back({"mtp.fc.weight", {c.hidden, 2 * c.hidden}, Init::kMatrix});
    t.push_back({"mtp.pre_fc_norm_embedding.weight", {c.hidden}, Init::kNorm});
    t.push_back({"mtp.pre_fc_norm_hidden.weight", {c.hidden}, Init::kNorm});
    t.push_back({"mtp.norm.weight", {c.hidden}, Init::kNorm});
  }
  return t;
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint16_t to_bf16(float f) {  // round to nearest even; values here are finite
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// A matrix value: Irwin-Hall, the sum of 4 U(0,1) (mean 2, variance 1/3), centred and scaled
// to N(0, 0.02^2)'s variance; |value| <= 2 sqrt(3) 0.02.
const float kMatrixScale = 0.02f * std::sqrt(3.0f);
inline float matrix_value(uint64_t& s) {
  const uint64_t r = splitmix(s);
  const float sum =
      static_cast<float>((r & 0xFFFF) + ((r >> 16) & 0xFFFF) + ((r >> 32) & 0xFFFF) + (r >> 48)) *
      (1.0f / 65536.0f);
  return (sum - 2.0f) * kMatrixScale;
}

// FP8 block scales: kScaleBase x U(0.75, 1.25); the largest matrix value over the smallest
// scale is 2 kMatrixScale / (0.75 kScaleBase) = 448, E4M3's largest finite value.
const float kScaleBase = 2.0f * kMatrixScale / (0.75f * 448.0f);

/// The scale_inv of block `block` (row-major over [ceil(N / 128), ceil(K / 128)]) of the
/// weight of generator id `id`.
float block_scale(uint64_t seed, uint32_t id, uint64_t block) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull ^ (uint64_t{id + kScaleId} << 40) ^ block;
  s = splitmix(s);
  const float u = static_cast<float>(splitmix(s) >> 40) * 0x1p-24f;  // [0, 1)
  return kScaleBase * (0.75f + 0.5f * u);
}

/// Fills `out` (n elements of the tensor's dtype) with the elements [first, first + n) of
/// tensor `t`, from the chunk's generator `chunk_seed`; `seed`: --seed (for block scales).
void fill(void* out_bytes, size_t n, Tensor const& t, uint64_t first, uint64_t chunk_seed,
          uint64_t seed) {
  uint64_t s = chunk_seed;
  const Init init = t.init;
  size_t i = 0;
  if (init == Init::kFp8Matrix) {
    // Row by row: each 128-column block's codes are the matrix values over its scale_inv.
    auto* out = static_cast<uint8_t*>(out_bytes);
    const auto k = static_cast<uint64_t>(t.cols);
    const uint64_t bcols = (k + 127) / 128;
    uint64_t row = first / k, col = first % k;
    while (i < n) {  // one run of a row within one block at a time
      const float inv = 1.0f / block_scale(seed, t.id, (row / 128) * bcols + col / 128);
      const uint64_t end = std::min({k, (col / 128 + 1) * 128, col + (n - i)});
      for (; col < end; ++col, ++i) out[i] = tandem::f32_to_f8e4m3(matrix_value(s) * inv);
      if (col == k) {
        col = 0;
        ++row;
      }
    }
    return;
  }
  if (init == Init::kScaleInv) {
    auto* out = static_cast<float*>(out_bytes);
    for (; i < n; ++i) out[i] = block_scale(seed, t.id - kScaleId, first + i);
    return;
  }
  auto* out = static_cast<uint16_t*>(out_bytes);
  if (init == Init::kMatrix) {
    for (; i < n; ++i) out[i] = to_bf16(matrix_value(s));
  } else {
    const float base = init == Init::kZeroNorm ? 0.0f : 1.0f;
    for (; i < n; ++i) {
      const float u = static_cast<float>(splitmix(s) >> 40) * 0x1p-24f;  // [0, 1)
      out[i] = init == Init::kALog ? to_bf16(std::log(1.0f + 15.0f * u))
                                   : to_bf16(base + 0.1f * (u - 0.5f));
    }
  }
}

std::string shape_json(std::vector<int64_t> const& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

std::string shard_name(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i + 1, n);
  return buf;
}

void write_text(std::filesystem::path const& p, std::string const& s) {
  std::ofstream f(p, std::ios::binary);
  f << s;
  if (!f) throw std::runtime_error("cannot write " + p.string());
}

std::string fmt_double(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  std::string s = os.str();
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

// Qwen3.5: the published image-text layout (language model under text_config; the vision
// config abridged: its weights are not written and text serving skips it).
std::string qwen35_config_json(Config const& c) {
  const bool qwen_ids = c.vocab > 248044;
  const int64_t bos = qwen_ids ? 248044 : c.vocab - 2, eos = qwen_ids ? 248046 : c.vocab - 1;
  std::ostringstream o;
  o << "{\n"
    << "  \"architectures\": [\n    \"Qwen3_5MoeForConditionalGeneration\"\n  ],\n"
    << "  \"model_type\": \"qwen3_5_moe\",\n"
    << "  \"text_config\": {\n"
    << "    \"attention_bias\": false,\n"
    << "    \"attn_output_gate\": true,\n"
    << "    \"bos_token_id\": " << bos << ",\n"
    << "    \"dtype\": \"bfloat16\",\n"
    << "    \"eos_token_id\": " << eos << ",\n"
    << "    \"full_attention_interval\": " << c.full_interval << ",\n"
    << "    \"head_dim\": " << c.head_dim << ",\n"
    << "    \"hidden_act\": \"silu\",\n"
    << "    \"hidden_size\": " << c.hidden << ",\n"
    << "    \"linear_conv_kernel_dim\": " << c.conv_kernel << ",\n"
    << "    \"linear_key_head_dim\": " << c.lin_k_dim << ",\n"
    << "    \"linear_num_key_heads\": " << c.lin_k_heads << ",\n"
    << "    \"linear_num_value_heads\": " << c.lin_v_heads << ",\n"
    << "    \"linear_value_head_dim\": " << c.lin_v_dim << ",\n"
    << "    \"mamba_ssm_dtype\": \"float32\",\n"
    << "    \"max_position_embeddings\": " << c.max_position << ",\n"
    << "    \"model_type\": \"qwen3_5_moe_text\",\n"
    << "    \"moe_intermediate_size\": " << c.moe_intermediate << ",\n"
    << "    \"mtp_num_hidden_layers\": " << (c.mtp ? 1 : 0) << ",\n"
    << "    \"num_attention_heads\": " << c.heads << ",\n"
    << "    \"num_experts\": " << c.experts << ",\n"
    << "    \"num_experts_per_tok\": " << c.top_k << ",\n"
    << "    \"num_hidden_layers\": " << c.layers << ",\n"
    << "    \"num_key_value_heads\": " << c.kv_heads << ",\n"
    << "    \"rms_norm_eps\": " << fmt_double(c.rms_norm_eps) << ",\n"
    << "    \"rope_parameters\": {\n"
    << "      \"mrope_interleaved\": true,\n"
    << "      \"mrope_section\": [11, 11, 10],\n"
    << "      \"partial_rotary_factor\": 0.25,\n"
    << "      \"rope_theta\": " << fmt_double(c.rope_theta) << ",\n"
    << "      \"rope_type\": \"default\"\n"
    << "    },\n"
    << "    \"shared_expert_intermediate_size\": " << c.shared_intermediate << ",\n"
    << "    \"tie_word_embeddings\": " << (c.tie ? "true" : "false") << ",\n"
    << "    \"vocab_size\": " << c.vocab << "\n"
    << "  },\n"
    << "  \"tie_word_embeddings\": " << (c.tie ? "true" : "false") << ",\n"
    << "  \"transformers_version\": \"5.24.0\",\n"
    << "  \"vision_config\": {\"depth\": 0, \"model_type\": \"qwen3_5_moe_vision\"}\n"
    << "}\n";
  return o.str();
}

std::string config_json(Config const& c) {
  if (c.qwen35) return qwen35_config_json(c);
  const bool qwen_ids = c.vocab > 151645;
  const int64_t bos = qwen_ids ? 151643 : c.vocab - 2, eos = qwen_ids ? 151645 : c.vocab - 1;
  std::ostringstream o;
  o << "{\n"
    << "  \"architectures\": [\n    \"Qwen3MoeForCausalLM\"\n  ],\n"
    << "  \"attention_bias\": false,\n"
    << "  \"attention_dropout\": 0.0,\n"
    << "  \"bos_token_id\": " << bos << ",\n"
    << "  \"decoder_sparse_step\": 1,\n"
    << "  \"eos_token_id\": " << eos << ",\n"
    << "  \"head_dim\": " << c.head_dim << ",\n"
    << "  \"hidden_act\": \"silu\",\n"
    << "  \"hidden_size\": " << c.hidden << ",\n"
    << "  \"initializer_range\": 0.02,\n"
    << "  \"intermediate_size\": " << c.intermediate << ",\n"
    << "  \"max_position_embeddings\": " << c.max_position << ",\n"
    << "  \"max_window_layers\": " << c.layers << ",\n"
    << "  \"mlp_only_layers\": [],\n"
    << "  \"model_type\": \"qwen3_moe\",\n"
    << "  \"moe_intermediate_size\": " << c.moe_intermediate << ",\n"
    << "  \"norm_topk_prob\": " << (c.norm_topk_prob ? "true" : "false") << ",\n"
    << "  \"num_attention_heads\": " << c.heads << ",\n"
    << "  \"num_experts\": " << c.experts << ",\n"
    << "  \"num_experts_per_tok\": " << c.top_k << ",\n"
    << "  \"num_hidden_layers\": " << c.layers << ",\n"
    << "  \"num_key_value_heads\": " << c.kv_heads << ",\n"
    << "  \"output_router_logits\": false,\n"
    << "  \"rms_norm_eps\": " << fmt_double(c.rms_norm_eps) << ",\n"
    << "  \"rope_scaling\": null,\n"
    << "  \"rope_theta\": " << fmt_double(c.rope_theta) << ",\n"
    << "  \"router_aux_loss_coef\": 0.001,\n"
    << "  \"sliding_window\": null,\n"
    << "  \"tie_word_embeddings\": " << (c.tie ? "true" : "false") << ",\n"
    << "  \"torch_dtype\": \"bfloat16\",\n"
    << "  \"transformers_version\": \"4.51.0\",\n"
    << "  \"use_cache\": true,\n"
    << "  \"use_sliding_window\": false,\n"
    << "  \"vocab_size\": " << c.vocab << "\n"
    << "}\n";
  return o.str();
}

std::string generation_config_json(Config const& c) {
  const bool qwen_ids = c.qwen35 ? c.vocab > 248044 : c.vocab > 151645;
  const int64_t bos = qwen_ids ? (c.qwen35 ? 248044 : 151643) : c.vocab - 2;
  const int64_t eos = qwen_ids ? (c.qwen35 ? 248046 : 151645) : c.vocab - 1;
  std::ostringstream o;
  o << "{\n  \"bos_token_id\": " << bos << ",\n  \"do_sample\": true,\n  \"eos_token_id\": [\n    "
    << eos << ",\n    " << bos << "\n  ],\n  \"pad_token_id\": " << bos
    << ",\n  \"temperature\": 0.6,\n  \"top_k\": 20,\n  \"top_p\": 0.95,\n"
    << "  \"transformers_version\": \"4.51.0\"\n}\n";
  return o.str();
}

struct Args {
  std::string out;
  Config c;
  uint64_t seed = 0;
  double shard_gb = 4.0;
  unsigned threads = 0;
  bool config_only = false;
  bool fp8 = false;  // --format fp8
};

[[noreturn]] void usage(std::string const& msg) {
  std::fprintf(stderr,
               "make_random_checkpoint: %s\n"
               "usage: make_random_checkpoint --out DIR [--preset qwen3-30b-a3b|qwen3-235b-a22b|\n"
               "  qwen3.5-35b-a3b|qwen3.5-122b-a10b|qwen3.5-397b-a17b]\n"
               "  [--layers N] [--hidden H] [--intermediate I] [--moe-intermediate M]\n"
               "  [--experts E] [--top-k K] [--heads Q] [--kv-heads KV] [--head-dim D]\n"
               "  [--vocab V] [--max-position P] [--rope-theta T] [--rms-norm-eps EPS]\n"
               "  [--tie-word-embeddings] [--no-norm-topk-prob] [--seed S] [--shard-gb G]\n"
               "  [--threads T] [--mtp] [--config-only] [--format bf16|fp8]\n"
               "  Qwen3.5: [--full-attention-interval N] [--linear-key-heads H]\n"
               "  [--linear-value-heads H] [--linear-key-dim D] [--linear-value-dim D]\n"
               "  [--shared-intermediate I]\n",
               msg.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  // The preset first, so that the other flags override it wherever they stand.
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--preset") a.c = preset(argv[i + 1]);
  }
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--tie-word-embeddings") {
      a.c.tie = true;
      continue;
    }
    if (f == "--no-norm-topk-prob") {
      a.c.norm_topk_prob = false;
      continue;
    }
    if (f == "--mtp") {
      a.c.mtp = true;
      continue;
    }
    if (f == "--config-only") {
      a.config_only = true;
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + f);
    const std::string v = argv[++i];
    auto pos_int = [&]() -> int64_t {
      char* end = nullptr;
      const long long x = std::strtoll(v.c_str(), &end, 10);
      if (end == v.c_str() || *end != '\0' || x <= 0) usage("bad value for " + f + ": " + v);
      return x;
    };
    auto pos_double = [&]() -> double {
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !(x > 0)) usage("bad value for " + f + ": " + v);
      return x;
    };
    if (f == "--out")
      a.out = v;
    else if (f == "--preset")
      continue;  // applied above
    else if (f == "--layers")
      a.c.layers = pos_int();
    else if (f == "--hidden")
      a.c.hidden = pos_int();
    else if (f == "--intermediate")
      a.c.intermediate = pos_int();
    else if (f == "--moe-intermediate")
      a.c.moe_intermediate = pos_int();
    else if (f == "--experts")
      a.c.experts = pos_int();
    else if (f == "--top-k")
      a.c.top_k = pos_int();
    else if (f == "--heads")
      a.c.heads = pos_int();
    else if (f == "--kv-heads")
      a.c.kv_heads = pos_int();
    else if (f == "--head-dim")
      a.c.head_dim = pos_int();
    else if (f == "--vocab")
      a.c.vocab = pos_int();
    else if (f == "--max-position")
      a.c.max_position = pos_int();
    else if (f == "--rope-theta")
      a.c.rope_theta = pos_double();
    else if (f == "--rms-norm-eps")
      a.c.rms_norm_eps = pos_double();
    else if (f == "--full-attention-interval")
      a.c.full_interval = pos_int();
    else if (f == "--linear-key-heads")
      a.c.lin_k_heads = pos_int();
    else if (f == "--linear-value-heads")
      a.c.lin_v_heads = pos_int();
    else if (f == "--linear-key-dim")
      a.c.lin_k_dim = pos_int();
    else if (f == "--linear-value-dim")
      a.c.lin_v_dim = pos_int();
    else if (f == "--shared-intermediate")
      a.c.shared_intermediate = pos_int();
    else if (f == "--seed")
      a.seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (f == "--shard-gb")
      a.shard_gb = pos_double();
    else if (f == "--threads")
      a.threads = static_cast<unsigned>(pos_int());
    else if (f == "--format") {
      if (v != "bf16" && v != "fp8") usage("bad value for --format: " + v + " (bf16 or fp8)");
      a.fp8 = v == "fp8";
    } else
      usage("unknown flag " + f);
  }
  if (a.out.empty()) usage("--out is required");
  if (a.c.top_k > a.c.experts) usage("--top-k exceeds --experts");
  if (a.c.heads % a.c.kv_heads != 0) usage("--heads must be a multiple of --kv-heads");
  if (a.c.qwen35 && a.c.lin_v_heads % a.c.lin_k_heads != 0) {
    usage("--linear-value-heads must be a multiple of --linear-key-heads");
  }
  if (a.c.qwen35 && a.c.full_interval > a.c.layers) {
    usage("--full-attention-interval exceeds --layers (no full-attention layer)");
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    const Config& c = a.c;
    std::vector<Tensor> tensors = tensor_list(c);
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].id = static_cast<uint32_t>(i);
    if (a.fp8) {
      // As convert: each linear it quantizes becomes E4M3 codes, then its scale_inv.
      std::vector<Tensor> q;
      q.reserve(tensors.size() * 2);
      for (Tensor& t : tensors) {
        const bool linear =
            t.init == Init::kMatrix && t.shape.size() == 2 && !tandem::linear_kind(t.name).empty();
        if (!linear) {
          q.push_back(std::move(t));
          continue;
        }
        const int64_t rows = t.shape[0], cols = t.shape[1];
        Tensor w = t;
        w.init = Init::kFp8Matrix;
        w.cols = cols;
        q.push_back(w);
        Tensor sc;
        sc.name = t.name + "_scale_inv";
        sc.shape = {(rows + 127) / 128, (cols + 127) / 128};
        sc.init = Init::kScaleInv;
        sc.id = t.id + kScaleId;
        sc.cols = cols;
        q.push_back(std::move(sc));
      }
      tensors = std::move(q);
    }

    // Shards: tensors in order, a new shard when the next tensor would pass the limit.
    const uint64_t limit = static_cast<uint64_t>(a.shard_gb * 1e9);
    std::vector<uint64_t> shard_bytes{0};
    for (Tensor& t : tensors) {
      if (shard_bytes.back() > 0 && shard_bytes.back() + t.bytes() > limit)
        shard_bytes.push_back(0);
      t.shard = static_cast<int>(shard_bytes.size() - 1);
      t.offset = shard_bytes.back();
      shard_bytes.back() += t.bytes();
    }
    const int nshards = static_cast<int>(shard_bytes.size());

    std::filesystem::create_directories(a.out);
    const std::filesystem::path dir(a.out);
    std::string config = config_json(c);
    if (a.fp8) {  // convert's config.json: its quantization_config (no linear kept unquantized)
      const tandem::ModelConfig mc = tandem::ModelConfig::from_json(config, "config.json");
      config = tandem::converted_config_json(config, mc, tandem::WeightQuant::kFp8Block, {});
    }
    write_text(dir / "config.json", config);
    write_text(dir / "generation_config.json", generation_config_json(c));
    if (a.config_only) {
      std::printf("%s: config.json only\n", a.out.c_str());
      return 0;
    }

    // Headers, then the pre-sized files.
    std::vector<int> fds(nshards, -1);
    std::vector<uint64_t> data_start(nshards);
    uint64_t total = 0;
    for (int s = 0; s < nshards; ++s) {
      std::string h = "{\"__metadata__\":{\"format\":\"pt\"}";
      for (Tensor const& t : tensors) {
        if (t.shard != s) continue;
        h += ",\"" + t.name + "\":{\"dtype\":\"" + t.dtype() +
             "\",\"shape\":" + shape_json(t.shape) + ",\"data_offsets\":[" +
             std::to_string(t.offset) + "," + std::to_string(t.offset + t.bytes()) + "]}";
      }
      h += "}";
      while ((8 + h.size()) % 8 != 0) h += ' ';  // data 8-byte aligned, as safetensors writes
      const std::string path = (dir / shard_name(s, nshards)).string();
      const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
      if (fd < 0) throw std::runtime_error("cannot create " + path + ": " + std::strerror(errno));
      fds[s] = fd;
      uint8_t len[8];
      for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(h.size() >> (8 * i));
      data_start[s] = 8 + h.size();
      if (::pwrite(fd, len, 8, 0) != 8 ||
          ::pwrite(fd, h.data(), h.size(), 8) != static_cast<ssize_t>(h.size()) ||
          ::ftruncate(fd, static_cast<off_t>(data_start[s] + shard_bytes[s])) != 0) {
        throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
      }
      total += shard_bytes[s];
    }

    // Work items: chunks of every tensor, 1 Mi elements (bf16, fp8) or 2 MiB (f32 scales).
    constexpr uint64_t kChunkBytes = uint64_t{2} << 20;
    auto chunk_of = [](Tensor const& t) {
      return std::min(uint64_t{1} << 20, kChunkBytes / t.elem_bytes());
    };
    struct Item {
      uint32_t tensor;
      uint64_t chunk;
    };
    std::vector<Item> items;
    for (uint32_t i = 0; i < tensors.size(); ++i) {
      const uint64_t chunk = chunk_of(tensors[i]);
      const uint64_t n = (tensors[i].numel() + chunk - 1) / chunk;
      for (uint64_t k = 0; k < n; ++k) items.push_back({i, k});
    }
    const unsigned threads =
        a.threads ? a.threads : std::max(1u, std::thread::hardware_concurrency());
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    std::string error;
    std::atomic_flag error_lock = ATOMIC_FLAG_INIT;
    const auto t0 = std::chrono::steady_clock::now();
    auto work = [&] {
      std::vector<uint32_t> buf(kChunkBytes / 4);  // 4-byte aligned for the f32 scales
      for (size_t w; !failed && (w = next.fetch_add(1)) < items.size();) {
        const Item it = items[w];
        Tensor const& t = tensors[it.tensor];
        const uint64_t chunk = chunk_of(t);
        const uint64_t first = it.chunk * chunk;
        const size_t n = static_cast<size_t>(std::min(chunk, t.numel() - first));
        uint64_t seed = a.seed * 0x9E3779B97F4A7C15ull ^ (uint64_t{t.id} << 40) ^ it.chunk;
        seed = splitmix(seed);
        fill(buf.data(), n, t, first, seed, a.seed);
        const uint64_t off = data_start[t.shard] + t.offset + first * t.elem_bytes();
        const char* p = reinterpret_cast<const char*>(buf.data());
        const size_t nbytes = n * t.elem_bytes();
        size_t left = nbytes;
        while (left > 0) {
          const ssize_t wr =
              ::pwrite(fds[t.shard], p, left, static_cast<off_t>(off + (nbytes - left)));
          if (wr <= 0) {
            if (wr < 0 && errno == EINTR) continue;
            if (!error_lock.test_and_set()) error = std::string("pwrite: ") + std::strerror(errno);
            failed = true;
            return;
          }
          p += wr;
          left -= static_cast<size_t>(wr);
        }
      }
    };
    std::vector<std::thread> pool;
    for (unsigned i = 0; i < threads; ++i) pool.emplace_back(work);
    for (auto& th : pool) th.join();
    for (int fd : fds) {
      if (::close(fd) != 0 && !failed) {
        failed = true;
        error = std::string("close: ") + std::strerror(errno);
      }
    }
    if (failed) throw std::runtime_error(error);

    // The index.
    std::string idx = "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total) +
                      "\n  },\n  \"weight_map\": {";
    for (size_t i = 0; i < tensors.size(); ++i) {
      idx += (i ? ",\n    \"" : "\n    \"") + tensors[i].name + "\": \"" +
             shard_name(tensors[i].shard, nshards) + "\"";
    }
    idx += "\n  }\n}\n";
    write_text(dir / "model.safetensors.index.json", idx);

    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    uint64_t params = 0;
    for (Tensor const& t : tensors) params += t.init == Init::kScaleInv ? 0 : t.numel();
    std::printf(
        "%s: %zu tensors (%s), %.3f B params, %.2f GB in %d shard(s), %.1f s (%.2f GB/s, %u "
        "threads)\n",
        a.out.c_str(), tensors.size(), a.fp8 ? "block FP8" : "bf16", params / 1e9, total / 1e9,
        nshards, secs, total / 1e9 / std::max(secs, 1e-9), threads);
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "make_random_checkpoint: %s\n", e.what());
    return 1;
  }
}
