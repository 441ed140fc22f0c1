#include "disagg/instance_api.h"

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
#include <iostream>
#include <unordered_set>

#include "core/error.h"
#include "disagg/lockstep.h"
#include "net/cluster_auth.h"

namespace tandem {

namespace {

enum Msg : uint32_t {
  kHello = 1,
  kAccept = 2,
  kSubmit = 3,
  kFail = 4,
  kAbort = 5,
  kLoad = 6,
  kPrefilled = 7,
  kEngineSubmit = 8,  // a colocated replica: the request, run whole there
  kReply = 100,
  kOutput = 101,
  kPrefillDone = 102,
};

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool write_frame(int fd, uint32_t type, const std::vector<uint8_t>& payload) {
  uint32_t head[2] = {type, static_cast<uint32_t>(payload.size())};
  return write_all(fd, head, sizeof(head)) && write_all(fd, payload.data(), payload.size());
}

// False when the connection ended or the frame is over kMaxControlFrameBytes (why says which).
// The payload grows with the bytes that actually arrive (1 MiB at a time), so a frame that
// claims more than it sends costs no memory.
bool read_frame(int fd, uint32_t& type, std::vector<uint8_t>& payload, std::string* why = nullptr) {
  uint32_t head[2];
  if (!read_all(fd, head, sizeof(head))) return false;
  type = head[0];
  if (head[1] > kMaxControlFrameBytes) {
    if (why) {
      *why = "a control frame of " + std::to_string(head[1]) + " bytes (type " +
             std::to_string(type) + ") is over the limit of " +
             std::to_string(kMaxControlFrameBytes);
    }
    return false;
  }
  payload.clear();
  constexpr size_t kStep = size_t{1} << 20;
  for (size_t got = 0; got < head[1];) {
    const size_t n = std::min<size_t>(kStep, head[1] - got);
    payload.resize(got + n);
    if (!read_all(fd, payload.data() + got, n)) return false;
    got += n;
  }
  return true;
}

int connect_to(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  TANDEM_CHECK_KIND(kInvalidArgument, colon != std::string::npos, "bad instance address '",
                    endpoint, "' (want host:port)");
  const std::string host = endpoint.substr(0, colon), port = endpoint.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int gai = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  TANDEM_CHECK_KIND(kIo, gai == 0, "instance ", endpoint, ": ", ::gai_strerror(gai));
  // NOTE: non-blocking, with a timeout: an address that does not answer at all (a pod that is
  // gone) must not hold the router's monitor for the kernel's two minutes.
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
      rc = ::poll(&pfd, 1, 1000);
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
  TANDEM_CHECK_KIND(kIo, fd >= 0, "cannot connect to instance ", endpoint, ": ", why);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

// ---- Codecs. ----

// A reply: serial, ok, (error kind, message) or body.
std::vector<uint8_t> reply_ok(uint64_t serial, const std::vector<uint8_t>& body) {
  ByteWriter w;
  w.put(serial);
  w.put<uint8_t>(1);
  w.put_vec(body);
  return std::move(w.bytes());
}

std::vector<uint8_t> reply_error(uint64_t serial, ErrorKind kind, const std::string& message) {
  ByteWriter w;
  w.put(serial);
  w.put<uint8_t>(0);
  w.put<int32_t>(static_cast<int32_t>(kind));
  w.put_str(message);
  return std::move(w.bytes());
}

int listen_on(const std::string& host, int port, int& bound_port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TANDEM_CHECK_KIND(kIo, fd >= 0, "socket() failed");
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    TANDEM_THROW(kInvalidArgument, "bad listen address '", host, "' (an IPv4 address)");
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 16) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    TANDEM_THROW(kIo, "cannot listen on ", host, ":", port, ": ", why);
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  bound_port = ntohs(addr.sin_port);
  return fd;
}
}  // namespace

// ---- Server (the instance's side). ----

struct InstanceServer::Conn {
  int fd = -1;
  std::mutex write_mu;
  std::atomic<bool> open{true};
  std::mutex ids_mu;
  std::unordered_set<std::string> ids;  // live requests that came through this connection

