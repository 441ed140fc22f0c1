// The input of one forward pass: a batch mixing prefill chunks and decode tokens.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "core/error.h"

namespace tandem {

/// Which positions of a sequence's chunk produce logits.
enum class LogitsMode : uint8_t { kNone, kLast, kAll };

/// One sequence's slice of a forward pass: new tokens at positions
/// [start_pos, start_pos + num_tokens), reading and writing KV through its block table.
struct ForwardSeq {
  const int32_t* tokens = nullptr;  // [num_tokens]
  int64_t num_tokens = 0;
  int64_t start_pos = 0;                 // tokens before this are already in the KV cache
  const int32_t* block_table = nullptr;  // [num_pages] covering start_pos + num_tokens
  int64_t num_pages = 0;
  LogitsMode logits = LogitsMode::kLast;
  /// Hybrid models: the sequence's recurrent state slot in the KvCache (-1: none). A chunk
  /// at start_pos 0 starts the state from zeros; a later chunk continues it.
  int32_t state_slot = -1;
};

struct ForwardBatch {
  std::vector<ForwardSeq> seqs;
  /// Optional: called with each layer's index once that layer's new KV is in the cache (the
  /// prefill instance streams a finished prompt's KV layer by layer while later layers run).
  std::function<void(int64_t layer)> on_layer_kv;
  /// Optional (MTP speculative decoding, Model::has_mtp()): receives every token's final
  /// hidden state, after the final norm ([num_tokens, hidden], batch order), the input of the
  /// MTP layer.
  std::vector<float>* hidden_out = nullptr;
  /// Hybrid models with speculative decoding: keep every token's inputs of the DeltaNet
  /// recurrences (Model::replay_states), so that a verify step's rejected drafts roll back
  /// without a second forward.
  bool keep_recurrent_inputs = false;

