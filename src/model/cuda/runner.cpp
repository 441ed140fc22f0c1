// The CUDA model runner. See runner.h.
#include "model/cuda/runner.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "model/cuda/device_sampler.h"
#include "model/cuda/factory.h"
#include "model/load_progress.h"

namespace tandem::cuda_model {

HostStepMeta build_step_meta(const ForwardBatch& batch, const StepLayout& l,
                             std::vector<int64_t>& first_token, int64_t& num_prefill) {
  const int64_t n = batch.num_tokens(), rows_n = l.rows_n, page_size = l.page_size;
  HostStepMeta hm;
  hm.num_real = static_cast<int32_t>(n);
  hm.ids.assign(static_cast<size_t>(rows_n), 0);
  hm.positions.assign(static_cast<size_t>(rows_n), 0);
  hm.token_seq.resize(static_cast<size_t>(rows_n));
  hm.slots.assign(static_cast<size_t>(rows_n), -1);  // padding writes no KV
  hm.tables.assign(static_cast<size_t>(l.num_seqs * l.width), 0);
  for (int64_t t = 0; t < rows_n; ++t) hm.token_seq[static_cast<size_t>(t)] = int32_t(t);
  if (l.deltanet) hm.dn_token_seq = hm.token_seq;
  // Tokens of multi-token chunks go first (the attention's prefill kernel takes the leading
  // num_prefill tokens); logits rows stay in batch order.
  first_token.assign(batch.seqs.size(), 0);
  num_prefill = 0;
  {
    int64_t chunk_t = 0, decode_t = 0;
    for (const auto& s : batch.seqs) num_prefill += s.num_tokens > 1 ? s.num_tokens : 0;
    for (size_t si = 0; si < batch.seqs.size(); ++si) {
      const int64_t k = batch.seqs[si].num_tokens;
      first_token[si] = k > 1 ? chunk_t : num_prefill + decode_t;
      (k > 1 ? chunk_t : decode_t) += k;
    }
  }
  if (l.deltanet) {
    // DeltaNet sequences in token order: the chunks, then the decode tokens (each group in
    // batch order), then the padding sequences.
    std::vector<size_t> order(batch.seqs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return first_token[a] < first_token[b]; });
    for (size_t oi = 0; oi < order.size(); ++oi) {
      const size_t si = order[oi];
      const ForwardSeq& s = batch.seqs[si];
      hm.dn_begin.push_back(static_cast<int32_t>(first_token[si]));
      hm.dn_slot.push_back(s.state_slot);
      const int32_t out = l.state_out != nullptr ? (*l.state_out)[si] : -1;
      hm.dn_slot_out.push_back(out >= 0 ? out : s.state_slot);
      hm.dn_fresh.push_back(s.start_pos == 0 ? 1 : 0);
      for (int64_t i = 0; i < s.num_tokens; ++i) {
        hm.dn_token_seq[static_cast<size_t>(first_token[si] + i)] = static_cast<int32_t>(oi);
      }
    }
  }
  const auto nseq = static_cast<int64_t>(batch.seqs.size());
  for (int64_t t = n; t < rows_n; ++t) {  // padding: pad_q tokens per sequence, no slot
    const int64_t j = (t - n) / l.pad_q;
    hm.token_seq[static_cast<size_t>(t)] = static_cast<int32_t>(nseq + j);
    hm.positions[static_cast<size_t>(t)] = static_cast<int32_t>((t - n) % l.pad_q);
    if (!l.deltanet) continue;
    hm.dn_token_seq[static_cast<size_t>(t)] = static_cast<int32_t>(nseq + j);
    if ((t - n) % l.pad_q != 0) continue;
    hm.dn_begin.push_back(static_cast<int32_t>(t));
    hm.dn_slot.push_back(-1);
    hm.dn_slot_out.push_back(-1);
    hm.dn_fresh.push_back(0);
  }
  if (l.deltanet) hm.dn_begin.push_back(static_cast<int32_t>(rows_n));
  for (size_t si = 0; si < batch.seqs.size(); ++si) {
    const ForwardSeq& s = batch.seqs[si];
    TANDEM_CHECK(s.num_tokens > 0, "empty sequence chunk");
    TANDEM_CHECK((s.start_pos + s.num_tokens + page_size - 1) / page_size <= s.num_pages,
                 "block table too short: ", s.num_pages, " pages for ", s.start_pos + s.num_tokens,
                 " tokens");
    if (l.state_slots >= 0) {
      TANDEM_CHECK(s.state_slot >= 0 && s.state_slot < l.state_slots, "sequence ", si,
                   " has no state slot (", s.state_slot, ")");
    }
    for (int64_t p = 0; p < s.num_pages; ++p) {
      const int32_t page = s.block_table[p];
      TANDEM_CHECK(page >= 0 && page < l.num_pages, "page ", page, " outside the KV cache");
      hm.tables[static_cast<size_t>(static_cast<int64_t>(si) * l.width + p)] = page;
    }
    const bool all = s.logits == LogitsMode::kAll;
    for (int64_t i = 0; i < s.num_tokens; ++i) {
      const int64_t t = first_token[si] + i;
      const int64_t pos = s.start_pos + i;
      const int32_t id = s.tokens[i];
      TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < l.vocab, "token id ", id,
                        " is out of range [0, ", l.vocab, ")");
      hm.ids[static_cast<size_t>(t)] = id;
      hm.positions[static_cast<size_t>(t)] = static_cast<int32_t>(pos);
      hm.token_seq[static_cast<size_t>(t)] = static_cast<int32_t>(si);
      hm.slots[static_cast<size_t>(t)] =
          int64_t{s.block_table[pos / page_size]} * page_size + pos % page_size;
      if (all || (s.logits == LogitsMode::kLast && i == s.num_tokens - 1)) {
        hm.rows.push_back(static_cast<int32_t>(t));
      }
    }
  }
  if (l.pad_rows) {  // every padded row produces (discarded) logits, so the graph is fixed
    for (int64_t r = n; r < rows_n; ++r) hm.rows.push_back(static_cast<int32_t>(r));
  }
  return hm;
}

