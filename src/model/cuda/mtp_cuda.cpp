// The MTP layer on the GPU. See mtp_cuda.h.
#include "model/cuda/mtp_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_gemm.h"
#include "backend/cuda/moe_layer.h"
#include "backend/cuda/norm.h"
#include "backend/cuda/spec_advance.h"
#include "comm/cuda/cuda_moe.h"
#include "core/dtype.h"
#include "core/error.h"
#include "model/cuda/cuda_mem.h"
#include "model/cuda/device_sampler.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/cuda/random_fill.h"
#include "model/cuda/runner.h"
#include "model/cuda/shard_comms.h"
#include "model/cuda/spec_stage.h"
#include "model/quant.h"
#include "model/safetensors.h"

namespace tandem {

using cuda::bf16;
using cuda_model::DeviceMem;
using cuda_model::host_bf16;
using cuda_model::PinnedMem;
using cuda_model::Uploader;

// One pass as staged (Impl::stage): its real sizes and what the kernels run (a graph bucket's
// padded sizes).
struct MtpLaunch {
  int64_t n = 0, rows = 0;                  // tokens, logits rows
  int64_t n_run = 0, r_run = 0, w_run = 0;  // as the kernels see them (padded)
  int64_t bucket = 0;                       // the graph's (0: eager)
  size_t table_bytes = 0;
  bool graph() const { return bucket > 0; }
};

struct MtpCuda::Impl {
  const ModelConfig c;
  MtpScratch s;
  std::vector<DeviceMem> mem;
  bf16* fc = nullptr;                         // [H, 2H] over [embedding; hidden]
  bf16 *norm_e = nullptr, *norm_h = nullptr;  // [H] pre_fc norms
  bf16* norm = nullptr;                       // [H] mtp.norm
  bf16 *input_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  bf16 *qkv_w = nullptr, *o_w = nullptr;  // [(qh + 2 kvh) d, H], [H, qh d]
  bool moe = false;
  // MoE: experts [expert_begin, expert_begin + local_experts) here (all, or this rank's with
  // s.ep); gate_up [local, 2I, H] packed, down [local, H, I]. Dense: [2I, H], [H, I].
  int64_t expert_begin = 0, local_experts = 0;
  bf16 *router = nullptr, *gate_up = nullptr, *down = nullptr;
  DeviceMem cat;        // [t_cap, 2H]
  DeviceMem hidden_in;  // [t_cap, H]
  DeviceMem gu, act;    // dense MLP only
  std::unique_ptr<cuda::MoeLayer> moe_layer;
  // Metadata: ids | positions | token_seq | rows | hidden source rows (int32, t_cap each) |
  // slots (int64) | the pass's real token count (int32 at region 7: the EP dispatch's).
  DeviceMem d_meta, d_tables;
  // Host staging, one set per pass of a draft chain (the passes are enqueued back to back, so
  // a pass's staging must not be reused before its copies ran); set 0 serves single passes.
  struct Staging {
    PinnedMem meta, tables;
    cudaEvent_t copied = nullptr;  // the set may be reused
  };
  static constexpr size_t kStages = 8;
  std::array<Staging, kStages> stages;
  PinnedMem h_hidden;  // fp32 hidden states as bf16 (single passes, set 0)
  DeviceMem d_drafts;  // int32 [kStages, rows_cap]: a chain's drafts per pass
  PinnedMem h_drafts;
  // Chained draft passes' graphs by bucket of sequences, against one KV pool and page size.
  std::map<int64_t, cudaGraphExec_t> graphs;
  const void* graph_kv = nullptr;
  int64_t graph_page_size = 0;
  void drop_graphs() {
    for (auto& [b, e] : graphs) (void)cudaGraphExecDestroy(e);
    graphs.clear();
    graph_kv = nullptr;
  }
  // Stage timing (MtpCuda::profile_stages): an event before the pass and after each stage.
  bool profile = false;
  std::vector<cudaEvent_t> stage_ev;
  void mark(size_t i) {
    if (!profile) return;
    if (stage_ev.size() <= i) {
      const size_t from = stage_ev.size();
      stage_ev.resize(i + 1, nullptr);
      for (size_t e = from; e <= i; ++e) TANDEM_CUDA_CHECK(cudaEventCreate(&stage_ev[e]));
    }
    TANDEM_CUDA_CHECK(cudaEventRecord(stage_ev[i], s.stream));
  }

  Impl(const ModelConfig& config, const MtpScratch& scratch) : c(config), s(scratch) {}
  ~Impl() {
    for (Staging& st : stages) {
      if (st.copied != nullptr) (void)cudaEventDestroy(st.copied);
    }
    for (cudaEvent_t e : stage_ev) (void)cudaEventDestroy(e);
    drop_graphs();
  }

  // d_meta's regions (int32 units of t_cap): ids, positions, token_seq, rows, hidden source
  // rows, then the int64 slots, then the token count (one int32 used).
  static constexpr size_t kMetaInts = 8;
  static constexpr int64_t kNumRealRegion = 7;
  bool collective() const { return moe && s.ep != nullptr; }
  int64_t qkv_rows() const {
    return (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
  }
  bf16* alloc(int64_t elems) {
    mem.emplace_back(static_cast<size_t>(elems) * sizeof(bf16));
    return mem.back().as<bf16>();
  }

  void allocate(bool with_moe) {
    const int64_t h = c.hidden_size, d = c.head_dim;
    moe = with_moe;
    fc = alloc(2 * h * h);
    norm_e = alloc(h);
    norm_h = alloc(h);
    norm = alloc(h);
    input_norm = alloc(h);
    post_norm = alloc(h);
    q_norm = alloc(d);
    k_norm = alloc(d);
    qkv_w = alloc(qkv_rows() * h);
    o_w = alloc(h * c.num_attention_heads * d);
    const auto T = static_cast<size_t>(s.t_cap);
    if (moe) {
      const int64_t inter = c.moe_intermediate_size;
      expert_begin = s.ep != nullptr ? s.ep_expert_begin : 0;
      local_experts = s.ep != nullptr ? s.ep_local_experts : c.num_experts;
      const int64_t e = local_experts;
      router = alloc(c.num_experts * h);
      gate_up = alloc(e * 2 * inter * h);
      down = alloc(e * h * inter);
      if (s.ep == nullptr) {
        moe_layer = std::make_unique<cuda::MoeLayer>(s.t_cap, h, inter, e, c.num_experts_per_tok, 0,
                                                     e, c.norm_topk_prob);
      }
    } else {
      const int64_t inter = c.intermediate_size;
      gate_up = alloc(2 * inter * h);
      down = alloc(h * inter);
      gu = DeviceMem(T * static_cast<size_t>(2 * inter) * sizeof(bf16));
      act = DeviceMem(T * static_cast<size_t>(inter) * sizeof(bf16));
    }
    cat = DeviceMem(T * static_cast<size_t>(2 * h) * sizeof(bf16));
    hidden_in = DeviceMem(T * static_cast<size_t>(h) * sizeof(bf16));
    d_meta = DeviceMem(T * kMetaInts * sizeof(int32_t));
    for (Staging& st : stages) {
      st.meta = PinnedMem(T * kMetaInts * sizeof(int32_t));
      TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&st.copied, cudaEventDisableTiming));
    }
    h_hidden = PinnedMem(T * static_cast<size_t>(h) * sizeof(bf16));
    const auto R = static_cast<size_t>(s.rows_cap);
    d_drafts = DeviceMem(kStages * R * sizeof(int32_t));
    h_drafts = PinnedMem(kStages * R * sizeof(int32_t));
  }

