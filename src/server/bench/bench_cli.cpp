#include "server/bench/bench_cli.h"

#include <CLI/CLI.hpp>
#include <iostream>
#include <limits>

#include "server/bench/bench_serve.h"

namespace tandem::bench {

struct BenchCli::Impl {
  ModelLoader load;
  CLI::App* bench = nullptr;
  CLI::App* serve = nullptr;
  CLI::App* latency = nullptr;
  BenchServeOptions so;
  BenchLatencyOptions lo;
  double top_k = -1, temperature = -1, top_p = -1, min_p = -1;
  std::string request_rate = "inf";
  std::string burstiness = "1.0";
  int64_t input_len = -1, output_len = -1;  // vLLM's general --input-len / --output-len
};

namespace {

double parse_float(const std::string& flag, const std::string& s) {
  if (s == "inf" || s == "Inf" || s == "INF") return std::numeric_limits<double>::infinity();
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || used == 0) throw CLI::ValidationError(flag, "not a number: '" + s + "'");
  return v;
}

}  // namespace

BenchCli::BenchCli(CLI::App& app, ModelLoader load, std::string default_model)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.load = std::move(load);
  m.lo.model = std::move(default_model);
  m.bench = app.add_subcommand("bench",
                               "Benchmarks: serve (a load generator for any "
                               "OpenAI-compatible server) and latency (the engine here)");
  m.bench->require_subcommand(1);

  // ---- bench serve (vLLM's `vllm bench serve` flags) ----
  BenchServeOptions& s = m.so;
  auto* sv = m.serve = m.bench->add_subcommand(
      "serve",
      "Load an OpenAI-compatible endpoint (Tandem, vLLM, SGLang) and report throughput, "
      "TTFT, TPOT, ITL and E2EL as `vllm bench serve` does (docs/bench.md)");
  sv->add_option("--backend", s.backend,
                 "openai (/v1/completions) or openai-chat (/v1/chat/completions)")
      ->check(CLI::IsMember({"openai", "openai-chat"}));
  sv->add_option("--base-url", s.base_url, "http://HOST:PORT[/PATH] (else --host / --port)");
  sv->add_option("--host", s.host, "Server host");
  sv->add_option("--port", s.port, "Server port")->check(CLI::Range(1, 65535));
  sv->add_option("--endpoint", s.endpoint,
                 "API path (default: /v1/completions, or /v1/chat/completions for openai-chat)");
  sv->add_option("--model", s.model,
                 "Model name in the requests (default: the server's first /v1/models entry); "
                 "a directory also serves as --tokenizer");
  sv->add_option("--label", s.label, "Result label (default: the backend)");
  sv->add_option("--tokenizer", s.tokenizer,
                 "Model directory: tokenizer.json (text prompts, token counts) or config.json's "
                 "vocab_size (token-id prompts)");
  sv->add_option("--dataset-name", s.dataset_name, "random or sharegpt")
      ->check(CLI::IsMember({"random", "sharegpt"}));
  sv->add_option("--dataset-path", s.dataset_path, "ShareGPT JSON file");
  sv->add_option("--num-prompts", s.random.num_prompts, "Requests to send")
      ->check(CLI::PositiveNumber);
  sv->add_option("--input-len", m.input_len, "Same as --random-input-len");
  sv->add_option("--output-len", m.output_len,
                 "Same as --random-output-len and --sharegpt-output-len");
  sv->add_option("--random-input-len", s.random.input_len, "Prompt tokens (random dataset)")
      ->check(CLI::NonNegativeNumber);
  sv->add_option("--random-output-len", s.random.output_len, "Output tokens (random dataset)")
      ->check(CLI::PositiveNumber);
  sv->add_option("--random-range-ratio", s.random.range_ratio,
                 "Lengths uniform in [L (1 - r), L (1 + r)], r in [0, 1)")
      ->check(CLI::Range(0.0, 0.999999));
  sv->add_option("--random-prefix-len", s.random.prefix_len,
                 "A random prefix shared by every prompt, before its own tokens")
      ->check(CLI::NonNegativeNumber);
  sv->add_option("--sharegpt-output-len", s.sharegpt_output_len,
                 "Output tokens of every ShareGPT request (default: its reply's length)");
  sv->add_option("--max-concurrency", s.max_concurrency,
                 "Requests in flight at most (default: no limit)")
      ->check(CLI::PositiveNumber);
  sv->add_option("--request-rate", m.request_rate,
                 "Requests per second (inf: all at once; else Poisson / gamma arrivals)");
  sv->add_option("--burstiness", m.burstiness,
                 "Gamma shape of the arrival gaps (1: Poisson; < 1 burstier, > 1 more even)");
  sv->add_flag("--ignore-eos", s.ignore_eos, "Send ignore_eos: generate every output token");
  sv->add_option("--seed", s.seed, "Seed of the dataset and the arrivals");
  sv->add_option("--num-warmups", s.num_warmups, "Requests before the measured run")
      ->check(CLI::NonNegativeNumber);
  sv->add_option("--ready-check-timeout-sec", s.ready_check_timeout_s,
                 "Retry the first request alone until it succeeds, up to this long (0: no check)")
      ->check(CLI::NonNegativeNumber);
  sv->add_option("--request-timeout", s.request_timeout_s,
                 "Seconds a request may take before it counts as failed")
      ->check(CLI::PositiveNumber);
  sv->add_flag("--save-result", s.save_result, "Write the result JSON (vLLM's fields)");
  sv->add_flag("--save-detailed", s.save_detailed,
               "With --save-result: per-request lists too (input_lens, output_lens, ttfts, itls, "
               "start_times, generated_texts, errors)");
  sv->add_option("--result-dir", s.result_dir, "Directory of the result file");
  sv->add_option(
      "--result-filename", s.result_filename,
      "Result file name (default: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json)");
  sv->add_option("--metadata", s.metadata, "KEY=VALUE pairs written into the result");
  sv->add_option("--percentile-metrics", s.percentile_metrics,
                 "Metrics to report: ttft,tpot,itl,e2el[,client_queue_time,"
                 "e2el_including_client_queue] (vLLM's default: ttft,tpot,itl)");
  sv->add_option("--metric-percentiles", s.metric_percentiles,
                 "Percentiles to report, comma-separated (vLLM's default: 99)");
  sv->add_option("--temperature", m.temperature, "Sampling temperature (default: the server's)");
  sv->add_option("--top-p", m.top_p, "top_p (default: the server's)");
  sv->add_option("--top-k", m.top_k, "top_k (default: the server's)");
  sv->add_option("--min-p", m.min_p, "min_p (default: the server's)");
  sv->add_option("--extra-body", s.extra_body, "A JSON object merged into every request body");
  sv->add_flag("--disable-tqdm", s.disable_tqdm, "No progress bar");

  // ---- bench latency (vLLM's `vllm bench latency` flags) ----
  BenchLatencyOptions& l = m.lo;
  auto* lt = m.latency = m.bench->add_subcommand(
      "latency",
      "The engine in this process, no HTTP: TTFT (the prefill) per prompt size and "
      "ms per output token, as `vllm bench latency`");
  lt->add_option("--model", l.model, "Model directory (default: the embedded demo model)");
  lt->add_option("--device", l.device, "cpu or cuda (one GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  lt->add_option("--input-len", l.input_lens, "Prompt tokens; several sizes comma-separated")
      ->delimiter(',');
  lt->add_option("--output-len", l.output_len, "Output tokens per request")
      ->check(CLI::PositiveNumber);
  lt->add_option("--batch-size", l.batch_size, "Requests per iteration (vLLM's default: 8)")
      ->check(CLI::PositiveNumber);
  lt->add_option("--num-iters-warmup", l.num_iters_warmup, "Iterations not measured")
      ->check(CLI::NonNegativeNumber);
  lt->add_option("--num-iters", l.num_iters, "Measured iterations per size")
      ->check(CLI::PositiveNumber);
  lt->add_option("--seed", l.seed, "Seed of the random prompts");
  lt->add_option("--max-num-batched-tokens", l.max_num_batched_tokens,
                 "Tokens per step (default: a batch's prompts in one step, up to 16,384)")
      ->check(CLI::NonNegativeNumber);
  lt->add_option("--kv-cache-mb", l.kv_cache_mb,
                 "KV cache (default: 512 on the CPU; on the GPU what --gpu-memory-utilization "
                 "leaves)")
      ->check(CLI::NonNegativeNumber);
  lt->add_option("--gpu-memory-utilization", l.gpu_memory_utilization,
                 "Share of the GPU's memory for weights, activations and KV")
      ->check(CLI::Range(0.05, 1.0));
  lt->add_option("--output-json", l.output_json, "Write the results as JSON");
}

BenchCli::~BenchCli() = default;

bool BenchCli::parsed() const { return impl_->bench->parsed(); }

int BenchCli::run() {
  Impl& m = *impl_;
  if (m.latency->parsed()) return run_bench_latency(m.lo, m.load, std::cout);
  BenchServeOptions o = m.so;
  o.request_rate = parse_float("--request-rate", m.request_rate);
  o.burstiness = parse_float("--burstiness", m.burstiness);
  if (m.input_len >= 0) o.random.input_len = m.input_len;
  if (m.output_len >= 0) {
    o.random.output_len = m.output_len;
    o.sharegpt_output_len = m.output_len;
  }
  if (m.temperature >= 0) o.temperature = m.temperature;
  if (m.top_p >= 0) o.top_p = m.top_p;
  if (m.top_k >= 0) o.top_k = static_cast<int64_t>(m.top_k);
  if (m.min_p >= 0) o.min_p = m.min_p;
  run_bench_serve(o, std::cout);
  return 0;
}

}  // namespace tandem::bench
