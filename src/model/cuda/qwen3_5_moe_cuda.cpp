// Qwen3.5 hybrid MoE forward on one GPU. See qwen3_5_moe_cuda.h.
#include "model/cuda/qwen3_5_moe_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <span>
#include <string>
#include <utility>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_sm90.h"
#include "backend/cuda/check.h"
#include "backend/cuda/deltanet.h"
#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/gated_attention.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_layer.h"
#include "backend/cuda/norm.h"
#include "backend/cuda/sampling.h"
#include "backend/cuda/spec_advance.h"
#include "backend/cuda/spec_replay.h"
#include "core/dtype.h"
#include "core/env.h"
#include "core/error.h"
#include "model/cuda/cuda_mem.h"
#include "model/cuda/dense_linear.h"
#include "model/cuda/device_sampler.h"
#include "model/cuda/mxfp8_weights.h"
#include "model/cuda/runner.h"
#include "model/cuda/shard_comms.h"
#include "model/cuda/spec_stage.h"
#include "model/hybrid_state.h"
#include "model/quant.h"
#include "model/safetensors.h"

namespace tandem {

using cuda::bf16;
using cuda_model::CudaRunner;
using cuda_model::DeviceMem;
using cuda_model::host_bf16;
using cuda_model::HostStepMeta;
using cuda_model::PinnedMem;
using cuda_model::SpecAdvanceStage;
using cuda_model::StageClock;
using cuda_model::StepMeta;
using cuda_model::Uploader;

namespace {

struct LayerW {
  bool linear = false;
  int64_t index = 0;               // among the layers of its kind: KV layer or state part
  cuda_model::KvScales kv_scales;  // gated attention over an FP8 KV cache (1.0: none given)
  bf16* input_norm = nullptr;      // [H], 1 + w
  bf16* post_norm = nullptr;       // [H], 1 + w
  // Gated attention.
  bf16* qkv = nullptr;     // [(2 qh + 2 kvh) d, H]: q_proj (query | gate per head), k, v
  bf16* o = nullptr;       // [H, qh d]
  bf16* q_norm = nullptr;  // [d], 1 + w
  bf16* k_norm = nullptr;  // [d], 1 + w
  // Gated DeltaNet.
  bf16* in_proj = nullptr;    // [in_rows, H]: qkv | z | b | a | zero rows (to a multiple of 8)
  bf16* conv = nullptr;       // [conv_dim, kernel]
  float* a_log = nullptr;     // [hv]
  float* dt_bias = nullptr;   // [hv]
  float* out_norm = nullptr;  // [dv] (plain weight)
  bf16* out_proj = nullptr;   // [H, value_dim]
  // MoE + shared expert.
  bf16* router = nullptr;   // [E, H]
  bf16* gate_up = nullptr;  // [local E, 2I, H] packed (moe_pack_gate_up): this rank's
  bf16* down = nullptr;     // [local E, H, I]
  // Block-FP8 experts (Impl::fp8, every local expert of the layer stored F8_E4M3; gate_up and
  // down then unallocated): E4M3 codes in the layouts above and their row scales
  // (backend/cuda/fp8_linear.h: [.., 2I, ceil(H / 128)] packed as the rows, [.., H, ceil(I /
  // 128)]).
  uint8_t* gate_up_q = nullptr;
  float* gate_up_s = nullptr;
  uint8_t* down_q = nullptr;
  float* down_s = nullptr;
  bf16* shared_gate_up = nullptr;  // [2 SI, H]: gate rows, then up rows (this rank's SI)
  bf16* shared_down = nullptr;     // [H, SI]
  bf16* shared_gate = nullptr;     // [H]
  // Dense linears kept in block FP8 (Impl::fp8 and the checkpoint's tensors F8_E4M3: keep_fp8):
  // the same layouts as E4M3 codes + row scales (model/cuda/dense_linear.h), the bf16 pointer of
  // the same linear then unallocated.
  cuda_model::Fp8Mat qkv8, o8, in_proj8, out_proj8, shared_gate_up8, shared_down8;
};

// A host float vector as bf16 bits.
std::vector<uint16_t> to_bf16_bits(const std::vector<float>& f) {
  std::vector<uint16_t> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = f32_to_bf16(f[i]);
  return b;
}

}  // namespace

struct Qwen35MoeCuda::Impl final : cuda_model::CudaLayers {
  const ModelConfig& c;
  CudaRunner& run;
  cuda_model::Workspace& ws;
  cudaStream_t stream;

  // Sharding (model/shard.h, model/hybrid_state.h): this rank's attention heads, DeltaNet
  // heads, experts, shared-expert columns and vocabulary rows, and the collectives.
  ShardPlan plan;
  DeltaNetHeads dn;
  HybridSlices sl;
  std::unique_ptr<cuda_model::ShardComms> comms;
  bool tp() const { return comms->tp(); }
  bool dp_ep() const { return comms->dp_ep(); }

  // Sizes (this rank's heads).
  int64_t num_linear = 0, num_attention = 0;
  int64_t qh = 0, kvh = 0, hk = 0, hv = 0, sinter = 0, local_experts = 0;
  int64_t key_dim = 0, value_dim = 0, conv_dim = 0, in_rows = 0, in_used = 0;
  // prefill TP: the last gathered whole state (gather_state) and one layer's sum.
  DeviceMem whole_state, gather_sum;

  // Weights.
  std::vector<DeviceMem> mem;
  // Block-FP8 checkpoints: the routed experts stay E4M3 + row scales on the device (1 byte a
  // weight: they are nearly all of a Qwen3.5 MoE's bytes), run by MoeLayer / the decode EP
  // exchange; the dense linears (attention, DeltaNet, shared expert) stay E4M3 too (f8), each
  // rank reading only its rows / columns, run by Fp8Linears by the step's rows (the gemv at
  // decode sizes: half the bytes of bf16). Set by load() from CudaModelOptions::fp8_weights,
  // TANDEM_CUDA_FP8 and the config (block FP8 of 128 columns).
  bool fp8 = false;
  bool any_fp8_experts = false;
  cuda_model::Fp8Linears f8;  // the dense FP8 linears (not the experts)
  bool fp8_dense = true;      // CudaModelOptions::fp8_dense
  // FP8 activations for the FP8 experts (W8A8 on the FP8 tensor cores, as Qwen3MoeCuda: the
  // rows quantized per token and 128 columns, Qwen's dynamic activation scheme); off
  // (TANDEM_CUDA_FP8_ACT=0): W8A16, bf16 rows against the E4M3 weights.
  bool fp8_act = false;
  bf16* embed = nullptr;
  bf16* final_norm = nullptr;
  bf16* lm_head = nullptr;  // the embedding when tied
  std::vector<LayerW> layers;
  // The MTP layer (load_mtp): x = fc([norm_e(embed(t + 1)); norm_h(h_t)]), one gated
  // full-attention decoder layer with the MoE block (its own one-layer KV: layer.index 0),
  // norm; the target's embedding, lm_head, activations, GEMM plans and metadata buffers.
  struct MtpW {
    bool loaded = false;
    bf16* fc = nullptr;                         // [H, 2H] over [embedding; hidden]
    bf16 *norm_e = nullptr, *norm_h = nullptr;  // [H], 1 + w
    bf16* norm = nullptr;                       // [H], 1 + w
    LayerW layer;
    DeviceMem cat;                 // [t_cap, 2H] bf16: [norm_e(embed); norm_h(hidden)]
    DeviceMem hidden_in;           // [t_cap, H] bf16, device token order
    PinnedMem h_hidden;            // its staging
    cudaEvent_t staged = nullptr;  // h_hidden may be reused
  } mtp_w;

  // Activations beside the runner's workspace, sized for its t_cap tokens. (Eager prefill
  // chunks: FlashInfer's sm90 prefill, head_dim 256 by its gathered-KV path, planned by the
  // runner once per step for every attention layer; FA2 when it does not plan.)
  DeviceMem proj, q, gate, attn, conv_out, core, dn_ws, sgu, sact, sout;
  std::unique_ptr<cuda::MoeLayer> moe;
  // Steps of at most kForkMaxTokens tokens run the shared expert (gate_up, SiLU, down) on a
  // second stream beside the router and the routed experts (both read the post-attention norm;
  // the shared expert's gate joins them): at decode sizes these are latency-bound kernels of few
  // CTAs, so the two chains overlap (faster on the H200: docs/perf.md). Its own GemmLt (one per
  // stream). Off (tests and benchmarks): set_shared_expert_fork(false).
  static constexpr int64_t kForkMaxTokens = 256;
  bool fork_shared = true;
  // A DeltaNet decode step as one kernel (GatedDeltaRuleParams::fused_decode). Off (tests and
  // benchmarks): set_fused_deltanet_decode(false).
  bool fused_decode = true;
  cudaStream_t side = nullptr;
  cudaEvent_t ev_fork = nullptr, ev_join = nullptr;
  std::unique_ptr<cuda::GemmLt> gemm_side;

  // The target's decode graphs and verify graphs (q tokens per sequence) are the runner's.
  static constexpr int64_t kMaxVerifyTokens =
      cuda_model::kMaxGraphTokensPerSeq;  // K + 1 for K up to kMaxSpeculativeTokens
  // Verify steps replay graphs (faster end to end on the H200: docs/perf.md). Off (tests and
  // benchmarks): set_verify_graphs(false).
  bool verify_graphs = true;
  // Chained MTP passes (one token per sequence) replayed from graphs by bucket, against one MTP
  // KV pool; their own metadata buffers (g_meta's layout) and block tables.
  bool mtp_graphs_on = false;
  // CudaModelOptions::kv_cache_fp8: the target's KV pools hold E4M3 codes.
  bool kv_fp8 = false;
  cuda_model::GraphSet mtp_graphs;
  // The last launch's DeltaNet recurrence inputs (ForwardBatch::keep_recurrent_inputs; every
  // verify graph keeps them): per linear layer its in_proj rows [kept_cap, in_rows] in device
  // token order (conv input | z | b | a), for replay_states. kept_tokens < 0: none kept;
  // kept_first / kept_count: that launch's sequences' first device tokens and sizes.
  DeviceMem kept;
  int64_t kept_cap = 0, kept_tokens = -1;
  // The draft chain's per-pass gather indices and argmax tokens.
  // Drafts chain on the device (faster end to end than drafting pass by pass on the H200:
  // docs/perf.md). Off (tests and benchmarks): set_device_chain(false).
  bool device_chain = true;
  DeviceMem chain_buf;
  PinnedMem chain_host;
  std::vector<int64_t> kept_first, kept_count;
  // A draft chain's device buffers: per pass its gather index ([t_cap]) and its argmax
  // ([ws.rows_cap]); their pinned twins (the indices up, the tokens down). Nothing of an earlier
  // chain is in flight: it ended with a synchronisation.
  struct ChainBuffers {
    int32_t *idx, *tokens, *idx_host, *tokens_host;
  };
  ChainBuffers chain_buffers(int64_t passes) {
    const size_t bytes = static_cast<size_t>(passes * (ws.t_cap + ws.rows_cap)) * sizeof(int32_t);
    if (chain_buf.size() < bytes) {
      chain_buf = DeviceMem(bytes);
      chain_host = PinnedMem(bytes);
    }
    ChainBuffers b{};
    b.idx = chain_buf.as<int32_t>();
    b.tokens = b.idx + passes * ws.t_cap;
    b.idx_host = chain_host.as<int32_t>();
    b.tokens_host = b.idx_host + passes * ws.t_cap;
    return b;
  }
  // Every pass's argmax tokens to the host (after the stream's sync: tokens_host).
  void tokens_to_host(const ChainBuffers& b, int64_t passes) {
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(b.tokens_host, b.tokens,
                                      static_cast<size_t>(passes * ws.rows_cap) * sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, stream));
  }
  // The fused speculative step (forward_verify_draft): on unless set_fused_step(false) (tests
  // and benchmarks); spec_advance's staging; the
  // device-driven state replay's metadata (a metadata buffer, written by spec_replay_plan).
  bool fused_step = true;
  int64_t fused_steps = 0;
  StageClock fused_clock;  // profile_fused_stages
  SpecAdvanceStage spec;
  DeviceMem r_meta;

