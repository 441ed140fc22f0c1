#include "engine/spec_decoder.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "engine/engine.h"
#include "engine/speculative.h"

namespace tandem {

namespace {

// The logits a row samples from: `raw`, or a copy with EOS and the stop ids masked while the
// sequence is below min_tokens (as the non-speculative path masks them).
std::span<const float> masked_row(const Sequence& s, int64_t output_index,
                                  std::span<const float> raw, const std::vector<int64_t>& eos,
                                  std::vector<float>& masked) {
  if (output_index >= s.req.min_tokens) return raw;
  const auto vocab = static_cast<int64_t>(raw.size());
  masked.assign(raw.begin(), raw.end());
  for (int64_t id : eos) {
    if (id >= 0 && id < vocab && !s.req.ignore_eos) masked[static_cast<size_t>(id)] = -INFINITY;
  }
  for (int32_t id : s.req.stop_token_ids) {
    if (id >= 0 && id < vocab) masked[static_cast<size_t>(id)] = -INFINITY;
  }
  return masked;
}

// The constraint's next-token mask into `mask` (sized for `vocab`); false: every token is
// allowed. Speculation fills it on the engine thread: each position needs the state after the
// positions before it.
bool mask_row(TokenConstraint& c, int64_t vocab, std::vector<uint32_t>& mask) {
  mask.resize(static_cast<size_t>(bitmask_words(vocab)));
  return c.fill_next_mask(mask);
}

}  // namespace

SpecDecoder::SpecDecoder(Model& model, const EngineConfig& config, BlockManager& blocks,
                         KvCache& kv, Scheduler& scheduler, EngineStats& counters,
                         SpecEngineHooks hooks)
    : model_(model),
      config_(config),
      blocks_(blocks),
      kv_(kv),
      scheduler_(scheduler),
      counters_(counters),
      hooks_(std::move(hooks)),
      mtp_kv_(model.make_mtp_kv_cache(config.num_pages, config.page_size)) {
  counters_.spec_accepted_per_pos.assign(static_cast<size_t>(config_.num_speculative_tokens), 0);
}

void SpecDecoder::warm_up() {
  model_.warm_up_speculative(kv_, mtp_kv_, config_.max_num_seqs, config_.num_speculative_tokens);
}

void SpecDecoder::add_prefilled(Sequence& s, std::vector<float> prompt_hidden, int64_t begin) {
  s.spec.prompt_hidden = std::move(prompt_hidden);
  s.spec.prompt_hidden_begin = begin;
}

void SpecDecoder::prepare(ScheduledBatch& batch) {
  // Prefilled sequences with prompt hidden states that this batch schedules for their first
  // decode token: taken out of it, their prompt positions held for finish_step's pass 0.
  size_t kept = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const ScheduledSeq ss = batch.seqs[i];
    Sequence& s = *ss.seq;
    bool hold = false;
    if (!s.spec.prompt_hidden.empty()) {
      // Its first decode token (not a recomputation after a preemption), with drafts to make:
      // the MTP layer over the prompt this step (its drafts are verified in the next), as the
      // step that computes a prompt does in one engine.
      const int64_t k = draft_limit(s);
      hold = !ss.verify && ss.num_tokens == 1 && s.num_computed == s.prompt_len &&
             static_cast<int64_t>(s.tokens.size()) == s.prompt_len + 1 && k > 0 &&
             s.req.allow_speculation && (!s.req.constraint || s.req.constraint->can_rollback());
      if (hold) {
        const int64_t count = s.prompt_len - s.spec.prompt_hidden_begin;
        held_.push_back(
            {s.req.id, s.spec.prompt_hidden_begin, count, std::move(s.spec.prompt_hidden)});
        StepShape row;  // its decode row leaves the step
        row.add(s.num_computed, 1, true);
        batch.shape.decode_rows -= row.decode_rows;
        batch.shape.decode_context -= row.decode_context;
      }
      s.spec.prompt_hidden = {};
    }
    if (hold) continue;
    batch.seqs[kept] = ss;
    batch.forward.seqs[kept] = batch.forward.seqs[i];
    ++kept;
  }
  batch.seqs.resize(kept);
  batch.forward.seqs.resize(kept);
  // The MTP layer's input: on the host unless every draft stays on the device (held prompts'
  // rows are on the host).
  bool host = !model_.mtp_drafts_on_device() || !held_.empty();
  for (const auto& ss : batch.seqs) host = host || !drafts_on_device(*ss.seq);
  batch.forward.hidden_out = host ? &hidden_ : nullptr;
  if (!host) hidden_.clear();
  // A hybrid's rejected drafts roll back from the verify's own recurrence inputs.
  if (model_.state_slot_elems() > 0 && config_.spec_state_replay) {
    batch.forward.keep_recurrent_inputs =
        std::any_of(batch.seqs.begin(), batch.seqs.end(), [](const auto& ss) { return ss.verify; });
  }
}

