// PrefillAttentionPlan (FlashInfer's sm90 prefill kernels behind paged_attention_launch) vs
// cpu::paged_attention. Fresh random inputs every run (the seed is printed on failure); outputs
// poisoned with NaN bit patterns before each launch; block-table entries past a sequence's
// pages hold invalid page ids (a read past the end faults); odd lengths, page and tile
// boundaries, several sequences, chunks after a cached history, GQA groups 1..16, page sizes
// 8..128, decode tokens after the prefill part; both K/V paths (paged in place, gathered);
// head_dim 128 and 256. When the kernels are not built (or the GPU is not sm90) every case
// checks instead that plan() declines and the launch falls back to the FA2 kernel, still
// against the reference. Skips without a GPU, except the host-only tests at the end.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/attention_sm90.h"
#include "backend/cuda/check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::to_f32;
template <typename T>
using DeviceBuffer = test_util::DeviceBuffer<T, test_util::UploadCheck::kThrow>;

// Relative L2 error below 1e-2 and no element off by more than 0.05 + 5%; names the worst
// element (token, head, dim) on failure.
::testing::AssertionResult close(Bits const& out_bits, std::vector<float> const& ref, int64_t heads,
                                 int64_t head_dim) {
  const std::vector<float> out = to_f32(out_bits);
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << out.size() << " vs " << ref.size();
  }
  double num = 0, den = 0, worst = -1;
  size_t worst_i = 0, bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double d = std::isfinite(out[i]) ? std::fabs(double(out[i]) - ref[i]) : INFINITY;
    num += d * d;
    den += double(ref[i]) * ref[i];
    if (d > worst) {
      worst = d;
      worst_i = i;
    }
    if (d > 0.05 + 0.05 * std::fabs(ref[i])) ++bad;
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  if (rel < 1e-2 && bad == 0) return ::testing::AssertionSuccess();
  const int64_t d = static_cast<int64_t>(worst_i) % head_dim;
  const int64_t th = static_cast<int64_t>(worst_i) / head_dim;
  return ::testing::AssertionFailure()
         << "rel err " << rel << ", " << bad << " of " << out.size()
         << " elements off; worst [token " << th / heads << ", head " << th % heads << ", dim " << d
         << "] " << out[worst_i] << " vs ref " << ref[worst_i];
}

/// A sequence: `len` keys after this step, the last `queries` of them this step's queries.
struct SeqSpec {
  int64_t len, queries;
};

struct Case {
  int64_t q_heads, kv_heads, head_dim, page_size;
  std::vector<SeqSpec> prefill;  // the prefill part (num_prefill_tokens)
  std::vector<SeqSpec> decode;   // decode tokens after it (queries 1 each)
  float q_mean = 0.f;            // > 0: peaked softmax
  int64_t kv_split = 0;          // > 0: the decode tokens' keys in splits (with a workspace)
  std::string name() const {
    std::ostringstream s;
    s << q_heads << "q/" << kv_heads << "kv d" << head_dim << " page " << page_size << " prefill";
    for (auto const& q : prefill) s << " " << q.len << ":" << q.queries;
    s << " decode";
    for (auto const& q : decode) s << " " << q.len;
    if (kv_split > 0) s << " split " << kv_split;
    return s.str();
  }
};

class CudaAttentionSm90 : public test_util::CudaFixture<> {
 protected:
  // Kept across the cases of a test: plans reuse and grow their buffers.
  PrefillAttentionPlan paged_{PrefillKvPath::kPaged}, gathered_{PrefillKvPath::kGathered};

  // Whether this build and device run the FlashInfer kernels (else the fallback is checked).
  static bool expect_sm90() {
    return PrefillAttentionPlan::built() && PrefillAttentionPlan::device_supported();
  }

  Bits randn_bf16(size_t n, float mean = 0.f) {
    std::normal_distribution<float> d(mean, 1.f);
    Bits b(n);
    for (auto& x : b) x = f32_to_bf16(d(rng_));
    return b;
  }