KvScales read_kv_scales(const Checkpoint& ckpt, const std::string& prefix) {
  KvScales s;
  for (int kv = 0; kv < 2; ++kv) {
    const std::string name = prefix + (kv == 0 ? "self_attn.k_scale" : "self_attn.v_scale");
    if (!ckpt.has(name)) continue;
    const TensorView t = ckpt.get(name);
    TANDEM_CHECK_KIND(kUnsupported, t.numel() == 1, ckpt.file_of(name), ": ", name, " has ",
                      t.numel(),
                      " elements: --kv-cache-dtype fp8 takes per-tensor KV scales only (one "
                      "element)");
    float f = 0;
    Checkpoint::to_f32(t, &f);
    TANDEM_CHECK_KIND(kInvalidArgument, std::isfinite(f) && f > 0.f, ckpt.file_of(name), ": ", name,
                      " is ", f, " (--kv-cache-dtype fp8 needs a positive finite scale)");
    (kv == 0 ? s.k : s.v) = f;
  }
  return s;
}

void check_kv_cache_dtype(const CudaModelOptions& opts, const char* what) {
  TANDEM_CHECK_KIND(kUnsupported, !(opts.kv_cache_fp8 && opts.deterministic),
                    "--kv-cache-dtype fp8 with --deterministic is not supported (", what,
                    ": the batch-invariant attention reads bf16 KV)");
}

// ---- GraphSet ------------------------------------------------------------------------------

void GraphSet::drop() {
  for (auto& [k, g] : graphs_) (void)cudaGraphExecDestroy(g);
  graphs_.clear();
  inputs_.clear();
}

void GraphSet::bind(const std::vector<const void*>& inputs) {
  if (inputs == inputs_) return;
  drop();
  inputs_ = inputs;
}

void GraphSet::drop_if(const std::function<bool(int64_t)>& pred) {
  for (auto it = graphs_.begin(); it != graphs_.end();) {
    if (!pred(it->first)) {
      ++it;
      continue;
    }
    (void)cudaGraphExecDestroy(it->second);
    it = graphs_.erase(it);
  }
}

cudaGraphExec_t GraphSet::find(int64_t key) const {
  const auto it = graphs_.find(key);
  return it == graphs_.end() ? nullptr : it->second;
}

std::vector<int64_t> GraphSet::keys() const {
  std::vector<int64_t> out;
  for (const auto& [k, g] : graphs_) out.push_back(k);
  return out;
}