bool SpecDecoder::device_rows(const ScheduledSeq& ss, std::vector<DeviceSampling>& rows) const {
  const Sequence& s = *ss.seq;
  // Sampled verify rows stay on the device for deterministic drafts (q one-hot: the MTP's
  // argmax on the device, or the test hook's): row j draws its token from the target's p with
  // the draw counter of output position num_output + j, and the draft is accepted while the
  // drawn token equals it. That is the rejection rule for a one-hot q exactly (accept with
  // probability p(d); a rejection's token is distributed as norm(max(0, p - q)), p without
  // d), and every emitted token is the draw that non-speculative device sampling makes at its
  // position: the same tokens for the same seed whatever K. Drafts sampled from q on the
  // host (draft_probs) take the host rule (accept_draft).
  if (!s.req.sampling.greedy() && ss.verify && !s.spec.draft_probs.empty()) {
    return false;  // the host path (rejection sampling against q)
  }
  if (!ss.verify) return true;
  // A constrained verify row needs one mask per position (the host path).
  if (s.req.constraint) return false;
  // Greedy verification: each row's argmax (and the logprobs of the token it gives); forced
  // acceptance (benchmarks) emits drafts the rows did not choose, whose logprobs would need
  // host logits.
  if (config_.spec_forced_accept_prob >= 0.0 && s.req.sampling.logprobs >= 0) return false;
  if (s.num_output() < s.req.min_tokens) return false;
  for (int64_t j = 0; j < ss.num_tokens; ++j) {
    std::optional<DeviceSampling> d = to_device_sampling(s.req.sampling, s.device_seed,
                                                         static_cast<uint64_t>(s.num_output() + j));
    if (!d) return false;
    rows.push_back(*d);
  }
  return true;
}

bool SpecDecoder::forward(const ScheduledBatch& batch, const std::vector<DeviceSampling>* rows,
                          std::vector<SampledToken>& sampled) {
  draw_forced_accepts(batch);
  rollbacks_.clear();
  fused_ = rows != nullptr && can_fuse(batch);
  if (fused_) {
    forward_fused(batch, *rows, sampled);
    return true;
  }
  snapshot_states(batch);
  return false;
}

void SpecDecoder::finish_step() {
  // Drafts first: a device draft chain reads the verify's final hidden states on the device,
  // which a rollback by forward would overwrite (the MTP passes touch no recurrent state).
  draft();
  rollback_states();
  fused_ = false;
}

bool SpecDecoder::drafts_on_device(const Sequence& s) const {
  // No row needs host logits (penalties, the min_tokens mask, a token constraint's mask); a
  // sampled request drafts deterministically then (q one-hot at the MTP's argmax), which its
  // verify step accepts on the device (device_rows).
  const SamplingParams& sp = s.req.sampling;
  return model_.samples_on_device() && !sp.needs_host_logits() &&
         s.num_output() >= s.req.min_tokens && !s.req.constraint;
}

void SpecDecoder::note_computed(const Sequence& s, int64_t start, int64_t count,
                                int64_t hidden_row) {
  // A constrained request speculates when its constraint can roll back (its drafts are then
  // masked along the draft, and each verified position with the state before it).
  if (!s.req.allow_speculation || count <= 0) return;
  if (s.req.constraint && !s.req.constraint->can_rollback()) return;
  computed_.push_back({s.req.id, start, count, hidden_row});
}

