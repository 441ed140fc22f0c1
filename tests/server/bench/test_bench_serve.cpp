// `tandem bench serve`: the datasets, arrivals and percentiles against their definitions (vLLM's),
// the client against a scripted server whose timings are known (counts, TTFT / TPOT / ITL / E2EL,
// failures counted, never a hang), the result JSON's fields, and a short run against the real
// engine over the demo model (completions with token ids, chat with text).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>

#include "engine/engine.h"
#include "model/qwen3_moe.h"
#include "server/bench/bench_serve.h"
#include "server/bench/scripted_server.h"
#include "server/http/http_server.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem::bench {
namespace {

using json = nlohmann::json;

std::string demo_dir() { return std::string(TANDEM_SOURCE_DIR) + "/models/demo"; }

/// A fresh temporary directory, removed with the object.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    char tmpl[] = "/tmp/tandem_bench_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

TEST(BenchPercentile, MatchesNumpyLinearInterpolation) {
  // numpy.percentile([1, 2, 3, 4], p): 50 -> 2.5, 90 -> 3.7, 99 -> 3.97, 0 -> 1, 100 -> 4.
  const std::vector<double> v = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(percentile(v, 50), 2.5);
  EXPECT_NEAR(percentile(v, 90), 3.7, 1e-12);
  EXPECT_NEAR(percentile(v, 99), 3.97, 1e-12);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 4);
  EXPECT_DOUBLE_EQ(percentile({}, 99), 0);
  const MetricStats s = metric_stats({0.001, 0.002, 0.003, 0.004}, {99});
  EXPECT_NEAR(s.mean_ms, 2.5, 1e-9);
  EXPECT_NEAR(s.median_ms, 2.5, 1e-9);
  EXPECT_NEAR(s.std_ms, std::sqrt(1.25), 1e-9);  // population std, as numpy
  ASSERT_EQ(s.percentiles_ms.size(), 1u);
  EXPECT_NEAR(s.percentiles_ms[0].second, 3.97, 1e-9);
}

TEST(BenchArrivals, PoissonAndGammaAsVllm) {
  for (double b : {1.0, 0.25, 4.0}) {
    const auto t = arrival_times(4000, 20.0, b, 7);
    ASSERT_EQ(t.size(), 4000u);
    EXPECT_NEAR(t.back(), 4000 / 20.0, 1e-9);  // rescaled so the last send is n / rate
    std::vector<double> gaps;
    for (size_t i = 0; i < t.size(); ++i) gaps.push_back(t[i] - (i ? t[i - 1] : 0.0));
    const double mean = std::accumulate(gaps.begin(), gaps.end(), 0.0) / double(gaps.size());
    double var = 0;
    for (double g : gaps) var += (g - mean) * (g - mean);
    const double cv = std::sqrt(var / double(gaps.size())) / mean;
    // A gamma of shape b has a coefficient of variation 1 / sqrt(b).
    EXPECT_NEAR(cv, 1.0 / std::sqrt(b), 0.12 / std::sqrt(b)) << "burstiness " << b;
    EXPECT_TRUE(std::is_sorted(t.begin(), t.end()));
  }
  EXPECT_EQ(arrival_times(5, std::numeric_limits<double>::infinity(), 1.0, 0),
            std::vector<double>(5, 0.0));
  const auto even = arrival_times(4, 2.0, std::numeric_limits<double>::infinity(), 0);
  EXPECT_EQ(even, (std::vector<double>{0.5, 1.0, 1.5, 2.0}));
  EXPECT_NE(arrival_times(10, 5.0, 1.0, 1), arrival_times(10, 5.0, 1.0, 2));
  EXPECT_EQ(arrival_times(10, 5.0, 1.0, 3), arrival_times(10, 5.0, 1.0, 3));
}

