#include "server/router.h"

#include <algorithm>

#include "core/error.h"
#include "server/instance_api.h"

namespace tandem {

/// A request between submit and its finished callback.
struct Router::Live {
  std::mutex mu;
  OutputCallback on_output;
  std::atomic<int> decode{-1};  // NOTE: atomics, so abort() from inside a callback is safe
  std::atomic<int> prefill{-1};
  bool done = false;  // the finished callback ran (or was suppressed)

  // Forwards one output unless the request already ended; false when it was dropped.
  bool deliver(const StepOutput& out) {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return false;
    done = out.finished;
    if (on_output) on_output(out);
    return true;
  }
};

Router::Router(std::vector<PrefillClient*> prefill, std::vector<DecodeClient*> decode,
               RouterConfig config)
    : prefill_(std::move(prefill)),
      decode_(std::move(decode)),
      config_(config),
      decode_dead_(decode_.size()) {
  TANDEM_CHECK_KIND(kInvalidArgument, !prefill_.empty() && !decode_.empty(),
                    "the router needs at least one prefill and one decode instance");
  max_model_len_ = decode_[0]->max_model_len();
  vocab_size_ = decode_[0]->vocab_size();
  for (DecodeClient* d : decode_) {
    max_model_len_ = std::min(max_model_len_, d->max_model_len());
    TANDEM_CHECK_KIND(kInvalidArgument, d->vocab_size() == vocab_size_,
                      "decode instances serve models of different vocabularies");
  }
  refresh_loads();
  monitor_ = std::thread([this] { monitor(); });
}

Router::~Router() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  monitor_.join();
}

void Router::refresh_loads() {
  std::vector<PrefillLoad> p;
  std::vector<DecodeLoad> d;
  for (PrefillClient* c : prefill_) p.push_back(c->load());
  for (DecodeClient* c : decode_) d.push_back(c->load());
  std::lock_guard<std::mutex> lock(load_mu_);
  prefill_loads_ = std::move(p);
  decode_loads_ = std::move(d);
}

int Router::pick_prefill(int64_t prompt_tokens) {
  std::lock_guard<std::mutex> lock(load_mu_);
  int best = -1;
  for (int i = 0; i < static_cast<int>(prefill_loads_.size()); ++i) {
    const PrefillLoad& l = prefill_loads_[static_cast<size_t>(i)];
    if (!l.alive) continue;
    if (best < 0 ||
        l.queued_input_tokens < prefill_loads_[static_cast<size_t>(best)].queued_input_tokens) {
      best = i;
    }
  }
  // Counted here until the next refresh, so a burst spreads over the instances.
  if (best >= 0) prefill_loads_[static_cast<size_t>(best)].queued_input_tokens += prompt_tokens;
  return best;
}

std::vector<int> Router::decode_order() const {
  // Smallest batch first (the rank the request would land on), then the emptier instance;
  // after them the instances that looked full (the loads are up to one refresh old).
  std::lock_guard<std::mutex> lock(load_mu_);
  std::vector<std::tuple<bool, int64_t, int64_t, int>> c;
  for (int i = 0; i < static_cast<int>(decode_loads_.size()); ++i) {
    const DecodeLoad& l = decode_loads_[static_cast<size_t>(i)];
    if (decode_dead_[static_cast<size_t>(i)] || !l.alive) continue;
    c.emplace_back(!l.has_room(), l.min_batch(), l.total_batch(), i);
  }
  std::sort(c.begin(), c.end());
  std::vector<int> order;
  for (const auto& [full, b, t, i] : c) order.push_back(i);
  return order;
}

void Router::note_accepted(int d) {
  std::lock_guard<std::mutex> lock(load_mu_);
  auto& batch = decode_loads_[static_cast<size_t>(d)].batch_per_rank;
  if (!batch.empty()) ++*std::min_element(batch.begin(), batch.end());
}