FinishReason SpecDecoder::accept(const ScheduledSeq& ss, const std::vector<float>& logits,
                                 const std::vector<SampledToken>* sampled, int64_t first_row,
                                 int64_t hidden_row, StepOutput& out) {
  Sequence& s = *ss.seq;
  const int64_t vocab = model_.config().vocab_size;
  const auto& eos = model_.config().eos_token_ids;
  const int64_t start = s.num_computed - ss.num_tokens;  // the last token's position
  const int64_t k = ss.num_tokens - 1;                   // drafts
  const std::vector<int32_t> drafts(s.spec.tokens.begin() + 1, s.spec.tokens.end());
  const std::vector<float> q_all = std::move(s.spec.draft_probs);  // [k, vocab] or empty (one-hot)
  s.spec.tokens.clear();
  s.spec.draft_probs.clear();
  ++counters_.spec_num_drafts;
  counters_.spec_num_draft_tokens += k;

  const SamplingParams& sp = s.req.sampling;
  std::vector<float> masked, p;
  FinishReason reason = FinishReason::kNone;
  int64_t emitted = 0;
  // Row j is the target's distribution after the last token and drafts 1..j: each row
  // samples exactly as a non-speculative step would, then the next row only if its draft
  // was accepted.
  TokenConstraint* constraint = s.req.constraint.get();
  for (int64_t j = 0; j <= k; ++j) {
    std::span<const float> raw, from;  // host logits (not when sampled on the device)
    if (sampled == nullptr) {
      raw = {logits.data() + (first_row + j) * vocab, static_cast<size_t>(vocab)};
      from = masked_row(s, s.num_output(), raw, eos, masked);
    }
    if (constraint) {  // the grammar's state after the tokens so far (the drafts accepted)
      // (constrained rows are sampled on the host: device_rows)
      try {
        if (mask_row(*constraint, vocab, s.mask)) {
          if (from.data() != masked.data()) masked.assign(raw.begin(), raw.end());
          apply_token_bitmask(masked, s.mask);
          from = masked;
        }
      } catch (const std::exception& e) {
        out.error = e.what();
        reason = FinishReason::kError;
        break;
      }
    }
    std::span<const int32_t> prompt(s.tokens.data(), static_cast<size_t>(s.prompt_len));
    std::span<const int32_t> output(s.tokens.data() + s.prompt_len,
                                    static_cast<size_t>(s.num_output()));
    int32_t token = 0;
    bool accepted = false;
    const SampledToken* dev =  // the row's greedy token from the device (device_rows)
        sampled != nullptr ? &(*sampled)[static_cast<size_t>(first_row + j)] : nullptr;
    if (dev != nullptr) {
      token = dev->token;
      if (j < k) {
        const int32_t d = drafts[static_cast<size_t>(j)];
        accepted = s.spec.forced_accepts >= 0 ? j < s.spec.forced_accepts  // benchmarks only
                                              : token == d;
        if (accepted) token = d;
      }
      out.token_ids.push_back(token);
      if (sp.logprobs >= 0) {  // token is the row's own (device_rows: no forced acceptance)
        out.token_logprobs.push_back(dev->logprob);
        if (sp.logprobs > 0) {
          std::vector<TokenLogprob> top;
          for (const auto& [id, lp] : dev->top) top.push_back({id, lp});
          out.top_logprobs.push_back(std::move(top));
        }
      }
    } else if (j < k) {
      const int32_t d = drafts[static_cast<size_t>(j)];
      if (s.spec.forced_accepts >= 0) {  // benchmarks only
        accepted = j < s.spec.forced_accepts;
        token = accepted ? d : sample_token(from, sp, prompt, output, s.rng);
      } else if (sp.greedy()) {
        token = sample_token(from, sp, prompt, output, s.rng);  // the argmax; no draw
        accepted = token == d;
      } else {
        token_distribution(from, sp, prompt, output, p);
        std::span<const float> q;
        if (!q_all.empty()) q = {q_all.data() + j * vocab, static_cast<size_t>(vocab)};
        const AcceptResult r = accept_draft(p, q, d, s.rng);
        token = r.token;
        accepted = r.accepted;
      }
    } else {
      token = sample_token(from, sp, prompt, output, s.rng);  // every draft accepted: the bonus
    }
    std::string rejected;
    if (constraint && !constraint->accept(token, rejected)) {
      out.error = rejected;
      reason = FinishReason::kError;
      break;
    }
    if (dev == nullptr) {
      out.token_ids.push_back(token);
      if (sp.logprobs >= 0) {  // from the target's raw logits, as without speculation
        out.token_logprobs.push_back(token_logprob(raw, token));
        if (sp.logprobs > 0) out.top_logprobs.push_back(top_logprobs(raw, sp.logprobs));
      }
    }
    s.tokens.push_back(token);
    ++counters_.generation_tokens;
    ++emitted;
    if (accepted) {
      ++counters_.spec_num_accepted_tokens;
      ++counters_.spec_accepted_per_pos[static_cast<size_t>(j)];
    }
    reason = hooks_.stop_reason(s, out);
    if (reason != FinishReason::kNone || !accepted) break;
  }
  // Positions start .. start + emitted - 1 hold the last token and the accepted drafts; the KV
  // of the rejected ones is dead, and the pages past the live tokens go back to the pool.
  s.num_computed = start + emitted;
  const int64_t ps = config_.page_size;
  const auto keep = static_cast<size_t>((static_cast<int64_t>(s.tokens.size()) + ps - 1) / ps);
  if (s.pages.size() > keep) {
    blocks_.release(std::span<const int32_t>(s.pages).subspan(keep));
    s.pages.resize(keep);
  }
  if (reason != FinishReason::kNone) return reason;
  if (model_.state_slot_elems() > 0 && emitted < ss.num_tokens) {
    rollbacks_.push_back({s.req.id, start, emitted, hidden_row});
  }
  note_computed(s, start, emitted, hidden_row);
  return FinishReason::kNone;
}

