#include "transfer/tcp_transfer.h"

// clang-format off
#include <utility>  // NOTE: first: Boost 1.74's asio/awaitable.hpp uses std::exchange without it
#include <boost/asio.hpp>
// clang-format on

#include <algorithm>
#include <array>
#include <cstdio>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "core/error.h"
#include "net/address.h"
#include "net/cluster_auth_asio.h"
#include "transfer/kv_pack.h"
#include "transfer/wire.h"

namespace tandem::transfer {

namespace {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using error_code = boost::system::error_code;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using Bytes = std::vector<uint8_t>;

std::string ms_text(milliseconds ms) { return std::to_string(ms.count()) + " ms"; }

std::string peer_of(const tcp::socket& s) {
  error_code ec;
  const auto ep = s.remote_endpoint(ec);
  if (ec) return "unknown peer";
  const auto a = ep.address();
  return (a.is_v6() ? "[" + a.to_string() + "]" : a.to_string()) + ":" + std::to_string(ep.port());
}

milliseconds sweep_interval(milliseconds timeout) {
  return std::clamp(timeout / 4, milliseconds(5), milliseconds(500));
}

// One io_context run by one thread until stop().
class IoThread {
 public:
  IoThread() : guard_(net::make_work_guard(io_)) {}
  ~IoThread() { stop(); }
  void start() {
    thread_ = std::thread([this] { run(); });
  }
  void stop() {
    guard_.reset();
    io_.stop();
    if (thread_.joinable()) thread_.join();
  }
  net::io_context& io() { return io_; }

 private:
  void run() {
    for (;;) {
      try {
        io_.run();
        return;
      } catch (const std::exception& e) {  // handlers catch what they expect; this is a bug
        std::fprintf(stderr, "tandem transfer: unexpected exception on the I/O thread: %s\n",
                     e.what());
      }
    }
  }
  net::io_context io_;
  net::executor_work_guard<net::io_context::executor_type> guard_;
  std::thread thread_;
};

// =============================================================================================
// Receiver

class TcpReceiver final : public TransferReceiver {
 public:
  TcpReceiver(KvCache& cache, ReceiverCallbacks callbacks, const HostTcpOptions& options)
      : cache_(cache),
        callbacks_(std::move(callbacks)),
        options_(options),
        acceptor_(io_.io()),
        sweep_timer_(io_.io()) {
    error_code ec;
    const auto addr = net::ip::make_address(options.bind_host, ec);
    TANDEM_CHECK_KIND(kInvalidArgument, !ec, "KV transfer receiver: bind host '", options.bind_host,
                      "' is not an IP address");
    const tcp::endpoint ep(addr, static_cast<uint16_t>(options.port));
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
    TANDEM_CHECK_KIND(kIo, !ec, "KV transfer receiver could not listen on ", options.bind_host, ":",
                      options.port, ": ", ec.message());
    address_ = tandem::net::join_host_port(
        options.advertise_host.empty() ? options.bind_host : options.advertise_host,
        acceptor_.local_endpoint().port());
    start_accept();
    arm_sweep();
    io_.start();
  }

  ~TcpReceiver() override { io_.stop(); }

  std::string address() const override { return address_; }

  void expect(const TransferDescriptor& d) override {
    d.validate();
    const KvGeometry& g = cache_.geometry();
    const std::string where = "KV transfer of request '" + d.request_id + "': ";
    TANDEM_CHECK_KIND(kInvalidArgument, d.dst_heads.size() == g.num_kv_heads, where,
                      "head range mismatch: the descriptor puts heads ", d.dst_heads.str(), " (",
                      d.dst_heads.size(), ") here but this cache holds ", g.num_kv_heads, " heads");
    TANDEM_CHECK_KIND(kInvalidArgument, d.page_size == g.page_size, where, "page_size ",
                      d.page_size, " differs from this cache's ", g.page_size);
    TANDEM_CHECK_KIND(kInvalidArgument, d.head_dim == g.head_dim, where, "head_dim ", d.head_dim,
                      " differs from this cache's ", g.head_dim);
    TANDEM_CHECK_KIND(kInvalidArgument, d.num_layers == g.num_layers, where, d.num_layers,
                      " layers differ from this cache's ", g.num_layers);
    const int64_t written = (d.num_tokens + d.page_size - 1) / d.page_size;
    std::set<int32_t> seen;
    for (size_t i = 0; i < d.dst_pages.size(); ++i) {
      const int32_t p = d.dst_pages[i];
      TANDEM_CHECK_KIND(kInvalidArgument, p >= 0 && p < g.num_pages, where, "page id ", p,
                        " out of range [0, ", g.num_pages, ")");
      TANDEM_CHECK_KIND(kInvalidArgument,
                        static_cast<int64_t>(i) >= written || seen.insert(p).second, where,
                        "page id ", p, " appears twice in the block table");
    }

    auto inc = std::make_shared<Incoming>();
    inc->desc = d;
    inc->senders = d.senders();
    for (int r : inc->senders) inc->slices.push_back(*plan_head_slice(d.src, r, d.dst_heads));
    const size_t s = inc->senders.size();
    inc->next_token.assign(s, std::vector<int64_t>(static_cast<size_t>(d.num_layers), 0));
    inc->connected.assign(s, false);
    inc->finished.assign(s, false);
    inc->last_progress = Clock::now();

    std::lock_guard lock(mu_);
    TANDEM_CHECK_KIND(kInvalidArgument, !pending_.contains(d.request_id), where,
                      "already expected");
    for (int32_t p : seen) {
      auto it = page_writer_.find(p);
      TANDEM_CHECK_KIND(kInvalidArgument, it == page_writer_.end(), where, "page ", p,
                        " is already reserved for the transfer of request '",
                        it == page_writer_.end() ? "" : it->second, "'");
    }
    for (int32_t p : seen) page_writer_.emplace(p, d.request_id);
    pending_.emplace(d.request_id, inc);
  }

  bool cancel(const std::string& request) override {
    std::shared_ptr<Incoming> inc;
    {
      std::lock_guard lock(mu_);
      auto it = pending_.find(request);
      if (it == pending_.end()) return false;
      inc = it->second;
      erase_locked(it);
    }
    {
      std::lock_guard lock(inc->write_mu);  // waits for a copy in progress
      inc->live = false;
    }
    net::post(io_.io(), [this, inc] {
      abandon_conns(*inc, "request '" + inc->desc.request_id + "' was cancelled by the receiver");
    });
    return true;
  }

