#include "model/config.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/error.h"

namespace tandem {

namespace {

using Json = nlohmann::json;

constexpr const char* kModelType = "qwen3_moe";
constexpr const char* kArchitecture = "Qwen3MoeForCausalLM";

const char* json_type_name(const Json& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();  // "null", "boolean", "string", "array", "object"
}

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  TANDEM_CHECK_KIND(kNotFound, std::filesystem::is_regular_file(path, ec), path, ": not found");
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK_KIND(kIo, in.good(), path, ": cannot open for reading");
  std::ostringstream os;
  os << in.rdbuf();
  TANDEM_CHECK_KIND(kIo, !in.bad(), path, ": read failed");
  return os.str();
}

Json parse_json_object(const std::string& text, const std::string& origin) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    TANDEM_THROW(kIo, origin, ": invalid JSON: ", e.what());
  }
  TANDEM_CHECK_KIND(kInvalidArgument, j.is_object(), origin,
                    ": expected a JSON object at the top level, got ", json_type_name(j));
  return j;
}

/// Typed field access on one JSON object; every error names the file and the field.
class FieldReader {
 public:
  FieldReader(const Json& obj, const std::string& origin, std::string prefix = "")
      : obj_(obj), origin_(origin), prefix_(std::move(prefix)) {}

  /// The field, or nullptr when absent. JSON null counts as present here.
  const Json* find(const char* field) const {
    auto it = obj_.find(field);
    return it == obj_.end() ? nullptr : &*it;
  }
  /// The field, or nullptr when absent or null.
  const Json* find_non_null(const char* field) const {
    const Json* v = find(field);
    return v == nullptr || v->is_null() ? nullptr : v;
  }

  std::string name(const char* field) const { return prefix_ + field; }

  [[noreturn]] void type_error(const char* field, const Json& v, const char* expected) const {
    TANDEM_THROW(kInvalidArgument, origin_, ": field '", name(field), "': expected ", expected,
                 ", got ", json_type_name(v));
  }

  int64_t as_int(const char* field, const Json& v) const {
    if (!v.is_number_integer()) type_error(field, v, "an integer");
    if (v.is_number_unsigned() &&
        v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      TANDEM_THROW(kInvalidArgument, origin_, ": field '", name(field), "': integer out of range");
    }
    return v.get<int64_t>();
  }

  int64_t get_int(const char* field, int64_t def) const {
    const Json* v = find(field);
    return v == nullptr ? def : as_int(field, *v);
  }
  double get_double(const char* field, double def) const {
    const Json* v = find(field);
    if (v == nullptr) return def;
    if (!v->is_number()) type_error(field, *v, "a number");
    return v->get<double>();
  }
  bool get_bool(const char* field, bool def) const {
    const Json* v = find(field);
    if (v == nullptr) return def;
    if (!v->is_boolean()) type_error(field, *v, "a boolean");
    return v->get<bool>();
  }
  /// A string, or nullopt when absent (or null when `nullable`).
  std::optional<std::string> get_string(const char* field, bool nullable = false) const {
    const Json* v = nullable ? find_non_null(field) : find(field);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) type_error(field, *v, "a string");
    return v->get<std::string>();
  }
  /// An integer or a list of integers (eos_token_id); nullopt when absent or null.
  std::optional<std::vector<int64_t>> get_int_or_list(const char* field) const {
    const Json* v = find_non_null(field);
    if (v == nullptr) return std::nullopt;
    std::vector<int64_t> out;
    if (v->is_array()) {
      for (const Json& e : *v) {
        if (!e.is_number_integer()) type_error(field, e, "an integer or a list of integers");
        out.push_back(as_int(field, e));
      }
    } else if (v->is_number_integer()) {
      out.push_back(as_int(field, *v));
    } else {
      type_error(field, *v, "an integer or a list of integers");
    }
    return out;
  }
  /// A list of integers; nullopt when absent or null.
  std::optional<std::vector<int64_t>> get_int_list(const char* field) const {
    const Json* v = find_non_null(field);
    if (v == nullptr) return std::nullopt;
    if (!v->is_array()) type_error(field, *v, "a list of integers");
    std::vector<int64_t> out;
    for (const Json& e : *v) {
      if (!e.is_number_integer()) type_error(field, e, "a list of integers");
      out.push_back(as_int(field, e));
    }
    return out;
  }

  const std::string& origin() const { return origin_; }

 private:
  const Json& obj_;
  const std::string& origin_;
  std::string prefix_;
};