  // direct: calls plan.run() itself instead of paged_attention_launch (prefill tokens only).
  void check(Case const& c, PrefillAttentionPlan& plan, bool direct = false) {
    SCOPED_TRACE(c.name());
    const int64_t ps = c.page_size;
    std::vector<SeqSpec> seqs = c.prefill;
    seqs.insert(seqs.end(), c.decode.begin(), c.decode.end());
    int64_t max_pages = 1, num_pages = 7;  // a few pages nobody owns
    for (auto const& s : seqs) {
      max_pages = std::max(max_pages, (s.len + ps - 1) / ps + 1);  // one spare entry
      num_pages += (s.len + ps - 1) / ps;
    }
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    std::vector<int32_t> table(seqs.size() * max_pages, 0x3fffffff), token_seq, positions;
    size_t next = 0;
    int64_t num_prefill = 0;
    for (size_t sq = 0; sq < seqs.size(); ++sq) {
      for (int64_t pg = 0; pg < (seqs[sq].len + ps - 1) / ps; ++pg) {
        table[sq * max_pages + pg] = perm[next++];
      }
      for (int64_t pos = seqs[sq].len - seqs[sq].queries; pos < seqs[sq].len; ++pos) {
        token_seq.push_back(static_cast<int32_t>(sq));
        positions.push_back(static_cast<int32_t>(pos));
      }
      if (sq + 1 == c.prefill.size()) num_prefill = static_cast<int64_t>(token_seq.size());
    }
    const int64_t tokens = static_cast<int64_t>(token_seq.size());
    const Bits pool = randn_bf16(num_pages * 2 * c.kv_heads * ps * c.head_dim);
    const Bits q = randn_bf16(tokens * c.q_heads * c.head_dim, c.q_mean);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));

    std::vector<float> qf = to_f32(q), pf = to_f32(pool), ref(tokens * c.q_heads * c.head_dim);
    cpu::paged_attention({qf.data(), pf.data(), table.data(), token_seq.data(), positions.data(),
                          ref.data(), tokens, c.q_heads, c.kv_heads, c.head_dim, ps, max_pages,
                          scale});

    DeviceBuffer<uint16_t> d_pool(pool), d_q(q), d_out(tokens * c.q_heads * c.head_dim);
    DeviceBuffer<int32_t> d_table(table), d_seq(token_seq), d_pos(positions);
    const bool planned = plan.plan({token_seq.data(), positions.data(), num_prefill, c.q_heads,
                                    c.kv_heads, c.head_dim, ps, max_pages},
                                   stream_);
    const bool want = expect_sm90() && (c.head_dim == 128 || c.head_dim == 256);
    ASSERT_EQ(planned, want) << plan.why();
    d_out.poison(0xff);
    PagedAttentionParams p{d_q.bf(),   d_pool.bf(), d_table.ptr, d_seq.ptr,  d_pos.ptr,
                           d_out.bf(), tokens,      c.q_heads,   c.kv_heads, c.head_dim,
                           ps,         max_pages,   scale};
    p.num_prefill_tokens = num_prefill;
    p.prefill_plan = &plan;
    DeviceBuffer<float> d_ws(
        std::max<size_t>(1, paged_attention_workspace_floats(tokens, c.q_heads, c.head_dim,
                                                             max_pages, ps, c.kv_split)));
    if (c.kv_split > 0) {
      d_ws.poison(0xff);
      p.kv_split = c.kv_split;
      p.workspace = d_ws.ptr;
    }
    if (direct) {
      ASSERT_EQ(num_prefill, tokens);
      plan.run(p, stream_);
    } else {
      paged_attention_launch(p, stream_);
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    EXPECT_TRUE(close(d_out.download(), ref, c.q_heads, c.head_dim));
  }

  void check_both(Case const& c, bool direct = false) {
    {
      SCOPED_TRACE("paged");
      check(c, paged_, direct);
      if (paged_.ready()) {  // head_dim 256 is always gathered
        EXPECT_EQ(paged_.path(),
                  c.head_dim == 128 ? PrefillKvPath::kPaged : PrefillKvPath::kGathered);
      }
    }
    {
      SCOPED_TRACE("gathered");
      check(c, gathered_, direct);
      if (gathered_.ready()) {
        EXPECT_EQ(gathered_.path(), PrefillKvPath::kGathered);
      }
    }
  }
};

