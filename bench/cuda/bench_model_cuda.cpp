// Whole-model numbers on one GPU at real shapes with random weights (generated on the device:
// a 61 GB Qwen3-30B-A3B checkpoint does not fit the GPU machine's disk beside anything else;
// tools/make_random_checkpoint writes the same shapes to disk when wanted), each beside its
// bound measured in the same run:
//   - decode step time (one token for each of B sequences with `ctx` tokens of context, the
//     captured CUDA graph of the step, fp32 logits left on the device) vs the HBM roofline:
//     (weights touched + KV read) / the measured D2D copy bandwidth. Weights touched: all
//     attention and norm weights, the routers, lm_head, and per MoE layer the expected number
//     of distinct experts hit by B tokens x top_k under uniform routing
//     (E * (1 - (1 - k/E)^B)) times one expert's bytes;
//   - prefill tokens/s for one prompt of T tokens (eager, one chunk), as MFU: model FLOPs
//     (2 x active parameters x T + causal attention 2 x T^2 x head_dim x q_heads per layer)
//     over the time, against cuBLASLt's bf16 8192^3 rate measured in the same run.
// Models: Qwen3-30B-A3B whole (48 layers), and one Qwen3-235B-A22B layer (vocab cut to 1024 so
// the number is the layer's; attention, MoE and norms at real shapes).
//
//   bench_model_cuda [--quick] [--model 30b|235b-layer|all] [--decode-only B] [--checkpoint DIR]
//   --checkpoint DIR: that checkpoint (loaded from disk) instead of the built-in shapes.
//   --prefill-only, --moe-path mma|cublas|padded: prefill alone, with the MoE path forced.
//   CSV to $TANDEM_BENCH_CSV. --decode-only B: just decode at batch B, 1k context (profiling).
//   --fp8: each built-in model twice in the same run, bf16 then block FP8 (the linears E4M3 with
//   128x128 block scales in device memory, backend/cuda/fp8_linear.h; router, norms, embedding
//   and lm_head bf16 as in Qwen's FP8 checkpoints), then FP8's speed-up over bf16 per decode row
//   and its share of the FP8 roofline (the same byte count with the linears at 1 byte / weight).
//   The "-fp8" rows take bf16 activations (W8A16, TANDEM_CUDA_FP8_ACT=0).
//   --fp8-act: (with or without --fp8) a run of the 30B in block FP8 with FP8 activations (W8A8
//   on the FP8 tensor cores, the default for block-FP8 checkpoints), rows "-fp8a". --batches
//   1,32,128: the decode batches to run.
//   --mxfp8: the 30B twice more in MXFP8 (E4M3 + one E8M0 scale per 32 weights), rows "-mxfp8n"
//   (native per-32 scales in the kernels, TANDEM_CUDA_MXFP8=native) and "-mxfp8b" (requantized
//   to 128x128 block FP8 at load, TANDEM_CUDA_MXFP8=block: the block-FP8 kernels and layout).
//   --kv-fp8: (with --fp8-act) one more run of the 30B in block FP8 with FP8 activations and the
//   FP8 KV cache (--kv-cache-dtype fp8, CudaModelOptions::kv_cache_fp8), rows "-fp8a-kv8": the
//   KV bytes of the roofline count 1 byte an element.
//   --no-prefill: decode rows only.
//   --deterministic: each built-in model also in the batch-invariant mode
//   (CudaModelOptions::deterministic, rows "-det") in the same run, then its cost per row
//   (det us / default us).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/gemm.h"
#include "bench_util.h"
#include "core/error.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/cuda/random_fill.h"

using namespace tandem;

