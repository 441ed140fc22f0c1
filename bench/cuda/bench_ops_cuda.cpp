// Per-kernel timings of the CUDA backend ops at Qwen3-30B-A3B shapes (hidden 2048, 32 q / 4 kv
// heads, head_dim 128, 128 experts top-8, expert width 768) for 1, 32, 128 and 8192 tokens,
// each beside its bound measured in the same run: the device-to-device copy bandwidth
// (cudaMemcpyAsync, bytes read + written) for memory-bound ops, and cuBLASLt's own bf16 rate
// at 8192^3 for the GEMMs. bound = max(bytes / copy bandwidth, flops / GEMM rate).
//
//   bench_ops_cuda [--quick] [--gemv]   CSV to $TANDEM_BENCH_CSV when set
//   (--gemv: the ceilings and the small-m GEMM section only)
//
// Method: inputs are random (never zeros); each op rotates among enough input/output sets to
// exceed 3x the L2 (a set larger than that is used alone); warm-up launches first; the
// launches are captured in a CUDA graph and replayed, per-call time = replay time / launches,
// median over replays. Decode attention: one query per sequence, 4096-token context each;
// at 8192 tokens it is one causal prefill sequence (CUDA cores, so far below the GEMM bound).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/gemv.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/norm.h"
#include "bench_util.h"
#include "core/dtype.h"

using namespace tandem;
using namespace tandem::cuda;

