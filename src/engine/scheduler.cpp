#include "engine/scheduler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <unordered_set>

#include "core/error.h"

namespace tandem {

// ---- The step-time model. ----

namespace {
// The terms, scaled to be about 1 at a typical step (the fit's conditioning).
constexpr std::array<double, StepCostModel::kTerms> kScale = {
    1.0, 1.0 / 64, 1.0 / 65536, 1.0 / 1024, 1.0 / 1048576, 1.0};
constexpr double kForget = 0.995;

std::array<double, StepCostModel::kTerms> terms(const StepShape& s) {
  return {1.0,
          s.decode_rows * kScale[1],
          s.decode_context * kScale[2],
          s.prefill_tokens * kScale[3],
          s.prefill_context * kScale[4],
          s.prefill_tokens > 0 ? kScale[5] : 0.0};
}

// Positions attended to by tokens at [start, start + n): sum of (p + 1).
double context_sum(int64_t start, int64_t n) {
  return static_cast<double>(n) * static_cast<double>(start) +
         0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
}
}  // namespace

void StepShape::add(int64_t start, int64_t n, bool decode) {
  if (decode) {
    decode_rows += static_cast<double>(n);
    decode_context += context_sum(start, n);
  } else {
    prefill_tokens += static_cast<double>(n);
    prefill_context += context_sum(start, n);
  }
}

void StepCostModel::observe(const StepShape& shape, double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return;
  const auto x = terms(shape);
  for (double& v : xtx_) v *= kForget;
  for (double& v : xty_) v *= kForget;
  for (int i = 0; i < kTerms; ++i) {
    for (int j = 0; j < kTerms; ++j) xtx_[i * kTerms + j] += x[i] * x[j];
    xty_[i] += x[i] * seconds;
  }
  ++num_steps_;
  if (shape.prefill_tokens > 0) ++num_prefill_steps_;
  solve();
}

void StepCostModel::solve() {
  // Least squares over the active terms (a tiny ridge for terms the data does not pin down);
  // a negative coefficient leaves the active set and the rest is refit.
  std::array<bool, kTerms> active;
  active.fill(true);
  // The mixed-step term only when both kinds of step were seen lately (weights decay): with
  // only mixed steps it is the intercept twice over, and the decode-only prediction that the
  // relative target rests on would get an arbitrary share of it.
  const double mixed_w = xtx_[5 * kTerms + 5], decode_only_w = xtx_[0] - mixed_w;
  if (mixed_w < 4.0 || decode_only_w < 4.0) active[5] = false;
  for (int round = 0; round < kTerms; ++round) {
    std::array<double, kTerms*(kTerms + 1)> m{};  // augmented [A | b]
    for (int i = 0; i < kTerms; ++i) {
      for (int j = 0; j < kTerms; ++j) {
        m[i * (kTerms + 1) + j] = active[i] && active[j] ? xtx_[i * kTerms + j] : 0.0;
      }
      m[i * (kTerms + 1) + i] += active[i] ? 1e-9 * (1.0 + xtx_[i * kTerms + i]) : 1.0;
      m[i * (kTerms + 1) + kTerms] = active[i] ? xty_[i] : 0.0;
    }
    for (int c = 0; c < kTerms; ++c) {  // Gaussian elimination, partial pivoting
      int piv = c;
      for (int r = c + 1; r < kTerms; ++r) {
        if (std::abs(m[r * (kTerms + 1) + c]) > std::abs(m[piv * (kTerms + 1) + c])) piv = r;
      }
      for (int k = 0; k <= kTerms; ++k)
        std::swap(m[c * (kTerms + 1) + k], m[piv * (kTerms + 1) + k]);
      const double d = m[c * (kTerms + 1) + c];
      if (std::abs(d) < 1e-300) continue;
      for (int r = 0; r < kTerms; ++r) {
        if (r == c) continue;
        const double f = m[r * (kTerms + 1) + c] / d;
        for (int k = c; k <= kTerms; ++k) m[r * (kTerms + 1) + k] -= f * m[c * (kTerms + 1) + k];
      }
    }
    std::array<double, kTerms> th{};
    int worst = -1;
    for (int i = 0; i < kTerms; ++i) {
      const double d = m[i * (kTerms + 1) + i];
      th[i] = active[i] && std::abs(d) > 1e-300 ? m[i * (kTerms + 1) + kTerms] / d : 0.0;
      if (active[i] && th[i] < 0 && (worst < 0 || th[i] < th[worst])) worst = i;
    }
    theta_ = th;
    if (worst < 0) return;
    active[worst] = false;
  }
  for (double& t : theta_) t = std::max(0.0, t);
}

double StepCostModel::predict(const StepShape& shape) const {
  const auto x = terms(shape);
  double t = 0;
  for (int i = 0; i < kTerms; ++i) t += theta_[i] * x[i];
  return t;
}

double StepCostModel::mixed_cost() const { return theta_[5] * kScale[5]; }

double StepCostModel::prefill_cost(int64_t start, int64_t n) const {
  if (n <= 0) return 0;
  return theta_[3] * kScale[3] * static_cast<double>(n) +
         theta_[4] * kScale[4] * context_sum(start, n);
}

int64_t StepCostModel::prefill_tokens_within(double seconds, int64_t start) const {
  if (!(seconds > 0)) return 0;
  // cost(n) = B n + A n^2 with B = d' + e' (start + 0.5), A = e' / 2.
  const double e = theta_[4] * kScale[4];
  const double b = theta_[3] * kScale[3] + e * (static_cast<double>(start) + 0.5);
  const double a = 0.5 * e;
  double n;
  if (a > 0) {
    n = (-b + std::sqrt(b * b + 4 * a * seconds)) / (2 * a);
  } else if (b > 0) {
    n = seconds / b;
  } else {
    return std::numeric_limits<int64_t>::max();
  }
  if (!(n < 1e15)) return std::numeric_limits<int64_t>::max();
  return static_cast<int64_t>(std::floor(n));
}

std::array<double, StepCostModel::kTerms> StepCostModel::coefficients() const {
  std::array<double, kTerms> c{};
  for (int i = 0; i < kTerms; ++i) c[i] = theta_[i] * kScale[i];
  return c;
}

// ---- The scheduler. ----

Scheduler::Scheduler(BlockManager& blocks, int64_t max_num_seqs, int64_t max_batched_tokens,
                     int64_t num_state_slots)
    : blocks_(blocks),
      max_num_seqs_(max_num_seqs),
      max_batched_tokens_(max_batched_tokens),
      slots_(num_state_slots),
      stateful_(num_state_slots > 0),
      clock_([] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
      }) {}

