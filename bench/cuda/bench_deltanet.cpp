// Qwen3.5 DeltaNet layer ops at Qwen3.5-35B-A3B shapes (16 k / 32 v heads of 128, conv over
// 8192 channels, kernel 4): the causal conv1d and the gated delta rule for a decode step of
// 1, 32 and 128 sequences (each with a 64 KiB fp32 state per value head: 4 MiB per sequence,
// read and written once) and for one prefill sequence of 1024 / 8192 tokens; beside the bound
// measured in the same run (bench_util.h: bytes / device copy bandwidth, flops / cuBLASLt bf16
// rate). Prefill runs as the chunked tensor-core form (gated_delta_rule, what the model uses;
// also its first one / two kernels alone, gdr_chunked_prep / gdr_chunked_prep_wy, so that the
// sequence-order state kernel's time is the difference) and the per-token recurrence
// (gated_delta_rule_seq); the FLOP bound of both is the
// rule's minimum, 6 dk dv per token and value head (the chunked form does about 2x that on
// tensor cores: K K^T, Q K^T, the WY products, W S, Q S, P U, K^T U).
// bench/cuda/deltanet_torch_baseline.py times flash-linear-attention's Triton kernel and
// transformers' torch chunked reference at the same shapes.
//
//   bench_deltanet [--quick] [--verify]   CSV to $TANDEM_BENCH_CSV when set
// --verify: the decode and speculative verify shapes only (B sequences x 2 / 4 tokens).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/deltanet.h"
#include "bench_util.h"

using namespace tandem;
using namespace tandem::cuda;

