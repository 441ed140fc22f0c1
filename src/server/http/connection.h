// Internal seam between the HTTP transport (http_server.cpp) and the OpenAI handlers
// (api_handler.cpp, generation.cpp): a parsed request, the connection a handler answers on,
// and the gate through which engine callbacks reach a connection.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "engine/request.h"

namespace tandem::openai {

/// One HTTP request as the handlers see it.
struct HttpRequest {
  std::string method;         // "GET", "POST", ...
  std::string path;           // target without the query string
  std::string authorization;  // the Authorization header ("" when absent)
  std::string body;
  std::string request_id;  // X-Request-Id as sent (sanitised), or a fresh one; echoed back
};

/// What a handler reports for the request's access-log line (-1: not applicable).
struct RequestLog {
  int64_t prompt_tokens = -1;
  int64_t output_tokens = -1;
  double ttft_s = -1;  // seconds from the request to its first output token
};

/// One HTTP response header + body (non-streaming).
struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // extra headers
};

/// The client connection a request is answered on. All methods except post() must be called
/// on the connection's strand (the thread the handler was called on, or a posted function).
class Connection {
 public:
  virtual ~Connection() = default;
  /// Runs fn on the connection's strand. Thread-safe.
  virtual void post(std::function<void()> fn) = 0;
  /// Sends a whole response; ends the current request.
  virtual void respond(HttpResponse response) = 0;
  /// Starts a `text/event-stream` response (chunked).
  virtual void stream_begin() = 0;
  /// Sends one piece of the stream (e.g. "data: {...}\n\n").
  virtual void stream_write(std::string data) = 0;
  /// Ends the stream; ends the current request.
  virtual void stream_end() = 0;
  /// fn runs once, on the strand, if the client goes away before the response ends (closed
  /// socket or failed write). Watching starts at once.
  virtual void on_disconnect(std::function<void()> fn) = 0;
  /// False once the client is gone.
  virtual bool is_open() const = 0;

  /// Filled in by the handler (on the strand); the transport logs it with the response.
  RequestLog log;
};

/// Routes engine callbacks (engine thread) to connections (their strands) while the server
/// runs, and tracks live engine request ids so stop() can abort them. Thread-safe.
class EngineGate {
 public:
  explicit EngineGate(EngineClient& engine) : engine_(engine) {}

  EngineClient& engine() { return engine_; }

  /// Posts fn to the connection's strand unless the server stopped or the connection is gone.
  void post(const std::weak_ptr<Connection>& conn, std::function<void()> fn) {
    std::shared_ptr<Connection> c;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!open_) return;
      c = conn.lock();
      if (!c) return;
      c->post(std::move(fn));
      ++holding_;
    }
    // NOTE: released outside the lock, and counted: this may be the connection's last
    // reference, and its destructor closes a socket of the server's io_context, which
    // close_and_abort_all() (stop()) must not let the server destroy before (a use after free
    // ASan found when a server stopped while the engine thread was here).
    c.reset();
    {
      std::lock_guard<std::mutex> lock(mu_);
      --holding_;
    }
    released_.notify_all();
  }

  void track(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(id);
  }
  void untrack(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(id);
  }

  /// Every engine output passes here (engine thread): a finished one is untracked, and an
  /// abort issued by fail_all() becomes an error with its message.
  StepOutput on_engine_output(const std::string& id, const StepOutput& out) {
    StepOutput o = out;
    std::lock_guard<std::mutex> lock(mu_);
    if (o.finished) {
      live_.erase(id);
      if (!fail_message_.empty() && o.finish_reason == FinishReason::kAbort) {
        o.finish_reason = FinishReason::kError;
        o.error = fail_message_;
      }
    }
    return o;
  }

  size_t live_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }

  /// Aborts every live engine request; their finished outputs become errors with `message`
  /// (the end of a drain). The gate stays open, so the errors reach the clients.
  void fail_all(const std::string& message) {
    std::unordered_set<std::string> live;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fail_message_ = message;
      live = live_;
    }
    for (const auto& id : live) engine_.abort(id);
  }

  /// Closes the gate (no more posts) and aborts every live engine request. Returns once no
  /// engine thread holds a connection through post().
  void close_and_abort_all() {
    std::unordered_set<std::string> live;
    {
      std::unique_lock<std::mutex> lock(mu_);
      open_ = false;
      live.swap(live_);
      released_.wait(lock, [this] { return holding_ == 0; });
    }
    for (const auto& id : live) engine_.abort(id);
  }

 private:
  EngineClient& engine_;
  std::mutex mu_;
  std::condition_variable released_;  // holding_ went down
  bool open_ = true;
  int holding_ = 0;  // post() calls between lock() and the release of their connection
  std::unordered_set<std::string> live_;
  std::string fail_message_;  // set by fail_all()
};

}  // namespace tandem::openai
