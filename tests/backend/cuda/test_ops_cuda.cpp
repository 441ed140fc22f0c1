// Each CUDA op against the CPU reference (src/backend/cpu/ops.h), bf16 inputs converted to
// fp32 for the reference. Fresh random inputs every run (the seed is printed on failure),
// outputs poisoned (NaN bit patterns, 0x7f7f7f7f for integers) before each launch and checked
// fully written, relative error ||out - ref|| / ||ref|| per output dtype: bf16 outputs 1e-2,
// fp32 outputs 1e-5 where the op computes in fp32, integer outputs exact.
// Every test skips (GTEST_SKIP) when no CUDA device is visible: CI has none.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/norm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::DeviceBuffer;
using test_util::gpu_available;
using test_util::rel_err;
using test_util::to_bf16;
using test_util::to_f32;

constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-5;

/// Device memory of `count` elements of T, freed on scope exit.

// ||out - ref|| / ||ref||; a non-finite output anywhere fails (returns infinity).

// Exact comparison that reports the number of differing elements and the first one, not both
// whole vectors (NaN never equals).
template <typename T>
::testing::AssertionResult same(std::vector<T> const& out, std::vector<T> const& ref) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << out.size() << " vs " << ref.size();
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!(out[i] == ref[i])) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << out.size() << " elements differ; first ["
                                       << first << "]: " << +out[first] << " vs " << +ref[first];
}

class CudaOps : public test_util::CudaFixture<> {
 protected:
  std::vector<float> randn(size_t n, float scale = 1.0f, float mean = 0.0f) {
    std::normal_distribution<float> d(mean, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }
  // Random bf16 values (and their exact fp32 values via to_f32).
  Bits randn_bf16(size_t n, float scale = 1.0f, float mean = 0.0f) {
    return to_bf16(randn(n, scale, mean));
  }
  int64_t uniform(int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
};

// ------------------------------------------------------------------------------ embedding

TEST_F(CudaOps, Embedding) {
  SCOPED_TRACE(trace());
  const int64_t vocab = 1000;
  for (int64_t hidden : {2048, 72, 37}) {
    for (int64_t tokens : {1, 7, 130}) {
      SCOPED_TRACE("hidden " + std::to_string(hidden) + " tokens " + std::to_string(tokens));
      Bits table = randn_bf16(vocab * hidden);
      std::vector<int32_t> ids(tokens);
      for (auto& id : ids) id = static_cast<int32_t>(uniform(0, vocab - 1));
      DeviceBuffer<uint16_t> d_table(table), d_out(tokens * hidden);
      DeviceBuffer<int32_t> d_ids(ids);
      d_out.poison(0xff);
      embedding_launch({d_ids.ptr, d_table.bf(), d_out.bf(), tokens, hidden, vocab}, stream_);
      sync();
      std::vector<float> ref(tokens * hidden), tf = to_f32(table);
      cpu::embedding({ids.data(), tf.data(), ref.data(), tokens, hidden, vocab});
      EXPECT_TRUE(same(to_f32(d_out.download()), ref));  // a copy: exact
    }
  }
}

// ------------------------------------------------------------------------------ rms norm

TEST_F(CudaOps, RmsNorm) {
  SCOPED_TRACE(trace());
  for (int64_t dim : {2048, 4096, 40, 33}) {
    for (int64_t rows : {1, 3, 257}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + " rows " + std::to_string(rows));
      Bits x = randn_bf16(rows * dim, 2.0f), w = randn_bf16(dim, 0.1f, 1.0f);
      DeviceBuffer<uint16_t> d_x(x), d_w(w), d_out(rows * dim);
      d_out.poison(0xff);
      rms_norm_launch({d_x.bf(), d_w.bf(), d_out.bf(), rows, dim, 1e-6f}, stream_);
      std::vector<float> xf = to_f32(x), wf = to_f32(w), ref(rows * dim);
      cpu::rms_norm({xf.data(), wf.data(), ref.data(), rows, dim, 1e-6f});
      EXPECT_LT(rel_err(d_out.download(), ref), kTolBf16);
      // In place (x and out alias).
      rms_norm_launch({d_x.bf(), d_w.bf(), d_x.bf(), rows, dim, 1e-6f}, stream_);
      EXPECT_LT(rel_err(d_x.download(), ref), kTolBf16);
    }
  }
}

TEST_F(CudaOps, AddRmsNorm) {
  SCOPED_TRACE(trace());
  for (int64_t dim : {2048, 4096, 40, 33}) {
    for (int64_t rows : {1, 3, 257}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + " rows " + std::to_string(rows));
      Bits res = randn_bf16(rows * dim, 3.0f), x = randn_bf16(rows * dim),
           w = randn_bf16(dim, 0.1f, 1.0f);
      DeviceBuffer<uint16_t> d_res(res), d_x(x), d_w(w), d_out(rows * dim);
      d_out.poison(0xff);
      add_rms_norm_launch({d_res.bf(), d_x.bf(), d_w.bf(), d_out.bf(), rows, dim, 1e-6f}, stream_);
      std::vector<float> rf = to_f32(res), xf = to_f32(x), wf = to_f32(w), ref(rows * dim);
      cpu::add_rms_norm({rf.data(), xf.data(), wf.data(), ref.data(), rows, dim, 1e-6f});
      EXPECT_LT(rel_err(d_res.download(), rf), kTolBf16) << "residual";
      EXPECT_LT(rel_err(d_out.download(), ref), kTolBf16) << "out";
    }
  }
}

