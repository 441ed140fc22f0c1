// FP8 (E4M3) KV cache kernels (--kv-cache-dtype fp8) vs the CPU references: the quantizing KV
// writes (kv_write_launch, qkv_prep_launch, gated_qkv_prep_launch) code for code against
// cpu::kv_write_fp8 / cpu::kv_fp8_quantize, and paged_attention_launch over FP8 pages against
// cpu::paged_attention over the pages cpu::kv_pool_dequantize_fp8 dequantizes (the tensor-core
// decode kernel for decode tokens with kAuto and every token with kDecode, head_dim 64, 128 and
// 256; the simple kernel with kSimple and, without a prefill plan, for prefill tokens;
// FlashInfer's gathered sm90 prefill, dequantizing as it gathers, where built and on an sm90
// GPU), and the tensor-core decode kernel against the simple kernel on the same pages. Fresh
// random inputs and scales every run (the seed is printed on failure); pools, outputs and
// workspaces poisoned first (0xff: an E4M3 NaN code, a bf16 / fp32 NaN; the decode tests also
// fill the slots past each sequence's end with NaN codes); block-table entries past a
// sequence's pages are invalid page ids. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/attention.h"
#include "backend/cuda/attention_sm90.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gated_attention.h"
#include "backend/cuda/norm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "decode_graph_replay.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::gpu_available;
using test_util::to_f32;
template <typename T>
using DeviceBuffer = test_util::DeviceBuffer<T, test_util::UploadCheck::kThrow>;

// Codes that differ (index of the first, count); 0xff pages where nothing was written stay 0xff.
::testing::AssertionResult same_codes(std::vector<uint8_t> const& out,
                                      std::vector<uint8_t> const& ref) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << out.size() << " vs " << ref.size();
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] != ref[i] && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << out.size() << " codes differ; first at " << first << ": 0x" << std::hex
         << int(out[first]) << " vs ref 0x" << int(ref[first]);
}

class CudaKvFp8 : public test_util::CudaFixture<> {
 protected:
  Bits randn_bf16(size_t n, float scale, float mean = 0.f) {
    std::normal_distribution<float> d(mean, scale);
    Bits b(n);
    for (auto& x : b) x = f32_to_bf16(d(rng_));
    return b;
  }
  float rand_scale() { return std::uniform_real_distribution<float>(0.01f, 0.5f)(rng_); }
  // Distinct slots of pages [0, num_pages) in random order, every 7th token padding (-1).
  std::vector<int64_t> rand_slots(int64_t tokens, int64_t num_pages, int64_t page_size) {
    std::vector<int64_t> all(static_cast<size_t>(num_pages * page_size));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng_);
    std::vector<int64_t> s(all.begin(), all.begin() + tokens);
    for (size_t i = 3; i < s.size(); i += 7) s[i] = -1;
    return s;
  }
};

TEST_F(CudaKvFp8, KvWriteQuantizesAsTheCpuReference) {
  SCOPED_TRACE(trace());
  for (int64_t d : {64, 128, 256}) {
    for (int64_t ps : {1, 16}) {
      SCOPED_TRACE("head_dim " + std::to_string(d) + " page " + std::to_string(ps));
      const int64_t kvh = 4, tokens = 37, pages = 40;
      const float ks = rand_scale(), vs = rand_scale();
      // k values wide enough that some saturate at +-448 * scale.
      const Bits k = randn_bf16(tokens * kvh * d, 60.f * ks), v = randn_bf16(k.size(), 1.f);
      const std::vector<int64_t> slots = rand_slots(tokens, pages, ps);
      const size_t pool_bytes = static_cast<size_t>(pages * 2 * kvh * ps * d);
      DeviceBuffer<uint16_t> d_k(k), d_v(v);
      DeviceBuffer<uint8_t> d_pool(pool_bytes);
      DeviceBuffer<int64_t> d_slots(slots);
      d_pool.poison(0xff);
      KvWriteParams p{
          d_k.bf(), d_v.bf(), reinterpret_cast<bf16*>(d_pool.ptr), d_slots.ptr, tokens, kvh, d, ps};
      p.kv_fp8 = true;
      p.k_scale = ks;
      p.v_scale = vs;
      kv_write_launch(p, stream_);
      sync();
      std::vector<float> kf = to_f32(k), vf = to_f32(v);
      std::vector<uint8_t> ref(pool_bytes, 0xff);
      cpu::KvWriteParams c{kf.data(), vf.data(), nullptr, slots.data(), tokens, kvh, d, ps};
      c.kv_fp8 = true;
      c.k_scale = ks;
      c.v_scale = vs;
      cpu::kv_write_fp8(c, ref.data());
      EXPECT_TRUE(same_codes(d_pool.download(), ref));
    }
  }
}