TEST(BenchRandomDataset, LengthsRangeAndSequenceAsVllm) {
  std::vector<int32_t> allowed(50);
  std::iota(allowed.begin(), allowed.end(), 100);  // ids 100..149
  RandomDatasetOptions o;
  o.num_prompts = 300;
  o.input_len = 40;
  o.output_len = 10;
  o.range_ratio = 0.5;
  o.prefix_len = 3;
  o.seed = 11;
  const auto reqs = sample_random(o, allowed, 150, nullptr);
  ASSERT_EQ(reqs.size(), 300u);
  int64_t min_in = 1 << 30, max_in = 0, min_out = 1 << 30, max_out = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto& r = reqs[i];
    const int64_t in = r.prompt_len - 3;
    min_in = std::min(min_in, in);
    max_in = std::max(max_in, in);
    min_out = std::min(min_out, r.expected_output_len);
    max_out = std::max(max_out, r.expected_output_len);
    ASSERT_EQ(static_cast<int64_t>(r.prompt_ids.size()), r.prompt_len);
    // The shared prefix, then consecutive allowed ids (mod |allowed|).
    for (int k = 0; k < 3; ++k) EXPECT_EQ(r.prompt_ids[k], reqs[0].prompt_ids[k]);
    for (size_t j = 4; j < r.prompt_ids.size(); ++j) {
      EXPECT_EQ(r.prompt_ids[j] - 100, (r.prompt_ids[j - 1] - 100 + 1) % 50);
    }
    for (int32_t id : r.prompt_ids) ASSERT_TRUE(id >= 100 && id < 150);
  }
  // [floor(40 * 0.5), ceil(40 * 1.5)] = [20, 60]; output [5, 15]; 300 draws reach the ends.
  EXPECT_EQ(min_in, 20);
  EXPECT_EQ(max_in, 60);
  EXPECT_EQ(min_out, 5);
  EXPECT_EQ(max_out, 15);
  // Range ratio 0: exact lengths; the seed decides the ids.
  o.range_ratio = 0;
  o.prefix_len = 0;
  const auto a = sample_random(o, allowed, 150, nullptr);
  for (const auto& r : a) {
    EXPECT_EQ(r.prompt_len, 40);
    EXPECT_EQ(r.expected_output_len, 10);
  }
  EXPECT_EQ(sample_random(o, allowed, 150, nullptr)[5].prompt_ids, a[5].prompt_ids);
  o.seed = 12;
  EXPECT_NE(sample_random(o, allowed, 150, nullptr)[5].prompt_ids, a[5].prompt_ids);
  o.range_ratio = 1.0;
  EXPECT_THROW(sample_random(o, allowed, 150, nullptr), Error);
}

TEST(BenchRandomDataset, TextPromptsWithTheTokenizer) {
  auto tok = Tokenizer::from_dir(demo_dir());
  ASSERT_TRUE(tok);
  std::vector<int32_t> allowed;
  for (int32_t id = 0; id < 1000; ++id) allowed.push_back(id);
  RandomDatasetOptions o;
  o.num_prompts = 5;
  o.input_len = 64;
  const auto reqs = sample_random(o, allowed, 1000, tok.get());
  for (const auto& r : reqs) {
    EXPECT_TRUE(r.prompt_ids.empty());
    EXPECT_FALSE(r.prompt_text.empty());
    EXPECT_EQ(r.prompt_len, static_cast<int64_t>(tok->encode(r.prompt_text, false).size()));
    EXPECT_LE(r.prompt_len, 64 + 2);
    EXPECT_GE(r.prompt_len, 32);
  }
}

TEST(BenchShareGpt, FiltersShufflesAndOversamples) {
  auto tok = Tokenizer::from_dir(demo_dir());
  ASSERT_TRUE(tok);
  TempDir d;
  const std::string path = (d.path / "sg.json").string();
  json data = json::array();
  const std::string long_text = [] {
    std::string s;
    for (int i = 0; i < 800; ++i) s += "Elizabeth walked to town and back. ";
    return s;
  }();
  data.push_back({{"id", "ok1"},
                  {"conversations",
                   {{{"from", "human"}, {"value", "Who is Mr. Darcy in the novel?"}},
                    {{"from", "gpt"}, {"value", "He is a proud gentleman of Pemberley."}}}}});
  data.push_back({{"id", "ok2"},
                  {"conversations",
                   {{{"from", "human"}, {"value", "Tell me about Emma and her friends."}},
                    {{"from", "gpt"}, {"value", "Emma Woodhouse lives at Hartfield."}}}}});
  data.push_back({{"id", "one_turn"}, {"conversations", {{{"from", "human"}, {"value", "Hi"}}}}});
  data.push_back({{"id", "short"},
                  {"conversations",
                   {{{"from", "human"}, {"value", "Hi"}},
                    {{"from", "gpt"}, {"value", "Hello there, friend."}}}}});
  data.push_back({{"id", "long"},
                  {"conversations",
                   {{{"from", "human"}, {"value", long_text}},
                    {{"from", "gpt"}, {"value", "Yes, quite long."}}}}});
  std::ofstream(path) << data.dump();
  const auto reqs = sample_sharegpt(path, *tok, 6, 0, -1);
  ASSERT_EQ(reqs.size(), 6u);  // the two usable entries, repeated to six
  for (const auto& r : reqs) {
    EXPECT_TRUE(r.prompt_text.rfind("Who is", 0) == 0 || r.prompt_text.rfind("Tell me", 0) == 0);
    EXPECT_EQ(r.prompt_len, static_cast<int64_t>(tok->encode(r.prompt_text).size()));
    EXPECT_GE(r.expected_output_len, 4);
  }
  // --sharegpt-output-len fixes the output.
  for (const auto& r : sample_sharegpt(path, *tok, 2, 0, 3)) EXPECT_EQ(r.expected_output_len, 3);
  std::ofstream(path) << "{\"not\": \"a list\"}";
  EXPECT_THROW(sample_sharegpt(path, *tok, 2, 0, -1), Error);
  EXPECT_THROW(sample_sharegpt((d.path / "missing.json").string(), *tok, 2, 0, -1), Error);
}

