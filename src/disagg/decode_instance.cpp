#include "disagg/decode_instance.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "comm/local_comm.h"
#include "core/error.h"
#include "disagg/lockstep.h"

namespace tandem {

int64_t DecodeLoad::min_batch() const {
  return batch_per_rank.empty() ? 0
                                : *std::min_element(batch_per_rank.begin(), batch_per_rank.end());
}

int64_t DecodeLoad::total_batch() const {
  return std::accumulate(batch_per_rank.begin(), batch_per_rank.end(), int64_t{0});
}

// One rank: its communicator, model, engine, KV receiver, and what it produced since its last
// report.
struct DecodeInstance::Rank {
  int index = 0;  // the group rank
  std::unique_ptr<comm::Communicator> comm;
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<transfer::TransferReceiver> receiver;
  std::thread thread;
  std::mutex mu;         // engine, reserved
  int64_t reserved = 0;  // accepted, not admitted yet
  std::atomic<int64_t> batch{0};
  std::atomic<int64_t> free_pages{0};
  // NOTE: its own lock: the engine's callbacks (under mu) and the receiver's write here.
  std::mutex out_mu;
  DecodeReport report;
  // Hybrid models: recurrent states that came with completed transfers, until the admission
  // (or release) of their request. Guarded by out_mu (the receiver's thread writes).
  std::map<std::string, std::vector<float>> states;
  // MTP speculative decoding: the prompts' final hidden states that came with completed
  // transfers (the engine runs its MTP layer over them at admission). Guarded by out_mu.
  std::map<std::string, transfer::PromptHidden> hidden;
  // Hybrid models over a device transfer: the state slot reserved for each accepted request
  // (the transfer writes the prompt's state there), until its admission hands it to the
  // sequence or its release gives it back. Guarded by mu.
  std::map<std::string, int32_t> state_slots;

  EngineStats stats;  // the engine's counters as of the last load_locked() (for the report)

  int64_t load_locked() {
    stats = engine->stats();
    free_pages = stats.kv_pages_free;
    return stats.running + stats.waiting + reserved;
  }
};

namespace {

constexpr uint32_t kReportTag = 0x7D0001;

void finish_with(const OutputCallback& cb, const std::string& id, FinishReason reason,
                 const std::string& error) {
  if (!cb) return;
  StepOutput out;
  out.id = id;
  out.finished = true;
  out.finish_reason = reason;
  out.error = error;
  try {
    cb(out);
  } catch (...) {
  }
}

}  // namespace

DecodeInstance::DecodeInstance(DecodeInstanceConfig config) : config_(std::move(config)) {
  TANDEM_CHECK_KIND(kInvalidArgument, config_.dp >= 1, "--dp must be at least 1");
  TANDEM_CHECK_KIND(kInvalidArgument, config_.max_decode_batch >= 1,
                    "--max-decode-batch must be at least 1");
  config_.engine.max_num_seqs = std::max(config_.engine.max_num_seqs, config_.max_decode_batch);
  if (!config_.model) config_.model = cpu_model_factory(config_.model_dir);
  // The ranks as threads: a thread-local communicator group runs the same loop as processes.
  auto comms = comm::LocalCommunicator::create_group(config_.dp);
  for (int r = 0; r < config_.dp; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = r;
    rank->comm = std::move(comms[static_cast<size_t>(r)]);
    // NOTE: loaded one after another: a model factory whose sharded load is collective (the
    // CUDA model) needs one process per rank.
    rank->model = config_.model(ShardSpec::decode(r, config_.dp), rank->comm.get());
    load_mtp(*rank->model);
    rank->engine = std::make_unique<Engine>(*rank->model, config_.engine);
    ranks_.push_back(std::move(rank));
  }
  batch_.assign(static_cast<size_t>(config_.dp), 0);
  free_pages_.assign(static_cast<size_t>(config_.dp), 0);
  reported_stats_.assign(static_cast<size_t>(config_.dp), EngineStats{});
  init_receivers();
  running_ranks_ = config_.dp;
  for (auto& rank : ranks_) rank->thread = std::thread([this, r = rank.get()] { rank_main(*r); });
}

DecodeInstance::DecodeInstance(DecodeInstanceConfig config,
                               std::unique_ptr<comm::Communicator> comm)
    : config_(std::move(config)) {
  TANDEM_CHECK_KIND(kInvalidArgument, comm->world_size() == config_.dp, "--dp ", config_.dp,
                    " differs from the group's ", comm->world_size(), " ranks (WORLD_SIZE)");
  TANDEM_CHECK_KIND(kInvalidArgument, config_.max_decode_batch >= 1,
                    "--max-decode-batch must be at least 1");
  config_.engine.max_num_seqs = std::max(config_.engine.max_num_seqs, config_.max_decode_batch);
  if (!config_.model) config_.model = cpu_model_factory(config_.model_dir);
  first_rank_ = comm->rank();
  auto rank = std::make_unique<Rank>();
  rank->index = first_rank_;
  rank->comm = std::move(comm);
  rank->model = config_.model(ShardSpec::decode(first_rank_, config_.dp), rank->comm.get());
  load_mtp(*rank->model);
  rank->engine = std::make_unique<Engine>(*rank->model, config_.engine);
  ranks_.push_back(std::move(rank));
  batch_.assign(static_cast<size_t>(config_.dp), 0);
  free_pages_.assign(static_cast<size_t>(config_.dp), 0);
  reported_stats_.assign(static_cast<size_t>(config_.dp), EngineStats{});
  init_receivers();
  running_ranks_ = 1;
  ranks_[0]->thread = std::thread([this] { rank_main(*ranks_[0]); });
}

void DecodeInstance::load_mtp(Model& model) const {
  if (config_.mtp_dir.empty()) return;
  // A hybrid's rejected drafts roll back by Model::replay_states, rank-local (a rollback by
  // forward would be a collective only the ranks with a rejection run).
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      config_.dp == 1 || model.state_slot_elems() == 0 || config_.engine.spec_state_replay,
      "MTP speculative decoding of a hybrid model (model_type '", model.config().model_type,
      "') with --dp ", config_.dp,
      " needs the state replay (EngineConfig::spec_state_replay is off)");
  model.load_mtp(config_.mtp_dir);
}

