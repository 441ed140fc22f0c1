#include "engine/decode_instance.h"

#include <algorithm>
#include <numeric>

#include "comm/local_comm.h"
#include "core/error.h"
#include "engine/lockstep.h"

namespace tandem {

int64_t DecodeLoad::min_batch() const {
  return batch_per_rank.empty() ? 0
                                : *std::min_element(batch_per_rank.begin(), batch_per_rank.end());
}

int64_t DecodeLoad::total_batch() const {
  return std::accumulate(batch_per_rank.begin(), batch_per_rank.end(), int64_t{0});
}

struct DecodeInstance::Rank {
  std::unique_ptr<Model> model;
  std::unique_ptr<Engine> engine;
  std::mutex mu;  // engine, reserved
  // NOTE: the inbox has its own lock: a callback running inside a step (under mu) may post.
  std::mutex inbox_mu;
  std::deque<std::function<void(Engine&)>> inbox;
  int64_t reserved = 0;  // accepted, not admitted yet
  std::atomic<int64_t> batch{0};
  std::atomic<int64_t> free_pages{0};

  int64_t load_locked() {
    EngineStats st = engine->stats();
    free_pages = st.kv_pages_free;
    return st.running + st.waiting + reserved;
  }
};

// One process per rank: rank 0's command queue and registry of running callbacks, and this
// process's report (what its rank produced since the last iteration).
struct DecodeInstance::Group {
  struct Reservation {  // an accept() waiting for its rank's answer
    bool done = false;
    DecodeReport::Reservation r;
  };
  std::unique_ptr<comm::Communicator> comm;
  std::thread thread;
  std::mutex done_mu;
  std::condition_variable done_cv;
  bool finished = false;

  // Rank 0 (mu): the next iteration's commands, waiting accept() calls, per-rank load.
  std::mutex mu;
  std::condition_variable cmd_cv;  // a command was queued
  std::condition_variable res_cv;  // a reservation was answered
  std::vector<DecodeCommand> cmds;
  std::unordered_map<std::string, std::shared_ptr<Reservation>> reservations;
  std::vector<int64_t> batch;
  std::vector<int64_t> free_pages;  // per rank, from the reports
  bool idle = false;                // the last iteration stepped no rank
  // Rank 0 (DecodeInstance::mu_): running requests' callbacks.
  std::unordered_map<std::string, OutputCallback> callbacks;

  // This rank (out_mu): what goes into the next report.
  std::mutex out_mu;
  DecodeReport report;
};

namespace {
constexpr uint32_t kReportTag = 0x7D0001;
}  // namespace

namespace {
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
  for (auto& c : comm::LocalCommunicator::create_group(config_.dp)) comms_.push_back(std::move(c));
  if (!config_.model) config_.model = cpu_model_factory(config_.model_dir);
  for (int r = 0; r < config_.dp; ++r) {
    auto rank = std::make_unique<Rank>();
    // NOTE: the ranks are threads here, loaded one after another: a model factory whose
    // sharded load is collective (the CUDA model) needs one process per rank.
    rank->model =
        config_.model(ShardSpec::decode(r, config_.dp), comms_[static_cast<size_t>(r)].get());
    rank->engine = std::make_unique<Engine>(*rank->model, config_.engine);
    ranks_.push_back(std::move(rank));
  }
  init_receivers();
  for (int r = 0; r < config_.dp; ++r) {
    threads_.emplace_back([this, r] { rank_main(r, *comms_[static_cast<size_t>(r)]); });
  }
}

DecodeInstance::DecodeInstance(DecodeInstanceConfig config,
                               std::unique_ptr<comm::Communicator> comm)
    : config_(std::move(config)) {
  TANDEM_CHECK_KIND(kInvalidArgument, comm->world_size() == config_.dp, "--dp ", config_.dp,
                    " differs from the group's ", comm->world_size(), " ranks (WORLD_SIZE)");
  TANDEM_CHECK_KIND(kInvalidArgument, config_.max_decode_batch >= 1,
                    "--max-decode-batch must be at least 1");
  config_.engine.max_num_seqs = std::max(config_.engine.max_num_seqs, config_.max_decode_batch);
  first_rank_ = comm->rank();
  group_ = std::make_unique<Group>();
  group_->comm = std::move(comm);
  group_->batch.assign(static_cast<size_t>(config_.dp), 0);
  group_->free_pages.assign(static_cast<size_t>(config_.dp), 0);
  if (!config_.model) config_.model = cpu_model_factory(config_.model_dir);
  auto rank = std::make_unique<Rank>();
  rank->model = config_.model(ShardSpec::decode(first_rank_, config_.dp), group_->comm.get());
  rank->engine = std::make_unique<Engine>(*rank->model, config_.engine);
  ranks_.push_back(std::move(rank));
  init_receivers();
  group_->thread = std::thread([this] { group_main(); });
}

void DecodeInstance::wait() {
  if (group_) {
    std::unique_lock<std::mutex> lock(group_->done_mu);
    group_->done_cv.wait(lock, [&] { return group_->finished; });
    return;
  }
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
}

// ---- One process per rank: the loop every process runs. ----

void DecodeInstance::group_main() {
  try {
    group_loop(*group_->comm);
  } catch (const std::exception& e) {
    // A rank failed (or a peer did): the group is broken, so is the instance.
    dead_ = true;
    stop_ = true;
    { std::lock_guard<std::mutex> lock(group_->mu); }
    group_->res_cv.notify_all();
    if (first_rank_ == 0) {
      const std::string why = std::string("the decode instance failed: ") + e.what();
      std::vector<std::string> ids;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& [id, p] : pending_) ids.push_back(id);
      }
      for (const auto& id : ids) {
        Pending p;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = pending_.find(id);
          if (it == pending_.end()) continue;
          p = std::move(it->second);
          pending_.erase(it);
        }
        finish_with(p.on_output, id, FinishReason::kError, why);
      }
      std::unordered_map<std::string, OutputCallback> cbs;
      {
        std::lock_guard<std::mutex> lock(mu_);
        cbs.swap(group_->callbacks);
      }
      for (auto& [id, cb] : cbs) finish_with(cb, id, FinishReason::kError, why);
    }
  }
  {
    std::lock_guard<std::mutex> lock(group_->done_mu);
    group_->finished = true;
  }
  group_->done_cv.notify_all();
}

