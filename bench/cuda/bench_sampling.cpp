// sample_launch (src/backend/cuda/sampling.h) at Qwen3's vocabulary (151936) for 1, 32, 128 and
// 256 rows, beside the bound of reading the logits once at the device-to-device copy bandwidth
// measured in the same run (cudaMemcpyAsync of 1 GiB, bytes read + written).
//
//   bench_sampling [--quick] [--bf16] [--rows R1,R2,...] [--single]
//
// --rows: only these row counts (default 1,32,128,256); --single: the single-CTA paths only.
// Each case runs on two paths: "single" (one CTA per row, no workspace) and "multi" (rows split
// over several CTAs, with a workspace of sample_workspace_bytes).
// Cases: greedy; greedy + chosen logprob + top-20 logprobs; temperature only; top-p 0.9;
// top-k 20 + top-p 0.95 (Qwen3's defaults); min-p 0.05; top-k 50; logits N(0, 2^2) plus 8
// tokens raised by 8 (a peaked head over a flat tail: ~93% of the vocabulary within 20 nats of
// the max, the hard case for a cut). Method as bench_ops_cuda: enough logits sets to exceed 3x
// the L2, warm-up, launches captured in a CUDA graph, median per-call time over replays.
// The CSV (case,rows,path,us,bound_us) goes to $TANDEM_BENCH_CSV when set; the same-run PyTorch
// baseline is bench/cuda/sampling_torch_baseline.py --ours THAT_CSV.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/sampling.h"
#include "bench_util.h"
#include "core/dtype.h"

using namespace tandem;
using namespace tandem::cuda;

namespace {

constexpr int64_t kVocab = 151936;

using bench::Buf;

double copy_bandwidth(bench::Timer& t) {
  const size_t bytes = size_t{1} << 30;
  Buf src(bytes), dst(bytes);
  TANDEM_CUDA_CHECK(cudaMemset(src.ptr, 0x3c, bytes));
  return bench::measure_copy_Bps(t, src, dst, /*warmup=*/3, /*samples=*/10);
}

struct Case {
  const char* name;
  SamplingRowParams p;
};

}  // namespace