  Impl(const ModelConfig& config, CudaRunner& r, const CudaModelOptions& o)
      : c(config),
        run(r),
        ws(r.ws()),
        stream(r.stream()),
        plan(ShardPlan::make(config, o.shard)),
        dn(DeltaNetHeads::of(config, o.shard)),
        sl(HybridSlices::of(config, plan, dn)),
        comms(std::make_unique<cuda_model::ShardComms>(config, plan, o.store)) {
    qh = plan.q_heads.size();
    kvh = plan.kv_heads.size();
    kv_fp8 = o.kv_cache_fp8;
    hk = dn.key_heads.size();
    hv = dn.value_heads.size();
    sinter = sl.shared_inter.size();
    local_experts = plan.experts.size();
    key_dim = hk * c.linear_key_head_dim;
    value_dim = hv * c.linear_value_head_dim;
    conv_dim = 2 * key_dim + value_dim;
    in_used = conv_dim + value_dim + 2 * hv;
    in_rows = (in_used + 7) / 8 * 8;
  }
  ~Impl() {
    drop_graphs();
    drop_settle_graphs();
    if (mtp_w.staged != nullptr) (void)cudaEventDestroy(mtp_w.staged);
    if (ev_fork != nullptr) (void)cudaEventDestroy(ev_fork);
    if (ev_join != nullptr) (void)cudaEventDestroy(ev_join);
    gemm_side.reset();
    if (side != nullptr) (void)cudaStreamDestroy(side);
  }
  void drop_graphs() {
    run.graphs().drop();
    mtp_graphs.drop();
  }
  void drop_verify_graphs() {
    run.graphs().drop_if([](int64_t key) { return key >= cuda_model::kGraphKeyStride; });
  }