  void push(uint32_t type, const std::vector<uint8_t>& payload) {
    std::lock_guard<std::mutex> lock(write_mu);
    if (open && !write_frame(fd, type, payload)) open = false;
  }
};

InstanceServer::InstanceServer(EngineClient* engine, const std::string& host, int port,
                               net::KeyRef key)
    : decode_(nullptr), prefill_(nullptr), key_(std::move(key)), engine_(engine) {
  TANDEM_CHECK(engine_ != nullptr, "serve exactly one instance");
  listen_fd_ = listen_on(host, port, port_);
  accept_thread_ = std::thread([this] { accept_loop(); });
}

void InstanceServer::abort_request(const std::string& id) {
  if (decode_) {
    decode_->abort(id);
  } else if (prefill_) {
    prefill_->abort(id);
  } else {
    engine_->abort(id);
  }
}

InstanceServer::InstanceServer(DecodeClient* decode, PrefillClient* prefill,
                               const std::string& host, int port, net::KeyRef key)
    : decode_(decode), prefill_(prefill), key_(std::move(key)) {
  TANDEM_CHECK((decode_ != nullptr) != (prefill_ != nullptr), "serve exactly one instance");
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  TANDEM_CHECK_KIND(kIo, listen_fd_ >= 0, "socket() failed");
  int one = 1;
  ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  TANDEM_CHECK_KIND(kInvalidArgument, ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) == 1,
                    "bad listen address '", host, "' (an IPv4 address)");
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listen_fd_, 16) != 0) {
    ::close(listen_fd_);
    TANDEM_CHECK_KIND(kIo, false, "cannot listen on ", host, ":", port, ": ", std::strerror(errno));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
  accept_thread_ = std::thread([this] { accept_loop(); });
}

InstanceServer::~InstanceServer() { stop(); }

size_t InstanceServer::live_requests() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (auto& c : conns_) {
    std::lock_guard<std::mutex> l(c->ids_mu);
    if (c->open) n += c->ids.size();
  }
  return n;
}

void InstanceServer::drain(std::chrono::milliseconds grace) {
  draining_ = true;
  const auto until = std::chrono::steady_clock::now() + grace;
  // (a moment first, so the routers' next load poll sees it before the last request ends)
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  while (live_requests() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop();
}

void InstanceServer::stop() {
  if (stop_.exchange(true)) return;
  ::shutdown(listen_fd_, SHUT_RDWR);
  ::close(listen_fd_);
  accept_thread_.join();
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& c : conns_) ::shutdown(c->fd, SHUT_RDWR);
    threads.swap(threads_);
  }
  for (auto& t : threads) t.join();
}

void InstanceServer::accept_loop() {
  while (!stop_) {
    int fd = ::accept(listen_fd_, nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return;
    }
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    auto conn = std::make_shared<Conn>();
    conn->fd = fd;
    std::lock_guard<std::mutex> lock(mu_);
    conns_.push_back(conn);
    threads_.emplace_back([this, conn] { serve(conn); });
  }
}