TEST_F(CudaAttentionSm90, FreshPrefill) {
  SCOPED_TRACE(trace());
  // One chunk from position 0: 1 token, partial / exact / ragged tiles of 128 queries.
  for (int64_t len : {1, 5, 16, 127, 128, 129, 300, 1000})
    check_both({32, 4, 128, 16, {{len, len}}, {}});
  check_both({8, 1, 128, 16, {{2053, 2053}}, {}});  // many key tiles, GQA 8
}

TEST_F(CudaAttentionSm90, ChunkAfterHistory) {
  SCOPED_TRACE(trace());
  // A chunk continuing a cached history: history not page aligned, page aligned, tile aligned,
  // longer than the chunk.
  check_both({32, 4, 128, 16, {{37 + 200, 200}}, {}});
  check_both({32, 4, 128, 16, {{64 + 129, 129}}, {}});
  check_both({32, 4, 128, 16, {{256 + 256, 256}}, {}});
  check_both({8, 1, 128, 16, {{1001, 77}}, {}});
  check_both({8, 1, 128, 16, {{3000 + 333, 333}}, {}});
  check_both({32, 4, 128, 16, {{2, 1}}, {}});  // a one-query "chunk" after one key
}

TEST_F(CudaAttentionSm90, SeveralSequencesAndDecodeTokens) {
  SCOPED_TRACE(trace());
  check_both({32, 4, 128, 16, {{150, 150}, {90, 40}, {513, 257}, {7, 3}}, {}});
  check_both(
      {32, 4, 128, 16, {{150, 150}, {90, 40}}, {{1, 1}, {17, 1}, {4096, 1}, {64, 1}, {333, 1}}});
  check_both({64, 4, 128, 16, {{300, 300}, {1000, 130}, {2, 2}}, {{17, 1}, {900, 1}}});
}

TEST_F(CudaAttentionSm90, GqaGroups) {
  SCOPED_TRACE(trace());
  for (int64_t group : {1, 2, 4, 8, 16}) {
    const int64_t kv = group >= 8 ? 2 : 3;
    check_both({kv * group, kv, 128, 16, {{100, 60}, {260, 260}}, {{33, 1}}});
  }
}

TEST_F(CudaAttentionSm90, PageSizes) {
  SCOPED_TRACE(trace());
  for (int64_t ps : {8, 32, 64, 128}) {
    check_both({32, 4, 128, ps, {{211, 100}, {129, 129}}, {{700, 1}}});
  }
}

TEST_F(CudaAttentionSm90, SkewedScores) {
  SCOPED_TRACE(trace());
  // Large query mean: peaked softmax, large running-max corrections.
  Case c{32, 4, 128, 16, {{400, 180}, {300, 300}}, {{2500, 1}}};
  c.q_mean = 2.0f;
  check_both(c);
}

TEST_F(CudaAttentionSm90, HeadDim256) {
  SCOPED_TRACE(trace());
  // Qwen3.5's gated attention (16 q / 2 kv heads x 256): the ragged kernel, prefill only.
  if (!expect_sm90()) GTEST_SKIP() << "FlashInfer sm90 kernels not built or not an sm90 GPU";
  check_both({16, 2, 256, 16, {{300, 300}}, {}}, /*direct=*/true);
  check_both({16, 2, 256, 16, {{129, 129}, {1000, 77}, {5, 5}}, {}}, /*direct=*/true);
  check_both({32, 2, 256, 64, {{600 + 65, 65}, {64, 64}}, {}}, /*direct=*/true);
}

TEST_F(CudaAttentionSm90, HeadDim256ThroughLaunch) {
  SCOPED_TRACE(trace());
  // Qwen35MoeCuda's call: paged_attention_launch with a ready plan runs the prefill tokens on
  // the ragged kernel and the decode tokens after them on the simple kernel (no FlashInfer or
  // not sm90: plan() declines and the simple kernel runs every token). GQA 8 and 16 (the 35B /
  // 122B-A10B shapes), several query tiles, chunks after a history, split decode tokens.
  check_both({16, 2, 256, 16, {{300, 300}}, {}});
  check_both({32, 2, 256, 16, {{520, 520}, {129 + 40, 40}}, {{33, 1}, {700, 1}}});
  Case split{32, 2, 256, 16, {{600 + 65, 65}}, {{1, 1}, {900, 1}, {2000, 1}}};
  split.kv_split = 256;
  check_both(split);
}

