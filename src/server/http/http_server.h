// The OpenAI-compatible HTTP front: asynchronous HTTP/1.1 (Boost.Beast) on a small pool of
// io threads, serving /v1/completions, /v1/chat/completions (streaming as SSE), /v1/models,
// /tokenize, /detokenize, /health, /ready and /metrics over one EngineClient. See docs/api.md
// and docs/operations.md (CORS, request ids, the access log, timeouts, drain).
//
//   HttpServerConfig cfg;
//   cfg.port = 8000;
//   HttpServer server(cfg, engine, tokenizer.get(), chat_template.get());
//   server.start();   // binds and returns; requests are served on the io threads
//   server.wait();    // blocks until stop() (or SIGINT/SIGTERM with stop_on_signals: then
//                     // drains for config.drain_seconds first)
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>  // NOTE: Boost 1.74 Asio (in http_server.cpp) needs std::exchange first

#include "engine/request.h"

namespace tandem {

class Tokenizer;
class ChatTemplate;
class ServerMetrics;

struct HttpServerConfig {
  std::string host = "0.0.0.0";       // address or host name to listen on
  uint16_t port = 8000;               // 0: any free port (see HttpServer::port())
  int num_threads = 2;                // io threads (--http-threads); each serves many streams
  std::string api_key;                // non-empty: /v1/*, /tokenize, /detokenize need
                                      // "Authorization: Bearer <api_key>"
  std::string model_name = "tandem";  // the served model name (/v1/models, "model" field)
  size_t max_body_bytes = 16u << 20;  // request bodies over this get 413
  int idle_timeout_s = 120;           // a keep-alive connection with no request: closed, seconds
  int header_timeout_s = 30;  // a started request's headers and body must arrive within this, s
  // CORS: origins browsers may call from ("*": any); empty: no CORS headers, preflights fail.
  std::vector<std::string> allowed_origins;
  // One line per request (id, method, path, status, tokens, TTFT, duration); null: none.
  std::function<void(const std::string&)> access_log;
  // GET /ready: 200 while this returns true (null: always), 503 otherwise or while draining.
  std::function<bool()> ready;
  // While the process starts (the model loading): returns the /health body, a JSON object
  // naming the phase (server/startup.h); "" once started. While non-empty, /health and /ready
  // answer 503 with it and the API routes 503 (/metrics as usual). Null: started.
  std::function<std::string()> startup_status;
  // Appended to GET /metrics (e.g. the router's per-instance metrics); null: none.
  std::function<std::string()> extra_metrics;
  // TLS (vLLM's --ssl-certfile / --ssl-keyfile): PEM certificate chain and private key; both
  // empty: plain HTTP. Keep-alive and SSE work the same over TLS.
  std::string ssl_certfile;
  std::string ssl_keyfile;
  int drain_seconds = 30;        // SIGTERM (stop_on_signals): in-flight requests get this long
  bool stop_on_signals = false;  // SIGINT / SIGTERM: drain, then end wait()

  /// Chat tool-call parser: hermes, qwen3_coder or none (see docs/api.md).
  std::string tool_call_parser = "hermes";
  /// Reasoning parser (<think> into reasoning_content): qwen3 or none.
  std::string reasoning_parser = "qwen3";
};

class HttpServer {
 public:
  /// engine, tokenizer (may be null: token-id prompts only) and chat_template (may be null:
  /// no chat) must outlive the server. Nothing runs before start().
  HttpServer(HttpServerConfig config, EngineClient& engine, const Tokenizer* tokenizer,
             const ChatTemplate* chat_template = nullptr);
  /// Calls stop().
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  /// Binds, listens and starts the io threads. Throws Error(kIo) when it cannot listen.
  void start();
  /// The bound port (the chosen one when config.port is 0); valid after start().
  uint16_t port() const;
  /// Blocks until stop() is called (from another thread) or, with stop_on_signals, until
  /// SIGINT / SIGTERM; then stops the server.
  void wait();
  /// Stops accepting, aborts every engine request still running, closes connections and joins
  /// the io threads. Idempotent; must not be called from an io thread (a request handler).
  void stop();
  /// Graceful stop: new requests get 503 + Connection: close (/health stays 200, /ready 503),
  /// responses in flight may finish within `grace`; then the rest end with an error (streams
  /// with an error event and `data: [DONE]`), then stop(). Not from an io thread.
  void drain(std::chrono::milliseconds grace);
  /// True from the start of a drain.
  bool draining() const;
  /// Responses being produced now (a request read, its response not fully written).
  int in_flight() const;

  /// The front-end counters (for tests and embedding).
  const ServerMetrics& metrics() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