void InstanceServer::serve(std::shared_ptr<Conn> conn) {
  const std::string peer = net::peer_of(conn->fd);
  if (key_) {
    try {
      net::authenticate_server(conn->fd, *key_, net::Channel::kControl, peer);
    } catch (const Error&) {  // (counted and logged): nothing was read as a message
      conn->open = false;
      ::close(conn->fd);
      return;
    }
  }
  uint32_t type = 0;
  std::vector<uint8_t> payload;
  std::string why;
  while (read_frame(conn->fd, type, payload, &why)) {
    ByteReader r(payload);
    uint64_t serial = 0;
    try {
      if (type == kFail || type == kAbort) {
        const std::string id = r.get_str();
        const std::string error = r.get_str();
        if (type == kFail && decode_) decode_->fail(id, error);
        if (type == kAbort) abort_request(id);
        continue;
      }
      if (type == kPrefilled) {
        const std::string id = r.get_str();
        StepOutput first = get_step_output(r);
        if (decode_) decode_->prefilled(id, first);
        continue;
      }
      serial = r.get<uint64_t>();
      ByteWriter body;
      if (type == kHello && engine_) {  // role 2: a colocated engine
        body.put<uint8_t>(2);
        body.put<int64_t>(engine_->max_model_len());
        body.put<int64_t>(engine_->vocab_size());
      } else if (type == kHello) {
        body.put<uint8_t>(decode_ ? 1 : 0);
        body.put<int64_t>(decode_ ? decode_->max_model_len() : 0);
        body.put<int64_t>(decode_ ? decode_->vocab_size() : 0);
        const transfer::KvSharding sh = prefill_ ? prefill_->kv_sharding() : transfer::KvSharding{};
        body.put<int64_t>(sh.num_kv_heads);
        body.put<int32_t>(sh.tp);
      } else if (type == kLoad && engine_) {
        put_stats(body, engine_->stats());
        body.put<uint8_t>(draining_ ? 1 : 0);
      } else if (type == kEngineSubmit && engine_) {
        TANDEM_CHECK_KIND(kIo, !draining_, "the replica is draining");
        GenRequest req = get_request(r);
        const std::string id = req.id;
        std::weak_ptr<Conn> weak = conn;
        {
          std::lock_guard<std::mutex> lock(conn->ids_mu);
          conn->ids.insert(id);
        }
        try {
          engine_->submit(std::move(req), [weak, id](const StepOutput& out) {
            auto c = weak.lock();
            if (!c) return;
            if (out.finished) {
              std::lock_guard<std::mutex> lock(c->ids_mu);
              c->ids.erase(id);
            }
            c->push(kOutput, encode_step_output(out));
          });
        } catch (...) {
          std::lock_guard<std::mutex> lock(conn->ids_mu);
          conn->ids.erase(id);
          throw;
        }
      } else if (type == kLoad) {
        if (decode_) {
          DecodeLoad l = decode_->load();
          body.put_vec(l.batch_per_rank);
          body.put(l.max_decode_batch);
          body.put<uint8_t>(l.alive ? 1 : 0);
          // Then the engine counters (KV pages, prefix cache) for the router's /metrics, and
          // whether it drains.
          auto* di = dynamic_cast<DecodeInstance*>(decode_);
          put_stats(body, di ? di->stats() : EngineStats{});
          body.put<uint8_t>(draining_ ? 1 : 0);
        } else {
          PrefillLoad l = prefill_->load();
          body.put(l.queued_input_tokens);
          body.put(l.input_tokens_total);
          body.put(l.input_tokens_per_s);
          body.put<uint8_t>(l.alive ? 1 : 0);
          body.put<uint8_t>(draining_ ? 1 : 0);
          put_histogram(body, l.queue_time);  // (for the router's /metrics)
          put_histogram(body, l.iteration_tokens);
        }
      } else if (type == kAccept && decode_ && draining_) {
        body.put<uint8_t>(0);  // draining: no room for anything new
      } else if (type == kAccept && decode_) {
        GenRequest req = get_request(r);
        transfer::KvSharding src;
        src.num_kv_heads = r.get<int64_t>();
        src.tp = r.get<int32_t>();
        const std::string id = req.id;
        std::weak_ptr<Conn> weak = conn;
        auto dst = decode_->accept(req, src, [weak, id](const StepOutput& out) {
          auto c = weak.lock();
          if (!c) return;
          if (out.finished) {
            std::lock_guard<std::mutex> lock(c->ids_mu);
            c->ids.erase(id);
          }
          c->push(kOutput, encode_step_output(out));
        });
        body.put<uint8_t>(dst ? 1 : 0);
        if (dst) {
          std::lock_guard<std::mutex> lock(conn->ids_mu);
          conn->ids.insert(id);
          put_descriptor(body, *dst);
        }
      } else if (type == kSubmit && prefill_) {
        TANDEM_CHECK_KIND(kIo, !draining_, "the prefill instance is draining");
        GenRequest req = get_request(r);
        transfer::TransferDescriptor dst = get_descriptor(r);
        const std::string id = req.id;
        std::weak_ptr<Conn> weak = conn;
        {
          std::lock_guard<std::mutex> lock(conn->ids_mu);
          conn->ids.insert(id);
        }
        prefill_->submit(req, std::move(dst),
                         [weak, id](const std::string& error, const StepOutput& first) {
                           auto c = weak.lock();
                           if (!c) return;
                           {
                             std::lock_guard<std::mutex> lock(c->ids_mu);
                             c->ids.erase(id);
                           }
                           ByteWriter w;
                           w.put_str(id);
                           w.put_str(error);
                           put_step_output(w, first);
                           c->push(kPrefillDone, w.bytes());
                         });
      } else {
        TANDEM_THROW(kInvalidArgument, "unexpected message ", type, " for this instance");
      }
      conn->push(kReply, reply_ok(serial, body.bytes()));
    } catch (const Error& e) {
      conn->push(kReply, reply_error(serial, e.kind(), e.message()));
    } catch (const std::exception& e) {
      conn->push(kReply, reply_error(serial, ErrorKind::kInternal, e.what()));
    }
  }
  if (!why.empty())
    std::cerr << "tandem: control connection with " + peer + " closed: " + why + "\n";
  // The router is gone: its requests have nobody to stream to.
  conn->open = false;
  std::unordered_set<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(conn->ids_mu);
    ids.swap(conn->ids);
  }
  for (const auto& id : ids) abort_request(id);
  ::close(conn->fd);
}

