// Tensor-core paged attention (prefill and split-KV decode kernels behind
// paged_attention_launch) vs cpu::paged_attention. Fresh random inputs every run (the seed is
// printed on failure); outputs and workspaces poisoned with NaN bit patterns before each
// launch; block-table entries past a sequence's pages hold invalid page ids, so a read past the
// end faults instead of passing. GQA groups 1, 2, 4, 8 and 16 (Qwen3-235B-A22B: 64 q / 4 kv
// heads); the simple kernel runs on every case too. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/attention_fa.h"
#include "backend/cuda/check.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "decode_graph_replay.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::gpu_available;
using test_util::to_f32;
// upload() of a wrong size throws here (TANDEM_CHECK).
template <typename T>
using DeviceBuffer = test_util::DeviceBuffer<T, test_util::UploadCheck::kThrow>;

constexpr double kTolBf16 = 1e-2;

// Relative L2 error below tol and every element finite; on failure names the worst element as
// (token, head, dim) with both values.
::testing::AssertionResult close(Bits const& out_bits, std::vector<float> const& ref, int64_t heads,
                                 int64_t head_dim, double tol) {
  const std::vector<float> out = to_f32(out_bits);
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << out.size() << " vs " << ref.size();
  }
  double num = 0, den = 0, worst = -1;
  size_t worst_i = 0, bad = 0, first_bad = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double d = std::isfinite(out[i]) ? std::fabs(double(out[i]) - ref[i]) : INFINITY;
    num += d * d;
    den += double(ref[i]) * ref[i];
    if (d > worst) {
      worst = d;
      worst_i = i;
    }
    if (d > 0.05 + 0.05 * std::fabs(ref[i]) && bad++ == 0) first_bad = i;
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  if (rel < tol && bad == 0) return ::testing::AssertionSuccess();
  auto where = [&](size_t i) {
    std::ostringstream s;
    const int64_t d = static_cast<int64_t>(i) % head_dim, th = static_cast<int64_t>(i) / head_dim;
    s << "[token " << th / heads << ", head " << th % heads << ", dim " << d << "] " << out[i]
      << " vs ref " << ref[i];
    return s.str();
  };
  return ::testing::AssertionFailure()
         << "rel err " << rel << " (tol " << tol << "), " << bad << " of " << out.size()
         << " elements off by > 0.05 + 5%; first " << (bad ? where(first_bad) : "-") << "; worst "
         << where(worst_i);
}

/// A sequence of the batch: `len` tokens in the cache after this step, of which the last
/// `queries` are this step's query tokens (queries 1: decode; len == queries: fresh prefill).
struct SeqSpec {
  int64_t len, queries;
};

struct Case {
  int64_t q_heads, kv_heads, head_dim, page_size;
  std::vector<SeqSpec> seqs;  // multi-query sequences first (the prefill part)
  int64_t extra_pages = 0;    // block-table capacity past the longest sequence
  float q_mean = 0.f;         // > 0 skews the scores (peaked softmax)
  std::string name() const {
    std::ostringstream s;
    s << q_heads << "q/" << kv_heads << "kv d" << head_dim << " page " << page_size << " seqs";
    for (auto const& q : seqs) s << " " << q.len << ":" << q.queries;
    return s.str();
  }
};

class CudaAttention : public test_util::CudaFixture<> {
 protected:
  Bits randn_bf16(size_t n, float scale, float mean = 0.f) {
    std::normal_distribution<float> d(mean, scale);
    Bits b(n);
    for (auto& x : b) x = f32_to_bf16(d(rng_));
    return b;
  }

