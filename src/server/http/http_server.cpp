// Transport: an acceptor and one Session per TCP connection, all on a shared io_context run
// by a few threads; each session lives on its own strand. Requests are parsed by Beast;
// responses (whole or chunked SSE) are written from a per-session queue. While a response is
// being produced a read stays pending on the socket, so a client that goes away is noticed
// at once and its engine requests are aborted. HEAD is answered as GET without the body,
// OPTIONS (CORS preflights) here, /ready here; every response carries X-Request-Id, and one
// access-log line is written per request. A stream's head goes out with its first bytes, so
// a generation that fails before any output can still answer with a status (e.g. 429).
#include "server/http/http_server.h"

#include <atomic>
#include <boost/asio.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <cinttypes>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/error.h"
#include "server/http/api_handler.h"
#include "server/http/connection.h"
#include "server/http/metrics.h"

namespace tandem {

namespace {

namespace beast = boost::beast;
namespace ssl = boost::asio::ssl;
namespace bhttp = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

constexpr size_t kHeaderLimit = 64 * 1024;
constexpr size_t kMaxPipelinedBytes = 1 << 20;  // read ahead while answering, at most
constexpr size_t kMaxQueuedBytes = 64 << 20;    // unsent output of a client that stopped reading

using Clock = std::chrono::steady_clock;

/// What every session shares with the server.
struct ServerCore {
  HttpServerConfig config;
  openai::ApiHandler* api = nullptr;
  ServerMetrics* metrics = nullptr;
  mutable std::atomic<bool> draining{false};
  mutable std::atomic<int> in_flight{0};  // requests read whose response is not fully written

  /// The Access-Control-Allow-Origin value for this Origin ("" : not allowed / no CORS).
  std::string allow_origin(const std::string& origin) const {
    if (origin.empty()) return "";
    for (const auto& o : config.allowed_origins) {
      if (o == "*") return "*";
      if (o == origin) return origin;
    }
    return "";
  }
};

/// X-Request-Id as sent, when it is short printable ASCII without spaces; else "".
std::string sanitize_request_id(std::string_view id) {
  if (id.empty() || id.size() > 128) return "";
  for (char ch : id) {
    if (ch <= ' ' || ch > '~') return "";
  }
  return std::string(id);
}

std::string log_number(int64_t v) { return v < 0 ? "-" : std::to_string(v); }
std::string log_ms(double s) {
  if (s < 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", s * 1e3);
  return buf;
}

std::string status_line(int status) {
  std::string reason(bhttp::obsolete_reason(bhttp::int_to_status(unsigned(status))));
  if (reason.empty() || reason == "<unknown-status>") reason = "Unknown";
  return "HTTP/1.1 " + std::to_string(status) + " " + reason + "\r\n";
}

// NOTE: with TLS (--ssl-certfile) the session reads and writes through an ssl_stream over the
// same tcp_stream: timeouts, cancellation and closing act on the TCP layer either way, and
// everything above (keep-alive, SSE, the disconnect watch) is the same code.
class Session final : public openai::Connection, public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket&& socket, const ServerCore& core, ssl::context* tls)
      : executor_(socket.get_executor()), core_(core) {
    if (tls != nullptr) {
      tls_.emplace(std::move(socket), *tls);
    } else {
      plain_.emplace(std::move(socket));
    }
  }

  void run() {
    if (!tls_) {
      net::dispatch(executor_, beast::bind_front_handler(&Session::do_read, shared_from_this()));
      return;
    }
    net::dispatch(executor_, [self = shared_from_this()] {
      self->tcp_layer().expires_after(std::chrono::seconds(self->core_.config.header_timeout_s));
      self->tls_->async_handshake(ssl::stream_base::server, [self](beast::error_code ec) {
        if (ec) return self->close();  // not TLS, or a failed handshake: nobody to answer
        self->do_read();
      });
    });
  }

  // --- openai::Connection ---
  void post(std::function<void()> fn) override { net::post(executor_, std::move(fn)); }