// ------------------------------------------------------------------------------ q/k norm + rope

TEST_F(CudaOps, QkNormRope) {
  SCOPED_TRACE(trace());
  struct Shape {
    int64_t q_heads, kv_heads, head_dim;
  };
  for (Shape s : {Shape{32, 4, 128}, Shape{16, 2, 64}, Shape{4, 4, 128}, Shape{3, 1, 64}}) {
    for (int64_t tokens : {1, 5, 67}) {
      for (bool norm : {true, false}) {
        SCOPED_TRACE("heads " + std::to_string(s.q_heads) + "/" + std::to_string(s.kv_heads) +
                     " d " + std::to_string(s.head_dim) + " tokens " + std::to_string(tokens) +
                     " norm " + std::to_string(norm));
        const int64_t d = s.head_dim;
        Bits q = randn_bf16(tokens * s.q_heads * d, 2.0f), k = randn_bf16(tokens * s.kv_heads * d);
        Bits qw = randn_bf16(d, 0.1f, 1.0f), kw = randn_bf16(d, 0.1f, 1.0f);
        std::vector<int32_t> pos(tokens);
        for (auto& p : pos) p = static_cast<int32_t>(uniform(0, 40000));
        pos[0] = 0;
        DeviceBuffer<uint16_t> d_q(q), d_k(k), d_qw(qw), d_kw(kw);
        DeviceBuffer<int32_t> d_pos(pos);
        QkNormRopeParams p{d_q.bf(),
                           d_k.bf(),
                           norm ? d_qw.bf() : nullptr,
                           norm ? d_kw.bf() : nullptr,
                           d_pos.ptr,
                           tokens,
                           s.q_heads,
                           s.kv_heads,
                           d,
                           1e-6f,
                           1e6};
        qk_norm_rope_launch(p, stream_);
        std::vector<float> qf = to_f32(q), kf = to_f32(k), qwf = to_f32(qw), kwf = to_f32(kw);
        cpu::qk_norm_rope({qf.data(), kf.data(), norm ? qwf.data() : nullptr,
                           norm ? kwf.data() : nullptr, pos.data(), tokens, s.q_heads, s.kv_heads,
                           d, 1e-6f, 1e6});
        EXPECT_LT(rel_err(d_q.download(), qf), kTolBf16) << "q";
        EXPECT_LT(rel_err(d_k.download(), kf), kTolBf16) << "k";
      }
    }
  }
}

// The fused attention prologue vs its CPU composition: split the fused qkv rows, q/k norm +
// RoPE (cpu::qk_norm_rope), k and v into the pages (cpu::kv_write); q_out and the pool are
// poisoned first; tokens with slot -1 must leave the pool untouched (still poison).
TEST_F(CudaOps, QkvPrepMatchesSplitNormRopeKvWrite) {
  SCOPED_TRACE(trace());
  struct Shape {
    int64_t q_heads, kv_heads, head_dim;
  };
  for (Shape s : {Shape{32, 4, 128}, Shape{64, 4, 128}, Shape{16, 2, 64}, Shape{2, 1, 128}}) {
    for (int64_t tokens : {1, 5, 300}) {
      SCOPED_TRACE("heads " + std::to_string(s.q_heads) + "/" + std::to_string(s.kv_heads) + " d " +
                   std::to_string(s.head_dim) + " tokens " + std::to_string(tokens));
      const int64_t d = s.head_dim, qh = s.q_heads, kvh = s.kv_heads, w = (qh + 2 * kvh) * d;
      const int64_t page = 16, pages = tokens / page + 3;
      Bits qkv = randn_bf16(tokens * w, 2.0f);
      Bits qw = randn_bf16(d, 0.1f, 1.0f), kw = randn_bf16(d, 0.1f, 1.0f);
      std::vector<int32_t> pos(tokens);
      std::vector<int64_t> slots(tokens);
      std::vector<int64_t> perm(pages * page);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng_);
      for (int64_t t = 0; t < tokens; ++t) {
        pos[t] = static_cast<int32_t>(uniform(0, 40000));
        slots[t] = t % 7 == 3 ? -1 : perm[t];  // some tokens are padding
      }
      DeviceBuffer<uint16_t> d_qkv(qkv), d_qw(qw), d_kw(kw);
      DeviceBuffer<uint16_t> d_q(tokens * qh * d), d_pool(pages * 2 * kvh * page * d);
      DeviceBuffer<int32_t> d_pos(pos);
      DeviceBuffer<int64_t> d_slots(slots);
      d_q.poison(0xff);
      d_pool.poison(0xff);
      qkv_prep_launch({d_qkv.bf(), d_q.bf(), d_pool.bf(), d_slots.ptr, d_qw.bf(), d_kw.bf(),
                       d_pos.ptr, tokens, qh, kvh, d, page, 1e-6f, 1e6},
                      stream_);
      // CPU: split, norm + rope, write into an fp32 pool of NaN.
      std::vector<float> f = to_f32(qkv), qf(tokens * qh * d), kf(tokens * kvh * d),
                         vf(tokens * kvh * d);
      for (int64_t t = 0; t < tokens; ++t) {
        std::copy_n(f.begin() + t * w, qh * d, qf.begin() + t * qh * d);
        std::copy_n(f.begin() + t * w + qh * d, kvh * d, kf.begin() + t * kvh * d);
        std::copy_n(f.begin() + t * w + (qh + kvh) * d, kvh * d, vf.begin() + t * kvh * d);
      }
      std::vector<float> qwf = to_f32(qw), kwf = to_f32(kw);
      cpu::qk_norm_rope({qf.data(), kf.data(), qwf.data(), kwf.data(), pos.data(), tokens, qh, kvh,
                         d, 1e-6f, 1e6});
      std::vector<float> pool(pages * 2 * kvh * page * d, NAN);
      std::vector<int64_t> written;  // cpu::kv_write takes every token: pass the real ones only
      std::vector<float> kw_rows, vw_rows;
      for (int64_t t = 0; t < tokens; ++t) {
        if (slots[t] < 0) continue;
        written.push_back(slots[t]);
        kw_rows.insert(kw_rows.end(), kf.begin() + t * kvh * d, kf.begin() + (t + 1) * kvh * d);
        vw_rows.insert(vw_rows.end(), vf.begin() + t * kvh * d, vf.begin() + (t + 1) * kvh * d);
      }
      cpu::kv_write({kw_rows.data(), vw_rows.data(), pool.data(), written.data(),
                     static_cast<int64_t>(written.size()), kvh, d, page});
      EXPECT_LT(rel_err(d_q.download(), qf), kTolBf16) << "q";
      // The pool: written slots within bf16 tolerance, every other element still poison.
      const Bits got = d_pool.download();
      std::vector<float> got_w, ref_w;
      int64_t leaked = 0;
      for (size_t i = 0; i < pool.size(); ++i) {
        if (std::isnan(pool[i])) {
          leaked += got[i] != 0xffff;
        } else {
          got_w.push_back(bf16_to_f32(got[i]));
          ref_w.push_back(pool[i]);
        }
      }
      EXPECT_EQ(leaked, 0) << "elements written outside the real tokens' slots";
      EXPECT_LT(rel_err(got_w, ref_w), kTolBf16) << "k / v in the pool";
    }
  }
}

