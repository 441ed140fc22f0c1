// After a hybrid model's verify step, on the device: each sequence's DeltaNet state settled to the
// one after its accepted drafts (Model::forward_verify_draft of Qwen3.5), driven by the
// accepted counts that spec_advance left on the device, so that no host round trip sits between
// the acceptance and the next drafts. Framework-free: params structs in, a stream; asynchronous
// and CUDA-graph safe (no host sync, no allocation).
//
// The verify kept each DeltaNet layer's recurrence inputs (its in_proj rows, in verify token
// order), and wrote each verify sequence's state after all its tokens to that sequence's spare
// slot, its own state slot keeping the state from before the step. Per verify sequence s with
// tokens [seq_begin[s], seq_begin[s + 1]) (its last token, then k >= 1 drafts) and a =
// accepted[s]:
//   a == k: accepted_state_copy_launch copies the spare slot over its state slot;
//   a < k: the replay runs the conv and the delta rule over its first a + 1 tokens (their kept
//     rows) on its state slot: its state becomes the one after the last kept token.
// A sequence without drafts (k == 0) or without a state slot gets neither.
// spec_replay_plan_launch writes the replay's DeltaNet metadata (DeltaNetSeqs, deltanet.h) for a
// launch of seq_begin[seqs] tokens and out_seqs sequences: replay sequence s (s < seqs) has the
// a + 1 tokens above from the sum of the earlier ones' counts, or none (state slot -1); sequence
// seqs (padding, slot -1: reads zeros, writes nothing) has the rest of the tokens, at least one
// (each replayed sequence keeps fewer tokens than it verified), their rows 0; sequences past it
// are empty padding. out_seqs > seqs + 1 lets the caller keep num_tokens != num_seqs (the
// DeltaNet ops take that as a one-token decode step).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace tandem::cuda {

struct SpecReplayPlanParams {
  int32_t const* accepted = nullptr;    // [seqs] drafts accepted (spec_advance)
  int32_t const* seq_begin = nullptr;   // [seqs + 1] verify token offsets (= kept rows)
  int32_t const* state_slot = nullptr;  // [seqs] state slot (< 0: none)
  int64_t seqs = 0, out_seqs = 0;       // out_seqs >= seqs + 1
  int32_t* ids = nullptr;               // [tokens] out: the kept row of each replay token
  int32_t* dn_begin = nullptr;          // [out_seqs + 1] out
  int32_t* dn_token_seq = nullptr;      // [tokens] out
  int32_t* dn_slot = nullptr;           // [out_seqs] out
  int32_t* dn_fresh = nullptr;          // [out_seqs] out: 0 (the replay continues the snapshot)
};

/// Launches on `stream` (one block); throws Error(kInvalidArgument) for bad shapes or a null
/// pointer. At most 4096 sequences.
void spec_replay_plan_launch(SpecReplayPlanParams const& p, cudaStream_t stream);

/// Copies slot spare_slot[s] over slot state_slot[s] (slot_elems floats at states + slot *
/// slot_stride) for each sequence s that accepted every one of its k >= 1 drafts (both slots
/// >= 0).
struct AcceptedStateCopyParams {
  int32_t const* accepted = nullptr;    // [seqs]
  int32_t const* seq_begin = nullptr;   // [seqs + 1]
  int32_t const* state_slot = nullptr;  // [seqs]
  int32_t const* spare_slot = nullptr;  // [seqs] where the verify wrote the state
  float* states = nullptr;
  int64_t seqs = 0, slot_elems = 0, slot_stride = 0;
};
void accepted_state_copy_launch(AcceptedStateCopyParams const& p, cudaStream_t stream);

/// The CPU references over host arrays of the same layout (the pointers of the params ignored).
struct SpecReplayHost {
  std::vector<int32_t> accepted, seq_begin, state_slot, spare_slot;
  std::vector<int32_t> ids, dn_begin, dn_token_seq, dn_slot, dn_fresh;  // out
};
void spec_replay_plan_reference(SpecReplayPlanParams const& shape, SpecReplayHost& h);
/// `states`: [slots, slot_stride] floats.
void accepted_state_copy_reference(AcceptedStateCopyParams const& shape, const SpecReplayHost& h,
                                   std::vector<float>& states);

}  // namespace tandem::cuda
