#include "engine/decode_instance.h"

#include <algorithm>
#include <numeric>

#include "comm/local_comm.h"
#include "core/error.h"
#include "engine/lockstep.h"
#include "model/qwen3_moe.h"
#include "transfer/tcp_transfer.h"

namespace tandem {

int64_t DecodeLoad::min_batch() const {
  return batch_per_rank.empty() ? 0
                                : *std::min_element(batch_per_rank.begin(), batch_per_rank.end());
}

int64_t DecodeLoad::total_batch() const {
  return std::accumulate(batch_per_rank.begin(), batch_per_rank.end(), int64_t{0});
}

struct DecodeInstance::Rank {
  std::unique_ptr<Qwen3MoeCpu> model;
  std::unique_ptr<Engine> engine;
  std::mutex mu;  // engine, reserved
  // NOTE: the inbox has its own lock: a callback running inside a step (under mu) may post.
  std::mutex inbox_mu;
  std::deque<std::function<void(Engine&)>> inbox;
  int64_t reserved = 0;  // accepted, not admitted yet
  std::atomic<int64_t> batch{0};

  int64_t load_locked() const {
    EngineStats st = engine->stats();
    return st.running + st.waiting + reserved;
  }
};

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
  for (int r = 0; r < config_.dp; ++r) {
    auto rank = std::make_unique<Rank>();
    // NOTE: loading is local (no collective), so the shards load one after another here.
    rank->model = Qwen3MoeCpu::load(config_.model_dir, ShardSpec::decode(r, config_.dp),
                                    comms_[static_cast<size_t>(r)].get());
    rank->engine = std::make_unique<Engine>(*rank->model, config_.engine);
    ranks_.push_back(std::move(rank));
  }
  // Each rank's transfer receiver writes into that rank's cache.
  transfer::HostTcpOptions topts;
  topts.bind_host = config_.kv_host;
  topts.timeout = config_.transfer_timeout;
  transfer_ = transfer::make_host_tcp_backend(topts);
  for (int r = 0; r < config_.dp; ++r) {
    transfer::ReceiverCallbacks cbs;
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
    receivers_.push_back(
        transfer_->make_receiver(ranks_[static_cast<size_t>(r)]->engine->kv_cache(), cbs));
  }
  for (int r = 0; r < config_.dp; ++r) {
    threads_.emplace_back([this, r] { rank_main(r, *comms_[static_cast<size_t>(r)]); });
  }
}

DecodeInstance::~DecodeInstance() {
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
  const ModelConfig& mc = ranks_[0]->model->config();
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
    transfer::TransferDescriptor d;
    d.request_id = req.id;
    d.dst_address = rx->address();
    d.dst_pages = pages;
    d.dst_heads = {0, mc.num_key_value_heads};  // DP: every rank holds every head
    d.src = src;
    d.num_tokens = static_cast<int64_t>(req.prompt_ids.size());
    d.page_size = rank.engine->config().page_size;
    d.head_dim = mc.head_dim;
    d.num_layers = mc.num_hidden_layers;
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
  // NOTE: once cancel returns, the receiver writes no more into the pages (its callback, if
  // firing, finds the request gone).
  if (cancel_transfer) {
    if (auto rx = receiver(p.rank)) rx->cancel(id);
  }
  post(p.rank, [this, r = p.rank, pages = std::move(p.pages)](Engine& e) {
    --ranks_[static_cast<size_t>(r)]->reserved;
    e.release_pages(pages);
  });
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
  post(rank, [id](Engine& e) { e.abort(id); });
}

DecodeLoad DecodeInstance::load() const {
  DecodeLoad l;
  for (const auto& r : ranks_) l.batch_per_rank.push_back(r->batch.load());
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
