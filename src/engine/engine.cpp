#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>

#include "core/error.h"
#include "engine/speculative.h"

namespace tandem {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kLength: return "length";
    case FinishReason::kStop: return "stop";
    case FinishReason::kAbort: return "abort";
    case FinishReason::kError: return "error";
  }
  return "none";
}

bool spec_state_replay_on(const EngineConfig& c) {
  const char* e = std::getenv("TANDEM_SPEC_STATE_REPLAY");
  return c.spec_state_replay && (e == nullptr || std::strcmp(e, "0") != 0);
}

namespace {

EngineConfig resolve(const Model& model, EngineConfig c) {
  const ModelConfig& m = model.config();
  if (const char* e = std::getenv("TANDEM_SPEC_SAMPLED_ON_DEVICE"); e && std::strcmp(e, "0") == 0) {
    c.spec_sampled_on_device = false;
  }
  c.spec_state_replay = spec_state_replay_on(c);
  if (c.max_model_len <= 0) c.max_model_len = m.max_position_embeddings;
  TANDEM_CHECK_KIND(kInvalidArgument, c.max_model_len > 0, "max_model_len must be positive");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    c.page_size > 0 && c.max_num_seqs > 0 && c.max_batched_tokens > 0,
                    "page_size, max_num_seqs and max_batched_tokens must be positive");
  if (c.num_pages <= 0 && c.kv_cache_mb <= 0) {
    c.kv_cache_mb =
        model.kv_cache_mb_hint() > 0 ? model.kv_cache_mb_hint() : EngineConfig{}.kv_cache_mb;
  }
  // Hybrid models: one recurrent state slot per running sequence plus the prefix cache's
  // state checkpoints, out of the same budget.
  if (model.state_slot_elems() > 0 && c.enable_prefix_cache) {
    TANDEM_CHECK_KIND(kInvalidArgument,
                      c.state_checkpoint_interval > 0 && c.num_state_checkpoints >= 0,
                      "state_checkpoint_interval must be positive");
    c.state_checkpoint_interval =
        (c.state_checkpoint_interval + c.page_size - 1) / c.page_size * c.page_size;
    if (c.num_state_checkpoints == 0) c.num_state_checkpoints = c.max_num_seqs;
  } else {
    c.num_state_checkpoints = 0;
  }
  // (Speculation on a hybrid: one spare slot per sequence, the state before its verify step.)
  const int64_t state_bytes =
      model.state_slot_elems() * static_cast<int64_t>(sizeof(float)) *
      (c.max_num_seqs * (c.num_speculative_tokens > 0 ? 2 : 1) + c.num_state_checkpoints);
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      c.num_speculative_tokens >= 0 && c.num_speculative_tokens <= kMaxSpeculativeTokens,
      "num_speculative_tokens must be in [0, ", kMaxSpeculativeTokens, "], not ",
      c.num_speculative_tokens);
  TANDEM_CHECK_KIND(kInvalidArgument, c.num_speculative_tokens == 0 || model.has_mtp(),
                    "speculative decoding (num_speculative_tokens ", c.num_speculative_tokens,
                    ") needs the model's MTP layer, which is not loaded");
  if (c.num_pages <= 0) {
    int64_t page_bytes = model.kv_geometry(1, c.page_size).page_bytes_all_layers();
    // The MTP layer's KV shares the page ids: a page costs both.
    if (c.num_speculative_tokens > 0) {
      page_bytes += model.mtp_kv_geometry(1, c.page_size).page_bytes_all_layers();
    }
    const int64_t budget = c.kv_cache_mb * (1 << 20);
    TANDEM_CHECK_KIND(kInvalidArgument, state_bytes < budget, "a KV cache of ", c.kv_cache_mb,
                      " MiB cannot hold the recurrent states of max_num_seqs ", c.max_num_seqs,
                      " sequences and ", c.num_state_checkpoints, " prefix-cache checkpoints (",
                      state_bytes, " bytes)");
    c.num_pages = std::max<int64_t>(1, (budget - state_bytes) / page_bytes);
  }
  // The pool must hold at least one sequence of full length, or scheduling could stall.
  int64_t min_pages = (c.max_model_len + c.page_size - 1) / c.page_size;
  TANDEM_CHECK_KIND(kInvalidArgument, c.num_pages >= min_pages, "KV cache of ", c.num_pages,
                    " pages of ", c.page_size, " tokens cannot hold max_model_len ",
                    c.max_model_len);
  return c;
}

void emit(Sequence& s, const StepOutput& out) {
  if (!s.on_output) return;
  try {
    s.on_output(out);
  } catch (...) {
    // A failing consumer must not take the engine down.
  }
}

}  // namespace