bool SpecDecoder::take_held_prompts(std::vector<Computed>& computed) {
  if (held_.empty()) return false;
  const int64_t h = model_.config().hidden_size;
  std::vector<HeldPrompt> held = std::move(held_);
  held_.clear();
  for (HeldPrompt& p : held) {
    // The same sequence computed this step too (a failed forward skipped the draft of its
    // hold): right after the transferred positions, one run of positions; else (recomputed
    // after a preemption) the transferred rows are stale.
    bool stale = false;
    for (Computed& d : computed) {
      if (d.id != p.id || d.count == 0) continue;
      if (d.start != p.start + p.count) {
        stale = true;
        break;
      }
      p.rows.insert(p.rows.end(), hidden_.begin() + d.hidden_row * h,
                    hidden_.begin() + (d.hidden_row + d.count) * h);
      p.count += d.count;
      d.count = 0;
    }
    if (stale) continue;
    computed.push_back({p.id, p.start, p.count, static_cast<int64_t>(hidden_.size()) / h});
    hidden_.insert(hidden_.end(), p.rows.begin(), p.rows.end());
  }
  std::erase_if(computed, [](const Computed& c) { return c.count == 0; });
  return true;
}

void SpecDecoder::snapshot_states(const ScheduledBatch& batch) {
  // (a fused step keeps the state before itself: VerifyDraftStep::spare_slots)
  if (model_.state_slot_elems() <= 0) return;
  for (const auto& ss : batch.seqs) {
    if (ss.verify && ss.seq->state_slot >= 0) {
      kv_.copy_state(ss.seq->state_slot, spare_state_slot(ss.seq->state_slot));
    }
  }
}

void SpecDecoder::rollback_states() {
  std::vector<Computed> todo = std::move(rollbacks_);
  rollbacks_.clear();
  ForwardBatch fb;
  std::vector<StateReplay> replays;
  for (const Computed& c : todo) {
    Sequence* s = scheduler_.find(c.id);
    if (s == nullptr || s->state_slot < 0) continue;
    if (fused_) {  // rolled back inside the step, to the device's accepted count
      if (s->spec.fused_accepted == c.count - 1) {
        ++state_replays_;
        continue;
      }
      // (the host accepts what the device did unless the step ended the sequence)
      StepOutput out;
      out.id = s->req.id;
      out.error = "internal error: the fused speculative step kept " +
                  std::to_string(s->spec.fused_accepted + 1) + " positions, the engine " +
                  std::to_string(c.count);
      hooks_.finish(*s, FinishReason::kError, out);
      continue;
    }
    kv_.copy_state(spare_state_slot(s->state_slot), s->state_slot);
    replays.push_back({s->state_slot, c.hidden_row, c.count});
    ForwardSeq f{s->tokens.data() + c.start,
                 c.count,
                 c.start,
                 s->pages.data(),
                 static_cast<int64_t>(s->pages.size()),
                 LogitsMode::kNone,
                 s->state_slot};
    fb.seqs.push_back(f);
  }
  if (fb.seqs.empty()) return;
  // The verify kept its recurrence inputs (keep_recurrent_inputs): no second forward.
  if (config_.spec_state_replay && model_.replay_states(replays, kv_)) {
    state_replays_ += static_cast<int64_t>(replays.size());
    return;
  }
  std::vector<float> none;
  model_.forward(fb, kv_, none);
}

