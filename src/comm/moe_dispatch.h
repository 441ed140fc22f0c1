// MoE dispatch/combine across expert-parallel ranks, decode flavour (DP attention + EP
// experts): every rank has its own tokens; a sparse all-to-all sends each token's hidden state
// at most once to every rank that holds one of its experts, the receivers run their local
// experts, and the per-(token, expert) outputs come back to the token's home rank, which sums
// them in ascending expert id: the same order as cpu::moe, so the result is bit-identical to
// a single-process run.
//
// The prefill flavour (input replicated on every rank) needs no all-to-all: the model runs
// cpu::moe over this rank's expert range (which selects the locally routed tokens and
// accumulates their weighted outputs) and combines with Communicator::all_reduce_sum.
//
// Data movement only: the expert math stays with the caller (the model), so this layer does
// not depend on a compute backend.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"

namespace tandem::comm {

/// One rank's half of the decode MoE all-to-all. Usage per MoE layer, on every rank (also a
/// rank with no tokens): dispatch(); fill pair_out() from pair_x() with this rank's experts;
/// combine(). Buffers are reused across calls.
class MoeAllToAll {
 public:
  /// Experts are placed in contiguous blocks: rank r holds
  /// [r * num_experts / world, (r + 1) * num_experts / world); num_experts must divide.
  MoeAllToAll(Communicator& comm, int64_t num_experts, int64_t hidden, int64_t top_k);

  /// Collective. Sends this rank's tokens to their experts' ranks and receives the tokens
  /// routed to this rank's experts, unpacked into one row per (token, expert) pair, grouped
  /// by local expert (ascending), then source rank, then the source's token order.
  void dispatch(const float* x,             // [num_tokens, hidden]
                const int32_t* topk_ids,    // [num_tokens, top_k], global expert ids
                const float* topk_weights,  // [num_tokens, top_k]
                int64_t num_tokens);

  /// (token, expert) pairs routed to this rank by the last dispatch, over all source ranks.
  int64_t num_pairs() const { return static_cast<int64_t>(pair_expert_.size()); }
  const float* pair_x() const { return pair_x_.data(); }              // [num_pairs, hidden]
  const int32_t* pair_expert() const { return pair_expert_.data(); }  // [num_pairs], global id
  const float* pair_weight() const { return pair_weight_.data(); }    // [num_pairs]
  /// Pairs of local expert e are rows [expert_offsets()[e], expert_offsets()[e + 1]).
  const std::vector<int64_t>& expert_offsets() const { return expert_offsets_; }
  /// [num_pairs, hidden]: the caller writes weight * expert(x) of each pair here.
  float* pair_out() { return pair_out_.data(); }

  /// Collective. Returns the pair outputs to their home ranks and writes, for every token of
  /// the last dispatch, out[t] = sum of its k pair outputs in ascending expert id, starting
  /// from 0 (cpu::moe's order).
  void combine(float* out);  // [num_tokens, hidden], overwritten

  int64_t experts_per_rank() const { return experts_per_rank_; }
  int64_t expert_begin() const { return experts_per_rank_ * comm_.rank(); }

 private:
  Communicator& comm_;
  int64_t num_experts_, hidden_, top_k_, experts_per_rank_;

  // Home side (this rank's tokens).
  int64_t num_tokens_ = 0;
  std::vector<int32_t> topk_ids_;     // [num_tokens, top_k] copy
  std::vector<int64_t> pairs_sent_;   // [world]: pairs this rank sent to each rank
  std::vector<int64_t> tokens_sent_;  // [world]: tokens this rank sent to each rank
  // Receiver side.
  std::vector<int64_t> pairs_recv_;      // [world]: pairs received from each rank
  std::vector<float> pair_x_;            // [num_pairs, hidden]
  std::vector<int32_t> pair_expert_;     // [num_pairs]
  std::vector<float> pair_weight_;       // [num_pairs]
  std::vector<float> pair_out_;          // [num_pairs, hidden]
  std::vector<int64_t> expert_offsets_;  // [experts_per_rank + 1]
  std::vector<int64_t> return_order_;    // pair rows in (source, token, slot) order
  // Staging.
  std::vector<float> send_f_, recv_f_;
  std::vector<int32_t> send_i_, recv_i_;
};

}  // namespace tandem::comm