  int64_t num_tokens() const {
    int64_t n = 0;
    for (const auto& s : seqs) n += s.num_tokens;
    return n;
  }
  /// The token index (into the flattened batch) of each logits row, in batch order.
  std::vector<int64_t> logit_token_rows() const {
    std::vector<int64_t> rows;
    int64_t t = 0;
    for (const auto& s : seqs) {
      if (s.logits == LogitsMode::kAll) {
        for (int64_t i = 0; i < s.num_tokens; ++i) rows.push_back(t + i);
      } else if (s.logits == LogitsMode::kLast) {
        rows.push_back(t + s.num_tokens - 1);
      }
      t += s.num_tokens;
    }
    return rows;
  }
  /// Rows of logits the forward returns, in batch order.
  int64_t num_logit_rows() const {
    int64_t n = 0;
    for (const auto& s : seqs) {
      n += s.logits == LogitsMode::kAll ? s.num_tokens : (s.logits == LogitsMode::kLast ? 1 : 0);
    }
    return n;
  }
};

/// A batch flattened for a host forward: per token its id, position, owning sequence and KV
/// slot (page * page_size + offset); one block-table row of max_pages per sequence (zero
/// padded); each sequence's first token index.
struct FlatBatch {
  std::vector<int32_t> ids, positions, token_seq;
  std::vector<int64_t> slots;
  std::vector<int32_t> tables;  // [seqs, max_pages]
  int64_t max_pages = 1;
  std::vector<int64_t> seq_begin;  // [seqs]
};

/// Checks every chunk (non-empty, block table long enough) and flattens it.
inline FlatBatch flatten_batch(const ForwardBatch& batch, int64_t page_size) {
  FlatBatch f;
  const auto n = static_cast<size_t>(batch.num_tokens());
  f.ids.resize(n);
  f.positions.resize(n);
  f.token_seq.resize(n);
  f.slots.resize(n);
  f.seq_begin.resize(batch.seqs.size());
  for (const auto& s : batch.seqs) f.max_pages = std::max(f.max_pages, s.num_pages);
  f.tables.assign(batch.seqs.size() * static_cast<size_t>(f.max_pages), 0);
  int64_t t = 0;
  for (size_t si = 0; si < batch.seqs.size(); ++si) {
    const ForwardSeq& s = batch.seqs[si];
    TANDEM_CHECK(s.num_tokens > 0, "empty sequence chunk");
    TANDEM_CHECK((s.start_pos + s.num_tokens + page_size - 1) / page_size <= s.num_pages,
                 "block table too short: ", s.num_pages, " pages for ", s.start_pos + s.num_tokens,
                 " tokens");
    std::memcpy(f.tables.data() + si * static_cast<size_t>(f.max_pages), s.block_table,
                sizeof(int32_t) * static_cast<size_t>(s.num_pages));
    f.seq_begin[si] = t;
    for (int64_t i = 0; i < s.num_tokens; ++i, ++t) {
      const int64_t pos = s.start_pos + i;
      const auto ti = static_cast<size_t>(t);
      f.ids[ti] = s.tokens[i];
      f.positions[ti] = static_cast<int32_t>(pos);
      f.token_seq[ti] = static_cast<int32_t>(si);
      f.slots[ti] = int64_t{s.block_table[pos / page_size]} * page_size + pos % page_size;
    }
  }
  return f;
}

/// How to sample one logits row on the model's device (Model::forward_sample): the
/// engine's SamplingParams minus penalties (which need host logits), plus the row's logit
/// biases and structured-output mask, applied to the logits on the device before the draw
/// (biases, then the mask, as the host path). Logprobs describe the raw logits, so a row that
/// asks for them carries neither biases nor a mask (the engine samples it on the host).
struct DeviceSampling {
  float temperature = 1.0f;  // < 1e-5: greedy
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  uint64_t seed = 0;      // the request's seed
  uint64_t counter = 0;   // the draw's index in the request (its output position)
  int32_t logprobs = -1;  // -1: none; 0: the chosen token's; n: and the top n (<= 20)
  std::vector<std::pair<int32_t, float>> bias;  // (id, added to its logit), distinct ids; -inf
                                                // suppresses a token (EOS before min_tokens)
  // Packed allowed-token bits (bit id % 32 of word id / 32; ids past the words disallowed),
  // applied when *mask_active. Both are read only after forward_sample's wait_masks() returns
  // (the engine's MaskWorker fills them while the forward runs). nullptr: no mask.
  const std::vector<uint32_t>* mask = nullptr;
  const bool* mask_active = nullptr;
};

/// One sampled row: the token, its logprob (raw log_softmax) and the top logprobs asked for.
struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // (id, logprob), descending
};

/// One sequence of Model::replay_states: its first token's row in the last forward's batch
/// (batch order), its state slot there, and how many of its tokens to replay (>= 1).
struct StateReplay {
  int32_t state_slot = -1;
  int64_t row = 0, count = 0;
};

/// One chained pass of a device-resident MTP draft chain (Model::mtp_draft_chain): one token per
/// drafting sequence (every logits row of the chain's first pass, in order), each row continuing
/// the same row of the pass before: its token is that pass's draft (the argmax), its hidden state
/// that pass's MTP output. A row past its sequence's drafts (writes[i] == 0) still computes, so
/// that every pass has the same rows, but writes no KV; its start_pos is a position it wrote
/// before (inside its block table).
struct MtpChainPass {
  ForwardBatch batch;           // seqs[i]: num_tokens 1, logits kLast; tokens unused
  std::vector<uint8_t> writes;  // [seqs]: 1 = a live draft (writes the MTP KV at start_pos)
};

/// A speculative step's verify fused with its next drafts (Model::forward_verify_draft).
struct VerifyDraftStep {
  std::vector<int32_t> forced;  // [seqs] in: accepted drafts forced (benchmarks); -1: the target's
  int64_t num_drafts = 0;       // in: K, the drafts each sequence gets for the next step
  // [seqs] in, hybrid models: a free state slot for each verify sequence, the model's to use
  // during the step (its contents are not kept), -1: none (no drafts to verify).
  std::vector<int32_t> spare_slots;
  std::vector<int32_t> accepted;             // [seqs] out: drafts accepted
  std::vector<std::vector<int32_t>> drafts;  // [seqs][num_drafts] out: the next drafts
};

}  // namespace tandem