/// `n` token-id requests whose first id picks the scripted server's behaviour.
std::vector<SampleRequest> scripted_requests(const std::vector<int>& modes, int64_t out_len) {
  std::vector<SampleRequest> r;
  for (int m : modes) {
    SampleRequest s;
    s.prompt_ids = {1000 + m, 9, 9};
    s.prompt_len = 3;
    s.expected_output_len = out_len;
    r.push_back(s);
  }
  return r;
}

TEST(BenchClient, TimingsOfAScriptedServer) {
  testing::ScriptedServer server(/*first_ms=*/60, /*gap_ms=*/25);
  LoadOptions o;
  o.port = server.port();
  o.model = "scripted";
  o.max_concurrency = 4;
  const auto reqs = scripted_requests(std::vector<int>(8, 1), 6);
  double duration = 0;
  const auto outs = run_load(o, reqs, &duration);
  ASSERT_EQ(outs.size(), 8u);
  for (const auto& r : outs) {
    ASSERT_TRUE(r.success) << r.error;
    EXPECT_EQ(r.chunks, 6);
    EXPECT_EQ(r.output_tokens, 6);  // usage.completion_tokens
    EXPECT_EQ(r.prompt_len, 7);     // usage.prompt_tokens replaces the dataset's 3
    EXPECT_EQ(r.generated_text, "tttttt");
    ASSERT_EQ(r.itl.size(), 5u);
    // Known delays; the upper bounds leave room for a loaded 2-core machine (a late read may
    // take two chunks at once: single gaps are not bounded below, their sum and median are).
    EXPECT_GE(r.ttft, 0.060);
    EXPECT_LT(r.ttft, 0.060 + 1.0);
    EXPECT_GE(r.ttft + std::accumulate(r.itl.begin(), r.itl.end(), 0.0), 0.060 + 5 * 0.025);
    EXPECT_GE(percentile(r.itl, 50), 0.010);
    EXPECT_NEAR(r.latency, r.ttft + std::accumulate(r.itl.begin(), r.itl.end(), 0.0), 1e-9);
  }
  // Concurrency 4, 8 requests of ~185 ms: two waves, the second queued behind the first.
  EXPECT_GT(duration, 2 * 0.185 - 0.01);
  int queued = 0;
  for (const auto& r : outs) queued += r.queue_time > 0.1;
  EXPECT_EQ(queued, 4);
  EXPECT_LE(server.connections(), 4);  // keep-alive: the second wave reuses the first's

  const BenchMetrics m = compute_metrics(outs, duration, {50, 99}, nullptr);
  EXPECT_EQ(m.completed, 8);
  EXPECT_EQ(m.failed, 0);
  EXPECT_EQ(m.total_output, 48);
  EXPECT_EQ(m.total_input, 56);
  EXPECT_NEAR(m.output_throughput, 48 / duration, 1e-9);
  EXPECT_GE(m.tpot.mean_ms, 15.0);
  EXPECT_LT(m.tpot.mean_ms, 25.0 + 200.0);
  EXPECT_GE(m.ttft.median_ms, 60.0);
  EXPECT_LE(m.max_concurrent_requests, 4);
  EXPECT_GE(m.max_concurrent_requests, 3);
}