// The fused prologues: the FP8 run's codes are the CPU quantization of the bf16 run's pool (the
// same kernel computes k and v either way), and q is the same.
TEST_F(CudaKvFp8, QkvPrepQuantizesItsBf16Output) {
  SCOPED_TRACE(trace());
  for (int64_t d : {64, 128}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    const int64_t qh = 8, kvh = 2, tokens = 23, ps = 16, pages = 4;
    const float ks = rand_scale(), vs = rand_scale();
    const Bits qkv = randn_bf16(tokens * (qh + 2 * kvh) * d, 1.f), qw = randn_bf16(d, 1.f),
               kw = randn_bf16(d, 1.f);
    std::vector<int32_t> pos(static_cast<size_t>(tokens));
    for (auto& x : pos) x = std::uniform_int_distribution<int32_t>(0, 5000)(rng_);
    const std::vector<int64_t> slots = rand_slots(tokens, pages, ps);
    const size_t elems = static_cast<size_t>(pages * 2 * kvh * ps * d);
    DeviceBuffer<uint16_t> d_qkv(qkv), d_qw(qw), d_kw(kw), d_q(tokens * qh * d),
        d_q8(tokens * qh * d), d_pool(elems);
    DeviceBuffer<uint8_t> d_pool8(elems);
    DeviceBuffer<int32_t> d_pos(pos);
    DeviceBuffer<int64_t> d_slots(slots);
    d_q.poison(0xff);
    d_q8.poison(0xff);
    d_pool.poison(0xff);
    d_pool8.poison(0xff);
    QkvPrepParams p{d_qkv.bf(), d_q.bf(), d_pool.bf(), d_slots.ptr, d_qw.bf(), d_kw.bf(), d_pos.ptr,
                    tokens,     qh,       kvh,         d,           ps,        1e-6f,     1e6};
    qkv_prep_launch(p, stream_);
    p.q_out = d_q8.bf();
    p.pool = reinterpret_cast<bf16*>(d_pool8.ptr);
    p.kv_fp8 = true;
    p.k_scale = ks;
    p.v_scale = vs;
    qkv_prep_launch(p, stream_);
    sync();
    EXPECT_EQ(d_q8.download(), d_q.download());
    const std::vector<float> pool = to_f32(d_pool.download());
    std::vector<uint8_t> ref(elems, 0xff);
    const int64_t half = kvh * ps * d;
    for (size_t i = 0; i < elems; ++i) {
      if (std::isnan(pool[i])) continue;  // not written
      ref[i] = cpu::kv_fp8_quantize(pool[i], (static_cast<int64_t>(i) / half) % 2 == 0 ? ks : vs);
    }
    EXPECT_TRUE(same_codes(d_pool8.download(), ref));
  }
}