  void respond(openai::HttpResponse r) override {
    if (!begin_response(r.status)) return;
    std::string head = status_line(r.status);
    head += "Server: tandem\r\n";
    head += "Content-Type: " + r.content_type + "\r\n";
    head += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
    for (const auto& [k, v] : r.headers) head.append(k).append(": ").append(v).append("\r\n");
    head += common_headers();
    head += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    if (!head_only_) head += r.body;  // HEAD: the GET response's head, no body
    enqueue(std::move(head));
    mark_complete();
  }

  void stream_begin() override {
    if (closed_ || !in_request_ || response_started_) return;
    stream_pending_ = true;  // the head goes out with the first bytes (see send_stream_head)
  }

  void stream_write(std::string data) override {
    if (closed_ || !in_request_ || response_complete_ || data.empty()) return;
    if (stream_pending_) send_stream_head();
    if (!response_started_) return;
    if (chunked_) {
      char size[32];
      std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
      enqueue(size + data + "\r\n");
    } else {
      enqueue(std::move(data));
    }
  }

  void stream_end() override {
    if (closed_ || !in_request_ || response_complete_) return;
    if (stream_pending_) send_stream_head();
    if (!response_started_) return;
    if (chunked_) enqueue("0\r\n\r\n");
    mark_complete();
  }

  void on_disconnect(std::function<void()> fn) override {
    if (closed_) {
      if (fn) fn();
      return;
    }
    on_disconnect_ = std::move(fn);
    if (!watching_) start_watch();
  }

  bool is_open() const override { return !closed_; }

 private:
  // --- reading requests ---
  // Between requests: the idle timeout until the first byte of the next one arrives.
  void do_read() {
    if (closed_) return;
    if (buffer_.size() > 0) return read_header();
    tcp_layer().expires_after(std::chrono::seconds(core_.config.idle_timeout_s));
    io([&](auto& s) {
      s.async_read_some(buffer_.prepare(4096),
                        [self = shared_from_this()](beast::error_code ec, size_t n) {
                          if (ec) return self->read_failed(ec);
                          self->buffer_.commit(n);
                          self->read_header();
                        });
    });
  }

  // A request has started: its headers and body get the header timeout, together.
  void read_header() {
    if (closed_) return;
    parser_.emplace();
    parser_->body_limit(core_.config.max_body_bytes);
    parser_->header_limit(kHeaderLimit);
    tcp_layer().expires_after(std::chrono::seconds(core_.config.header_timeout_s));
    io([&](auto& s) {
      bhttp::async_read_header(s, buffer_, *parser_,
                               beast::bind_front_handler(&Session::on_header, shared_from_this()));
    });
  }

  void on_header(beast::error_code ec, size_t) {
    if (ec) return read_failed(ec);
    const auto& req = parser_->get();
    if (parser_->is_done()) return on_body({}, 0);
    if (beast::iequals(req[bhttp::field::expect], "100-continue")) {
      enqueue("HTTP/1.1 100 Continue\r\n\r\n");
    }
    io([&](auto& s) {
      bhttp::async_read(s, buffer_, *parser_,
                        beast::bind_front_handler(&Session::on_body, shared_from_this()));
    });
  }

  void on_body(beast::error_code ec, size_t) {
    if (ec) return read_failed(ec);
    bhttp::request<bhttp::string_body> req = parser_->release();
    parser_.reset();
    keep_alive_ = req.keep_alive();
    http10_ = req.version() < 11;
    begin_request();
    tcp_layer().expires_never();  // generations may take long; a disconnect is watched instead

    openai::HttpRequest r;
    r.method = std::string(req.method_string());
    std::string_view target(req.target().data(), req.target().size());
    r.path = std::string(target.substr(0, target.find('?')));
    r.authorization = std::string(req[bhttp::field::authorization]);
    r.body = std::move(req.body());
    const auto rid = req["X-Request-Id"];
    r.request_id = sanitize_request_id(std::string_view(rid.data(), rid.size()));
    if (r.request_id.empty()) r.request_id = openai::new_request_id();
    request_id_ = r.request_id;
    method_ = r.method;
    path_ = r.path;
    allow_origin_ = core_.allow_origin(std::string(req[bhttp::field::origin]));
    head_only_ = req.method() == bhttp::verb::head;
    if (head_only_) r.method = "GET";
    try {
      if (core_.draining && r.path != "/health" && r.path != "/metrics") {
        keep_alive_ = false;
        return respond(openai::ApiHandler::error_response(openai::ApiError(
            503, "The server is shutting down.", "server_error", "", "service_unavailable")));
      }
      if (req.method() == bhttp::verb::options) return options(req);
      if (core_.config.startup_status && r.path != "/metrics") {
        std::string status = core_.config.startup_status();
        if (!status.empty()) return starting(r, std::move(status));
      }
      if (r.path == "/ready") return ready(r);
      core_.api->handle(r, shared_from_this());
    } catch (...) {
      // handle() answers every error itself; this is a last resort (e.g. out of memory).
      if (response_started_) return close();
      error_and_close(500, "internal error");
    }
  }

