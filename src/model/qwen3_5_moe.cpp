#include "model/qwen3_5_moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "backend/cpu/ops.h"
#include "comm/communicator.h"
#include "comm/moe_dispatch.h"
#include "core/error.h"
#include "model/gated_qkv.h"
#include "model/lm_head.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "model/weight_load.h"

namespace tandem {

namespace {

// Rows of a vector / matrix already in memory: [r.begin, r.end) of `t` ([rows, cols]).
HostTensor take_rows(const HostTensor& t, int64_t cols, const std::vector<IndexRange>& ranges) {
  int64_t total = 0;
  for (const auto& r : ranges) total += r.size();
  HostTensor out(DType::kF32, {total, cols});
  float* dst = out.ptr<float>();
  for (const auto& r : ranges) {
    std::memcpy(dst, t.ptr<float>() + r.begin * cols, sizeof(float) * r.size() * cols);
    dst += r.size() * cols;
  }
  return out;
}

// Expert e of a fused [experts, rows, cols] tensor.
HostTensor load_expert(const Checkpoint& ckpt, const std::string& name, int64_t experts, int64_t e,
                       int64_t rows, int64_t cols) {
  TensorView src = ckpt.get(name, {experts, rows, cols});
  HostTensor t(DType::kF32, {rows, cols});
  Checkpoint::to_f32(src, t.ptr<float>(), e, e + 1);
  return t;
}

}  // namespace

Qwen35MoeCpu::Qwen35MoeCpu(ModelConfig config, ShardPlan plan, DeltaNetHeads dn,
                           comm::Communicator* comm)
    : config_(std::move(config)), plan_(plan), dn_(dn), comm_(comm) {
  const auto& c = config_;
  key_dim_ = dn_.key_heads.size() * c.linear_key_head_dim;
  value_dim_ = dn_.value_heads.size() * c.linear_value_head_dim;
  conv_dim_ = 2 * key_dim_ + value_dim_;
  shared_inter_ = HybridSlices::of(c, plan_, dn_).shared_inter;
}

Qwen35MoeCpu::~Qwen35MoeCpu() = default;

std::unique_ptr<Qwen35MoeCpu> Qwen35MoeCpu::load(const std::string& dir) {
  return load(dir, ShardSpec::single(), nullptr);
}

std::unique_ptr<Qwen35MoeCpu> Qwen35MoeCpu::load(const std::string& dir, const ShardSpec& shard,
                                                 comm::Communicator* comm) {
  ModelConfig config = ModelConfig::from_dir(dir);
  TANDEM_CHECK_KIND(kUnsupported, config.is_hybrid(), dir, "/config.json: model_type '",
                    config.model_type, "' is not a Qwen3.5 hybrid model");
  ShardPlan plan = ShardPlan::make(config, shard);
  DeltaNetHeads dn = DeltaNetHeads::of(config, shard);
  (void)HybridSlices::of(config, plan, dn);  // throws when the shared expert does not split
  check_shard_communicator(shard, comm);
  Checkpoint ckpt(dir);
  std::unique_ptr<Qwen35MoeCpu> model(new Qwen35MoeCpu(std::move(config), plan, dn, comm));
  model->load_weights(ckpt, (std::filesystem::path(dir) / "config.json").string());
  if (plan.data_parallel() && plan.experts.size() > 0) {
    const auto& c = model->config_;
    model->all_to_all_ = std::make_unique<comm::MoeAllToAll>(*comm, c.num_experts, c.hidden_size,
                                                             c.num_experts_per_tok);
  }
  return model;
}

void Qwen35MoeCpu::load_weights(const Checkpoint& ckpt, const std::string& config_path) {
  const auto& c = config_;
  const WeightReader wr(ckpt, c.quant, config_path);
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t kern = c.linear_conv_kernel_dim;
  const int64_t inter = c.moe_intermediate_size, sinter = c.shared_expert_intermediate_size;
  const std::string& root = c.weight_prefix;
  // This rank's rows: q_proj's (query, gate) rows of its query heads, its KV heads' rows; the
  // DeltaNet channels of its key / value heads (q | k | v of the conv, z, b, a).
  const HybridSlices sl = HybridSlices::of(c, plan_, dn_);
  const IndexRange q_rows = sl.q_rows, o_cols = sl.o_cols, kv_rows = sl.kv_rows;
  const IndexRange kq = sl.conv_q, kk = sl.conv_k, vv = sl.conv_v, zr = sl.z_rows, vh = sl.v_heads;
  const int64_t conv_all = 2 * hk * dk + hv * dv, value_all = hv * dv;
  embed_ = load_f32(ckpt, root + "embed_tokens.weight", {c.vocab_size, h});
  norm_ = load_f32(ckpt, root + "norm.weight", {h}, /*plus_one=*/true);
  if (!c.tie_word_embeddings) {
    lm_head_ = load_rows(wr, {{"lm_head.weight", c.vocab_size, plan_.vocab}}, h);
  }

  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& layer = layers_[static_cast<size_t>(l)];
    const std::string p = root + "layers." + std::to_string(l) + ".";
    layer.linear =
        c.layer_types[static_cast<size_t>(l)] == ModelConfig::LayerType::kLinearAttention;
    layer.index = layer.linear ? num_linear_++ : num_attention_++;
    layer.input_norm = load_f32(ckpt, p + "input_layernorm.weight", {h}, true);
    layer.post_norm = load_f32(ckpt, p + "post_attention_layernorm.weight", {h}, true);
    if (layer.linear) {
      const std::string a = p + "linear_attn.";
      const std::string qkv = a + "in_proj_qkv.weight";
      layer.in_proj = load_rows(wr,
                                {{qkv, conv_all, kq},
                                 {qkv, conv_all, kk},
                                 {qkv, conv_all, vv},
                                 {a + "in_proj_z.weight", value_all, zr},
                                 {a + "in_proj_b.weight", hv, vh},
                                 {a + "in_proj_a.weight", hv, vh}},
                                h);
      HostTensor conv = load_f32(ckpt, a + "conv1d.weight", {conv_all, 1, kern});
      layer.conv = take_rows(conv, kern, {kq, kk, vv});
      layer.a_log = take_rows(load_f32(ckpt, a + "A_log", {hv}), 1, {vh});
      layer.dt_bias = take_rows(load_f32(ckpt, a + "dt_bias", {hv}), 1, {vh});
      layer.out_norm = load_f32(ckpt, a + "norm.weight", {dv});
      layer.out_proj = load_cols(wr, a + "out_proj.weight", h, value_all, zr);
    } else {
      const std::string a = p + "self_attn.";
      layer.qkv = load_rows(wr,
                            {{a + "q_proj.weight", qh * 2 * d, q_rows},
                             {a + "k_proj.weight", kvh * d, kv_rows},
                             {a + "v_proj.weight", kvh * d, kv_rows}},
                            h);
      layer.o = load_cols(wr, a + "o_proj.weight", h, qh * d, o_cols);
      layer.q_norm = load_f32(ckpt, a + "q_norm.weight", {d}, true);
      layer.k_norm = load_f32(ckpt, a + "k_norm.weight", {d}, true);
    }
    const std::string m = p + "mlp.";
    layer.router = load_f32(ckpt, m + "gate.weight", {c.num_experts, h});
    // Experts (this rank's): fused 3D (transformers 5) or one tensor per expert (the hub).
    const bool fused = ckpt.has(m + "experts.gate_up_proj");
    for (int64_t e = plan_.experts.begin; e < plan_.experts.end; ++e) {
      if (fused) {
        layer.gate_up.push_back(
            load_expert(ckpt, m + "experts.gate_up_proj", c.num_experts, e, 2 * inter, h));
        layer.down.push_back(
            load_expert(ckpt, m + "experts.down_proj", c.num_experts, e, h, inter));
      } else {
        const std::string ep = m + "experts." + std::to_string(e) + ".";
        layer.gate_up.push_back(load_rows(wr,
                                          {{ep + "gate_proj.weight", inter, {0, inter}},
                                           {ep + "up_proj.weight", inter, {0, inter}}},
                                          h));
        layer.down.push_back(load_matrix(wr, ep + "down_proj.weight", h, inter));
      }
    }
    for (auto& t : layer.gate_up) layer.gate_up_ptrs.push_back(t.ptr<float>());
    for (auto& t : layer.down) layer.down_ptrs.push_back(t.ptr<float>());
    layer.shared_gate_up = load_rows(wr,
                                     {{m + "shared_expert.gate_proj.weight", sinter, shared_inter_},
                                      {m + "shared_expert.up_proj.weight", sinter, shared_inter_}},
                                     h);
    layer.shared_down =
        load_cols(wr, m + "shared_expert.down_proj.weight", h, sinter, shared_inter_);
    layer.shared_gate = load_f32(ckpt, m + "shared_expert_gate.weight", {1, h});
  }
  TANDEM_CHECK_KIND(kUnsupported, num_attention_ > 0, ckpt.dir(),
                    "/config.json: layer_types has no full_attention layer");
}