void DecodeInstance::group_loop(comm::Communicator& comm) {
  Rank& rank = *ranks_[0];
  Engine& engine = *rank.engine;
  const bool leader = first_rank_ == 0;
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
    std::vector<uint8_t> report = take_report();
    if (leader) {
      handle_report(0, report);
      for (int r = 1; r < config_.dp; ++r) handle_report(r, comm.recv_blob(r, kReportTag));
      std::lock_guard<std::mutex> lock(group_->mu);
      group_->idle = !work;
    } else {
      comm.send_blob(report, 0, kReportTag);
    }
  }
}

std::vector<uint8_t> DecodeInstance::take_commands() {
  std::unique_lock<std::mutex> lock(group_->mu);
  if (group_->idle && group_->cmds.empty() && !stop_) {
    // Idle: wait for a command, but send a heartbeat now and then (the other ranks wait in
    // the broadcast, which has a timeout; and they report transfer completions).
    group_->cmd_cv.wait_for(lock, std::chrono::milliseconds(20),
                            [&] { return stop_ || !group_->cmds.empty(); });
  }
  DecodeCommands c;
  c.stop = stop_;
  c.cmds.swap(group_->cmds);
  return encode_decode_commands(c);
}

void DecodeInstance::apply_commands(Rank& rank, const std::vector<DecodeCommand>& cmds) {
  Engine& engine = *rank.engine;
  for (const DecodeCommand& c : cmds) {
    if (c.rank != first_rank_) continue;  // another rank's
    if (c.kind == DecodeCommand::kReserve) {
      DecodeReport::Reservation res;
      res.id = c.id;
      std::vector<int32_t> pages;
      {
        std::lock_guard<std::mutex> lock(rank.mu);
        res.ok = rank.load_locked() < config_.max_decode_batch &&
                 engine.reserve_pages(c.num_tokens, pages);
        if (res.ok) ++rank.reserved;
      }
      if (res.ok) {
        res.d = descriptor(rank, receivers_[0]->address(), c.id, c.num_tokens, c.src, pages);
        try {
          receivers_[0]->expect(res.d);  // before the descriptor leaves
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(rank.mu);
          engine.release_pages(pages);
          --rank.reserved;
          res.ok = false;
          res.error = e.what();
        }
      }
      std::lock_guard<std::mutex> lock(group_->out_mu);
      group_->report.reserved.push_back(std::move(res));
    } else if (c.kind == DecodeCommand::kAdmit) {
      OutputCallback cb = [this](const StepOutput& out) {
        std::lock_guard<std::mutex> lock(group_->out_mu);
        group_->report.outputs.push_back(out);
      };
      std::lock_guard<std::mutex> lock(rank.mu);
      --rank.reserved;
      try {
        engine.add_prefilled(c.req, cb, c.pages, c.token, c.logprob);
      } catch (const std::exception& ex) {
        engine.release_pages(c.pages);
        finish_with(cb, c.id, FinishReason::kError, ex.what());
      }
    } else if (c.kind == DecodeCommand::kRelease) {
      if (c.cancel) receivers_[0]->cancel(c.id);
      std::lock_guard<std::mutex> lock(rank.mu);
      --rank.reserved;
      engine.release_pages(c.pages);
    } else {
      std::lock_guard<std::mutex> lock(rank.mu);
      engine.abort(c.id);
    }
  }
}