  void read_failed(beast::error_code ec) {
    if (ec == bhttp::error::body_limit) {
      return error_and_close(413, "request body is larger than " +
                                      std::to_string(core_.config.max_body_bytes) + " bytes");
    }
    if (ec == bhttp::error::header_limit) {
      return error_and_close(431, "request headers are too large");
    }
    const bool parse_error =
        ec.category() == bhttp::make_error_code(bhttp::error::bad_method).category() &&
        ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message;
    if (parse_error) return error_and_close(400, "malformed HTTP request: " + ec.message());
    close();  // closed, cut off or timed out: nobody to answer
  }

  /// OPTIONS: a CORS preflight (Origin + Access-Control-Request-Method) is allowed for the
  /// configured origins only; any other OPTIONS gets the methods.
  void options(const bhttp::request<bhttp::string_body>& req) {
    const bool preflight = !req[bhttp::field::origin].empty() &&
                           !req[bhttp::field::access_control_request_method].empty();
    if (preflight && allow_origin_.empty()) {
      return respond(openai::ApiHandler::error_response(
          openai::ApiError(400, "Disallowed CORS origin (see --allowed-origins)",
                           "invalid_request_error", "", "cors_origin_not_allowed")));
    }
    openai::HttpResponse r{204, "text/plain", "", {}};
    r.headers.emplace_back("Allow", "GET, POST, HEAD, OPTIONS");
    if (preflight) {
      std::string headers(req[bhttp::field::access_control_request_headers]);
      r.headers.emplace_back("Access-Control-Allow-Methods", "GET, POST, HEAD, OPTIONS");
      r.headers.emplace_back(
          "Access-Control-Allow-Headers",
          headers.empty() ? "Authorization, Content-Type, X-Request-Id" : headers);
      r.headers.emplace_back("Access-Control-Max-Age", "600");
    }
    respond(std::move(r));
  }

  /// While starting (HttpServerConfig::startup_status): /health and /ready answer 503 with the
  /// start-up status, every other route 503 with an OpenAI-style error.
  void starting(const openai::HttpRequest& r, std::string status) {
    if (r.path == "/health" || r.path == "/ready") {
      openai::HttpResponse res{503, "application/json", std::move(status), {}};
      res.headers.emplace_back("Retry-After", "5");
      return respond(std::move(res));
    }
    openai::HttpResponse e = openai::ApiHandler::error_response(
        openai::ApiError(503, "The server is starting (GET /health shows the phase); retry later.",
                         "server_error", "", "service_unavailable"));
    return respond(std::move(e));
  }

  /// GET /ready: 200 while the server can serve generations (see HttpServerConfig::ready).
  void ready(const openai::HttpRequest& r) {
    if (r.method != "GET") {
      openai::HttpResponse e = openai::ApiHandler::error_response(
          openai::ApiError(405, "Method " + r.method + " is not allowed for /ready (use GET)",
                           "invalid_request_error", "", "method_not_allowed"));
      e.headers.emplace_back("Allow", "GET");
      return respond(std::move(e));
    }
    const bool ok = !core_.draining && (!core_.config.ready || core_.config.ready());
    respond({ok ? 200 : 503,
             "application/json",
             ok ? "{\"status\":\"ready\"}" : "{\"status\":\"not ready\"}",
             {}});
  }