int main(int argc, char** argv) {
  bench::Timer t(3.0, 15);  // ~3 ms per replay, 15 replays (5 with --quick)
  bool bf16 = false, single_only = false;
  std::vector<int64_t> row_counts = {1, 32, 128, 256};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) t.quick = true;
    if (!std::strcmp(argv[i], "--bf16")) bf16 = true;
    if (!std::strcmp(argv[i], "--single")) single_only = true;
    if (!std::strcmp(argv[i], "--rows") && i + 1 < argc) {
      row_counts.clear();
      for (char const* c = argv[++i]; *c != 0;) {
        char* end = nullptr;
        const long long r = std::strtoll(c, &end, 10);
        if (end == c || r <= 0) {
          std::fprintf(stderr, "bench_sampling: --rows wants positive counts like 128,256\n");
          return 2;
        }
        row_counts.push_back(r);
        c = *end == ',' ? end + 1 : end;
      }
    }
  }
  try {
    t.create();
    int l2 = 0;
    TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
    const double copy_Bps = copy_bandwidth(t);
    const size_t esize = bf16 ? 2 : 4;
    std::printf(
        "== copy %.0f GB/s (1 GiB cudaMemcpyAsync D2D, read + write); logits %s, vocab %lld\n",
        copy_Bps / 1e9, bf16 ? "bf16" : "fp32", static_cast<long long>(kVocab));
    std::printf("%-22s %6s %-9s %10s %10s %7s %8s\n", "case", "rows", "path", "us", "bound_us",
                "%bound", "GB/s");

    auto mk = [](float temp, int k, float p, int lp, int top) {
      SamplingRowParams r;
      r.temperature = temp;
      r.top_k = k;
      r.top_p = p;
      r.want_logprob = lp;
      r.n_top = top;
      r.seed = 42;
      return r;
    };
    const Case cases[] = {{"greedy", mk(0.f, 0, 1.f, 0, 0)},
                          {"greedy+logprobs20", mk(0.f, 0, 1.f, 1, 20)},
                          {"temperature", mk(1.f, 0, 1.f, 0, 0)},
                          {"top_p0.9", mk(1.f, 0, 0.9f, 0, 0)},
                          {"top_k20+top_p0.95", mk(0.7f, 20, 0.95f, 0, 0)},
                          {"min_p0.05", mk(1.f, 0, 1.f, 0, 0)},
                          {"top_k50", mk(1.f, 50, 1.f, 0, 0)}};
    std::ofstream csv;
    if (const char* path = std::getenv("TANDEM_BENCH_CSV")) {
      csv.open(path);
      csv << "case,rows,path,us,bound_us\n";
    }
    std::mt19937 rng(20261130);
    for (int64_t rows : row_counts) {
      const double set_bytes = static_cast<double>(rows * kVocab * esize);
      const int sets = static_cast<int>(std::clamp(std::ceil(3.0 * l2 / set_bytes), 1.0, 64.0));
      // Logits: N(0, 4) plus 8 tokens per row raised by 8.
      std::vector<float> h(static_cast<size_t>(rows * kVocab));
      std::normal_distribution<float> nd(0.f, 2.f);
      std::uniform_int_distribution<int64_t> pick(0, kVocab - 1);
      for (auto& v : h) v = nd(rng);
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < 8; ++j) h[static_cast<size_t>(r * kVocab + pick(rng))] += 8.f;
      Buf logits(static_cast<size_t>(sets) * rows * kVocab * esize);
      if (bf16) {
        std::vector<uint16_t> b(h.size());
        for (size_t i = 0; i < h.size(); ++i) b[i] = f32_to_bf16(h[i]);
        for (int s = 0; s < sets; ++s)
          TANDEM_CUDA_CHECK(cudaMemcpy(logits.as<uint16_t>(s * rows * kVocab), b.data(),
                                       b.size() * 2, cudaMemcpyHostToDevice));
      } else {
        for (int s = 0; s < sets; ++s)
          TANDEM_CUDA_CHECK(cudaMemcpy(logits.as<float>(s * rows * kVocab), h.data(), h.size() * 4,
                                       cudaMemcpyHostToDevice));
      }
      Buf params(rows * sizeof(SamplingRowParams)), tokens(rows * 4), lp(rows * 4),
          top_ids(rows * kMaxTopLogprobs * 4), top_lp(rows * kMaxTopLogprobs * 4),
          workspace(sample_workspace_bytes(rows, kVocab));
      for (Case const& c : cases) {
        std::vector<SamplingRowParams> hp(static_cast<size_t>(rows), c.p);
        if (!std::strcmp(c.name, "min_p0.05"))
          for (auto& r : hp) r.min_p = 0.05f;
        for (int64_t r = 0; r < rows; ++r) hp[r].counter = static_cast<uint64_t>(r);
        TANDEM_CUDA_CHECK(cudaMemcpy(params.ptr, hp.data(), hp.size() * sizeof(SamplingRowParams),
                                     cudaMemcpyHostToDevice));
        for (int path = 0; path < 2; ++path) {
          const bool multi = path == 1;
          char const* path_name = multi ? "multi" : "single";
          if (multi && single_only) continue;
          const double us = t.time_us(sets, [&](int i) {
            SampleParams p{bf16 ? static_cast<void const*>(logits.as<uint16_t>(i * rows * kVocab))
                                : static_cast<void const*>(logits.as<float>(i * rows * kVocab)),
                           bf16 ? DType::kBF16 : DType::kF32,
                           params.as<SamplingRowParams>(),
                           tokens.as<int32_t>(),
                           lp.as<float>(),
                           top_ids.as<int32_t>(),
                           top_lp.as<float>(),
                           rows,
                           kVocab,
                           multi ? workspace.ptr : nullptr};
            sample_launch(p, t.stream);
          });
          const double bound = 1e6 * set_bytes / copy_Bps;
          std::printf("%-22s %6lld %-9s %10.2f %10.2f %6.1f%% %8.0f\n", c.name,
                      static_cast<long long>(rows), path_name, us, bound, 100.0 * bound / us,
                      set_bytes / (us * 1e-6) / 1e9);
          std::fflush(stdout);
          if (csv.is_open())
            csv << c.name << "," << rows << "," << path_name << "," << us << "," << bound << "\n";
        }
      }
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "bench_sampling: %s\n", e.what());
    return 1;
  }
  return 0;
}