DType dtype_from_torch_name(const std::string& s, const std::string& origin, const char* field) {
  if (s == "bfloat16") return DType::kBF16;
  if (s == "float16" || s == "half") return DType::kF16;
  if (s == "float32" || s == "float") return DType::kF32;
  TANDEM_THROW(kUnsupported, origin, ": field '", field, "': unsupported dtype '", s,
               "' (supported: bfloat16, float16, float32)");
}

void check_positive(const std::string& origin, const char* field, int64_t v) {
  TANDEM_CHECK_KIND(kInvalidArgument, v > 0, origin, ": field '", field, "' must be positive, got ",
                    v);
}

/// rope_scaling / rope_parameters: only plain (default) RoPE is supported. Returns the
/// rope_theta it carries, if any.
std::optional<double> read_rope_object(const FieldReader& top, const char* field) {
  const Json* v = top.find_non_null(field);
  if (v == nullptr) return std::nullopt;
  if (!v->is_object()) top.type_error(field, *v, "an object");
  FieldReader r(*v, top.origin(), std::string(field) + ".");
  // transformers: rope_type defaults to the legacy "type" key, then to "default".
  std::optional<std::string> type = r.get_string("rope_type", /*nullable=*/true);
  const char* type_field = "rope_type";
  if (!type) {
    type = r.get_string("type", /*nullable=*/true);
    type_field = "type";
  }
  if (type && *type != "default") {
    TANDEM_THROW(kUnsupported, top.origin(), ": field '", r.name(type_field),
                 "': unsupported RoPE scaling type '", *type, "' (only default RoPE is supported)");
  }
  if (r.find_non_null("partial_rotary_factor") != nullptr) {
    double f = r.get_double("partial_rotary_factor", 1.0);
    TANDEM_CHECK_KIND(kUnsupported, f == 1.0, top.origin(), ": field '",
                      r.name("partial_rotary_factor"), "': partial RoPE (", f,
                      ") is not supported");
  }
  if (r.find_non_null("rope_theta") == nullptr) return std::nullopt;
  return r.get_double("rope_theta", 0.0);
}

/// A list of strings (modules_to_not_convert, ignore); empty when absent or null.
std::vector<std::string> read_string_list(const FieldReader& r, const char* field) {
  std::vector<std::string> out;
  const Json* v = r.find_non_null(field);
  if (v == nullptr) return out;
  if (!v->is_array()) r.type_error(field, *v, "a list of strings");
  for (const Json& e : *v) {
    if (!e.is_string()) r.type_error(field, e, "a list of strings");
    out.push_back(e.get<std::string>());
  }
  return out;
}

std::string upper(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return s;
}

