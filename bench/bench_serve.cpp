// Load generator (like `vllm bench serve`): streams completions at a fixed concurrency and
// reports throughput, TTFT and inter-token latency percentiles. The baseline in the same run
// is the engine driven directly (no HTTP, no tokenizer): the ratio is what the front costs.
//   build/bench_serve [--model DIR] [--url http://host:port] [--concurrency 1,16,64]
//                     [--requests N] [--max-tokens T] [--null-model] [--http-threads N]
// Without --url it starts an in-process server on a free loopback port.
// --null-model: DIR's config and tokenizer over a model that computes nothing and "samples on
// its device" (a pseudo-random token per row at once, as a GPU model returns sampled ids): the
// figures are then the front's own ceiling on this machine (HTTP, SSE encoding,
// detokenization, the engine's host work per step, and this client), the bound a serving
// figure cannot pass whatever the GPU does.
#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "model/qwen3_moe.h"
#include "server/http/http_server.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

#ifndef TANDEM_DEMO_MODEL_DIR
#define TANDEM_DEMO_MODEL_DIR "models/demo"
#endif

using namespace tandem;
using Clock = std::chrono::steady_clock;

namespace {

double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

const char* kPrompts[] = {
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home",
    "The family of Dashwood had long been settled in Sussex.",
    "No one who had ever seen Catherine Morland in her infancy",
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who",
    "About thirty years ago Miss Maria Ward, of Huntingdon, with only seven thousand pounds",
    "She was",
    "The weather was fine, and the party set out for the park",
};

// A model that computes nothing (--null-model): KV of one tiny layer, each logits row's token
// drawn from (position, sequence length) at once, never an EOS (the requests ignore it anyway).
class NullModel final : public Model {
 public:
  explicit NullModel(ModelConfig c) : c_(std::move(c)) {}
  const ModelConfig& config() const override { return c_; }
  KvGeometry kv_geometry(int64_t pages, int64_t page) const override {
    return KvGeometry{1, pages, 1, page, 8};
  }
  void forward(const ForwardBatch& b, KvCache&, std::vector<float>& logits) override {
    const int64_t rows = b.num_logit_rows();
    logits.assign(static_cast<size_t>(rows * c_.vocab_size), 0.0f);
    int64_t r = 0;
    for (const auto& s : b.seqs) {
      const int64_t n = s.logits == LogitsMode::kAll ? s.num_tokens : s.logits == LogitsMode::kLast;
      for (int64_t i = 0; i < n; ++i, ++r) {
        logits[static_cast<size_t>(r * c_.vocab_size + token(s, i))] = 10.0f;
      }
    }
  }
  bool samples_on_device() const override { return true; }
  void forward_sample(const ForwardBatch& b, KvCache&, const std::vector<DeviceSampling>& rows,
                      std::vector<SampledToken>& out,
                      const std::function<void()>& wait_masks = {}) override {
    if (wait_masks) wait_masks();
    out.clear();
    for (const auto& s : b.seqs) {
      const int64_t n = s.logits == LogitsMode::kAll ? s.num_tokens : s.logits == LogitsMode::kLast;
      for (int64_t i = 0; i < n; ++i) out.push_back({token(s, i), 0.0f, {}});
    }
    out.resize(rows.size());
  }

