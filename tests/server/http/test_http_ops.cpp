// HTTP conformance and operations over the fake engine: HEAD on a keep-alive connection,
// OPTIONS and CORS, X-Request-Id, the access log, idle / header timeouts, /ready, a 429 with
// Retry-After for a request that never started, and graceful drain.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <regex>
#include <thread>

#include "server/http/connection.h"
#include "server/http/http_test_util.h"

namespace tandem::testing {

using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

/// One raw TCP connection: send bytes, read one response head (and a body of its length).
class RawConn {
 public:
  explicit RawConn(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    timeout(2000);
  }
  ~RawConn() { close(fd_); }
  bool ok() const { return ok_; }
  void timeout(int ms) {
    timeval tv{ms / 1000, (ms % 1000) * 1000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  void send_all(const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      ssize_t n = send(fd_, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return;
      off += size_t(n);
    }
  }
  /// Reads until the head is complete; the head (without the blank line) or "" on close.
  std::string read_head() {
    for (;;) {
      size_t end = buf_.find("\r\n\r\n");
      if (end != std::string::npos) {
        std::string head = buf_.substr(0, end);
        buf_.erase(0, end + 4);
        return head;
      }
      if (!fill()) return "";
    }
  }
  std::string read_body(size_t n) {
    while (buf_.size() < n && fill()) {
    }
    std::string body = buf_.substr(0, n);
    buf_.erase(0, std::min(n, buf_.size()));
    return body;
  }
  /// Bytes that arrive within the receive timeout beyond what was read.
  std::string rest() {
    while (fill()) {
    }
    return std::move(buf_);
  }
  /// True when the server closed the connection (recv returned 0) within the timeout.
  bool closed_by_peer() {
    char c;
    return recv(fd_, &c, 1, 0) == 0;
  }

 private:
  bool fill() {
    char b[4096];
    ssize_t n = recv(fd_, b, sizeof(b), 0);
    if (n <= 0) return false;
    buf_.append(b, size_t(n));
    return true;
  }
  int fd_ = -1;
  bool ok_ = false;
  std::string buf_;
};

std::string header_value(const std::string& head, const std::string& name) {
  std::regex re("(^|\r\n)" + name + ": ([^\r\n]*)", std::regex::icase);
  std::smatch m;
  return std::regex_search(head, m, re) ? m[2].str() : "";
}

size_t content_length(const std::string& head) {
  const std::string v = header_value(head, "Content-Length");
  return v.empty() ? 0 : std::stoul(v);
}

/// Collects access-log lines from any thread.
struct LogSink {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> fn() {
    return [this](const std::string& l) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(l);
    };
  }
  std::vector<std::string> wait(size_t n) {
    for (int i = 0; i < 200; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu);
        if (lines.size() >= n) return lines;
      }
      std::this_thread::sleep_for(10ms);
    }
    std::lock_guard<std::mutex> lock(mu);
    return lines;
  }
};

