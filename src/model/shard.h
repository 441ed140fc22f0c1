// How the ranks of one instance split a Qwen3-MoE model (DESIGN.md section 4):
//   prefill, TP=t EP=t: q heads / t; KV heads / t, or replicated when t > kv heads; o_proj
//     row-parallel (columns split) + all-reduce; router replicated; experts E / t; lm_head
//     vocab-parallel (rows ceil(V / t), the last shard padded) + all-gather of the logits.
//   decode, DP=d EP=d: attention, dense layers, router and lm_head replicated, each rank its
//     own batch and KV cache; experts E / d, tokens reach them by all-to-all.
// Everything not listed (embedding, norms, dense MLPs) is replicated.
#pragma once

#include <cstdint>
#include <string_view>

#include "model/config.h"

namespace tandem {

namespace comm {
class Communicator;
}

enum class ShardMode : uint8_t {
  kSingle,       // one rank holds the whole model
  kPrefillTpEp,  // tensor-parallel attention + expert-parallel MoE; input replicated
  kDecodeDpEp,   // data-parallel attention + expert-parallel MoE; each rank its own batch
};

std::string_view shard_mode_name(ShardMode mode);

/// Which slice of the model a rank holds: the instance's mode, this rank, the group size.
struct ShardSpec {
  ShardMode mode = ShardMode::kSingle;
  int rank = 0;
  int size = 1;

  static ShardSpec single() { return {}; }
  static ShardSpec prefill(int rank, int size) { return {ShardMode::kPrefillTpEp, rank, size}; }
  static ShardSpec decode(int rank, int size) { return {ShardMode::kDecodeDpEp, rank, size}; }
};

/// A sharded spec needs a communicator whose rank and size are the spec's (kInvalidArgument
/// naming both otherwise); a single-rank spec needs none.
void check_shard_communicator(const ShardSpec& shard, const comm::Communicator* comm);

/// A half-open index range [begin, end).
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool contains(int64_t i) const { return begin <= i && i < end; }
  bool operator==(const IndexRange&) const = default;
};

/// The blocks of `block` elements that elements `r` touch: [r.begin / block, ceil(r.end /
/// block)), empty for an empty range. A quantized weight's shard takes these scale rows /
/// columns with its own rows / columns, so a shard narrower than a block (or straddling two)
/// carries the scales of every element it holds; neighbouring shards may share a block.
IndexRange block_range(IndexRange r, int64_t block);

/// What one rank holds, derived from the config and the spec, validated once.
struct ShardPlan {
  ShardSpec spec;
  IndexRange q_heads;       // query heads computed here
  IndexRange kv_heads;      // KV heads projected and cached here (the KV cache's heads)
  int64_t kv_replicas = 1;  // ranks holding each KV head (t / kv_heads when t > kv_heads)
  IndexRange experts;       // experts held here (contiguous: rank r holds the r-th block)
  IndexRange vocab;         // lm_head rows computed here (clamped to vocab_size)
  int64_t vocab_rows = 0;   // lm_head rows per rank, padded (ceil(V / t) when vocab-parallel)

  /// Throws kInvalidArgument naming the quantity that does not split (e.g. "16 experts do
  /// not split over 3 ranks") or a bad rank / size.
  static ShardPlan make(const ModelConfig& config, const ShardSpec& spec);

  /// Attention heads split, o_proj / MoE all-reduced, lm_head vocab-parallel.
  bool tensor_parallel() const { return spec.mode == ShardMode::kPrefillTpEp; }
  /// Each rank its own batch; MoE by all-to-all.
  bool data_parallel() const { return spec.mode == ShardMode::kDecodeDpEp; }

  /// The rank that sends KV head `head` (global index) to a decode instance: with replicated
  /// heads only the first rank holding a head sends it, so every head travels once. In the
  /// data-parallel and single modes each rank sends its own sequences' heads: this rank.
  int kv_head_owner(int64_t head) const;
  /// True when this rank sends all of its local KV heads (see kv_head_owner).
  bool sends_kv() const { return kv_head_owner(kv_heads.begin) == spec.rank; }
};

}  // namespace tandem