  /// Answers a request that could not be parsed, then closes the connection.
  void error_and_close(int status, const std::string& message) {
    keep_alive_ = false;
    head_only_ = false;
    if (!in_request_) {
      begin_request();
      method_ = "-";
      path_ = "-";
      request_id_ = openai::new_request_id();
    }
    std::string type = status >= 500 ? "server_error" : "invalid_request_error";
    std::string code = status == 413 ? "request_too_large" : "";
    respond(openai::ApiHandler::error_response(
        openai::ApiError(status, message, std::move(type), "", std::move(code))));
  }

  void begin_request() {
    in_request_ = true;
    response_started_ = false;
    response_complete_ = false;
    stream_pending_ = false;
    status_ = 0;
    log = {};
    request_start_ = Clock::now();
    if (!counted_) {
      counted_ = true;
      ++core_.in_flight;
    }
  }

  /// The request is over (answered, or its client gone): one access-log line.
  void end_request(bool client_gone) {
    if (!counted_) return;
    counted_ = false;
    --core_.in_flight;
    const double secs = std::chrono::duration<double>(Clock::now() - request_start_).count();
    if (!client_gone && status_ == 200 && core_.metrics) {
      core_.metrics->observe_request(log.ttft_s, secs);
    }
    if (!core_.config.access_log) return;
    std::string line =
        "tandem: access id=" + request_id_ + " method=" + method_ + " path=" + path_ +
        " status=" + std::to_string(status_ == 0 && client_gone ? 499 : status_) +
        (client_gone ? " client_gone=1" : "") + " prompt_tokens=" + log_number(log.prompt_tokens) +
        " output_tokens=" + log_number(log.output_tokens) + " ttft_ms=" + log_ms(log.ttft_s) +
        " duration_ms=" + log_ms(secs);
    try {
      core_.config.access_log(line);
    } catch (...) {  // NOTE: a failing log sink must not take the connection down
    }
  }

  // --- writing responses ---
  bool begin_response(int status) {
    if (closed_ || !in_request_ || response_started_) return false;
    response_started_ = true;
    stream_pending_ = false;
    status_ = status;
    if (core_.draining) keep_alive_ = false;
    if (core_.metrics) core_.metrics->count_response(status);
    return true;
  }

  /// X-Request-Id and, for an allowed Origin, the CORS headers.
  std::string common_headers() const {
    std::string h = "X-Request-Id: " + request_id_ + "\r\n";
    if (!allow_origin_.empty()) {
      h += "Access-Control-Allow-Origin: " + allow_origin_ + "\r\n";
      h += "Access-Control-Expose-Headers: X-Request-Id\r\n";
      if (allow_origin_ != "*") h += "Vary: Origin\r\n";
    }
    return h;
  }

  void send_stream_head() {
    if (!begin_response(200)) return;
    chunked_ = !http10_;
    if (http10_) keep_alive_ = false;  // HTTP/1.0 has no chunks: the stream ends at close
    std::string head = status_line(200);
    head +=
        "Server: tandem\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        "X-Accel-Buffering: no\r\n";
    if (chunked_) head += "Transfer-Encoding: chunked\r\n";
    head += common_headers();
    head += keep_alive_ ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
    enqueue(std::move(head));
  }

  void enqueue(std::string bytes) {
    if (closed_) return;
    queued_bytes_ += bytes.size();
    if (queued_bytes_ > kMaxQueuedBytes) return client_gone();  // not reading: give up on it
    writes_.push_back(std::move(bytes));
    if (!writing_) do_write();
  }

  void do_write() {
    // Coalesce what is queued into one write (many small SSE chunks under load).
    if (writes_.size() > 1) {
      std::string all;
      for (auto& w : writes_) all += w;
      writes_.clear();
      writes_.push_back(std::move(all));
    }
    writing_ = true;
    io([&](auto& s) {
      net::async_write(s, net::buffer(writes_.front()),
                       beast::bind_front_handler(&Session::on_write, shared_from_this()));
    });
  }

  void on_write(beast::error_code ec, size_t) {
    writing_ = false;
    if (ec) return client_gone();
    queued_bytes_ -= writes_.front().size();
    writes_.pop_front();
    if (closed_) return;
    if (!writes_.empty()) return do_write();
    if (in_request_ && response_complete_) finish_response();
  }

  void mark_complete() {
    response_complete_ = true;
    if (!writing_ && writes_.empty()) finish_response();
  }