TEST_F(CudaKvFp8, GatedQkvPrepQuantizesItsBf16Output) {
  SCOPED_TRACE(trace());
  const int64_t qh = 4, kvh = 2, d = 256, rot = 64, tokens = 19, ps = 16, pages = 3;
  const float ks = rand_scale(), vs = rand_scale();
  const Bits qkv = randn_bf16(tokens * (2 * qh + 2 * kvh) * d, 1.f), qw = randn_bf16(d, 1.f),
             kw = randn_bf16(d, 1.f);
  std::vector<int32_t> pos(static_cast<size_t>(tokens));
  for (auto& x : pos) x = std::uniform_int_distribution<int32_t>(0, 5000)(rng_);
  const std::vector<int64_t> slots = rand_slots(tokens, pages, ps);
  const size_t elems = static_cast<size_t>(pages * 2 * kvh * ps * d);
  DeviceBuffer<uint16_t> d_qkv(qkv), d_qw(qw), d_kw(kw), d_q(tokens * qh * d), d_g(tokens * qh * d),
      d_pool(elems);
  DeviceBuffer<uint8_t> d_pool8(elems);
  DeviceBuffer<int32_t> d_pos(pos);
  DeviceBuffer<int64_t> d_slots(slots);
  d_pool.poison(0xff);
  d_pool8.poison(0xff);
  GatedQkvPrepParams p{d_qkv.bf(), d_q.bf(),  d_g.bf(), d_pool.bf(), d_slots.ptr, d_qw.bf(),
                       d_kw.bf(),  d_pos.ptr, tokens,   qh,          kvh,         d,
                       ps,         rot,       1e-6f,    10000.0};
  gated_qkv_prep_launch(p, stream_);
  p.pool = reinterpret_cast<bf16*>(d_pool8.ptr);
  p.kv_fp8 = true;
  p.k_scale = ks;
  p.v_scale = vs;
  gated_qkv_prep_launch(p, stream_);
  sync();
  const std::vector<float> pool = to_f32(d_pool.download());
  std::vector<uint8_t> ref(elems, 0xff);
  const int64_t half = kvh * ps * d;
  for (size_t i = 0; i < elems; ++i) {
    if (std::isnan(pool[i])) continue;
    ref[i] = cpu::kv_fp8_quantize(pool[i], (static_cast<int64_t>(i) / half) % 2 == 0 ? ks : vs);
  }
  EXPECT_TRUE(same_codes(d_pool8.download(), ref));
}

// ---- paged attention over FP8 pages ---------------------------------------------------------

struct SeqSpec {
  int64_t len, queries;  // keys after the step; the last `queries` are this step's tokens
};
struct Case {
  int64_t q_heads, kv_heads, head_dim, page_size;
  std::vector<SeqSpec> seqs;  // multi-query sequences first
  int64_t extra_pages = 0;    // block-table capacity past the longest sequence (empty splits)
  float k_scale = 0.f, v_scale = 0.f;  // 0: random in [0.01, 0.5]
  bool poison_tail = false;  // NaN codes in the slots past each sequence's end and unused pages
  float q_mean = 0.f;        // > 0 skews the scores (peaked softmax)
  std::string name() const {
    std::ostringstream s;
    s << q_heads << "q/" << kv_heads << "kv d" << head_dim << " page " << page_size << " seqs";
    for (auto const& q : seqs) s << " " << q.len << ":" << q.queries;
    if (extra_pages > 0) s << " +" << extra_pages << " pages";
    if (k_scale > 0.f) s << " scales " << k_scale << " " << v_scale;
    return s.str();
  }
};