/// quantization_config: block-scaled FP8 (Qwen / DeepSeek "fp8") or ModelOpt MXFP8.
QuantConfig read_quantization_config(const FieldReader& top) {
  QuantConfig q;
  const char* field = "quantization_config";
  const Json* v = top.find_non_null(field);
  if (v == nullptr) return q;
  if (!v->is_object()) top.type_error(field, *v, "an object");
  FieldReader r(*v, top.origin(), std::string(field) + ".");
  const std::string& origin = top.origin();
  std::optional<std::string> method = r.get_string("quant_method");
  TANDEM_CHECK_KIND(kInvalidArgument, method.has_value(), origin, ": missing field '",
                    r.name("quant_method"), "'");
  if (*method == "fp8") {
    const std::string fmt = r.get_string("fmt", /*nullable=*/true).value_or("e4m3");
    TANDEM_CHECK_KIND(kUnsupported, fmt == "e4m3", origin, ": field '", r.name("fmt"),
                      "': unsupported FP8 format '", fmt, "' (supported: e4m3)");
    const std::string act =
        r.get_string("activation_scheme", /*nullable=*/true).value_or("dynamic");
    TANDEM_CHECK_KIND(kUnsupported, act == "dynamic", origin, ": field '",
                      r.name("activation_scheme"), "': unsupported activation scheme '", act,
                      "' (supported: dynamic)");
    std::optional<std::vector<int64_t>> block = r.get_int_list("weight_block_size");
    TANDEM_CHECK_KIND(kUnsupported, block.has_value(), origin, ": missing field '",
                      r.name("weight_block_size"),
                      "' (only block-scaled FP8, weight_block_size [128, 128], is supported)");
    std::string got = "[";
    for (size_t i = 0; i < block->size(); ++i) {
      got += (i ? ", " : "") + std::to_string((*block)[i]);
    }
    got += "]";
    TANDEM_CHECK_KIND(kUnsupported, *block == std::vector<int64_t>({128, 128}), origin, ": field '",
                      r.name("weight_block_size"), "': unsupported block size ", got,
                      " (supported: [128, 128])");
    q.method = WeightQuant::kFp8Block;
    q.block_rows = 128;
    q.block_cols = 128;
    q.not_converted = read_string_list(r, "modules_to_not_convert");
    return q;
  }
  if (*method == "modelopt" || *method == "mxfp8") {
    // ModelOpt in config.json: {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore"};
    // as hf_quant_config.json nests it: {"quantization": {"quant_algo", "exclude_modules"}};
    // MiniMax-style {"quant_method": "mxfp8", "ignored_layers"}.
    std::string algo = "MXFP8";
    std::string algo_field = r.name("quant_algo");
    std::vector<std::string> ignore;
    if (*method == "modelopt") {
      const Json* nested = r.find_non_null("quantization");
      if (nested != nullptr) {
        if (!nested->is_object()) r.type_error("quantization", *nested, "an object");
        FieldReader n(*nested, origin, r.name("quantization") + ".");
        algo = n.get_string("quant_algo", /*nullable=*/true).value_or("");
        algo_field = n.name("quant_algo");
        ignore = read_string_list(n, "exclude_modules");
      } else {
        algo = r.get_string("quant_algo", /*nullable=*/true).value_or("");
        ignore = read_string_list(r, "ignore");
      }
    } else {
      ignore = read_string_list(r, "ignored_layers");
    }
    TANDEM_CHECK_KIND(kUnsupported, upper(algo) == "MXFP8", origin, ": field '", algo_field,
                      "': unsupported ModelOpt quant_algo '", algo, "' (supported: MXFP8)");
    q.method = WeightQuant::kMxfp8;
    q.block_rows = 1;
    q.block_cols = 32;
    q.not_converted = std::move(ignore);
    return q;
  }
  TANDEM_THROW(kUnsupported, origin, ": field '", r.name("quant_method"),
               "': unsupported quantization method '", *method,
               "' (supported: fp8 with weight_block_size [128, 128], modelopt MXFP8)");
}

// ---- Qwen3.5 hybrid MoE (qwen3_5_moe: image-text, language model under text_config;
// qwen3_5_moe_text: text only). Defaults as transformers' Qwen3_5MoeTextConfig (5.x).
constexpr const char* kQwen35ModelType = "qwen3_5_moe";
constexpr const char* kQwen35TextModelType = "qwen3_5_moe_text";
constexpr const char* kQwen35Architecture = "Qwen3_5MoeForConditionalGeneration";
constexpr const char* kQwen35TextArchitecture = "Qwen3_5MoeForCausalLM";

void check_architectures(const FieldReader& r, const char* expected) {
  const Json* archs = r.find_non_null("architectures");
  if (archs == nullptr) return;
  if (!archs->is_array()) r.type_error("architectures", *archs, "a list of strings");
  for (const Json& a : *archs) {
    if (!a.is_string()) r.type_error("architectures", a, "a list of strings");
    TANDEM_CHECK_KIND(kUnsupported, a.get<std::string>() == expected, r.origin(),
                      ": field 'architectures': unsupported architecture '", a.get<std::string>(),
                      "' (supported: ", expected, ")");
  }
}

