// The load client of `tandem bench serve`: one io thread (Boost.Asio / Beast) drives every
// stream. Requests arrive at their send times (arrival_times), wait while --max-concurrency
// are in flight, and run on keep-alive connections taken from an idle pool (a new one when
// none is idle, as aiohttp's pool). Each read of the body is stamped when it completes and its
// server-sent events are handled at once: a chunk with a choice is a token chunk (TTFT for the
// first, an ITL gap for the others, as vLLM's client), `usage` gives the token counts, an
// `error` event or a malformed one fails the request. A connection error, an HTTP status
// other than 200, a stream cut short or the request timeout fail that request alone.
// clang-format off
#include <utility>  // (first: Boost 1.74's Asio needs std::exchange)
// clang-format on
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <limits>
#include <memory>
#include <optional>

#include "core/error.h"
#include "server/bench/bench_serve.h"

namespace tandem::bench {

namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr size_t kReadChunk = 64 * 1024;
constexpr size_t kMaxErrorBody = 4096;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

/// One keep-alive connection with its read buffer (bytes past a response stay for the next).
struct Conn {
  explicit Conn(net::io_context& ioc) : stream(ioc) {}
  beast::tcp_stream stream;
  beast::flat_buffer buffer;
};

class LoadRun;

/// One request: connect (or reuse), write, read the head, then the body read by read.
class Exchange : public std::enable_shared_from_this<Exchange> {
 public:
  Exchange(LoadRun& run, size_t index);
  void start();

 private:
  void use(std::shared_ptr<Conn> conn, bool reused);
  void on_connect(beast::error_code ec);
  void on_write(beast::error_code ec);
  void on_header(beast::error_code ec);
  void read_body();
  void on_body(beast::error_code ec);
  void consume(const char* data, size_t n, Clock::time_point at);
  void handle_event(std::string_view data, Clock::time_point at);
  void finish(bool ok, std::string error);
  void deadline();

  LoadRun& run_;
  size_t index_;
  std::shared_ptr<Conn> conn_;
  bool reused_ = false;
  bool retried_ = false;
  bool got_response_ = false;  // any byte of the response head
  bool finished_ = false;
  Clock::time_point t0_, last_token_;
  http::request<http::string_body> req_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  std::unique_ptr<char[]> body_buf_;
  std::string sse_;         // body bytes not yet split into events
  std::string error_body_;  // a non-200 response's body (the start of it)
  bool first_ = false;
  std::string failure_;  // set by an event: the request fails once the read returns
};

class LoadRun {
 public:
  LoadRun(const LoadOptions& o, const std::vector<SampleRequest>& reqs)
      : o_(o),
        reqs_(reqs),
        outputs_(reqs.size()),
        arrived_(reqs.size()),
        arrival_timer_(ioc_),
        progress_timer_(ioc_) {}

  std::vector<RequestOutput> run(double* duration_s) {
    if (reqs_.empty()) {
      if (duration_s) *duration_s = 0;
      return {};
    }
    tcp::resolver resolver(ioc_);
    beast::error_code ec;
    endpoints_ = resolver.resolve(o_.host, std::to_string(o_.port), ec);
    TANDEM_CHECK_KIND(kInvalidArgument, !ec, "cannot resolve ", o_.host, ":", o_.port, ": ",
                      ec.message());
    start_ = Clock::now();
    net::post(ioc_, [this] { arrive(); });
    if (o_.progress) tick();
    ioc_.run();
    const double d = seconds(end_ - start_);
    if (duration_s) *duration_s = d;
    if (o_.progress) draw(true);
    return std::move(outputs_);
  }

  // --- for Exchange ---
  net::io_context& ioc() { return ioc_; }
  const LoadOptions& options() const { return o_; }
  const tcp::resolver::results_type& endpoints() const { return endpoints_; }
  const SampleRequest& request(size_t i) const { return reqs_[i]; }
  RequestOutput& output(size_t i) { return outputs_[i]; }
  Clock::time_point start() const { return start_; }
  Clock::time_point arrived(size_t i) const { return arrived_[i]; }

  /// An idle keep-alive connection, or null.
  std::shared_ptr<Conn> take_idle() {
    while (!idle_.empty()) {
      auto c = std::move(idle_.back());
      idle_.pop_back();
      if (c->stream.socket().is_open()) return c;
    }
    return nullptr;
  }
  void give_back(std::shared_ptr<Conn> c) { idle_.push_back(std::move(c)); }

  void on_token() { ++tokens_; }

  void done(size_t i) {
    --active_;
    ++finished_;
    if (!outputs_[i].success) ++failed_;
    end_ = Clock::now();
    if (!waiting_.empty()) {
      const size_t next = waiting_.front();
      waiting_.pop_front();
      launch(next);
    }
    if (finished_ == reqs_.size()) {
      arrival_timer_.cancel();
      progress_timer_.cancel();
      idle_.clear();  // closes the keep-alive connections
    }
  }