class CudaKvFp8Attention : public CudaKvFp8 {
 protected:
  void check(Case const& c, bool sm90_plan = false) {
    SCOPED_TRACE(c.name());
    const int64_t ps = c.page_size, ns = static_cast<int64_t>(c.seqs.size());
    int64_t max_pages = 0, num_pages = 5, npf = 0;
    for (auto const& s : c.seqs) {
      max_pages = std::max(max_pages, (s.len + ps - 1) / ps);
      num_pages += (s.len + ps - 1) / ps;
    }
    max_pages += c.extra_pages;
    std::vector<int32_t> perm(static_cast<size_t>(num_pages));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    std::vector<int32_t> table(static_cast<size_t>(ns * max_pages), 0x3fffffff), seq, pos;
    size_t next = 0;
    for (int64_t s = 0; s < ns; ++s) {
      for (int64_t pg = 0; pg < (c.seqs[s].len + ps - 1) / ps; ++pg) {
        table[s * max_pages + pg] = perm[next++];
      }
      for (int64_t p = c.seqs[s].len - c.seqs[s].queries; p < c.seqs[s].len; ++p) {
        seq.push_back(static_cast<int32_t>(s));
        pos.push_back(static_cast<int32_t>(p));
      }
      if (c.seqs[s].queries > 1) npf = static_cast<int64_t>(seq.size());
    }
    const int64_t tokens = static_cast<int64_t>(seq.size());
    const float ks = c.k_scale > 0.f ? c.k_scale : rand_scale();
    const float vs = c.v_scale > 0.f ? c.v_scale : rand_scale();
    // Codes of N(0, 1) keys and values at these scales (a realistic spread of codes).
    const size_t elems = static_cast<size_t>(num_pages * 2 * c.kv_heads * ps * c.head_dim);
    const std::vector<float> raw = to_f32(randn_bf16(elems, 1.f));
    std::vector<uint8_t> codes(elems);
    const int64_t half = c.kv_heads * ps * c.head_dim;
    for (size_t i = 0; i < elems; ++i) {
      codes[i] = cpu::kv_fp8_quantize(raw[i], (static_cast<int64_t>(i) / half) % 2 == 0 ? ks : vs);
    }
    if (c.poison_tail) {
      // Only slots [0, len) of each sequence hold codes; a kernel that reads past them (or an
      // unused page) sees NaN.
      std::vector<uint8_t> live(elems, 0);
      for (int64_t s = 0; s < ns; ++s) {
        for (int64_t j = 0; j < c.seqs[s].len; ++j) {
          const int64_t page = table[s * max_pages + j / ps], slot = j % ps;
          for (int64_t kv = 0; kv < 2; ++kv) {
            for (int64_t h = 0; h < c.kv_heads; ++h) {
              const int64_t row = ((page * 2 + kv) * c.kv_heads + h) * ps + slot;
              std::fill_n(live.begin() + row * c.head_dim, c.head_dim, uint8_t{1});
            }
          }
        }
      }
      for (size_t i = 0; i < elems; ++i) {
        if (!live[i]) codes[i] = 0xff;
      }
    }
    std::vector<float> pool_f(elems);
    cpu::kv_pool_dequantize_fp8(codes.data(), pool_f.data(), num_pages, c.kv_heads, ps, c.head_dim,
                                ks, vs);
    const Bits q = randn_bf16(tokens * c.q_heads * c.head_dim, 1.f, c.q_mean);
    const std::vector<float> qf = to_f32(q);
    std::vector<float> ref(static_cast<size_t>(tokens * c.q_heads * c.head_dim));
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    cpu::paged_attention({qf.data(), pool_f.data(), table.data(), seq.data(), pos.data(),
                          ref.data(), tokens, c.q_heads, c.kv_heads, c.head_dim, ps, max_pages,
                          scale});
    DeviceBuffer<uint8_t> d_pool(codes);
    DeviceBuffer<uint16_t> d_q(q), d_out(ref.size());
    DeviceBuffer<int32_t> d_table(table), d_seq(seq), d_pos(pos);
    struct Variant {
      const char* name;
      PagedAttentionAlgo algo;
      int64_t num_prefill, kv_split;
      bool plan;
    };
    // The split the model would pick for this batch's decode tokens (132 SMs).
    const int64_t auto_split =
        tokens > npf ? paged_attention_decode_split(tokens - npf, c.kv_heads, max_pages, ps, 132)
                     : 0;
    std::vector<Variant> variants = {
        {"auto, prefill/decode split, no plan", PagedAttentionAlgo::kAuto, npf, 0, false},
        {"auto, kv_split 128", PagedAttentionAlgo::kAuto, npf, 128, false},
        {"auto, unknown prefill", PagedAttentionAlgo::kAuto, -1, 0, false},
        {"simple", PagedAttentionAlgo::kSimple, -1, 0, false},
        {"simple, kv_split 256", PagedAttentionAlgo::kSimple, -1, 256, false},
        {"decode kernel", PagedAttentionAlgo::kDecode, -1, 0, false},
        {"decode kernel, kv_split 128", PagedAttentionAlgo::kDecode, -1, 128, false},
    };
    if (auto_split > 128) {
      variants.push_back(
          {"auto, decode_split's kv_split", PagedAttentionAlgo::kAuto, npf, auto_split, false});
    }
    if (sm90_plan) {
      variants.push_back({"sm90 gathered plan", PagedAttentionAlgo::kAuto, npf, 0, true});
      variants.push_back(
          {"sm90 gathered plan, kv_split 128", PagedAttentionAlgo::kAuto, npf, 128, true});
    }
    PrefillAttentionPlan plan(PrefillKvPath::kPaged);  // fp8: gathered whatever is asked
    std::vector<float> simple_out, decode_out;         // the two kernels' outputs, compared below
    for (Variant const& v : variants) {
      SCOPED_TRACE(v.name);
      DeviceBuffer<float> d_ws(paged_attention_workspace_floats(tokens, c.q_heads, c.head_dim,
                                                                max_pages, ps, v.kv_split));
      d_ws.poison(0xff);
      d_out.poison(0xff);
      PagedAttentionParams p{d_q.bf(),    reinterpret_cast<bf16 const*>(d_pool.ptr),
                             d_table.ptr, d_seq.ptr,
                             d_pos.ptr,   d_out.bf(),
                             tokens,      c.q_heads,
                             c.kv_heads,  c.head_dim,
                             ps,          max_pages,
                             scale,       v.kv_split,
                             d_ws.ptr};
      p.num_prefill_tokens = v.num_prefill;
      p.algo = v.algo;
      p.kv_fp8 = true;
      p.k_scale = ks;
      p.v_scale = vs;
      if (v.plan) {
        ASSERT_TRUE(plan.plan({seq.data(), pos.data(), npf, c.q_heads, c.kv_heads, c.head_dim, ps,
                               max_pages, /*kv_fp8=*/true},
                              stream_))
            << plan.why();
        EXPECT_EQ(plan.path(), PrefillKvPath::kGathered);
        p.prefill_plan = &plan;
      }
      paged_attention_launch(p, stream_);
      sync();
      const std::vector<float> out = to_f32(d_out.download());
      const double err = test_util::rel_err(out, ref);
      EXPECT_LT(err, 1e-2);
      if (v.algo == PagedAttentionAlgo::kSimple && v.kv_split == 0) simple_out = out;
      if (v.algo == PagedAttentionAlgo::kDecode && v.kv_split == 0) decode_out = out;
    }
    // The tensor-core decode kernel (fp16 tiles) and the simple kernel (fp32 in registers) on
    // the same codes: closer to each other than either is to the fp32 reference's bound.
    ASSERT_EQ(simple_out.size(), ref.size());
    ASSERT_EQ(decode_out.size(), ref.size());
    EXPECT_LT(test_util::rel_err(decode_out, simple_out), 5e-3) << "kDecode vs kSimple";
  }
};

