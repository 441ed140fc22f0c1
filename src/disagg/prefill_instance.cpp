#include "disagg/prefill_instance.h"

#include <algorithm>
#include <chrono>

#include "comm/local_comm.h"
#include "core/error.h"
#include "disagg/lockstep.h"
#include "model/hybrid_state.h"

namespace tandem {

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
constexpr double kRateWindowS = 10.0;
}  // namespace

struct PrefillInstance::Rank {
  int index = 0;  // the group rank
  std::unique_ptr<Model> model;
  std::unique_ptr<KvCache> own_kv;  // ranks > 0 (rank 0 uses its engine's cache)
  KvCache* kv = nullptr;
  std::unique_ptr<transfer::TransferSender> sender;
  std::vector<float> logits;
  std::vector<float> hidden;  // rank 0: the step's final hidden states when a job wants them
};

struct PrefillInstance::Job {
  std::string id;
  transfer::TransferDescriptor dst;
  PrefillDone on_done;
  int64_t prompt_len = 0;
  int64_t computed = 0;  // prompt tokens computed (for the queued-token count)
  bool begun = false;    // the transfer began (after the last chunk)
  bool failed = false;   // a rank could not begin the transfer
  bool ended = false;
  std::vector<float> state;  // hybrid models: the recurrent state after the prompt
  // The decode side speculates (dst.hidden_size > 0): the prompt's final hidden states of the
  // positions computed here, gathered chunk by chunk (rank 0's: identical on every rank).
  transfer::PromptHidden hidden;
  std::vector<int32_t> prompt;  // (the same: PromptHiddenCache's pages)
};

namespace {
// Appends a chunk's hidden rows (positions [start, start + count)) to a job's, which cover
// [hidden.begin, ...) without gaps; a recomputed chunk (preemption) overwrites from its start.
void add_hidden_rows(transfer::PromptHidden& hidden, int64_t hidden_size, int64_t start,
                     int64_t count, const float* rows) {
  const auto have = static_cast<int64_t>(hidden.rows.size()) / hidden_size;
  if (hidden.rows.empty() || start < hidden.begin || start > hidden.begin + have) {
    hidden.begin = start;
    hidden.rows.clear();
  }
  hidden.rows.resize(static_cast<size_t>((start - hidden.begin) * hidden_size));
  hidden.rows.insert(hidden.rows.end(), rows, rows + count * hidden_size);
}
}  // namespace

PrefillInstance::PrefillInstance(PrefillInstanceConfig config) : config_(std::move(config)) {
  TANDEM_CHECK_KIND(kInvalidArgument, config_.tp >= 1, "--tp must be at least 1");
  for (auto& c : comm::LocalCommunicator::create_group(config_.tp)) comms_.push_back(std::move(c));
  init_ranks(0, config_.tp);
}

PrefillInstance::PrefillInstance(PrefillInstanceConfig config,
                                 std::unique_ptr<comm::Communicator> comm)
    : config_(std::move(config)) {
  TANDEM_CHECK_KIND(kInvalidArgument, comm->world_size() == config_.tp, "--tp ", config_.tp,
                    " differs from the group's ", comm->world_size(), " ranks (WORLD_SIZE)");
  const int rank = comm->rank();
  comms_.push_back(std::move(comm));
  init_ranks(rank, 1);
}