KvGeometry Qwen35MoeCpu::kv_geometry(int64_t num_pages, int64_t page_size) const {
  return {num_attention_, num_pages, plan_.kv_heads.size(), page_size, config_.head_dim};
}

int64_t Qwen35MoeCpu::state_elems_per_layer() const { return state_layout().layer_elems(); }

int64_t Qwen35MoeCpu::state_slot_elems() const { return state_layout().slot_elems(); }

void Qwen35MoeCpu::moe_block(const Layer& layer, const float* xn, int64_t n, float* y) {
  const auto& c = config_;
  const int64_t h = c.hidden_size, inter = c.moe_intermediate_size;
  const int64_t k = c.num_experts_per_tok, si = shared_inter_.size();
  std::vector<float> router(static_cast<size_t>(n * c.num_experts));
  std::vector<int32_t> topk_ids(static_cast<size_t>(n * k));
  std::vector<float> topk_w(topk_ids.size());
  if (n > 0) {
    cpu::gemm({xn, layer.router.ptr<float>(), router.data(), n, c.num_experts, h});
    cpu::topk_softmax({router.data(), topk_ids.data(), topk_w.data(), n, c.num_experts, k, true});
  }
  if (plan_.data_parallel()) {
    // Decode EP: tokens travel to their experts' ranks (every rank takes part, also with no
    // tokens of its own); the home rank sums the pairs in ascending expert id, as cpu::moe.
    comm::MoeAllToAll& a2a = *all_to_all_;
    a2a.dispatch(xn, topk_ids.data(), topk_w.data(), n);
    cpu::moe({a2a.pair_x(), a2a.pair_expert(), a2a.pair_weight(), layer.gate_up_ptrs.data(),
              layer.down_ptrs.data(), a2a.pair_out(), a2a.num_pairs(), h, inter, 1,
              plan_.experts.begin, plan_.experts.size()});
    a2a.combine(y);
  } else if (n > 0) {
    // Single, or prefill EP: this rank's experts over the replicated tokens.
    cpu::moe({xn, topk_ids.data(), topk_w.data(), layer.gate_up_ptrs.data(), layer.down_ptrs.data(),
              y, n, h, inter, k, plan_.experts.begin, plan_.experts.size()});
  }
  if (n > 0) {
    // The shared expert (prefill TP: this rank's intermediate columns) times its sigmoid gate.
    std::vector<float> sgu(static_cast<size_t>(n * 2 * si)), sact(static_cast<size_t>(n * si));
    std::vector<float> sout(static_cast<size_t>(n * h)), sgate(static_cast<size_t>(n));
    cpu::gemm({xn, layer.shared_gate_up.ptr<float>(), sgu.data(), n, 2 * si, h});
    cpu::silu_mul({sgu.data(), sact.data(), n, si});
    cpu::gemm({sact.data(), layer.shared_down.ptr<float>(), sout.data(), n, h, si});
    cpu::gemm({xn, layer.shared_gate.ptr<float>(), sgate.data(), n, 1, h});
    cpu::sigmoid_gate({sout.data(), sgate.data(), y, n, h, 1, /*per_row=*/true,
                       /*accumulate=*/true});
  }
  if (plan_.tensor_parallel() && n > 0) comm_->all_reduce_sum(y, n * h, DType::kF32);
}