  /// The whole response is on the wire: next request, or close.
  void finish_response() {
    in_request_ = false;
    response_complete_ = false;
    on_disconnect_ = nullptr;
    end_request(false);
    if (watching_) {
      // The watch read ends with operation_aborted (or with data) and goes on in on_watch.
      beast::error_code ec;
      tcp_layer().socket().cancel(ec);
      return;
    }
    if (!keep_alive_) return graceful_close();
    do_read();
  }

  // --- noticing a client that goes away mid-response ---
  void start_watch() {
    watching_ = true;
    tcp_layer().expires_never();
    io([&](auto& s) {
      s.async_read_some(buffer_.prepare(4096),
                        beast::bind_front_handler(&Session::on_watch, shared_from_this()));
    });
  }

  void on_watch(beast::error_code ec, size_t n) {
    watching_ = false;
    if (!ec) buffer_.commit(n);  // a pipelined request: kept for do_read
    if (closed_) return;
    if (ec && ec != net::error::operation_aborted) return client_gone();
    if (in_request_) {
      if (!ec && buffer_.size() < kMaxPipelinedBytes) start_watch();
      return;
    }
    if (keep_alive_) {
      do_read();
    } else {
      graceful_close();
    }
  }

  void client_gone() {
    if (closed_) return;
    auto fn = std::move(on_disconnect_);
    on_disconnect_ = nullptr;
    close();
    if (fn) fn();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    end_request(true);
    beast::error_code ec;
    tcp_layer().socket().shutdown(tcp::socket::shutdown_both, ec);
    tcp_layer().socket().close(ec);
  }

  /// Sends FIN, then drains what the client still sends for a moment before closing, so an
  /// early answer (e.g. 413 before the body was read) is not lost to a TCP reset.
  void graceful_close() {
    if (closed_) return;
    beast::error_code ec;
    tcp_layer().socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close();
    tcp_layer().expires_after(std::chrono::seconds(2));
    drain();
  }

  void drain() {
    drain_buf_.resize(16 * 1024);
    tcp_layer().async_read_some(net::buffer(drain_buf_),  // (raw bytes, TLS or not: discarded)
                                [self = shared_from_this()](beast::error_code ec, size_t) {
                                  if (ec) return self->close();
                                  self->drain();
                                });
  }

  // The TCP layer (timeouts, cancel, close) and the stream requests are read from.
  beast::tcp_stream& tcp_layer() { return tls_ ? tls_->next_layer() : *plain_; }
  template <typename Fn>
  void io(Fn&& fn) {
    if (tls_) {
      fn(*tls_);
    } else {
      fn(*plain_);
    }
  }

  const net::any_io_executor executor_;  // the session's strand
  std::optional<beast::tcp_stream> plain_;
  std::optional<beast::ssl_stream<beast::tcp_stream>> tls_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  const ServerCore& core_;
  std::deque<std::string> writes_;
  size_t queued_bytes_ = 0;  // bytes in writes_
  std::vector<char> drain_buf_;
  std::function<void()> on_disconnect_;
  bool writing_ = false;
  bool in_request_ = false;         // a request is being answered
  bool response_started_ = false;   // its status line was queued
  bool response_complete_ = false;  // its last bytes were queued
  bool keep_alive_ = true;
  bool http10_ = false;
  bool chunked_ = true;
  bool watching_ = false;
  bool closed_ = false;
  bool stream_pending_ = false;  // stream_begin() called, its head not sent yet
  bool head_only_ = false;       // a HEAD request: no body
  bool counted_ = false;         // counted in core_.in_flight
  int status_ = 0;               // of the current response (for the access log)
  std::string request_id_, method_, path_, allow_origin_;
  Clock::time_point request_start_;
};

class Listener : public std::enable_shared_from_this<Listener> {
 public:
  Listener(net::io_context& ioc, tcp::acceptor acceptor, const ServerCore& core, ssl::context* tls)
      : ioc_(ioc), acceptor_(std::move(acceptor)), core_(core), tls_(tls), retry_timer_(ioc) {}

  void run() { do_accept(); }

  void close() {
    beast::error_code ec;
    acceptor_.close(ec);
    retry_timer_.cancel();
  }

