// Qwen3.5 hybrid-layer CUDA ops (backend/cuda/deltanet.h, gated_attention.h) vs the CPU
// reference (src/backend/cpu/ops.h). Fresh random inputs every run (the seed is printed on
// failure); outputs poisoned with NaN bit patterns before each launch; batches of several
// sequences of odd lengths (fresh, continuing from a random state, padding without a slot),
// state slots shuffled and interleaved with untouched ones. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/ops.h"
#include "backend/cuda/check.h"
#include "backend/cuda/deltanet.h"
#include "backend/cuda/gated_attention.h"
#include "core/dtype.h"
#include "core/error.h"
#include "cuda_test_util.h"

namespace tandem::cuda {
namespace {

using test_util::Bits;
using test_util::rel_err;
using test_util::to_bf16;
using test_util::to_f32;
template <typename T>
using DeviceBuffer = test_util::DeviceBuffer<T, test_util::UploadCheck::kThrow>;

constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-4;  // fp32 recurrences, other summation order and expf
// The chunked delta rule: bf16 tensor-core operands (q, k, W, U', the state copy); a numpy
// model of the same roundings gives 2.5e-3 .. 3.7e-3 on these inputs.
constexpr double kTolChunked = 1.5e-2;

/// A sequence of a batch: its new tokens, whether it starts at position 0, whether it is
/// padding (no slot).
struct SeqSpec {
  int64_t len;
  bool fresh = false;
  bool padding = false;
};

class CudaDeltaNet : public test_util::CudaFixture<> {
 protected:
  std::vector<float> randn(size_t n, float scale = 1.f, float mean = 0.f) {
    std::normal_distribution<float> d(mean, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }
  // bf16-representable values (the device reads bf16).
  std::vector<float> randn_bf(size_t n, float scale = 1.f, float mean = 0.f) {
    return to_f32(to_bf16(randn(n, scale, mean)));
  }

  /// Host metadata of a batch; slots shuffled among num_slots (> sequences), padding -1. With
  /// out_slots_, each sequence's state after its tokens goes to a slot of its own
  /// (DeltaNetSeqs::state_slot_out; -1 for padding), its slot only read.
  struct Batch {
    int64_t tokens = 0, num_slots = 0;
    std::vector<int32_t> seq_begin, token_seq, slot, fresh, slot_out;
    int32_t dst(size_t s) const { return slot_out.empty() ? slot[s] : slot_out[s]; }
  };
  Batch make_batch(std::vector<SeqSpec> const& seqs) {
    Batch b;
    const auto n = static_cast<int64_t>(seqs.size());
    b.num_slots = (out_slots_ ? 2 * n : n) + 3;
    std::vector<int32_t> perm(static_cast<size_t>(b.num_slots));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    for (size_t s = 0; s < seqs.size(); ++s) {
      b.seq_begin.push_back(static_cast<int32_t>(b.tokens));
      for (int64_t i = 0; i < seqs[s].len; ++i) b.token_seq.push_back(static_cast<int32_t>(s));
      b.tokens += seqs[s].len;
      b.slot.push_back(seqs[s].padding ? -1 : perm[s]);
      b.fresh.push_back(seqs[s].fresh ? 1 : 0);
      if (out_slots_) b.slot_out.push_back(seqs[s].padding ? -1 : perm[seqs.size() + s]);
    }
    b.seq_begin.push_back(static_cast<int32_t>(b.tokens));
    return b;
  }
  struct DeviceSeqs {
    DeviceBuffer<int32_t> begin, token_seq, slot, fresh, slot_out;
    explicit DeviceSeqs(Batch const& b)
        : begin(b.seq_begin),
          token_seq(b.token_seq),
          slot(b.slot),
          fresh(b.fresh),
          slot_out(b.slot_out) {}
    DeltaNetSeqs view(Batch const& b) const {
      return {begin.ptr,
              token_seq.ptr,
              slot.ptr,
              fresh.ptr,
              static_cast<int64_t>(b.slot.size()),
              b.slot_out.empty() ? nullptr : slot_out.ptr};
    }
  };
  // make_batch: out slots (the speculative verify's spare slots).
  bool out_slots_ = false;
  // delta_case: GatedDeltaRuleParams::states_only (the padding's outputs left as they were).
  bool states_only_ = false;

  void conv_case(std::vector<SeqSpec> const& seqs, int64_t channels, int64_t kernel);
  /// Runs the rule on a random batch and compares with the CPU reference; `sequential` asks
  /// for the per-token prefill instead of the chunked one, `fused` for the one-kernel decode
  /// step (GatedDeltaRuleParams::fused_decode).
  void delta_case(std::vector<SeqSpec> const& seqs, int64_t hk, int64_t hv, int64_t dk, int64_t dv,
                  bool sequential = false, bool fused = false, int64_t row_pad = 8);
  // Every chunked run with GatedDeltaRuleParams::wy_blocked_inverse (the opt-in).
  bool blocked_inverse_ = false;
  // The chunked form for short chunks too (GatedDeltaRuleParams::short_chunk_tokens 0).
  bool force_chunked_ = false;
};

void CudaDeltaNet::conv_case(std::vector<SeqSpec> const& seqs, int64_t channels, int64_t kernel) {
  SCOPED_TRACE("channels " + std::to_string(channels) + " kernel " + std::to_string(kernel));
  const Batch b = make_batch(seqs);
  const int64_t n = b.tokens, hist = kernel - 1, stride = channels + 24;
  const int64_t slot_stride = channels * hist + 5;  // slots spaced by more than the window
  std::vector<float> x = randn_bf(static_cast<size_t>(n * stride));
  std::vector<float> w = randn_bf(static_cast<size_t>(channels * kernel), 0.5f);
  std::vector<float> states = randn(static_cast<size_t>(b.num_slots * slot_stride));
  DeviceBuffer<uint16_t> d_x(to_bf16(x)), d_w(to_bf16(w)), d_out(static_cast<size_t>(n * channels));
  DeviceBuffer<float> d_states(states);
  DeviceSeqs ds(b);
  d_out.poison(0xff);
  CausalConv1dParams p{d_x.bf(), d_w.bf(), d_states.ptr, d_out.bf(), ds.view(b),
                       n,        channels, kernel,       stride,     slot_stride};
  causal_conv1d_launch(p, stream_);
  sync();
  // Reference: per sequence on a private copy of its window (zero when fresh or padding).
  std::vector<float> ref_out(static_cast<size_t>(n * channels)), ref_states = states;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int64_t t0 = b.seq_begin[s], len = seqs[s].len;
    std::vector<float> win(static_cast<size_t>(channels * hist), 0.f);
    if (!seqs[s].fresh && !seqs[s].padding) {
      std::copy_n(states.begin() + b.slot[s] * slot_stride, channels * hist, win.begin());
    }
    std::vector<float> xs(static_cast<size_t>(len * channels));
    for (int64_t i = 0; i < len; ++i) {
      std::copy_n(x.begin() + (t0 + i) * stride, channels, xs.begin() + i * channels);
    }
    cpu::causal_conv1d(
        {xs.data(), w.data(), win.data(), ref_out.data() + t0 * channels, len, channels, kernel});
    if (!seqs[s].padding) {
      std::copy(win.begin(), win.end(), ref_states.begin() + b.dst(s) * slot_stride);
    }
  }
  EXPECT_LT(rel_err(d_out.download(), ref_out), kTolBf16);
  // The windows are copies of bf16 inputs (or of the old window): exact; untouched slots and
  // the gaps between slots keep their values.
  const std::vector<float> got = d_states.download();
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) bad += got[i] != ref_states[i];
  EXPECT_EQ(bad, 0u);
}

void CudaDeltaNet::delta_case(std::vector<SeqSpec> const& seqs, int64_t hk, int64_t hv, int64_t dk,
                              int64_t dv, bool sequential, bool fused, int64_t row_pad) {
  SCOPED_TRACE("hk " + std::to_string(hk) + " hv " + std::to_string(hv) + " dk " +
               std::to_string(dk) + " dv " + std::to_string(dv) +
               (sequential ? " sequential" : ""));
  const Batch b = make_batch(seqs);
  const int64_t n = b.tokens;
  const int64_t width = 2 * hk * dk + hv * dv, qkv_stride = width + row_pad, ab_stride = 2 * hv + 3;
  const int64_t slot_stride = hv * dk * dv + 16;
  std::vector<float> qkv = randn_bf(static_cast<size_t>(n * qkv_stride));
  std::vector<float> ab = randn_bf(static_cast<size_t>(n * ab_stride), 1.5f);
  std::vector<float> a_log = randn(static_cast<size_t>(hv), 0.5f);
  std::vector<float> dt_bias = randn(static_cast<size_t>(hv), 0.5f);
  std::vector<float> states = randn(static_cast<size_t>(b.num_slots * slot_stride), 0.3f);
  // Reference: gates over the batch, then the rule per sequence on a copy of its state.
  std::vector<float> beta(static_cast<size_t>(n * hv)), g(static_cast<size_t>(n * hv));
  cpu::deltanet_gates({ab.data(), ab.data() + hv + 1, a_log.data(), dt_bias.data(), beta.data(),
                       g.data(), n, hv, ab_stride});
  std::vector<float> ref_out(static_cast<size_t>(n * hv * dv)), ref_states = states;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int64_t t0 = b.seq_begin[s];
    std::vector<float> st(static_cast<size_t>(hv * dk * dv), 0.f);
    if (!seqs[s].fresh && !seqs[s].padding) {
      std::copy_n(states.begin() + b.slot[s] * slot_stride, hv * dk * dv, st.begin());
    }
    const float* row = qkv.data() + t0 * qkv_stride;
    cpu::gated_delta_rule({row, row + hk * dk, row + 2 * hk * dk, g.data() + t0 * hv,
                           beta.data() + t0 * hv, st.data(), ref_out.data() + t0 * hv * dv,
                           seqs[s].len, hk, hv, dk, dv, qkv_stride});
    if (!seqs[s].padding) {
      std::copy(st.begin(), st.end(), ref_states.begin() + b.dst(s) * slot_stride);
    }
  }
  // The chunked form takes prefill batches at k_dim 64 / 128 (launch's dispatch); it runs in
  // each of its shapes: the default (the state kernel's by the grid), the WY kernel's first
  // layout (wide_wy) with the state kernel's first shape, the state kernel's other shape
  // (GatedDeltaRuleParams::state_variant), the opt-in prep (prep_heads4).
  const auto nseq = static_cast<int64_t>(seqs.size());
  const int64_t short_chunk = force_chunked_ ? 0 : GatedDeltaRuleParams{}.short_chunk_tokens;
  const bool chunked =
      !sequential && n != nseq && (dk == 64 || dk == 128) && n > short_chunk * nseq;
  const double tol = chunked ? kTolChunked : kTolF32;
  // Short chunks run in both recurrence forms (the block's, the default, and the one-warp one).
  const bool short_chunks = !chunked && !sequential && n != nseq && n <= short_chunk * nseq;
  DeviceBuffer<uint16_t> d_qkv(to_bf16(qkv)), d_ab(to_bf16(ab));
  DeviceBuffer<float> d_alog(a_log), d_dt(dt_bias);
  DeviceBuffer<float> d_out(static_cast<size_t>(n * hv * dv));
  DeviceBuffer<float> d_ws(gated_delta_rule_workspace_floats(n, hk, hv, dk, dv));
  DeviceSeqs ds(b);
  for (int run = 0; run < (chunked ? 4 : short_chunks ? 2 : 1); ++run) {
    SCOPED_TRACE((chunked ? "chunked shape " : "run ") + std::to_string(run));
    DeviceBuffer<float> d_states(states);
    d_out.poison(0xff);
    d_ws.poison(0xff);
    GatedDeltaRuleParams p{};
    p.qkv = d_qkv.bf();
    p.b = d_ab.bf();           // columns [0, hv)
    p.a = d_ab.bf() + hv + 1;  // columns [hv + 1, 2 hv + 1)
    p.a_log = d_alog.ptr;
    p.dt_bias = d_dt.ptr;
    p.states = d_states.ptr;
    p.out = d_out.ptr;
    p.workspace = d_ws.ptr;
    p.seqs = ds.view(b);
    p.num_tokens = n;
    p.num_k_heads = hk;
    p.num_v_heads = hv;
    p.k_dim = dk;
    p.v_dim = dv;
    p.qkv_stride = qkv_stride;
    p.ab_stride = ab_stride;
    p.state_stride = slot_stride;
    p.sequential = sequential;
    p.short_chunk_tokens = short_chunk;
    p.fused_decode = fused;
    p.wide_wy = run == 1;
    p.state_variant = run < 3 ? run : 0;  // 0: by the grid, 1, 2: forced
    p.prep_heads4 = run == 3;
    p.wy_blocked_inverse = blocked_inverse_ && run != 1;  // compact layout only
    p.states_only = states_only_;
    p.short_chunks_by_warp = short_chunks && run == 1;
    gated_delta_rule_launch(p, stream_);
    sync();
    std::vector<float> out = d_out.download();
    if (states_only_) {  // the padding's rows untouched (still poisoned), then not compared
      for (size_t s = 0; s < seqs.size(); ++s) {
        if (!seqs[s].padding) continue;
        const auto r0 = static_cast<size_t>(b.seq_begin[s] * hv * dv),
                   r1 = static_cast<size_t>(b.seq_begin[s + 1] * hv * dv);
        for (size_t i = r0; i < r1; ++i) {
          uint32_t bits = 0;
          std::memcpy(&bits, &out[i], sizeof(bits));
          ASSERT_EQ(bits, 0xffffffffu) << "sequence " << s << " (padding) wrote an output";
          out[i] = ref_out[i];
        }
      }
    }
    EXPECT_LT(rel_err(out, ref_out), tol);
    // Per slot, so an untouched slot or a wrong one shows; the gaps between slots keep their
    // values exactly.
    const std::vector<float> got = d_states.download();
    const int64_t per = hv * dk * dv;
    for (int64_t sl = 0; sl < b.num_slots; ++sl) {
      const auto at = static_cast<size_t>(sl * slot_stride);
      std::vector<float> g1(got.begin() + at, got.begin() + at + per);
      std::vector<float> r1(ref_states.begin() + at, ref_states.begin() + at + per);
      EXPECT_LT(rel_err(g1, r1), tol) << "slot " << sl;
      for (int64_t i = per; i < slot_stride; ++i) {
        EXPECT_EQ(got[at + i], ref_states[at + i]) << "slot " << sl << " gap " << i;
      }
    }
  }
}

