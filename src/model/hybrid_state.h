// The per-sequence state of a Qwen3.5 hybrid model (one KvCache state slot) and the part of it
// a tensor-parallel rank holds, shared by the models (CPU / CUDA) and by whatever moves states
// between instances (disaggregated prefill -> decode, split by value heads when TP differs).
//
// A slot holds, for each gated-DeltaNet layer in layer order (num_linear_layers parts back to
// back, floats):
//   conv window     [conv_channels, kernel - 1]   channels: q (key heads x dk) | k (key heads x
//                                                  dk) | v (value heads x dv), oldest input first
//   recurrent state [value_heads, dk, dv]
// A TP rank (ShardMode::kPrefillTpEp over t ranks) holds value heads [r hv / t, (r + 1) hv / t)
// and the key heads those map to (value head h reads key head h / (hv / hk)): hk / t of them
// when t divides hk, else one key head replicated on t / hk ranks (t a multiple of hk). Its
// slot is the same layout over its own heads (its conv channels: its q heads | its k heads |
// its v heads). Data-parallel decode ranks and a single rank hold every head.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/config.h"
#include "model/shard.h"

namespace tandem {

namespace comm {
class Communicator;
}

/// The DeltaNet heads one rank holds (global indices).
struct DeltaNetHeads {
  IndexRange key_heads;      // linear_num_key_heads range
  IndexRange value_heads;    // linear_num_value_heads range
  int64_t key_replicas = 1;  // ranks holding each of these key heads (t / hk when t > hk)

  /// Every head: single and data-parallel ranks.
  static DeltaNetHeads all(const ModelConfig& c);
  /// Rank spec.rank's heads. Throws kInvalidArgument naming the head count that does not
  /// split over spec.size ranks (hv % t != 0, or neither t | hk nor hk | t).
  static DeltaNetHeads of(const ModelConfig& c, const ShardSpec& spec);
  bool operator==(const DeltaNetHeads&) const = default;
};

/// The layout of a state slot over some heads (HybridStateLayout::of(config, heads)).
struct HybridStateLayout {
  int64_t num_linear_layers = 0;
  int64_t key_heads = 0, value_heads = 0;  // heads held (counts)
  int64_t key_dim = 0, value_dim = 0;      // dk, dv
  int64_t conv_window = 0;                 // linear_conv_kernel_dim - 1

  static HybridStateLayout of(const ModelConfig& c, const DeltaNetHeads& heads);
  static HybridStateLayout full(const ModelConfig& c) { return of(c, DeltaNetHeads::all(c)); }

  int64_t conv_channels() const { return 2 * key_heads * key_dim + value_heads * value_dim; }
  int64_t conv_elems() const { return conv_channels() * conv_window; }
  int64_t recurrent_elems() const { return value_heads * key_dim * value_dim; }
  int64_t layer_elems() const { return conv_elems() + recurrent_elems(); }
  /// Floats of one slot (the models' state_slot_elems(): at least 1).
  int64_t slot_elems() const {
    return num_linear_layers > 0 ? num_linear_layers * layer_elems() : 1;
  }
  /// Offsets of DeltaNet layer `l` (0-based among the DeltaNet layers) within a slot.
  int64_t conv_offset(int64_t l) const { return l * layer_elems(); }
  int64_t recurrent_offset(int64_t l) const { return l * layer_elems() + conv_elems(); }
  bool operator==(const HybridStateLayout&) const = default;
};

/// A contiguous run of a rank's slot (`part` floats in) and its place in the full slot (`full`).
struct StateRun {
  int64_t full = 0, part = 0, count = 0;
  bool operator==(const StateRun&) const = default;
};

/// The runs of a slot of `heads` within the full slot, layer by layer (per DeltaNet layer the q,
/// k and v conv channels, then the recurrent state). owned_only: without the q / k channels of a
/// replicated key head on every holder but its first (the rank whose value heads start the key
/// head's group), so that the ranks' runs cover every float of the full slot exactly once (a
/// merge by summing zero-filled full slots is then exact: the device gather).
std::vector<StateRun> hybrid_state_runs(const ModelConfig& c, const DeltaNetHeads& heads,
                                        bool owned_only = false);

/// The rows and columns of each Qwen3.5 tensor a rank loads (global indices; everything for
/// single and data-parallel ranks), shared by the CPU and CUDA models:
struct HybridSlices {
  IndexRange q_rows;   // q_proj rows: its query heads' (query, gate) rows, 2 head_dim each
  IndexRange kv_rows;  // k_proj / v_proj rows: its KV heads'
  IndexRange o_cols;   // o_proj columns: its query heads'
  IndexRange conv_q, conv_k, conv_v;  // in_proj_qkv rows = conv1d channels (q | k | v)
  IndexRange z_rows;        // in_proj_z rows = out_proj columns: its value heads' channels
  IndexRange v_heads;       // in_proj_b / in_proj_a rows, A_log, dt_bias: its value heads
  IndexRange shared_inter;  // the shared expert's gate / up rows and down columns
  /// Throws kInvalidArgument naming shared_expert_intermediate_size when a tensor-parallel
  /// plan's size does not divide it.
  static HybridSlices of(const ModelConfig& c, const ShardPlan& plan, const DeltaNetHeads& dn);
};

/// Copies the part of a full slot (HybridStateLayout::full(c)) that `heads` hold into a slot of
/// HybridStateLayout::of(c, heads).
void slice_hybrid_state(const ModelConfig& c, const DeltaNetHeads& heads, const float* full_slot,
                        float* part_slot);
/// Writes a rank's slot back into its place in a full slot (the inverse of slice; replicated key
/// heads are written by every rank that holds them, with equal values).
void merge_hybrid_state(const ModelConfig& c, const DeltaNetHeads& heads, const float* part_slot,
                        float* full_slot);

/// One sequence's state over a tensor-parallel group (ShardMode::kPrefillTpEp over
/// comm.world_size() ranks): every rank passes its slot (`part`, HybridStateLayout::of(c, its
/// heads)); rank `root` gets the full slot (HybridStateLayout::full(c)) merged from all of
/// them, the other ranks an empty vector. Collective (ranks != root send their part to root);
/// throws kInvalidArgument on a part of another size than the rank's layout.
std::vector<float> gather_hybrid_state(comm::Communicator& comm, const ModelConfig& c,
                                       std::span<const float> part, int root = 0);

}  // namespace tandem