int64_t SpecDecoder::draft_limit(const Sequence& s) const {
  return std::min(config_.num_speculative_tokens, config_.max_model_len - 1 - s.num_computed);
}

int64_t SpecDecoder::draft_budget(Sequence& s, const Computed& c) {
  const int64_t ps = config_.page_size;
  const auto n = static_cast<int64_t>(s.tokens.size());
  if (s.num_computed + 1 != n || s.num_computed != c.start + c.count) return 0;
  int64_t k = draft_limit(s);
  // Chained drafts write MTP KV up to position num_computed + k - 2.
  const int64_t need_tokens = s.num_computed + k - 1;
  const int64_t need = (need_tokens + ps - 1) / ps - static_cast<int64_t>(s.pages.size());
  if (k > 1 && need > 0 && !blocks_.allocate(need, s.pages)) {
    k = std::min(k, static_cast<int64_t>(s.pages.size()) * ps - s.num_computed + 1);
  }
  return std::max<int64_t>(k, 0);
}

void SpecDecoder::draft() {
  std::vector<Computed> computed = std::move(computed_);
  computed_.clear();
  if (fused_) {  // the step ran its MTP passes (all K of them: nothing to pad)
    adopt_fused_drafts(computed);
    return;
  }
  const bool host_rows = take_held_prompts(computed);  // prefilled prompts' (prepare)

  // 1. The MTP layer over every position the target computed this step: position t takes the
  // target's hidden state at t and the token at t + 1 (known for all of them now), so its KV
  // follows the target's. A decoding sequence's last row gives its first draft.
  ForwardBatch fb;
  std::vector<int64_t> hidden_rows;  // [tokens]: rows of the target's hidden states
  std::vector<Sequence*> drafting;   // sequences that draft, in batch order
  std::vector<int64_t> num_drafts;   // their K for this step
  for (const Computed& c : computed) {
    Sequence* s = scheduler_.find(c.id);
    if (s == nullptr) continue;  // finished this step
    s->spec.tokens.clear();
    s->spec.draft_probs.clear();
    const int64_t k = draft_budget(*s, c);
    fb.seqs.push_back({s->tokens.data() + c.start + 1, c.count, c.start, s->pages.data(),
                       static_cast<int64_t>(s->pages.size()),
                       k > 0 ? LogitsMode::kLast : LogitsMode::kNone, -1});
    for (int64_t i = 0; i < c.count; ++i) hidden_rows.push_back(c.hidden_row + i);
    if (k > 0) {
      drafting.push_back(s);
      num_drafts.push_back(k);
    }
  }
  if (fb.seqs.empty()) {
    pad_mtp_passes(0);
    return;
  }
  // Drafts on a model that samples on its device: the rows' argmax there (no logits come to
  // the host; drafts_on_device). A model that chains its drafts on the device runs all K
  // passes in one call (no hidden state leaves it); otherwise each pass's hidden states come
  // to the host for the next.
  bool on_device = model_.samples_on_device();
  for (const Sequence* s : drafting) on_device = on_device && drafts_on_device(*s);
  // A collective MTP layer (decode EP): every rank runs K passes per step (pad_mtp_passes).
  const int64_t passes = on_device && model_.mtp_drafts_on_device() && !host_rows
                             ? draft_chain_on_device(fb, hidden_rows, drafting, num_drafts)
                             : draft_on_host(fb, hidden_rows, drafting, num_drafts, on_device);
  pad_mtp_passes(passes);
  apply_draft_hook(drafting);
}

void SpecDecoder::apply_draft_hook(const std::vector<Sequence*>& drafting) {
  if (!config_.spec_draft_hook) return;  // tests: replaced drafts are deterministic (q one-hot)
  const int64_t vocab = model_.config().vocab_size;
  for (Sequence* s : drafting) {
    std::vector<int32_t> d(s->spec.tokens.begin() + 1, s->spec.tokens.end());
    const size_t k = d.size();
    config_.spec_draft_hook(s->req.id, s->tokens, d);
    d.resize(std::min(d.size(), k));
    for (int32_t& t : d) t = std::clamp<int32_t>(t, 0, static_cast<int32_t>(vocab - 1));
    s->spec.tokens.resize(1);
    s->spec.tokens.insert(s->spec.tokens.end(), d.begin(), d.end());
    if (d.empty()) s->spec.tokens.clear();
    s->spec.draft_probs.clear();
  }
}

