#include "engine/constraint.h"

#include <exception>

namespace tandem {

MaskWorker::MaskWorker(int64_t vocab) : words_(bitmask_words(vocab)) {}

MaskWorker::~MaskWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void MaskWorker::run(const std::vector<Job>& jobs) const {
  for (const Job& j : jobs) {
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
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    jobs_ = std::move(jobs);
    pending_ = true;
  }
  cv_.notify_all();
}

void MaskWorker::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !pending_; });
}

void MaskWorker::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || pending_; });
    if (stop_) return;
    std::vector<Job> jobs = std::move(jobs_);
    lock.unlock();
    run(jobs);
    lock.lock();
    pending_ = false;
    cv_.notify_all();
  }
}

}  // namespace tandem
