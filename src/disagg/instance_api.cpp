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
#include "net/address.h"
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

bool write_frame(int fd, uint32_t type, const std::vector<uint8_t>& payload) {
  uint32_t head[2] = {type, static_cast<uint32_t>(payload.size())};
  return net::send_all(fd, head, sizeof(head)) && net::send_all(fd, payload.data(), payload.size());
}

// False when the connection ended or the frame is over kMaxControlFrameBytes (why says which).
// The payload grows with the bytes that actually arrive (1 MiB at a time), so a frame that
// claims more than it sends costs no memory.
bool read_frame(int fd, uint32_t& type, std::vector<uint8_t>& payload, std::string* why = nullptr) {
  uint32_t head[2];
  if (!net::recv_all(fd, head, sizeof(head))) return false;
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
    if (!net::recv_all(fd, payload.data() + got, n)) return false;
    got += n;
  }
  return true;
}

// ---- The control messages: each one's fields once (disagg/protocol.h's format). ----

using ::tandem::fields;  // (the roles' messages these carry)

// kReply: serial, ok, then the call's reply body or (error kind, message).
struct ReplyMsg {
  uint64_t serial = 0;
  bool ok = false;
  std::vector<uint8_t> body;  // ok
  int32_t kind = 0;           // not ok: the ErrorKind
  std::string message;
};
template <class Io, codec::Is<ReplyMsg> M>
void fields(Io& io, M& m) {
  io(m.serial);
  io(m.ok);
  if (m.ok) {
    io(m.body);
  } else {
    io(m.kind);
    io(m.message);
  }
}

// kFail / kAbort (one-way): the request and why ("" for an abort).
struct EndMsg {
  std::string id;
  std::string error;
};
template <class Io, codec::Is<EndMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
  io(m.error);
}

// kPrefilled (one-way): the prefill's first output of an accepted request.
struct PrefilledMsg {
  std::string id;
  StepOutput first;
};
template <class Io, codec::Is<PrefilledMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
  fields(io, m.first);
}

// kPrefillDone (pushed): a prefill that ended, with its first output or an error.
struct PrefillDoneMsg {
  std::string id;
  std::string error;
  StepOutput first;
};
template <class Io, codec::Is<PrefillDoneMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
  io(m.error);
  fields(io, m.first);
}

// kHello's reply: what the instance is (0 prefill, 1 decode, 2 a colocated replica).
struct HelloReply {
  uint8_t role = 0;
  int64_t max_model_len = 0;
  int64_t vocab_size = 0;
  transfer::KvSharding sharding;  // (a prefill instance's; not sent by a replica)
};
template <class Io, codec::Is<HelloReply> M>
void fields(Io& io, M& m) {
  io(m.role);
  io(m.max_model_len);
  io(m.vocab_size);
  if (m.role != 2) fields(io, m.sharding);
}

// kAccept: a request and its prefill instance's sharding; the reply: its descriptor when the
// decode instance has room.
struct AcceptMsg {
  GenRequest req;
  transfer::KvSharding src;
};
template <class Io, codec::Is<AcceptMsg> M>
void fields(Io& io, M& m) {
  fields(io, m.req);
  fields(io, m.src);
}
struct AcceptReply {
  bool ok = false;
  transfer::TransferDescriptor dst;
};
template <class Io, codec::Is<AcceptReply> M>
void fields(Io& io, M& m) {
  io(m.ok);
  if (m.ok) fields(io, m.dst);
}

// kSubmit: a request and where its KV goes.
struct SubmitMsg {
  GenRequest req;
  transfer::TransferDescriptor dst;
};
template <class Io, codec::Is<SubmitMsg> M>
void fields(Io& io, M& m) {
  fields(io, m.req);
  fields(io, m.dst);
}