// The rope object of a Qwen3.5 text config: default RoPE with partial_rotary_factor and the
// multimodal mrope_section / mrope_interleaved (text positions are equal in all three sections,
// so mrope reduces to plain RoPE for text).
void read_qwen3_5_rope(const FieldReader& t, ModelConfig& c) {
  c.rope_theta = t.get_double("rope_theta", 10000.0);
  c.partial_rotary_factor = t.get_double("partial_rotary_factor", 0.25);
  const Json* v = t.find_non_null("rope_parameters");
  if (v == nullptr) v = t.find_non_null("rope_scaling");
  if (v != nullptr) {
    if (!v->is_object()) t.type_error("rope_parameters", *v, "an object");
    FieldReader r(*v, t.origin(), t.name("rope_parameters."));
    std::optional<std::string> type = r.get_string("rope_type", /*nullable=*/true);
    if (!type) type = r.get_string("type", /*nullable=*/true);
    TANDEM_CHECK_KIND(kUnsupported, !type || *type == "default" || *type == "mrope", t.origin(),
                      ": field '", r.name("rope_type"), "': unsupported RoPE type '",
                      type.value_or(""), "' (supported: default)");
    c.rope_theta = r.get_double("rope_theta", c.rope_theta);
    c.partial_rotary_factor = r.get_double("partial_rotary_factor", c.partial_rotary_factor);
    (void)r.get_int_list("mrope_section");
    (void)r.get_bool("mrope_interleaved", false);
  }
  (void)t.get_int_list("mrope_section");
  (void)t.get_bool("mrope_interleaved", false);
  TANDEM_CHECK_KIND(kInvalidArgument, c.rope_theta > 0.0, t.origin(), ": field '",
                    t.name("rope_theta"), "' must be positive, got ", c.rope_theta);
  TANDEM_CHECK_KIND(kInvalidArgument,
                    c.partial_rotary_factor > 0.0 && c.partial_rotary_factor <= 1.0, t.origin(),
                    ": field '", t.name("partial_rotary_factor"), "' must be in (0, 1], got ",
                    c.partial_rotary_factor);
}

