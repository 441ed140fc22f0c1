// Qwen3.5 hybrid MoE on one GPU (Qwen35MoeCuda) from a checkpoint on disk, e.g. a slice of
// Qwen3.5-35B-A3B at real shapes written by the checkpoint tool:
//   make_random_checkpoint --out /tmp/q35 --preset qwen3.5-35b-a3b --layers 4
//   bench_qwen35_cuda --checkpoint /tmp/q35 [--quick] [--prefill TOKENS] [--prefill-only]
//                                                              CSV to $TANDEM_BENCH_CSV
// A/B: TANDEM_PREFILL_ATTENTION=fa2 (our FA2 kernel instead of FlashInfer's sm90 prefill),
// TANDEM_DELTA_RULE=sequential (the per-token delta rule instead of the chunked one).
// Each number beside its bound measured in the same run (bench_util.h):
//   - decode step (one token for each of B sequences with `ctx` tokens of context, the captured
//     graph, greedy sampling on the device) vs the HBM roofline: (weights touched + KV read +
//     DeltaNet state read and written) / the measured D2D copy bandwidth. Weights touched: all
//     attention / DeltaNet / norm / router / shared-expert weights, lm_head, and per layer the
//     expected distinct experts of B x top_k uniformly routed tokens (E (1 - (1 - k/E)^B));
//   - prefill of one T-token prompt (eager, one chunk) as MFU: (2 x active parameters x T +
//     causal attention 2 T^2 head_dim q_heads per attention layer + the delta rule's
//     6 T hv dk dv per DeltaNet layer) over the time, against cuBLASLt's bf16 8192^3 rate.
// The KV and the states hold zeros (the work per step does not depend on their values).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "backend/cuda/check.h"
#include "bench_util.h"
#include "model/cuda/qwen3_5_moe_cuda.h"

using namespace tandem;

namespace {

struct Shapes {
  double weights_all = 0;    // bytes of every weight but the routed experts
  double expert_bytes = 0;   // one expert's gate/up/down
  double active_params = 0;  // per token: everything but the experts not picked
  int64_t moe_layers = 0, attn_layers = 0, linear_layers = 0;
};

Shapes shapes_of(const ModelConfig& c) {
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
  s.weights_all = 2 * (params + head);
  s.expert_bytes = 2 * 3 * inter * h;
  s.active_params = params + head + s.moe_layers * c.num_experts_per_tok * 3 * inter * h;
  return s;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  bool quick = false, prefill_only = false;
  int64_t prefill_arg = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--checkpoint") == 0 && i + 1 < argc) dir = argv[++i];
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--prefill-only") == 0) prefill_only = true;
    if (std::strcmp(argv[i], "--prefill") == 0 && i + 1 < argc) prefill_arg = std::atoll(argv[++i]);
  }
  if (dir.empty() || (prefill_arg != 0 && prefill_arg < 16)) {
    std::printf(
        "usage: bench_qwen35_cuda --checkpoint DIR [--quick] [--prefill TOKENS] "
        "[--prefill-only]\n");
    return 2;
  }
  bench::OpBench b;
  b.quick = quick;
  try {
    if (!b.open()) return 2;
    b.measure_ceilings();
    const int64_t prefill_t = prefill_arg > 0 ? prefill_arg : (quick ? 2048 : 8192);
    const std::vector<int64_t> batches = {1, 32, 128};
    const std::vector<int64_t> contexts =
        quick ? std::vector<int64_t>{1024} : std::vector<int64_t>{1024, 8192};
    const int64_t page = 16, max_ctx = 8192 + page;
    CudaModelOptions o;
    o.max_tokens = prefill_t;
    o.max_seqs = 128;
    o.page_size = page;
    o.graph_max_context = max_ctx;
    auto model = Qwen35MoeCuda::load(dir, o);
    const ModelConfig& c = model->config();
    const Shapes s = shapes_of(c);
    std::printf("== %s: %lld layers (%lld DeltaNet, %lld attention), %.2f GB of weights\n",
                dir.c_str(), static_cast<long long>(c.num_hidden_layers),
                static_cast<long long>(s.linear_layers), static_cast<long long>(s.attn_layers),
                model->weight_bytes() / 1e9);
    const double kv_token_bytes = 2.0 * c.num_key_value_heads * c.head_dim * 2 * s.attn_layers;
    const double state_bytes = 4.0 * model->state_slot_elems();

    // Decode: B sequences at ctx - 1 (pages 0..ctx/page of sequence b at b * pages_per_seq).
    for (int64_t ctx : contexts) {
      if (prefill_only) break;
      for (int64_t B : batches) {
        b.guarded("decode", [&] {
          const int64_t per_seq = (ctx + page - 1) / page;
          KvCache kv = model->make_kv_cache(B * per_seq + 1, page);
          kv.allocate_states(B, model->state_slot_elems());
          std::vector<std::vector<int32_t>> tables(static_cast<size_t>(B));
          std::vector<int32_t> tokens(static_cast<size_t>(B), 1);
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
          std::vector<double> us;
          for (int it = 0; it < (quick ? 10 : 30); ++it) {
            const double t0 = now_us();
            model->forward_sample(fb, kv, rows, out);
            us.push_back(now_us() - t0);
          }
          const double E = c.num_experts, k = c.num_experts_per_tok;
          const double hit = E * (1 - std::pow(1 - k / E, static_cast<double>(B)));
          const double bytes = s.weights_all + s.moe_layers * hit * s.expert_bytes +
                               B * ctx * kv_token_bytes + B * 2 * state_bytes;
          b.add("decode_ctx" + std::to_string(ctx), B,
                std::to_string(B) + " seqs x " + std::to_string(ctx) + " ctx (graph)",
                bench::median(us), bytes, 0);
        });
      }
    }

    // Prefill: one prompt of prefill_t tokens.
    b.guarded("prefill", [&] {
      const int64_t pages = (prefill_t + page - 1) / page;
      KvCache kv = model->make_kv_cache(pages + 1, page);
      kv.allocate_states(1, model->state_slot_elems());
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
      std::vector<double> us;
      for (int it = 0; it < (quick ? 2 : 4); ++it) {
        const double t0 = now_us();
        model->forward_sample(fb, kv, rows, out);
        us.push_back(now_us() - t0);
      }
      const double T = static_cast<double>(prefill_t);
      const double flops = 2 * s.active_params * T +
                           s.attn_layers * 2.0 * T * T * c.head_dim * c.num_attention_heads +
                           s.linear_layers * 6.0 * T * c.linear_num_value_heads *
                               c.linear_key_head_dim * c.linear_value_head_dim;
      b.add("prefill", prefill_t, "one prompt, eager (MFU = bound / us)", bench::median(us),
            s.weights_all, flops);
    });
  } catch (std::exception const& e) {
    std::printf("FATAL: %s\n", e.what());
    return 1;
  }
  return b.finish();
}