 private:
  // Every request whose send time has come arrives; the timer waits for the next.
  void arrive() {
    const auto now = Clock::now();
    while (next_ < reqs_.size()) {
      const double at = o_.arrivals.empty() ? 0.0 : o_.arrivals[next_];
      const auto when =
          start_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at));
      if (when > now) {
        arrival_timer_.expires_at(when);
        arrival_timer_.async_wait([this](beast::error_code ec) {
          if (!ec) arrive();
        });
        return;
      }
      const size_t i = next_++;
      arrived_[i] = now;
      if (o_.max_concurrency > 0 && active_ >= o_.max_concurrency) {
        waiting_.push_back(i);
      } else {
        launch(i);
      }
    }
  }

  void launch(size_t i) {
    ++active_;
    std::make_shared<Exchange>(*this, i)->start();
  }

  void tick() {
    draw(false);
    progress_timer_.expires_after(std::chrono::milliseconds(200));
    progress_timer_.async_wait([this](beast::error_code ec) {
      if (!ec) tick();
    });
  }

  // [#####.....] done/total, failed, elapsed, output chunks/s so far (stderr, one line).
  // A terminal gets the bar redrawn in place; a log gets a line per 10% of the requests.
  void draw(bool final) {
    const size_t n = reqs_.size();
    const int decile = static_cast<int>(10 * finished_ / n);
    if (!tty_ && !final && decile == last_decile_) return;
    last_decile_ = decile;
    const double el = seconds(Clock::now() - start_);
    const int width = 30;
    const int filled = static_cast<int>(double(finished_) / double(n) * width);
    char line[256];
    std::snprintf(line, sizeof line,
                  "\r%3d%%|%-*s| %zu/%zu [%.1fs, %lld in flight, %zu failed, %.0f chunks/s]",
                  static_cast<int>(100.0 * double(finished_) / double(n)), width,
                  std::string(static_cast<size_t>(filled), '#').c_str(), finished_, n, el,
                  static_cast<long long>(active_), failed_, el > 0 ? double(tokens_) / el : 0.0);
    std::fputs(tty_ ? line : line + 1, stderr);  // (no carriage return in a log)
    if (final || !tty_) std::fputs("\n", stderr);
    std::fflush(stderr);
  }

  const LoadOptions& o_;
  const std::vector<SampleRequest>& reqs_;
  std::vector<RequestOutput> outputs_;
  std::vector<Clock::time_point> arrived_;
  net::io_context ioc_;
  tcp::resolver::results_type endpoints_;
  net::steady_timer arrival_timer_, progress_timer_;
  std::vector<std::shared_ptr<Conn>> idle_;
  std::deque<size_t> waiting_;
  size_t next_ = 0, finished_ = 0, failed_ = 0;
  int64_t active_ = 0;
  uint64_t tokens_ = 0;
  const bool tty_ = ::isatty(STDERR_FILENO) != 0;
  int last_decile_ = -1;
  Clock::time_point start_, end_;
};

Exchange::Exchange(LoadRun& run, size_t index) : run_(run), index_(index) {}

void Exchange::start() {
  const LoadOptions& o = run_.options();
  const SampleRequest& s = run_.request(index_);
  json body = o.extra_body.is_object() ? o.extra_body : json::object();
  body["model"] = o.model;
  if (o.chat) {
    json part = json::object();
    part["type"] = "text";
    part["text"] = s.prompt_text;
    json message = json::object();
    message["role"] = "user";
    message["content"] = json::array({part});
    body["messages"] = json::array({message});
    body["max_completion_tokens"] = s.expected_output_len;
  } else {
    if (!s.prompt_ids.empty())
      body["prompt"] = s.prompt_ids;
    else
      body["prompt"] = s.prompt_text;
    body["max_tokens"] = s.expected_output_len;
  }
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  if (o.ignore_eos) body["ignore_eos"] = true;
  req_.method(http::verb::post);
  req_.target(o.path);
  req_.version(11);
  req_.set(http::field::host, o.host + ":" + std::to_string(o.port));
  req_.set(http::field::content_type, "application/json");
  req_.set(http::field::accept, "text/event-stream");
  req_.set(http::field::user_agent, "tandem-bench");
  if (!o.api_key.empty()) req_.set(http::field::authorization, "Bearer " + o.api_key);
  req_.keep_alive(true);
  req_.body() = body.dump(-1, ' ', false, json::error_handler_t::replace);
  req_.prepare_payload();

  RequestOutput& out = run_.output(index_);
  out.prompt_len = s.prompt_len;
  t0_ = Clock::now();
  out.start_time = seconds(t0_ - run_.start());
  out.queue_time = seconds(t0_ - run_.arrived(index_));
  body_buf_.reset(new char[kReadChunk]);
  auto idle = run_.take_idle();
  use(idle ? idle : std::make_shared<Conn>(run_.ioc()), idle != nullptr);
}