void Qwen35MoeCpu::lm_head(const float* last, int64_t r, std::vector<float>& logits) {
  const int64_t vocab_begin = plan_.tensor_parallel() ? plan_.vocab.begin : 0;
  const float* head = config_.tie_word_embeddings
                          ? embed_.ptr<float>() + vocab_begin * config_.hidden_size
                          : lm_head_.ptr<float>();
  cpu_lm_head(config_, plan_, comm_, head, last, r, logits);
}

void Qwen35MoeCpu::recurrence(const Layer& layer, const float* mixed, const float* g,
                              const float* beta, int64_t n, float* slot, float* conv_out,
                              float* out) const {
  const auto& c = config_;
  const int64_t hk = dn_.key_heads.size(), hv = dn_.value_heads.size();
  float* conv_state = slot + layer.index * state_elems_per_layer();
  float* rec_state = conv_state + conv_dim_ * (c.linear_conv_kernel_dim - 1);
  cpu::causal_conv1d({mixed, layer.conv.ptr<float>(), conv_state, conv_out, n, conv_dim_,
                      c.linear_conv_kernel_dim});
  cpu::gated_delta_rule({conv_out, conv_out + key_dim_, conv_out + 2 * key_dim_, g, beta, rec_state,
                         out, n, hk, hv, c.linear_key_head_dim, c.linear_value_head_dim,
                         conv_dim_});
}

