// The HTTP front end to end over arbitrary client bytes: a real HttpServer (Beast's parser with
// our limits, keep-alive and pipelining, CORS, the OpenAI handlers and their JSON parsing,
// SSE) on a loopback port, over the deterministic fake engine and the demo model's tokenizer
// and chat template. Each input is one connection's bytes; once the answers stop the client
// half-closes, and the server must close (a connection still open after 10 s is a hang).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "fuzz_input.h"
#include "server/http/fake_engine.h"
#include "server/http/http_server.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

using namespace tandem;

namespace {
struct Server {
  Server() {
    const std::string dir = std::string(TANDEM_SOURCE_DIR) + "/models/demo";
    tok = Tokenizer::from_dir(dir);
    tmpl = ChatTemplate::from_dir(dir);
    testing::FakeEngine::Options o;
    o.vocab = tok->vocab_size();
    o.max_model_len = 512;
    o.step = std::chrono::microseconds(10);
    engine = std::make_unique<testing::FakeEngine>(o);
    HttpServerConfig cfg;
    cfg.host = "127.0.0.1";
    cfg.port = 0;
    cfg.num_threads = 2;
    cfg.model_name = "demo";
    cfg.max_body_bytes = 1 << 20;
    cfg.header_timeout_s = 5;
    cfg.idle_timeout_s = 5;
    cfg.allowed_origins = {"https://ok.example"};
    server = std::make_unique<HttpServer>(cfg, *engine, tok.get(), tmpl.get());
    server->start();
  }
  std::unique_ptr<Tokenizer> tok;
  std::unique_ptr<ChatTemplate> tmpl;
  std::unique_ptr<testing::FakeEngine> engine;
  std::unique_ptr<HttpServer> server;
};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Server* s = new Server();  // (lives for the process)
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(s->server->port());
  ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    std::perror("fuzz_http: connect to the server");  // (not the input's doing: the harness's)
    std::abort();
  }
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  size_t sent = 0;
  while (sent < size) {  // (the server may answer and close early: a failed send is fine)
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  // Read the answers until the server is quiet for 10 ms, then half-close (an EOF at once
  // would read as a client that left, and the server would answer nothing), then read to EOF.
  char buf[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
  }
  ::shutdown(fd, SHUT_WR);
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n > 0) continue;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) std::abort();  // a hang
    break;
  }
  // The exchange is over (EOF read): close with a reset, so that the client side, which closed
  // first, keeps no TIME_WAIT port. Otherwise ~350 connections a second for minutes exhaust
  // the ephemeral ports and connect() fails (found by a 240 s run).
  const linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  ::close(fd);
  return 0;
}
