// After-verify metadata on the GPU (src/backend/cuda/spec_advance.h) against its CPU reference
// (spec_advance_reference): over fresh random batches (1 .. 300 sequences, 0 .. 4 drafts each,
// targets that agree with a random prefix of the drafts, forced counts, sequences whose chain
// runs past their block table), outputs poisoned before the launch, every output equal. The
// reference itself is checked on a hand-worked case, and the launcher's argument checks run
// anywhere. The seed is printed on failure.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/spec_advance.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::gpu_available;
template <typename T>
using DeviceBuffer = test_util::DeviceBuffer<T, test_util::UploadCheck::kNone>;

// Seq 0: x = [5, 7, 9], y = [7, 8, 1] -> a = 1 (y_0 == x_1, y_1 != x_2); pass 0 ids [7, 8, 1],
// row 1; start 10, page size 4, pages {3, 6, 2, 9}: chained pass 1 at 12 (page 9 -> slot 36),
// pass 2 at 13 (slot 37). Seq 1: one token (no drafts), forced 3 -> a = 0; start 6 with 2 pages
// (8 positions): pass 1 at 7 (page 1 = 4 -> slot 19), pass 2 at 8, past the table: clamped to 7,
// slot -1.
TEST(SpecAdvanceReference, HandWorkedCase) {
  SpecAdvanceParams shape;
  shape.seqs = 2;
  shape.table_width = 4;
  shape.page_size = 4;
  shape.passes = 2;
  SpecAdvanceHost h;
  h.verify_ids = {5, 7, 9, 11};
  h.sampled = {7, 8, 1, 12};
  h.seq_begin = {0, 3, 4};
  h.forced = {-1, 3};
  h.start = {10, 6};
  h.tables = {3, 6, 2, 9, 0, 4, 0, 0};
  h.num_pages = {4, 2};
  spec_advance_reference(shape, h);
  EXPECT_EQ(h.accepted, (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(h.mtp_ids, (std::vector<int32_t>{7, 8, 1, 12}));
  EXPECT_EQ(h.mtp_rows, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(h.chain_pos, (std::vector<int32_t>{12, 7, 13, 7}));
  EXPECT_EQ(h.chain_slots, (std::vector<int64_t>{36, 19, 37, -1}));
}

TEST(SpecAdvanceLaunch, RejectsBadShapes) {
  SpecAdvanceParams p;
  p.seqs = 1;
  p.page_size = 0;
  p.table_width = 1;
  EXPECT_THROW(spec_advance_launch(p, nullptr), Error);
  p.page_size = 16;
  EXPECT_THROW(spec_advance_launch(p, nullptr), Error);  // null arrays
}

TEST(CudaSpecAdvance, MatchesTheReference) {
  if (!gpu_available()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 gen(seed);
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(gen);
  };
  for (int trial = 0; trial < 40; ++trial) {
    SpecAdvanceParams shape;
    shape.seqs = trial == 0 ? 1 : uni(1, 300);
    shape.page_size = std::vector<int64_t>{1, 4, 16, 64}[static_cast<size_t>(uni(0, 3))];
    shape.passes = uni(0, 3);
    shape.table_width = uni(1, 12);
    const auto S = static_cast<size_t>(shape.seqs);
    SpecAdvanceHost h;
    h.seq_begin.push_back(0);
    for (size_t s = 0; s < S; ++s) {
      const int64_t k = uni(0, 4);
      const int64_t agree = uni(0, k);  // the target agrees with this many drafts
      for (int64_t j = 0; j <= k; ++j) h.verify_ids.push_back(static_cast<int32_t>(uni(0, 999)));
      const size_t b = static_cast<size_t>(h.seq_begin.back());
      for (int64_t j = 0; j <= k; ++j) {
        h.sampled.push_back(j < agree ? h.verify_ids[b + static_cast<size_t>(j) + 1]
                                      : static_cast<int32_t>(uni(0, 999)));
      }
      h.seq_begin.push_back(static_cast<int32_t>(b + static_cast<size_t>(k) + 1));
      h.forced.push_back(uni(0, 3) == 0 ? static_cast<int32_t>(uni(0, 6)) : -1);
      const int64_t pages = uni(1, shape.table_width);
      h.num_pages.push_back(static_cast<int32_t>(pages));
      // The verify positions fit the table; the chain may run past it.
      const int64_t cap = pages * shape.page_size;
      h.start.push_back(static_cast<int32_t>(uni(0, std::max<int64_t>(0, cap - k - 1))));
      for (int64_t i = 0; i < shape.table_width; ++i) {
        h.tables.push_back(static_cast<int32_t>(uni(0, 5000)));
      }
    }
    SpecAdvanceHost want = h;
    spec_advance_reference(shape, want);
    const size_t T = h.sampled.size(), PS = static_cast<size_t>(shape.passes) * S;
    DeviceBuffer<int32_t> sampled(h.sampled), ids(h.verify_ids), begin(h.seq_begin),
        forced(h.forced), start(h.start), tables(h.tables), pages(h.num_pages);
    DeviceBuffer<int32_t> accepted(S), mtp_ids(T), mtp_rows(S), pos(std::max<size_t>(PS, 1));
    DeviceBuffer<int64_t> slots(std::max<size_t>(PS, 1));
    accepted.poison(0xAB);
    mtp_ids.poison(0xAB);
    mtp_rows.poison(0xAB);
    pos.poison(0xAB);
    slots.poison(0xAB);
    SpecAdvanceParams p = shape;
    p.sampled = sampled.ptr;
    p.verify_ids = ids.ptr;
    p.seq_begin = begin.ptr;
    p.forced = forced.ptr;
    p.start = start.ptr;
    p.tables = tables.ptr;
    p.num_pages = pages.ptr;
    p.accepted = accepted.ptr;
    p.mtp_ids = mtp_ids.ptr;
    p.mtp_rows = mtp_rows.ptr;
    p.chain_pos = pos.ptr;
    p.chain_slots = slots.ptr;
    spec_advance_launch(p, nullptr);
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(accepted.download(), want.accepted) << "trial " << trial;
    EXPECT_EQ(mtp_ids.download(), want.mtp_ids) << "trial " << trial;
    EXPECT_EQ(mtp_rows.download(), want.mtp_rows) << "trial " << trial;
    if (PS > 0) {
      EXPECT_EQ(pos.download(), want.chain_pos) << "trial " << trial;
      EXPECT_EQ(slots.download(), want.chain_slots) << "trial " << trial;
    }
  }
}

}  // namespace
}  // namespace tandem::cuda