TEST_F(CudaOps, QkNormRopeRejectsHeadDim96) {
  QkNormRopeParams p{};
  p.num_tokens = 1;
  p.num_q_heads = p.num_kv_heads = 1;
  p.head_dim = 96;
  try {
    qk_norm_rope_launch(p, stream_);
    FAIL() << "no throw";
  } catch (Error const& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(e.message().find("unsupported head_dim 96"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------------------ kv write

TEST_F(CudaOps, KvWrite) {
  SCOPED_TRACE(trace());
  const int64_t num_pages = 13, page_size = 16;
  for (int64_t heads : {4, 1}) {
    for (int64_t d : {128, 64}) {
      for (int64_t tokens : {1, 37}) {
        SCOPED_TRACE("heads " + std::to_string(heads) + " d " + std::to_string(d) + " tokens " +
                     std::to_string(tokens));
        const int64_t pool_n = num_pages * 2 * heads * page_size * d;
        Bits pool = randn_bf16(pool_n), k = randn_bf16(tokens * heads * d),
             v = randn_bf16(tokens * heads * d);
        std::vector<int64_t> all(num_pages * page_size);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng_);
        std::vector<int64_t> slots(all.begin(), all.begin() + tokens);
        if (tokens > 1) slots[1] = -1;  // padding: skipped
        DeviceBuffer<uint16_t> d_pool(pool), d_k(k), d_v(v);
        DeviceBuffer<int64_t> d_slots(slots);
        kv_write_launch({d_k.bf(), d_v.bf(), d_pool.bf(), d_slots.ptr, tokens, heads, d, page_size},
                        stream_);
        // Reference over the non-padding tokens.
        std::vector<float> pf = to_f32(pool), kf = to_f32(k), vf = to_f32(v), kc, vc;
        std::vector<int64_t> sc;
        for (int64_t t = 0; t < tokens; ++t) {
          if (slots[t] < 0) continue;
          sc.push_back(slots[t]);
          kc.insert(kc.end(), kf.begin() + t * heads * d, kf.begin() + (t + 1) * heads * d);
          vc.insert(vc.end(), vf.begin() + t * heads * d, vf.begin() + (t + 1) * heads * d);
        }
        cpu::kv_write({kc.data(), vc.data(), pf.data(), sc.data(), static_cast<int64_t>(sc.size()),
                       heads, d, page_size});
        EXPECT_TRUE(same(to_f32(d_pool.download()), pf));  // copies; untouched slots unchanged
      }
    }
  }
}

// ------------------------------------------------------------------------------ attention

TEST_F(CudaOps, PagedAttention) {
  SCOPED_TRACE(trace());
  struct Shape {
    int64_t q_heads, kv_heads, head_dim;
  };
  const int64_t page_size = 16;
  const std::vector<int64_t> seq_lens = {1, 17, 300, 64};
  for (Shape s :
       {Shape{32, 4, 128}, Shape{8, 1, 64}, Shape{4, 4, 128}, Shape{16, 2, 128}, Shape{4, 2, 64}}) {
    SCOPED_TRACE("heads " + std::to_string(s.q_heads) + "/" + std::to_string(s.kv_heads) + " d " +
                 std::to_string(s.head_dim));
    const int64_t d = s.head_dim, num_seqs = static_cast<int64_t>(seq_lens.size());
    int64_t max_pages = 0, num_pages = 0;
    for (int64_t l : seq_lens) {
      max_pages = std::max(max_pages, (l + page_size - 1) / page_size);
      num_pages += (l + page_size - 1) / page_size;
    }
    num_pages += 3;  // unused pages
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    std::vector<int32_t> table(num_seqs * max_pages, 0);
    size_t next = 0;
    for (int64_t sq = 0; sq < num_seqs; ++sq) {
      for (int64_t pg = 0; pg < (seq_lens[sq] + page_size - 1) / page_size; ++pg) {
        table[sq * max_pages + pg] = perm[next++];
      }
    }
    // Queries: a decode token per sequence, plus prefill-like tokens of sequence 2.
    std::vector<int32_t> token_seq, positions;
    for (int64_t sq = 0; sq < num_seqs; ++sq) {
      token_seq.push_back(static_cast<int32_t>(sq));
      positions.push_back(static_cast<int32_t>(seq_lens[sq] - 1));
    }
    for (int32_t p : {0, 5, 31, 32, 150, 299}) {
      token_seq.push_back(2);
      positions.push_back(p);
    }
    const int64_t tokens = static_cast<int64_t>(token_seq.size());
    Bits pool = randn_bf16(num_pages * 2 * s.kv_heads * page_size * d);
    Bits q = randn_bf16(tokens * s.q_heads * d);
    DeviceBuffer<uint16_t> d_pool(pool), d_q(q), d_out(tokens * s.q_heads * d);
    DeviceBuffer<int32_t> d_table(table), d_seq(token_seq), d_pos(positions);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> qf = to_f32(q), pf = to_f32(pool), ref(tokens * s.q_heads * d);
    cpu::paged_attention({qf.data(), pf.data(), table.data(), token_seq.data(), positions.data(),
                          ref.data(), tokens, s.q_heads, s.kv_heads, d, page_size, max_pages,
                          scale});
    // No split, splits of 128 (3 for the longest sequence, empty ones for the short), 256.
    for (int64_t kv_split : {0, 128, 256}) {
      SCOPED_TRACE("kv_split " + std::to_string(kv_split));
      DeviceBuffer<float> d_ws(
          paged_attention_workspace_floats(tokens, s.q_heads, d, max_pages, page_size, kv_split));
      d_ws.poison(0xff);
      d_out.poison(0xff);
      PagedAttentionParams p{d_q.bf(),   d_pool.bf(), d_table.ptr, d_seq.ptr,  d_pos.ptr,
                             d_out.bf(), tokens,      s.q_heads,   s.kv_heads, d,
                             page_size,  max_pages,   scale,       kv_split,   d_ws.ptr};
      paged_attention_launch(p, stream_);
      EXPECT_LT(rel_err(d_out.download(), ref), kTolBf16);
    }
  }
}

// Host-only: runs without a GPU too.
TEST(CudaOpsHost, PagedAttentionPickSplit) {
  // Decode of one sequence with a 4096-token context on 132 SMs: splits of 128 keys give the
  // 4 kv heads 128 blocks; a large batch needs no split.
  const int64_t split = paged_attention_pick_split(1, 4, 256, 16, 132);
  EXPECT_EQ(split, 128);
  EXPECT_EQ(paged_attention_num_splits(256, 16, split), 32);
  EXPECT_EQ(paged_attention_num_splits(256, 16, paged_attention_pick_split(32, 4, 256, 16, 132)),
            3);
  EXPECT_EQ(paged_attention_pick_split(512, 4, 256, 16, 132), 0);
  EXPECT_EQ(paged_attention_num_splits(256, 16, 0), 1);
  EXPECT_EQ(paged_attention_workspace_floats(3, 32, 128, 256, 16, 0), 0u);
}

TEST_F(CudaOps, PagedAttentionRejectsUnsupported) {
  PagedAttentionParams p{};
  p.num_tokens = 1;
  p.page_size = 16;
  p.max_pages_per_seq = 1;
  p.num_q_heads = 12;
  p.num_kv_heads = 4;  // group 3
  p.head_dim = 128;
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.num_q_heads = 8;
  p.head_dim = 96;
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.head_dim = 128;
  p.num_q_heads = 128;
  p.num_kv_heads = 4;  // group 32
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.num_q_heads = 32;
  p.kv_split = 100;  // not a multiple of 128
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
}

// ------------------------------------------------------------------------------ router

TEST_F(CudaOps, TopkSoftmax) {
  SCOPED_TRACE(trace());
  struct Case {
    int64_t experts, top_k;
  };
  // Narrow variant (<= 256 experts, top-8) and the wide one (Qwen3.5-397B's 512 / top-10, an odd
  // k, top-16, more than 256 experts at top-8, a top-k past 8 of few experts).
  for (Case c :
       {Case{128, 8}, Case{256, 8}, Case{60, 4}, Case{8, 1}, Case{33, 8}, Case{8, 8}, Case{512, 10},
        Case{512, 16}, Case{300, 7}, Case{257, 8}, Case{64, 11}, Case{16, 16}}) {
    for (int64_t tokens : {1, 33, 300}) {
      for (bool renorm : {true, false}) {
        for (DType dt : {DType::kBF16, DType::kF32}) {
          for (bool ties : {false, true}) {
            SCOPED_TRACE("E " + std::to_string(c.experts) + " k " + std::to_string(c.top_k) +
                         " tokens " + std::to_string(tokens) + " renorm " + std::to_string(renorm) +
                         " dtype " + std::string(dtype_name(dt)) + " ties " + std::to_string(ties));
            const int64_t n = tokens * c.experts;
            std::vector<float> logits = randn(n, 2.0f);
            if (ties) {  // a few distinct values: many exact ties
              for (auto& l : logits) l = static_cast<float>(uniform(-2, 2)) * 0.5f;
            }
            if (dt == DType::kBF16) logits = to_f32(to_bf16(logits));
            Bits lb = to_bf16(logits);
            DeviceBuffer<uint16_t> d_lb(lb);
            DeviceBuffer<float> d_lf(logits), d_w(tokens * c.top_k);
            DeviceBuffer<int32_t> d_ids(tokens * c.top_k);
            d_w.poison(0xff);
            d_ids.poison(0x7f);
            TopkSoftmaxParams p{dt == DType::kBF16 ? static_cast<void const*>(d_lb.ptr)
                                                   : static_cast<void const*>(d_lf.ptr),
                                d_ids.ptr,
                                d_w.ptr,
                                tokens,
                                c.experts,
                                c.top_k,
                                renorm,
                                dt};
            topk_softmax_launch(p, stream_);
            std::vector<int32_t> ref_ids(tokens * c.top_k);
            std::vector<float> ref_w(tokens * c.top_k);
            cpu::topk_softmax(
                {logits.data(), ref_ids.data(), ref_w.data(), tokens, c.experts, c.top_k, renorm});
            EXPECT_TRUE(same(d_ids.download(), ref_ids));
            EXPECT_LT(rel_err(d_w.download(), ref_w), kTolF32);
          }
        }
      }
    }
  }
}

TEST_F(CudaOps, TopkSoftmaxRejectsUnsupported) {
  TopkSoftmaxParams p{};
  p.num_tokens = 1;
  p.num_experts = 513;
  p.top_k = 8;
  EXPECT_THROW(topk_softmax_launch(p, stream_), Error);
  p.num_experts = 512;
  p.top_k = 17;
  EXPECT_THROW(topk_softmax_launch(p, stream_), Error);
  p.num_experts = 9;
  p.top_k = 10;  // more than the experts
  EXPECT_THROW(topk_softmax_launch(p, stream_), Error);
  p.num_experts = 128;
  p.top_k = 8;
  p.logits_dtype = DType::kF16;
  EXPECT_THROW(topk_softmax_launch(p, stream_), Error);
}

// ------------------------------------------------------------------------------ silu * mul

TEST_F(CudaOps, SiluMul) {
  SCOPED_TRACE(trace());
  for (int64_t inter : {768, 100, 33}) {
    for (int64_t rows : {1, 9, 300}) {
      SCOPED_TRACE("inter " + std::to_string(inter) + " rows " + std::to_string(rows));
      Bits gu = randn_bf16(rows * 2 * inter, 2.0f);
      DeviceBuffer<uint16_t> d_gu(gu), d_out(rows * inter);
      d_out.poison(0xff);
      silu_mul_launch({d_gu.bf(), d_out.bf(), rows, inter}, stream_);
      std::vector<float> gf = to_f32(gu), ref(rows * inter);
      cpu::silu_mul({gf.data(), ref.data(), rows, inter});
      EXPECT_LT(rel_err(d_out.download(), ref), kTolBf16);
    }
  }
}

// ------------------------------------------------------------------------------ moe permute

enum class Routing { kRandom, kSkewed, kAllToOne };

struct PermuteCase {
  int64_t tokens, experts, top_k, expert_begin, local_experts, hidden;
  Routing routing;
};

class MoePermute : public CudaOps {
 protected:
  // top_k distinct experts per token out of `experts`.
  std::vector<int32_t> route(PermuteCase const& c) {
    std::vector<int32_t> ids(c.tokens * c.top_k);
    std::vector<int32_t> all(c.experts);
    std::iota(all.begin(), all.end(), 0);
    for (int64_t t = 0; t < c.tokens; ++t) {
      switch (c.routing) {
        case Routing::kRandom:
          std::shuffle(all.begin(), all.end(), rng_);
          std::copy(all.begin(), all.begin() + c.top_k, ids.begin() + t * c.top_k);
          break;
        case Routing::kSkewed: {  // every token to expert 5, the rest among experts 0..8
          std::vector<int32_t> few = {0, 1, 2, 3, 4, 6, 7, 8};
          std::shuffle(few.begin(), few.end(), rng_);
          ids[t * c.top_k] = 5;
          for (int64_t j = 1; j < c.top_k; ++j) ids[t * c.top_k + j] = few[j - 1];
          break;
        }
        case Routing::kAllToOne:
          for (int64_t j = 0; j < c.top_k; ++j) ids[t * c.top_k + j] = static_cast<int32_t>(3 + j);
          break;
      }
    }
    return ids;
  }
};

TEST_F(MoePermute, MatchesHostReference) {
  SCOPED_TRACE(trace());
  const std::vector<PermuteCase> cases = {
      {1, 128, 8, 0, 128, 2048, Routing::kRandom},
      {13, 8, 2, 0, 8, 72, Routing::kRandom},
      {1000, 128, 8, 0, 128, 2048, Routing::kRandom},
      {3000, 256, 8, 0, 256, 64, Routing::kRandom},  // 24 blocks of token-slots
      {700, 128, 8, 32, 64, 37, Routing::kRandom},   // EP: a slice of experts, odd hidden
      {2000, 128, 8, 0, 128, 64, Routing::kSkewed},  // every token to expert 5; most empty
      {1500, 16, 1, 0, 16, 40, Routing::kAllToOne},  // all slots to one expert
      {37, 256, 8, 0, 256, 128, Routing::kRandom},   // many empty experts
      {5, 128, 8, 120, 8, 64, Routing::kAllToOne},   // no local slot at all
      // Past 256 local experts (the 512-wide kernels) and top-k past 8: Qwen3.5-397B's 512 /
      // top-10, odd k, top-16.
      {1, 512, 10, 0, 512, 4096, Routing::kRandom},
      {1000, 512, 10, 0, 512, 64, Routing::kRandom},  // 10 blocks of token-slots
      {3000, 512, 11, 0, 512, 40, Routing::kRandom},  // 33 blocks, odd hidden rows of 40
      {700, 512, 9, 100, 300, 37, Routing::kRandom},  // EP: 300 of 512 local, odd hidden
      {2000, 512, 9, 0, 512, 64, Routing::kSkewed},   // every token to expert 5; most empty
      {1500, 512, 13, 0, 512, 40, Routing::kAllToOne},
      {64, 512, 16, 0, 512, 128, Routing::kRandom},
      {5, 512, 16, 500, 12, 64, Routing::kAllToOne},  // no local slot at all
      {40, 128, 10, 0, 128, 64, Routing::kRandom},    // top-10 of 128: narrow permute
  };
  for (PermuteCase const& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " E " + std::to_string(c.experts) + " k " +
                 std::to_string(c.top_k) + " local [" + std::to_string(c.expert_begin) + ", +" +
                 std::to_string(c.local_experts) + ") hidden " + std::to_string(c.hidden) +
                 " routing " + std::to_string(static_cast<int>(c.routing)));
    const int64_t slots = c.tokens * c.top_k, E = c.local_experts;
    std::vector<int32_t> ids = route(c);
    Bits x = randn_bf16(c.tokens * c.hidden);
    DeviceBuffer<uint16_t> d_x(x), d_px(slots * c.hidden);
    DeviceBuffer<int32_t> d_ids(ids), d_counts(E), d_offsets(E + 1), d_src(slots),
        d_slot_row(slots), d_ws(moe_permute_workspace_elems(c.tokens, c.top_k, E));
    d_px.poison(0xff);
    for (auto* b : {&d_counts, &d_offsets, &d_src, &d_slot_row}) b->poison(0x7f);
    MoePermuteParams p{d_x.bf(),  d_ids.ptr,      d_px.bf(), d_counts.ptr, d_offsets.ptr,
                       d_src.ptr, d_slot_row.ptr, d_ws.ptr,  c.tokens,     c.hidden,
                       c.top_k,   c.expert_begin, E};
    moe_permute_launch(p, stream_);

    // Host reference: stable counting sort of the local token-slots by expert.
    std::vector<std::vector<int32_t>> by_expert(E);
    std::vector<int32_t> ref_slot_row(slots, -1);
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t e = ids[s] - c.expert_begin;
      if (e >= 0 && e < E) by_expert[e].push_back(static_cast<int32_t>(s));
    }
    std::vector<int32_t> ref_counts(E), ref_offsets(E + 1, 0), ref_src;
    for (int64_t e = 0; e < E; ++e) {
      ref_counts[e] = static_cast<int32_t>(by_expert[e].size());
      ref_offsets[e + 1] = ref_offsets[e] + ref_counts[e];
      for (int32_t s : by_expert[e]) {
        ref_slot_row[s] = static_cast<int32_t>(ref_src.size());
        ref_src.push_back(s);
      }
    }
    const int64_t total = ref_offsets[E];
    EXPECT_TRUE(same(d_counts.download(), ref_counts)) << "counts";
    EXPECT_TRUE(same(d_offsets.download(), ref_offsets)) << "offsets";
    EXPECT_TRUE(same(d_slot_row.download(), ref_slot_row)) << "slot_row";
    std::vector<int32_t> src = d_src.download();
    src.resize(total);
    EXPECT_TRUE(same(src, ref_src)) << "permuted_src";
    Bits px = d_px.download(), ref_px;
    px.resize(total * c.hidden);
    for (int32_t s : ref_src) {
      ref_px.insert(ref_px.end(), x.begin() + (s / c.top_k) * c.hidden,
                    x.begin() + (s / c.top_k + 1) * c.hidden);
    }
    EXPECT_TRUE(same(px, ref_px)) << "permuted rows";

    // Unpermute: rows past `total` hold NaN, so a read of one shows.
    std::vector<float> weights(slots);
    for (auto& w : weights) w = std::uniform_real_distribution<float>(0.05f, 1.0f)(rng_);
    Bits y = randn_bf16(slots * c.hidden);
    for (int64_t i = total * c.hidden; i < slots * c.hidden; ++i) y[i] = 0xffff;
    std::vector<float> yf = to_f32(y), ref_out(c.tokens * c.hidden, 0.f);
    for (int64_t t = 0; t < c.tokens; ++t) {
      std::vector<std::pair<int32_t, int64_t>> order;  // (expert, j), ascending expert
      for (int64_t j = 0; j < c.top_k; ++j) {
        if (ref_slot_row[t * c.top_k + j] >= 0) order.push_back({ids[t * c.top_k + j], j});
      }
      std::sort(order.begin(), order.end());
      for (int64_t h = 0; h < c.hidden; ++h) {
        float acc = 0.f;
        for (auto [e, j] : order) {
          acc += weights[t * c.top_k + j] * yf[ref_slot_row[t * c.top_k + j] * c.hidden + h];
        }
        ref_out[t * c.hidden + h] = acc;
      }
    }
    DeviceBuffer<uint16_t> d_y(y), d_out_bf(c.tokens * c.hidden);
    DeviceBuffer<float> d_w(weights), d_out_f(c.tokens * c.hidden);
    d_out_bf.poison(0xff);
    d_out_f.poison(0xff);
    MoeUnpermuteParams u{d_y.bf(), d_ids.ptr, d_w.ptr, d_slot_row.ptr, d_out_f.ptr,
                         c.tokens, c.hidden,  c.top_k, DType::kF32};
    moe_unpermute_launch(u, stream_);
    u.out = d_out_bf.ptr;
    u.out_dtype = DType::kBF16;
    moe_unpermute_launch(u, stream_);
    if (total == 0) {
      std::vector<float> out = d_out_f.download();
      EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 0.f; }));
    } else {
      EXPECT_LT(rel_err(d_out_f.download(), ref_out), kTolF32) << "unpermute fp32";
      EXPECT_LT(rel_err(d_out_bf.download(), ref_out), kTolBf16) << "unpermute bf16";
    }
  }
}

