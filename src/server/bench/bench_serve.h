// `tandem bench serve`: a load generator for any OpenAI-compatible endpoint (Tandem, vLLM,
// SGLang) in vLLM's `vllm bench serve` vocabulary: the random and ShareGPT datasets, Poisson /
// gamma arrivals (--request-rate, --burstiness), --max-concurrency, streaming completions or
// chat completions, and vLLM's report and --save-result JSON fields (docs/bench.md).
//
// The client is C++ on Boost.Beast, one io thread driving every stream (load_client.cpp): a
// Python client at 1,000 concurrent streams spends its time in the interpreter and stamps
// tokens late; this one stamps each read as it arrives.
//
//   BenchServeOptions o;                       // the CLI's flags
//   nlohmann::ordered_json r = run_bench_serve(o, std::cout);
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace tandem {
class Tokenizer;
}

namespace tandem::bench {

/// One request of a dataset.
struct SampleRequest {
  std::string prompt_text;          // the prompt as text (ShareGPT; random with a tokenizer)
  std::vector<int32_t> prompt_ids;  // the prompt as token ids (random to /v1/completions)
  int64_t prompt_len = 0;           // tokens in the prompt
  int64_t expected_output_len = 0;  // max_tokens of the request
};

/// vLLM's random dataset (--dataset-name random).
struct RandomDatasetOptions {
  int64_t num_prompts = 1000;
  int64_t input_len = 1024;  // --random-input-len
  int64_t output_len = 128;  // --random-output-len
  int64_t prefix_len = 0;    // --random-prefix-len: one shared random prefix in front
  double range_ratio = 0.0;  // --random-range-ratio in [0, 1): lengths uniform in
                             // [floor(L (1 - r)), ceil(L (1 + r))] (output at least 1)
  uint64_t seed = 0;
};

/// Random prompts as vLLM builds them: request i of length n is allowed[(offset_i + i + j) %
/// |allowed|] for j < n after the shared prefix, offset_i uniform in [0, vocab_size).
/// `allowed`: the token ids that may appear (the vocabulary without special tokens).
/// `text_tokenizer` non-null: the ids are decoded to text and re-encoded (truncated to the
/// length when longer), and prompt_len is the re-encoded length (the chat endpoint needs text);
/// null: token-id prompts of exactly the sampled length.
std::vector<SampleRequest> sample_random(const RandomDatasetOptions& o,
                                         const std::vector<int32_t>& allowed, int64_t vocab_size,
                                         const Tokenizer* text_tokenizer);

/// vLLM's ShareGPT dataset: a JSON array of {"conversations": [{"from", "value"}, ...]}; entries
/// with at least two turns, shuffled by `seed`; prompt = turn 0, the expected output the length
/// of turn 1 (or `output_len` when >= 0); pairs with a prompt or output under 4 tokens (output
/// checked only without `output_len`), a prompt over 1,024 or a total over 2,048 are skipped;
/// repeated (drawn again) when fewer than num_prompts remain. Errors name the file and entry.
std::vector<SampleRequest> sample_sharegpt(const std::string& path, const Tokenizer& tokenizer,
                                           int64_t num_prompts, uint64_t seed, int64_t output_len);

/// Send times (s from the start) of n requests: all 0 for an infinite rate; else gaps drawn
/// from a gamma distribution of shape `burstiness` and scale 1 / (rate x burstiness) (a Poisson
/// process at burstiness 1), summed, then scaled so the last is n / rate (as vLLM does);
/// burstiness infinite: evenly spaced.
std::vector<double> arrival_times(int64_t n, double request_rate, double burstiness, uint64_t seed);

/// What one request measured (seconds), vLLM's RequestFuncOutput.
struct RequestOutput {
  bool success = false;
  double ttft = 0;            // send -> first chunk with a choice
  std::vector<double> itl;    // gaps between chunks with a choice (one per chunk after the first)
  double latency = 0;         // send -> last chunk with a choice
  double start_time = 0;      // send time, from the start of the run
  double queue_time = 0;      // arrival -> send (waiting for --max-concurrency)
  int64_t prompt_len = 0;     // the dataset's, or usage.prompt_tokens when the server sent it
  int64_t output_tokens = 0;  // usage.completion_tokens (0: not sent)
  int64_t chunks = 0;         // chunks with a choice
  std::string generated_text;
  std::string error;  // failed: why
};

/// numpy.percentile(v, p) (linear interpolation); 0 for an empty v (numpy of [0]).
double percentile(std::vector<double> v, double p);

/// mean, median, std (population, as numpy) and the asked percentiles of `v`, in ms.
struct MetricStats {
  double mean_ms = 0, median_ms = 0, std_ms = 0;
  std::vector<std::pair<double, double>> percentiles_ms;  // (p, value)
};
MetricStats metric_stats(const std::vector<double>& seconds, const std::vector<double>& ps);

/// vLLM's BenchmarkMetrics.
struct BenchMetrics {
  int64_t completed = 0, failed = 0, total_input = 0, total_output = 0;
  double request_throughput = 0, output_throughput = 0, total_token_throughput = 0;
  MetricStats ttft, tpot, itl, e2el;
  double max_output_tokens_per_s = 0;
  int64_t max_concurrent_requests = 0;
  std::vector<int64_t> output_lens;  // per request (0 for a failed one)
};

/// The metrics of a run of `duration_s` (vLLM's calculate_metrics): a request's output length
/// is usage.completion_tokens, else the tokens of its text when `tokenizer` is given, else its
/// chunks with a choice; TPOT = (latency - TTFT) / (output - 1) over requests with more than one
/// output token; ITL pools every request's chunk gaps.
BenchMetrics compute_metrics(const std::vector<RequestOutput>& outputs, double duration_s,
                             const std::vector<double>& percentiles, const Tokenizer* tokenizer);

/// Where and how to send (load_client.cpp).
struct LoadOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  std::string path = "/v1/completions";  // the endpoint (with the base URL's path in front)
  bool chat = false;                     // openai-chat: messages, delta.content
  std::string model;
  bool ignore_eos = false;
  int64_t max_concurrency = 0;          // 0: no limit
  std::vector<double> arrivals;         // per request (arrival_times); empty: all at 0
  double request_timeout_s = 6 * 3600;  // a request still running after this fails
  bool progress = false;                // a live progress bar on stderr
  nlohmann::json extra_body = nlohmann::json::object();  // merged into every body
  std::string api_key;                                   // "Authorization: Bearer" when non-empty
};