  void load(const WeightReader& wr) {
    const int64_t h = c.hidden_size, d = c.head_dim, qh = c.num_attention_heads,
                  kvh = c.num_key_value_heads;
    Uploader up(s.stream);
    std::vector<uint16_t> tmp, tmp2;
    auto put = [&](bf16* dst, const std::string& name, const Shape& shape) {
      const uint16_t* src = host_bf16(wr, name, shape, tmp);
      up.put(dst, src, static_cast<size_t>(shape.numel()) * sizeof(bf16));
    };
    put(fc, "mtp.fc.weight", {h, 2 * h});
    put(norm_e, "mtp.pre_fc_norm_embedding.weight", {h});
    put(norm_h, "mtp.pre_fc_norm_hidden.weight", {h});
    put(norm, "mtp.norm.weight", {h});
    const std::string p = "mtp.layers.0.";
    put(input_norm, p + "input_layernorm.weight", {h});
    put(post_norm, p + "post_attention_layernorm.weight", {h});
    put(q_norm, p + "self_attn.q_norm.weight", {d});
    put(k_norm, p + "self_attn.k_norm.weight", {d});
    put(qkv_w, p + "self_attn.q_proj.weight", {qh * d, h});
    put(qkv_w + qh * d * h, p + "self_attn.k_proj.weight", {kvh * d, h});
    put(qkv_w + (qh + kvh) * d * h, p + "self_attn.v_proj.weight", {kvh * d, h});
    put(o_w, p + "self_attn.o_proj.weight", {h, qh * d});
    if (moe) {
      const int64_t inter = c.moe_intermediate_size;
      put(router, p + "mlp.gate.weight", {c.num_experts, h});
      std::vector<uint16_t> packed(static_cast<size_t>(2 * inter * h)), gate_copy;
      for (int64_t e = 0; e < local_experts; ++e) {  // this rank's (all without s.ep)
        const std::string ep = p + "mlp.experts." + std::to_string(expert_begin + e) + ".";
        const uint16_t* gate = host_bf16(wr, ep + "gate_proj.weight", {inter, h}, tmp);
        if (gate == tmp.data()) {  // converted: keep it while `up` converts into tmp2
          gate_copy = tmp;
          gate = gate_copy.data();
        }
        const uint16_t* upw = host_bf16(wr, ep + "up_proj.weight", {inter, h}, tmp2);
        cuda::moe_pack_gate_up(reinterpret_cast<const bf16*>(gate),
                               reinterpret_cast<const bf16*>(upw), inter, h,
                               reinterpret_cast<bf16*>(packed.data()));
        up.put(gate_up + e * 2 * inter * h, packed.data(), packed.size() * sizeof(uint16_t));
        put(down + e * h * inter, ep + "down_proj.weight", {h, inter});
      }
    } else {
      const int64_t inter = c.intermediate_size;
      put(gate_up, p + "mlp.gate_proj.weight", {inter, h});
      put(gate_up + inter * h, p + "mlp.up_proj.weight", {inter, h});
      put(down, p + "mlp.down_proj.weight", {h, inter});
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  }

  // Qwen3MoeCuda::random's distribution: matrices U(-a, a), output projections 1000x smaller,
  // norms 1 + U(-0.05, 0.05).
  void random(uint64_t seed) {
    const float a = 0.02f * std::sqrt(3.0f);
    uint64_t k = seed * 0x9e3779b97f4a7c15ull + 17;
    for (auto& m : mem) {
      const int64_t n = static_cast<int64_t>(m.size() / sizeof(bf16));
      const bool is_norm = n == c.hidden_size || n == c.head_dim;
      const bool out = m.as<void>() == o_w || m.as<void>() == down;
      cuda::random_fill_bf16(m.as<void>(), n, ++k, is_norm ? 1.0f : 0.0f,
                             is_norm ? 0.05f : (out ? 1e-3f * a : a), s.stream);
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  }

  // Steps 2-4 of a pass over n tokens (r logits rows, block tables `width` wide) from the
  // staged metadata in d_meta / d_tables / hidden_in: graph-capturable (no host work).
  void body(KvCache& kv, int64_t n, int64_t r, int64_t width) {
    const int64_t h = c.hidden_size, d = c.head_dim, qh = c.num_attention_heads,
                  kvh = c.num_key_value_heads, ps = kv.geometry().page_size;
    const int64_t T = s.t_cap;
    cudaStream_t st = s.stream;
    auto& im = *this;
    auto* dm = d_meta.as<int32_t>();
    const int32_t *d_ids = dm, *d_pos = dm + T, *d_seq = dm + 2 * T, *d_rows = dm + 3 * T;
    const auto* d_slots = reinterpret_cast<const int64_t*>(dm + 5 * T);

    // 2. x = fc([norm_e(embed(t + 1)); norm_h(h_t)]).
    const float eps = static_cast<float>(c.rms_norm_eps);
    auto* X = static_cast<bf16*>(s.x);
    auto* XN = static_cast<bf16*>(s.xn);
    auto* Y = static_cast<bf16*>(s.y);
    bf16* CAT = im.cat.as<bf16>();
    const size_t row = static_cast<size_t>(h) * sizeof(bf16);
    cuda::embedding_launch({d_ids, static_cast<const bf16*>(s.embed), Y, n, h, c.vocab_size}, st);
    cuda::rms_norm_launch({Y, im.norm_e, Y, n, h, eps}, st);
    cuda::rms_norm_launch({im.hidden_in.as<bf16>(), im.norm_h, XN, n, h, eps}, st);
    TANDEM_CUDA_CHECK(cudaMemcpy2DAsync(CAT, 2 * row, Y, row, row, static_cast<size_t>(n),
                                        cudaMemcpyDeviceToDevice, st));
    TANDEM_CUDA_CHECK(cudaMemcpy2DAsync(CAT + h, 2 * row, XN, row, row, static_cast<size_t>(n),
                                        cudaMemcpyDeviceToDevice, st));
    im.linear(CAT, im.fc, X, n, h, 2 * h);
    im.mark(2);

    // 3. The decoder layer over the MTP KV.
    auto* QKV = static_cast<bf16*>(s.qkv);
    auto* Q = static_cast<bf16*>(s.q);
    auto* ATT = static_cast<bf16*>(s.attn);
    auto* pool = static_cast<bf16*>(kv.layer_data(0));
    cuda::rms_norm_launch({X, im.input_norm, XN, n, h, eps}, st);
    im.linear(XN, im.qkv_w, QKV, n, im.qkv_rows(), h);
    cuda::qkv_prep_launch(
        {QKV, Q, pool, d_slots, im.q_norm, im.k_norm, d_pos, n, qh, kvh, d, ps, eps, c.rope_theta},
        st);
    im.mark(3);
    cuda::PagedAttentionParams ap{};
    ap.q = Q;
    ap.pool = pool;
    ap.block_table = im.d_tables.as<int32_t>();
    ap.token_seq = d_seq;
    ap.positions = d_pos;
    ap.out = ATT;
    ap.num_tokens = n;
    ap.num_q_heads = qh;
    ap.num_kv_heads = kvh;
    ap.head_dim = d;
    ap.page_size = ps;
    ap.max_pages_per_seq = width;
    ap.scale = 1.0f / std::sqrt(static_cast<float>(d));
    int64_t split = cuda::paged_attention_decode_split(n, kvh, width, ps, s.num_sms);
    if (split > 0 &&
        cuda::paged_attention_workspace_floats(n, qh, d, width, ps, split) > s.attn_ws_floats) {
      split = 0;
    }
    ap.kv_split = split;
    ap.workspace = split > 0 ? s.attn_ws : nullptr;
    ap.num_prefill_tokens = -1;  // the kernels pick: every token is correct either way
    cuda::paged_attention_launch(ap, st);
    im.mark(4);
    im.linear(ATT, im.o_w, Y, n, h, qh * d);
    cuda::add_rms_norm_launch({X, Y, im.post_norm, XN, n, h, eps}, st);
    im.mark(5);
    if (im.moe && s.ep != nullptr) {
      im.moe_ep(XN, Y, n);
    } else if (im.moe) {
      im.moe_layer->run({im.router, im.gate_up, im.down}, XN, Y, n, *s.gemm, st);
    } else {
      const int64_t inter = c.intermediate_size;
      im.linear(XN, im.gate_up, im.gu.as<bf16>(), n, 2 * inter, h);
      cuda::silu_mul_launch({im.gu.as<bf16>(), im.act.as<bf16>(), n, inter}, st);
      im.linear(im.act.as<bf16>(), im.down, Y, n, h, inter);
    }

    im.mark(6);
    // 4. mtp.norm, the logits rows gathered, the shared lm_head.
    cuda::add_rms_norm_launch({X, Y, im.norm, XN, n, h, eps}, st);
    auto* LAST = static_cast<bf16*>(s.last);
    cuda::embedding_launch({d_rows, XN, LAST, r, h, n}, st);
    if (r > 0) {
      cuda::GemmParams gp{};
      gp.x = LAST;
      gp.w = static_cast<const bf16*>(s.lm_head);
      gp.m = r;
      gp.n = c.vocab_size;
      gp.k = h;
      gp.y_f32 = s.logits;
      s.gemm->run(gp, st);
    }
  }

  // Decode EP MoE block over n tokens (0: an empty pass) through the target's exchange
  // (ShardComms::moe_ep; the token count from d_meta's region 7, uploaded with the pass).
  // Collective: every rank runs it once per pass.
  void moe_ep(const bf16* XN, bf16* Y, int64_t n) {
    cuda_model::EpExperts e;
    e.router = router;
    e.gate_up = gate_up;
    e.down = down;
    const int32_t* num_real = d_meta.as<int32_t>() + kNumRealRegion * s.t_cap;
    s.comms->moe_ep(e, XN, Y, n, num_real, /*warmup=*/false, c.norm_topk_prob,
                    /*fp8_activations=*/false, *s.gemm, s.stream);
  }
  // A pass with no tokens of this rank (collective()): only the exchange, serving the others.
  void empty_pass() {
    TANDEM_CUDA_CHECK(cudaMemsetAsync(d_meta.as<int32_t>() + kNumRealRegion * s.t_cap, 0,
                                      sizeof(int32_t), s.stream));
    moe_ep(static_cast<const bf16*>(s.xn), static_cast<bf16*>(s.y), 0);
  }

  // A pass in four parts (a draft chain stages all its passes first): its metadata into a
  // staging set, that set to the device, a bucket's graph on first use, the kernels.
  MtpLaunch stage(const ForwardBatch& batch, const KvCache& kv, size_t si, const uint8_t* writes,
                  bool ids_on_device, const int32_t* src_rows);
  void upload(const MtpLaunch& l, size_t si);
  void capture(const MtpLaunch& l, KvCache& kv, size_t si);
  void run(const MtpLaunch& l, KvCache& kv);

  // A draft chain's checks: at most kStages passes, one hidden row per token of `first`, each
  // a row of the target's last forward.
  void check_chain(const ForwardBatch& first, int64_t target_rows,
                   std::span<const int32_t> hidden_rows, size_t chained) const {
    TANDEM_CHECK(s.sampler != nullptr, "MTP draft chain: no device sampler");
    TANDEM_CHECK(chained + 1 <= kStages, "MTP draft chain: ", chained + 1, " passes (at most ",
                 kStages, ")");
    TANDEM_CHECK(static_cast<int64_t>(hidden_rows.size()) == first.num_tokens(),
                 "MTP draft chain: ", hidden_rows.size(), " hidden rows for ", first.num_tokens(),
                 " tokens");
    for (const int32_t r : hidden_rows) {
      TANDEM_CHECK(r >= 0 && r < target_rows, "MTP draft chain: hidden row ", r,
                   " outside the target's last forward (", target_rows, " tokens)");
    }
  }
  std::vector<int64_t> run_chain(const std::vector<MtpLaunch>& launches, KvCache& kv,
                                 const void* target_hidden, int64_t target_rows,
                                 const std::function<void(size_t)>& fix);
  // The drafts of each pass (rows[p] of them) to h_drafts; then, after a sync, unpacked.
  void drafts_to_host(const std::vector<int64_t>& rows) {
    const int64_t R = s.rows_cap;
    auto* hd = h_drafts.as<int32_t>();
    const auto* dd = d_drafts.as<int32_t>();
    for (size_t p = 0; p < rows.size(); ++p) {
      if (rows[p] == 0) continue;
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(hd + p * R, dd + p * R,
                                        static_cast<size_t>(rows[p]) * sizeof(int32_t),
                                        cudaMemcpyDeviceToHost, s.stream));
    }
  }
  void unpack_drafts(const std::vector<int64_t>& rows,
                     std::vector<std::vector<int32_t>>& drafts) const {
    const int64_t R = s.rows_cap;
    const auto* hd = h_drafts.as<int32_t>();
    drafts.resize(std::max(drafts.size(), rows.size()));
    for (size_t p = 0; p < rows.size(); ++p) {
      drafts[p].assign(hd + p * R, hd + p * R + rows[p]);
    }
  }
  // draft_after_verify's spec_advance staging (model/cuda/spec_stage.h).
  cuda_model::SpecAdvanceStage spec;

  // y[m, n] = x[m, k] W^T.
  void linear(const bf16* x, const bf16* w, bf16* y, int64_t m, int64_t n, int64_t k) {
    s.gemm->run({x, w, y, m, n, k}, s.stream);
  }
};

MtpCuda::MtpCuda(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  for (const auto& m : impl_->mem) weight_bytes_ += static_cast<int64_t>(m.size());
}

MtpCuda::~MtpCuda() = default;

std::unique_ptr<MtpCuda> MtpCuda::load(const ModelConfig& config, const std::string& dir,
                                       const MtpScratch& scratch) {
  Checkpoint ckpt(dir);
  TANDEM_CHECK_KIND(kNotFound, ckpt.has("mtp.fc.weight"), dir,
                    ": no MTP weights (tensor 'mtp.fc.weight' not found); the checkpoint needs "
                    "mtp.* tensors, or give the MTP layer's directory as \"model\" in "
                    "--speculative-config (tools/train_mtp.py writes one)");
  const WeightReader wr(ckpt, config.quant, (std::filesystem::path(dir) / "config.json").string());
  auto impl = std::make_unique<Impl>(config, scratch);
  const bool moe = ckpt.has("mtp.layers.0.mlp.gate.weight");
  TANDEM_CHECK_KIND(kUnsupported, !moe || config.num_experts > 0, dir,
                    ": the MTP layer has experts but config.json has num_experts 0");
  impl->allocate(moe);
  impl->load(wr);
  return std::unique_ptr<MtpCuda>(new MtpCuda(std::move(impl)));
}

std::unique_ptr<MtpCuda> MtpCuda::random(const ModelConfig& config, uint64_t seed,
                                         const MtpScratch& scratch) {
  auto impl = std::make_unique<Impl>(config, scratch);
  impl->allocate(config.num_experts > 0);
  impl->random(seed);
  return std::unique_ptr<MtpCuda>(new MtpCuda(std::move(impl)));
}

KvGeometry MtpCuda::kv_geometry(int64_t num_pages, int64_t page_size) const {
  KvGeometry g{1, num_pages, impl_->c.num_key_value_heads, page_size, impl_->c.head_dim};
  g.dtype = DType::kBF16;
  return g;
}

KvCache MtpCuda::make_kv_cache(int64_t num_pages, int64_t page_size) {
  const KvGeometry g = kv_geometry(num_pages, page_size);
  TANDEM_CHECK_KIND(kInvalidArgument, num_pages > 0 && page_size > 0, "bad MTP KV cache size");
  auto pool =
      std::make_shared<DeviceMem>(static_cast<size_t>(g.page_elems() * num_pages) * sizeof(bf16));
  TANDEM_CUDA_CHECK(cudaMemsetAsync(pool->as<void>(), 0, pool->size(), impl_->s.stream));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(impl_->s.stream));
  KvCache::External ext;
  ext.layers.push_back(pool->as<uint8_t>());
  ext.owner = pool;
  ext.stream = impl_->s.stream;
  return KvCache(g, std::move(ext));
}

