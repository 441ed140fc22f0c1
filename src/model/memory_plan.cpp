#include "model/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "core/error.h"
#include "model/hybrid_state.h"

namespace tandem {

namespace {

constexpr int64_t kBf16 = 2;
constexpr int64_t kFixedOverhead = int64_t{1} << 30;  // CUDA context, cuBLAS, graphs
constexpr int64_t kLargestBucket = 256;               // the decode graphs' largest batch bucket

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// True when `module` (e.g. "model.layers.3.self_attn.q_proj") is named by an entry of
// modules_to_not_convert / ignore: the entry equals it or is a dotted part of it.
bool not_converted(const QuantConfig& q, const std::string& module) {
  for (const std::string& e : q.not_converted) {
    if (e.empty()) continue;
    const std::string m = "." + module + ".", d = "." + e + ".";
    if (m.find(d) != std::string::npos) return true;
  }
  return false;
}

std::string gb(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f GB", bytes / 1e9);
  return buf;
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", bytes / (1 << 20));
  return buf;
}

// The weights of one rank.
struct WeightCounter {
  const ModelConfig& c;
  const MemoryPlanOptions& o;
  const ShardPlan& p;
  WeightBytes w;

  // An [n, k] linear of `module`, this rank's column range `cols` of k (row slices need nothing:
  // the scales are per row).
  int64_t linear(const std::string& module, int64_t n, int64_t k, IndexRange cols) const {
    const QuantConfig& q = c.quant;
    const bool fp8_kept =
        q.method == WeightQuant::kFp8Block || (q.method == WeightQuant::kMxfp8 && o.mxfp8_native);
    if (!fp8_kept || not_converted(q, module) || k % 16 != 0 || n % 8 != 0) return n * k * kBf16;
    // The loaders keep FP8 only where each kept column block lies in this rank's columns.
    // (WeightReader::fp8_columns_splittable; MXFP8 native: whole 32-column groups.)
    const int64_t block = q.method == WeightQuant::kFp8Block ? 128 : 32, off = cols.begin % block;
    if (off != 0 && (q.method != WeightQuant::kFp8Block || cols.size() > block - off)) {
      return n * k * kBf16;
    }
    return linear_bytes(n, k, q, o.mxfp8_native);
  }