  // CudaLayers.
  void body(const StepMeta& m, KvCache& kv, const Args& a) override {
    step(m, kv, a.batch, a.keep, a.warmup);
  }
  void check_cache(const KvCache& kv) const override {
    const auto& g = kv.geometry();
    TANDEM_CHECK(!kv.is_host() && g.dtype == (kv_fp8 ? DType::kF8E4M3 : DType::kBF16) &&
                     g.num_kv_heads == kvh && g.head_dim == c.head_dim &&
                     g.num_layers == num_attention,
                 "the KV cache was not made by this CUDA model");
    if (num_linear > 0) {
      TANDEM_CHECK(kv.states_on_device() && kv.state_slot_elems() == slot_elems(),
                   "the KV cache has no device state slots for this hybrid model");
    }
  }
  cuda_model::AttentionShape attention() const override {
    return {qh, kvh, c.head_dim, num_attention > 0, kv_fp8};
  }
  bool collective_steps() const override { return dp_ep(); }
  bool has_states() const override { return num_linear > 0; }
  int64_t max_graph_q() const override { return verify_graphs ? kMaxVerifyTokens : 1; }
  // replay_states' inputs: kept by every verify graph, and by an eager batch that asks, up to a
  // verify step's size (a larger batch rolls back with a forward), of any size on a decode EP
  // rank (a forward there is collective: only the ranks with a rejection would run it).
  bool keeps_inputs(bool graph, int64_t q, int64_t rows_n, const ForwardBatch& batch) override {
    kept_tokens = -1;
    const bool keep = num_linear > 0 &&
                      (graph ? q > 1
                             : batch.keep_recurrent_inputs &&
                                   (dp_ep() || batch.num_tokens() <= ws.s_cap * kMaxVerifyTokens));
    if (keep) ensure_kept(rows_n);
    return keep;
  }
  // After a launch of `batch`: what replay_states needs to find its rows.
  void launched(const ForwardBatch& batch, bool keep) override {
    kept_tokens = keep ? batch.num_tokens() : -1;
    if (!keep) return;
    const std::vector<int64_t>& first_token = run.first_token();
    kept_first.assign(first_token.begin(), first_token.begin() + batch.seqs.size());
    kept_count.clear();
    for (const auto& s : batch.seqs) kept_count.push_back(s.num_tokens);
  }
  // Room in `kept` for `tokens` tokens; growing it drops the verify graphs (they copy into it).
  void ensure_kept(int64_t tokens) {
    if (kept_cap >= tokens) return;
    const int64_t cap = std::max(tokens, std::min(ws.t_cap, std::max<int64_t>(2 * kept_cap, 64)));
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));  // nothing in flight writes the old one
    drop_verify_graphs();
    kept = DeviceMem(static_cast<size_t>(num_linear * cap * in_rows) * sizeof(bf16));
    kept_cap = cap;
  }

  // The second stream, its GemmLt and the fork / join events (made when the fork is turned on).
  void ensure_side() {
    if (gemm_side != nullptr) return;
    gemm_side = std::make_unique<cuda::GemmLt>();
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork, cudaEventDisableTiming));
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&ev_join, cudaEventDisableTiming));
  }

  int64_t qkv_rows() const { return (2 * qh + 2 * kvh) * c.head_dim; }
  int64_t state_per_layer() const {
    return conv_dim * (c.linear_conv_kernel_dim - 1) +
           hv * c.linear_key_head_dim * c.linear_value_head_dim;
  }
  int64_t slot_elems() const { return std::max<int64_t>(1, num_linear * state_per_layer()); }

  template <typename T>
  T* alloc(int64_t elems) {
    mem.emplace_back(static_cast<size_t>(elems) * sizeof(T));
    return mem.back().as<T>();
  }

  void allocate_weights(const WeightReader& wr) {
    const int64_t h = c.hidden_size;
    embed = alloc<bf16>(c.vocab_size * h);
    final_norm = alloc<bf16>(h);
    // The lm_head rows of this rank (all of them unless prefill TP): a slice of the embedding
    // when tied.
    lm_head =
        c.tie_word_embeddings ? embed + plan.vocab.begin * h : alloc<bf16>(plan.vocab.size() * h);
    layers.resize(static_cast<size_t>(c.num_hidden_layers));
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      LayerW& w = layers[static_cast<size_t>(l)];
      w.linear = c.layer_types[static_cast<size_t>(l)] == ModelConfig::LayerType::kLinearAttention;
      w.index = w.linear ? num_linear++ : num_attention++;
      const std::string prefix = c.weight_prefix + "layers." + std::to_string(l) + ".";
      allocate_layer(w, fp8_experts(wr, prefix), &wr, prefix);
    }
    TANDEM_CHECK_KIND(kUnsupported, num_attention > 0, "config.json: layer_types has no ",
                      "full_attention layer");
  }

  // Whether the routed experts of the layer at `prefix` stay FP8 (fp8 above): this rank's
  // experts stored one tensor per expert, every gate / up / down F8_E4M3, shapes the FP8 kernels
  // take (k % 16, n % 8). Otherwise they are dequantized to bf16 (e.g. modules_to_not_convert).
  bool fp8_experts(const WeightReader& wr, const std::string& prefix) const {
    const int64_t h = c.hidden_size, inter = c.moe_intermediate_size;
    if (!fp8 || h % 16 != 0 || inter % 16 != 0 || h % 8 != 0 || (2 * inter) % 8 != 0) return false;
    const Checkpoint& ckpt = wr.checkpoint();
    for (int64_t e = plan.experts.begin; e < plan.experts.end; ++e) {
      const std::string ep = prefix + "mlp.experts." + std::to_string(e) + ".";
      for (const char* t : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}) {
        if (!ckpt.has(ep + t) || !wr.is_quantized(ep + t)) return false;
      }
    }
    return plan.experts.size() > 0;
  }

  // Whether the linear [n, k] read from `names` (columns `cols` of each) stays FP8: FP8 on,
  // shapes the FP8 kernels take (k % 16, n % 8), columns on 128-column blocks and every tensor
  // stored as F8_E4M3 (wr null: no checkpoint, bf16).
  bool keep_fp8(const WeightReader* wr, const std::vector<std::string>& names, int64_t n, int64_t k,
                IndexRange cols) const {
    if (!fp8 || !fp8_dense || wr == nullptr || k % 16 != 0 || n % 8 != 0 ||
        !WeightReader::fp8_columns_splittable(cols, cuda::kFp8BlockK)) {
      return false;
    }
    for (const std::string& name : names) {
      if (!wr->checkpoint().has(name) || !wr->is_quantized(name)) return false;
    }
    return true;
  }

  // The device weights of one layer of w.linear's kind (fp8_experts: its experts in FP8; its
  // dense linears FP8 where keep_fp8 says so for the tensors at `prefix` of wr).
  void allocate_layer(LayerW& w, bool fp8_experts = false, const WeightReader* wr = nullptr,
                      const std::string& prefix = "") {
    const int64_t h = c.hidden_size, d = c.head_dim, dv = c.linear_value_head_dim;
    const int64_t E = c.num_experts, inter = c.moe_intermediate_size;
    const IndexRange all_h{0, h};
    w.input_norm = alloc<bf16>(h);
    w.post_norm = alloc<bf16>(h);
    if (w.linear) {
      const std::string a = prefix + "linear_attn.";
      // in_proj: its q / k / v and z rows FP8 in the checkpoint (the b / a rows, bf16 in Qwen's
      // layout, are quantized at load: Fp8Linears::upload).
      if (keep_fp8(wr, {a + "in_proj_qkv.weight", a + "in_proj_z.weight"}, in_rows, h, all_h)) {
        w.in_proj8 = f8.alloc(1, in_rows, h, false);
      } else {
        w.in_proj = alloc<bf16>(in_rows * h);
      }
      w.conv = alloc<bf16>(conv_dim * c.linear_conv_kernel_dim);
      w.a_log = alloc<float>(hv);
      w.dt_bias = alloc<float>(hv);
      w.out_norm = alloc<float>(dv);
      if (keep_fp8(wr, {a + "out_proj.weight"}, h, value_dim, sl.z_rows)) {
        w.out_proj8 = f8.alloc(1, h, value_dim, true);
      } else {
        w.out_proj = alloc<bf16>(h * value_dim);
      }
    } else {
      const std::string a = prefix + "self_attn.";
      if (keep_fp8(wr, {a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"}, qkv_rows(),
                   h, all_h)) {
        w.qkv8 = f8.alloc(1, qkv_rows(), h, false);
      } else {
        w.qkv = alloc<bf16>(qkv_rows() * h);
      }
      if (keep_fp8(wr, {a + "o_proj.weight"}, h, qh * d, sl.o_cols)) {
        w.o8 = f8.alloc(1, h, qh * d, true);
      } else {
        w.o = alloc<bf16>(h * qh * d);
      }
      w.q_norm = alloc<bf16>(d);
      w.k_norm = alloc<bf16>(d);
    }
    w.router = alloc<bf16>(E * h);
    if (fp8_experts) {
      w.gate_up_q = alloc<uint8_t>(local_experts * 2 * inter * h);
      w.gate_up_s = alloc<float>(local_experts * 2 * inter * cuda::fp8_row_scale_cols(h));
      w.down_q = alloc<uint8_t>(local_experts * h * inter);
      w.down_s = alloc<float>(local_experts * h * cuda::fp8_row_scale_cols(inter));
      any_fp8_experts = true;
    } else {
      w.gate_up = alloc<bf16>(local_experts * 2 * inter * h);
      w.down = alloc<bf16>(local_experts * h * inter);
    }
    const std::string se = prefix + "mlp.shared_expert.";
    if (keep_fp8(wr, {se + "gate_proj.weight", se + "up_proj.weight"}, 2 * sinter, h, all_h)) {
      w.shared_gate_up8 = f8.alloc(1, 2 * sinter, h, false);
    } else {
      w.shared_gate_up = alloc<bf16>(2 * sinter * h);
    }
    if (keep_fp8(wr, {se + "down_proj.weight"}, h, sinter, sl.shared_inter)) {
      w.shared_down8 = f8.alloc(1, h, sinter, true);
    } else {
      w.shared_down = alloc<bf16>(h * sinter);
    }
    w.shared_gate = alloc<bf16>(h);
  }

  // The target's weights, or (mtp) the MTP layer's: mtp.fc, its norms and mtp.layers.0 (the
  // target's layer layout; every norm zero-centred, stored 1 + w). A sharded rank reads its
  // slices (HybridSlices: heads, DeltaNet channels, shared-expert columns; its experts; its
  // lm_head rows).
  void load_weights(const WeightReader& wr, bool mtp = false) {
    const Checkpoint& ckpt = wr.checkpoint();
    const int64_t h = c.hidden_size, d = c.head_dim, qh_all = c.num_attention_heads,
                  kvh_all = c.num_key_value_heads;
    const int64_t hv_all = c.linear_num_value_heads, dv = c.linear_value_head_dim;
    const int64_t kern = c.linear_conv_kernel_dim, E = c.num_experts;
    const int64_t inter = c.moe_intermediate_size, si_all = c.shared_expert_intermediate_size;
    const int64_t conv_all = 2 * c.linear_num_key_heads * c.linear_key_head_dim + hv_all * dv;
    const int64_t value_all = hv_all * dv;
    const std::string& root = c.weight_prefix;
    Uploader up(stream);
    std::vector<uint16_t> tmp, tmp2;
    auto put = [&](bf16* dst, const std::string& name, const Shape& shape) {
      const uint16_t* src = host_bf16(wr, name, shape, tmp);
      up.put(dst, src, static_cast<size_t>(shape.numel()) * sizeof(bf16));
    };
    // rows x columns of a quantized [rows, cols] linear dequantized (only those read: each
    // element with its own block's scale, so a slice off the 128 grid is exact) to bf16.
    std::vector<float> deq;
    auto put_dequant = [&](bf16* dst, const std::string& name, int64_t rows, int64_t cols,
                           IndexRange rr, IndexRange cr) {
      deq.resize(static_cast<size_t>(rr.size() * cr.size()));
      wr.read(name, rows, cols, rr, cr, deq.data());
      tmp = to_bf16_bits(deq);
      up.put(dst, tmp.data(), tmp.size() * sizeof(uint16_t));
    };
    // Rows r of a tensor of `shape` (rows of numel / shape[0] elements).
    auto put_rows = [&](bf16* dst, const std::string& name, const Shape& shape, IndexRange r) {
      if (shape.ndim() == 2 && wr.is_quantized(name)) {
        put_dequant(dst, name, shape[0], shape[1], r, {0, shape[1]});
        return;
      }
      cuda_model::upload_rows(up, dst, host_bf16(wr, name, shape, tmp), shape.numel() / shape[0],
                              r);
    };
    // Columns r of a [rows, cols] tensor (a row-parallel linear).
    auto put_cols = [&](bf16* dst, const std::string& name, int64_t rows, int64_t cols,
                        IndexRange r) {
      if (wr.is_quantized(name)) {
        put_dequant(dst, name, rows, cols, {0, rows}, r);
        return;
      }
      cuda_model::upload_cols(up, dst, host_bf16(wr, name, {rows, cols}, tmp), rows, cols, r);
    };
    // A vector as fp32 (optionally 1 + w, computed in fp32 as transformers does).
    auto f32 = [&](const std::string& name, const Shape& shape, bool plus_one) {
      TensorView v = ckpt.get(name, shape);
      std::vector<float> f(static_cast<size_t>(v.numel()));
      Checkpoint::to_f32(v, f.data());
      if (plus_one) {
        for (float& e : f) e += 1.0f;
      }
      return f;
    };
    auto put_norm = [&](bf16* dst, const std::string& name, int64_t n) {
      const std::vector<uint16_t> b = to_bf16_bits(f32(name, {n}, true));
      up.put(dst, b.data(), b.size() * sizeof(uint16_t));
    };
    // FP8 (a linear keep_fp8 kept): rows rr x columns cr of a [rows, cols] tensor into dst from
    // its row row0 (Fp8Linears::upload: codes and row scales as stored, a bf16 tensor quantized).
    auto put8 = [&](const cuda_model::Fp8Mat& dst, int64_t row0, const std::string& name,
                    int64_t rows, int64_t cols, IndexRange rr,
                    IndexRange cr) { f8.upload(wr, up, dst, row0, name, rows, cols, rr, cr); };
    // Elements r of an fp32 vector of n.
    auto put_f32 = [&](float* dst, const std::string& name, int64_t n, IndexRange r) {
      const std::vector<float> f = f32(name, {n}, false);
      up.put(dst, f.data() + r.begin, static_cast<size_t>(r.size()) * sizeof(float));
    };
    std::vector<std::pair<LayerW*, std::string>> todo;  // each layer and its tensors' prefix
    if (mtp) {
      put(mtp_w.fc, "mtp.fc.weight", {h, 2 * h});
      put_norm(mtp_w.norm_e, "mtp.pre_fc_norm_embedding.weight", h);
      put_norm(mtp_w.norm_h, "mtp.pre_fc_norm_hidden.weight", h);
      put_norm(mtp_w.norm, "mtp.norm.weight", h);
      todo.emplace_back(&mtp_w.layer, "mtp.layers.0.");
    } else {
      put(embed, root + "embed_tokens.weight", {c.vocab_size, h});
      put_norm(final_norm, root + "norm.weight", h);
      if (!c.tie_word_embeddings)
        put_rows(lm_head, "lm_head.weight", {c.vocab_size, h}, plan.vocab);
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        todo.emplace_back(&layers[static_cast<size_t>(l)],
                          root + "layers." + std::to_string(l) + ".");
      }
    }
    std::vector<uint16_t> packed(static_cast<size_t>(2 * inter * h));
    for (auto& [wp, p] : todo) {
      LayerW& w = *wp;
      if (kv_fp8 && !mtp && !w.linear) w.kv_scales = cuda_model::read_kv_scales(ckpt, p);
      put_norm(w.input_norm, p + "input_layernorm.weight", h);
      put_norm(w.post_norm, p + "post_attention_layernorm.weight", h);
      if (w.linear) {
        // in_proj rows: this rank's conv channels (q | k | v), z, b, a.
        const std::string a = p + "linear_attn.";
        const std::string qkv = a + "in_proj_qkv.weight";
        const int64_t kc = sl.conv_q.size();
        if (w.in_proj8) {
          const IndexRange all_h{0, h};
          put8(w.in_proj8, 0, qkv, conv_all, h, sl.conv_q, all_h);
          put8(w.in_proj8, kc, qkv, conv_all, h, sl.conv_k, all_h);
          put8(w.in_proj8, 2 * kc, qkv, conv_all, h, sl.conv_v, all_h);
          put8(w.in_proj8, conv_dim, a + "in_proj_z.weight", value_all, h, sl.z_rows, all_h);
          put8(w.in_proj8, conv_dim + value_dim, a + "in_proj_b.weight", hv_all, h, sl.v_heads,
               all_h);
          put8(w.in_proj8, conv_dim + value_dim + hv, a + "in_proj_a.weight", hv_all, h, sl.v_heads,
               all_h);
          f8.zero_rows(up, w.in_proj8, in_used, in_rows - in_used, h);
        } else {
          put_rows(w.in_proj, qkv, {conv_all, h}, sl.conv_q);
          put_rows(w.in_proj + kc * h, qkv, {conv_all, h}, sl.conv_k);
          put_rows(w.in_proj + 2 * kc * h, qkv, {conv_all, h}, sl.conv_v);
          put_rows(w.in_proj + conv_dim * h, a + "in_proj_z.weight", {value_all, h}, sl.z_rows);
          put_rows(w.in_proj + (conv_dim + value_dim) * h, a + "in_proj_b.weight", {hv_all, h},
                   sl.v_heads);
          put_rows(w.in_proj + (conv_dim + value_dim + hv) * h, a + "in_proj_a.weight", {hv_all, h},
                   sl.v_heads);
          if (in_rows > in_used) {
            TANDEM_CUDA_CHECK(cudaMemsetAsync(w.in_proj + in_used * h, 0,
                                              static_cast<size_t>((in_rows - in_used) * h) * 2,
                                              stream));
          }
        }
        const std::string conv = a + "conv1d.weight";
        put_rows(w.conv, conv, {conv_all, 1, kern}, sl.conv_q);
        put_rows(w.conv + kc * kern, conv, {conv_all, 1, kern}, sl.conv_k);
        put_rows(w.conv + 2 * kc * kern, conv, {conv_all, 1, kern}, sl.conv_v);
        put_f32(w.a_log, a + "A_log", hv_all, sl.v_heads);
        put_f32(w.dt_bias, a + "dt_bias", hv_all, sl.v_heads);
        put_f32(w.out_norm, a + "norm.weight", dv, {0, dv});
        if (w.out_proj8) {
          put8(w.out_proj8, 0, a + "out_proj.weight", h, value_all, {0, h}, sl.z_rows);
        } else {
          put_cols(w.out_proj, a + "out_proj.weight", h, value_all, sl.z_rows);
        }
      } else {
        const std::string a = p + "self_attn.";
        if (w.qkv8) {
          const IndexRange all_h{0, h};
          put8(w.qkv8, 0, a + "q_proj.weight", qh_all * 2 * d, h, sl.q_rows, all_h);
          put8(w.qkv8, qh * 2 * d, a + "k_proj.weight", kvh_all * d, h, sl.kv_rows, all_h);
          put8(w.qkv8, qh * 2 * d + kvh * d, a + "v_proj.weight", kvh_all * d, h, sl.kv_rows,
               all_h);
        } else {
          put_rows(w.qkv, a + "q_proj.weight", {qh_all * 2 * d, h}, sl.q_rows);
          put_rows(w.qkv + qh * 2 * d * h, a + "k_proj.weight", {kvh_all * d, h}, sl.kv_rows);
          put_rows(w.qkv + (qh * 2 * d + kvh * d) * h, a + "v_proj.weight", {kvh_all * d, h},
                   sl.kv_rows);
        }
        if (w.o8) {
          put8(w.o8, 0, a + "o_proj.weight", h, qh_all * d, {0, h}, sl.o_cols);
        } else {
          put_cols(w.o, a + "o_proj.weight", h, qh_all * d, sl.o_cols);
        }
        put_norm(w.q_norm, a + "q_norm.weight", d);
        put_norm(w.k_norm, a + "k_norm.weight", d);
      }
      const std::string m = p + "mlp.";
      put(w.router, m + "gate.weight", {E, h});
      // This rank's experts: fused 3D (transformers 5) or one tensor per expert (the hub).
      const bool fused = ckpt.has(m + "experts.gate_up_proj");
      std::vector<float> ef;
      if (w.gate_up_q != nullptr) {  // FP8 experts: codes + row scales as stored (fp8_experts)
        cuda_model::upload_fp8_experts(wr, m + "experts.", plan.experts.begin, plan.experts.size(),
                                       inter, h, w.gate_up_q, w.gate_up_s, w.down_q, w.down_s, up);
      }
      for (int64_t e = plan.experts.begin; w.gate_up_q == nullptr && e < plan.experts.end; ++e) {
        const int64_t le = e - plan.experts.begin;
        const uint16_t *gate = nullptr, *upw = nullptr;
        std::vector<uint16_t> gate_copy;
        if (fused) {
          TensorView gu = ckpt.get(m + "experts.gate_up_proj", {E, 2 * inter, h});
          if (gu.dtype == DType::kBF16) {
            gate = gu.ptr<uint16_t>() + e * 2 * inter * h;
          } else {
            ef.resize(static_cast<size_t>(2 * inter * h));
            Checkpoint::to_f32(gu, ef.data(), e, e + 1);
            gate_copy = to_bf16_bits(ef);
            gate = gate_copy.data();
          }
          upw = gate + inter * h;
        } else {
          const std::string ep = m + "experts." + std::to_string(e) + ".";
          gate = host_bf16(wr, ep + "gate_proj.weight", {inter, h}, tmp);
          if (gate == tmp.data()) {  // converted: keep it while `up` converts into tmp2
            gate_copy = tmp;
            gate = gate_copy.data();
          }
          upw = host_bf16(wr, ep + "up_proj.weight", {inter, h}, tmp2);
        }
        cuda::moe_pack_gate_up(reinterpret_cast<const bf16*>(gate),
                               reinterpret_cast<const bf16*>(upw), inter, h,
                               reinterpret_cast<bf16*>(packed.data()));
        up.put(w.gate_up + le * 2 * inter * h, packed.data(), packed.size() * sizeof(uint16_t));
        if (fused) {
          TensorView dn_v = ckpt.get(m + "experts.down_proj", {E, h, inter});
          if (dn_v.dtype == DType::kBF16) {
            up.put(w.down + le * h * inter, dn_v.ptr<uint16_t>() + e * h * inter,
                   static_cast<size_t>(h * inter) * sizeof(uint16_t));
          } else {
            ef.resize(static_cast<size_t>(h * inter));
            Checkpoint::to_f32(dn_v, ef.data(), e, e + 1);
            const std::vector<uint16_t> b = to_bf16_bits(ef);
            up.put(w.down + le * h * inter, b.data(), b.size() * sizeof(uint16_t));
          }
        } else {
          put(w.down + le * h * inter, m + "experts." + std::to_string(e) + ".down_proj.weight",
              {h, inter});
        }
      }
      // The shared expert: this rank's intermediate columns (gate rows, then up rows).
      if (w.shared_gate_up8) {
        put8(w.shared_gate_up8, 0, m + "shared_expert.gate_proj.weight", si_all, h, sl.shared_inter,
             {0, h});
        put8(w.shared_gate_up8, sinter, m + "shared_expert.up_proj.weight", si_all, h,
             sl.shared_inter, {0, h});
      } else {
        put_rows(w.shared_gate_up, m + "shared_expert.gate_proj.weight", {si_all, h},
                 sl.shared_inter);
        put_rows(w.shared_gate_up + sinter * h, m + "shared_expert.up_proj.weight", {si_all, h},
                 sl.shared_inter);
      }
      if (w.shared_down8) {
        put8(w.shared_down8, 0, m + "shared_expert.down_proj.weight", h, si_all, {0, h},
             sl.shared_inter);
      } else {
        put_cols(w.shared_down, m + "shared_expert.down_proj.weight", h, si_all, sl.shared_inter);
      }
      put(w.shared_gate, m + "shared_expert_gate.weight", {1, h});
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  void allocate_activations() {
    run.allocate(/*batch_invariant=*/false);
    const int64_t h = c.hidden_size, d = c.head_dim, dv = c.linear_value_head_dim;
    const int64_t t_cap = ws.t_cap;
    const auto T = static_cast<size_t>(t_cap);
    const size_t b = sizeof(bf16);
    proj = DeviceMem(T * static_cast<size_t>(std::max(qkv_rows(), in_rows)) * b);
    q = DeviceMem(T * static_cast<size_t>(qh * d) * b);
    gate = DeviceMem(T * static_cast<size_t>(qh * d) * b);
    attn = DeviceMem(T * static_cast<size_t>(std::max(qh * d, value_dim)) * b);
    if (num_linear > 0) {
      conv_out = DeviceMem(T * static_cast<size_t>(conv_dim) * b);
      core = DeviceMem(T * static_cast<size_t>(hv * dv) * sizeof(float));
      dn_ws = DeviceMem(
          cuda::gated_delta_rule_workspace_floats(ws.t_cap, hk, hv, c.linear_key_head_dim, dv) *
          sizeof(float));
    }
    sgu = DeviceMem(T * static_cast<size_t>(2 * sinter) * b);
    sact = DeviceMem(T * static_cast<size_t>(sinter) * b);
    sout = DeviceMem(T * h * b);
    if (fork_shared) ensure_side();
    // Routed experts: this rank's (all unless sharded) by MoeLayer, or through the decode EP
    // exchange (ShardComms::moe_ep).
    if (!dp_ep()) {
      moe = std::make_unique<cuda::MoeLayer>(ws.t_cap, h, c.moe_intermediate_size, c.num_experts,
                                             c.num_experts_per_tok, plan.experts.begin,
                                             local_experts, true);
      // W8A8 FP8 experts: the wgmma grouped GEMMs (set up now, outside any capture). W8A16:
      // prefill-sized batches dequantize a layer's experts into MoeLayer's bf16 copy for the
      // cuBLAS paths (reserved now, before any graph capture).
      if (any_fp8_experts && fp8_act) {
        moe->set_fp8_activations(true);
        moe->set_fp8_prefill_dequant(false);
      } else if (any_fp8_experts) {
        moe->reserve_fp8_prefill();
      }
    }
    // The dense FP8 linears' bf16 scratch for m above the gemv's (the largest of them), and
    // with FP8 activations their cuBLASLt W8A8 path at prefill sizes.
    int64_t max_nk = 0;
    auto largest = [&](const cuda_model::Fp8Mat& m8, int64_t n, int64_t k) {
      if (m8) max_nk = std::max(max_nk, n * k);
    };
    for (const LayerW& w : layers) {
      largest(w.qkv8, qkv_rows(), h);
      largest(w.o8, h, qh * d);
      largest(w.in_proj8, in_rows, h);
      largest(w.out_proj8, h, value_dim);
      largest(w.shared_gate_up8, 2 * sinter, h);
      largest(w.shared_down8, h, sinter);
    }
    f8.prepare(max_nk, ws.t_cap, std::max({h, qh * d, value_dim, sinter}), fp8_act);
    // The FP8 grouped GEMM's tiles before any graph capture (the experts', and the last rows of
    // the dense cuBLASLt path: fp8_dense.h).
    if (any_fp8_experts || !f8.empty()) cuda::moe_gemm_prepare();
    // The communicators (collective); the registered buffer also holds one DeltaNet layer of a
    // whole state (gather_state).
    const HybridStateLayout whole = HybridStateLayout::full(c);
    comms->connect(run.device(), ws.t_cap, ws.rows_cap, /*any_moe=*/true,
                   static_cast<size_t>(whole.layer_elems()) * sizeof(float));
  }

  // Layer w's gated full attention over `pool` (its KV layer): reads XN, writes Y and the new
  // KV of m's tokens (batch->on_layer_kv after the KV write when set). fp8: the pool holds E4M3
  // codes (the target's with kv_fp8; the MTP layer's pool is bf16).
  void gated_attention(const LayerW& w, const StepMeta& m, bf16* pool, int64_t page_size,
                       int64_t split, const ForwardBatch* batch, bool fp8 = false) {
    const int64_t n = m.n, h = c.hidden_size, d = c.head_dim;
    const float eps = static_cast<float>(c.rms_norm_eps);
    bf16 *XN = ws.xn.as<bf16>(), *Y = ws.y.as<bf16>(), *P = proj.as<bf16>();
    f8.run(XN, w.qkv, w.qkv8, P, n, qkv_rows(), h, *ws.gemm, stream);
    cuda::gated_qkv_prep_launch(
        {P, q.as<bf16>(), gate.as<bf16>(), pool, m.slots, w.q_norm, w.k_norm, m.positions, n, qh,
         kvh, d, page_size, c.rotary_dim(), eps, c.rope_theta, fp8, w.kv_scales.k, w.kv_scales.v},
        stream);
    if (batch != nullptr && batch->on_layer_kv) batch->on_layer_kv(w.index);
    cuda::PagedAttentionParams ap =
        run.attention_params(m, q.as<bf16>(), pool, attn.as<bf16>(), page_size, split);
    ap.kv_fp8 = fp8;
    ap.k_scale = w.kv_scales.k;
    ap.v_scale = w.kv_scales.v;
    cuda::paged_attention_launch(ap, stream);
    cuda::sigmoid_mul_launch({attn.as<bf16>(), gate.as<bf16>(), attn.as<bf16>(), n * qh * d},
                             stream);
    // Row-parallel o_proj (prefill TP): the partial products summed over the ranks into Y.
    f8.run(attn.as<bf16>(), w.o, w.o8, comms->partial(Y), n, h, qh * d, *ws.gemm, stream);
    comms->reduce(Y, n * h, DType::kBF16, stream);
  }

  // Layer w's routed experts for the decode EP exchange (bf16 or FP8).
  static void ep_experts(const LayerW& w, cuda_model::EpExperts& e) {
    e.router = w.router;
    e.gate_up = w.gate_up;
    e.down = w.down;
    e.gate_up_q = w.gate_up_q;
    e.gate_up_s = w.gate_up_s;
    e.down_q = w.down_q;
    e.down_s = w.down_s;
  }

  // Layer w's MoE block over m's n tokens: routed experts + the sigmoid-gated shared expert, from
  // XN into Y. Prefill TP: this rank's experts and shared-expert columns into the registered
  // buffer, summed over the ranks; decode EP: the routed experts through the exchange (not on a
  // graph's warm-up run).
  void moe_block(const LayerW& w, const StepMeta& m, bool warmup) {
    const int64_t n = m.n, h = c.hidden_size;
    bf16 *XN = ws.xn.as<bf16>(), *Y = ws.y.as<bf16>(), *out = comms->partial(Y);
    auto routed = [&] {
      if (dp_ep()) {
        cuda_model::EpExperts e;
        ep_experts(w, e);
        comms->moe_ep(e, XN, out, n, m.num_real, warmup, true, fp8_act && w.gate_up_q != nullptr,
                      *ws.gemm, stream);
      } else {
        moe->run({w.router, w.gate_up, w.down, w.gate_up_q, w.gate_up_s, w.down_q, w.down_s}, XN,
                 out, n, *ws.gemm, stream);
      }
    };
    if (!(fork_shared && n <= kForkMaxTokens)) {  // the default: one stream, main's order
      routed();
      f8.run(XN, w.shared_gate_up, w.shared_gate_up8, sgu.as<bf16>(), n, 2 * sinter, h, *ws.gemm,
             stream);
      cuda::silu_mul_launch({sgu.as<bf16>(), sact.as<bf16>(), n, sinter}, stream);
      f8.run(sact.as<bf16>(), w.shared_down, w.shared_down8, sout.as<bf16>(), n, h, sinter,
             *ws.gemm, stream);
    } else {
      // The shared expert on the side stream: it reads XN and writes sgu / sact / sout only;
      // the next writer of XN (the next layer's norm) comes after the join below.
      TANDEM_CUDA_CHECK(cudaEventRecord(ev_fork, stream));
      TANDEM_CUDA_CHECK(cudaStreamWaitEvent(side, ev_fork, 0));
      // (Fp8Linears' one scratch: the main stream's dense linears ran before the fork and run
      // again after the join; routed() uses none.)
      f8.run(XN, w.shared_gate_up, w.shared_gate_up8, sgu.as<bf16>(), n, 2 * sinter, h, *gemm_side,
             side);
      cuda::silu_mul_launch({sgu.as<bf16>(), sact.as<bf16>(), n, sinter}, side);
      f8.run(sact.as<bf16>(), w.shared_down, w.shared_down8, sout.as<bf16>(), n, h, sinter,
             *gemm_side, side);
      TANDEM_CUDA_CHECK(cudaEventRecord(ev_join, side));
      routed();
      TANDEM_CUDA_CHECK(cudaStreamWaitEvent(stream, ev_join, 0));
    }
    cuda::shared_expert_gate_launch({XN, w.shared_gate, sout.as<bf16>(), out, n, h}, stream);
    comms->reduce(Y, n * h, DType::kBF16, stream);
  }

  // Embedding -> layers -> final norm -> the logits rows' hidden states in `last`.
  // The delta rule of DeltaNet layer w over n tokens: the conv output in conv_out, the gates in
  // the in_proj rows P, the recurrent states at rec_state, the output in core.
  cuda::GatedDeltaRuleParams delta_rule_params(const LayerW& w, const bf16* P, float* rec_state,
                                               const cuda::DeltaNetSeqs& seqs, int64_t n,
                                               int64_t slot_stride) const {
    cuda::GatedDeltaRuleParams dp{};
    dp.qkv = conv_out.as<bf16>();
    dp.b = P + conv_dim + value_dim;
    dp.a = P + conv_dim + value_dim + hv;
    dp.a_log = w.a_log;
    dp.dt_bias = w.dt_bias;
    dp.states = rec_state;
    dp.out = core.as<float>();
    dp.workspace = dn_ws.as<float>();
    dp.seqs = seqs;
    dp.num_tokens = n;
    dp.num_k_heads = hk;
    dp.num_v_heads = hv;
    dp.k_dim = c.linear_key_head_dim;
    dp.v_dim = c.linear_value_head_dim;
    dp.qkv_stride = conv_dim;
    dp.ab_stride = in_rows;
    dp.state_stride = slot_stride;
    dp.fused_decode = fused_decode;
    return dp;
  }

  // keep: each DeltaNet layer's in_proj rows go to `kept` (replay_states).
  // warmup: a graph's first run (padding only): no collective call.
  void step(const StepMeta& m, KvCache& kv, const ForwardBatch* batch, bool keep, bool warmup) {
    const int64_t n = m.n, h = c.hidden_size;
    const int64_t dv = c.linear_value_head_dim;
    const int64_t kern = c.linear_conv_kernel_dim;
    const int64_t page_size = kv.geometry().page_size;
    const float eps = static_cast<float>(c.rms_norm_eps);
    bf16 *X = ws.x.as<bf16>(), *XN = ws.xn.as<bf16>(), *Y = ws.y.as<bf16>(), *P = proj.as<bf16>();
    float* states = num_linear > 0 ? kv.state_data(0) : nullptr;
    const int64_t slot_stride = num_linear > 0 ? kv.state_slot_elems() : 0;
    const cuda::DeltaNetSeqs seqs{m.dn_begin, m.dn_token_seq, m.dn_slot,
                                  m.dn_fresh, m.num_seqs,     m.dn_slot_out};
    cuda::embedding_launch({m.ids, embed, X, n, h, c.vocab_size}, stream);
    const int64_t split = run.pick_split(n, m.num_prefill, m.width, page_size);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const LayerW& w = layers[static_cast<size_t>(l)];
      if (l == 0) {
        cuda::rms_norm_launch({X, w.input_norm, XN, n, h, eps}, stream);
      } else {
        cuda::add_rms_norm_launch({X, Y, w.input_norm, XN, n, h, eps}, stream);
      }
      if (!w.linear) {
        gated_attention(w, m, static_cast<bf16*>(kv.layer_data(w.index)), page_size, split, batch,
                        kv_fp8);
      } else {
        // One fused projection [qkv | z | b | a], the conv and the delta rule per sequence on
        // its state slot, the gated norm, out_proj.
        f8.run(XN, w.in_proj, w.in_proj8, P, n, in_rows, h, *ws.gemm, stream);
        if (keep) {
          TANDEM_CUDA_CHECK(cudaMemcpyAsync(kept.as<bf16>() + w.index * kept_cap * in_rows, P,
                                            static_cast<size_t>(n * in_rows) * sizeof(bf16),
                                            cudaMemcpyDeviceToDevice, stream));
        }
        float* conv_state = states + w.index * state_per_layer();
        float* rec_state = conv_state + conv_dim * (kern - 1);
        cuda::causal_conv1d_launch({P, w.conv, conv_state, conv_out.as<bf16>(), seqs, n, conv_dim,
                                    kern, in_rows, slot_stride},
                                   stream);
        cuda::gated_delta_rule_launch(delta_rule_params(w, P, rec_state, seqs, n, slot_stride),
                                      stream);
        cuda::gated_rms_norm_launch({core.as<float>(), P + conv_dim, w.out_norm, attn.as<bf16>(),
                                     n * hv, dv, hv, in_rows, eps},
                                    stream);
        // Row-parallel out_proj over this rank's value heads (prefill TP: summed).
        f8.run(attn.as<bf16>(), w.out_proj, w.out_proj8, comms->partial(Y), n, h, value_dim,
               *ws.gemm, stream);
        comms->reduce(Y, n * h, DType::kBF16, stream);
      }
      // MoE block: routed experts + the sigmoid-gated shared expert.
      cuda::add_rms_norm_launch({X, Y, w.post_norm, XN, n, h, eps}, stream);
      moe_block(w, m, warmup);
    }
    cuda::add_rms_norm_launch({X, Y, final_norm, XN, n, h, eps}, stream);
    cuda::embedding_launch({m.rows, XN, ws.last.as<bf16>(), m.num_rows, h, n}, stream);
  }

  // replay_states: per DeltaNet layer, m's tokens' in_proj rows gathered from `kept` (m.ids:
  // their rows there) into proj, then the conv and the delta rule on m's sequences' states
  // (outputs unused), as body() runs them.
  void replay(const StepMeta& m, KvCache& kv) {
    const int64_t n = m.n, kern = c.linear_conv_kernel_dim;
    bf16* P = proj.as<bf16>();
    float* states = kv.state_data(0);
    const int64_t slot_stride = kv.state_slot_elems();
    const cuda::DeltaNetSeqs seqs{m.dn_begin, m.dn_token_seq, m.dn_slot, m.dn_fresh, m.num_seqs};
    for (const LayerW& w : layers) {
      if (!w.linear) continue;
      cuda::embedding_launch(
          {m.ids, kept.as<bf16>() + w.index * kept_cap * in_rows, P, n, in_rows, kept_cap}, stream);
      float* conv_state = states + w.index * state_per_layer();
      cuda::causal_conv1d_launch({P, w.conv, conv_state, conv_out.as<bf16>(), seqs, n, conv_dim,
                                  kern, in_rows, slot_stride},
                                 stream);
      cuda::GatedDeltaRuleParams dp =
          delta_rule_params(w, P, conv_state + conv_dim * (kern - 1), seqs, n, slot_stride);
      dp.states_only = true;  // (m's padding: no work)
      cuda::gated_delta_rule_launch(dp, stream);
    }
  }

  // After a fused step's acceptance (ap: spec_advance's, its sequences the last launch's in
  // device order, `tokens` of them; the verify wrote each verify sequence's state to its spare
  // slot): from the accepted counts on the device (backend/cuda/spec_replay.h), the spare slot's
  // state copied over the slot of each sequence that accepted every draft, and the others'
  // slots (the state before the step) rolled over their kept rows. `graph`: replayed from a
  // graph per (sequences, tokens), captured on first use (five launches per DeltaNet layer);
  // eagerly while fused_clock profiles, its parts timed.
  void settle_states(const cuda::SpecAdvanceParams& ap, int64_t tokens, const int32_t* slots,
                     const int32_t* spares, KvCache& kv, bool graph) {
    if (r_meta.size() == 0) r_meta = run.make_meta_buffer();
    StepMeta m = run.meta_at(r_meta);
    // One more replay sequence than num_tokens == num_seqs would make (a decode step's shape).
    m.num_seqs = ap.seqs + 1 == tokens ? ap.seqs + 2 : ap.seqs + 1;
    m.n = tokens;
    TANDEM_CHECK(m.num_seqs <= ws.s_cap + 2 && tokens <= kept_cap, "settle_states: ", ap.seqs,
                 " sequences, ", tokens, " tokens");
    kept_tokens = -1;  // replayed once
    auto record = [&] {
      cuda::spec_replay_plan_launch({ap.accepted, ap.seq_begin, slots, ap.seqs, m.num_seqs, m.ids,
                                     m.dn_begin, m.dn_token_seq, m.dn_slot, m.dn_fresh},
                                    stream);
      fused_clock.mark("settle: plan", stream);
      cuda::accepted_state_copy_launch({ap.accepted, ap.seq_begin, slots, spares, kv.state_data(0),
                                        ap.seqs, slot_elems(), kv.state_slot_elems()},
                                       stream);
      fused_clock.mark("settle: accepted copy", stream);
      replay(m, kv);
    };
    if (fused_clock.on()) return record();
    // What a captured settle reads and writes besides r_meta and the activations.
    const SettleInputs in{ap.accepted, ap.seq_begin,     slots,
                          spares,      kv.state_data(0), kept.as<void>()};
    const std::pair<int64_t, int64_t> key{ap.seqs, tokens};
    auto it = settle_graphs.find(key);
    if (it != settle_graphs.end() && it->second.in != in) {
      (void)cudaGraphExecDestroy(it->second.exec);
      settle_graphs.erase(it);
      it = settle_graphs.end();
    }
    if (it == settle_graphs.end()) {
      if (!graph || settle_graphs.size() >= kMaxSettleGraphs) return record();
      it = settle_graphs.emplace(key, SettleGraph{cuda_model::capture_graph(stream, record), in})
               .first;
    }
    TANDEM_CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream));
  }
  using SettleInputs = std::array<const void*, 6>;
  struct SettleGraph {
    cudaGraphExec_t exec;
    SettleInputs in;
  };
  static constexpr size_t kMaxSettleGraphs = 512;
  std::map<std::pair<int64_t, int64_t>, SettleGraph> settle_graphs;
  void drop_settle_graphs() {
    for (auto& [k, g] : settle_graphs) (void)cudaGraphExecDestroy(g.exec);
    settle_graphs.clear();
  }

  // prefill TP: the whole state of `slot` (HybridStateLayout::full) into whole_state on the
  // device, on every rank: per DeltaNet layer each rank's runs (hybrid_state_runs, owned only)
  // scattered into a zeroed full layer of the registered buffer, summed over the ranks (every
  // float comes from one rank, the others add zeros: exact), then placed. Collective.
  const float* gather_whole_state(KvCache& kv, int64_t slot) {
    const HybridStateLayout full = HybridStateLayout::full(c);
    const int64_t le = full.layer_elems();
    if (whole_state.size() == 0) {
      whole_state = DeviceMem(static_cast<size_t>(full.slot_elems()) * sizeof(float));
      gather_sum = DeviceMem(static_cast<size_t>(le) * sizeof(float));
    }
    const std::vector<StateRun> runs = hybrid_state_runs(c, dn, /*owned_only=*/true);
    auto* reg = static_cast<float*>(comms->registered());
    const float* part = kv.state_data(slot);
    float* whole = whole_state.as<float>();
    size_t r = 0;
    for (int64_t l = 0; l < full.num_linear_layers; ++l) {
      TANDEM_CUDA_CHECK(cudaMemsetAsync(reg, 0, static_cast<size_t>(le) * sizeof(float), stream));
      for (; r < runs.size() && runs[r].full < (l + 1) * le; ++r) {
        if (runs[r].count == 0) continue;
        TANDEM_CUDA_CHECK(cudaMemcpyAsync(reg + (runs[r].full - l * le), part + runs[r].part,
                                          static_cast<size_t>(runs[r].count) * sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream));
      }
      comms->reduce(gather_sum.as<float>(), le, DType::kF32, stream);
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(whole + l * le, gather_sum.as<float>(),
                                        static_cast<size_t>(le) * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream));
    }
    return whole;
  }

  // fp32 logits of rows [begin, begin + count) of `last` into logits[0, count) (vocab-parallel
  // under prefill TP).
  void head(int64_t begin, int64_t count) override {
    comms->head(*ws.gemm, ws.last.as<bf16>() + begin * c.hidden_size, lm_head, count,
                ws.logits.as<float>(), stream);
  }

  // One MTP pass over m's tokens (ids: the tokens t + 1; mtp_w.hidden_in: h_t, device token
  // order), as Qwen35MoeCpu::mtp_forward: x = fc([norm_e(embed); norm_h(hidden)]), the decoder
  // layer over the MTP KV `mkv`, then mtp.norm of its output gathered for the logits rows into
  // `last`.
  void mtp_body(const StepMeta& m, KvCache& mkv) {
    const int64_t n = m.n, h = c.hidden_size;
    const int64_t page_size = mkv.geometry().page_size;
    const float eps = static_cast<float>(c.rms_norm_eps);
    const MtpW& t = mtp_w;
    bf16 *X = ws.x.as<bf16>(), *XN = ws.xn.as<bf16>(), *Y = ws.y.as<bf16>(),
         *CAT = t.cat.as<bf16>();
    const size_t row = static_cast<size_t>(h) * sizeof(bf16);
    cuda::embedding_launch({m.ids, embed, Y, n, h, c.vocab_size}, stream);
    cuda::rms_norm_launch({Y, t.norm_e, Y, n, h, eps}, stream);
    cuda::rms_norm_launch({t.hidden_in.as<bf16>(), t.norm_h, XN, n, h, eps}, stream);
    TANDEM_CUDA_CHECK(cudaMemcpy2DAsync(CAT, 2 * row, Y, row, row, static_cast<size_t>(n),
                                        cudaMemcpyDeviceToDevice, stream));
    TANDEM_CUDA_CHECK(cudaMemcpy2DAsync(CAT + h, 2 * row, XN, row, row, static_cast<size_t>(n),
                                        cudaMemcpyDeviceToDevice, stream));
    ws.gemm->run({CAT, t.fc, X, n, h, 2 * h}, stream);
    const LayerW& w = t.layer;
    cuda::rms_norm_launch({X, w.input_norm, XN, n, h, eps}, stream);
    gated_attention(w, m, static_cast<bf16*>(mkv.layer_data(0)), page_size,
                    run.pick_split(n, m.num_prefill, m.width, page_size), nullptr);
    cuda::add_rms_norm_launch({X, Y, w.post_norm, XN, n, h, eps}, stream);
    moe_block(w, m, /*warmup=*/false);
    cuda::add_rms_norm_launch({X, Y, t.norm, XN, n, h, eps}, stream);
    cuda::embedding_launch({m.rows, XN, ws.last.as<bf16>(), m.num_rows, h, n}, stream);
  }
};

