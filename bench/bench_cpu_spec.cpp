// CPU decode tok/s with MTP speculative decoding vs without, in the same run: B greedy
// sequences decoding N tokens each, for K = 1..4, beside the non-speculative baseline.
//   build/bench_cpu_spec [--model DIR] [--mtp DIR] [--batch B] [--tokens N] [--prompt-len P]
//       [--accept-prob p]
// --mtp: the MTP weights' directory (default: the model's own mtp.* tensors; tools/train_mtp.py
// or make_random_checkpoint --mtp write them). --accept-prob p: the benchmark switch
// (EngineConfig::spec_forced_accept_prob) that accepts each draft with probability p whatever
// the target says (random weights accept nothing; NOT lossless); default: real acceptance.
#include <chrono>
#include <cstdio>
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

struct Result {
  double tps = 0;         // decoded tokens / s over all sequences
  double accept_len = 0;  // tokens per sequence per verify step
};

Result run(Model& model, const EngineConfig& cfg, int batch, int tokens, int prompt_len) {
  Engine engine(model, cfg);
  const int64_t vocab = model.config().vocab_size;
  int64_t got = 0;
  for (int b = 0; b < batch; ++b) {
    GenRequest r;
    r.id = "b" + std::to_string(b);
    for (int i = 0; i < prompt_len; ++i) {
      r.prompt_ids.push_back(static_cast<int32_t>((i * 7 + b * 13 + 3) % vocab));
    }
    r.max_tokens = tokens;
    r.ignore_eos = true;
    r.sampling.temperature = 0;
    engine.add(r, [&](const StepOutput& o) { got += static_cast<int64_t>(o.token_ids.size()); });
  }
  engine.step();  // the prompts and the first tokens
  const int64_t first = got;
  const double t0 = now();
  while (engine.step()) {
  }
  const double secs = now() - t0;
  const EngineStats st = engine.stats();
  Result r;
  r.tps = static_cast<double>(got - first) / secs;
  if (st.spec_num_drafts > 0) {
    r.accept_len = 1.0 + static_cast<double>(st.spec_num_accepted_tokens) /
                             static_cast<double>(st.spec_num_drafts);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = TANDEM_DEMO_MODEL_DIR, mtp;
  int batch = 1, tokens = 128, prompt_len = 16;
  double accept = -1.0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--model") {
      dir = argv[i + 1];
    } else if (k == "--mtp") {
      mtp = argv[i + 1];
    } else if (k == "--batch") {
      batch = std::stoi(argv[i + 1]);
    } else if (k == "--tokens") {
      tokens = std::stoi(argv[i + 1]);
    } else if (k == "--prompt-len") {
      prompt_len = std::stoi(argv[i + 1]);
    } else if (k == "--accept-prob") {
      accept = std::stod(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  auto model = Qwen3MoeCpu::load(dir);
  model->load_mtp(mtp.empty() ? dir : mtp);
  EngineConfig cfg;
  cfg.max_num_seqs = batch;
  cfg.kv_cache_mb = 512;
  cfg.enable_prefix_cache = false;
  cfg.spec_forced_accept_prob = accept;

  run(*model, cfg, 1, 8, prompt_len);  // warm up
  const Result base = run(*model, cfg, batch, tokens, prompt_len);
  std::printf("model %s  threads %d  batch %d  tokens %d  accept %s\n", dir.c_str(),
              ThreadPool::global().size(), batch, tokens,
              accept < 0 ? "real" : std::to_string(accept).c_str());
  std::printf("%-8s %14s %12s %10s\n", "K", "decode tok/s", "accept len", "speedup");
  std::printf("%-8s %14.1f %12s %10s\n", "off", base.tps, "-", "1.00");
  for (int64_t k = 1; k <= 4; ++k) {
    EngineConfig s = cfg;
    s.num_speculative_tokens = k;
    const Result r = run(*model, s, batch, tokens, prompt_len);
    std::printf("%-8lld %14.1f %12.2f %10.2f\n", static_cast<long long>(k), r.tps, r.accept_len,
                r.tps / base.tps);
  }
  return 0;
}
