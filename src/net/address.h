// Addresses and plain TCP sockets of the internal connections: one "host:port" parser (an IPv6
// host in brackets) for every transport, and the POSIX connect (with a timeout) and IPv4 listener
// of the raw-socket ones (the router <-> instance control protocol, the CUDA IPC control socket,
// the roles' /metrics). The Boost.Asio KV transfer resolves and connects with Asio itself.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace tandem::net {

struct HostPort {
  std::string host;  // without the brackets of an IPv6 literal
  std::string port;  // decimal digits, 1..65535
};

/// "host:port" or "[v6]:port". Throws Error(kInvalidArgument) "<what> '<address>' is not
/// host:port" or "... has no valid port".
HostPort split_host_port(const std::string& address, const std::string& what);

/// "host:port", the host in brackets when it is an IPv6 literal (it has a ':').
std::string join_host_port(const std::string& host, int port);

/// A blocking TCP socket connected to `address` (host:port; every resolved address tried, each
/// for at most connect_timeout, so an address that does not answer fails in time), with
/// TCP_NODELAY. Throws Error(kInvalidArgument) for a malformed address, Error(kIo)
/// "cannot connect to <what> <address>: <why>" otherwise.
int connect_tcp(const std::string& address, std::chrono::milliseconds connect_timeout,
                const std::string& what);

/// Writes all n bytes (send with MSG_NOSIGNAL, EINTR retried); false when the peer is gone.
bool send_all(int fd, const void* data, size_t n);

/// Reads exactly n bytes (EINTR retried); false on EOF or an error.
bool recv_all(int fd, void* data, size_t n);

/// A socket listening on host (an IPv4 address) and port (0: any free one), SO_REUSEADDR;
/// bound_port is the port it got. Throws Error(kInvalidArgument) "<what>: bad listen address
/// '<host>' (an IPv4 address)", Error(kIo) "<what>: cannot listen on host:port: <why>".
int listen_tcp(const std::string& host, int port, int backlog, int& bound_port,
               const std::string& what);

}  // namespace tandem::net
