// Structured outputs on the GPU: a packed token bitmask (xgrammar's layout: bit id % 32 of
// int32 word id / 32 set = token allowed) applied to logits in place, disallowed logits set to
// -inf. The CPU reference is tandem::apply_token_bitmask (src/engine/sampling.h). Also sparse
// additive logit biases (OpenAI logit_bias; the CPU reference is the last step of
// tandem::apply_penalties). Asynchronous, no allocation, CUDA-graph safe (the grids depend only
// on rows and vocab, or on the entry count).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/dtype.h"

namespace tandem::cuda {

struct TokenBitmaskParams {
  void* logits;             // [rows, vocab] fp32 or bf16, row-major, contiguous; modified
  DType dtype;              // kF32 or kBF16
  int32_t const* bitmask;   // [mask_rows, words] words >= ceil(vocab / 32)
  int32_t const* mask_row;  // [rows]: the bitmask row of each logits row, -1: unmasked;
                            // nullptr: logits row r uses bitmask row r
  int64_t rows, vocab, words;
};

/// Launches on `stream`; throws Error(kInvalidArgument) for bad shapes or dtype.
void apply_token_bitmask_launch(TokenBitmaskParams const& p, cudaStream_t stream);

/// One additive bias: logits[row, id] += bias (-inf: the token is never chosen).
struct LogitBiasEntry {
  int32_t row;
  int32_t id;
  float bias;
};

struct LogitBiasParams {
  float* logits;                  // [rows, vocab] fp32, row-major, contiguous; modified
  LogitBiasEntry const* entries;  // [count], distinct (row, id) pairs (no write races)
  int64_t count, vocab;
};

/// Launches on `stream` (nothing when count is 0). The entries are not checked on the device:
/// the caller keeps rows < the logits rows and 0 <= id < vocab.
void apply_logit_bias_launch(LogitBiasParams const& p, cudaStream_t stream);

}  // namespace tandem::cuda