void DecodeInstance::init_receivers() {
  // Each rank's transfer receiver writes into that rank's cache; its events go into the
  // rank's next report.
  transfer_ = config_.transfer
                  ? config_.transfer
                  : host_transfer_backend({config_.kv_host, config_.transfer_timeout, nullptr});
  for (auto& rank : ranks_) {
    transfer::ReceiverCallbacks cbs;
    Rank* r = rank.get();
    cbs.on_state = [r](const std::string& id, std::vector<float> state) {
      std::lock_guard<std::mutex> lock(r->out_mu);
      r->states[id] = std::move(state);
    };
    cbs.on_hidden = [r](const std::string& id, transfer::PromptHidden hidden) {
      std::lock_guard<std::mutex> lock(r->out_mu);
      r->hidden[id] = std::move(hidden);
    };
    cbs.on_complete = [r](const std::string& id, int32_t, float) {
      std::lock_guard<std::mutex> lock(r->out_mu);
      r->report.kv_events.push_back({id, true, ""});
    };
    cbs.on_error = [r](const std::string& id, const std::string& message) {
      std::lock_guard<std::mutex> lock(r->out_mu);
      r->report.kv_events.push_back({id, false, message});
    };
    rank->receiver = transfer_->make_receiver(rank->engine->kv_cache(), cbs);
  }
}

void DecodeInstance::wait() {
  std::unique_lock<std::mutex> lock(done_mu_);
  done_cv_.wait(lock, [&] { return running_ranks_ == 0; });
}

// ---- Every rank's loop. ----

void DecodeInstance::rank_main(Rank& rank) {
  try {
    rank_loop(rank);
  } catch (const std::exception& e) {
    // A rank failed (or a peer did): the group is broken, so is the instance.
    dead_ = true;
    stop_ = true;
    if (auto* local = dynamic_cast<comm::LocalCommunicator*>(rank.comm.get())) local->abort_group();
    { std::lock_guard<std::mutex> lock(leader_mu_); }
    res_cv_.notify_all();
    if (rank.index == 0) fail_all(std::string("the decode instance failed: ") + e.what());
  }
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    --running_ranks_;
  }
  done_cv_.notify_all();
}