Qwen35MoeCuda::Qwen35MoeCuda(ModelConfig config, const CudaModelOptions& opts)
    : config_(std::move(config)), opts_(opts) {
  TANDEM_CHECK_KIND(kInvalidArgument, opts_.max_tokens > 0 && opts_.max_seqs > 0,
                    "max_tokens and max_seqs must be positive");
  TANDEM_CHECK_KIND(kUnsupported, !opts_.deterministic,
                    "--deterministic is not supported for Qwen3.5 hybrid models on the GPU");
  cuda_model::check_kv_cache_dtype(opts_, "Qwen3.5");
  runner_ = std::make_unique<CudaRunner>(config_, opts_);
  stream_ = runner_->stream();
  impl_ = std::make_unique<Impl>(config_, *runner_, opts_);
  runner_->set_layers(impl_.get());
  if (impl_->plan.tensor_parallel()) {
    check_gqa_group(impl_->qh / impl_->kvh, "config.json",
                    "query heads / KV heads per prefill TP rank");
    runner_->clear_buckets();  // prefill TP batches are prompts: eager (no decode graphs)
  }
}

Qwen35MoeCuda::~Qwen35MoeCuda() {
  if (runner_) runner_->reset_graphs();
  impl_.reset();
  runner_.reset();
}

std::unique_ptr<Qwen35MoeCuda> Qwen35MoeCuda::load(const std::string& dir,
                                                   const CudaModelOptions& opts) {
  ModelConfig config = ModelConfig::from_dir(dir);
  TANDEM_CHECK_KIND(kUnsupported, config.is_hybrid(), dir, "/config.json: model_type '",
                    config.model_type, "' is not a Qwen3.5 hybrid model");
  check_cuda_model_config(config, dir + "/config.json");
  Checkpoint ckpt(dir);
  const WeightReader reader(ckpt, config.quant, dir + "/config.json");
  std::unique_ptr<Qwen35MoeCuda> m(new Qwen35MoeCuda(std::move(config), opts));
  // Block FP8 keeps its experts FP8 unless turned off (the option, or TANDEM_CUDA_FP8=0 for
  // comparisons), as Qwen3MoeCuda; MXFP8 is dequantized to bf16.
  const std::string fp8_env = env::choice("TANDEM_CUDA_FP8").value_or("on");
  const bool env_off = fp8_env == "0" || fp8_env == "off" || fp8_env == "dequant";
  const QuantConfig& q = m->config_.quant;
  m->impl_->fp8 = opts.fp8_weights && !env_off && q.method == WeightQuant::kFp8Block &&
                  q.block_cols == cuda::kFp8BlockK && q.block_rows > 0;
  m->impl_->fp8_act = m->impl_->fp8 && env::flag("TANDEM_CUDA_FP8_ACT", true);
  m->impl_->fp8_dense = opts.fp8_dense;
  m->impl_->allocate_weights(reader);
  m->impl_->load_weights(reader);
  m->impl_->allocate_activations();
  for (const auto& d : m->impl_->mem) m->weight_bytes_ += static_cast<int64_t>(d.size());
  m->weight_bytes_ += m->impl_->f8.bytes();
  return m;
}