// ---- The fused speculative step (Model::forward_verify_draft) --------------------------

void SpecDecoder::draw_forced_accepts(const ScheduledBatch& batch) {
  for (const auto& ss : batch.seqs) {
    Sequence& s = *ss.seq;
    s.spec.forced_accepts = -1;
    if (config_.spec_forced_accept_prob < 0.0 || !ss.verify) continue;
    int32_t a = 0;
    while (a < ss.num_tokens - 1 &&
           uniform_draw(forced_accept_rng_) < config_.spec_forced_accept_prob) {
      ++a;
    }
    s.spec.forced_accepts = a;
  }
}

bool SpecDecoder::can_fuse(const ScheduledBatch& batch) {
  // (held prefilled prompts: their MTP pass over the prompt runs in draft(), not fused)
  // (a hybrid's rejected drafts roll back inside the step by replaying its recurrence inputs)
  // (a collective MTP layer: the step runs pass 0 and K - 1 chained passes, the K exchanges of
  // an unfused or empty step of a peer, so the choice is this rank's alone)
  const bool states = model_.state_slot_elems() > 0;
  if (batch.seqs.empty() || !model_.fuses_verify_and_draft() ||
      (states && !config_.spec_state_replay) || !held_.empty()) {
    return false;
  }
  for (const auto& ss : batch.seqs) {
    const Sequence& s = *ss.seq;
    const bool decode = ss.num_tokens == 1 && ss.logits == LogitsMode::kLast &&
                        s.num_computed >= s.prompt_len &&
                        s.num_computed + 1 == static_cast<int64_t>(s.tokens.size());
    if (!(ss.verify || decode) || !s.req.allow_speculation || !drafts_on_device(s)) return false;
  }
  // The pages the chained drafts write: up to position start + drafts + K - 2 (all accepted).
  const int64_t ps = config_.page_size, K = config_.num_speculative_tokens;
  for (const auto& ss : batch.seqs) {
    Sequence& s = *ss.seq;
    const int64_t tokens = std::min(s.num_computed + ss.num_tokens + K - 1, config_.max_model_len);
    const int64_t need = (tokens + ps - 1) / ps - static_cast<int64_t>(s.pages.size());
    if (need > 0 && !blocks_.allocate(need, s.pages)) return false;  // (accept() trims)
  }
  return true;
}

void SpecDecoder::forward_fused(const ScheduledBatch& batch,
                                const std::vector<DeviceSampling>& rows,
                                std::vector<SampledToken>& sampled) {
  ForwardBatch fb = batch.forward;  // the block tables again: can_fuse may have grown them
  VerifyDraftStep step;
  step.num_drafts = config_.num_speculative_tokens;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    Sequence& s = *batch.seqs[i].seq;
    fb.seqs[i].block_table = s.pages.data();
    fb.seqs[i].num_pages = static_cast<int64_t>(s.pages.size());
    step.forced.push_back(s.spec.forced_accepts);
    const bool verify = batch.seqs[i].verify && s.state_slot >= 0;
    step.spare_slots.push_back(verify ? static_cast<int32_t>(spare_state_slot(s.state_slot)) : -1);
  }
  model_.forward_verify_draft(fb, kv_, rows, mtp_kv_, step, sampled);
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    Sequence& s = *batch.seqs[i].seq;
    s.spec.fused_drafts = std::move(step.drafts[i]);
    s.spec.fused_accepted = step.accepted[i];
  }
}

void SpecDecoder::adopt_fused_drafts(const std::vector<Computed>& computed) {
  std::vector<Sequence*> drafting;
  for (const Computed& c : computed) {
    Sequence* s = scheduler_.find(c.id);
    if (s == nullptr) continue;  // finished this step
    std::vector<int32_t> d = std::move(s->spec.fused_drafts);
    s->spec.fused_drafts.clear();
    s->spec.tokens.clear();
    s->spec.draft_probs.clear();
    // The device accepted what accept() did unless the step ended the sequence (then it
    // is gone); drafts made after another count would continue other positions: none then.
    if (s->spec.fused_accepted != c.count - 1) continue;
    const int64_t k = std::min(draft_budget(*s, c), static_cast<int64_t>(d.size()));
    if (k <= 0) continue;
    s->spec.tokens.assign(1, s->tokens.back());
    s->spec.tokens.insert(s->spec.tokens.end(), d.begin(), d.begin() + k);
    drafting.push_back(s);
  }
  apply_draft_hook(drafting);
}