std::vector<int64_t> graph_buckets(int64_t max_seqs) {
  std::vector<int64_t> buckets;
  for (const int64_t b : kGraphBuckets) {
    if (b <= max_seqs) buckets.push_back(b);
  }
  const int64_t top = std::clamp<int64_t>(max_seqs, 1, kMaxGraphBatch);
  if (buckets.empty() || buckets.back() < top) buckets.push_back(top);
  return buckets;
}

// ---- CudaRunner ----------------------------------------------------------------------------

CudaRunner::CudaRunner(const ModelConfig& config, const CudaModelOptions& opts)
    : c_(config), opts_(opts) {
  TANDEM_CHECK_KIND(kInvalidArgument, opts_.max_tokens > 0 && opts_.max_seqs > 0,
                    "max_tokens and max_seqs must be positive");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    TANDEM_THROW(kUnsupported, "--device cuda: no CUDA device is visible");
  }
  TANDEM_CHECK_KIND(kInvalidArgument, opts_.device >= 0 && opts_.device < count, "CUDA device ",
                    opts_.device, " does not exist (", count, " visible)");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TANDEM_CUDA_CHECK(
      cudaDeviceGetAttribute(&ws_.num_sms, cudaDevAttrMultiProcessorCount, opts_.device));
  if (opts_.cuda_graphs) buckets_ = graph_buckets(opts_.max_seqs);
}

CudaRunner::~CudaRunner() {
  graphs_.drop();
  if (meta_copied_ != nullptr) (void)cudaEventDestroy(meta_copied_);
  ws_.sampler.reset();
  ws_.gemm.reset();
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

void CudaRunner::allocate(bool batch_invariant) {
  TANDEM_CHECK(layers_ != nullptr, "CudaRunner::allocate: no layers");
  const int64_t h = c_.hidden_size, largest = buckets_.empty() ? 1 : buckets_.back();
  Workspace& w = ws_;
  w.t_cap = std::max(opts_.max_tokens, largest);
  w.rows_cap = std::max<int64_t>({opts_.max_seqs, largest, std::min<int64_t>(w.t_cap, 1024)});
  w.s_cap = std::max(opts_.max_seqs, largest);
  const auto T = static_cast<size_t>(w.t_cap);
  const size_t row = static_cast<size_t>(h) * sizeof(uint16_t);
  w.x = DeviceMem(T * row);
  w.xn = DeviceMem(T * row);
  w.y = DeviceMem(T * row);
  w.last = DeviceMem(T * row);
  w.logits = DeviceMem(static_cast<size_t>(w.rows_cap * c_.vocab_size) * sizeof(float));
  w.sampler = std::make_unique<DeviceSampler>(w.rows_cap, c_.vocab_size);
  w.sampler->set_batch_invariant(batch_invariant);
  w.gemm = std::make_unique<cuda::GemmLt>();
  w.gemm->set_batch_invariant(batch_invariant);
  // Split-KV workspace for the captured decode steps (and eager batches that fit it).
  const AttentionShape a = layers_->attention();
  const int64_t ctx =
      opts_.graph_max_context > 0 ? opts_.graph_max_context : c_.max_position_embeddings;
  const int64_t width = std::max<int64_t>(1, (ctx + opts_.page_size - 1) / opts_.page_size);
  for (int64_t b = 1; b <= largest; ++b) {
    const int64_t split =
        cuda::paged_attention_decode_split(b, a.kv_heads, width, opts_.page_size, w.num_sms);
    if (split > 0) {
      w.attn_ws_floats =
          std::max(w.attn_ws_floats, cuda::paged_attention_workspace_floats(
                                         b, a.q_heads, a.head_dim, width, opts_.page_size, split));
    }
  }
  w.attn_ws = DeviceMem(w.attn_ws_floats * sizeof(float));
  e_meta_ = make_meta_buffer();
  h_meta_ = PinnedMem(e_meta_.size());
  TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&meta_copied_, cudaEventDisableTiming));
}

int64_t CudaRunner::graph_width(int64_t page_size) {
  if (graph_width_ == 0) {
    const int64_t ctx =
        opts_.graph_max_context > 0 ? opts_.graph_max_context : c_.max_position_embeddings;
    graph_width_ = std::max<int64_t>(1, (ctx + page_size - 1) / page_size);
  }
  return graph_width_;
}