 private:
  void do_accept() {
    acceptor_.async_accept(net::make_strand(ioc_),
                           beast::bind_front_handler(&Listener::on_accept, shared_from_this()));
  }

  void on_accept(beast::error_code ec, tcp::socket socket) {
    if (!acceptor_.is_open() || ec == net::error::operation_aborted) return;
    if (ec) {
      // E.g. out of file descriptors: back off instead of spinning.
      retry_timer_.expires_after(std::chrono::milliseconds(50));
      retry_timer_.async_wait([self = shared_from_this()](beast::error_code e) {
        if (!e) self->do_accept();
      });
      return;
    }
    beast::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    std::make_shared<Session>(std::move(socket), core_, tls_)->run();
    do_accept();
  }

  net::io_context& ioc_;
  tcp::acceptor acceptor_;
  const ServerCore& core_;
  ssl::context* tls_;  // null: plain HTTP
  net::steady_timer retry_timer_;
};

// The TLS context of --ssl-certfile / --ssl-keyfile (TLS 1.2 and later); errors name the file.
std::unique_ptr<ssl::context> make_tls_context(const HttpServerConfig& cfg) {
  TANDEM_CHECK_KIND(kInvalidArgument, cfg.ssl_certfile.empty() == cfg.ssl_keyfile.empty(),
                    "--ssl-certfile and --ssl-keyfile go together (got ",
                    cfg.ssl_certfile.empty() ? "only --ssl-keyfile" : "only --ssl-certfile", ")");
  if (cfg.ssl_certfile.empty()) return nullptr;
  auto ctx = std::make_unique<ssl::context>(ssl::context::tls_server);
  ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                   ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 |
                   ssl::context::single_dh_use);
  beast::error_code ec;
  ctx->use_certificate_chain_file(cfg.ssl_certfile, ec);
  TANDEM_CHECK_KIND(kInvalidArgument, !ec, "--ssl-certfile ", cfg.ssl_certfile,
                    ": cannot load a PEM certificate chain (", ec.message(), ")");
  ctx->use_private_key_file(cfg.ssl_keyfile, ssl::context::pem, ec);
  TANDEM_CHECK_KIND(kInvalidArgument, !ec, "--ssl-keyfile ", cfg.ssl_keyfile,
                    ": cannot load a PEM private key that matches --ssl-certfile ",
                    cfg.ssl_certfile, " (", ec.message(), ")");
  TANDEM_CHECK_KIND(kInvalidArgument, SSL_CTX_check_private_key(ctx->native_handle()) == 1,
                    "--ssl-keyfile ", cfg.ssl_keyfile, " does not match the certificate in ",
                    cfg.ssl_certfile);
  return ctx;
}

}  // namespace

struct HttpServer::Impl {
  Impl(HttpServerConfig cfg, EngineClient& engine, const Tokenizer* tokenizer,
       const ChatTemplate* chat_template)
      : gate(std::make_shared<openai::EngineGate>(engine)),
        api(cfg, gate, tokenizer, chat_template, metrics),
        ioc(std::max(1, cfg.num_threads)) {
    core.config = std::move(cfg);
    core.api = &api;
    core.metrics = &metrics;
    metrics.set_model_name(core.config.model_name);
    metrics.set_extra(core.config.extra_metrics);
  }

  // NOTE: declaration order matters: sessions (owned by handlers inside ioc) refer to core,
  // api and metrics, so ioc is declared after them and destroyed first.
  ServerMetrics metrics;
  std::shared_ptr<openai::EngineGate> gate;
  openai::ApiHandler api;
  ServerCore core;
  std::unique_ptr<ssl::context> tls;  // --ssl-certfile / --ssl-keyfile (null: plain HTTP)
  net::io_context ioc;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  std::shared_ptr<Listener> listener;
  std::optional<net::signal_set> signals;
  std::vector<std::thread> threads;
  uint16_t port = 0;

  std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool stop_requested = false;
  bool signalled = false;
  bool stopped = false;
};

HttpServer::HttpServer(HttpServerConfig config, EngineClient& engine, const Tokenizer* tokenizer,
                       const ChatTemplate* chat_template)
    : impl_(std::make_unique<Impl>(std::move(config), engine, tokenizer, chat_template)) {}