  /// Host batch of a case: shuffled pages, table entries past each sequence invalid.
  struct Batch {
    int64_t max_pages = 0, num_pages = 0, tokens = 0, prefill_tokens = 0;
    std::vector<int32_t> table, token_seq, positions;
    Bits pool, q;
  };
  Batch make_batch(Case const& c) {
    Batch b;
    const int64_t ps = c.page_size, n = static_cast<int64_t>(c.seqs.size());
    for (auto const& s : c.seqs) {
      b.max_pages = std::max(b.max_pages, (s.len + ps - 1) / ps);
      b.num_pages += (s.len + ps - 1) / ps;
    }
    b.max_pages += c.extra_pages;
    b.num_pages += 5;  // unused pages
    std::vector<int32_t> perm(b.num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    b.table.assign(n * b.max_pages, 0x3fffffff);  // faults if read
    size_t next = 0;
    for (int64_t sq = 0; sq < n; ++sq) {
      for (int64_t pg = 0; pg < (c.seqs[sq].len + ps - 1) / ps; ++pg) {
        b.table[sq * b.max_pages + pg] = perm[next++];
      }
      for (int64_t pos = c.seqs[sq].len - c.seqs[sq].queries; pos < c.seqs[sq].len; ++pos) {
        b.token_seq.push_back(static_cast<int32_t>(sq));
        b.positions.push_back(static_cast<int32_t>(pos));
      }
      if (c.seqs[sq].queries > 1) b.prefill_tokens = static_cast<int64_t>(b.token_seq.size());
    }
    b.tokens = static_cast<int64_t>(b.token_seq.size());
    b.pool = randn_bf16(b.num_pages * 2 * c.kv_heads * ps * c.head_dim, 1.f);
    b.q = randn_bf16(b.tokens * c.q_heads * c.head_dim, 1.f, c.q_mean);
    return b;
  }

  std::vector<float> reference(Case const& c, Batch const& b, float scale) {
    std::vector<float> qf = to_f32(b.q), pf = to_f32(b.pool),
                       ref(b.tokens * c.q_heads * c.head_dim);
    cpu::paged_attention({qf.data(), pf.data(), b.table.data(), b.token_seq.data(),
                          b.positions.data(), ref.data(), b.tokens, c.q_heads, c.kv_heads,
                          c.head_dim, c.page_size, b.max_pages, scale});
    return ref;
  }

  /// Runs every dispatch of paged_attention_launch on the case and checks each.
  void check(Case const& c) {
    SCOPED_TRACE(c.name());
    Batch b = make_batch(c);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    const std::vector<float> ref = reference(c, b, scale);
    DeviceBuffer<uint16_t> d_pool(b.pool), d_q(b.q), d_out(b.tokens * c.q_heads * c.head_dim);
    DeviceBuffer<int32_t> d_table(b.table), d_seq(b.token_seq), d_pos(b.positions);
    struct Variant {
      const char* name;
      PagedAttentionAlgo algo;
      int64_t num_prefill_tokens, kv_split;
    };
    const int64_t npf = b.prefill_tokens;
    const std::vector<Variant> variants = {
        {"auto split prefill/decode", PagedAttentionAlgo::kAuto, npf, 0},
        {"auto split prefill/decode, kv_split 128", PagedAttentionAlgo::kAuto, npf, 128},
        {"auto unknown (prefill kernel for all)", PagedAttentionAlgo::kAuto, -1, 0},
        {"auto unknown, kv_split 256 (decode kernel for all)", PagedAttentionAlgo::kAuto, -1, 256},
        {"prefill kernel", PagedAttentionAlgo::kPrefill, -1, 0},
        {"decode kernel", PagedAttentionAlgo::kDecode, -1, 0},
        {"simple kernel", PagedAttentionAlgo::kSimple, -1, 0},
        {"simple kernel, kv_split 128", PagedAttentionAlgo::kSimple, -1, 128},
    };
    for (Variant const& v : variants) {
      SCOPED_TRACE(v.name);
      DeviceBuffer<float> d_ws(paged_attention_workspace_floats(
          b.tokens, c.q_heads, c.head_dim, b.max_pages, c.page_size, v.kv_split));
      d_ws.poison(0xff);
      d_out.poison(0xff);
      PagedAttentionParams p{d_q.bf(),    d_pool.bf(), d_table.ptr, d_seq.ptr,  d_pos.ptr,
                             d_out.bf(),  b.tokens,    c.q_heads,   c.kv_heads, c.head_dim,
                             c.page_size, b.max_pages, scale,       v.kv_split, d_ws.ptr};
      p.num_prefill_tokens = v.num_prefill_tokens;
      p.algo = v.algo;
      paged_attention_launch(p, stream_);
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream_));
      EXPECT_TRUE(close(d_out.download(), ref, c.q_heads, c.head_dim, kTolBf16));
    }
  }

  /// DecodeGraphReplay with q_heads over 4 kv heads.
  void graph_replay(int64_t q_heads);
};