TEST_F(HttpServerTest, HeadIsGetWithoutBodyAndKeepsTheConnectionUsable) {
  start();
  RawConn c(server_->port());
  ASSERT_TRUE(c.ok());
  // The probe aiperf sends: HEAD /metrics, then a GET on the same connection.
  c.send_all("HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string head = c.read_head();
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_GT(content_length(head), 0u) << head;  // the GET's length, no body
  c.send_all("GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
  head = c.read_head();
  ASSERT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  json models = json::parse(c.read_body(content_length(head)));
  EXPECT_EQ(models["object"], "list");
  // HEAD of a POST-only route: 405 without a body, the connection still usable.
  c.send_all("HEAD /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n");
  head = c.read_head();
  EXPECT_EQ(head.rfind("HTTP/1.1 405", 0), 0u) << head;
  c.send_all("GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  head = c.read_head();
  EXPECT_EQ(head.rfind("HTTP/1.1 200", 0), 0u) << head;
  EXPECT_EQ(c.rest(), "");  // nothing stray: no body after either HEAD
}

TEST_F(HttpServerTest, CorsOnlyForAllowedOrigins) {
  start();  // default: no allowed origins
  auto r = client_.get(url("/v1/models"), {"Origin: http://ui.example"});
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(header_value(r.headers, "Access-Control-Allow-Origin"), "");
  auto pre = client_.request("OPTIONS", url("/v1/chat/completions"), "",
                             {"Origin: http://ui.example", "Access-Control-Request-Method: POST"});
  EXPECT_EQ(pre.status, 400) << pre.body;
  auto plain = client_.request("OPTIONS", url("/v1/models"));
  EXPECT_EQ(plain.status, 204);
  EXPECT_NE(header_value(plain.headers, "Allow").find("POST"), std::string::npos);
  server_.reset();

  HttpServerConfig cfg;
  cfg.allowed_origins = {"http://ui.example"};
  start({}, cfg);
  pre = client_.request("OPTIONS", url("/v1/chat/completions"), "",
                        {"Origin: http://ui.example", "Access-Control-Request-Method: POST",
                         "Access-Control-Request-Headers: authorization, content-type"});
  EXPECT_EQ(pre.status, 204) << pre.headers;
  EXPECT_EQ(header_value(pre.headers, "Access-Control-Allow-Origin"), "http://ui.example");
  EXPECT_NE(header_value(pre.headers, "Access-Control-Allow-Methods").find("POST"),
            std::string::npos);
  EXPECT_EQ(header_value(pre.headers, "Access-Control-Allow-Headers"),
            "authorization, content-type");
  r = client_.post(url("/v1/completions"), json{{"prompt", {1}}, {"max_tokens", 2}},
                   {"Origin: http://ui.example"});
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(header_value(r.headers, "Access-Control-Allow-Origin"), "http://ui.example");
  EXPECT_EQ(header_value(r.headers, "Vary"), "Origin");
  r = client_.get(url("/v1/models"), {"Origin: http://evil.example"});
  EXPECT_EQ(header_value(r.headers, "Access-Control-Allow-Origin"), "");
  server_.reset();

  cfg.allowed_origins = {"*"};
  start({}, cfg);
  r = client_.post(url("/v1/completions"),
                   json{{"prompt", {1}}, {"max_tokens", 2}, {"stream", true}},
                   {"Origin: http://any.example"});
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(header_value(r.headers, "Access-Control-Allow-Origin"), "*");
}

TEST_F(HttpServerTest, RequestIdEchoedOrGenerated) {
  start();
  auto r = client_.get(url("/health"), {"X-Request-Id: trace-abc.123"});
  EXPECT_EQ(header_value(r.headers, "X-Request-Id"), "trace-abc.123");
  r = client_.post(url("/v1/completions"),
                   json{{"prompt", {1}}, {"max_tokens", 2}, {"stream", true}},
                   {"X-Request-Id: stream-1"});
  EXPECT_EQ(header_value(r.headers, "X-Request-Id"), "stream-1");
  const std::string a = header_value(client_.get(url("/health")).headers, "X-Request-Id");
  const std::string b = header_value(client_.get(url("/health")).headers, "X-Request-Id");
  EXPECT_EQ(a.size(), 16u) << a;
  EXPECT_NE(a, b);
  // Not echoed when it could break the header (too long or with spaces): a fresh one.
  r = client_.get(url("/health"), {"X-Request-Id: " + std::string(200, 'x')});
  EXPECT_EQ(header_value(r.headers, "X-Request-Id").size(), 16u);
  // Errors carry it too.
  r = client_.get(url("/nope"), {"X-Request-Id: err-1"});
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(header_value(r.headers, "X-Request-Id"), "err-1");
}

TEST_F(HttpServerTest, AccessLogOneLinePerRequest) {
  LogSink sink;
  HttpServerConfig cfg;
  cfg.access_log = sink.fn();
  start({}, cfg);
  EXPECT_EQ(client_
                .post(url("/v1/completions"), json{{"prompt", {1, 2, 3}}, {"max_tokens", 5}},
                      {"X-Request-Id: log-1"})
                .status,
            200);
  EXPECT_EQ(client_
                .post(url("/v1/completions"),
                      json{{"prompt", {4, 5}}, {"max_tokens", 4}, {"stream", true}},
                      {"X-Request-Id: log-2"})
                .status,
            200);
  EXPECT_EQ(client_.get(url("/health"), {"X-Request-Id: log-3"}).status, 200);
  EXPECT_EQ(client_.post(url("/v1/completions"), std::string("{bad")).status, 400);
  std::vector<std::string> lines = sink.wait(4);
  ASSERT_EQ(lines.size(), 4u);
  std::regex gen(
      "id=log-1 method=POST path=/v1/completions status=200 prompt_tokens=3 output_tokens=5 "
      "ttft_ms=[0-9.]+ duration_ms=[0-9.]+");
  EXPECT_TRUE(std::regex_search(lines[0], gen)) << lines[0];
  std::regex stream(
      "id=log-2 method=POST path=/v1/completions status=200 prompt_tokens=2 output_tokens=4 "
      "ttft_ms=[0-9.]+ duration_ms=[0-9.]+");
  EXPECT_TRUE(std::regex_search(lines[1], stream)) << lines[1];
  EXPECT_NE(lines[2].find("id=log-3 method=GET path=/health status=200 prompt_tokens=- "
                          "output_tokens=- ttft_ms=- duration_ms="),
            std::string::npos)
      << lines[2];
  EXPECT_NE(lines[3].find("status=400"), std::string::npos) << lines[3];
}

TEST_F(HttpServerTest, HeaderTimeoutAndIdleTimeoutAreSeparate) {
  HttpServerConfig cfg;
  cfg.idle_timeout_s = 30;
  cfg.header_timeout_s = 1;
  start({}, cfg);
  {  // A started request that stalls: closed after the header timeout.
    RawConn c(server_->port());
    c.timeout(5000);
    auto t0 = std::chrono::steady_clock::now();
    c.send_all("GET /hea");
    EXPECT_TRUE(c.closed_by_peer());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GT(s, 0.5);
    EXPECT_LT(s, 4.0);
  }
  {  // An idle keep-alive connection outlives the header timeout.
    RawConn c(server_->port());
    c.send_all("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(c.read_head().rfind("HTTP/1.1 200", 0), 0u);
    std::this_thread::sleep_for(1500ms);
    c.send_all("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(c.read_head().rfind("HTTP/1.1 200", 0), 0u);
  }
  server_.reset();
  cfg.idle_timeout_s = 1;
  cfg.header_timeout_s = 30;
  start({}, cfg);
  RawConn c(server_->port());
  c.timeout(5000);
  c.send_all("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(c.read_head().rfind("HTTP/1.1 200", 0), 0u);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(c.closed_by_peer());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 4.0);
}

TEST_F(HttpServerTest, ReadyFollowsTheCallback) {
  std::atomic<bool> ok{false};
  HttpServerConfig cfg;
  cfg.ready = [&] { return ok.load(); };
  start({}, cfg);
  EXPECT_EQ(get("/ready").status, 503);
  EXPECT_EQ(get("/health").status, 200);  // liveness is not readiness
  ok = true;
  EXPECT_EQ(get("/ready").status, 200);
  EXPECT_EQ(client_.request("POST", url("/ready")).status, 405);
}

TEST_F(HttpServerTest, RequestThatNeverStartedIsA429WithRetryAfter) {
  start();
  engine_->set_error_after(0);
  engine_->set_retry_after(7);
  for (bool stream : {false, true}) {
    auto r = post("/v1/completions", {{"prompt", {1}}, {"max_tokens", 3}, {"stream", stream}});
    EXPECT_EQ(r.status, 429) << r.body;
    EXPECT_EQ(header_value(r.headers, "Retry-After"), "7");
    EXPECT_EQ(json::parse(r.body)["error"]["code"], "queue_full");
  }
  // Without retry_after_s, an engine failure before any token stays a 500 (stream: 200 and
  // an error event).
  engine_->set_retry_after(0);
  auto r = post("/v1/completions", {{"prompt", {1}}, {"max_tokens", 3}});
  EXPECT_EQ(r.status, 500);
  r = post("/v1/completions", {{"prompt", {1}}, {"max_tokens", 3}, {"stream", true}});
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("fake engine failure"), std::string::npos);
  EXPECT_NE(r.body.find("data: [DONE]"), std::string::npos);
}

TEST_F(HttpServerTest, DrainFinishesShortRequestsAndEndsTheRestWithDone) {
  FakeEngine::Options eo;
  eo.step = std::chrono::microseconds(5000);
  LogSink sink;
  HttpServerConfig cfg;
  cfg.access_log = sink.fn();
  start(eo, cfg);
  const std::string base = url("");
  HttpResult short_stream, long_stream, long_plain;
  std::thread a([&] {
    HttpClient c;
    short_stream = c.post(base + "/v1/completions",
                          json{{"prompt", {1}}, {"max_tokens", 100}, {"stream", true}});
  });
  std::thread b([&] {
    HttpClient c;
    long_stream = c.post(base + "/v1/completions",
                         json{{"prompt", {2}}, {"max_tokens", 3000}, {"stream", true}});
  });
  std::thread d([&] {
    HttpClient c;
    long_plain = c.post(base + "/v1/completions", json{{"prompt", {3}}, {"max_tokens", 3000}});
  });
  for (int i = 0; i < 2500 && engine_->submitted().size() < 3; ++i)
    std::this_thread::sleep_for(2ms);
  ASSERT_EQ(engine_->submitted().size(), 3u);
  const uint16_t port = server_->port();
  std::thread drainer([&] { server_->drain(1500ms); });
  for (int i = 0; i < 500 && !server_->draining(); ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(server_->draining());
  {  // New requests: 503 + Connection: close; /health stays 200, /ready turns 503.
    RawConn c(port);
    c.send_all("GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
    std::string head = c.read_head();
    EXPECT_EQ(head.rfind("HTTP/1.1 503", 0), 0u) << head;
    EXPECT_EQ(header_value(head, "Connection"), "close");
    HttpClient h;
    EXPECT_EQ(h.get(base + "/health").status, 200);
    EXPECT_EQ(h.get(base + "/ready").status, 503);
  }
  a.join();
  b.join();
  d.join();
  drainer.join();
  // The short stream finished inside the drain time, normally.
  EXPECT_EQ(short_stream.status, 200);
  EXPECT_NE(short_stream.body.find("\"finish_reason\":\"length\""), std::string::npos);
  EXPECT_NE(short_stream.body.find("data: [DONE]"), std::string::npos);
  // The long ones did not: an error event then [DONE]; a 500 for the non-streaming one.
  EXPECT_EQ(long_stream.status, 200);
  EXPECT_NE(long_stream.body.find("shutting down"), std::string::npos) << long_stream.body;
  EXPECT_EQ(long_stream.body.rfind("data: [DONE]\n\n"), long_stream.body.size() - 14);
  EXPECT_EQ(long_plain.status, 500);
  EXPECT_NE(long_plain.body.find("shutting down"), std::string::npos) << long_plain.body;
  EXPECT_EQ(engine_->live(), 0u);
}

TEST_F(HttpServerTest, VllmMetricNamesWithModelName) {
  HttpServerConfig cfg;
  cfg.model_name = "my-model";
  cfg.extra_metrics = [] { return std::string("extra_metric 7\n"); };
  start({}, cfg);
  ASSERT_EQ(post("/v1/completions", {{"model", "my-model"}, {"prompt", {1, 2}}, {"max_tokens", 5}})
                .status,
            200);
  ASSERT_EQ(post("/v1/completions",
                 {{"model", "my-model"}, {"prompt", {3}}, {"max_tokens", 3}, {"stream", true}})
                .status,
            200);
  // The histograms of the second request are observed once its last byte is written.
  std::string t;
  for (int i = 0; i < 100; ++i) {
    t = get("/metrics").body;
    if (t.find("vllm:request_decode_time_seconds_count{model_name=\"my-model\"} 2") !=
        std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  const std::string L = "{model_name=\"my-model\"}";
  for (const std::string& needle : {
           "vllm:num_requests_running" + L + " 0",
           "vllm:num_requests_waiting" + L + " 0",
           "vllm:kv_cache_usage_perc" + L + " 0",
           "vllm:prefix_cache_queries_total" + L + " 10",
           "vllm:prefix_cache_hits_total" + L + " 5",
           "vllm:prompt_tokens_total" + L + " 3",
           "vllm:generation_tokens_total" + L + " 8",
           std::string("vllm:request_success_total{model_name=\"my-model\",finished_reason=") +
               "\"length\"} 2",
           std::string("vllm:request_success_total{model_name=\"my-model\",finished_reason=") +
               "\"stop\"} 0",
           "vllm:time_to_first_token_seconds_count" + L + " 2",
           std::string("vllm:time_to_first_token_seconds_bucket{model_name=\"my-model\",le=") +
               "\"+Inf\"} 2",
           "vllm:inter_token_latency_seconds_count" + L + " 6",
           "vllm:e2e_request_latency_seconds_count" + L + " 2",
           "vllm:request_prefill_time_seconds_count" + L + " 2",
           "vllm:request_decode_time_seconds_count" + L + " 2",
           std::string("# TYPE vllm:e2e_request_latency_seconds histogram"),
           std::string("\nextra_metric 7\n"),
           // Per-sequence and per-request histograms: prompts of 2 and 1 tokens, 5 + 3
           // generated, n = 1 each, max_tokens 5 and 3.
           "vllm:request_prompt_tokens_count" + L + " 2",
           "vllm:request_prompt_tokens_sum" + L + " 3",
           std::string("vllm:request_prompt_tokens_bucket{model_name=\"my-model\",le=") +
               "\"1\"} 1",
           "vllm:request_generation_tokens_sum" + L + " 8",
           "vllm:request_params_max_tokens_sum" + L + " 8",
           std::string("vllm:request_params_max_tokens_bucket{model_name=\"my-model\",le=") +
               "\"2\"} 0",
           std::string("vllm:request_params_max_tokens_bucket{model_name=\"my-model\",le=") +
               "\"5\"} 2",
           "vllm:request_params_n_count" + L + " 2",
           "vllm:request_params_n_sum" + L + " 2",
           "vllm:request_max_num_generation_tokens_sum" + L + " 8",
           std::string("tandem_request_prompt_tokens_sum 3"),
           std::string("tandem_request_prefill_time_seconds_count 2"),
           // The engine's (none from this fake engine: zero counts, every bucket listed).
           "vllm:request_queue_time_seconds_count" + L + " 0",
           std::string("vllm:iteration_tokens_total_bucket{model_name=\"my-model\",le=") +
               "\"16384\"} 0",
           "vllm:iteration_tokens_total_count" + L + " 0",
           std::string("tandem_request_queue_time_seconds_count 0"),
           std::string("tandem_iteration_tokens_total_count 0"),
       }) {
    EXPECT_NE(t.find(needle), std::string::npos) << needle << "\n" << t;
  }
}

/// A connection whose post() hands its caller the last reference (the server let go of it
/// meanwhile) and whose destructor takes a while, as a session's socket close can.
class LastRefConnection : public openai::Connection {
 public:
  LastRefConnection(std::shared_ptr<openai::Connection>* owner, std::atomic<bool>* dropped,
                    std::atomic<bool>* destroyed)
      : owner_(owner), dropped_(dropped), destroyed_(destroyed) {}
  ~LastRefConnection() override {
    std::this_thread::sleep_for(200ms);
    destroyed_->store(true);
  }
  void post(std::function<void()>) override {
    owner_->reset();
    dropped_->store(true);
  }
  void respond(openai::HttpResponse) override {}
  void stream_begin() override {}
  void stream_write(std::string) override {}
  void stream_end() override {}
  void on_disconnect(std::function<void()>) override {}
  bool is_open() const override { return true; }

 private:
  std::shared_ptr<openai::Connection>* owner_;
  std::atomic<bool>* dropped_;
  std::atomic<bool>* destroyed_;
};

class IdleEngine : public EngineClient {
 public:
  void submit(GenRequest, OutputCallback) override {}
  void abort(const std::string&) override {}
  EngineStats stats() const override { return {}; }
  int64_t max_model_len() const override { return 0; }
  int64_t vocab_size() const override { return 0; }
};

// stop() closes the gate and then destroys the io_context that the sessions' sockets live in:
// an engine callback still inside post() with a session's last reference must release it
// first (ASan: a use after free in the session's socket close, HttpServerTest teardown).
TEST(EngineGate, CloseWaitsForAPostThatHoldsTheLastReference) {
  IdleEngine engine;
  openai::EngineGate gate(engine);
  std::atomic<bool> dropped{false}, destroyed{false};
  std::shared_ptr<openai::Connection> owner;
  owner = std::make_shared<LastRefConnection>(&owner, &dropped, &destroyed);
  std::weak_ptr<openai::Connection> weak = owner;
  std::thread engine_thread([&] { gate.post(weak, [] {}); });
  while (!dropped.load()) std::this_thread::yield();  // post() holds the last reference
  gate.close_and_abort_all();
  EXPECT_TRUE(destroyed.load()) << "close_and_abort_all() returned while post() held a connection";
  engine_thread.join();
}

}  // namespace
}  // namespace tandem::testing