  std::optional<TransferProgress> progress(const std::string& request) const override {
    std::lock_guard lock(mu_);
    auto it = pending_.find(request);
    if (it == pending_.end()) return std::nullopt;
    const Incoming& inc = *it->second;
    const int s = static_cast<int>(inc.senders.size());
    return TransferProgress{inc.pieces_received, inc.desc.num_layers * s, inc.senders_finished, s};
  }

 private:
  struct Conn;

  // One expected request.
  struct Incoming {
    TransferDescriptor desc;
    std::vector<int> senders;       // source ranks that send here, ascending
    std::vector<HeadSlice> slices;  // per sender
    // I/O thread only.
    std::vector<std::vector<int64_t>> next_token;  // [sender][layer]: tokens received so far
    std::vector<bool> connected, finished;
    bool have_token = false;
    int32_t first_token = 0;
    float logprob = 0.0f;
    int token_rank = -1;
    bool have_state = false;  // hybrid models: the recurrent state arrived with a FINISH
    std::vector<float> state;
    bool have_hidden = false;  // MTP: the prompt's hidden states arrived (HIDDEN)
    PromptHidden hidden;
    std::vector<std::weak_ptr<Conn>> conns;
    // Guarded by TcpReceiver::mu_.
    int64_t pieces_received = 0;
    int senders_finished = 0;
    Clock::time_point last_progress;
    // Pages are written only under write_mu while live.
    std::mutex write_mu;
    bool live = true;
  };

  enum class ConnState { kHello, kStreaming, kFinished, kDraining, kClosed };

  // One sender's connection (I/O thread only).
  struct Conn {
    explicit Conn(tcp::socket s) : sock(std::move(s)) {}
    tcp::socket sock;
    std::string peer;
    ConnState state = ConnState::kHello;
    bool reading = false;  // a read is outstanding
    bool timed_out = false;
    Clock::time_point last_activity;
    std::array<uint8_t, wire::kHeaderBytes> header{};
    wire::MsgHeader msg;
    Bytes body;
    std::shared_ptr<Incoming> req;  // set by HELLO
    int sender = -1;                // index into req->senders
    Bytes reply;
  };

  using ConnPtr = std::shared_ptr<Conn>;

  // --- bookkeeping under mu_ ---

  void erase_locked(std::unordered_map<std::string, std::shared_ptr<Incoming>>::iterator it) {
    const TransferDescriptor& d = it->second->desc;
    const int64_t written = (d.num_tokens + d.page_size - 1) / d.page_size;
    for (int64_t i = 0; i < written; ++i) page_writer_.erase(d.dst_pages[static_cast<size_t>(i)]);
    pending_.erase(it);
  }

  // Ends the request here: true when this call took it out of pending_ (it owes the callback);
  // false when it was cancelled or ended before. Either way no page write follows.
  bool take(Incoming& inc) {
    bool ours = false;
    {
      std::lock_guard lock(mu_);
      auto it = pending_.find(inc.desc.request_id);
      if (it != pending_.end() && it->second.get() == &inc) {
        erase_locked(it);
        ours = true;
      }
    }
    std::lock_guard lock(inc.write_mu);
    inc.live = false;
    return ours;
  }

  bool is_live(Incoming& inc) {
    std::lock_guard lock(inc.write_mu);
    return inc.live;
  }

  void touch(Incoming& inc, int64_t pieces, int finished) {
    std::lock_guard lock(mu_);
    inc.pieces_received += pieces;
    inc.senders_finished += finished;
    inc.last_progress = Clock::now();
  }

  // Bytes of one token of a sender's LAYER payload.
  static uint64_t row_bytes(const Incoming& inc, int sender) {
    const HeadSlice& s = inc.slices[static_cast<size_t>(sender)];
    return 4 * static_cast<uint64_t>(packed_layer_elems(s.num_heads(), 1, inc.desc.head_dim));
  }

  std::string who(const Conn& c) const {
    if (c.req == nullptr) return "sender " + c.peer;
    return "source rank " + std::to_string(c.req->senders[static_cast<size_t>(c.sender)]) + " (" +
           c.peer + ")";
  }

  // Layers wholly received from one sender.
  static int64_t layers_got(const Incoming& inc, int sender) {
    const auto& next = inc.next_token[static_cast<size_t>(sender)];
    return std::count(next.begin(), next.end(), inc.desc.num_tokens);
  }

  // --- outcomes ---

  void fail_request(Incoming& inc, const std::string& message) {
    const bool ours = take(inc);
    const std::string& id = inc.desc.request_id;
    abandon_conns(inc, "KV transfer of request '" + id + "' failed at the receiver: " + message);
    if (ours && callbacks_.on_error) {
      callbacks_.on_error(id, "KV transfer of request '" + id + "' failed: " + message);
    }
  }

  void complete_request(Incoming& inc) {
    if (!take(inc)) return;
    if (inc.have_state && callbacks_.on_state) {
      callbacks_.on_state(inc.desc.request_id, std::move(inc.state));
    }
    if (inc.have_hidden && callbacks_.on_hidden) {
      callbacks_.on_hidden(inc.desc.request_id, std::move(inc.hidden));
    }
    if (callbacks_.on_complete) {
      callbacks_.on_complete(inc.desc.request_id, inc.first_token, inc.logprob);
    }
  }

  // Tells every still-streaming sender of the request that it failed.
  void abandon_conns(Incoming& inc, const std::string& message) {
    for (auto& w : inc.conns) {
      if (auto c = w.lock(); c && c->state == ConnState::kStreaming) reject(c, message);
    }
  }

  // A problem with what this connection sent: fails its request if it has one.
  void protocol_error(const ConnPtr& c, const std::string& message) {
    if (c->state == ConnState::kStreaming) {
      fail_request(*c->req, who(*c) + ": " + message);  // rejects c too
    } else {
      reject(c, who(*c) + ": " + message);
    }
  }