int64_t Qwen35MoeCuda::num_linear_layers() const { return impl_->num_linear; }
int64_t Qwen35MoeCuda::num_attention_layers() const { return impl_->num_attention; }

KvGeometry Qwen35MoeCuda::kv_geometry(int64_t num_pages, int64_t page_size) const {
  KvGeometry g{impl_->num_attention, num_pages, impl_->kvh, page_size, config_.head_dim};
  g.dtype = impl_->kv_fp8 ? DType::kF8E4M3 : DType::kBF16;
  return g;
}

int64_t Qwen35MoeCuda::state_slot_elems() const {
  return impl_->num_linear > 0 ? impl_->slot_elems() : 0;
}

KvCache Qwen35MoeCuda::make_kv_cache(int64_t num_pages, int64_t page_size) {
  return runner_->make_kv_cache(kv_geometry(num_pages, page_size), /*states=*/true);
}

int64_t Qwen35MoeCuda::kv_cache_budget_mb(double utilization) const {
  return runner_->kv_cache_budget_mb(utilization);
}

int64_t Qwen35MoeCuda::kv_cache_mb_hint() const { return runner_->kv_cache_mb_hint(); }

std::vector<int64_t> Qwen35MoeCuda::captured_buckets() const { return runner_->captured_buckets(); }

