// Progress of checkpoint loads, for a person watching start-up. No loader carries it: a
// Checkpoint reports, to the observer installed for the process (ScopedLoadObserver), its total
// tensor bytes when it opens and each tensor a loader reads through the shape-checked
// Checkpoint::get(name, shape) (the loaders' read path; with mmap the bytes are paged in right
// after). The observer is the caller's (the server prints progress and serves it on /health).
#pragma once

#include <cstdint>
#include <string>

namespace tandem {

/// Receives load progress; the calls may come from several loader threads at once.
class LoadObserver {
 public:
  virtual ~LoadObserver() = default;
  /// A checkpoint directory was opened; `total_bytes`: all its tensors' bytes. The same
  /// directory may be opened more than once (e.g. the MTP layer after the model).
  virtual void on_checkpoint(const std::string& dir, uint64_t total_bytes) = 0;
  /// A loader read tensor `name` of `dir` (`bytes` of it); the same tensor may be read again.
  virtual void on_tensor(const std::string& dir, const std::string& name, uint64_t bytes) = 0;
  /// A CUDA graph was captured at warm-up: `done` of `total`, for a batch of `batch` sequences.
  /// (For the GPU models' warm_up loops to call; nothing calls it yet.)
  virtual void on_graph(int64_t batch, int64_t done, int64_t total) {}
};

/// The observer checkpoints report to (null: none).
LoadObserver* load_observer();

/// Installs `observer` for the process while it lives (the previous one comes back after).
class ScopedLoadObserver {
 public:
  explicit ScopedLoadObserver(LoadObserver* observer);
  ~ScopedLoadObserver();
  ScopedLoadObserver(const ScopedLoadObserver&) = delete;
  ScopedLoadObserver& operator=(const ScopedLoadObserver&) = delete;

 private:
  LoadObserver* previous_;
};

}  // namespace tandem