std::vector<uint8_t> DecodeInstance::take_report() {
  DecodeReport rep;
  {
    std::lock_guard<std::mutex> lock(group_->out_mu);
    std::swap(rep, group_->report);
  }
  rep.batch = ranks_[0]->batch.load();
  rep.free_pages = ranks_[0]->free_pages.load();
  return encode_decode_report(rep);
}

void DecodeInstance::handle_report(int r, const std::vector<uint8_t>& bytes) {
  DecodeReport rep = decode_decode_report(bytes);
  {
    std::lock_guard<std::mutex> lock(group_->mu);
    group_->batch[static_cast<size_t>(r)] = rep.batch;
    group_->free_pages[static_cast<size_t>(r)] = rep.free_pages;
    for (auto& res : rep.reserved) {
      auto it = group_->reservations.find(res.id);
      if (it == group_->reservations.end()) continue;
      it->second->r = std::move(res);
      it->second->done = true;
    }
  }
  group_->res_cv.notify_all();
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
      auto it = group_->callbacks.find(out.id);
      if (it == group_->callbacks.end()) continue;
      cb = it->second;
      if (out.finished) group_->callbacks.erase(it);
    }
    if (cb) cb(out);
  }
}

transfer::TransferDescriptor DecodeInstance::descriptor(Rank& rank, const std::string& address,
                                                        const std::string& id, int64_t num_tokens,
                                                        const transfer::KvSharding& src,
                                                        const std::vector<int32_t>& pages) const {
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
  d.num_layers = mc.num_hidden_layers;
  return d;
}

void DecodeInstance::release(int r, const std::string& id, std::vector<int32_t> pages,
                             bool cancel) {
  if (!group_) {
    // NOTE: once cancel returns, the receiver writes no more into the pages (its callback, if
    // firing, finds the request gone).
    if (cancel) {
      if (auto rx = receiver(r)) rx->cancel(id);
    }
    post(r, [this, r, pages = std::move(pages)](Engine& e) {
      --ranks_[static_cast<size_t>(r)]->reserved;
      e.release_pages(pages);
    });
    return;
  }
  {
    std::lock_guard<std::mutex> lock(group_->mu);
    DecodeCommand c;
    c.kind = DecodeCommand::kRelease;
    c.rank = r;
    c.id = id;
    c.pages = std::move(pages);
    c.cancel = cancel;
    group_->cmds.push_back(std::move(c));
  }
  group_->cmd_cv.notify_all();
}