  void count() {
    const int64_t h = c.hidden_size, d = c.head_dim, V = c.vocab_size;
    w.embedding = V * h * kBf16;
    w.lm_head = c.tie_word_embeddings ? 0 : p.vocab.size() * h * kBf16;
    w.norms = h * kBf16;  // final norm
    const int64_t qh = p.q_heads.size(), kvh = p.kv_heads.size();
    const int64_t t = p.tensor_parallel() ? p.spec.size : 1;
    const IndexRange all_h{0, h};
    const DeltaNetHeads dn = c.is_hybrid() ? DeltaNetHeads::of(c, p.spec) : DeltaNetHeads{};
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string pre = c.weight_prefix + "layers." + std::to_string(l) + ".";
      w.norms += 2 * h * kBf16;  // input / post-attention norms
      const bool linear_attn = c.is_hybrid() && c.layer_types[static_cast<size_t>(l)] ==
                                                    ModelConfig::LayerType::kLinearAttention;
      if (linear_attn) {
        const std::string a = pre + "linear_attn.";
        const int64_t hk = dn.key_heads.size(), hv = dn.value_heads.size();
        const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
        const int64_t conv = 2 * hk * dk + hv * dv;
        // Qwen35MoeCuda's in_proj: one matrix of qkv | z | b | a rows padded to a multiple of 8,
        // FP8 (b / a quantized at load) when in_proj_qkv and in_proj_z stay FP8.
        const int64_t qkv8 = linear(a + "in_proj_qkv", conv, h, all_h),
                      z8 = linear(a + "in_proj_z", hv * dv, h, all_h);
        if (qkv8 < conv * h * kBf16 && z8 < hv * dv * h * kBf16) {
          const int64_t rows = (conv + hv * dv + 2 * hv + 7) / 8 * 8;
          w.deltanet += linear_bytes(rows, h, c.quant, o.mxfp8_native);
        } else {
          w.deltanet += qkv8 + z8 + 2 * hv * h * kBf16;  // in_proj_b, in_proj_a bf16
        }
        w.deltanet += conv * c.linear_conv_kernel_dim * kBf16;  // conv1d
        w.deltanet += (2 * hv + dv) * 4;                        // A_log, dt_bias, norm (fp32)
        w.deltanet += linear(a + "out_proj", h, hv * dv,
                             {dn.value_heads.begin * dv, dn.value_heads.end * dv});
      } else {
        const std::string a = pre + "self_attn.";
        const int64_t gate = c.attn_output_gate ? 2 : 1;  // Qwen3.5's q_proj: query | gate
        const int64_t qkv_rows = (gate * qh + 2 * kvh) * d;
        // Each of q / k / v must stay FP8 for the fused matrix to (Qwen3MoeCuda's rule).
        auto kept8 = [&](const std::string& m, int64_t n) {
          return linear(m, n, h, all_h) < n * h * kBf16;
        };
        const bool all8 = kept8(a + "q_proj", gate * qh * d) && kept8(a + "k_proj", kvh * d) &&
                          kept8(a + "v_proj", kvh * d);
        w.attention +=
            all8 ? linear_bytes(qkv_rows, h, c.quant, o.mxfp8_native) : qkv_rows * h * kBf16;
        w.attention += linear(a + "o_proj", h, qh * d, {p.q_heads.begin * d, p.q_heads.end * d});
        w.attention += 2 * d * kBf16;  // q_norm, k_norm
      }
      const std::string mlp = pre + "mlp.";
      if (c.is_moe_layer(l)) {
        const int64_t e = p.experts.size(), inter = c.moe_intermediate_size;
        w.router += c.num_experts * h * kBf16;
        const std::string ex = mlp + "experts";
        const int64_t gu = linear(ex, 2 * inter, h, all_h), dn_b = linear(ex, h, inter, {0, inter});
        // Both expert GEMMs FP8 or neither.
        const bool both8 = gu < 2 * inter * h * kBf16 && dn_b < h * inter * kBf16;
        w.experts += e * (both8 ? gu + dn_b : 3 * inter * h * kBf16);
        if (c.shared_expert_intermediate_size > 0) {
          const int64_t si = c.shared_expert_intermediate_size / t;
          const std::string s = mlp + "shared_expert";
          w.shared_expert += linear(s + ".gate_proj", 2 * si, h, all_h);
          w.shared_expert += linear(s + ".down_proj", h, si, {0, si});
          w.shared_expert += h * kBf16;  // shared_expert_gate
        }
      } else {
        const int64_t inter = c.intermediate_size;
        w.dense_mlp += linear(mlp + "gate_proj", 2 * inter, h, all_h);
        w.dense_mlp += linear(mlp + "down_proj", h, inter, {0, inter});
      }
    }
  }
};

}  // namespace

int64_t linear_bytes(int64_t n, int64_t k, const QuantConfig& q, bool mxfp8_native) {
  switch (q.method) {
    case WeightQuant::kFp8Block: return n * k + n * ceil_div(k, 128) * 4;
    case WeightQuant::kMxfp8: return mxfp8_native ? n * k + n * ceil_div(k, 32) : n * k * kBf16;
    case WeightQuant::kNone: break;
  }
  return n * k * kBf16;
}