TEST_F(CudaDeltaNet, ConvPrefillAndDecode) {
  SCOPED_TRACE(trace());
  // Prefill chunks (fresh and continuing), 1- and 2-token sequences (shorter than the window),
  // a padding sequence; then a pure decode batch.
  const std::vector<SeqSpec> mixed = {
      {37, true}, {1}, {2, false}, {70, false}, {5, true}, {1, false, true}, {3, true}};
  for (int64_t channels : {8, 200, 8192}) conv_case(mixed, channels, 4);
  conv_case(mixed, 100, 4);  // channels not a multiple of 8: the per-channel kernel
  conv_case(mixed, 96, 2);
  conv_case(mixed, 96, 8);
  conv_case({{1}, {1}, {1, true}, {1, false, true}, {1}}, 8192, 4);
}

TEST_F(CudaDeltaNet, ConvChunksEqualOnePrefill) {
  SCOPED_TRACE(trace());
  // One sequence in chunks of 1, 3, 29 tokens from a fresh start equals one 33-token prefill.
  const int64_t channels = 136, kernel = 4, hist = kernel - 1, n = 33;
  std::vector<float> x = randn_bf(static_cast<size_t>(n * channels));
  std::vector<float> w = randn_bf(static_cast<size_t>(channels * kernel));
  DeviceBuffer<uint16_t> d_x(to_bf16(x)), d_w(to_bf16(w)), d_out(static_cast<size_t>(n * channels));
  auto run = [&](std::vector<int64_t> const& chunks, DeviceBuffer<float>& st) {
    int64_t t0 = 0;
    for (int64_t len : chunks) {
      std::vector<int32_t> begin = {0, static_cast<int32_t>(len)}, ts(len, 0), slot = {0},
                           fresh = {t0 == 0 ? 1 : 0};
      DeviceBuffer<int32_t> d_b(begin), d_ts(ts), d_sl(slot), d_fr(fresh);
      CausalConv1dParams p{d_x.bf() + t0 * channels,
                           d_w.bf(),
                           st.ptr,
                           d_out.bf() + t0 * channels,
                           {d_b.ptr, d_ts.ptr, d_sl.ptr, d_fr.ptr, 1},
                           len,
                           channels,
                           kernel,
                           channels,
                           channels * hist};
      causal_conv1d_launch(p, stream_);
      sync();
      t0 += len;
    }
    return d_out.download();
  };
  DeviceBuffer<float> s1(static_cast<size_t>(channels * hist)), s2(s1.count);
  s1.poison(0xff);  // fresh: the old window is never read
  s2.poison(0xff);
  d_out.poison(0xff);
  const Bits one = run({n}, s1);
  d_out.poison(0xff);
  const Bits chunked = run({1, 3, 29}, s2);
  EXPECT_EQ(one, chunked);
  EXPECT_EQ(s1.download(), s2.download());
}