Engine::Engine(Model& model, const EngineConfig& config)
    : model_(model),
      config_(resolve(model, config)),
      blocks_(config_.num_pages, config_.page_size, config_.enable_prefix_cache),
      kv_(model.make_kv_cache(config_.num_pages, config_.page_size)),
      scheduler_(blocks_, config_.max_num_seqs, config_.max_batched_tokens,
                 model.state_slot_elems() > 0 ? config_.max_num_seqs : 0) {
  if (speculating()) {
    mtp_kv_ = model.make_mtp_kv_cache(config_.num_pages, config_.page_size);
    counters_.spec_accepted_per_pos.assign(static_cast<size_t>(config_.num_speculative_tokens), 0);
  }
  scheduler_.set_step_time_target(config_.step_time_target_ms / 1000.0, config_.min_prefill_chunk,
                                  config_.step_time_factor);
  if (!config_.step_trace_path.empty()) {
    trace_.reset(std::fopen(config_.step_trace_path.c_str(), "w"));
    TANDEM_CHECK_KIND(kInvalidArgument, trace_ != nullptr, "--step-trace: cannot write ",
                      config_.step_trace_path);
    std::fprintf(trace_.get(),
                 "t_s,decode_rows,decode_context,prefill_tokens,prefill_context,target_ms,"
                 "predicted_ms,measured_ms\n");
    trace_t0_ = std::chrono::steady_clock::now();
  }
  if (model.state_slot_elems() > 0) {
    kv_.allocate_states(
        config_.max_num_seqs * (speculating() ? 2 : 1) + config_.num_state_checkpoints,
        model.state_slot_elems());
    if (config_.num_state_checkpoints > 0) {
      scheduler_.enable_state_checkpoints(static_cast<int32_t>(config_.max_num_seqs),
                                          config_.num_state_checkpoints,
                                          config_.state_checkpoint_interval);
    }
  }
  // (after the state slots: a hybrid's verify graphs capture on them)
  if (config_.warm_up) {
    model.warm_up(kv_, config_.max_num_seqs);
    // Verify steps of K + 1 tokens per sequence (the common case: every draft made) and the
    // chained draft passes.
    if (speculating()) {
      model.warm_up_speculative(kv_, mtp_kv_, config_.max_num_seqs, config_.num_speculative_tokens);
    }
  }
}

void Engine::copy_states(const std::vector<StateCopy>& copies) {
  for (const StateCopy& c : copies) kv_.copy_state(c.src, c.dst);  // host or device slots
}

void Engine::validate(const GenRequest& req) const {
  const int64_t vocab = model_.config().vocab_size;
  const int64_t n = static_cast<int64_t>(req.prompt_ids.size());
  TANDEM_CHECK_KIND(kInvalidArgument, n > 0, "the prompt is empty");
  for (int32_t id : req.prompt_ids) {
    TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < vocab, "prompt token id ", id,
                      " is out of range [0, ", vocab, ")");
  }
  TANDEM_CHECK_KIND(kInvalidArgument, req.max_tokens >= 1, "max_tokens must be at least 1");
  TANDEM_CHECK_KIND(kInvalidArgument, n + req.max_tokens <= config_.max_model_len,
                    "this model's maximum context length is ", config_.max_model_len,
                    " tokens, but the prompt has ", n, " tokens and max_tokens is ", req.max_tokens,
                    " (", n + req.max_tokens, " in total)");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    req.constraint_spec.empty() || req.constraint || config_.constraint_factory,
                    "request '", req.id,
                    "': structured outputs are not available on this instance (no grammar "
                    "engine)");
}

std::shared_ptr<TokenConstraint> Engine::constraint_from_spec(const GenRequest& req) const {
  if (req.constraint_spec.empty()) return nullptr;
  TANDEM_CHECK_KIND(kInvalidArgument, config_.constraint_factory, "request '", req.id,
                    "': structured outputs are not available on this instance (no grammar "
                    "engine)");
  return config_.constraint_factory(req.constraint_spec);
}

void Engine::add(GenRequest req, OutputCallback on_output) {
  validate(req);
  if (!req.constraint) req.constraint = constraint_from_spec(req);
  TANDEM_CHECK_KIND(kOutOfResources, scheduler_.num_waiting() < config_.max_waiting,
                    "the waiting queue is full (", config_.max_waiting, " requests)");
  auto seq = std::make_unique<Sequence>();
  seq->tokens = req.prompt_ids;
  seq->prompt_len = static_cast<int64_t>(req.prompt_ids.size());
  seq->rng.seed(req.sampling.seed ? *req.sampling.seed : std::random_device{}());
  seq->device_seed = req.sampling.seed ? *req.sampling.seed : seq->rng();
  seq->req = std::move(req);
  seq->on_output = std::move(on_output);
  scheduler_.add(std::move(seq));
}

bool Engine::reserve_pages(int64_t num_tokens, std::vector<int32_t>& pages) {
  const int64_t ps = config_.page_size;
  return blocks_.allocate((num_tokens + ps - 1) / ps, pages);
}

void Engine::release_pages(const std::vector<int32_t>& pages) { blocks_.release(pages); }

int32_t Engine::reserve_state_slot() { return scheduler_.reserve_state_slot(); }

void Engine::release_state_slot(int32_t slot) { scheduler_.release_state_slot(slot); }