TEST_F(CudaKvFp8Attention, DecodeContexts) {
  SCOPED_TRACE(trace());
  for (int64_t len : {1, 17, 128, 129, 700}) {
    check({32, 4, 128, 16, {{len, 1}, {len / 2 + 1, 1}, {3, 1}}});
  }
}

TEST_F(CudaKvFp8Attention, PrefillAfterCachedPrefixAndMixed) {
  SCOPED_TRACE(trace());
  check({32, 4, 128, 16, {{40, 40}}});
  check({32, 4, 128, 16, {{300, 77}, {65, 1}, {20, 1}}});
  check({16, 2, 128, 1, {{33, 9}, {5, 1}}});  // page size 1
}

TEST_F(CudaKvFp8Attention, GroupsAndHeadDims) {
  SCOPED_TRACE(trace());
  for (int64_t g : {1, 2, 4, 8, 16}) {
    check({4 * g, 4, 128, 16, {{90, 30}, {200, 1}}});
    check({4 * g, 4, 64, 16, {{90, 30}, {200, 1}}});
  }
  check({16, 2, 256, 16, {{90, 30}, {200, 1}}});  // Qwen3.5's gated attention
}

TEST_F(CudaKvFp8Attention, Sm90GatheredPrefillDequantizes) {
  SCOPED_TRACE(trace());
  if (!PrefillAttentionPlan::built() || !PrefillAttentionPlan::device_supported()) {
    GTEST_SKIP() << "FlashInfer sm90 kernels not built or not an sm90 GPU";
  }
  check({32, 4, 128, 16, {{300, 77}, {129, 129}, {65, 1}}}, true);
  check({16, 2, 256, 16, {{200, 60}, {40, 1}}}, true);
}

