// What a CUDA model is built with (every architecture, every role): the device, the step sizes
// the runner is sized for, CUDA graphs, the shard this rank holds and the weight formats.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "model/shard.h"

namespace tandem {

namespace comm {
class TcpStore;
}

struct CudaModelOptions {
  int device = 0;
  /// Most tokens in one forward (the engine's max_num_batched_tokens, or more).
  int64_t max_tokens = 8192;
  /// Most sequences in one forward (the engine's max_num_seqs).
  int64_t max_seqs = 256;
  /// Capture decode steps in CUDA graphs.
  bool cuda_graphs = true;
  /// Context a captured decode step can address (its block tables' width); 0: the model's
  /// max_position_embeddings. Longer sequences run eagerly.
  int64_t graph_max_context = 0;
  /// Page size the graphs are captured for (the engine's page size).
  int64_t page_size = 16;
  /// MTP speculative decoding: replay the chained (one-token) draft passes in CUDA graphs by
  /// batch bucket, and capture them and the verify graphs of the configured K at warm-up
  /// (Model::warm_up_speculative). On by default (as fast as eager draft passes, docs/perf.md,
  /// and warm-up moves the captures out of serving); false: passes eager, verify graphs captured
  /// on first use.
  bool mtp_graphs = true;
  /// For benchmarks: force the MoE layer's path for eager (prefill) batches: "" (auto), "mma",
  /// "cublas" or "padded" (backend/cuda/moe_layer.h).
  std::string moe_prefill_path;
  /// > 0: kv_cache_mb_hint() is what this share of the device's memory leaves after the model
  /// (vLLM's --gpu-memory-utilization); 0: no hint.
  double gpu_memory_utilization = 0;
  /// Which slice of the model this rank holds (model/shard.h): the whole model (kSingle),
  /// prefill TP/EP (heads and experts split, o_proj and the MoE block all-reduced with our
  /// one-shot / two-shot kernels, vocab-parallel lm_head) or decode DP/EP (attention
  /// replicated, experts split, tokens to their experts by our CUDA-IPC dispatch / combine
  /// inside the decode graphs).
  ShardSpec shard;
  /// Block-FP8 checkpoints (quantization_config fp8, 128-wide blocks): keep the quantized
  /// linears E4M3 in device memory with their block scales (half bf16's bytes; the FP8 kernels
  /// of backend/cuda/fp8_linear.h). false, or TANDEM_CUDA_FP8=0 in the environment: dequantize
  /// them to bf16 at load (the comparison path). random() keeps FP8 when its config says
  /// block FP8. MXFP8 checkpoints are dequantized to bf16 either way.
  bool fp8_weights = true;
  /// With fp8_weights: the dense linears (attention, DeltaNet, shared expert, dense MLP) FP8 too
  /// (model/cuda/dense_linear.h); false: only the routed experts stay FP8, the dense linears
  /// are dequantized to bf16 at load (a benchmark's comparison: bench_qwen35_cuda
  /// --fp8-dense-bf16).
  bool fp8_dense = true;
  /// Batch-invariant numerics (--deterministic, model/cuda/batch_invariant.h): a request's
  /// logits are bitwise the same alone, batched with any others, chunked or after a prefix-cache
  /// hit, in graphs or eager. Slower prefill attention (every token on the decode kernel);
  /// block-FP8 weights dequantized to bf16 at load; one GPU only (kUnsupported when sharded);
  /// no MTP (load_mtp refuses it: drafts would depend on the batch).
  bool deterministic = false;
  /// --kv-cache-dtype fp8 (vLLM's): the target's KV cache holds E4M3 codes (1 byte an element:
  /// twice the pages of bf16 for the same memory), quantized as the KV is written with each
  /// attention layer's k / v scale from the checkpoint (self_attn.k_scale / v_scale, per
  /// tensor) or 1.0, dequantized in the attention kernels (backend/cuda/attention.h). Qwen3-MoE
  /// and Qwen3.5; not with deterministic or MTP (kUnsupported). The MTP layer's cache stays
  /// bf16.
  bool kv_cache_fp8 = false;
  /// The group's bootstrap store (required when shard.size > 1; one process per rank): the
  /// rank's CUDA communicators rendezvous through it. Kept alive by the model.
  std::shared_ptr<comm::TcpStore> store;
};

}  // namespace tandem
