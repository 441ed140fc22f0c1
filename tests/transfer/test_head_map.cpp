// Head mapping between prefill and decode shardings: exhaustive over the shapes we run.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "transfer/head_map.h"

namespace tandem::transfer {
namespace {

constexpr int64_t kHeads[] = {1, 2, 4, 8};
constexpr int kTps[] = {1, 2, 4, 8};

// Every destination layout worth checking for a model with h heads: decode TP (replicated
// when tp > h, which covers DP: tp 1 = all heads) and every contiguous subset.
std::vector<HeadRange> destinations(int64_t h) {
  std::vector<HeadRange> out;
  for (int tp : kTps) {
    const KvSharding d{h, tp};
    for (int r = 0; r < tp; ++r) out.push_back(d.held(r));
  }
  for (int64_t b = 0; b < h; ++b) {
    for (int64_t e = b + 1; e <= h; ++e) out.push_back({b, e});
  }
  return out;
}

TEST(HeadMap, ShardingMatchesTheModelsRule) {
  // t <= H: contiguous blocks; t > H: rank r holds head r*H/t, first replica sends.
  EXPECT_EQ((KvSharding{8, 4}.held(1)), (HeadRange{2, 4}));
  EXPECT_EQ((KvSharding{4, 8}.held(5)), (HeadRange{2, 3}));
  EXPECT_TRUE((KvSharding{4, 8}.sends(4)));
  EXPECT_FALSE((KvSharding{4, 8}.sends(5)));
  EXPECT_EQ((KvSharding{2, 4}.owner(1)), 2);
  EXPECT_EQ((KvSharding{8, 2}.owner(5)), 1);
  EXPECT_THROW((KvSharding{4, 3}.validate()), Error);
  EXPECT_THROW((KvSharding{6, 4}.validate()), Error);
  EXPECT_THROW((KvSharding{4, 2}.held(2)), Error);
  EXPECT_THROW(plan_head_slice(KvSharding{4, 2}, 0, {2, 5}), Error);
  EXPECT_THROW(plan_head_slice(KvSharding{4, 2}, 0, {1, 1}), Error);
}

TEST(HeadMap, ExhaustiveEveryHeadArrivesOnceFromItsOwner) {
  int checked = 0;
  for (int64_t h : kHeads) {
    for (int tp : kTps) {
      const KvSharding src{h, tp};
      for (const HeadRange dst : destinations(h)) {
        SCOPED_TRACE(src.str() + " -> destination " + dst.str());
        // Simulated copy of head ids: source rank r's local head i is global held(r).begin + i.
        std::vector<int64_t> got(static_cast<size_t>(dst.size()), -1);
        std::vector<int> senders;
        for (int r = 0; r < tp; ++r) {
          const HeadRange held = src.held(r);
          auto slice = plan_head_slice(src, r, dst);
          if (!slice) continue;
          senders.push_back(r);
          ASSERT_TRUE(src.sends(r));
          ASSERT_FALSE(slice->heads.empty());
          // Within both ranges, offsets consistent with them.
          ASSERT_GE(slice->heads.begin, std::max(held.begin, dst.begin));
          ASSERT_LE(slice->heads.end, std::min(held.end, dst.end));
          ASSERT_EQ(slice->src_offset, slice->heads.begin - held.begin);
          ASSERT_EQ(slice->dst_offset, slice->heads.begin - dst.begin);
          for (int64_t i = 0; i < slice->num_heads(); ++i) {
            const int64_t value = held.begin + slice->src_offset + i;
            auto& slot = got[static_cast<size_t>(slice->dst_offset + i)];
            ASSERT_EQ(slot, -1) << "head " << dst.begin + slice->dst_offset + i << " sent twice";
            slot = value;
            ASSERT_EQ(src.owner(slice->heads.begin + i), r);
          }
        }
        for (int64_t i = 0; i < dst.size(); ++i) {
          ASSERT_EQ(got[static_cast<size_t>(i)], dst.begin + i) << "local head " << i;
        }
        EXPECT_EQ(senders_for(src, dst), senders);
        // Ranges intersect for every owner of a destination head; only owners send.
        for (int r = 0; r < tp; ++r) {
          const HeadRange held = src.held(r);
          const bool overlaps = held.begin < dst.end && dst.begin < held.end;
          const bool listed = std::find(senders.begin(), senders.end(), r) != senders.end();
          EXPECT_EQ(listed, overlaps && src.sends(r)) << "rank " << r;
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 200);
}

TEST(HeadMap, SeedLayoutsPrefillTp4AndTp8WithFourHeads) {
  // Qwen3-235B: 4 KV heads. TP=4: each rank one head; TP=8: pairs replicate, even ranks send.
  const HeadRange all{0, 4};
  EXPECT_EQ(senders_for(KvSharding{4, 4}, all), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(senders_for(KvSharding{4, 8}, all), (std::vector<int>{0, 2, 4, 6}));
  auto s = plan_head_slice(KvSharding{4, 8}, 6, all);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(*s, (HeadSlice{{3, 4}, 0, 3}));
  EXPECT_FALSE(plan_head_slice(KvSharding{4, 8}, 7, all).has_value());
  // Split: TP=1 into a decode rank holding heads [2, 4).
  auto split = plan_head_slice(KvSharding{4, 1}, 0, {2, 4});
  ASSERT_TRUE(split.has_value());
  EXPECT_EQ(*split, (HeadSlice{{2, 4}, 2, 0}));
}

}  // namespace
}  // namespace tandem::transfer
