#include "model/convert.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/quant.h"
#include "model/safetensors.h"

namespace tandem {

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string safetensors_dtype(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kE8M0: return "U8";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
  }
  return "?";
}

// Natural order: embedding first, layers by index, the rest last; names within.
struct NameOrder {
  bool operator()(const std::string& a, const std::string& b) const { return key(a) < key(b); }
  static std::tuple<int, int64_t, std::string> key(const std::string& n) {
    const std::string pre = "model.layers.";
    if (n.rfind(pre, 0) == 0) {
      const size_t dot = n.find('.', pre.size());
      try {
        return {1, std::stoll(n.substr(pre.size(), dot - pre.size())), n};
      } catch (const std::exception&) {
      }
    }
    return {n.find("embed") != std::string::npos ? 0 : 2, 0, n};
  }
};

enum class Action : uint8_t { kCopy, kQuantWeight, kScale, kDequantF32 };

struct OutTensor {
  std::string name;
  std::string src;  // the input tensor it comes from
  Action action = Action::kCopy;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
};

uint64_t numel_of(const std::vector<int64_t>& s) {
  uint64_t n = 1;
  for (int64_t d : s) n *= static_cast<uint64_t>(d);
  return n;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TANDEM_CHECK_KIND(kIo, in.good(), path, ": cannot open for reading");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  TANDEM_CHECK_KIND(kIo, out.good(), path, ": cannot open for writing");
  out << text;
  out.close();
  TANDEM_CHECK_KIND(kIo, out.good(), path, ": write failed");
}

// The module name of a weight ("a.b.weight" -> "a.b").
std::string module_of(const std::string& weight) {
  return weight.substr(0, weight.size() - std::string(".weight").size());
}

// One quantized weight: its codes, its scale bytes, and error statistics.
struct Quantized {
  std::vector<uint8_t> q;
  std::vector<uint8_t> scale;  // U8 E8M0 codes or F32 scale_inv bytes
};

Quantized quantize(const std::vector<float>& w, int64_t rows, int64_t cols, WeightQuant format,
                   QuantErrorStats& st) {
  Quantized out;
  out.q.resize(w.size());
  const float* table = f8e4m3_table();
  // Per-row error partials, summed in row order afterwards (deterministic).
  std::vector<double> sq_err(static_cast<size_t>(rows)), sq_ref(static_cast<size_t>(rows)),
      max_err(static_cast<size_t>(rows)), max_ratio(static_cast<size_t>(rows));
  std::vector<float> scale_f;  // the scale of each element's block, by (row, block)
  int64_t bc = 0, scols = 0;
  if (format == WeightQuant::kMxfp8) {
    bc = 32;
    scols = (cols + bc - 1) / bc;
    out.scale.resize(static_cast<size_t>(rows * scols));
    ThreadPool::global().parallel_for(rows, 16, [&](int64_t b, int64_t e) {
      quantize_mxfp8(w.data() + b * cols, e - b, cols, out.q.data() + b * cols,
                     out.scale.data() + b * scols);
    });
  } else {
    bc = 128;
    scols = (cols + bc - 1) / bc;
    const int64_t srows = (rows + 127) / 128;
    std::vector<float> s(static_cast<size_t>(srows * scols));
    ThreadPool::global().parallel_for(srows, 1, [&](int64_t b, int64_t e) {
      const int64_t r0 = b * 128, r1 = std::min(rows, e * 128);
      quantize_fp8_block(w.data() + r0 * cols, r1 - r0, cols, out.q.data() + r0 * cols,
                         s.data() + b * scols);
    });
    out.scale.resize(s.size() * 4);
    std::memcpy(out.scale.data(), s.data(), out.scale.size());
    scale_f = std::move(s);
  }
  ThreadPool::global().parallel_for(rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      double se = 0, sr = 0, me = 0, mr = 0;
      for (int64_t j = 0; j < cols; ++j) {
        const size_t k = static_cast<size_t>(i * cols + j);
        const float s = format == WeightQuant::kMxfp8
                            ? e8m0_to_f32(out.scale[static_cast<size_t>(i * scols + j / bc)])
                            : scale_f[static_cast<size_t>((i / 128) * scols + j / bc)];
        const float deq = table[out.q[k]] * s;
        const double ref = w[k];
        const double err = std::fabs(static_cast<double>(deq) - ref);
        const double bound =
            std::max(std::fabs(ref) * 0.0625, static_cast<double>(s) * (1.0 / 1024)) * (1.0 + 1e-6);
        se += err * err;
        sr += ref * ref;
        me = std::max(me, err);
        mr = std::max(mr, err / bound);
      }
      sq_err[static_cast<size_t>(i)] = se;
      sq_ref[static_cast<size_t>(i)] = sr;
      max_err[static_cast<size_t>(i)] = me;
      max_ratio[static_cast<size_t>(i)] = mr;
    }
  });
  st.tensors += 1;
  st.elements += rows * cols;
  for (size_t i = 0; i < sq_err.size(); ++i) {
    st.sum_sq_err += sq_err[i];
    st.sum_sq_ref += sq_ref[i];
    st.max_abs_err = std::max(st.max_abs_err, max_err[i]);
    st.max_bound_ratio = std::max(st.max_bound_ratio, max_ratio[i]);
  }
  return out;
}

