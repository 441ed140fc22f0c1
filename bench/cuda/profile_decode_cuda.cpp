// Where a decode step's time goes, kernel by kernel (issue 15 item 1): nsys is not on the GPU
// image, so this records the kernels of the captured decode graph itself through CUPTI's
// activity API (linked from the CUDA toolkit; carried with the binaries where the image lacks
// it). Qwen3-30B-A3B shapes with random weights, B sequences at `ctx` tokens of context, as
// bench_model_cuda's decode rows.
//
//   profile_decode_cuda [--batch B ...] [--ctx N] [--layers L] [--steps S] [--variants V,...]
//       [--fp8 | --fp8-w8a16]
//
// --fp8: the linears and experts in block FP8 (128x128 scales) with FP8 activations, the
// default of a block-FP8 checkpoint; --fp8-w8a16: with bf16 activations. The roofline then counts
// one byte a weight (issue 29: batch-1 FP8 at 0.84x of bf16 while its bytes are half).
//
// Variants (same process, same model; each captures its own graphs): base = every switch of
// backend/cuda/decode_switches.h off (the kernels before issue 15 item 1), default = the
// switches' defaults, all = all on, or parts joined by '+' (pdl, gemvpdl, routerpdl, moe1,
// moe8). Default: base,default.
// Prints, per batch: the step time of the graph replay without CUPTI (events, upper median of 20)
// beside its HBM roofline (bytes touched / measured D2D copy bandwidth, bench_model_cuda's
// count); then S replays with CUPTI on, and per kernel kind (role in the layer, from the
// kernel's name and its order in the layer): launches per step, GPU time per step, bytes it must
// move, achieved GB/s and its share of the step; the busy time (union of kernel intervals) and
// the idle time between kernels; and one middle layer's kernels in order with their gaps.
// Kernel times under PDL include the time a dependent kernel waits for its predecessor
// (griddepcontrol.wait), so the busy union, not the sum, is the step's GPU time.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_switches.h"
#include "bench_util.h"
#include "core/error.h"
#include "cupti_kernels.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/cuda/random_fill.h"

using namespace tandem;