ModelConfig qwen3_5_from_json(const Json& j, const FieldReader& top,
                              const std::string& model_type) {
  const std::string& origin = top.origin();
  ModelConfig c;
  c.model_type = model_type;
  const Json* text = &j;
  std::string prefix;
  if (model_type == kQwen35ModelType) {
    check_architectures(top, kQwen35Architecture);
    c.architecture = kQwen35Architecture;
    c.weight_prefix = "model.language_model.";
    text = top.find_non_null("text_config");
    TANDEM_CHECK_KIND(kInvalidArgument, text != nullptr, origin,
                      ": missing required field 'text_config' (model_type ", model_type, ")");
    if (!text->is_object()) top.type_error("text_config", *text, "an object");
    prefix = "text_config.";
  } else {
    check_architectures(top, kQwen35TextArchitecture);
    c.architecture = kQwen35TextArchitecture;
    c.weight_prefix = "model.";
  }
  FieldReader t(*text, origin, prefix);

  c.vocab_size = t.get_int("vocab_size", 248320);
  c.hidden_size = t.get_int("hidden_size", 2048);
  c.num_hidden_layers = t.get_int("num_hidden_layers", 40);
  c.num_attention_heads = t.get_int("num_attention_heads", 16);
  c.num_key_value_heads = t.get_int("num_key_value_heads", 2);
  c.head_dim = t.get_int("head_dim", 256);
  c.max_position_embeddings = t.get_int("max_position_embeddings", 32768);
  c.rms_norm_eps = t.get_double("rms_norm_eps", 1e-6);
  c.linear_conv_kernel_dim = t.get_int("linear_conv_kernel_dim", 4);
  c.linear_key_head_dim = t.get_int("linear_key_head_dim", 128);
  c.linear_value_head_dim = t.get_int("linear_value_head_dim", 128);
  c.linear_num_key_heads = t.get_int("linear_num_key_heads", 16);
  c.linear_num_value_heads = t.get_int("linear_num_value_heads", 32);
  c.moe_intermediate_size = t.get_int("moe_intermediate_size", 512);
  c.shared_expert_intermediate_size = t.get_int("shared_expert_intermediate_size", 512);
  c.intermediate_size = c.shared_expert_intermediate_size;
  c.num_experts = t.get_int("num_experts", 256);
  c.num_experts_per_tok = t.get_int("num_experts_per_tok", 8);
  c.norm_topk_prob = true;  // Qwen3.5's router always renormalises the top-k weights
  c.decoder_sparse_step = 1;
  c.attn_output_gate = t.get_bool("attn_output_gate", true);
  c.mtp_num_hidden_layers = t.get_int("mtp_num_hidden_layers", 0);
  // The image-text class declares tie_word_embeddings at the top level; text_config's
  // is the fallback.
  c.tie_word_embeddings = t.get_bool("tie_word_embeddings", false);
  if (text != &j)
    c.tie_word_embeddings = top.get_bool("tie_word_embeddings", c.tie_word_embeddings);

  for (const char* f : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings",
                        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                        "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
                        "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok"}) {
    check_positive(origin, t.name(f).c_str(), t.get_int(f, 1));
  }
  TANDEM_CHECK_KIND(kInvalidArgument, c.num_attention_heads % c.num_key_value_heads == 0, origin,
                    ": field '", t.name("num_attention_heads"), "' (", c.num_attention_heads,
                    ") is not divisible by field '", t.name("num_key_value_heads"), "' (",
                    c.num_key_value_heads, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, c.linear_num_value_heads % c.linear_num_key_heads == 0,
                    origin, ": field '", t.name("linear_num_value_heads"), "' (",
                    c.linear_num_value_heads, ") is not divisible by field '",
                    t.name("linear_num_key_heads"), "' (", c.linear_num_key_heads, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, c.num_experts_per_tok <= c.num_experts, origin, ": field '",
                    t.name("num_experts_per_tok"), "' (", c.num_experts_per_tok,
                    ") exceeds field '", t.name("num_experts"), "' (", c.num_experts, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, c.rms_norm_eps > 0.0, origin, ": field '",
                    t.name("rms_norm_eps"), "' must be positive, got ", c.rms_norm_eps);
  TANDEM_CHECK_KIND(kInvalidArgument, c.mtp_num_hidden_layers >= 0, origin, ": field '",
                    t.name("mtp_num_hidden_layers"), "' must be >= 0");

  // What the forward does not implement: fail loudly.
  TANDEM_CHECK_KIND(kUnsupported, !t.get_bool("attention_bias", false), origin, ": field '",
                    t.name("attention_bias"), "': attention biases are not supported");
  TANDEM_CHECK_KIND(kUnsupported, c.attn_output_gate, origin, ": field '",
                    t.name("attn_output_gate"),
                    "': attention without the output gate is not supported");
  if (std::optional<std::string> act = t.get_string("hidden_act")) {
    TANDEM_CHECK_KIND(kUnsupported, *act == "silu", origin, ": field '", t.name("hidden_act"),
                      "': unsupported activation '", *act, "' (supported: silu)");
  }
  if (std::optional<std::string> sd = t.get_string("mamba_ssm_dtype", /*nullable=*/true)) {
    c.ssm_state_dtype = dtype_from_torch_name(*sd, origin, t.name("mamba_ssm_dtype").c_str());
    TANDEM_CHECK_KIND(kUnsupported, c.ssm_state_dtype == DType::kF32, origin, ": field '",
                      t.name("mamba_ssm_dtype"), "': unsupported recurrent state dtype '", *sd,
                      "' (supported: float32)");
  }
  read_qwen3_5_rope(t, c);
  TANDEM_CHECK_KIND(kInvalidArgument, c.rotary_dim() >= 2, origin, ": field '",
                    t.name("partial_rotary_factor"), "' (", c.partial_rotary_factor,
                    ") leaves no rotary dims of head_dim ", c.head_dim);

  // layer_types, else every full_attention_interval-th layer is full attention.
  if (t.find_non_null("layer_types") != nullptr) {
    const Json& lt = *t.find_non_null("layer_types");
    if (!lt.is_array()) t.type_error("layer_types", lt, "a list of strings");
    for (const Json& e : lt) {
      if (!e.is_string()) t.type_error("layer_types", e, "a list of strings");
      const std::string s = e.get<std::string>();
      if (s == "full_attention") {
        c.layer_types.push_back(ModelConfig::LayerType::kFullAttention);
      } else if (s == "linear_attention") {
        c.layer_types.push_back(ModelConfig::LayerType::kLinearAttention);
      } else {
        TANDEM_THROW(kUnsupported, origin, ": field '", t.name("layer_types"), "': entry ",
                     c.layer_types.size(), " is an unsupported layer type '", s,
                     "' (supported: full_attention, linear_attention)");
      }
    }
    TANDEM_CHECK_KIND(kInvalidArgument,
                      static_cast<int64_t>(c.layer_types.size()) == c.num_hidden_layers, origin,
                      ": field '", t.name("layer_types"), "' has ", c.layer_types.size(),
                      " entries for ", c.num_hidden_layers, " layers");
  } else {
    const int64_t every = t.get_int("full_attention_interval", 4);
    check_positive(origin, t.name("full_attention_interval").c_str(), every);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      c.layer_types.push_back((l + 1) % every == 0 ? ModelConfig::LayerType::kFullAttention
                                                   : ModelConfig::LayerType::kLinearAttention);
    }
  }

  std::optional<std::string> dt = t.get_string("dtype", /*nullable=*/true);
  if (!dt) dt = t.get_string("torch_dtype", /*nullable=*/true);
  if (!dt) dt = top.get_string("dtype", /*nullable=*/true);
  if (!dt) dt = top.get_string("torch_dtype", /*nullable=*/true);
  if (dt) c.dtype = dtype_from_torch_name(*dt, origin, "dtype");

  // Block FP8 / MXFP8 (Qwen's -FP8 checkpoints): quantization_config at the top level (as Qwen
  // publishes it), else text_config's.
  c.quant = read_quantization_config(top);
  if (!c.quant.quantized() && text != &j) c.quant = read_quantization_config(t);

  if (const Json* bos = t.find_non_null("bos_token_id")) {
    c.bos_token_id = t.as_int("bos_token_id", *bos);
  }
  c.eos_token_ids = t.get_int_or_list("eos_token_id").value_or(std::vector<int64_t>{});
  for (int64_t id : c.eos_token_ids) {
    TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < c.vocab_size, origin, ": field '",
                      t.name("eos_token_id"), "': token ", id, " is outside the vocabulary [0, ",
                      c.vocab_size, ")");
  }
  return c;
}

}  // namespace