MemoryPlan plan_memory(const ModelConfig& c, MemoryPlanOptions o) {
  TANDEM_CHECK_KIND(kInvalidArgument, o.ranks >= 1, "ranks must be at least 1, not ", o.ranks);
  TANDEM_CHECK_KIND(kInvalidArgument, o.mode != ShardMode::kSingle || o.ranks == 1,
                    "a single (serve) instance has 1 rank, not ", o.ranks);
  TANDEM_CHECK_KIND(kInvalidArgument, o.gpu_memory_bytes > 0, "the GPU memory must be positive");
  TANDEM_CHECK_KIND(kInvalidArgument, o.gpu_memory_utilization > 0 && o.gpu_memory_utilization <= 1,
                    "--gpu-memory-utilization must be in (0, 1], not ", o.gpu_memory_utilization);
  TANDEM_CHECK_KIND(kInvalidArgument, o.page_size > 0 && o.max_num_seqs > 0,
                    "page size and max_num_seqs must be positive");
  TANDEM_CHECK_KIND(
      kInvalidArgument, o.kv_cache_bytes_per_elem == 1 || o.kv_cache_bytes_per_elem == 2,
      "KV cache element bytes must be 1 (fp8) or 2 (bf16), not ", o.kv_cache_bytes_per_elem);
  if (o.max_model_len <= 0) o.max_model_len = c.max_position_embeddings;
  TANDEM_CHECK_KIND(kInvalidArgument, o.max_model_len > 0,
                    "give --max-model-len (config.json has no max_position_embeddings)");
  if (o.max_num_batched_tokens <= 0) {
    o.max_num_batched_tokens = o.mode == ShardMode::kDecodeDpEp ? 4096 : 1024;
  }
  MemoryPlan m;
  m.options = o;
  const ShardSpec spec{o.mode, 0, o.ranks};
  m.shard = ShardPlan::make(c, spec);
  const ShardPlan& p = m.shard;

  // Weights: rank 0, and every rank summed.
  WeightCounter wc{c, o, p, {}};
  wc.count();
  m.weights = wc.w;
  for (int r = 0; r < o.ranks; ++r) {
    const ShardPlan pr = ShardPlan::make(c, {o.mode, r, o.ranks});
    WeightCounter each{c, o, pr, {}};
    each.count();
    m.weights_all_ranks += each.w.total();
  }
  switch (c.quant.method) {
    case WeightQuant::kNone: m.weight_format = "bf16"; break;
    case WeightQuant::kFp8Block:
      m.weight_format = "block FP8 (1 byte + fp32 per row and 128 columns; the rest bf16)";
      break;
    case WeightQuant::kMxfp8:
      m.weight_format = o.mxfp8_native ? "MXFP8 native (1 byte + 1 E8M0 byte per 32; the rest bf16)"
                                       : "MXFP8 dequantized to bf16 at load (the default)";
      break;
  }

  // Activations: the buffers the loaders size for T tokens and R logits rows.
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t t = p.tensor_parallel() ? p.spec.size : 1;
  const int64_t T = std::max(o.max_num_batched_tokens, std::min(o.max_num_seqs, kLargestBucket));
  const int64_t R = std::max(
      {o.max_num_seqs, std::min(o.max_num_seqs, kLargestBucket), std::min<int64_t>(T, 1024)});
  const int64_t gate = c.attn_output_gate ? 2 : 1;
  const int64_t qkv = (gate * p.q_heads.size() + 2 * p.kv_heads.size()) * d;
  int64_t per_token = 4 * h + qkv + 2 * p.q_heads.size() * d;  // x xn y last | qkv | q attn
  if (c.is_hybrid()) {
    const DeltaNetHeads dn = DeltaNetHeads::of(c, spec);
    const int64_t conv = 2 * dn.key_heads.size() * c.linear_key_head_dim +
                         dn.value_heads.size() * c.linear_value_head_dim;
    const int64_t vd = dn.value_heads.size() * c.linear_value_head_dim;
    per_token += (conv + vd + 2 * dn.value_heads.size()) + conv + vd;  // in_proj | conv | core
    per_token += 3 * c.shared_expert_intermediate_size / t;            // shared gate_up | act
  }
  const int64_t inter = c.moe_intermediate_size, k = c.num_experts_per_tok;
  per_token += k * (3 * inter + h);  // routed rows: gate_up | act | down
  const int64_t per_token_bytes = per_token * kBf16 + c.num_experts * 4;  // + fp32 router logits
  const int64_t logits = R * c.vocab_size * 8;  // fp32 logits + the sampler's copy
  // W8A16 FP8 experts: prefill batches dequantize one layer's local experts to bf16.
  const bool fp8_experts = m.weights.experts < p.experts.size() * 3 * inter * h * kBf16;
  const int64_t dequant = fp8_experts ? p.experts.size() * 3 * inter * h * kBf16 : 0;
  m.activations = T * per_token_bytes + logits + dequant + kFixedOverhead;
  {
    std::ostringstream f;
    f << "T x " << per_token_bytes << " B/token + R x V x 8 (fp32 logits, sampler) "
      << (dequant > 0 ? "+ one layer's local experts in bf16 (FP8 prefill dequant) " : "")
      << "+ 1 GiB (context, cuBLAS, graphs); T = max(max-num-batched-tokens, min(max-num-seqs, "
      << kLargestBucket << ")) = " << T << ", R = max(max-num-seqs, min(T, 1024)) = " << R
      << ", V = " << c.vocab_size << "; per token: bf16 of 4 x hidden + qkv + 2 x q heads"
      << (c.is_hybrid() ? " + DeltaNet in_proj / conv / core + shared expert 3 x inter" : "")
      << " + top_k x (3 x moe_inter + hidden), fp32 router logits";
    m.activation_formula = f.str();
  }

  m.budget = static_cast<int64_t>(o.gpu_memory_bytes * o.gpu_memory_utilization);
  m.kv_state_bytes = m.budget - m.weights.total() - m.activations;

  // KV: the attention layers, this rank's KV heads.
  int64_t attn_layers = c.num_hidden_layers;
  if (c.is_hybrid()) {
    attn_layers = 0;
    for (auto lt : c.layer_types) attn_layers += lt == ModelConfig::LayerType::kFullAttention;
  }
  m.kv_bytes_per_token = attn_layers * 2 * p.kv_heads.size() * d * o.kv_cache_bytes_per_elem;
  m.page_bytes = m.kv_bytes_per_token * o.page_size;
  m.pages_per_seq = ceil_div(o.max_model_len, o.page_size);
  if (c.is_hybrid()) {
    m.state_bytes_per_seq = HybridStateLayout::of(c, DeltaNetHeads::of(c, spec)).slot_elems() * 4;
    m.state_slots_per_seq = 1 + (o.prefix_cache ? 1 : 0) + (o.speculative ? 1 : 0);
  }
  const int64_t state_per_seq = m.state_bytes_per_seq * m.state_slots_per_seq;
  const int64_t seq_bytes = m.pages_per_seq * m.page_bytes + state_per_seq;
  if (m.kv_state_bytes > 0) {
    m.max_batch = m.kv_state_bytes / seq_bytes;
    const int64_t left = m.kv_state_bytes - state_per_seq;
    m.max_context = left > 0 ? left / m.page_bytes * o.page_size : 0;
    const int64_t pool = m.kv_state_bytes - o.max_num_seqs * state_per_seq;
    m.num_pages = pool > 0 ? pool / m.page_bytes : 0;
  }

  // Refusals, the first that applies.
  const std::string layout = std::string(shard_mode_name(o.mode)) + " over " +
                             std::to_string(o.ranks) + " rank" + (o.ranks > 1 ? "s" : "");
  std::ostringstream why;
  if (m.kv_state_bytes <= 0) {
    why << layout << ": the weights (" << gb(static_cast<double>(m.weights.total()))
        << " per rank) and activations (" << gb(static_cast<double>(m.activations))
        << ") exceed the rank's budget of " << gb(static_cast<double>(m.budget)) << " ("
        << o.gpu_memory_utilization << " x " << gb(o.gpu_memory_bytes) << ") by "
        << gb(static_cast<double>(-m.kv_state_bytes)) << ", leaving nothing for the KV cache";
  } else if (m.max_batch < 1) {
    why << layout << ": one sequence of max-model-len " << o.max_model_len << " needs "
        << gb(static_cast<double>(seq_bytes)) << " of KV and state, "
        << gb(static_cast<double>(m.kv_state_bytes)) << " is left after the weights and "
        << "activations (short by " << gb(static_cast<double>(seq_bytes - m.kv_state_bytes))
        << "); the largest context that fits is " << m.max_context << " tokens";
  } else if (m.num_pages < m.pages_per_seq) {
    why << layout << ": the state slots of max-num-seqs " << o.max_num_seqs << " ("
        << gb(static_cast<double>(o.max_num_seqs * state_per_seq)) << ") leave " << m.num_pages
        << " KV pages, fewer than one sequence of max-model-len " << o.max_model_len << " needs ("
        << m.pages_per_seq << "); at most " << m.max_batch << " sequences of that length fit";
  }
  m.refusal = why.str();
  m.fits = m.refusal.empty();
  return m;
}