// ---- Client (the router's side). ----

InstanceConnection::InstanceConnection(const std::string& endpoint, OnPush on_push,
                                       std::function<void()> on_lost, const net::KeyRef& key)
    : endpoint_(endpoint), on_push_(std::move(on_push)), on_lost_(std::move(on_lost)) {
  fd_ = connect_to(endpoint);
  if (key) {
    try {
      net::authenticate_client(fd_, *key, net::Channel::kControl,
                               endpoint + " (" + net::peer_of(fd_) + ")");
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  reader_ = std::thread([this] { read_loop(); });
}

InstanceConnection::~InstanceConnection() {
  closing_ = true;
  ::shutdown(fd_, SHUT_RDWR);
  reader_.join();
  ::close(fd_);
}

void InstanceConnection::read_loop() {
  uint32_t type = 0;
  std::vector<uint8_t> payload;
  std::string why;
  while (read_frame(fd_, type, payload, &why)) {
    if (type == kReply) {
      if (payload.size() < sizeof(uint64_t)) break;  // malformed: the connection is unusable
      ByteReader r(payload);
      const uint64_t serial = r.get<uint64_t>();
      std::lock_guard<std::mutex> lock(mu_);
      auto it = replies_.find(serial);
      if (it == replies_.end()) continue;
      it->second.done = true;
      it->second.bytes = std::move(payload);
      cv_.notify_all();
      continue;
    }
    try {
      on_push_(type, payload);
    } catch (...) {
    }
  }
  if (!why.empty())
    std::cerr << "tandem: control connection to " + endpoint_ + " closed: " + why + "\n";
  {
    std::lock_guard<std::mutex> lock(mu_);
    alive_ = false;
  }
  cv_.notify_all();
  if (on_lost_ && !closing_) on_lost_();
}

bool InstanceConnection::send(uint32_t type, const std::vector<uint8_t>& body) {
  std::lock_guard<std::mutex> lock(write_mu_);
  return alive_ && write_frame(fd_, type, body);
}

std::vector<uint8_t> InstanceConnection::call(uint32_t type, const std::vector<uint8_t>& body,
                                              std::chrono::milliseconds timeout) {
  uint64_t serial;
  {
    std::lock_guard<std::mutex> lock(mu_);
    serial = next_serial_++;
    replies_[serial];
  }
  ByteWriter w;
  w.put(serial);
  w.bytes().insert(w.bytes().end(), body.begin(), body.end());
  const bool sent = send(type, w.bytes());
  std::unique_lock<std::mutex> lock(mu_);
  const bool answered =
      cv_.wait_for(lock, timeout, [&] { return !sent || !alive_ || replies_[serial].done; });
  Reply rep = std::move(replies_[serial]);
  replies_.erase(serial);
  lock.unlock();
  if (!answered) {
    ::shutdown(fd_, SHUT_RDWR);  // the reader ends: the connection counts as lost
    TANDEM_THROW(kIo, "instance ", endpoint_, " did not answer within ", timeout.count(), " ms");
  }
  TANDEM_CHECK_KIND(kIo, rep.done, "lost the connection to instance ", endpoint_);
  ByteReader r(rep.bytes);
  r.get<uint64_t>();
  if (r.get<uint8_t>() == 0) {
    const auto kind = static_cast<ErrorKind>(r.get<int32_t>());
    throw Error(kind, r.get_str());
  }
  return r.get_vec<uint8_t>();
}

// ---- InstanceLink. ----

InstanceLink::InstanceLink(std::string endpoint, InstanceConnection::OnPush on_push,
                           std::function<void()> on_lost, OnConnect on_connect, net::KeyRef key)
    : endpoint_(std::move(endpoint)),
      key_(std::move(key)),
      on_push_(std::move(on_push)),
      on_lost_(std::move(on_lost)),
      on_connect_(std::move(on_connect)) {}

void InstanceLink::close() {
  std::shared_ptr<InstanceConnection> c;
  {
    std::lock_guard<std::mutex> lock(mu_);
    c.swap(conn_);
    next_try_ = std::chrono::steady_clock::time_point::max();
  }
  c.reset();  // (joins its reader, unless a call in flight still holds it)
}

std::shared_ptr<InstanceConnection> InstanceLink::get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return conn_ && conn_->alive() ? conn_ : nullptr;
}

std::string InstanceLink::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
}