  // Sends the error reply, then reads and discards until the sender closes.
  void reject(const ConnPtr& c, const std::string& message) {
    if (c->state == ConnState::kDraining || c->state == ConnState::kClosed) return;
    c->state = ConnState::kDraining;
    c->last_activity = Clock::now();
    c->reply = wire::encode_reply({false, message});
    net::async_write(c->sock, net::buffer(c->reply), [this, c](error_code ec, size_t) {
      if (c->state == ConnState::kClosed) return;
      if (ec) {
        close_conn(c);
        return;
      }
      error_code ignored;
      c->sock.shutdown(tcp::socket::shutdown_send, ignored);
    });
    if (!c->reading) drain(c);
  }

  void drain(const ConnPtr& c) {
    c->body.resize(64 * 1024);
    c->reading = true;
    c->sock.async_read_some(net::buffer(c->body), [this, c](error_code ec, size_t) {
      c->reading = false;
      if (c->state == ConnState::kClosed) return;
      if (ec) {
        close_conn(c);
        return;
      }
      c->last_activity = Clock::now();
      drain(c);
    });
  }

  void close_conn(const ConnPtr& c) {
    if (c->state == ConnState::kClosed) return;
    c->state = ConnState::kClosed;
    error_code ignored;
    c->sock.close(ignored);
    conns_.erase(c);
  }

  // The connection ended (EOF, error, or closed by the sweep).
  void on_conn_lost(const ConnPtr& c, error_code ec) {
    if (c->state != ConnState::kStreaming) {  // nothing owed: before HELLO or after FINISH
      close_conn(c);
      return;
    }
    const std::string why = c->timed_out ? "sent nothing for " + ms_text(options_.timeout)
                            : ec == net::error::eof ? "closed the connection"
                                                    : "lost the connection (" + ec.message() + ")";
    auto inc = c->req;
    const std::string message = who(*c) + " " + why + " after " +
                                std::to_string(layers_got(*inc, c->sender)) + " of " +
                                std::to_string(inc->desc.num_layers) + " layers";
    close_conn(c);
    fail_request(*inc, message);
  }

  // --- reading ---

  void start_accept() {
    acceptor_.async_accept([this](error_code ec, tcp::socket s) {
      if (!acceptor_.is_open()) return;
      if (!ec) {
        auto c = std::make_shared<Conn>(std::move(s));
        error_code ignored;
        c->sock.set_option(tcp::no_delay(true), ignored);
        c->peer = peer_of(c->sock);
        c->last_activity = Clock::now();
        conns_.insert(c);
        if (options_.key) {  // nothing is read as a message before the handshake passed
          tandem::net::async_authenticate(c->sock, *options_.key, tandem::net::Channel::kKvTransfer,
                                          /*server=*/true, c->peer,
                                          [this, c](const std::string& error) {
                                            if (!error.empty()) return close_conn(c);
                                            if (c->state == ConnState::kClosed) return;
                                            c->last_activity = Clock::now();
                                            read_header(c);
                                          });
        } else {
          read_header(c);
        }
      }
      start_accept();
    });
  }

  // Common head of every read completion: true when the handler should go on.
  bool read_done(const ConnPtr& c, error_code ec) {
    c->reading = false;
    if (c->state == ConnState::kClosed) return false;
    if (c->state == ConnState::kDraining) {
      if (ec) {
        close_conn(c);
      } else {
        drain(c);
      }
      return false;
    }
    if (ec) {
      on_conn_lost(c, ec);
      return false;
    }
    c->last_activity = Clock::now();
    return true;
  }

  void read_header(const ConnPtr& c) {
    c->reading = true;
    net::async_read(c->sock, net::buffer(c->header), [this, c](error_code ec, size_t) {
      if (read_done(c, ec)) on_header(c);
    });
  }

  void on_header(const ConnPtr& c) {
    try {
      c->msg = wire::decode_header(c->header);
    } catch (const Error& e) {
      protocol_error(c, e.message());
      return;
    }
    const wire::MsgHeader& h = c->msg;
    switch (c->state) {
      case ConnState::kHello:
        if (h.type != wire::MsgType::kHello || h.body_bytes > wire::kMaxHelloBytes) {
          protocol_error(c, "expected a HELLO of at most " + std::to_string(wire::kMaxHelloBytes) +
                                " bytes first");
          return;
        }
        break;
      case ConnState::kStreaming: {
        const Incoming& inc = *c->req;
        if (h.type == wire::MsgType::kLayer) {  // 24 + rows * row bytes, 1 <= rows <= tokens
          const uint64_t row = row_bytes(inc, c->sender);
          const uint64_t payload = h.body_bytes - wire::kLayerPrefixBytes;
          if (h.body_bytes <= wire::kLayerPrefixBytes || payload % row != 0 ||
              payload / row > static_cast<uint64_t>(inc.desc.num_tokens)) {
            protocol_error(c, "LAYER of " + std::to_string(h.body_bytes) +
                                  " bytes is not 24 + k * " + std::to_string(row) +
                                  " for 1 <= k <= " + std::to_string(inc.desc.num_tokens));
            return;
          }
        } else if (h.type == wire::MsgType::kFinish) {
          const uint64_t with_state =
              wire::kFinishBytes + static_cast<uint64_t>(inc.desc.state_elems) * sizeof(float);
          if (h.body_bytes != wire::kFinishBytes &&
              (inc.desc.state_elems == 0 || h.body_bytes != with_state)) {
            protocol_error(c, "FINISH of " + std::to_string(h.body_bytes) + " bytes (8, or " +
                                  std::to_string(with_state) + " with the recurrent state)");
            return;
          }
        } else if (h.type == wire::MsgType::kHidden) {  // 16 + rows * 4 * hidden_size
          const uint64_t row = sizeof(float) * static_cast<uint64_t>(inc.desc.hidden_size);
          const uint64_t rows = h.body_bytes - wire::kHiddenPrefixBytes;
          if (row == 0 || h.body_bytes <= wire::kHiddenPrefixBytes || rows % row != 0 ||
              rows / row > static_cast<uint64_t>(inc.desc.num_tokens)) {
            protocol_error(
                c, "HIDDEN of " + std::to_string(h.body_bytes) + " bytes" +
                       (row == 0 ? " where the descriptor asks for no hidden states"
                                 : " is not 16 + k * " + std::to_string(row) +
                                       " for 1 <= k <= " + std::to_string(inc.desc.num_tokens)));
            return;
          }
        } else {
          protocol_error(c, "a second HELLO");
          return;
        }
        break;
      }
      default:  // kFinished: the acknowledgement may be in flight, so no second reply
        close_conn(c);
        return;
    }
    c->body.resize(h.body_bytes);
    c->reading = true;
    net::async_read(c->sock, net::buffer(c->body), [this, c](error_code ec, size_t) {
      if (!read_done(c, ec)) return;
      switch (c->msg.type) {
        case wire::MsgType::kHello: on_hello(c); break;
        case wire::MsgType::kLayer: on_layer(c); break;
        case wire::MsgType::kFinish: on_finish(c); break;
        case wire::MsgType::kHidden: on_hidden(c); break;
      }
    });
  }