void PrefillInstance::init_ranks(int first_rank, int count) {
  first_rank_ = first_rank;
  if (!config_.model) config_.model = cpu_model_factory(config_.model_dir);
  for (int i = 0; i < count; ++i) {
    auto rank = std::make_unique<Rank>();
    rank->model = config_.model(ShardSpec::prefill(first_rank + i, config_.tp),
                                comms_[static_cast<size_t>(i)].get());
    ranks_.push_back(std::move(rank));
  }
  const ModelConfig& mc = ranks_[0]->model->config();
  sharding_ = {mc.num_key_value_heads, config_.tp};
  // Hybrid models: each rank holds its value heads' part of every DeltaNet state
  // (model/hybrid_state.h), merged on rank 0 after a prompt's last chunk (gather_states).
  hybrid_ = ranks_[0]->model->state_slot_elems() > 0;
  if (hybrid_ && config_.tp > 1) {
    for (int i = 0; i < count; ++i) {
      const int r = first_rank + i;
      const int64_t want =
          HybridStateLayout::of(mc, DeltaNetHeads::of(mc, ShardSpec::prefill(r, config_.tp)))
              .slot_elems();
      const int64_t have = ranks_[static_cast<size_t>(i)]->model->state_slot_elems();
      TANDEM_CHECK_KIND(kUnsupported, have == want, "prefill --tp ", config_.tp, ": rank ", r,
                        "'s model keeps ", have,
                        " floats of recurrent state per sequence, not its DeltaNet heads' ", want,
                        " (model/hybrid_state.h)");
    }
  }
  int64_t sizes[2] = {0, 0};  // rank 0's pages and state slots: every rank mirrors its ids
  if (is_leader()) {
    engine_ = std::make_unique<Engine>(*ranks_[0]->model, config_.engine);
    ranks_[0]->kv = &engine_->kv_cache();
    sizes[0] = engine_->config().num_pages;
    sizes[1] = engine_->kv_cache().num_state_slots();
    note_pools();
  }
  if (count < config_.tp) {
    // One process per rank: rank 0's sizes, for the caches of the others (collective).
    comms_[0]->broadcast(sizes, 2, DType::kI64, 0);
  }
  const int64_t num_pages = sizes[0], num_state_slots = sizes[1];
  transfer_ = config_.transfer ? config_.transfer : host_transfer_backend({});
  for (int i = 0; i < count; ++i) {
    Rank& rank = *ranks_[static_cast<size_t>(i)];
    if (!rank.kv) {
      // NOTE: same page count as rank 0: every rank writes the pages rank 0 allocated.
      rank.own_kv =
          std::make_unique<KvCache>(rank.model->make_kv_cache(num_pages, config_.engine.page_size));
      // NOTE: as many state slots as rank 0's engine (running sequences, prefix-cache
      // checkpoints, spares), each of this rank's heads; the step names the slot of each
      // sequence and the checkpoint copies, so no allocator runs here (nothing to leak).
      if (hybrid_) rank.own_kv->allocate_states(num_state_slots, rank.model->state_slot_elems());
      rank.kv = rank.own_kv.get();
    }
    transfer::SenderCallbacks cbs;
    cbs.on_sent = [](const std::string&) {};
    rank.index = first_rank + i;
    // The decode side sees the same failure and ends the request there.
    cbs.on_error = [this, r = rank.index](const std::string& id, const std::string&) {
      note_transfer_error(id, r);
    };
    rank.sender = transfer_->make_sender(*rank.kv, sharding_, first_rank + i, cbs);
  }
  for (int i = 0; i < count; ++i) threads_.emplace_back([this, i] { rank_main(i); });
}

void PrefillInstance::wait() {
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

int PrefillInstance::num_senders() const {
  return static_cast<int>(transfer::senders_for(sharding_, {0, sharding_.num_kv_heads}).size());
}

PrefillInstance::~PrefillInstance() {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    stop_ = true;
  }
  inbox_cv_.notify_all();
  wait();
  // Whatever is left fails (the decode side releases its pages).
  for (auto& [id, job] : jobs_) {
    if (job->ended) continue;
    job->ended = true;
    if (job->on_done) job->on_done("the prefill instance is shutting down", StepOutput{});
  }
  for (auto& [req, job] : submitted_) {
    if (job->on_done) job->on_done("the prefill instance is shutting down", StepOutput{});
  }
  if (engine_) engine_->abort_all();
  for (auto& rank : ranks_) rank->sender.reset();
}