void Engine::add_prefilled(GenRequest req, OutputCallback on_output, std::vector<int32_t> pages,
                           int32_t first_token, float first_logprob, std::vector<float> state,
                           std::vector<float> prompt_hidden, int64_t prompt_hidden_begin,
                           int32_t state_slot) {
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      state_slot >= 0
          ? state.empty() && model_.state_slot_elems() > 0 && state_slot < kv_.num_state_slots()
          : static_cast<int64_t>(state.size()) == model_.state_slot_elems(),
      "request '", req.id, "': a prefilled request of this model carries ",
      model_.state_slot_elems(), " floats of recurrent state, got ", state.size(),
      state_slot >= 0 ? " beside its state slot " + std::to_string(state_slot) : "");
  validate(req);
  const int64_t n = static_cast<int64_t>(req.prompt_ids.size());
  TANDEM_CHECK_KIND(kInvalidArgument, static_cast<int64_t>(pages.size()) * config_.page_size >= n,
                    "request '", req.id, "': ", pages.size(), " pages cannot hold ", n,
                    " prompt tokens");
  TANDEM_CHECK_KIND(kInvalidArgument, first_token >= 0 && first_token < model_.config().vocab_size,
                    "request '", req.id, "': first token ", first_token, " out of range");
  const int64_t h = model_.config().hidden_size;
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      prompt_hidden.empty() ||
          (static_cast<int64_t>(prompt_hidden.size()) % h == 0 && prompt_hidden_begin >= 0 &&
           prompt_hidden_begin + static_cast<int64_t>(prompt_hidden.size()) / h == n),
      "request '", req.id, "': prompt hidden states of ", prompt_hidden.size(),
      " floats from position ", prompt_hidden_begin, " are not the rows of positions ",
      prompt_hidden_begin, "..", n - 1, " (hidden size ", h, ")");
  if (!req.constraint) req.constraint = constraint_from_spec(req);
  auto seq = std::make_unique<Sequence>();
  seq->tokens = req.prompt_ids;
  seq->prompt_len = n;
  seq->num_computed = n;  // the prompt's KV arrived with the pages
  if (speculating()) {  // the MTP layer runs over the prompt when first scheduled (hold_prefilled)
    seq->prompt_hidden = std::move(prompt_hidden);
    seq->prompt_hidden_begin = prompt_hidden_begin;
  }
  seq->pages = std::move(pages);
  seq->admitted_once = true;
  seq->prompt_logprobs_done = true;
  seq->rng.seed(req.sampling.seed ? *req.sampling.seed : std::random_device{}());
  seq->device_seed = req.sampling.seed ? *req.sampling.seed : seq->rng();
  // NOTE: the prefill instance drew the first token from the same seeded stream (one draw
  // per sampled token), so a seeded request continues exactly as in one engine.
  if (!req.sampling.greedy()) seq->rng.discard(1);
  seq->req = std::move(req);
  seq->on_output = std::move(on_output);
  seq->tokens.push_back(first_token);
  seq->initial_state = std::move(state);
  seq->state_slot = state_slot;  // (-1: one is allocated when it is first scheduled)
  Sequence& s = *seq;
  scheduler_.add(std::move(seq));
  ++counters_.generation_tokens;
  StepOutput out;
  out.id = s.req.id;
  std::string rejected;
  if (s.req.constraint && !s.req.constraint->accept(first_token, rejected)) {
    out.error = rejected;
    finish(s, FinishReason::kError, out);
    return;
  }
  out.token_ids.push_back(first_token);
  if (s.req.sampling.logprobs >= 0) out.token_logprobs.push_back(first_logprob);
  finish_if_done(s, out);
}

void Engine::abort(const std::string& id) {
  Sequence* s = scheduler_.find(id);
  if (!s) return;
  StepOutput out;
  out.id = id;
  finish(*s, FinishReason::kAbort, out);
}

void Engine::abort_all() {
  for (const std::string& id : scheduler_.live_ids()) abort(id);
}

void Engine::finish(Sequence& seq, FinishReason reason, StepOutput& out) {
  out.finished = true;
  out.finish_reason = reason;
  std::unique_ptr<Sequence> owned = scheduler_.remove(seq.req.id);  // pages freed now
  emit(*owned, out);
}

bool Engine::step() {
  if (!scheduler_.has_work()) return false;
  ScheduledBatch batch = schedule();
  if (batch.empty()) {
    if (held_.empty()) return false;
    complete(batch);  // held prefilled sequences (hold_prefilled): the MTP over their prompts
    return true;
  }
  if (forward(batch)) complete(batch);
  return true;
}

ScheduledBatch Engine::schedule() {
  if (!scheduler_.has_work()) return {};
  ScheduledBatch batch = scheduler_.schedule();
  hold_prefilled(batch);
  if (speculating()) {  // the MTP layer's input: on the host unless every draft stays on the device
    bool host = !chains_on_device() || !held_.empty();  // (held prompts' rows: host)
    for (const auto& ss : batch.seqs) host = host || !drafts_on_device(*ss.seq);
    batch.forward.hidden_out = host ? &hidden_ : nullptr;
    if (!host) hidden_.clear();
    // A hybrid's rejected drafts roll back from the verify's own recurrence inputs.
    if (model_.state_slot_elems() > 0 && config_.spec_state_replay) {
      batch.forward.keep_recurrent_inputs = std::any_of(batch.seqs.begin(), batch.seqs.end(),
                                                        [](const auto& ss) { return ss.verify; });
    }
  }
  if (trace_) {
    trace_target_s_ = scheduler_.last_step_target();
    trace_predicted_s_ = scheduler_.cost_model().predict(batch.shape);
  }
  step_start_ = std::chrono::steady_clock::now();
  copy_states(batch.state_restores);   // prefix-cache hits of hybrid models resume here
  for (const auto& ss : batch.seqs) {  // prefilled elsewhere: the state that came with it
    Sequence& s = *ss.seq;
    if (s.initial_state.empty()) continue;
    kv_.write_state(s.state_slot, s.initial_state.data());
    s.initial_state = {};
  }
  return batch;
}

std::span<const float> Engine::sequence_state(const std::string& id) {
  Sequence* s = scheduler_.find(id);
  if (s == nullptr || s->state_slot < 0) return {};
  return kv_.read_state(s->state_slot);
}

