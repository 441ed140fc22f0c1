// Qwen3-MoE forward on one GPU. See qwen3_moe_cuda.h.
#include "model/cuda/qwen3_moe_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_sm90.h"
#include "backend/cuda/check.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_layer.h"
#include "backend/cuda/norm.h"
#include "backend/cuda/sampling.h"
#include "comm/cuda/cuda_comm.h"
#include "comm/cuda/cuda_moe.h"
#include "core/dtype.h"
#include "core/env.h"
#include "core/error.h"
#include "model/cuda/batch_invariant.h"
#include "model/cuda/cuda_mem.h"
#include "model/cuda/dense_linear.h"
#include "model/cuda/device_sampler.h"
#include "model/cuda/mtp_cuda.h"
#include "model/cuda/mxfp8_weights.h"
#include "model/cuda/random_fill.h"
#include "model/cuda/runner.h"
#include "model/cuda/shard_comms.h"
#include "model/quant.h"
#include "model/safetensors.h"

namespace tandem {

using cuda::bf16;
using cuda_model::DeviceMem;
using cuda_model::DeviceSampler;
using cuda_model::Fp8Mat;
using cuda_model::host_bf16;
using cuda_model::PinnedMem;
using cuda_model::Uploader;

namespace {

struct LayerW {
  bf16* input_norm = nullptr;  // [H]
  bf16* post_norm = nullptr;   // [H]
  bf16* q_norm = nullptr;      // [d]
  bf16* k_norm = nullptr;      // [d]
  bf16* qkv = nullptr;         // [(qh + 2 kvh) d, H]
  bf16* o = nullptr;           // [H, qh d]
  bool moe = false;
  bf16* router = nullptr;   // [E, H]
  bf16* gate_up = nullptr;  // MoE: [E, 2I, H] packed (moe_pack_gate_up); dense: [2I, H]
  bf16* down = nullptr;     // MoE: [E, H, I]; dense: [H, I]
  // FP8 copies (block-FP8 checkpoints, CudaModelOptions::fp8_weights): when set, the bf16
  // pointer of the same linear is null. gate_up8 packed as gate_up (codes and scale rows).
  Fp8Mat qkv8, o8, gate_up8, down8;
};

}  // namespace

struct Qwen3MoeCuda::Impl final : cuda_model::CudaLayers {
  const ModelConfig& c;
  cuda_model::CudaRunner& run;
  cuda_model::Workspace& ws;
  cudaStream_t stream;

  // Sharding: local heads / experts / vocabulary rows, and the communicators.
  ShardPlan plan;
  std::unique_ptr<cuda_model::ShardComms> comms;  // the all-reduce, the decode EP exchange
  bool tp() const { return plan.tensor_parallel() && plan.spec.size > 1; }
  bool dp_ep() const { return plan.data_parallel() && plan.spec.size > 1; }
  int64_t qh() const { return plan.q_heads.size(); }
  int64_t kvh() const { return plan.kv_heads.size(); }
  int64_t local_experts() const { return plan.experts.size(); }

  // Weights.
  std::vector<DeviceMem> mem;  // bf16
  // FP8 linears and experts (codes and their scales), and the dense FP8 linears' GEMM by rows.
  cuda_model::Fp8Linears f8;
  // Whether block-FP8 linears stay FP8 (CudaModelOptions::fp8_weights, a block-FP8 config).
  bool fp8 = false;
  // MXFP8 with its per-32 E8M0 scales kept (TANDEM_CUDA_MXFP8=native; model/cuda/mxfp8_weights.h);
  // =block: requantized to block FP8 at load (fp8 on, this off); unset: dequantized to bf16.
  bool mx_native = false;
  bool fp8_dense = true;  // CudaModelOptions::fp8_dense
  // FP8 activations (W8A8 on the FP8 tensor cores; the default, TANDEM_CUDA_FP8_ACT=0 turns it
  // off): the MoE GEMMs (the wgmma grouped GEMMs of moe_gemm_w8a8.h, the permute's gather
  // quantizing the rows) and the dense linears at prefill sizes (cuBLASLt) quantize their
  // activations per token and 128-column group (backend/cuda/fp8_linear.h); off: W8A16 (the
  // dequantized numerics). Measured in docs/perf.md ("FP8 vs bf16").
  bool fp8_act = false;
  // CudaModelOptions::deterministic (batch_invariant.h).
  bool det = false;
  // CudaModelOptions::kv_cache_fp8: E4M3 pools, each layer's k / v scales (1.0 unless the
  // checkpoint has them; random weights: 1.0).
  bool kv_fp8 = false;
  std::vector<cuda_model::KvScales> kv_scales;
  bf16* embed = nullptr;
  bf16* final_norm = nullptr;
  bf16* lm_head = nullptr;  // the embedding when tied
  std::vector<LayerW> layers;

  // Activations beside the runner's workspace, sized for its t_cap tokens.
  DeviceMem qkv, q, attn, gu, act;
  std::unique_ptr<cuda::MoeLayer> moe;
  cuda::MoeLayerPath moe_prefill_path = cuda::MoeLayerPath::kAuto;

  Impl(const ModelConfig& config, cuda_model::CudaRunner& r)
      : c(config), run(r), ws(r.ws()), stream(r.stream()) {}

