// The device sampler of the CUDA models (Qwen3MoeCuda, Qwen35MoeCuda): per-row sampling
// parameters up, the rows' logit biases and structured-output masks applied to the logits on
// the device (backend/cuda/token_bitmask.h), sample_launch (backend/cuda/sampling.h), tokens
// and logprobs down. Host code; one instance per model, used from the model's stream only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "model/cuda/cuda_mem.h"
#include "model/forward_batch.h"

namespace tandem::cuda_model {

class DeviceSampler {
 public:
  DeviceSampler(int64_t rows_cap, int64_t vocab);

  /// Samples rows [0, rows.size()) of `logits` ([rows, vocab] fp32 on the device; modified in
  /// place where a row has biases or a mask) on `stream` and waits for it; out gets one entry
  /// per row. `wait_masks` (may be empty) is called before any rows[i].mask is read, after the
  /// parameters and biases are enqueued. Throws kInvalidArgument for a bias id outside the
  /// vocabulary or more rows than rows_cap.
  void sample(float* logits, const std::vector<DeviceSampling>& rows,
              const std::function<void()>& wait_masks, std::vector<SampledToken>& out,
              cudaStream_t stream);
  /// sample() in two halves: enqueue() queues everything, the copies to the host included,
  /// without waiting (the rows' tokens are in device_tokens() once the stream gets there, for
  /// more work on the stream: the fused speculative step); collect() waits and unpacks.
  void enqueue(float* logits, const std::vector<DeviceSampling>& rows,
               const std::function<void()>& wait_masks, cudaStream_t stream);
  void collect(std::vector<SampledToken>& out, cudaStream_t stream);
  /// [rows] the last enqueue()'s tokens (device).
  const int32_t* device_tokens() const { return tokens_.as<int32_t>(); }
  /// Greedy tokens (the argmax of the raw logits, ties -> lowest id) of rows [0, rows) of
  /// `logits` into the device array `tokens`, enqueued on `stream` only (no host copy, no
  /// sync): the next MTP pass of a draft chain reads them there.
  void argmax(const float* logits, int64_t rows, int32_t* tokens, cudaStream_t stream);
  /// Batch-invariant mode (--deterministic): every row on the single-CTA sampling kernel. The
  /// multi-CTA path, taken by the row count and the batch's top-k / top-p, draws the same
  /// tokens but sums a row's log-sum-exp over batch-sized slices (logprobs' last bits).
  void set_batch_invariant(bool on) { batch_invariant_ = on; }

 private:
  bool batch_invariant_ = false;
  int64_t pending_ = 0;  // rows enqueued, not yet collected
  int64_t rows_cap_, vocab_, words_;
  DeviceMem greedy_;  // SamplingRowParams [rows_cap], every row greedy (argmax)
  DeviceMem params_, tokens_, logprobs_, top_ids_, top_lp_, workspace_;
  PinnedMem host_;  // params [R] | tokens [R] | logprobs [R] | top ids [R, 20] | top lps [R, 20]
  DeviceMem mask_, mask_row_;  // [rows_cap, words_] packed masks of the masked rows; [rows_cap]
  PinnedMem host_mask_, host_mask_row_;
  DeviceMem bias_;  // LogitBiasEntry [bias_cap_], grown on demand
  PinnedMem host_bias_;
  int64_t bias_cap_ = 0;
};

}  // namespace tandem::cuda_model