int64_t CudaRunner::pick_split(int64_t n, int64_t num_prefill, int64_t width,
                               int64_t page_size) const {
  if (n - num_prefill <= 0) return 0;
  const AttentionShape a = layers_->attention();
  int64_t split = cuda::paged_attention_decode_split(n - num_prefill, a.kv_heads, width, page_size,
                                                     ws_.num_sms);
  if (split > 0 && cuda::paged_attention_workspace_floats(n, a.q_heads, a.head_dim, width,
                                                          page_size, split) > ws_.attn_ws_floats) {
    split = 0;
  }
  return split;
}

cuda::PagedAttentionParams CudaRunner::attention_params(const StepMeta& m, const void* q,
                                                        const void* pool, void* out,
                                                        int64_t page_size, int64_t split) const {
  const AttentionShape a = layers_->attention();
  cuda::PagedAttentionParams ap{};
  ap.q = static_cast<const cuda::bf16*>(q);
  ap.pool = static_cast<const cuda::bf16*>(pool);
  ap.block_table = m.tables;
  ap.token_seq = m.token_seq;
  ap.positions = m.positions;
  ap.out = static_cast<cuda::bf16*>(out);
  ap.num_tokens = m.n;
  ap.num_q_heads = a.q_heads;
  ap.num_kv_heads = a.kv_heads;
  ap.head_dim = a.head_dim;
  ap.page_size = page_size;
  ap.max_pages_per_seq = m.width;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(a.head_dim));
  ap.kv_split = split;
  ap.workspace = split > 0 ? ws_.attn_ws.as<float>() : nullptr;
  ap.num_prefill_tokens = m.num_prefill;
  ap.prefill_plan = m.prefill_plan;
  return ap;
}

// The layout of a metadata buffer, in int32 elements (T tokens, S sequences): ids | positions |
// token_seq | rows (T each) | slots (int64: 2T) | dn_token_seq (T) | dn_begin (S + 1) | dn_slot |
// dn_fresh | dn_slot_out (S each) | num_real, padded. S: room for the state replay's padding
// sequences too.
namespace {
size_t meta_elems(int64_t T, int64_t S) { return static_cast<size_t>(7 * T + 4 * S + 8); }
}  // namespace

DeviceMem CudaRunner::make_meta_buffer() const {
  return DeviceMem(meta_elems(ws_.t_cap, ws_.s_cap + 2) * sizeof(int32_t));
}

StepMeta CudaRunner::meta_at(const DeviceMem& buffer) const {
  StepMeta r;
  auto* base = buffer.as<int32_t>();
  const int64_t T = ws_.t_cap, S = ws_.s_cap + 2;
  r.ids = base;
  r.positions = base + T;
  r.token_seq = base + 2 * T;
  r.rows = base + 3 * T;
  r.slots = reinterpret_cast<int64_t*>(base + 4 * T);  // 4 T int32: 8-byte aligned
  r.dn_token_seq = base + 6 * T;
  r.dn_begin = base + 7 * T;
  r.dn_slot = base + 7 * T + S + 1;
  r.dn_fresh = base + 7 * T + 2 * S + 1;
  r.dn_slot_out = base + 7 * T + 3 * S + 1;
  r.num_real = base + 7 * T + 4 * S + 1;
  return r;
}

