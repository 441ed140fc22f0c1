#include "server/http/instance_metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "net/address.h"
#include "net/cluster_auth.h"

namespace tandem {

MetricsEndpoint::MetricsEndpoint(const std::string& host, int port,
                                 std::function<std::string()> render)
    : render_(std::move(render)) {
  listen_fd_ = net::listen_tcp(host, port, 16, port_, "metrics endpoint");
  thread_ = std::thread([this] { loop(); });
}

MetricsEndpoint::~MetricsEndpoint() {
  stop_ = true;
  ::shutdown(listen_fd_, SHUT_RDWR);
  ::close(listen_fd_);
  thread_.join();
}

void MetricsEndpoint::loop() {
  while (!stop_) {
    int fd = ::accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return;
    }
    timeval tv{2, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    std::string req;
    char buf[1024];
    while (req.find("\r\n\r\n") == std::string::npos && req.size() < 16384) {
      ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      req.append(buf, static_cast<size_t>(n));
    }
    std::string body, status = "200 OK";
    if (req.rfind("GET /health ", 0) == 0 || req.rfind("GET /ready ", 0) == 0) {
      body = "ok\n";  // (probes: the process serves)
    } else if (req.rfind("GET /metrics", 0) == 0) {
      try {
        body = render_();
      } catch (const std::exception& e) {
        status = "500 Internal Server Error";
        body = std::string(e.what()) + "\n";
      }
    } else {
      status = "404 Not Found";
      body = "GET /metrics only\n";
    }
    const std::string head = "HTTP/1.1 " + status +
                             "\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: " +
                             std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n";
    net::send_all(fd, head.data(), head.size());
    net::send_all(fd, body.data(), body.size());
    ::close(fd);
  }
}

std::string instances_metrics_text(const std::vector<std::pair<std::string, PrefillLoad>>& prefill,
                                   const std::vector<std::pair<std::string, DecodeLoad>>& decode) {
  std::ostringstream o;
  auto family = [&](const char* name, const char* type, const char* help) {
    o << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  };
  if (!prefill.empty()) {
    family("tandem_prefill_queued_input_tokens", "gauge",
           "Prompt tokens submitted, not computed yet.");
    for (const auto& [n, l] : prefill) {
      o << "tandem_prefill_queued_input_tokens{instance=\"" << n << "\"} " << l.queued_input_tokens
        << "\n";
    }
    family("tandem_prefill_input_tokens_per_second", "gauge", "Prompt tokens computed per second.");
    for (const auto& [n, l] : prefill) {
      o << "tandem_prefill_input_tokens_per_second{instance=\"" << n << "\"} "
        << l.input_tokens_per_s << "\n";
    }
    family("tandem_prefill_input_tokens_total", "counter", "Prompt tokens computed.");
    for (const auto& [n, l] : prefill) {
      o << "tandem_prefill_input_tokens_total{instance=\"" << n << "\"} " << l.input_tokens_total
        << "\n";
    }
  }
  if (!decode.empty()) {
    family("tandem_decode_batch", "gauge", "Sequences per DP rank (running, waiting, reserved).");
    for (const auto& [n, l] : decode) {
      for (size_t r = 0; r < l.batch_per_rank.size(); ++r) {
        o << "tandem_decode_batch{instance=\"" << n << "\",rank=\"" << r << "\"} "
          << l.batch_per_rank[r] << "\n";
      }
    }
    family("tandem_decode_max_batch", "gauge", "The per-rank limit (--max-decode-batch).");
    for (const auto& [n, l] : decode) {
      o << "tandem_decode_max_batch{instance=\"" << n << "\"} " << l.max_decode_batch << "\n";
    }
  }
  family("tandem_instance_up", "gauge", "1 while the instance is up.");
  for (const auto& [n, l] : prefill) {
    o << "tandem_instance_up{role=\"prefill\",instance=\"" << n << "\"} " << (l.alive ? 1 : 0)
      << "\n";
  }
  for (const auto& [n, l] : decode) {
    o << "tandem_instance_up{role=\"decode\",instance=\"" << n << "\"} " << (l.alive ? 1 : 0)
      << "\n";
  }
  o << net::metrics_text();  // (this process's refused internal connections)
  return o.str();
}

}  // namespace tandem
