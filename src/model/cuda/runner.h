// The CUDA model runner: what every architecture's GPU model needs around its layers, written
// once. An architecture (Qwen3MoeCuda, Qwen35MoeCuda) holds its weights and layer bodies and
// implements CudaLayers; the runner owns the rest:
//   - the device, the stream, the step sizes (max tokens, logits rows, sequences) and the
//     buffers every step uses (Workspace: the residual stream, the final hidden states, the
//     logits rows, the split-KV workspace, the GEMM plans, the device sampler, the FlashInfer
//     prefill plan);
//   - one step's metadata: packed on the host (build_step_meta: ids, positions, KV slots, block
//     tables, logits rows, and for hybrids the DeltaNet sequences with their state slots), then
//     copied up through one pinned staging buffer (StepMeta's device arrays);
//   - CUDA graphs: batch-size buckets, capture on first use after an eager warm-up run over the
//     padding (no KV or state written), replay, invalidation when the cache moves (GraphSet);
//     one set for the target's decode and verify steps, more for an architecture's own passes
//     (Qwen3.5's MTP passes);
//   - forward / forward_sample / the hidden states in batch order / warm-up captures;
//   - the KV cache in device memory (HND pools, hybrid state slots) and the KV budget.
// One step (launch):
//   1. the batch's metadata is packed on the host: the tokens of multi-token chunks first (the
//      attention's prefill kernel takes them), then the one-token sequences; logits rows in
//      batch order;
//   2. a pure decode step (one token per sequence, its logits) or a verify step (2..5 tokens per
//      sequence, logits of all) of n sequences <= the largest bucket replays the graph of the
//      smallest bucket >= n, padded (padding tokens write no KV, padding sequences no state);
//      anything else runs eagerly;
//   3. the logits rows' fp32 logits come back (forward), or stay on the device (forward_device),
//      or are sampled there (forward_sample: only tokens and logprobs come back).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_sm90.h"
#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/cuda/cuda_mem.h"
#include "model/cuda/options.h"
#include "model/forward_batch.h"
#include "model/safetensors.h"

namespace tandem::cuda {
class GemmLt;
}