std::string MemoryPlan::describe(const ModelConfig& c) const {
  const MemoryPlanOptions& o = options;
  std::ostringstream s;
  auto line = [&](const char* what, int64_t bytes) {
    if (bytes != 0) s << "    " << what << gb(static_cast<double>(bytes)) << "\n";
  };
  s << "model: " << c.model_type << " (" << c.num_hidden_layers << " layers, " << c.num_experts
    << " experts";
  if (c.is_hybrid()) s << ", hybrid DeltaNet / attention";
  s << "), weights " << weight_format << "\n";
  s << "layout: " << shard_mode_name(o.mode) << ", " << o.ranks << " rank(s); rank 0 holds "
    << shard.q_heads.size() << " q heads, " << shard.kv_heads.size() << " KV heads, "
    << shard.experts.size() << " experts, " << shard.vocab.size() << " vocab rows\n";
  s << "per rank:\n  weights " << gb(static_cast<double>(weights.total())) << "\n";
  line("embedding      ", weights.embedding);
  line("lm_head        ", weights.lm_head);
  line("attention      ", weights.attention);
  line("deltanet       ", weights.deltanet);
  line("experts        ", weights.experts);
  line("shared expert  ", weights.shared_expert);
  line("dense mlp      ", weights.dense_mlp);
  line("router         ", weights.router);
  line("norms          ", weights.norms);
  s << "  activations " << gb(static_cast<double>(activations))
    << " (estimate: " << activation_formula << ")\n";
  s << "  budget " << gb(static_cast<double>(budget)) << " (" << o.gpu_memory_utilization << " x "
    << gb(o.gpu_memory_bytes) << ")\n";
  s << "  left for KV and state " << gb(static_cast<double>(kv_state_bytes)) << "\n";
  s << "  KV per token " << kv_bytes_per_token << " bytes ("
    << (o.kv_cache_bytes_per_elem == 1 ? "fp8" : "bf16") << ", page of " << o.page_size
    << " tokens " << mib(static_cast<double>(page_bytes)) << ")\n";
  if (state_bytes_per_seq > 0) {
    s << "  state per sequence " << mib(static_cast<double>(state_bytes_per_seq)) << " x "
      << state_slots_per_seq << " slots (running" << (o.prefix_cache ? ", prefix checkpoint" : "")
      << (o.speculative ? ", speculation spare" : "") << ")\n";
  }
  s << "  all ranks' weights " << gb(static_cast<double>(weights_all_ranks)) << "\n";
  if (!fits) {
    s << "does not fit: " << refusal << "\n";
    return s.str();
  }
  s << "fits: " << max_batch << " sequences of " << o.max_model_len
    << " tokens (max-model-len), or one sequence of " << max_context << " tokens; with "
    << "max-num-seqs " << o.max_num_seqs << " the engine gets " << num_pages << " KV pages ("
    << num_pages * o.page_size << " tokens)\n";
  return s.str();
}

}  // namespace tandem