std::vector<std::pair<int64_t, int64_t>> Qwen35MoeCuda::captured_verify_graphs() const {
  return runner_->captured_verify_graphs();
}

void Qwen35MoeCuda::set_verify_graphs(bool on) {
  if (impl_->verify_graphs == on) return;
  reset_graphs();
  impl_->verify_graphs = on;
}

bool Qwen35MoeCuda::verify_graphs() const { return impl_->verify_graphs; }

void Qwen35MoeCuda::reset_graphs() {
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  impl_->drop_graphs();
}

void Qwen35MoeCuda::set_shared_expert_fork(bool on) {
  if (impl_->fork_shared == on) return;
  reset_graphs();
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  if (on) impl_->ensure_side();
  impl_->fork_shared = on;
}

bool Qwen35MoeCuda::shared_expert_fork() const { return impl_->fork_shared; }

void Qwen35MoeCuda::set_fused_deltanet_decode(bool on) {
  if (impl_->fused_decode == on) return;
  reset_graphs();
  impl_->fused_decode = on;
}

bool Qwen35MoeCuda::fused_deltanet_decode() const { return impl_->fused_decode; }

const std::vector<int64_t>& Qwen35MoeCuda::buckets() const { return runner_->buckets(); }

bool Qwen35MoeCuda::launch(const ForwardBatch& batch, KvCache& kv,
                           const std::vector<int32_t>* state_out) {
  return runner_->launch(batch, kv, state_out);
}

void Qwen35MoeCuda::forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) {
  runner_->forward(batch, kv, logits);
}

bool Qwen35MoeCuda::replay_states(const std::vector<StateReplay>& replays, KvCache& kv) {
  Impl& im = *impl_;
  // A decode EP rank cannot fall back to a forward: that is collective, and only the ranks with
  // a rejection would run it.
  TANDEM_CHECK(im.kept_tokens >= 0 || !im.dp_ep() || replays.empty() || im.num_linear == 0,
               "replay_states: the last forward kept no recurrence inputs, and a decode EP rank "
               "cannot roll back by a forward");
  if (im.kept_tokens < 0 || im.num_linear == 0) return false;
  TANDEM_CHECK(kv.states_on_device() && kv.state_slot_elems() == im.slot_elems(),
               "replay_states: the KV cache has no device state slots for this hybrid model");
  // The replayed tokens gathered from `kept` (device token order), one DeltaNet sequence each.
  HostStepMeta hm;
  std::vector<int64_t> batch_begin(im.kept_count.size() + 1, 0);
  for (size_t i = 0; i < im.kept_count.size(); ++i) {
    batch_begin[i + 1] = batch_begin[i] + im.kept_count[i];
  }
  for (const StateReplay& r : replays) {
    const auto it = std::lower_bound(batch_begin.begin(), batch_begin.end() - 1, r.row);
    TANDEM_CHECK(it != batch_begin.end() - 1 && *it == r.row, "replay_states: row ", r.row,
                 " starts no sequence of the last forward");
    const auto si = static_cast<size_t>(it - batch_begin.begin());
    TANDEM_CHECK(r.count >= 1 && r.count <= im.kept_count[si], "replay_states: ", r.count,
                 " tokens of a ", im.kept_count[si], "-token chunk");
    TANDEM_CHECK(r.state_slot >= 0 && r.state_slot < kv.num_state_slots(),
                 "replay_states: state slot ", r.state_slot, " out of range");
    hm.dn_begin.push_back(static_cast<int32_t>(hm.ids.size()));
    hm.dn_slot.push_back(r.state_slot);
    hm.dn_fresh.push_back(0);
    for (int64_t i = 0; i < r.count; ++i) {
      hm.ids.push_back(static_cast<int32_t>(im.kept_first[si] + i));
      hm.dn_token_seq.push_back(static_cast<int32_t>(hm.dn_slot.size() - 1));
    }
  }
  im.kept_tokens = -1;  // replayed once
  const auto n = static_cast<int64_t>(hm.ids.size());
  if (n == 0) return true;
  hm.dn_begin.push_back(static_cast<int32_t>(n));
  hm.positions.assign(static_cast<size_t>(n), 0);
  hm.token_seq.assign(static_cast<size_t>(n), 0);
  hm.slots.assign(static_cast<size_t>(n), -1);
  StepMeta m = runner_->eager_meta(0);
  m.n = n;
  m.num_seqs = static_cast<int64_t>(replays.size());
  runner_->upload(hm, m);
  im.replay(m, kv);
  return true;
}

void Qwen35MoeCuda::forward_sample(const ForwardBatch& batch, KvCache& kv,
                                   const std::vector<DeviceSampling>& rows,
                                   std::vector<SampledToken>& out,
                                   const std::function<void()>& wait_masks) {
  runner_->forward_sample(batch, kv, rows, out, wait_masks);
}

// ---- MTP speculative decoding (the published Qwen3.5 layout; Impl::mtp_body) ---------------

void Qwen35MoeCuda::load_mtp(const std::string& dir) {
  Impl& im = *impl_;
  TANDEM_CHECK_KIND(kUnsupported, !opts_.kv_cache_fp8,
                    "MTP speculative decoding with --kv-cache-dtype fp8 is not supported (the "
                    "MTP passes read the target's prefill plan and bf16 KV)");
  Checkpoint ckpt(dir);
  TANDEM_CHECK_KIND(kNotFound, ckpt.has("mtp.fc.weight"), dir,
                    ": no MTP weights (tensor 'mtp.fc.weight' not found); the checkpoint needs "
                    "mtp.* tensors, or give the MTP layer's directory as \"model\" in "
                    "--speculative-config");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const WeightReader reader(ckpt, config_.quant, dir + "/config.json");
  Impl::MtpW& t = im.mtp_w;
  if (t.fc == nullptr) {  // a second load_mtp reloads into the same buffers
    const int64_t h = config_.hidden_size;
    t.fc = im.alloc<bf16>(2 * h * h);
    t.norm_e = im.alloc<bf16>(h);
    t.norm_h = im.alloc<bf16>(h);
    t.norm = im.alloc<bf16>(h);
    t.layer.linear = false;
    t.layer.index = 0;
    im.allocate_layer(t.layer);
    const auto T = static_cast<size_t>(runner_->ws().t_cap);
    t.cat = DeviceMem(T * static_cast<size_t>(2 * h) * sizeof(bf16));
    t.hidden_in = DeviceMem(T * static_cast<size_t>(h) * sizeof(bf16));
    t.h_hidden = PinnedMem(T * static_cast<size_t>(h) * sizeof(bf16));
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&t.staged, cudaEventDisableTiming));
  }
  // (sharded: passes eager; decode EP passes exchange with the peers' every time)
  im.mtp_graphs_on = opts_.mtp_graphs && opts_.shard.size <= 1;
  t.loaded = false;  // until every tensor is in
  im.load_weights(reader, /*mtp=*/true);
  t.loaded = true;
  weight_bytes_ = im.f8.bytes();
  for (const auto& d : im.mem) weight_bytes_ += static_cast<int64_t>(d.size());
}

bool Qwen35MoeCuda::has_mtp() const { return impl_->mtp_w.loaded; }

const float* Qwen35MoeCuda::gather_state_device(KvCache& kv, int64_t slot) {
  Impl& im = *impl_;
  if (!im.tp() || im.num_linear == 0) return nullptr;
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  im.check_cache(kv);
  TANDEM_CHECK(slot >= 0 && slot < kv.num_state_slots(), "gather_state: state slot ", slot,
               " out of range");
  return im.gather_whole_state(kv, slot);
}

bool Qwen35MoeCuda::gathers_state_on_device() const { return impl_->tp() && impl_->num_linear > 0; }

bool Qwen35MoeCuda::gather_state(KvCache& kv, int64_t slot, int root, std::vector<float>& out) {
  const float* whole = gather_state_device(kv, slot);
  if (whole == nullptr) return false;
  out.clear();
  if (opts_.shard.rank == root) {
    out.resize(static_cast<size_t>(HybridStateLayout::full(config_).slot_elems()));
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(out.data(), whole, out.size() * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_));
  }
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return true;
}

bool Qwen35MoeCuda::fp8_activations() const {
  return impl_->fp8_act && (impl_->any_fp8_experts || !impl_->f8.empty());
}

int64_t Qwen35MoeCuda::fp8_dense_linears() const { return impl_->f8.count(); }

int64_t Qwen35MoeCuda::fp8_expert_layers() const {
  int64_t n = 0;
  for (const LayerW& w : impl_->layers) n += w.gate_up_q != nullptr ? 1 : 0;
  return n;
}

const float* Qwen35MoeCuda::gathered_state() const { return impl_->whole_state.as<float>(); }

bool Qwen35MoeCuda::mtp_collective() const { return has_mtp() && impl_->dp_ep(); }

void Qwen35MoeCuda::mtp_empty_pass() {
  // Only the MTP layer's MoE exchange (no tokens of this rank): its experts serve the others.
  Impl& im = *impl_;
  const StepMeta m = runner_->eager_meta(0);
  TANDEM_CUDA_CHECK(cudaMemsetAsync(m.num_real, 0, sizeof(int32_t), stream_));
  const LayerW& w = im.mtp_w.layer;
  cuda_model::EpExperts e;
  Impl::ep_experts(w, e);
  im.comms->moe_ep(e, runner_->ws().xn.as<bf16>(), runner_->ws().y.as<bf16>(), 0, m.num_real, false,
                   true, false, *runner_->ws().gemm, stream_);
}