  // CudaLayers.
  void body(const cuda_model::StepMeta& m, KvCache& kv, const Args& a) override {
    step(m, kv, a.batch, a.warmup);
  }
  void check_cache(const KvCache& kv) const override {
    const auto& g = kv.geometry();
    TANDEM_CHECK(!kv.is_host() && g.dtype == (kv_fp8 ? DType::kF8E4M3 : DType::kBF16) &&
                     g.num_kv_heads == kvh() && g.head_dim == c.head_dim &&
                     g.num_layers == c.num_hidden_layers,
                 "the KV cache was not made by this CUDA model");
  }
  cuda_model::AttentionShape attention() const override {
    // (--deterministic runs no prefill kernel: batch_invariant.h)
    return {qh(), kvh(), c.head_dim, !det, kv_fp8};
  }
  bool collective_steps() const override { return dp_ep(); }

  bf16* alloc(int64_t elems) {
    mem.emplace_back(static_cast<size_t>(elems) * sizeof(bf16));
    return mem.back().as<bf16>();
  }

  int64_t qkv_rows() const { return (qh() + 2 * kvh()) * c.head_dim; }

  // Whether the linear [n, k] read from `names` (columns `cols` of each) stays FP8: FP8 on,
  // shapes the FP8 kernels take (k % 16, n % 8), columns on 128-column blocks, and every
  // tensor stored as F8_E4M3 (wr null: the random model, all of them).
  // expert: a routed expert's (CudaModelOptions::fp8_dense false keeps only those).
  bool keep_fp8(const WeightReader* wr, const std::vector<std::string>& names, int64_t n, int64_t k,
                IndexRange cols, bool expert = false) const {
    if (!fp8 || (!expert && !fp8_dense) || k % 16 != 0 || n % 8 != 0) return false;
    if (mx_native ? cols.begin % cuda::kMxfp8BlockK != 0 ||
                        (cols.end % cuda::kMxfp8BlockK != 0 && cols.end != k)
                  : !WeightReader::fp8_columns_splittable(cols, cuda::kFp8BlockK)) {
      return false;
    }
    if (wr == nullptr) return true;
    for (const std::string& name : names) {
      if (!wr->is_quantized(name)) return false;
    }
    return true;
  }

  void allocate_weights(const WeightReader* wr) {
    const int64_t h = c.hidden_size, d = c.head_dim;
    embed = alloc(c.vocab_size * h);
    final_norm = alloc(h);
    // The lm_head rows of this rank (all of them unless prefill TP): a slice of the embedding
    // when tied.
    lm_head = c.tie_word_embeddings ? embed + plan.vocab.begin * h : alloc(plan.vocab.size() * h);
    layers.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      LayerW& w = layers[static_cast<size_t>(l)];
      w.input_norm = alloc(h);
      w.post_norm = alloc(h);
      w.q_norm = alloc(d);
      w.k_norm = alloc(d);
      const std::string p = "model.layers." + std::to_string(l) + ".";
      const IndexRange all_h{0, h}, q_cols{plan.q_heads.begin * d, plan.q_heads.end * d};
      if (keep_fp8(wr,
                   {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                    p + "self_attn.v_proj.weight"},
                   qkv_rows(), h, all_h)) {
        w.qkv8 = f8.alloc(1, qkv_rows(), h, false);
      } else {
        w.qkv = alloc(qkv_rows() * h);
      }
      if (keep_fp8(wr, {p + "self_attn.o_proj.weight"}, h, qh() * d, q_cols)) {
        w.o8 = f8.alloc(1, h, qh() * d, true);
      } else {
        w.o = alloc(h * qh() * d);
      }
      w.moe = c.is_moe_layer(l);
      if (w.moe) {
        const int64_t e = local_experts(), inter = c.moe_intermediate_size;
        w.router = alloc(c.num_experts * h);
        std::vector<std::string> gu_names, down_names;
        for (int64_t x = 0; x < e; ++x) {
          const std::string ep = p + "mlp.experts." + std::to_string(plan.experts.begin + x) + ".";
          gu_names.push_back(ep + "gate_proj.weight");
          gu_names.push_back(ep + "up_proj.weight");
          down_names.push_back(ep + "down_proj.weight");
        }
        // Both expert GEMMs FP8 or neither (MoeLayerWeights takes one kind).
        if (keep_fp8(wr, gu_names, 2 * inter, h, all_h, true) &&
            keep_fp8(wr, down_names, h, inter, {0, inter}, true)) {
          w.gate_up8 = f8.alloc(e, 2 * inter, h, false);
          w.down8 = f8.alloc(e, h, inter, true);
        } else {
          w.gate_up = alloc(e * 2 * inter * h);
          w.down = alloc(e * h * inter);
        }
      } else {
        const int64_t inter = c.intermediate_size;
        if (keep_fp8(wr, {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, 2 * inter, h,
                     all_h)) {
          w.gate_up8 = f8.alloc(1, 2 * inter, h, false);
        } else {
          w.gate_up = alloc(2 * inter * h);
        }
        if (keep_fp8(wr, {p + "mlp.down_proj.weight"}, h, inter, {0, inter})) {
          w.down8 = f8.alloc(1, h, inter, true);
        } else {
          w.down = alloc(h * inter);
        }
      }
    }
  }

