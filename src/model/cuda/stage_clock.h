// Where a model call's time goes, stage by stage (benchmarks): mark() records a CUDA event on the
// stream and the host clock at the end of each stage; after the call's synchronisation, collect()
// adds each stage's device time (event to event) and host time (mark to mark: its enqueue, or
// the wait for a stage marked after the synchronisation) to running totals, which take() hands
// out and clears. Off, mark() and collect() do nothing.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"

namespace tandem::cuda_model {

struct StageTimes {
  std::string name;
  int64_t calls = 0;
  double device_ms = 0, host_ms = 0;
};

class StageClock {
 public:
  StageClock() = default;
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;
  ~StageClock() {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
  }

  void enable(bool on) {
    on_ = on;
    used_ = 0;
  }
  bool on() const { return on_; }
  /// The end of stage `name` (the first mark of a call starts it: name it "start").
  void mark(const char* name, cudaStream_t stream) {
    if (!on_) return;
    if (used_ == events_.size()) {
      events_.emplace_back();
      TANDEM_CUDA_CHECK(cudaEventCreate(&events_.back()));
      marks_.emplace_back();
    }
    TANDEM_CUDA_CHECK(cudaEventRecord(events_[used_], stream));
    marks_[used_] = {name, std::chrono::steady_clock::now()};
    ++used_;
  }
  /// After the call's synchronisation: a host-only stage `wait` ends now.
  void collect(const char* wait) {
    if (!on_ || used_ == 0) return;
    const auto now = std::chrono::steady_clock::now();
    for (size_t i = 1; i <= used_; ++i) {
      const bool last = i == used_;
      float ms = 0;
      if (!last) TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i - 1], events_[i]));
      const auto end = last ? now : marks_[i].second;
      add(last ? wait : marks_[i].first, ms,
          std::chrono::duration<double, std::milli>(end - marks_[i - 1].second).count());
    }
    used_ = 0;
  }
  /// The totals since the last take(), in the order the stages first ran.
  std::vector<StageTimes> take() { return std::exchange(totals_, {}); }

 private:
  void add(const std::string& name, double device_ms, double host_ms) {
    for (StageTimes& t : totals_) {
      if (t.name != name) continue;
      ++t.calls;
      t.device_ms += device_ms;
      t.host_ms += host_ms;
      return;
    }
    totals_.push_back({name, 1, device_ms, host_ms});
  }
  bool on_ = false;
  std::vector<cudaEvent_t> events_;
  std::vector<std::pair<std::string, std::chrono::steady_clock::time_point>> marks_;
  size_t used_ = 0;
  std::vector<StageTimes> totals_;
};

}  // namespace tandem::cuda_model