void Scheduler::set_step_time_target(double target_s, int64_t min_prefill_chunk,
                                     double decode_factor) {
  TANDEM_CHECK_KIND(kInvalidArgument, std::isfinite(target_s) && min_prefill_chunk >= 1,
                    "the step time target must be a number (0: off, < 0: auto) and the minimum "
                    "prefill chunk at least 1 token, not ",
                    target_s, " and ", min_prefill_chunk);
  TANDEM_CHECK_KIND(
      kInvalidArgument, decode_factor == 0 || (decode_factor >= 1 && decode_factor < 1e6),
      "the step time factor must be 0 (the arrival rule) or at least 1, not ", decode_factor);
  target_s_ = target_s;
  min_prefill_chunk_ = min_prefill_chunk;
  decode_factor_ = decode_factor;
}

void Scheduler::observe_step(const StepShape& shape, double seconds) {
  cost_.observe(shape, seconds);
  if (shape.prefill_tokens == 0 && shape.decode_rows > 0 && std::isfinite(seconds) &&
      seconds >= 0) {
    decode_step_s_ = decode_step_s_ > 0 ? 0.9 * decode_step_s_ + 0.1 * seconds : seconds;
  }
}

void Scheduler::decay_arrivals(double now) {
  if (now > arrivals_at_) {
    const double f = std::exp(-(now - arrivals_at_) / kArrivalWindowS);
    arrived_tokens_ *= f;
    arrived_context_ *= f;
  }
  arrivals_at_ = std::max(arrivals_at_, now);
}

