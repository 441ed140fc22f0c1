// The CUDA IPC transfer backend. See cuda_ipc_transfer.h.
#include "transfer/cuda/cuda_ipc_transfer.h"

#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>

#include "core/byte_codec.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "net/address.h"
#include "transfer/cuda/kv_copy.h"
#include "transfer/hidden_chunks.h"
#include "transfer/wire.h"

namespace tandem::transfer {

namespace {

using Clock = std::chrono::steady_clock;

// ---- Control frames: u32 type | u32 body bytes | body (its fields below: one host). ----

enum Msg : uint32_t {
  kHello = 1,       // sender -> receiver: (nothing)
  kHelloReply = 2,  // PoolInfo
  kBegin = 3,       // id, src rank
  kBeginReply = 4,  // id, ok, message
  kFinish = 5,      // id, src rank, first token, logprob, u8 state copied
  kAbort = 6,       // id, src rank, message
  kCancel = 7,      // receiver -> sender: id
  kCancelAck = 8,   // sender -> receiver: id
  kHidden = 9,      // sender -> receiver: id, src rank, u64 offset, u64 total, bytes
};

// A frame's body is at most 1 MiB (the reader allocates it on the peer's word). The prompt's
// hidden states (descriptor hidden_size > 0; 256 MiB for 32k tokens at hidden 2048) therefore
// travel as the one HIDDEN wire message (wire::encode_hidden) cut into kHidden frames of at most
// kHiddenChunkBytes (hidden_chunks.h), before the sending rank's FINISH on the same connection.
// Why chunks over this connection rather than a buffer shared like the KV: the rows are host
// memory at both ends (PromptHidden), so a device staging buffer would add two copies and an
// allocation per request; a host shared-memory segment would need its own naming, lifetime and
// cleanup when a process dies. Chunks need none of that and cost one host copy over loopback
// (small beside the prefill that computed the rows), the receiver bounds the whole message by its
// descriptor before allocating it, and other frames (BEGIN, CANCEL, other requests' FINISH)
// interleave between chunks (one write lock per frame) instead of waiting for the whole message.
constexpr uint32_t kMaxBody = 1 << 20;
static_assert(kHiddenChunkBytes + 4096 <= kMaxBody, "a HIDDEN chunk and its fields fit a frame");

// Each frame's fields, once (core/byte_codec.h): u32 lengths; a malformed frame throws
// Error(kIo) (the connection is dropped).
constexpr codec::Format kFrameFormat{codec::LenWidth::kU32, ErrorKind::kIo, "control frame"};

struct HelloMsg {};
struct BeginMsg {
  std::string id;
  int32_t rank = 0;
};
struct BeginReplyMsg {
  std::string id;
  bool ok = false;
  std::string message;
};
struct FinishMsg {
  std::string id;
  int32_t rank = 0;
  int32_t token = 0;
  float logprob = 0;
  bool state_copied = false;
};
struct AbortMsg {
  std::string id;
  int32_t rank = 0;
  std::string why;
};
struct IdMsg {  // kCancel, kCancelAck
  std::string id;
};
struct HiddenMsg {
  std::string id;
  int32_t rank = 0;
  uint64_t offset = 0;             // of this chunk in the HIDDEN message
  uint64_t total = 0;              // the message's bytes
  std::span<const uint8_t> chunk;  // the rest of the frame
};

template <class Io, codec::Is<HelloMsg> M>
void fields(Io&, M&) {}
template <class Io, codec::Is<BeginMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
  io(m.rank);
}
template <class Io, codec::Is<BeginReplyMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
  io(m.ok);
  io(m.message);
}
template <class Io, codec::Is<FinishMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
  io(m.rank);
  io(m.token);
  io(m.logprob);
  io(m.state_copied);
}
template <class Io, codec::Is<AbortMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
  io(m.rank);
  io(m.why);
}
template <class Io, codec::Is<IdMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
}
template <class Io, codec::Is<HiddenMsg> M>
void fields(Io& io, M& m) {
  io(m.id);
  io(m.rank);
  io(m.offset);
  io(m.total);
  io.tail(m.chunk);
}

template <class Msg>
Msg parse(const std::vector<uint8_t>& body) {
  return codec::decode<Msg>(body, kFrameFormat);
}

// One socket with a write lock (several threads send on it; one reader thread reads).
struct Socket {
  int fd = -1;
  std::mutex write_mu;
  std::atomic<bool> alive{true};

  template <class Msg>
  bool send(uint32_t type, const Msg& msg) {
    const std::vector<uint8_t> body = codec::encode(msg, kFrameFormat);
    uint32_t hdr[2] = {type, static_cast<uint32_t>(body.size())};
    std::lock_guard<std::mutex> lock(write_mu);
    if (!alive) return false;
    if (!net::send_all(fd, hdr, sizeof(hdr)) || !net::send_all(fd, body.data(), body.size())) {
      alive = false;
      return false;
    }
    return true;
  }
  bool recv(uint32_t& type, std::vector<uint8_t>& body) {
    uint32_t hdr[2];
    if (!net::recv_all(fd, hdr, sizeof(hdr)) || hdr[1] > kMaxBody) return false;
    type = hdr[0];
    body.resize(hdr[1]);
    return net::recv_all(fd, body.data(), body.size());
  }
  void shutdown() {
    alive = false;
    if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
  }
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
};