namespace tandem::cuda_model {

class DeviceSampler;

/// Batch-size buckets decode and verify graphs are captured for: 1, 2, 4, then every 8 to 32,
/// every 16 to 128, every 32 to 320 and every 64 to kMaxGraphBatch (a replay pads a batch to its
/// bucket: by at most 20% above 256).
inline constexpr int64_t kGraphBuckets[] = {1,   2,   4,   8,   16,  24,  32,  48,  64,  80,  96,
                                            112, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512};
/// The largest decode batch a graph replays (--max-num-seqs above it runs larger steps eagerly).
inline constexpr int64_t kMaxGraphBatch = 512;
/// The buckets for max_seqs running sequences: kGraphBuckets up to max_seqs, then
/// min(max_seqs, kMaxGraphBatch) when it is not one of them (so that the largest batch pads
/// nothing).
std::vector<int64_t> graph_buckets(int64_t max_seqs);
/// Most tokens per sequence a graph replays: 1 (decode) or K + 1 for K up to 4 (verify).
inline constexpr int64_t kMaxGraphTokensPerSeq = 5;

/// Device arrays of one step's metadata (every architecture reads its part).
struct StepMeta {
  int32_t* ids = nullptr;        // [n]
  int32_t* positions = nullptr;  // [n]
  int32_t* token_seq = nullptr;  // [n]: the attention's sequence (block-table row) of each token
  int32_t* rows = nullptr;       // [num_rows]: token index of each logits row
  int64_t* slots = nullptr;      // [n]: KV slot (-1: none)
  int32_t* tables = nullptr;     // [num_seqs, width]
  int32_t* num_real = nullptr;   // [1]: real (unpadded) tokens (the decode EP dispatch)
  // DeltaNet sequences in token order (hybrids).
  int32_t* dn_begin = nullptr;      // [num_seqs + 1]
  int32_t* dn_token_seq = nullptr;  // [n]
  int32_t* dn_slot = nullptr;       // [num_seqs]
  int32_t* dn_fresh = nullptr;      // [num_seqs]
  int32_t* dn_slot_out = nullptr;   // [num_seqs]: where the state goes (dn_slot: in place)
  int64_t n = 0, width = 0, num_rows = 0, num_seqs = 0;
  int64_t num_prefill = 0;  // leading tokens that belong to multi-token chunks
  const cuda::PrefillAttentionPlan* prefill_plan = nullptr;  // FlashInfer sm90, when planned
};

/// StepMeta's arrays on the host.
struct HostStepMeta {
  std::vector<int32_t> ids, positions, token_seq, tables, rows;
  std::vector<int64_t> slots;
  std::vector<int32_t> dn_begin, dn_token_seq, dn_slot, dn_fresh, dn_slot_out;
  int32_t num_real = 0;
};

/// How build_step_meta lays a batch out.
struct StepLayout {
  int64_t page_size = 0, num_pages = 0, vocab = 0;
  int64_t rows_n = 0;        // tokens the kernels see: the batch's n, then padding
  int64_t width = 1;         // block-table row width
  int64_t num_seqs = 0;      // block-table rows (the batch's sequences, then padding ones)
  bool pad_rows = false;     // every padding token is a logits row (a graph's fixed shape)
  bool deltanet = false;     // fill the DeltaNet sequence arrays
  int64_t state_slots = -1;  // >= 0: every sequence needs a state slot below it
  int64_t pad_q = 1;         // tokens per padding sequence (a verify graph's q)
  const std::vector<int32_t>* state_out = nullptr;  // per sequence: its state's slot (-1: own)
};

/// The host metadata of `batch` (n real tokens padded to rows_n). first_token: each sequence's
/// first device token; num_prefill: the tokens of multi-token chunks (they come first). Padding
/// sequences have pad_q tokens each at positions 0.., no KV slot and no state slot. Throws on a
/// short block table, a page outside the cache, a token id outside the vocabulary or (with
/// state_slots >= 0) a sequence without a state slot.
HostStepMeta build_step_meta(const ForwardBatch& batch, const StepLayout& l,
                             std::vector<int64_t>& first_token, int64_t& num_prefill);

/// The buffers every step uses (sized by CudaRunner::allocate).
struct Workspace {
  int64_t t_cap = 0;     // tokens of one step
  int64_t rows_cap = 0;  // logits rows of one step
  int64_t s_cap = 0;     // sequences of one step
  DeviceMem x, xn, y;    // [t_cap, hidden] bf16: residual, normed, block output
  DeviceMem last;        // [t_cap, hidden] bf16: the logits rows' final hidden states
  DeviceMem logits;      // [rows_cap, vocab] fp32
  DeviceMem attn_ws;     // split-KV workspace of the decode attention
  size_t attn_ws_floats = 0;
  std::unique_ptr<cuda::GemmLt> gemm;
  std::unique_ptr<DeviceSampler> sampler;
  cuda::PrefillAttentionPlan prefill_plan;  // eager prefill chunks: planned once per step
  int num_sms = 0;
};

/// The attention an architecture's steps run (for split-KV and the prefill plan).
struct AttentionShape {
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;  // this rank's
  bool prefill_plan = true;                         // plan FlashInfer's prefill for eager chunks
  bool kv_fp8 = false;  // the target's pools hold E4M3 codes (CudaModelOptions::kv_cache_fp8)
};

/// A layer's FP8 KV scales (CudaModelOptions::kv_cache_fp8).
struct KvScales {
  float k = 1.f, v = 1.f;
};
/// The scales of the attention layer whose tensors start with `prefix` (e.g.
/// "model.layers.3."): `prefix`self_attn.k_scale and .v_scale when the checkpoint has them (one
/// element each: a per-tensor scale, as vLLM's fp8 KV checkpoints), else 1.0. Throws
/// kUnsupported for a scale of more than one element (per-head scales) and kInvalidArgument
/// for one that is not finite and positive.
KvScales read_kv_scales(const Checkpoint& ckpt, const std::string& prefix);
/// kUnsupported unless the KV dtype can be used with these options (fp8: not with
/// deterministic); `what` names the model.
void check_kv_cache_dtype(const CudaModelOptions& opts, const char* what);

/// What an architecture gives the runner: one step's layers over StepMeta, and its head.
class CudaLayers {
 public:
  struct Args {
    const ForwardBatch* batch = nullptr;  // the eager batch (its on_layer_kv hook); null in graphs
    bool warmup = false;                  // a graph's first run, padding only: no collective call
    bool keep = false;                    // keep the DeltaNet layers' inputs (replay_states)
  };
  virtual ~CudaLayers() = default;
  /// Embedding -> layers -> final norm (Workspace::xn, device token order) -> the logits rows'
  /// hidden states gathered into Workspace::last.
  virtual void body(const StepMeta& m, KvCache& kv, const Args& a) = 0;
  /// fp32 logits of rows [begin, begin + count) of Workspace::last into logits[0, count).
  virtual void head(int64_t begin, int64_t count) = 0;
  /// Throws unless `kv` was made for this model.
  virtual void check_cache(const KvCache& kv) const = 0;
  virtual AttentionShape attention() const = 0;
  /// True when every rank of the group must run every step, an empty one included (a decode
  /// EP rank: its experts serve the other ranks' tokens).
  virtual bool collective_steps() const { return false; }
  /// True when the layers keep per-sequence state slots (hybrids): steps carry DeltaNet arrays.
  virtual bool has_states() const { return false; }
  /// Most tokens per sequence a graph may replay (1: decode graphs only).
  virtual int64_t max_graph_q() const { return kMaxGraphTokensPerSeq; }
  /// Whether this step (a graph's or not, q tokens per sequence when uniform, rows_n tokens
  /// with padding) keeps the DeltaNet inputs (called before its metadata; may grow buffers).
  virtual bool keeps_inputs(bool graph, int64_t q, int64_t rows_n, const ForwardBatch& batch) {
    return false;
  }
  /// After a step of `batch` is enqueued (runner's first_token / hidden_rows are its).
  virtual void launched(const ForwardBatch& batch, bool keep) {}
};

/// CUDA graphs of one kind of step, with the metadata buffers they read, by key. Dropped when
/// what they were captured against (KV pools, state slots, page size) changes.
class GraphSet {
 public:
  GraphSet() = default;
  GraphSet(const GraphSet&) = delete;
  GraphSet& operator=(const GraphSet&) = delete;
  ~GraphSet() { drop(); }
  void drop();
  /// Drops every graph unless `inputs` is what they were captured against.
  void bind(const std::vector<const void*>& inputs);
  /// Drops the graphs whose key satisfies `pred`.
  void drop_if(const std::function<bool(int64_t)>& pred);
  cudaGraphExec_t find(int64_t key) const;
  void add(int64_t key, cudaGraphExec_t exec) { graphs_[key] = exec; }
  std::vector<int64_t> keys() const;
  bool empty() const { return graphs_.empty(); }
  DeviceMem meta, tables;  // the graphs' own metadata arrays (allocated on first use)

