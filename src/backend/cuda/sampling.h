// Logits post-processing and sampling on the GPU: greedy, temperature, top-k, top-p, min-p,
// the chosen token's logprob and the top-n logprobs, per-row parameters. Without a workspace
// one CTA per row; with one (SampleParams::workspace) each row is split over several CTAs so
// that small batches use the whole GPU (same tokens, see SampleParams::workspace).
// Framework-free: a params struct in, a stream; the launch is asynchronous and CUDA-graph safe
// (no host sync, no allocation; the grid depends only on rows).
//
// Semantics follow the CPU sampler (src/engine/sampling.h) exactly, except:
//   - penalties (repetition / presence / frequency) are NOT applied here: the engine applies
//     them on the host (or to the logits before this launch) for rows that use them;
//   - the random stream differs: the CPU draws one mt19937_64 value per token, the GPU one
//     53-bit uniform u per row from a counter-based Philox4x32-10 keyed by (seed, counter),
//     independent of the row index, and takes the inverse CDF of the kept fixed-point weights
//     (w * 2^40 rounded) in token-id order at u, so a request gets the same token for the same
//     (seed, counter) whatever its batch and whichever path runs. The distribution over tokens
//     is the same (up to the 2^-40 rounding of each weight); the individual draws are not.
// Order (as the CPU): temperature, top-k, top-p over the top-k renormalised distribution,
// min-p relative to the most likely token, then one categorical draw. The kept set is a prefix
// of the order (logit desc, id asc), so ties at the cut keep the lower ids, as the CPU does.
// Logprobs are log_softmax of the RAW logits (not tempered or filtered), as the CPU engine
// reports them; the top-n are sorted by logprob desc, ties -> lower id, NaN last.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace tandem::cuda {

/// Most top logprobs per row (OpenAI's limit).
inline constexpr int kMaxTopLogprobs = 20;

/// Per-row sampling parameters (device array, one per row). POD: fill on the host, copy up.
struct SamplingRowParams {
  float temperature = 1.0f;  // < 1e-5: greedy (argmax of the raw logits, ties -> lowest id)
  int32_t top_k = 0;         // <= 0 or >= vocab: off
  float top_p = 1.0f;        // (0, 1]; >= 1: off
  float min_p = 0.0f;        // [0, 1]; <= 0: off
  uint64_t seed = 0;         // the request's seed
  uint64_t counter = 0;      // a per-draw counter (e.g. the request's output position)
  int32_t want_logprob = 0;  // 1: write the chosen token's logprob
  int32_t n_top = 0;         // top logprobs to write, [0, kMaxTopLogprobs]
};

/// One sampled token per row.
/// Outputs: tokens[r]; logprobs[r] = log_softmax(raw)[tokens[r]] when want_logprob, NaN
/// otherwise; top_ids / top_logprobs[r, j] for j < min(n_top, vocab), the rest id -1 and
/// logprob -inf. logprobs / top_ids / top_logprobs may be nullptr when no row asks for them.
/// NaN logits count as -inf. vocab <= 2^23 (fixed-point probability mass, see sampling.cu).
struct SampleParams {
  void const* logits;                   // [rows, vocab] fp32 or bf16, row-major, contiguous
  DType dtype;                          // kF32 or kBF16
  SamplingRowParams const* row_params;  // [rows]
  int32_t* tokens;                      // [rows]
  float* logprobs;                      // [rows]
  int32_t* top_ids;                     // [rows, kMaxTopLogprobs]
  float* top_logprobs;                  // [rows, kMaxTopLogprobs]
  int64_t rows, vocab;
  // Scratch for the multi-CTA path, at least sample_workspace_bytes(rows, vocab) bytes (8-byte
  // aligned; no initialisation needed; its contents are scratch between launches). nullptr:
  // the single-CTA path (one CTA per row). Both paths give the same tokens (the same kept set
  // and the same draw for the same (seed, counter)) and the same top-n ids; logprob values may
  // differ in the last bits (another summation order of the log-sum-exp).
  void* workspace = nullptr;
};
/// Bytes of workspace that sample_launch needs for `rows` rows (an allocation for rows_cap rows
/// serves every launch with rows <= rows_cap).
size_t sample_workspace_bytes(int64_t rows, int64_t vocab);
/// Asynchronous, CUDA-graph safe (no sync, no allocation; with a workspace: one memset node of
/// rows * 64 bytes plus one kernel whose grid depends only on rows and vocab).
void sample_launch(SampleParams const& p, cudaStream_t stream);

}  // namespace tandem::cuda