// The safetensors header: u64 length + JSON (space-padded to 8 bytes).
std::string header_bytes(const std::vector<const OutTensor*>& tensors) {
  nlohmann::json h = nlohmann::json::object();
  h["__metadata__"] = {{"format", "pt"}};
  uint64_t off = 0;
  for (const OutTensor* t : tensors) {
    h[t->name] = {{"dtype", safetensors_dtype(t->dtype)},
                  {"shape", t->shape},
                  {"data_offsets", {off, off + t->nbytes}}};
    off += t->nbytes;
  }
  std::string js = h.dump();
  while ((js.size() + 8) % 8 != 0) js += ' ';
  std::string out(8, '\0');
  const uint64_t n = js.size();
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + js;
}

// The modules a converted checkpoint keeps unquantized: lm_head, the embedding, every MoE
// layer's router, then `kept`.
std::vector<std::string> unquantized_modules(const ModelConfig& config,
                                             const std::vector<std::string>& kept) {
  std::vector<std::string> skip = {"lm_head", "model.embed_tokens"};
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (config.is_moe_layer(l)) skip.push_back("model.layers." + std::to_string(l) + ".mlp.gate");
  }
  skip.insert(skip.end(), kept.begin(), kept.end());
  return skip;
}

}  // namespace

std::string converted_config_json(const std::string& config_text, const ModelConfig& config,
                                  WeightQuant format, const std::vector<std::string>& kept) {
  TANDEM_CHECK_KIND(kInvalidArgument,
                    format == WeightQuant::kMxfp8 || format == WeightQuant::kFp8Block,
                    "convert: the output format must be mxfp8 or fp8");
  Json cfg = Json::parse(config_text);
  cfg.erase("quantization_config");
  const std::vector<std::string> skip = unquantized_modules(config, kept);
  if (format == WeightQuant::kMxfp8) {
    cfg["quantization_config"] = {{"quant_method", "modelopt"},
                                  {"quant_algo", "MXFP8"},
                                  {"kv_cache_scheme", nullptr},
                                  {"ignore", skip},
                                  {"producer", {{"name", "tandem convert"}}}};
  } else {
    cfg["quantization_config"] = {{"quant_method", "fp8"},
                                  {"fmt", "e4m3"},
                                  {"activation_scheme", "dynamic"},
                                  {"weight_block_size", {128, 128}},
                                  {"modules_to_not_convert", skip}};
  }
  return cfg.dump(2) + "\n";
}