  // Why a HELLO does not match the request's descriptor ("" when it does).
  static std::string check_hello(const Incoming& inc, const wire::Hello& h, int& sender) {
    const TransferDescriptor& d = inc.desc;
    if (!(h.src == d.src)) {
      return "prefill sharding " + h.src.str() + " differs from the descriptor's " + d.src.str();
    }
    if (h.dtype != 0) return "unsupported KV dtype code " + std::to_string(h.dtype);
    if (h.num_layers != d.num_layers || h.num_tokens != d.num_tokens || h.head_dim != d.head_dim) {
      return "sends " + std::to_string(h.num_layers) + " layers x " + std::to_string(h.num_tokens) +
             " tokens x head_dim " + std::to_string(h.head_dim) + ", the descriptor says " +
             std::to_string(d.num_layers) + " x " + std::to_string(d.num_tokens) + " x " +
             std::to_string(d.head_dim);
    }
    auto it = std::find(inc.senders.begin(), inc.senders.end(), h.src_rank);
    if (it == inc.senders.end()) {
      return "head range mismatch: rank " + std::to_string(h.src_rank) +
             " owes no heads to a destination holding " + d.dst_heads.str();
    }
    sender = static_cast<int>(it - inc.senders.begin());
    const HeadRange need = inc.slices[static_cast<size_t>(sender)].heads;
    if (!(h.heads == need)) {
      return "head range mismatch: sends heads " + h.heads.str() + " where " + need.str() +
             " are needed from it";
    }
    if (inc.connected[static_cast<size_t>(sender)]) return "connected twice";
    return {};
  }

  void on_hello(const ConnPtr& c) {
    wire::Hello h;
    try {
      h = wire::decode_hello(c->body);
    } catch (const Error& e) {
      protocol_error(c, e.message());
      return;
    }
    std::shared_ptr<Incoming> inc;
    {
      std::lock_guard lock(mu_);
      auto it = pending_.find(h.request_id);
      if (it != pending_.end()) inc = it->second;
    }
    const std::string from = "source rank " + std::to_string(h.src_rank) + " (" + c->peer + ")";
    if (inc == nullptr) {
      reject(c, from + ": request '" + h.request_id +
                    "' is not expected by this receiver (never registered, cancelled, or "
                    "already ended)");
      return;
    }
    int sender = -1;
    if (std::string bad = check_hello(*inc, h, sender); !bad.empty()) {
      const std::string message = from + ": " + bad;
      reject(c, "KV transfer of request '" + h.request_id + "' failed at the receiver: " + message);
      fail_request(*inc, message);
      return;
    }
    c->req = inc;
    c->sender = sender;
    c->state = ConnState::kStreaming;
    inc->connected[static_cast<size_t>(sender)] = true;
    inc->conns.push_back(c);
    touch(*inc, 0, 0);
    read_header(c);
  }

  void on_layer(const ConnPtr& c) {
    Incoming& inc = *c->req;
    const wire::LayerPrefix p = wire::decode_layer_prefix(c->body);  // the size was checked
    const int64_t layer = p.layer;
    if (layer < 0 || layer >= inc.desc.num_layers) {
      protocol_error(c, "layer " + std::to_string(layer) + " outside [0, " +
                            std::to_string(inc.desc.num_layers) + ")");
      return;
    }
    int64_t& next = inc.next_token[static_cast<size_t>(c->sender)][static_cast<size_t>(layer)];
    const auto rows = static_cast<int64_t>((c->body.size() - wire::kLayerPrefixBytes) /
                                           row_bytes(inc, c->sender));
    if (p.token_begin != next || p.token_end != p.token_begin + rows ||
        p.token_end > inc.desc.num_tokens) {
      protocol_error(c, "layer " + std::to_string(layer) + " tokens [" +
                            std::to_string(p.token_begin) + ", " + std::to_string(p.token_end) +
                            ") with " + std::to_string(rows) +
                            " rows of data do not follow on from token " + std::to_string(next) +
                            " of " + std::to_string(inc.desc.num_tokens));
      return;
    }
    const HeadSlice& s = inc.slices[static_cast<size_t>(c->sender)];
    bool cancelled = false;
    std::string copy_error;
    {
      std::lock_guard lock(inc.write_mu);  // cancel() waits for this copy
      cancelled = !inc.live;
      if (!cancelled) {
        try {
          const auto* payload =
              reinterpret_cast<const float*>(c->body.data() + wire::kLayerPrefixBytes);
          unpack_layer(payload, cache_, layer, inc.desc.dst_pages, s.dst_offset, s.num_heads(),
                       p.token_begin, p.token_end);
        } catch (const Error& e) {
          copy_error = e.message();
        }
      }
    }
    if (cancelled) {
      reject(c, "request '" + inc.desc.request_id + "' was cancelled by the receiver");
      return;
    }
    if (!copy_error.empty()) {
      protocol_error(c, "layer " + std::to_string(layer) + ": " + copy_error);
      return;
    }
    next = p.token_end;
    touch(inc, next == inc.desc.num_tokens ? 1 : 0, 0);
    read_header(c);
  }