void CudaRunner::upload(const HostStepMeta& hm, const StepMeta& dst) {
  TANDEM_CUDA_CHECK(cudaEventSynchronize(meta_copied_));  // the staging is free again
  auto* base = h_meta_.as<int32_t>();
  const auto* dev = e_meta_.as<int32_t>();
  const StepMeta e = meta_at(e_meta_);
  // Each array staged at its offset in the eager layout (the staging is that layout's size).
  auto stage = [&](const int32_t* like, const void* src, size_t bytes, void* d) {
    if (bytes == 0 || d == nullptr) return;
    int32_t* h = base + (like - dev);
    std::memcpy(h, src, bytes);
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream_));
  };
  const size_t n = hm.ids.size();
  stage(e.ids, hm.ids.data(), n * 4, dst.ids);
  stage(e.positions, hm.positions.data(), n * 4, dst.positions);
  stage(e.token_seq, hm.token_seq.data(), n * 4, dst.token_seq);
  stage(e.rows, hm.rows.data(), hm.rows.size() * 4, dst.rows);
  stage(reinterpret_cast<const int32_t*>(e.slots), hm.slots.data(), n * 8, dst.slots);
  stage(e.dn_token_seq, hm.dn_token_seq.data(), hm.dn_token_seq.size() * 4, dst.dn_token_seq);
  stage(e.dn_begin, hm.dn_begin.data(), hm.dn_begin.size() * 4, dst.dn_begin);
  stage(e.dn_slot, hm.dn_slot.data(), hm.dn_slot.size() * 4, dst.dn_slot);
  stage(e.dn_fresh, hm.dn_fresh.data(), hm.dn_fresh.size() * 4, dst.dn_fresh);
  stage(e.dn_slot_out, hm.dn_slot_out.data(), hm.dn_slot_out.size() * 4, dst.dn_slot_out);
  stage(e.num_real, &hm.num_real, 4, dst.num_real);
  const size_t tb = hm.tables.size() * sizeof(int32_t);
  if (tb > 0 && dst.tables != nullptr) {
    if (h_tables_.size() < tb) h_tables_ = PinnedMem(tb * 2);
    std::memcpy(h_tables_.as<int32_t>(), hm.tables.data(), tb);
    TANDEM_CUDA_CHECK(
        cudaMemcpyAsync(dst.tables, h_tables_.as<int32_t>(), tb, cudaMemcpyHostToDevice, stream_));
  }
  TANDEM_CUDA_CHECK(cudaEventRecord(meta_copied_, stream_));
}

StepMeta CudaRunner::eager_meta(size_t tables) {
  const size_t tb = tables * sizeof(int32_t);
  if (e_tables_.size() < tb) e_tables_ = DeviceMem(tb * 2);
  StepMeta m = meta_at(e_meta_);
  m.tables = e_tables_.as<int32_t>();
  return m;
}

StepMeta CudaRunner::graph_meta(GraphSet& set) {
  if (set.meta.size() == 0) {
    set.meta = make_meta_buffer();
    set.tables = DeviceMem(static_cast<size_t>(buckets_.back() * graph_width_) * sizeof(int32_t));
  }
  StepMeta m = meta_at(set.meta);
  m.tables = set.tables.as<int32_t>();
  return m;
}

void CudaRunner::plan_prefill(const HostStepMeta& hm, StepMeta& m, int64_t page_size) {
  const AttentionShape a = layers_->attention();
  if (m.num_prefill > 0 && a.prefill_plan &&
      ws_.prefill_plan.plan({hm.token_seq.data(), hm.positions.data(), m.num_prefill, a.q_heads,
                             a.kv_heads, a.head_dim, page_size, m.width, a.kv_fp8},
                            stream_)) {
    m.prefill_plan = &ws_.prefill_plan;
  }
}

void CudaRunner::replay(GraphSet& set, int64_t key, const HostStepMeta& hm, const StepMeta& m,
                        const std::function<void(bool warmup)>& record,
                        const std::function<void()>& after_upload) {
  cudaGraphExec_t exec = set.find(key);
  if (exec == nullptr) {
    // Warm-up run (GEMM plans, workspaces) with padding only: no KV, no state is written.
    HostStepMeta pad = hm;
    std::fill(pad.slots.begin(), pad.slots.end(), -1);
    std::fill(pad.ids.begin(), pad.ids.end(), 0);
    std::fill(pad.dn_slot.begin(), pad.dn_slot.end(), -1);
    std::fill(pad.dn_slot_out.begin(), pad.dn_slot_out.end(), -1);
    upload(pad, m);
    record(true);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    exec = capture_graph(stream_, [&] { record(false); });
    set.add(key, exec);
  }
  upload(hm, m);
  if (after_upload) after_upload();
  TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
}

