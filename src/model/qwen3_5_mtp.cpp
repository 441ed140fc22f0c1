// The MTP layer of a Qwen3.5 hybrid (Qwen35MoeCpu::load_mtp / mtp_forward) on the CPU, the
// published layout: x = mtp.fc([RMSNorm_e(embed(t + 1)); RMSNorm_h(h_t)]), mtp.layers.0 (a
// gated full-attention Qwen3.5 decoder layer: (1 + w) norms, partial RoPE, the routed MoE with
// the sigmoid-gated shared expert), mtp.norm, the target's embedding and lm_head. Its own
// one-layer paged KV on the target's page ids. The verify step's DeltaNet rollback is the
// engine's (SpecDecoder::rollback_states).
#include <cmath>
#include <cstring>

#include "backend/cpu/ops.h"
#include "core/error.h"
#include "model/gated_qkv.h"
#include "model/mtp_input.h"
#include "model/qwen3_5_moe.h"
#include "model/safetensors.h"
#include "model/weight_load.h"

namespace tandem {

struct Qwen35MoeCpu::Mtp {
  HostTensor fc;              // [hidden, 2 hidden] over [embedding; hidden]
  HostTensor norm_e, norm_h;  // [hidden], 1 + w
  HostTensor norm;            // [hidden], 1 + w
  Layer layer;                // full attention + MoE + shared expert
};

void Qwen35MoeCpu::load_mtp(const std::string& dir) {
  // One process, or a decode DP/EP rank: the pass below is local (every head and expert, the
  // whole lm_head, which a decode rank replicates), and a rejected draft's DeltaNet state rolls
  // back by replay_states (local too). A prefill TP rank holds a slice of the heads and vocab.
  TANDEM_CHECK_KIND(kUnsupported, plan_.spec.size <= 1 || plan_.data_parallel(),
                    "MTP speculative decoding of Qwen3.5 hybrids on a tensor-parallel instance (",
                    plan_.spec.size, " ranks) is not supported; use one process or decode DP");
  Checkpoint ckpt(dir);
  TANDEM_CHECK_KIND(kNotFound, ckpt.has("mtp.fc.weight"), dir,
                    ": no MTP weights (tensor 'mtp.fc.weight' not found)");
  const auto& c = config_;
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t qh = c.num_attention_heads, kvh = c.num_key_value_heads;
  const int64_t inter = c.moe_intermediate_size, sinter = c.shared_expert_intermediate_size;
  auto m = std::make_unique<Mtp>();
  m->fc = load_f32(ckpt, "mtp.fc.weight", {h, 2 * h});
  m->norm_e = load_f32(ckpt, "mtp.pre_fc_norm_embedding.weight", {h}, true);
  m->norm_h = load_f32(ckpt, "mtp.pre_fc_norm_hidden.weight", {h}, true);
  m->norm = load_f32(ckpt, "mtp.norm.weight", {h}, true);
  Layer& l = m->layer;
  const std::string p = "mtp.layers.0.";
  l.input_norm = load_f32(ckpt, p + "input_layernorm.weight", {h}, true);
  l.post_norm = load_f32(ckpt, p + "post_attention_layernorm.weight", {h}, true);
  const std::string a = p + "self_attn.";
  l.qkv = load_concat(ckpt,
                      {{a + "q_proj.weight", qh * 2 * d},
                       {a + "k_proj.weight", kvh * d},
                       {a + "v_proj.weight", kvh * d}},
                      h);
  l.o = load_f32(ckpt, a + "o_proj.weight", {h, qh * d});
  l.q_norm = load_f32(ckpt, a + "q_norm.weight", {d}, true);
  l.k_norm = load_f32(ckpt, a + "k_norm.weight", {d}, true);
  const std::string mp = p + "mlp.";
  l.router = load_f32(ckpt, mp + "gate.weight", {c.num_experts, h});
  const bool fused = ckpt.has(mp + "experts.gate_up_proj");
  for (int64_t e = 0; e < c.num_experts; ++e) {
    if (fused) {
      HostTensor gu(DType::kF32, {2 * inter, h}), dn(DType::kF32, {h, inter});
      Checkpoint::to_f32(ckpt.get(mp + "experts.gate_up_proj", {c.num_experts, 2 * inter, h}),
                         gu.ptr<float>(), e, e + 1);
      Checkpoint::to_f32(ckpt.get(mp + "experts.down_proj", {c.num_experts, h, inter}),
                         dn.ptr<float>(), e, e + 1);
      l.gate_up.push_back(std::move(gu));
      l.down.push_back(std::move(dn));
    } else {
      const std::string ep = mp + "experts." + std::to_string(e) + ".";
      l.gate_up.push_back(
          load_concat(ckpt, {{ep + "gate_proj.weight", inter}, {ep + "up_proj.weight", inter}}, h));
      l.down.push_back(load_f32(ckpt, ep + "down_proj.weight", {h, inter}));
    }
  }
  for (auto& t : l.gate_up) l.gate_up_ptrs.push_back(t.ptr<float>());
  for (auto& t : l.down) l.down_ptrs.push_back(t.ptr<float>());
  l.shared_gate_up = load_concat(ckpt,
                                 {{mp + "shared_expert.gate_proj.weight", sinter},
                                  {mp + "shared_expert.up_proj.weight", sinter}},
                                 h);
  l.shared_down = load_f32(ckpt, mp + "shared_expert.down_proj.weight", {h, sinter});
  l.shared_gate = load_f32(ckpt, mp + "shared_expert_gate.weight", {1, h});
  mtp_ = std::move(m);
}

bool Qwen35MoeCpu::has_mtp() const { return mtp_ != nullptr; }

KvGeometry Qwen35MoeCpu::mtp_kv_geometry(int64_t num_pages, int64_t page_size) const {
  return {1, num_pages, config_.num_key_value_heads, page_size, config_.head_dim};
}

void Qwen35MoeCpu::mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& kv,
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
  if (n == 0) return;

