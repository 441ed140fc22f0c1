// The input of a CPU model's MTP layer (Qwen3-MoE and Qwen3.5 alike): position t takes its
// final hidden state h_t and the next token t + 1.
#pragma once

#include <cstdint>
#include <vector>

#include "kv/kv_cache.h"
#include "model/config.h"
#include "model/forward_batch.h"

namespace tandem {

/// The flattened batch of a CPU MTP pass, after its checks: the MTP KV cache is one layer of the
/// model's KV heads and head_dim, every token id is in the vocabulary.
FlatBatch mtp_flat_batch(const ModelConfig& c, const ForwardBatch& batch, const KvCache& kv);

/// x [n, hidden] = fc([RMSNorm_e(embed(ids)); RMSNorm_h(hidden)]); `norm_e` / `norm_h` as the
/// model stores them (Qwen3.5's already 1 + w), `fc` [hidden, 2 hidden].
std::vector<float> cpu_mtp_input(const ModelConfig& c, const float* embed, const float* norm_e,
                                 const float* norm_h, const float* fc, const int32_t* ids,
                                 const float* hidden, int64_t n);

}  // namespace tandem