void PrefillInstance::rank_main(int i) {
  comm::Communicator& comm = *comms_[static_cast<size_t>(i)];
  const bool leader = first_rank_ + i == 0;
  try {
    if (leader) {
      leader_loop(comm);
    } else {
      follower_loop(*ranks_[static_cast<size_t>(i)], comm);
    }
  } catch (const std::exception& e) {
    dead_ = true;
    stop_ = true;
    if (auto* local = dynamic_cast<comm::LocalCommunicator*>(&comm)) local->abort_group();
    if (!leader) return;
    std::vector<std::string> ids;
    for (const auto& [id, job] : jobs_) ids.push_back(id);
    for (const auto& id : ids) {
      end_job(id, std::string("the prefill instance failed: ") + e.what(), StepOutput{});
    }
  }
}

// ---- The loops: rank 0 schedules and samples, every rank forwards and sends its KV. ----

void PrefillInstance::leader_loop(comm::Communicator& comm) {
  Rank& rank = *ranks_[0];
  for (;;) {
    const bool stop = take_inbox();
    ScheduledBatch batch = stop ? ScheduledBatch{} : engine_->schedule();
    std::vector<uint8_t> msg = encode_prefill_step(make_step(batch, stop));
    broadcast_bytes(comm, msg, 0);  // 1. the step, to every rank
    const PrefillStep step = decode_prefill_step(msg);
    // NOTE: step.ends are for the other ranks: rank 0 ended those transfers in end_job (ending
    // one twice fails at the sender, which would count as a transfer error).
    note_pools();  // (after the inbox's aborts and the admissions)
    if (stop) return;
    if (batch.empty()) continue;                                // (an idle heartbeat)
    std::vector<int64_t> failed = begin_transfers(rank, step);  // 2. prompts ending now
    for (const PrefillStep::Seq& s : step.seqs) {
      if (s.last) jobs_.at(s.id)->begun = true;  // (whatever happens next ends the transfer)
    }
    batch.forward.on_layer_kv = [&](int64_t l) { send_layer(rank, step, l, failed); };
    // The prompts whose decode instance speculates: their final hidden states (after the final
    // norm the ranks' residual streams are identical: attention and MoE outputs all-reduced,
    // so rank 0's are every rank's).
    bool want_hidden = false;
    for (const PrefillStep::Seq& s : step.seqs) {
      auto it = jobs_.find(s.id);
      want_hidden = want_hidden || (it != jobs_.end() && it->second->dst.hidden_size > 0);
    }
    batch.forward.hidden_out = want_hidden ? &rank.hidden : nullptr;
    const bool ok = engine_->forward(batch);  // 3. TP attention + EP MoE (KV out per layer)
    comm.all_reduce_sum(failed.data(), static_cast<int64_t>(failed.size()), DType::kI64);
    if (ok && config_.tp == 1) send_device_states(rank, step, failed);
    const int64_t hs = rank.model->config().hidden_size;
    int64_t row = 0;  // the sequence's first token in the batch (hidden_out rows)
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      const auto count = static_cast<int64_t>(step.seqs[i].tokens.size());
      row += count;
      auto it = jobs_.find(step.seqs[i].id);
      if (it == jobs_.end()) continue;
      Job& job = *it->second;
      if (ok && job.dst.hidden_size > 0) {
        add_hidden_rows(job.hidden, hs, step.seqs[i].start, count,
                        rank.hidden.data() + (row - count) * hs);
      }
      job.failed = job.failed || failed[i] > 0;
      const int64_t now =
          std::min(job.computed + static_cast<int64_t>(step.seqs[i].tokens.size()), job.prompt_len);
      count_computed(now - job.computed);
      job.computed = now;
    }
    // Hybrid models: the recurrent state of every prompt that ended now, merged from the
    // ranks' heads (the sequence frees its slot when complete() finishes it after token 1).
    std::vector<std::vector<float>> states = gather_states(rank, comm, step, failed, ok);
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      auto it = jobs_.find(step.seqs[i].id);
      if (it == jobs_.end()) continue;
      if (failed[i] > 0) it->second->failed = true;  // (a refused device state copy)
      if (ok && !states[i].empty()) it->second->state = std::move(states[i]);
    }
    if (ok) {
      engine_->complete(batch);  // 4. sample token 1: the transfers can finish
      const std::vector<StateCopy>& saves = engine_->last_state_saves();
      if (config_.tp > 1) saves_.insert(saves_.end(), saves.begin(), saves.end());
    }
    {
      const EngineStats st = engine_->stats();
      std::lock_guard<std::mutex> lock(stats_mu_);
      queue_time_ = st.queue_time;
      iteration_tokens_ = st.iteration_tokens;
    }
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      if (failed[i] > 0) engine_->abort(step.seqs[i].id);  // ends it as failed (no-op if done)
    }
    note_pools();
  }
}