TEST_F(CudaDeltaNet, DeltaRuleShapes) {
  SCOPED_TRACE(trace());
  const std::vector<SeqSpec> mixed = {{37, true},       {1},        {70, false}, {2, true},
                                      {1, false, true}, {17, false}};
  delta_case(mixed, 2, 4, 16, 16);          // fixture qwen35_text_hd64: 2 k / 4 v heads of 16
  delta_case(mixed, 1, 2, 32, 32);          // fixture qwen35_vl_hd256: 1 k / 2 v heads of 32
  delta_case(mixed, 2, 2, 64, 48);          // v_dim not a multiple of 32
  delta_case(mixed, 2, 4, 128, 128);        // Qwen3.5 head sizes (16 k / 32 v heads at full size)
  delta_case(mixed, 1, 2, 128, 40);         // rows split over two lanes, a partial column block
  delta_case(mixed, 2, 4, 128, 128, true);  // the sequential prefill at full precision
  delta_case(mixed, 2, 2, 64, 48, true);
}

// Speculative verify steps (2..5 tokens per sequence, continuing; a padding sequence): the
// per-token recurrence by default (short_chunk_tokens), the chunked form when forced; both
// against the reference.
TEST_F(CudaDeltaNet, DeltaRuleVerifyShapes) {
  SCOPED_TRACE(trace());
  const std::vector<SeqSpec> verify = {{4}, {4}, {2}, {5}, {4, false, true},
                                       {3}, {4}, {4}, {2}, {5}};
  delta_case(verify, 2, 4, 128, 128);  // the recurrence (37 tokens over 10 sequences)
  delta_case(verify, 2, 2, 64, 48);
  delta_case(verify, 2, 4, 16, 16);
  force_chunked_ = true;
  delta_case(verify, 2, 4, 128, 128);
  delta_case(verify, 2, 2, 64, 48);
  force_chunked_ = false;
}