bool Engine::device_rows(const ScheduledBatch& batch, std::vector<DeviceSampling>& rows) const {
  rows.clear();
  for (const auto& ss : batch.seqs) {
    const Sequence& s = *ss.seq;
    // Sampled verify rows stay on the device for deterministic drafts (q one-hot: the MTP's
    // argmax on the device, or the test hook's): row j draws its token from the target's p with
    // the draw counter of output position num_output + j, and the draft is accepted while the
    // drawn token equals it. That is the rejection rule for a one-hot q exactly (accept with
    // probability p(d); a rejection's token is distributed as norm(max(0, p - q)), p without
    // d), and every emitted token is the draw that non-speculative device sampling makes at its
    // position: the same tokens for the same seed whatever K. Drafts sampled from q on the
    // host (draft_probs) take the host rule (accept_draft).
    if (speculating() && !s.req.sampling.greedy() &&
        (!config_.spec_sampled_on_device || (ss.verify && !s.draft_probs.empty()))) {
      return false;  // the host path (rejection sampling against q, or the switch is off)
    }
    // A constrained verify row needs one mask per position (the host path); a constrained
    // next-token row takes its MaskWorker mask to the device below.
    if (s.req.constraint && ss.verify) return false;
    if (ss.verify) {
      // Greedy verification: each row's argmax (and the logprobs of the token it gives);
      // forced acceptance (benchmarks) emits drafts the rows did not choose, whose logprobs
      // would need host logits.
      if (config_.spec_forced_accept_prob >= 0.0 && s.req.sampling.logprobs >= 0) return false;
      if (s.num_output() < s.req.min_tokens) return false;
      for (int64_t j = 0; j < ss.num_tokens; ++j) {
        std::optional<DeviceSampling> d = to_device_sampling(
            s.req.sampling, s.device_seed, static_cast<uint64_t>(s.num_output() + j));
        if (!d) return false;
        rows.push_back(*d);
      }
      continue;
    }
    if (ss.logits == LogitsMode::kAll) return false;
    if (ss.logits != LogitsMode::kLast) continue;
    const bool suppress_eos = s.num_output() < s.req.min_tokens;
    // Masks and biases overwrite the logits on the device; logprobs describe the raw ones.
    if ((suppress_eos || s.req.constraint) && s.req.sampling.logprobs >= 0) return false;
    std::optional<DeviceSampling> d =
        to_device_sampling(s.req.sampling, s.device_seed, static_cast<uint64_t>(s.num_output()));
    if (!d) return false;
    if (suppress_eos) {  // EOS and the stop ids as -inf biases (over the request's own)
      const int64_t vocab = model_.config().vocab_size;
      auto suppress = [&](int64_t id) {
        if (id < 0 || id >= vocab) return;
        for (auto& [bid, b] : d->bias) {
          if (bid == id) {
            b = -INFINITY;
            return;
          }
        }
        d->bias.emplace_back(static_cast<int32_t>(id), -INFINITY);
      };
      if (!s.req.ignore_eos)
        for (int64_t id : model_.config().eos_token_ids) suppress(id);
      for (int32_t id : s.req.stop_token_ids) suppress(id);
    }
    if (s.req.constraint) {  // structured outputs: the MaskWorker's mask (forward_sample waits)
      d->mask = &s.mask;
      d->mask_active = &s.mask_active;
    }
    rows.push_back(std::move(*d));
  }
  return true;
}

void Engine::start_masks(const ScheduledBatch& batch) {
  std::vector<MaskWorker::Job> jobs;
  for (const auto& ss : batch.seqs) {
    Sequence& s = *ss.seq;
    s.mask_active = false;
    const bool samples = ss.logits != LogitsMode::kNone &&
                         s.num_computed + ss.num_tokens == static_cast<int64_t>(s.tokens.size());
    if (!s.req.constraint || !samples) continue;
    jobs.push_back({s.req.constraint.get(), &s.mask, &s.mask_active, &s.mask_error});
  }
  if (jobs.empty()) return;
  if (!masks_) masks_ = std::make_unique<MaskWorker>(model_.config().vocab_size);
  masks_->start(std::move(jobs));
}

bool Engine::forward(const ScheduledBatch& batch) {
  start_masks(batch);  // overlaps the model's forward
  try {
    draw_forced_accepts(batch);
    sampled_on_device_ = model_.samples_on_device() && device_rows(batch, device_rows_);
    fused_ = sampled_on_device_ && fused_step(batch);
    snapshot_states(batch);
    if (fused_) {
      forward_fused(batch);
    } else if (sampled_on_device_) {
      model_.forward_sample(batch.forward, kv_, device_rows_, sampled_, [this] {
        if (masks_) masks_->wait();  // this step's token masks (start_masks)
      });
    } else {
      model_.forward(batch.forward, kv_, logits_);
    }
  } catch (const std::exception& e) {
    if (masks_) masks_->wait();  // the worker reads these sequences' constraints
    // Fail only the requests of this step; the engine keeps serving.
    for (const auto& ss : batch.seqs) {
      StepOutput out;
      out.id = ss.seq->req.id;
      out.error = e.what();
      finish(*ss.seq, FinishReason::kError, out);
    }
    // complete() is not called: a collective MTP layer still runs this step's passes (empty),
    // which the peers of a decode EP rank run too.
    pad_mtp_passes(0);
    return false;
  }
  return true;
}

void Engine::complete(const ScheduledBatch& batch) {
  if (batch.empty()) {
    // A decode EP rank's empty step: its peers' MTP passes need its experts; held prefilled
    // sequences (hold_prefilled) run theirs.
    if (held_.empty()) {
      pad_mtp_passes(0);
    } else {
      fused_ = false;  // (no forward ran)
      draft();
    }
    return;
  }
  scheduler_.commit(batch);
  last_state_saves_ = scheduler_.take_state_saves();
  copy_states(last_state_saves_);  // before a finished sequence frees its slot
  process_outputs(batch, logits_);
  if (speculating()) {
    // Drafts first: a device draft chain reads the verify's final hidden states on the device,
    // which a rollback by forward would overwrite (the MTP passes touch no recurrent state).
    draft();
    rollback_states();
  }
  const auto now = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(now - step_start_).count();
  scheduler_.observe_step(batch.shape, seconds);  // the step's time for the step-time model
  if (trace_) {
    const StepShape& sh = batch.shape;
    std::fprintf(trace_.get(), "%.6f,%.0f,%.0f,%.0f,%.0f,%.4f,%.4f,%.4f\n",
                 std::chrono::duration<double>(step_start_ - trace_t0_).count(), sh.decode_rows,
                 sh.decode_context, sh.prefill_tokens, sh.prefill_context, 1e3 * trace_target_s_,
                 1e3 * trace_predicted_s_, 1e3 * seconds);
    std::fflush(trace_.get());  // a server may be killed; a write per step is cheap beside it
  }
}

