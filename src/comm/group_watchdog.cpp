#include "comm/group_watchdog.h"

#include <vector>

#include "core/error.h"

namespace tandem::comm {

GroupWatchdog::GroupWatchdog(std::shared_ptr<TcpStore> store,
                             std::function<void(int, const std::string&)> on_lost,
                             WatchdogOptions options)
    : store_(std::move(store)), on_lost_(std::move(on_lost)), opts_(std::move(options)) {
  thread_ = std::thread([this] { loop(); });
}

GroupWatchdog::~GroupWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void GroupWatchdog::loop() {
  using Clock = std::chrono::steady_clock;
  const int world = store_->world_size(), me = store_->rank();
  std::vector<int64_t> last(static_cast<size_t>(world), -1);
  std::vector<Clock::time_point> moved(static_cast<size_t>(world), Clock::now());
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    std::string lost_why;
    int lost = -2;
    try {
      store_->add(opts_.key + std::to_string(me), 1);
      const auto now = Clock::now();
      for (int r = 0; r < world; ++r) {
        if (r == me) continue;
        const int64_t v = store_->add(opts_.key + std::to_string(r), 0);
        if (v != last[static_cast<size_t>(r)]) {
          last[static_cast<size_t>(r)] = v;
          moved[static_cast<size_t>(r)] = now;
        } else if (now - moved[static_cast<size_t>(r)] > opts_.timeout) {
          lost = r;
          lost_why = "rank " + std::to_string(r) + " sent no heartbeat for " +
                     std::to_string(opts_.timeout.count()) + " ms";
          break;
        }
      }
    } catch (const std::exception& e) {
      lost = -1;
      lost_why = std::string("the group's store does not answer (rank 0 gone?): ") + e.what();
    }
    lock.lock();
    if (lost != -2 && !stop_) {
      lock.unlock();
      if (on_lost_) on_lost_(lost, lost_why);
      return;
    }
    cv_.wait_for(lock, opts_.interval, [&] { return stop_; });
  }
}

}  // namespace tandem::comm
