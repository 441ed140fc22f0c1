// Internal seam between the HTTP transport (http_server.cpp) and the OpenAI handlers
// (api_handler.cpp, generation.cpp): a parsed request, the connection a handler answers on,
// and the gate through which engine callbacks reach a connection.
#pragma once

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
};

/// Routes engine callbacks (engine thread) to connections (their strands) while the server
/// runs, and tracks live engine request ids so stop() can abort them. Thread-safe.
class EngineGate {
 public:
  explicit EngineGate(EngineClient& engine) : engine_(engine) {}

  EngineClient& engine() { return engine_; }

  /// Posts fn to the connection's strand unless the server stopped or the connection is gone.
  void post(const std::weak_ptr<Connection>& conn, std::function<void()> fn) {
    std::shared_ptr<Connection> c;  // NOTE: released after the lock
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_) return;
    c = conn.lock();
    if (c) c->post(std::move(fn));
  }

  void track(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(id);
  }
  void untrack(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(id);
  }

  /// Closes the gate (no more posts) and aborts every live engine request.
  void close_and_abort_all() {
    std::unordered_set<std::string> live;
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = false;
      live.swap(live_);
    }
    for (const auto& id : live) engine_.abort(id);
  }

 private:
  EngineClient& engine_;
  std::mutex mu_;
  bool open_ = true;
  std::unordered_set<std::string> live_;
};

}  // namespace tandem::openai
