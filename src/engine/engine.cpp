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

namespace {

EngineConfig resolve(const Model& model, EngineConfig c) {
  const ModelConfig& m = model.config();
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
  } else {
    c.num_state_checkpoints = -1;  // none (0 below)
  }
  // (Speculation on a hybrid: one spare slot per sequence, the state before its verify step.)
  const int64_t slot_bytes = model.state_slot_elems() * static_cast<int64_t>(sizeof(float));
  const int64_t live_bytes = slot_bytes * c.max_num_seqs * (c.num_speculative_tokens > 0 ? 2 : 1);
  if (c.num_state_checkpoints == 0) {
    // Not given: max_num_seqs, or when the KV cache is sized from its budget, at most what a
    // quarter of the budget left after the live states holds (a large hybrid's state is tens of
    // MB: 256 checkpoints of Qwen3.5-35B-A3B would take 16 GB from the KV pages).
    c.num_state_checkpoints = c.max_num_seqs;
    const int64_t budget = c.kv_cache_mb * (int64_t{1} << 20);
    if (c.num_pages <= 0 && slot_bytes > 0 && live_bytes < budget) {
      c.num_state_checkpoints =
          std::clamp<int64_t>((budget - live_bytes) / 4 / slot_bytes, 1, c.max_num_seqs);
    }
  }
  c.num_state_checkpoints = std::max<int64_t>(c.num_state_checkpoints, 0);
  const int64_t state_bytes = live_bytes + slot_bytes * c.num_state_checkpoints;
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
                      state_bytes, " bytes): lower --max-num-seqs or give the cache more memory");
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
  blocks_.events().enable(config_.kv_events != nullptr && config_.enable_prefix_cache);
  if (config_.num_speculative_tokens > 0) {
    SpecEngineHooks hooks;
    hooks.stop_reason = [this](const Sequence& s, StepOutput& out) {
      return finish_reason_of(s, out);
    };
    hooks.finish = [this](Sequence& s, FinishReason r, StepOutput& out) { finish(s, r, out); };
    spec_ = std::make_unique<SpecDecoder>(model_, config_, blocks_, kv_, scheduler_, counters_,
                                          std::move(hooks));
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
    kv_.allocate_states(config_.max_num_seqs * (spec_ ? 2 : 1) + config_.num_state_checkpoints,
                        model.state_slot_elems());
    if (config_.num_state_checkpoints > 0) {
      scheduler_.enable_state_checkpoints(static_cast<int32_t>(config_.max_num_seqs),
                                          config_.num_state_checkpoints,
                                          config_.state_checkpoint_interval);
    }
  }
  // (after the state slots: a hybrid's verify graphs capture on them)
  if (config_.on_startup_phase) config_.on_startup_phase("graphs");
  if (config_.warm_up) {
    model.warm_up(kv_, config_.max_num_seqs);
    if (spec_) spec_->warm_up();  // verify steps of K + 1 tokens, the chained draft passes
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
  if (spec_) spec_->add_prefilled(*seq, std::move(prompt_hidden), prompt_hidden_begin);
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
    if (!spec_ || !spec_->has_held_prompts()) return false;
    complete(batch);  // held prefilled sequences: the MTP layer over their prompts
    return true;
  }
  if (forward(batch)) complete(batch);
  return true;
}

ScheduledBatch Engine::schedule() {
  flush_kv_events();  // (releases since the last step: aborts, finished transfers)
  if (!scheduler_.has_work()) return {};
  ScheduledBatch batch = scheduler_.schedule();
  if (spec_) spec_->prepare(batch);  // held prefilled prompts out; the hidden states it drafts from
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
    // Speculating: the decoder's rule for sampled rows, and a verify chunk's rows.
    if (spec_ && !spec_->device_rows(ss, rows)) return false;
    if (ss.verify) continue;
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
    sampled_on_device_ = model_.samples_on_device() && device_rows(batch, device_rows_);
    // Speculating: the decoder runs a fused step (verify and next drafts in one model call)
    // itself, or snapshots the hybrid states its verify may roll back.
    if (spec_ && spec_->forward(batch, sampled_on_device_ ? &device_rows_ : nullptr, sampled_)) {
      return true;
    }
    if (sampled_on_device_) {
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
    if (spec_) spec_->abort_step();
    return false;
  }
  return true;
}

void Engine::complete(const ScheduledBatch& batch) {
  if (batch.empty()) {
    // A decode EP rank's empty step: its peers' MTP passes need its experts; held prefilled
    // sequences run theirs.
    if (spec_) spec_->finish_step();
    return;
  }
  scheduler_.commit(batch);
  last_state_saves_ = scheduler_.take_state_saves();
  copy_states(last_state_saves_);  // before a finished sequence frees its slot
  process_outputs(batch, logits_);
  if (spec_) spec_->finish_step();  // the next drafts; hybrid states of rejected drafts back
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
  flush_kv_events();
}

void Engine::flush_kv_events() {
  if (config_.kv_events && !blocks_.events().empty())
    config_.kv_events->publish(blocks_.events().take());
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
    if (ss.verify) {  // speculating: the drafts accepted, the target's next token
      StepOutput out;
      out.id = s.req.id;
      const FinishReason r = spec_->accept(ss, logits, sampled_on_device_ ? &sampled_ : nullptr,
                                           first_row, hidden_row, out);
      r != FinishReason::kNone ? finish(s, r, out) : emit(s, out);
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
      if (spec_) spec_->note_computed(s, start, ss.num_tokens, hidden_row);
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
      if (spec_) spec_->note_computed(s, start, ss.num_tokens, hidden_row);
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
    if (spec_) spec_->note_computed(s, start, ss.num_tokens, hidden_row);

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
