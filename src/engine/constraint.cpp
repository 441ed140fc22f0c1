#include "engine/constraint.h"

#include <algorithm>
#include <exception>

namespace tandem {

MaskWorker::MaskWorker(int64_t vocab, int num_threads)
    : words_(bitmask_words(vocab)),
      num_threads_(
          num_threads > 0
              ? num_threads
              : std::clamp(static_cast<int>(std::thread::hardware_concurrency()) / 4, 1, 4)) {}

MaskWorker::~MaskWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void MaskWorker::run(int index) const {
  for (size_t i = static_cast<size_t>(index); i < jobs_.size();
       i += static_cast<size_t>(num_threads_)) {
    const Job& j = jobs_[i];
    j.mask->resize(static_cast<size_t>(words_));
    try {
      *j.active = j.constraint->fill_next_mask(*j.mask);
    } catch (const std::exception& e) {
      *j.active = false;
      *j.error = std::string("the grammar failed to build the token mask: ") + e.what();
    }
  }
}

void MaskWorker::start(std::vector<Job> jobs) {
  wait();
  if (jobs.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (static_cast<int>(threads_.size()) < num_threads_) {
      const int index = static_cast<int>(threads_.size());
      threads_.emplace_back([this, index] { loop(index); });
    }
    jobs_ = std::move(jobs);
    running_ = num_threads_;
    ++generation_;
  }
  cv_.notify_all();
}

void MaskWorker::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return running_ == 0; });
}

void MaskWorker::loop(int index) {
  int64_t seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    lock.unlock();
    run(index);  // jobs_ is not written while running_ > 0
    lock.lock();
    if (--running_ == 0) cv_.notify_all();
  }
}

}  // namespace tandem