int connect_to(const std::string& address, std::chrono::milliseconds timeout) {
  const int fd = net::connect_tcp(address, timeout, "KV receiver");
  timeval tv{};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

// What a receiver tells its senders about its pool (registration, once per sender process).
struct PoolInfo {
  cudaIpcMemHandle_t handle;
  uint64_t base;  // the pool pointer in the receiver's process (used by a same-process sender)
  int32_t pid;
  int32_t elem_bytes;  // of the pool's elements: 2 bf16, 1 fp8 E4M3 (0, as before: bf16)
  int64_t num_layers, num_pages, num_kv_heads, page_size, head_dim, layer_stride;  // bytes
  // A hybrid's recurrent state slots (KvCache device states: [num_state_slots, state_slot_elems]
  // fp32, one allocation from slot 0); num_state_slots 0: none exported.
  cudaIpcMemHandle_t state_handle;
  uint64_t state_base;
  int64_t num_state_slots, state_slot_elems;
};

struct HelloReplyMsg {
  PoolInfo info;
};
template <class Io, codec::Is<HelloReplyMsg> M>
void fields(Io& io, M& m) {
  io(m.info);
}

// The device pool of a cache: one allocation, layers at a fixed stride.
void pool_of(KvCache& cache, uint8_t*& base, int64_t& stride) {
  const KvGeometry& g = cache.geometry();
  TANDEM_CHECK_KIND(kInvalidArgument,
                    !cache.is_host() && (g.dtype == DType::kBF16 || g.dtype == DType::kF8E4M3),
                    "the cuda-ipc KV transfer needs a device bf16 or fp8 KV cache (a GPU model's)");
  base = static_cast<uint8_t*>(cache.layer_data(0));
  stride = static_cast<int64_t>(g.page_elems() * g.num_pages * dtype_size(g.dtype));
  for (int64_t l = 1; l < g.num_layers; ++l) {
    TANDEM_CHECK_KIND(kInvalidArgument,
                      static_cast<uint8_t*>(cache.layer_data(l)) == base + l * stride,
                      "the cuda-ipc KV transfer needs the layers in one allocation");
  }
}

int device_of(const void* ptr) {
  cudaPointerAttributes attr{};
  TANDEM_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  TANDEM_CHECK_KIND(kInvalidArgument, attr.type == cudaMemoryTypeDevice,
                    "the KV cache is not in device memory");
  return attr.device;
}

// ======================================= receiver ======================================

class IpcReceiver final : public TransferReceiver {
 public:
  IpcReceiver(KvCache& cache, ReceiverCallbacks cbs, const CudaIpcOptions& opts)
      : cache_(cache), cbs_(std::move(cbs)), opts_(opts) {
    const KvGeometry& g = cache.geometry();
    uint8_t* base = nullptr;
    int64_t stride = 0;
    pool_of(cache, base, stride);
    TANDEM_CUDA_CHECK(cudaSetDevice(device_of(base)));
    info_ = {};
    TANDEM_CUDA_CHECK(cudaIpcGetMemHandle(&info_.handle, base));
    info_.base = reinterpret_cast<uint64_t>(base);
    info_.pid = static_cast<int32_t>(::getpid());
    info_.num_layers = g.num_layers;
    info_.num_pages = g.num_pages;
    info_.num_kv_heads = g.num_kv_heads;
    info_.page_size = g.page_size;
    info_.head_dim = g.head_dim;
    info_.layer_stride = stride;
    info_.elem_bytes = static_cast<int32_t>(dtype_size(g.dtype));
    if (cache.states_on_device() && cache.num_state_slots() > 0) {
      // NOTE: slot 0 is the base of the states' allocation (KvCache::External::alloc_states).
      TANDEM_CUDA_CHECK(cudaIpcGetMemHandle(&info_.state_handle, cache.state_data(0)));
      info_.state_base = reinterpret_cast<uint64_t>(cache.state_data(0));
      info_.num_state_slots = cache.num_state_slots();
      info_.state_slot_elems = cache.state_slot_elems();
    }

    int port = 0;
    listen_fd_ = net::listen_tcp(opts_.bind_host, 0, 64, port, "cuda-ipc receiver");
    address_ = net::join_host_port(
        opts_.advertise_host.empty() ? opts_.bind_host : opts_.advertise_host, port);
    accept_thread_ = std::thread([this] { accept_loop(); });
    timer_thread_ = std::thread([this] { timer_loop(); });
  }

  ~IpcReceiver() override {
    stop_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);
    ::close(listen_fd_);
    timer_cv_.notify_all();
    if (accept_thread_.joinable()) accept_thread_.join();
    if (timer_thread_.joinable()) timer_thread_.join();
    std::vector<std::shared_ptr<Conn>> conns;
    {
      std::lock_guard<std::mutex> lock(mu_);
      conns = conns_;
    }
    for (auto& c : conns) c->sock.shutdown();
    for (auto& c : conns) {
      if (c->reader.joinable()) c->reader.join();
    }
  }

  std::string address() const override { return address_; }

  void expect(const TransferDescriptor& d) override {
    d.validate();
    const KvGeometry& g = cache_.geometry();
    const std::string where = "KV transfer of request '" + d.request_id + "': ";
    TANDEM_CHECK_KIND(kInvalidArgument,
                      d.dst_heads.size() == g.num_kv_heads && d.head_dim == g.head_dim &&
                          d.num_layers == g.num_layers && d.page_size == g.page_size,
                      where, "descriptor geometry (", d.dst_heads.size(), " heads x ", d.head_dim,
                      ", ", d.num_layers, " layers, page ", d.page_size,
                      ") does not match this cache (", g.num_kv_heads, " x ", g.head_dim, ", ",
                      g.num_layers, ", page ", g.page_size, ")");
    const int64_t need = (d.num_tokens + g.page_size - 1) / g.page_size;
    std::set<int32_t> seen;
    for (int64_t i = 0; i < need; ++i) {
      const int32_t p = d.dst_pages[static_cast<size_t>(i)];
      TANDEM_CHECK_KIND(kInvalidArgument, p >= 0 && p < g.num_pages && seen.insert(p).second, where,
                        "page id ", p, " out of range [0, ", g.num_pages, ") or repeated");
    }
    if (d.state_elems > 0) {
      // The state is copied device to device into a slot reserved here (never in the FINISH).
      TANDEM_CHECK_KIND(kInvalidArgument, info_.num_state_slots > 0 && d.dst_state_slot >= 0, where,
                        "a recurrent state of ", d.state_elems,
                        " floats moves over cuda-ipc only into a reserved device state slot of "
                        "this cache (descriptor dst_state_slot ",
                        d.dst_state_slot, ", ", info_.num_state_slots, " device slots)");
      TANDEM_CHECK_KIND(
          kInvalidArgument,
          d.dst_state_slot < info_.num_state_slots && d.state_elems == info_.state_slot_elems,
          where, "state slot ", d.dst_state_slot, " of ", d.state_elems,
          " floats does not fit this cache's ", info_.num_state_slots, " slots of ",
          info_.state_slot_elems);
    }
    std::lock_guard<std::mutex> lock(mu_);
    TANDEM_CHECK_KIND(kInvalidArgument, !expected_.count(d.request_id), where, "already expected");
    Expected e;
    e.d = d;
    for (int r : d.senders()) e.senders.insert(r);
    e.hidden = HiddenAssembler(d.num_tokens, d.hidden_size);
    e.deadline = Clock::now() + opts_.timeout;
    expected_.emplace(d.request_id, std::move(e));
  }

  bool cancel(const std::string& id) override {
    std::vector<std::shared_ptr<Conn>> begun;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = expected_.find(id);
      if (it == expected_.end()) return false;
      for (auto& [r, c] : it->second.begun) begun.push_back(c);
      expected_.erase(it);
    }
    drain(id, begun);
    return true;
  }

  std::optional<TransferProgress> progress(const std::string& id) const override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = expected_.find(id);
    if (it == expected_.end()) return std::nullopt;
    TransferProgress p;
    p.senders_expected = static_cast<int>(it->second.senders.size());
    p.senders_finished = static_cast<int>(it->second.finished.size());
    p.pieces_expected = it->second.d.num_layers * p.senders_expected;
    p.pieces_received = it->second.d.num_layers * p.senders_finished;
    return p;
  }

 private:
  struct Conn {
    Socket sock;
    std::thread reader;
  };
  struct Expected {
    TransferDescriptor d;
    std::set<int> senders, finished;
    std::map<int, std::shared_ptr<Conn>> begun;  // src rank -> its control connection
    HiddenAssembler hidden{1, 0};  // descriptor hidden_size > 0: the prompt's hidden states
    int hidden_rank = -1;          // the rank whose HIDDEN chunks arrive
    int state_rank = -1;           // the rank whose FINISH said it copied the state
    int32_t token = 0;
    float logprob = 0;
    Clock::time_point deadline;
  };

  void accept_loop() {
    while (!stop_) {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) {
        if (stop_) return;
        continue;
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      auto c = std::make_shared<Conn>();
      c->sock.fd = fd;
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      conns_.push_back(c);
      c->reader = std::thread([this, c] { serve(c); });
    }
  }

  // Makes every sender that began `id` stop and drain its copies (CANCEL -> CANCEL_ACK):
  // once this returns, nothing writes the request's pages any more.
  void drain(const std::string& id, const std::vector<std::shared_ptr<Conn>>& begun) {
    if (begun.empty()) return;
    std::unique_lock<std::mutex> lock(mu_);
    int& waiting = draining_[id];
    for (auto& c : begun) {
      if (c->sock.send(kCancel, IdMsg{id})) ++waiting;
    }
    drain_cv_.wait_for(lock, opts_.control_timeout, [&] { return draining_[id] <= 0 || stop_; });
    draining_.erase(id);
  }

  void fail(const std::string& id, const std::string& why,
            const std::vector<std::shared_ptr<Conn>>& drain_first) {
    drain(id, drain_first);
    if (cbs_.on_error) cbs_.on_error(id, why);
  }

  void serve(std::shared_ptr<Conn> c) {
    uint32_t type = 0;
    std::vector<uint8_t> body;
    bool authenticated = true;
    if (opts_.key) {
      try {
        net::authenticate_server(c->sock.fd, *opts_.key, net::Channel::kIpcControl,
                                 net::peer_of(c->sock.fd));
      } catch (const Error&) {  // (counted and logged)
        authenticated = false;
      }
    }
    while (authenticated && c->sock.recv(type, body)) {
      try {
        if (type == kHello) {
          c->sock.send(kHelloReply, HelloReplyMsg{info_});
        } else if (type == kBegin) {
          const auto [id, rank] = parse<BeginMsg>(body);
          std::string error;
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = expected_.find(id);
            if (it == expected_.end()) {
              error = "request '" + id + "' is not expected by " + address_ +
                      " (cancelled, timed out or never reserved)";
            } else if (!it->second.senders.count(rank) || it->second.begun.count(rank)) {
              error = "request '" + id + "': prefill rank " + std::to_string(rank) +
                      " does not send to " + address_ + " or began twice";
            } else {
              it->second.begun[rank] = c;
            }
          }
          c->sock.send(kBeginReply, BeginReplyMsg{id, error.empty(), error});
        } else if (type == kFinish) {
          const auto [id, rank, token, lp, state_copied] = parse<FinishMsg>(body);
          bool done = false;
          std::string error;
          std::vector<std::shared_ptr<Conn>> others;
          std::optional<PromptHidden> hidden;
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = expected_.find(id);
            if (it == expected_.end() || !it->second.begun.count(rank)) continue;
            Expected& e = it->second;
            e.finished.insert(rank);
            e.token = token;
            e.logprob = lp;
            done = e.finished == e.senders;
            if (state_copied && e.state_rank < 0) e.state_rank = rank;
            if (state_copied && (e.d.dst_state_slot < 0 || e.state_rank != rank)) {
              error = "prefill rank " + std::to_string(rank) + " copied a recurrent state " +
                      (e.d.dst_state_slot < 0 ? "nobody asked for" : "a second time");
            } else if (done && e.d.dst_state_slot >= 0 && e.state_rank < 0) {
              error = "every sender finished without copying the recurrent state (" +
                      std::to_string(e.d.state_elems) + " floats into slot " +
                      std::to_string(e.d.dst_state_slot) + ")";
            } else if (e.hidden_rank == rank && !e.hidden.whole()) {
              error = "prefill rank " + std::to_string(rank) +
                      " finished before its hidden states were whole";
            } else if (done && e.d.hidden_size > 0 && !e.hidden.whole()) {
              error = "every sender finished without the prompt's hidden states (" +
                      std::to_string(e.d.hidden_size) + " per row)";
            } else if (done && e.hidden.whole()) {
              hidden = e.hidden.take();
            }
            if (!error.empty()) {
              for (auto& [r, oc] : e.begun) {
                if (oc != c) others.push_back(oc);
              }
            }
            if (done || !error.empty()) expected_.erase(it);
          }
          if (!error.empty()) {
            fail(id, "KV transfer of request '" + id + "' failed: " + error, others);
            continue;
          }
          if (done && hidden && cbs_.on_hidden) cbs_.on_hidden(id, std::move(*hidden));
          if (done && cbs_.on_complete) cbs_.on_complete(id, token, lp);
        } else if (type == kHidden) {
          const auto [id, rank, offset, total, chunk] = parse<HiddenMsg>(body);
          std::string error;
          std::vector<std::shared_ptr<Conn>> others;
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = expected_.find(id);
            // Cancelled, timed out or failed: the rest of its chunks are dropped (as a FINISH).
            if (it == expected_.end() || !it->second.begun.count(rank)) continue;
            Expected& e = it->second;
            try {
              TANDEM_CHECK_KIND(kInvalidArgument, !e.finished.count(rank),
                                "HIDDEN after the FINISH");
              TANDEM_CHECK_KIND(kInvalidArgument, e.hidden_rank < 0 || e.hidden_rank == rank,
                                "a second HIDDEN (rank ", e.hidden_rank, " sent one)");
              e.hidden_rank = rank;
              e.hidden.add(offset, total, chunk);
            } catch (const Error& ex) {
              error = "prefill rank " + std::to_string(rank) + ": " + ex.message();
              // (the sending rank's copies completed before its first chunk: no drain)
              for (auto& [r, oc] : e.begun) {
                if (oc != c) others.push_back(oc);
              }
              expected_.erase(it);
            }
          }
          if (!error.empty()) {
            fail(id, "KV transfer of request '" + id + "' failed: " + error, others);
          }
        } else if (type == kAbort) {
          const auto [id, rank, why] = parse<AbortMsg>(body);
          std::vector<std::shared_ptr<Conn>> others;
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = expected_.find(id);
            if (it == expected_.end()) continue;
            for (auto& [r, oc] : it->second.begun) {
              if (r != rank) others.push_back(oc);
            }
            expected_.erase(it);
          }
          fail(id, "prefill rank " + std::to_string(rank) + " aborted: " + why, others);
        } else if (type == kCancelAck) {
          const std::string id = parse<IdMsg>(body).id;
          std::lock_guard<std::mutex> lock(mu_);
          auto it = draining_.find(id);
          if (it != draining_.end()) --it->second;
          drain_cv_.notify_all();
        }
      } catch (const std::exception& e) {
        // A malformed frame: drop the connection (its requests fail below), saying why.
        std::fprintf(stderr,
                     "tandem: KV receiver %s: control frame %u from a prefill rank: %s; "
                     "its connection is dropped\n",
                     address_.c_str(), type, e.what());
        break;
      }
    }
    c->sock.alive = false;
    // Lost: the requests that began on this connection fail (the sender is gone: no writes).
    std::vector<std::pair<std::string, std::vector<std::shared_ptr<Conn>>>> failed;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = expected_.begin(); it != expected_.end();) {
        bool mine = false;
        for (auto& [r, oc] : it->second.begun) mine = mine || oc == c;
        if (mine && it->second.finished.size() < it->second.senders.size()) {
          std::vector<std::shared_ptr<Conn>> others;
          for (auto& [r, oc] : it->second.begun) {
            if (oc != c) others.push_back(oc);
          }
          failed.emplace_back(it->first, std::move(others));
          it = expected_.erase(it);
        } else {
          ++it;
        }
      }
      drain_cv_.notify_all();
    }
    for (auto& [id, others] : failed) {
      fail(id, "lost the control connection of a prefill rank sending to " + address_, others);
    }
  }

  void timer_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      timer_cv_.wait_for(lock, std::chrono::milliseconds(100));
      const auto now = Clock::now();
      std::vector<std::pair<std::string, std::vector<std::shared_ptr<Conn>>>> expired;
      for (auto it = expected_.begin(); it != expected_.end();) {
        if (it->second.deadline <= now) {
          std::vector<std::shared_ptr<Conn>> begun;
          for (auto& [r, c] : it->second.begun) begun.push_back(c);
          expired.emplace_back(it->first, std::move(begun));
          it = expected_.erase(it);
        } else {
          ++it;
        }
      }
      lock.unlock();
      for (auto& [id, begun] : expired) {
        fail(id,
             "KV transfer timed out at " + address_ + " after " +
                 std::to_string(opts_.timeout.count()) + " ms",
             begun);
      }
      lock.lock();
    }
  }

  KvCache& cache_;
  ReceiverCallbacks cbs_;
  CudaIpcOptions opts_;
  PoolInfo info_{};
  int listen_fd_ = -1;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread accept_thread_, timer_thread_;
  std::condition_variable timer_cv_, drain_cv_;
  mutable std::mutex mu_;  // expected_, conns_, draining_
  std::unordered_map<std::string, Expected> expected_;
  std::vector<std::shared_ptr<Conn>> conns_;
  std::unordered_map<std::string, int> draining_;  // request -> CANCEL_ACKs outstanding
};