// The chunked tests' batch: sequences shorter than a chunk, ending on / next to chunk boundaries,
// spanning several chunks, starting mid-chunk (the tiles are global over the batch), fresh,
// continuing and padding.
std::vector<SeqSpec> chunked_batch() {
  return {{1, true},  {63, false},  {64, true},       {65, false}, {130, true},      {5, false},
          {1, false}, {200, false}, {3, false, true}, {129, true}, {66, false, true}};
}

TEST_F(CudaDeltaNet, DeltaRuleChunked) {
  SCOPED_TRACE(trace());
  // The chunked form: sequences shorter than a chunk, ending on / next to chunk boundaries,
  // spanning several chunks, starting mid-chunk (the tiles are global over the batch), fresh,
  // continuing and padding; k_dim 128 and 64; v_dim 128, partial column blocks, 256.
  const std::vector<SeqSpec> mixed = chunked_batch();
  delta_case(mixed, 2, 4, 128, 128);
  delta_case(mixed, 1, 3, 128, 40);
  delta_case(mixed, 2, 2, 64, 64);
  delta_case(mixed, 1, 2, 64, 256);
  delta_case(mixed, 1, 2, 64, 36);  // v_dim not a multiple of 8: V by scalar loads
  // An odd row stride: q / k (the prep) and V by scalar loads.
  delta_case(mixed, 2, 4, 128, 128, false, false, 7);
  delta_case(mixed, 1, 2, 64, 64, false, false, 3);
  delta_case({{64, true}}, 1, 1, 128, 128);      // exactly one chunk
  delta_case({{2, false}, {1}}, 2, 4, 128, 96);  // a 2-token prefill beside a decode token
}