void Scheduler::add(std::unique_ptr<Sequence> seq) {
  Sequence* s = seq.get();
  const double now = clock_();
  if (s->arrival_s < 0) s->arrival_s = now;
  decay_arrivals(now);
  const int64_t todo = static_cast<int64_t>(s->tokens.size()) - s->num_computed;
  arrived_tokens_ += static_cast<double>(todo);
  arrived_context_ += context_sum(s->num_computed, todo);
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
  last_target_s_ = 0;
  if (target_s_ != 0) return schedule_timed();
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
    const auto spec = static_cast<int64_t>(s->spec.tokens.size());
    const bool verify = spec > 1 && s->num_computed + 1 == static_cast<int64_t>(s->tokens.size()) &&
                        spec <= budget && ensure_pages(*s, s->num_computed + spec);
    if (!verify) s->spec.tokens.clear();
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
    admitted(*s);
    waiting_.pop_front();
    running_.push_back(s);
    take(s, chunk);
  }
  finish_batch(batch);
  return batch;
}

void Scheduler::admitted(Sequence& s) {
  if (s.admitted_once) return;
  s.admitted_once = true;
  s.num_cached_prompt = s.num_computed;
  blocks_.count_query(s.prompt_len, s.num_computed);
  queue_time_.observe(kQueueTimeBounds, std::max(0.0, clock_() - s.arrival_s));
}

void Scheduler::finish_batch(ScheduledBatch& batch) {
  int64_t tokens = 0;
  for (const auto& ss : batch.seqs) {
    Sequence* s = ss.seq;
    const int32_t* toks = ss.verify ? s->spec.tokens.data() : s->tokens.data() + s->num_computed;
    const bool decode = ss.verify || (ss.num_tokens == 1 && s->num_computed >= s->prompt_len);
    batch.shape.add(s->num_computed, ss.num_tokens, decode);
    tokens += ss.num_tokens;
    batch.forward.seqs.push_back({toks, ss.num_tokens, s->num_computed, s->pages.data(),
                                  static_cast<int64_t>(s->pages.size()), ss.logits, s->state_slot});
  }
  if (tokens > 0) iteration_tokens_.observe(kIterationTokensBounds, static_cast<double>(tokens));
}

namespace {
bool is_decode_row(const Sequence& s) {
  return s.num_computed >= s.prompt_len &&
         static_cast<int64_t>(s.tokens.size()) - s.num_computed == 1;
}
}  // namespace