namespace {

struct Ceilings {
  double copy_Bps = 0, gemm_flops = 0;
};

// Event timing as bench::event_samples_ms, 3 warm-up calls, the upper median (not the mean of
// the middle two); the GEMM eager (not graph-captured), the buffers filled on the device.
Ceilings measure_ceilings(cudaStream_t s) {
  Ceilings c;
  bench::Timer t;
  t.stream = s;
  t.create_events();
  const size_t bytes = size_t{1} << 30;
  bench::Buf a(bytes), b(bytes);
  cuda::random_fill_bf16(a.ptr, bytes / 2, 1, 0.f, 1.f, s);
  c.copy_Bps = bench::measure_copy_Bps(t, a, b, /*warmup=*/3, /*samples=*/20, bench::upper_median);
  const int64_t n = 8192;
  bench::Buf y(n * n * 2);
  cuda::GemmLt gemm;
  auto run = [&] {
    gemm.run({a.as<cuda::bf16>(), b.as<cuda::bf16>(), y.as<cuda::bf16>(), n, n, n}, s);
  };
  run();
  const double gemm_ms = bench::upper_median(bench::event_samples_ms(s, t.ev0, t.ev1, 3, 10, run));
  c.gemm_flops = 2.0 * n * n * n / (gemm_ms * 1e-3);
  std::printf(
      "== ceilings: copy %.0f GB/s (1 GiB D2D, read + write), cuBLASLt bf16 8192^3 %.1f "
      "TFLOP/s\n",
      c.copy_Bps / 1e9, c.gemm_flops / 1e12);
  return c;
}

ModelConfig qwen3_30b() {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = 48;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 40960;
  return c;
}

ModelConfig qwen3_235b_layer() {
  ModelConfig c = qwen3_30b();
  c.vocab_size = 1024;
  c.hidden_size = 4096;
  c.intermediate_size = 12288;
  c.moe_intermediate_size = 1536;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 4;
  return c;
}

struct Shapes {
  double attn_bytes_layer, expert_bytes, router_bytes_layer, head_bytes, kv_bytes_token_layer;
  double active_params_token;  // for FLOPs: 2 * this per token; the LM head runs for the
                               // logits rows only (one per prompt)
};

Shapes shapes(const ModelConfig& c) {
  Shapes s{};
  const double h = c.hidden_size, d = c.head_dim, qh = c.num_attention_heads,
               kvh = c.num_key_value_heads;
  // Block FP8: one byte per linear weight plus a 4-byte scale per 128 (row scales).
  // MXFP8: one byte per weight plus a 1-byte E8M0 per 32 (native) or the block path's 4 / 128.
  const double wb =
      c.quant.method == WeightQuant::kFp8Block || c.quant.method == WeightQuant::kMxfp8
          ? 1.0 + 4.0 / 128
          : 2.0;
  s.attn_bytes_layer = wb * ((qh + 2 * kvh) * d * h + h * qh * d) + 2.0 * (2 * h + 2 * d);
  s.expert_bytes = wb * 3 * h * c.moe_intermediate_size;
  s.router_bytes_layer = 2.0 * c.num_experts * h;
  s.head_bytes = 2.0 * c.vocab_size * h;
  s.kv_bytes_token_layer = 2.0 * 2 * kvh * d;
  s.active_params_token =
      c.num_hidden_layers * ((qh + 2 * kvh) * d * h + h * qh * d + c.num_experts * h +
                             c.num_experts_per_tok * 3 * h * c.moe_intermediate_size);
  return s;
}

struct Row {
  std::string model, what;
  int64_t batch, ctx;
  double us, bound_us, tokens_per_s;
  std::string note;
};

std::vector<Row> g_rows;
bool g_fp8 = false;         // --fp8
bool g_fp8_act = false;     // --fp8-act: block FP8 with W8A8 (TANDEM_CUDA_FP8_ACT=1)
bool g_mxfp8 = false;       // --mxfp8: MXFP8 native and requantized to blocks
std::string g_moe_path;     // --moe-path
bool g_det = false;         // --deterministic
bool g_det_run = false;     // the model being measured runs in the batch-invariant mode
bool g_kv_fp8 = false;      // --kv-fp8
bool g_kv_fp8_run = false;  // the model being measured keeps an E4M3 KV cache

void print_row(const Row& r, bool record = true) {
  std::printf("%-16s %-8s %6lld %6lld %11.1f %11.1f %7.1f%% %12.0f  %s\n", r.model.c_str(),
              r.what.c_str(), static_cast<long long>(r.batch), static_cast<long long>(r.ctx), r.us,
              r.bound_us, r.us > 0 ? 100.0 * r.bound_us / r.us : 0.0, r.tokens_per_s,
              r.note.c_str());
  std::fflush(stdout);
  if (record) g_rows.push_back(r);
}

void bench_model(const std::string& name, const ModelConfig& config, const Ceilings& ceil,
                 const std::vector<int64_t>& batches, const std::vector<int64_t>& ctxs,
                 const std::vector<int64_t>& prompts, double kv_budget_bytes,
                 const std::string& checkpoint = "") {
  CudaModelOptions o;
  o.max_tokens = 8192;
  o.max_seqs = *std::max_element(batches.begin(), batches.end());
  o.page_size = 16;
  o.graph_max_context = ctxs.empty() ? 1024 : *std::max_element(ctxs.begin(), ctxs.end());
  o.moe_prefill_path = g_moe_path;
  o.deterministic = g_det_run;
  o.kv_cache_fp8 = g_kv_fp8_run;
  std::unique_ptr<Qwen3MoeCuda> model;
  if (checkpoint.empty()) {
    model = Qwen3MoeCuda::random(config, o, 7);
  } else {  // a checkpoint on disk (tools/make_random_checkpoint): mmap -> pinned -> device
    const auto t0 = std::chrono::steady_clock::now();
    model = Qwen3MoeCuda::load(checkpoint, o);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("== loaded %s: %.1f GB in %.1f s (%.2f GB/s, page cache state as found)\n",
                checkpoint.c_str(), model->weight_bytes() / 1e9, s,
                model->weight_bytes() / 1e9 / s);
  }
  const ModelConfig& c = model->config();
  const Shapes s = shapes(c);
  cudaStream_t st = model->stream();
  std::printf("\n== %s: %.1f GB of weights on the device (%lld FP8 linears)\n", name.c_str(),
              model->weight_bytes() / 1e9, static_cast<long long>(model->fp8_linears()));
  // The KV pool for the largest decode configuration that fits the budget (and the prompts).
  const double kv_token = s.kv_bytes_token_layer * c.num_hidden_layers * (g_kv_fp8_run ? 0.5 : 1.0);
  int64_t max_tokens = 0;
  for (int64_t b : batches) {
    for (int64_t x : ctxs) {
      if (b * x * kv_token <= kv_budget_bytes) max_tokens = std::max(max_tokens, b * (x + 16));
    }
  }
  for (int64_t p : prompts) max_tokens = std::max(max_tokens, p + 16);
  const int64_t pages = max_tokens / 16 + 8;
  KvCache kv = model->make_kv_cache(pages, 16);
  // Random KV contents (a zero cache makes attention's softmax trivially uniform).
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (g_kv_fp8_run) {
      cuda::random_fill_fp8(kv.layer_data(l), kv.geometry().page_elems() * pages, 100 + l, st);
    } else {
      cuda::random_fill_bf16(kv.layer_data(l), kv.geometry().page_elems() * pages, 100 + l, 0.f,
                             1.f, st);
    }
  }
  bench::Timer timer;  // events on the model's stream
  timer.stream = st;
  timer.create_events();

