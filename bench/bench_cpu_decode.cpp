// Single-stream CPU decode on a model (default: the embedded demo model): tokens/s beside
// the memory-bandwidth roofline measured in the same run (weights touched per token over
// the measured copy bandwidth).
//   build/bench_cpu_decode [--model DIR] [--tokens N] [--prompt-len P]
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "engine/engine.h"
#include "model/qwen3_moe.h"

#ifndef TANDEM_DEMO_MODEL_DIR
#define TANDEM_DEMO_MODEL_DIR "models/demo"
#endif

using namespace tandem;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Copy bandwidth (read + write bytes per second) over a buffer far larger than the caches.
double measure_copy_bandwidth() {
  const size_t n = size_t(256) << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    double t0 = now();
    ThreadPool::global().parallel_for(static_cast<int64_t>(n >> 20), 1,
                                      [&](int64_t b0, int64_t b1) {
                                        std::memcpy(b.data() + (b0 << 20), a.data() + (b0 << 20),
                                                    static_cast<size_t>(b1 - b0) << 20);
                                      });
    double dt = now() - t0;
    best = std::max(best, 2.0 * static_cast<double>(n) / dt);
    a[static_cast<size_t>(rep)] = b[static_cast<size_t>(rep) + 1];
  }
  return best;
}

// fp32 bytes of the weights one decode token reads.
double bytes_per_token(const ModelConfig& c) {
  const double h = double(c.hidden_size), d = double(c.head_dim);
  double attn = h * d * double(c.num_attention_heads + 2 * c.num_key_value_heads) +
                double(c.num_attention_heads) * d * h;
  double total = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    total += attn + 2 * h;
    if (c.is_moe_layer(l)) {
      total += double(c.num_experts) * h +
               double(c.num_experts_per_tok) * 3 * h * double(c.moe_intermediate_size);
    } else {
      total += 3 * h * double(c.intermediate_size);
    }
  }
  total += double(c.vocab_size) * h + h;  // lm_head + final norm
  return total * 4;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = TANDEM_DEMO_MODEL_DIR;
  int tokens = 256, prompt_len = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--model")
      dir = argv[i + 1];
    else if (k == "--tokens")
      tokens = std::stoi(argv[i + 1]);
    else if (k == "--prompt-len")
      prompt_len = std::stoi(argv[i + 1]);
  }
  auto model = Qwen3MoeCpu::load(dir);
  const ModelConfig& c = model->config();
  EngineConfig cfg;
  cfg.max_num_seqs = 1;
  cfg.kv_cache_mb = 256;
  cfg.enable_prefix_cache = false;
  Engine engine(*model, cfg);

  auto run_once = [&](int n) {
    GenRequest r;
    r.id = "bench";
    for (int i = 0; i < prompt_len; ++i) r.prompt_ids.push_back((i * 7 + 3) % int(c.vocab_size));
    r.max_tokens = n;
    r.ignore_eos = true;
    r.sampling.temperature = 0;
    int got = 0;
    engine.add(r, [&](const StepOutput& o) { got += int(o.token_ids.size()); });
    engine.step();  // prefill + first token
    double t0 = now();
    while (engine.step()) {
    }
    return std::pair<double, int>(now() - t0, got - 1);
  };
  run_once(8);  // warm up
  auto [secs, decoded] = run_once(tokens);
  double tps = decoded / secs;
  double bw = measure_copy_bandwidth();
  double roof = bw / bytes_per_token(c);
  std::printf("model %s  threads %d\n", dir.c_str(), ThreadPool::global().size());
  std::printf("%-28s %12s %14s %8s\n", "metric", "ours", "roofline", "ratio");
  std::printf("%-28s %12.1f %14.1f %8.2f\n", "decode tok/s (batch 1)", tps, roof, tps / roof);
  std::printf("copy bandwidth GB/s: %.1f   weights read per token MB: %.2f\n", bw / 1e9,
              bytes_per_token(c) / 1e6);
  return 0;
}