TEST_F(MoePermute, RejectsTooManyExperts) {
  MoePermuteParams p{};
  p.num_tokens = 1;
  p.top_k = 1;
  p.hidden = 8;
  p.num_local_experts = 513;
  EXPECT_THROW(moe_permute_launch(p, stream_), Error);
}

// Router -> permute -> unpermute captured once in a CUDA graph and replayed on new inputs:
// row counts live on the device, so nothing in the step needs the host. With the permuted x
// itself as the "expert output", the renormalised weights sum to 1 and out == x.
TEST_F(MoePermute, ReplaysInCudaGraph) {
  SCOPED_TRACE(trace());
  const int64_t tokens = 50, experts = 128, top_k = 8, hidden = 64, slots = tokens * top_k;
  DeviceBuffer<uint16_t> d_logits(tokens * experts), d_x(tokens * hidden), d_px(slots * hidden);
  DeviceBuffer<int32_t> d_ids(slots), d_counts(experts), d_offsets(experts + 1), d_src(slots),
      d_slot_row(slots), d_ws(moe_permute_workspace_elems(tokens, top_k, experts));
  DeviceBuffer<float> d_w(slots), d_out(tokens * hidden);
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TANDEM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  topk_softmax_launch(
      {d_logits.ptr, d_ids.ptr, d_w.ptr, tokens, experts, top_k, true, DType::kBF16}, stream_);
  moe_permute_launch({d_x.bf(), d_ids.ptr, d_px.bf(), d_counts.ptr, d_offsets.ptr, d_src.ptr,
                      d_slot_row.ptr, d_ws.ptr, tokens, hidden, top_k, 0, experts},
                     stream_);
  moe_unpermute_launch({d_px.bf(), d_ids.ptr, d_w.ptr, d_slot_row.ptr, d_out.ptr, tokens, hidden,
                        top_k, DType::kF32},
                       stream_);
  TANDEM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
  TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int rep = 0; rep < 3; ++rep) {
    SCOPED_TRACE("replay " + std::to_string(rep));
    Bits logits = randn_bf16(tokens * experts, 2.0f), x = randn_bf16(tokens * hidden);
    d_logits.upload(logits);
    d_x.upload(x);
    d_out.poison(0xff);
    TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
    sync();
    std::vector<float> lf = to_f32(logits), w(slots);
    std::vector<int32_t> ids(slots);
    cpu::topk_softmax({lf.data(), ids.data(), w.data(), tokens, experts, top_k, true});
    EXPECT_TRUE(same(d_ids.download(), ids));
    EXPECT_LT(rel_err(d_out.download(), to_f32(x)), kTolF32);
  }
  TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
}

