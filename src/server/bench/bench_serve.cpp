// `tandem bench serve`: datasets, arrivals, metrics, vLLM's report and result JSON. The HTTP
// side is load_client.cpp.
#include "server/bench/bench_serve.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include "core/env.h"
#include "core/error.h"
#include "server/startup.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem::bench {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

/// Uniform integer in [lo, hi] (both inclusive).
int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

/// Python's repr of a float as vLLM's file names print it ("inf", "10.0", "2.5").
std::string py_float(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, end);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

/// "99" for 99.0, "99.9" for 99.9 (vLLM's p_word).
std::string p_word(double p) {
  if (std::floor(p) == p) return std::to_string(static_cast<int64_t>(p));
  return py_float(p);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

/// http://host[:port][/path] -> host, port, path ("" when none).
void parse_base_url(const std::string& url, std::string& host, uint16_t& port, std::string& path) {
  TANDEM_CHECK_KIND(kInvalidArgument, url.rfind("https://", 0) != 0, "--base-url ", url,
                    ": https is not supported by this client (use http, or a TLS proxy)");
  const std::string prefix = "http://";
  TANDEM_CHECK_KIND(kInvalidArgument, url.rfind(prefix, 0) == 0, "--base-url ", url,
                    ": expected http://HOST[:PORT][/PATH]");
  std::string rest = url.substr(prefix.size());
  const size_t slash = rest.find('/');
  path = slash == std::string::npos ? "" : rest.substr(slash);
  while (!path.empty() && path.back() == '/') path.pop_back();
  std::string hp = rest.substr(0, slash);
  port = 80;
  std::string h = hp;
  if (!hp.empty() && hp[0] == '[') {  // [v6]:port
    const size_t close = hp.find(']');
    TANDEM_CHECK_KIND(kInvalidArgument, close != std::string::npos, "--base-url ", url,
                      ": unterminated [ in the host");
    h = hp.substr(1, close - 1);
    if (close + 1 < hp.size() && hp[close + 1] == ':')
      hp = hp.substr(close + 2);
    else
      hp.clear();
  } else if (const size_t colon = hp.rfind(':'); colon != std::string::npos) {
    h = hp.substr(0, colon);
    hp = hp.substr(colon + 1);
  } else {
    hp.clear();
  }
  if (!hp.empty()) {
    int p = 0;
    auto [end, ec] = std::from_chars(hp.data(), hp.data() + hp.size(), p);
    TANDEM_CHECK_KIND(kInvalidArgument,
                      ec == std::errc() && end == hp.data() + hp.size() && p > 0 && p < 65536,
                      "--base-url ", url, ": bad port '", hp, "'");
    port = static_cast<uint16_t>(p);
  }
  TANDEM_CHECK_KIND(kInvalidArgument, !h.empty(), "--base-url ", url, ": no host");
  host = h;
}

/// The vocabulary a random prompt draws from: the tokenizer's ids without its added tokens
/// (vLLM: range(tokenizer.vocab_size) less the special ids), or config.json's vocab_size.
void random_vocabulary(const std::string& dir, const Tokenizer* tok, std::vector<int32_t>& allowed,
                       int64_t& vocab_size) {
  allowed.clear();
  if (tok) {
    std::vector<bool> added(static_cast<size_t>(tok->vocab_size()), false);
    for (const auto& a : tok->added_tokens()) {
      if (a.id >= 0 && a.id < tok->vocab_size()) added[static_cast<size_t>(a.id)] = true;
    }
    for (int32_t id = 0; id < tok->vocab_size(); ++id) {
      if (!added[static_cast<size_t>(id)] && !tok->token_bytes(id).empty()) allowed.push_back(id);
    }
    vocab_size = static_cast<int64_t>(allowed.size());
    return;
  }
  std::ifstream in(dir + "/config.json");
  TANDEM_CHECK_KIND(kInvalidArgument, static_cast<bool>(in), "--tokenizer ", dir,
                    ": neither tokenizer.json nor config.json (the random dataset needs the "
                    "vocabulary)");
  json c = json::parse(in, nullptr, /*allow_exceptions=*/false);
  const json* v = nullptr;
  if (c.is_object() && c.contains("vocab_size")) v = &c["vocab_size"];
  if (c.is_object() && !v && c.contains("text_config") && c["text_config"].is_object() &&
      c["text_config"].contains("vocab_size")) {
    v = &c["text_config"]["vocab_size"];
  }
  TANDEM_CHECK_KIND(kInvalidArgument, v && v->is_number_integer() && v->get<int64_t>() > 0, dir,
                    "/config.json: no positive integer vocab_size");
  vocab_size = v->get<int64_t>();
  allowed.resize(static_cast<size_t>(vocab_size));
  std::iota(allowed.begin(), allowed.end(), 0);
}

}  // namespace