 private:
  // Ids in [1000, 1000 + 8000) of the vocabulary (ordinary text pieces, not special tokens).
  int32_t token(const ForwardSeq& s, int64_t i) const {
    const int64_t span = std::max<int64_t>(1, std::min<int64_t>(8000, c_.vocab_size - 1000));
    const uint64_t h = static_cast<uint64_t>(s.start_pos + i) * 0x9e3779b97f4a7c15ull ^
                       static_cast<uint64_t>(s.num_pages) * 0xbf58476d1ce4e5b9ull;
    return static_cast<int32_t>(std::min<int64_t>(c_.vocab_size - 1, 1000 + (h >> 33) % span));
  }
  ModelConfig c_;
};

struct RequestStats {
  double ttft = 0;
  std::vector<double> itl;
  int tokens = 0;
  bool ok = false;
};

struct StreamState {
  Clock::time_point start, last;
  RequestStats* stats;
  std::string buf;
  bool first = true;
};

size_t on_data(char* ptr, size_t size, size_t n, void* user) {
  auto* st = static_cast<StreamState*>(user);
  st->buf.append(ptr, size * n);
  size_t pos;
  while ((pos = st->buf.find("\n\n")) != std::string::npos) {
    std::string ev = st->buf.substr(0, pos);
    st->buf.erase(0, pos + 2);
    if (ev.rfind("data: ", 0) != 0) continue;
    std::string data = ev.substr(6);
    if (data == "[DONE]") {
      st->stats->ok = true;
      continue;
    }
    auto j = nlohmann::json::parse(data, nullptr, false);
    if (j.is_discarded() || !j.contains("choices") || j["choices"].empty()) continue;
    auto now = Clock::now();
    if (st->first) {
      st->stats->ttft = secs(st->start, now);
      st->first = false;
    } else {
      st->stats->itl.push_back(secs(st->last, now));
    }
    st->last = now;
    ++st->stats->tokens;
  }
  return size * n;
}

RequestStats http_request(const std::string& url, const std::string& prompt, int max_tokens) {
  RequestStats rs;
  StreamState st{Clock::now(), Clock::now(), &rs, {}, true};
  nlohmann::json body = {{"model", "bench"},   {"prompt", prompt}, {"max_tokens", max_tokens},
                         {"temperature", 0.8}, {"stream", true},   {"ignore_eos", true}};
  std::string payload = body.dump();
  CURL* c = curl_easy_init();
  curl_slist* hdr = curl_slist_append(nullptr, "Content-Type: application/json");
  curl_easy_setopt(c, CURLOPT_URL, (url + "/v1/completions").c_str());
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdr);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, payload.c_str());
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &st);
  st.start = Clock::now();
  CURLcode rc = curl_easy_perform(c);
  if (rc != CURLE_OK) rs.ok = false;
  curl_slist_free_all(hdr);
  curl_easy_cleanup(c);
  return rs;
}