namespace {

constexpr int64_t kHk = 16, kHv = 32, kDk = 128, kDv = 128, kKernel = 4;
constexpr int64_t kConv = 2 * kHk * kDk + kHv * kDv;    // 8192
constexpr int64_t kProj = kConv + kHv * kDv + 2 * kHv;  // qkv | z | b | a

using bench::Buf;
using bench::fill_bf16;
using Bench = bench::OpBench;

// One batch: `seqs` sequences of `len` tokens each, slots 0..seqs-1, none fresh.
struct Seqs {
  Buf begin, token_seq, slot, fresh;
  int64_t n;
  Seqs(int64_t seqs, int64_t len)
      : begin((seqs + 1) * 4), token_seq(seqs * len * 4), slot(seqs * 4), fresh(seqs * 4), n(seqs) {
    std::vector<int32_t> b(seqs + 1), ts(seqs * len), sl(seqs), fr(seqs, 0);
    for (int64_t s = 0; s <= seqs; ++s) b[s] = static_cast<int32_t>(s * len);
    for (int64_t t = 0; t < seqs * len; ++t) ts[t] = static_cast<int32_t>(t / len);
    std::iota(sl.begin(), sl.end(), 0);
    bench::upload(begin, b);
    bench::upload(token_seq, ts);
    bench::upload(slot, sl);
    bench::upload(fresh, fr);
  }
  DeltaNetSeqs view() const {
    return {begin.as<int32_t>(), token_seq.as<int32_t>(), slot.as<int32_t>(), fresh.as<int32_t>(),
            n};
  }
};

void bench_case(Bench& b, int64_t seqs, int64_t len) {
  const int64_t T = seqs * len;
  const std::string shape = std::to_string(seqs) + " seq x " + std::to_string(len) + " tok";
  Seqs sq(seqs, len);
  Buf proj(T * kProj * 2), conv_out(T * kConv * 2), out(T * kHv * kDv * 4);
  fill_bf16(proj);
  const int64_t conv_state = kConv * (kKernel - 1), rec_state = kHv * kDk * kDv;
  Buf states(seqs * (conv_state + rec_state) * 4);
  TANDEM_CUDA_CHECK(cudaMemset(states.ptr, 0, states.bytes));
  Buf w(kConv * kKernel * 2), a_log(kHv * 4), dt(kHv * 4);
  fill_bf16(w, 0.5f);
  TANDEM_CUDA_CHECK(cudaMemset(a_log.ptr, 0, a_log.bytes));
  TANDEM_CUDA_CHECK(cudaMemset(dt.ptr, 0, dt.bytes));
  Buf ws(gated_delta_rule_workspace_floats(T, kHk, kHv, kDk, kDv) * 4);
  const int64_t slot_stride = conv_state + rec_state;

  b.guarded("causal_conv1d", [&] {
    CausalConv1dParams p{
        proj.as<bf16>(), w.as<bf16>(), states.as<float>(), conv_out.as<bf16>(), sq.view(), T, kConv,
        kKernel,         kProj,        slot_stride};
    const double us = b.time_us(1, [&](int) { causal_conv1d_launch(p, b.stream); });
    // x read, out written, the window read and written.
    const double bytes = T * kConv * 2.0 * 2 + seqs * conv_state * 4.0 * 2;
    b.add("causal_conv1d", T, shape, us, bytes, 2.0 * T * kConv * kKernel);
  });
  // Prefill: the chunked form, its first kernels alone (stages 1: q / k norm + gates, 2: + the
  // per-chunk WY kernel; the sequence-order state kernel is the difference to the whole), the
  // per-token recurrence.
  // Decode: also the opt-in one-kernel step (gdr_decode_fused: fused_decode). Prefill: also the
  // WY kernel's first shared-memory layout (_wywide: wide_wy, 2 blocks per SM, vs 4) and the
  // state kernel in each of its shapes (gdr_stateN: state_variant N; the default picks by grid),
  // the opt-in prep (_prep4: prep_heads4), and the WY kernel without its substitution
  // (gdr_chunked_prep_wy_nosub: wy_probe_no_substitution, wrong results, its cost only) or with
  // the opt-in blockwise inverse (_blkinv: wy_blocked_inverse). Verify shapes: also the short
  // chunks' default form (gdr_short_block: the decode step's blocks; gated_delta_rule_seq is the
  // one-warp recurrence they took before).
  struct Variant {
    const char* name;
    bool sequential;
    int stages;
    bool fused = false;
    bool wide = false;
    int state_variant = 0;
    bool prep4 = false;
    bool nosub = false;
    bool blkinv = false;
    bool short_block = false;  // the model's pick for short chunks (the decode step's blocks)
  };
  const Variant variants[] = {
      {"gated_delta_rule", false, 3},
      {"gdr_decode_fused", false, 3, true},
      {"gdr_chunked_prep", false, 1},
      {"gdr_chunked_prep_wy", false, 2},
      {"gdr_chunked_prep_wywide", false, 2, false, true},
      {"gated_delta_rule_wywide", false, 3, false, true},
      {"gdr_state1", false, 3, false, false, 1},
      {"gdr_state2", false, 3, false, false, 2},
      {"gated_delta_rule_prep4", false, 3, false, false, 0, true},
      {"gdr_chunked_prep4", false, 1, false, false, 0, true},
      {"gdr_chunked_prep_wy_nosub", false, 2, false, false, 0, false, true},
      {"gdr_chunked_prep_wy_blkinv", false, 2, false, false, 0, false, false, true},
      {"gated_delta_rule_blkinv", false, 3, false, false, 0, false, false, true},
      {"gated_delta_rule_seq", true, 3},
      {"gdr_short_block", false, 3, false, false, 0, false, false, false, true}};
  for (const Variant& var : variants) {
    if (len == 1 && (var.sequential || var.stages < 3)) continue;  // decode: no stages
    if (len > 1 && var.fused) continue;                            // a decode kernel
    if (var.short_block && (len == 1 || len > GatedDeltaRuleParams{}.short_chunk_tokens)) continue;
    if (len == 1 && (var.wide || var.state_variant != 0 || var.prep4 || var.nosub || var.blkinv)) {
      continue;  // prefill rows
    }
    const bool sequential = var.sequential;
    const char* name = var.name;
    b.guarded(name, [&] {
      GatedDeltaRuleParams p{};
      p.qkv = conv_out.as<bf16>();
      p.b = proj.as<bf16>() + kConv + kHv * kDv;
      p.a = p.b + kHv;
      p.a_log = a_log.as<float>();
      p.dt_bias = dt.as<float>();
      p.states = states.as<float>() + conv_state;
      p.out = out.as<float>();
      p.workspace = ws.as<float>();
      p.seqs = sq.view();
      p.num_tokens = T;
      p.num_k_heads = kHk;
      p.num_v_heads = kHv;
      p.k_dim = kDk;
      p.v_dim = kDv;
      p.qkv_stride = kConv;
      p.ab_stride = kProj;
      p.state_stride = slot_stride;
      p.sequential = sequential;
      // each row the form it names (the model's default picks by length)
      p.short_chunk_tokens = var.short_block ? GatedDeltaRuleParams{}.short_chunk_tokens : 0;
      p.stages = var.stages;
      p.fused_decode = var.fused;
      p.wide_wy = var.wide;
      p.state_variant = var.state_variant;
      p.prep_heads4 = var.prep4;
      p.wy_probe_no_substitution = var.nosub;
      p.wy_blocked_inverse = var.blkinv;
      const double us = b.time_us(1, [&](int) { gated_delta_rule_launch(p, b.stream); });
      // qkv read, out written (fp32), the state read and written once per sequence.
      const double bytes = T * kConv * 2.0 + T * kHv * kDv * 4.0 + seqs * rec_state * 4.0 * 2;
      // Per token and value head: decay, S^T k, the rank-1 update, S^T q: ~6 dk dv flops (the
      // chunked form does about the same on tensor cores).
      if (var.stages < 3) {  // a part of the op: no bound of its own
        b.add(name, T, shape + " (part)", us, 0, 0);
        return;
      }
      b.add(name, T, shape, us, bytes, 6.0 * T * kHv * kDk * kDv);
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  bool verify_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) b.quick = true;
    if (std::strcmp(argv[i], "--verify") == 0) verify_only = true;
  }
  try {
    if (!b.open()) return 2;
    b.measure_ceilings();
    for (int64_t seqs : {1, 32, 128}) bench_case(b, seqs, 1);  // decode steps
    int occ[4] = {};
    gated_delta_rule_occupancy(kDv, occ);
    std::printf(
        "== resident blocks per SM: chunk_wy %d (wide layout %d), chunk_state shape 1 %d, "
        "shape 2 %d\n",
        occ[0], occ[1], occ[2], occ[3]);
    // Speculative verify steps: K + 1 = 2 / 4 tokens per sequence (the chunked form pads each
    // sequence's tokens to a chunk; the per-token recurrence does not), beside the decode rows.
    for (int64_t seqs : {1, 32, 128}) bench_case(b, seqs, 4);
    bench_case(b, 32, 2);
    if (verify_only) return b.finish();
    bench_case(b, 1, 1024);
    if (!b.quick) {
      bench_case(b, 1, 8192);
      bench_case(b, 8, 1024);
    }
  } catch (std::exception const& e) {
    std::printf("FATAL: %s\n", e.what());
    return 1;
  }
  return b.finish();
}