std::optional<transfer::TransferDescriptor> DecodeInstance::group_accept(
    const GenRequest& req, const transfer::KvSharding& src, OutputCallback on_output) {
  TANDEM_CHECK(is_leader(), "accept() on a decode rank other than 0");
  // The least-loaded ranks first (as last reported); the first with room and pages takes it.
  std::vector<std::pair<int64_t, int>> order;
  {
    std::lock_guard<std::mutex> lock(group_->mu);
    for (int r = 0; r < config_.dp; ++r)
      order.push_back({group_->batch[static_cast<size_t>(r)], r});
  }
  std::sort(order.begin(), order.end());
  for (const auto& [unused, r] : order) {
    auto res = std::make_shared<Group::Reservation>();
    {
      std::unique_lock<std::mutex> lock(group_->mu);
      group_->reservations[req.id] = res;
      DecodeCommand c;
      c.kind = DecodeCommand::kReserve;
      c.rank = r;
      c.id = req.id;
      c.num_tokens = static_cast<int64_t>(req.prompt_ids.size());
      c.src = src;
      group_->cmds.push_back(std::move(c));
      group_->cmd_cv.notify_all();
      group_->res_cv.wait(lock, [&] { return res->done || dead_ || stop_; });
      group_->reservations.erase(req.id);
    }
    TANDEM_CHECK_KIND(kOutOfResources, res->done, "the decode instance is down");
    if (!res->r.error.empty()) TANDEM_THROW(kInternal, res->r.error);
    if (!res->r.ok) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Pending p;
      p.req = req;
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

void DecodeInstance::init_receivers() {
  // Each rank's transfer receiver writes into that rank's cache.
  transfer_ = config_.transfer ? config_.transfer
                               : host_transfer_backend({config_.kv_host, config_.transfer_timeout});
  for (size_t r = 0; r < ranks_.size(); ++r) {
    transfer::ReceiverCallbacks cbs;
    if (group_) {  // reported to rank 0 in the next iteration
      cbs.on_complete = [this](const std::string& id, int32_t, float) {
        std::lock_guard<std::mutex> lock(group_->out_mu);
        group_->report.kv_events.push_back({id, true, ""});
      };
      cbs.on_error = [this](const std::string& id, const std::string& message) {
        std::lock_guard<std::mutex> lock(group_->out_mu);
        group_->report.kv_events.push_back({id, false, message});
      };
    } else {
      cbs.on_complete = [this](const std::string& id, int32_t, float) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = pending_.find(id);
        if (it == pending_.end()) return;
        it->second.kv_done = true;
        admit_if_ready(id);
      };
      cbs.on_error = [this](const std::string& id, const std::string& message) {
        end_pending(id, FinishReason::kError, "KV transfer failed: " + message,
                    /*cancel_transfer=*/false);
      };
    }
    receivers_.push_back(transfer_->make_receiver(ranks_[r]->engine->kv_cache(), cbs));
  }
}

DecodeInstance::~DecodeInstance() {
  if (group_) {
    stop_ = true;
    { std::lock_guard<std::mutex> lock(group_->mu); }
    group_->cmd_cv.notify_all();
    group_->res_cv.notify_all();
    if (group_->thread.joinable()) group_->thread.join();
    {
      std::lock_guard<std::mutex> lock(rx_mu_);
      receivers_.clear();
    }
    if (!dead_ && is_leader()) {  // every live request gets its finished callback
      std::unordered_map<std::string, Pending> pending;
      std::unordered_map<std::string, OutputCallback> cbs;
      {
        std::lock_guard<std::mutex> lock(mu_);
        pending.swap(pending_);
        cbs.swap(group_->callbacks);
      }
      for (auto& [id, p] : pending) finish_with(p.on_output, id, FinishReason::kAbort, "");
      for (auto& [id, cb] : cbs) finish_with(cb, id, FinishReason::kAbort, "");
    }
    std::lock_guard<std::mutex> lock(ranks_[0]->mu);
    ranks_[0]->engine->abort_all();  // (their outputs went to rank 0 above)
    return;
  }
  stop_ = true;
  wake_cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  {
    std::lock_guard<std::mutex> lock(rx_mu_);
    receivers_.clear();
  }
  if (dead_) return;  // killed: no callbacks
  // Shutting down: every live request gets its finished callback.
  std::vector<std::string> ids;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, p] : pending_) ids.push_back(id);
  }
  for (const auto& id : ids) end_pending(id, FinishReason::kAbort, "");
  for (auto& rank : ranks_) {
    std::lock_guard<std::mutex> lock(rank->mu);
    std::lock_guard<std::mutex> il(rank->inbox_mu);
    for (auto& fn : rank->inbox) fn(*rank->engine);
    rank->inbox.clear();
    rank->engine->abort_all();
  }
}

void DecodeInstance::kill() {
  dead_ = true;
  stop_ = true;
  wake_cv_.notify_all();
  if (group_) {
    { std::lock_guard<std::mutex> lock(group_->mu); }
    group_->cmd_cv.notify_all();
    group_->res_cv.notify_all();
    if (group_->thread.joinable()) group_->thread.join();
  }
  for (auto& t : threads_) t.join();
  std::vector<std::shared_ptr<transfer::TransferReceiver>> dying;
  {
    std::lock_guard<std::mutex> lock(rx_mu_);
    dying.swap(receivers_);
  }
  dying.clear();  // the transfers in flight fail at their senders
}

