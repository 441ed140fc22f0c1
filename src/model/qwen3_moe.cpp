#include "model/qwen3_moe.h"

#include <cmath>
#include <cstring>

#include "backend/cpu/ops.h"
#include "core/error.h"
#include "model/safetensors.h"

namespace tandem {

namespace {

// Loads `name` (bf16/f16/f32 on disk) as an fp32 tensor of the expected shape.
HostTensor load_f32(const Checkpoint& ckpt, const std::string& name, const Shape& shape) {
  TensorView src = ckpt.get(name, shape);
  HostTensor t(DType::kF32, shape);
  Checkpoint::to_f32(src, t.ptr<float>());
  return t;
}

// Concatenates tensors along the outermost dim (fused QKV, fused gate/up).
HostTensor load_concat(const Checkpoint& ckpt, const std::vector<std::string>& names,
                       const std::vector<int64_t>& rows, int64_t cols) {
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  HostTensor t(DType::kF32, {total, cols});
  float* dst = t.ptr<float>();
  for (size_t i = 0; i < names.size(); ++i) {
    TensorView src = ckpt.get(names[i], {rows[i], cols});
    Checkpoint::to_f32(src, dst);
    dst += rows[i] * cols;
  }
  return t;
}

}  // namespace

std::unique_ptr<Qwen3MoeCpu> Qwen3MoeCpu::load(const std::string& dir) {
  ModelConfig config = ModelConfig::from_dir(dir);
  Checkpoint ckpt(dir);
  std::unique_ptr<Qwen3MoeCpu> model(new Qwen3MoeCpu(std::move(config)));
  model->load_weights(ckpt);
  return model;
}

void Qwen3MoeCpu::load_weights(const Checkpoint& ckpt) {
  const auto& c = config_;
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  embed_ = load_f32(ckpt, "model.embed_tokens.weight", {c.vocab_size, h});
  norm_ = load_f32(ckpt, "model.norm.weight", {h});
  if (!c.tie_word_embeddings) {
    lm_head_ = load_f32(ckpt, "lm_head.weight", {c.vocab_size, h});
  }
  layers_.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    L.input_norm = load_f32(ckpt, p + "input_layernorm.weight", {h});
    L.post_norm = load_f32(ckpt, p + "post_attention_layernorm.weight", {h});
    L.q_norm = load_f32(ckpt, p + "self_attn.q_norm.weight", {d});
    L.k_norm = load_f32(ckpt, p + "self_attn.k_norm.weight", {d});
    L.qkv = load_concat(ckpt,
                        {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                         p + "self_attn.v_proj.weight"},
                        {qh * d, kvh * d, kvh * d}, h);
    L.o = load_f32(ckpt, p + "self_attn.o_proj.weight", {h, qh * d});
    L.moe = c.is_moe_layer(l);
    if (L.moe) {
      const int64_t inter = c.moe_intermediate_size;
      L.router = load_f32(ckpt, p + "mlp.gate.weight", {c.num_experts, h});
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
        L.gate_up.push_back(load_concat(ckpt, {ep + "gate_proj.weight", ep + "up_proj.weight"},
                                        {inter, inter}, h));
        L.down.push_back(load_f32(ckpt, ep + "down_proj.weight", {h, inter}));
      }
    } else {
      const int64_t inter = c.intermediate_size;
      L.gate_up.push_back(load_concat(ckpt, {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"},
                                      {inter, inter}, h));
      L.down.push_back(load_f32(ckpt, p + "mlp.down_proj.weight", {h, inter}));
    }
    for (auto& t : L.gate_up) L.gate_up_ptrs.push_back(t.ptr<float>());
    for (auto& t : L.down) L.down_ptrs.push_back(t.ptr<float>());
  }
}

KvGeometry Qwen3MoeCpu::kv_geometry(int64_t num_pages, int64_t page_size) const {
  return {config_.num_hidden_layers, num_pages, config_.num_key_value_heads, page_size,
          config_.head_dim};
}