// The step-time policy: every decode row first (pages taken from the newest sequences, as in
// schedule()), then prompt chunks of running and then waiting sequences sized by the model so
// that the step meets the target; never below the starvation floor (set_step_time_target).
ScheduledBatch Scheduler::schedule_timed() {
  ScheduledBatch batch;
  int64_t budget = max_batched_tokens_;
  std::unordered_set<const Sequence*> taken;
  StepShape decode_shape;
  auto take = [&](Sequence* s, int64_t chunk) {
    batch.seqs.push_back({s, chunk, logits_mode(*s, chunk)});
    taken.insert(s);
    budget -= chunk;
  };

  // 1. Decode rows, in admission order.
  bool out_of_pages = false;
  for (auto it = running_.begin(); it != running_.end() && budget > 0;) {
    Sequence* s = *it;
    if (!is_decode_row(*s)) {
      ++it;
      continue;
    }
    // Speculative decoding: the last token and its drafts, as schedule() does.
    const auto spec = static_cast<int64_t>(s->spec.tokens.size());
    const bool verify = spec > 1 && spec <= budget && ensure_pages(*s, s->num_computed + spec);
    if (!verify) s->spec.tokens.clear();
    const int64_t chunk = verify ? spec : 1;
    bool ok = verify || ensure_pages(*s, s->num_computed + 1);
    while (!ok && running_.back() != s) {
      preempt(running_.back());  // newer than s, so not taken yet
      ok = ensure_pages(*s, s->num_computed + 1);
    }
    if (!ok) {
      preempt(s);
      out_of_pages = true;
      break;
    }
    decode_shape.add(s->num_computed, chunk, true);
    take(s, chunk);
    if (verify) {
      batch.seqs.back().verify = true;
      batch.seqs.back().logits = LogitsMode::kAll;
    }
    ++it;
  }

  // 2. The prefill budget: time left under the target, and the starvation floor. Auto: a
  // decode step over every live sequence (the waiting ones that could run counted as decode
  // rows at their prompt's length), times clamp(1.25 / (1 - u), 2, 3), u the share of time the
  // prompts arriving lately need (their predicted prefill time per second, over ~2 s): steps
  // twice the decode rows' time, up to 3x (the ITL goal: p99 <= 3x p50) when the prompts need
  // more to keep up.
  const double decode_time = cost_.predict(decode_shape);
  double target = target_s_;
  if (target < 0) {
    StepShape all = decode_shape;
    int64_t room = max_num_seqs_ - static_cast<int64_t>(batch.seqs.size());
    for (Sequence* s : running_) {
      if (room > 0 && taken.count(s) == 0) {
        all.add(static_cast<int64_t>(s->tokens.size()) - 1, 1, true);
        --room;
      }
    }
    for (size_t i = 0; room > 0 && i < waiting_.size(); ++i, --room) {
      all.add(static_cast<int64_t>(waiting_[i]->tokens.size()) - 1, 1, true);
    }
    decay_arrivals(clock_());
    StepShape arrived;
    arrived.prefill_tokens = arrived_tokens_;
    arrived.prefill_context = arrived_context_;
    const double u = (cost_.predict(arrived) - cost_.predict(StepShape{}) - cost_.mixed_cost()) /
                     kArrivalWindowS;
    if (decode_factor_ > 0) {
      // At least F x the decode step; more when the arriving prompts need a larger share of
      // the time to keep up (prefill-bound loads: long but even steps keep the ratio and the
      // throughput), up to 25x.
      // The decode step: the model's, but never under the measured decode-only steps (a fit
      // dominated by long mixed steps can put them near 0).
      target = std::max(cost_.predict(all), decode_step_s_) *
               std::max(decode_factor_, 1.25 / (1.0 - std::clamp(u, 0.0, 0.95)));
    } else {
      target = cost_.predict(all) * std::clamp(1.25 / (1.0 - std::min(u, 0.9)), 2.0, 3.0);
    }
  }
  last_target_s_ = cost_.ready() ? target : 0;
  // A step with prompt tokens also pays the model's mixed-step cost (eager, not a graph).
  double time_left = target - decode_time - cost_.mixed_cost();
  std::vector<Sequence*> prefills;
  for (Sequence* s : running_) {
    if (taken.count(s) == 0 && !is_decode_row(*s)) prefills.push_back(s);
  }
  int64_t floor_left = min_prefill_chunk_;
  // No fit yet (the first steps): the prompt tokens of a step double from the floor, so the
  // fit sees chunks of several sizes and no step is much longer than the last.
  const bool fitted = cost_.ready();
  int64_t ramp_left = min_prefill_chunk_ << std::min<int64_t>(cost_.num_steps(), 20);
  auto size_chunk = [&](const Sequence& s) {
    const int64_t avail = static_cast<int64_t>(s.tokens.size()) - s.num_computed;
    const int64_t n =
        fitted ? std::max(cost_.prefill_tokens_within(time_left, s.num_computed), floor_left)
               : ramp_left;
    return limit_chunk(s, std::min({n, avail, budget}));
  };
  auto account = [&](const Sequence& s, int64_t chunk) {
    floor_left = std::max<int64_t>(0, floor_left - chunk);
    ramp_left = std::max<int64_t>(0, ramp_left - chunk);
    time_left -= cost_.prefill_cost(s.num_computed, chunk);
  };

  // 3. Running sequences' prompt chunks (pages: from newer sequences not in this step).
  for (Sequence* s : prefills) {
    if (out_of_pages || budget <= 0) break;
    if (std::find(running_.begin(), running_.end(), s) == running_.end()) continue;  // preempted
    const int64_t chunk = size_chunk(*s);
    if (chunk <= 0) break;
    bool ok = ensure_pages(*s, s->num_computed + chunk);
    while (!ok) {
      Sequence* victim = nullptr;
      for (auto r = running_.rbegin(); r != running_.rend() && *r != s; ++r) {
        if (taken.count(*r) == 0) {
          victim = *r;
          break;
        }
      }
      if (victim == nullptr) break;
      preempt(victim);
      ok = ensure_pages(*s, s->num_computed + chunk);
    }
    if (!ok) {
      if (batch.seqs.empty()) preempt(s);  // nothing else runs: as schedule() does
      out_of_pages = true;
      break;
    }
    account(*s, chunk);
    take(s, chunk);
  }

  // 4. Waiting sequences, first come first served.
  while (!out_of_pages && !waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(running_.size()) < max_num_seqs_) {
    Sequence* s = waiting_.front();
    const int64_t ps = blocks_.page_size();
    int32_t restore = -1;
    if (s->pages.empty()) {
      int64_t max_pages = (static_cast<int64_t>(s->tokens.size()) - 1) / ps;
      if (s->req.sampling.prompt_logprobs >= 0 && !s->prompt_logprobs_done) max_pages = 0;
      restore = match_with_checkpoint(*s, max_pages);
    }
    const int64_t chunk = size_chunk(*s);
    if (chunk <= 0 || !ensure_pages(*s, s->num_computed + chunk)) {
      free_pages(*s);
      break;
    }
    if (stateful_ && s->state_slot < 0 && (s->state_slot = slots_.allocate()) < 0) {
      free_pages(*s);
      break;
    }
    if (restore >= 0) batch.state_restores.push_back({restore, s->state_slot});
    admitted(*s);
    waiting_.pop_front();
    running_.push_back(s);
    account(*s, chunk);
    take(s, chunk);
  }
  finish_batch(batch);
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
      blocks_.publish(s.pages[static_cast<size_t>(pi)], h, toks, parent);
      s.page_hashes.push_back(h);
    }
    // Hybrid prefix cache: the state at a checkpoint position of the prompt.
    if (checkpoints_ && s.num_computed > 0 && s.num_computed <= s.prompt_len &&
        s.num_computed % checkpoint_interval_ == 0) {
      const auto pi = static_cast<size_t>(s.num_computed / ps - 1);
      std::optional<uint64_t> evicted;
      const int32_t dst = checkpoints_->insert(s.page_hashes[pi], &evicted);
      if (dst >= 0) {
        state_saves_.push_back({s.state_slot, dst});
        // KV events, group 1 (vLLM's "mamba" group): the checkpoint under the chain hash of the
        // page it follows, with that page's tokens and parent, as group 0 stores the page.
        KvEventLog& events = blocks_.events();
        if (evicted) events.removed(*evicted, kKvGroupState);
        events.stored(s.page_hashes[pi],
                      pi == 0 ? std::nullopt : std::optional<uint64_t>(s.page_hashes[pi - 1]),
                      s.tokens.data() + pi * static_cast<size_t>(ps), ps, kKvGroupState);
      }
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