// ------------------------------------------------------------------------------ gemm

TEST_F(CudaOps, Gemm) {
  SCOPED_TRACE(trace());
  GemmLt gemm;
  struct Shape {
    int64_t m, n, k;
  };
  for (Shape s : {Shape{1, 5120, 2048}, Shape{37, 200, 72}, Shape{300, 128, 2048}, Shape{8, 96, 40},
                  Shape{257, 512, 1024}}) {
    SCOPED_TRACE("m " + std::to_string(s.m) + " n " + std::to_string(s.n) + " k " +
                 std::to_string(s.k));
    Bits x = randn_bf16(s.m * s.k), w = randn_bf16(s.n * s.k), y0 = randn_bf16(s.m * s.n, 4.0f);
    DeviceBuffer<uint16_t> d_x(x), d_w(w), d_y(s.m * s.n);
    d_y.poison(0xff);
    gemm.run({d_x.bf(), d_w.bf(), d_y.bf(), s.m, s.n, s.k}, stream_);
    std::vector<float> xf = to_f32(x), wf = to_f32(w), ref(s.m * s.n);
    cpu::gemm({xf.data(), wf.data(), ref.data(), s.m, s.n, s.k});
    EXPECT_LT(rel_err(d_y.download(), ref), kTolBf16);
    // beta = 1 accumulates onto y.
    d_y.upload(y0);
    gemm.run({d_x.bf(), d_w.bf(), d_y.bf(), s.m, s.n, s.k, 1.0f, 1.0f}, stream_);
    std::vector<float> y0f = to_f32(y0);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += y0f[i];
    EXPECT_LT(rel_err(d_y.download(), ref), kTolBf16) << "beta 1";
  }
  EXPECT_EQ(gemm.num_plans(), 10u);
  // Cached plans are reused.
  Bits x = randn_bf16(37 * 72), w = randn_bf16(200 * 72);
  DeviceBuffer<uint16_t> d_x(x), d_w(w), d_y(37 * 200);
  gemm.run({d_x.bf(), d_w.bf(), d_y.bf(), 37, 200, 72}, stream_);
  sync();
  EXPECT_EQ(gemm.num_plans(), 10u);
  // Rows 1.. of x and y: 16-byte aligned pointers only (a new plan for that alignment), as
  // the per-expert GEMMs of a permuted batch get.
  d_y.poison(0xff);
  gemm.run({d_x.bf() + 72, d_w.bf(), d_y.bf() + 200, 36, 200, 72}, stream_);
  std::vector<float> xf = to_f32(x), wf = to_f32(w), ref(37 * 200);
  cpu::gemm({xf.data(), wf.data(), ref.data(), 37, 200, 72});
  std::vector<float> y = to_f32(d_y.download());
  EXPECT_LT(rel_err(std::vector<float>(y.begin() + 200, y.end()),
                    std::vector<float>(ref.begin() + 200, ref.end())),
            kTolBf16);
  EXPECT_EQ(gemm.num_plans(), 11u);
}