// ======================================== sender =======================================

class IpcSender final : public TransferSender {
 public:
  IpcSender(const KvCache& cache, const KvSharding& sharding, int rank, SenderCallbacks cbs,
            const CudaIpcOptions& opts)
      : cache_(const_cast<KvCache&>(cache)),
        sharding_(sharding),
        rank_(rank),
        cbs_(std::move(cbs)),
        opts_(opts) {
    sharding_.validate();
    pool_of(cache_, base_, stride_);
    device_ = device_of(base_);
    model_stream_ = static_cast<cudaStream_t>(cache_.device_stream());
    TANDEM_CHECK_KIND(
        kInvalidArgument, cache_.geometry().num_kv_heads == sharding_.held(rank).size(),
        "cuda-ipc sender of rank ", rank, ": the cache holds ", cache_.geometry().num_kv_heads,
        " heads, the sharding ", sharding_.held(rank).size());
    TANDEM_CUDA_CHECK(cudaSetDevice(device_));
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&written_, cudaEventDisableTiming));
    worker_ = std::thread([this] { work_loop(); });
  }

  ~IpcSender() override {
    stopping_ = true;  // a HIDDEN being sent stops at its next chunk
    {
      std::lock_guard<std::mutex> lock(work_mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    if (worker_.joinable()) worker_.join();
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(copy_stream_);
    std::map<std::string, std::shared_ptr<Peer>> peers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      peers.swap(peers_);
      for (auto& [id, r] : reqs_) free_tables(*r);
      reqs_.clear();
    }
    for (auto& [a, p] : peers) p->sock.shutdown();
    for (auto& [a, p] : peers) {
      if (p->reader.joinable()) p->reader.join();
      if (p->mapped && p->info.pid != ::getpid()) (void)cudaIpcCloseMemHandle(p->base);
      if (p->state_mapped) (void)cudaIpcCloseMemHandle(p->state_base);
    }
    (void)cudaEventDestroy(written_);
    (void)cudaStreamDestroy(copy_stream_);
  }

  void begin(const std::string& request, std::vector<TransferDescriptor> destinations,
             std::vector<int32_t> src_pages) override {
    const KvGeometry& g = cache_.geometry();
    const std::string where = "KV transfer of request '" + request + "'";
    TANDEM_CHECK_KIND(kInvalidArgument, !destinations.empty(), where, ": no destinations");
    auto req = std::make_shared<Req>();
    req->id = request;
    req->num_tokens = destinations.front().num_tokens;
    req->num_layers = destinations.front().num_layers;
    req->hidden_size = destinations.front().hidden_size;
    req->state_elems = destinations.front().state_elems;
    for (auto& d : destinations) {
      d.validate();
      const std::string at = where + " to " + d.dst_address + ": ";
      TANDEM_CHECK_KIND(kInvalidArgument, d.hidden_size == req->hidden_size, at, "hidden_size ",
                        d.hidden_size, " differs from another destination's ", req->hidden_size);
      TANDEM_CHECK_KIND(kInvalidArgument, d.state_elems == req->state_elems, at, "state_elems ",
                        d.state_elems, " differs from another destination's ", req->state_elems);
      TANDEM_CHECK_KIND(kInvalidArgument, d.state_elems == 0 || d.dst_state_slot >= 0, at,
                        "a recurrent state moves over cuda-ipc only into a reserved device state "
                        "slot (descriptor dst_state_slot)");
      TANDEM_CHECK_KIND(kInvalidArgument, d.request_id == request && d.src == sharding_, at,
                        "descriptor of request '", d.request_id, "' sharded ", d.src.str(),
                        " does not fit this rank (", sharding_.str(), ")");
      TANDEM_CHECK_KIND(kInvalidArgument,
                        d.head_dim == g.head_dim && d.num_layers == g.num_layers &&
                            d.num_tokens == req->num_tokens,
                        at, "geometry differs from this cache's or another destination's");
      auto slice = plan_head_slice(sharding_, rank_, d.dst_heads);
      if (!slice) continue;
      Dest dest;
      dest.d = d;
      dest.slice = *slice;
      req->dests.push_back(std::move(dest));
    }
    const int64_t need = (req->num_tokens + g.page_size - 1) / g.page_size;
    TANDEM_CHECK_KIND(kInvalidArgument, static_cast<int64_t>(src_pages.size()) >= need, where, ": ",
                      src_pages.size(), " source pages cannot hold ", req->num_tokens, " tokens");
    for (int64_t i = 0; i < need; ++i) {
      const int32_t p = src_pages[static_cast<size_t>(i)];
      TANDEM_CHECK_KIND(kInvalidArgument, p >= 0 && p < g.num_pages, where, ": source page id ", p,
                        " out of range [0, ", g.num_pages, ")");
    }
    req->sent.assign(static_cast<size_t>(req->num_layers), 0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      TANDEM_CHECK_KIND(kInvalidArgument, !reqs_.count(request), where, ": already begun");
    }
    // Registration (once per receiver) and BEGIN: the receiver checks it expects this rank.
    for (Dest& dest : req->dests) {
      const KvGeometry& rg = (dest.peer = peer(dest.d.dst_address))->geometry;
      TANDEM_CHECK_KIND(kInvalidArgument,
                        rg.num_kv_heads == dest.d.dst_heads.size() && rg.head_dim == g.head_dim &&
                            rg.num_layers == g.num_layers && rg.page_size == dest.d.page_size,
                        where, ": the receiver at ", dest.d.dst_address,
                        " has another geometry than its descriptor");
      TANDEM_CHECK_KIND(kInvalidArgument, rg.dtype == g.dtype, where, ": the receiver at ",
                        dest.d.dst_address, " has a ", dtype_name(rg.dtype),
                        " KV cache, this sender ", dtype_name(g.dtype),
                        " (--kv-cache-dtype must match)");
      const Peer& pr = *dest.peer;
      TANDEM_CHECK_KIND(kInvalidArgument,
                        dest.d.state_elems == 0 || (dest.d.dst_state_slot < pr.num_state_slots &&
                                                    dest.d.state_elems == pr.state_slot_elems),
                        where, ": state slot ", dest.d.dst_state_slot, " of ", dest.d.state_elems,
                        " floats does not fit the receiver at ", dest.d.dst_address, " (",
                        pr.num_state_slots, " device slots of ", pr.state_slot_elems, ")");
      call_begin(*dest.peer, request);
    }
    TANDEM_CUDA_CHECK(cudaSetDevice(device_));
    req->d_src = upload(src_pages);
    for (Dest& dest : req->dests) dest.d_dst = upload(dest.d.dst_pages);
    TANDEM_CUDA_CHECK(cudaEventCreateWithFlags(&req->copied, cudaEventDisableTiming));
    std::lock_guard<std::mutex> lock(mu_);
    reqs_[request] = req;
  }

  void send_layer(const std::string& request, int64_t layer, TokenRange tokens) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Piece> pieces;
    take_piece(request, layer, tokens, pieces);
    launch(pieces, layer);
  }

  std::vector<size_t> send_layers(const std::vector<std::string>& requests,
                                  int64_t layer) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Piece> pieces;
    std::vector<size_t> refused;
    for (size_t i = 0; i < requests.size(); ++i) {
      try {
        take_piece(requests[i], layer, {}, pieces);
      } catch (const std::exception&) {
        refused.push_back(i);
      }
    }
    launch(pieces, layer);
    return refused;
  }

  void finish(const std::string& request, int32_t first_token, float logprob) override {
    finish_with(request, first_token, logprob, {});
  }

  void send_state(const std::string& request, int32_t src_slot) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string where = "KV transfer of request '" + request + "': ";
    Req& r = state_request(request, where);
    TANDEM_CHECK_KIND(
        kInvalidArgument,
        cache_.states_on_device() && src_slot >= 0 && src_slot < cache_.num_state_slots() &&
            cache_.state_slot_elems() == r.state_elems,
        where, "source state slot ", src_slot, " of ", cache_.state_slot_elems(), " floats (",
        cache_.num_state_slots(), " device slots: ", cache_.states_on_device() ? "yes" : "no",
        ") does not give the ", r.state_elems, " the destination expects");
    copy_state(r, cache_.state_data(src_slot));
  }

  void send_state_from(const std::string& request, const float* src, int64_t elems) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string where = "KV transfer of request '" + request + "': ";
    Req& r = state_request(request, where);
    TANDEM_CHECK_KIND(kInvalidArgument, src != nullptr && elems == r.state_elems, where,
                      "a device state of ", elems, " floats", src == nullptr ? " (null)" : "",
                      " does not give the ", r.state_elems, " the destination expects");
    copy_state(r, src);
  }

  void finish_with(const std::string& request, int32_t first_token, float logprob,
                   FinishPayload payload) override {
    TANDEM_CHECK_KIND(kUnsupported, payload.state.empty(), "KV transfer of request '", request,
                      "': the cuda-ipc backend does not carry a recurrent state");
    const PromptHidden& hidden = payload.hidden;
    if (!hidden.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = reqs_.find(request);
      if (it != reqs_.end()) {
        const int64_t hs = it->second->hidden_size, tokens = it->second->num_tokens;
        TANDEM_CHECK_KIND(
            kInvalidArgument,
            hs > 0 && static_cast<int64_t>(hidden.rows.size()) % hs == 0 && hidden.begin >= 0 &&
                hidden.begin + static_cast<int64_t>(hidden.rows.size()) / hs == tokens,
            "KV transfer of request '", request, "': hidden states of ", hidden.rows.size(),
            " floats from row ", hidden.begin, ", the destination expects rows up to ", tokens,
            " of ", hs, hs == 0 ? " (it asked for none)" : "");
      }
    }
    std::shared_ptr<Req> r = take(request, /*check_whole=*/true);
    if (!r) return;
    auto rows = std::make_shared<PromptHidden>(std::move(payload.hidden));
    if (!rows->empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      finishing_[request] = r;  // a CANCEL from now on stops its chunks
    }
    // Once the copies completed: HIDDEN (in chunks, when given) then FINISH to every
    // destination, from the worker (a HIDDEN may be hundreds of MiB: not on the caller's thread).
    post([this, r, first_token, logprob, rows] {
      (void)cudaEventSynchronize(r->copied);
      const bool with_hidden = !rows->empty();
      if (with_hidden && stopping_) {  // destroyed: neither HIDDEN nor FINISH, no callback
        {
          std::lock_guard<std::mutex> lock(mu_);
          finishing_.erase(r->id);
          r->callback_done = true;
        }
        done(*r, "");
        return;
      }
      std::vector<uint8_t> message;
      if (with_hidden) {
        message = wire::encode_hidden({rows->begin, r->hidden_size, std::move(rows->rows)});
      }
      bool ok;
      {
        std::lock_guard<std::mutex> lock(mu_);  // (a CANCEL may fail it meanwhile: finishing_)
        ok = !r->failed;
      }
      for (const Dest& dest : r->dests) {
        if (cancelled(dest)) continue;
        if (with_hidden && !send_hidden(*r, dest, message)) {
          ok = false;
          continue;
        }
        ok = dest.peer->sock.send(kFinish,
                                  FinishMsg{r->id, rank_, first_token, logprob, r->state_copied}) &&
             ok;
      }
      if (with_hidden) {
        std::lock_guard<std::mutex> lock(mu_);
        finishing_.erase(r->id);
        if (stopping_) r->callback_done = true;  // destroyed meanwhile: no callback
      }
      done(*r, ok ? "" : "lost the control connection to a KV receiver");
    });
  }

  void abort(const std::string& request) override {
    std::shared_ptr<Req> r = take(request, /*check_whole=*/false);
    if (!r) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      r->callback_done = true;  // no callback after abort
    }
    post([this, r] {
      (void)cudaEventSynchronize(r->copied);  // drained before the receiver frees the pages
      for (const Dest& dest : r->dests) {
        if (dest.cancelled) continue;
        dest.peer->sock.send(kAbort, AbortMsg{r->id, rank_, "aborted by the prefill instance"});
      }
      done(*r, "");
    });
  }

 private:
  struct Peer {
    std::string address;
    Socket sock;
    std::thread reader;
    PoolInfo info{};
    KvGeometry geometry;
    uint8_t* base = nullptr;
    int64_t stride = 0;
    bool mapped = false;
    uint8_t* state_base = nullptr;  // its state slots (num_state_slots > 0)
    int64_t num_state_slots = 0, state_slot_elems = 0;
    bool state_mapped = false;
    std::mutex mu;
    std::condition_variable cv;
    bool hello = false;
    std::map<std::string, std::pair<bool, std::string>> begun;  // BEGIN replies
  };
  struct Dest {
    TransferDescriptor d;
    HeadSlice slice;
    std::shared_ptr<Peer> peer;
    int32_t* d_dst = nullptr;
    bool cancelled = false;
  };
  struct Req {
    std::string id;
    std::vector<Dest> dests;
    int32_t* d_src = nullptr;
    std::vector<int64_t> sent;
    int64_t num_tokens = 0, num_layers = 0;
    cudaEvent_t copied = nullptr;
    int64_t hidden_size = 0;    // descriptor hidden_size (every destination's)
    int64_t state_elems = 0;    // descriptor state_elems (every destination's)
    bool state_copied = false;  // send_state enqueued its copies (the FINISH says so)
    bool failed = false;
    bool callback_done = false;
  };

  // The begun request `request` that owes its state (under mu_).
  Req& state_request(const std::string& request, const std::string& where) {
    auto it = reqs_.find(request);
    TANDEM_CHECK_KIND(kInvalidArgument, it != reqs_.end(), where, "send_state before begin");
    Req& r = *it->second;
    TANDEM_CHECK_KIND(kInvalidArgument, r.state_elems > 0 && !r.state_copied, where,
                      r.state_elems == 0 ? "the destination asks for no recurrent state"
                                         : "the state was sent already");
    return r;
  }

  // r.state_elems floats at device address src into every destination's reserved slot (under
  // mu_).
  void copy_state(Req& r, const float* src) {
    r.state_copied = true;
    if (r.failed || r.dests.empty()) return;
    TANDEM_CUDA_CHECK(cudaSetDevice(device_));
    // After the model's last write of the slot (stream order), on the copy stream.
    TANDEM_CUDA_CHECK(cudaEventRecord(written_, model_stream_));
    TANDEM_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, written_, 0));
    const size_t bytes = static_cast<size_t>(r.state_elems) * sizeof(float);
    for (const Dest& dest : r.dests) {
      if (dest.cancelled || !dest.peer->sock.alive) continue;
      uint8_t* dst = dest.peer->state_base + static_cast<size_t>(dest.d.dst_state_slot) * bytes;
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, copy_stream_));
    }
    // The source slot may be reused once the copy read it.
    TANDEM_CUDA_CHECK(cudaEventRecord(r.copied, copy_stream_));
    TANDEM_CUDA_CHECK(cudaStreamWaitEvent(model_stream_, r.copied, 0));
  }

  bool cancelled(const Dest& d) {
    std::lock_guard<std::mutex> lock(mu_);
    return d.cancelled;
  }

  // The HIDDEN message of a finishing request to one destination, in chunks (see kMaxBody).
  // False when the connection is lost, the destination cancelled or this sender is destroyed
  // meanwhile (then no FINISH follows: the receiver fails or has dropped the request).
  bool send_hidden(const Req& r, const Dest& dest, const std::vector<uint8_t>& message) {
    uint64_t at = 0;
    for (const std::span<const uint8_t> chunk : split_chunks(message)) {
      if (stopping_ || cancelled(dest)) return false;
      if (!dest.peer->sock.send(kHidden, HiddenMsg{r.id, rank_, at, message.size(), chunk})) {
        return false;
      }
      at += chunk.size();
    }
    return true;
  }

  struct Piece {  // tokens of one request's layer to move
    Req* req;
    int64_t begin, end;
  };

  // Checks and records the next token range of `request`'s layer (under mu_); adds it to
  // `pieces` unless the request failed or owes nobody.
  void take_piece(const std::string& request, int64_t layer, TokenRange tokens,
                  std::vector<Piece>& pieces) {
    auto it = reqs_.find(request);
    TANDEM_CHECK_KIND(kInvalidArgument, it != reqs_.end(), "send_layer: request '", request,
                      "' was not begun");
    Req& r = *it->second;
    TANDEM_CHECK_KIND(kInvalidArgument, layer >= 0 && layer < r.num_layers, "send_layer: layer ",
                      layer, " out of range");
    const int64_t end = tokens.end < 0 ? r.num_tokens : tokens.end;
    int64_t& sent = r.sent[static_cast<size_t>(layer)];
    TANDEM_CHECK_KIND(kInvalidArgument,
                      tokens.begin == sent && end > tokens.begin && end <= r.num_tokens,
                      "send_layer: tokens [", tokens.begin, ", ", end, ") of layer ", layer,
                      " of request '", request, "' do not follow on from ", sent);
    sent = end;
    if (!r.failed && !r.dests.empty()) pieces.push_back({&r, tokens.begin, end});
  }

  // One copy launch per kKvCopyMaxDests (request, destination) pairs of layer `layer`, once
  // the model's write of the layer is done (stream order). Under mu_.
  void launch(const std::vector<Piece>& pieces, int64_t layer) {
    if (pieces.empty()) return;
    TANDEM_CUDA_CHECK(cudaSetDevice(device_));
    TANDEM_CUDA_CHECK(cudaEventRecord(written_, model_stream_));
    TANDEM_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, written_, 0));
    const KvGeometry& g = cache_.geometry();
    transfer::cuda::KvCopyParams p{};
    p.src = reinterpret_cast<const uint16_t*>(base_ + layer * stride_);
    p.src_heads = static_cast<int32_t>(g.num_kv_heads);
    p.src_page_size = static_cast<int32_t>(g.page_size);
    p.head_dim = static_cast<int32_t>(g.head_dim);
    p.elem_bytes = static_cast<int32_t>(dtype_size(g.dtype));
    for (const Piece& piece : pieces) {
      for (const Dest& dest : piece.req->dests) {
        if (dest.cancelled || !dest.peer->sock.alive) continue;
        transfer::cuda::KvCopyDest& d = p.dests[p.num_dests++];
        d.src_table = piece.req->d_src;
        d.token_begin = piece.begin;
        d.token_end = piece.end;
        d.dst = reinterpret_cast<uint16_t*>(dest.peer->base + layer * dest.peer->stride);
        d.dst_table = dest.d_dst;
        d.dst_heads = static_cast<int32_t>(dest.peer->geometry.num_kv_heads);
        d.dst_head_offset = static_cast<int32_t>(dest.slice.dst_offset);
        d.src_head_offset = static_cast<int32_t>(dest.slice.src_offset);
        d.num_heads = static_cast<int32_t>(dest.slice.num_heads());
        d.dst_page_size = static_cast<int32_t>(dest.peer->geometry.page_size);
        if (p.num_dests == transfer::cuda::kKvCopyMaxDests) {
          transfer::cuda::kv_copy_launch(p, copy_stream_);
          p.num_dests = 0;
        }
      }
    }
    transfer::cuda::kv_copy_launch(p, copy_stream_);
  }

  int32_t* upload(const std::vector<int32_t>& table) {
    int32_t* d = nullptr;
    TANDEM_CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(1, table.size()) * sizeof(int32_t)));
    TANDEM_CUDA_CHECK(
        cudaMemcpy(d, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    return d;
  }
  static void free_tables(Req& r) {
    if (r.d_src) (void)cudaFree(r.d_src);
    for (Dest& d : r.dests) {
      if (d.d_dst) (void)cudaFree(d.d_dst);
    }
    if (r.copied) (void)cudaEventDestroy(r.copied);
    r.d_src = nullptr;
    r.copied = nullptr;
    for (Dest& d : r.dests) d.d_dst = nullptr;
  }

  // Removes a begun request; the model stream then waits for its copies (its pages may be
  // reused by the next forward only after them).
  std::shared_ptr<Req> take(const std::string& request, bool check_whole) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = reqs_.find(request);
    if (it == reqs_.end()) return nullptr;
    std::shared_ptr<Req> r = it->second;
    if (check_whole && !r->failed) {
      for (int64_t l = 0; l < r->num_layers; ++l) {
        TANDEM_CHECK_KIND(kInvalidArgument, r->sent[static_cast<size_t>(l)] == r->num_tokens,
                          "finish: layer ", l, " of request '", request, "' is not whole");
      }
    }
    reqs_.erase(it);
    TANDEM_CUDA_CHECK(cudaSetDevice(device_));
    // Everything enqueued on the copy stream so far covers this request's copies.
    TANDEM_CUDA_CHECK(cudaEventRecord(r->copied, copy_stream_));
    TANDEM_CUDA_CHECK(cudaStreamWaitEvent(model_stream_, r->copied, 0));
    return r;
  }

  void done(Req& r, const std::string& error) {
    (void)cudaSetDevice(device_);
    free_tables(r);
    bool cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cb = !r.callback_done;
      r.callback_done = true;
    }
    if (!cb) return;
    if (error.empty()) {
      if (cbs_.on_sent) cbs_.on_sent(r.id);
    } else if (cbs_.on_error) {
      cbs_.on_error(r.id, error);
    }
  }

  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(work_mu_);
      work_.push_back(std::move(fn));
    }
    work_cv_.notify_one();
  }

  void work_loop() {
    (void)cudaSetDevice(device_);
    std::unique_lock<std::mutex> lock(work_mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || !work_.empty(); });
      if (work_.empty() && stop_) return;
      auto fn = std::move(work_.front());
      work_.pop_front();
      lock.unlock();
      try {
        fn();
      } catch (...) {
      }
      lock.lock();
    }
  }

  // The control connection to a receiver, made and registered at first use.
  std::shared_ptr<Peer> peer(const std::string& address) {
    std::lock_guard<std::mutex> lock(peers_mu_);
    {
      std::lock_guard<std::mutex> l2(mu_);
      auto it = peers_.find(address);
      if (it != peers_.end() && it->second->sock.alive) return it->second;
      if (it != peers_.end()) peers_.erase(it);  // (its reader ends by itself)
    }
    auto p = std::make_shared<Peer>();
    p->address = address;
    p->sock.fd = connect_to(address, opts_.control_timeout);
    if (opts_.key) {  // (throws, counted and logged; ~Socket closes the fd)
      net::authenticate_client(p->sock.fd, *opts_.key, net::Channel::kIpcControl, address);
    }
    p->reader = std::thread([this, p] { read_peer(p); });
    p->sock.send(kHello, HelloMsg{});
    {
      std::unique_lock<std::mutex> pl(p->mu);
      if (!p->cv.wait_for(pl, opts_.control_timeout, [&] { return p->hello || !p->sock.alive; }) ||
          !p->hello) {
        pl.unlock();
        p->sock.shutdown();
        p->reader.join();
        TANDEM_THROW(kIo, "KV receiver ", address, " did not answer the registration");
      }
    }
    const PoolInfo& in = p->info;
    p->geometry = {in.num_layers, in.num_pages, in.num_kv_heads, in.page_size, in.head_dim};
    p->geometry.dtype = in.elem_bytes == 1 ? DType::kF8E4M3 : DType::kBF16;
    p->stride = in.layer_stride;
    TANDEM_CUDA_CHECK(cudaSetDevice(device_));
    if (in.pid == ::getpid()) {
      p->base = reinterpret_cast<uint8_t*>(in.base);
    } else {
      void* mapped = nullptr;
      const cudaError_t st =
          cudaIpcOpenMemHandle(&mapped, in.handle, cudaIpcMemLazyEnablePeerAccess);
      if (st != cudaSuccess) {
        (void)cudaGetLastError();
        p->sock.shutdown();
        p->reader.join();
        TANDEM_THROW(kIo, "cannot map the KV pool of receiver ", address,
                     " (CUDA IPC: ", cudaGetErrorString(st), "): is it on another host?");
      }
      p->base = static_cast<uint8_t*>(mapped);
      p->mapped = true;
    }
    if (in.num_state_slots > 0) {
      p->num_state_slots = in.num_state_slots;
      p->state_slot_elems = in.state_slot_elems;
      if (in.pid == ::getpid()) {
        p->state_base = reinterpret_cast<uint8_t*>(in.state_base);
      } else {
        void* mapped = nullptr;
        const cudaError_t st =
            cudaIpcOpenMemHandle(&mapped, in.state_handle, cudaIpcMemLazyEnablePeerAccess);
        if (st != cudaSuccess) {
          (void)cudaGetLastError();
          if (p->mapped) (void)cudaIpcCloseMemHandle(p->base);
          p->sock.shutdown();
          p->reader.join();
          TANDEM_THROW(kIo, "cannot map the state slots of KV receiver ", address,
                       " (CUDA IPC: ", cudaGetErrorString(st), ")");
        }
        p->state_base = static_cast<uint8_t*>(mapped);
        p->state_mapped = true;
      }
    }
    std::lock_guard<std::mutex> l2(mu_);
    peers_[address] = p;
    return p;
  }

  void call_begin(Peer& p, const std::string& id) {
    TANDEM_CHECK_KIND(kIo, p.sock.send(kBegin, BeginMsg{id, rank_}),
                      "lost the control connection to KV receiver ", p.address);
    std::unique_lock<std::mutex> lock(p.mu);
    const bool answered = p.cv.wait_for(lock, opts_.control_timeout,
                                        [&] { return p.begun.count(id) || !p.sock.alive; });
    TANDEM_CHECK_KIND(kIo, answered && p.begun.count(id), "KV receiver ", p.address,
                      " did not answer BEGIN of request '", id, "'");
    auto [ok, msg] = p.begun[id];
    p.begun.erase(id);
    TANDEM_CHECK_KIND(kInvalidArgument, ok, "KV receiver refused request '", id, "': ", msg);
  }

  void read_peer(std::shared_ptr<Peer> p) {
    uint32_t type = 0;
    std::vector<uint8_t> body;
    while (p->sock.recv(type, body)) {
      try {
        if (type == kHelloReply) {
          const PoolInfo info = parse<HelloReplyMsg>(body).info;
          std::lock_guard<std::mutex> lock(p->mu);
          p->info = info;
          p->hello = true;
          p->cv.notify_all();
        } else if (type == kBeginReply) {
          auto [id, ok, msg] = parse<BeginReplyMsg>(body);
          std::lock_guard<std::mutex> lock(p->mu);
          p->begun[id] = {ok, msg};
          p->cv.notify_all();
        } else if (type == kCancel) {
          const std::string id = parse<IdMsg>(body).id;
          std::shared_ptr<Req> r;
          {
            std::lock_guard<std::mutex> lock(mu_);
            auto it = reqs_.find(id);
            auto fin = finishing_.find(id);  // sending its HIDDEN
            if (it != reqs_.end() || fin != finishing_.end()) {
              r = it != reqs_.end() ? it->second : fin->second;
              for (Dest& d : r->dests) {
                if (d.peer == p) d.cancelled = true;
              }
            }
          }
          // Copies already enqueued for it finish before the receiver hears back.
          (void)cudaSetDevice(device_);
          (void)cudaStreamSynchronize(copy_stream_);
          p->sock.send(kCancelAck, IdMsg{id});
          if (r) error_once(*r, "the KV receiver at " + p->address + " cancelled the request");
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr,
                     "tandem: KV sender, receiver %s: control frame %u: %s; "
                     "the connection is dropped\n",
                     p->address.c_str(), type, e.what());
        break;
      }
    }
    p->sock.alive = false;
    {
      std::lock_guard<std::mutex> lock(p->mu);
      p->cv.notify_all();
    }
    // Lost: the requests with a destination there fail.
    std::vector<std::shared_ptr<Req>> lost;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, r] : reqs_) {
        for (const Dest& d : r->dests) {
          if (d.peer == p) {
            lost.push_back(r);
            break;
          }
        }
      }
    }
    for (auto& r : lost) error_once(*r, "lost the control connection to KV receiver " + p->address);
  }

  void error_once(Req& r, const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      r.failed = true;
      if (r.callback_done) return;
      r.callback_done = true;
    }
    if (cbs_.on_error) cbs_.on_error(r.id, why);
  }

  KvCache& cache_;
  KvSharding sharding_;
  int rank_;
  SenderCallbacks cbs_;
  CudaIpcOptions opts_;
  uint8_t* base_ = nullptr;
  int64_t stride_ = 0;
  int device_ = 0;
  cudaStream_t model_stream_ = nullptr;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t written_ = nullptr;  // reused: "the model wrote this layer" (send_layer, under mu_)
  std::mutex peers_mu_;            // serialises connecting
  std::mutex mu_;                  // reqs_, peers_, Req fields
  std::map<std::string, std::shared_ptr<Peer>> peers_;
  std::unordered_map<std::string, std::shared_ptr<Req>> reqs_;
  std::unordered_map<std::string, std::shared_ptr<Req>> finishing_;  // sending a HIDDEN
  std::atomic<bool> stopping_{false};
  std::mutex work_mu_;
  std::condition_variable work_cv_;
  std::deque<std::function<void()>> work_;
  bool stop_ = false;
  std::thread worker_;
};

class CudaIpcBackend final : public TransferBackend {
 public:
  explicit CudaIpcBackend(CudaIpcOptions opts) : opts_(std::move(opts)) {}
  std::string_view name() const override { return "cuda-ipc"; }
  bool carries_prompt_hidden() const override { return true; }  // HIDDEN chunks (kMaxBody)
  bool carries_device_state() const override { return true; }   // send_state
  std::unique_ptr<TransferSender> make_sender(const KvCache& cache, const KvSharding& sharding,
                                              int rank, SenderCallbacks callbacks) override {
    return std::make_unique<IpcSender>(cache, sharding, rank, std::move(callbacks), opts_);
  }
  std::unique_ptr<TransferReceiver> make_receiver(KvCache& cache,
                                                  ReceiverCallbacks callbacks) override {
    return std::make_unique<IpcReceiver>(cache, std::move(callbacks), opts_);
  }

 private:
  CudaIpcOptions opts_;
};

}  // namespace

std::unique_ptr<TransferBackend> make_cuda_ipc_backend(CudaIpcOptions options) {
  return std::make_unique<CudaIpcBackend>(std::move(options));
}

}  // namespace tandem::transfer
