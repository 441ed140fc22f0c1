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
  int32_t state_slot = -1;            // hybrid models: recurrent state slot while running
  std::vector<float> initial_state;   // prefilled elsewhere: restored into the slot at admission
  SamplerRng rng;
  uint64_t device_seed = 0;  // the seed of on-device sampling (the request's, else random)
  bool admitted_once = false;
  bool prompt_logprobs_done = false;
  StepOutput prompt_out;  // prompt logprobs gathered across chunks
  // MTP speculative decoding (engine/speculative.h): the last token followed by its drafts,
  // verified together in the next step; empty when there are none.
  std::vector<int32_t> spec_tokens;
  std::vector<float> draft_probs;  // [drafts, vocab] the draft distributions; empty: one-hot
  // req.constraint's next-token mask, filled by the engine's MaskWorker during the forward.
  std::vector<uint32_t> mask;
  bool mask_active = false;
  std::string mask_error;

  int64_t num_output() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

struct ScheduledSeq {
  Sequence* seq;
  int64_t num_tokens;  // tokens computed this step, starting at seq->num_computed
  LogitsMode logits;
  bool verify = false;  // seq->spec_tokens (the last token and its drafts), logits for each
};

/// A copy of one KvCache state slot into another (hybrid models' prefix cache).
struct StateCopy {
  int32_t src = -1, dst = -1;
};

struct ScheduledBatch {
  std::vector<ScheduledSeq> seqs;
  ForwardBatch forward;
  /// Before the forward: checkpoints restored into the state slots of admitted sequences.
  std::vector<StateCopy> state_restores;
  bool empty() const { return seqs.empty(); }
};

class Scheduler {
 public:
  /// num_state_slots > 0 (hybrid models): every running sequence holds one state slot,
  /// taken at admission and given back on preemption and removal.
  Scheduler(BlockManager& blocks, int64_t max_num_seqs, int64_t max_batched_tokens,
            int64_t num_state_slots = 0);

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
  /// State slots not held by a running sequence (0 for a model without states).
  int64_t num_free_state_slots() const { return slots_.num_free(); }
  /// Hybrid models' prefix cache: prompt prefill chunks end at every multiple of `interval`
  /// tokens (a multiple of the page size), where commit() checkpoints the state into one of
  /// `capacity` slots from `first_slot` on; admission resumes a prompt from the deepest
  /// checkpoint its cached pages reach. Requires state slots and an enabled prefix cache.
  void enable_state_checkpoints(int32_t first_slot, int64_t capacity, int64_t interval);
  /// The checkpoints commit() asks for (src: a running slot, dst: a checkpoint slot), to be
  /// copied before the next forward; clears the list.
  std::vector<StateCopy> take_state_saves() { return std::move(state_saves_); }
  const StateCheckpoints* state_checkpoints() const { return checkpoints_.get(); }

 private:
  bool ensure_pages(Sequence& seq, int64_t num_tokens);
  void preempt(Sequence* seq);
  void free_pages(Sequence& seq);
  void release_slot(Sequence& seq);
  // Prefill chunks stop at the next checkpoint position (hybrid prefix cache).
  int64_t limit_chunk(const Sequence& seq, int64_t chunk) const;
  // Admission with a prefix match: keeps the pages up to the deepest checkpoint; returns the
  // checkpoint slot to restore (-1: none, start from zero).
  int32_t match_with_checkpoint(Sequence& seq, int64_t max_pages);

  BlockManager& blocks_;
  int64_t max_num_seqs_;
  int64_t max_batched_tokens_;
  std::unordered_map<std::string, std::unique_ptr<Sequence>> seqs_;
  std::list<Sequence*> running_;  // admission order
  std::deque<Sequence*> waiting_;
  int64_t preemptions_ = 0;
  StateSlotAllocator slots_;
  bool stateful_ = false;
  std::unique_ptr<StateCheckpoints> checkpoints_;
  int64_t checkpoint_interval_ = 0;
  std::vector<StateCopy> state_saves_;
};

}  // namespace tandem