TEST_F(CudaAttention, PrefillFromZero) {
  SCOPED_TRACE(trace());
  // One chunk from position 0: 1 token, a partial tile, several tiles plus a ragged end.
  for (int64_t len : {1, 5, 16, 129, 300}) {
    check({32, 4, 128, 16, {{len, len}}});
    check({64, 4, 128, 16, {{len, len}}});  // GQA 16: 8 tokens per prefill tile
  }
  check({8, 1, 128, 16, {{1000, 1000}}});   // many key tiles, GQA 8
  check({16, 1, 128, 16, {{1000, 1000}}});  // many key tiles, GQA 16
  check({64, 4, 64, 16, {{300, 300}}});     // GQA 16, head_dim 64
}

TEST_F(CudaAttention, PrefillAfterCachedPrefix) {
  SCOPED_TRACE(trace());
  // A chunk continuing at a cached prefix that is not page (nor tile) aligned.
  check({32, 4, 128, 16, {{37 + 200, 200}}});
  check({8, 1, 128, 16, {{1001, 77}}});
  check({16, 2, 64, 32, {{515, 130}}});
  // GQA 16.
  check({64, 4, 128, 16, {{37 + 200, 200}}});
  check({16, 1, 128, 16, {{1001, 77}}});
  check({32, 2, 64, 32, {{515, 130}}});
}

TEST_F(CudaAttention, MixedBatch) {
  SCOPED_TRACE(trace());
  // Two prefill chunks, then decode tokens of other sequences (contexts 1, 17, 4096, ...).
  check({32, 4, 128, 16, {{150, 150}, {90, 40}, {1, 1}, {17, 1}, {4096, 1}, {64, 1}, {333, 1}}});
  check({8, 4, 64, 16, {{70, 3}, {1, 1}, {17, 1}, {200, 1}}});
  // GQA 16.
  check({64, 4, 128, 16, {{150, 150}, {90, 40}, {1, 1}, {17, 1}, {4096, 1}, {64, 1}, {333, 1}}});
  check({64, 4, 64, 16, {{70, 3}, {1, 1}, {17, 1}, {200, 1}}});
}

TEST_F(CudaAttention, DecodeContexts) {
  SCOPED_TRACE(trace());
  for (int64_t q_heads : {32, 64}) {  // GQA 8 and 16
    for (int64_t ctx : {1, 17, 4096}) check({q_heads, 4, 128, 16, {{ctx, 1}}});
    check({q_heads, 4, 128, 16, {{4096, 1}, {1, 1}, {17, 1}, {2000, 1}, {129, 1}}, 7});
  }
  for (int64_t ctx : {1, 17, 4096}) check({64, 4, 64, 16, {{ctx, 1}}});  // GQA 16, head_dim 64
}

TEST_F(CudaAttention, GroupsAndHeadDims) {
  SCOPED_TRACE(trace());
  for (int64_t d : {64, 128}) {
    for (int64_t group : {1, 2, 4, 8, 16}) {
      const int64_t kv = group >= 8 ? 2 : 3;
      check({kv * group, kv, d, 16, {{100, 60}, {33, 1}, {260, 1}}});
    }
  }
}

