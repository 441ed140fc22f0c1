#include "net/address.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace tandem::net {

HostPort split_host_port(const std::string& address, const std::string& what) {
  const auto colon = address.rfind(':');
  TANDEM_CHECK_KIND(kInvalidArgument,
                    colon != std::string::npos && colon > 0 && colon + 1 < address.size(), what,
                    " '", address, "' is not host:port");
  std::string host = address.substr(0, colon), port = address.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const bool digits =
      std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
  TANDEM_CHECK_KIND(kInvalidArgument,
                    digits && port.size() <= 5 && std::stoi(port) >= 1 && std::stoi(port) <= 65535,
                    what, " '", address, "' has no valid port");
  return {host, port};
}

std::string join_host_port(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

int connect_tcp(const std::string& address, std::chrono::milliseconds connect_timeout,
                const std::string& what) {
  const HostPort hp = split_host_port(address, what + " address");
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int gai = ::getaddrinfo(hp.host.c_str(), hp.port.c_str(), &hints, &res);
  TANDEM_CHECK_KIND(kIo, gai == 0, "cannot resolve ", what, " ", address, ": ",
                    ::gai_strerror(gai));
  // NOTE: non-blocking, with a timeout: an address that does not answer at all (a pod that is
  // gone) must not hold the caller for the kernel's two minutes.
  int fd = -1;
  std::string why = "no address";
  for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int flags = ::fcntl(fd, F_GETFL, 0);
    ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      rc = ::poll(&pfd, 1, static_cast<int>(connect_timeout.count()));
      int err = 0;
      socklen_t len = sizeof(err);
      if (rc == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) {
        rc = 0;
      } else {
        errno = rc == 0 ? ETIMEDOUT : (err != 0 ? err : errno);
        rc = -1;
      }
    }
    if (rc != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
      continue;
    }
    ::fcntl(fd, F_SETFL, flags);
  }
  ::freeaddrinfo(res);
  TANDEM_CHECK_KIND(kIo, fd >= 0, "cannot connect to ", what, " ", address, ": ", why);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

int listen_tcp(const std::string& host, int port, int backlog, int& bound_port,
               const std::string& what) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TANDEM_CHECK_KIND(kIo, fd >= 0, what, ": socket: ", std::strerror(errno));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    TANDEM_THROW(kInvalidArgument, what, ": bad listen address '", host, "' (an IPv4 address)");
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, backlog) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    TANDEM_THROW(kIo, what, ": cannot listen on ", host, ":", port, ": ", why);
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  bound_port = ntohs(addr.sin_port);
  return fd;
}

bool send_all(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool recv_all(int fd, void* data, size_t n) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace tandem::net
