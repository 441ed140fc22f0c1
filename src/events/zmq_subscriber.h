// A consumer of vLLM's KV-event stream (ZmqKvEventPublisher's or vLLM's own): SUB on the
// endpoint (topic prefix), and the replay ROUTER for what it missed. Batches are handed over in
// sequence order. With a replay endpoint it first asks for everything from seq 0 (a late
// subscriber catches up at once); one that sees a gap asks for everything from the seq it
// expected; what the publisher no longer
// buffers (or everything, without a replay endpoint) is lost: on_lost is called and the stream
// goes on from the batch at hand. A seq below the expected one is a restarted publisher: the
// stream starts over from it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "events/kv_event_codec.h"

namespace tandem {

struct KvEventSubscriberConfig {
  std::string endpoint;         // tcp://host:port of the publisher's PUB socket
  std::string replay_endpoint;  // its ROUTER socket; empty: no replay
  std::string topic;            // prefix filter ("": every message)
  int replay_timeout_ms = 1000;
};

class ZmqKvEventSubscriber {
 public:
  using OnBatch = std::function<void(int64_t seq, DecodedKvEventBatch&& batch)>;
  using OnLost = std::function<void(int64_t expected, int64_t got)>;
  /// Starts a thread that connects (nothing needs to be up yet) and calls the callbacks on it.
  ZmqKvEventSubscriber(KvEventSubscriberConfig config, OnBatch on_batch, OnLost on_lost);
  ~ZmqKvEventSubscriber();

  /// The next seq expected (every batch below it was handed over or declared lost).
  int64_t next_seq() const { return next_.load(); }
  int64_t replayed() const { return replayed_.load(); }
  int64_t lost() const { return lost_.load(); }
  int64_t malformed() const { return malformed_.load(); }

 private:
  struct Sockets;
  void run();
  void deliver(int64_t seq, const std::string& payload);
  bool replay_from(int64_t start);

  KvEventSubscriberConfig config_;
  OnBatch on_batch_;
  OnLost on_lost_;
  std::unique_ptr<Sockets> sock_;
  std::atomic<int64_t> next_{-1};  // -1: nothing seen yet
  std::atomic<int64_t> replayed_{0}, lost_{0}, malformed_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace tandem