void Engine::process_outputs(const ScheduledBatch& batch, const std::vector<float>& logits) {
  const int64_t vocab = model_.config().vocab_size;
  const auto& eos = model_.config().eos_token_ids;
  if (masks_) masks_->wait();  // this step's token masks (start_masks)
  int64_t row = 0, token_row = 0;
  for (const auto& ss : batch.seqs) {
    Sequence& s = *ss.seq;
    const int64_t start = s.num_computed - ss.num_tokens;
    const int64_t rows =
        ss.logits == LogitsMode::kAll ? ss.num_tokens : (ss.logits == LogitsMode::kLast ? 1 : 0);
    const int64_t first_row = row;
    row += rows;
    const int64_t hidden_row = token_row;
    token_row += ss.num_tokens;
    counters_.prompt_tokens += std::max<int64_t>(0, std::min(s.num_computed, s.prompt_len) - start);
    if (ss.verify) {
      process_verify(ss, logits, first_row, hidden_row);
      continue;
    }
    // Prompt logprobs: row i predicts the token at position start + i + 1.
    if (ss.logits == LogitsMode::kAll) {
      const int32_t k = s.req.sampling.prompt_logprobs;
      for (int64_t i = 0; i < ss.num_tokens && start + i + 1 < s.prompt_len; ++i) {
        std::span<const float> r(logits.data() + (first_row + i) * vocab,
                                 static_cast<size_t>(vocab));
        int32_t next = s.tokens[static_cast<size_t>(start + i + 1)];
        s.prompt_out.prompt_token_logprobs.push_back(token_logprob(r, next));
        s.prompt_out.prompt_top_logprobs.push_back(top_logprobs(r, k));
      }
      if (s.num_computed >= s.prompt_len) s.prompt_logprobs_done = true;
    }
    if (s.num_computed != static_cast<int64_t>(s.tokens.size())) {  // mid-prefill
      note_computed(s, start, ss.num_tokens, hidden_row);
      continue;
    }

    StepOutput out;
    out.id = s.req.id;
    if (s.num_output() == 0) {
      out.num_cached_prompt_tokens = static_cast<int32_t>(s.num_cached_prompt);
      out.prompt_token_logprobs = std::move(s.prompt_out.prompt_token_logprobs);
      out.prompt_top_logprobs = std::move(s.prompt_out.prompt_top_logprobs);
    }
    if (sampled_on_device_) {  // token and logprobs came from the device
      const SampledToken& st = sampled_[static_cast<size_t>(first_row + rows - 1)];
      if (!s.mask_error.empty()) {  // the mask fill threw: the row was drawn unmasked
        out.error = s.mask_error;
        finish(s, FinishReason::kError, out);
        continue;
      }
      std::string rejected;  // the mask was applied on the device; the constraint advances
      if (s.req.constraint && !s.req.constraint->accept(st.token, rejected)) {
        out.error = rejected;
        finish(s, FinishReason::kError, out);
        continue;
      }
      out.token_ids.push_back(st.token);
      if (s.req.sampling.logprobs >= 0) {
        out.token_logprobs.push_back(st.logprob);
        if (s.req.sampling.logprobs > 0) {
          std::vector<TokenLogprob> top;
          for (const auto& [id, lp] : st.top) top.push_back({id, lp});
          out.top_logprobs.push_back(std::move(top));
        }
      }
      s.tokens.push_back(st.token);
      ++counters_.generation_tokens;
      note_computed(s, start, ss.num_tokens, hidden_row);
      finish_if_done(s, out);
      continue;
    }
    std::span<const float> raw(logits.data() + (first_row + rows - 1) * vocab,
                               static_cast<size_t>(vocab));
    std::span<const float> sample_from = raw;
    std::vector<float> masked;
    if (s.num_output() < s.req.min_tokens) {  // suppress EOS and stop ids
      masked.assign(raw.begin(), raw.end());
      for (int64_t id : eos) {
        if (id >= 0 && id < vocab && !s.req.ignore_eos) masked[static_cast<size_t>(id)] = -INFINITY;
      }
      for (int32_t id : s.req.stop_token_ids) {
        if (id >= 0 && id < vocab) masked[static_cast<size_t>(id)] = -INFINITY;
      }
      sample_from = masked;
    }
    if (!s.mask_error.empty()) {
      out.error = s.mask_error;
      finish(s, FinishReason::kError, out);
      continue;
    }
    if (s.mask_active) {  // the constraint's allowed tokens (structured outputs)
      if (masked.empty()) masked.assign(raw.begin(), raw.end());
      apply_token_bitmask(masked, s.mask);
      sample_from = masked;
    }
    std::span<const int32_t> prompt(s.tokens.data(), static_cast<size_t>(s.prompt_len));
    std::span<const int32_t> output(s.tokens.data() + s.prompt_len,
                                    static_cast<size_t>(s.num_output()));
    const int32_t token = sample_token(sample_from, s.req.sampling, prompt, output, s.rng);
    std::string rejected;
    if (s.req.constraint && !s.req.constraint->accept(token, rejected)) {
      out.error = rejected;
      finish(s, FinishReason::kError, out);
      continue;
    }
    out.token_ids.push_back(token);
    if (s.req.sampling.logprobs >= 0) {
      out.token_logprobs.push_back(token_logprob(raw, token));
      if (s.req.sampling.logprobs > 0)
        out.top_logprobs.push_back(top_logprobs(raw, s.req.sampling.logprobs));
    }
    s.tokens.push_back(token);
    ++counters_.generation_tokens;
    note_computed(s, start, ss.num_tokens, hidden_row);

    finish_if_done(s, out);
  }
}