namespace {

void check_mtp_kv(const ModelConfig& c, const KvCache& kv) {
  const auto& g = kv.geometry();
  TANDEM_CHECK(!kv.is_host() && g.num_layers == 1 && g.dtype == DType::kBF16 &&
                   g.num_kv_heads == c.num_key_value_heads && g.head_dim == c.head_dim,
               "the MTP KV cache was not made by this CUDA model");
}

}  // namespace

// Fills staging set `si` with `batch`'s metadata (waiting until the set's last copies ran).
// writes: per sequence, 0 = a row that writes no KV (nullptr: every row writes). Token ids
// are 0 with ids_on_device (the pass before's drafts are copied over them on the device),
// `src_rows` (when given) the rows of the target's hidden states per token.
MtpLaunch MtpCuda::Impl::stage(const ForwardBatch& batch, const KvCache& kv, size_t si,
                               const uint8_t* writes, bool ids_on_device, const int32_t* src_rows) {
  const int64_t n = batch.num_tokens(), ps = kv.geometry().page_size;
  const int64_t num_pages = kv.geometry().num_pages;
  MtpLaunch l;
  l.n = n;
  l.rows = batch.num_logit_rows();
  TANDEM_CHECK_KIND(kInvalidArgument, n <= s.t_cap && l.rows <= s.rows_cap, "an MTP pass of ", n,
                    " tokens (", l.rows, " rows) exceeds the CUDA model's max_tokens ", s.t_cap);
  // Graph eligibility: a chained draft pass (one token per sequence, its logits) that fits a
  // bucket of sequences and the graph's table width; not while stage timing is on.
  const auto nseq = static_cast<int64_t>(batch.seqs.size());
  int64_t width = 1;
  for (const auto& q : batch.seqs) width = std::max(width, q.num_pages);
  // (Not under decode EP: the passes are eager there, mtp_graphs_on.)
  bool graph = !profile && s.ep == nullptr && !s.buckets.empty() && nseq <= s.buckets.back() &&
               s.graph_context > 0;
  for (const auto& q : batch.seqs)
    graph = graph && q.num_tokens == 1 && q.logits == LogitsMode::kLast;
  const int64_t gw = (s.graph_context + ps - 1) / ps;
  graph = graph && width <= gw;
  const int64_t bucket = graph ? *std::lower_bound(s.buckets.begin(), s.buckets.end(), nseq) : 0;
  graph = graph && bucket <= s.t_cap && bucket <= s.rows_cap;

  // The block tables' room, for either shape (a regrown device buffer drops the graphs
  // captured so far: they read the old one), then the shape.
  Staging& sg = stages[si];
  TANDEM_CUDA_CHECK(cudaEventSynchronize(sg.copied));
  const size_t need =
      static_cast<size_t>(std::max(graph ? bucket * gw : 0, nseq * width)) * sizeof(int32_t);
  if (sg.tables.size() < need || d_tables.size() < need) {
    // Room for the largest bucket's graph table at once, so that warm-up does not grow it
    // bucket by bucket.
    const size_t cap = std::max(
        need * 2, s.buckets.empty() ? size_t{0}
                                    : static_cast<size_t>(s.buckets.back() * gw) * sizeof(int32_t));
    if (sg.tables.size() < need) sg.tables = PinnedMem(cap);
    if (d_tables.size() < need) {
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(s.stream));  // passes in flight may read it
      d_tables = DeviceMem(cap);
      drop_graphs();  // they read the old table buffer
    }
  }
  l.bucket = graph ? bucket : 0;
  l.n_run = graph ? bucket : n;
  l.r_run = graph ? bucket : l.rows;
  l.w_run = graph ? gw : width;
  const int64_t seqs_run = graph ? bucket : nseq;
  l.table_bytes = static_cast<size_t>(seqs_run * l.w_run) * sizeof(int32_t);
  const int64_t T = s.t_cap;
  auto* hm = sg.meta.as<int32_t>();
  int32_t *ids = hm, *pos = hm + T, *seq = hm + 2 * T, *rw = hm + 3 * T, *src = hm + 4 * T;
  auto* slots = reinterpret_cast<int64_t*>(hm + 5 * T);
  auto* tables = sg.tables.as<int32_t>();
  std::memset(tables, 0, l.table_bytes);
  int64_t t = 0, r = 0;
  for (size_t si2 = 0; si2 < batch.seqs.size(); ++si2) {
    const ForwardSeq& q = batch.seqs[si2];
    TANDEM_CHECK(q.num_tokens > 0, "empty sequence chunk");
    TANDEM_CHECK((q.start_pos + q.num_tokens + ps - 1) / ps <= q.num_pages,
                 "block table too short: ", q.num_pages, " pages for ", q.start_pos + q.num_tokens,
                 " tokens");
    for (int64_t p = 0; p < q.num_pages; ++p) {
      TANDEM_CHECK(q.block_table[p] >= 0 && q.block_table[p] < num_pages, "page ", q.block_table[p],
                   " outside the MTP KV cache");
      tables[static_cast<int64_t>(si2) * l.w_run + p] = q.block_table[p];
    }
    const bool write = writes == nullptr || writes[si2] != 0;
    for (int64_t i = 0; i < q.num_tokens; ++i, ++t) {
      const int64_t at = q.start_pos + i;
      if (ids_on_device) {
        ids[t] = 0;
      } else {
        TANDEM_CHECK_KIND(kInvalidArgument, q.tokens[i] >= 0 && q.tokens[i] < c.vocab_size,
                          "token id ", q.tokens[i], " is out of range [0, ", c.vocab_size, ")");
        ids[t] = q.tokens[i];
      }
      pos[t] = static_cast<int32_t>(at);
      seq[t] = static_cast<int32_t>(si2);
      slots[t] = write ? int64_t{q.block_table[at / ps]} * ps + at % ps : -1;
      src[t] = src_rows != nullptr ? src_rows[t] : 0;
      if (q.logits == LogitsMode::kAll ||
          (q.logits == LogitsMode::kLast && i == q.num_tokens - 1)) {
        rw[r++] = static_cast<int32_t>(t);
      }
    }
  }
  // Graph padding: one token per padding sequence at position 0 (tables of zeros), writing no
  // KV, its (discarded) logits row after the real ones.
  for (; t < l.n_run; ++t) {
    ids[t] = 0;
    pos[t] = 0;
    seq[t] = static_cast<int32_t>(t);
    slots[t] = -1;
    src[t] = 0;
    rw[r++] = static_cast<int32_t>(t);
  }
  hm[kNumRealRegion * T] = static_cast<int32_t>(n);  // the real tokens (the EP dispatch's count)
  return l;
}