bool InstanceLink::poll() {
  std::lock_guard<std::mutex> attempt(connect_mu_);
  std::shared_ptr<InstanceConnection> dead;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (conn_ && conn_->alive()) return true;
    dead.swap(conn_);  // lost: dropped below (outside the lock), then retried
    if (std::chrono::steady_clock::now() < next_try_) return false;
  }
  dead.reset();  // NOTE: joins its reader thread, so its on_lost has finished
  try {
    auto c = std::make_shared<InstanceConnection>(endpoint_, on_push_, on_lost_, key_);
    if (on_connect_) on_connect_(*c);
    std::lock_guard<std::mutex> lock(mu_);
    if (next_try_ == std::chrono::steady_clock::time_point::max()) return false;  // closed
    conn_ = std::move(c);
    backoff_ = std::chrono::milliseconds(100);
    last_error_.clear();
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (next_try_ != std::chrono::steady_clock::time_point::max()) {
      next_try_ = std::chrono::steady_clock::now() + backoff_;
      backoff_ = std::min<std::chrono::milliseconds>(backoff_ * 2, std::chrono::seconds(5));
    }
    const Error* err = dynamic_cast<const Error*>(&e);
    last_error_ = err ? err->message() : e.what();
  }
  return false;
}

// ---- Remote instances. ----

namespace {
constexpr std::chrono::milliseconds kLoadTimeout{2000};
}  // namespace

RemoteDecode::RemoteDecode(const std::string& endpoint, net::KeyRef key)
    : link_(
          endpoint, [this](uint32_t type, const std::vector<uint8_t>& p) { on_push(type, p); },
          [this] { on_lost(); },
          [this, endpoint](InstanceConnection& c) {
            std::vector<uint8_t> info = c.call(kHello, {}, kLoadTimeout);
            ByteReader r(info);
            TANDEM_CHECK_KIND(kInvalidArgument, r.get<uint8_t>() == 1, endpoint,
                              " is not a decode instance");
            max_model_len_ = r.get<int64_t>();
            vocab_size_ = r.get<int64_t>();
          },
          std::move(key)) {
  link_.poll();  // connect now when it is up (else the router's monitor retries)
}

namespace {

using Callbacks = std::unordered_map<std::string, OutputCallback>;

// An output an instance pushed, to its request's callback (the last output removes it).
void deliver_output(std::mutex& mu, Callbacks& callbacks, const std::vector<uint8_t>& payload) {
  StepOutput out = decode_step_output(payload.data(), payload.size());
  OutputCallback cb;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = callbacks.find(out.id);
    if (it == callbacks.end()) return;
    cb = it->second;
    if (out.finished) callbacks.erase(it);
  }
  cb(out);
}

// Ends every request of `lost` with `error` (its connection is gone).
void end_with_error(Callbacks& lost, const std::string& error) {
  for (auto& [id, cb] : lost) {
    StepOutput out;
    out.id = id;
    out.finished = true;
    out.finish_reason = FinishReason::kError;
    out.error = error;
    if (cb) cb(out);
  }
}

}  // namespace

std::shared_ptr<InstanceConnection> RemoteDecode::conn(const char* what) const {
  auto c = link_.get();
  TANDEM_CHECK_KIND(kIo, c != nullptr, what, ": decode instance ", link_.endpoint(),
                    " is not connected");
  return c;
}

void RemoteDecode::on_lost() {
  std::unordered_map<std::string, OutputCallback> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = callbacks_.begin(); it != callbacks_.end();) {
      if (accepting_.count(it->first)) {
        ++it;  // (its accept() call ends with the loss and cleans up)
      } else {
        all.insert(std::move(*it));
        it = callbacks_.erase(it);
      }
    }
  }
  end_with_error(all, "lost the connection to decode instance " + link_.endpoint());
}

void RemoteDecode::on_push(uint32_t type, const std::vector<uint8_t>& payload) {
  if (type == kOutput) deliver_output(mu_, callbacks_, payload);
}

