#include "events/zmq_publisher.h"

#include <chrono>
#include <cstdio>
#include <zmq.hpp>

#include "core/error.h"

namespace tandem {

namespace {

std::string be64(int64_t v) {
  std::string s(8, '\0');
  for (int i = 7; i >= 0; --i) {
    s[static_cast<size_t>(i)] = static_cast<char>(static_cast<uint64_t>(v) & 0xff);
    v = static_cast<int64_t>(static_cast<uint64_t>(v) >> 8);
  }
  return s;
}

bool binds(const std::string& ep) {
  return ep.find('*') != std::string::npos || ep.find("::") != std::string::npos ||
         ep.rfind("ipc://", 0) == 0 || ep.rfind("inproc://", 0) == 0;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

struct ZmqKvEventPublisher::Sockets {
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  std::unique_ptr<zmq::socket_t> replay;
};

ZmqKvEventPublisher::ZmqKvEventPublisher(const KvEventsConfig& config, int32_t rank,
                                         std::string medium)
    : config_(config), sock_(std::make_unique<Sockets>()) {
  info_.data_parallel_rank = rank;
  info_.medium = std::move(medium);
  info_.encoding = config.encoding;
  const std::string ep = offset_endpoint_port(config.endpoint, rank);
  try {
    sock_->pub.set(zmq::sockopt::sndhwm, static_cast<int>(config.hwm));
    sock_->pub.set(zmq::sockopt::linger, 0);
    if (binds(ep)) {
      sock_->pub.bind(ep);
      endpoint_ = sock_->pub.get(zmq::sockopt::last_endpoint);
    } else {
      sock_->pub.connect(ep);
      endpoint_ = ep;
    }
    if (config.replay_endpoint) {
      const std::string rep = offset_endpoint_port(*config.replay_endpoint, rank);
      sock_->replay = std::make_unique<zmq::socket_t>(sock_->ctx, zmq::socket_type::router);
      sock_->replay->set(zmq::sockopt::linger, 0);
      sock_->replay->bind(rep);
      replay_endpoint_ = sock_->replay->get(zmq::sockopt::last_endpoint);
    }
  } catch (const zmq::error_t& e) {
    TANDEM_THROW(kInvalidArgument, "--kv-events-config: cannot set up ", ep, " (", e.what(), ")");
  }
  queue_.push_back({KvAllBlocksCleared{}});  // seq 0: consumers start from an empty view
  thread_ = std::thread([this] { run(); });
}

ZmqKvEventPublisher::~ZmqKvEventPublisher() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void ZmqKvEventPublisher::publish(std::vector<KvEvent> events) {
  if (events.empty()) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (static_cast<int64_t>(queue_.size()) >= config_.max_queue_size) {
      dropped_.fetch_add(1);
      lost_ = true;
      return;
    }
    if (lost_) {
      events.insert(events.begin(), KvEvent{KvAllBlocksCleared{}});
      lost_ = false;
    }
    queue_.push_back(std::move(events));
  }
  cv_.notify_one();
}

void ZmqKvEventPublisher::run() {
  const std::string topic = config_.topic;
  for (;;) {
    std::vector<KvEvent> batch;
    {
      std::unique_lock<std::mutex> lk(mu_);
      // Wake at least every 10 ms to answer replay requests.
      cv_.wait_for(lk, std::chrono::milliseconds(sock_->replay ? 10 : 100),
                   [&] { return stop_ || !queue_.empty(); });
      if (!queue_.empty()) {
        batch = std::move(queue_.front());
        queue_.pop_front();
      } else if (stop_) {
        return;
      }
    }
    if (sock_->replay) serve_replay();
    if (batch.empty()) continue;
    try {
      info_.ts = now_s();
      std::string payload = encode_kv_event_batch(batch, info_);
      const int64_t seq = sent_.load();
      const std::string seq_bytes = be64(seq);
      sock_->pub.send(zmq::buffer(topic), zmq::send_flags::sndmore);
      sock_->pub.send(zmq::buffer(seq_bytes), zmq::send_flags::sndmore);
      sock_->pub.send(zmq::buffer(payload), zmq::send_flags::none);
      if (config_.buffer_steps > 0) {
        buffer_.emplace_back(seq, std::move(payload));
        while (static_cast<int64_t>(buffer_.size()) > config_.buffer_steps) buffer_.pop_front();
      }
      sent_.fetch_add(1);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kv events: publish failed: %s\n", e.what());
    }
  }
}

void ZmqKvEventPublisher::serve_replay() {
  zmq::socket_t& r = *sock_->replay;
  for (;;) {
    std::vector<zmq::message_t> frames;
    try {
      zmq::message_t m;
      if (!r.recv(m, zmq::recv_flags::dontwait)) return;
      frames.push_back(std::move(m));
      while (frames.back().more()) {
        zmq::message_t part;
        (void)r.recv(part, zmq::recv_flags::none);
        frames.push_back(std::move(part));
      }
      // [identity, empty, start_seq]
      if (frames.size() != 3 || frames[2].size() != 8) continue;
      const auto* b = static_cast<const uint8_t*>(frames[2].data());
      uint64_t start = 0;
      for (int i = 0; i < 8; ++i) start = (start << 8) | b[i];
      const std::string id(static_cast<const char*>(frames[0].data()), frames[0].size());
      for (const auto& [seq, payload] : buffer_) {
        if (seq < static_cast<int64_t>(start)) continue;
        const std::string seq_bytes = be64(seq);
        r.send(zmq::buffer(id), zmq::send_flags::sndmore);
        r.send(zmq::message_t(), zmq::send_flags::sndmore);
        r.send(zmq::buffer(seq_bytes), zmq::send_flags::sndmore);
        r.send(zmq::buffer(payload), zmq::send_flags::none);
      }
      const std::string end = be64(-1);
      r.send(zmq::buffer(id), zmq::send_flags::sndmore);
      r.send(zmq::message_t(), zmq::send_flags::sndmore);
      r.send(zmq::buffer(end), zmq::send_flags::sndmore);
      r.send(zmq::message_t(), zmq::send_flags::none);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kv events: replay failed: %s\n", e.what());
      return;
    }
  }
}

}  // namespace tandem