// The tensor-core decode kernel over FP8 pages at every GQA group and head_dim (256: Qwen3.5's
// gated attention), contexts of 1 key, a partial 64-key tile, tile edges, several tiles, and
// block tables wider than the longest sequence (splits past a sequence's end write empty
// partials); codes past each sequence's end are NaN.
TEST_F(CudaKvFp8Attention, TensorCoreDecodeGroupsAndHeadDims) {
  SCOPED_TRACE(trace());
  for (int64_t d : {64, 128, 256}) {
    for (int64_t g : {1, 2, 4, 8, 16}) {
      const int64_t kvh = d == 256 ? 2 : 4;
      Case c{kvh * g, kvh, d, 16, {{1, 1}, {63, 1}, {64, 1}, {65, 1}, {200, 1}, {777, 1}}, 2};
      c.poison_tail = true;
      check(c);
    }
  }
}

// Page sizes 1 to 128 (the decode kernel indexes pages by shift), ragged contexts.
TEST_F(CudaKvFp8Attention, TensorCoreDecodePageSizes) {
  SCOPED_TRACE(trace());
  for (int64_t ps : {1, 8, 32, 64, 128}) {
    for (int64_t d : {128, 256}) {
      Case c{
          d == 256 ? 16 : 32, d == 256 ? 2 : 4, d, ps, {{130, 1}, {1, 1}, {1000, 1}, {17, 1}}, 1};
      c.poison_tail = true;
      check(c);
    }
  }
}

// Long contexts (many tiles per split, many splits), GQA 8 and 16, a prefill chunk beside them.
TEST_F(CudaKvFp8Attention, TensorCoreDecodeLongContexts) {
  SCOPED_TRACE(trace());
  for (int64_t q_heads : {32, 64}) {
    Case c{q_heads, 4, 128, 16, {{4096, 1}, {2049, 1}, {1, 1}, {333, 1}}, 3};
    c.poison_tail = true;
    check(c);
  }
  Case c{16, 2, 256, 16, {{3000, 1}, {4095, 1}, {2, 1}}};
  c.poison_tail = true;
  check(c);
  check({32, 4, 128, 16, {{300, 77}, {4000, 1}, {65, 1}}});  // a prefill chunk first
}

// Scales far from the random range (1 and 1; large k, small v; small k, large v).
TEST_F(CudaKvFp8Attention, TensorCoreDecodeScales) {
  SCOPED_TRACE(trace());
  for (auto [ks, vs] : {std::pair{1.f, 1.f}, std::pair{4.f, 0.05f}, std::pair{0.02f, 3.f}}) {
    for (int64_t d : {128, 256}) {
      Case c{d == 256 ? 16 : 32, d == 256 ? 2 : 4, d, 16, {{500, 1}, {1, 1}, {129, 1}}, 1};
      c.k_scale = ks;
      c.v_scale = vs;
      c.poison_tail = true;
      check(c);
    }
  }
}