void PrefillInstance::follower_loop(Rank& rank, comm::Communicator& comm) {
  for (;;) {
    std::vector<uint8_t> msg;
    broadcast_bytes(comm, msg, 0);
    const PrefillStep step = decode_prefill_step(msg);
    end_transfers(rank, step);
    if (step.stop) return;
    // Rank 0's prefix-cache state copies, in its order (its engine made them around its
    // schedule() and complete()).
    for (const auto* copies : {&step.state_saves, &step.state_restores}) {
      for (const StateCopy& c : *copies) rank.kv->copy_state(c.src, c.dst);
    }
    if (step.seqs.empty()) continue;
    std::vector<int64_t> failed = begin_transfers(rank, step);
    ForwardBatch batch = step.forward();
    batch.on_layer_kv = [&](int64_t l) { send_layer(rank, step, l, failed); };
    rank.model->forward(batch, *rank.kv, rank.logits);
    comm.all_reduce_sum(failed.data(), static_cast<int64_t>(failed.size()), DType::kI64);
    gather_states(rank, comm, step, failed, true);
  }
}

std::vector<std::vector<float>> PrefillInstance::gather_states(Rank& rank, comm::Communicator& comm,
                                                               const PrefillStep& step,
                                                               std::vector<int64_t>& failed,
                                                               bool ok) {
  std::vector<std::vector<float>> states(step.seqs.size());
  // (a failed forward at TP 1: nothing to send, nobody waiting for the parts)
  if (!hybrid_ || (!ok && config_.tp == 1)) return states;
  // NOTE: every rank takes the same sequences (failed[] is all-reduced), whether or not rank
  // 0's forward succeeded (the other ranks cannot know): the collective calls agree.
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const PrefillStep::Seq& s = step.seqs[i];
    if (!s.last || failed[i] > 0 || s.state_slot < 0) continue;
    if (config_.tp == 1) {
      auto it = jobs_.find(s.id);  // (a device state slot: send_device_states copied it)
      if (it != jobs_.end() && it->second->dst.dst_state_slot >= 0) continue;
    }
    // TP > 1 into a device state slot: merged on the devices, rank 0 copies the whole state
    // from its device (the other ranks' gather_state below takes part in the same collective).
    if (config_.tp > 1 && rank.index == 0) {
      auto it = jobs_.find(s.id);
      if (it != jobs_.end() && it->second->dst.dst_state_slot >= 0) {
        const float* whole = rank.model->gather_state_device(*rank.kv, s.state_slot);
        try {
          TANDEM_CHECK_KIND(kUnsupported, whole != nullptr, "request '", s.id,
                            "': the model does not merge its ranks' state parts on the device");
          if (ok) {
            rank.sender->send_state_from(
                s.id, whole, HybridStateLayout::full(rank.model->config()).slot_elems());
          }
        } catch (const std::exception&) {
          note_transfer_error(s.id, rank.index);
          failed[i] = 1;
        }
        continue;
      }
    }
    // A model that merges the parts itself (a GPU model, on the devices) does; otherwise they
    // meet on rank 0 through the group's communicator.
    if (config_.tp > 1 && rank.model->gather_state(*rank.kv, s.state_slot, 0, states[i])) continue;
    const std::span<const float> part = rank.kv->read_state(s.state_slot);
    if (config_.tp == 1) {
      states[i].assign(part.begin(), part.end());
    } else {
      states[i] = gather_hybrid_state(comm, rank.model->config(), part, 0);
    }
  }
  return states;
}