void Engine::finish_if_done(Sequence& s, StepOutput& out) {
  const FinishReason reason = finish_reason_of(s, out);
  if (reason != FinishReason::kNone) {
    finish(s, reason, out);
  } else {
    emit(s, out);
  }
}

FinishReason Engine::finish_reason_of(const Sequence& s, StepOutput& out) const {
  const int32_t token = s.tokens.back();
  const auto& eos = model_.config().eos_token_ids;
  FinishReason reason = FinishReason::kNone;
  const bool is_eos = !s.req.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end();
  const bool is_stop = std::find(s.req.stop_token_ids.begin(), s.req.stop_token_ids.end(), token) !=
                       s.req.stop_token_ids.end();
  if (is_eos || is_stop) {
    reason = FinishReason::kStop;
    out.stop_token_id = token;
  } else if (s.num_output() >= s.req.max_tokens ||
             static_cast<int64_t>(s.tokens.size()) >= config_.max_model_len) {
    reason = FinishReason::kLength;
  }
  return reason;
}

EngineStats Engine::stats() const {
  EngineStats st = counters_;
  st.running = scheduler_.num_running();
  st.waiting = scheduler_.num_waiting();
  st.kv_pages_total = blocks_.num_pages();
  st.kv_pages_free = blocks_.num_available();
  st.prefix_cache_queries = blocks_.query_tokens();
  st.prefix_cache_hits = blocks_.hit_tokens();
  st.preemptions = scheduler_.preemptions();
  st.queue_time = scheduler_.queue_time();
  st.iteration_tokens = scheduler_.iteration_tokens();
  return st;
}

// ---- MTP speculative decoding ----------------------------------------------------------

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

bool Engine::drafts_on_device(const Sequence& s) const {
  // No row needs host logits (penalties, the min_tokens mask, a token constraint's mask); a
  // sampled request drafts deterministically then (q one-hot at the MTP's argmax), which its
  // verify step accepts on the device (device_rows).
  const SamplingParams& sp = s.req.sampling;
  return model_.samples_on_device() && (sp.greedy() || config_.spec_sampled_on_device) &&
         !sp.needs_host_logits() && s.num_output() >= s.req.min_tokens && !s.req.constraint;
}

void Engine::note_computed(const Sequence& s, int64_t start, int64_t count, int64_t hidden_row) {
  // A constrained request speculates when its constraint can roll back (its drafts are then
  // masked along the draft, and each verified position with the state before it).
  if (!speculating() || !s.req.allow_speculation || count <= 0) return;
  if (s.req.constraint && !s.req.constraint->can_rollback()) return;
  computed_.push_back({s.req.id, start, count, hidden_row});
}