void Exchange::use(std::shared_ptr<Conn> conn, bool reused) {
  conn_ = std::move(conn);
  reused_ = reused;
  got_response_ = false;
  deadline();
  if (reused) {
    on_connect({});
    return;
  }
  conn_->stream.async_connect(
      run_.endpoints(), [self = shared_from_this()](beast::error_code ec, const tcp::endpoint&) {
        self->on_connect(ec);
      });
}

// The whole request must end by t0 + the timeout; every operation waits at most until then.
void Exchange::deadline() {
  const auto limit = t0_ + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(run_.options().request_timeout_s));
  conn_->stream.expires_at(limit);
}

void Exchange::on_connect(beast::error_code ec) {
  if (ec) return finish(false, "connect: " + ec.message());
  conn_->stream.socket().set_option(tcp::no_delay(true), ec);
  http::async_write(conn_->stream, req_, [self = shared_from_this()](beast::error_code ec, size_t) {
    self->on_write(ec);
  });
}

void Exchange::on_write(beast::error_code ec) {
  if (ec) return finish(false, "write: " + ec.message());
  parser_.emplace();
  // (not boost::none: Boost 1.74 compares a Content-Length with an empty limit as exceeding it)
  parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
  parser_->header_limit(64 * 1024);
  http::async_read_header(
      conn_->stream, conn_->buffer, *parser_,
      [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
}

void Exchange::on_header(beast::error_code ec) {
  if (ec) return finish(false, "reading the response head: " + ec.message());
  got_response_ = true;
  read_body();
}

void Exchange::read_body() {
  auto& b = parser_->get().body();
  b.data = body_buf_.get();
  b.size = kReadChunk;
  if (parser_->is_done()) return on_body({});  // (no body: nothing read)
  http::async_read_some(
      conn_->stream, conn_->buffer, *parser_,
      [self = shared_from_this()](beast::error_code ec, size_t) { self->on_body(ec); });
}

void Exchange::on_body(beast::error_code ec) {
  if (ec == http::error::need_buffer) ec = {};
  const auto at = Clock::now();
  const size_t got = kReadChunk - parser_->get().body().size;
  const unsigned status = parser_->get().result_int();
  if (got > 0) {
    if (status == 200) {
      consume(body_buf_.get(), got, at);
    } else if (error_body_.size() < kMaxErrorBody) {
      error_body_.append(body_buf_.get(), std::min(got, kMaxErrorBody - error_body_.size()));
    }
  }
  if (ec) return finish(false, "reading the stream: " + ec.message());
  if (!failure_.empty()) return finish(false, failure_);
  if (!parser_->is_done()) return read_body();
  if (status != 200) {
    const auto r = parser_->get().reason();
    const std::string reason(r.data(), r.size());
    return finish(false, "HTTP " + std::to_string(status) + (reason.empty() ? "" : " " + reason) +
                             (error_body_.empty() ? "" : ": " + error_body_));
  }
  // The end of the body: a last event without its blank line still counts (vLLM's client).
  if (!sse_.empty()) consume("\n\n", 2, at);
  if (!failure_.empty()) return finish(false, failure_);
  if (!first_) {
    return finish(false, "never received a chunk with a choice (TTFT unknown): the request fails");
  }
  finish(true, "");
}

// Splits the body into events (a blank line ends one; CR LF as LF) and handles their data.
void Exchange::consume(const char* data, size_t n, Clock::time_point at) {
  for (size_t i = 0; i < n; ++i) {
    if (data[i] != '\r') sse_.push_back(data[i]);
  }
  size_t pos = 0;
  for (;;) {
    const size_t end = sse_.find("\n\n", pos);
    if (end == std::string::npos) break;
    std::string_view ev(sse_.data() + pos, end - pos);
    pos = end + 2;
    std::string joined;  // the event's data lines, joined by LF
    bool has_data = false;
    while (!ev.empty()) {
      const size_t nl = ev.find('\n');
      std::string_view line = ev.substr(0, nl);
      ev.remove_prefix(nl == std::string_view::npos ? ev.size() : nl + 1);
      if (line.rfind("data:", 0) != 0) continue;  // comments (":"), event:, id:, retry:
      line.remove_prefix(5);
      if (!line.empty() && line.front() == ' ') line.remove_prefix(1);
      if (has_data) joined.push_back('\n');
      joined.append(line);
      has_data = true;
    }
    if (has_data) handle_event(joined, at);
    if (!failure_.empty()) break;
  }
  sse_.erase(0, pos);
}

void Exchange::handle_event(std::string_view data, Clock::time_point at) {
  if (!failure_.empty()) return;
  while (!data.empty() && data.back() == ' ') data.remove_suffix(1);
  if (data.empty() || data == "[DONE]") return;
  json j = json::parse(data.begin(), data.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    failure_ = "malformed event in the stream: " + std::string(data.substr(0, 200));
    return;
  }
  RequestOutput& out = run_.output(index_);
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) {
    failure_ =
        "error event: " + (e->is_object() && e->contains("message") && (*e)["message"].is_string()
                               ? (*e)["message"].get<std::string>()
                               : e->dump());
    return;
  }
  if (auto c = j.find("choices"); c != j.end() && c->is_array() && !c->empty()) {
    const json& ch = (*c)[0];
    if (!first_) {
      first_ = true;
      out.ttft = seconds(at - t0_);
    } else {
      out.itl.push_back(seconds(at - last_token_));
    }
    last_token_ = at;
    ++out.chunks;
    run_.on_token();
    const json* text = nullptr;
    if (run_.options().chat) {
      if (auto d = ch.find("delta"); d != ch.end() && d->is_object()) {
        if (auto t = d->find("content"); t != d->end()) text = &*t;
      }
    } else if (auto t = ch.find("text"); t != ch.end()) {
      text = &*t;
    }
    if (text && text->is_string()) out.generated_text += text->get_ref<const std::string&>();
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    if (auto ct = u->find("completion_tokens"); ct != u->end() && ct->is_number_integer()) {
      out.output_tokens = ct->get<int64_t>();
    }
    if (auto pt = u->find("prompt_tokens"); pt != u->end() && pt->is_number_integer()) {
      out.prompt_len = pt->get<int64_t>();
    }
  }
}

void Exchange::finish(bool ok, std::string error) {
  if (finished_) return;
  // A reused keep-alive connection the server had closed: once more on a new one.
  if (!ok && reused_ && !retried_ && !got_response_ && error.find("timeout") == std::string::npos &&
      error.find("timed out") == std::string::npos) {
    retried_ = true;
    beast::error_code ignored;
    conn_->stream.socket().close(ignored);
    use(std::make_shared<Conn>(run_.ioc()), false);
    return;
  }
  finished_ = true;
  RequestOutput& out = run_.output(index_);
  out.success = ok;
  out.error = std::move(error);
  out.latency = first_ ? seconds(last_token_ - t0_) : seconds(Clock::now() - t0_);
  if (!ok) out.latency = first_ ? out.latency : 0.0;
  if (ok && parser_ && parser_->is_done() && parser_->get().keep_alive()) {
    conn_->stream.expires_never();
    run_.give_back(conn_);
  } else {
    beast::error_code ignored;
    conn_->stream.socket().shutdown(tcp::socket::shutdown_both, ignored);
    conn_->stream.socket().close(ignored);
  }
  conn_.reset();
  run_.done(index_);
}

}  // namespace

