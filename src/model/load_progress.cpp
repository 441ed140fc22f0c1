#include "model/load_progress.h"

#include <atomic>

namespace tandem {

namespace {
std::atomic<LoadObserver*> g_observer{nullptr};
}

LoadObserver* load_observer() { return g_observer.load(std::memory_order_acquire); }

ScopedLoadObserver::ScopedLoadObserver(LoadObserver* observer)
    : previous_(g_observer.exchange(observer, std::memory_order_acq_rel)) {}

ScopedLoadObserver::~ScopedLoadObserver() {
  g_observer.store(previous_, std::memory_order_release);
}

}  // namespace tandem