 private:
  std::map<int64_t, cudaGraphExec_t> graphs_;
  std::vector<const void*> inputs_;
};

/// Key of a target step's graph: (tokens per sequence - 1) * kGraphKeyStride + bucket.
inline constexpr int64_t kGraphKeyStride = 1 << 20;
constexpr int64_t graph_key(int64_t bucket, int64_t q) {
  return (q - 1) * kGraphKeyStride + bucket;
}

class CudaRunner {
 public:
  /// Checks the device, makes the stream, picks the buckets (none without opts.cuda_graphs).
  CudaRunner(const ModelConfig& config, const CudaModelOptions& opts);
  ~CudaRunner();
  CudaRunner(const CudaRunner&) = delete;
  CudaRunner& operator=(const CudaRunner&) = delete;

  /// The layers steps run (the architecture; set before the first step).
  void set_layers(CudaLayers* layers) { layers_ = layers; }
  /// No graphs (e.g. prefill TP ranks: their batches are prompts).
  void clear_buckets() { buckets_.clear(); }
  /// Sizes the workspace (after the weights: what is left is the KV's).
  void allocate(bool batch_invariant);

  const ModelConfig& config() const { return c_; }
  const CudaModelOptions& options() const { return opts_; }
  cudaStream_t stream() const { return stream_; }
  int device() const { return opts_.device; }
  Workspace& ws() { return ws_; }
  const Workspace& ws() const { return ws_; }
  const std::vector<int64_t>& buckets() const { return buckets_; }
  /// The graphs' block-table width for page_size (the context a graph can address).
  int64_t graph_width(int64_t page_size);

  /// The paged attention of m's tokens over one layer's pool (q: [n, q_heads, head_dim] with
  /// RoPE applied, out: the same shape), split-KV as pick_split chose (`split`).
  cuda::PagedAttentionParams attention_params(const StepMeta& m, const void* q, const void* pool,
                                              void* out, int64_t page_size, int64_t split) const;
  /// Split-KV for the decode tokens of an n-token step (flash-decoding) when the workspace
  /// holds it; 0: none.
  int64_t pick_split(int64_t n, int64_t num_prefill, int64_t width, int64_t page_size) const;