std::optional<transfer::TransferDescriptor> RemoteDecode::accept(const GenRequest& req,
                                                                 const transfer::KvSharding& src,
                                                                 OutputCallback on_output) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    callbacks_[req.id] = std::move(on_output);  // before the call: outputs may follow at once
    accepting_.insert(req.id);  // a loss meanwhile is this call's (it throws), not the callback's
  }
  ByteWriter w;
  put_request(w, req);
  w.put<int64_t>(src.num_kv_heads);
  w.put<int32_t>(src.tp);
  std::shared_ptr<InstanceConnection> c;
  std::optional<transfer::TransferDescriptor> dst;
  try {
    c = conn("accept");
    std::vector<uint8_t> body = c->call(kAccept, w.bytes());
    ByteReader r(body);
    if (r.get<uint8_t>() == 1) dst = get_descriptor(r);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_.erase(req.id);
    callbacks_.erase(req.id);
    throw;
  }
  OutputCallback orphan;
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_.erase(req.id);
    auto it = callbacks_.find(req.id);
    if (!dst) {
      if (it != callbacks_.end()) callbacks_.erase(it);
    } else if (!c->alive() && it != callbacks_.end()) {
      orphan = std::move(it->second);  // accepted, then lost before on_lost could see it
      callbacks_.erase(it);
    }
  }
  if (orphan) {
    StepOutput out;
    out.id = req.id;
    out.finished = true;
    out.finish_reason = FinishReason::kError;
    out.error = "lost the connection to decode instance " + link_.endpoint();
    orphan(out);
  }
  return dst;
}

void RemoteDecode::prefilled(const std::string& id, const StepOutput& first) {
  ByteWriter w;
  w.put_str(id);
  put_step_output(w, first);
  if (auto c = link_.get()) c->send(kPrefilled, w.bytes());
}

void RemoteDecode::fail(const std::string& id, const std::string& error) {
  ByteWriter w;
  w.put_str(id);
  w.put_str(error);
  if (auto c = link_.get()) c->send(kFail, w.bytes());
}

void RemoteDecode::abort(const std::string& id) {
  ByteWriter w;
  w.put_str(id);
  w.put_str("");
  if (auto c = link_.get()) c->send(kAbort, w.bytes());
}

DecodeLoad RemoteDecode::load() const {
  DecodeLoad l;
  try {
    if (!link_.poll()) {
      l.alive = false;
      return l;
    }
    std::vector<uint8_t> body = conn("load")->call(kLoad, {}, kLoadTimeout);
    ByteReader r(body);
    l.batch_per_rank = r.get_vec<int64_t>();
    l.max_decode_batch = r.get<int64_t>();
    l.alive = r.get<uint8_t>() != 0;
    if (r.left() >= 9 * sizeof(int64_t)) {
      EngineStats s = get_stats(r);
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_ = s;
    }
    if (r.left() >= 1) draining_ = r.get<uint8_t>() != 0;
  } catch (const std::exception&) {
    l.alive = false;
  }
  return l;
}

RemoteReplica::RemoteReplica(const std::string& endpoint, net::KeyRef key)
    : link_(
          endpoint, [this](uint32_t type, const std::vector<uint8_t>& p) { on_push(type, p); },
          [this] { on_lost(); },
          [this, endpoint](InstanceConnection& c) {
            std::vector<uint8_t> info = c.call(kHello, {}, kLoadTimeout);
            ByteReader r(info);
            TANDEM_CHECK_KIND(kInvalidArgument, r.get<uint8_t>() == 2, endpoint,
                              " is not a colocated replica (tandem serve --control-port)");
            max_model_len_ = r.get<int64_t>();
            vocab_size_ = r.get<int64_t>();
          },
          std::move(key)) {
  link_.poll();
}

void RemoteReplica::on_lost() {
  std::unordered_map<std::string, OutputCallback> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(callbacks_);
  }
  end_with_error(all, "lost the connection to replica " + link_.endpoint());
}

void RemoteReplica::on_push(uint32_t type, const std::vector<uint8_t>& payload) {
  if (type == kOutput) deliver_output(mu_, callbacks_, payload);
}