void DecodeInstance::rank_loop(Rank& rank) {
  comm::Communicator& comm = *rank.comm;
  Engine& engine = *rank.engine;
  const bool leader = rank.index == 0;
  for (;;) {
    // 1. Rank 0's commands (the client calls since the last iteration), to every rank.
    std::vector<uint8_t> msg;
    if (leader) msg = take_commands();
    broadcast_bytes(comm, msg, 0);
    const DecodeCommands cmds = decode_decode_commands(msg);
    if (cmds.stop) return;
    apply_commands(rank, cmds.cmds);
    // 2. Every rank steps when any has work (an empty batch still serves its experts).
    bool mine;
    {
      std::lock_guard<std::mutex> lock(rank.mu);
      mine = engine.has_work();
    }
    const bool work = agree_any(comm, mine);
    {
      std::lock_guard<std::mutex> lock(rank.mu);
      if (work) {
        ScheduledBatch batch = engine.schedule();
        if (engine.forward(batch)) engine.complete(batch);
      }
      rank.batch = rank.load_locked();
    }
    // 3. What each rank produced, to rank 0.
    std::vector<uint8_t> report = take_report(rank);
    if (leader) {
      handle_report(0, report);
      for (int r = 1; r < config_.dp; ++r) handle_report(r, comm.recv_blob(r, kReportTag));
      std::lock_guard<std::mutex> lock(leader_mu_);
      idle_ = !work;
    } else {
      comm.send_blob(report, 0, kReportTag);
    }
  }
}

std::vector<uint8_t> DecodeInstance::take_commands() {
  std::unique_lock<std::mutex> lock(leader_mu_);
  if (idle_ && cmds_.empty() && !stop_) {
    // Idle: wait for a command, but send a heartbeat now and then (the other ranks wait in
    // the broadcast, which has a timeout; and they report transfer completions).
    cmd_cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stop_ || !cmds_.empty(); });
  }
  DecodeCommands c;
  c.stop = stop_;
  c.cmds.swap(cmds_);
  return encode_decode_commands(c);
}

void DecodeInstance::queue(DecodeCommand c) {
  {
    std::lock_guard<std::mutex> lock(leader_mu_);
    cmds_.push_back(std::move(c));
  }
  cmd_cv_.notify_all();
}

void DecodeInstance::apply_commands(Rank& rank, const std::vector<DecodeCommand>& cmds) {
  Engine& engine = *rank.engine;
  for (const DecodeCommand& c : cmds) {
    if (c.rank != rank.index) continue;  // another rank's
    if (c.kind == DecodeCommand::kReserve) {
      DecodeReport::Reservation res;
      res.id = c.id;
      std::vector<int32_t> pages;
      int32_t slot = -1;  // a device transfer's state slot
      {
        std::lock_guard<std::mutex> lock(rank.mu);
        res.ok = rank.load_locked() < config_.max_decode_batch &&
                 engine.reserve_pages(c.num_tokens, pages);
        if (res.ok && transfer_->carries_device_state() && rank.model->state_slot_elems() > 0) {
          slot = engine.reserve_state_slot();
          if (slot < 0) {
            engine.release_pages(pages);
            res.ok = false;
          } else {
            rank.state_slots[c.id] = slot;
          }
        }
        if (res.ok) ++rank.reserved;
      }
      if (res.ok) {
        res.d = descriptor(rank, rank.receiver->address(), c.id, c.num_tokens, c.src, pages,
                           c.speculate);
        res.d.dst_state_slot = slot;
        try {
          rank.receiver->expect(res.d);  // before the descriptor leaves
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(rank.mu);
          engine.release_pages(pages);
          if (slot >= 0) {
            engine.release_state_slot(slot);
            rank.state_slots.erase(c.id);
          }
          --rank.reserved;
          res.ok = false;
          res.error = e.what();
        }
      }
      std::lock_guard<std::mutex> lock(rank.out_mu);
      rank.report.reserved.push_back(std::move(res));
    } else if (c.kind == DecodeCommand::kAdmit) {
      Rank* r = &rank;
      OutputCallback cb = [r](const StepOutput& out) {
        std::lock_guard<std::mutex> lock(r->out_mu);
        r->report.outputs.push_back(out);
      };
      std::vector<float> state;       // hybrid models: from the transfer
      transfer::PromptHidden hidden;  // a speculating instance: from the transfer
      {
        std::lock_guard<std::mutex> lock(rank.out_mu);
        auto it = rank.states.find(c.id);
        if (it != rank.states.end()) {
          state = std::move(it->second);
          rank.states.erase(it);
        }
        auto h = rank.hidden.find(c.id);
        if (h != rank.hidden.end()) {
          hidden = std::move(h->second);
          rank.hidden.erase(h);
        }
      }
      std::lock_guard<std::mutex> lock(rank.mu);
      --rank.reserved;
      int32_t slot = -1;  // filled by a device transfer: the sequence runs in it
      if (auto s = rank.state_slots.find(c.id); s != rank.state_slots.end()) {
        slot = s->second;
        rank.state_slots.erase(s);
      }
      try {
        engine.add_prefilled(c.req, cb, c.pages, c.token, c.logprob, std::move(state),
                             std::move(hidden.rows), hidden.begin, slot);
      } catch (const std::exception& ex) {
        engine.release_pages(c.pages);
        if (slot >= 0) engine.release_state_slot(slot);
        finish_with(cb, c.id, FinishReason::kError, ex.what());
      }
    } else if (c.kind == DecodeCommand::kRelease) {
      // NOTE: once cancel returns, the receiver writes no more into the pages.
      if (c.cancel) rank.receiver->cancel(c.id);
      {
        std::lock_guard<std::mutex> lock(rank.out_mu);
        rank.states.erase(c.id);
        rank.hidden.erase(c.id);
      }
      std::lock_guard<std::mutex> lock(rank.mu);
      --rank.reserved;
      engine.release_pages(c.pages);
      if (auto s = rank.state_slots.find(c.id); s != rank.state_slots.end()) {
        engine.release_state_slot(s->second);
        rank.state_slots.erase(s);
      }
    } else {
      std::lock_guard<std::mutex> lock(rank.mu);
      engine.abort(c.id);
    }
  }
}