  std::printf("%-16s %-8s %6s %6s %11s %11s %8s %12s  %s\n", "model", "phase", "batch", "ctx", "us",
              "bound_us", "%bound", "tokens/s", "note");
  for (int64_t x : ctxs) {
    for (int64_t b : batches) {
      if (b * x * kv_token > kv_budget_bytes) {
        print_row({name, "decode", b, x, 0, 0, 0,
                   "skipped: KV " + std::to_string(static_cast<int64_t>(b * x * kv_token / 1e9)) +
                       " GB exceeds the memory left"});
        continue;
      }
      // B sequences at position x - 1, each with its own pages.
      const int64_t per_seq = (x + 15) / 16;
      std::vector<int32_t> tables(static_cast<size_t>(b * per_seq));
      std::iota(tables.begin(), tables.end(), 0);
      std::vector<int32_t> tokens(static_cast<size_t>(b));
      for (int64_t i = 0; i < b; ++i)
        tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % c.vocab_size);
      ForwardBatch fb;
      for (int64_t i = 0; i < b; ++i) {
        fb.seqs.push_back(
            {tokens.data() + i, 1, x - 1, tables.data() + i * per_seq, per_seq, LogitsMode::kLast});
      }
      for (int w = 0; w < 3; ++w) model->forward_device(fb, kv);  // capture + warm
      const double us =
          1e3 * bench::upper_median(bench::event_samples_ms(
                    st, timer.ev0, timer.ev1, 0, 20, [&] { model->forward_device(fb, kv); }));
      const double E = c.num_experts, k = c.num_experts_per_tok;
      const double touched = E * (1.0 - std::pow(1.0 - k / E, static_cast<double>(b)));
      const double bytes = c.num_hidden_layers * (s.attn_bytes_layer + s.router_bytes_layer +
                                                  touched * s.expert_bytes) +
                           s.head_bytes + static_cast<double>(b) * x * kv_token;
      const double bound = 1e6 * bytes / ceil.copy_Bps;
      char note[192];
      std::snprintf(note, sizeof note, "%.2f GB/step, %.0f experts/layer", bytes / 1e9, touched);
      print_row({name, "decode", b, x, us, bound, b / (us * 1e-6), note});
    }
  }
  for (int64_t T : prompts) {
    std::vector<int32_t> tokens(static_cast<size_t>(T));
    for (int64_t i = 0; i < T; ++i)
      tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 31 + 7) % c.vocab_size);
    const int64_t per_seq = (T + 15) / 16;
    std::vector<int32_t> table(static_cast<size_t>(per_seq));
    std::iota(table.begin(), table.end(), 0);
    ForwardBatch fb;
    fb.seqs.push_back({tokens.data(), T, 0, table.data(), per_seq, LogitsMode::kLast});
    model->forward_device(fb, kv);
    const double us =
        1e3 * bench::upper_median(bench::event_samples_ms(st, timer.ev0, timer.ev1, 0, 3,
                                                          [&] { model->forward_device(fb, kv); }));
    const double flops =
        2.0 * s.active_params_token * T + s.head_bytes /* 1 row: 2 flops/weight */ +
        c.num_hidden_layers * 2.0 * double(T) * T * c.head_dim * c.num_attention_heads;
    const double bound = 1e6 * flops / ceil.gemm_flops;
    char note[192];
    std::snprintf(note, sizeof note,
                  "%.1f TFLOP, %%bound = MFU vs cuBLAS, MoE path %s, routing max/mean %.2f",
                  flops / 1e12, model->last_moe_path().c_str(), model->last_moe_imbalance());
    print_row({name, "prefill", 1, T, us, bound, T / (us * 1e-6), note});
  }
}