TEST_F(CudaDeltaNet, DeltaRuleChunkedBlockedInverse) {
  SCOPED_TRACE(trace());
  // The opt-in blockwise T = (I + A)^-1 (wy_blocked_inverse) on DeltaRuleChunked's batch:
  // sequences starting and ending mid-tile, several in a tile, fresh / continuing / padding.
  blocked_inverse_ = true;
  const std::vector<SeqSpec> mixed = chunked_batch();
  delta_case(mixed, 2, 4, 128, 128);
  delta_case(mixed, 1, 3, 128, 40);
  delta_case(mixed, 2, 2, 64, 64);
  delta_case(mixed, 1, 2, 64, 36);
  delta_case({{64, true}}, 1, 1, 128, 128);
  delta_case({{700, true}, {300, false}}, 2, 4, 128, 128);
}

TEST_F(CudaDeltaNet, DeltaRuleChunkedPiecesEqualOnePrefill) {
  SCOPED_TRACE(trace());
  // One sequence prefilled in pieces (1, 70, 64, 198 tokens: every piece starts at a different
  // offset in its chunk), the state carried in its slot, equals one 333-token prefill and the
  // CPU reference.
  const int64_t hk = 2, hv = 4, dk = 128, dv = 128, n = 333;
  const int64_t width = 2 * hk * dk + hv * dv, ab_stride = 2 * hv;
  std::vector<float> qkv = randn_bf(static_cast<size_t>(n * width));
  std::vector<float> ab = randn_bf(static_cast<size_t>(n * ab_stride), 1.5f);
  std::vector<float> a_log = randn(static_cast<size_t>(hv), 0.5f, -1.f);
  std::vector<float> dt_bias = randn(static_cast<size_t>(hv), 0.5f);
  DeviceBuffer<uint16_t> d_qkv(to_bf16(qkv)), d_ab(to_bf16(ab));
  DeviceBuffer<float> d_alog(a_log), d_dt(dt_bias);
  DeviceBuffer<float> d_ws(gated_delta_rule_workspace_floats(n, hk, hv, dk, dv));
  const auto run = [&](std::vector<int64_t> const& pieces, DeviceBuffer<float>& st,
                       DeviceBuffer<float>& out) {
    int64_t t0 = 0;
    for (int64_t len : pieces) {
      std::vector<int32_t> begin = {0, static_cast<int32_t>(len)}, ts(len, 0), slot = {0},
                           fresh = {t0 == 0 ? 1 : 0};
      DeviceBuffer<int32_t> d_b(begin), d_ts(ts), d_sl(slot), d_fr(fresh);
      GatedDeltaRuleParams p{};
      p.qkv = d_qkv.bf() + t0 * width;
      p.b = d_ab.bf() + t0 * ab_stride;
      p.a = d_ab.bf() + t0 * ab_stride + hv;
      p.a_log = d_alog.ptr;
      p.dt_bias = d_dt.ptr;
      p.states = st.ptr;
      p.out = out.ptr + t0 * hv * dv;
      p.workspace = d_ws.ptr;
      p.seqs = {d_b.ptr, d_ts.ptr, d_sl.ptr, d_fr.ptr, 1};
      p.num_tokens = len;
      p.num_k_heads = hk;
      p.num_v_heads = hv;
      p.k_dim = dk;
      p.v_dim = dv;
      p.qkv_stride = width;
      p.ab_stride = ab_stride;
      p.state_stride = hv * dk * dv;
      gated_delta_rule_launch(p, stream_);
      sync();
      t0 += len;
    }
  };
  const auto count = static_cast<size_t>(hv * dk * dv),
             out_count = static_cast<size_t>(n * hv * dv);
  DeviceBuffer<float> s1(count), s2(count), o1(out_count), o2(out_count);
  s1.poison(0xff);  // fresh: the old state is never read
  s2.poison(0xff);
  o1.poison(0xff);
  o2.poison(0xff);
  d_ws.poison(0xff);
  run({n}, s1, o1);
  run({1, 70, 64, 198}, s2, o2);
  std::vector<float> beta(static_cast<size_t>(n * hv)), g(beta.size());
  cpu::deltanet_gates({ab.data(), ab.data() + hv, a_log.data(), dt_bias.data(), beta.data(),
                       g.data(), n, hv, ab_stride});
  std::vector<float> ref_out(out_count), ref_state(count, 0.f);
  cpu::gated_delta_rule({qkv.data(), qkv.data() + hk * dk, qkv.data() + 2 * hk * dk, g.data(),
                         beta.data(), ref_state.data(), ref_out.data(), n, hk, hv, dk, dv, width});
  const std::vector<float> out1 = o1.download(), out2 = o2.download();
  EXPECT_LT(rel_err(out1, ref_out), kTolChunked);
  EXPECT_LT(rel_err(out2, ref_out), kTolChunked);
  EXPECT_LT(rel_err(out2, out1), kTolChunked);
  EXPECT_LT(rel_err(s1.download(), ref_state), kTolChunked);
  EXPECT_LT(rel_err(s2.download(), ref_state), kTolChunked);
}