// Staging set si's metadata (and block tables) to the device, then its event.
void MtpCuda::Impl::upload(const MtpLaunch& l, size_t si) {
  const int64_t T = s.t_cap;
  auto* hm = stages[si].meta.as<int32_t>();
  auto* dm = d_meta.as<int32_t>();
  auto h2d = [&](void* dst, const void* src, size_t bytes) {
    if (bytes > 0) {
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s.stream));
    }
  };
  const auto nb = static_cast<size_t>(l.n_run) * 4;
  for (int64_t region : {0, 1, 2, 4}) h2d(dm + region * T, hm + region * T, nb);
  h2d(dm + 3 * T, hm + 3 * T, static_cast<size_t>(l.r_run) * 4);
  h2d(dm + 5 * T, hm + 5 * T, nb * 2);
  h2d(dm + kNumRealRegion * T, hm + kNumRealRegion * T, sizeof(int32_t));
  h2d(d_tables.as<void>(), stages[si].tables.as<void>(), l.table_bytes);
  TANDEM_CUDA_CHECK(cudaEventRecord(stages[si].copied, s.stream));
}

// A graph bucket's first use: a warm-up run (GEMM plans, workspaces) with padding only (no KV
// written; staging set si's slots for it), then the capture. Synchronises (warm-up time).
void MtpCuda::Impl::capture(const MtpLaunch& l, KvCache& kv, size_t si) {
  if (graph_kv != kv.layer_data(0) || graph_page_size != kv.geometry().page_size) {
    drop_graphs();
    graph_kv = kv.layer_data(0);
    graph_page_size = kv.geometry().page_size;
  }
  if (graphs.count(l.bucket) > 0) return;
  auto* slots = reinterpret_cast<int64_t*>(stages[si].meta.as<int32_t>() + 5 * s.t_cap);
  const std::vector<int64_t> real(slots, slots + l.n_run);
  std::fill(slots, slots + l.n_run, int64_t{-1});
  upload(l, si);
  body(kv, l.n_run, l.r_run, l.w_run);
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(s.stream));
  std::copy(real.begin(), real.end(), slots);
  graphs.emplace(l.bucket,
                 cuda_model::capture_graph(s.stream, [&] { body(kv, l.n_run, l.r_run, l.w_run); }));
}