// Qwen3.5's gated attention: head_dim 256 (the tensor-core decode kernel for kDecode and
// kAuto's decode tokens, the simple kernel for the rest), GQA 1 to 16 (Qwen3.5-35B-A3B: 16 q /
// 2 kv heads; 397B-A17B: 32 / 2), prefill, decode and split-KV.
TEST_F(CudaAttention, HeadDim256) {
  SCOPED_TRACE(trace());
  for (int64_t group : {1, 2, 4, 8, 16}) {
    check({2 * group, 2, 256, 16, {{100, 60}, {33, 1}, {260, 1}}});
  }
  check({16, 2, 256, 16, {{1, 1}, {700, 1}, {17, 1}}, 3});
  check({32, 2, 256, 16, {{301, 301}}});
}

// The tensor-core decode kernel at head_dim 256: contexts of 1 key, a partial tile, tile edges,
// thousands of keys, capacity past the longest sequence (empty splits), page sizes 1 to 64,
// GQA 1 to 16.
TEST_F(CudaAttention, HeadDim256Decode) {
  SCOPED_TRACE(trace());
  for (int64_t group : {1, 2, 4, 8, 16}) {
    check({2 * group, 2, 256, 16, {{1, 1}, {63, 1}, {64, 1}, {65, 1}, {4096, 1}, {129, 1}}, 2});
  }
  for (int64_t ps : {1, 8, 32, 64}) check({16, 2, 256, ps, {{130, 1}, {1, 1}, {1000, 1}}, 1});
  Case skewed{32, 2, 256, 16, {{2500, 1}, {3, 1}, {400, 1}}};
  skewed.q_mean = 2.0f;
  check(skewed);
}

TEST_F(CudaAttention, PageSizes) {
  SCOPED_TRACE(trace());
  for (int64_t ps : {8, 32, 64, 128}) {
    check({32, 4, 128, ps, {{211, 100}, {1, 1}, {700, 1}}, 2});
    check({64, 4, 128, ps, {{211, 100}, {1, 1}, {700, 1}}, 2});
  }
}

TEST_F(CudaAttention, SkewedScores) {
  SCOPED_TRACE(trace());
  // Queries with a large mean: the keys' shared direction dominates, peaked softmax, large
  // running-max corrections.
  for (int64_t q_heads : {32, 64}) {
    Case c{q_heads, 4, 128, 16, {{400, 180}, {2500, 1}, {3, 1}}};
    c.q_mean = 2.0f;
    check(c);
  }
}

TEST_F(CudaAttention, ManyPrefillTokensOfTinyModel) {
  SCOPED_TRACE(trace());
  // Tiles that hold several sequences' chunks (group 1: 128 tokens per tile; group 16: 8).
  check({4, 4, 64, 16, {{10, 10}, {50, 30}, {3, 3}, {140, 70}, {1, 1}, {5, 1}}});
  check({16, 1, 64, 16, {{10, 10}, {50, 30}, {3, 3}, {140, 70}, {1, 1}, {5, 1}}});
  check({64, 4, 128, 16, {{5, 5}, {9, 2}, {2, 2}, {30, 9}, {1, 1}, {5, 1}}});
}

// Decode captured once in a CUDA graph at a fixed capacity, replayed with other lengths and
// block tables (the model's decode steps). GQA 8 and 16.
TEST_F(CudaAttention, DecodeGraphReplay) {
  SCOPED_TRACE(trace());
  for (int64_t q_heads : {32, 64}) graph_replay(q_heads);
}