TEST_F(CudaDeltaNet, DeltaRuleDecode) {
  SCOPED_TRACE(trace());
  // A decode batch (the decode kernel: one token per sequence), one of them padding, one fresh
  // (a 1-token prompt). The batches above take the chunk kernel.
  std::vector<SeqSpec> dec;
  for (int i = 0; i < 9; ++i) dec.push_back({1, i == 4, i == 7});
  delta_case(dec, 4, 8, 128, 128);
  delta_case(dec, 2, 4, 16, 16);
  // The opt-in one-kernel step (q / k norm and gates in the delta-rule kernel).
  delta_case(dec, 4, 8, 128, 128, false, true);
  delta_case(dec, 2, 4, 16, 16, false, true);
  delta_case(dec, 4, 4, 64, 96, false, true);
}

// Out slots (DeltaNetSeqs::state_slot_out: a speculative verify writes its sequences' states to
// their spare slots): every form of the conv and the delta rule leaves the state it computes in
// the out slot and every other slot as it was (the compared slots include the in slots).
TEST_F(CudaDeltaNet, OutSlotsKeepTheStateBefore) {
  SCOPED_TRACE(trace());
  out_slots_ = true;
  const std::vector<SeqSpec> mixed = {{37, true}, {1}, {2, false}, {70, false}, {1, false, true}};
  const std::vector<SeqSpec> verify = {{4}, {2}, {5}, {4, false, true}, {3}};
  std::vector<SeqSpec> dec;
  for (int i = 0; i < 6; ++i) dec.push_back({1, i == 4, i == 2});
  conv_case(mixed, 200, 4);  // the vectorised prefill
  conv_case(mixed, 100, 4);  // the per-channel kernel
  conv_case(verify, 8192, 4);
  conv_case(dec, 8192, 4);             // the decode kernel (the window shifted into the out slot)
  delta_case(verify, 2, 4, 128, 128);  // the recurrence over short chunks
  delta_case(mixed, 2, 4, 128, 128, true);       // the sequential prefill
  delta_case(dec, 4, 8, 128, 128);               // the decode kernel
  delta_case(dec, 4, 8, 128, 128, false, true);  // the fused decode kernel
  delta_case(chunked_batch(), 2, 4, 128, 128);   // the chunked form
  out_slots_ = false;
}

// A speculative step's state replay (GatedDeltaRuleParams::states_only, the recurrence over short
// chunks): the sequences with a slot as without it, the padding's (many tokens, one sequence or
// several, empty ones) skipped without an output written.
TEST_F(CudaDeltaNet, StatesOnlySkipsThePadding) {
  SCOPED_TRACE(trace());
  states_only_ = true;
  delta_case({{2}, {0, false, true}, {4}, {11, false, true}, {1}, {0}}, 2, 4, 128, 128);
  delta_case({{3}, {1, false, true}, {1, false, true}, {2}, {1, false, true}}, 4, 8, 64, 32);
  states_only_ = false;
}