bool CudaRunner::launch(const ForwardBatch& batch, KvCache& kv,
                        const std::vector<int32_t>* state_out) {
  CudaLayers& L = *layers_;
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));  // the engine thread may be a new one
  L.check_cache(kv);
  const auto& g = kv.geometry();
  const int64_t n = batch.num_tokens(), page_size = g.page_size;
  TANDEM_CHECK_KIND(kInvalidArgument, n <= ws_.t_cap, "a batch of ", n,
                    " tokens exceeds the CUDA model's max_tokens ", ws_.t_cap);
  const auto nseq = static_cast<int64_t>(batch.seqs.size());
  const bool states = L.has_states();
  if (states) {
    TANDEM_CHECK_KIND(kInvalidArgument, nseq <= ws_.s_cap, "a batch of ", nseq,
                      " sequences exceeds the CUDA model's ", ws_.s_cap);
  }
  hidden_rows_.clear();
  if (n == 0 && !L.collective_steps()) {
    L.launched(batch, false);
    return false;
  }
  // NOTE: a decode EP rank with nothing to do still runs one (zero-token) step: its experts
  // serve the other ranks' tokens, and every rank makes the same collective calls per step.

  // Graph eligibility: a pure decode step (one token per sequence, its logits), or a verify
  // step (q tokens per sequence, logits of all, run as decode tokens of the attention), that
  // fits a bucket of sequences and the captured table width.
  const int64_t q = batch.seqs.empty() ? 1 : batch.seqs.front().num_tokens;
  bool graph = !batch.on_layer_kv && !buckets_.empty() && nseq <= buckets_.back() &&
               page_size == opts_.page_size && q >= 1 && q <= L.max_graph_q();
  int64_t width = 1;
  for (const auto& s : batch.seqs) {
    width = std::max(width, s.num_pages);
    graph =
        graph && s.num_tokens == q && s.logits == (q == 1 ? LogitsMode::kLast : LogitsMode::kAll);
  }
  if (graph) graph = width <= graph_width(page_size);
  int64_t bucket = graph ? *std::lower_bound(buckets_.begin(), buckets_.end(), nseq) : 0;
  if (graph && (bucket * q > ws_.t_cap || bucket * q > ws_.rows_cap)) {
    graph = false;
    bucket = 0;
  }
  // 1. Metadata on the host.
  StepLayout l;
  l.page_size = page_size;
  l.num_pages = g.num_pages;
  l.vocab = c_.vocab_size;
  l.rows_n = graph ? bucket * q : std::max<int64_t>(n, 1);  // n == 0: one padding token
  l.width = graph ? graph_width_ : width;
  l.num_seqs = graph ? bucket : std::max<int64_t>(1, nseq);
  l.pad_rows = graph;
  l.deltanet = states;
  l.state_slots = states ? kv.num_state_slots() : -1;
  l.pad_q = graph ? q : 1;
  l.state_out = state_out;
  const bool keep = L.keeps_inputs(graph, q, l.rows_n, batch);
  int64_t num_prefill = 0;
  const HostStepMeta hm = build_step_meta(batch, l, first_token_, num_prefill);
  for (size_t si = 0; si < batch.seqs.size(); ++si) {
    for (int64_t i = 0; i < batch.seqs[si].num_tokens; ++i) {
      hidden_rows_.push_back(static_cast<int32_t>(first_token_[si] + i));
    }
  }
  const ForwardBatch* eager_batch = n == 0 ? nullptr : &batch;

  if (!graph) {
    // 2a. Eager.
    StepMeta m = eager_meta(hm.tables.size());
    m.n = l.rows_n;
    m.width = width;
    m.num_rows = batch.num_logit_rows();
    m.num_seqs = l.num_seqs;
    m.num_prefill = num_prefill;
    upload(hm, m);
    plan_prefill(hm, m, page_size);
    L.body(m, kv, {eager_batch, false, keep});
    L.launched(batch, keep);
    return false;
  }

  // 2b. Graph replay (captured on first use of the bucket).
  StepMeta m = graph_meta(graphs_);
  m.n = l.rows_n;
  m.width = graph_width_;
  m.num_rows = l.rows_n;
  m.num_seqs = bucket;
  m.num_prefill = 0;  // a verify step's tokens as decode tokens of the attention (each attends
                      // to its own prefix): no host plan in the graph
  graphs_.bind({kv.layer_data(0), states ? kv.state_data(0) : nullptr,
                reinterpret_cast<const void*>(static_cast<intptr_t>(page_size))});
  replay(graphs_, graph_key(bucket, q), hm, m, [&](bool warmup) {
    L.body(m, kv, {nullptr, warmup, keep});
    L.head(0, m.n);
  });
  L.launched(batch, keep);
  return true;
}