std::shared_ptr<transfer::TransferReceiver> DecodeInstance::receiver(int rank) const {
  std::lock_guard<std::mutex> lock(rx_mu_);
  return static_cast<size_t>(rank) < receivers_.size() ? receivers_[static_cast<size_t>(rank)]
                                                       : nullptr;
}

// ---- The lockstep loop of one rank. ----

void DecodeInstance::rank_main(int r, comm::Communicator& comm) {
  try {
    lockstep_loop(*ranks_[static_cast<size_t>(r)], comm);
  } catch (const std::exception&) {
    // A rank failed (or a peer did): the group is broken, so is the instance.
    dead_ = true;
    stop_ = true;
    static_cast<comm::LocalCommunicator&>(comm).abort_group();
    wake_cv_.notify_all();
  }
}

void DecodeInstance::lockstep_loop(Rank& rank, comm::Communicator& comm) {
  Engine& engine = *rank.engine;
  for (;;) {
    uint64_t seen;
    {
      std::lock_guard<std::mutex> wl(wake_mu_);
      seen = wake_seq_;
    }
    bool mine;
    {
      std::deque<std::function<void(Engine&)>> inbox;
      {
        std::lock_guard<std::mutex> il(rank.inbox_mu);
        inbox.swap(rank.inbox);
      }
      std::lock_guard<std::mutex> lock(rank.mu);
      for (auto& fn : inbox) fn(engine);  // admissions, aborts, released pages
      mine = engine.has_work();
      rank.batch = rank.load_locked();
    }
    // 1. Agree: stop? any rank with work?
    int64_t flags[2] = {stop_ ? 1 : 0, mine ? 1 : 0};
    comm.all_reduce_sum(flags, 2, DType::kI64);
    if (flags[0] > 0) return;
    if (flags[1] == 0) {  // idle everywhere: wait for news (or poll again soon)
      std::unique_lock<std::mutex> wl(wake_mu_);
      wake_cv_.wait_for(wl, std::chrono::milliseconds(20),
                        [&] { return stop_ || wake_seq_ != seen; });
      continue;
    }
    // 2. Every rank steps; an empty batch still forwards (this rank serves its experts).
    std::lock_guard<std::mutex> lock(rank.mu);
    ScheduledBatch batch = engine.schedule();
    if (engine.forward(batch)) engine.complete(batch);
    rank.batch = rank.load_locked();
  }
}

void DecodeInstance::post(int r, std::function<void(Engine&)> fn) {
  Rank& rank = *ranks_[static_cast<size_t>(r)];
  {
    std::lock_guard<std::mutex> lock(rank.inbox_mu);
    rank.inbox.push_back(std::move(fn));
  }
  {
    std::lock_guard<std::mutex> wl(wake_mu_);
    ++wake_seq_;
  }
  wake_cv_.notify_all();
}