// The pass's kernels over the uploaded metadata and hidden_in: its graph, or eagerly.
void MtpCuda::Impl::run(const MtpLaunch& l, KvCache& kv) {
  if (l.graph()) {
    const auto it = graphs.find(l.bucket);
    TANDEM_CHECK(it != graphs.end(), "MTP pass: no graph captured for bucket ", l.bucket);
    TANDEM_CUDA_CHECK(cudaGraphLaunch(it->second, s.stream));
    return;
  }
  mark(1);
  body(kv, l.n_run, l.r_run, l.w_run);
  mark(7);
}

// The staged passes of a chain (launches[0]: pass 0, its hidden states gathered from the
// target's buffer of target_rows rows by the staged region 4; then one-token passes, row i
// continuing row i of the pass before: its token that pass's draft, its hidden state that pass's
// output, copied on the device). A bucket's first use is captured before any pass runs (its
// warm-up run overwrites the scratch the target's hidden states are in). fix(p), when given,
// runs after pass p's metadata is uploaded and before its kernels. Each pass's argmax goes to
// d_drafts + p * rows_cap. Returns the rows of each pass.
std::vector<int64_t> MtpCuda::Impl::run_chain(const std::vector<MtpLaunch>& launches, KvCache& kv,
                                              const void* target_hidden, int64_t target_rows,
                                              const std::function<void(size_t)>& fix) {
  cudaStream_t st = s.stream;
  const int64_t h = c.hidden_size, R = s.rows_cap;
  const size_t row = static_cast<size_t>(h) * sizeof(bf16);
  auto* hin = hidden_in.as<bf16>();
  auto* dm = d_meta.as<int32_t>();
  auto* dd = d_drafts.as<int32_t>();
  std::vector<int64_t> rows(launches.size(), 0);
  MtpLaunch l = launches[0];
  upload(l, 0);
  cuda::embedding_launch(
      {dm + 4 * s.t_cap, static_cast<const bf16*>(target_hidden), hin, l.n, h, target_rows}, st);
  auto zero_padding = [&](const MtpLaunch& p) {
    if (p.n_run > p.n) {
      TANDEM_CUDA_CHECK(
          cudaMemsetAsync(hin + p.n * h, 0, static_cast<size_t>(p.n_run - p.n) * row, st));
    }
  };
  zero_padding(l);
  bool captured = false;
  for (size_t p = 0; p < launches.size(); ++p) {
    if (!launches[p].graph() ||
        (graph_kv == kv.layer_data(0) && graph_page_size == kv.geometry().page_size &&
         graphs.count(launches[p].bucket) > 0)) {
      continue;
    }
    capture(launches[p], kv, p);
    captured = true;
  }
  if (captured) upload(l, 0);  // pass 0's metadata again
  if (fix) fix(0);
  run(l, kv);
  rows[0] = l.rows;
  s.sampler->argmax(s.logits, l.rows, dd, st);
  for (size_t p = 1; p < launches.size(); ++p) {
    l = launches[p];
    upload(l, p);
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dm, dd + (p - 1) * R,
                                      static_cast<size_t>(l.n) * sizeof(int32_t),
                                      cudaMemcpyDeviceToDevice, st));
    TANDEM_CUDA_CHECK(
        cudaMemcpyAsync(hin, s.last, static_cast<size_t>(l.n) * row, cudaMemcpyDeviceToDevice, st));
    zero_padding(l);
    if (fix) fix(p);
    run(l, kv);
    rows[p] = l.rows;
    s.sampler->argmax(s.logits, l.rows, dd + p * R, st);
  }
  return rows;
}