  void on_hidden(const ConnPtr& c) {
    Incoming& inc = *c->req;
    wire::Hidden h;
    try {
      h = wire::decode_hidden(c->body);  // (the size was checked against the descriptor)
    } catch (const Error& e) {
      protocol_error(c, e.message());
      return;
    }
    const int64_t rows = static_cast<int64_t>(h.rows.size()) / inc.desc.hidden_size;
    if (h.hidden_size != inc.desc.hidden_size || h.row_begin + rows != inc.desc.num_tokens) {
      protocol_error(c, "HIDDEN of rows [" + std::to_string(h.row_begin) + ", " +
                            std::to_string(h.row_begin + rows) + ") x " +
                            std::to_string(h.hidden_size) + ", the descriptor wants rows up to " +
                            std::to_string(inc.desc.num_tokens) + " x " +
                            std::to_string(inc.desc.hidden_size));
      return;
    }
    if (inc.have_hidden) {
      protocol_error(c, "a second HIDDEN (rank " +
                            std::to_string(inc.senders[static_cast<size_t>(c->sender)]) + ")");
      return;
    }
    inc.have_hidden = true;
    inc.hidden.begin = h.row_begin;
    inc.hidden.rows = std::move(h.rows);
    touch(inc, 0, 0);
    read_header(c);
  }

  void on_finish(const ConnPtr& c) {
    Incoming& inc = *c->req;
    if (!is_live(inc)) {
      reject(c, "request '" + inc.desc.request_id + "' was cancelled by the receiver");
      return;
    }
    wire::Finish f = wire::decode_finish(c->body);  // the size was checked
    const int64_t have = layers_got(inc, c->sender);
    if (have != inc.desc.num_layers) {
      protocol_error(c, "FINISH after only " + std::to_string(have) + " of " +
                            std::to_string(inc.desc.num_layers) + " layers");
      return;
    }
    const int rank = inc.senders[static_cast<size_t>(c->sender)];
    if (inc.have_token && f.first_token != inc.first_token) {
      protocol_error(c, "first token " + std::to_string(f.first_token) + " differs from rank " +
                            std::to_string(inc.token_rank) + "'s " +
                            std::to_string(inc.first_token));
      return;
    }
    if (!f.state.empty() && inc.have_state) {
      protocol_error(c, "a second recurrent state (rank " + std::to_string(rank) + ")");
      return;
    }
    if (!inc.have_token) {
      inc.have_token = true;
      inc.first_token = f.first_token;
      inc.logprob = f.logprob;
      inc.token_rank = rank;
    }
    if (!f.state.empty()) {
      inc.have_state = true;
      inc.state = std::move(f.state);
    }
    inc.finished[static_cast<size_t>(c->sender)] = true;
    touch(inc, 0, 1);
    c->state = ConnState::kFinished;
    c->reply = wire::encode_reply({true, ""});
    net::async_write(c->sock, net::buffer(c->reply), [c](error_code, size_t) {});
    read_header(c);  // the sender closes after reading the reply
    if (std::all_of(inc.finished.begin(), inc.finished.end(), [](bool b) { return b; })) {
      if (inc.desc.state_elems > 0 && !inc.have_state) {
        fail_request(inc, "every sender finished without the recurrent state (" +
                              std::to_string(inc.desc.state_elems) + " floats)");
        return;
      }
      if (inc.desc.hidden_size > 0 && !inc.have_hidden) {
        fail_request(inc, "every sender finished without the prompt's hidden states (" +
                              std::to_string(inc.desc.hidden_size) + " per row)");
        return;
      }
      complete_request(inc);
    }
  }

  // --- timeouts ---

  void arm_sweep() {
    sweep_timer_.expires_after(sweep_interval(options_.timeout));
    sweep_timer_.async_wait([this](error_code ec) {
      if (ec) return;
      sweep();
      arm_sweep();
    });
  }

  void sweep() {
    const auto now = Clock::now();
    std::vector<std::pair<std::shared_ptr<Incoming>, std::string>> stale;
    {
      std::lock_guard lock(mu_);
      for (auto& [id, inc] : pending_) {
        if (now - inc->last_progress <= options_.timeout) continue;
        stale.emplace_back(inc, "timed out: no data for " + ms_text(options_.timeout) + " (" +
                                    std::to_string(inc->pieces_received) + " of " +
                                    std::to_string(inc->desc.num_layers *
                                                   static_cast<int64_t>(inc->senders.size())) +
                                    " pieces received)");
      }
    }
    for (auto& [inc, message] : stale) fail_request(*inc, message);
    std::vector<ConnPtr> idle;
    for (const auto& c : conns_) {
      if (now - c->last_activity > options_.timeout) idle.push_back(c);
    }
    for (const auto& c : idle) {  // a stalled stream fails its request (on_conn_lost)
      c->timed_out = true;
      error_code ignored;
      c->sock.close(ignored);
      if (c->state != ConnState::kStreaming) close_conn(c);
    }
  }

  KvCache& cache_;
  ReceiverCallbacks callbacks_;
  HostTcpOptions options_;
  IoThread io_;  // declared before every I/O object, so it outlives them
  tcp::acceptor acceptor_;
  net::steady_timer sweep_timer_;
  std::string address_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Incoming>> pending_;  // guarded by mu_
  std::unordered_map<int32_t, std::string> page_writer_;  // page -> request; guarded by mu_
  std::set<ConnPtr> conns_;                               // I/O thread only
};

// =============================================================================================
// Sender

class TcpSender final : public TransferSender {
 public:
  TcpSender(const KvCache& cache, const KvSharding& sharding, int rank, SenderCallbacks callbacks,
            const HostTcpOptions& options)
      : cache_(cache),
        sharding_(sharding),
        rank_(rank),
        callbacks_(std::move(callbacks)),
        options_(options),
        sweep_timer_(io_.io()) {
    const HeadRange held = sharding.held(rank);  // validates
    TANDEM_CHECK_KIND(kInvalidArgument, cache.geometry().num_kv_heads == held.size(),
                      "KV transfer sender: rank ", rank, " of ", sharding.str(), " holds heads ",
                      held.str(), " but its cache has ", cache.geometry().num_kv_heads, " heads");
    arm_sweep();
    io_.start();
  }

  ~TcpSender() override { io_.stop(); }