void Qwen3MoeCpu::forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) {
  const auto& c = config_;
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  const int64_t page_size = kv.geometry().page_size;
  const int64_t n = batch.num_tokens();
  TANDEM_CHECK(kv.geometry().num_kv_heads == kvh && kv.geometry().head_dim == d,
               "KV cache geometry does not match the model");

  // Flatten the batch: ids, positions, owning sequence, KV slot; one block table row each.
  std::vector<int32_t> ids(static_cast<size_t>(n)), positions(static_cast<size_t>(n)),
      token_seq(static_cast<size_t>(n));
  std::vector<int64_t> slots(static_cast<size_t>(n));
  int64_t max_pages = 1;
  for (const auto& s : batch.seqs) max_pages = std::max(max_pages, s.num_pages);
  std::vector<int32_t> tables(batch.seqs.size() * static_cast<size_t>(max_pages), 0);
  int64_t t = 0;
  for (size_t si = 0; si < batch.seqs.size(); ++si) {
    const ForwardSeq& s = batch.seqs[si];
    TANDEM_CHECK(s.num_tokens > 0, "empty sequence chunk");
    TANDEM_CHECK((s.start_pos + s.num_tokens + page_size - 1) / page_size <= s.num_pages,
                 "block table too short: ", s.num_pages, " pages for ",
                 s.start_pos + s.num_tokens, " tokens");
    std::memcpy(tables.data() + si * static_cast<size_t>(max_pages), s.block_table,
                sizeof(int32_t) * static_cast<size_t>(s.num_pages));
    for (int64_t i = 0; i < s.num_tokens; ++i, ++t) {
      int64_t pos = s.start_pos + i;
      ids[static_cast<size_t>(t)] = s.tokens[i];
      positions[static_cast<size_t>(t)] = static_cast<int32_t>(pos);
      token_seq[static_cast<size_t>(t)] = static_cast<int32_t>(si);
      slots[static_cast<size_t>(t)] = s.block_table[pos / page_size] * page_size + pos % page_size;
    }
  }

  // Activations.                                  // shapes
  std::vector<float> x(static_cast<size_t>(n * h));        // [n, hidden] residual stream
  std::vector<float> xn(static_cast<size_t>(n * h));       // [n, hidden] normed
  std::vector<float> qkv(static_cast<size_t>(n * (qh + 2 * kvh) * d));
  std::vector<float> q(static_cast<size_t>(n * qh * d)), k(static_cast<size_t>(n * kvh * d)),
      v(static_cast<size_t>(n * kvh * d));
  std::vector<float> attn(static_cast<size_t>(n * qh * d));
  std::vector<float> y(static_cast<size_t>(n * h));
  std::vector<float> router(static_cast<size_t>(n * std::max<int64_t>(c.num_experts, 1)));
  std::vector<int32_t> topk_ids(static_cast<size_t>(n * std::max<int64_t>(c.num_experts_per_tok, 1)));
  std::vector<float> topk_w(topk_ids.size());
  std::vector<float> gu(static_cast<size_t>(n * 2 * c.intermediate_size));
  std::vector<float> act(static_cast<size_t>(n * c.intermediate_size));

  cpu::embedding({ids.data(), embed_.ptr<float>(), x.data(), n, h, c.vocab_size});
  const float eps = static_cast<float>(c.rms_norm_eps);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    // Attention block.
    if (l == 0) {
      cpu::rms_norm({x.data(), L.input_norm.ptr<float>(), xn.data(), n, h, eps});
    } else {
      cpu::add_rms_norm({x.data(), y.data(), L.input_norm.ptr<float>(), xn.data(), n, h, eps});
    }
    cpu::gemm({xn.data(), L.qkv.ptr<float>(), qkv.data(), n, (qh + 2 * kvh) * d, h});
    for (int64_t i = 0; i < n; ++i) {  // split fused qkv rows
      const float* row = qkv.data() + i * (qh + 2 * kvh) * d;
      std::memcpy(q.data() + i * qh * d, row, sizeof(float) * qh * d);
      std::memcpy(k.data() + i * kvh * d, row + qh * d, sizeof(float) * kvh * d);
      std::memcpy(v.data() + i * kvh * d, row + (qh + kvh) * d, sizeof(float) * kvh * d);
    }
    cpu::qk_norm_rope({q.data(), k.data(), L.q_norm.ptr<float>(), L.k_norm.ptr<float>(),
                       positions.data(), n, qh, kvh, d, eps, c.rope_theta});
    cpu::kv_write({k.data(), v.data(), kv.layer(l), slots.data(), n, kvh, d, page_size});
    cpu::paged_attention({q.data(), kv.layer(l), tables.data(), token_seq.data(),
                          positions.data(), attn.data(), n, qh, kvh, d, page_size, max_pages,
                          1.0f / std::sqrt(static_cast<float>(d))});
    cpu::gemm({attn.data(), L.o.ptr<float>(), y.data(), n, h, qh * d});
    // MLP block.
    cpu::add_rms_norm({x.data(), y.data(), L.post_norm.ptr<float>(), xn.data(), n, h, eps});
    if (L.moe) {
      cpu::gemm({xn.data(), L.router.ptr<float>(), router.data(), n, c.num_experts, h});
      cpu::topk_softmax({router.data(), topk_ids.data(), topk_w.data(), n, c.num_experts,
                         c.num_experts_per_tok, c.norm_topk_prob});
      cpu::moe({xn.data(), topk_ids.data(), topk_w.data(), L.gate_up_ptrs.data(),
                L.down_ptrs.data(), y.data(), n, h, c.moe_intermediate_size,
                c.num_experts_per_tok, 0, c.num_experts});
    } else {
      cpu::gemm({xn.data(), L.gate_up_ptrs[0], gu.data(), n, 2 * c.intermediate_size, h});
      cpu::silu_mul({gu.data(), act.data(), n, c.intermediate_size});
      cpu::gemm({act.data(), L.down_ptrs[0], y.data(), n, h, c.intermediate_size});
    }
  }

  // Final norm and lm_head on the rows that need logits only.
  std::vector<int64_t> rows;
  t = 0;
  for (const auto& s : batch.seqs) {
    if (s.logits == LogitsMode::kAll) {
      for (int64_t i = 0; i < s.num_tokens; ++i) rows.push_back(t + i);
    } else if (s.logits == LogitsMode::kLast) {
      rows.push_back(t + s.num_tokens - 1);
    }
    t += s.num_tokens;
  }
  const int64_t r = static_cast<int64_t>(rows.size());
  std::vector<float> last(static_cast<size_t>(r * h));
  for (int64_t i = 0; i < r; ++i) {
    const int64_t src = rows[static_cast<size_t>(i)];
    for (int64_t j = 0; j < h; ++j) {
      last[static_cast<size_t>(i * h + j)] = x[static_cast<size_t>(src * h + j)] +
                                            y[static_cast<size_t>(src * h + j)];
    }
  }
  cpu::rms_norm({last.data(), norm_.ptr<float>(), last.data(), r, h, eps});
  logits.resize(static_cast<size_t>(r * c.vocab_size));
  const float* head = c.tie_word_embeddings ? embed_.ptr<float>() : lm_head_.ptr<float>();
  cpu::gemm({last.data(), head, logits.data(), r, c.vocab_size, h});
}

}  // namespace tandem
