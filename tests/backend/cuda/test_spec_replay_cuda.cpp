// The device-driven DeltaNet state rollback's kernels (src/backend/cuda/spec_replay.h) against
// their CPU references: the replay plan over fresh random batches (1 .. 300 sequences, 0 .. 4
// drafts each, random acceptance, sequences without a state slot, extra padding sequences),
// outputs poisoned before the launch, every output equal; the accepted sequences' state copy
// over random states, the slots it must not touch included. The references are checked on a
// hand-worked case, and the launchers' argument checks run anywhere. The seed is printed on
// failure.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/spec_replay.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::gpu_available;
template <typename T>
using DeviceBuffer = test_util::DeviceBuffer<T, test_util::UploadCheck::kNone>;

// Seq 0: 4 tokens (3 drafts), 1 accepted -> replays tokens 0, 1 on slot 5. Seq 1: 2 tokens, all
// accepted -> takes its spare slot 10 (slot 7). Seq 2: 3 tokens, none accepted -> token 6 on slot
// 2. Seq 3: 2 tokens, 0 accepted but no slot -> nothing. Seq 4: no drafts -> nothing. 12 tokens:
// 3 replayed, the padding sequence (5) has the other 9; sequence 6 is empty.
TEST(SpecReplayReference, HandWorkedCase) {
  SpecReplayPlanParams shape;
  shape.seqs = 5;
  shape.out_seqs = 7;
  SpecReplayHost h;
  h.accepted = {1, 1, 0, 0, 0};
  h.seq_begin = {0, 4, 6, 9, 11, 12};
  h.state_slot = {5, 7, 2, -1, 8};
  h.spare_slot = {9, 10, 11, 12, 3};
  spec_replay_plan_reference(shape, h);
  EXPECT_EQ(h.dn_begin, (std::vector<int32_t>{0, 2, 2, 3, 3, 3, 12, 12}));
  EXPECT_EQ(h.dn_slot, (std::vector<int32_t>{5, -1, 2, -1, -1, -1, -1}));
  EXPECT_EQ(h.dn_fresh, (std::vector<int32_t>(7, 0)));
  EXPECT_EQ(h.ids, (std::vector<int32_t>{0, 1, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(h.dn_token_seq, (std::vector<int32_t>{0, 0, 2, 5, 5, 5, 5, 5, 5, 5, 5, 5}));
  // The copy: slot 10 -> 7 only.
  AcceptedStateCopyParams cs;
  cs.seqs = 5;
  cs.slot_elems = 2;
  cs.slot_stride = 3;
  std::vector<float> states(13 * 3);
  std::iota(states.begin(), states.end(), 0.f);
  std::vector<float> want = states;
  want[21] = 30;  // slot 7 <- slot 10 (its first two floats)
  want[22] = 31;
  accepted_state_copy_reference(cs, h, states);
  EXPECT_EQ(states, want);
}

TEST(SpecReplayLaunch, RejectsBadShapes) {
  SpecReplayPlanParams p;
  p.seqs = 2;
  p.out_seqs = 2;  // needs a padding sequence
  EXPECT_THROW(spec_replay_plan_launch(p, nullptr), Error);
  p.out_seqs = 3;
  EXPECT_THROW(spec_replay_plan_launch(p, nullptr), Error);  // null arrays
  AcceptedStateCopyParams r;
  r.seqs = 1;
  r.slot_elems = 8;
  r.slot_stride = 4;  // smaller than a slot
  EXPECT_THROW(accepted_state_copy_launch(r, nullptr), Error);
  r.slot_stride = 8;
  EXPECT_THROW(accepted_state_copy_launch(r, nullptr), Error);  // null arrays
}

TEST(CudaSpecReplay, PlanAndRestoreMatchTheReference) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen);
  };
  for (int trial = 0; trial < 40; ++trial) {
    SpecReplayPlanParams shape;
    shape.seqs = trial == 0 ? 1 : uni(1, 300);
    shape.out_seqs = shape.seqs + uni(1, 3);
    const auto S = static_cast<size_t>(shape.seqs);
    SpecReplayHost h;
    h.seq_begin.push_back(0);
    for (size_t s = 0; s < S; ++s) {
      const int64_t k = uni(0, 4);
      // every draft accepted about a third of the time
      h.accepted.push_back(static_cast<int32_t>(uni(0, 2) == 0 ? k : uni(0, k)));
      h.seq_begin.push_back(h.seq_begin.back() + static_cast<int32_t>(k + 1));
      // Distinct slots: sequence s on 2 s, its snapshot on 2 s + 1; some without a slot.
      h.state_slot.push_back(uni(0, 7) == 0 ? -1 : static_cast<int32_t>(2 * s));
      h.spare_slot.push_back(static_cast<int32_t>(2 * s + 1));
    }
    SpecReplayHost want = h;
    spec_replay_plan_reference(shape, want);
    const size_t T = static_cast<size_t>(h.seq_begin.back()),
                 O = static_cast<size_t>(shape.out_seqs);
    DeviceBuffer<int32_t> accepted(h.accepted), begin(h.seq_begin), slot(h.state_slot),
        spare(h.spare_slot);
    DeviceBuffer<int32_t> ids(T), dn_begin(O + 1), dn_token_seq(T), dn_slot(O), dn_fresh(O);
    for (auto* b : {&ids, &dn_begin, &dn_token_seq, &dn_slot, &dn_fresh}) b->poison(0xAB);
    SpecReplayPlanParams p = shape;
    p.accepted = accepted.ptr;
    p.seq_begin = begin.ptr;
    p.state_slot = slot.ptr;
    p.ids = ids.ptr;
    p.dn_begin = dn_begin.ptr;
    p.dn_token_seq = dn_token_seq.ptr;
    p.dn_slot = dn_slot.ptr;
    p.dn_fresh = dn_fresh.ptr;
    spec_replay_plan_launch(p, nullptr);
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(ids.download(), want.ids) << "trial " << trial;
    EXPECT_EQ(dn_begin.download(), want.dn_begin) << "trial " << trial;
    EXPECT_EQ(dn_token_seq.download(), want.dn_token_seq) << "trial " << trial;
    EXPECT_EQ(dn_slot.download(), want.dn_slot) << "trial " << trial;
    EXPECT_EQ(dn_fresh.download(), want.dn_fresh) << "trial " << trial;

    // The copy over random states: odd sizes take the scalar path.
    AcceptedStateCopyParams rs;
    rs.seqs = shape.seqs;
    rs.slot_elems = trial % 2 == 0 ? uni(1, 5000) * 4 : uni(1, 20000);
    rs.slot_stride = rs.slot_elems + (trial % 4 == 0 ? 0 : uni(0, 3) * 4);
    std::vector<float> host(2 * S * static_cast<size_t>(rs.slot_stride));
    std::uniform_real_distribution<float> val(-1.f, 1.f);
    for (float& x : host) x = val(gen);
    std::vector<float> want_states = host;
    accepted_state_copy_reference(rs, h, want_states);
    DeviceBuffer<float> states(host);
    rs.accepted = accepted.ptr;
    rs.seq_begin = begin.ptr;
    rs.state_slot = slot.ptr;
    rs.spare_slot = spare.ptr;
    rs.states = states.ptr;
    accepted_state_copy_launch(rs, nullptr);
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(states.download(), want_states) << "trial " << trial;
  }
}

}  // namespace
}  // namespace tandem::cuda