TEST_F(CudaDeltaNet, DeltaRuleLongPrefill) {
  SCOPED_TRACE(trace());
  // Long sequences: the state carried over 700 tokens (11 chunks; the sequential prefill in
  // registers over them).
  delta_case({{700, true}, {300, false}}, 2, 4, 128, 128);
  delta_case({{700, true}, {300, false}}, 2, 4, 128, 128, true);
}

TEST_F(CudaDeltaNet, DeltaRuleRejectsUnsupported) {
  GatedDeltaRuleParams p{};
  p.num_tokens = 1;
  p.num_k_heads = 1;
  p.num_v_heads = 2;
  p.k_dim = 48;
  p.v_dim = 32;
  p.qkv_stride = 1000;
  p.ab_stride = 4;
  int32_t dummy = 0;
  p.seqs = {&dummy, &dummy, &dummy, &dummy, 1};
  EXPECT_THROW(gated_delta_rule_launch(p, stream_), Error);
  p.k_dim = 32;
  p.num_k_heads = 2;
  p.num_v_heads = 3;  // not a multiple of the key heads
  EXPECT_THROW(gated_delta_rule_launch(p, stream_), Error);
}

TEST_F(CudaDeltaNet, GatedRmsNorm) {
  SCOPED_TRACE(trace());
  for (int64_t dv : {16, 32, 128}) {
    const int64_t n = 23, hv = 4, gate_stride = hv * dv + 40, rows = n * hv;
    std::vector<float> x = randn(static_cast<size_t>(rows * dv), 2.f);
    std::vector<float> z = randn_bf(static_cast<size_t>(n * gate_stride));
    std::vector<float> w = randn(static_cast<size_t>(dv), 0.1f, 1.f);
    DeviceBuffer<float> d_x(x), d_w(w);
    DeviceBuffer<uint16_t> d_z(to_bf16(z)), d_out(static_cast<size_t>(rows * dv));
    d_out.poison(0xff);
    gated_rms_norm_launch(
        {d_x.ptr, d_z.bf() + 7, d_w.ptr, d_out.bf(), rows, dv, hv, gate_stride, 1e-6f}, stream_);
    sync();
    std::vector<float> zd(static_cast<size_t>(rows * dv)), ref(zd.size());
    for (int64_t t = 0; t < n; ++t) {
      std::copy_n(z.begin() + t * gate_stride + 7, hv * dv, zd.begin() + t * hv * dv);
    }
    cpu::gated_rms_norm({x.data(), zd.data(), w.data(), ref.data(), rows, dv, 1e-6f});
    EXPECT_LT(rel_err(d_out.download(), ref), kTolBf16) << "dv " << dv;
  }
}

