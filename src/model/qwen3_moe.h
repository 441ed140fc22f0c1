// Qwen3-MoE on the CPU backend: weights loaded from a Hugging Face checkpoint, forward over
// paged HND KV.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/forward_batch.h"

namespace tandem {

class Checkpoint;

/// The interface every model implementation (CPU now, CUDA later) offers the engine.
class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelConfig& config() const = 0;
  /// KV geometry for a cache of num_pages pages of page_size tokens.
  virtual KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const = 0;
  /// Runs the batch, writing new KV into `kv` and the requested logits rows
  /// ([batch.num_logit_rows(), vocab], fp32) into `logits`.
  virtual void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) = 0;
};

/// Qwen3-MoE forward on the CPU, fp32 weights and accumulation.
class Qwen3MoeCpu final : public Model {
 public:
  /// Loads config.json and the safetensors weights of `dir`. Errors name file and tensor.
  static std::unique_ptr<Qwen3MoeCpu> load(const std::string& dir);

  const ModelConfig& config() const override { return config_; }
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const override;
  void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) override;

 private:
  struct Layer {
    HostTensor input_norm;   // [hidden]
    HostTensor post_norm;    // [hidden]
    HostTensor q_norm;       // [head_dim]
    HostTensor k_norm;       // [head_dim]
    HostTensor qkv;          // [(q_heads + 2 kv_heads) * head_dim, hidden]
    HostTensor o;            // [hidden, q_heads * head_dim]
    bool moe = false;
    HostTensor router;                  // [experts, hidden]
    std::vector<HostTensor> gate_up;    // per expert (or one dense): [2 * inter, hidden]
    std::vector<HostTensor> down;       // per expert (or one dense): [hidden, inter]
    std::vector<const float*> gate_up_ptrs, down_ptrs;
  };

  explicit Qwen3MoeCpu(ModelConfig config) : config_(std::move(config)) {}
  void load_weights(const Checkpoint& ckpt);

  ModelConfig config_;
  HostTensor embed_;   // [vocab, hidden]
  HostTensor norm_;    // [hidden]
  HostTensor lm_head_; // [vocab, hidden]; empty when tied
  std::vector<Layer> layers_;
};

}  // namespace tandem
