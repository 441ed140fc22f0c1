// "Will it fit?": the device memory one rank of an instance needs for a checkpoint, from its
// config.json alone (no weights read), and what is left for KV pages and recurrent states.
//
// Per rank (rank 0, the largest: a vocab-parallel head's last shard is the short one):
//   weights      every tensor the CUDA loaders keep (model/cuda/qwen3_moe_cuda.cpp,
//                qwen3_5_moe_cuda.cpp allocate_weights), sliced by ShardPlan::make (q / KV heads,
//                experts E/t or E/d, lm_head vocab rows) and, for Qwen3.5 under prefill TP,
//                DeltaNetHeads::of (the DeltaNet projections, conv channels and per-head
//                parameters) and the shared expert's intermediate / t. Formats as the loaders
//                keep them: bf16 2 bytes; a block-FP8 linear 1 byte per weight + an fp32 scale
//                per row and 128 columns ([N, ceil(K/128)], the block scale repeated per row);
//                MXFP8 dequantized to bf16 (the loaders' default) or, with mxfp8_native, 1 byte +
//                one E8M0 byte per 32. Embedding, lm_head, router, norms, the shared-expert gate
//                and conv1d bf16; A_log, dt_bias and the DeltaNet output norm fp32; DeltaNet's
//                in_proj_b / in_proj_a rows are part of Qwen35MoeCuda's one in_proj matrix (FP8
//                when in_proj_qkv and in_proj_z are). MTP weights are not counted.
//   activations  an estimate of the buffers sized at load (MemoryPlan::activation_formula).
//   KV + state   budget - weights - activations, with budget = gpu_memory * utilization (the
//                loaders' --gpu-memory-utilization rule). The engine holds state_slots_per_seq
//                state slots per sequence (one running slot, one prefix-cache checkpoint, one
//                spare while speculating) out of the same budget as the pages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/shard.h"

namespace tandem {

struct MemoryPlanOptions {
  ShardMode mode = ShardMode::kSingle;  // serve: kSingle; prefill: TP=EP; decode: DP=EP
  int ranks = 1;
  double gpu_memory_bytes = 141e9;  // one GPU's memory (H200: 141 GB)
  double gpu_memory_utilization = 0.9;
  int64_t max_model_len = 0;           // 0: max_position_embeddings
  int64_t page_size = 16;              // tokens per KV page
  int64_t max_num_seqs = 64;           // running sequences per rank
  int64_t max_num_batched_tokens = 0;  // tokens per step; 0: 1024 (prefill, serve) or 4096 (decode)
  int64_t kv_cache_bytes_per_elem = 2;  // 2: bf16; 1: FP8 KV cache
  bool prefix_cache = true;             // a hybrid's prefix cache: one checkpoint slot per seq
  bool speculative = false;             // a hybrid speculating: one spare slot per seq
  bool mxfp8_native = false;            // MXFP8 kept as codes + E8M0 (TANDEM_CUDA_MXFP8=native)
};

/// Weight bytes of one rank by kind.
struct WeightBytes {
  int64_t embedding = 0;      // embed_tokens (every rank holds it whole)
  int64_t lm_head = 0;        // this rank's vocab rows (0 when tied to the embedding)
  int64_t attention = 0;      // full-attention q / k / v / o (+ q_norm, k_norm)
  int64_t deltanet = 0;       // gated DeltaNet projections, conv1d, per-head parameters, norm
  int64_t experts = 0;        // this rank's routed experts
  int64_t shared_expert = 0;  // Qwen3.5: the shared expert and its gate
  int64_t dense_mlp = 0;      // Qwen3-MoE dense (mlp_only) layers
  int64_t router = 0;
  int64_t norms = 0;  // layer and final norms
  int64_t total() const {
    return embedding + lm_head + attention + deltanet + experts + shared_expert + dense_mlp +
           router + norms;
  }
};

struct MemoryPlan {
  MemoryPlanOptions options;        // as used (defaults filled in)
  ShardPlan shard;                  // rank 0's
  std::string weight_format;        // "bf16", "block FP8 (...)", ...
  WeightBytes weights;              // rank 0
  int64_t weights_all_ranks = 0;    // every rank's weights summed (replicas counted each time)
  int64_t budget = 0;               // gpu_memory * utilization
  int64_t activations = 0;          // the estimate
  int64_t kv_state_bytes = 0;       // budget - weights - activations (may be negative)
  int64_t kv_bytes_per_token = 0;   // over the attention layers, this rank's KV heads
  int64_t state_bytes_per_seq = 0;  // one slot (hybrids), 0 otherwise
  int64_t state_slots_per_seq = 0;  // slots the engine holds per sequence (hybrids)
  int64_t page_bytes = 0;           // one page over all layers
  int64_t pages_per_seq = 0;        // a sequence of max_model_len
  int64_t num_pages = 0;            // what the engine would get with max_num_seqs' state slots
  int64_t max_batch = 0;            // sequences of max_model_len that fit (states included)
  int64_t max_context = 0;          // tokens one sequence can hold (batch 1), page-rounded
  bool fits = false;
  std::string refusal;  // why not, naming what does not fit and by how much (fits false)

  /// The activation estimate's formula with this plan's numbers.
  std::string activation_formula;
  /// A human-readable report (GB = 1e9 bytes), or the refusal.
  std::string describe(const ModelConfig& c) const;
};

/// The memory of rank 0 of an instance of `c` in `o`'s layout. Throws Error(kInvalidArgument)
/// when the layout does not split the model (ShardPlan::make, DeltaNetHeads::of) or an option is
/// out of range; a layout that splits but does not fit returns fits = false with `refusal`.
MemoryPlan plan_memory(const ModelConfig& c, MemoryPlanOptions o);

/// Bytes of one [n, k] linear stored as the loaders keep it: bf16, or quantized per `q`
/// (exposed for tests).
int64_t linear_bytes(int64_t n, int64_t k, const QuantConfig& q, bool mxfp8_native);

}  // namespace tandem