void Router::submit(GenRequest req, OutputCallback on_output) {
  const std::string id = req.id;
  auto live = std::make_shared<Live>();
  live->on_output = std::move(on_output);
  {
    std::lock_guard<std::mutex> lock(reg_->mu);
    TANDEM_CHECK_KIND(kInvalidArgument, reg_->live.count(id) == 0, "duplicate request id '", id,
                      "'");
    reg_->live[id] = live;
  }
  // NOTE: the callbacks hold the registry, not the router: an instance may still report
  // after the router is gone.
  auto forget = [reg = reg_, id] {
    std::lock_guard<std::mutex> lock(reg->mu);
    reg->live.erase(id);
  };
  OutputCallback relay = [reg = reg_, live, forget](const StepOutput& out) {
    if (!live->deliver(out)) return;
    reg->generated += static_cast<int64_t>(out.token_ids.size());
    if (out.finished) forget();
  };
  try {
    // 1. A decode instance reserves KV pages for a transfer from the least-queued prefill
    //    instance (validation happens there).
    const int p = pick_prefill(static_cast<int64_t>(req.prompt_ids.size()));
    TANDEM_CHECK_KIND(kOutOfResources, p >= 0, "no prefill instance is up");
    std::optional<transfer::TransferDescriptor> dst;
    int d = -1;
    const transfer::KvSharding sharding = prefill_[static_cast<size_t>(p)]->kv_sharding();
    for (int cand : decode_order()) {
      live->decode = cand;  // before accept: a death right after it still ends this request
      try {
        dst = decode_[static_cast<size_t>(cand)]->accept(req, sharding, relay);
      } catch (const Error& e) {
        // NOTE: a lost connection means the instance died since the last load refresh: try
        // the next one (the monitor ends its live requests); other errors are the request's.
        if (e.kind() != ErrorKind::kIo) throw;
        continue;
      }
      if (dst) {
        d = cand;
        note_accepted(d);
        break;
      }
    }
    TANDEM_CHECK_KIND(kOutOfResources, dst.has_value(),
                      "every decode instance is at its batch limit (--max-decode-batch)");
    live->decode = d;
    live->prefill = p;  // (set before the prefill can fail, so abort() reaches both)
    // 2. The prefill instance fills those pages; a failure ends the request on the decode side.
    DecodeClient* decode = decode_[static_cast<size_t>(d)];
    try {
      prefill_[static_cast<size_t>(p)]->submit(
          req, std::move(*dst), [decode, id](const std::string& error, const StepOutput& first) {
            if (error.empty()) {
              decode->prefilled(id, first);  // token 1: the decode instance takes over
            } else {
              decode->fail(id, error);
            }
          });
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(live->mu);
        live->done = true;  // the caller learns from the exception, not from a callback
      }
      decode->abort(id);
      throw;
    }
  } catch (...) {
    forget();
    throw;
  }
}

void Router::abort(const std::string& id) {
  std::shared_ptr<Live> live;
  {
    std::lock_guard<std::mutex> lock(reg_->mu);
    auto it = reg_->live.find(id);
    if (it == reg_->live.end()) return;
    live = it->second;
  }
  const int p = live->prefill, d = live->decode;
  if (p >= 0) prefill_[static_cast<size_t>(p)]->abort(id);
  if (d >= 0) decode_[static_cast<size_t>(d)]->abort(id);
}

void Router::monitor() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    stop_cv_.wait_for(lock, config_.health_interval, [&] { return stop_; });
    if (stop_) break;
    lock.unlock();
    refresh_loads();
    for (int d = 0; d < static_cast<int>(decode_.size()); ++d) {
      bool alive;
      {
        std::lock_guard<std::mutex> ll(load_mu_);
        alive = decode_loads_[static_cast<size_t>(d)].alive;
      }
      if (!decode_dead_[static_cast<size_t>(d)] && !alive) {
        decode_dead_[static_cast<size_t>(d)] = true;
        end_dead_decode(d);
      }
    }
    lock.lock();
  }
}

void Router::end_dead_decode(int d) {
  std::vector<std::pair<std::string, std::shared_ptr<Live>>> victims;
  {
    std::lock_guard<std::mutex> lock(reg_->mu);
    for (const auto& [id, live] : reg_->live) victims.emplace_back(id, live);
  }
  for (auto& [id, live] : victims) {
    const int dd = live->decode, p = live->prefill;
    if (dd != d) continue;
    if (p >= 0) prefill_[static_cast<size_t>(p)]->abort(id);  // its KV has nowhere to go
    StepOutput out;
    out.id = id;
    out.finished = true;
    out.finish_reason = FinishReason::kError;
    out.error = "decode instance " + std::to_string(d) + " failed";
    if (live->deliver(out)) {
      std::lock_guard<std::mutex> lock(reg_->mu);
      reg_->live.erase(id);
    }
  }
}

RouterSnapshot Router::snapshot() const {
  RouterSnapshot s;
  for (PrefillClient* p : prefill_) s.prefill.push_back(p->load());
  for (int d = 0; d < static_cast<int>(decode_.size()); ++d) {
    DecodeLoad l = decode_[static_cast<size_t>(d)]->load();
    l.alive = l.alive && !decode_dead_[static_cast<size_t>(d)];
    s.decode.push_back(l);
  }
  std::lock_guard<std::mutex> lock(reg_->mu);
  s.live_requests = static_cast<int64_t>(reg_->live.size());
  return s;
}

EngineStats Router::stats() const {
  RouterSnapshot s = snapshot();
  EngineStats st;
  for (const auto& d : s.decode) st.running += d.alive ? d.total_batch() : 0;
  st.waiting = std::max<int64_t>(0, s.live_requests - st.running);
  for (const auto& p : s.prefill) st.prompt_tokens += p.input_tokens_total;
  st.generation_tokens = reg_->generated.load();
  return st;
}

std::string Router::metrics_text() const {
  RouterSnapshot s = snapshot();
  std::vector<std::pair<std::string, PrefillLoad>> p;
  std::vector<std::pair<std::string, DecodeLoad>> d;
  for (size_t i = 0; i < s.prefill.size(); ++i) p.emplace_back(std::to_string(i), s.prefill[i]);
  for (size_t i = 0; i < s.decode.size(); ++i) d.emplace_back(std::to_string(i), s.decode[i]);
  return instances_metrics_text(p, d);
}

}  // namespace tandem