TEST(BenchClient, FailuresAreCountedNotHangs) {
  testing::ScriptedServer server(5, 5);
  LoadOptions o;
  o.port = server.port();
  o.model = "scripted";
  o.request_timeout_s = 1.0;  // mode 4 never answers
  const auto reqs = scripted_requests({1, 2, 3, 4, 5, 6, 1}, 4);
  const auto t0 = std::chrono::steady_clock::now();
  double duration = 0;
  const auto outs = run_load(o, reqs, &duration);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  ASSERT_EQ(outs.size(), 7u);
  EXPECT_TRUE(outs[0].success) << outs[0].error;
  EXPECT_FALSE(outs[1].success);
  EXPECT_NE(outs[1].error.find("HTTP 500"), std::string::npos) << outs[1].error;
  EXPECT_NE(outs[1].error.find("scripted failure"), std::string::npos) << outs[1].error;
  EXPECT_FALSE(outs[2].success);  // dropped mid-stream: a cut chunked body
  EXPECT_FALSE(outs[3].success);  // timed out
  EXPECT_NE(outs[3].error.find("timeout"), std::string::npos) << outs[3].error;
  EXPECT_FALSE(outs[4].success);
  EXPECT_NE(outs[4].error.find("scripted error event"), std::string::npos) << outs[4].error;
  EXPECT_FALSE(outs[5].success);
  EXPECT_NE(outs[5].error.find("malformed"), std::string::npos) << outs[5].error;
  EXPECT_TRUE(outs[6].success) << outs[6].error;
  const BenchMetrics m = compute_metrics(outs, duration, {99}, nullptr);
  EXPECT_EQ(m.completed, 2);
  EXPECT_EQ(m.failed, 5);

  // Nobody listening: every request fails at connect, at once.
  uint16_t dead_port = 0;
  {
    testing::ScriptedServer gone(1, 1);
    dead_port = gone.port();
  }
  o.port = dead_port;
  const auto refused = run_load(o, scripted_requests({1, 1, 1}, 2), &duration);
  for (const auto& r : refused) {
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find("connect"), std::string::npos) << r.error;
  }
}

TEST(BenchServe, ResultJsonAsVllm) {
  testing::ScriptedServer server(40, 20);
  TempDir d;
  std::ofstream(d.path / "config.json") << R"({"vocab_size": 64})";  // token-id prompts
  BenchServeOptions o;
  o.port = server.port();
  o.tokenizer = d.path.string();
  o.random.num_prompts = 6;
  o.random.input_len = 8;
  o.random.output_len = 5;
  o.max_concurrency = 3;
  o.request_rate = 200;
  o.ignore_eos = true;
  o.save_result = true;
  o.result_dir = (d.path / "out").string();
  o.label = "scripted-run";
  o.metadata = {"gpu=none"};
  o.disable_tqdm = true;
  std::ostringstream report;
  const auto res = run_bench_serve(o, report);
  // The model came from /v1/models; the report has vLLM's lines.
  EXPECT_EQ(res["model_id"], "scripted");
  EXPECT_NE(report.str().find("Successful requests:                     6"), std::string::npos)
      << report.str();
  EXPECT_NE(report.str().find("Mean TPOT (ms):"), std::string::npos);
  EXPECT_NE(report.str().find("P99 ITL (ms):"), std::string::npos);
  // The file: {label}-{rate}qps-concurrency{N}-{model}-{date}.json with vLLM's fields.
  std::vector<std::filesystem::path> files;
  for (const auto& e : std::filesystem::directory_iterator(d.path / "out"))
    files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  const std::string name = files[0].filename().string();
  EXPECT_EQ(name.rfind("scripted-run-200.0qps-concurrency3-scripted-", 0), 0u) << name;
  json j = json::parse(std::ifstream(files[0]));
  for (const char* k : {"date",
                        "endpoint_type",
                        "backend",
                        "label",
                        "model_id",
                        "tokenizer_id",
                        "num_prompts",
                        "request_rate",
                        "burstiness",
                        "max_concurrency",
                        "duration",
                        "completed",
                        "failed",
                        "total_input_tokens",
                        "total_output_tokens",
                        "request_throughput",
                        "request_goodput",
                        "output_throughput",
                        "total_token_throughput",
                        "latencies",
                        "queue_times",
                        "max_output_tokens_per_s",
                        "max_concurrent_requests",
                        "rtfx",
                        "mean_ttft_ms",
                        "median_ttft_ms",
                        "std_ttft_ms",
                        "p90_ttft_ms",
                        "p99_ttft_ms",
                        "mean_tpot_ms",
                        "median_tpot_ms",
                        "std_tpot_ms",
                        "p99_tpot_ms",
                        "mean_itl_ms",
                        "median_itl_ms",
                        "std_itl_ms",
                        "p99_itl_ms",
                        "mean_e2el_ms",
                        "median_e2el_ms",
                        "p99_e2el_ms",
                        "mean_client_queue_time_ms" /* not selected: absent */}) {
    if (std::string(k) == "mean_client_queue_time_ms") {
      EXPECT_FALSE(j.contains(k));
    } else {
      EXPECT_TRUE(j.contains(k)) << k;
    }
  }
  EXPECT_FALSE(j.contains("ttfts"));  // only with --save-detailed
  EXPECT_EQ(j["gpu"], "none");
  EXPECT_EQ(j["completed"], 6);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_output_tokens"], 30);
  EXPECT_EQ(j["total_input_tokens"], 42);  // usage.prompt_tokens (7) each
  EXPECT_EQ(j["max_concurrency"], 3);
  EXPECT_EQ(j["request_rate"], 200.0);
  EXPECT_EQ(j["backend"], "openai");
  EXPECT_EQ(j["tokenizer_id"], d.path.string());
  const double ttft = j["mean_ttft_ms"], tpot = j["mean_tpot_ms"], e2el = j["median_e2el_ms"];
  EXPECT_GE(ttft, 40.0);
  EXPECT_LT(ttft, 40.0 + 1000.0);
  EXPECT_GE(tpot, 12.0);
  EXPECT_LT(tpot, 20.0 + 200.0);
  EXPECT_GE(e2el, 40.0 + 4 * 20.0);
  EXPECT_GE(j["p99_itl_ms"].get<double>(), j["median_itl_ms"].get<double>());
  EXPECT_NEAR(j["output_throughput"].get<double>(), 30.0 / j["duration"].get<double>(), 1e-6);

  // --save-detailed: the per-request lists.
  o.save_detailed = true;
  o.result_filename = "detailed.json";
  run_bench_serve(o, report);
  json dj = json::parse(std::ifstream(d.path / "out" / "detailed.json"));
  ASSERT_TRUE(dj.contains("ttfts") && dj.contains("itls") && dj.contains("output_lens"));
  EXPECT_EQ(dj["output_lens"], json::array({5, 5, 5, 5, 5, 5}));
  EXPECT_EQ(dj["itls"][0].size(), 4u);
  EXPECT_EQ(dj["errors"][0], "");

  // Bad flags are refused by name.
  BenchServeOptions bad = o;
  bad.metric_percentiles = "99,abc";
  EXPECT_THROW(run_bench_serve(bad, report), Error);
  bad = o;
  bad.base_url = "https://example.com";
  EXPECT_THROW(run_bench_serve(bad, report), Error);
  bad = o;
  bad.tokenizer.clear();
  EXPECT_THROW(run_bench_serve(bad, report), Error);  // the random dataset needs the vocabulary
}

