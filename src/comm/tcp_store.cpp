#include "comm/tcp_store.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "core/env.h"
#include "core/error.h"

namespace tandem::comm {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Wire format (both ends run on the same architecture: host byte order).
// request: u8 op, i64 arg, u32 key_len, u64 value_len, key, value
// reply:   u8 status, i64 num, u64 value_len, value
enum Op : uint8_t { kHello = 1, kSet = 2, kGet = 3, kAdd = 4 };
enum Status : uint8_t { kOk = 0, kTimeout = 1, kFailed = 2 };
constexpr size_t kRequestHeader = 1 + 8 + 4 + 8;
constexpr size_t kReplyHeader = 1 + 8 + 8;
constexpr uint64_t kMaxValueBytes = uint64_t(1) << 30;
constexpr uint32_t kMaxKeyBytes = 4096;

std::string errno_text(int err) { return std::string(std::strerror(err)); }

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}
template <typename T>
T take(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Sends all bytes; false when the peer is gone.
bool send_all(int fd, const uint8_t* data, size_t n) {
  while (n > 0) {
    ssize_t k = ::send(fd, data, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    data += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

enum class RecvResult { kOk, kClosed, kTimeout };

// Receives exactly n bytes before the deadline (none: wait forever).
RecvResult recv_all(int fd, uint8_t* data, size_t n, const Clock::time_point* deadline) {
  while (n > 0) {
    if (deadline != nullptr) {
      auto left = std::chrono::duration_cast<milliseconds>(*deadline - Clock::now()).count();
      if (left <= 0) return RecvResult::kTimeout;
      pollfd pfd{fd, POLLIN, 0};
      int r = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1 << 30)));
      if (r < 0 && errno == EINTR) continue;
      if (r == 0) return RecvResult::kTimeout;
      if (r < 0) return RecvResult::kClosed;
    }
    ssize_t k = ::recv(fd, data, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return RecvResult::kClosed;
    data += k;
    n -= static_cast<size_t>(k);
  }
  return RecvResult::kOk;
}

// Receives n bytes into out, growing it 1 MiB at a time as they arrive (a length a peer claims
// costs memory only once its bytes are there).
RecvResult recv_growing(int fd, std::vector<uint8_t>& out, size_t n,
                        const Clock::time_point* deadline) {
  out.clear();
  constexpr size_t kStep = size_t{1} << 20;
  for (size_t got = 0; got < n;) {
    const size_t k = std::min(kStep, n - got);
    out.resize(got + k);
    const RecvResult r = recv_all(fd, out.data() + got, k, deadline);
    if (r != RecvResult::kOk) return r;
    got += k;
  }
  return RecvResult::kOk;
}

// A required rank variable (RANK, WORLD_SIZE), or FALLBACK when it has one and is unset.
int rank_var(const char* name, std::optional<int> fallback) {
  const std::optional<int64_t> v = env::integer(name);
  TANDEM_CHECK_KIND(kInvalidArgument, v.has_value() || fallback.has_value(),
                    "environment variable ", name,
                    " is not set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT bootstrap a rank)");
  return v ? static_cast<int>(*v) : *fallback;
}

}  // namespace

TcpStoreOptions TcpStoreOptions::of(const RankEnv& env) {
  TcpStoreOptions o;
  o.host = env.master_addr;
  o.port = env.master_port;
  o.rank = env.rank;
  o.world_size = env.world_size;
  return o;
}

RankEnv RankEnv::from_env() {
  RankEnv env;
  env.rank = rank_var("RANK", std::nullopt);
  env.world_size = rank_var("WORLD_SIZE", std::nullopt);
  env.local_rank = rank_var("LOCAL_RANK", env.rank);
  if (auto addr = tandem::env::text("MASTER_ADDR")) env.master_addr = *addr;
  env.master_port = rank_var("MASTER_PORT", 29500);
  TANDEM_CHECK_KIND(kInvalidArgument, env.world_size >= 1, "WORLD_SIZE must be >= 1, got ",
                    env.world_size);
  TANDEM_CHECK_KIND(kInvalidArgument, env.rank >= 0 && env.rank < env.world_size, "RANK ", env.rank,
                    " is outside [0, WORLD_SIZE=", env.world_size, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, env.master_port > 0 && env.master_port < 65536,
                    "MASTER_PORT ", env.master_port, " is not a TCP port");
  return env;
}

// ---------------------------------------------------------------------------------------------
// Server (rank 0): one thread accepts, one thread per connection serves requests in order.

class TcpStoreServer {
 public:
  TcpStoreServer(int port, int world_size, net::KeyRef key)
      : world_size_(world_size), key_(std::move(key)) {
    listen_fd_ = ::socket(AF_INET6, SOCK_STREAM, 0);
    bool v6 = listen_fd_ >= 0;
    if (!v6) listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    TANDEM_CHECK_KIND(kIo, listen_fd_ >= 0, "tcp_store: socket() failed: ", errno_text(errno));
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int rc;
    if (v6) {
      int zero = 0;  // dual stack: accept IPv4 clients too
      ::setsockopt(listen_fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    }
    if (rc != 0 || ::listen(listen_fd_, 128) != 0) {
      int err = errno;
      ::close(listen_fd_);
      TANDEM_THROW(kIo, "tcp_store: rank 0 could not listen on port ", port, ": ", errno_text(err),
                   " (is another group using MASTER_PORT=", port, "?)");
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    accept_thread_ = std::thread([this] { accept_loop(); });
  }

  ~TcpStoreServer() { stop(); }

  int port() const { return port_; }

  /// Waits until no client connection is open (every rank closed its store) or the timeout.
  void wait_clients_gone(milliseconds timeout) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, timeout, [this] { return open_conns_ == 0; });
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      for (int fd : conn_fds_) ::shutdown(fd, SHUT_RDWR);
    }
    cv_.notify_all();
    if (accept_thread_.joinable()) accept_thread_.join();
    for (auto& t : conn_threads_) t.join();
    for (int fd : conn_fds_) ::close(fd);
    ::close(listen_fd_);
  }

 private:
  void accept_loop() {
    while (true) {
      {
        std::lock_guard lock(mu_);
        if (stopping_) return;
      }
      pollfd pfd{listen_fd_, POLLIN, 0};
      int r = ::poll(&pfd, 1, 100);
      if (r <= 0) continue;
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      std::lock_guard lock(mu_);
      if (stopping_) {
        ::close(fd);
        return;
      }
      conn_fds_.push_back(fd);
      ++open_conns_;
      conn_threads_.emplace_back([this, fd] { serve(fd); });
    }
  }

  void reply(int fd, Status status, int64_t num, std::string_view value) {
    std::vector<uint8_t> out;
    out.reserve(kReplyHeader + value.size());
    put<uint8_t>(out, status);
    put<int64_t>(out, num);
    put<uint64_t>(out, value.size());
    out.insert(out.end(), value.begin(), value.end());
    send_all(fd, out.data(), out.size());
  }

  void serve(int fd) {
    int hello_rank = -1;
    std::vector<uint8_t> header(kRequestHeader);
    bool authenticated = true;
    if (key_) {
      try {
        net::authenticate_server(fd, *key_, net::Channel::kStore, net::peer_of(fd));
      } catch (const Error&) {  // (counted and logged): nothing is read as a request
        authenticated = false;
      }
    }
    while (authenticated) {
      if (recv_all(fd, header.data(), header.size(), nullptr) != RecvResult::kOk) break;
      auto op = take<uint8_t>(header.data());
      auto arg = take<int64_t>(header.data() + 1);
      auto klen = take<uint32_t>(header.data() + 9);
      auto vlen = take<uint64_t>(header.data() + 13);
      if (klen > kMaxKeyBytes || vlen > kMaxValueBytes) break;  // garbage: drop the client
      std::string key(klen, '\0');
      std::vector<uint8_t> value;
      if (klen > 0 &&
          recv_all(fd, reinterpret_cast<uint8_t*>(key.data()), klen, nullptr) != RecvResult::kOk)
        break;
      if (recv_growing(fd, value, vlen, nullptr) != RecvResult::kOk) break;

      switch (op) {
        case kHello: {
          int rank = static_cast<int>(arg >> 32);
          int world = static_cast<int>(arg & 0xffffffff);
          std::unique_lock lock(mu_);
          if (world != world_size_) {
            lock.unlock();
            reply(fd, kFailed, 0,
                  detail::concat("rank ", rank, " says WORLD_SIZE=", world, " but rank 0 has ",
                                 world_size_));
          } else if (hello_ranks_.count(rank) != 0) {
            lock.unlock();
            reply(fd, kFailed, 0,
                  detail::concat("two processes claim RANK=", rank, " (check the launcher)"));
          } else {
            hello_ranks_.insert(rank);
            hello_rank = rank;
            lock.unlock();
            reply(fd, kOk, 0, {});
          }
          break;
        }
        case kSet: {
          {
            std::lock_guard lock(mu_);
            data_[key] = std::move(value);
          }
          cv_.notify_all();
          reply(fd, kOk, 0, {});
          break;
        }
        case kGet: {
          std::unique_lock lock(mu_);
          auto deadline = Clock::now() + milliseconds(arg);
          bool found = cv_.wait_until(lock, deadline,
                                      [&] { return stopping_ || data_.find(key) != data_.end(); });
          auto it = data_.find(key);
          if (found && it != data_.end()) {
            std::string copy(it->second.begin(), it->second.end());
            lock.unlock();
            reply(fd, kOk, 0, copy);
          } else {
            bool stopping = stopping_;
            lock.unlock();
            reply(fd, stopping ? kFailed : kTimeout, 0, stopping ? "store is shutting down" : "");
          }
          break;
        }
        case kAdd: {
          int64_t now;
          {
            std::lock_guard lock(mu_);
            auto& v = data_[key];
            int64_t cur = 0;
            if (v.size() == sizeof(int64_t)) cur = take<int64_t>(v.data());
            now = cur + arg;
            v.assign(reinterpret_cast<uint8_t*>(&now), reinterpret_cast<uint8_t*>(&now) + 8);
          }
          cv_.notify_all();
          reply(fd, kOk, now, {});
          break;
        }
        default: reply(fd, kFailed, 0, detail::concat("unknown op ", int(op)));
      }
    }
    std::lock_guard lock(mu_);
    if (hello_rank >= 0) hello_ranks_.erase(hello_rank);
    --open_conns_;
    cv_.notify_all();
  }

  int world_size_;
  net::KeyRef key_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>, std::less<>> data_;
  std::set<int> hello_ranks_;
  bool stopping_ = false;
  int open_conns_ = 0;
  std::vector<int> conn_fds_;
  std::thread accept_thread_;
  std::vector<std::thread> conn_threads_;
};

