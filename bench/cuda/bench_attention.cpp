// Paged attention on the GPU at Qwen3 shapes (head_dim 128, page 16, 4 kv heads; 32 q heads of
// Qwen3-30B-A3B, 64 of Qwen3-235B-A22B): the tensor-core prefill and split-KV decode kernels
// behind paged_attention_launch beside the first simple kernel, and for prefill FlashInfer's
// sm90 kernels through PrefillAttentionPlan (attn_prefill_fi_paged: pages read in place;
// attn_prefill_fi_gathered: keys gathered, then TMA) when built, each beside its bound measured
// in the same run: cuBLASLt's own bf16 rate at 8192^3 for prefill (FLOPs = 4 * causal pairs *
// head_dim * q_heads), the device-to-device copy bandwidth (cudaMemcpyAsync, bytes read +
// written) for decode (bytes = the KV read + q + out).
//
//   bench_attention [--quick] [--prefill-only]     CSV to $TANDEM_BENCH_CSV when set
//
// FP8 KV cache (--kv-cache-dtype fp8): attn_decode_fp8 (the tensor-core decode kernel over
// E4M3 pages, widened to fp16 in shared memory; split as attn_decode), attn_decode_fp8_simple
// (the simple kernel dequantizing in registers, as before the tensor-core kernel read FP8) and
// attn_prefill_fi_gathered_fp8 (FlashInfer's gathered prefill, its gather dequantizing) beside
// their bf16 rows, with the time ratio fp8 / bf16 printed; their bytes count 1-byte KV
// elements, so an FP8 row at its bound takes about half the bf16 row's time at long contexts.
// Decode also runs at Qwen3.5-35B-A3B's gated attention (16 q / 2 kv heads, head_dim 256: the
// same tensor-core kernel), bf16 and FP8 pages.
//
// Prefill rows also print TFLOP/s; bench/cuda/attention_torch_baseline.py --ours CSV prints
// PyTorch SDPA (cuDNN, flash) at the same shapes beside them with the ratios.
//
// Method as bench_ops_cuda: random inputs, enough input sets to exceed 3x the L2, warm-up,
// launches captured in a CUDA graph and replayed, median per-call time over replays.
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
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_fa.h"
#include "backend/cuda/attention_sm90.h"
#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "bench_util.h"
#include "core/dtype.h"

using namespace tandem;
using namespace tandem::cuda;