void Engine::process_verify(const ScheduledSeq& ss, const std::vector<float>& logits,
                            int64_t first_row, int64_t hidden_row) {
  Sequence& s = *ss.seq;
  const int64_t vocab = model_.config().vocab_size;
  const auto& eos = model_.config().eos_token_ids;
  const int64_t start = s.num_computed - ss.num_tokens;  // the last token's position
  const int64_t k = ss.num_tokens - 1;                   // drafts
  const std::vector<int32_t> drafts(s.spec_tokens.begin() + 1, s.spec_tokens.end());
  const std::vector<float> q_all = std::move(s.draft_probs);  // [k, vocab] or empty (one-hot)
  s.spec_tokens.clear();
  s.draft_probs.clear();
  ++counters_.spec_num_drafts;
  counters_.spec_num_draft_tokens += k;

  StepOutput out;
  out.id = s.req.id;
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
    if (!sampled_on_device_) {
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
        sampled_on_device_ ? &sampled_[static_cast<size_t>(first_row + j)] : nullptr;
    if (dev != nullptr) {
      token = dev->token;
      if (j < k) {
        const int32_t d = drafts[static_cast<size_t>(j)];
        accepted = s.forced_accepts >= 0 ? j < s.forced_accepts  // benchmarks only
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
      if (s.forced_accepts >= 0) {  // benchmarks only
        accepted = j < s.forced_accepts;
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
    reason = finish_reason_of(s, out);
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
  if (reason != FinishReason::kNone) {
    finish(s, reason, out);
    return;
  }
  if (model_.state_slot_elems() > 0 && emitted < ss.num_tokens) {
    rollbacks_.push_back({s.req.id, start, emitted, hidden_row});
  }
  note_computed(s, start, emitted, hidden_row);
  emit(s, out);
}

void Engine::hold_prefilled(ScheduledBatch& batch) {
  if (!speculating()) return;
  size_t kept = 0;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const ScheduledSeq ss = batch.seqs[i];
    Sequence& s = *ss.seq;
    bool hold = false;
    if (!s.prompt_hidden.empty()) {
      // Its first decode token (not a recomputation after a preemption), with drafts to make:
      // the MTP layer over the prompt this step (its drafts are verified in the next), as the
      // step that computes a prompt does in one engine.
      const int64_t k = draft_limit(s);
      hold = !ss.verify && ss.num_tokens == 1 && s.num_computed == s.prompt_len &&
             static_cast<int64_t>(s.tokens.size()) == s.prompt_len + 1 && k > 0 &&
             s.req.allow_speculation && (!s.req.constraint || s.req.constraint->can_rollback());
      if (hold) {
        const int64_t count = s.prompt_len - s.prompt_hidden_begin;
        held_.push_back({s.req.id, s.prompt_hidden_begin, count, std::move(s.prompt_hidden)});
        StepShape row;  // its decode row leaves the step
        row.add(s.num_computed, 1, true);
        batch.shape.decode_rows -= row.decode_rows;
        batch.shape.decode_context -= row.decode_context;
      }
      s.prompt_hidden = {};
    }
    if (hold) continue;
    batch.seqs[kept] = ss;
    batch.forward.seqs[kept] = batch.forward.seqs[i];
    ++kept;
  }
  batch.seqs.resize(kept);
  batch.forward.seqs.resize(kept);
}

bool Engine::take_host_rows(std::vector<Computed>& computed) {
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

void Engine::snapshot_states(const ScheduledBatch& batch) {
  rollbacks_.clear();
  // (a fused step keeps the state before itself: VerifyDraftStep::spare_slots)
  if (!speculating() || model_.state_slot_elems() <= 0 || fused_) return;
  for (const auto& ss : batch.seqs) {
    if (ss.verify && ss.seq->state_slot >= 0) {
      kv_.copy_state(ss.seq->state_slot, spare_state_slot(ss.seq->state_slot));
    }
  }
}

void Engine::rollback_states() {
  std::vector<Computed> todo = std::move(rollbacks_);
  rollbacks_.clear();
  ForwardBatch fb;
  std::vector<StateReplay> replays;
  for (const Computed& c : todo) {
    Sequence* s = scheduler_.find(c.id);
    if (s == nullptr || s->state_slot < 0) continue;
    if (fused_) {  // rolled back inside the step, to the device's accepted count
      if (s->fused_accepted == c.count - 1) {
        ++state_replays_;
        continue;
      }
      // (the host accepts what the device did unless the step ended the sequence)
      StepOutput out;
      out.id = s->req.id;
      out.error = "internal error: the fused speculative step kept " +
                  std::to_string(s->fused_accepted + 1) + " positions, the engine " +
                  std::to_string(c.count);
      finish(*s, FinishReason::kError, out);
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

int64_t Engine::draft_limit(const Sequence& s) const {
  return std::min(config_.num_speculative_tokens, config_.max_model_len - 1 - s.num_computed);
}

int64_t Engine::draft_budget(Sequence& s, const Computed& c) {
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

void Engine::draft() {
  std::vector<Computed> computed = std::move(computed_);
  computed_.clear();
  if (fused_) {  // the step ran its MTP passes (all K of them: nothing to pad)
    adopt_fused_drafts(computed);
    return;
  }
  const bool host_rows = take_host_rows(computed);  // prefilled prompts' (hold_prefilled)

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
    s->spec_tokens.clear();
    s->draft_probs.clear();
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
  const int64_t passes = on_device && chains_on_device() && !host_rows
                             ? draft_chain_on_device(fb, hidden_rows, drafting, num_drafts)
                             : draft_on_host(fb, hidden_rows, drafting, num_drafts, on_device);
  pad_mtp_passes(passes);
  apply_draft_hook(drafting);
}

void Engine::apply_draft_hook(const std::vector<Sequence*>& drafting) {
  if (!config_.spec_draft_hook) return;  // tests: replaced drafts are deterministic (q one-hot)
  const int64_t vocab = model_.config().vocab_size;
  for (Sequence* s : drafting) {
    std::vector<int32_t> d(s->spec_tokens.begin() + 1, s->spec_tokens.end());
    const size_t k = d.size();
    config_.spec_draft_hook(s->req.id, s->tokens, d);
    d.resize(std::min(d.size(), k));
    for (int32_t& t : d) t = std::clamp<int32_t>(t, 0, static_cast<int32_t>(vocab - 1));
    s->spec_tokens.resize(1);
    s->spec_tokens.insert(s->spec_tokens.end(), d.begin(), d.end());
    if (d.empty()) s->spec_tokens.clear();
    s->draft_probs.clear();
  }
}

// ---- The fused speculative step (Model::forward_verify_draft) --------------------------

void Engine::draw_forced_accepts(const ScheduledBatch& batch) {
  for (const auto& ss : batch.seqs) {
    Sequence& s = *ss.seq;
    s.forced_accepts = -1;
    if (config_.spec_forced_accept_prob < 0.0 || !ss.verify) continue;
    int32_t a = 0;
    while (a < ss.num_tokens - 1 &&
           uniform_draw(forced_accept_rng_) < config_.spec_forced_accept_prob) {
      ++a;
    }
    s.forced_accepts = a;
  }
}

bool Engine::fused_step(const ScheduledBatch& batch) {
  // (held prefilled prompts: their MTP pass over the prompt runs in draft(), not fused)
  // (a hybrid's rejected drafts roll back inside the step by replaying its recurrence inputs)
  // (a collective MTP layer: the step runs pass 0 and K - 1 chained passes, the K exchanges of
  // an unfused or empty step of a peer, so the choice is this rank's alone)
  const bool states = model_.state_slot_elems() > 0;
  if (!speculating() || batch.seqs.empty() || !model_.fuses_verify_and_draft() ||
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
    if (need > 0 && !blocks_.allocate(need, s.pages)) return false;  // (process_verify trims)
  }
  return true;
}

void Engine::forward_fused(const ScheduledBatch& batch) {
  ForwardBatch fb = batch.forward;  // the block tables again: fused_step may have grown them
  VerifyDraftStep step;
  step.num_drafts = config_.num_speculative_tokens;
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    Sequence& s = *batch.seqs[i].seq;
    fb.seqs[i].block_table = s.pages.data();
    fb.seqs[i].num_pages = static_cast<int64_t>(s.pages.size());
    step.forced.push_back(s.forced_accepts);
    const bool verify = batch.seqs[i].verify && s.state_slot >= 0;
    step.spare_slots.push_back(verify ? static_cast<int32_t>(spare_state_slot(s.state_slot)) : -1);
  }
  model_.forward_verify_draft(fb, kv_, device_rows_, mtp_kv_, step, sampled_);
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    Sequence& s = *batch.seqs[i].seq;
    s.fused_drafts = std::move(step.drafts[i]);
    s.fused_accepted = step.accepted[i];
  }
}

void Engine::adopt_fused_drafts(const std::vector<Computed>& computed) {
  std::vector<Sequence*> drafting;
  for (const Computed& c : computed) {
    Sequence* s = scheduler_.find(c.id);
    if (s == nullptr) continue;  // finished this step
    std::vector<int32_t> d = std::move(s->fused_drafts);
    s->fused_drafts.clear();
    s->spec_tokens.clear();
    s->draft_probs.clear();
    // The device accepted what process_verify did unless the step ended the sequence (then it
    // is gone); drafts made after another count would continue other positions: none then.
    if (s->fused_accepted != c.count - 1) continue;
    const int64_t k = std::min(draft_budget(*s, c), static_cast<int64_t>(d.size()));
    if (k <= 0) continue;
    s->spec_tokens.assign(1, s->tokens.back());
    s->spec_tokens.insert(s->spec_tokens.end(), d.begin(), d.begin() + k);
    drafting.push_back(s);
  }
  apply_draft_hook(drafting);
}

int64_t Engine::draft_chain_on_device(const ForwardBatch& fb,
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
    s.spec_tokens.assign(1, s.tokens.back());
    for (int64_t p = 0; p < num_drafts[i]; ++p) {
      s.spec_tokens.push_back(drafts[static_cast<size_t>(p)][i]);
    }
  }
  return 1 + static_cast<int64_t>(chain.size());  // pass 0 and the chained ones
}

int64_t Engine::draft_on_host(const ForwardBatch& fb, const std::vector<int64_t>& hidden_rows,
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
      if (s.spec_tokens.empty()) s.spec_tokens.push_back(s.tokens.back());
      if (on_device) {
        s.spec_tokens.push_back(dev_out[r].token);
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
        out_ctx.insert(out_ctx.end(), s.spec_tokens.begin() + 1, s.spec_tokens.end());
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
      if (!sp.greedy()) s.draft_probs.insert(s.draft_probs.end(), q.begin(), q.end());
      s.spec_tokens.push_back(d);
    }
    // The next pass: the sequences that want another draft.
    std::vector<size_t> next;
    ForwardBatch chain;
    std::vector<float> chain_hidden;
    for (size_t r = 0; r < live.size(); ++r) {
      Sequence& s = *drafting[live[r]];
      if (j + 1 >= num_drafts[live[r]]) continue;
      next.push_back(live[r]);
      chain.seqs.push_back({&s.spec_tokens.back(), 1, s.num_computed + j, s.pages.data(),
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

int64_t Engine::mtp_passes() const {
  return speculating() && model_.mtp_collective() ? config_.num_speculative_tokens : 0;
}

void Engine::pad_mtp_passes(int64_t done) {
  const int64_t want = mtp_passes();
  TANDEM_CHECK(want == 0 || done <= want, "draft(): ", done, " MTP passes in a step of ", want);
  if (done >= want) return;
  ForwardBatch none;
  std::vector<float> logits, hout;
  for (; done < want; ++done) model_.mtp_forward(none, nullptr, mtp_kv_, logits, hout);
}

// ---------------------------------------------------------------------------------------

std::vector<int32_t> AsyncEngine::eos_token_ids() const {
  std::vector<int32_t> ids;
  for (int64_t id : model_->config().eos_token_ids) ids.push_back(static_cast<int32_t>(id));
  return ids;
}

AsyncEngine::AsyncEngine(std::unique_ptr<Model> model, const EngineConfig& config)
    : model_(std::move(model)), engine_(*model_, config) {
  last_stats_ = engine_.stats();
  thread_ = std::thread([this] { loop(); });
}

AsyncEngine::~AsyncEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void AsyncEngine::submit(GenRequest request, OutputCallback on_output) {
  engine_.validate(request);  // const, reads immutable state only
  {
    std::lock_guard<std::mutex> lock(mu_);
    // NOTE: the engine's waiting count is the last published one; close enough here.
    TANDEM_CHECK_KIND(kOutOfResources,
                      pending_ + last_stats_.waiting < engine_.config().max_waiting,
                      "the waiting queue is full (", engine_.config().max_waiting, " requests)");
    incoming_.emplace_back(std::move(request), std::move(on_output));
    ++pending_;
  }
  cv_.notify_one();
}

void AsyncEngine::abort(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.push_back(id);
  }
  cv_.notify_one();
}

EngineStats AsyncEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats st = last_stats_;
  st.waiting += pending_;
  return st;
}

void AsyncEngine::loop() {
  for (;;) {
    std::deque<std::pair<GenRequest, OutputCallback>> incoming;
    std::vector<std::string> aborts;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return stop_ || !incoming_.empty() || !aborts_.empty() || engine_.has_work();
      });
      if (stop_) break;
      incoming.swap(incoming_);
      aborts.swap(aborts_);
    }
    for (auto& [req, cb] : incoming) {
      std::string id = req.id;
      try {
        engine_.add(std::move(req), cb);
      } catch (const std::exception& e) {
        StepOutput out;
        out.id = id;
        out.finished = true;
        out.finish_reason = FinishReason::kError;
        out.error = e.what();
        if (cb) cb(out);
      }
    }
    for (const auto& id : aborts) engine_.abort(id);
    engine_.step();
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_ -= static_cast<int64_t>(incoming.size());
      last_stats_ = engine_.stats();
    }
  }
  // Shutting down: every live request still gets its finished callback.
  for (auto& [req, cb] : incoming_) {
    StepOutput out;
    out.id = req.id;
    out.finished = true;
    out.finish_reason = FinishReason::kAbort;
    if (cb) cb(out);
  }
  engine_.abort_all();
}

}  // namespace tandem
