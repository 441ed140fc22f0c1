// The CPU references of spec_replay_plan_launch and accepted_state_copy_launch (spec_replay.h),
// written plainly.
#include <algorithm>

#include "backend/cuda/spec_replay.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

int32_t replay_count(const SpecReplayHost& h, size_t s) {
  const int32_t k = h.seq_begin[s + 1] - h.seq_begin[s] - 1, a = h.accepted[s];
  return a < k && h.state_slot[s] >= 0 ? a + 1 : 0;
}

}  // namespace

void spec_replay_plan_reference(SpecReplayPlanParams const& shape, SpecReplayHost& h) {
  const auto seqs = static_cast<size_t>(shape.seqs), out = static_cast<size_t>(shape.out_seqs);
  TANDEM_CHECK(h.accepted.size() == seqs && h.seq_begin.size() == seqs + 1 &&
                   h.state_slot.size() == seqs && out >= seqs + 1,
               "spec_replay_plan_reference: inconsistent host arrays");
  const auto tokens = static_cast<size_t>(h.seq_begin.back());
  h.ids.assign(tokens, 0);
  h.dn_token_seq.assign(tokens, static_cast<int32_t>(seqs));  // the padding sequence's
  h.dn_begin.clear();
  h.dn_slot.clear();
  h.dn_fresh.assign(out, 0);
  int32_t t = 0;
  for (size_t s = 0; s < seqs; ++s) {
    const int32_t n = replay_count(h, s);
    h.dn_begin.push_back(t);
    h.dn_slot.push_back(n > 0 ? h.state_slot[s] : -1);
    for (int32_t j = 0; j < n; ++j, ++t) {
      h.ids[static_cast<size_t>(t)] = h.seq_begin[s] + j;
      h.dn_token_seq[static_cast<size_t>(t)] = static_cast<int32_t>(s);
    }
  }
  h.dn_begin.push_back(t);  // the padding sequence: the rest
  h.dn_slot.push_back(-1);
  while (h.dn_begin.size() < out + 1) h.dn_begin.push_back(static_cast<int32_t>(tokens));
  h.dn_slot.resize(out, -1);
}

void accepted_state_copy_reference(AcceptedStateCopyParams const& shape, const SpecReplayHost& h,
                                   std::vector<float>& states) {
  for (size_t s = 0; s < static_cast<size_t>(shape.seqs); ++s) {
    const int32_t k = h.seq_begin[s + 1] - h.seq_begin[s] - 1;
    if (k < 1 || h.accepted[s] != k || h.state_slot[s] < 0 || h.spare_slot[s] < 0) continue;
    const auto src = static_cast<size_t>(int64_t{h.spare_slot[s]} * shape.slot_stride);
    const auto dst = static_cast<size_t>(int64_t{h.state_slot[s]} * shape.slot_stride);
    TANDEM_CHECK(std::max(src, dst) + static_cast<size_t>(shape.slot_elems) <= states.size(),
                 "accepted_state_copy_reference: slot out of range");
    std::copy_n(states.begin() + static_cast<int64_t>(src), shape.slot_elems,
                states.begin() + static_cast<int64_t>(dst));
  }
}

}  // namespace tandem::cuda