  void begin(const std::string& request, std::vector<TransferDescriptor> destinations,
             std::vector<int32_t> src_pages) override {
    const KvGeometry& g = cache_.geometry();
    const std::string where = "KV transfer of request '" + request + "'";
    TANDEM_CHECK_KIND(kInvalidArgument, !destinations.empty(), where, ": no destinations");
    auto job = std::make_shared<Job>();
    job->request = request;
    job->num_tokens = destinations.front().num_tokens;
    job->num_layers = destinations.front().num_layers;
    job->state_elems = destinations.front().state_elems;
    job->hidden_size = destinations.front().hidden_size;
    for (auto& d : destinations) {
      d.validate();
      const std::string at = where + " to " + d.dst_address + ": ";
      TANDEM_CHECK_KIND(kInvalidArgument, d.request_id == request, at,
                        "descriptor is for request '", d.request_id, "'");
      TANDEM_CHECK_KIND(kInvalidArgument, d.src == sharding_, at,
                        "head range mismatch: the descriptor's prefill sharding is ", d.src.str(),
                        " but this rank is in ", sharding_.str());
      TANDEM_CHECK_KIND(kInvalidArgument, d.head_dim == g.head_dim && d.num_layers == g.num_layers,
                        at, "head_dim ", d.head_dim, " x ", d.num_layers,
                        " layers differ from this cache's ", g.head_dim, " x ", g.num_layers);
      TANDEM_CHECK_KIND(kInvalidArgument, d.num_tokens == job->num_tokens, at, d.num_tokens,
                        " tokens differ from another destination's ", job->num_tokens);
      TANDEM_CHECK_KIND(kInvalidArgument, d.state_elems == job->state_elems, at, "state_elems ",
                        d.state_elems, " differs from another destination's ", job->state_elems);
      TANDEM_CHECK_KIND(kInvalidArgument, d.hidden_size == job->hidden_size, at, "hidden_size ",
                        d.hidden_size, " differs from another destination's ", job->hidden_size);
      auto slice = plan_head_slice(sharding_, rank_, d.dst_heads);
      auto [host, port] = tandem::net::split_host_port(d.dst_address, "destination address");
      if (!slice) continue;
      auto link = std::make_shared<Link>(io_.io());
      link->desc = d;
      link->slice = *slice;
      link->host = host;
      link->port = port;
      job->links.push_back(std::move(link));
    }
    const int64_t need = (job->num_tokens + g.page_size - 1) / g.page_size;
    TANDEM_CHECK_KIND(kInvalidArgument, static_cast<int64_t>(src_pages.size()) >= need, where, ": ",
                      src_pages.size(), " source pages cannot hold ", job->num_tokens,
                      " tokens at page_size ", g.page_size);
    for (int64_t i = 0; i < need; ++i) {
      const int32_t p = src_pages[static_cast<size_t>(i)];
      TANDEM_CHECK_KIND(kInvalidArgument, p >= 0 && p < g.num_pages, where, ": source page id ", p,
                        " out of range [0, ", g.num_pages, ")");
    }
    job->src_pages = std::move(src_pages);
    job->next_token.assign(static_cast<size_t>(job->num_layers), 0);

    {
      std::lock_guard lock(mu_);
      TANDEM_CHECK_KIND(kInvalidArgument, !jobs_.contains(request), where, " already begun");
      jobs_.emplace(request, job);
      for (auto& link : job->links) link->last_progress = Clock::now();
    }
    for (auto& link : job->links) {
      wire::Hello h;
      h.request_id = request;
      h.src_rank = rank_;
      h.src = sharding_;
      h.heads = link->slice.heads;
      h.num_layers = job->num_layers;
      h.num_tokens = job->num_tokens;
      h.head_dim = g.head_dim;
      enqueue(job, link, {std::make_shared<Bytes>(wire::encode_hello(h)), false});
      net::post(io_.io(), [this, job, link] { connect(job, link); });
    }
  }

  void send_layer(const std::string& request, int64_t layer, TokenRange tokens) override {
    std::shared_ptr<Job> job = find_job(request, "send_layer");
    const std::string where = "KV transfer of request '" + request + "': ";
    int64_t begin = 0, end = 0;
    {
      std::lock_guard lock(mu_);
      TANDEM_CHECK_KIND(kInvalidArgument, !job->user_done, where, "send_layer after finish");
      TANDEM_CHECK_KIND(kInvalidArgument, layer >= 0 && layer < job->num_layers, where, "layer ",
                        layer, " outside [0, ", job->num_layers, ")");
      int64_t& next = job->next_token[static_cast<size_t>(layer)];
      TANDEM_CHECK_KIND(kInvalidArgument, next < job->num_tokens, where, "layer ", layer,
                        " was already sent whole");
      begin = tokens.begin;
      end = tokens.end < 0 ? job->num_tokens : tokens.end;
      TANDEM_CHECK_KIND(kInvalidArgument, begin == next && end > begin && end <= job->num_tokens,
                        where, "layer ", layer, " tokens [", begin, ", ", end,
                        ") do not follow on from token ", next, " of ", job->num_tokens);
      next = end;
      if (job->io_done) return;  // failed: nothing more to send
    }
    const int64_t d = cache_.geometry().head_dim;
    for (auto& link : job->links) {
      const int64_t heads = link->slice.num_heads();
      auto buf = std::make_shared<Bytes>(
          wire::encode_layer({layer, begin, end}, packed_layer_elems(heads, end - begin, d)));
      pack_layer(
          cache_, layer, job->src_pages, link->slice.src_offset, heads, begin, end,
          reinterpret_cast<float*>(buf->data() + wire::kHeaderBytes + wire::kLayerPrefixBytes));
      enqueue(job, link, {std::move(buf), false});
    }
  }

  void finish(const std::string& request, int32_t first_token, float logprob) override {
    finish_with(request, first_token, logprob, {});
  }