std::string linear_kind(const std::string& name) {
  if (!ends_with(name, ".weight")) return "";
  const std::string m = module_of(name);
  const size_t dot = m.rfind('.');
  const std::string leaf = dot == std::string::npos ? m : m.substr(dot + 1);
  // The MTP layer stays as stored (its loaders read bf16 / f32 only).
  if (m.rfind("mtp.", 0) == 0) return "";
  static const char* kAttn[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
  static const char* kMlp[] = {"gate_proj", "up_proj", "down_proj"};
  // Qwen3.5's gated DeltaNet: the linears Qwen's -FP8 checkpoints quantize (in_proj_b /
  // in_proj_a, of one row per value head, stay bf16 there).
  static const char* kDeltaNet[] = {"in_proj_qkv", "in_proj_z", "out_proj"};
  for (const char* a : kAttn) {
    if (leaf == a && m.find(".self_attn.") != std::string::npos) return leaf;
  }
  for (const char* a : kDeltaNet) {
    if (leaf == a && m.find(".linear_attn.") != std::string::npos) return "linear_attn." + leaf;
  }
  for (const char* a : kMlp) {
    if (leaf != a) continue;
    if (m.find(".mlp.experts.") != std::string::npos) return "experts." + leaf;
    if (m.find(".mlp.shared_expert.") != std::string::npos) return "shared_expert." + leaf;
    if (m.find(".mlp.") != std::string::npos) return "mlp." + leaf;
  }
  return "";
}

ConvertReport convert_checkpoint(const ConvertOptions& o) {
  TANDEM_CHECK_KIND(kInvalidArgument,
                    o.format == WeightQuant::kMxfp8 || o.format == WeightQuant::kFp8Block,
                    "convert: the output format must be mxfp8 or fp8");
  const std::string config_path = (fs::path(o.in_dir) / "config.json").string();
  const ModelConfig config = ModelConfig::from_dir(o.in_dir);  // validates the input
  std::error_code ec;
  TANDEM_CHECK_KIND(kInvalidArgument,
                    !fs::exists(o.out_dir, ec) ||
                        (fs::is_directory(o.out_dir, ec) && fs::is_empty(o.out_dir, ec)),
                    o.out_dir, ": the output directory exists and is not empty");
  TANDEM_CHECK_KIND(kInvalidArgument, o.shard_bytes > 0, "convert: shard size must be positive");
  const Checkpoint ckpt(o.in_dir);
  const WeightReader reader(ckpt, config.quant, config_path);

  // Plan the output tensors.
  std::vector<std::string> names = ckpt.names();
  std::sort(names.begin(), names.end(), NameOrder{});
  const std::string in_scale =
      config.quant.method == WeightQuant::kMxfp8 ? ".weight_scale" : ".weight_scale_inv";
  std::vector<OutTensor> plan;
  ConvertReport report;
  std::vector<std::string> ignore;  // modules left unquantized (for the config)
  for (const std::string& n : names) {
    const TensorView v = ckpt.get(n);
    if (config.quant.quantized() && ends_with(n, in_scale)) {
      const std::string w = n.substr(0, n.size() - in_scale.size()) + ".weight";
      if (ckpt.has(w) && ckpt.get(w).dtype == DType::kF8E4M3) continue;  // the input's scales
    }
    const std::string kind = linear_kind(n);
    const bool stored_f8 = v.dtype == DType::kF8E4M3;
    const bool is_linear = !kind.empty() && v.shape.ndim() == 2;
    // A linear the input kept unquantized (modules_to_not_convert) stays so.
    const bool kept_by_input = is_linear && config.quant.quantized() && !stored_f8;
    const bool whole_blocks =
        o.format != WeightQuant::kMxfp8 || (is_linear && v.shape[1] % 32 == 0);
    OutTensor t;
    t.name = n;
    t.src = n;
    t.shape = v.shape.to_vector();
    if (is_linear && !kept_by_input && whole_blocks) {
      const int64_t rows = v.shape[0], cols = v.shape[1];
      t.action = Action::kQuantWeight;
      t.dtype = DType::kF8E4M3;
      t.nbytes = numel_of(t.shape);
      plan.push_back(t);
      OutTensor s;
      s.src = n;
      s.action = Action::kScale;
      if (o.format == WeightQuant::kMxfp8) {
        s.name = n + "_scale";
        s.dtype = DType::kE8M0;
        s.shape = {rows, (cols + 31) / 32};
        s.nbytes = numel_of(s.shape);
      } else {
        s.name = n + "_scale_inv";
        s.dtype = DType::kF32;
        s.shape = {(rows + 127) / 128, (cols + 127) / 128};
        s.nbytes = 4 * numel_of(s.shape);
      }
      plan.push_back(s);
      continue;
    }
    if (is_linear) {
      ignore.push_back(module_of(n));
      report.kept_unquantized.push_back(n);
    }
    TANDEM_CHECK_KIND(kUnsupported, !stored_f8 || v.shape.ndim() == 2, ckpt.file_of(n),
                      ": tensor '", n, "': an F8_E4M3 tensor of shape ", v.shape.str(),
                      " is not a linear weight");
    t.action = stored_f8 ? Action::kDequantF32 : Action::kCopy;
    t.dtype = stored_f8 ? DType::kF32 : v.dtype;
    t.nbytes = stored_f8 ? 4 * numel_of(t.shape) : v.nbytes();
    plan.push_back(t);
  }

  // Files of at most shard_bytes (a tensor larger than that gets a file of its own).
  std::vector<std::vector<const OutTensor*>> files(1);
  uint64_t cur = 0, total_bytes = 0;
  for (const OutTensor& t : plan) {
    if (cur > 0 && cur + t.nbytes > o.shard_bytes) {
      files.emplace_back();
      cur = 0;
    }
    files.back().push_back(&t);
    cur += t.nbytes;
    total_bytes += t.nbytes;
  }

  fs::create_directories(o.out_dir, ec);
  TANDEM_CHECK_KIND(kIo, fs::is_directory(o.out_dir, ec), o.out_dir,
                    ": cannot create the output directory");
  std::map<std::string, QuantErrorStats> stats;
  std::map<std::string, std::vector<uint8_t>> pending_scales;  // weight name -> scale bytes
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t done = 0;
  uint64_t done_bytes = 0;
  for (size_t f = 0; f < files.size(); ++f) {
    char fname[64];
    if (files.size() == 1) {
      std::snprintf(fname, sizeof fname, "model.safetensors");
    } else {
      std::snprintf(fname, sizeof fname, "model-%05zu-of-%05zu.safetensors", f + 1, files.size());
    }
    const std::string path = (fs::path(o.out_dir) / fname).string();
    std::ofstream out(path, std::ios::binary);
    TANDEM_CHECK_KIND(kIo, out.good(), path, ": cannot open for writing");
    const std::string hdr = header_bytes(files[f]);
    out.write(hdr.data(), static_cast<std::streamsize>(hdr.size()));
    for (const OutTensor* t : files[f]) {
      weight_map[t->name] = fname;
      const TensorView v = ckpt.get(t->src);
      auto put = [&](const void* p, size_t n) {
        out.write(static_cast<const char*>(p), static_cast<std::streamsize>(n));
      };
      switch (t->action) {
        case Action::kCopy: put(v.data, v.nbytes()); break;
        case Action::kDequantF32:
        case Action::kQuantWeight: {
          const int64_t rows = v.shape[0], cols = v.shape[1];
          std::vector<float> w(static_cast<size_t>(rows * cols));
          reader.read(t->src, rows, cols, w.data());
          if (t->action == Action::kDequantF32) {
            put(w.data(), w.size() * 4);
            break;
          }
          const std::string kind = linear_kind(t->src);
          QuantErrorStats& st = stats[kind];
          st.kind = kind;
          Quantized qz = quantize(w, rows, cols, o.format, st);
          put(qz.q.data(), qz.q.size());
          pending_scales[t->src] = std::move(qz.scale);
          break;
        }
        case Action::kScale: {
          auto it = pending_scales.find(t->src);
          TANDEM_CHECK(it != pending_scales.end() && it->second.size() == t->nbytes,
                       "convert: scale of '", t->src, "' not ready");
          put(it->second.data(), it->second.size());
          pending_scales.erase(it);
          break;
        }
      }
      if (t->action == Action::kQuantWeight) ++report.quantized_tensors;
      if (t->action == Action::kCopy || t->action == Action::kDequantF32) {
        ++report.copied_tensors;
      }
      ++done;
      done_bytes += t->nbytes;
      if (o.progress) o.progress(done, static_cast<int64_t>(plan.size()), done_bytes, total_bytes);
    }
    out.close();
    TANDEM_CHECK_KIND(kIo, out.good(), path, ": write failed (disk full?)");
    report.files.push_back(fname);
  }
  report.bytes_out = total_bytes;
  if (files.size() > 1) {
    nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}},
                            {"weight_map", weight_map}};
    write_text((fs::path(o.out_dir) / "model.safetensors.index.json").string(),
               index.dump(2) + "\n");
  }

  // config.json: the input's, with the new quantization_config.
  if (o.format == WeightQuant::kMxfp8) {
    const std::vector<std::string> skip = unquantized_modules(config, ignore);
    Json hf = {
        {"producer", {{"name", "tandem convert"}}},
        {"quantization",
         {{"quant_algo", "MXFP8"}, {"kv_cache_quant_algo", nullptr}, {"exclude_modules", skip}}}};
    write_text((fs::path(o.out_dir) / "hf_quant_config.json").string(), hf.dump(2) + "\n");
  }
  write_text((fs::path(o.out_dir) / "config.json").string(),
             converted_config_json(read_text(config_path), config, o.format, ignore));

  // Everything else of the input directory (tokenizer, generation config, ...).
  for (const fs::directory_entry& e : fs::directory_iterator(o.in_dir, ec)) {
    if (!e.is_regular_file(ec)) continue;
    const std::string fn = e.path().filename().string();
    if (ends_with(fn, ".safetensors") || fn == "model.safetensors.index.json" ||
        fn == "config.json" || fn == "hf_quant_config.json" || fn == "golden.json" ||
        fn == "README.md") {
      continue;
    }
    fs::copy_file(e.path(), fs::path(o.out_dir) / fn, fs::copy_options::overwrite_existing, ec);
    TANDEM_CHECK_KIND(kIo, !ec, e.path().string(), ": copy failed: ", ec.message());
  }
  for (auto& [k, s] : stats) report.kinds.push_back(s);
  return report;
}

std::string format_report(const ConvertReport& r) {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "%-24s %8s %12s %12s %12s %12s\n", "tensor kind", "tensors",
                "elements", "rel RMS err", "max |err|", "max err/bnd");
  os << line;
  for (const QuantErrorStats& s : r.kinds) {
    std::snprintf(line, sizeof line, "%-24s %8lld %12lld %12.3e %12.3e %12.3f\n", s.kind.c_str(),
                  static_cast<long long>(s.tensors), static_cast<long long>(s.elements),
                  s.rel_rms(), s.max_abs_err, s.max_bound_ratio);
    os << line;
  }
  os << r.quantized_tensors << " tensors quantized, " << r.copied_tensors << " kept as stored";
  if (!r.kept_unquantized.empty()) {
    os << " (" << r.kept_unquantized.size() << " of them linears:";
    for (size_t i = 0; i < std::min<size_t>(3, r.kept_unquantized.size()); ++i) {
      os << " " << r.kept_unquantized[i];
    }
    if (r.kept_unquantized.size() > 3) os << " ...";
    os << ")";
  }
  os << "; " << r.files.size() << " file(s), " << r.bytes_out << " bytes\n";
  return os.str();
}

}  // namespace tandem
