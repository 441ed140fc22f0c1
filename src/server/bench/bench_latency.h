// `tandem bench latency`: the single-request view (vLLM's `vllm bench latency`), the engine in
// this process with no HTTP: for each prompt size, --num-iters batches of --batch-size random
// prompts (distinct every iteration, prefix cache off) generating --output-len tokens each
// (ignore_eos); prints each size's TTFT (the prefill step), TPOT (ms per decode step after the
// first token) and end-to-end latency with vLLM's percentiles, and --output-json.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace tandem {
class Model;
struct EngineConfig;
}  // namespace tandem

namespace tandem::bench {

/// Loads the model of `dir` for `device` ("cpu" / "cuda"), sizing the engine config's KV cache
/// (the CLI's load_model: on the GPU the KV takes what `gpu_memory_utilization` leaves).
using ModelLoader =
    std::function<std::unique_ptr<Model>(const std::string& dir, const std::string& device,
                                         EngineConfig& engine, double gpu_memory_utilization)>;

struct BenchLatencyOptions {
  std::string model;  // model directory
  std::string device = "cpu";
  std::vector<int64_t> input_lens{32};  // --input-len: one run per size
  int64_t output_len = 128;
  int64_t batch_size = 1;
  int64_t num_iters_warmup = 10;
  int64_t num_iters = 30;
  uint64_t seed = 0;
  int64_t max_num_batched_tokens = 0;  // 0: a batch's prompts in one step (capped at 16,384)
  int64_t kv_cache_mb = 0;             // 0: the device's default
  double gpu_memory_utilization = 0.9;
  std::string output_json;  // "": none
};

/// Runs the benchmark and prints the report to `out`; returns 0. Throws Error for bad flags.
int run_bench_latency(const BenchLatencyOptions& o, const ModelLoader& load, std::ostream& out);

}  // namespace tandem::bench
