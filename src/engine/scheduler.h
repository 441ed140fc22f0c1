// Continuous-batching scheduler: chunked prefill under a token budget, paged KV with
// prefix caching, admission control and preemption by recompute.
#pragma once

#include <deque>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/request.h"
#include "kv/block_manager.h"
#include "model/forward_batch.h"

namespace tandem {

/// A request's state inside the engine.
struct Sequence {
  GenRequest req;
  OutputCallback on_output;
  std::vector<int32_t> tokens;  // prompt followed by output
  int64_t prompt_len = 0;
  int64_t num_computed = 0;           // tokens whose KV is in the cache
  int64_t num_cached_prompt = 0;      // prefix-cache hit at first admission
  std::vector<int32_t> pages;         // block table
  std::vector<uint64_t> page_hashes;  // hashes of the leading full prompt pages
  SamplerRng rng;
  uint64_t device_seed = 0;  // the seed of on-device sampling (the request's, else random)
  bool admitted_once = false;
  bool prompt_logprobs_done = false;
  StepOutput prompt_out;  // prompt logprobs gathered across chunks

  int64_t num_output() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

struct ScheduledSeq {
  Sequence* seq;
  int64_t num_tokens;  // tokens computed this step, starting at seq->num_computed
  LogitsMode logits;
};

struct ScheduledBatch {
  std::vector<ScheduledSeq> seqs;
  ForwardBatch forward;
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  Scheduler(BlockManager& blocks, int64_t max_num_seqs, int64_t max_batched_tokens);

  void add(std::unique_ptr<Sequence> seq);
  /// Picks this step's work: running sequences first (decode and unfinished prefill, in
  /// admission order), then waiting ones FCFS. Preempts the newest running sequence when
  /// pages run out.
  ScheduledBatch schedule();
  /// After the forward: marks the scheduled tokens computed and publishes full prompt
  /// pages to the prefix cache.
  void commit(const ScheduledBatch& batch);
  /// Removes a sequence (finished or aborted) and frees its pages.
  std::unique_ptr<Sequence> remove(const std::string& id);
  Sequence* find(const std::string& id);
  std::vector<std::string> live_ids() const;

  bool has_work() const { return !running_.empty() || !waiting_.empty(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t preemptions() const { return preemptions_; }

 private:
  bool ensure_pages(Sequence& seq, int64_t num_tokens);
  void preempt(Sequence* seq);
  void free_pages(Sequence& seq);

  BlockManager& blocks_;
  int64_t max_num_seqs_;
  int64_t max_batched_tokens_;
  std::unordered_map<std::string, std::unique_ptr<Sequence>> seqs_;
  std::list<Sequence*> running_;  // admission order
  std::deque<Sequence*> waiting_;
  int64_t preemptions_ = 0;
};

}  // namespace tandem