namespace {

// Qwen3-30B-A3B.
constexpr int64_t kHidden = 2048, kQHeads = 32, kKvHeads = 4, kHeadDim = 128;
constexpr int64_t kExperts = 128, kTopK = 8, kInter = 768, kVocab = 151936;
constexpr int64_t kPageSize = 16, kDecodeContext = 4096;

using bench::Buf;
using bench::fill_bf16;
using bench::g_rng;
using bench::upload;
using Bench = bench::OpBench;

// ---------------------------------------------------------------- ops
void bench_tokens(Bench& b, int64_t T) {
  const int64_t H = kHidden;
  std::string hs = "hidden " + std::to_string(H);

  b.guarded("embedding", [&] {
    Buf table(kVocab * H * 2);
    fill_bf16(table);
    const int sets = b.sets_for(2.0 * T * H * 2);
    Buf ids(sets * T * 4), out(sets * T * H * 2);
    std::vector<int32_t> h(sets * T);
    for (auto& v : h) v = std::uniform_int_distribution<int32_t>(0, kVocab - 1)(g_rng);
    upload(ids, h);
    double us = b.time_us(sets, [&](int i) {
      embedding_launch(
          {ids.as<int32_t>(i * T), table.as<bf16>(), out.as<bf16>(i * T * H), T, H, kVocab},
          b.stream);
    });
    b.add("embedding", T, "vocab 151936, " + hs, us, 2.0 * T * H * 2, 0);
  });

  b.guarded("rms_norm", [&] {
    const int sets = b.sets_for(2.0 * T * H * 2);
    Buf x(sets * T * H * 2), out(sets * T * H * 2), w(H * 2);
    fill_bf16(x, 3.0f);
    fill_bf16(w);
    double us = b.time_us(sets, [&](int i) {
      rms_norm_launch({x.as<bf16>(i * T * H), w.as<bf16>(), out.as<bf16>(i * T * H), T, H, 1e-6f},
                      b.stream);
    });
    b.add("rms_norm", T, hs, us, 2.0 * T * H * 2 + H * 2, 0);
  });

  b.guarded("add_rms_norm", [&] {
    const int sets = b.sets_for(3.0 * T * H * 2);
    Buf res(sets * T * H * 2), x(sets * T * H * 2), out(sets * T * H * 2), w(H * 2);
    fill_bf16(res, 3.0f);
    fill_bf16(x, 0.01f);
    fill_bf16(w);
    double us = b.time_us(sets, [&](int i) {
      add_rms_norm_launch({res.as<bf16>(i * T * H), x.as<bf16>(i * T * H), w.as<bf16>(),
                           out.as<bf16>(i * T * H), T, H, 1e-6f},
                          b.stream);
    });
    b.add("add_rms_norm", T, hs, us, 4.0 * T * H * 2 + H * 2, 0);
  });

  b.guarded("qk_norm_rope", [&] {
    const int64_t nq = T * kQHeads * kHeadDim, nk = T * kKvHeads * kHeadDim;
    const int sets = b.sets_for((nq + nk) * 2.0);
    Buf q(sets * nq * 2), k(sets * nk * 2), qw(kHeadDim * 2), kw(kHeadDim * 2), pos(T * 4);
    fill_bf16(q);
    fill_bf16(k);
    fill_bf16(qw);
    fill_bf16(kw);
    std::vector<int32_t> hp(T);
    std::iota(hp.begin(), hp.end(), 100);
    upload(pos, hp);
    double us = b.time_us(sets, [&](int i) {
      qk_norm_rope_launch({q.as<bf16>(i * nq), k.as<bf16>(i * nk), qw.as<bf16>(), kw.as<bf16>(),
                           pos.as<int32_t>(), T, kQHeads, kKvHeads, kHeadDim, 1e-6f, 1e6},
                          b.stream);
    });
    b.add("qk_norm_rope", T, "32 q + 4 kv heads x 128, in place", us, 2.0 * (nq + nk) * 2, 0);
  });

  b.guarded("kv_write", [&] {
    const int64_t n = T * kKvHeads * kHeadDim;
    const int sets = b.sets_for(4.0 * n * 2);
    const int64_t slots_per_set = (T + kPageSize - 1) / kPageSize * kPageSize;
    const int64_t pages = sets * slots_per_set / kPageSize;
    Buf k(sets * n * 2), v(sets * n * 2), pool(pages * 2 * kKvHeads * kPageSize * kHeadDim * 2),
        slots(sets * T * 8);
    fill_bf16(k);
    fill_bf16(v);
    std::vector<int64_t> hs_(sets * T);
    for (int s = 0; s < sets; ++s) {
      std::vector<int64_t> perm(slots_per_set);
      std::iota(perm.begin(), perm.end(), s * slots_per_set);
      std::shuffle(perm.begin(), perm.end(), g_rng);
      std::copy(perm.begin(), perm.begin() + T, hs_.begin() + s * T);
    }
    upload(slots, hs_);
    double us = b.time_us(sets, [&](int i) {
      kv_write_launch({k.as<bf16>(i * n), v.as<bf16>(i * n), pool.as<bf16>(),
                       slots.as<int64_t>(i * T), T, kKvHeads, kHeadDim, kPageSize},
                      b.stream);
    });
    b.add("kv_write", T, "4 kv heads x 128, page 16", us, 4.0 * n * 2 + T * 8, 0);
  });

  b.guarded("topk_softmax", [&] {
    const int sets = b.sets_for(T * kExperts * 2.0);
    Buf logits(sets * T * kExperts * 2), ids(sets * T * kTopK * 4), w(sets * T * kTopK * 4);
    fill_bf16(logits, 4.0f);
    double us = b.time_us(sets, [&](int i) {
      topk_softmax_launch({logits.as<bf16>(i * T * kExperts), ids.as<int32_t>(i * T * kTopK),
                           w.as<float>(i * T * kTopK), T, kExperts, kTopK, true, DType::kBF16},
                          b.stream);
    });
    b.add("topk_softmax", T, "128 experts, top 8, renorm", us, T * kExperts * 2.0 + T * kTopK * 8.0,
          0);
  });

  b.guarded("silu_mul", [&] {
    const int64_t R = T * kTopK;
    const int sets = b.sets_for(R * 3.0 * kInter * 2);
    Buf gu(sets * R * 2 * kInter * 2), out(sets * R * kInter * 2);
    fill_bf16(gu, 3.0f);
    double us = b.time_us(sets, [&](int i) {
      silu_mul_launch({gu.as<bf16>(i * R * 2 * kInter), out.as<bf16>(i * R * kInter), R, kInter},
                      b.stream);
    });
    b.add("silu_mul", T, "rows T*8, inter 768", us, R * 3.0 * kInter * 2, 0);
  });

  // Routing shared by permute / unpermute: top-8 distinct experts per token, uniform.
  std::vector<int32_t> route(T * kTopK);
  {
    std::vector<int32_t> all(kExperts);
    std::iota(all.begin(), all.end(), 0);
    for (int64_t t = 0; t < T; ++t) {
      std::shuffle(all.begin(), all.end(), g_rng);
      std::copy(all.begin(), all.begin() + kTopK, route.begin() + t * kTopK);
    }
  }
  const int64_t S = T * kTopK;
  b.guarded("moe_permute", [&] {
    const int sets = b.sets_for((T + S) * H * 2.0);
    const size_t ws_elems = moe_permute_workspace_elems(T, kTopK, kExperts);
    Buf x(sets * T * H * 2), px(sets * S * H * 2), ids(T * kTopK * 4), counts(kExperts * 4),
        offsets((kExperts + 1) * 4), src(S * 4), slot_row(S * 4), ws(ws_elems * 4);
    fill_bf16(x);
    upload(ids, route);
    double us = b.time_us(sets, [&](int i) {
      moe_permute_launch({x.as<bf16>(i * T * H), ids.as<int32_t>(), px.as<bf16>(i * S * H),
                          counts.as<int32_t>(), offsets.as<int32_t>(), src.as<int32_t>(),
                          slot_row.as<int32_t>(), ws.as<int32_t>(), T, H, kTopK, 0, kExperts},
                         b.stream);
    });
    b.add("moe_permute", T, "128 experts, top 8, " + hs, us, (T + S) * H * 2.0 + S * 12.0, 0);
  });

  b.guarded("moe_unpermute", [&] {
    const int sets = b.sets_for((T + S) * H * 2.0);
    Buf y(sets * S * H * 2), out(sets * T * H * 2), ids(S * 4), w(S * 4), slot_row(S * 4);
    fill_bf16(y);
    upload(ids, route);
    std::vector<float> hw(S, 0.125f);
    upload(w, hw);
    std::vector<int32_t> rows(S);
    std::iota(rows.begin(), rows.end(), 0);
    std::shuffle(rows.begin(), rows.end(), g_rng);
    upload(slot_row, rows);
    double us = b.time_us(sets, [&](int i) {
      moe_unpermute_launch(
          {y.as<bf16>(i * S * H), ids.as<int32_t>(), w.as<float>(), slot_row.as<int32_t>(),
           out.as<bf16>(i * T * H), T, H, kTopK, DType::kBF16},
          b.stream);
    });
    b.add("moe_unpermute", T, "top 8, " + hs + ", bf16 out", us, (T + S) * H * 2.0 + S * 12.0, 0);
  });

  struct G {
    const char* name;
    int64_t m, n, k;
  };
  GemmLt gemm;
  for (G g : {G{"gemm_qkv", T, (kQHeads + 2 * kKvHeads) * kHeadDim, H},
              G{"gemm_o_proj", T, H, kQHeads * kHeadDim}, G{"gemm_router", T, kExperts, H},
              G{"gemm_expert_gate_up", std::max<int64_t>(1, S / kExperts), 2 * kInter, H}}) {
    b.guarded(g.name, [&] {
      const double set_bytes = (g.m * g.k + g.n * g.k + g.m * g.n) * 2.0;
      const int sets = b.sets_for(set_bytes);
      Buf x(sets * g.m * g.k * 2), w(sets * g.n * g.k * 2), y(sets * g.m * g.n * 2);
      fill_bf16(x);
      fill_bf16(w, 0.05f);
      double us = b.time_us(sets, [&](int i) {
        gemm.run({x.as<bf16>(i * g.m * g.k), w.as<bf16>(i * g.n * g.k), y.as<bf16>(i * g.m * g.n),
                  g.m, g.n, g.k},
                 b.stream);
      });
      b.add(g.name, T, std::to_string(g.m) + "x" + std::to_string(g.n) + "x" + std::to_string(g.k),
            us, set_bytes, 2.0 * g.m * g.n * g.k);
    });
  }

  b.guarded("paged_attention", [&] {
    const bool prefill = T > 1024;
    const int64_t seqs = prefill ? 1 : T, ctx = prefill ? T : kDecodeContext;
    const int64_t pages_per_seq = (ctx + kPageSize - 1) / kPageSize;
    const double page_bytes = 2.0 * kKvHeads * kPageSize * kHeadDim * 2;
    const double kv_bytes = seqs * pages_per_seq * page_bytes;
    const int sets = prefill ? 1 : b.sets_for(kv_bytes);
    const int64_t pages = sets * seqs * pages_per_seq;
    Buf pool(static_cast<size_t>(pages * page_bytes)), q(sets * T * kQHeads * kHeadDim * 2),
        out(sets * T * kQHeads * kHeadDim * 2), table(sets * seqs * pages_per_seq * 4), tseq(T * 4),
        pos(T * 4);
    fill_bf16(pool);
    fill_bf16(q);
    std::vector<int32_t> ht(sets * seqs * pages_per_seq), hseq(T), hpos(T);
    std::iota(ht.begin(), ht.end(), 0);
    std::shuffle(ht.begin(), ht.end(), g_rng);
    for (int64_t t = 0; t < T; ++t) {
      hseq[t] = prefill ? 0 : static_cast<int32_t>(t);
      hpos[t] = prefill ? static_cast<int32_t>(t) : static_cast<int32_t>(ctx - 1);
    }
    upload(table, ht);
    upload(tseq, hseq);
    upload(pos, hpos);
    const int64_t nq = T * kQHeads * kHeadDim;
    const double pairs = prefill ? 0.5 * T * (T + 1) : double(T) * ctx;
    // Without split, then (decode only) with the split paged_attention_pick_split chooses.
    const int64_t split =
        prefill ? 0 : paged_attention_pick_split(T, kKvHeads, pages_per_seq, kPageSize, b.num_sms);
    for (int64_t kv_split : {int64_t{0}, split}) {
      Buf ws(paged_attention_workspace_floats(T, kQHeads, kHeadDim, pages_per_seq, kPageSize,
                                              kv_split) *
             4);
      double us = b.time_us(sets, [&](int i) {
        PagedAttentionParams p{q.as<bf16>(i * nq),
                               pool.as<bf16>(),
                               table.as<int32_t>(i * seqs * pages_per_seq),
                               tseq.as<int32_t>(),
                               pos.as<int32_t>(),
                               out.as<bf16>(i * nq),
                               T,
                               kQHeads,
                               kKvHeads,
                               kHeadDim,
                               kPageSize,
                               pages_per_seq,
                               0.0883883f,
                               kv_split,
                               ws.as<float>()};
        paged_attention_launch(p, b.stream);
      });
      std::string shape = prefill
                              ? "causal prefill, 1 seq x 8192"
                              : "decode, 4096 ctx/seq, GQA 8, split " + std::to_string(kv_split);
      b.add(kv_split ? "paged_attention_split" : "paged_attention", T, shape, us,
            kv_bytes + 2.0 * nq * 2, 4.0 * pairs * kQHeads * kHeadDim);
      if (split == 0) break;
    }
  });
}

// ---------------------------------------------------------------- small-m GEMM
// The decode GEMMs at m = 1 and 8: the gemv kernel alone, GemmLt with cuBLASLt only (tuned),
// and GemmLt as built (tuned with gemv as one more candidate; the winner in the shape column).
// bytes = W + x + y: the weights dominate, so the bound is ~ weight bytes / copy bandwidth.
void bench_small_m(Bench& b) {
  struct G {
    const char* name;
    int64_t n, k;
    bool f32;
  };
  for (int64_t m : {1, 8}) {
    for (G g : {G{"qkv", (kQHeads + 2 * kKvHeads) * kHeadDim, kHidden, false},
                G{"o_proj", kHidden, kQHeads * kHeadDim, false},
                G{"router", kExperts, kHidden, true}, G{"lm_head", kVocab, kHidden, true}}) {
      const std::string shape = std::to_string(m) + "x" + std::to_string(g.n) + "x" +
                                std::to_string(g.k) + (g.f32 ? " fp32 out" : "");
      const double ysz = g.f32 ? 4.0 : 2.0;
      const double set_bytes = (m * g.k + g.n * g.k) * 2.0 + m * g.n * ysz;
      const double flops = 2.0 * m * g.n * g.k;
      const int sets = b.sets_for(set_bytes);
      Buf x(sets * m * g.k * 2), w(sets * g.n * g.k * 2),
          y(static_cast<size_t>(sets * m * g.n * ysz));
      fill_bf16(x);
      fill_bf16(w, 0.05f);
      auto params = [&](int i) {
        GemmParams p{x.as<bf16>(i * m * g.k), w.as<bf16>(i * g.n * g.k), nullptr, m, g.n, g.k};
        if (g.f32) {
          p.y_f32 = y.as<float>(i * m * g.n);
        } else {
          p.y = y.as<bf16>(i * m * g.n);
        }
        return p;
      };
      b.guarded(std::string("gemv_") + g.name, [&] {
        double us = b.time_us(sets, [&](int i) {
          GemmParams p = params(i);
          gemv_launch({p.x, p.w, p.y, p.m, p.n, p.k, p.alpha, p.y_f32}, b.stream);
        });
        b.add(std::string("gemv_") + g.name, m, shape, us, set_bytes, flops);
      });
      b.guarded(std::string("gemm_cublas_") + g.name, [&] {
        GemmLt gemm;
        gemm.set_gemv_enabled(false);
        double us = b.time_us(sets, [&](int i) { gemm.run(params(i), b.stream); });
        b.add(std::string("gemm_cublas_") + g.name, m, shape, us, set_bytes, flops);
      });
      b.guarded(std::string("gemm_tuned_") + g.name, [&] {
        GemmLt gemm;
        double us = b.time_us(sets, [&](int i) { gemm.run(params(i), b.stream); });
        b.add(std::string("gemm_tuned_") + g.name, m,
              shape + (gemm.num_gemv_plans() ? " (gemv)" : " (cublas)"), us, set_bytes, flops);
      });
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  bool gemv_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) b.quick = true;
    if (std::strcmp(argv[i], "--gemv") == 0) gemv_only = true;
  }
  try {
    if (!b.open()) return 2;
    b.measure_ceilings();
    for (int64_t T : {1, 32, 128, 8192}) {
      if (gemv_only) break;
      std::printf("== %lld tokens\n", static_cast<long long>(T));
      bench_tokens(b, T);
    }
    std::printf("== small-m GEMM (gemv kernel, GemmLt cuBLAS only, GemmLt tuned)\n");
    bench_small_m(b);
  } catch (std::exception const& e) {
    std::printf("FATAL: %s\n", e.what());
    return 1;
  }

  // The table last.
  return b.finish();
}