// ---------------------------------------------------------------------------------------------
// Client

TcpStore::TcpStore(TcpStoreOptions options) : options_(std::move(options)) {
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      options_.world_size >= 1 && options_.rank >= 0 && options_.rank < options_.world_size,
      "tcp_store: rank ", options_.rank, " outside world size ", options_.world_size);
  port_ = options_.port;
  if (options_.rank == 0) {
    server_ = std::make_unique<TcpStoreServer>(options_.port, options_.world_size, options_.key);
    port_ = server_->port();
  }
  TANDEM_CHECK_KIND(kInvalidArgument, port_ > 0 && port_ < 65536, "tcp_store: rank ", options_.rank,
                    " needs a port in 1..65535, got ", port_);
  connect_to_server();
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  if (server_) {
    server_->wait_clients_gone(options_.timeout);
    server_->stop();
  }
}

void TcpStore::connect_to_server() {
  const auto deadline = Clock::now() + options_.timeout;
  const std::string port = std::to_string(port_);
  std::string last_error = "no address";
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  while (true) {
    addrinfo* res = nullptr;
    int gai = ::getaddrinfo(options_.host.c_str(), port.c_str(), &hints, &res);
    if (gai != 0) {
      last_error = std::string("getaddrinfo: ") + ::gai_strerror(gai);
    } else {
      for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          fd_ = fd;
          break;
        }
        last_error = errno_text(errno);
        ::close(fd);
      }
      ::freeaddrinfo(res);
    }
    if (fd_ >= 0) break;
    if (Clock::now() >= deadline) {
      TANDEM_THROW(kIo, "tcp_store: rank ", options_.rank, " could not connect to ", options_.host,
                   ":", port_, " within ", options_.timeout.count(),
                   " ms (last error: ", last_error,
                   "); is rank 0 running and are MASTER_ADDR/MASTER_PORT right?");
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
  int one = 1;
  ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (options_.key) {
    try {
      net::authenticate_client(fd_, *options_.key, net::Channel::kStore,
                               options_.host + ":" + std::to_string(port_));
    } catch (...) {
      ::close(fd_);
      fd_ = -1;
      throw;
    }
  }
  int64_t hello = (int64_t(options_.rank) << 32) | int64_t(uint32_t(options_.world_size));
  Reply r{};
  try {
    r = request(kHello, hello, {}, {}, options_.timeout);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
  if (r.status != kOk) {
    ::close(fd_);
    fd_ = -1;
    TANDEM_THROW(kIo, "tcp_store: rank ", options_.rank,
                 " was refused by rank 0: ", std::string(r.value.begin(), r.value.end()));
  }
}

TcpStore::Reply TcpStore::request(uint8_t op, int64_t arg, std::string_view key,
                                  std::span<const uint8_t> value, milliseconds reply_timeout) {
  TANDEM_CHECK_KIND(kInvalidArgument, key.size() <= kMaxKeyBytes, "tcp_store: key too long");
  TANDEM_CHECK_KIND(kInvalidArgument, value.size() <= kMaxValueBytes, "tcp_store: value of ",
                    value.size(), " bytes is too large");
  std::vector<uint8_t> msg;
  msg.reserve(kRequestHeader + key.size() + value.size());
  put<uint8_t>(msg, op);
  put<int64_t>(msg, arg);
  put<uint32_t>(msg, static_cast<uint32_t>(key.size()));
  put<uint64_t>(msg, value.size());
  msg.insert(msg.end(), key.begin(), key.end());
  msg.insert(msg.end(), value.begin(), value.end());

  std::lock_guard lock(mu_);
  TANDEM_CHECK_KIND(kIo, send_all(fd_, msg.data(), msg.size()), "tcp_store: rank ", options_.rank,
                    " lost its connection to rank 0 (", options_.host, ":", port_, ") sending '",
                    key, "'");
  const auto deadline = Clock::now() + reply_timeout;
  uint8_t header[kReplyHeader];
  RecvResult rr = recv_all(fd_, header, kReplyHeader, &deadline);
  Reply reply{};
  if (rr == RecvResult::kOk) {
    reply.status = take<uint8_t>(header);
    reply.num = take<int64_t>(header + 1);
    auto vlen = take<uint64_t>(header + 9);
    TANDEM_CHECK_KIND(kIo, vlen <= kMaxValueBytes, "tcp_store: corrupt reply");
    rr = recv_growing(fd_, reply.value, vlen, &deadline);
  }
  TANDEM_CHECK_KIND(kIo, rr != RecvResult::kTimeout, "tcp_store: rank ", options_.rank,
                    " got no reply from rank 0 for '", key, "' within ", reply_timeout.count(),
                    " ms");
  TANDEM_CHECK_KIND(kIo, rr == RecvResult::kOk, "tcp_store: rank ", options_.rank,
                    " lost its connection to rank 0 (", options_.host, ":", port_,
                    ") waiting for '", key, "' (did rank 0 exit?)");
  return reply;
}

void TcpStore::set(std::string_view key, std::span<const uint8_t> value) {
  Reply r = request(kSet, 0, key, value, options_.timeout);
  TANDEM_CHECK_KIND(kIo, r.status == kOk, "tcp_store: set('", key,
                    "') failed: ", std::string(r.value.begin(), r.value.end()));
}

void TcpStore::set(std::string_view key, std::string_view value) {
  set(key, std::span(reinterpret_cast<const uint8_t*>(value.data()), value.size()));
}

std::vector<uint8_t> TcpStore::get(std::string_view key) { return get(key, options_.timeout); }

std::vector<uint8_t> TcpStore::get(std::string_view key, milliseconds timeout) {
  // The server enforces the timeout; the client waits a little longer for the reply.
  Reply r = request(kGet, timeout.count(), key, {}, timeout + std::chrono::seconds(10));
  TANDEM_CHECK_KIND(kIo, r.status != kTimeout, "tcp_store: rank ", options_.rank, " get('", key,
                    "') timed out after ", timeout.count(),
                    " ms: no rank set it (did a rank fail or take another code path?)");
  TANDEM_CHECK_KIND(kIo, r.status == kOk, "tcp_store: get('", key,
                    "') failed: ", std::string(r.value.begin(), r.value.end()));
  return std::move(r.value);
}

std::string TcpStore::get_string(std::string_view key) {
  auto v = get(key);
  return std::string(v.begin(), v.end());
}

int64_t TcpStore::add(std::string_view key, int64_t delta) {
  Reply r = request(kAdd, delta, key, {}, options_.timeout);
  TANDEM_CHECK_KIND(kIo, r.status == kOk, "tcp_store: add('", key, "') failed");
  return r.num;
}

void TcpStore::barrier() {
  const std::string key = "__barrier/" + std::to_string(barrier_generation_++);
  int64_t arrived = add(key, 1);
  if (arrived == options_.world_size) set(key + "/done", "1");
  try {
    get(key + "/done");
  } catch (const Error&) {
    int64_t now = add(key, 0);
    TANDEM_THROW(kIo, "tcp_store: rank ", options_.rank, " timed out in barrier ",
                 barrier_generation_ - 1, " after ", options_.timeout.count(), " ms: ", now, " of ",
                 options_.world_size, " ranks arrived");
  }
}

std::vector<std::vector<uint8_t>> TcpStore::all_gather(std::string_view key,
                                                       std::span<const uint8_t> value) {
  const std::string prefix = std::string(key) + "/";
  set(prefix + std::to_string(options_.rank), value);
  std::vector<std::vector<uint8_t>> out(options_.world_size);
  for (int r = 0; r < options_.world_size; ++r) out[r] = get(prefix + std::to_string(r));
  return out;
}

}  // namespace tandem::comm