  void finish_with(const std::string& request, int32_t first_token, float logprob,
                   FinishPayload payload) override {
    std::shared_ptr<Job> job = find_job(request, "finish");
    std::vector<float>& state = payload.state;
    const PromptHidden& hidden = payload.hidden;
    {
      std::lock_guard lock(mu_);
      const auto hs = job->hidden_size;
      TANDEM_CHECK_KIND(
          kInvalidArgument,
          hidden.empty() ||
              (hs > 0 && static_cast<int64_t>(hidden.rows.size()) % hs == 0 && hidden.begin >= 0 &&
               hidden.begin + static_cast<int64_t>(hidden.rows.size()) / hs == job->num_tokens),
          "KV transfer of request '", request, "': hidden states of ", hidden.rows.size(),
          " floats from row ", hidden.begin, ", the destination expects rows up to ",
          job->num_tokens, " of ", hs, hs == 0 ? " (it asked for none)" : "");
      TANDEM_CHECK_KIND(kInvalidArgument,
                        state.empty() || static_cast<int64_t>(state.size()) == job->state_elems,
                        "KV transfer of request '", request, "': a recurrent state of ",
                        state.size(), " floats, the destination expects ", job->state_elems);
      TANDEM_CHECK_KIND(kInvalidArgument, !job->user_done, "KV transfer of request '", request,
                        "': finish called twice");
      for (size_t l = 0; l < job->next_token.size(); ++l) {
        TANDEM_CHECK_KIND(kInvalidArgument, job->next_token[l] == job->num_tokens,
                          "KV transfer of request '", request, "': finish before layer ", l,
                          " was whole (tokens [", job->next_token[l], ", ", job->num_tokens,
                          ") not sent)");
      }
      job->user_done = true;
      if (job->io_done) {  // failed earlier: on_error has fired
        erase_locked(*job);
        return;
      }
      if (job->links.empty()) {  // this rank owes no heads: done at once
        job->io_done = true;
        erase_locked(*job);
        net::post(io_.io(), [this, request] {
          if (callbacks_.on_sent) callbacks_.on_sent(request);
        });
        return;
      }
      for (auto& link : job->links) link->finish_queued = true;
    }
    std::shared_ptr<Bytes> hidden_buf;
    if (!hidden.empty()) {
      hidden_buf = std::make_shared<Bytes>(
          wire::encode_hidden({hidden.begin, job->hidden_size, std::move(payload.hidden.rows)}));
    }
    const auto buf =
        std::make_shared<Bytes>(wire::encode_finish({first_token, logprob, std::move(state)}));
    for (auto& link : job->links) {
      if (hidden_buf) enqueue(job, link, {hidden_buf, false});
      enqueue(job, link, {buf, true});
    }
  }

  void abort(const std::string& request) override {
    std::shared_ptr<Job> job;
    {
      std::lock_guard lock(mu_);
      auto it = jobs_.find(request);
      if (it == jobs_.end()) return;
      job = it->second;
      jobs_.erase(it);
      job->aborted = true;
      job->io_done = true;
      job->user_done = true;
      for (auto& link : job->links) {
        link->closed = true;
        link->queue.clear();
      }
    }
    net::post(io_.io(), [job] {
      for (auto& link : job->links) close_link(*link);
    });
  }

 private:
  struct Out {
    std::shared_ptr<Bytes> bytes;
    bool is_finish = false;
  };

  // One destination of one request: one connection.
  struct Link {
    explicit Link(net::io_context& io) : sock(io), resolver(io) {}
    TransferDescriptor desc;
    HeadSlice slice;
    std::string host, port;
    tcp::socket sock;        // I/O thread only
    tcp::resolver resolver;  // I/O thread only
    // Guarded by TcpSender::mu_.
    std::deque<Out> queue;
    bool connected = false, writing = false, finish_queued = false, acked = false, closed = false;
    Clock::time_point last_progress;
    // I/O thread only.
    std::array<uint8_t, wire::kReplyHeaderBytes> reply_header{};
    std::string reply_message;
  };

  struct Job {
    std::string request;
    std::vector<int32_t> src_pages;
    int64_t num_layers = 0, num_tokens = 0, state_elems = 0, hidden_size = 0;
    std::vector<std::shared_ptr<Link>> links;  // destinations this rank owes heads
    // Guarded by TcpSender::mu_.
    std::vector<int64_t> next_token;  // per layer: tokens sent so far
    bool user_done = false;           // finish or abort called
    bool io_done = false;             // succeeded, failed or aborted: no more I/O, callback decided
    bool aborted = false;
    size_t links_acked = 0;
  };

  std::shared_ptr<Job> find_job(const std::string& request, const char* what) {
    std::lock_guard lock(mu_);
    auto it = jobs_.find(request);
    TANDEM_CHECK_KIND(kInvalidArgument, it != jobs_.end(), what, ": KV transfer of request '",
                      request, "' was not begun on this rank or has ended");
    return it->second;
  }

  void erase_locked(const Job& job) {
    auto it = jobs_.find(job.request);
    if (it != jobs_.end() && it->second.get() == &job) jobs_.erase(it);
  }

  static void close_link(Link& link) {
    error_code ignored;
    link.resolver.cancel();
    link.sock.close(ignored);
  }

  void enqueue(const std::shared_ptr<Job>& job, const std::shared_ptr<Link>& link, Out out) {
    {
      std::lock_guard lock(mu_);
      if (link->closed) return;
      if (!link->writing && link->queue.empty()) link->last_progress = Clock::now();
      link->queue.push_back(std::move(out));
    }
    net::post(io_.io(), [this, job, link] { pump(job, link); });
  }

  void connect(const std::shared_ptr<Job>& job, const std::shared_ptr<Link>& link) {
    link->resolver.async_resolve(
        link->host, link->port,
        [this, job, link](error_code ec, const tcp::resolver::results_type& results) {
          if (is_closed(*link)) return;
          if (ec) {
            fail_job(job, *link, "cannot resolve the address: " + ec.message());
            return;
          }
          net::async_connect(link->sock, results,
                             [this, job, link](error_code ec, const tcp::endpoint&) {
                               on_connected(job, link, ec);
                             });
        });
  }

  void on_connected(const std::shared_ptr<Job>& job, const std::shared_ptr<Link>& link,
                    error_code ec) {
    if (is_closed(*link)) {
      close_link(*link);
      return;
    }
    if (ec) {
      fail_job(job, *link, "cannot connect: " + ec.message());
      return;
    }
    error_code ignored;
    link->sock.set_option(tcp::no_delay(true), ignored);
    if (options_.key) {
      tandem::net::async_authenticate(link->sock, *options_.key, tandem::net::Channel::kKvTransfer,
                                      /*server=*/false, link->desc.dst_address,
                                      [this, job, link](const std::string& error) {
                                        if (is_closed(*link)) return;
                                        if (!error.empty()) {
                                          fail_job(job, *link, "cluster key: " + error);
                                          return;
                                        }
                                        start_streaming(job, link);
                                      });
      return;
    }
    start_streaming(job, link);
  }

  void start_streaming(const std::shared_ptr<Job>& job, const std::shared_ptr<Link>& link) {
    {
      std::lock_guard lock(mu_);
      link->connected = true;
      link->last_progress = Clock::now();
    }
    read_reply(job, link);
    pump(job, link);
  }