std::vector<SampleRequest> sample_random(const RandomDatasetOptions& o,
                                         const std::vector<int32_t>& allowed, int64_t vocab_size,
                                         const Tokenizer* text_tokenizer) {
  TANDEM_CHECK_KIND(kInvalidArgument, o.range_ratio >= 0.0 && o.range_ratio < 1.0,
                    "--random-range-ratio must be in [0, 1), not ", o.range_ratio);
  TANDEM_CHECK_KIND(kInvalidArgument, !allowed.empty(), "the random dataset has no token ids");
  TANDEM_CHECK_KIND(kInvalidArgument, o.num_prompts >= 1, "--num-prompts must be at least 1");
  TANDEM_CHECK_KIND(kInvalidArgument, o.input_len >= 0 && o.output_len >= 1 && o.prefix_len >= 0,
                    "--random-input-len >= 0, --random-output-len >= 1, --random-prefix-len >= 0");
  const auto r = o.range_ratio;
  const int64_t in_lo = static_cast<int64_t>(std::floor(double(o.input_len) * (1 - r)));
  const int64_t in_hi = static_cast<int64_t>(std::ceil(double(o.input_len) * (1 + r)));
  const int64_t out_lo =
      std::max<int64_t>(1, static_cast<int64_t>(std::floor(double(o.output_len) * (1 - r))));
  const int64_t out_hi =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(double(o.output_len) * (1 + r))));
  TANDEM_CHECK_KIND(kInvalidArgument, o.prefix_len + in_lo >= 1,
                    "--random-input-len is too small: with --random-range-ratio ", r,
                    " a prompt could have ", o.prefix_len + in_lo, " tokens");
  std::mt19937_64 rng(o.seed);
  const int64_t n_allowed = static_cast<int64_t>(allowed.size());
  std::vector<int32_t> prefix;
  for (int64_t i = 0; i < o.prefix_len; ++i) {
    prefix.push_back(allowed[static_cast<size_t>(uniform(rng, 0, n_allowed - 1))]);
  }
  std::vector<SampleRequest> out;
  out.reserve(static_cast<size_t>(o.num_prompts));
  for (int64_t i = 0; i < o.num_prompts; ++i) {
    const int64_t in_len = uniform(rng, in_lo, in_hi);
    const int64_t out_len = uniform(rng, out_lo, out_hi);
    const int64_t offset = uniform(rng, 0, std::max<int64_t>(1, vocab_size) - 1);
    SampleRequest s;
    s.prompt_ids = prefix;
    s.prompt_ids.reserve(static_cast<size_t>(o.prefix_len + in_len));
    for (int64_t j = 0; j < in_len; ++j) {
      s.prompt_ids.push_back(allowed[static_cast<size_t>((offset + i + j) % n_allowed)]);
    }
    s.expected_output_len = out_len;
    s.prompt_len = static_cast<int64_t>(s.prompt_ids.size());
    if (text_tokenizer) {
      // Text whose encoding has the sampled length where the tokenizer allows it: decode,
      // re-encode, cut to the length and decode again (vLLM's decode-to-target, one pass).
      const size_t target = s.prompt_ids.size();
      s.prompt_text = text_tokenizer->decode(s.prompt_ids);
      std::vector<int32_t> ids = text_tokenizer->encode(s.prompt_text, /*parse_special=*/false);
      if (ids.size() > target) {
        ids.resize(target);
        s.prompt_text = text_tokenizer->decode(ids);
        ids = text_tokenizer->encode(s.prompt_text, /*parse_special=*/false);
      }
      s.prompt_len = static_cast<int64_t>(ids.size());
      s.prompt_ids.clear();
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<SampleRequest> sample_sharegpt(const std::string& path, const Tokenizer& tokenizer,
                                           int64_t num_prompts, uint64_t seed, int64_t output_len) {
  std::ifstream in(path);
  TANDEM_CHECK_KIND(kInvalidArgument, static_cast<bool>(in), "--dataset-path ", path,
                    ": cannot open");
  json data = json::parse(in, nullptr, /*allow_exceptions=*/false);
  TANDEM_CHECK_KIND(kInvalidArgument, data.is_array(), path,
                    ": not a ShareGPT JSON array of {\"conversations\": [...]}");
  std::vector<std::pair<std::string, std::string>> pairs;  // (prompt, completion)
  for (size_t i = 0; i < data.size(); ++i) {
    const json& e = data[i];
    if (!e.is_object() || !e.contains("conversations")) continue;
    const json& c = e["conversations"];
    if (!c.is_array() || c.size() < 2) continue;
    auto value = [&](size_t k) {
      TANDEM_CHECK_KIND(kInvalidArgument,
                        c[k].is_object() && c[k].contains("value") && c[k]["value"].is_string(),
                        path, ": entry ", i, ": conversations[", k, "].value is not a string");
      return c[k]["value"].get<std::string>();
    };
    pairs.emplace_back(value(0), value(1));
  }
  std::mt19937_64 rng(seed);
  std::shuffle(pairs.begin(), pairs.end(), rng);
  std::vector<SampleRequest> out;
  for (const auto& [prompt, completion] : pairs) {
    if (static_cast<int64_t>(out.size()) >= num_prompts) break;
    const int64_t prompt_len = static_cast<int64_t>(tokenizer.encode(prompt).size());
    const int64_t out_len =
        output_len >= 0 ? output_len : static_cast<int64_t>(tokenizer.encode(completion).size());
    // vLLM's is_valid_sequence: min 4, prompt <= 1024, prompt + output <= 2048.
    if (prompt_len < 4 || (output_len < 0 && out_len < 4) || prompt_len > 1024 ||
        prompt_len + out_len > 2048) {
      continue;
    }
    SampleRequest s;
    s.prompt_text = prompt;
    s.prompt_len = prompt_len;
    s.expected_output_len = std::max<int64_t>(1, out_len);
    out.push_back(std::move(s));
  }
  TANDEM_CHECK_KIND(kInvalidArgument, !out.empty(), path,
                    ": no usable conversation (two turns, prompt 4..1024 tokens, total <= 2048)");
  const size_t have = out.size();
  while (static_cast<int64_t>(out.size()) < num_prompts) {  // oversample, as vLLM
    out.push_back(out[static_cast<size_t>(uniform(rng, 0, static_cast<int64_t>(have) - 1))]);
  }
  return out;
}

std::vector<double> arrival_times(int64_t n, double request_rate, double burstiness,
                                  uint64_t seed) {
  TANDEM_CHECK_KIND(kInvalidArgument, request_rate > 0, "--request-rate must be positive");
  TANDEM_CHECK_KIND(kInvalidArgument, burstiness > 0, "--burstiness must be positive");
  std::vector<double> t(static_cast<size_t>(std::max<int64_t>(0, n)), 0.0);
  if (std::isinf(request_rate) || t.empty()) return t;
  if (std::isinf(burstiness)) {
    for (size_t i = 0; i < t.size(); ++i) t[i] = double(i + 1) / request_rate;
  } else {
    std::mt19937_64 rng(seed);
    std::gamma_distribution<double> gap(burstiness, 1.0 / (request_rate * burstiness));
    double sum = 0;
    for (auto& v : t) v = (sum += gap(rng));
  }
  const double target = double(n) / request_rate;
  if (t.back() > 0) {
    const double f = target / t.back();
    for (auto& v : t) v *= f;
  }
  return t;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * double(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - double(lo));
}

MetricStats metric_stats(const std::vector<double>& seconds, const std::vector<double>& ps) {
  MetricStats m;
  if (!seconds.empty()) {
    double sum = 0;
    for (double x : seconds) sum += x;
    const double mean = sum / double(seconds.size());
    double var = 0;
    for (double x : seconds) var += (x - mean) * (x - mean);
    m.mean_ms = mean * 1000;
    m.std_ms = std::sqrt(var / double(seconds.size())) * 1000;
    m.median_ms = percentile(seconds, 50) * 1000;
  }
  for (double p : ps) m.percentiles_ms.emplace_back(p, percentile(seconds, p) * 1000);
  return m;
}

BenchMetrics compute_metrics(const std::vector<RequestOutput>& outputs, double duration_s,
                             const std::vector<double>& ps, const Tokenizer* tokenizer) {
  BenchMetrics m;
  std::vector<double> ttfts, tpots, itls, e2els;
  for (const RequestOutput& o : outputs) {
    if (!o.success) {
      m.output_lens.push_back(0);
      ++m.failed;
      continue;
    }
    int64_t out_len = o.output_tokens;
    if (out_len <= 0) {
      out_len = tokenizer ? static_cast<int64_t>(tokenizer->encode(o.generated_text, false).size())
                          : o.chunks;
    }
    m.output_lens.push_back(out_len);
    m.total_input += o.prompt_len;
    if (out_len > 1) tpots.push_back((o.latency - o.ttft) / double(out_len - 1));
    itls.insert(itls.end(), o.itl.begin(), o.itl.end());
    ttfts.push_back(o.ttft);
    e2els.push_back(o.latency);
    ++m.completed;
  }
  for (int64_t l : m.output_lens) m.total_output += l;
  const double d = duration_s > 0 ? duration_s : 1e-9;
  m.request_throughput = double(m.completed) / d;
  m.output_throughput = double(m.total_output) / d;
  m.total_token_throughput = double(m.total_input + m.total_output) / d;
  m.ttft = metric_stats(ttfts, ps);
  m.tpot = metric_stats(tpots, ps);
  m.itl = metric_stats(itls, ps);
  m.e2el = metric_stats(e2els, ps);

  // Peak output tokens in one second of the run, and the peak number of requests in flight.
  double t_min = std::numeric_limits<double>::infinity(), t_max = 0;
  for (const RequestOutput& o : outputs) {
    if (!o.success) continue;
    t_min = std::min(t_min, o.start_time);
    t_max = std::max(t_max, o.start_time + o.latency);
  }
  if (m.completed > 0) {
    const size_t secs = static_cast<size_t>(std::ceil(t_max - t_min)) + 1;
    std::vector<double> per_s(secs, 0.0);
    std::vector<std::pair<double, int>> events;
    for (const RequestOutput& o : outputs) {
      if (!o.success) continue;
      double t = o.start_time + o.ttft;
      auto add = [&](double at) {
        const double b = std::floor(at - t_min);
        if (b >= 0 && b < double(secs)) per_s[static_cast<size_t>(b)] += 1;
      };
      add(t);
      for (double g : o.itl) add(t += g);
      events.emplace_back(o.start_time, 1);
      events.emplace_back(o.start_time + o.latency, -1);
    }
    std::sort(events.begin(), events.end());  // a departure (-1) before an arrival at a tie
    int64_t cur = 0;
    for (const auto& e : events)
      m.max_concurrent_requests = std::max(m.max_concurrent_requests, cur += e.second);
    m.max_output_tokens_per_s = *std::max_element(per_s.begin(), per_s.end());
  }
  return m;
}

namespace {

void print_row(std::ostream& out, const std::string& label, const std::string& value) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "%-40s %-10s\n", label.c_str(), value.c_str());
  out << buf;
}
std::string f2(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}
void print_header(std::ostream& out, const std::string& title, char fill) {
  const int n = 50, len = static_cast<int>(title.size());
  const int left = std::max(0, (n - len) / 2), right = std::max(0, n - len - left);
  out << std::string(static_cast<size_t>(left), fill) << title
      << std::string(static_cast<size_t>(right), fill) << "\n";
}

std::string now_stamp() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return buf;
}