int64_t SpecDecoder::draft_chain_on_device(const ForwardBatch& fb,
                                           const std::vector<int64_t>& hidden_rows,
                                           const std::vector<Sequence*>& drafting,
                                           const std::vector<int64_t>& num_drafts) {
  // 2. Every drafting sequence in every chained pass (the passes keep their shape, so a graph
  // bucket serves them all); a sequence past its K computes at a position it wrote before and
  // writes no KV. Chained pass p writes position num_computed + p - 1.
  const int64_t kmax =
      drafting.empty() ? 0 : *std::max_element(num_drafts.begin(), num_drafts.end());
  std::vector<MtpChainPass> chain(static_cast<size_t>(std::max<int64_t>(kmax - 1, 0)));
  for (size_t p = 1; p <= chain.size(); ++p) {
    MtpChainPass& c = chain[p - 1];
    for (size_t i = 0; i < drafting.size(); ++i) {
      Sequence& s = *drafting[i];
      const bool live = static_cast<int64_t>(p) < num_drafts[i];
      const int64_t at = s.num_computed + (live ? static_cast<int64_t>(p) - 1 : num_drafts[i] - 2);
      c.batch.seqs.push_back({&s.tokens.back(), 1, at, s.pages.data(),
                              static_cast<int64_t>(s.pages.size()), LogitsMode::kLast, -1});
      c.writes.push_back(live ? 1 : 0);
    }
  }
  std::vector<std::vector<int32_t>> drafts;
  model_.mtp_draft_chain(fb, hidden_rows, chain, mtp_kv_, drafts);
  for (size_t i = 0; i < drafting.size(); ++i) {
    Sequence& s = *drafting[i];
    s.spec.tokens.assign(1, s.tokens.back());
    for (int64_t p = 0; p < num_drafts[i]; ++p) {
      s.spec.tokens.push_back(drafts[static_cast<size_t>(p)][i]);
    }
  }
  return 1 + static_cast<int64_t>(chain.size());  // pass 0 and the chained ones
}

