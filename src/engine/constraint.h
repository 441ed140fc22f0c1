// Per-request token constraints (structured outputs, a thinking budget): before each sample
// the engine asks a request's constraint for the set of allowed tokens (a packed bitmask),
// and after it reports the sampled token. The engine knows nothing of grammars; the server
// layer implements TokenConstraint (src/server/grammar).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace tandem {

/// Words of a packed token bitmask over `vocab` tokens: bit (id % 32) of word id / 32 is set
/// when token id is allowed (xgrammar's layout).
inline int64_t bitmask_words(int64_t vocab) { return (vocab + 31) / 32; }

inline bool bitmask_allows(std::span<const uint32_t> mask, int32_t id) {
  return ((mask[static_cast<size_t>(id) / 32] >> (static_cast<uint32_t>(id) % 32)) & 1u) != 0;
}

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  /// Writes the tokens allowed next into `mask` (bitmask_words(vocab) words). Returns false
  /// when every token is allowed at this step (the mask is then unspecified). Runs on the
  /// engine's mask worker, never at the same time as accept().
  virtual bool fill_next_mask(std::span<uint32_t> mask) = 0;
  /// Advances past the sampled token. Returns false when the constraint rejects it; `error`
  /// then says why (the engine finishes the request with kError).
  virtual bool accept(int32_t token, std::string& error) = 0;
  /// Speculative decoding: whether rollback() works. When it does, the engine masks a
  /// request's drafts with the state advanced along them (accept() per draft, then rollback())
  /// and verifies each position with the state after the tokens before it; when it does not,
  /// the request does not speculate.
  virtual bool can_rollback() const { return false; }
  /// Undoes the last `num_tokens` accept()s (at most the drafts of one step).
  virtual void rollback(int32_t num_tokens) { (void)num_tokens; }
};

/// Builds a request's constraint from its wire form (GenRequest::constraint_spec, the server
/// layer's encoding, opaque to the engine) where the request samples: an engine's
/// EngineConfig::constraint_factory (e.g. grammar::instance_constraint_factory). Thread-safe;
/// throws Error(kInvalidArgument) for a spec it cannot build.
using ConstraintFactory = std::function<std::shared_ptr<TokenConstraint>(const std::string& spec)>;

/// Worker threads that fill the next-token masks of a step's constrained rows while the
/// model's forward runs (off the critical path): start() hands them the jobs, wait() joins.
/// Thread k fills jobs k, k + n, ... (n threads: a quarter of the hardware threads, 1 to 4).
class MaskWorker {
 public:
  struct Job {
    TokenConstraint* constraint = nullptr;
    std::vector<uint32_t>* mask = nullptr;  // resized to the word count
    bool* active = nullptr;                 // set to fill_next_mask's result
    std::string* error = nullptr;           // a fill that threw: its message (active false)
  };
  explicit MaskWorker(int64_t vocab, int num_threads = 0);
  ~MaskWorker();
  MaskWorker(const MaskWorker&) = delete;
  MaskWorker& operator=(const MaskWorker&) = delete;

  /// Starts filling (after a wait() of any earlier start()).
  void start(std::vector<Job> jobs);
  /// Blocks until the jobs of the last start() are done; a no-op when none is pending.
  void wait();

 private:
  void loop(int index);
  void run(int index) const;

  int64_t words_;
  int num_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Job> jobs_;
  int64_t generation_ = 0;  // start() count
  int running_ = 0;         // threads still filling the current jobs
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace tandem