void PrefillInstance::send_device_states(Rank& rank, const PrefillStep& step,
                                         std::vector<int64_t>& failed) {
  if (!hybrid_) return;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const PrefillStep::Seq& s = step.seqs[i];
    if (!s.last || failed[i] > 0 || s.state_slot < 0) continue;
    auto it = jobs_.find(s.id);
    if (it == jobs_.end() || it->second->dst.dst_state_slot < 0) continue;
    try {
      rank.sender->send_state(s.id, s.state_slot);  // (ordered after the forward's writes)
    } catch (const std::exception&) {
      note_transfer_error(s.id, rank.index);
      failed[i] = 1;
    }
  }
}

void PrefillInstance::note_pools() {
  const EngineStats st = engine_->stats();
  PrefillPools p;
  p.kv_pages_free = st.kv_pages_free;
  p.kv_pages_total = st.kv_pages_total;
  p.state_slots_free = hybrid_ ? engine_->num_free_state_slots() : 0;
  p.state_slots_total = hybrid_ ? engine_->config().max_num_seqs : 0;
  p.preemptions = st.preemptions;
  p.prefix_cache_hits = st.prefix_cache_hits;
  std::lock_guard<std::mutex> lock(stats_mu_);
  pools_ = p;
}

void PrefillInstance::note_transfer_error(const std::string& id, int rank) {
  // NOTE: a sender may report one failed transfer twice (callback and a throwing finish).
  std::lock_guard<std::mutex> lock(errors_mu_);
  if (failed_transfers_.insert({id, rank}).second) ++transfer_errors_;
}

void PrefillInstance::end_transfers(Rank& rank, const PrefillStep& step) {
  for (const TransferEnd& e : step.ends) {
    try {
      if (e.ok) {
        rank.sender->finish(e.id, e.token, e.logprob);
      } else {
        rank.sender->abort(e.id);
      }
    } catch (const std::exception&) {
      note_transfer_error(e.id, rank.index);  // (the decode side times out and ends it)
    }
  }
}

std::vector<int64_t> PrefillInstance::begin_transfers(Rank& rank, const PrefillStep& step) {
  std::vector<int64_t> failed(step.seqs.size(), 0);
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    const PrefillStep::Seq& s = step.seqs[i];
    if (!s.last) continue;
    try {
      // NOTE: the block table already covers the whole prompt (the scheduler allocated this
      // chunk's pages), as begin() wants.
      rank.sender->begin(s.id, {s.dst}, s.table);
    } catch (const std::exception&) {
      failed[i] = 1;
    }
  }
  return failed;
}

void PrefillInstance::send_layer(Rank& rank, const PrefillStep& step, int64_t layer,
                                 std::vector<int64_t>& failed) {
  // Every prompt that ends in this step at once (a device backend: one copy launch).
  std::vector<std::string> ids;
  std::vector<size_t> seq_of;
  for (size_t i = 0; i < step.seqs.size(); ++i) {
    if (!step.seqs[i].last || failed[i] > 0) continue;
    ids.push_back(step.seqs[i].id);
    seq_of.push_back(i);
  }
  if (ids.empty()) return;
  for (size_t k : rank.sender->send_layers(ids, layer)) {
    failed[seq_of[k]] = 1;
    rank.sender->abort(ids[k]);
  }
}

