// MTP speculative decoding: the configuration (vLLM's --speculative-config) and the
// acceptance rule. The engine drafts K tokens per sequence with the model's MTP layer (chained
// K times), verifies them with one target forward over the K + 1 positions, and keeps the
// longest prefix the target agrees with (greedy) or what rejection sampling accepts (sampled
// requests; Leviathan et al. 2023), plus one token from the target.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/sampling.h"

namespace tandem {

struct SpeculativeConfig {
  std::string method;                  // "mtp" (the only one)
  int64_t num_speculative_tokens = 0;  // K, 1..4; 0: no speculation
  std::string model;                   // the MTP weights' directory; "": the model's own
};

/// Parses '{"method": "mtp", "num_speculative_tokens": K[, "model": DIR]}'. Throws
/// kInvalidArgument naming --speculative-config and the field for anything else.
SpeculativeConfig parse_speculative_config(const std::string& json_text);

/// The largest K.
constexpr int64_t kMaxSpeculativeTokens = 4;

/// A sequence's speculation state (Sequence::spec), the SpecDecoder's (engine/spec_decoder.h).
struct SequenceSpec {
  // The last token followed by its drafts, verified together in the next step; empty when
  // there are none.
  std::vector<int32_t> tokens;
  std::vector<float> draft_probs;  // [drafts, vocab] the draft distributions; empty: one-hot
  // Benchmarks (EngineConfig::spec_forced_accept_prob): the drafts this verify step accepts,
  // drawn when it is forwarded; -1: the target decides.
  int32_t forced_accepts = -1;
  // A fused step's next drafts (Model::forward_verify_draft), made with `fused_accepted` drafts
  // accepted; they are adopted when the verify accepted as many.
  std::vector<int32_t> fused_drafts;
  int32_t fused_accepted = -1;
  // Prefilled elsewhere (Engine::add_prefilled): the prompt's final hidden states of positions
  // [prompt_hidden_begin, prompt_len) ([rows, hidden]), for the MTP layer's pass over the
  // prompt in the step the sequence is first scheduled (SpecDecoder::prepare).
  std::vector<float> prompt_hidden;
  int64_t prompt_hidden_begin = 0;
};

struct AcceptResult {
  int32_t token = 0;
  bool accepted = false;  // token is the draft
};

/// Rejection sampling of one draft token `draft` drawn from `q` against the target
/// distribution `p` (both vocab floats, the same sampling transforms applied; token_distribution).
/// Accepts with probability min(1, p(d) / q(d)); else returns a token drawn from
/// norm(max(0, p - q)). An empty `q` is a deterministic draft (q one-hot at `draft`). Uses one
/// uniform draw of `rng`, and one more on rejection. The token's distribution is exactly `p`.
AcceptResult accept_draft(std::span<const float> p, std::span<const float> q, int32_t draft,
                          SamplerRng& rng);

}  // namespace tandem