std::vector<uint8_t> DecodeInstance::take_report(Rank& rank) {
  DecodeReport rep;
  {
    std::lock_guard<std::mutex> lock(rank.out_mu);
    std::swap(rep, rank.report);
  }
  rep.batch = rank.batch.load();
  rep.free_pages = rank.free_pages.load();
  rep.stats = rank.stats;  // (written by this thread only, in load_locked)
  return encode_decode_report(rep);
}

void DecodeInstance::handle_report(int r, const std::vector<uint8_t>& bytes) {
  DecodeReport rep = decode_decode_report(bytes);
  {
    std::lock_guard<std::mutex> lock(leader_mu_);
    batch_[static_cast<size_t>(r)] = rep.batch;
    free_pages_[static_cast<size_t>(r)] = rep.free_pages;
    reported_stats_[static_cast<size_t>(r)] = std::move(rep.stats);
    for (auto& res : rep.reserved) {
      auto it = reservations_.find(res.id);
      if (it == reservations_.end()) continue;
      it->second->r = std::move(res);
      it->second->done = true;
    }
  }
  res_cv_.notify_all();
  for (const auto& e : rep.kv_events) {
    if (e.ok) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = pending_.find(e.id);
      if (it == pending_.end()) continue;
      it->second.kv_done = true;
      admit_if_ready(e.id);
    } else {
      end_pending(e.id, FinishReason::kError, "KV transfer failed: " + e.error,
                  /*cancel_transfer=*/false);
    }
  }
  for (const StepOutput& out : rep.outputs) {
    OutputCallback cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = callbacks_.find(out.id);
      if (it == callbacks_.end()) continue;
      cb = it->second;
      if (out.finished) callbacks_.erase(it);
    }
    if (cb) cb(out);
  }
}

transfer::TransferDescriptor DecodeInstance::descriptor(Rank& rank, const std::string& address,
                                                        const std::string& id, int64_t num_tokens,
                                                        const transfer::KvSharding& src,
                                                        const std::vector<int32_t>& pages,
                                                        bool speculate) const {
  const ModelConfig& mc = rank.model->config();
  transfer::TransferDescriptor d;
  d.request_id = id;
  d.dst_address = address;
  d.dst_pages = pages;
  d.dst_heads = {0, mc.num_key_value_heads};  // DP: every rank holds every head
  d.src = src;
  d.num_tokens = num_tokens;
  d.page_size = rank.engine->config().page_size;
  d.head_dim = mc.head_dim;
  // The KV cache's layers (a hybrid model's attention layers only), and its recurrent state.
  d.num_layers = rank.engine->kv_cache().geometry().num_layers;
  d.state_elems = rank.model->state_slot_elems();
  // A speculating engine runs its MTP layer over the prompt at admission (Engine::add_prefilled)
  // when the backend carries the prompt's hidden states; else its MTP KV of the prompt is zeros.
  // A request that opted out of speculation asks for none.
  if (speculate && rank.engine->config().num_speculative_tokens > 0 &&
      transfer_->carries_prompt_hidden()) {
    d.hidden_size = mc.hidden_size;
  }
  return d;
}