/// The server's first model (vLLM: /v1/models data[0].id).
std::string first_model(const std::string& host, uint16_t port, const std::string& prefix,
                        const std::string& api_key) {
  auto [status, body] = http_get(host, port, prefix + "/v1/models", 30, api_key);
  TANDEM_CHECK_KIND(kInvalidArgument, status == 200, "no --model given and GET ", prefix,
                    "/v1/models on ", host, ":", port, " failed (",
                    status ? "HTTP " + std::to_string(status) : body, "): is the server up?");
  json j = json::parse(body, nullptr, false);
  TANDEM_CHECK_KIND(kInvalidArgument,
                    j.is_object() && j.contains("data") && j["data"].is_array() &&
                        !j["data"].empty() && j["data"][0].contains("id") &&
                        j["data"][0]["id"].is_string(),
                    "GET /v1/models: no model in the answer: ", body.substr(0, 200));
  return j["data"][0]["id"].get<std::string>();
}

}  // namespace

nlohmann::ordered_json run_bench_serve(const BenchServeOptions& o, std::ostream& out) {
  TANDEM_CHECK_KIND(kInvalidArgument, o.backend == "openai" || o.backend == "openai-chat",
                    "--backend must be openai or openai-chat, not '", o.backend, "'");
  TANDEM_CHECK_KIND(kInvalidArgument, o.max_concurrency >= 0, "--max-concurrency must be > 0");
  const bool chat = o.backend == "openai-chat";
  LoadOptions lo;
  std::string prefix;
  if (!o.base_url.empty()) {
    parse_base_url(o.base_url, lo.host, lo.port, prefix);
  } else {
    TANDEM_CHECK_KIND(kInvalidArgument, o.port > 0 && o.port < 65536, "--port ", o.port);
    lo.host = o.host;
    lo.port = static_cast<uint16_t>(o.port);
  }
  const std::string endpoint =
      !o.endpoint.empty() ? o.endpoint : (chat ? "/v1/chat/completions" : "/v1/completions");
  lo.path = prefix + endpoint;
  lo.chat = chat;
  if (auto k = env::text("OPENAI_API_KEY")) lo.api_key = *k;  // as vLLM's client
  // vLLM turns ignore_eos on for its random dataset on the OpenAI backends: the asked lengths.
  lo.ignore_eos = o.ignore_eos || o.dataset_name == "random";
  lo.max_concurrency = o.max_concurrency;
  lo.request_timeout_s = o.request_timeout_s;
  lo.progress = !o.disable_tqdm;
  const uint64_t fds = raise_open_file_limit();  // a socket per request in flight
  TANDEM_CHECK_KIND(kInvalidArgument,
                    o.max_concurrency == 0 || fds == 0 || uint64_t(o.max_concurrency) + 64 <= fds,
                    "--max-concurrency ", o.max_concurrency, " needs more open files than the ",
                    fds, " this process may have (ulimit -n)");

  std::vector<double> ps;
  for (const auto& s : split(o.metric_percentiles, ',')) {
    double p = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), p);
    TANDEM_CHECK_KIND(kInvalidArgument,
                      ec == std::errc() && end == s.data() + s.size() && p >= 0 && p <= 100,
                      "--metric-percentiles: bad percentile '", s, "'");
    ps.push_back(p);
  }
  const std::vector<std::string> selected = split(o.percentile_metrics, ',');
  for (const auto& m : selected) {
    TANDEM_CHECK_KIND(kInvalidArgument,
                      m == "ttft" || m == "tpot" || m == "itl" || m == "e2el" ||
                          m == "client_queue_time" || m == "e2el_including_client_queue",
                      "--percentile-metrics: unknown metric '", m,
                      "' (ttft, tpot, itl, e2el, client_queue_time, e2el_including_client_queue)");
  }

  // The extra body: sampling flags, then --extra-body over them (vLLM's order).
  json extra = json::object();
  if (o.temperature) extra["temperature"] = *o.temperature;
  if (o.top_p) extra["top_p"] = *o.top_p;
  if (o.top_k) extra["top_k"] = *o.top_k;
  if (o.min_p) extra["min_p"] = *o.min_p;
  if (!o.extra_body.empty()) {
    json e = json::parse(o.extra_body, nullptr, false);
    TANDEM_CHECK_KIND(kInvalidArgument, e.is_object(), "--extra-body must be a JSON object");
    for (auto& [k, v] : e.items()) extra[k] = v;
  }
  lo.extra_body = extra;

  // The tokenizer: --tokenizer, else --model when it is a directory (vLLM loads it by the
  // model's name).
  std::string tok_dir = o.tokenizer;
  if (tok_dir.empty() && !o.model.empty() && std::filesystem::is_directory(o.model)) {
    tok_dir = o.model;
  }
  std::unique_ptr<Tokenizer> tok;
  if (!tok_dir.empty()) {
    TANDEM_CHECK_KIND(kInvalidArgument, std::filesystem::is_directory(tok_dir), "--tokenizer ",
                      tok_dir, ": not a directory");
    tok = Tokenizer::from_dir(tok_dir);
  }

  std::string model = o.model;
  if (model.empty()) {
    model = first_model(lo.host, lo.port, prefix, lo.api_key);
    out << "Model not specified, fetched the server's first model: " << model << "\n";
  }
  lo.model = model;

  std::vector<SampleRequest> reqs;
  if (o.dataset_name == "random") {
    TANDEM_CHECK_KIND(kInvalidArgument, o.dataset_path.empty(),
                      "--dataset-name random takes no --dataset-path");
    TANDEM_CHECK_KIND(kInvalidArgument, !tok_dir.empty(),
                      "--dataset-name random needs the vocabulary: --tokenizer DIR (a model "
                      "directory with tokenizer.json, or config.json's vocab_size)");
    TANDEM_CHECK_KIND(kInvalidArgument, !chat || tok != nullptr, "--backend openai-chat with ",
                      "the random dataset needs text prompts: --tokenizer DIR with tokenizer.json");
    std::vector<int32_t> allowed;
    int64_t vocab = 0;
    random_vocabulary(tok_dir, tok.get(), allowed, vocab);
    RandomDatasetOptions r = o.random;
    r.seed = o.seed;
    // Completions get token-id prompts (exact lengths, no tokenizer round trip); chat needs text.
    reqs = sample_random(r, allowed, vocab, chat ? tok.get() : nullptr);
  } else if (o.dataset_name == "sharegpt") {
    TANDEM_CHECK_KIND(kInvalidArgument, !o.dataset_path.empty(),
                      "--dataset-name sharegpt needs --dataset-path FILE.json");
    TANDEM_CHECK_KIND(kInvalidArgument, tok != nullptr,
                      "--dataset-name sharegpt needs --tokenizer DIR (with tokenizer.json) to "
                      "count the prompts' tokens");
    reqs =
        sample_sharegpt(o.dataset_path, *tok, o.random.num_prompts, o.seed, o.sharegpt_output_len);
  } else {
    TANDEM_THROW(kInvalidArgument, "--dataset-name must be random or sharegpt, not '",
                 o.dataset_name, "'");
  }

  if (o.ready_check_timeout_s > 0) {  // the first request, alone, until it succeeds
    out << "Waiting for the endpoint (up to " << o.ready_check_timeout_s << " s)...\n";
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(o.ready_check_timeout_s);
    LoadOptions one = lo;
    one.progress = false;
    one.arrivals.clear();
    std::string last;
    for (;;) {
      double d = 0;
      auto r = run_load(one, {reqs.front()}, &d);
      if (r[0].success) break;
      last = r[0].error;
      TANDEM_CHECK_KIND(kInvalidArgument, std::chrono::steady_clock::now() < deadline,
                        "the endpoint did not answer within --ready-check-timeout-sec: ", last);
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    out << "Initial test run completed.\n";
  }
  if (o.num_warmups > 0) {
    out << "Warming up with " << o.num_warmups << " requests...\n";
    LoadOptions w = lo;
    w.arrivals.clear();
    double d = 0;
    run_load(w, std::vector<SampleRequest>(static_cast<size_t>(o.num_warmups), reqs.front()), &d);
    out << "Warmup run completed.\n";
  }

  out << "Starting main benchmark run...\n";
  out << "Traffic request rate: " << py_float(o.request_rate) << "\n";
  out << "Burstiness factor: " << py_float(o.burstiness) << " ("
      << (o.burstiness == 1.0 ? "Poisson process" : "Gamma distribution") << ")\n";
  out << "Maximum request concurrency: "
      << (o.max_concurrency > 0 ? std::to_string(o.max_concurrency) : "None") << "\n"
      << std::flush;
  lo.arrivals =
      arrival_times(static_cast<int64_t>(reqs.size()), o.request_rate, o.burstiness, o.seed);
  double duration = 0;
  const std::vector<RequestOutput> outputs = run_load(lo, reqs, &duration);
  const BenchMetrics m = compute_metrics(outputs, duration, ps, tok.get());

  int shown = 0;
  for (const RequestOutput& r : outputs) {
    if (r.success) continue;
    if (shown == 0) out << "Failed requests during benchmark run detected (capping to 10):\n";
    if (shown < 10) out << "Error " << shown << ": " << r.error << "\n";
    ++shown;
  }
  print_header(out, " Serving Benchmark Result ", '=');
  print_row(out, "Successful requests:", std::to_string(m.completed));
  print_row(out, "Failed requests:", std::to_string(m.failed));
  if (o.max_concurrency > 0) {
    print_row(out, "Maximum request concurrency:", std::to_string(o.max_concurrency));
  }
  if (!std::isinf(o.request_rate))
    print_row(out, "Request rate configured (RPS):", f2(o.request_rate));
  print_row(out, "Benchmark duration (s):", f2(duration));
  print_row(out, "Total input tokens:", std::to_string(m.total_input));
  print_row(out, "Total generated tokens:", std::to_string(m.total_output));
  print_row(out, "Request throughput (req/s):", f2(m.request_throughput));
  print_row(out, "Output token throughput (tok/s):", f2(m.output_throughput));
  print_row(out, "Peak output token throughput (tok/s):", f2(m.max_output_tokens_per_s));
  print_row(out, "Peak concurrent requests:", f2(double(m.max_concurrent_requests)));
  print_row(out, "Total token throughput (tok/s):", f2(m.total_token_throughput));

  ojson res;
  res["date"] = now_stamp();
  res["endpoint_type"] = o.backend;
  res["backend"] = o.backend;
  res["label"] = o.label.empty() ? ojson(nullptr) : ojson(o.label);
  res["model_id"] = model;
  res["tokenizer_id"] = tok_dir.empty() ? ojson(nullptr) : ojson(tok_dir);
  res["num_prompts"] = o.random.num_prompts;
  for (const auto& kv : o.metadata) {
    const size_t eq = kv.find('=');
    TANDEM_CHECK_KIND(kInvalidArgument, eq != std::string::npos && eq > 0,
                      "--metadata: expected KEY=VALUE, not '", kv, "'");
    res[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  if (std::isinf(o.request_rate))
    res["request_rate"] = "inf";
  else
    res["request_rate"] = o.request_rate;
  res["burstiness"] = o.burstiness;
  res["max_concurrency"] = o.max_concurrency > 0 ? ojson(o.max_concurrency) : ojson(nullptr);
  res["duration"] = duration;
  res["completed"] = m.completed;
  res["failed"] = m.failed;
  res["total_input_tokens"] = m.total_input;
  res["total_output_tokens"] = m.total_output;
  res["request_throughput"] = m.request_throughput;
  res["request_goodput"] = nullptr;
  res["output_throughput"] = m.output_throughput;
  res["total_token_throughput"] = m.total_token_throughput;
  ojson input_lens = ojson::array(), ttfts = ojson::array(), itls = ojson::array(),
        latencies = ojson::array(), starts = ojson::array(), queues = ojson::array(),
        texts = ojson::array(), errors = ojson::array();
  std::vector<double> queue_s, e2el_queue_s;
  for (const RequestOutput& r : outputs) {
    input_lens.push_back(r.prompt_len);
    ttfts.push_back(r.ttft);
    itls.push_back(r.itl);
    latencies.push_back(r.latency);
    starts.push_back(r.start_time);
    queues.push_back(r.queue_time);
    texts.push_back(r.generated_text);
    errors.push_back(r.error);
    if (r.success) {
      queue_s.push_back(r.queue_time);
      e2el_queue_s.push_back(r.latency + r.queue_time);
    }
  }
  if (o.save_detailed) {
    res["input_lens"] = input_lens;
    res["output_lens"] = m.output_lens;
    res["ttfts"] = ttfts;
    res["itls"] = itls;
  }
  res["latencies"] = latencies;
  if (o.save_detailed) res["start_times"] = starts;
  res["queue_times"] = queues;
  if (o.save_detailed) {
    res["generated_texts"] = texts;
    res["errors"] = errors;
  }
  res["max_output_tokens_per_s"] = m.max_output_tokens_per_s;
  res["max_concurrent_requests"] = m.max_concurrent_requests;
  res["rtfx"] = 0.0;

  auto metric = [&](const std::string& key, const std::string& name, const std::string& header,
                    const MetricStats& s) {
    if (std::find(selected.begin(), selected.end(), key) == selected.end()) return;
    print_header(out, header, '-');
    print_row(out, "Mean " + name + " (ms):", f2(s.mean_ms));
    print_row(out, "Median " + name + " (ms):", f2(s.median_ms));
    res["mean_" + key + "_ms"] = s.mean_ms;
    res["median_" + key + "_ms"] = s.median_ms;
    res["std_" + key + "_ms"] = s.std_ms;
    for (const auto& [p, v] : s.percentiles_ms) {
      print_row(out, "P" + p_word(p) + " " + name + " (ms):", f2(v));
      res["p" + p_word(p) + "_" + key + "_ms"] = v;
    }
  };
  metric("ttft", "TTFT", "Time to First Token", m.ttft);
  metric("tpot", "TPOT", "Time per Output Token (excl. 1st token)", m.tpot);
  metric("itl", "ITL", "Inter-token Latency", m.itl);
  metric("e2el", "E2EL", "End-to-end Latency", m.e2el);
  if (o.max_concurrency > 0) {
    metric("client_queue_time", "Client Queue Time", "Client-side Queueing",
           metric_stats(queue_s, ps));
    if (!std::isinf(o.request_rate)) {
      metric("e2el_including_client_queue", "E2EL incl. Client Queue",
             "Queue-inclusive End-to-end Latency", metric_stats(e2el_queue_s, ps));
    }
  }
  out << std::string(50, '=') << "\n" << std::flush;

  if (o.save_result) {
    std::string name = o.result_filename;
    if (name.empty()) {
      std::string base = model;
      if (const size_t s = base.rfind('/'); s != std::string::npos) base = base.substr(s + 1);
      name = (o.label.empty() ? o.backend : o.label) + "-" + py_float(o.request_rate) + "qps" +
             (o.max_concurrency > 0 ? "-concurrency" + std::to_string(o.max_concurrency) : "") +
             "-" + base + "-" + res["date"].get<std::string>() + ".json";
    }
    if (!o.result_dir.empty()) {
      std::filesystem::create_directories(o.result_dir);
      name = (std::filesystem::path(o.result_dir) / name).string();
    }
    std::ofstream f(name);
    TANDEM_CHECK_KIND(kInvalidArgument, static_cast<bool>(f), "cannot write the result to ", name);
    f << res.dump();
    TANDEM_CHECK_KIND(kIo, static_cast<bool>(f), "writing ", name, " failed");
    out << "Result written to " << name << "\n";
  }
  return res;
}

}  // namespace tandem::bench