// kLoad's replies. The parts after the first ones are read when present (an older instance
// did not send them).
struct DecodeLoadReply {
  DecodeLoad load;
  EngineStats stats;  // for the router's /metrics
  bool draining = false;
};
template <class Io, codec::Is<DecodeLoadReply> M>
void fields(Io& io, M& m) {
  io(m.load.batch_per_rank);
  io(m.load.max_decode_batch);
  io(m.load.alive);
  if (io.has(9 * sizeof(int64_t))) fields(io, m.stats);
  if (io.has(1)) io(m.draining);
}
struct PrefillLoadReply {
  PrefillLoad load;
  bool draining = false;
};
template <class Io, codec::Is<PrefillLoadReply> M>
void fields(Io& io, M& m) {
  io(m.load.queued_input_tokens);
  io(m.load.input_tokens_total);
  io(m.load.input_tokens_per_s);
  io(m.load.alive);
  if (io.has(1)) io(m.draining);
  if (io.has(1)) {
    fields(io, m.load.queue_time);  // (for the router's /metrics)
    fields(io, m.load.iteration_tokens);
  }
}
struct ReplicaLoadReply {
  EngineStats stats;
  bool draining = false;
};
template <class Io, codec::Is<ReplicaLoadReply> M>
void fields(Io& io, M& m) {
  fields(io, m.stats);
  io(m.draining);
}

template <class Msg>
std::vector<uint8_t> encode(const Msg& m) {
  return codec::encode(m, kProtocolFormat);
}
template <class Msg>
Msg decode(const std::vector<uint8_t>& bytes) {
  return codec::decode<Msg>(bytes, kProtocolFormat);
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
  listen_fd_ = net::listen_tcp(host, port, 16, port_, "instance server");
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
  listen_fd_ = net::listen_tcp(host, port, 16, port_, "instance server");
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
        const auto [id, error] = codec::decode<EndMsg>(r.rest(), kProtocolFormat);
        if (type == kFail && decode_) decode_->fail(id, error);
        if (type == kAbort) abort_request(id);
        continue;
      }
      if (type == kPrefilled) {
        const auto [id, first] = codec::decode<PrefilledMsg>(r.rest(), kProtocolFormat);
        if (decode_) decode_->prefilled(id, first);
        continue;
      }
      serial = r.get<uint64_t>();
      const std::span<const uint8_t> call = r.rest();  // the call's body
      std::vector<uint8_t> body;                       // its reply's
      if (type == kHello && engine_) {                 // role 2: a colocated engine
        body = encode(HelloReply{2, engine_->max_model_len(), engine_->vocab_size(), {}});
      } else if (type == kHello) {
        body = encode(HelloReply{static_cast<uint8_t>(decode_ ? 1 : 0),
                                 decode_ ? decode_->max_model_len() : 0,
                                 decode_ ? decode_->vocab_size() : 0,
                                 prefill_ ? prefill_->kv_sharding() : transfer::KvSharding{}});
      } else if (type == kLoad && engine_) {
        body = encode(ReplicaLoadReply{engine_->stats(), draining_});
      } else if (type == kEngineSubmit && engine_) {
        TANDEM_CHECK_KIND(kIo, !draining_, "the replica is draining");
        GenRequest req = codec::decode<GenRequest>(call, kProtocolFormat);
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
          // With the engine counters (KV pages, prefix cache) and whether it drains.
          auto* di = dynamic_cast<DecodeInstance*>(decode_);
          body =
              encode(DecodeLoadReply{decode_->load(), di ? di->stats() : EngineStats{}, draining_});
        } else {
          body = encode(PrefillLoadReply{prefill_->load(), draining_});
        }
      } else if (type == kAccept && decode_ && draining_) {
        body = encode(AcceptReply{});  // draining: no room for anything new
      } else if (type == kAccept && decode_) {
        auto [req, src] = codec::decode<AcceptMsg>(call, kProtocolFormat);
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
        if (dst) {
          std::lock_guard<std::mutex> lock(conn->ids_mu);
          conn->ids.insert(id);
        }
        body = encode(AcceptReply{dst.has_value(), dst.value_or(transfer::TransferDescriptor{})});
      } else if (type == kSubmit && prefill_) {
        TANDEM_CHECK_KIND(kIo, !draining_, "the prefill instance is draining");
        auto [req, dst] = codec::decode<SubmitMsg>(call, kProtocolFormat);
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
                           c->push(kPrefillDone, encode(PrefillDoneMsg{id, error, first}));
                         });
      } else {
        TANDEM_THROW(kInvalidArgument, "unexpected message ", type, " for this instance");
      }
      conn->push(kReply, encode(ReplyMsg{serial, true, body, 0, ""}));
    } catch (const Error& e) {
      conn->push(kReply,
                 encode(ReplyMsg{serial, false, {}, static_cast<int32_t>(e.kind()), e.message()}));
    } catch (const std::exception& e) {
      conn->push(kReply,
                 encode(ReplyMsg{
                     serial, false, {}, static_cast<int32_t>(ErrorKind::kInternal), e.what()}));
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
  fd_ = net::connect_tcp(endpoint, std::chrono::milliseconds(1000), "instance");
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
  ReplyMsg reply = decode<ReplyMsg>(rep.bytes);
  if (!reply.ok) throw Error(static_cast<ErrorKind>(reply.kind), reply.message);
  return std::move(reply.body);
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

// The hello a remote end opens each connection with: the peer must have the role it is used for.
HelloReply hello_as(InstanceConnection& c, int role, const std::string& endpoint,
                    const char* not_that) {
  HelloReply hello = decode<HelloReply>(c.call(kHello, {}, kLoadTimeout));
  TANDEM_CHECK_KIND(kInvalidArgument, hello.role == role, endpoint, not_that);
  return hello;
}
}  // namespace

