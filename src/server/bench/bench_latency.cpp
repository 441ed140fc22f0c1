#include "server/bench/bench_latency.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "engine/engine.h"
#include "model/qwen3_moe.h"
#include "server/bench/bench_serve.h"

namespace tandem::bench {

namespace {

using Clock = std::chrono::steady_clock;

struct Iteration {
  double latency_s = 0;  // submit -> every request finished
  double ttft_s = 0;     // submit -> every request has its first token (the prefill)
  double tpot_s = 0;     // (finish - first tokens) / (output_len - 1): one decode step
};

/// One batch through the engine: `batch` prompts of `input_len` random ids.
Iteration run_batch(Engine& engine, int64_t batch, int64_t input_len, int64_t output_len,
                    int64_t vocab, std::mt19937_64& rng, int64_t iter) {
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  std::vector<Clock::time_point> first(static_cast<size_t>(batch));
  std::vector<bool> got(static_cast<size_t>(batch), false);
  int64_t finished = 0;
  std::string error;
  const auto t0 = Clock::now();
  for (int64_t b = 0; b < batch; ++b) {
    GenRequest r;
    r.id = "lat-" + std::to_string(iter) + "-" + std::to_string(b);
    r.prompt_ids.resize(static_cast<size_t>(input_len));
    for (auto& t : r.prompt_ids) t = id(rng);
    r.max_tokens = static_cast<int32_t>(output_len);
    r.ignore_eos = true;
    engine.add(std::move(r), [&, b](const StepOutput& out) {
      if (!out.token_ids.empty() && !got[static_cast<size_t>(b)]) {
        got[static_cast<size_t>(b)] = true;
        first[static_cast<size_t>(b)] = Clock::now();
      }
      if (out.finished) {
        ++finished;
        if (out.finish_reason == FinishReason::kError) error = out.error;
      }
    });
  }
  while (engine.step()) {
  }
  const auto t1 = Clock::now();
  TANDEM_CHECK_KIND(kInternal, error.empty(), "bench latency: a request failed: ", error);
  TANDEM_CHECK_KIND(kInternal, finished == batch, "bench latency: ", batch - finished,
                    " requests did not finish");
  Iteration it;
  auto last_first = t0;
  for (int64_t b = 0; b < batch; ++b)
    last_first = std::max(last_first, first[static_cast<size_t>(b)]);
  it.latency_s = std::chrono::duration<double>(t1 - t0).count();
  it.ttft_s = std::chrono::duration<double>(last_first - t0).count();
  it.tpot_s = output_len > 1
                  ? std::chrono::duration<double>(t1 - last_first).count() / double(output_len - 1)
                  : 0.0;
  return it;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / double(v.size());
}

}  // namespace

int run_bench_latency(const BenchLatencyOptions& o, const ModelLoader& load, std::ostream& out) {
  TANDEM_CHECK_KIND(kInvalidArgument, !o.input_lens.empty(), "--input-len: give a size");
  for (int64_t n : o.input_lens) {
    TANDEM_CHECK_KIND(kInvalidArgument, n >= 1, "--input-len must be at least 1, not ", n);
  }
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      o.output_len >= 1 && o.batch_size >= 1 && o.num_iters >= 1 && o.num_iters_warmup >= 0,
      "--output-len, --batch-size and --num-iters must be at least 1");
  const int64_t max_in = *std::max_element(o.input_lens.begin(), o.input_lens.end());
  EngineConfig cfg;
  cfg.max_num_seqs = o.batch_size;
  cfg.max_model_len = max_in + o.output_len;
  cfg.max_batched_tokens = o.max_num_batched_tokens > 0
                               ? o.max_num_batched_tokens
                               : std::max<int64_t>(cfg.max_batched_tokens,
                                                   std::min<int64_t>(16384, max_in * o.batch_size));
  cfg.enable_prefix_cache = false;  // every iteration computes its prompts
  cfg.warm_up = true;               // the GPU's decode graphs before the first iteration
  cfg.kv_cache_mb = o.kv_cache_mb;
  std::unique_ptr<Model> model = load(o.model, o.device, cfg, o.gpu_memory_utilization);
  const int64_t vocab = model->config().vocab_size;
  Engine engine(*model, cfg);
  std::mt19937_64 rng(o.seed);

  const std::vector<double> ps = {10, 25, 50, 75, 90, 99};  // vLLM's
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  char line[256];
  out << "device " << o.device << ", batch " << o.batch_size << ", output " << o.output_len
      << " tokens, " << o.num_iters << " iterations after " << o.num_iters_warmup
      << " warm-up, step budget " << cfg.max_batched_tokens << " tokens\n";
  std::snprintf(line, sizeof line, "%10s %12s %12s %12s %14s %12s %12s\n", "input_len", "TTFT ms",
                "TTFT p99 ms", "TPOT ms", "decode tok/s", "latency s", "p99 s");
  out << line;
  int64_t iter = 0;
  for (int64_t in_len : o.input_lens) {
    for (int64_t i = 0; i < o.num_iters_warmup; ++i) {
      run_batch(engine, o.batch_size, in_len, o.output_len, vocab, rng, iter++);
    }
    std::vector<double> lat, ttft, tpot;
    for (int64_t i = 0; i < o.num_iters; ++i) {
      const Iteration it =
          run_batch(engine, o.batch_size, in_len, o.output_len, vocab, rng, iter++);
      lat.push_back(it.latency_s);
      ttft.push_back(it.ttft_s);
      tpot.push_back(it.tpot_s);
    }
    const double tpot_ms = mean(tpot) * 1000;
    std::snprintf(line, sizeof line, "%10lld %12.2f %12.2f %12.3f %14.1f %12.4f %12.4f\n",
                  static_cast<long long>(in_len), mean(ttft) * 1000, percentile(ttft, 99) * 1000,
                  tpot_ms, tpot_ms > 0 ? double(o.batch_size) * 1000.0 / tpot_ms : 0.0, mean(lat),
                  percentile(lat, 99));
    out << line << std::flush;
    nlohmann::ordered_json r;
    r["input_len"] = in_len;
    r["output_len"] = o.output_len;
    r["batch_size"] = o.batch_size;
    r["avg_latency"] = mean(lat);
    r["latencies"] = lat;
    nlohmann::ordered_json pj;
    for (double p : ps) pj[std::to_string(static_cast<int>(p))] = percentile(lat, p);
    r["percentiles"] = pj;
    r["mean_ttft_ms"] = mean(ttft) * 1000;
    r["p99_ttft_ms"] = percentile(ttft, 99) * 1000;
    r["mean_tpot_ms"] = tpot_ms;
    r["p99_tpot_ms"] = percentile(tpot, 99) * 1000;
    results.push_back(std::move(r));
  }
  // vLLM's closing lines, for the last size.
  const auto& last = results.back();
  out << "Avg latency: " << last["avg_latency"].get<double>() << " seconds\n";
  for (double p : ps) {
    out << static_cast<int>(p) << "% percentile latency: "
        << last["percentiles"][std::to_string(static_cast<int>(p))].get<double>() << " seconds\n";
  }
  if (!o.output_json.empty()) {
    std::ofstream f(o.output_json);
    TANDEM_CHECK_KIND(kInvalidArgument, static_cast<bool>(f), "--output-json: cannot write ",
                      o.output_json);
    // One size: vLLM's object (avg_latency, latencies, percentiles) with ours beside; several:
    // {"results": [one per size]}.
    f << (results.size() == 1 ? results[0] : nlohmann::ordered_json{{"results", results}}).dump(2)
      << "\n";
  }
  return 0;
}

}  // namespace tandem::bench