  /// One step of the architecture's layers: from a graph (returns true: the logits of every
  /// row are computed) or eagerly up to the logits rows' hidden states (returns false: the
  /// head is the caller's). state_out (hybrids, per sequence): its state's slot after the step.
  bool launch(const ForwardBatch& batch, KvCache& kv,
              const std::vector<int32_t>* state_out = nullptr);
  /// As launch, the head run too: the fp32 logits rows [num_logit_rows, vocab] on the device
  /// (valid until the next call; ordered on stream()).
  const float* forward_device(const ForwardBatch& batch, KvCache& kv);
  /// Model::forward.
  void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits);
  /// Model::forward_sample.
  void forward_sample(const ForwardBatch& batch, KvCache& kv,
                      const std::vector<DeviceSampling>& rows, std::vector<SampledToken>& out,
                      const std::function<void()>& wait_masks = {});
  /// Samples logits rows [rows.size(), vocab] on the device (biases and masks applied in
  /// place, after wait_masks()); synchronises.
  void sample_rows(const float* logits, const std::vector<DeviceSampling>& rows,
                   std::vector<SampledToken>& out, const std::function<void()>& wait_masks = {});
  /// The last launch's final hidden states (Workspace::xn) in batch order, fp32 (synchronises).
  void copy_hidden(const ForwardBatch& batch, std::vector<float>& out);
  /// Captures the graphs of q tokens per sequence (1: decode, 2..5: verify) of every bucket
  /// up to max_batch (sequences at positions 0.. of page 0, each on its own state slot).
  void capture_buckets(KvCache& kv, int64_t max_batch, int64_t q);

  /// Uploads `hm` into m's arrays (tables into m.tables) through the pinned staging.
  void upload(const HostStepMeta& hm, const StepMeta& m);
  /// The arrays of a metadata buffer (eager: the runner's own; graphs: a GraphSet's).
  StepMeta meta_at(const DeviceMem& buffer) const;
  /// A metadata buffer (meta_at's layout).
  DeviceMem make_meta_buffer() const;
  /// The eager metadata arrays, block tables room for `tables` ints.
  StepMeta eager_meta(size_t tables);
  /// A graph set's metadata arrays (allocated on first use: the largest bucket's tables).
  StepMeta graph_meta(GraphSet& set);
  /// Plans FlashInfer's prefill for the leading num_prefill tokens of an eager step (when the
  /// layers plan; for FP8 pools when AttentionShape::kv_fp8): sets m.prefill_plan when it
  /// planned.
  void plan_prefill(const HostStepMeta& hm, StepMeta& m, int64_t page_size);
  /// Runs `record` (the kernels of one step over m) from set's graph at `key`, captured on first
  /// use after an eager run of `record(true)` over hm with its padding only (no KV or state
  /// written); hm is uploaded before the replay, then `after_upload` runs.
  void replay(GraphSet& set, int64_t key, const HostStepMeta& hm, const StepMeta& m,
              const std::function<void(bool warmup)>& record,
              const std::function<void()>& after_upload = {});

  /// The target steps' graphs.
  GraphSet& graphs() { return graphs_; }
  /// Batch buckets of the decode graphs captured so far.
  std::vector<int64_t> captured_buckets() const;
  /// (bucket, tokens per sequence) of the verify graphs captured so far.
  std::vector<std::pair<int64_t, int64_t>> captured_verify_graphs() const;
  /// Drops every target graph (synchronises).
  void reset_graphs();

  /// The last launch's device token of each sequence's first token, and of each of its tokens
  /// in batch order (the rows of Workspace::xn).
  const std::vector<int64_t>& first_token() const { return first_token_; }
  std::vector<int64_t>& first_token() { return first_token_; }
  const std::vector<int32_t>& hidden_rows() const { return hidden_rows_; }

  /// Device pools of `g` (one allocation, zero-filled: a padding token of a graph may read any
  /// page), with device state slots when `states` (zero-filled, copied on the stream).
  KvCache make_kv_cache(const KvGeometry& g, bool states);
  /// kv_cache_mb_for() with this device's free and total memory now.
  int64_t kv_cache_budget_mb(double utilization) const;
  /// CudaModelOptions::gpu_memory_utilization's budget, 0 without one.
  int64_t kv_cache_mb_hint() const;

 private:
  const ModelConfig& c_;
  CudaModelOptions opts_;
  cudaStream_t stream_ = nullptr;
  CudaLayers* layers_ = nullptr;
  std::vector<int64_t> buckets_;
  Workspace ws_;
  int64_t graph_width_ = 0;
  DeviceMem e_meta_, e_tables_;
  PinnedMem h_meta_, h_tables_;
  cudaEvent_t meta_copied_ = nullptr;
  GraphSet graphs_;
  std::vector<int64_t> first_token_;
  std::vector<int32_t> hidden_rows_;
};

}  // namespace tandem::cuda_model