bool Qwen35MoeCpu::replay_states(const std::vector<StateReplay>& replays, KvCache& kv) {
  // A decode DP rank cannot fall back to a forward: that is collective, and only the ranks with
  // a rejection would run it.
  TANDEM_CHECK(kept_tokens_ >= 0 || !plan_.data_parallel() || replays.empty(),
               "replay_states: the last forward kept no recurrence inputs, and a decode DP rank "
               "cannot roll back by a forward");
  if (kept_tokens_ < 0) return false;
  const auto hv = static_cast<int64_t>(dn_.value_heads.size());
  int64_t most = 0;
  for (const StateReplay& r : replays) {
    const auto it = std::find_if(kept_chunks_.begin(), kept_chunks_.end(),
                                 [&](const auto& ch) { return ch.first == r.row; });
    TANDEM_CHECK(it != kept_chunks_.end(), "replay_states: row ", r.row,
                 " starts no sequence of the last forward");
    TANDEM_CHECK(r.count >= 1 && r.count <= it->second, "replay_states: ", r.count, " tokens of a ",
                 it->second, "-token chunk");
    TANDEM_CHECK(r.state_slot >= 0 && r.state_slot < kv.num_state_slots(),
                 "replay_states: state slot ", r.state_slot, " out of range");
    most = std::max(most, r.count);
  }
  std::vector<float> co(static_cast<size_t>(most * conv_dim_));
  std::vector<float> out(static_cast<size_t>(most * value_dim_));  // (not needed)
  for (const Layer& layer : layers_) {
    if (!layer.linear) continue;
    const KeptInputs& kept = kept_[static_cast<size_t>(layer.index)];
    for (const StateReplay& r : replays) {
      recurrence(layer, kept.mixed.data() + r.row * conv_dim_, kept.g.data() + r.row * hv,
                 kept.beta.data() + r.row * hv, r.count, kv.state(r.state_slot), co.data(),
                 out.data());
    }
  }
  kept_tokens_ = -1;  // replayed once
  return true;
}

