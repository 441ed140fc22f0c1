#include "events/zmq_subscriber.h"

#include <chrono>
#include <cstdio>
#include <vector>
#include <zmq.hpp>

namespace tandem {

namespace {

int64_t from_be64(const zmq::message_t& m) {
  if (m.size() != 8) return -2;
  const auto* b = static_cast<const uint8_t*>(m.data());
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | b[i];
  return static_cast<int64_t>(v);
}

std::string be64(int64_t v) {
  std::string s(8, '\0');
  for (int i = 7; i >= 0; --i) {
    s[static_cast<size_t>(i)] = static_cast<char>(static_cast<uint64_t>(v) & 0xff);
    v = static_cast<int64_t>(static_cast<uint64_t>(v) >> 8);
  }
  return s;
}

bool recv_all(zmq::socket_t& s, std::vector<zmq::message_t>& frames) {
  frames.clear();
  zmq::message_t m;
  if (!s.recv(m, zmq::recv_flags::dontwait)) return false;
  frames.push_back(std::move(m));
  while (frames.back().more()) {
    zmq::message_t part;
    (void)s.recv(part, zmq::recv_flags::none);
    frames.push_back(std::move(part));
  }
  return true;
}

}  // namespace

struct ZmqKvEventSubscriber::Sockets {
  zmq::context_t ctx{1};
  zmq::socket_t sub{ctx, zmq::socket_type::sub};
  std::unique_ptr<zmq::socket_t> replay;
};

ZmqKvEventSubscriber::ZmqKvEventSubscriber(KvEventSubscriberConfig config, OnBatch on_batch,
                                           OnLost on_lost)
    : config_(std::move(config)),
      on_batch_(std::move(on_batch)),
      on_lost_(std::move(on_lost)),
      sock_(std::make_unique<Sockets>()) {
  sock_->sub.set(zmq::sockopt::linger, 0);
  sock_->sub.set(zmq::sockopt::subscribe, config_.topic);
  sock_->sub.connect(config_.endpoint);
  if (!config_.replay_endpoint.empty()) {
    sock_->replay = std::make_unique<zmq::socket_t>(sock_->ctx, zmq::socket_type::dealer);
    sock_->replay->set(zmq::sockopt::linger, 0);
    sock_->replay->connect(config_.replay_endpoint);
  }
  thread_ = std::thread([this] { run(); });
}

ZmqKvEventSubscriber::~ZmqKvEventSubscriber() {
  stop_ = true;
  thread_.join();
}

void ZmqKvEventSubscriber::deliver(int64_t seq, const std::string& payload) {
  DecodedKvEventBatch batch;
  try {
    batch = decode_kv_event_batch(payload);
  } catch (const std::exception& e) {
    malformed_.fetch_add(1);  // (a batch we cannot read is lost all the same)
    if (on_lost_) on_lost_(seq, seq + 1);
    next_ = seq + 1;
    return;
  }
  next_ = seq + 1;
  if (on_batch_) on_batch_(seq, std::move(batch));
}

bool ZmqKvEventSubscriber::replay_from(int64_t start) {
  if (!sock_->replay) return false;
  zmq::socket_t& r = *sock_->replay;
  std::vector<zmq::message_t> frames;
  while (recv_all(r, frames)) {
  }  // (stale replies of an earlier, timed-out request)
  const std::string start_bytes = be64(start);
  r.send(zmq::message_t(), zmq::send_flags::sndmore);
  r.send(zmq::buffer(start_bytes), zmq::send_flags::none);
  bool complete = false;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(config_.replay_timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    zmq::pollitem_t item{static_cast<void*>(r), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(20));
    if (!(item.revents & ZMQ_POLLIN) || !recv_all(r, frames)) continue;
    if (frames.size() != 3) continue;  // [empty, seq, payload]
    const int64_t seq = from_be64(frames[1]);
    if (seq == -1) {
      complete = true;
      break;
    }
    const int64_t next = next_.load();
    if (seq < next && next >= 0) continue;
    if (next >= 0 && seq > next) {  // older batches are no longer buffered
      lost_.fetch_add(seq - next);
      if (on_lost_) on_lost_(next, seq);
    }
    replayed_.fetch_add(1);
    deliver(seq, std::string(static_cast<const char*>(frames[2].data()), frames[2].size()));
  }
  return complete;
}

void ZmqKvEventSubscriber::run() {
  std::vector<zmq::message_t> frames;
  if (sock_->replay) {  // catch up at once, without waiting for the next live batch
    next_ = 0;
    try {
      replay_from(0);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kv events: subscriber: %s\n", e.what());
    }
  }
  while (!stop_) {
    zmq::pollitem_t item{static_cast<void*>(sock_->sub), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(50));
      if (!(item.revents & ZMQ_POLLIN) || !recv_all(sock_->sub, frames)) continue;
      if (frames.size() != 3) {
        malformed_.fetch_add(1);
        continue;
      }
      const int64_t seq = from_be64(frames[1]);
      if (seq < 0) {
        malformed_.fetch_add(1);
        continue;
      }
      std::string payload(static_cast<const char*>(frames[2].data()), frames[2].size());
      int64_t next = next_.load();
      if (next < 0) next = 0;              // the first batch: everything from seq 0 is wanted
      if (seq < next) next_ = next = seq;  // a restarted publisher
      if (seq > next) {
        next_ = next;
        replay_from(next);  // a late subscriber, or a gap
        next = next_.load();
        if (seq < next) continue;  // (the replay covered it)
        if (seq > next) {
          lost_.fetch_add(seq - next);
          if (on_lost_) on_lost_(next, seq);
        }
      }
      deliver(seq, payload);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kv events: subscriber: %s\n", e.what());
    }
  }
}

}  // namespace tandem
