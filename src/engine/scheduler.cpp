#include "engine/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace tandem {

Scheduler::Scheduler(BlockManager& blocks, int64_t max_num_seqs, int64_t max_batched_tokens)
    : blocks_(blocks), max_num_seqs_(max_num_seqs), max_batched_tokens_(max_batched_tokens) {}

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

void Scheduler::preempt(Sequence* seq) {
  free_pages(*seq);
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
    int64_t chunk =
        std::min<int64_t>(static_cast<int64_t>(s->tokens.size()) - s->num_computed, budget);
    bool ok = ensure_pages(*s, s->num_computed + chunk);
    while (!ok && running_.back() != s) {
      preempt(running_.back());  // the newest sequence gives its pages back
      ok = ensure_pages(*s, s->num_computed + chunk);
    }
    if (!ok) {
      preempt(s);  // nothing newer left to take from
      break;
    }
    take(s, chunk);
    ++it;
  }

  // 2. Waiting sequences, first come first served.
  while (!waiting_.empty() && budget > 0 && static_cast<int64_t>(running_.size()) < max_num_seqs_) {
    Sequence* s = waiting_.front();
    const int64_t ps = blocks_.page_size();
    if (s->pages.empty()) {
      // Reuse cached prompt pages; at least one token is always computed (for logits).
      int64_t max_pages = (static_cast<int64_t>(s->tokens.size()) - 1) / ps;
      if (s->req.sampling.prompt_logprobs >= 0 && !s->prompt_logprobs_done) max_pages = 0;
      int64_t matched = blocks_.match_prefix(s->tokens, max_pages, s->pages, s->page_hashes);
      s->num_computed = matched * ps;
    }
    int64_t chunk =
        std::min<int64_t>(static_cast<int64_t>(s->tokens.size()) - s->num_computed, budget);
    if (!ensure_pages(*s, s->num_computed + chunk)) {
      free_pages(*s);  // do not hold cached pages while waiting
      break;
    }
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
    batch.forward.seqs.push_back({s->tokens.data() + s->num_computed, ss.num_tokens,
                                  s->num_computed, s->pages.data(),
                                  static_cast<int64_t>(s->pages.size()), ss.logits});
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
  return seq;
}

}  // namespace tandem