void DecodeInstance::release(int r, const std::string& id, std::vector<int32_t> pages,
                             bool cancel) {
  DecodeCommand c;
  c.kind = DecodeCommand::kRelease;
  c.rank = r;
  c.id = id;
  c.pages = std::move(pages);
  c.cancel = cancel;
  queue(std::move(c));
}

// ---- Shutdown and failure. ----

void DecodeInstance::stop_ranks() {
  stop_ = true;
  { std::lock_guard<std::mutex> lock(leader_mu_); }
  cmd_cv_.notify_all();
  res_cv_.notify_all();
  for (auto& rank : ranks_) {
    if (rank->thread.joinable()) rank->thread.join();
  }
}

void DecodeInstance::fail_all(const std::string& why) {
  std::unordered_map<std::string, Pending> pending;
  std::unordered_map<std::string, OutputCallback> cbs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(pending_);
    cbs.swap(callbacks_);
  }
  const FinishReason reason = why.empty() ? FinishReason::kAbort : FinishReason::kError;
  for (auto& [id, p] : pending) finish_with(p.on_output, id, reason, why);
  for (auto& [id, cb] : cbs) finish_with(cb, id, reason, why);
}

DecodeInstance::~DecodeInstance() {
  stop_ranks();
  for (auto& rank : ranks_) rank->receiver.reset();
  if (!dead_ && is_leader()) fail_all("");  // every live request gets its finished callback
  for (auto& rank : ranks_) {
    std::lock_guard<std::mutex> lock(rank->mu);
    rank->engine->abort_all();  // (their outputs went to rank 0 above)
  }
}

void DecodeInstance::kill() {
  dead_ = true;
  stop_ranks();
  for (auto& rank : ranks_) rank->receiver.reset();  // the transfers in flight fail at senders
}

// ---- Admission (rank 0). ----

OutputCallback DecodeInstance::guard(OutputCallback cb, const std::string& id) {
  // Drops callbacks after kill() (a crashed process says nothing) and forgets finished ids.
  return [this, cb = std::move(cb), id](const StepOutput& out) {
    if (dead_) return;
    if (out.finished) {
      std::lock_guard<std::mutex> lock(mu_);
      running_ids_.erase(id);
    }
    if (cb) cb(out);
  };
}

std::optional<transfer::TransferDescriptor> DecodeInstance::accept(const GenRequest& req,
                                                                   const transfer::KvSharding& src,
                                                                   OutputCallback on_output) {
  TANDEM_CHECK(is_leader(), "accept() on a decode rank other than 0");
  TANDEM_CHECK_KIND(kOutOfResources, !dead_ && !stop_, "the decode instance is down");
  ranks_[0]->engine->validate(req);
  // A constrained request: its spec is compiled here once (a bad one is refused now, and the
  // ranks of this process find the grammar in the factory's cache when they admit it; a rank
  // process of its own compiles it at admission).
  (void)ranks_[0]->engine->constraint_from_spec(req);
  {
    std::lock_guard<std::mutex> lock(mu_);
    TANDEM_CHECK_KIND(kInvalidArgument, !pending_.count(req.id) && !running_ids_.count(req.id),
                      "duplicate request id '", req.id, "'");
  }
  // The least-loaded ranks first (as last reported); the first with room and pages takes it.
  std::vector<std::pair<int64_t, int>> order;
  {
    std::lock_guard<std::mutex> lock(leader_mu_);
    for (int r = 0; r < config_.dp; ++r) order.push_back({batch_[static_cast<size_t>(r)], r});
  }
  std::sort(order.begin(), order.end());
  for (const auto& [unused, r] : order) {
    auto res = std::make_shared<Reservation>();
    {
      std::unique_lock<std::mutex> lock(leader_mu_);
      reservations_[req.id] = res;
      DecodeCommand c;
      c.kind = DecodeCommand::kReserve;
      c.rank = r;
      c.id = req.id;
      c.num_tokens = static_cast<int64_t>(req.prompt_ids.size());
      c.src = src;
      c.speculate = req.allow_speculation;
      cmds_.push_back(std::move(c));
      cmd_cv_.notify_all();
      res_cv_.wait(lock, [&] { return res->done || dead_ || stop_; });
      reservations_.erase(req.id);
    }
    TANDEM_CHECK_KIND(kOutOfResources, res->done, "the decode instance is down");
    if (!res->r.error.empty()) TANDEM_THROW(kInternal, res->r.error);
    if (!res->r.ok) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Pending p;
      p.req = req;
      p.req.constraint = nullptr;  // the rank builds its own from the spec (its grammar state)
      p.on_output = std::move(on_output);
      p.rank = r;
      p.pages = res->r.d.dst_pages;
      pending_.emplace(req.id, std::move(p));
    }
    res->r.d.src = src;
    return res->r.d;
  }
  return std::nullopt;
}