KvGeometry Qwen35MoeCuda::mtp_kv_geometry(int64_t num_pages, int64_t page_size) const {
  TANDEM_CHECK_KIND(kUnsupported, has_mtp(), "this model has no MTP layer loaded");
  KvGeometry g{1, num_pages, impl_->kvh, page_size, config_.head_dim};
  g.dtype = DType::kBF16;
  return g;
}

KvCache Qwen35MoeCuda::make_mtp_kv_cache(int64_t num_pages, int64_t page_size) {
  const KvGeometry g = mtp_kv_geometry(num_pages, page_size);
  TANDEM_CHECK_KIND(kInvalidArgument, num_pages > 0 && page_size > 0, "bad MTP KV cache size");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  auto pool =
      std::make_shared<DeviceMem>(static_cast<size_t>(g.page_elems() * num_pages) * sizeof(bf16));
  TANDEM_CUDA_CHECK(cudaMemsetAsync(pool->as<void>(), 0, pool->size(), stream_));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  KvCache::External ext;
  ext.layers.push_back(pool->as<uint8_t>());
  ext.owner = pool;
  ext.stream = stream_;
  return KvCache(g, std::move(ext));
}

// h_t gathered from `src` (device bf16 [src_rows, hidden]): rows[t] for the batch's token t
// (batch order), through the device index buffer idx ([tokens of the pass, padded]) staged in
// idx_host (pinned, as large: a pageable copy would wait for the stream); writes (when set)
// [seqs]: 0 = the sequence writes no KV. Device arrays that replace the metadata computed from
// the batch (when set; the batch's device token order must be its batch order): ids and
// positions [tokens], KV slots [tokens] (int64, -1: none), logits rows [rows] (token indices).
struct Qwen35MoeCuda::MtpDeviceIn {
  const bf16* src = nullptr;
  int64_t src_rows = 0;
  std::span<const int32_t> rows;
  int32_t* idx = nullptr;
  int32_t* idx_host = nullptr;
  const std::vector<uint8_t>* writes = nullptr;
  const int32_t* ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* kv_slots = nullptr;
  const int32_t* logit_rows = nullptr;
  bool replaces_meta() const { return ids || positions || kv_slots || logit_rows; }
};

int64_t Qwen35MoeCuda::mtp_launch(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                                  const MtpDeviceIn* dev) {
  Impl& im = *impl_;
  TANDEM_CHECK(has_mtp(), "mtp_forward: no MTP layer loaded");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const auto& g = mtp_kv.geometry();
  TANDEM_CHECK(!mtp_kv.is_host() && g.num_layers == 1 && g.dtype == DType::kBF16 &&
                   g.num_kv_heads == im.kvh && g.head_dim == config_.head_dim,
               "the MTP KV cache was not made by this CUDA model");
  const int64_t n = batch.num_tokens(), h = config_.hidden_size, page_size = g.page_size;
  const int64_t rows = batch.num_logit_rows();
  if (n == 0) {
    if (mtp_collective()) mtp_empty_pass();  // a decode EP rank's: its experts serve the others
    return 0;
  }
  CudaRunner& run = *runner_;
  const cuda_model::Workspace& ws = run.ws();
  const std::vector<int64_t>& buckets = run.buckets();
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      n <= ws.t_cap && rows <= ws.rows_cap && static_cast<int64_t>(batch.seqs.size()) <= ws.s_cap,
      "an MTP pass of ", n, " tokens (", rows, " logits rows, ", batch.seqs.size(),
      " sequences) exceeds the CUDA model's max_tokens ", ws.t_cap);
  TANDEM_CHECK(hidden != nullptr || dev != nullptr, "mtp_forward: no hidden states");
  // A chained draft pass (one token per sequence, its logits) that fits a bucket and the graph
  // width replays the bucket's graph (captured on first use), padded with sequences that write
  // no KV; anything else runs eagerly.
  const auto nseq = static_cast<int64_t>(batch.seqs.size());
  int64_t width = 1;
  bool graph = im.mtp_graphs_on && !buckets.empty() && nseq <= buckets.back() &&
               page_size == opts_.page_size;
  for (const auto& s : batch.seqs) {
    width = std::max(width, s.num_pages);
    graph = graph && s.num_tokens == 1 && s.logits == LogitsMode::kLast;
  }
  if (graph) graph = width <= run.graph_width(page_size);
  const int64_t bucket =
      graph ? *std::lower_bound(buckets.begin(), buckets.end(), nseq) : int64_t{0};
  const int64_t n_run = graph ? bucket : n;  // tokens the kernels see (padded)
  cuda_model::StepLayout l;
  l.page_size = page_size;
  l.num_pages = g.num_pages;
  l.vocab = config_.vocab_size;
  l.rows_n = n_run;
  l.width = graph ? run.graph_width(page_size) : width;
  l.num_seqs = graph ? bucket : nseq;
  l.pad_rows = graph;
  int64_t num_prefill = 0;
  std::vector<int64_t>& first_token = run.first_token();
  HostStepMeta hm = cuda_model::build_step_meta(batch, l, first_token, num_prefill);
  Impl::MtpW& t = im.mtp_w;
  if (dev != nullptr) {
    TANDEM_CHECK(dev->rows.size() == static_cast<size_t>(n) &&
                     (dev->writes == nullptr || dev->writes->size() == batch.seqs.size()),
                 "mtp_draft_chain: ", dev->rows.size(), " hidden rows for ", n, " tokens");
    int32_t* idx = dev->idx_host;  // device token order
    std::fill(idx, idx + n_run, 0);
    int64_t bt = 0;
    for (size_t si = 0; si < batch.seqs.size(); ++si) {
      const ForwardSeq& s = batch.seqs[si];
      TANDEM_CHECK(!dev->replaces_meta() || first_token[si] == bt,
                   "mtp_launch: device metadata for a batch whose device order is not its own");
      if (dev->writes != nullptr && (*dev->writes)[si] == 0) {
        for (int64_t i = 0; i < s.num_tokens; ++i) {
          hm.slots[static_cast<size_t>(first_token[si] + i)] = -1;
        }
      }
      for (int64_t i = 0; i < s.num_tokens; ++i, ++bt) {
        const int32_t r = dev->rows[static_cast<size_t>(bt)];
        TANDEM_CHECK(r >= 0 && r < dev->src_rows, "mtp_draft_chain: hidden row ", r,
                     " outside the ", dev->src_rows, " rows of its source");
        idx[first_token[si] + i] = r;
      }
    }
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dev->idx, idx, static_cast<size_t>(n_run) * sizeof(int32_t),
                                      cudaMemcpyHostToDevice, stream_));
    cuda::embedding_launch({dev->idx, dev->src, t.hidden_in.as<bf16>(), n_run, h, dev->src_rows},
                           stream_);
  } else {
    stage_mtp_hidden(batch, hidden, n_run);
  }
  // dev's device metadata over the uploaded one (device order is batch order).
  auto device_meta = [&](const StepMeta& m) {
    if (dev == nullptr) return;
    auto put = [&](void* dst, const void* src, int64_t count, size_t elem) {
      if (src == nullptr) return;
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(count) * elem,
                                        cudaMemcpyDeviceToDevice, stream_));
    };
    put(m.ids, dev->ids, n, sizeof(int32_t));
    put(m.positions, dev->positions, n, sizeof(int32_t));
    put(m.slots, dev->kv_slots, n, sizeof(int64_t));
    put(m.rows, dev->logit_rows, rows, sizeof(int32_t));
  };
  if (!graph) {
    StepMeta m = run.eager_meta(hm.tables.size());
    m.n = n;
    m.width = width;
    m.num_rows = rows;
    m.num_seqs = nseq;
    m.num_prefill = num_prefill;
    run.upload(hm, m);
    device_meta(m);
    run.plan_prefill(hm, m, page_size);
    im.mtp_body(m, mtp_kv);
    if (rows > 0) im.head(0, rows);
    return rows;
  }

  // Graph replay (captured on first use of the bucket).
  StepMeta m = run.graph_meta(im.mtp_graphs);
  m.n = bucket;
  m.width = l.width;
  m.num_rows = bucket;
  m.num_seqs = bucket;
  m.num_prefill = 0;
  im.mtp_graphs.bind(
      {mtp_kv.layer_data(0), reinterpret_cast<const void*>(static_cast<intptr_t>(page_size))});
  run.replay(
      im.mtp_graphs, bucket, hm, m,
      [&](bool) {
        im.mtp_body(m, mtp_kv);
        im.head(0, bucket);
      },
      [&] { device_meta(m); });
  return rows;
}

void Qwen35MoeCuda::stage_mtp_hidden(const ForwardBatch& batch, const float* hidden,
                                     int64_t n_run) {
  // h_t as bf16 in device token order (the order build_meta gave the tokens), padding zero.
  Impl& im = *impl_;
  Impl::MtpW& t = im.mtp_w;
  const int64_t n = batch.num_tokens(), h = config_.hidden_size;
  TANDEM_CUDA_CHECK(cudaEventSynchronize(t.staged));
  auto* hh = t.h_hidden.as<uint16_t>();
  int64_t bt = 0;  // batch order
  for (size_t si = 0; si < batch.seqs.size(); ++si) {
    for (int64_t i = 0; i < batch.seqs[si].num_tokens; ++i, ++bt) {
      const float* src = hidden + bt * h;
      uint16_t* dst = hh + (runner_->first_token()[si] + i) * h;
      for (int64_t j = 0; j < h; ++j) dst[j] = f32_to_bf16(src[j]);
    }
  }
  std::memset(hh + n * h, 0, static_cast<size_t>((n_run - n) * h) * sizeof(uint16_t));
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(t.hidden_in.as<void>(), hh,
                                    static_cast<size_t>(n_run * h) * sizeof(bf16),
                                    cudaMemcpyHostToDevice, stream_));
  TANDEM_CUDA_CHECK(cudaEventRecord(t.staged, stream_));
}

bool Qwen35MoeCuda::mtp_drafts_on_device() const { return has_mtp() && impl_->device_chain; }

void Qwen35MoeCuda::set_device_chain(bool on) { impl_->device_chain = on; }

bool Qwen35MoeCuda::device_chain() const { return impl_->device_chain; }