HttpServer::~HttpServer() {
  try {
    stop();
  } catch (...) {  // NOTE: a destructor must not throw; stop() only fails on a broken system
  }
}

void HttpServer::start() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    TANDEM_CHECK(!m.started, "HttpServer::start called twice");
    m.started = true;
  }
  const HttpServerConfig& cfg = m.core.config;
  m.tls = make_tls_context(cfg);
  tcp::acceptor acceptor(m.ioc);
  try {
    tcp::resolver resolver(m.ioc);
    auto results = resolver.resolve(cfg.host, std::to_string(cfg.port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service);
    TANDEM_CHECK_KIND(kIo, !results.empty(), "cannot resolve host ", cfg.host);
    tcp::endpoint ep = results.begin()->endpoint();
    acceptor.open(ep.protocol());
    acceptor.set_option(net::socket_base::reuse_address(true));
    acceptor.bind(ep);
    acceptor.listen(net::socket_base::max_listen_connections);
    m.port = acceptor.local_endpoint().port();
  } catch (const boost::system::system_error& e) {
    TANDEM_THROW(kIo, "cannot listen on ", cfg.host, ":", cfg.port, ": ", e.code().message());
  }
  m.listener = std::make_shared<Listener>(m.ioc, std::move(acceptor), m.core, m.tls.get());
  m.listener->run();
  m.work.emplace(net::make_work_guard(m.ioc));
  if (cfg.stop_on_signals) {
    m.signals.emplace(m.ioc, SIGINT, SIGTERM);
    m.signals->async_wait([&m](beast::error_code ec, int) {
      if (ec) return;
      std::lock_guard<std::mutex> lock(m.mu);
      m.stop_requested = true;
      m.signalled = true;
      m.cv.notify_all();
    });
  }
  for (int i = 0; i < std::max(1, cfg.num_threads); ++i) {
    m.threads.emplace_back([&m] { m.ioc.run(); });
  }
}

uint16_t HttpServer::port() const { return impl_->port; }

const ServerMetrics& HttpServer::metrics() const { return impl_->metrics; }

void HttpServer::wait() {
  bool signalled = false;
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->cv.wait(lock, [&] { return impl_->stop_requested || impl_->stopped; });
    signalled = impl_->signalled && !impl_->stopped;
  }
  if (signalled) {
    drain(std::chrono::seconds(impl_->core.config.drain_seconds));
  } else {
    stop();
  }
}

bool HttpServer::draining() const { return impl_->core.draining; }

int HttpServer::in_flight() const { return impl_->core.in_flight; }

void HttpServer::drain(std::chrono::milliseconds grace) {
  Impl& m = *impl_;
  bool started = false;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.stopped) return;
    started = m.started;
  }
  if (!started) return stop();
  m.core.draining = true;
  auto wait_idle = [&](Clock::time_point deadline) {
    while (m.core.in_flight > 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return m.core.in_flight == 0;
  };
  const int before = m.core.in_flight;
  if (m.core.config.access_log) {
    m.core.config.access_log("tandem: draining: " + std::to_string(before) +
                             " request(s) in flight, up to " + std::to_string(grace.count()) +
                             " ms");
  }
  if (!wait_idle(Clock::now() + grace)) {
    // The rest end with an error (a stream: an error event, then [DONE]).
    m.gate->fail_all("the server is shutting down (the drain time of " +
                     std::to_string(grace.count() / 1000.0) + " s is over)");
    wait_idle(Clock::now() + std::chrono::seconds(5));
  }
  stop();
}

void HttpServer::stop() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.stopped) return;
    m.stopped = true;
    m.stop_requested = true;
  }
  m.cv.notify_all();
  // No engine callback reaches a session from here on; running requests are aborted.
  m.gate->close_and_abort_all();
  m.work.reset();
  m.ioc.stop();
  for (auto& t : m.threads) {
    if (t.joinable()) t.join();
  }
  m.threads.clear();
  // No io thread runs now: the listener and signals can be touched from here.
  if (m.listener) m.listener->close();
  if (m.signals) {
    beast::error_code ec;
    m.signals->cancel(ec);
  }
}

}  // namespace tandem