// Queries with a large mean (scores dominated by each key's sum, a wider spread): a peaked
// softmax, large running-max corrections, most probabilities far below 1 (fp16 P).
TEST_F(CudaKvFp8Attention, TensorCoreDecodeSkewedScores) {
  SCOPED_TRACE(trace());
  for (int64_t d : {128, 256}) {
    Case c{d == 256 ? 16 : 64, d == 256 ? 2 : 4, d, 16, {{2500, 1}, {3, 1}, {400, 1}}, 1};
    c.q_mean = 2.0f;
    c.poison_tail = true;
    check(c);
  }
}

// kDecode (tensor cores, fp16 tiles) and kSimple (CUDA cores, fp32) on the same FP8 inputs:
// check() compares their outputs with each other (5e-3) besides each with the reference.
TEST_F(CudaKvFp8Attention, DecodeKernelAgreesWithSimpleKernel) {
  SCOPED_TRACE(trace());
  for (int64_t g : {4, 8, 16}) {
    check({4 * g, 4, 128, 16, {{1024, 1}, {1023, 1}, {64, 1}, {1, 1}}});
    check({2 * g, 2, 256, 16, {{1024, 1}, {100, 1}}});
  }
}

// Decode over FP8 pages captured once in a CUDA graph at a fixed capacity (kAuto, every token a
// decode token, split as the model splits), replayed with other lengths, block tables and
// queries (the model's decode steps), head_dim 128 and 256.
TEST_F(CudaKvFp8Attention, TensorCoreDecodeGraphReplay) {
  SCOPED_TRACE(trace());
  for (int64_t d : {128, 256}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    const int64_t kv_heads = d == 256 ? 2 : 4, q_heads = 8 * kv_heads, ps = 16, max_pages = 64,
                  seqs = 4, num_pages = seqs * max_pages + 3;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const float ks = rand_scale(), vs = rand_scale();
    const int64_t kv_split = paged_attention_decode_split(seqs, kv_heads, max_pages, ps, 132);
    ASSERT_GT(kv_split, 0);
    const size_t elems = static_cast<size_t>(num_pages * 2 * kv_heads * ps * d);
    const std::vector<float> raw = to_f32(randn_bf16(elems, 1.f));
    std::vector<uint8_t> codes(elems);
    const int64_t half = kv_heads * ps * d;
    for (size_t i = 0; i < elems; ++i) {
      codes[i] = cpu::kv_fp8_quantize(raw[i], (static_cast<int64_t>(i) / half) % 2 == 0 ? ks : vs);
    }
    std::vector<float> pool_f(elems);
    cpu::kv_pool_dequantize_fp8(codes.data(), pool_f.data(), num_pages, kv_heads, ps, d, ks, vs);
    DeviceBuffer<uint8_t> d_pool(codes);
    DeviceBuffer<uint16_t> d_q(seqs * q_heads * d), d_out(seqs * q_heads * d);
    DeviceBuffer<int32_t> d_table(seqs * max_pages), d_seq(seqs), d_pos(seqs);
    DeviceBuffer<float> d_ws(
        paged_attention_workspace_floats(seqs, q_heads, d, max_pages, ps, kv_split));
    d_ws.poison(0xff);
    PagedAttentionParams p{d_q.bf(),    reinterpret_cast<bf16 const*>(d_pool.ptr),
                           d_table.ptr, d_seq.ptr,
                           d_pos.ptr,   d_out.bf(),
                           seqs,        q_heads,
                           kv_heads,    d,
                           ps,          max_pages,
                           scale,       kv_split,
                           d_ws.ptr};
    p.num_prefill_tokens = 0;
    p.kv_fp8 = true;
    p.k_scale = ks;
    p.v_scale = vs;
    test_util::replay_decode_graph(
        p, num_pages, stream_, rng_, d_q, d_table, d_seq, d_pos, d_out,
        [&] { return randn_bf16(seqs * q_heads * d, 1.f); },
        [&](test_util::DecodeReplayInputs const& in) {
          const std::vector<float> qf = to_f32(in.q);
          std::vector<float> ref(static_cast<size_t>(seqs * q_heads * d));
          cpu::paged_attention({qf.data(), pool_f.data(), in.table.data(), in.token_seq.data(),
                                in.positions.data(), ref.data(), seqs, q_heads, kv_heads, d, ps,
                                max_pages, scale});
          EXPECT_LT(test_util::rel_err(d_out.download(), ref), 1e-2);
        });
  }
}