int64_t MtpCuda::forward(const ForwardBatch& batch, const float* hidden, KvCache& kv) {
  Impl& im = *impl_;
  check_mtp_kv(im.c, kv);
  if (batch.num_tokens() == 0) {
    if (im.collective()) im.empty_pass();  // a decode EP rank's: its experts serve the others
    return 0;
  }
  const int64_t h = im.c.hidden_size;
  im.mark(0);
  const MtpLaunch l = im.stage(batch, kv, 0, nullptr, false, nullptr);
  // The hidden states (bf16) through pinned staging (free: stage() waited for set 0's copies),
  // before a first use's capture runs the bucket once.
  auto* hh = im.h_hidden.as<uint16_t>();
  for (int64_t i = 0; i < l.n * h; ++i) hh[i] = f32_to_bf16(hidden[i]);
  std::memset(hh + l.n * h, 0, static_cast<size_t>((l.n_run - l.n) * h) * sizeof(uint16_t));
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(im.hidden_in.as<void>(), hh,
                                    static_cast<size_t>(l.n_run * h) * sizeof(bf16),
                                    cudaMemcpyHostToDevice, im.s.stream));
  if (l.graph()) im.capture(l, kv, 0);
  im.upload(l, 0);
  im.run(l, kv);
  return l.rows;
}