int64_t SpecDecoder::draft_on_host(const ForwardBatch& fb, const std::vector<int64_t>& hidden_rows,
                                   const std::vector<Sequence*>& drafting,
                                   std::vector<int64_t>& num_drafts, bool on_device) {
  const ModelConfig& mc = model_.config();
  const int64_t h = mc.hidden_size, vocab = mc.vocab_size;
  std::vector<float> hin;  // [tokens, hidden]
  hin.reserve(hidden_rows.size() * static_cast<size_t>(h));
  for (const int64_t r : hidden_rows) {
    TANDEM_CHECK((r + 1) * h <= static_cast<int64_t>(hidden_.size()),
                 "speculative decoding: the step's hidden states are not on the host");
    hin.insert(hin.end(), hidden_.begin() + r * h, hidden_.begin() + (r + 1) * h);
  }
  std::vector<float> logits, hout;
  std::vector<DeviceSampling> dev_rows;
  std::vector<SampledToken> dev_out;
  int64_t passes = 0;  // MTP passes run this step (pad_mtp_passes)
  auto pass = [&](const ForwardBatch& b, const float* hid) {
    ++passes;
    if (on_device) {
      DeviceSampling greedy;
      greedy.temperature = 0.0f;
      dev_rows.assign(static_cast<size_t>(b.num_logit_rows()), greedy);
      model_.mtp_forward_sample(b, hid, mtp_kv_, dev_rows, dev_out, hout);
    } else {
      model_.mtp_forward(b, hid, mtp_kv_, logits, hout);
    }
  };
  pass(fb, hin.data());

  // 2. Drafts: draft j + 1 from the pass before; chained passes run the MTP layer on its own
  // output (hidden state and draft) one position further. A constrained sequence's draft is
  // masked by its grammar advanced along the drafts before it (undone once drafted).
  const auto& eos = mc.eos_token_ids;
  std::vector<float> masked, q;
  std::vector<int32_t> out_ctx;
  std::vector<uint32_t> cmask;
  std::vector<int32_t> advanced(drafting.size(), 0);  // drafts accepted into the constraint
  std::vector<size_t> live(drafting.size());          // indices into drafting of this pass's rows
  for (size_t i = 0; i < live.size(); ++i) live[i] = i;
  for (int64_t j = 0; !live.empty(); ++j) {
    for (size_t r = 0; r < live.size(); ++r) {
      Sequence& s = *drafting[live[r]];
      if (s.spec.tokens.empty()) s.spec.tokens.push_back(s.tokens.back());
      if (on_device) {
        s.spec.tokens.push_back(dev_out[r].token);
        continue;
      }
      std::span<const float> raw(logits.data() + static_cast<int64_t>(r) * vocab,
                                 static_cast<size_t>(vocab));
      std::span<const float> from = masked_row(s, s.num_output() + j, raw, eos, masked);
      TokenConstraint* constraint = s.req.constraint.get();
      if (constraint) {
        bool active = false;
        try {
          active = mask_row(*constraint, vocab, cmask);
        } catch (const std::exception&) {
          num_drafts[live[r]] = j;  // no more drafts (the verify step reports the error)
          continue;
        }
        if (active) {
          if (from.data() != masked.data()) masked.assign(raw.begin(), raw.end());
          apply_token_bitmask(masked, cmask);
          from = masked;
        }
      }
      const SamplingParams& sp = s.req.sampling;
      // Penalties see the output so far and the drafts before this one.
      out_ctx.clear();
      if (sp.needs_host_logits()) {
        out_ctx.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
        out_ctx.insert(out_ctx.end(), s.spec.tokens.begin() + 1, s.spec.tokens.end());
      }
      std::span<const int32_t> prompt(s.tokens.data(), static_cast<size_t>(s.prompt_len));
      int32_t d = 0;
      if (sp.greedy()) {
        d = sample_token(from, sp, prompt, out_ctx, s.rng);  // the argmax; no draw
      } else {
        token_distribution(from, sp, prompt, out_ctx, q);
        d = sample_from_weights(q, s.rng);
        if (d < 0) d = 0;
      }
      std::string rejected;
      if (constraint) {
        if (!constraint->accept(d, rejected)) {
          num_drafts[live[r]] = j;  // a draft the grammar refuses ends the drafts here
          continue;
        }
        ++advanced[live[r]];
      }
      if (!sp.greedy()) s.spec.draft_probs.insert(s.spec.draft_probs.end(), q.begin(), q.end());
      s.spec.tokens.push_back(d);
    }
    // The next pass: the sequences that want another draft.
    std::vector<size_t> next;
    ForwardBatch chain;
    std::vector<float> chain_hidden;
    for (size_t r = 0; r < live.size(); ++r) {
      Sequence& s = *drafting[live[r]];
      if (j + 1 >= num_drafts[live[r]]) continue;
      next.push_back(live[r]);
      chain.seqs.push_back({&s.spec.tokens.back(), 1, s.num_computed + j, s.pages.data(),
                            static_cast<int64_t>(s.pages.size()), LogitsMode::kLast, -1});
      chain_hidden.insert(chain_hidden.end(), hout.begin() + static_cast<int64_t>(r) * h,
                          hout.begin() + static_cast<int64_t>(r + 1) * h);
    }
    live = std::move(next);
    if (live.empty()) break;
    pass(chain, chain_hidden.data());
  }
  for (size_t i = 0; i < drafting.size(); ++i) {  // the grammar back to the emitted tokens
    if (advanced[i] > 0) drafting[i]->req.constraint->rollback(advanced[i]);
  }
  return passes;
}

int64_t SpecDecoder::spare_state_slot(int32_t slot) const {
  // (state slots: max_num_seqs running, then the prefix-cache checkpoints, then the spares)
  return config_.max_num_seqs + config_.num_state_checkpoints + slot;
}

void SpecDecoder::pad_mtp_passes(int64_t done) {
  // A collective MTP layer (Model::mtp_collective(): a decode EP rank's group) runs K passes in
  // every step, pass 0 over the computed positions (a fused step's: over every verify position)
  // and K - 1 chained ones, whatever each rank drafts.
  const int64_t want = model_.mtp_collective() ? config_.num_speculative_tokens : 0;
  TANDEM_CHECK(want == 0 || done <= want, "draft(): ", done, " MTP passes in a step of ", want);
  if (done >= want) return;
  ForwardBatch none;
  std::vector<float> logits, hout;
  for (; done < want; ++done) model_.mtp_forward(none, nullptr, mtp_kv_, logits, hout);
}

}  // namespace tandem