void Qwen35MoeCpu::forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) {
  const auto& c = config_;
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = plan_.q_heads.size(), kvh = plan_.kv_heads.size();  // this rank's heads
  const int64_t hv = dn_.value_heads.size(), dv = c.linear_value_head_dim;
  const int64_t in_w = conv_dim_ + value_dim_ + 2 * hv;  // in_proj row: qkv | z | b | a
  const int64_t page_size = kv.geometry().page_size;
  const int64_t n = batch.num_tokens();
  TANDEM_CHECK(kv.geometry().num_layers == num_attention_ && kv.geometry().num_kv_heads == kvh &&
                   kv.geometry().head_dim == d,
               "KV cache geometry does not match the model");
  logits.clear();
  kept_tokens_ = -1;
  if (n == 0) {
    // Nothing of our own; a decode rank still serves its experts in every (MoE) layer.
    if (plan_.data_parallel()) {
      for (const Layer& layer : layers_) moe_block(layer, nullptr, 0, nullptr);
    }
    return;
  }
  if (num_linear_ > 0) {
    TANDEM_CHECK(kv.state_slot_elems() == state_slot_elems(),
                 "the KV cache has no state slots for this hybrid model");
  }

  // Flatten the batch: ids, positions, owning sequence, KV slot; one block table row each.
  const auto [ids, positions, token_seq, slots, tables, max_pages, seq_begin] =
      flatten_batch(batch, page_size);
  if (num_linear_ > 0) {
    for (size_t si = 0; si < batch.seqs.size(); ++si) {
      const ForwardSeq& s = batch.seqs[si];
      TANDEM_CHECK(s.state_slot >= 0 && s.state_slot < kv.num_state_slots(), "sequence ", si,
                   " has no state slot (", s.state_slot, ")");
      // A sequence computed from its first token starts from a zero state.
      if (s.start_pos == 0) {
        float* st = kv.state(s.state_slot);
        std::fill(st, st + kv.state_slot_elems(), 0.0f);
      }
    }
  }

  // Activations.                                    // shapes
  auto buf = [](int64_t elems) { return std::vector<float>(static_cast<size_t>(elems)); };
  std::vector<float> x = buf(n * h);                         // [n, hidden] residual stream
  std::vector<float> xn = buf(n * h);                        // [n, hidden] normed
  std::vector<float> y = buf(n * h);                         // [n, hidden] block output
  std::vector<float> qkv = buf(n * (qh * 2 + 2 * kvh) * d);  // attention projections
  std::vector<float> q = buf(n * qh * d), gate = buf(n * qh * d);
  std::vector<float> k = buf(n * kvh * d), v = buf(n * kvh * d);
  std::vector<float> attn = buf(n * std::max(qh * d, value_dim_));  // [n, qh*d] | [n, v_dim]
  std::vector<float> proj = buf(n * in_w);                          // DeltaNet in_proj rows
  std::vector<float> mixed = buf(n * conv_dim_), conv_out = buf(n * conv_dim_);
  std::vector<float> z = buf(n * value_dim_);
  std::vector<float> beta = buf(n * hv), g = buf(n * hv);

  cpu::embedding({ids.data(), embed_.ptr<float>(), x.data(), n, h, c.vocab_size});
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (batch.keep_recurrent_inputs) kept_.resize(static_cast<size_t>(num_linear_));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& layer = layers_[static_cast<size_t>(l)];
    if (l == 0) {
      cpu::rms_norm({x.data(), layer.input_norm.ptr<float>(), xn.data(), n, h, eps});
    } else {
      cpu::add_rms_norm({x.data(), y.data(), layer.input_norm.ptr<float>(), xn.data(), n, h, eps});
    }
    if (!layer.linear) {
      // Gated full attention: q_proj rows are (query, gate) per head.
      const int64_t w = (qh * 2 + 2 * kvh) * d;
      cpu::gemm({xn.data(), layer.qkv.ptr<float>(), qkv.data(), n, w, h});
      split_gated_qkv(qkv.data(), n, qh, kvh, d, q.data(), gate.data(), k.data(), v.data());
      cpu::qk_norm_rope({q.data(), k.data(), layer.q_norm.ptr<float>(), layer.k_norm.ptr<float>(),
                         positions.data(), n, qh, kvh, d, eps, c.rope_theta, c.rotary_dim()});
      float* pool = kv.layer(layer.index);
      cpu::kv_write({k.data(), v.data(), pool, slots.data(), n, kvh, d, page_size});
      cpu::paged_attention({q.data(), pool, tables.data(), token_seq.data(), positions.data(),
                            attn.data(), n, qh, kvh, d, page_size, max_pages,
                            1.0f / std::sqrt(static_cast<float>(d))});
      cpu::sigmoid_gate({attn.data(), gate.data(), attn.data(), n, qh * d, qh * d});
      cpu::gemm({attn.data(), layer.o.ptr<float>(), y.data(), n, h, qh * d});
      // Row-parallel o_proj: the partial products of every rank's heads are summed.
      if (plan_.tensor_parallel()) comm_->all_reduce_sum(y.data(), n * h, DType::kF32);
    } else {
      // Gated DeltaNet: one fused projection, then per sequence conv + delta rule on its state.
      cpu::gemm({xn.data(), layer.in_proj.ptr<float>(), proj.data(), n, in_w, h});
      for (int64_t i = 0; i < n; ++i) {
        const float* row = proj.data() + i * in_w;
        std::memcpy(mixed.data() + i * conv_dim_, row, sizeof(float) * conv_dim_);
        std::memcpy(z.data() + i * value_dim_, row + conv_dim_, sizeof(float) * value_dim_);
      }
      cpu::deltanet_gates({proj.data() + conv_dim_ + value_dim_,
                           proj.data() + conv_dim_ + value_dim_ + hv, layer.a_log.ptr<float>(),
                           layer.dt_bias.ptr<float>(), beta.data(), g.data(), n, hv, in_w});
      for (size_t si = 0; si < batch.seqs.size(); ++si) {
        const ForwardSeq& s = batch.seqs[si];
        const int64_t t0 = seq_begin[si];
        recurrence(layer, mixed.data() + t0 * conv_dim_, g.data() + t0 * hv, beta.data() + t0 * hv,
                   s.num_tokens, kv.state(s.state_slot), conv_out.data() + t0 * conv_dim_,
                   attn.data() + t0 * value_dim_);
      }
      if (batch.keep_recurrent_inputs) {  // replay_states' inputs
        KeptInputs& kept = kept_[static_cast<size_t>(layer.index)];
        kept.mixed.assign(mixed.begin(), mixed.begin() + n * conv_dim_);
        kept.beta.assign(beta.begin(), beta.begin() + n * hv);
        kept.g.assign(g.begin(), g.begin() + n * hv);
      }
      cpu::gated_rms_norm(
          {attn.data(), z.data(), layer.out_norm.ptr<float>(), attn.data(), n * hv, dv, eps});
      cpu::gemm({attn.data(), layer.out_proj.ptr<float>(), y.data(), n, h, value_dim_});
      // Row-parallel out_proj over this rank's value heads.
      if (plan_.tensor_parallel()) comm_->all_reduce_sum(y.data(), n * h, DType::kF32);
    }
    if (batch.on_layer_kv && !layer.linear) batch.on_layer_kv(layer.index);

    // MoE block: routed experts (top-k renormalised) + sigmoid-gated shared expert.
    cpu::add_rms_norm({x.data(), y.data(), layer.post_norm.ptr<float>(), xn.data(), n, h, eps});
    moe_block(layer, xn.data(), n, y.data());
  }

  if (batch.keep_recurrent_inputs) {
    kept_tokens_ = n;
    kept_chunks_.clear();
    for (size_t si = 0; si < batch.seqs.size(); ++si) {
      kept_chunks_.emplace_back(seq_begin[si], batch.seqs[si].num_tokens);
    }
  }

  // Final norm and lm_head on the rows that need logits only.
  const std::vector<int64_t> rows = batch.logit_token_rows();
  const int64_t r = static_cast<int64_t>(rows.size());
  std::vector<float> last = buf(r * h);
  if (batch.hidden_out != nullptr) {  // every row's final hidden state (MTP drafting)
    std::vector<float>& hid = *batch.hidden_out;
    hid.resize(static_cast<size_t>(n * h));
    for (size_t i = 0; i < hid.size(); ++i) hid[i] = x[i] + y[i];
    cpu::rms_norm({hid.data(), norm_.ptr<float>(), hid.data(), n, h, eps});
  }
  for (int64_t i = 0; i < r; ++i) {
    const int64_t src = rows[static_cast<size_t>(i)];
    for (int64_t j = 0; j < h; ++j) {
      last[static_cast<size_t>(i * h + j)] =
          x[static_cast<size_t>(src * h + j)] + y[static_cast<size_t>(src * h + j)];
    }
  }
  cpu::rms_norm({last.data(), norm_.ptr<float>(), last.data(), r, h, eps});
  lm_head(last.data(), r, logits);
}

std::unique_ptr<Model> load_cpu_model(const std::string& dir) {
  ModelConfig config = ModelConfig::from_dir(dir);
  if (config.is_hybrid()) return Qwen35MoeCpu::load(dir);
  return Qwen3MoeCpu::load(dir);
}

std::unique_ptr<Model> load_cpu_model(const std::string& dir, const ShardSpec& shard,
                                      comm::Communicator* comm) {
  const ModelConfig config = ModelConfig::from_dir(dir);
  if (config.is_hybrid()) return Qwen35MoeCpu::load(dir, shard, comm);
  return Qwen3MoeCpu::load(dir, shard, comm);
}

}  // namespace tandem