bool PrefillInstance::take_inbox() {
  std::deque<std::pair<GenRequest, std::shared_ptr<Job>>> submitted;
  std::vector<std::string> aborts;
  {
    std::unique_lock<std::mutex> lock(inbox_mu_);
    // Idle: wait for work, but broadcast a heartbeat now and then (the other ranks wait in
    // the broadcast, which has a timeout).
    if (!engine_->has_work() && ends_.empty()) {
      inbox_cv_.wait_for(lock, std::chrono::milliseconds(100),
                         [&] { return stop_ || !submitted_.empty() || !aborts_.empty(); });
    }
    if (stop_) return true;
    submitted.swap(submitted_);
    aborts.swap(aborts_);
  }
  for (auto& [req, job] : submitted) {
    jobs_[job->id] = job;
    GenRequest first_only = std::move(req);
    first_only.max_tokens = 1;  // the decode instance generates the rest
    try {
      engine_->add(std::move(first_only),
                   [this, job = job](const StepOutput& out) { on_output(*job, out); });
    } catch (const std::exception& e) {
      end_job(job->id, e.what(), StepOutput{});
    }
  }
  for (const auto& id : aborts) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;
    it->second->on_done = nullptr;  // aborted by the router: nothing to report
    engine_->abort(id);
    end_job(id, "aborted", StepOutput{});
  }
  return false;
}

PrefillStep PrefillInstance::make_step(const ScheduledBatch& batch, bool stop) {
  PrefillStep st;
  st.stop = stop;
  st.ends.swap(ends_);
  for (const ScheduledSeq& ss : batch.seqs) {
    const Sequence& seq = *ss.seq;
    const int64_t start = seq.num_computed, end = start + ss.num_tokens;
    PrefillStep::Seq s;
    s.id = seq.req.id;
    s.tokens.assign(seq.tokens.begin() + start, seq.tokens.begin() + end);
    s.table = seq.pages;
    s.start = start;
    s.logits = ss.logits;
    s.last = end >= seq.prompt_len;
    if (s.last) s.dst = jobs_.at(seq.req.id)->dst;
    s.state_slot = seq.state_slot;
    st.seqs.push_back(std::move(s));
  }
  if (config_.tp > 1) {
    st.state_saves.swap(saves_);
    st.state_restores = batch.state_restores;
  }
  return st;
}

// ---- Rank 0's request bookkeeping. ----

void PrefillInstance::on_output(Job& job, const StepOutput& out) {
  if (!out.finished || job.ended) return;
  std::string error;
  if (out.finish_reason == FinishReason::kError) {
    error = out.error.empty() ? "prefill failed" : out.error;
  } else if (job.failed) {
    error = "the KV transfer to " + job.dst.dst_address + " could not start";
  } else if (out.finish_reason == FinishReason::kAbort) {
    error = "prefill aborted";
  }
  end_job(job.id, error, out);
}

void PrefillInstance::complete_hidden(Job& job) {
  if (config_.hidden_cache_mb <= 0 || job.hidden.empty()) return;
  if (!hidden_cache_) {
    hidden_cache_ = std::make_unique<PromptHiddenCache>(
        engine_->config().page_size, job.dst.hidden_size, config_.hidden_cache_mb << 20);
  }
  hidden_cache_->complete(job.prompt, job.hidden);
}

void PrefillInstance::end_job(const std::string& id, const std::string& error,
                              const StepOutput& first) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  std::shared_ptr<Job> job = it->second;
  jobs_.erase(it);
  if (job->ended) return;
  job->ended = true;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    queued_tokens_ -= job->prompt_len - job->computed;
  }
  // Every rank ends its part of the transfer: with token 1, or by aborting it.
  TransferEnd e;
  e.id = id;
  e.ok = error.empty() && job->begun && !first.token_ids.empty();
  if (e.ok) {
    e.token = first.token_ids[0];
    e.logprob = first.token_logprobs.empty() ? 0.f : first.token_logprobs[0];
  }
  if (job->begun) {
    try {
      if (e.ok) {
        if (job->dst.hidden_size > 0) complete_hidden(*job);
        ranks_[0]->sender->finish_with(id, e.token, e.logprob,
                                       {std::move(job->state), std::move(job->hidden)});
      } else {
        ranks_[0]->sender->abort(id);
      }
    } catch (const std::exception&) {
      note_transfer_error(id, ranks_[0]->index);
    }
    if (config_.tp > 1) ends_.push_back(e);  // the other ranks finish in the next step
  }
  if (job->on_done) job->on_done(e.ok ? "" : (error.empty() ? "prefill failed" : error), first);
}

