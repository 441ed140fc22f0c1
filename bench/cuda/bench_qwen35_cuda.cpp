// Qwen3.5 hybrid MoE on one GPU (Qwen35MoeCuda) from checkpoints on disk, e.g. slices of
// Qwen3.5-35B-A3B / 122B-A10B at real shapes written by the checkpoint tool:
//   make_random_checkpoint --out /tmp/q35 --preset qwen3.5-35b-a3b --layers 4
//   make_random_checkpoint --out /tmp/pair --preset qwen3.5-122b-a10b --layers 2
//       --full-attention-interval 2 --vocab 1024     (one DeltaNet + one attention layer)
//   bench_qwen35_cuda --checkpoint DIR [--checkpoint DIR2 ...] [--quick]
//       [--batches 1,32,128] [--contexts 1024,8192] [--prefill 8192[,2048...]]
//       [--switches default[,base,...]] [--prefill-only] [--decode-only]
//       [--profile-prefill TOKENS] [--profile-decode BATCH] [--fp8-dense-bf16]
//                                                             CSV to $TANDEM_BENCH_CSV
// Several checkpoints run one after the other in one process (one set of ceilings); each row's
// shape names its checkpoint (the directory's last component).
// --switches: decode rows per backend/cuda/decode_switches.h setting: default (the switches'
// defaults), base (every switch off), all (every switch on), each optionally followed by
// "+fork" (the shared expert on a second stream beside the routed experts:
// set_shared_expert_fork) and / or "+fused" (the one-kernel DeltaNet decode step:
// set_fused_deltanet_decode), both on in the model by default and off in a variant without
// them; graphs captured again for each.
// Each number beside its bound measured in the same run (bench_util.h):
//   - decode step (one token for each of B sequences with `ctx` tokens of context, the captured
//     graph, greedy sampling on the device) vs the HBM roofline: (weights touched + KV read +
//     DeltaNet state read and written) / the measured D2D copy bandwidth. Weights touched: all
//     attention / DeltaNet / norm / router / shared-expert weights, lm_head (the B embedding
//     rows read are left out), and per layer the expected distinct experts of B x top_k uniformly
//     routed tokens (E (1 - (1 - k/E)^B)). The B sequences decode B different token ids, so that
//     their routing differs (the same id in every row would route every row to the same experts);
//   - prefill of one T-token prompt (eager, one chunk) as MFU: (2 x active parameters but the
//     lm_head x T + the lm_head's 2 x vocab x hidden for the one logits row + causal attention
//     2 T^2 head_dim q_heads per attention layer + the delta rule's 6 T hv dk dv per DeltaNet
//     layer) over the time, against cuBLASLt's bf16 8192^3 rate.
// --profile-prefill T: after the rows of each checkpoint, one T-token prefill with CUPTI's
// activity records on (when built with CUPTI): per kernel (launches, GPU time, share of the
// busy time), the busy time and the idle gaps, and the kernels in order (the first 400 records).
// --profile-decode B: the same for one decode step of B sequences at the first context (the
// default switches' captured graph, after its warm-up): where a step's time goes, and the gaps
// between its kernels (batch 1 is bound by them, not by bytes).
// --fp8-dense-bf16: a block-FP8 checkpoint's dense linears dequantized to bf16 at load, only the
// routed experts FP8 (CudaModelOptions::fp8_dense false): the comparison for the dense FP8
// linears (the default keeps them FP8).
// The KV and the states hold zeros (the work per step does not depend on their values).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/decode_switches.h"
#include "bench_util.h"
#include "model/cuda/qwen3_5_moe_cuda.h"
#include "model/memory_plan.h"
#ifndef TANDEM_BENCH_CUPTI
#define TANDEM_BENCH_CUPTI 0
#endif
#if TANDEM_BENCH_CUPTI
#include <map>

#include "cupti_kernels.h"
#endif

using namespace tandem;