// The block-FP8 variant of a config (Qwen's published layout: 128x128 blocks).
ModelConfig fp8_of(ModelConfig c) {
  c.quant.method = WeightQuant::kFp8Block;
  c.quant.block_rows = 128;
  c.quant.block_cols = 128;
  return c;
}

// The MXFP8 variant of a config (ModelOpt's layout: 1x32 E8M0 blocks).
ModelConfig mxfp8_of(ModelConfig c) {
  c.quant.method = WeightQuant::kMxfp8;
  c.quant.block_rows = 1;
  c.quant.block_cols = 32;
  return c;
}

// Each FP8 row beside the bf16 row of the same model, phase, batch and context.
void print_fp8_comparison() {
  std::printf(
      "\n== FP8 vs bf16 (same run): speed-up = bf16 us / FP8 us; %%fp8-roofline = FP8 "
      "bound / FP8 time\n");
  std::printf("%-16s %-8s %6s %6s %11s %11s %9s %13s\n", "model", "phase", "batch", "ctx",
              "bf16 us", "fp8 us", "speed-up", "%fp8-roofline");
  // -fp8a: W8A8 (--fp8-act), -fp8a-kv8 with the FP8 KV cache (--kv-fp8); -mxfp8n / -mxfp8b: MXFP8
  // native / requantized to blocks (--mxfp8).
  for (const char* suffix_c : {"-fp8", "-fp8a", "-fp8a-kv8", "-mxfp8n", "-mxfp8b"}) {
    for (const Row& f : g_rows) {
      const std::string suffix = suffix_c;
      if (f.model.size() <= suffix.size() ||
          f.model.compare(f.model.size() - suffix.size(), suffix.size(), suffix) != 0) {
        continue;
      }
      const std::string base = f.model.substr(0, f.model.size() - suffix.size());
      for (const Row& b : g_rows) {
        if (b.model == base && b.what == f.what && b.batch == f.batch && b.ctx == f.ctx &&
            b.us > 0 && f.us > 0) {
          std::printf("%-16s %-8s %6lld %6lld %11.1f %11.1f %8.2fx %12.1f%%\n",
                      (base + suffix).c_str(), f.what.c_str(), static_cast<long long>(f.batch),
                      static_cast<long long>(f.ctx), b.us, f.us, b.us / f.us,
                      f.what == "decode" ? 100.0 * f.bound_us / f.us : 0.0);
        }
      }
    }
  }
}