TEST_F(CudaKvFp8Attention, RejectsThePrefillAlgo) {
  const int64_t d = 128;
  DeviceBuffer<uint16_t> d_q(4 * d), d_out(4 * d);
  DeviceBuffer<uint8_t> d_pool(2 * 16 * d);
  std::vector<int32_t> zero(1, 0);
  DeviceBuffer<int32_t> d_table(zero), d_seq(zero), d_pos(zero);
  PagedAttentionParams p{d_q.bf(),    reinterpret_cast<bf16 const*>(d_pool.ptr),
                         d_table.ptr, d_seq.ptr,
                         d_pos.ptr,   d_out.bf(),
                         1,           4,
                         1,           d,
                         16,          1,
                         0.1f};
  p.algo = PagedAttentionAlgo::kPrefill;
  p.kv_fp8 = true;
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);
  p.algo = PagedAttentionAlgo::kDecode;  // the tensor-core decode kernel reads FP8 pages
  p.k_scale = 0.f;
  EXPECT_THROW(paged_attention_launch(p, stream_), Error);  // scales must be positive
}

// Host only: the CPU reference's quantization (bf16 rounding, scale, saturation).
TEST(KvFp8Reference, QuantizeRoundsSaturatesAndRoundTrips) {
  EXPECT_EQ(cpu::kv_fp8_quantize(0.f, 1.f), 0);
  EXPECT_EQ(cpu::kv_fp8_dequantize(cpu::kv_fp8_quantize(1.f, 1.f), 1.f), 1.f);
  EXPECT_EQ(cpu::kv_fp8_dequantize(cpu::kv_fp8_quantize(1e6f, 1.f), 1.f), 448.f);
  EXPECT_EQ(cpu::kv_fp8_dequantize(cpu::kv_fp8_quantize(-1e6f, 2.f), 2.f), -896.f);
  EXPECT_EQ(cpu::kv_fp8_dequantize(cpu::kv_fp8_quantize(3.f, 0.5f), 0.5f), 3.f);
  // Every code's value quantizes back to that code (scale 0.25), NaN codes aside.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    const float v = cpu::kv_fp8_dequantize(static_cast<uint8_t>(c), 0.25f);
    if (v == 0.f) continue;  // +-0
    EXPECT_EQ(cpu::kv_fp8_quantize(v, 0.25f), c) << c;
  }
  // A pool written through cpu::kv_write(kv_fp8) holds the dequantized codes.
  const float k[2] = {0.3f, -7.f}, v[2] = {100.f, 1e-3f};
  const int64_t slot = 1;
  float pool[2 * 2 * 2];
  cpu::KvWriteParams p{k, v, pool, &slot, 1, 1, 2, 2};
  p.kv_fp8 = true;
  p.k_scale = 0.1f;
  p.v_scale = 0.5f;
  cpu::kv_write(p);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(pool[2 + i], cpu::kv_fp8_dequantize(cpu::kv_fp8_quantize(k[i], 0.1f), 0.1f));
    EXPECT_EQ(pool[6 + i], cpu::kv_fp8_dequantize(cpu::kv_fp8_quantize(v[i], 0.5f), 0.5f));
  }
}

}  // namespace
}  // namespace tandem::cuda