void CudaAttention::graph_replay(int64_t q_heads) {
  SCOPED_TRACE("q_heads " + std::to_string(q_heads));
  const int64_t kv_heads = 4, d = 128, ps = 16, max_pages = 64, seqs = 4;
  const int64_t num_pages = seqs * max_pages + 3;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t kv_split = paged_attention_pick_split(seqs, kv_heads, max_pages, ps, 132);
  ASSERT_GT(kv_split, 0);
  Bits pool = randn_bf16(num_pages * 2 * kv_heads * ps * d, 1.f);
  DeviceBuffer<uint16_t> d_pool(pool), d_q(seqs * q_heads * d), d_out(seqs * q_heads * d);
  DeviceBuffer<int32_t> d_table(seqs * max_pages), d_seq(seqs), d_pos(seqs);
  DeviceBuffer<float> d_ws(
      paged_attention_workspace_floats(seqs, q_heads, d, max_pages, ps, kv_split));
  d_ws.poison(0xff);
  PagedAttentionParams p{d_q.bf(),   d_pool.bf(), d_table.ptr, d_seq.ptr, d_pos.ptr,
                         d_out.bf(), seqs,        q_heads,     kv_heads,  d,
                         ps,         max_pages,   scale,       kv_split,  d_ws.ptr};
  p.num_prefill_tokens = 0;
  const std::vector<float> pf = to_f32(pool);
  test_util::replay_decode_graph(
      p, num_pages, stream_, rng_, d_q, d_table, d_seq, d_pos, d_out,
      [&] { return randn_bf16(seqs * q_heads * d, 1.f); },
      [&](test_util::DecodeReplayInputs const& in) {
        std::vector<float> qf = to_f32(in.q), ref(seqs * q_heads * d);
        cpu::paged_attention({qf.data(), pf.data(), in.table.data(), in.token_seq.data(),
                              in.positions.data(), ref.data(), seqs, q_heads, kv_heads, d, ps,
                              max_pages, scale});
        EXPECT_TRUE(close(d_out.download(), ref, q_heads, d, kTolBf16));
      });
}

TEST_F(CudaAttention, RejectsUnsupported) {
  PagedAttentionParams p{};
  p.num_tokens = 1;
  p.page_size = 12;  // not a power of two: the tensor-core kernels index pages by shift
  p.max_pages_per_seq = 1;
  p.num_q_heads = 32;
  p.num_kv_heads = 4;
  p.head_dim = 128;
  DeviceBuffer<uint16_t> buf(1024);
  p.q = p.pool = buf.bf();
  p.out = buf.bf();
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.page_size = 16;
  p.num_prefill_tokens = 2;  // more than num_tokens
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.num_prefill_tokens = -1;
  p.num_q_heads = 128;  // group 32
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
}

// Host-only: about 4 waves of decode blocks (3 per SM on 132 SMs), splits of 128 keys or more.
TEST(CudaAttentionHost, DecodeSplit) {
  EXPECT_EQ(paged_attention_decode_split(1, 4, 256, 16, 132), 128);
  EXPECT_EQ(paged_attention_decode_split(32, 4, 256, 16, 132), 384);
  EXPECT_EQ(paged_attention_decode_split(128, 4, 256, 16, 132), 1024);
  EXPECT_EQ(paged_attention_decode_split(512, 4, 256, 16, 132), 0);
  EXPECT_EQ(paged_attention_decode_split(1, 4, 8, 16, 132), 0);  // 128 keys: nothing to split
}

// Host-only: the blocks' shared memory fits an H100/H200 multiprocessor (227 KiB per block);
// three decode blocks fit one (228 KiB, 1 KiB reserved per block) at every head_dim, bf16 or
// FP8 pages alike (head_dim 256: 32-key tiles of 2 warps).
TEST(CudaAttentionHost, SharedMemoryFits) {
  for (int64_t d : {64, 128}) {
    EXPECT_LE(detail::paged_attention_prefill_smem(d), 227u * 1024);
    EXPECT_LE(detail::paged_attention_decode_smem(d), 227u * 1024);
  }
  for (int64_t d : {64, 128, 256}) {
    for (bool fp8 : {false, true}) {
      EXPECT_LE(3 * (detail::paged_attention_decode_smem(d, fp8) + 1024), 228u * 1024) << d;
    }
    EXPECT_EQ(detail::paged_attention_decode_smem(d, true), detail::paged_attention_decode_smem(d));
  }
  EXPECT_EQ(detail::paged_attention_decode_smem(128), 69632u);  // 68 KiB
  EXPECT_EQ(detail::paged_attention_decode_smem(256), 73728u);  // 72 KiB
}

}  // namespace
}  // namespace tandem::cuda