namespace {

struct Shapes {
  double weights_all = 0;    // bytes of every weight but the routed experts
  double expert_bytes = 0;   // one expert's gate/up/down
  double active_params = 0;  // per token: everything but the experts not picked
  double head_params = 0;    // of which the lm_head (run for the logits rows only)
  int64_t moe_layers = 0, attn_layers = 0, linear_layers = 0;
};

// fp8_dense false (--fp8-dense-bf16): a block-FP8 checkpoint's dense linears counted in bf16.
Shapes shapes_of(const ModelConfig& c, bool fp8_dense) {
  Shapes s;
  const double h = c.hidden_size, d = c.head_dim, qh = c.num_attention_heads,
               kvh = c.num_key_value_heads;
  const double hk = c.linear_num_key_heads, hv = c.linear_num_value_heads,
               dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const double conv = 2 * hk * dk + hv * dv, inter = c.moe_intermediate_size,
               sinter = c.shared_expert_intermediate_size, E = c.num_experts;
  double params = 0;  // per token, without the routed experts
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const bool linear =
        c.layer_types[static_cast<size_t>(l)] == ModelConfig::LayerType::kLinearAttention;
    if (linear) {
      ++s.linear_layers;
      params += (conv + hv * dv + 2 * hv) * h + h * hv * dv + conv * c.linear_conv_kernel_dim;
    } else {
      ++s.attn_layers;
      params += (2 * qh * d + 2 * kvh * d) * h + h * qh * d;
    }
    params += E * h + 3 * sinter * h + h + 2 * h;  // router, shared expert + gate, norms
    ++s.moe_layers;
  }
  const double head = c.vocab_size * h;
  // Bytes as the loader keeps them (model/memory_plan.h: bf16, or block FP8's 1 byte + row
  // scales for the linears an FP8 checkpoint stores F8_E4M3): the dense weights and lm_head
  // read every step, one routed expert's gate / up / down.
  const MemoryPlan plan = plan_memory(c, MemoryPlanOptions{});
  ModelConfig dense_c = c;
  if (!fp8_dense) dense_c.quant = QuantConfig{};
  const MemoryPlan dense_plan = fp8_dense ? plan : plan_memory(dense_c, MemoryPlanOptions{});
  const WeightBytes& w = dense_plan.weights;
  s.weights_all =
      static_cast<double>(w.attention + w.deltanet + w.shared_expert + w.router + w.norms) +
      2 * head;
  s.expert_bytes = static_cast<double>(plan.weights.experts) / E;
  s.active_params = params + head + s.moe_layers * c.num_experts_per_tok * 3 * inter * h;
  s.head_params = head;
  return s;
}

std::vector<int64_t> int_list(const char* arg) {
  std::vector<int64_t> out;
  std::string a = arg;
  for (size_t at = 0; at <= a.size();) {
    const size_t z = std::min(a.find(',', at), a.size());
    if (z > at) out.push_back(std::atoll(a.substr(at, z - at).c_str()));
    at = z + 1;
  }
  return out;
}

std::vector<std::string> str_list(const char* arg) {
  std::vector<std::string> out;
  std::string a = arg;
  for (size_t at = 0; at <= a.size();) {
    const size_t z = std::min(a.find(',', at), a.size());
    if (z > at) out.push_back(a.substr(at, z - at));
    at = z + 1;
  }
  return out;
}

// A --switches entry: default | base | all, then optional "+fork" / "+fused" parts.
struct Variant {
  std::string base;
  bool fork = false, fused = false;
};

Variant parse_variant(const std::string& v) {
  Variant r;
  size_t at = v.find('+');
  r.base = v.substr(0, at);
  while (at != std::string::npos) {
    const size_t z = v.find('+', at + 1);
    const std::string part =
        v.substr(at + 1, z == std::string::npos ? std::string::npos : z - at - 1);
    if (part == "fork") {
      r.fork = true;
    } else if (part == "fused") {
      r.fused = true;
    } else {
      r.base = "?";  // refused by the caller
    }
    at = z;
  }
  return r;
}