void Qwen35MoeCuda::mtp_draft_chain(const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                                    const std::vector<MtpChainPass>& chain, KvCache& mtp_kv,
                                    std::vector<std::vector<int32_t>>& drafts) {
  Impl& im = *impl_;
  TANDEM_CHECK(has_mtp(), "mtp_draft_chain: no MTP layer loaded");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int64_t rows = first.num_logit_rows();
  const auto passes = static_cast<int64_t>(chain.size()) + 1;
  drafts.assign(static_cast<size_t>(passes), {});
  if (first.num_tokens() == 0) {
    if (mtp_collective()) {  // every pass's exchange still runs (decode EP)
      for (int64_t p = 0; p < passes; ++p) mtp_empty_pass();
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    return;
  }
  const Impl::ChainBuffers cb = im.chain_buffers(passes);
  int32_t *idx = cb.idx, *tokens = cb.tokens, *idx_host = cb.idx_host;
  // Pass 0: h_t from the last forward's final hidden states (xn, device token order).
  std::vector<int32_t> src(hidden_rows.size());
  for (size_t t = 0; t < src.size(); ++t) {
    const int64_t r = hidden_rows[t];
    TANDEM_CHECK(r >= 0 && r < static_cast<int64_t>(runner_->hidden_rows().size()),
                 "mtp_draft_chain: hidden row ", r, " is not a token of the last forward (",
                 runner_->hidden_rows().size(), " tokens)");
    src[t] = runner_->hidden_rows()[static_cast<size_t>(r)];
  }
  MtpDeviceIn in;
  in.src = runner_->ws().xn.as<bf16>();
  in.src_rows = static_cast<int64_t>(runner_->hidden_rows().size());
  in.rows = src;
  in.idx = idx;
  in.idx_host = idx_host;
  TANDEM_CHECK(mtp_launch(first, nullptr, mtp_kv, &in) == rows, "mtp_draft_chain: ", rows,
               " logits rows expected");
  runner_->ws().sampler->argmax(runner_->ws().logits.as<float>(), rows, tokens, stream_);
  // Chained passes: row i continues row i of the pass before (its argmax, its mtp.norm row).
  std::vector<int32_t> same(static_cast<size_t>(rows));
  std::iota(same.begin(), same.end(), 0);
  for (int64_t p = 1; p < passes; ++p) {
    const MtpChainPass& c = chain[static_cast<size_t>(p - 1)];
    TANDEM_CHECK(c.batch.num_logit_rows() == rows && c.batch.num_tokens() == rows,
                 "mtp_draft_chain: chained pass ", p, " has ", c.batch.num_tokens(),
                 " tokens, not one per row of pass 0 (", rows, ")");
    MtpDeviceIn ci;
    ci.src = runner_->ws().last.as<bf16>();
    ci.src_rows = rows;
    ci.rows = same;
    ci.idx = idx + p * runner_->ws().t_cap;
    ci.idx_host = idx_host + p * runner_->ws().t_cap;
    ci.ids = tokens + (p - 1) * runner_->ws().rows_cap;
    ci.writes = &c.writes;
    mtp_launch(c.batch, nullptr, mtp_kv, &ci);
    runner_->ws().sampler->argmax(runner_->ws().logits.as<float>(), rows,
                                  tokens + p * runner_->ws().rows_cap, stream_);
  }
  im.tokens_to_host(cb, passes);
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (int64_t p = 0; p < passes; ++p) {
    const int32_t* row = cb.tokens_host + p * runner_->ws().rows_cap;
    drafts[static_cast<size_t>(p)].assign(row, row + rows);
  }
}

bool Qwen35MoeCuda::fuses_verify_and_draft() const {
  return mtp_drafts_on_device() && impl_->fused_step;
}

void Qwen35MoeCuda::set_fused_step(bool on) { impl_->fused_step = on; }

int64_t Qwen35MoeCuda::fused_steps() const { return impl_->fused_steps; }

void Qwen35MoeCuda::profile_fused_stages(bool on) { impl_->fused_clock.enable(on); }

std::vector<cuda_model::StageTimes> Qwen35MoeCuda::take_fused_stage_times() {
  return impl_->fused_clock.take();
}

void Qwen35MoeCuda::forward_verify_draft(const ForwardBatch& batch, KvCache& kv,
                                         const std::vector<DeviceSampling>& rows, KvCache& mtp_kv,
                                         VerifyDraftStep& step, std::vector<SampledToken>& out) {
  Impl& im = *impl_;
  TANDEM_CHECK(has_mtp(), "forward_verify_draft: no MTP layer loaded");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const auto n = static_cast<int64_t>(batch.seqs.size());
  const int64_t T = batch.num_tokens(), K = step.num_drafts;
  TANDEM_CHECK(static_cast<int64_t>(rows.size()) == T && batch.num_logit_rows() == T && n > 0 &&
                   K >= 1 && static_cast<int64_t>(step.forced.size()) == n &&
                   (im.num_linear == 0 || static_cast<int64_t>(step.spare_slots.size()) == n),
               "forward_verify_draft: ", rows.size(), " sampling rows, ", step.forced.size(),
               " forced counts and ", step.spare_slots.size(), " snapshot slots for ", n,
               " sequences of ", T, " tokens (one row each), K ", K);
  TANDEM_CHECK_KIND(kInvalidArgument, T <= runner_->ws().rows_cap, T,
                    " sampling rows exceed the CUDA model's ", runner_->ws().rows_cap);
  // The step runs the sequences in device order (build_meta's: the verify chunks, then the
  // one-token decodes), so that every device array below is in batch order too; the results go
  // back to the caller's order at the end. order[j]: the caller's sequence at position j.
  std::vector<size_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_partition(order.begin(), order.end(),
                        [&](size_t i) { return batch.seqs[i].num_tokens > 1; });
  std::vector<int64_t> row_begin(static_cast<size_t>(n) + 1, 0);  // the caller's rows
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    row_begin[i + 1] = row_begin[i] + batch.seqs[i].num_tokens;
  }
  ForwardBatch vb = batch;
  vb.keep_recurrent_inputs = true;
  vb.hidden_out = nullptr;
  std::vector<DeviceSampling> vrows;
  std::vector<int32_t> forced, slots, spares;
  vrows.reserve(rows.size());
  for (size_t j = 0; j < order.size(); ++j) {
    const size_t i = order[j];
    vb.seqs[j] = batch.seqs[i];
    for (int64_t r = row_begin[i]; r < row_begin[i + 1]; ++r) {
      vrows.push_back(rows[static_cast<size_t>(r)]);
    }
    forced.push_back(step.forced[i]);
    slots.push_back(batch.seqs[i].state_slot);
    spares.push_back(im.num_linear > 0 ? step.spare_slots[i] : -1);
  }

  // 1. The verify forward (kept recurrence inputs; each verify sequence's state after all its
  // tokens into its spare slot, its own slot keeping the state before), its rows sampled on the
  // device.
  ++im.fused_steps;
  StageClock& clock = im.fused_clock;
  clock.mark("start", stream_);
  if (!runner_->launch(vb, kv, im.num_linear > 0 ? &spares : nullptr)) im.head(0, T);
  clock.mark("verify", stream_);
  runner_->ws().sampler->enqueue(runner_->ws().logits.as<float>(), vrows, {}, stream_);
  // 2. The accepted drafts (spec_advance), and the metadata of the MTP passes.
  const int64_t ps = mtp_kv.geometry().page_size;
  cuda::SpecAdvanceParams ap = im.spec.stage(vb, forced, K - 1, ps, {slots, spares}, stream_);
  ap.sampled = runner_->ws().sampler->device_tokens();
  cuda::spec_advance_launch(ap, stream_);
  clock.mark("sample + accept", stream_);
  // 3. The DeltaNet states: a sequence that accepted every draft takes its spare slot's; one
  // that rejected a draft replays its kept rows on its own slot (the state before the step).
  if (im.num_linear > 0 && T > n) {
    TANDEM_CHECK(im.kept_tokens == T, "forward_verify_draft: the verify kept no recurrence inputs");
    im.settle_states(ap, T, im.spec.extra(0), im.spec.extra(1), kv, !runner_->buckets().empty());
    clock.mark("settle: replay", stream_);
  }
  // 4. MTP pass 0 over every verify position (the token at t + 1: an accepted draft, else the
  // target's; its logits row at the last accepted position), then K - 1 chained passes at the
  // positions after it, as mtp_draft_chain chains them.
  const Impl::ChainBuffers cb = im.chain_buffers(K);
  ForwardBatch first = vb;
  for (ForwardSeq& f : first.seqs) f.logits = LogitsMode::kLast;
  MtpDeviceIn in;
  in.src = runner_->ws().xn.as<bf16>();
  in.src_rows = static_cast<int64_t>(runner_->hidden_rows().size());
  in.rows = runner_->hidden_rows();
  in.idx = cb.idx;
  in.idx_host = cb.idx_host;
  in.ids = ap.mtp_ids;
  in.logit_rows = ap.mtp_rows;
  mtp_launch(first, nullptr, mtp_kv, &in);
  runner_->ws().sampler->argmax(runner_->ws().logits.as<float>(), n, cb.tokens, stream_);
  clock.mark("mtp pass 0", stream_);
  ForwardBatch one;
  for (const ForwardSeq& f : vb.seqs) {  // positions and KV slots: the kernel's
    one.seqs.push_back({f.tokens, 1, f.start_pos + f.num_tokens - 1, f.block_table, f.num_pages,
                        LogitsMode::kLast, -1});
  }
  std::vector<int32_t> same(static_cast<size_t>(n));
  std::iota(same.begin(), same.end(), 0);
  for (int64_t p = 1; p < K; ++p) {
    MtpDeviceIn ci;
    ci.src = runner_->ws().last.as<bf16>();
    ci.src_rows = n;
    ci.rows = same;
    ci.idx = cb.idx + p * runner_->ws().t_cap;
    ci.idx_host = cb.idx_host + p * runner_->ws().t_cap;
    ci.ids = cb.tokens + (p - 1) * runner_->ws().rows_cap;
    ci.positions = ap.chain_pos + (p - 1) * n;
    ci.kv_slots = ap.chain_slots + (p - 1) * n;
    mtp_launch(one, nullptr, mtp_kv, &ci);
    runner_->ws().sampler->argmax(runner_->ws().logits.as<float>(), n,
                                  cb.tokens + p * runner_->ws().rows_cap, stream_);
  }
  clock.mark("mtp chained passes", stream_);
  im.tokens_to_host(cb, K);
  im.spec.accepted_to_host(stream_);
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the step's one synchronisation
  clock.collect("copies + host wait");
  std::vector<SampledToken> vout;
  runner_->ws().sampler->collect(vout, stream_);

  // Back to the caller's order.
  out.assign(static_cast<size_t>(T), {});
  step.accepted.assign(static_cast<size_t>(n), 0);
  step.drafts.assign(static_cast<size_t>(n), std::vector<int32_t>(static_cast<size_t>(K)));
  int64_t vr = 0;
  for (size_t j = 0; j < order.size(); ++j) {
    const size_t i = order[j];
    for (int64_t r = row_begin[i]; r < row_begin[i + 1]; ++r) {
      out[static_cast<size_t>(r)] = std::move(vout[static_cast<size_t>(vr++)]);
    }
    step.accepted[i] = im.spec.host_accepted()[j];
    for (int64_t p = 0; p < K; ++p) {
      step.drafts[i][static_cast<size_t>(p)] = cb.tokens_host[p * runner_->ws().rows_cap + j];
    }
  }
}

void Qwen35MoeCuda::warm_up(KvCache& kv, int64_t max_batch) {
  // (a sharded model's ranks capture together on first use)
  if (opts_.shard.size <= 1) runner_->capture_buckets(kv, max_batch, 1);
}

void Qwen35MoeCuda::warm_up_speculative(KvCache& kv, KvCache& mtp_kv, int64_t max_batch,
                                        int64_t k) {
  Impl& im = *impl_;
  const int64_t q = k + 1;  // tokens per verify sequence
  // The verify steps' recurrence inputs (replay_states), before serving.
  if (has_mtp() && im.num_linear > 0 && k >= 1) {
    im.ensure_kept(std::min(runner_->ws().t_cap, std::max<int64_t>(1, max_batch) * q));
  }
  if (opts_.shard.size > 1) return;  // (a sharded model's ranks capture together on first use)
  if (has_mtp() && im.verify_graphs && k >= 1 && q <= Impl::kMaxVerifyTokens) {
    runner_->capture_buckets(kv, max_batch, q);  // the verify graphs
  }
  if (!has_mtp() || !im.mtp_graphs_on || runner_->buckets().empty() || k < 2) return;  // no chain
  const int32_t token = 0, page = 0;
  const std::vector<float> hidden(
      static_cast<size_t>(runner_->buckets().back() * config_.hidden_size), 0.0f);
  for (const int64_t bucket : runner_->buckets()) {
    if (bucket > std::max<int64_t>(1, max_batch)) break;
    ForwardBatch chain;  // bucket one-token MTP passes at position 0 of page 0
    for (int64_t i = 0; i < bucket; ++i) {
      chain.seqs.push_back({&token, 1, 0, &page, 1, LogitsMode::kLast, -1});
    }
    mtp_launch(chain, hidden.data(), mtp_kv);  // captures the bucket's graph, replays it once
  }
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<int64_t> Qwen35MoeCuda::captured_mtp_buckets() const {
  return impl_->mtp_graphs.keys();
}

void Qwen35MoeCuda::mtp_hidden(int64_t rows, std::vector<float>& out) {
  const int64_t h = config_.hidden_size;
  out.resize(static_cast<size_t>(rows * h));
  if (rows == 0) {
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  std::vector<uint16_t> b(out.size());
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(b.data(), runner_->ws().last.as<void>(),
                                    b.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream_));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (size_t i = 0; i < b.size(); ++i) out[i] = bf16_to_f32(b[i]);
}

void Qwen35MoeCuda::mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                                std::vector<float>& logits, std::vector<float>& hidden_out) {
  const int64_t rows = mtp_launch(batch, hidden, mtp_kv), v = config_.vocab_size;
  logits.resize(static_cast<size_t>(rows * v));
  if (rows > 0) {
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(logits.data(), runner_->ws().logits.as<float>(),
                                      logits.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                      stream_));
  }
  mtp_hidden(rows, hidden_out);  // synchronises
}

void Qwen35MoeCuda::mtp_forward_sample(const ForwardBatch& batch, const float* hidden,
                                       KvCache& mtp_kv, const std::vector<DeviceSampling>& rows,
                                       std::vector<SampledToken>& out,
                                       std::vector<float>& hidden_out) {
  TANDEM_CHECK(static_cast<int64_t>(rows.size()) == batch.num_logit_rows(),
               "mtp_forward_sample: ", rows.size(), " sampling rows for ", batch.num_logit_rows(),
               " logits rows");
  const int64_t r = mtp_launch(batch, hidden, mtp_kv);
  out.clear();
  mtp_hidden(r, hidden_out);  // before the sampler may touch the logits (synchronises)
  if (r > 0)
    runner_->ws().sampler->sample(runner_->ws().logits.as<float>(), rows, {}, out, stream_);
}

}  // namespace tandem