RemoteDecode::RemoteDecode(const std::string& endpoint, net::KeyRef key)
    : link_(
          endpoint, [this](uint32_t type, const std::vector<uint8_t>& p) { on_push(type, p); },
          [this] { on_lost(); },
          [this, endpoint](InstanceConnection& c) {
            const auto hello = hello_as(c, 1, endpoint, " is not a decode instance");
            max_model_len_ = hello.max_model_len;
            vocab_size_ = hello.vocab_size;
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
  const std::vector<uint8_t> call = encode(AcceptMsg{req, src});
  std::shared_ptr<InstanceConnection> c;
  std::optional<transfer::TransferDescriptor> dst;
  try {
    c = conn("accept");
    const auto reply = decode<AcceptReply>(c->call(kAccept, call));
    if (reply.ok) dst = reply.dst;
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
  if (auto c = link_.get()) c->send(kPrefilled, encode(PrefilledMsg{id, first}));
}

void RemoteDecode::fail(const std::string& id, const std::string& error) {
  if (auto c = link_.get()) c->send(kFail, encode(EndMsg{id, error}));
}

void RemoteDecode::abort(const std::string& id) {
  if (auto c = link_.get()) c->send(kAbort, encode(EndMsg{id, ""}));
}

DecodeLoad RemoteDecode::load() const {
  DecodeLoad l;
  try {
    if (!link_.poll()) {
      l.alive = false;
      return l;
    }
    auto reply = decode<DecodeLoadReply>(conn("load")->call(kLoad, {}, kLoadTimeout));
    l = std::move(reply.load);
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_ = std::move(reply.stats);
    }
    draining_ = reply.draining;
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
            const auto hello = hello_as(
                c, 2, endpoint, " is not a colocated replica (tandem serve --control-port)");
            max_model_len_ = hello.max_model_len;
            vocab_size_ = hello.vocab_size;
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
  const std::vector<uint8_t> call = encode(request);
  try {
    auto c = link_.get();
    TANDEM_CHECK_KIND(kIo, c != nullptr, "replica ", link_.endpoint(), " is not connected");
    c->call(kEngineSubmit, call);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    if (callbacks_.erase(id) == 0) return;  // lost meanwhile: on_lost ended it with an error
    throw;                                  // refused
  }
}

void RemoteReplica::abort(const std::string& id) {
  if (auto c = link_.get()) c->send(kAbort, encode(EndMsg{id, ""}));
}

bool RemoteReplica::load() const {
  try {
    if (!link_.poll()) return false;
    auto c = link_.get();
    if (!c) return false;
    auto reply = decode<ReplicaLoadReply>(c->call(kLoad, {}, kLoadTimeout));
    draining_ = reply.draining;
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = std::move(reply.stats);
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
            const auto hello = hello_as(c, 0, endpoint, " is not a prefill instance");
            std::lock_guard<std::mutex> lock(sharding_mu_);
            sharding_ = hello.sharding;
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
  const auto [id, error, first] = decode<PrefillDoneMsg>(payload);
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
  const std::vector<uint8_t> call = encode(SubmitMsg{req, dst});
  try {
    auto c = link_.get();
    TANDEM_CHECK_KIND(kIo, c != nullptr, "prefill instance ", link_.endpoint(),
                      " is not connected");
    c->call(kSubmit, call);
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
  if (auto c = link_.get()) c->send(kAbort, encode(EndMsg{id, ""}));
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
    auto reply = decode<PrefillLoadReply>(c->call(kLoad, {}, kLoadTimeout));
    l = std::move(reply.load);
    draining_ = reply.draining;
  } catch (const std::exception&) {
    l.alive = false;
  }
  return l;
}

}  // namespace tandem