std::string_view weight_quant_name(WeightQuant q) {
  switch (q) {
    case WeightQuant::kNone: return "none";
    case WeightQuant::kFp8Block: return "fp8 (128x128 blocks)";
    case WeightQuant::kMxfp8: return "mxfp8";
  }
  return "?";
}

std::string QuantConfig::scale_name(const std::string& weight_name) const {
  return weight_name + (method == WeightQuant::kMxfp8 ? "_scale" : "_scale_inv");
}

int64_t ModelConfig::rotary_dim() const {
  // transformers: int(head_dim * partial_rotary_factor), rotated in halves.
  return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor) / 2 * 2;
}

bool ModelConfig::is_moe_layer(int64_t layer) const {
  if (is_hybrid()) return true;  // Qwen3.5: every layer is sparse
  // transformers Qwen3MoeDecoderLayer:
  //   (layer_idx not in mlp_only_layers) and
  //   (num_experts > 0 and (layer_idx + 1) % decoder_sparse_step == 0)
  bool mlp_only =
      std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end();
  return !mlp_only && num_experts > 0 && decoder_sparse_step > 0 &&
         (layer + 1) % decoder_sparse_step == 0;
}

ModelConfig ModelConfig::from_json(const std::string& json_text, const std::string& origin) {
  Json j = parse_json_object(json_text, origin);
  FieldReader r(j, origin);
  ModelConfig c;

  // Identity.
  std::optional<std::string> model_type = r.get_string("model_type");
  TANDEM_CHECK_KIND(kInvalidArgument, model_type.has_value(), origin,
                    ": missing required field 'model_type'");
  if (*model_type == kQwen35ModelType || *model_type == kQwen35TextModelType) {
    return qwen3_5_from_json(j, r, *model_type);
  }
  TANDEM_CHECK_KIND(kUnsupported, *model_type == kModelType, origin,
                    ": field 'model_type': unsupported model_type '", *model_type,
                    "' (supported: ", kModelType, ", ", kQwen35ModelType, ", ",
                    kQwen35TextModelType, ")");
  c.model_type = *model_type;
  c.architecture = kArchitecture;
  if (const Json* archs = r.find_non_null("architectures")) {
    if (!archs->is_array()) r.type_error("architectures", *archs, "a list of strings");
    for (const Json& a : *archs) {
      if (!a.is_string()) r.type_error("architectures", a, "a list of strings");
      TANDEM_CHECK_KIND(kUnsupported, a.get<std::string>() == kArchitecture, origin,
                        ": field 'architectures': unsupported architecture '", a.get<std::string>(),
                        "' (supported: ", kArchitecture, ")");
    }
  }

  // Sizes; defaults as transformers' Qwen3MoeConfig (5.x).
  c.vocab_size = r.get_int("vocab_size", 151936);
  c.hidden_size = r.get_int("hidden_size", 2048);
  c.intermediate_size = r.get_int("intermediate_size", 6144);
  c.moe_intermediate_size = r.get_int("moe_intermediate_size", 768);
  c.num_hidden_layers = r.get_int("num_hidden_layers", 24);
  c.num_attention_heads = r.get_int("num_attention_heads", 32);
  c.num_key_value_heads = r.get_int("num_key_value_heads", 4);
  c.max_position_embeddings = r.get_int("max_position_embeddings", 32768);

  // num_experts (hub) is an alias of num_local_experts (transformers 5).
  const Json* ne_hub = r.find("num_experts");
  const Json* ne_tf5 = r.find("num_local_experts");
  c.num_experts = 128;
  if (ne_hub != nullptr) c.num_experts = r.as_int("num_experts", *ne_hub);
  if (ne_tf5 != nullptr) {
    int64_t v = r.as_int("num_local_experts", *ne_tf5);
    TANDEM_CHECK_KIND(kInvalidArgument, ne_hub == nullptr || v == c.num_experts, origin,
                      ": fields 'num_experts' (", c.num_experts, ") and 'num_local_experts' (", v,
                      ") disagree");
    c.num_experts = v;
  }
  c.num_experts_per_tok = r.get_int("num_experts_per_tok", 8);
  c.decoder_sparse_step = r.get_int("decoder_sparse_step", 1);
  c.mlp_only_layers = r.get_int_list("mlp_only_layers").value_or(std::vector<int64_t>{});
  c.norm_topk_prob = r.get_bool("norm_topk_prob", false);
  c.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  c.attention_bias = r.get_bool("attention_bias", false);
  c.rms_norm_eps = r.get_double("rms_norm_eps", 1e-6);

  // Validation of the sizes (before head_dim's default divides by the head count).
  check_positive(origin, "vocab_size", c.vocab_size);
  check_positive(origin, "hidden_size", c.hidden_size);
  check_positive(origin, "intermediate_size", c.intermediate_size);
  check_positive(origin, "moe_intermediate_size", c.moe_intermediate_size);
  check_positive(origin, "num_hidden_layers", c.num_hidden_layers);
  check_positive(origin, "num_attention_heads", c.num_attention_heads);
  check_positive(origin, "num_key_value_heads", c.num_key_value_heads);
  check_positive(origin, "max_position_embeddings", c.max_position_embeddings);
  TANDEM_CHECK_KIND(kInvalidArgument, c.num_attention_heads % c.num_key_value_heads == 0, origin,
                    ": field 'num_attention_heads' (", c.num_attention_heads,
                    ") is not divisible by field 'num_key_value_heads' (", c.num_key_value_heads,
                    ")");
  // transformers: getattr(config, "head_dim", hidden_size // num_attention_heads).
  c.head_dim = r.get_int("head_dim", c.hidden_size / c.num_attention_heads);
  check_positive(origin, "head_dim", c.head_dim);
  TANDEM_CHECK_KIND(kInvalidArgument, c.num_experts >= 0, origin,
                    ": field 'num_experts' must be >= 0, got ", c.num_experts);
  check_positive(origin, "decoder_sparse_step", c.decoder_sparse_step);
  if (c.num_experts > 0) {
    check_positive(origin, "num_experts_per_tok", c.num_experts_per_tok);
    TANDEM_CHECK_KIND(kInvalidArgument, c.num_experts_per_tok <= c.num_experts, origin,
                      ": field 'num_experts_per_tok' (", c.num_experts_per_tok,
                      ") exceeds field 'num_experts' (", c.num_experts, ")");
  }
  for (int64_t l : c.mlp_only_layers) {
    TANDEM_CHECK_KIND(kInvalidArgument, l >= 0 && l < c.num_hidden_layers, origin,
                      ": field 'mlp_only_layers': layer ", l, " is outside [0, ",
                      c.num_hidden_layers, ")");
  }
  TANDEM_CHECK_KIND(kInvalidArgument, c.rms_norm_eps > 0.0, origin,
                    ": field 'rms_norm_eps' must be positive, got ", c.rms_norm_eps);

  // Features we do not implement (yet): fail loudly instead of computing something else.
  TANDEM_CHECK_KIND(kUnsupported, !c.attention_bias, origin,
                    ": field 'attention_bias': attention biases are not supported");
  TANDEM_CHECK_KIND(kUnsupported, !r.get_bool("use_sliding_window", false), origin,
                    ": field 'use_sliding_window': sliding-window attention is not supported");
  if (std::optional<std::string> act = r.get_string("hidden_act")) {
    TANDEM_CHECK_KIND(kUnsupported, *act == "silu", origin, ": field 'hidden_act': unsupported ",
                      "activation '", *act, "' (supported: silu)");
  }

  // RoPE. transformers: rope_scaling (legacy) wins over rope_parameters; the dict's own
  // rope_theta wins over the top-level one; default 10000.
  c.rope_theta = r.get_double("rope_theta", 10000.0);
  std::optional<double> scaling_theta = read_rope_object(r, "rope_scaling");
  std::optional<double> params_theta = read_rope_object(r, "rope_parameters");
  bool has_scaling =
      r.find_non_null("rope_scaling") != nullptr && !r.find_non_null("rope_scaling")->empty();
  if (has_scaling && scaling_theta) {
    c.rope_theta = *scaling_theta;
  } else if (!has_scaling && params_theta) {
    c.rope_theta = *params_theta;
  }
  TANDEM_CHECK_KIND(kInvalidArgument, c.rope_theta > 0.0, origin,
                    ": field 'rope_theta' must be positive, got ", c.rope_theta);

  // dtype (transformers 5) or torch_dtype (hub).
  std::optional<std::string> dt = r.get_string("dtype", /*nullable=*/true);
  std::optional<std::string> tdt = r.get_string("torch_dtype", /*nullable=*/true);
  if (dt) {
    c.dtype = dtype_from_torch_name(*dt, origin, "dtype");
    if (tdt) {
      TANDEM_CHECK_KIND(kInvalidArgument,
                        dtype_from_torch_name(*tdt, origin, "torch_dtype") == c.dtype, origin,
                        ": fields 'dtype' ('", *dt, "') and 'torch_dtype' ('", *tdt, "') disagree");
    }
  } else if (tdt) {
    c.dtype = dtype_from_torch_name(*tdt, origin, "torch_dtype");
  }

  c.quant = read_quantization_config(r);

  // Special tokens.
  if (const Json* bos = r.find_non_null("bos_token_id")) {
    c.bos_token_id = r.as_int("bos_token_id", *bos);
  }
  c.eos_token_ids = r.get_int_or_list("eos_token_id").value_or(std::vector<int64_t>{});
  for (int64_t id : c.eos_token_ids) {
    TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < c.vocab_size, origin,
                      ": field 'eos_token_id': token ", id, " is outside the vocabulary [0, ",
                      c.vocab_size, ")");
  }
  return c;
}

QuantConfig QuantConfig::from_dir(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  const Json j = parse_json_object(read_text_file(path), path);
  return read_quantization_config(FieldReader(j, path));
}

ModelConfig ModelConfig::from_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::string config_path = (fs::path(dir) / "config.json").string();
  ModelConfig c = from_json(read_text_file(config_path), config_path);

  std::string gen_path = (fs::path(dir) / "generation_config.json").string();
  std::error_code ec;
  if (fs::exists(gen_path, ec)) {
    Json g = parse_json_object(read_text_file(gen_path), gen_path);
    FieldReader r(g, gen_path);
    if (std::optional<std::vector<int64_t>> eos = r.get_int_or_list("eos_token_id")) {
      for (int64_t id : *eos) {
        TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < c.vocab_size, gen_path,
                          ": field 'eos_token_id': token ", id, " is outside the vocabulary [0, ",
                          c.vocab_size, ")");
      }
      c.eos_token_ids = std::move(*eos);
    }
    if (const Json* bos = r.find_non_null("bos_token_id")) {
      int64_t id = r.as_int("bos_token_id", *bos);
      if (c.bos_token_id < 0) c.bos_token_id = id;
    }
  }
  return c;
}

}  // namespace tandem