/// Sends every request (streaming) and returns one output each, in order; `duration_s` gets
/// the wall time from the first send to the last completion. Never throws for a request that
/// fails (a refused connection, an HTTP error, a dropped stream, a timeout): it is counted
/// failed with its reason. Throws only when the host does not resolve.
std::vector<RequestOutput> run_load(const LoadOptions& o, const std::vector<SampleRequest>& reqs,
                                    double* duration_s);

/// GET `target` (for /v1/models); returns (status, body), status 0 with the error as body when
/// the request failed.
std::pair<int, std::string> http_get(const std::string& host, uint16_t port,
                                     const std::string& target, double timeout_s,
                                     const std::string& api_key = "");

/// The CLI's flags (vLLM's names).
struct BenchServeOptions {
  std::string backend = "openai";  // openai (/v1/completions) | openai-chat
  std::string base_url;            // http://host:port[/prefix] (else --host / --port)
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string endpoint;  // default: /v1/completions or /v1/chat/completions
  std::string model;     // default: the server's first /v1/models entry
  std::string label;
  std::string dataset_name = "random";  // random | sharegpt
  std::string dataset_path;
  std::string tokenizer;  // a model directory (tokenizer.json and/or config.json)
  RandomDatasetOptions random;
  int64_t sharegpt_output_len = -1;
  int64_t max_concurrency = 0;  // 0: none
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1.0;
  bool ignore_eos = false;
  uint64_t seed = 0;
  int64_t num_warmups = 0;
  double ready_check_timeout_s = 0;  // > 0: retry the first request until it succeeds
  double request_timeout_s = 6 * 3600;
  bool save_result = false;
  bool save_detailed = false;
  std::string result_dir;
  std::string result_filename;
  std::vector<std::string> metadata;  // KEY=VALUE, into the result JSON
  std::string percentile_metrics = "ttft,tpot,itl,e2el";
  std::string metric_percentiles = "90,99";
  std::optional<double> temperature, top_p, min_p;
  std::optional<int64_t> top_k;
  std::string extra_body;  // a JSON object merged into every request
  bool disable_tqdm = false;
};

/// Runs the benchmark: prints vLLM's report to `out` (progress on stderr), writes the result
/// JSON when asked, and returns it. Throws Error(kInvalidArgument) for bad flags, a dataset
/// that cannot be built, or a ready check that timed out.
nlohmann::ordered_json run_bench_serve(const BenchServeOptions& o, std::ostream& out);

}  // namespace tandem::bench