  bool is_closed(const Link& link) {
    std::lock_guard lock(mu_);
    return link.closed;
  }

  // Starts the next write if the link is idle.
  void pump(const std::shared_ptr<Job>& job, const std::shared_ptr<Link>& link) {
    Out out;
    {
      std::lock_guard lock(mu_);
      if (link->closed || !link->connected || link->writing || link->queue.empty()) return;
      link->writing = true;
      out = link->queue.front();
    }
    net::async_write(link->sock, net::buffer(*out.bytes),
                     [this, job, link, out](error_code ec, size_t) {
                       {
                         std::lock_guard lock(mu_);
                         link->writing = false;
                         if (link->closed) return;
                         if (!ec) {
                           link->queue.pop_front();
                           link->last_progress = Clock::now();
                         }
                       }
                       if (ec) {
                         fail_job(job, *link, "sending failed: " + ec.message());
                         return;
                       }
                       pump(job, link);
                     });
  }

  void read_reply(const std::shared_ptr<Job>& job, const std::shared_ptr<Link>& link) {
    net::async_read(link->sock, net::buffer(link->reply_header),
                    [this, job, link](error_code ec, size_t) {
                      if (ec) {
                        on_link_lost(job, *link, ec);
                        return;
                      }
                      uint32_t n = 0;
                      bool ok = false;
                      try {
                        ok = wire::decode_reply_header(link->reply_header, n);
                      } catch (const Error& e) {
                        fail_job(job, *link, "bad reply from the receiver: " + e.message());
                        return;
                      }
                      link->reply_message.resize(n);
                      net::async_read(link->sock, net::buffer(link->reply_message),
                                      [this, job, link, ok](error_code ec, size_t) {
                                        if (ec) {
                                          on_link_lost(job, *link, ec);
                                        } else if (!ok) {
                                          fail_job(job, *link, "receiver: " + link->reply_message);
                                        } else {
                                          on_acked(job, link);
                                        }
                                      });
                    });
  }

  void on_link_lost(const std::shared_ptr<Job>& job, Link& link, error_code ec) {
    {
      std::lock_guard lock(mu_);
      if (link.closed || link.acked) return;
    }
    fail_job(job, link,
             ec == net::error::eof ? "the receiver closed the connection"
                                   : "connection lost: " + ec.message());
  }

  void on_acked(const std::shared_ptr<Job>& job, const std::shared_ptr<Link>& link) {
    bool done = false;
    {
      std::lock_guard lock(mu_);
      if (link->closed) return;
      if (link->finish_queued) {
        link->acked = true;
        link->closed = true;
        done = ++job->links_acked == job->links.size() && !job->io_done;
        if (done) {
          job->io_done = true;
          if (job->user_done) erase_locked(*job);
        }
      }
    }
    if (!link->acked) {
      fail_job(job, *link, "the receiver acknowledged before FINISH");
      return;
    }
    close_link(*link);
    if (done && callbacks_.on_sent) callbacks_.on_sent(job->request);
  }

  // Ends the request with an error (once); closes all its connections. I/O thread.
  void fail_job(const std::shared_ptr<Job>& job, Link& at, const std::string& message) {
    bool report = false;
    {
      std::lock_guard lock(mu_);
      if (job->io_done) return;
      job->io_done = true;
      report = !job->aborted;
      for (auto& link : job->links) {
        link->closed = true;
        link->queue.clear();
      }
      if (job->user_done) erase_locked(*job);
    }
    for (auto& link : job->links) close_link(*link);
    if (report && callbacks_.on_error) {
      callbacks_.on_error(job->request, "KV transfer of request '" + job->request + "' to " +
                                            at.desc.dst_address + " failed: " + message);
    }
  }

  void arm_sweep() {
    sweep_timer_.expires_after(sweep_interval(options_.timeout));
    sweep_timer_.async_wait([this](error_code ec) {
      if (ec) return;
      sweep();
      arm_sweep();
    });
  }

  // Fails links with pending work and no progress for the timeout.
  void sweep() {
    const auto now = Clock::now();
    std::vector<std::tuple<std::shared_ptr<Job>, std::shared_ptr<Link>, std::string>> stale;
    {
      std::lock_guard lock(mu_);
      for (auto& [id, job] : jobs_) {
        if (job->io_done) continue;
        for (auto& link : job->links) {
          if (link->closed || now - link->last_progress <= options_.timeout) continue;
          const char* what = !link->connected                          ? "connecting"
                             : (link->writing || !link->queue.empty()) ? "sending"
                             : (link->finish_queued && !link->acked)
                                 ? "waiting for the acknowledgement"
                                 : nullptr;
          if (what != nullptr) stale.emplace_back(job, link, what);
        }
      }
    }
    for (auto& [job, link, what] : stale) {
      fail_job(job, *link, "timed out after " + ms_text(options_.timeout) + " " + what);
    }
  }

  const KvCache& cache_;
  KvSharding sharding_;
  int rank_;
  SenderCallbacks callbacks_;
  HostTcpOptions options_;
  IoThread io_;  // declared before every I/O object, so it outlives them
  net::steady_timer sweep_timer_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Job>> jobs_;  // guarded by mu_
};

class HostTcpBackend final : public TransferBackend {
 public:
  explicit HostTcpBackend(HostTcpOptions options) : options_(std::move(options)) {}
  std::string_view name() const override { return "host-tcp"; }
  bool carries_prompt_hidden() const override { return true; }
  std::unique_ptr<TransferSender> make_sender(const KvCache& cache, const KvSharding& sharding,
                                              int rank, SenderCallbacks callbacks) override {
    return std::make_unique<TcpSender>(cache, sharding, rank, std::move(callbacks), options_);
  }
  std::unique_ptr<TransferReceiver> make_receiver(KvCache& cache,
                                                  ReceiverCallbacks callbacks) override {
    return std::make_unique<TcpReceiver>(cache, std::move(callbacks), options_);
  }

 private:
  HostTcpOptions options_;
};

}  // namespace

std::unique_ptr<TransferBackend> make_host_tcp_backend(HostTcpOptions options) {
  return std::make_unique<HostTcpBackend>(std::move(options));
}

}  // namespace tandem::transfer