std::string base_name(std::string d) {
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const size_t s = d.rfind('/');
  return s == std::string::npos ? d : d.substr(s + 1);
}

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#if TANDEM_BENCH_CUPTI
// The records of one forward: per kernel name, then in order (--profile-prefill).
void print_profile(const std::string& label, const std::string& what, double wall_us,
                   const std::vector<cupti::KernelRec>& recs) {
  const auto [busy, idle] = cupti::busy_idle_us(recs, 1e9);
  std::printf(
      "== profile %s: %s, %zu records, wall %.1f us (CUPTI on), GPU busy %.1f us, idle gaps "
      "%.1f us\n",
      label.c_str(), what.c_str(), recs.size(), wall_us, busy, idle);
  struct Agg {
    int64_t n = 0;
    double us = 0;
  };
  std::map<std::string, Agg> by;
  for (const auto& r : recs) {
    Agg& a = by[cupti::short_name(r.name)];
    ++a.n;
    a.us += 1e-3 * static_cast<double>(r.end - r.start);
  }
  std::vector<std::pair<std::string, Agg>> rows(by.begin(), by.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& z) { return a.second.us > z.second.us; });
  std::printf("   %-48s %6s %11s %10s %7s\n", "kernel", "n", "us", "us/each", "%busy");
  for (const auto& [n, a] : rows) {
    std::printf("   %-48s %6lld %11.1f %10.1f %6.1f%%\n", n.c_str(), static_cast<long long>(a.n),
                a.us, a.us / static_cast<double>(a.n), busy > 0 ? 100.0 * a.us / busy : 0.0);
  }
  std::printf("   in order (kernel, us, gap to the previous end us, grid x block):\n");
  for (size_t i = 0; i < recs.size() && i < 400; ++i) {
    const auto& r = recs[i];
    const double gap =
        i > 0 ? 1e-3 * (static_cast<double>(r.start) - static_cast<double>(recs[i - 1].end)) : 0;
    std::printf("     %3zu %-48s %10.1f %8.1f  %d x %d\n", i, cupti::short_name(r.name).c_str(),
                1e-3 * static_cast<double>(r.end - r.start), gap, r.grid, r.block);
  }
  std::fflush(stdout);
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> dirs, switches = {"default"};
  bool quick = false, prefill_only = false, decode_only = false, fp8_dense = true;
  std::vector<int64_t> prefills, batches, contexts;
  int64_t profile_prefill = 0, profile_decode = 0;
  bool bad = false;
  for (int i = 1; i < argc; ++i) {
    const bool has = i + 1 < argc;
    if (std::strcmp(argv[i], "--checkpoint") == 0 && has) {
      dirs.push_back(argv[++i]);
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--prefill-only") == 0) {
      prefill_only = true;
    } else if (std::strcmp(argv[i], "--decode-only") == 0) {
      decode_only = true;
    } else if (std::strcmp(argv[i], "--fp8-dense-bf16") == 0) {
      fp8_dense = false;
    } else if (std::strcmp(argv[i], "--prefill") == 0 && has) {
      prefills = int_list(argv[++i]);
    } else if (std::strcmp(argv[i], "--batches") == 0 && has) {
      batches = int_list(argv[++i]);
    } else if (std::strcmp(argv[i], "--contexts") == 0 && has) {
      contexts = int_list(argv[++i]);
    } else if (std::strcmp(argv[i], "--switches") == 0 && has) {
      switches = str_list(argv[++i]);
    } else if (std::strcmp(argv[i], "--profile-prefill") == 0 && has) {
      profile_prefill = std::atoll(argv[++i]);
      bad = bad || profile_prefill < 16;
    } else if (std::strcmp(argv[i], "--profile-decode") == 0 && has) {
      profile_decode = std::atoll(argv[++i]);
      bad = bad || profile_decode < 1 || profile_decode > 1024;
    } else {
      bad = true;
    }
  }
  if (prefills.empty()) prefills = {quick ? 2048 : 8192};
  if (batches.empty()) batches = {1, 32, 128};
  if (contexts.empty())
    contexts = quick ? std::vector<int64_t>{1024} : std::vector<int64_t>{1024, 8192};
  for (int64_t v : prefills) bad = bad || v < 16;
  // Decode batches up to 1024: graphs to kMaxGraphBatch (512), eager above (the peers' long row).
  for (int64_t v : batches) bad = bad || v < 1 || v > 1024;
  for (int64_t v : contexts) bad = bad || v < 2;
  for (const std::string& v : switches) {
    const Variant var = parse_variant(v);
    bad = bad || (var.base != "default" && var.base != "base" && var.base != "all");
  }
  if (dirs.empty() || bad) {
    std::printf(
        "usage: bench_qwen35_cuda --checkpoint DIR [--checkpoint DIR ...] [--quick]\n"
        "  [--batches 1,32,128] [--contexts 1024,8192] [--prefill TOKENS[,TOKENS...]]\n"
        "  [--switches default,base,all[+fork][+fused],...] [--prefill-only] [--decode-only]\n"
        "  [--profile-prefill TOKENS] [--profile-decode BATCH] [--fp8-dense-bf16]\n");
    return 2;
  }
  bench::OpBench b;
  b.quick = quick;
  try {
    if (!b.open()) return 2;
    b.measure_ceilings();
    const int64_t page = 16;
    const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end()) + page;
    for (const std::string& dir : dirs) {
      const std::string label = base_name(dir);
      CudaModelOptions o;
      o.max_seqs =
          std::max<int64_t>({8, *std::max_element(batches.begin(), batches.end()), profile_decode});
      o.max_tokens = std::max(
          {*std::max_element(prefills.begin(), prefills.end()), profile_prefill, o.max_seqs});
      o.page_size = page;
      o.graph_max_context = max_ctx;
      o.fp8_dense = fp8_dense;
      const double t_load = now_us();
      std::unique_ptr<Qwen35MoeCuda> model;
      b.guarded("load " + label, [&] { model = Qwen35MoeCuda::load(dir, o); });
      if (!model) continue;
      const ModelConfig& c = model->config();
      const Shapes s = shapes_of(c, fp8_dense);
      std::printf(
          "== %s: %lld layers (%lld DeltaNet, %lld attention), %lld experts top-%lld, "
          "hidden %lld, vocab %lld, %.2f GB of weights, loaded in %.1f s\n",
          dir.c_str(), static_cast<long long>(c.num_hidden_layers),
          static_cast<long long>(s.linear_layers), static_cast<long long>(s.attn_layers),
          static_cast<long long>(c.num_experts), static_cast<long long>(c.num_experts_per_tok),
          static_cast<long long>(c.hidden_size), static_cast<long long>(c.vocab_size),
          model->weight_bytes() / 1e9, (now_us() - t_load) / 1e6);
      std::fflush(stdout);
      const double kv_token_bytes = 2.0 * c.num_key_value_heads * c.head_dim * 2 * s.attn_layers;
      const double state_bytes = 4.0 * model->state_slot_elems();

      // Decode: B sequences at ctx - 1 (pages 0..ctx/page of sequence b at b * pages_per_seq);
      // `body` runs after the graph's capture and warm-up with a function that runs one step.
      auto with_decode = [&](int64_t B, int64_t ctx,
                             const std::function<void(const std::function<void()>&)>& body) {
        const int64_t per_seq = (ctx + page - 1) / page;
        KvCache kv = model->make_kv_cache(B * per_seq + 1, page);
        if (model->state_slot_elems() > 0) kv.allocate_states(B, model->state_slot_elems());
        std::vector<std::vector<int32_t>> tables(static_cast<size_t>(B));
        std::vector<int32_t> tokens(static_cast<size_t>(B));
        for (int64_t i = 0; i < B; ++i) {
          tokens[static_cast<size_t>(i)] = static_cast<int32_t>((1 + i * 7919) % c.vocab_size);
        }
        ForwardBatch fb;
        for (int64_t i = 0; i < B; ++i) {
          auto& t = tables[static_cast<size_t>(i)];
          t.resize(static_cast<size_t>(per_seq));
          std::iota(t.begin(), t.end(), static_cast<int32_t>(i * per_seq));
          fb.seqs.push_back({tokens.data() + i, 1, ctx - 1, t.data(), per_seq, LogitsMode::kLast,
                             static_cast<int32_t>(i)});
        }
        std::vector<DeviceSampling> rows(static_cast<size_t>(B));
        for (auto& r : rows) r.temperature = 0;
        std::vector<SampledToken> out;
        for (int w = 0; w < 3; ++w) model->forward_sample(fb, kv, rows, out);  // capture
        body([&] { model->forward_sample(fb, kv, rows, out); });
      };
      for (const std::string& sw : switches) {
        if (prefill_only) break;
        const Variant var = parse_variant(sw);
        cuda::decode_switches() = var.base == "base"  ? cuda::DecodeSwitches::all_off()
                                  : var.base == "all" ? cuda::DecodeSwitches::all_on()
                                                      : cuda::DecodeSwitches{};
        model->set_shared_expert_fork(var.fork);
        model->set_fused_deltanet_decode(var.fused);
        model->reset_graphs();
        for (int64_t ctx : contexts) {
          for (int64_t B : batches) {
            b.guarded("decode", [&] {
              std::vector<double> us;
              with_decode(B, ctx, [&](const std::function<void()>& step) {
                for (int it = 0; it < (quick ? 10 : 30); ++it) {
                  const double t0 = now_us();
                  step();
                  us.push_back(now_us() - t0);
                }
              });
              const double E = c.num_experts, k = c.num_experts_per_tok;
              const double hit = E * (1 - std::pow(1 - k / E, static_cast<double>(B)));
              const double bytes = s.weights_all + s.moe_layers * hit * s.expert_bytes +
                                   B * ctx * kv_token_bytes + B * 2 * state_bytes;
              b.add("decode_ctx" + std::to_string(ctx), B,
                    label + ": " + std::to_string(B) + " seqs x " + std::to_string(ctx) +
                        " ctx, graph, switches " + sw,
                    bench::median(us), bytes, 0);
            });
          }
        }
      }
      if (profile_decode > 0) {  // the default switches' graph, one step recorded
        b.guarded("profile decode", [&] {
#if TANDEM_BENCH_CUPTI
          cuda::decode_switches() = cuda::DecodeSwitches{};
          model->set_shared_expert_fork(true);
          model->set_fused_deltanet_decode(true);
          model->reset_graphs();
          const int64_t ctx = contexts.front();
          with_decode(profile_decode, ctx, [&](const std::function<void()>& step) {
            cupti::Recorder rec;
            rec.start();
            const double t0 = now_us();
            step();
            const double wall = now_us() - t0;
            print_profile(label,
                          "decode step of " + std::to_string(profile_decode) + " x " +
                              std::to_string(ctx) + " ctx (graph)",
                          wall, rec.stop());
          });
#else
          std::printf("== profile %s: built without CUPTI (CUDA::cupti not found)\n",
                      label.c_str());
#endif
        });
      }
      cuda::decode_switches() = cuda::DecodeSwitches{};
      model->set_shared_expert_fork(false);
      model->set_fused_deltanet_decode(false);
      model->reset_graphs();

      // Prefill: one prompt of T tokens; `body` runs after the warm-up forward (GEMM plans)
      // with a function that runs the forward once more.
      auto with_prefill = [&](int64_t prefill_t,
                              const std::function<void(const std::function<void()>&)>& body) {
        const int64_t pages = (prefill_t + page - 1) / page;
        KvCache kv = model->make_kv_cache(pages + 1, page);
        if (model->state_slot_elems() > 0) kv.allocate_states(1, model->state_slot_elems());
        std::vector<int32_t> table(static_cast<size_t>(pages)),
            tokens(static_cast<size_t>(prefill_t));
        std::iota(table.begin(), table.end(), 0);
        for (int64_t i = 0; i < prefill_t; ++i) {
          tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % c.vocab_size);
        }
        ForwardBatch fb;
        fb.seqs.push_back({tokens.data(), prefill_t, 0, table.data(), pages, LogitsMode::kLast, 0});
        std::vector<DeviceSampling> rows(1);
        rows[0].temperature = 0;
        std::vector<SampledToken> out;
        model->forward_sample(fb, kv, rows, out);  // GEMM plans
        body([&] { model->forward_sample(fb, kv, rows, out); });
      };
      for (int64_t prefill_t : prefills) {
        if (decode_only) break;
        b.guarded("prefill", [&] {
          std::vector<double> us;
          with_prefill(prefill_t, [&](const std::function<void()>& run) {
            for (int it = 0; it < (quick ? 2 : 4); ++it) {
              const double t0 = now_us();
              run();
              us.push_back(now_us() - t0);
            }
          });
          const double T = static_cast<double>(prefill_t);
          const double flops = 2 * (s.active_params - s.head_params) * T + 2 * s.head_params +
                               s.attn_layers * 2.0 * T * T * c.head_dim * c.num_attention_heads +
                               s.linear_layers * 6.0 * T * c.linear_num_value_heads *
                                   c.linear_key_head_dim * c.linear_value_head_dim;
          b.add("prefill", prefill_t, label + ": one prompt, eager (MFU = bound / us)",
                bench::median(us), s.weights_all, flops);
        });
      }
      if (profile_prefill > 0) {
        b.guarded("profile prefill", [&] {
#if TANDEM_BENCH_CUPTI
          with_prefill(profile_prefill, [&](const std::function<void()>& run) {
            cupti::Recorder rec;
            rec.start();
            const double t0 = now_us();
            run();
            const double wall = now_us() - t0;
            print_profile(label, "one " + std::to_string(profile_prefill) + "-token prefill", wall,
                          rec.stop());
          });
#else
          std::printf("== profile %s: built without CUPTI (CUDA::cupti not found)\n",
                      label.c_str());
#endif
        });
      }
    }
  } catch (std::exception const& e) {
    std::printf("FATAL: %s\n", e.what());
    return 1;
  }
  return b.finish();
}
