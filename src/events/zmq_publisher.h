// vLLM's ZmqEventPublisher in C++: a PUB socket sends each batch as the multipart message
// [topic, seq (8 bytes big-endian), payload] (seq from 0, one per batch), and an optional ROUTER
// socket answers replay requests: a client sends [empty, start_seq (8 bytes big-endian)]
// (a REQ or DEALER socket), and gets [empty, seq, payload] for every buffered batch with
// seq >= start_seq, then [empty, -1 (8 bytes), empty]. The last buffer_steps batches are kept.
//
// The engine thread only queues (publish never blocks): a publisher thread encodes, sends and
// serves replays. A full queue (max_queue_size batches) drops the batch, and the next batch that
// fits starts with AllBlocksCleared, so a consumer forgets what it can no longer trust rather
// than keep a wrong view. The first batch (seq 0) is AllBlocksCleared: a restarted instance
// clears its consumers' view of it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "events/kv_events_config.h"
#include "kv/kv_events.h"

namespace tandem {

class ZmqKvEventPublisher final : public KvEventSink {
 public:
  /// Binds (an endpoint with '*', '::', ipc:// or inproc://) or connects the PUB socket, as vLLM
  /// does, and binds the replay socket; a data-parallel rank offsets both ports. Throws
  /// Error(kInvalidArgument) when a socket cannot be set up.
  ZmqKvEventPublisher(const KvEventsConfig& config, int32_t data_parallel_rank, std::string medium);
  ~ZmqKvEventPublisher() override;

  void publish(std::vector<KvEvent> events) override;

  /// The endpoints as bound (a tcp port 0 or '*' resolved), for logs and tests.
  std::string endpoint() const { return endpoint_; }
  std::string replay_endpoint() const { return replay_endpoint_; }
  /// Batches sent so far (the next seq), and batches dropped on a full queue.
  int64_t sent() const { return sent_.load(); }
  int64_t dropped() const { return dropped_.load(); }

 private:
  void run();
  void serve_replay();

  KvEventsConfig config_;
  KvEventBatchInfo info_;
  struct Sockets;
  std::unique_ptr<Sockets> sock_;
  std::string endpoint_, replay_endpoint_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<KvEvent>> queue_;
  bool lost_ = false;  // a batch was dropped: the next one starts with AllBlocksCleared
  bool stop_ = false;
  std::deque<std::pair<int64_t, std::string>> buffer_;  // (seq, payload): publisher thread only
  std::atomic<int64_t> sent_{0}, dropped_{0};
  std::thread thread_;
};

}  // namespace tandem