void RemoteReplica::submit(GenRequest request, OutputCallback on_output) {
  const std::string id = request.id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    callbacks_[id] = std::move(on_output);  // before the call: outputs may follow at once
  }
  ByteWriter w;
  put_request(w, request);
  try {
    auto c = link_.get();
    TANDEM_CHECK_KIND(kIo, c != nullptr, "replica ", link_.endpoint(), " is not connected");
    c->call(kEngineSubmit, w.bytes());
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    if (callbacks_.erase(id) == 0) return;  // lost meanwhile: on_lost ended it with an error
    throw;                                  // refused
  }
}

void RemoteReplica::abort(const std::string& id) {
  ByteWriter w;
  w.put_str(id);
  w.put_str("");
  if (auto c = link_.get()) c->send(kAbort, w.bytes());
}

bool RemoteReplica::load() const {
  try {
    if (!link_.poll()) return false;
    auto c = link_.get();
    if (!c) return false;
    std::vector<uint8_t> body = c->call(kLoad, {}, kLoadTimeout);
    ByteReader r(body);
    EngineStats s = get_stats(r);
    draining_ = r.get<uint8_t>() != 0;
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = s;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

RemotePrefill::RemotePrefill(const std::string& endpoint, net::KeyRef key)
    : link_(
          endpoint, [this](uint32_t type, const std::vector<uint8_t>& p) { on_push(type, p); },
          [this] { on_lost(); },
          [this, endpoint](InstanceConnection& c) {
            std::vector<uint8_t> info = c.call(kHello, {}, kLoadTimeout);
            ByteReader r(info);
            TANDEM_CHECK_KIND(kInvalidArgument, r.get<uint8_t>() == 0, endpoint,
                              " is not a prefill instance");
            r.get<int64_t>();
            r.get<int64_t>();
            std::lock_guard<std::mutex> lock(sharding_mu_);
            sharding_.num_kv_heads = r.get<int64_t>();
            sharding_.tp = r.get<int32_t>();
          },
          std::move(key)) {
  link_.poll();
}

transfer::KvSharding RemotePrefill::kv_sharding() const {
  std::lock_guard<std::mutex> lock(sharding_mu_);
  return sharding_;
}

void RemotePrefill::on_push(uint32_t type, const std::vector<uint8_t>& payload) {
  if (type != kPrefillDone) return;
  ByteReader r(payload);
  const std::string id = r.get_str();
  const std::string error = r.get_str();
  const StepOutput first = get_step_output(r);
  PrefillDone done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = done_.find(id);
    if (it == done_.end()) return;
    done = std::move(it->second);
    done_.erase(it);
  }
  if (done) done(error, first);
}

void RemotePrefill::on_lost() {
  std::unordered_map<std::string, PrefillDone> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(done_);
  }
  for (auto& [id, done] : all) {
    if (done) done("lost the connection to the prefill instance", StepOutput{});
  }
}

void RemotePrefill::submit(const GenRequest& req, transfer::TransferDescriptor dst,
                           PrefillDone on_done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_[req.id] = std::move(on_done);
  }
  ByteWriter w;
  put_request(w, req);
  put_descriptor(w, dst);
  try {
    auto c = link_.get();
    TANDEM_CHECK_KIND(kIo, c != nullptr, "prefill instance ", link_.endpoint(),
                      " is not connected");
    c->call(kSubmit, w.bytes());
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    done_.erase(req.id);
    throw;
  }
}

void RemotePrefill::abort(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_.erase(id);
  }
  ByteWriter w;
  w.put_str(id);
  w.put_str("");
  if (auto c = link_.get()) c->send(kAbort, w.bytes());
}

PrefillLoad RemotePrefill::load() const {
  PrefillLoad l;
  try {
    if (!link_.poll()) {
      l.alive = false;
      return l;
    }
    auto c = link_.get();
    TANDEM_CHECK_KIND(kIo, c != nullptr, "lost");
    std::vector<uint8_t> body = c->call(kLoad, {}, kLoadTimeout);
    ByteReader r(body);
    l.queued_input_tokens = r.get<int64_t>();
    l.input_tokens_total = r.get<int64_t>();
    l.input_tokens_per_s = r.get<double>();
    l.alive = r.get<uint8_t>() != 0;
    if (r.left() >= 1) draining_ = r.get<uint8_t>() != 0;
    if (r.left() > 0) {
      l.queue_time = get_histogram(r);
      l.iteration_tokens = get_histogram(r);
    }
  } catch (const std::exception&) {
    l.alive = false;
  }
  return l;
}

}  // namespace tandem