const float* CudaRunner::forward_device(const ForwardBatch& batch, KvCache& kv) {
  const int64_t rows = batch.num_logit_rows();
  TANDEM_CHECK_KIND(kInvalidArgument, rows <= ws_.rows_cap, rows,
                    " logits rows exceed the CUDA model's ", ws_.rows_cap);
  if (!launch(batch, kv) && rows > 0) layers_->head(0, rows);
  return ws_.logits.as<float>();
}

void CudaRunner::forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) {
  const int64_t rows = batch.num_logit_rows(), v = c_.vocab_size;
  logits.clear();
  if (batch.num_tokens() == 0) {
    if (layers_->collective_steps()) {  // the zero-token step of a decode EP rank
      launch(batch, kv);
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    return;
  }
  logits.resize(static_cast<size_t>(rows * v));
  const bool done = launch(batch, kv);
  // The head in chunks of the logits buffer (prompt logprobs of a long chunk need many rows).
  for (int64_t begin = 0; begin < rows; begin += ws_.rows_cap) {
    const int64_t count = std::min(ws_.rows_cap, rows - begin);
    if (!done) layers_->head(begin, count);
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(logits.data() + begin * v, ws_.logits.as<float>(),
                                      static_cast<size_t>(count * v) * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_));
    // the next chunk's GEMM overwrites the buffer: the copy comes first (same stream)
  }
  if (batch.hidden_out != nullptr) copy_hidden(batch, *batch.hidden_out);  // synchronises
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaRunner::forward_sample(const ForwardBatch& batch, KvCache& kv,
                                const std::vector<DeviceSampling>& rows,
                                std::vector<SampledToken>& out,
                                const std::function<void()>& wait_masks) {
  const auto R = static_cast<int64_t>(rows.size());
  TANDEM_CHECK(R == batch.num_logit_rows(), "forward_sample: ", R, " sampling rows for ",
               batch.num_logit_rows(), " logits rows");
  out.clear();
  if (batch.num_tokens() == 0) {
    if (layers_->collective_steps()) {  // the zero-token step of a decode EP rank
      launch(batch, kv);
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    return;
  }
  const float* logits = forward_device(batch, kv);
  if (batch.hidden_out != nullptr) copy_hidden(batch, *batch.hidden_out);
  sample_rows(logits, rows, out, wait_masks);
}

void CudaRunner::sample_rows(const float* logits, const std::vector<DeviceSampling>& rows,
                             std::vector<SampledToken>& out,
                             const std::function<void()>& wait_masks) {
  const auto R = static_cast<int64_t>(rows.size());
  out.clear();
  if (R == 0) {
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  TANDEM_CHECK_KIND(kInvalidArgument, R <= ws_.rows_cap, R,
                    " sampling rows exceed the CUDA model's ", ws_.rows_cap);
  // The logits are the model's own device scratch: biases and masks are applied in place.
  ws_.sampler->sample(const_cast<float*>(logits), rows, wait_masks, out, stream_);
}

void CudaRunner::copy_hidden(const ForwardBatch& batch, std::vector<float>& out) {
  const int64_t n = batch.num_tokens(), h = c_.hidden_size;
  out.resize(static_cast<size_t>(n * h));
  if (n == 0) return;
  std::vector<uint16_t> dev(static_cast<size_t>(n * h));  // device token order
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(dev.data(), ws_.xn.as<void>(), dev.size() * sizeof(uint16_t),
                                    cudaMemcpyDeviceToHost, stream_));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  int64_t t = 0;  // batch order
  for (size_t si = 0; si < batch.seqs.size(); ++si) {
    const int64_t k = batch.seqs[si].num_tokens, first = first_token_[si];
    for (int64_t i = 0; i < k; ++i, ++t) {
      const uint16_t* src = dev.data() + (first + i) * h;
      float* dst = out.data() + t * h;
      for (int64_t j = 0; j < h; ++j) dst[j] = bf16_to_f32(src[j]);
    }
  }
}

void CudaRunner::capture_buckets(KvCache& kv, int64_t max_batch, int64_t q) {
  // bucket sequences of q tokens at positions 0.. of page 0, each on its own state slot (the
  // engine has handed out none yet; a sequence starting at 0 starts from a zero state, so what
  // these write is never read).
  if (buckets_.empty() || q > kv.geometry().page_size ||
      kv.geometry().page_size != opts_.page_size) {
    return;
  }
  const bool states = layers_->has_states();
  const std::vector<int32_t> tokens(static_cast<size_t>(q), 0);
  const int32_t page = 0;
  std::vector<int64_t> todo;
  for (const int64_t bucket : buckets_) {
    if (bucket > std::max<int64_t>(1, max_batch) || bucket * q > ws_.t_cap ||
        bucket * q > ws_.rows_cap || (states && bucket > kv.num_state_slots())) {
      break;
    }
    todo.push_back(bucket);
  }
  // Start-up progress (the serve's /health phase and its log): each graph as it is captured.
  LoadObserver* const obs = load_observer();
  int64_t done = 0;
  for (const int64_t bucket : todo) {
    ForwardBatch b;
    for (int64_t i = 0; i < bucket; ++i) {
      b.seqs.push_back({tokens.data(), q, 0, &page, 1,
                        q == 1 ? LogitsMode::kLast : LogitsMode::kAll,
                        states ? static_cast<int32_t>(i) : -1});
    }
    launch(b, kv);  // captures the (bucket, q) graph, then replays it once
    if (obs != nullptr) obs->on_graph(bucket, ++done, static_cast<int64_t>(todo.size()));
  }
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<int64_t> CudaRunner::captured_buckets() const {
  std::vector<int64_t> out;
  for (const int64_t k : graphs_.keys()) {
    if (k < kGraphKeyStride) out.push_back(k);
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> CudaRunner::captured_verify_graphs() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const int64_t k : graphs_.keys()) {
    if (k >= kGraphKeyStride) out.emplace_back(k % kGraphKeyStride, k / kGraphKeyStride + 1);
  }
  return out;
}

void CudaRunner::reset_graphs() {
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  graphs_.drop();
}

KvCache CudaRunner::make_kv_cache(const KvGeometry& g, bool states) {
  TANDEM_CHECK_KIND(kInvalidArgument, g.num_pages > 0 && g.page_size > 0, "bad KV cache size");
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const size_t layer_bytes =
      static_cast<size_t>(g.page_elems() * g.num_pages) * dtype_size(g.dtype);
  // One allocation for all layers, zeroed: a captured step's padding tokens read page 0.
  auto pool = std::make_shared<DeviceMem>(layer_bytes * static_cast<size_t>(g.num_layers));
  TANDEM_CUDA_CHECK(cudaMemsetAsync(pool->as<void>(), 0, pool->size(), stream_));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  KvCache::External ext;
  for (int64_t l = 0; l < g.num_layers; ++l) {
    ext.layers.push_back(pool->as<uint8_t>() + static_cast<size_t>(l) * layer_bytes);
  }
  ext.owner = pool;
  ext.stream = stream_;
  if (states) {
    cudaStream_t s = stream_;
    const int device = opts_.device;
    ext.alloc_states = [s, device](size_t bytes) {
      TANDEM_CUDA_CHECK(cudaSetDevice(device));
      auto m = std::make_shared<DeviceMem>(bytes);
      TANDEM_CUDA_CHECK(cudaMemsetAsync(m->as<void>(), 0, bytes, s));
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
      return std::shared_ptr<void>(m, m->as<void>());
    };
    ext.copy_states = [s, device](void* dst, const void* src, size_t bytes, int kind) {
      TANDEM_CUDA_CHECK(cudaSetDevice(device));
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, static_cast<cudaMemcpyKind>(kind), s));
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    };
  }
  return KvCache(g, std::move(ext));
}

int64_t CudaRunner::kv_cache_budget_mb(double utilization) const {
  size_t free_b = 0, total_b = 0;
  TANDEM_CUDA_CHECK(cudaSetDevice(opts_.device));
  TANDEM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return kv_cache_mb_for(free_b, total_b, utilization);
}

int64_t CudaRunner::kv_cache_mb_hint() const {
  return opts_.gpu_memory_utilization > 0 ? kv_cache_budget_mb(opts_.gpu_memory_utilization) : 0;
}

}  // namespace tandem::cuda_model