// The batch-invariant mode's cost: each "-det" row beside the default row of the same run.
void print_det_comparison() {
  std::printf("\n== --deterministic vs default (same run): cost = det us / default us - 1\n");
  std::printf("%-16s %-8s %6s %6s %11s %11s %8s %12s\n", "model", "phase", "batch", "ctx",
              "default us", "det us", "cost", "det tok/s");
  const std::string suffix = "-det";
  for (const Row& f : g_rows) {
    if (f.model.size() <= suffix.size() ||
        f.model.compare(f.model.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const std::string base = f.model.substr(0, f.model.size() - suffix.size());
    for (const Row& b : g_rows) {
      if (b.model == base && b.what == f.what && b.batch == f.batch && b.ctx == f.ctx && b.us > 0 &&
          f.us > 0) {
        std::printf("%-16s %-8s %6lld %6lld %11.1f %11.1f %7.1f%% %12.0f\n", f.model.c_str(),
                    f.what.c_str(), static_cast<long long>(f.batch), static_cast<long long>(f.ctx),
                    b.us, f.us, 100.0 * (f.us / b.us - 1.0), f.tokens_per_s);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::string which = "all";
  int64_t decode_only = 0;
  std::string checkpoint, moe_path;
  bool prefill_only = false, no_prefill = false;
  std::string batches_arg;  // --batches 1,32,128: the decode batches instead of the defaults
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc) which = argv[++i];
    if (std::strcmp(argv[i], "--decode-only") == 0 && i + 1 < argc)
      decode_only = std::atoll(argv[++i]);
    if (std::strcmp(argv[i], "--checkpoint") == 0 && i + 1 < argc) checkpoint = argv[++i];
    if (std::strcmp(argv[i], "--moe-path") == 0 && i + 1 < argc) moe_path = argv[++i];
    if (std::strcmp(argv[i], "--prefill-only") == 0) prefill_only = true;
    if (std::strcmp(argv[i], "--fp8") == 0) g_fp8 = true;
    if (std::strcmp(argv[i], "--fp8-act") == 0) g_fp8_act = true;
    if (std::strcmp(argv[i], "--mxfp8") == 0) g_mxfp8 = true;
    if (std::strcmp(argv[i], "--no-prefill") == 0) no_prefill = true;
    if (std::strcmp(argv[i], "--kv-fp8") == 0) g_kv_fp8 = true;
    if (std::strcmp(argv[i], "--deterministic") == 0) g_det = true;
    if (std::strcmp(argv[i], "--batches") == 0 && i + 1 < argc) batches_arg = argv[++i];
  }
  try {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      std::printf("no CUDA device: nothing to measure\n");
      return 0;
    }
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreate(&s));
    const Ceilings ceil = measure_ceilings(s);
    size_t free_b = 0, total_b = 0;
    TANDEM_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    std::vector<int64_t> batches =
        quick ? std::vector<int64_t>{1, 32} : std::vector<int64_t>{1, 8, 32, 128, 256};
    std::vector<int64_t> ctxs =
        quick ? std::vector<int64_t>{1024} : std::vector<int64_t>{1024, 4096};
    std::vector<int64_t> prompts =
        quick ? std::vector<int64_t>{2048} : std::vector<int64_t>{2048, 8192};
    if (!batches_arg.empty()) {
      batches.clear();
      for (size_t p = 0; p < batches_arg.size();) {
        const size_t comma = std::min(batches_arg.find(',', p), batches_arg.size());
        batches.push_back(std::atoll(batches_arg.substr(p, comma - p).c_str()));
        p = comma + 1;
      }
    }
    if (prefill_only) {
      batches = {1};
      ctxs = {};
    }
    if (no_prefill) prompts = {};
    if (decode_only > 0) {
      batches = {decode_only};
      ctxs = {1024};
      prompts = {};
    }
    g_moe_path = moe_path;
    if (!checkpoint.empty()) {
      bench_model(checkpoint, ModelConfig{}, ceil, batches, ctxs, prompts, 40e9, checkpoint);
      which = "none";
    }
    if (which == "all" || which == "30b") {
      // KV budget: what is left after the weights (61 GB) and ~8 GB of activations / logits.
      const ModelConfig c = qwen3_30b();
      const double budget = static_cast<double>(free_b) - 61.1e9 - 10e9;
      bench_model("qwen3-30b-a3b", c, ceil, batches, ctxs, prompts, budget);
      if (g_det) {
        g_det_run = true;
        bench_model("qwen3-30b-a3b-det", c, ceil, batches, ctxs, prompts, budget);
        g_det_run = false;
      }
      if (g_fp8) {  // W8A16: bf16 activations (read at construction; W8A8 is the default)
        setenv("TANDEM_CUDA_FP8_ACT", "0", 1);
        bench_model("qwen3-30b-a3b-fp8", fp8_of(c), ceil, batches, ctxs, prompts, budget);
        unsetenv("TANDEM_CUDA_FP8_ACT");
      }
      if (g_fp8_act) {  // W8A8: the FP8 activations of Qwen3MoeCuda (read at construction)
        setenv("TANDEM_CUDA_FP8_ACT", "1", 1);
        bench_model("qwen3-30b-a3b-fp8a", fp8_of(c), ceil, batches, ctxs, prompts, budget);
        if (g_kv_fp8) {
          g_kv_fp8_run = true;
          bench_model("qwen3-30b-a3b-fp8a-kv8", fp8_of(c), ceil, batches, ctxs, prompts, budget);
          g_kv_fp8_run = false;
        }
        unsetenv("TANDEM_CUDA_FP8_ACT");
      }
      if (g_mxfp8) {  // both MXFP8 paths (read at construction)
        setenv("TANDEM_CUDA_MXFP8", "native", 1);
        bench_model("qwen3-30b-a3b-mxfp8n", mxfp8_of(c), ceil, batches, ctxs, prompts, budget);
        setenv("TANDEM_CUDA_MXFP8", "block", 1);
        bench_model("qwen3-30b-a3b-mxfp8b", mxfp8_of(c), ceil, batches, ctxs, prompts, budget);
        unsetenv("TANDEM_CUDA_MXFP8");
      }
    }
    if (which == "all" || which == "235b-layer") {
      bench_model("qwen3-235b-layer", qwen3_235b_layer(), ceil, batches, ctxs, prompts, 40e9);
      if (g_det) {
        g_det_run = true;
        bench_model("qwen3-235b-layer-det", qwen3_235b_layer(), ceil, batches, ctxs, prompts, 40e9);
        g_det_run = false;
      }
      if (g_fp8) {
        bench_model("qwen3-235b-layer-fp8", fp8_of(qwen3_235b_layer()), ceil, batches, ctxs,
                    prompts, 40e9);
      }
    }
    if (g_fp8 || g_fp8_act || g_mxfp8) print_fp8_comparison();
    if (g_det) print_det_comparison();
    std::printf("\n== summary (decode %%bound = roofline / time; prefill %%bound = MFU)\n");
    for (const auto& r : g_rows) print_row(r, /*record=*/false);
    bench::write_csv(g_rows, "model,phase,batch,ctx,us,bound_us,tokens_per_s,note\n",
                     [](std::ofstream& f, Row const& r) {
                       f << r.model << "," << r.what << "," << r.batch << "," << r.ctx << ","
                         << r.us << "," << r.bound_us << "," << r.tokens_per_s << ",\"" << r.note
                         << "\"\n";
                     });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_model_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