// The real engine over the demo model, in process: a short run of each backend.
TEST(BenchServe, DemoModelServer) {
  auto tok = Tokenizer::from_dir(demo_dir());
  auto tmpl = ChatTemplate::from_dir(demo_dir());
  EngineConfig cfg;
  cfg.max_num_seqs = 16;
  cfg.kv_cache_mb = 64;
  AsyncEngine engine(Qwen3MoeCpu::load(demo_dir()), cfg);
  HttpServerConfig hc;
  hc.host = "127.0.0.1";
  hc.port = 0;
  hc.model_name = "demo";
  HttpServer server(hc, engine, tok.get(), tmpl.get());
  server.start();

  BenchServeOptions o;
  o.port = server.port();
  o.model = "demo";
  o.tokenizer = demo_dir();
  o.random.num_prompts = 8;
  o.random.input_len = 24;
  o.random.output_len = 8;
  o.max_concurrency = 4;
  o.ignore_eos = true;
  o.disable_tqdm = true;
  std::ostringstream report;
  auto res = run_bench_serve(o, report);
  EXPECT_EQ(res["completed"], 8) << report.str();
  EXPECT_EQ(res["failed"], 0);
  EXPECT_EQ(res["total_input_tokens"], 8 * 24);  // token-id prompts: exact lengths
  EXPECT_EQ(res["total_output_tokens"], 8 * 8);  // ignore_eos
  EXPECT_GT(res["mean_ttft_ms"].get<double>(), 0.0);
  EXPECT_GT(res["mean_tpot_ms"].get<double>(), 0.0);

  o.backend = "openai-chat";
  o.random.num_prompts = 4;
  res = run_bench_serve(o, report);
  EXPECT_EQ(res["completed"], 4) << report.str();
  EXPECT_EQ(res["total_output_tokens"], 4 * 8);
  // The chat template's tokens come on top of the prompt's (usage.prompt_tokens).
  EXPECT_GT(res["total_input_tokens"].get<int64_t>(), 4 * 16);
}

}  // namespace
}  // namespace tandem::bench