TEST_F(CudaAttentionSm90, AutoPathAndFallbacks) {
  SCOPED_TRACE(trace());
  // kAuto gathers up to max_gather_keys keys, reads the pages in place past that.
  PrefillAttentionPlan small(PrefillKvPath::kAuto, /*max_gather_keys=*/500);
  check({32, 4, 128, 16, {{300, 300}}, {{40, 1}}}, small);
  if (small.ready()) {
    EXPECT_EQ(small.path(), PrefillKvPath::kGathered);
  }
  check({32, 4, 128, 16, {{300, 300}, {400, 100}}, {}}, small);
  if (small.ready()) {
    EXPECT_EQ(small.path(), PrefillKvPath::kPaged);
  }
  // head_dim 64: declined, the FA2 kernel runs (check() expects planned == false).
  check({32, 4, 64, 16, {{300, 300}}, {{40, 1}}}, small);
  EXPECT_FALSE(small.ready());
}

TEST_F(CudaAttentionSm90, RejectsMismatchedLaunch) {
  if (!expect_sm90()) GTEST_SKIP() << "FlashInfer sm90 kernels not built or not an sm90 GPU";
  const std::vector<int32_t> seq(10, 0), pos = [] {
    std::vector<int32_t> v(10);
    std::iota(v.begin(), v.end(), 0);
    return v;
  }();
  ASSERT_TRUE(paged_.plan({seq.data(), pos.data(), 10, 32, 4, 128, 16, 1}, stream_))
      << paged_.why();
  DeviceBuffer<uint16_t> buf(16 * 2 * 4 * 16 * 128);
  DeviceBuffer<int32_t> ints(16);
  PagedAttentionParams p{buf.bf(), buf.bf(), ints.ptr, ints.ptr, ints.ptr, buf.bf(), 10,
                         32,       4,        128,      16,       1,        0.1f};
  p.num_prefill_tokens = 10;
  p.num_q_heads = 64;  // the plan was for 32
  EXPECT_THROW(paged_.run(p, stream_), Error);
  p.num_q_heads = 32;
  p.max_pages_per_seq = 2;
  EXPECT_THROW(paged_.run(p, stream_), Error);
}

// Host-only (no GPU needed): what plan() declines before touching the device.
TEST(CudaAttentionSm90Host, PlanDeclines) {
  PrefillAttentionPlan plan;
  const std::vector<int32_t> seq = {0, 0, 0, 1, 1}, pos = {0, 1, 2, 5, 6};
  EXPECT_FALSE(plan.plan({seq.data(), pos.data(), 5, 32, 4, 64, 16, 4}, nullptr));  // head_dim
  EXPECT_FALSE(plan.ready());
  EXPECT_FALSE(plan.plan({seq.data(), pos.data(), 0, 32, 4, 128, 16, 4}, nullptr));  // empty
  EXPECT_FALSE(plan.why().empty());
  if (!test_util::gpu_available() || !PrefillAttentionPlan::device_supported()) {
    EXPECT_FALSE(plan.plan({seq.data(), pos.data(), 5, 32, 4, 128, 16, 4}, nullptr));
    return;
  }
  if (PrefillAttentionPlan::built()) {
    // A sequence's chunk with a gap in its positions: declined (the FA2 kernel handles it).
    const std::vector<int32_t> gap = {0, 1, 3, 5, 6};
    EXPECT_FALSE(plan.plan({seq.data(), gap.data(), 5, 32, 4, 128, 16, 4}, nullptr));
    // Keys past the block table (sequence 1 has 7 keys: 2 pages of 4, the table 1): a caller
    // bug.
    EXPECT_THROW(plan.plan({seq.data(), pos.data(), 5, 32, 4, 128, 4, 1}, nullptr), Error);
    EXPECT_FALSE(plan.ready());
    EXPECT_TRUE(plan.plan({seq.data(), pos.data(), 5, 32, 4, 128, 16, 4}, nullptr)) << plan.why();
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

}  // namespace
}  // namespace tandem::cuda