// The same requests straight into the engine (token ids from the same tokenizer).
RequestStats engine_request(EngineClient& engine, const std::vector<int32_t>& ids, int max_tokens,
                            const std::string& id) {
  RequestStats rs;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  auto start = Clock::now(), last = start;
  GenRequest r;
  r.id = id;
  r.prompt_ids = ids;
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.sampling.temperature = 0.8f;
  engine.submit(r, [&](const StepOutput& o) {
    std::lock_guard<std::mutex> lock(mu);
    auto now = Clock::now();
    for (size_t i = 0; i < o.token_ids.size(); ++i) {
      if (rs.tokens == 0)
        rs.ttft = secs(start, now);
      else
        rs.itl.push_back(secs(last, now));
      last = now;
      ++rs.tokens;
    }
    if (o.finished) {
      rs.ok = o.finish_reason == FinishReason::kLength;
      done = true;
      cv.notify_all();
    }
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  return rs;
}

struct Summary {
  double wall = 0, tok_s = 0, ttft_p50 = 0, ttft_p99 = 0, itl_p50 = 0, itl_p99 = 0;
  int ok = 0, total = 0;
  int64_t tokens = 0;  // received (an SSE event with a choice counts as one token)
};

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

template <typename F>
Summary run_load(int concurrency, int requests, F&& one) {
  std::vector<RequestStats> all(static_cast<size_t>(requests));
  std::atomic<int> next{0};
  auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int c = 0; c < concurrency; ++c) {
    threads.emplace_back([&] {
      for (int i; (i = next++) < requests;) all[static_cast<size_t>(i)] = one(i);
    });
  }
  for (auto& t : threads) t.join();
  Summary s;
  s.wall = secs(t0, Clock::now());
  std::vector<double> ttft, itl;
  int tokens = 0;
  for (const auto& r : all) {
    s.ok += r.ok;
    ++s.total;
    tokens += r.tokens;
    ttft.push_back(r.ttft);
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
  }
  s.tokens = tokens;
  s.tok_s = tokens / s.wall;
  s.ttft_p50 = pct(ttft, 0.5) * 1e3;
  s.ttft_p99 = pct(ttft, 0.99) * 1e3;
  s.itl_p50 = pct(itl, 0.5) * 1e3;
  s.itl_p99 = pct(itl, 0.99) * 1e3;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = TANDEM_DEMO_MODEL_DIR, url, conc = "1,16,64";
  int requests = 0, max_tokens = 64, http_threads = 2;
  bool null_model = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const bool has = i + 1 < argc;
    if (k == "--null-model") {
      null_model = true;
    } else if (k == "--model" && has) {
      model_dir = argv[++i];
    } else if (k == "--url" && has) {
      url = argv[++i];
    } else if (k == "--concurrency" && has) {
      conc = argv[++i];
    } else if (k == "--requests" && has) {
      requests = std::stoi(argv[++i]);
    } else if (k == "--max-tokens" && has) {
      max_tokens = std::stoi(argv[++i]);
    } else if (k == "--http-threads" && has) {
      http_threads = std::stoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: bench_serve [--model DIR] [--url URL] [--concurrency 1,16,64] "
                   "[--requests N] [--max-tokens T] [--null-model] [--http-threads N]\n");
      return 2;
    }
  }
  curl_global_init(CURL_GLOBAL_ALL);
  auto tok = Tokenizer::from_dir(model_dir);
  auto chat = ChatTemplate::from_dir(model_dir);
  EngineConfig cfg;
  cfg.max_num_seqs = 256;
  cfg.enable_prefix_cache = false;  // the prompts repeat: keep both paths equally cold
  std::unique_ptr<Model> model;
  if (null_model) {
    model = std::make_unique<NullModel>(ModelConfig::from_dir(model_dir));
  } else {
    model = Qwen3MoeCpu::load(model_dir);
  }
  AsyncEngine engine(std::move(model), cfg);
  std::unique_ptr<HttpServer> server;
  if (url.empty()) {
    HttpServerConfig hc;
    hc.host = "127.0.0.1";
    hc.port = 0;
    hc.model_name = "bench";
    hc.num_threads = http_threads;
    server = std::make_unique<HttpServer>(hc, engine, tok.get(), chat.get());
    server->start();
    url = "http://127.0.0.1:" + std::to_string(server->port());
  }
  std::vector<std::vector<int32_t>> ids;
  for (const char* p : kPrompts) ids.push_back(tok->encode(p));
  const int np = static_cast<int>(std::size(kPrompts));

  std::printf(
      "model %s%s, %d output tokens per request, ignore_eos, temperature 0.8, %d HTTP "
      "threads, %u hardware threads\n",
      model_dir.c_str(), null_model ? " (null model: the front's ceiling)" : "", max_tokens,
      http_threads, std::thread::hardware_concurrency());
  std::printf("%-5s %-7s %5s %9s %9s %9s %9s %8s %8s %9s\n", "conc", "path", "ok", "tokens",
              "tok/s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "ratio");
  std::stringstream ss(conc);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int c = std::stoi(item);
    int n = requests > 0 ? requests : std::max(8, 2 * c);
    Summary direct = run_load(c, n, [&](int i) {
      return engine_request(engine, ids[static_cast<size_t>(i % np)], max_tokens,
                            "direct-" + std::to_string(c) + "-" + std::to_string(i));
    });
    Summary http =
        run_load(c, n, [&](int i) { return http_request(url, kPrompts[i % np], max_tokens); });
    for (auto [name, s] : {std::pair<const char*, Summary&>{"engine", direct}, {"http", http}}) {
      std::printf("%-5d %-7s %2d/%-2d %9lld %9.1f %9.1f %9.1f %8.2f %8.2f %9.2f\n", c, name, s.ok,
                  s.total, static_cast<long long>(s.tokens), s.tok_s, s.ttft_p50, s.ttft_p99,
                  s.itl_p50, s.itl_p99, s.tok_s / direct.tok_s);
    }
  }
  if (server) server->stop();
  curl_global_cleanup();
  return 0;
}