// ---- Admission. ----

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
  TANDEM_CHECK_KIND(kOutOfResources, !dead_ && !stop_, "the decode instance is down");
  ranks_[0]->engine->validate(req);
  {
    std::lock_guard<std::mutex> lock(mu_);
    TANDEM_CHECK_KIND(kInvalidArgument, !pending_.count(req.id) && !running_ids_.count(req.id),
                      "duplicate request id '", req.id, "'");
  }
  if (group_) return group_accept(req, src, std::move(on_output));
  // The least-loaded ranks first; the first with room and pages takes it.
  std::vector<std::pair<int64_t, int>> order;
  for (int r = 0; r < config_.dp; ++r)
    order.push_back({ranks_[static_cast<size_t>(r)]->batch.load(), r});
  std::sort(order.begin(), order.end());
  for (const auto& [unused, r] : order) {
    Rank& rank = *ranks_[static_cast<size_t>(r)];
    std::vector<int32_t> pages;
    {
      std::lock_guard<std::mutex> lock(rank.mu);
      if (rank.load_locked() >= config_.max_decode_batch) continue;
      if (!rank.engine->reserve_pages(static_cast<int64_t>(req.prompt_ids.size()), pages)) continue;
      ++rank.reserved;
      rank.batch = rank.load_locked();
    }
    std::shared_ptr<transfer::TransferReceiver> rx = receiver(r);
    if (!rx) {
      std::lock_guard<std::mutex> lock(rank.mu);
      rank.engine->release_pages(pages);
      --rank.reserved;
      TANDEM_THROW(kOutOfResources, "the decode instance is down");
    }
    const transfer::TransferDescriptor d = descriptor(
        rank, rx->address(), req.id, static_cast<int64_t>(req.prompt_ids.size()), src, pages);
    {
      std::lock_guard<std::mutex> lock(mu_);
      Pending p;
      p.req = req;
      p.on_output = std::move(on_output);
      p.rank = r;
      p.pages = pages;
      pending_.emplace(req.id, std::move(p));
    }
    try {
      rx->expect(d);  // before the descriptor leaves
    } catch (...) {
      {  // the caller learns from the exception: no callback
        std::lock_guard<std::mutex> lock(mu_);
        pending_.erase(req.id);
      }
      post(r, [this, r, pages](Engine& e) {
        --ranks_[static_cast<size_t>(r)]->reserved;
        e.release_pages(pages);
      });
      throw;
    }
    return d;
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
  OutputCallback cb = [first, inner](const StepOutput& out) {
    if (first->id.empty()) return inner(out);
    StepOutput merged = out;
    merged.top_logprobs = std::move(first->top_logprobs);
    merged.prompt_token_logprobs = std::move(first->prompt_token_logprobs);
    merged.prompt_top_logprobs = std::move(first->prompt_top_logprobs);
    merged.num_cached_prompt_tokens = first->num_cached_prompt_tokens;
    first->id.clear();
    inner(merged);
  };
  const int32_t token = first->token_ids.empty() ? -1 : first->token_ids[0];
  const float logprob = first->token_logprobs.empty() ? 0.f : first->token_logprobs[0];
  if (group_) {  // (under mu_: callbacks)
    group_->callbacks[p.req.id] = std::move(cb);
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      DecodeCommand c;
      c.kind = DecodeCommand::kAdmit;
      c.rank = p.rank;
      c.id = p.req.id;
      c.req = p.req;
      c.pages = p.pages;
      c.token = token;
      c.logprob = logprob;
      group_->cmds.push_back(std::move(c));
    }
    group_->cmd_cv.notify_all();
    return;
  }
  post(p.rank, [this, r = p.rank, req = std::move(p.req), cb = std::move(cb),
                pages = std::move(p.pages), token, logprob](Engine& e) mutable {
    --ranks_[static_cast<size_t>(r)]->reserved;
    const std::string rid = req.id;
    try {
      e.add_prefilled(std::move(req), cb, pages, token, logprob);
    } catch (const std::exception& ex) {
      e.release_pages(pages);
      finish_with(cb, rid, FinishReason::kError, ex.what());
    }
  });
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
  if (group_) {
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      DecodeCommand c;
      c.kind = DecodeCommand::kAbort;
      c.rank = rank;
      c.id = id;
      group_->cmds.push_back(std::move(c));
    }
    group_->cmd_cv.notify_all();
    return;
  }
  post(rank, [id](Engine& e) { e.abort(id); });
}

DecodeLoad DecodeInstance::load() const {
  DecodeLoad l;
  if (group_) {
    std::lock_guard<std::mutex> lock(group_->mu);
    l.batch_per_rank = group_->batch;
    l.kv_pages_free_per_rank = group_->free_pages;
  } else {
    for (const auto& r : ranks_) {
      l.batch_per_rank.push_back(r->batch.load());
      l.kv_pages_free_per_rank.push_back(r->free_pages.load());
    }
  }
  l.max_decode_batch = config_.max_decode_batch;
  l.alive = !dead_ && !stop_;
  return l;
}

int64_t DecodeInstance::max_model_len() const { return ranks_[0]->engine->max_model_len(); }
int64_t DecodeInstance::vocab_size() const { return ranks_[0]->model->config().vocab_size; }

EngineStats DecodeInstance::stats() const {
  EngineStats sum;
  for (const auto& r : ranks_) {
    std::lock_guard<std::mutex> lock(r->mu);
    EngineStats s = r->engine->stats();
    sum.running += s.running;
    sum.waiting += s.waiting;
    sum.kv_pages_total += s.kv_pages_total;
    sum.kv_pages_free += s.kv_pages_free;
    sum.prompt_tokens += s.prompt_tokens;
    sum.generation_tokens += s.generation_tokens;
    sum.preemptions += s.preemptions;
  }
  return sum;
}

}  // namespace tandem
