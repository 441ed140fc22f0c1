// Which KV heads move from which prefill rank to which decode rank (DESIGN.md sections 1, 4).
//
// Both instances hold KV heads as contiguous ranges of the model's heads, so the heads a source
// rank owes a destination are one contiguous run (the intersection of two ranges), and in the
// HND page layout a head run of a page is two contiguous chunks (k and v): splitting and
// merging heads in flight are plain copies.
//   source (prefill, TP=t, H KV heads): t <= H: rank r holds [r*H/t, (r+1)*H/t);
//     t > H: rank r holds one replica of head r*H/t, and only the first replica of each head
//     (r % (t/H) == 0) sends it, so every head travels exactly once.
//   destination: any head range [h0, h1) (decode DP: all heads on every rank; a TP'd decode
//     instance: its rank's range, replicated or not - every destination rank gets its copy).
// Pure functions, no I/O; the same rules as model/shard.h's ShardPlan (kept here because the
// transfer layer sits below model/).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tandem::transfer {

/// A half-open range [begin, end) of global KV head indices.
struct HeadRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool contains(int64_t h) const { return begin <= h && h < end; }
  bool operator==(const HeadRange&) const = default;
  std::string str() const;  // "[0, 4)"
};

/// How the ranks of one tensor-parallel instance hold the model's KV heads.
struct KvSharding {
  int64_t num_kv_heads = 1;  // of the model
  int tp = 1;                // ranks in the instance

  /// Throws Error(kInvalidArgument) unless tp divides num_kv_heads or num_kv_heads divides tp.
  void validate() const;
  /// Ranks holding each head: tp / num_kv_heads when tp > num_kv_heads, else 1.
  int64_t replicas() const { return tp > num_kv_heads ? tp / num_kv_heads : 1; }
  /// Global heads rank `rank` holds in its KV cache (its local head 0 is held(rank).begin).
  HeadRange held(int rank) const;
  /// True when `rank` sends its heads (false for all but the first replica of a head).
  bool sends(int rank) const { return rank % replicas() == 0; }
  /// The rank that sends global head `head`.
  int owner(int64_t head) const;
  bool operator==(const KvSharding&) const = default;
  std::string str() const;  // "TP=4 over 2 KV heads"
};

/// One contiguous run of heads to copy from a source rank's cache into a destination cache.
struct HeadSlice {
  HeadRange heads;         // global head indices
  int64_t src_offset = 0;  // index of heads.begin in the source rank's cache
  int64_t dst_offset = 0;  // index of heads.begin in the destination's cache
  int64_t num_heads() const { return heads.size(); }
  bool operator==(const HeadSlice&) const = default;
};

/// What source rank `src_rank` sends to a destination holding global heads `dst`: at most one
/// contiguous slice; nullopt when the ranges are disjoint or the rank is not the sending
/// replica. Throws Error(kInvalidArgument) on an invalid sharding, rank or range.
std::optional<HeadSlice> plan_head_slice(const KvSharding& src, int src_rank, HeadRange dst);

/// The source ranks that send to a destination holding `dst`, ascending. Their slices tile
/// `dst` exactly once.
std::vector<int> senders_for(const KvSharding& src, HeadRange dst);

}  // namespace tandem::transfer
