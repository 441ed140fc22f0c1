// Token sampling on the CPU: penalties, temperature, top-k, top-p, min-p; seeded.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "model/forward_batch.h"

namespace tandem {

/// An additive bias on one token's logit (OpenAI logit_bias).
struct LogitBias {
  int32_t id = 0;
  float bias = 0.0f;  // [-100, 100]
};

/// Per-request sampling parameters (OpenAI / vLLM semantics).
struct SamplingParams {
  float temperature = 1.0f;           // 0: greedy (argmax; ties -> lowest id)
  float top_p = 1.0f;                 // (0, 1]
  int32_t top_k = 0;                  // <= 0: disabled
  float min_p = 0.0f;                 // [0, 1]
  float repetition_penalty = 1.0f;    // > 0; applies to prompt and output tokens
  float presence_penalty = 0.0f;      // [-2, 2]; output tokens only
  float frequency_penalty = 0.0f;     // [-2, 2]; output tokens only
  std::optional<uint64_t> seed;       // none: a random seed per request
  int32_t logprobs = -1;              // top-N logprobs per generated token; -1: none
  int32_t prompt_logprobs = -1;       // top-N logprobs per prompt token; -1: none
  std::vector<LogitBias> logit_bias;  // added after the penalties, before temperature

  /// Needs the logits on the host: penalties and biases (the device sampler has neither).
  bool needs_host_logits() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f ||
           !logit_bias.empty();
  }

  /// Greedy below 1e-5, as vLLM (a tinier temperature only overflows the scaled logits).
  bool greedy() const { return temperature < 1e-5f; }
};

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0.0f;
};

/// The per-request random stream (seeded from SamplingParams::seed).
using SamplerRng = std::mt19937_64;

/// Applies the penalties to `logits` in place, as vLLM does: the repetition penalty to every
/// token seen in `prompt` or `output` (positive logits divided by it, others multiplied),
/// then `logit -= frequency_penalty * count + presence_penalty` for each token in `output`,
/// then `logit += bias` for each logit_bias entry (OpenAI). Throws kInvalidArgument for a
/// token id outside the vocabulary.
void apply_penalties(std::span<float> logits, const SamplingParams& params,
                     std::span<const int32_t> prompt, std::span<const int32_t> output);

/// Samples one token from `logits` (vocab floats, raw model output; not modified).
/// `prompt` and `output` are the request's tokens so far (for penalties).
/// Order: penalties and logit biases, temperature, top-k, top-p (over the top-k renormalised
/// distribution), min-p (relative to the most likely token), then one categorical draw (one 64-bit
/// value from `rng`). Greedy (temperature 0) is the argmax of the penalised logits, ties -> lowest
/// id, and consumes no randomness. NaN logits count as -inf.
int32_t sample_token(std::span<const float> logits, const SamplingParams& params,
                     std::span<const int32_t> prompt, std::span<const int32_t> output,
                     SamplerRng& rng);

/// The exact distribution sample_token() draws from, as `probs` (vocab floats summing to 1):
/// the same penalties, temperature, top-k, top-p, min-p and tie order. Greedy: one-hot at the
/// argmax. Speculative decoding compares the target's and the draft's distributions with it.
void token_distribution(std::span<const float> logits, const SamplingParams& params,
                        std::span<const int32_t> prompt, std::span<const int32_t> output,
                        std::vector<float>& probs);

/// One categorical draw over non-negative `weights` (not necessarily normalised), one 64-bit
/// value from `rng`; -1 when every weight is zero.
int32_t sample_from_weights(std::span<const float> weights, SamplerRng& rng);

/// A uniform double in [0, 1) from one 64-bit value of `rng` (53 bits).
double uniform_draw(SamplerRng& rng);
/// Structured outputs: sets every logit whose bit in `mask` is clear to -inf (mask: packed
/// int32 words, bit id % 32 of word id / 32 set = allowed; xgrammar's layout). Tokens past
/// the mask's bits are disallowed. The CPU reference of the CUDA apply_token_bitmask.
void apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> mask);

/// The one conversion to the device sampler's row parameters, for draw number `counter` of a
/// request whose device seed is `seed`; none when the row needs the host sampler
/// (penalties, more than 20 logprobs, logit biases together with logprobs or with a repeated
/// token id). Logit biases travel as DeviceSampling::bias.
std::optional<DeviceSampling> to_device_sampling(const SamplingParams& p, uint64_t seed,
                                                 uint64_t counter);

/// log_softmax of the raw fp32 logits: the chosen token's logprob and the top `n` (n >= 0)
/// sorted by descending logprob (ties -> lower id first).
float token_logprob(std::span<const float> logits, int32_t token);
std::vector<TokenLogprob> top_logprobs(std::span<const float> logits, int32_t n);

}  // namespace tandem