void PrefillInstance::count_computed(int64_t tokens) {
  std::lock_guard<std::mutex> lock(stats_mu_);
  queued_tokens_ -= tokens;
  computed_total_ += tokens;
  rate_window_.push_back({now_s(), tokens});
}

// ---- The client side (any thread). ----

void PrefillInstance::submit(const GenRequest& req, transfer::TransferDescriptor dst,
                             PrefillDone on_done) {
  TANDEM_CHECK(is_leader(), "submit() on a prefill rank other than 0");
  TANDEM_CHECK_KIND(kOutOfResources, !dead_ && !stop_, "the prefill instance is down");
  GenRequest first_only = req;
  first_only.max_tokens = 1;
  engine_->validate(first_only);
  const int64_t n = static_cast<int64_t>(req.prompt_ids.size());
  dst.request_id = req.id;
  dst.src = sharding_;
  dst.validate();
  TANDEM_CHECK_KIND(kInvalidArgument, dst.num_tokens == n, "request '", req.id,
                    "': the destination expects ", dst.num_tokens, " tokens, the prompt has ", n);
  const int64_t hs = ranks_[0]->model->config().hidden_size;
  TANDEM_CHECK_KIND(
      kUnsupported,
      dst.dst_state_slot < 0 || config_.tp == 1 || ranks_[0]->model->gathers_state_on_device(),
      "request '", req.id,
      "': the decode side reserved a device state slot, and this prefill model "
      "over --tp ",
      config_.tp,
      " merges its ranks' state parts on the host (device-to-device state "
      "transfer needs --tp 1 or a model that gathers them on the device)");
  TANDEM_CHECK_KIND(kInvalidArgument, dst.hidden_size == 0 || dst.hidden_size == hs, "request '",
                    req.id, "': the destination asks for hidden states of size ", dst.hidden_size,
                    ", this model's hidden size is ", hs);
  GenRequest queued = req;
  // A constrained request (token 1 samples here): its grammar compiled now, off the step loop.
  if (!req.constraint_spec.empty()) queued.constraint = engine_->constraint_from_spec(req);
  auto job = std::make_shared<Job>();
  job->id = req.id;
  job->dst = std::move(dst);
  job->on_done = std::move(on_done);
  job->prompt_len = n;
  if (job->dst.hidden_size > 0) job->prompt = req.prompt_ids;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    queued_tokens_ += n;
  }
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    submitted_.emplace_back(std::move(queued), std::move(job));
  }
  inbox_cv_.notify_one();
}

void PrefillInstance::abort(const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);
    aborts_.push_back(id);
  }
  inbox_cv_.notify_one();
}

PrefillLoad PrefillInstance::load() const {
  PrefillLoad l;
  l.alive = !dead_ && !stop_;
  std::lock_guard<std::mutex> lock(stats_mu_);
  l.queued_input_tokens = queued_tokens_;
  l.input_tokens_total = computed_total_;
  l.queue_time = queue_time_;
  l.iteration_tokens = iteration_tokens_;
  // Tokens computed over the last kRateWindowS seconds.
  const double since = now_s() - kRateWindowS;
  while (!rate_window_.empty() && rate_window_.front().first < since) rate_window_.pop_front();
  int64_t recent = 0;
  for (const auto& [t, n] : rate_window_) recent += n;
  l.input_tokens_per_s = static_cast<double>(recent) / kRateWindowS;
  return l;
}

}  // namespace tandem