namespace {

constexpr int64_t kPageSize = 16;

using bench::Buf;
using bench::fill_bf16;
using bench::g_rng;
using bench::upload;
using Bench = bench::OpBench;

// ---------------------------------------------------------------- attention
struct Variant {
  std::string name;
  PagedAttentionAlgo algo;
  int64_t num_prefill_tokens, kv_split;
  int prefill_variant = -1;  // >= 0: detail::paged_attention_prefill_variant (block shapes)
  PrefillAttentionPlan* plan = nullptr;  // FlashInfer sm90 (planned before timing)
  bool fp8 = false;                      // E4M3 pool (--kv-cache-dtype fp8)
  std::string vs = "";                   // fp8: the bf16 variant its time ratio is against
};

// Random E4M3 codes (no NaN code), the pattern repeated over the buffer.
void fill_fp8(Buf& b) {
  std::vector<uint8_t> h(std::min<size_t>(b.bytes, size_t{1} << 20));
  std::uniform_int_distribution<int> d(0, 0x7e);
  for (auto& c : h) c = static_cast<uint8_t>(d(g_rng) | ((d(g_rng) & 1) << 7));
  for (size_t off = 0; off < b.bytes; off += h.size()) {
    TANDEM_CUDA_CHECK(cudaMemcpy(b.as<uint8_t>(off), h.data(), std::min(h.size(), b.bytes - off),
                                 cudaMemcpyHostToDevice));
  }
}

// `seqs` sequences of `ctx` cached tokens each, whose last `queries` positions are queried
// (queries == ctx: a fresh causal prefill; 1: decode).
// head_dim 128 over 4 kv heads (Qwen3) unless given (Qwen3.5: 256 over 2).
void bench_attention(Bench& b, int64_t q_heads, int64_t seqs, int64_t ctx, int64_t queries,
                     bool with_simple, int64_t head_dim = 128, int64_t kv_heads = 4) {
  const int64_t T = seqs * queries, pages_per_seq = (ctx + kPageSize - 1) / kPageSize;
  const double page_bytes = 2.0 * kv_heads * kPageSize * head_dim * 2;
  const double kv_bytes = seqs * pages_per_seq * page_bytes;
  const int64_t nq = T * q_heads * head_dim;
  const int sets = b.sets_for(kv_bytes + 4.0 * nq);
  Buf pool(static_cast<size_t>(sets * seqs * pages_per_seq * page_bytes)), q(sets * nq * 2),
      out(sets * nq * 2), table(sets * seqs * pages_per_seq * 4), tseq(T * 4), pos(T * 4);
  fill_bf16(pool);
  fill_bf16(q);
  Buf pool8(pool.bytes / 2);  // the same pages as E4M3 codes
  fill_fp8(pool8);
  std::vector<int32_t> ht(sets * seqs * pages_per_seq), hseq(T), hpos(T);
  std::iota(ht.begin(), ht.end(), 0);
  std::shuffle(ht.begin(), ht.end(), g_rng);
  double pairs = 0;
  for (int64_t t = 0; t < T; ++t) {
    hseq[t] = static_cast<int32_t>(t / queries);
    hpos[t] = static_cast<int32_t>(ctx - queries + t % queries);
    pairs += hpos[t] + 1.0;
  }
  upload(table, ht);
  upload(tseq, hseq);
  upload(pos, hpos);
  const bool prefill = queries > 1;
  const int64_t split =
      prefill ? 0 : paged_attention_decode_split(T, kv_heads, pages_per_seq, kPageSize, b.num_sms);
  const int64_t simple_split =
      prefill ? 0 : paged_attention_pick_split(T, kv_heads, pages_per_seq, kPageSize, b.num_sms);
  std::vector<Variant> variants;
  PrefillAttentionPlan fi_paged(PrefillKvPath::kPaged), fi_gathered(PrefillKvPath::kGathered),
      fi_fp8(PrefillKvPath::kGathered);
  if (prefill) {
    if (head_dim != 128) throw std::runtime_error("prefill rows: head_dim 128 only");
    variants.push_back({"attn_prefill", PagedAttentionAlgo::kAuto, T, 0});
    const PrefillPlanArgs pa{hseq.data(), hpos.data(), T,         q_heads,
                             kv_heads,    head_dim,    kPageSize, pages_per_seq};
    for (auto* pl : {&fi_paged, &fi_gathered}) {
      if (pl->plan(pa, b.stream)) {
        const bool paged = pl == &fi_paged;
        variants.push_back({paged ? "attn_prefill_fi_paged" : "attn_prefill_fi_gathered",
                            PagedAttentionAlgo::kAuto, T, 0, -1, pl});
      } else {
        std::printf("(FlashInfer sm90 prefill not run: %s)\n", pl->why().c_str());
      }
    }
    PrefillPlanArgs pa8 = pa;
    pa8.kv_fp8 = true;
    if (fi_fp8.plan(pa8, b.stream)) {
      variants.push_back({"attn_prefill_fi_gathered_fp8", PagedAttentionAlgo::kAuto, T, 0, -1,
                          &fi_fp8, true, "attn_prefill_fi_gathered"});
    }
    if (with_simple) {
      variants.push_back({"attn_prefill_8w2b", PagedAttentionAlgo::kPrefill, T, 0, 1});
      variants.push_back({"attn_prefill_4w2b", PagedAttentionAlgo::kPrefill, T, 0, 2});
      variants.push_back({"attn_prefill_simple", PagedAttentionAlgo::kSimple, T, 0});
    }
  } else {
    variants.push_back({"attn_decode", PagedAttentionAlgo::kAuto, 0, split});
    variants.push_back(
        {"attn_decode_fp8", PagedAttentionAlgo::kAuto, 0, split, -1, nullptr, true, "attn_decode"});
    if (split) variants.push_back({"attn_decode_nosplit", PagedAttentionAlgo::kAuto, 0, 0});
    if (with_simple) {
      variants.push_back({"attn_decode_simple", PagedAttentionAlgo::kSimple, 0, simple_split});
      variants.push_back({"attn_decode_fp8_simple", PagedAttentionAlgo::kSimple, 0, split, -1,
                          nullptr, true, "attn_decode"});
    }
  }
  const std::string shape =
      std::to_string(q_heads) + "q/" + std::to_string(kv_heads) + "kv" +
      (head_dim != 128 ? " d" + std::to_string(head_dim) : std::string()) + ", " +
      (prefill ? "causal prefill 1 seq x " + std::to_string(ctx)
               : std::to_string(seqs) + " seq x " + std::to_string(ctx) + " ctx");
  std::vector<std::pair<std::string, double>> times;  // bf16 rows' us, for the fp8 ratios
  for (Variant const& v : variants) {
    b.guarded(v.name, [&] {
      Buf ws(paged_attention_workspace_floats(T, q_heads, head_dim, pages_per_seq, kPageSize,
                                              v.kv_split) *
             4);
      const double us = b.time_us(sets, [&](int i) {
        PagedAttentionParams p{q.as<bf16>(i * nq),
                               v.fp8 ? pool8.as<bf16>() : pool.as<bf16>(),
                               table.as<int32_t>(i * seqs * pages_per_seq),
                               tseq.as<int32_t>(),
                               pos.as<int32_t>(),
                               out.as<bf16>(i * nq),
                               T,
                               q_heads,
                               kv_heads,
                               head_dim,
                               kPageSize,
                               pages_per_seq,
                               1.0f / std::sqrt(static_cast<float>(head_dim)),
                               v.kv_split,
                               ws.as<float>()};
        p.num_prefill_tokens = v.num_prefill_tokens;
        p.algo = v.algo;
        p.prefill_plan = v.plan;
        p.kv_fp8 = v.fp8;
        p.k_scale = v.fp8 ? 0.05f : 1.f;
        p.v_scale = v.fp8 ? 0.05f : 1.f;
        if (v.prefill_variant >= 0) {
          cuda::detail::paged_attention_prefill_variant(p, v.prefill_variant, b.stream);
        } else {
          paged_attention_launch(p, b.stream);
        }
      });
      const double kv = v.fp8 ? kv_bytes / 2 : kv_bytes;
      b.add(v.name, T, shape + (prefill ? "" : ", split " + std::to_string(v.kv_split)), us,
            kv + 4.0 * nq, 4.0 * pairs * q_heads * head_dim);
      times.emplace_back(v.name, us);
      for (auto const& [name, base] : times) {
        if (v.fp8 && name == v.vs) {
          std::printf("  %s / %s %lldq d%lld T %lld ctx %lld: %.2fx the time\n", v.name.c_str(),
                      name.c_str(), static_cast<long long>(q_heads),
                      static_cast<long long>(head_dim), static_cast<long long>(T),
                      static_cast<long long>(ctx), us / base);
        }
      }
      if (prefill) {
        std::printf("  %s %lldq T %lld: %.1f TFLOP/s\n", v.name.c_str(),
                    static_cast<long long>(q_heads), static_cast<long long>(T),
                    4.0 * pairs * q_heads * head_dim / (us * 1e-6) / 1e12);
      }
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  bool prefill_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) b.quick = true;
    if (std::strcmp(argv[i], "--prefill-only") == 0) prefill_only = true;
  }
  try {
    if (!b.open()) return 2;
    b.measure_ceilings();
    std::printf("== prefill (Qwen3-30B-A3B 32q/4kv, Qwen3-235B 64q/4kv)\n");
    for (int64_t T : {2048, 8192}) {
      bench_attention(b, 32, 1, T, T, /*with_simple=*/true);
      bench_attention(b, 64, 1, T, T, /*with_simple=*/false);
    }
    if (prefill_only) return b.finish();
    std::printf("== decode (Qwen3-30B-A3B 32q/4kv)\n");
    for (int64_t ctx : {1024, 4096}) {
      for (int64_t seqs : {1, 8, 32, 128, 256}) {
        bench_attention(b, 32, seqs, ctx, 1, /*with_simple=*/seqs <= 128);
      }
    }
    std::printf("== decode (Qwen3-235B-A22B 64q/4kv: GQA 16)\n");
    for (int64_t ctx : {1024, 4096}) {
      for (int64_t seqs : {1, 8, 32, 128, 256}) {
        bench_attention(b, 64, seqs, ctx, 1, /*with_simple=*/seqs <= 8);
      }
    }
    std::printf("== decode (Qwen3.5-35B-A3B gated attention 16q/2kv, head_dim 256)\n");
    for (int64_t ctx : {1024, 4096}) {
      for (int64_t seqs : {1, 32, 128}) {
        bench_attention(b, 16, seqs, ctx, 1, /*with_simple=*/seqs <= 128, 256, 2);
      }
    }
  } catch (std::exception const& e) {
    std::printf("FATAL: %s\n", e.what());
    return 1;
  }

  return b.finish();
}