  void load_weights(const WeightReader& wr) {
    const int64_t h = c.hidden_size, d = c.head_dim, qh = c.num_attention_heads,
                  kvh = c.num_key_value_heads;
    Uploader up(stream);
    std::vector<uint16_t> tmp, tmp2;
    auto put = [&](bf16* dst, const std::string& name, const Shape& shape) {
      const uint16_t* src = host_bf16(wr, name, shape, tmp);
      up.put(dst, src, static_cast<size_t>(shape.numel()) * sizeof(bf16));
    };
    // Rows [r.begin, r.end) of a [rows, cols] tensor.
    auto put_rows = [&](bf16* dst, const std::string& name, int64_t rows, int64_t cols,
                        IndexRange r) {
      cuda_model::upload_rows(up, dst, host_bf16(wr, name, {rows, cols}, tmp), cols, r);
    };
    // Columns [r.begin, r.end) of a [rows, cols] tensor (row-parallel o_proj).
    auto put_cols = [&](bf16* dst, const std::string& name, int64_t rows, int64_t cols,
                        IndexRange r) {
      cuda_model::upload_cols(up, dst, host_bf16(wr, name, {rows, cols}, tmp), rows, cols, r);
    };
    // FP8: rows x columns of an F8_E4M3 tensor as codes + row scales, at row `row0` of dst.
    auto put8 = [&](const Fp8Mat& dst, int64_t row0, const std::string& name, int64_t rows,
                    int64_t cols, IndexRange rr,
                    IndexRange cr) { f8.upload(wr, up, dst, row0, name, rows, cols, rr, cr); };
    const IndexRange q_rows{plan.q_heads.begin * d, plan.q_heads.end * d};
    const IndexRange kv_rows{plan.kv_heads.begin * d, plan.kv_heads.end * d};
    put(embed, "model.embed_tokens.weight", {c.vocab_size, h});
    put(final_norm, "model.norm.weight", {h});
    if (!c.tie_word_embeddings) put_rows(lm_head, "lm_head.weight", c.vocab_size, h, plan.vocab);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      LayerW& w = layers[static_cast<size_t>(l)];
      const std::string p = "model.layers." + std::to_string(l) + ".";
      if (kv_fp8)
        kv_scales[static_cast<size_t>(l)] = cuda_model::read_kv_scales(wr.checkpoint(), p);
      put(w.input_norm, p + "input_layernorm.weight", {h});
      put(w.post_norm, p + "post_attention_layernorm.weight", {h});
      put(w.q_norm, p + "self_attn.q_norm.weight", {d});
      put(w.k_norm, p + "self_attn.k_norm.weight", {d});
      if (w.qkv8) {
        put8(w.qkv8, 0, p + "self_attn.q_proj.weight", qh * d, h, q_rows, {0, h});
        put8(w.qkv8, q_rows.size(), p + "self_attn.k_proj.weight", kvh * d, h, kv_rows, {0, h});
        put8(w.qkv8, q_rows.size() + kv_rows.size(), p + "self_attn.v_proj.weight", kvh * d, h,
             kv_rows, {0, h});
      } else {
        put_rows(w.qkv, p + "self_attn.q_proj.weight", qh * d, h, q_rows);
        put_rows(w.qkv + q_rows.size() * h, p + "self_attn.k_proj.weight", kvh * d, h, kv_rows);
        put_rows(w.qkv + (q_rows.size() + kv_rows.size()) * h, p + "self_attn.v_proj.weight",
                 kvh * d, h, kv_rows);
      }
      if (w.o8) {
        put8(w.o8, 0, p + "self_attn.o_proj.weight", h, qh * d, {0, h}, q_rows);
      } else {
        put_cols(w.o, p + "self_attn.o_proj.weight", h, qh * d, q_rows);
      }
      if (w.moe && w.gate_up8 && w.gate_up8.e != nullptr) {
        const int64_t inter = c.moe_intermediate_size;
        put(w.router, p + "mlp.gate.weight", {c.num_experts, h});
        for (int64_t e = 0; e < local_experts(); ++e) {
          const std::string ep = p + "mlp.experts." + std::to_string(plan.experts.begin + e) + ".";
          cuda_model::upload_mxfp8_gate_up(wr, ep, inter, h, w.gate_up8.q + e * 2 * inter * h,
                                           w.gate_up8.e + e * 2 * inter * cuda::mxfp8_scale_cols(h),
                                           up);
          put8(w.down8, e * h, ep + "down_proj.weight", h, inter, {0, h}, {0, inter});
        }
      } else if (w.moe && w.gate_up8) {
        const int64_t inter = c.moe_intermediate_size;
        put(w.router, p + "mlp.gate.weight", {c.num_experts, h});
        cuda_model::upload_fp8_experts(wr, p + "mlp.experts.", plan.experts.begin, local_experts(),
                                       inter, h, w.gate_up8.q, w.gate_up8.s, w.down8.q, w.down8.s,
                                       up);
      } else if (w.moe) {
        const int64_t inter = c.moe_intermediate_size;
        put(w.router, p + "mlp.gate.weight", {c.num_experts, h});
        const size_t gu_bytes = static_cast<size_t>(2 * inter * h) * sizeof(bf16);
        std::vector<uint16_t> packed(static_cast<size_t>(2 * inter * h));
        for (int64_t e = 0; e < local_experts(); ++e) {
          const std::string ep = p + "mlp.experts." + std::to_string(plan.experts.begin + e) + ".";
          std::vector<uint16_t> gate_copy;
          const uint16_t* gate = host_bf16(wr, ep + "gate_proj.weight", {inter, h}, tmp);
          if (gate == tmp.data()) {  // converted: keep it while `up` converts into tmp2
            gate_copy = tmp;
            gate = gate_copy.data();
          }
          const uint16_t* upw = host_bf16(wr, ep + "up_proj.weight", {inter, h}, tmp2);
          cuda::moe_pack_gate_up(reinterpret_cast<const bf16*>(gate),
                                 reinterpret_cast<const bf16*>(upw), inter, h,
                                 reinterpret_cast<bf16*>(packed.data()));
          up.put(w.gate_up + e * 2 * inter * h, packed.data(), gu_bytes);
          put(w.down + e * h * inter, ep + "down_proj.weight", {h, inter});
        }
      } else {
        const int64_t inter = c.intermediate_size;
        if (w.gate_up8) {
          put8(w.gate_up8, 0, p + "mlp.gate_proj.weight", inter, h, {0, inter}, {0, h});
          put8(w.gate_up8, inter, p + "mlp.up_proj.weight", inter, h, {0, inter}, {0, h});
        } else {
          put(w.gate_up, p + "mlp.gate_proj.weight", {inter, h});
          put(w.gate_up + inter * h, p + "mlp.up_proj.weight", {inter, h});
        }
        if (w.down8) {
          put8(w.down8, 0, p + "mlp.down_proj.weight", h, inter, {0, h}, {0, inter});
        } else {
          put(w.down, p + "mlp.down_proj.weight", {h, inter});
        }
      }
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  void random_weights(uint64_t seed) {
    const float a = 0.02f * std::sqrt(3.0f);
    // The blocks' output projections (o_proj, the experts' down_proj) near zero: with random
    // weights every block's output shares one direction (attention over a common prefix
    // averages to about the same vector for every token), which grows with depth and sends
    // most tokens to the same experts (the last 30B layer: 15.9x the mean to one expert).
    // A trained router is balanced; keeping the residual stream the embedding's keeps ours
    // balanced too, so the benchmark sees the routing a real model has. The work per step
    // is the same.
    std::vector<const void*> outputs;
    for (const auto& w : layers) {
      outputs.push_back(w.o);
      outputs.push_back(w.down);
    }
    uint64_t k = seed * 0x100000001b3ull;
    for (size_t i = 0; i < mem.size(); ++i) {
      const int64_t n = static_cast<int64_t>(mem[i].size() / sizeof(bf16));
      // Norm weights are the vectors of length hidden or head_dim: ~1, matrices ~0.
      const bool norm = n == c.hidden_size || n == c.head_dim;
      const bool out =
          std::find(outputs.begin(), outputs.end(), mem[i].as<void>()) != outputs.end();
      cuda::random_fill_bf16(mem[i].as<void>(), n, ++k, norm ? 1.0f : 0.0f,
                             norm ? 0.05f : (out ? 1e-3f * a : a), stream);
    }
    // FP8 linears: codes of U(-1, 1), the scale the half-width (the same distribution).
    f8.random_fill(k, a, stream);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  void allocate_activations(const CudaModelOptions& o) {
    run.allocate(det);
    const int64_t h = c.hidden_size, d = c.head_dim, qh = this->qh();
    const size_t b = sizeof(bf16);
    const auto T = static_cast<size_t>(ws.t_cap);
    qkv = DeviceMem(T * static_cast<size_t>(qkv_rows()) * b);
    q = DeviceMem(T * static_cast<size_t>(qh * d) * b);
    attn = DeviceMem(T * static_cast<size_t>(qh * d) * b);
    const int64_t dense_inter = c.intermediate_size;
    bool any_dense = false;
    for (const auto& w : layers) any_dense |= !w.moe;
    if (any_dense) {
      gu = DeviceMem(T * static_cast<size_t>(2 * dense_inter) * b);
      act = DeviceMem(T * static_cast<size_t>(dense_inter) * b);
    }
    bool any_moe = false;
    for (const auto& w : layers) any_moe |= w.moe;
    if (any_moe) {
      const std::string& mp = o.moe_prefill_path;
      TANDEM_CHECK_KIND(kInvalidArgument,
                        mp.empty() || mp == "mma" || mp == "cublas" || mp == "padded",
                        "moe_prefill_path must be mma, cublas or padded, not '", mp, "'");
      moe_prefill_path = mp == "mma"      ? cuda::MoeLayerPath::kMma
                         : mp == "cublas" ? cuda::MoeLayerPath::kCublas
                         : mp == "padded" ? cuda::MoeLayerPath::kPadded
                                          : cuda::MoeLayerPath::kAuto;
      if (!dp_ep()) {
        moe = std::make_unique<cuda::MoeLayer>(ws.t_cap, h, c.moe_intermediate_size, c.num_experts,
                                               c.num_experts_per_tok, plan.experts.begin,
                                               local_experts(), c.norm_topk_prob);
        bool fp8_experts = false;
        for (const auto& w : layers) fp8_experts |= w.moe && static_cast<bool>(w.gate_up8);
        // W8A8: prefill-sized batches too on the FP8 grouped GEMM (mma path), no bf16 copy of
        // the experts; W8A16: they dequantize into that copy for the cuBLAS paths.
        moe->set_fp8_activations(fp8_act);
        moe->set_fp8_prefill_dequant(!fp8_act);
        if (fp8_experts && !fp8_act) moe->reserve_fp8_prefill();
      }
    }
    // The FP8 grouped GEMM's tiles before any graph capture; the dense FP8 linears' bf16
    // scratch for m above the gemv's.
    if (!f8.empty() || det) cuda::moe_gemm_prepare();
    int64_t dq_elems = 0;
    for (const auto& w : layers) {
      if (w.qkv8) dq_elems = std::max(dq_elems, qkv_rows() * h);
      if (w.o8) dq_elems = std::max(dq_elems, h * qh * d);
      if (!w.moe && w.gate_up8) dq_elems = std::max(dq_elems, 2 * dense_inter * h);
      if (!w.moe && w.down8) dq_elems = std::max(dq_elems, h * dense_inter);
    }
    f8.prepare(dq_elems, ws.t_cap, std::max({h, qh * d, dense_inter}), fp8_act);
    make_communicators(o, any_moe);
  }

  // Embedding -> layers -> final norm -> the logits rows' hidden states in `last`.
  // `warmup`: a graph's first (eager) run with padding only: no collective call (the other
  // ranks are not running it), so the decode EP MoE block is left out.
  void step(const cuda_model::StepMeta& m, KvCache& kv, const ForwardBatch* batch, bool warmup) {
    const int64_t n = m.n, h = c.hidden_size, d = c.head_dim, qh = this->qh(), kvh = this->kvh();
    cuda_model::ShardComms& sc = *comms;
    const int64_t page_size = kv.geometry().page_size;
    const float eps = static_cast<float>(c.rms_norm_eps);
    bf16 *X = ws.x.as<bf16>(), *XN = ws.xn.as<bf16>(), *Y = ws.y.as<bf16>();
    cuda::embedding_launch({m.ids, embed, X, n, h, c.vocab_size}, stream);
    const int64_t split = run.pick_split(n, m.num_prefill, m.width, page_size);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const LayerW& w = layers[static_cast<size_t>(l)];
      if (l == 0) {
        cuda::rms_norm_launch({X, w.input_norm, XN, n, h, eps}, stream);
      } else {
        cuda::add_rms_norm_launch({X, Y, w.input_norm, XN, n, h, eps}, stream);
      }
      linear(XN, w.qkv, w.qkv8, qkv.as<bf16>(), n, qkv_rows(), h);
      bf16* pool = static_cast<bf16*>(kv.layer_data(l));
      const cuda_model::KvScales ks = kv_scales[static_cast<size_t>(l)];
      cuda::qkv_prep_launch(
          {qkv.as<bf16>(), q.as<bf16>(), pool, m.slots, w.q_norm, w.k_norm, m.positions, n, qh, kvh,
           d, page_size, eps, c.rope_theta, kv_fp8, ks.k, ks.v},
          stream);
      // The KV of layer l is written once the stream gets here (the hook orders its reads
      // after it on KvCache::device_stream()).
      if (batch != nullptr && batch->on_layer_kv) batch->on_layer_kv(l);
      cuda::PagedAttentionParams ap =
          run.attention_params(m, q.as<bf16>(), pool, attn.as<bf16>(), page_size, split);
      ap.kv_fp8 = kv_fp8;
      ap.k_scale = ks.k;
      ap.v_scale = ks.v;
      if (det) cuda_model::make_batch_invariant(ap);
      cuda::paged_attention_launch(ap, stream);
      // Row-parallel o_proj (prefill TP): the partial products go straight into the
      // all-reduce's registered buffer and come back summed over the ranks into Y.
      linear(attn.as<bf16>(), w.o, w.o8, sc.partial(Y), n, h, qh * d);
      sc.reduce(Y, n * h, DType::kBF16, stream);
      cuda::add_rms_norm_launch({X, Y, w.post_norm, XN, n, h, eps}, stream);
      if (w.moe && dp_ep()) {
        moe_ep(w, XN, Y, m, warmup);
      } else if (w.moe) {
        // A forced prefill path (benchmarks) applies to eager batches only.
        moe->set_path(cuda_model::moe_path(
            det, batch != nullptr ? moe_prefill_path : cuda::MoeLayerPath::kAuto));
        // Prefill EP: this rank's experts' weighted sum (zeros for tokens routed elsewhere),
        // into the registered buffer, then summed over the ranks.
        moe->run({w.router, w.gate_up, w.down, w.gate_up8.q, w.gate_up8.s, w.down8.q, w.down8.s,
                  w.gate_up8.e, w.down8.e},
                 XN, sc.partial(Y), n, *ws.gemm, stream);
        sc.reduce(Y, n * h, DType::kBF16, stream);
      } else {
        const int64_t inter = c.intermediate_size;
        linear(XN, w.gate_up, w.gate_up8, gu.as<bf16>(), n, 2 * inter, h);
        cuda::silu_mul_launch({gu.as<bf16>(), act.as<bf16>(), n, inter}, stream);
        linear(act.as<bf16>(), w.down, w.down8, Y, n, h, inter);
      }
    }
    // x + y, normed; then the rows that need logits, gathered (the embedding gather with the
    // token index as id).
    cuda::add_rms_norm_launch({X, Y, final_norm, XN, n, h, eps}, stream);
    cuda::embedding_launch({m.rows, XN, ws.last.as<bf16>(), m.num_rows, h, n}, stream);
  }

  // y[m, n] = x[m, k] W^T: bf16 through GemmLt, FP8 by the step's rows (Fp8Linears::run).
  void linear(const bf16* x, const bf16* w, const Fp8Mat& w8, bf16* y, int64_t m, int64_t n,
              int64_t k) {
    f8.run(x, w, w8, y, m, n, k, *ws.gemm, stream);
  }

  // Decode EP MoE block (ShardComms::moe_ep) over the step's tokens.
  void moe_ep(const LayerW& w, bf16* XN, bf16* Y, const cuda_model::StepMeta& m, bool warmup) {
    cuda_model::EpExperts e;
    e.router = w.router;
    e.gate_up = w.gate_up;
    e.down = w.down;
    e.gate_up_q = w.gate_up8.q;
    e.gate_up_s = w.gate_up8.s;
    e.gate_up_e = w.gate_up8.e;
    e.down_q = w.down8.q;
    e.down_s = w.down8.s;
    e.down_e = w.down8.e;
    comms->moe_ep(e, XN, Y, m.n, m.num_real, warmup, c.norm_topk_prob, fp8_act, *ws.gemm, stream);
  }

  // fp32 logits of rows [begin, begin + count) of `last` into logits[0, count).
  void head(int64_t begin, int64_t count) override {
    comms->head(*ws.gemm, ws.last.as<bf16>() + begin * c.hidden_size, lm_head, count,
                ws.logits.as<float>(), stream);
  }
  // The rank's CUDA communicators (collective: every rank of the group builds them now).
  void make_communicators(const CudaModelOptions& o, bool any_moe) {
    comms->connect(o.device, ws.t_cap, ws.rows_cap, any_moe);
  }
};

Qwen3MoeCuda::Qwen3MoeCuda(ModelConfig config, const CudaModelOptions& opts)
    : config_(std::move(config)), opts_(opts) {
  TANDEM_CHECK_KIND(kInvalidArgument, opts_.max_tokens > 0 && opts_.max_seqs > 0,
                    "max_tokens and max_seqs must be positive");
  // TANDEM_CUDA_MXFP8 checked before anything is allocated (a bad value throws).
  const bool mxfp8 = cuda_model::is_mxfp8(config_.quant);
  const cuda_model::Mxfp8Gpu mx_mode =
      mxfp8 ? cuda_model::mxfp8_gpu_mode_from_env() : cuda_model::Mxfp8Gpu::kDequant;
  runner_ = std::make_unique<cuda_model::CudaRunner>(config_, opts_);
  stream_ = runner_->stream();
  impl_ = std::make_unique<Impl>(config_, *runner_);
  runner_->set_layers(impl_.get());
  impl_->plan = ShardPlan::make(config_, opts_.shard);
  impl_->comms = std::make_unique<cuda_model::ShardComms>(config_, impl_->plan, opts_.store);
  // Block FP8 stays FP8 unless turned off (the option, or TANDEM_CUDA_FP8=0);
  // MXFP8 only when TANDEM_CUDA_MXFP8 asks for it (native or block).
  const std::string fp8_env = env::choice("TANDEM_CUDA_FP8").value_or("on");
  const bool env_off = fp8_env == "0" || fp8_env == "off" || fp8_env == "dequant";
  cuda_model::check_deterministic(opts_);
  cuda_model::check_kv_cache_dtype(opts_, "Qwen3-MoE");
  impl_->det = opts_.deterministic;
  impl_->kv_fp8 = opts_.kv_cache_fp8;
  impl_->kv_scales.assign(static_cast<size_t>(config_.num_hidden_layers), {});
  impl_->fp8 = opts_.fp8_weights && !env_off && !impl_->det &&
               ((config_.quant.method == WeightQuant::kFp8Block &&
                 config_.quant.block_cols == cuda::kFp8BlockK && config_.quant.block_rows > 0) ||
                (mxfp8 && mx_mode != cuda_model::Mxfp8Gpu::kDequant));
  impl_->mx_native = impl_->fp8 && mx_mode == cuda_model::Mxfp8Gpu::kNative;
  impl_->f8 = cuda_model::Fp8Linears(impl_->mx_native);
  impl_->fp8_dense = opts_.fp8_dense;
  impl_->fp8_act = impl_->fp8 && !impl_->mx_native && env::flag("TANDEM_CUDA_FP8_ACT", true);
  if (impl_->plan.tensor_parallel()) {
    check_gqa_group(impl_->qh() / impl_->kvh(), "config.json",
                    "query heads / KV heads per prefill TP rank");
  }
  // Prefill TP batches are prompts: eager (no decode graphs).
  if (impl_->plan.tensor_parallel()) runner_->clear_buckets();
}

const std::vector<int64_t>& Qwen3MoeCuda::buckets() const { return runner_->buckets(); }

const ShardPlan& Qwen3MoeCuda::shard() const { return impl_->plan; }

bool Qwen3MoeCuda::mtp_graphs_on() const { return impl_->plan.spec.size == 1 && opts_.mtp_graphs; }

MtpScratch Qwen3MoeCuda::mtp_scratch() const {
  Impl& im = *impl_;
  const cuda_model::Workspace& ws = runner_->ws();
  MtpScratch s;
  s.x = ws.x.as<void>();
  s.xn = ws.xn.as<void>();
  s.y = ws.y.as<void>();
  s.qkv = im.qkv.as<void>();
  s.q = im.q.as<void>();
  s.attn = im.attn.as<void>();
  s.last = ws.last.as<void>();
  s.logits = ws.logits.as<float>();
  s.attn_ws = ws.attn_ws.as<float>();
  s.attn_ws_floats = ws.attn_ws_floats;
  s.gemm = ws.gemm.get();
  s.embed = im.embed;
  s.lm_head = im.lm_head;
  s.t_cap = ws.t_cap;
  s.rows_cap = ws.rows_cap;
  s.num_sms = ws.num_sms;
  s.stream = stream_;
  s.sampler = ws.sampler.get();
  if (const cuda_model::ShardComms& sc = *im.comms; sc.ep() != nullptr) {
    // decode DP/EP: the MTP layer's MoE through the target's exchange
    s.ep = sc.ep();
    s.comms = im.comms.get();
    s.ep_expert_begin = im.plan.experts.begin;
    s.ep_local_experts = im.local_experts();
  }
  if (mtp_graphs_on()) {  // the draft passes' graphs (mtp_cuda.h): single-GPU models
    s.buckets = runner_->buckets();
    s.graph_context =
        opts_.graph_max_context > 0 ? opts_.graph_max_context : config_.max_position_embeddings;
  }
  return s;
}

bool Qwen3MoeCuda::mtp_drafts_on_device() const { return mtp_ != nullptr && device_chain_; }

void Qwen3MoeCuda::mtp_draft_chain(const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                                   const std::vector<MtpChainPass>& chain, KvCache& mtp_kv,
                                   std::vector<std::vector<int32_t>>& drafts) {
  TANDEM_CHECK(mtp_ != nullptr, "mtp_draft_chain: no MTP layer loaded");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const std::vector<int32_t>& last = runner_->hidden_rows();
  std::vector<int32_t> rows(hidden_rows.size());  // batch order -> rows of xn
  for (size_t t = 0; t < rows.size(); ++t) {
    const int64_t r = hidden_rows[t];
    TANDEM_CHECK(r >= 0 && r < static_cast<int64_t>(last.size()), "mtp_draft_chain: hidden row ", r,
                 " is not a token of the last forward (", last.size(), " tokens)");
    rows[t] = last[static_cast<size_t>(r)];
  }
  const cuda_model::Workspace& ws = runner_->ws();
  mtp_->draft_chain(first, ws.xn.as<void>(), ws.t_cap, rows, chain, mtp_kv, drafts);
}

bool Qwen3MoeCuda::fuses_verify_and_draft() const {
  // (decode EP too: the step's MTP passes are pass 0 and K - 1 chained ones, K exchanges)
  return mtp_drafts_on_device() && fused_step_;
}

void Qwen3MoeCuda::forward_verify_draft(const ForwardBatch& batch, KvCache& kv,
                                        const std::vector<DeviceSampling>& rows, KvCache& mtp_kv,
                                        VerifyDraftStep& step, std::vector<SampledToken>& out) {
  TANDEM_CHECK(mtp_ != nullptr, "forward_verify_draft: no MTP layer loaded");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  cuda_model::Workspace& ws = runner_->ws();
  const auto R = static_cast<int64_t>(rows.size());
  TANDEM_CHECK(R == batch.num_logit_rows() && R == batch.num_tokens() && R > 0,
               "forward_verify_draft: ", R, " sampling rows for ", batch.num_logit_rows(),
               " logits rows of ", batch.num_tokens(), " tokens (one row each)");
  TANDEM_CHECK_KIND(kInvalidArgument, R <= ws.rows_cap, R,
                    " sampling rows exceed the CUDA model's ", ws.rows_cap);
  // The logits are the model's own device scratch (the sampler's biases apply in place); the
  // MTP passes reuse that buffer after the sampler read it (one stream).
  ++fused_steps_;
  float* logits = const_cast<float*>(forward_device(batch, kv));
  ws.sampler->enqueue(logits, rows, {}, stream_);
  mtp_->draft_after_verify(batch, ws.xn.as<void>(), ws.t_cap, runner_->hidden_rows(),
                           ws.sampler->device_tokens(), step, mtp_kv);  // synchronises
  ws.sampler->collect(out, stream_);
}

int64_t Qwen3MoeCuda::fp8_linears() const { return impl_->f8.count(); }
bool Qwen3MoeCuda::fp8_activations() const { return impl_->fp8_act; }

Qwen3MoeCuda::~Qwen3MoeCuda() {
  mtp_.reset();
  if (runner_) runner_->reset_graphs();
  impl_.reset();
  runner_.reset();
}

std::unique_ptr<Qwen3MoeCuda> Qwen3MoeCuda::load(const std::string& dir,
                                                 const CudaModelOptions& opts) {
  ModelConfig config = ModelConfig::from_dir(dir);
  check_cuda_model_config(config, dir + "/config.json");
  TANDEM_CHECK_KIND(kUnsupported, !config.is_hybrid(), dir, "/config.json: model_type '",
                    config.model_type, "' is a Qwen3.5 hybrid: load it with Qwen35MoeCuda");
  Checkpoint ckpt(dir);
  const WeightReader reader(ckpt, config.quant, dir + "/config.json");
  std::unique_ptr<Qwen3MoeCuda> m(new Qwen3MoeCuda(std::move(config), opts));
  m->impl_->allocate_weights(&reader);
  m->impl_->load_weights(reader);
  m->impl_->allocate_activations(opts);
  for (const auto& d : m->impl_->mem) m->weight_bytes_ += static_cast<int64_t>(d.size());
  m->weight_bytes_ += m->impl_->f8.bytes();
  return m;
}

std::unique_ptr<Qwen3MoeCuda> Qwen3MoeCuda::random(const ModelConfig& config,
                                                   const CudaModelOptions& opts, uint64_t seed) {
  check_cuda_model_config(config, "config");
  TANDEM_CHECK_KIND(kUnsupported, !config.is_hybrid(), "config: a Qwen3.5 hybrid model");
  std::unique_ptr<Qwen3MoeCuda> m(new Qwen3MoeCuda(config, opts));
  m->impl_->allocate_weights(nullptr);
  m->impl_->random_weights(seed);
  m->impl_->allocate_activations(opts);
  for (const auto& d : m->impl_->mem) m->weight_bytes_ += static_cast<int64_t>(d.size());
  m->weight_bytes_ += m->impl_->f8.bytes();
  return m;
}

KvGeometry Qwen3MoeCuda::kv_geometry(int64_t num_pages, int64_t page_size) const {
  KvGeometry g{config_.num_hidden_layers, num_pages, impl_->kvh(), page_size, config_.head_dim};
  g.dtype = impl_->kv_fp8 ? DType::kF8E4M3 : DType::kBF16;
  return g;
}

KvCache Qwen3MoeCuda::make_kv_cache(int64_t num_pages, int64_t page_size) {
  return runner_->make_kv_cache(kv_geometry(num_pages, page_size), /*states=*/false);
}

int64_t Qwen3MoeCuda::kv_cache_budget_mb(double utilization) const {
  return runner_->kv_cache_budget_mb(utilization);
}

int64_t Qwen3MoeCuda::kv_cache_mb_hint() const { return runner_->kv_cache_mb_hint(); }

std::string Qwen3MoeCuda::last_moe_path() const {
  if (!impl_->moe) return "";
  switch (impl_->moe->last_path()) {
    case cuda::MoeLayerPath::kMma: return "mma";
    case cuda::MoeLayerPath::kDecode: return "decode";
    case cuda::MoeLayerPath::kCublas: return "cublas";
    case cuda::MoeLayerPath::kPadded: return "padded";
    default: return "";
  }
}

double Qwen3MoeCuda::last_moe_imbalance() const {
  if (!impl_->moe) return 0.0;
  const int64_t e = config_.num_experts;
  std::vector<int32_t> off(static_cast<size_t>(e + 1));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  TANDEM_CUDA_CHECK(
      cudaMemcpy(off.data(), impl_->moe->expert_offsets(), off.size() * 4, cudaMemcpyDeviceToHost));
  int32_t mx = 0;
  for (int64_t i = 0; i < e; ++i) mx = std::max(mx, off[i + 1] - off[i]);
  return off[e] > 0 ? static_cast<double>(mx) * e / off[e] : 0.0;
}

void Qwen3MoeCuda::warm_up(KvCache& kv, int64_t max_batch) {
  // (a sharded model's ranks capture together on first use)
  if (impl_->plan.spec.size == 1) runner_->capture_buckets(kv, max_batch, 1);
}

void Qwen3MoeCuda::warm_up_speculative(KvCache& kv, KvCache& mtp_kv, int64_t max_batch, int64_t k) {
  const int64_t q = k + 1;  // tokens per verify sequence
  const std::vector<int64_t>& buckets = runner_->buckets();
  const cuda_model::Workspace& ws = runner_->ws();
  if (!mtp_graphs_on() || buckets.empty() || k < 1 || q > cuda_model::kMaxGraphTokensPerSeq ||
      q > opts_.page_size) {
    return;
  }
  const std::vector<int32_t> tokens(static_cast<size_t>(q), 0);
  const std::vector<float> hidden(
      static_cast<size_t>(std::min(std::max<int64_t>(1, max_batch), buckets.back()) *
                          config_.hidden_size),
      0.0f);
  const int32_t page = 0;
  for (const int64_t bucket : buckets) {
    if (bucket > std::max<int64_t>(1, max_batch)) break;
    if (bucket * q > ws.t_cap || bucket * q > ws.rows_cap) break;
    ForwardBatch batch;  // bucket verify-shaped sequences at positions 0.. of page 0
    ForwardBatch chain;  // bucket one-token MTP passes at position 0 of page 0
    for (int64_t i = 0; i < bucket; ++i) {
      ForwardSeq s;
      s.tokens = tokens.data();
      s.num_tokens = q;
      s.block_table = &page;
      s.num_pages = 1;
      s.logits = LogitsMode::kAll;
      batch.seqs.push_back(s);
      s.num_tokens = 1;
      s.logits = LogitsMode::kLast;
      chain.seqs.push_back(s);
    }
    runner_->launch(batch, kv);  // captures the (bucket, K + 1) graph, then replays it once
    if (mtp_ != nullptr) mtp_->forward(chain, hidden.data(), mtp_kv);  // its draft pass graph
  }
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<int64_t> Qwen3MoeCuda::captured_buckets() const { return runner_->captured_buckets(); }

std::vector<std::pair<int64_t, int64_t>> Qwen3MoeCuda::captured_verify_graphs() const {
  return runner_->captured_verify_graphs();
}

const float* Qwen3MoeCuda::forward_device(const ForwardBatch& batch, KvCache& kv) {
  return runner_->forward_device(batch, kv);
}

void Qwen3MoeCuda::forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) {
  runner_->forward(batch, kv, logits);
}

void Qwen3MoeCuda::forward_sample(const ForwardBatch& batch, KvCache& kv,
                                  const std::vector<DeviceSampling>& rows,
                                  std::vector<SampledToken>& out,
                                  const std::function<void()>& wait_masks) {
  runner_->forward_sample(batch, kv, rows, out, wait_masks);
}

}  // namespace tandem
