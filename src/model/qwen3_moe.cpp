#include "model/qwen3_moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "backend/cpu/ops.h"
#include "comm/communicator.h"
#include "comm/moe_dispatch.h"
#include "core/error.h"
#include "model/lm_head.h"
#include "model/mtp_input.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "model/weight_load.h"

namespace tandem {

struct Qwen3MoeCpu::Mtp {
  HostTensor fc;      // [hidden, 2 * hidden] over [embedding; hidden]
  HostTensor norm_e;  // [hidden] pre_fc_norm_embedding
  HostTensor norm_h;  // [hidden] pre_fc_norm_hidden
  HostTensor norm;    // [hidden] the final norm before the shared lm_head
  Layer layer;        // all heads, all experts
};

Qwen3MoeCpu::Qwen3MoeCpu(ModelConfig config, ShardPlan plan, comm::Communicator* comm)
    : config_(std::move(config)), plan_(plan), comm_(comm) {}

Qwen3MoeCpu::~Qwen3MoeCpu() = default;

void Qwen3MoeCpu::set_kv_fp8(std::vector<float> k_scales, std::vector<float> v_scales) {
  const auto layers = static_cast<size_t>(config_.num_hidden_layers);
  if (k_scales.empty()) k_scales.assign(layers, 1.f);
  if (v_scales.empty()) v_scales.assign(layers, 1.f);
  TANDEM_CHECK_KIND(kInvalidArgument, k_scales.size() == layers && v_scales.size() == layers,
                    "set_kv_fp8: ", k_scales.size(), " k and ", v_scales.size(), " v scales for ",
                    layers, " layers");
  kv_fp8_ = true;
  k_scales_ = std::move(k_scales);
  v_scales_ = std::move(v_scales);
}

std::unique_ptr<Qwen3MoeCpu> Qwen3MoeCpu::load(const std::string& dir) {
  return load(dir, ShardSpec::single(), nullptr);
}

std::unique_ptr<Qwen3MoeCpu> Qwen3MoeCpu::load(const std::string& dir, const ShardSpec& shard,
                                               comm::Communicator* comm) {
  ModelConfig config = ModelConfig::from_dir(dir);
  TANDEM_CHECK_KIND(
      kUnsupported, !config.is_hybrid(), dir, "/config.json: model_type '", config.model_type,
      "' is a hybrid model: this path (sharded roles, Qwen3MoeCpu) serves qwen3_moe only; ",
      "tandem generate / serve run it on the CPU");
  ShardPlan plan = ShardPlan::make(config, shard);
  check_shard_communicator(shard, comm);
  Checkpoint ckpt(dir);
  std::unique_ptr<Qwen3MoeCpu> model(new Qwen3MoeCpu(std::move(config), plan, comm));
  model->load_weights(ckpt, (std::filesystem::path(dir) / "config.json").string());
  if (plan.data_parallel() && plan.experts.size() > 0) {
    const auto& c = model->config_;
    model->all_to_all_ = std::make_unique<comm::MoeAllToAll>(*comm, c.num_experts, c.hidden_size,
                                                             c.num_experts_per_tok);
  }
  return model;
}

void Qwen3MoeCpu::load_weights(const Checkpoint& ckpt, const std::string& config_path) {
  const auto& c = config_;
  const WeightReader wr(ckpt, c.quant, config_path);
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  const IndexRange q_rows{plan_.q_heads.begin * d, plan_.q_heads.end * d};
  const IndexRange kv_rows{plan_.kv_heads.begin * d, plan_.kv_heads.end * d};
  embed_ = load_matrix(wr, "model.embed_tokens.weight", c.vocab_size, h);
  norm_ = load_f32(ckpt, "model.norm.weight", {h});
  if (!c.tie_word_embeddings) {
    lm_head_ = load_rows(wr, {{"lm_head.weight", c.vocab_size, plan_.vocab}}, h);
  }
  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& layer = layers_[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    layer.input_norm = load_f32(ckpt, p + "input_layernorm.weight", {h});
    layer.post_norm = load_f32(ckpt, p + "post_attention_layernorm.weight", {h});
    layer.q_norm = load_f32(ckpt, p + "self_attn.q_norm.weight", {d});
    layer.k_norm = load_f32(ckpt, p + "self_attn.k_norm.weight", {d});
    layer.qkv = load_rows(wr,
                          {{p + "self_attn.q_proj.weight", qh * d, q_rows},
                           {p + "self_attn.k_proj.weight", kvh * d, kv_rows},
                           {p + "self_attn.v_proj.weight", kvh * d, kv_rows}},
                          h);
    layer.o = load_cols(wr, p + "self_attn.o_proj.weight", h, qh * d, q_rows);
    layer.moe = c.is_moe_layer(l);
    if (layer.moe) {
      const int64_t inter = c.moe_intermediate_size;
      const IndexRange all{0, inter};
      layer.router = load_matrix(wr, p + "mlp.gate.weight", c.num_experts, h);
      for (int64_t e = plan_.experts.begin; e < plan_.experts.end; ++e) {
        const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
        layer.gate_up.push_back(load_rows(
            wr, {{ep + "gate_proj.weight", inter, all}, {ep + "up_proj.weight", inter, all}}, h));
        layer.down.push_back(load_matrix(wr, ep + "down_proj.weight", h, inter));
      }
    } else {
      const int64_t inter = c.intermediate_size;
      const IndexRange all{0, inter};
      layer.gate_up.push_back(load_rows(
          wr, {{p + "mlp.gate_proj.weight", inter, all}, {p + "mlp.up_proj.weight", inter, all}},
          h));
      layer.down.push_back(load_matrix(wr, p + "mlp.down_proj.weight", h, inter));
    }
    for (auto& t : layer.gate_up) layer.gate_up_ptrs.push_back(t.ptr<float>());
    for (auto& t : layer.down) layer.down_ptrs.push_back(t.ptr<float>());
  }
}

KvGeometry Qwen3MoeCpu::kv_geometry(int64_t num_pages, int64_t page_size) const {
  return {config_.num_hidden_layers, num_pages, plan_.kv_heads.size(), page_size, config_.head_dim};
}

void Qwen3MoeCpu::moe_block(const Layer& layer, const float* xn, const int32_t* topk_ids,
                            const float* topk_w, int64_t n, float* y) {
  const auto& c = config_;
  const int64_t h = c.hidden_size, inter = c.moe_intermediate_size;
  if (!plan_.data_parallel()) {
    // Single, or prefill EP: this rank's experts over the replicated tokens (cpu::moe selects
    // the locally routed ones), then the partial sums are all-reduced.
    cpu::moe({xn, topk_ids, topk_w, layer.gate_up_ptrs.data(), layer.down_ptrs.data(), y, n, h,
              inter, c.num_experts_per_tok, plan_.experts.begin, plan_.experts.size()});
    if (plan_.tensor_parallel()) comm_->all_reduce_sum(y, n * h, DType::kF32);
    return;
  }
  // Decode EP: tokens travel to their experts' ranks; each received (token, expert) pair is
  // one row run with top_k = 1, so pair_out = weight * expert(x); the home rank sums the pairs
  // in ascending expert id, as cpu::moe does.
  comm::MoeAllToAll& a2a = *all_to_all_;
  a2a.dispatch(xn, topk_ids, topk_w, n);
  cpu::moe({a2a.pair_x(), a2a.pair_expert(), a2a.pair_weight(), layer.gate_up_ptrs.data(),
            layer.down_ptrs.data(), a2a.pair_out(), a2a.num_pairs(), h, inter, 1,
            plan_.experts.begin, plan_.experts.size()});
  a2a.combine(y);
}

void Qwen3MoeCpu::lm_head(const float* last, int64_t r, std::vector<float>& logits) {
  const int64_t vocab_begin = plan_.tensor_parallel() ? plan_.vocab.begin : 0;
  const float* head = config_.tie_word_embeddings
                          ? embed_.ptr<float>() + vocab_begin * config_.hidden_size
                          : lm_head_.ptr<float>();
  cpu_lm_head(config_, plan_, comm_, head, last, r, logits);
}

void Qwen3MoeCpu::forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) {
  const auto& c = config_;
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = plan_.q_heads.size(), kvh = plan_.kv_heads.size();  // local heads
  const int64_t page_size = kv.geometry().page_size;
  const int64_t n = batch.num_tokens();
  TANDEM_CHECK(kv.geometry().num_kv_heads == kvh && kv.geometry().head_dim == d,
               "KV cache geometry does not match the model");
  if (n == 0) {
    // Nothing of our own; a decode rank still serves its experts in every MoE layer.
    if (plan_.data_parallel()) {
      for (const Layer& layer : layers_) {
        if (layer.moe) moe_block(layer, nullptr, nullptr, nullptr, 0, nullptr);
      }
    }
    logits.clear();
    return;
  }

  // Flatten the batch: ids, positions, owning sequence, KV slot; one block table row each.
  const auto [ids, positions, token_seq, slots, tables, max_pages, seq_begin] =
      flatten_batch(batch, page_size);

  // Activations.                                  // shapes
  std::vector<float> x(static_cast<size_t>(n * h));   // [n, hidden] residual stream
  std::vector<float> xn(static_cast<size_t>(n * h));  // [n, hidden] normed
  std::vector<float> qkv(static_cast<size_t>(n * (qh + 2 * kvh) * d));
  std::vector<float> q(static_cast<size_t>(n * qh * d)), k(static_cast<size_t>(n * kvh * d)),
      v(static_cast<size_t>(n * kvh * d));
  std::vector<float> attn(static_cast<size_t>(n * qh * d));
  std::vector<float> y(static_cast<size_t>(n * h));
  std::vector<float> router(static_cast<size_t>(n * std::max<int64_t>(c.num_experts, 1)));
  std::vector<int32_t> topk_ids(
      static_cast<size_t>(n * std::max<int64_t>(c.num_experts_per_tok, 1)));
  std::vector<float> topk_w(topk_ids.size());
  std::vector<float> gu(static_cast<size_t>(n * 2 * c.intermediate_size));
  std::vector<float> act(static_cast<size_t>(n * c.intermediate_size));

  cpu::embedding({ids.data(), embed_.ptr<float>(), x.data(), n, h, c.vocab_size});
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& layer = layers_[static_cast<size_t>(l)];
    // Attention block (this rank's heads).
    if (l == 0) {
      cpu::rms_norm({x.data(), layer.input_norm.ptr<float>(), xn.data(), n, h, eps});
    } else {
      cpu::add_rms_norm({x.data(), y.data(), layer.input_norm.ptr<float>(), xn.data(), n, h, eps});
    }
    cpu::gemm({xn.data(), layer.qkv.ptr<float>(), qkv.data(), n, (qh + 2 * kvh) * d, h});
    for (int64_t i = 0; i < n; ++i) {  // split fused qkv rows
      const float* row = qkv.data() + i * (qh + 2 * kvh) * d;
      std::memcpy(q.data() + i * qh * d, row, sizeof(float) * qh * d);
      std::memcpy(k.data() + i * kvh * d, row + qh * d, sizeof(float) * kvh * d);
      std::memcpy(v.data() + i * kvh * d, row + (qh + kvh) * d, sizeof(float) * kvh * d);
    }
    cpu::qk_norm_rope({q.data(), k.data(), layer.q_norm.ptr<float>(), layer.k_norm.ptr<float>(),
                       positions.data(), n, qh, kvh, d, eps, c.rope_theta});
    cpu::KvWriteParams kw{k.data(), v.data(), kv.layer(l), slots.data(), n, kvh, d, page_size};
    if (kv_fp8_) {
      kw.kv_fp8 = true;
      kw.k_scale = k_scales_[static_cast<size_t>(l)];
      kw.v_scale = v_scales_[static_cast<size_t>(l)];
    }
    cpu::kv_write(kw);
    if (batch.on_layer_kv) batch.on_layer_kv(l);
    cpu::paged_attention({q.data(), kv.layer(l), tables.data(), token_seq.data(), positions.data(),
                          attn.data(), n, qh, kvh, d, page_size, max_pages,
                          1.0f / std::sqrt(static_cast<float>(d))});
    cpu::gemm({attn.data(), layer.o.ptr<float>(), y.data(), n, h, qh * d});
    // Row-parallel o_proj: the partial products of every rank's heads are summed.
    if (plan_.tensor_parallel()) comm_->all_reduce_sum(y.data(), n * h, DType::kF32);
    // MLP block.
    cpu::add_rms_norm({x.data(), y.data(), layer.post_norm.ptr<float>(), xn.data(), n, h, eps});
    if (layer.moe) {
      cpu::gemm({xn.data(), layer.router.ptr<float>(), router.data(), n, c.num_experts, h});
      cpu::topk_softmax({router.data(), topk_ids.data(), topk_w.data(), n, c.num_experts,
                         c.num_experts_per_tok, c.norm_topk_prob});
      moe_block(layer, xn.data(), topk_ids.data(), topk_w.data(), n, y.data());
    } else {
      cpu::gemm({xn.data(), layer.gate_up_ptrs[0], gu.data(), n, 2 * c.intermediate_size, h});
      cpu::silu_mul({gu.data(), act.data(), n, c.intermediate_size});
      cpu::gemm({act.data(), layer.down_ptrs[0], y.data(), n, h, c.intermediate_size});
    }
  }

  // Final norm and lm_head on the rows that need logits only.
  const std::vector<int64_t> rows = batch.logit_token_rows();
  const int64_t r = static_cast<int64_t>(rows.size());
  std::vector<float> last(static_cast<size_t>(r * h));
  if (batch.hidden_out != nullptr) {
    // Every row's final hidden state (MTP drafting); the logits rows are copies of some (the
    // norm is per row, so the bits are those of the path below).
    std::vector<float>& hid = *batch.hidden_out;
    hid.resize(static_cast<size_t>(n * h));
    for (size_t i = 0; i < hid.size(); ++i) hid[i] = x[i] + y[i];
    cpu::rms_norm({hid.data(), norm_.ptr<float>(), hid.data(), n, h, eps});
    for (int64_t i = 0; i < r; ++i) {
      std::memcpy(last.data() + i * h, hid.data() + rows[static_cast<size_t>(i)] * h,
                  sizeof(float) * h);
    }
    lm_head(last.data(), r, logits);
    return;
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

void Qwen3MoeCpu::load_mtp(const std::string& dir) {
  TANDEM_CHECK_KIND(kUnsupported, plan_.spec.mode != ShardMode::kPrefillTpEp,
                    "MTP speculative decoding: prefill instances (TP) do not speculate");
  const auto& c = config_;
  Checkpoint ckpt(dir);
  TANDEM_CHECK_KIND(kNotFound, ckpt.has("mtp.fc.weight"), dir,
                    ": no MTP weights (tensor 'mtp.fc.weight' not found); the checkpoint needs "
                    "mtp.* tensors, or give the MTP layer's directory as \"model\" in "
                    "--speculative-config (tools/train_mtp.py writes one)");
  const WeightReader wr(ckpt, c.quant, (std::filesystem::path(dir) / "config.json").string());
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  auto m = std::make_unique<Mtp>();
  m->fc = load_matrix(wr, "mtp.fc.weight", h, 2 * h);
  m->norm_e = load_f32(ckpt, "mtp.pre_fc_norm_embedding.weight", {h});
  m->norm_h = load_f32(ckpt, "mtp.pre_fc_norm_hidden.weight", {h});
  m->norm = load_f32(ckpt, "mtp.norm.weight", {h});
  Layer& layer = m->layer;
  const std::string p = "mtp.layers.0.";
  layer.input_norm = load_f32(ckpt, p + "input_layernorm.weight", {h});
  layer.post_norm = load_f32(ckpt, p + "post_attention_layernorm.weight", {h});
  layer.q_norm = load_f32(ckpt, p + "self_attn.q_norm.weight", {d});
  layer.k_norm = load_f32(ckpt, p + "self_attn.k_norm.weight", {d});
  layer.qkv = load_rows(wr,
                        {{p + "self_attn.q_proj.weight", qh * d, {0, qh * d}},
                         {p + "self_attn.k_proj.weight", kvh * d, {0, kvh * d}},
                         {p + "self_attn.v_proj.weight", kvh * d, {0, kvh * d}}},
                        h);
  layer.o = load_matrix(wr, p + "self_attn.o_proj.weight", h, qh * d);
  layer.moe = ckpt.has(p + "mlp.gate.weight");
  if (layer.moe) {
    TANDEM_CHECK_KIND(kUnsupported, c.num_experts > 0, dir,
                      ": the MTP layer has experts but config.json has num_experts 0");
    const int64_t inter = c.moe_intermediate_size;
    const IndexRange all{0, inter};
    layer.router = load_matrix(wr, p + "mlp.gate.weight", c.num_experts, h);
    // Decode DP/EP: this rank's experts only, as the target's MoE layers (the router whole);
    // the block runs through the same all-to-all (moe_block). Single: every expert.
    for (int64_t e = plan_.experts.begin; e < plan_.experts.end; ++e) {
      const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
      layer.gate_up.push_back(load_rows(
          wr, {{ep + "gate_proj.weight", inter, all}, {ep + "up_proj.weight", inter, all}}, h));
      layer.down.push_back(load_matrix(wr, ep + "down_proj.weight", h, inter));
    }
  } else {
    const int64_t inter = c.intermediate_size;
    const IndexRange all{0, inter};
    layer.gate_up.push_back(load_rows(
        wr, {{p + "mlp.gate_proj.weight", inter, all}, {p + "mlp.up_proj.weight", inter, all}}, h));
    layer.down.push_back(load_matrix(wr, p + "mlp.down_proj.weight", h, inter));
  }
  for (auto& t : layer.gate_up) layer.gate_up_ptrs.push_back(t.ptr<float>());
  for (auto& t : layer.down) layer.down_ptrs.push_back(t.ptr<float>());
  mtp_ = std::move(m);
}

bool Qwen3MoeCpu::mtp_collective() const {
  return mtp_ != nullptr && mtp_->layer.moe && plan_.data_parallel() && plan_.spec.size > 1;
}

int64_t Qwen3MoeCpu::mtp_weight_bytes() const {
  if (mtp_ == nullptr) return 0;
  const Mtp& m = *mtp_;
  const Layer& l = m.layer;
  int64_t bytes = 0;
  auto add = [&](const HostTensor& t) {
    if (!t.empty()) bytes += t.numel() * static_cast<int64_t>(dtype_size(t.dtype()));
  };
  for (const HostTensor* t : {&m.fc, &m.norm_e, &m.norm_h, &m.norm, &l.input_norm, &l.post_norm,
                              &l.q_norm, &l.k_norm, &l.qkv, &l.o, &l.router}) {
    add(*t);
  }
  for (const auto& t : l.gate_up) add(t);
  for (const auto& t : l.down) add(t);
  return bytes;
}

KvGeometry Qwen3MoeCpu::mtp_kv_geometry(int64_t num_pages, int64_t page_size) const {
  return {1, num_pages, config_.num_key_value_heads, page_size, config_.head_dim};
}

void Qwen3MoeCpu::mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& kv,
                              std::vector<float>& logits, std::vector<float>& hidden_out) {
  TANDEM_CHECK(mtp_ != nullptr, "mtp_forward: no MTP layer loaded");
  const auto& c = config_;
  const Layer& layer = mtp_->layer;
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  const int64_t page_size = kv.geometry().page_size;
  const int64_t n = batch.num_tokens();
  // Flatten the batch: ids, positions, owning sequence, KV slot; one block table row each.
  const auto [ids, positions, token_seq, slots, tables, max_pages, seq_begin] =
      mtp_flat_batch(c, batch, kv);
  logits.clear();
  hidden_out.clear();
  if (n == 0) {
    // Nothing of our own; a decode EP rank still serves its MTP experts (mtp_collective).
    if (plan_.data_parallel() && layer.moe) moe_block(layer, nullptr, nullptr, nullptr, 0, nullptr);
    return;
  }

  auto buf = [](int64_t elems) { return std::vector<float>(static_cast<size_t>(elems)); };
  const float eps = static_cast<float>(c.rms_norm_eps);
  // x = fc([norm_e(embed(t + 1)); norm_h(h_t)])       // [n, hidden]
  std::vector<float> x =
      cpu_mtp_input(c, embed_.ptr<float>(), mtp_->norm_e.ptr<float>(), mtp_->norm_h.ptr<float>(),
                    mtp_->fc.ptr<float>(), ids.data(), hidden, n);
  std::vector<float> xn = buf(n * h), y = buf(n * h);

  // The decoder layer: all heads here; the MoE block as the target's (moe_block: this rank's
  // experts through the decode all-to-all under DP/EP).
  std::vector<float> qkv = buf(n * (qh + 2 * kvh) * d);
  std::vector<float> q = buf(n * qh * d), k = buf(n * kvh * d), v = buf(n * kvh * d);
  std::vector<float> attn = buf(n * qh * d);
  cpu::rms_norm({x.data(), layer.input_norm.ptr<float>(), xn.data(), n, h, eps});
  cpu::gemm({xn.data(), layer.qkv.ptr<float>(), qkv.data(), n, (qh + 2 * kvh) * d, h});
  for (int64_t i = 0; i < n; ++i) {
    const float* row = qkv.data() + i * (qh + 2 * kvh) * d;
    std::memcpy(q.data() + i * qh * d, row, sizeof(float) * qh * d);
    std::memcpy(k.data() + i * kvh * d, row + qh * d, sizeof(float) * kvh * d);
    std::memcpy(v.data() + i * kvh * d, row + (qh + kvh) * d, sizeof(float) * kvh * d);
  }
  cpu::qk_norm_rope({q.data(), k.data(), layer.q_norm.ptr<float>(), layer.k_norm.ptr<float>(),
                     positions.data(), n, qh, kvh, d, eps, c.rope_theta});
  cpu::kv_write({k.data(), v.data(), kv.layer(0), slots.data(), n, kvh, d, page_size});
  cpu::paged_attention({q.data(), kv.layer(0), tables.data(), token_seq.data(), positions.data(),
                        attn.data(), n, qh, kvh, d, page_size, max_pages,
                        1.0f / std::sqrt(static_cast<float>(d))});
  cpu::gemm({attn.data(), layer.o.ptr<float>(), y.data(), n, h, qh * d});
  cpu::add_rms_norm({x.data(), y.data(), layer.post_norm.ptr<float>(), xn.data(), n, h, eps});
  if (layer.moe) {
    std::vector<float> router = buf(n * c.num_experts);
    std::vector<int32_t> topk_ids(static_cast<size_t>(n * c.num_experts_per_tok));
    std::vector<float> topk_w(topk_ids.size());
    cpu::gemm({xn.data(), layer.router.ptr<float>(), router.data(), n, c.num_experts, h});
    cpu::topk_softmax({router.data(), topk_ids.data(), topk_w.data(), n, c.num_experts,
                       c.num_experts_per_tok, c.norm_topk_prob});
    moe_block(layer, xn.data(), topk_ids.data(), topk_w.data(), n, y.data());
  } else {
    std::vector<float> gu = buf(n * 2 * c.intermediate_size), act = buf(n * c.intermediate_size);
    cpu::gemm({xn.data(), layer.gate_up_ptrs[0], gu.data(), n, 2 * c.intermediate_size, h});
    cpu::silu_mul({gu.data(), act.data(), n, c.intermediate_size});
    cpu::gemm({act.data(), layer.down_ptrs[0], y.data(), n, h, c.intermediate_size});
  }

  // mtp.norm and the shared lm_head on the rows asked for.
  const std::vector<int64_t> rows = batch.logit_token_rows();
  const int64_t r = static_cast<int64_t>(rows.size());
  hidden_out.resize(static_cast<size_t>(r * h));
  for (int64_t i = 0; i < r; ++i) {
    const int64_t src = rows[static_cast<size_t>(i)];
    for (int64_t j = 0; j < h; ++j) {
      hidden_out[static_cast<size_t>(i * h + j)] =
          x[static_cast<size_t>(src * h + j)] + y[static_cast<size_t>(src * h + j)];
    }
  }
  cpu::rms_norm({hidden_out.data(), mtp_->norm.ptr<float>(), hidden_out.data(), r, h, eps});
  lm_head(hidden_out.data(), r, logits);
}

}  // namespace tandem