std::vector<RequestOutput> run_load(const LoadOptions& o, const std::vector<SampleRequest>& reqs,
                                    double* duration_s) {
  LoadRun run(o, reqs);
  return run.run(duration_s);
}

std::pair<int, std::string> http_get(const std::string& host, uint16_t port,
                                     const std::string& target, double timeout_s,
                                     const std::string& api_key) {
  net::io_context ioc;
  beast::tcp_stream stream(ioc);
  tcp::resolver resolver(ioc);
  beast::flat_buffer buf;
  http::request<http::empty_body> req{http::verb::get, target, 11};
  req.set(http::field::host, host + ":" + std::to_string(port));
  req.set(http::field::user_agent, "tandem-bench");
  if (!api_key.empty()) req.set(http::field::authorization, "Bearer " + api_key);
  http::response<http::string_body> res;
  std::pair<int, std::string> result{0, "no answer"};
  beast::error_code ec;
  auto endpoints = resolver.resolve(host, std::to_string(port), ec);
  if (ec) return {0, "resolve: " + ec.message()};
  stream.expires_after(
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s)));
  stream.async_connect(endpoints, [&](beast::error_code ec, const tcp::endpoint&) {
    if (ec) return void(result = {0, "connect: " + ec.message()});
    http::async_write(stream, req, [&](beast::error_code ec, size_t) {
      if (ec) return void(result = {0, "write: " + ec.message()});
      http::async_read(stream, buf, res, [&](beast::error_code ec, size_t) {
        if (ec) return void(result = {0, "read: " + ec.message()});
        result = {static_cast<int>(res.result_int()), res.body()};
      });
    });
  });
  ioc.run();
  return result;
}

}  // namespace tandem::bench