  auto buf = [](int64_t elems) { return std::vector<float>(static_cast<size_t>(elems)); };
  const float eps = static_cast<float>(c.rms_norm_eps);
  // x = fc([norm_e(embed(t + 1)); norm_h(h_t)])       // [n, hidden]
  std::vector<float> x =
      cpu_mtp_input(c, embed_.ptr<float>(), mtp_->norm_e.ptr<float>(), mtp_->norm_h.ptr<float>(),
                    mtp_->fc.ptr<float>(), ids.data(), hidden, n);
  std::vector<float> xn = buf(n * h), y = buf(n * h);

  // Gated full attention over the MTP KV: q_proj rows are (query, gate) per head.
  const int64_t w = (qh * 2 + 2 * kvh) * d;
  std::vector<float> qkv = buf(n * w), q = buf(n * qh * d), gate = buf(n * qh * d);
  std::vector<float> k = buf(n * kvh * d), v = buf(n * kvh * d), attn = buf(n * qh * d);
  cpu::rms_norm({x.data(), layer.input_norm.ptr<float>(), xn.data(), n, h, eps});
  cpu::gemm({xn.data(), layer.qkv.ptr<float>(), qkv.data(), n, w, h});
  split_gated_qkv(qkv.data(), n, qh, kvh, d, q.data(), gate.data(), k.data(), v.data());
  cpu::qk_norm_rope({q.data(), k.data(), layer.q_norm.ptr<float>(), layer.k_norm.ptr<float>(),
                     positions.data(), n, qh, kvh, d, eps, c.rope_theta, c.rotary_dim()});
  cpu::kv_write({k.data(), v.data(), kv.layer(0), slots.data(), n, kvh, d, page_size});
  cpu::paged_attention({q.data(), kv.layer(0), tables.data(), token_seq.data(), positions.data(),
                        attn.data(), n, qh, kvh, d, page_size, max_pages,
                        1.0f / std::sqrt(static_cast<float>(d))});
  cpu::sigmoid_gate({attn.data(), gate.data(), attn.data(), n, qh * d, qh * d});
  cpu::gemm({attn.data(), layer.o.ptr<float>(), y.data(), n, h, qh * d});

  // MoE block: routed experts (top-k renormalised) + sigmoid-gated shared expert.
  cpu::add_rms_norm({x.data(), y.data(), layer.post_norm.ptr<float>(), xn.data(), n, h, eps});
  std::vector<float> router = buf(n * c.num_experts);
  std::vector<int32_t> topk_ids(static_cast<size_t>(n * c.num_experts_per_tok));
  std::vector<float> topk_w(topk_ids.size());
  cpu::gemm({xn.data(), layer.router.ptr<float>(), router.data(), n, c.num_experts, h});
  cpu::topk_softmax({router.data(), topk_ids.data(), topk_w.data(), n, c.num_experts,
                     c.num_experts_per_tok, true});
  cpu::moe({xn.data(), topk_ids.data(), topk_w.data(), layer.gate_up_ptrs.data(),
            layer.down_ptrs.data(), y.data(), n, h, c.moe_intermediate_size, c.num_experts_per_tok,
            0, c.num_experts});
  const int64_t sinter = c.shared_expert_intermediate_size;
  std::vector<float> sgu = buf(n * 2 * sinter), sact = buf(n * sinter), sout = buf(n * h);
  std::vector<float> sgate = buf(n);
  cpu::gemm({xn.data(), layer.shared_gate_up.ptr<float>(), sgu.data(), n, 2 * sinter, h});
  cpu::silu_mul({sgu.data(), sact.data(), n, sinter});
  cpu::gemm({sact.data(), layer.shared_down.ptr<float>(), sout.data(), n, h, sinter});
  cpu::gemm({xn.data(), layer.shared_gate.ptr<float>(), sgate.data(), n, 1, h});
  cpu::sigmoid_gate({sout.data(), sgate.data(), y.data(), n, h, 1, /*per_row=*/true,
                     /*accumulate=*/true});

  // mtp.norm and the shared lm_head on the rows asked for.
  const std::vector<int64_t> rows = batch.logit_token_rows();
  const auto r = static_cast<int64_t>(rows.size());
  hidden_out.resize(static_cast<size_t>(r * h));
  for (int64_t i = 0; i < r; ++i) {
    const int64_t src = rows[static_cast<size_t>(i)];
    for (int64_t j = 0; j < h; ++j) {
      hidden_out[static_cast<size_t>(i * h + j)] =
          x[static_cast<size_t>(src * h + j)] + y[static_cast<size_t>(src * h + j)];
    }
  }
  cpu::rms_norm({hidden_out.data(), mtp_->norm.ptr<float>(), hidden_out.data(), r, h, eps});
  logits.resize(static_cast<size_t>(r * c.vocab_size));
  const float* head = c.tie_word_embeddings ? embed_.ptr<float>() : lm_head_.ptr<float>();
  cpu::gemm({hidden_out.data(), head, logits.data(), r, c.vocab_size, h});
}

}  // namespace tandem
