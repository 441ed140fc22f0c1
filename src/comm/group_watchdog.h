// Notices the death of a rank of a process group within seconds, off the data path: every
// rank bumps its own counter in the group's TcpStore every `interval` and reads the others';
// a counter that has not moved for `timeout` (or a store that no longer answers: rank 0, which
// serves it, is gone) calls on_lost once, on the watchdog's thread. A collective waiting for a
// dead peer (a Gloo call, a GPU kernel spinning on a peer's flag) would otherwise notice only
// at its own timeout (tens of seconds). Start it on every rank once the group is up.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/tcp_store.h"

namespace tandem::comm {

struct WatchdogOptions {
  std::chrono::milliseconds interval{250};
  std::chrono::milliseconds timeout{std::chrono::seconds(2)};
  std::string key = "tandem/heartbeat/";
};

class GroupWatchdog {
 public:
  /// on_lost(rank, why): `rank` is the silent rank (-1: the store is unreachable).
  GroupWatchdog(std::shared_ptr<TcpStore> store,
                std::function<void(int, const std::string&)> on_lost, WatchdogOptions options = {});
  ~GroupWatchdog();
  GroupWatchdog(const GroupWatchdog&) = delete;
  GroupWatchdog& operator=(const GroupWatchdog&) = delete;

 private:
  void loop();
  std::shared_ptr<TcpStore> store_;
  std::function<void(int, const std::string&)> on_lost_;
  WatchdogOptions opts_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace tandem::comm
