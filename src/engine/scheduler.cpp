#include "engine/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace tandem {

Scheduler::Scheduler(BlockManager& blocks, int64_t max_num_seqs, int64_t max_batched_tokens,
                     int64_t num_state_slots)
    : blocks_(blocks),
      max_num_seqs_(max_num_seqs),
      max_batched_tokens_(max_batched_tokens),
      slots_(num_state_slots),
      stateful_(num_state_slots > 0) {}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  Sequence* s = seq.get();
  TANDEM_CHECK_KIND(kInvalidArgument, seqs_.count(s->req.id) == 0, "duplicate request id '",
                    s->req.id, "'");
  seqs_.emplace(s->req.id, std::move(seq));
  waiting_.push_back(s);
}

Sequence* Scheduler::find(const std::string& id) {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

std::vector<std::string> Scheduler::live_ids() const {
  std::vector<std::string> ids;
  for (const auto& [id, seq] : seqs_) ids.push_back(id);
  return ids;
}

bool Scheduler::ensure_pages(Sequence& seq, int64_t num_tokens) {
  const int64_t ps = blocks_.page_size();
  int64_t need = (num_tokens + ps - 1) / ps - static_cast<int64_t>(seq.pages.size());
  return need <= 0 || blocks_.allocate(need, seq.pages);
}

void Scheduler::free_pages(Sequence& seq) {
  blocks_.release(seq.pages);
  seq.pages.clear();
  seq.page_hashes.clear();
  seq.num_computed = 0;
}

void Scheduler::release_slot(Sequence& seq) {
  if (seq.state_slot >= 0) slots_.release(seq.state_slot);
  seq.state_slot = -1;
}

void Scheduler::enable_state_checkpoints(int32_t first_slot, int64_t capacity, int64_t interval) {
  const int64_t ps = blocks_.page_size();
  TANDEM_CHECK(stateful_ && capacity > 0 && interval > 0 && interval % ps == 0,
               "state checkpoints need state slots, a capacity and an interval of whole pages (",
               interval, " tokens, pages of ", ps, ")");
  checkpoints_ = std::make_unique<StateCheckpoints>(first_slot, capacity);
  checkpoint_interval_ = interval;
}

int64_t Scheduler::limit_chunk(const Sequence& s, int64_t chunk) const {
  if (!checkpoints_ || s.num_computed >= s.prompt_len) return chunk;
  const int64_t next = (s.num_computed / checkpoint_interval_ + 1) * checkpoint_interval_;
  return next < s.num_computed + chunk && next <= s.prompt_len ? next - s.num_computed : chunk;
}

int32_t Scheduler::match_with_checkpoint(Sequence& s, int64_t max_pages) {
  const int64_t ps = blocks_.page_size();
  int64_t matched = blocks_.match_prefix(s.tokens, max_pages, s.pages, s.page_hashes);
  if (!stateful_) {
    s.num_computed = matched * ps;
    return -1;
  }
  // A hybrid model resumes only where its recurrent state was checkpointed.
  int64_t keep = 0;
  int32_t slot = -1;
  for (int64_t j = matched; j > 0 && checkpoints_; --j) {
    if ((slot = checkpoints_->find(s.page_hashes[static_cast<size_t>(j - 1)])) >= 0) {
      keep = j;
      break;
    }
  }
  blocks_.release(std::span<const int32_t>(s.pages).subspan(static_cast<size_t>(keep)));
  s.pages.resize(static_cast<size_t>(keep));
  s.page_hashes.resize(static_cast<size_t>(keep));
  s.num_computed = keep * ps;
  return slot;
}

void Scheduler::preempt(Sequence* seq) {
  free_pages(*seq);
  release_slot(*seq);  // recomputed from its first token, so from a zero state
  running_.remove(seq);
  waiting_.push_front(seq);
  ++preemptions_;
}

namespace {
LogitsMode logits_mode(const Sequence& s, int64_t chunk) {
  const bool wants_prompt = s.req.sampling.prompt_logprobs >= 0 && !s.prompt_logprobs_done &&
                            s.num_computed < s.prompt_len;
  if (wants_prompt) return LogitsMode::kAll;
  return s.num_computed + chunk == static_cast<int64_t>(s.tokens.size()) ? LogitsMode::kLast
                                                                         : LogitsMode::kNone;
}
}  // namespace

ScheduledBatch Scheduler::schedule() {
  ScheduledBatch batch;
  int64_t budget = max_batched_tokens_;
  auto take = [&](Sequence* s, int64_t chunk) {
    batch.seqs.push_back({s, chunk, logits_mode(*s, chunk)});
    budget -= chunk;
  };

  // 1. Running sequences: decode tokens and unfinished prefill chunks.
  for (auto it = running_.begin(); it != running_.end() && budget > 0;) {
    Sequence* s = *it;
    int64_t chunk = limit_chunk(
        *s, std::min<int64_t>(static_cast<int64_t>(s->tokens.size()) - s->num_computed, budget));
    // Speculative decoding: the last token and its drafts, when the budget and the free pages
    // allow (drafts never preempt anyone: without room the step decodes one token).
    const auto spec = static_cast<int64_t>(s->spec_tokens.size());
    const bool verify = spec > 1 && s->num_computed + 1 == static_cast<int64_t>(s->tokens.size()) &&
                        spec <= budget && ensure_pages(*s, s->num_computed + spec);
    if (!verify) s->spec_tokens.clear();
    if (verify) chunk = spec;
    bool ok = verify || ensure_pages(*s, s->num_computed + chunk);
    while (!ok && running_.back() != s) {
      preempt(running_.back());  // the newest sequence gives its pages back
      ok = ensure_pages(*s, s->num_computed + chunk);
    }
    if (!ok) {
      preempt(s);  // nothing newer left to take from
      break;
    }
    take(s, chunk);
    if (verify) {
      batch.seqs.back().verify = true;
      batch.seqs.back().logits = LogitsMode::kAll;
    }
    ++it;
  }

  // 2. Waiting sequences, first come first served.
  while (!waiting_.empty() && budget > 0 && static_cast<int64_t>(running_.size()) < max_num_seqs_) {
    Sequence* s = waiting_.front();
    const int64_t ps = blocks_.page_size();
    int32_t restore = -1;
    if (s->pages.empty()) {
      // Reuse cached prompt pages; at least one token is always computed (for logits).
      int64_t max_pages = (static_cast<int64_t>(s->tokens.size()) - 1) / ps;
      if (s->req.sampling.prompt_logprobs >= 0 && !s->prompt_logprobs_done) max_pages = 0;
      restore = match_with_checkpoint(*s, max_pages);
    }
    int64_t chunk = limit_chunk(
        *s, std::min<int64_t>(static_cast<int64_t>(s->tokens.size()) - s->num_computed, budget));
    if (!ensure_pages(*s, s->num_computed + chunk)) {
      free_pages(*s);  // do not hold cached pages while waiting
      break;
    }
    if (stateful_ && s->state_slot < 0 && (s->state_slot = slots_.allocate()) < 0) {
      free_pages(*s);  // no state slot free: wait for a running sequence to end
      break;
    }
    if (restore >= 0) batch.state_restores.push_back({restore, s->state_slot});
    if (!s->admitted_once) {
      s->admitted_once = true;
      s->num_cached_prompt = s->num_computed;
      blocks_.count_query(s->prompt_len, s->num_computed);
    }
    waiting_.pop_front();
    running_.push_back(s);
    take(s, chunk);
  }

  for (const auto& ss : batch.seqs) {
    Sequence* s = ss.seq;
    const int32_t* tokens = ss.verify ? s->spec_tokens.data() : s->tokens.data() + s->num_computed;
    batch.forward.seqs.push_back({tokens, ss.num_tokens, s->num_computed, s->pages.data(),
                                  static_cast<int64_t>(s->pages.size()), ss.logits, s->state_slot});
  }
  return batch;
}

void Scheduler::commit(const ScheduledBatch& batch) {
  const int64_t ps = blocks_.page_size();
  for (const auto& ss : batch.seqs) {
    Sequence& s = *ss.seq;
    s.num_computed += ss.num_tokens;
    // Publish prompt pages that are now complete.
    int64_t full = std::min(s.num_computed, s.prompt_len) / ps;
    for (auto pi = static_cast<int64_t>(s.page_hashes.size()); pi < full; ++pi) {
      std::span<const int32_t> toks(s.tokens.data() + pi * ps, static_cast<size_t>(ps));
      uint64_t parent = pi == 0 ? 0 : s.page_hashes.back();
      uint64_t h = BlockManager::page_hash(parent, toks);
      blocks_.publish(s.pages[static_cast<size_t>(pi)], h, toks);
      s.page_hashes.push_back(h);
    }
    // Hybrid prefix cache: the state at a checkpoint position of the prompt.
    if (checkpoints_ && s.num_computed > 0 && s.num_computed <= s.prompt_len &&
        s.num_computed % checkpoint_interval_ == 0) {
      const int32_t dst =
          checkpoints_->insert(s.page_hashes[static_cast<size_t>(s.num_computed / ps - 1)]);
      if (dst >= 0) state_saves_.push_back({s.state_slot, dst});
    }
  }
}

std::unique_ptr<Sequence> Scheduler::remove(const std::string& id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return nullptr;
  std::unique_ptr<Sequence> seq = std::move(it->second);
  seqs_.erase(it);
  running_.remove(seq.get());
  auto w = std::find(waiting_.begin(), waiting_.end(), seq.get());
  if (w != waiting_.end()) waiting_.erase(w);
  blocks_.release(seq->pages);
  seq->pages.clear();
  release_slot(*seq);
  return seq;
}

}  // namespace tandem