void MtpCuda::draft_chain(const ForwardBatch& first, const void* target_hidden, int64_t target_rows,
                          std::span<const int32_t> hidden_rows,
                          const std::vector<MtpChainPass>& chain, KvCache& kv,
                          std::vector<std::vector<int32_t>>& drafts) {
  Impl& im = *impl_;
  check_mtp_kv(im.c, kv);
  im.check_chain(first, target_rows, hidden_rows, chain.size());
  drafts.assign(chain.size() + 1, {});
  if (first.num_tokens() == 0) {
    if (im.collective()) {  // every pass's exchange still runs (decode EP)
      for (size_t p = 0; p <= chain.size(); ++p) im.empty_pass();
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(im.s.stream));
    }
    return;
  }

  // Every pass staged first (host work only).
  std::vector<MtpLaunch> launches;
  launches.push_back(im.stage(first, kv, 0, nullptr, false, hidden_rows.data()));
  for (size_t p = 1; p <= chain.size(); ++p) {
    const MtpChainPass& c = chain[p - 1];
    const int64_t prev = launches.back().rows;
    TANDEM_CHECK(static_cast<int64_t>(c.batch.seqs.size()) == prev &&
                     c.writes.size() == c.batch.seqs.size() && c.batch.num_tokens() == prev &&
                     c.batch.num_logit_rows() == prev,
                 "MTP draft chain: pass ", p, " must have one token and logits row for each of ",
                 prev, " rows");
    if (prev == 0) break;
    launches.push_back(im.stage(c.batch, kv, p, c.writes.data(), true, nullptr));
  }
  const std::vector<int64_t> rows = im.run_chain(launches, kv, target_hidden, target_rows, {});
  // Passes past the last with rows (none of this rank's): empty ones under decode EP.
  const size_t empty_passes = im.collective() ? chain.size() + 1 - launches.size() : 0;
  for (size_t p = 0; p < empty_passes; ++p) im.empty_pass();
  im.drafts_to_host(rows);
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(im.s.stream));  // the chain's one synchronisation
  im.unpack_drafts(rows, drafts);
}

void MtpCuda::draft_after_verify(const ForwardBatch& verify, const void* target_hidden,
                                 int64_t target_rows, std::span<const int32_t> hidden_rows,
                                 const int32_t* sampled, VerifyDraftStep& step, KvCache& kv) {
  Impl& im = *impl_;
  const MtpScratch& s = im.s;
  cudaStream_t st = s.stream;
  check_mtp_kv(im.c, kv);
  const auto n = static_cast<int64_t>(verify.seqs.size());
  const int64_t K = step.num_drafts, T = verify.num_tokens(), ps = kv.geometry().page_size;
  TANDEM_CHECK(K >= 1 && static_cast<int64_t>(step.forced.size()) == n && n > 0 &&
                   verify.num_logit_rows() == T,
               "draft_after_verify: ", n, " sequences, ", step.forced.size(), " forced counts, K ",
               K, ", ", verify.num_logit_rows(), " rows for ", T, " tokens (one row each)");
  im.check_chain(verify, target_rows, hidden_rows, static_cast<size_t>(K - 1));

  // Pass 0 over every verify position (one logits row per sequence: the kernel picks it), the
  // chained passes one token per sequence at placeholder positions (the kernel's). Every pass
  // has every sequence, so a collective layer (decode EP) runs exactly K exchanges here, as the
  // unfused step's pass 0, chained and padding passes add up to (Engine::mtp_passes).
  ForwardBatch first = verify;
  for (ForwardSeq& f : first.seqs) f.logits = LogitsMode::kLast;
  std::vector<MtpLaunch> launches;
  launches.push_back(im.stage(first, kv, 0, nullptr, true, hidden_rows.data()));
  ForwardBatch one;
  for (const ForwardSeq& f : verify.seqs) {
    one.seqs.push_back({f.tokens, 1, f.start_pos + f.num_tokens - 1, f.block_table, f.num_pages,
                        LogitsMode::kLast, -1});
  }
  for (int64_t p = 1; p < K; ++p) {
    launches.push_back(im.stage(one, kv, static_cast<size_t>(p), nullptr, true, nullptr));
  }

  // The kernel's inputs, and its outputs: the accepted counts and the chained passes' positions
  // and KV slots in the stage's buffers, pass 0's tokens and logits rows straight into pass 0's
  // metadata (d_meta regions 0 and 3, written after its upload).
  auto* dm = im.d_meta.as<int32_t>();
  cuda::SpecAdvanceParams ap = im.spec.stage(verify, step.forced, K - 1, ps, {}, st);
  ap.sampled = sampled;
  ap.mtp_ids = dm;
  ap.mtp_rows = dm + 3 * s.t_cap;
  const auto N = static_cast<size_t>(n);
  const std::vector<int64_t> rows =
      im.run_chain(launches, kv, target_hidden, target_rows, [&](size_t p) {
        if (p == 0) {
          cuda::spec_advance_launch(ap, st);
          return;
        }
        // Chained pass p's positions and slots over the staged placeholders.
        const size_t o = (p - 1) * N;
        TANDEM_CUDA_CHECK(cudaMemcpyAsync(dm + s.t_cap, ap.chain_pos + o, N * sizeof(int32_t),
                                          cudaMemcpyDeviceToDevice, st));
        TANDEM_CUDA_CHECK(cudaMemcpyAsync(dm + 5 * s.t_cap, ap.chain_slots + o, N * sizeof(int64_t),
                                          cudaMemcpyDeviceToDevice, st));
      });
  im.drafts_to_host(rows);
  im.spec.accepted_to_host(st);
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(st));  // the step's one synchronisation
  std::vector<std::vector<int32_t>> drafts;
  im.unpack_drafts(rows, drafts);
  step.accepted.assign(im.spec.host_accepted(), im.spec.host_accepted() + n);
  step.drafts.assign(N, std::vector<int32_t>(static_cast<size_t>(K)));
  for (size_t i = 0; i < N; ++i) {
    for (size_t p = 0; p < static_cast<size_t>(K); ++p) step.drafts[i][p] = drafts[p][i];
  }
}