// ------------------------------------------------------------------------------ composition

// Router -> permute -> per-expert GEMMs -> SiLU-mul -> GEMMs -> unpermute, against cpu::moe.
TEST_F(CudaOps, MoeLayerMatchesCpuMoe) {
  SCOPED_TRACE(trace());
  const int64_t tokens = 37, hidden = 64, inter = 32, experts = 8, top_k = 2;
  for (int64_t begin : {0, 4}) {
    const int64_t local = begin == 0 ? experts : 4;
    SCOPED_TRACE("experts [" + std::to_string(begin) + ", +" + std::to_string(local) + ")");
    Bits x = randn_bf16(tokens * hidden), logits = randn_bf16(tokens * experts, 2.0f);
    std::vector<Bits> wgu(local), wd(local);
    for (int64_t e = 0; e < local; ++e) {
      wgu[e] = randn_bf16(2 * inter * hidden, 0.125f);
      wd[e] = randn_bf16(hidden * inter, 0.18f);
    }
    // Device: router.
    DeviceBuffer<uint16_t> d_x(x), d_logits(logits);
    DeviceBuffer<int32_t> d_ids(tokens * top_k);
    DeviceBuffer<float> d_tw(tokens * top_k);
    topk_softmax_launch(
        {d_logits.ptr, d_ids.ptr, d_tw.ptr, tokens, experts, top_k, true, DType::kBF16}, stream_);
    // Permute.
    const int64_t slots = tokens * top_k;
    DeviceBuffer<uint16_t> d_px(slots * hidden), d_gu(slots * 2 * inter), d_act(slots * inter),
        d_y(slots * hidden);
    DeviceBuffer<int32_t> d_counts(local), d_offsets(local + 1), d_src(slots), d_slot_row(slots),
        d_ws(moe_permute_workspace_elems(tokens, top_k, local));
    moe_permute_launch({d_x.bf(), d_ids.ptr, d_px.bf(), d_counts.ptr, d_offsets.ptr, d_src.ptr,
                        d_slot_row.ptr, d_ws.ptr, tokens, hidden, top_k, begin, local},
                       stream_);
    std::vector<int32_t> offsets = d_offsets.download();
    // Expert MLPs, one GEMM pair per expert.
    GemmLt gemm;
    std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> d_wgu, d_wd;
    for (int64_t e = 0; e < local; ++e) {
      d_wgu.push_back(std::make_unique<DeviceBuffer<uint16_t>>(wgu[e]));
      d_wd.push_back(std::make_unique<DeviceBuffer<uint16_t>>(wd[e]));
      const int64_t r0 = offsets[e], n = offsets[e + 1] - offsets[e];
      gemm.run({d_px.bf() + r0 * hidden, d_wgu[e]->bf(), d_gu.bf() + r0 * 2 * inter, n, 2 * inter,
                hidden},
               stream_);
    }
    const int64_t total = offsets[local];
    silu_mul_launch({d_gu.bf(), d_act.bf(), total, inter}, stream_);
    for (int64_t e = 0; e < local; ++e) {
      const int64_t r0 = offsets[e], n = offsets[e + 1] - offsets[e];
      gemm.run({d_act.bf() + r0 * inter, d_wd[e]->bf(), d_y.bf() + r0 * hidden, n, hidden, inter},
               stream_);
    }
    DeviceBuffer<float> d_out(tokens * hidden);
    d_out.poison(0xff);
    moe_unpermute_launch({d_y.bf(), d_ids.ptr, d_tw.ptr, d_slot_row.ptr, d_out.ptr, tokens, hidden,
                          top_k, DType::kF32},
                         stream_);
    // CPU reference with the CPU router.
    std::vector<float> xf = to_f32(x), lf = to_f32(logits), tw(slots), ref(tokens * hidden);
    std::vector<int32_t> ids(slots);
    cpu::topk_softmax({lf.data(), ids.data(), tw.data(), tokens, experts, top_k, true});
    EXPECT_TRUE(same(d_ids.download(), ids));
    std::vector<std::vector<float>> wguf(local), wdf(local);
    std::vector<float const*> pgu(local), pd(local);
    for (int64_t e = 0; e < local; ++e) {
      wguf[e] = to_f32(wgu[e]);
      wdf[e] = to_f32(wd[e]);
      pgu[e] = wguf[e].data();
      pd[e] = wdf[e].data();
    }
    cpu::moe({xf.data(), ids.data(), tw.data(), pgu.data(), pd.data(), ref.data(), tokens, hidden,
              inter, top_k, begin, local});
    EXPECT_LT(rel_err(d_out.download(), ref), 2e-2);  // bf16 intermediates (gate_up, act, y)
  }
}

}  // namespace
}  // namespace tandem::cuda