namespace {

using cupti::KernelRec;
using cupti::short_name;

ModelConfig qwen3_30b(int64_t layers) {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = layers;
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

// The kernel's role in the step and the bytes it must move (weights + activations + KV at
// batch b), from its name and its order: linears in layer order are qkv, o; the grouped expert
// GEMMs gate_up, down; the step's last GEMM is the LM head.
struct Roles {
  const ModelConfig& c;
  int64_t b, ctx;
  double experts_touched;
  double w = 2;  // bytes per weight of the linears and experts (1: block FP8; scales left out)
  double bytes(const std::string& role) const {
    const double h = c.hidden_size, d = c.head_dim, qh = c.num_attention_heads,
                 kvh = c.num_key_value_heads, I = c.moe_intermediate_size, E = c.num_experts,
                 k = c.num_experts_per_tok, B = static_cast<double>(b);
    if (role == "qkv_linear") return w * (qh + 2 * kvh) * d * h + 2 * B * (h + (qh + 2 * kvh) * d);
    if (role == "o_linear") return w * h * qh * d + 2 * B * (h + qh * d);
    if (role == "norm") return 2 * h + 2 * B * h * 4;
    if (role == "qkv_prep") return 2 * B * (qh + 2 * kvh) * d * 2 + 4 * d;
    if (role == "attention") return 2.0 * 2 * kvh * d * B * ctx + 2 * B * 2 * qh * d;
    if (role == "router") return 2 * E * h + 2 * B * h;
    if (role == "expert_gate_up") return experts_touched * w * 2 * I * h + 2 * B * k * (h + I);
    if (role == "expert_down") return experts_touched * w * h * I + 2 * B * k * (h + I);
    if (role == "act_quant") return 2 * B * h + B * h;
    if (role == "unpermute") return 2 * B * k * h + 2 * B * h;
    if (role == "lm_head") return 2 * c.vocab_size * h + 4 * B * c.vocab_size;
    return 0;
  }
};

std::string role_of(const std::string& n, int& linear_in_layer, int& moe_gemm_in_layer) {
  auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
  if (has("rms_norm")) {
    linear_in_layer = 0;  // a layer (or the final norm) starts
    moe_gemm_in_layer = 0;
    return "norm";
  }
  if (has("embedding")) return "embedding/gather";
  if (has("qkv_prep") || has("qk_norm_rope") || has("kv_write")) return "qkv_prep";
  if (has("decode_router") || has("topk")) return "router";
  if (has("merge")) return "attention_merge";
  if (n == "decode_kernel" || has("attention") || n == "prefill_kernel") return "attention";
  if (has("unpermute")) return "unpermute";
  if (has("quantize") || has("quant_act")) return "act_quant";  // FP8 activations (W8A8)
  if (n == "gate_up_kernel") return "expert_gate_up";
  if (n == "down_kernel") return "expert_down";
  if (has("moe_gemm")) return moe_gemm_in_layer++ == 0 ? "expert_gate_up" : "expert_down";
  if (has("[mem")) return n;
  if (has("splitKreduce") || has("reduce")) return "gemm_reduce";
  // Anything else is a dense linear (our gemv or a cuBLAS kernel).
  return linear_in_layer++ == 0 ? "qkv_linear" : "o_linear";
}

// Returns the graph step time (us, without CUPTI) and its roofline (us).
std::pair<double, double> profile(Qwen3MoeCuda* model, KvCache& kv, int64_t b, int64_t x, int steps,
                                  double copy_Bps) {
  const ModelConfig& c = model->config();
  cudaStream_t st = model->stream();
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
  for (int w = 0; w < 3; ++w) model->forward_device(fb, kv);
  bench::Timer timer;
  timer.stream = st;
  timer.create_events();
  const double us =
      1e3 * bench::upper_median(bench::event_samples_ms(st, timer.ev0, timer.ev1, 0, 20,
                                                        [&] { model->forward_device(fb, kv); }));
  const double E = c.num_experts, k = c.num_experts_per_tok;
  const double touched = E * (1.0 - std::pow(1.0 - k / E, static_cast<double>(b)));
  const double w = c.quant.method == WeightQuant::kFp8Block ? 1.0 : 2.0;
  Roles roles{c, b, x, touched, w};
  // bench_model_cuda's count: attention and norm weights, router, the touched experts, the
  // LM head and the KV read.
  const double h = c.hidden_size, d = c.head_dim, qh = c.num_attention_heads,
               kvh = c.num_key_value_heads, L = static_cast<double>(c.num_hidden_layers);
  const double attn_layer = w * ((qh + 2 * kvh) * d * h + h * qh * d) + 2.0 * (2 * h + 2 * d);
  const double step_bytes =
      L * (attn_layer + 2.0 * E * h + touched * 3 * w * h * c.moe_intermediate_size) +
      2.0 * c.vocab_size * h + 2.0 * 2 * kvh * d * static_cast<double>(b) * x * L;
  const double bound_us = 1e6 * step_bytes / copy_Bps;
  std::printf(
      "\n== batch %lld, ctx %lld, %lld layers: graph step %.1f us (%.0f tok/s); roofline %.1f us "
      "(%.3f GB/step, %.1f experts/layer) = %.1f%%\n",
      static_cast<long long>(b), static_cast<long long>(x),
      static_cast<long long>(c.num_hidden_layers), us, b / (us * 1e-6), bound_us, step_bytes / 1e9,
      touched, 100.0 * bound_us / us);

  // CUPTI over `steps` replays (each synchronised, so steps do not overlap).
  cupti::Recorder recorder;
  recorder.start();
  std::vector<double> wall;
  for (int i = 0; i < steps; ++i) {
    TANDEM_CUDA_CHECK(cudaEventRecord(timer.ev0, st));
    model->forward_device(fb, kv);
    TANDEM_CUDA_CHECK(cudaEventRecord(timer.ev1, st));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(timer.ev1));
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, timer.ev0, timer.ev1));
    wall.push_back(1e3 * ms);
  }
  const std::vector<KernelRec> recs = recorder.stop();
  // Split into steps at gaps > 20 us after the host-side metadata copy (each step starts with
  // the H2D metadata copies, then the graph).
  const size_t per_step = recs.size() / static_cast<size_t>(steps);
  std::printf("   %zu records over %d steps (%zu per step); wall with CUPTI on: %.1f us/step\n",
              recs.size(), steps, per_step, bench::upper_median(wall));
  // Per role and per kernel name, over all steps.
  struct Agg {
    int64_t count = 0;
    double us = 0;
    std::string kernels;
  };
  std::map<std::string, Agg> by_role;
  std::map<std::string, Agg> by_name;
  int lin = 0, mg = 0;
  std::vector<std::string> rec_role(recs.size());
  for (size_t i = 0; i < recs.size(); ++i) {
    const KernelRec& r = recs[i];
    const std::string sn = short_name(r.name);
    std::string role = role_of(sn, lin, mg);
    // The last linear of a step (after the final norm) is the LM head.
    rec_role[i] = role;
    const double d = 1e-3 * static_cast<double>(r.end - r.start);
    by_name[sn].count++;
    by_name[sn].us += d;
  }
  // LM head: the linear right after the gather of the logits rows (the step's second
  // embedding-kernel launch; the first, the token embedding, is followed by a norm).
  for (size_t i = 1; i < recs.size(); ++i) {
    if (rec_role[i - 1] == "embedding/gather" &&
        (rec_role[i] == "qkv_linear" || rec_role[i] == "o_linear")) {
      rec_role[i] = "lm_head";
    }
  }
  for (size_t i = 0; i < recs.size(); ++i) {
    Agg& a = by_role[rec_role[i]];
    a.count++;
    a.us += 1e-3 * static_cast<double>(recs[i].end - recs[i].start);
    const std::string sn = short_name(recs[i].name);
    if (a.kernels.find(sn) == std::string::npos && a.kernels.size() < 90)
      a.kernels += (a.kernels.empty() ? "" : ",") + sn;
  }
  // Busy time: union of the intervals; idle = the gaps inside each step.
  const auto [busy, idle] = cupti::busy_idle_us(recs, 30);  // gaps < 30 us: inside a step
  const double S = steps;
  std::printf("   busy (union of kernels) %.1f us/step, idle gaps inside the step %.1f us/step\n",
              busy / S, idle / S);
  std::printf("   %-18s %7s %10s %9s %10s %9s %7s  %s\n", "role", "n/step", "us/step", "us/each",
              "MB/step", "GB/s", "%step", "kernels");
  double total = 0;
  for (const auto& [role, a] : by_role) total += a.us / S;
  std::vector<std::pair<std::string, Agg>> rows(by_role.begin(), by_role.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& p, const auto& q) { return p.second.us > q.second.us; });
  for (const auto& [role, a] : rows) {
    const double n = a.count / S, t = a.us / S;
    const double mb = roles.bytes(role) * n / 1e6;
    std::printf("   %-18s %7.1f %10.1f %9.2f %10.2f %9.0f %6.1f%%  %s\n", role.c_str(), n, t, t / n,
                mb, mb > 0 ? mb * 1e6 / (t * 1e-6) / 1e9 : 0.0, 100.0 * t / us, a.kernels.c_str());
  }
  std::printf("   sum of kernel times %.1f us/step (PDL waits included)\n", total);
  std::printf("   %-48s %7s %10s\n", "kernel", "n/step", "us/step");
  std::vector<std::pair<std::string, Agg>> names(by_name.begin(), by_name.end());
  std::sort(names.begin(), names.end(),
            [](const auto& p, const auto& q) { return p.second.us > q.second.us; });
  for (const auto& [n, a] : names)
    std::printf("   %-48s %7.1f %10.1f\n", n.c_str(), a.count / S, a.us / S);
  // One middle layer of the last step, in order: start offset, duration, gap, grid x block.
  const size_t last0 = recs.size() - per_step;
  int norms = 0;
  const int want = static_cast<int>(c.num_hidden_layers / 2) * 2 + 1;  // the layer's input norm
  std::printf(
      "   one layer of the last step (kernel, us, gap to the previous end, grid x block):\n");
  for (size_t i = last0; i < recs.size(); ++i) {
    if (rec_role[i] == "norm") ++norms;
    if (norms > want + 1) break;
    if (norms < want) continue;
    const KernelRec& r = recs[i];
    const double gap =
        i > 0 ? 1e-3 * (static_cast<double>(r.start) - static_cast<double>(recs[i - 1].end)) : 0;
    std::printf("     %-16s %-44s %7.2f %7.2f  %d x %d\n", rec_role[i].c_str(),
                short_name(r.name).c_str(), 1e-3 * static_cast<double>(r.end - r.start), gap,
                r.grid, r.block);
  }
  return {us, bound_us};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> batches;
  int64_t ctx = 1024, layers = 48;
  int steps = 10;
  std::vector<std::string> variants = {"base", "default"};
  std::string fp8;  // "": bf16; "w8a8" / "w8a16": block FP8 with FP8 / bf16 activations
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--fp8") == 0) fp8 = "w8a8";
    if (std::strcmp(argv[i], "--fp8-w8a16") == 0) fp8 = "w8a16";
    if (std::strcmp(argv[i], "--batch") == 0 && i + 1 < argc)
      batches.push_back(std::atoll(argv[++i]));
    if (std::strcmp(argv[i], "--ctx") == 0 && i + 1 < argc) ctx = std::atoll(argv[++i]);
    if (std::strcmp(argv[i], "--layers") == 0 && i + 1 < argc) layers = std::atoll(argv[++i]);
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--variants") == 0 && i + 1 < argc) {
      variants.clear();
      std::string list = argv[++i];
      for (size_t a = 0; a <= list.size();) {
        const size_t z = std::min(list.find(',', a), list.size());
        if (z > a) variants.push_back(list.substr(a, z - a));
        a = z + 1;
      }
    }
  }
  if (batches.empty()) batches = {1, 8};
  try {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      std::printf("no CUDA device: nothing to measure\n");
      return 0;
    }
    cupti::register_callbacks();
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreate(&s));
    bench::Timer t;
    t.stream = s;
    t.create_events();
    double copy_Bps = 0;
    {
      const size_t bytes = size_t{1} << 30;
      bench::Buf a(bytes), b(bytes);
      cuda::random_fill_bf16(a.ptr, bytes / 2, 1, 0.f, 1.f, s);
      copy_Bps = bench::measure_copy_Bps(t, a, b, 3, 20, bench::upper_median);
    }
    std::printf("== copy %.0f GB/s (1 GiB D2D, read + write)\n", copy_Bps / 1e9);
    ModelConfig c = qwen3_30b(layers);
    if (!fp8.empty()) {  // Qwen's published block-FP8 layout; activations read at construction
      c.quant.method = WeightQuant::kFp8Block;
      c.quant.block_rows = 128;
      c.quant.block_cols = 128;
      setenv("TANDEM_CUDA_FP8_ACT", fp8 == "w8a8" ? "1" : "0", 1);
      std::printf("== block FP8 weights, %s\n",
                  fp8 == "w8a8" ? "FP8 activations (W8A8)" : "bf16 activations (W8A16)");
    }
    const int64_t max_b = *std::max_element(batches.begin(), batches.end());
    CudaModelOptions o;
    o.max_tokens = 2048;
    o.max_seqs = std::max<int64_t>(max_b, 1);
    o.page_size = 16;
    o.graph_max_context = ctx;
    auto model = Qwen3MoeCuda::random(c, o, 7);
    const int64_t pages = max_b * ((ctx + 15) / 16) + 8;
    // One KV cache per variant, all alive (a new cache address makes the model capture its
    // graphs again, with the variant's kernels), the same random contents in each.
    std::vector<KvCache> caches;
    struct Result {
      std::string variant;
      int64_t batch;
      double us, bound_us;
    };
    std::vector<Result> results;
    for (const std::string& v : variants) {
      cuda::DecodeSwitches sw = cuda::DecodeSwitches::all_off();
      // Names: base, default (the switches' defaults), all, or '+'-joined parts of pdl
      // (gemv_pdl, router_pdl, pdl_trigger), moe1 / moe8 (moe_gemv up to 1 / 8 tokens).
      if (v == "default") {
        sw = cuda::DecodeSwitches{};
      } else if (v == "all") {
        sw = cuda::DecodeSwitches::all_on();
      } else if (v != "base") {
        for (size_t a = 0; a <= v.size();) {
          const size_t z = std::min(v.find('+', a), v.size());
          const std::string part = v.substr(a, z - a);
          if (part == "pdl") {
            sw.gemv_pdl = sw.router_pdl = sw.pdl_trigger = true;
          } else if (part == "gemvpdl") {
            sw.gemv_pdl = sw.pdl_trigger = true;
          } else if (part == "routerpdl") {
            sw.router_pdl = true;
          } else if (part == "moe1" || part == "moe8") {
            sw.moe_gemv = true;
            sw.moe_gemv_max_tokens = part == "moe1" ? 1 : 8;
          } else {
            TANDEM_THROW(kInvalidArgument, "profile_decode_cuda: unknown variant part '", part,
                         "' (base, default, all, pdl, gemvpdl, routerpdl, moe1, moe8)");
          }
          a = z + 1;
        }
      }
      cuda::decode_switches() = sw;
      caches.push_back(model->make_kv_cache(pages, 16));
      KvCache& kv = caches.back();
      // Random KV contents (a zero cache makes attention's softmax trivially uniform).
      for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        cuda::random_fill_bf16(kv.layer_data(l), kv.geometry().page_elems() * pages, 100 + l, 0.f,
                               1.f, model->stream());
      }
      std::printf("\n==== variant %s\n", v.c_str());
      for (int64_t b : batches) {
        const auto [us, bound] = profile(model.get(), kv, b, ctx, steps, copy_Bps);
        results.push_back({v, b, us, bound});
      }
    }
    std::printf("\n== summary (graph step, no CUPTI; %%roofline = roofline / step)\n");
    std::printf("%-22s %6s %10s %10s %9s %10s\n", "variant", "batch", "step us", "roofline",
                "%roof", "tok/s");
    for (const Result& r : results) {
      std::printf("%-22s %6lld %10.1f %10.1f %8.1f%% %10.0f\n", r.variant.c_str(),
                  static_cast<long long>(r.batch), r.us, r.bound_us, 100.0 * r.bound_us / r.us,
                  r.batch / (r.us * 1e-6));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "profile_decode_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