bool MtpCuda::collective() const { return impl_->collective(); }

std::vector<int64_t> MtpCuda::captured_buckets() const {
  std::vector<int64_t> out;
  for (const auto& [b, e] : impl_->graphs) out.push_back(b);
  return out;
}

void MtpCuda::profile_stages(bool on) { impl_->profile = on; }

std::vector<std::pair<std::string, float>> MtpCuda::stage_ms() const {
  static const char* const kNames[] = {"staging (h2d)", "embed + norms + fc", "qkv + rope",
                                       "attention",     "o_proj + norm",      "moe / mlp",
                                       "norm + lm_head"};
  std::vector<std::pair<std::string, float>> out;
  const Impl& im = *impl_;
  if (!im.profile || im.stage_ev.size() < 8) return out;
  TANDEM_CUDA_CHECK(cudaEventSynchronize(im.stage_ev[7]));
  for (size_t i = 0; i < 7; ++i) {
    float ms = 0.0f;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, im.stage_ev[i], im.stage_ev[i + 1]));
    out.emplace_back(kNames[i], ms);
  }
  return out;
}

void MtpCuda::hidden_to_host(int64_t rows, std::vector<float>& out) {
  Impl& im = *impl_;
  const int64_t h = im.c.hidden_size;
  out.resize(static_cast<size_t>(rows * h));
  if (rows == 0) return;
  TANDEM_CUDA_CHECK(cudaEventSynchronize(im.stages[0].copied));  // h_hidden is free then
  auto* hh = im.h_hidden.as<uint16_t>();
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(hh, im.s.last, static_cast<size_t>(rows * h) * sizeof(bf16),
                                    cudaMemcpyDeviceToHost, im.s.stream));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(im.s.stream));
  for (int64_t i = 0; i < rows * h; ++i) out[static_cast<size_t>(i)] = bf16_to_f32(hh[i]);
}

// ---- Qwen3MoeCuda's MTP members (qwen3_moe_cuda.h) -------------------------------------

void Qwen3MoeCuda::load_mtp(const std::string& dir) {
  TANDEM_CHECK_KIND(kUnsupported, !(shard().tensor_parallel() && shard().spec.size > 1),
                    "MTP speculative decoding: prefill instances (TP) do not speculate");
  TANDEM_CHECK_KIND(kUnsupported, !opts_.deterministic,
                    "MTP speculative decoding with --deterministic is not supported (the drafts, "
                    "hence the accepted tokens, would depend on the batch)");
  TANDEM_CHECK_KIND(kUnsupported, !opts_.kv_cache_fp8,
                    "MTP speculative decoding with --kv-cache-dtype fp8 is not supported (the "
                    "MTP passes read the target's prefill plan and bf16 KV)");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  mtp_ = MtpCuda::load(config_, dir, mtp_scratch());
  weight_bytes_ += mtp_->weight_bytes();
}

void Qwen3MoeCuda::random_mtp(uint64_t seed) {
  TANDEM_CHECK_KIND(kUnsupported, !opts_.kv_cache_fp8,
                    "MTP speculative decoding with --kv-cache-dtype fp8 is not supported");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  mtp_ = MtpCuda::random(config_, seed, mtp_scratch());
  weight_bytes_ += mtp_->weight_bytes();
}

bool Qwen3MoeCuda::mtp_collective() const { return mtp_ != nullptr && mtp_->collective(); }

KvGeometry Qwen3MoeCuda::mtp_kv_geometry(int64_t num_pages, int64_t page_size) const {
  TANDEM_CHECK_KIND(kUnsupported, mtp_ != nullptr, "this model has no MTP layer loaded");
  return mtp_->kv_geometry(num_pages, page_size);
}

KvCache Qwen3MoeCuda::make_mtp_kv_cache(int64_t num_pages, int64_t page_size) {
  TANDEM_CHECK_KIND(kUnsupported, mtp_ != nullptr, "this model has no MTP layer loaded");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  return mtp_->make_kv_cache(num_pages, page_size);
}

const float* Qwen3MoeCuda::mtp_forward_device(const ForwardBatch& batch, const float* hidden,
                                              KvCache& mtp_kv) {
  TANDEM_CHECK(mtp_ != nullptr, "mtp_forward: no MTP layer loaded");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  mtp_->forward(batch, hidden, mtp_kv);
  return mtp_scratch().logits;
}

void Qwen3MoeCuda::mtp_forward(const ForwardBatch& batch, const float* hidden, KvCache& mtp_kv,
                               std::vector<float>& logits, std::vector<float>& hidden_out) {
  TANDEM_CHECK(mtp_ != nullptr, "mtp_forward: no MTP layer loaded");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int64_t rows = mtp_->forward(batch, hidden, mtp_kv), v = config_.vocab_size;
  logits.resize(static_cast<size_t>(rows * v));
  if (rows > 0) {
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(logits.data(), mtp_scratch().logits,
                                      logits.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                      stream_));
  }
  mtp_->hidden_to_host(rows, hidden_out);  // synchronises
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void Qwen3MoeCuda::mtp_forward_sample(const ForwardBatch& batch, const float* hidden,
                                      KvCache& mtp_kv, const std::vector<DeviceSampling>& rows,
                                      std::vector<SampledToken>& out,
                                      std::vector<float>& hidden_out) {
  TANDEM_CHECK(mtp_ != nullptr, "mtp_forward: no MTP layer loaded");
  TANDEM_CHECK(static_cast<int64_t>(rows.size()) == batch.num_logit_rows(),
               "mtp_forward_sample: ", rows.size(), " sampling rows for ", batch.num_logit_rows(),
               " logits rows");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const int64_t r = mtp_->forward(batch, hidden, mtp_kv);
  runner_->sample_rows(mtp_scratch().logits, rows, out);  // synchronises
  mtp_->hidden_to_host(r, hidden_out);
}

}  // namespace tandem