TEST_F(CudaDeltaNet, GatedQkvPrep) {
  SCOPED_TRACE(trace());
  struct Shape {
    int64_t qh, kvh, d;
  };
  for (Shape sh : {Shape{4, 2, 64}, Shape{16, 2, 256}, Shape{8, 1, 128}, Shape{2, 1, 256}}) {
    SCOPED_TRACE("d " + std::to_string(sh.d) + " qh " + std::to_string(sh.qh));
    const int64_t n = 37, ps = 16, num_pages = 5, d = sh.d, rot = d / 4;
    const int64_t width = (2 * sh.qh + 2 * sh.kvh) * d;
    std::vector<float> qkv = randn_bf(static_cast<size_t>(n * width), 2.f);
    std::vector<float> qw = randn_bf(static_cast<size_t>(d), 0.2f, 1.f);
    std::vector<float> kw = randn_bf(static_cast<size_t>(d), 0.2f, 1.f);
    std::vector<int32_t> pos(static_cast<size_t>(n));
    std::vector<int64_t> slots(static_cast<size_t>(n));
    std::vector<int64_t> perm(static_cast<size_t>(num_pages * ps));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    std::uniform_int_distribution<int32_t> pd(0, 5000);
    for (int64_t t = 0; t < n; ++t) {
      pos[t] = pd(rng_);
      slots[t] = t % 9 == 4 ? -1 : perm[t];  // some padding tokens
    }
    const size_t pool_elems = static_cast<size_t>(num_pages * 2 * sh.kvh * ps * d);
    DeviceBuffer<uint16_t> d_qkv(to_bf16(qkv)), d_qw(to_bf16(qw)), d_kw(to_bf16(kw));
    DeviceBuffer<uint16_t> d_q(static_cast<size_t>(n * sh.qh * d)), d_g(d_q.count),
        d_pool(pool_elems);
    DeviceBuffer<int32_t> d_pos(pos);
    DeviceBuffer<int64_t> d_slots(slots);
    d_q.poison(0xff);
    d_g.poison(0xff);
    d_pool.poison(0xff);
    GatedQkvPrepParams p{d_qkv.bf(), d_q.bf(),  d_g.bf(), d_pool.bf(), d_slots.ptr, d_qw.bf(),
                         d_kw.bf(),  d_pos.ptr, n,        sh.qh,       sh.kvh,      d,
                         ps,         rot,       1e-6f,    10000.0};
    gated_qkv_prep_launch(p, stream_);
    sync();
    // Reference: split the row, cpu::qk_norm_rope with rotary_dim, cpu::kv_write (fp32 pool).
    std::vector<float> q(static_cast<size_t>(n * sh.qh * d)), gate(q.size()),
        k(static_cast<size_t>(n * sh.kvh * d)), v(k.size());
    for (int64_t t = 0; t < n; ++t) {
      const float* row = qkv.data() + t * width;
      for (int64_t h = 0; h < sh.qh; ++h) {
        std::copy_n(row + h * 2 * d, d, q.begin() + (t * sh.qh + h) * d);
        std::copy_n(row + h * 2 * d + d, d, gate.begin() + (t * sh.qh + h) * d);
      }
      std::copy_n(row + 2 * sh.qh * d, sh.kvh * d, k.begin() + t * sh.kvh * d);
      std::copy_n(row + 2 * sh.qh * d + sh.kvh * d, sh.kvh * d, v.begin() + t * sh.kvh * d);
    }
    cpu::qk_norm_rope({q.data(), k.data(), qw.data(), kw.data(), pos.data(), n, sh.qh, sh.kvh, d,
                       1e-6f, 10000.0, rot});
    std::vector<float> ref_pool(pool_elems, NAN);
    for (int64_t t = 0; t < n; ++t) {
      if (slots[t] < 0) continue;
      cpu::kv_write({k.data() + t * sh.kvh * d, v.data() + t * sh.kvh * d, ref_pool.data(),
                     &slots[t], 1, sh.kvh, d, ps});
    }
    EXPECT_LT(rel_err(d_q.download(), q), kTolBf16);
    EXPECT_EQ(d_g.download(), to_bf16(gate));  // copied unchanged
    // Written slots match; every other pool element still holds the poison.
    const Bits pool = d_pool.download();
    std::vector<float> got, want;
    size_t untouched_bad = 0;
    for (size_t i = 0; i < pool_elems; ++i) {
      if (std::isnan(ref_pool[i])) {
        untouched_bad += pool[i] != 0xffff;
      } else {
        got.push_back(bf16_to_f32(pool[i]));
        want.push_back(ref_pool[i]);
      }
    }
    EXPECT_EQ(untouched_bad, 0u);
    EXPECT_LT(rel_err(got, want), kTolBf16);
  }
}

TEST_F(CudaDeltaNet, SigmoidGates) {
  SCOPED_TRACE(trace());
  const int64_t rows = 19, dim = 200;
  std::vector<float> x = randn_bf(static_cast<size_t>(rows * dim));
  std::vector<float> g = randn_bf(static_cast<size_t>(rows * dim), 2.f);
  DeviceBuffer<uint16_t> d_x(to_bf16(x)), d_g(to_bf16(g)), d_out(x.size());
  d_out.poison(0xff);
  sigmoid_mul_launch({d_x.bf(), d_g.bf(), d_out.bf(), rows * dim}, stream_);
  sync();
  std::vector<float> ref(x.size());
  cpu::sigmoid_gate({x.data(), g.data(), ref.data(), rows, dim, dim});
  EXPECT_LT(rel_err(d_out.download(), ref), kTolBf16);

  // Shared expert gate: y += sigmoid(xn . w) * s per row.
  std::vector<float> xn = randn_bf(static_cast<size_t>(rows * dim));
  std::vector<float> w = randn_bf(static_cast<size_t>(dim), 0.1f);
  std::vector<float> s = randn_bf(static_cast<size_t>(rows * dim));
  std::vector<float> y = randn_bf(static_cast<size_t>(rows * dim));
  DeviceBuffer<uint16_t> d_xn(to_bf16(xn)), d_w(to_bf16(w)), d_s(to_bf16(s)), d_y(to_bf16(y));
  shared_expert_gate_launch({d_xn.bf(), d_w.bf(), d_s.bf(), d_y.bf(), rows, dim}, stream_);
  sync();
  std::vector<float> logit(static_cast<size_t>(rows)), ref_y = y;
  cpu::gemm({xn.data(), w.data(), logit.data(), rows, 1, dim});
  cpu::sigmoid_gate({s.data(), logit.data(), ref_y.data(), rows, dim, 1, true, true});
  EXPECT_LT(rel_err(d_y.download(), ref_y), kTolBf16);
}

}  // namespace
}  // namespace tandem::cuda
