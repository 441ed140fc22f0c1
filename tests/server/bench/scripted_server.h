// A scripted OpenAI-style streaming server for the bench client's tests: timings known in
// advance. POST /v1/completions or /v1/chat/completions answers an SSE stream of max_tokens
// (max_completion_tokens) chunks, the first after `first_ms`, the next every `gap_ms`, then a
// usage chunk and [DONE]. A first prompt id of 1000 + m (or a prompt text "mode:m...") picks a
// behaviour (any other prompt: 1):
//   1 normal   2 HTTP 500   3 the connection dropped after two chunks   4 no answer at all
//   5 an error event after one chunk   6 a malformed event after one chunk
// GET /v1/models lists the model "scripted". Plain blocking sockets, a thread per connection,
// keep-alive honoured.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

namespace tandem::testing {

class ScriptedServer {
 public:
  ScriptedServer(int first_ms, int gap_ms) : first_ms_(first_ms), gap_ms_(gap_ms) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(listen_fd_, 512);
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~ScriptedServer() {
    stop_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    acceptor_.join();
    std::vector<std::thread> ts;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
      ts.swap(threads_);
    }
    for (auto& t : ts) t.join();
  }

  uint16_t port() const { return port_; }
  int connections() const { return connections_; }
  int requests() const { return requests_; }

 private:
  void accept_loop() {
    while (!stop_) {
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) return;
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      ++connections_;
      std::lock_guard<std::mutex> lock(mu_);
      fds_.push_back(fd);
      threads_.emplace_back([this, fd] { serve(fd); });
    }
  }

  static bool send_all(int fd, const std::string& s) {
    size_t off = 0;
    while (off < s.size()) {
      ssize_t n = ::send(fd, s.data() + off, s.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return false;
      off += static_cast<size_t>(n);
    }
    return true;
  }
  static bool send_chunk(int fd, const std::string& data) {
    char head[32];
    std::snprintf(head, sizeof head, "%zx\r\n", data.size());
    return send_all(fd, head + data + "\r\n");
  }

  void serve(int fd) {
    std::string buf;
    char tmp[65536];
    for (;;) {
      size_t hend;
      while ((hend = buf.find("\r\n\r\n")) == std::string::npos) {
        ssize_t n = ::recv(fd, tmp, sizeof tmp, 0);
        if (n <= 0) return close_fd(fd);
        buf.append(tmp, static_cast<size_t>(n));
      }
      const std::string head = buf.substr(0, hend);
      size_t clen = 0;
      if (size_t p = head.find("Content-Length: "); p != std::string::npos) {
        clen = std::stoul(head.substr(p + 16));
      } else if (size_t q = head.find("content-length: "); q != std::string::npos) {
        clen = std::stoul(head.substr(q + 16));
      }
      while (buf.size() < hend + 4 + clen) {
        ssize_t n = ::recv(fd, tmp, sizeof tmp, 0);
        if (n <= 0) return close_fd(fd);
        buf.append(tmp, static_cast<size_t>(n));
      }
      const std::string body = buf.substr(hend + 4, clen);
      buf.erase(0, hend + 4 + clen);
      ++requests_;
      if (head.rfind("GET /v1/models", 0) == 0) {
        const std::string b = R"({"object":"list","data":[{"id":"scripted","object":"model"}]})";
        if (!send_all(fd, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
                              std::to_string(b.size()) + "\r\n\r\n" + b)) {
          return close_fd(fd);
        }
        continue;
      }
      if (!answer(fd, head, body)) return close_fd(fd);
    }
  }

  // Returns false to close the connection.
  bool answer(int fd, const std::string& head, const std::string& body) {
    using json = nlohmann::json;
    json j = json::parse(body, nullptr, false);
    const bool chat = head.find("/chat/completions") != std::string::npos;
    int mode = 1;
    int64_t n = 1;
    if (j.is_object()) {
      if (chat) {
        n = j.value("max_completion_tokens", 1);
        const std::string text = j["messages"][0]["content"][0]["text"].get<std::string>();
        if (text.rfind("mode:", 0) == 0 && text.size() > 5) mode = text[5] - '0';
      } else {
        n = j.value("max_tokens", 1);
        if (j["prompt"].is_array() && !j["prompt"].empty() && j["prompt"][0].get<int>() > 1000) {
          mode = j["prompt"][0].get<int>() - 1000;
        }
      }
    }
    if (mode == 2) {
      const std::string b = R"({"error":{"message":"scripted failure","code":500}})";
      return send_all(fd,
                      "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json"
                      "\r\nContent-Length: " +
                          std::to_string(b.size()) + "\r\n\r\n" + b);
    }
    if (mode == 4) {  // say nothing until the client gives up
      char c;
      (void)::recv(fd, &c, 1, 0);
      return false;
    }
    if (!send_all(fd,
                  "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n")) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(first_ms_));
    for (int64_t i = 0; i < n; ++i) {
      if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(gap_ms_));
      if (mode == 3 && i == 2) return false;  // dropped mid-stream
      if (mode == 5 && i == 1) {
        return send_chunk(fd, "data: {\"error\":{\"message\":\"scripted error event\"}}\n\n") &&
               send_chunk(fd, "data: [DONE]\n\n") && send_all(fd, "0\r\n\r\n");
      }
      if (mode == 6 && i == 1) {
        return send_chunk(fd, "data: {not json\n\n") && send_all(fd, "0\r\n\r\n");
      }
      json c = {{"id", "x"}, {"object", "text_completion"}};
      if (chat) {
        c["choices"] = json::array({{{"index", 0}, {"delta", {{"content", "t"}}}}});
      } else {
        c["choices"] = json::array({{{"index", 0}, {"text", "t"}}});
      }
      c["usage"] = nullptr;
      if (!send_chunk(fd, "data: " + c.dump() + "\n\n")) return false;
    }
    json u = {{"id", "x"},
              {"choices", json::array()},
              {"usage", {{"prompt_tokens", 7}, {"completion_tokens", n}, {"total_tokens", 7 + n}}}};
    return send_chunk(fd, "data: " + u.dump() + "\n\n") && send_chunk(fd, "data: [DONE]\n\n") &&
           send_all(fd, "0\r\n\r\n");
  }

  void close_fd(int fd) {
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& f : fds_) {
      if (f == fd) f = -1;
    }
  }

  const int first_ms_, gap_ms_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::thread acceptor_;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0}, requests_{0};
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> threads_;
};

}  // namespace tandem::testing