void DecodeInstance::prefilled(const std::string& id, const StepOutput& first) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;
  it->second.first = first;
  it->second.has_first = true;
  admit_if_ready(id);
}

void DecodeInstance::admit_if_ready(const std::string& id) {
  auto it = pending_.find(id);
  if (it == pending_.end() || !it->second.kv_done || !it->second.has_first) return;
  Pending p = std::move(it->second);
  pending_.erase(it);
  running_ids_[p.req.id] = p.rank;
  // The prefill's first output carries what the engine cannot recompute here: the first
  // token's top logprobs and the prompt logprobs. Merge them into the first callback.
  auto first = std::make_shared<StepOutput>(std::move(p.first));
  OutputCallback inner = guard(std::move(p.on_output), p.req.id);
  callbacks_[p.req.id] = [first, inner](const StepOutput& out) {  // (under mu_)
    if (first->id.empty()) return inner(out);
    StepOutput merged = out;
    merged.top_logprobs = std::move(first->top_logprobs);
    merged.prompt_token_logprobs = std::move(first->prompt_token_logprobs);
    merged.prompt_top_logprobs = std::move(first->prompt_top_logprobs);
    merged.num_cached_prompt_tokens = first->num_cached_prompt_tokens;
    first->id.clear();
    inner(merged);
  };
  DecodeCommand c;
  c.kind = DecodeCommand::kAdmit;
  c.rank = p.rank;
  c.id = p.req.id;
  c.req = std::move(p.req);
  c.pages = std::move(p.pages);
  c.token = first->token_ids.empty() ? -1 : first->token_ids[0];
  c.logprob = first->token_logprobs.empty() ? 0.f : first->token_logprobs[0];
  queue(std::move(c));
}

void DecodeInstance::end_pending(const std::string& id, FinishReason reason,
                                 const std::string& error, bool cancel_transfer) {
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    p = std::move(it->second);
    pending_.erase(it);
  }
  release(p.rank, id, std::move(p.pages), cancel_transfer);
  if (!dead_) finish_with(p.on_output, id, reason, error);
}

void DecodeInstance::fail(const std::string& id, const std::string& error) {
  end_pending(id, FinishReason::kError, error);
}

void DecodeInstance::abort(const std::string& id) {
  int rank = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_.count(id) == 0) {
      auto it = running_ids_.find(id);
      if (it == running_ids_.end()) return;
      rank = it->second;
    }
  }
  if (rank < 0) return end_pending(id, FinishReason::kAbort, "");
  DecodeCommand c;
  c.kind = DecodeCommand::kAbort;
  c.rank = rank;
  c.id = id;
  queue(std::move(c));
}

DecodeLoad DecodeInstance::load() const {
  DecodeLoad l;
  {
    std::lock_guard<std::mutex> lock(leader_mu_);
    l.batch_per_rank = batch_;
    l.kv_pages_free_per_rank = free_pages_;
  }
  l.max_decode_batch = config_.max_decode_batch;
  l.alive = !dead_ && !stop_;
  return l;
}

int64_t DecodeInstance::max_model_len() const { return ranks_[0]->engine->max_model_len(); }
int64_t DecodeInstance::vocab_size() const { return ranks_[0]->model->config().vocab_size; }

EngineStats DecodeInstance::stats() const {
  // This process's ranks live; the others (ranks as processes) as their last report says.
  EngineStats sum;
  std::vector<bool> local(static_cast<size_t>(config_.dp), false);
  for (const auto& r : ranks_) {
    std::lock_guard<std::mutex> lock(r->mu);
    sum.add(r->engine->stats());
    local[static_cast<size_t>(r->index)] = true;
  }
  std::lock_guard<std::mutex> lock(leader_mu_);
  for (size_t r = 0; r < reported_stats_.size(); ++r) {
    if (!local[r]) sum.add(reported_stats_[r]);
  }
  return sum;
}

}  // namespace tandem
