#include "core/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "core/env.h"

namespace tandem {

namespace {
// NOTE: a parallel_for issued from inside a pool job runs serially (no nested fork).
thread_local bool tl_in_pool = false;
}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads = static_cast<int>(env::integer("TANDEM_NUM_THREADS").value_or(0));
    if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
    if (num_threads <= 0) num_threads = 1;
  }
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

// The global pool is made per process: a child of fork() inherits the parent's pool object but
// none of its worker threads, so a parallel_for there would wait for them forever (a rank forked
// by comm::run_local_ranks after the parent used the pool, then loading FP8 experts). The child
// handler drops the inherited pool (leaked: its threads do not exist to be joined; the child is
// single-threaded then) and the next global() call there starts a fresh one. The pool is never
// destroyed: its workers block on a condition variable until the process exits.
// g_pool_mu guards the creation and is held across fork() (prepare / parent / child handlers),
// so that the child never inherits it locked; a created pool is read without it.
namespace {
std::mutex g_pool_mu;
std::atomic<ThreadPool*> g_pool{nullptr};
ThreadPool* g_inherited = nullptr;  // the parent's, in a child (kept reachable for LSan)
void lock_pool() { g_pool_mu.lock(); }
void unlock_pool() { g_pool_mu.unlock(); }
void drop_pool_in_child() {
  if (ThreadPool* p = g_pool.exchange(nullptr)) g_inherited = p;
  g_pool_mu.unlock();
}
}  // namespace

ThreadPool& ThreadPool::global() {
  if (ThreadPool* p = g_pool.load(std::memory_order_acquire)) return *p;
  std::lock_guard<std::mutex> lock(g_pool_mu);
  static const bool registered = ::pthread_atfork(lock_pool, unlock_pool, drop_pool_in_child) == 0;
  (void)registered;
  ThreadPool* p = g_pool.load(std::memory_order_relaxed);
  if (p == nullptr) {
    p = new ThreadPool();
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

void ThreadPool::worker_loop(int index) {
  tl_in_pool = true;
  int64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    int64_t n, chunk;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      chunk = job_chunk_;
    }
    int64_t begin = static_cast<int64_t>(index) * chunk;
    int64_t end = std::min(n, begin + chunk);
    if (begin < end) {
      try {
        (*job)(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) cv_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  int64_t threads = static_cast<int64_t>(size());
  int64_t useful = std::max<int64_t>(1, std::min(threads, n / std::max<int64_t>(grain, 1)));
  if (useful <= 1 || workers_.empty() || tl_in_pool) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mu_);
  int64_t chunk = (n + threads - 1) / threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_chunk_ = chunk;
    pending_ = static_cast<int>(workers_.size());
    error_ = nullptr;
    ++generation_;
  }
  cv_work_.notify_all();
  std::exception_ptr mine;
  tl_in_pool = true;
  try {
    fn(0, std::min(n, chunk));
  } catch (...) {
    mine = std::current_exception();
  }
  tl_in_pool = false;
  std::unique_lock<std::mutex> lock(mu_);
  cv_done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

}  // namespace tandem
