#include "server/router.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <iostream>
#include <limits>
#include <set>

#include "core/error.h"
#include "disagg/instance_api.h"
#include "events/zmq_subscriber.h"
#include "net/address.h"
#include "server/http/instance_metrics.h"

namespace tandem {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

struct Router::Prefill {
  std::string name;  // its address (or index, for fixed instances)
  PrefillClient* client = nullptr;
  std::unique_ptr<PrefillClient> owned;
  int index_id = -1;  // its slot in the prefix index (-1: not indexed)
  std::unique_ptr<ZmqKvEventSubscriber> events;
  // Under load_mu_:
  PrefillLoad load;
  bool up = false;
  bool draining = false;  // it said so (SIGTERM): nothing new goes there
  bool retired = false;   // its address left the DNS answer
};

struct Router::Decode {
  std::string name;
  DecodeClient* client = nullptr;
  std::unique_ptr<DecodeClient> owned;
  // Under load_mu_:
  DecodeLoad load;
  bool up = false;
  bool draining = false;
  bool retired = false;
};

/// A request between submit and its finished callback.
struct Router::Live {
  std::mutex mu;
  OutputCallback on_output;
  bool done = false;      // no more outputs are forwarded
  bool reported = false;  // its finished callback ran
  std::atomic<bool> aborted{false};
  // Where it runs (members outlive the router's requests); under where_mu.
  std::mutex where_mu;
  Decode* decode = nullptr;
  Prefill* prefill = nullptr;

  // Forwards one output unless the request already ended; false when it was dropped.
  bool deliver(const StepOutput& out) {
    std::lock_guard<std::mutex> lock(mu);
    if (done) return false;
    done = out.finished;
    reported = out.finished;
    if (on_output) on_output(out);
    return true;
  }
  // The finished callback, even after the outputs were suppressed (once).
  bool force(const StepOutput& out) {
    std::lock_guard<std::mutex> lock(mu);
    if (reported) return false;
    done = reported = true;
    if (on_output) on_output(out);
    return true;
  }
  void set(Decode* d, Prefill* p) {
    std::lock_guard<std::mutex> lock(where_mu);
    decode = d;
    prefill = p;
  }
  std::pair<Decode*, Prefill*> where() {
    std::lock_guard<std::mutex> lock(where_mu);
    return {decode, prefill};
  }
};

struct Router::Queued {
  std::string id;
  GenRequest req;
  std::shared_ptr<Live> live;
  OutputCallback relay;
  Clock::time_point since;
};

struct Router::Watch {
  bool prefill = false;
  std::string endpoint, host, port;
  Clock::time_point next{};
  std::set<std::string> addresses;  // as last resolved
  bool failing = false;             // the last resolution failed (logged once)
};

Router::Router(std::vector<PrefillClient*> prefill, std::vector<DecodeClient*> decode,
               RouterConfig config)
    : config_(std::move(config)), index_(config_.prefix_index_blocks) {
  TANDEM_CHECK_KIND(kInvalidArgument, !prefill.empty() && !decode.empty(),
                    "the router needs at least one prefill and one decode instance");
  for (size_t i = 0; i < prefill.size(); ++i) add_prefill(std::to_string(i), prefill[i], nullptr);
  for (size_t i = 0; i < decode.size(); ++i) add_decode(std::to_string(i), decode[i], nullptr);
  refresh();
  monitor_ = std::thread([this] { monitor(); });
}

Router::Router(RouterConfig config)
    : config_(std::move(config)), index_(config_.prefix_index_blocks) {
  monitor_ = std::thread([this] { monitor(); });
}

Router::~Router() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  monitor_.join();
  {
    std::lock_guard<std::mutex> lock(reg_->mu);
    reg_->on_finished = nullptr;
  }
  std::deque<std::shared_ptr<Queued>> queued;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queued.swap(queue_);
  }
  for (auto& q : queued) finish(q->id, q->live, FinishReason::kAbort, "", 0);
  // NOTE: the prefill clients first: their callbacks reach the decode clients.
  std::lock_guard<std::mutex> lock(members_mu_);
  for (auto& p : prefill_) p->events.reset();  // (their callbacks reach index_)
  for (auto& p : prefill_) p->owned.reset();
  for (auto& d : decode_) d->owned.reset();
}

void Router::log(const std::string& line) const {
  if (config_.log) {
    config_.log(line);
  } else {
    std::cerr << "tandem: router: " << line << std::endl;
  }
}

namespace {
// "host:port" (an IPv6 host in brackets) into the host without brackets and the port.
bool split_endpoint(const std::string& endpoint, std::string& host, std::string& port) {
  try {
    net::HostPort hp = net::split_host_port(endpoint, "instance address");
    host = std::move(hp.host);
    port = std::move(hp.port);
    return true;
  } catch (const Error&) {
    return false;
  }
}
}  // namespace

void Router::add_prefill(const std::string& name, PrefillClient* client,
                         std::unique_ptr<PrefillClient> owned) {
  auto m = std::make_shared<Prefill>();
  m->name = name;
  m->client = client;
  m->owned = std::move(owned);
  m->load.alive = false;
  std::string host, port;
  if (config_.kv_events_port > 0 && split_endpoint(name, host, port) &&
      next_index_id_.load() < PrefixIndex::kMaxInstances) {
    const int id = next_index_id_++;
    m->index_id = id;
    KvEventSubscriberConfig sc;
    sc.endpoint = "tcp://" + net::join_host_port(host, config_.kv_events_port);
    if (config_.kv_events_replay_port > 0) {
      sc.replay_endpoint = "tcp://" + net::join_host_port(host, config_.kv_events_replay_port);
    }
    sc.topic = config_.kv_events_topic;
    try {
      m->events = std::make_unique<ZmqKvEventSubscriber>(
          sc, [this, id](int64_t, DecodedKvEventBatch&& b) { index_.apply(id, b.events); },
          [this, id](int64_t, int64_t) {
            events_lost_.fetch_add(1);
            index_.forget(id);  // its view can no longer be trusted: least-queued for it
          });
    } catch (const std::exception& e) {
      log("prefill instance " + name + ": no KV events (" + e.what() + ")");
    }
  }
  std::lock_guard<std::mutex> lock(members_mu_);
  prefill_.push_back(std::move(m));
}

void Router::add_decode(const std::string& name, DecodeClient* client,
                        std::unique_ptr<DecodeClient> owned) {
  auto m = std::make_shared<Decode>();
  m->name = name;
  m->client = client;
  m->owned = std::move(owned);
  m->load.alive = false;
  std::lock_guard<std::mutex> lock(members_mu_);
  decode_.push_back(std::move(m));
}

std::vector<std::shared_ptr<Router::Prefill>> Router::prefills() const {
  std::lock_guard<std::mutex> lock(members_mu_);
  return prefill_;
}

std::vector<std::shared_ptr<Router::Decode>> Router::decodes() const {
  std::lock_guard<std::mutex> lock(members_mu_);
  return decode_;
}

void Router::watch_prefill(const std::string& endpoint) {
  auto w = std::make_unique<Watch>();
  w->prefill = true;
  w->endpoint = endpoint;
  TANDEM_CHECK_KIND(kInvalidArgument, split_endpoint(endpoint, w->host, w->port),
                    "bad instance address '", endpoint, "' (want host:port)");
  {
    std::lock_guard<std::mutex> lock(members_mu_);
    watches_.push_back(std::move(w));
  }
  resolve_watches(false);
  refresh();  // the instances that answer now are usable at once
}

void Router::watch_decode(const std::string& endpoint) {
  auto w = std::make_unique<Watch>();
  w->endpoint = endpoint;
  TANDEM_CHECK_KIND(kInvalidArgument, split_endpoint(endpoint, w->host, w->port),
                    "bad instance address '", endpoint, "' (want host:port)");
  {
    std::lock_guard<std::mutex> lock(members_mu_);
    watches_.push_back(std::move(w));
  }
  resolve_watches(false);
  refresh();  // the instances that answer now are usable at once
}

void Router::resolve_watches(bool force) {
  // NOTE: runs on the monitor thread, or in watch_*() before the caller serves.
  std::vector<Watch*> due;
  {
    std::lock_guard<std::mutex> lock(members_mu_);
    const auto now = Clock::now();
    for (auto& w : watches_) {
      if (force || now >= w->next) due.push_back(w.get());
    }
  }
  static std::mutex resolve_mu;  // watch_*() and the monitor may both resolve
  std::lock_guard<std::mutex> resolving(resolve_mu);
  for (Watch* w : due) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int gai = ::getaddrinfo(w->host.c_str(), w->port.c_str(), &hints, &res);
    std::set<std::string> found;
    for (addrinfo* a = gai == 0 ? res : nullptr; a; a = a->ai_next) {
      char host[NI_MAXHOST];
      if (::getnameinfo(a->ai_addr, a->ai_addrlen, host, sizeof(host), nullptr, 0,
                        NI_NUMERICHOST) != 0) {
        continue;
      }
      const std::string h = host;
      found.insert((h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + w->port);
    }
    if (res) ::freeaddrinfo(res);
    const auto now = Clock::now();
    if (found.empty()) {
      if (!w->failing) {
        log("cannot resolve " + w->endpoint + " (" +
            (gai != 0 ? std::string(::gai_strerror(gai)) : std::string("no address")) +
            "); retrying");
      }
      w->failing = true;
      w->next = now + std::min<std::chrono::milliseconds>(config_.resolve_interval,
                                                          std::chrono::seconds(1));
      continue;
    }
    w->failing = false;
    w->next = now + config_.resolve_interval;
    for (const auto& addr : found) {
      if (w->addresses.count(addr)) continue;
      // NOTE: IPv6 literals are bracketed for display; the client wants host:port as is.
      std::string connect_to = addr;
      if (!connect_to.empty() && connect_to[0] == '[') {
        const size_t close = connect_to.find(']');
        connect_to = connect_to.substr(1, close - 1) + connect_to.substr(close + 1);
      }
      bool known = false;
      {
        std::lock_guard<std::mutex> ml(members_mu_);
        std::lock_guard<std::mutex> ll(load_mu_);
        if (w->prefill) {
          for (auto& p : prefill_) {
            if (p->name == addr) known = true, p->retired = false;
          }
        } else {
          for (auto& d : decode_) {
            if (d->name == addr) known = true, d->retired = false;
          }
        }
      }
      if (!known) {
        log(std::string(w->prefill ? "prefill" : "decode") + " instance " + addr + " added (" +
            w->endpoint + ")");
        if (w->prefill) {
          auto c = std::make_unique<RemotePrefill>(connect_to, config_.cluster_key);
          PrefillClient* raw = c.get();
          add_prefill(addr, raw, std::move(c));
        } else {
          auto c = std::make_unique<RemoteDecode>(connect_to, config_.cluster_key);
          DecodeClient* raw = c.get();
          add_decode(addr, raw, std::move(c));
        }
      }
    }
    for (const auto& addr : w->addresses) {
      if (found.count(addr)) continue;
      log(std::string(w->prefill ? "prefill" : "decode") + " instance " + addr +
          " left the DNS answer for " + w->endpoint + ": retired");
      std::lock_guard<std::mutex> ml(members_mu_);
      std::lock_guard<std::mutex> ll(load_mu_);
      if (w->prefill) {
        for (auto& p : prefill_) {
          if (p->name == addr) p->retired = true;
        }
      } else {
        for (auto& d : decode_) {
          if (d->name == addr) d->retired = true;
        }
      }
    }
    w->addresses = std::move(found);
  }
}

void Router::refresh() {
  auto ps = prefills();
  auto ds = decodes();
  std::vector<PrefillLoad> pl;
  std::vector<DecodeLoad> dl;
  std::vector<bool> pdrain, ddrain;
  // NOTE: remote clients (re)connect inside load(), with backoff.
  for (auto& p : ps) {
    pl.push_back(p->client->load());
    auto* remote = dynamic_cast<RemotePrefill*>(p->client);
    pdrain.push_back(remote && remote->draining());
  }
  for (auto& d : ds) {
    dl.push_back(d->client->load());
    auto* remote = dynamic_cast<RemoteDecode*>(d->client);
    ddrain.push_back(remote && remote->draining());
  }
  std::vector<std::string> lines;
  std::vector<std::shared_ptr<Decode>> died;
  {
    std::lock_guard<std::mutex> lock(load_mu_);
    for (size_t i = 0; i < ps.size(); ++i) {
      Prefill& p = *ps[i];
      const bool up = pl[i].alive && !p.retired;
      if (up != p.up) {
        lines.push_back("prefill instance " + p.name +
                        (up ? " is up: ready" : " does not answer: unready, routed around"));
      }
      if (up && pdrain[i] != p.draining) {
        lines.push_back("prefill instance " + p.name +
                        (pdrain[i] ? " is draining: no new requests" : " stopped draining"));
      }
      p.up = up;
      p.draining = pdrain[i];
      p.load = pl[i];
    }
    for (size_t i = 0; i < ds.size(); ++i) {
      Decode& d = *ds[i];
      bool up = dl[i].alive && !d.retired;
      if (up && !d.up) {
        const int64_t vocab = d.client->vocab_size(), len = d.client->max_model_len();
        int64_t want = vocab_size_.load();
        if (want == 0 && vocab > 0) vocab_size_.compare_exchange_strong(want, vocab);
        if (vocab_size_.load() != vocab) {
          lines.push_back("decode instance " + d.name + " serves a vocabulary of " +
                          std::to_string(vocab) + ", not " + std::to_string(vocab_size_.load()) +
                          ": not admitted");
          up = false;
          dl[i].alive = false;
        } else {
          int64_t cur = max_model_len_.load();
          while ((cur == 0 || len < cur) && !max_model_len_.compare_exchange_weak(cur, len)) {
          }
        }
      }
      if (up != d.up) {
        lines.push_back("decode instance " + d.name +
                        (up ? " is up: ready" : " does not answer: unready, routed around"));
        if (!up) died.push_back(ds[i]);
      }
      if (up && ddrain[i] != d.draining) {
        lines.push_back("decode instance " + d.name +
                        (ddrain[i] ? " is draining: no new requests" : " stopped draining"));
      }
      d.up = up;
      d.draining = ddrain[i];
      d.load = dl[i];
    }
  }
  for (const auto& l : lines) log(l);
  for (const auto& d : died) end_dead_decode(d);
}

std::shared_ptr<Router::Prefill> Router::pick_prefill(const std::vector<int32_t>& prompt) {
  auto ps = prefills();
  const auto n = static_cast<int64_t>(prompt.size());
  // What each instance holds of the prompt (zeros without KV events: least-queued).
  std::vector<int64_t> held;
  if (config_.kv_events_port > 0) held = index_.match(prompt, PrefixIndex::kMaxInstances);
  std::lock_guard<std::mutex> lock(load_mu_);
  std::vector<PrefillCandidate> c(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const Prefill& p = *ps[i];
    c[i].usable = p.up && !p.draining;
    c[i].queued_tokens = p.load.queued_input_tokens;
    if (p.index_id >= 0 && !held.empty())
      c[i].cached_tokens = held[static_cast<size_t>(p.index_id)];
  }
  const int k = pick_prefix_aware(c, n);
  if (k < 0) return nullptr;
  std::shared_ptr<Prefill> best = ps[static_cast<size_t>(k)];
  const int64_t cached = c[static_cast<size_t>(k)].cached_tokens;
  // Counted here until the next refresh, so a burst spreads over the instances.
  best->load.queued_input_tokens += n - cached;
  routed_prompt_ += n;
  routed_cached_ += cached;
  if (best->index_id >= 0) index_.predict(best->index_id, prompt);
  return best;
}

std::vector<std::shared_ptr<Router::Decode>> Router::decode_order() const {
  // Smallest batch first (the rank the request would land on), then the emptier instance;
  // after them the instances that looked full (the loads are up to one refresh old).
  auto ds = decodes();
  std::lock_guard<std::mutex> lock(load_mu_);
  std::vector<std::tuple<bool, int64_t, int64_t, size_t>> c;
  for (size_t i = 0; i < ds.size(); ++i) {
    const Decode& d = *ds[i];
    if (!d.up || d.draining) continue;
    c.emplace_back(!d.load.has_room(), d.load.min_batch(), d.load.total_batch(), i);
  }
  std::sort(c.begin(), c.end());
  std::vector<std::shared_ptr<Decode>> order;
  for (const auto& [full, b, t, i] : c) order.push_back(ds[i]);
  return order;
}

Router::Place Router::place(const GenRequest& req, const std::shared_ptr<Live>& live,
                            const OutputCallback& relay, std::string& why) {
  const std::string& id = req.id;
  // 1. A decode instance reserves KV pages for a transfer from the least-queued prefill
  //    instance (validation happens there).
  std::shared_ptr<Prefill> p = pick_prefill(req.prompt_ids);
  if (!p) {
    why = "no prefill instance is ready";
    return Place::kNone;
  }
  std::vector<std::shared_ptr<Decode>> order = decode_order();
  if (order.empty()) {
    why = "no decode instance is ready";
    return Place::kNone;
  }
  std::optional<transfer::TransferDescriptor> dst;
  Decode* d = nullptr;
  bool any_full = false;
  const transfer::KvSharding sharding = p->client->kv_sharding();
  for (auto& cand : order) {
    live->set(cand.get(), nullptr);  // before accept: a death right after it ends this request
    try {
      dst = cand->client->accept(req, sharding, relay);
    } catch (const Error& e) {
      // NOTE: a lost connection means the instance died since the last load refresh: try
      // the next one (the monitor ends its live requests); other errors are the request's.
      if (e.kind() != ErrorKind::kIo) {
        live->set(nullptr, nullptr);
        throw;
      }
      continue;
    }
    if (dst) {
      d = cand.get();
      std::lock_guard<std::mutex> lock(load_mu_);
      auto& batch = d->load.batch_per_rank;
      if (!batch.empty()) ++*std::min_element(batch.begin(), batch.end());
      break;
    }
    any_full = true;
  }
  if (!dst) {
    live->set(nullptr, nullptr);
    why = any_full ? "every decode instance is at its batch limit (--max-decode-batch)"
                   : "no decode instance is reachable";
    return any_full ? Place::kFull : Place::kNone;
  }
  live->set(d, p.get());  // (set before the prefill can fail, so abort() reaches both)
  // 2. The prefill instance fills those pages; a failure ends the request on the decode side.
  DecodeClient* decode = d->client;
  try {
    p->client->submit(req, std::move(*dst),
                      [decode, id](const std::string& error, const StepOutput& first) {
                        if (error.empty()) {
                          decode->prefilled(id, first);  // token 1: the decode side takes over
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
  if (live->aborted) {  // aborted while it was being placed from the queue
    p->client->abort(id);
    decode->abort(id);
  }
  return Place::kPlaced;
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
    if (out.finished) {
      forget();
      std::lock_guard<std::mutex> lock(reg->mu);  // (the router clears it before it goes)
      if (reg->on_finished) reg->on_finished();
    }
  };
  try {
    bool queued_before;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      queued_before = !queue_.empty();
    }
    std::string why;
    // FIFO: while others wait, a new request waits behind them.
    Place r = queued_before ? Place::kFull : place(req, live, relay, why);
    if (r == Place::kPlaced) return;
    if (r == Place::kNone) TANDEM_THROW(kIo, why);
    if (queued_before && decode_order().empty()) TANDEM_THROW(kIo, "no decode instance is ready");
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      TANDEM_CHECK_KIND(kOutOfResources, queue_.size() < config_.max_queue,
                        "every decode instance is at its batch limit (--max-decode-batch) and ",
                        queue_.size(), " requests wait in the router queue (--max-queue ",
                        config_.max_queue, ")");
      auto q = std::make_shared<Queued>();
      q->id = id;
      q->req = std::move(req);
      q->live = live;
      q->relay = std::move(relay);
      q->since = Clock::now();
      queue_.push_back(std::move(q));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      wake_ = true;
    }
    stop_cv_.notify_all();
  } catch (...) {
    forget();
    throw;
  }
}

void Router::finish(const std::string& id, const std::shared_ptr<Live>& live, FinishReason reason,
                    const std::string& error, int32_t retry_after_s) {
  StepOutput out;
  out.id = id;
  out.finished = true;
  out.finish_reason = reason;
  out.error = error;
  out.retry_after_s = retry_after_s;
  live->force(out);
  std::lock_guard<std::mutex> lock(reg_->mu);
  auto it = reg_->live.find(id);
  if (it != reg_->live.end() && it->second == live) reg_->live.erase(it);
}

void Router::drain_queue() {
  for (;;) {
    std::shared_ptr<Queued> q;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (queue_.empty()) return;
      q = queue_.front();
    }
    auto pop = [&] {
      std::lock_guard<std::mutex> lock(queue_mu_);
      auto it = std::find(queue_.begin(), queue_.end(), q);
      if (it == queue_.end()) return false;  // abort() took it
      queue_.erase(it);
      return true;
    };
    std::string why;
    Place r = Place::kFull;
    try {
      if (!q->live->aborted) r = place(q->req, q->live, q->relay, why);
    } catch (const Error& e) {
      if (pop()) finish(q->id, q->live, FinishReason::kError, e.message(), 0);
      continue;
    }
    if (r == Place::kPlaced || q->live->aborted) {
      if (pop() && q->live->aborted && r != Place::kPlaced) {
        finish(q->id, q->live, FinishReason::kAbort, "", 0);
      }
      continue;
    }
    // Nothing fits now: the ones past their deadline end (retryable), the rest wait.
    const auto now = Clock::now();
    std::vector<std::shared_ptr<Queued>> expired;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (now - (*it)->since >= config_.queue_timeout) {
          expired.push_back(*it);
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& e : expired) {
      finish(e->id, e->live, FinishReason::kError,
             "waited " + std::to_string(config_.queue_timeout.count() / 1000.0).substr(0, 5) +
                 " s in the router queue (--queue-timeout): " + why,
             1);
    }
    return;
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
  live->aborted = true;
  bool was_queued = false;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
      if ((*it)->live == live) {
        queue_.erase(it);
        was_queued = true;
        break;
      }
    }
  }
  if (was_queued) return finish(id, live, FinishReason::kAbort, "", 0);
  auto [d, p] = live->where();
  if (p) p->client->abort(id);
  if (d) d->client->abort(id);
}

void Router::monitor() {
  {
    std::lock_guard<std::mutex> lock(reg_->mu);
    reg_->on_finished = [this] {
      {
        std::lock_guard<std::mutex> l(mu_);
        wake_ = true;
      }
      stop_cv_.notify_all();
    };
  }
  auto last_refresh = Clock::time_point{};
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    stop_cv_.wait_for(lock, config_.health_interval, [&] { return stop_ || wake_; });
    if (stop_) break;
    wake_ = false;
    lock.unlock();
    resolve_watches(false);
    if (Clock::now() - last_refresh >= config_.health_interval) {
      refresh();
      last_refresh = Clock::now();
    }
    drain_queue();
    lock.lock();
  }
}

void Router::end_dead_decode(const std::shared_ptr<Decode>& d) {
  std::vector<std::pair<std::string, std::shared_ptr<Live>>> victims;
  {
    std::lock_guard<std::mutex> lock(reg_->mu);
    for (const auto& [id, live] : reg_->live) victims.emplace_back(id, live);
  }
  for (auto& [id, live] : victims) {
    auto [dd, p] = live->where();
    if (dd != d.get()) continue;
    if (p) p->client->abort(id);  // its KV has nowhere to go
    StepOutput out;
    out.id = id;
    out.finished = true;
    out.finish_reason = FinishReason::kError;
    out.error = "decode instance " + d->name + " failed";
    if (live->deliver(out)) {
      std::lock_guard<std::mutex> lock(reg_->mu);
      reg_->live.erase(id);
    }
  }
}

int64_t Router::max_model_len() const {
  const int64_t v = max_model_len_.load();
  return v > 0 ? v : int64_t(1) << 30;
}

int64_t Router::vocab_size() const {
  const int64_t v = vocab_size_.load();
  return v > 0 ? v : std::numeric_limits<int32_t>::max();
}

bool Router::ready() const {
  auto ps = prefills();
  auto ds = decodes();
  std::lock_guard<std::mutex> lock(load_mu_);
  auto usable = [](const auto& m) { return m->up && !m->draining; };
  const bool p = std::any_of(ps.begin(), ps.end(), usable);
  const bool d = std::any_of(ds.begin(), ds.end(), usable);
  return p && d;
}

RouterSnapshot Router::snapshot() const {
  RouterSnapshot s;
  auto ps = prefills();
  auto ds = decodes();
  {
    std::lock_guard<std::mutex> lock(load_mu_);
    for (auto& p : ps) {
      s.prefill.push_back(p->load);
      s.prefill.back().alive = p->up;
      s.prefill_names.push_back(p->name);
    }
    for (auto& d : ds) {
      s.decode.push_back(d->load);
      s.decode.back().alive = d->up;
      s.decode_names.push_back(d->name);
    }
  }
  {
    std::lock_guard<std::mutex> lock(reg_->mu);
    s.live_requests = static_cast<int64_t>(reg_->live.size());
  }
  s.routed_prompt_tokens = routed_prompt_.load();
  s.routed_cached_tokens = routed_cached_.load();
  s.kv_event_batches_lost = events_lost_.load();
  s.prefix_index_blocks = index_.size();
  std::lock_guard<std::mutex> lock(queue_mu_);
  s.queued_requests = static_cast<int64_t>(queue_.size());
  return s;
}

EngineStats Router::stats() const {
  RouterSnapshot s = snapshot();
  // The usable decode instances' engine counters, summed: KV pages, prefix cache, preemptions,
  // MTP counters and histograms; the request and token counts are the router's own (below).
  EngineStats st;
  for (const auto& d : decodes()) {
    {
      std::lock_guard<std::mutex> lock(load_mu_);
      if (!d->up) continue;
    }
    if (auto* remote = dynamic_cast<RemoteDecode*>(d->client)) {
      st.add(remote->stats());
    } else if (auto* local = dynamic_cast<DecodeInstance*>(d->client)) {
      st.add(local->stats());
    }
  }
  st.running = st.waiting = st.prompt_tokens = 0;
  for (const auto& p : s.prefill) {
    if (!p.alive) continue;
    st.queue_time.add(p.queue_time);
    st.iteration_tokens.add(p.iteration_tokens);
  }
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
  std::string out = instances_metrics_text(p, d);
  out +=
      "# HELP tandem_instance_info The address of each instance.\n"
      "# TYPE tandem_instance_info gauge\n";
  for (size_t i = 0; i < s.prefill.size(); ++i) {
    out += "tandem_instance_info{role=\"prefill\",instance=\"" + std::to_string(i) +
           "\",address=\"" + s.prefill_names[i] + "\"} 1\n";
  }
  for (size_t i = 0; i < s.decode.size(); ++i) {
    out += "tandem_instance_info{role=\"decode\",instance=\"" + std::to_string(i) +
           "\",address=\"" + s.decode_names[i] + "\"} 1\n";
  }
  out +=
      "# HELP tandem_router_queued_requests Requests waiting in the router for a decode slot.\n"
      "# TYPE tandem_router_queued_requests gauge\ntandem_router_queued_requests " +
      std::to_string(s.queued_requests) + "\n";
  out +=
      "# HELP tandem_router_prompt_tokens_total Prompt tokens routed to prefill instances.\n"
      "# TYPE tandem_router_prompt_tokens_total counter\ntandem_router_prompt_tokens_total " +
      std::to_string(s.routed_prompt_tokens) +
      "\n# HELP tandem_router_prefix_hit_tokens_total Of them, held by the picked instance (the "
      "prefix index's view).\n# TYPE tandem_router_prefix_hit_tokens_total counter\n"
      "tandem_router_prefix_hit_tokens_total " +
      std::to_string(s.routed_cached_tokens) +
      "\n# HELP tandem_router_kv_event_batches_lost_total KV event batches lost (the instance "
      "fell back to least-queued).\n# TYPE tandem_router_kv_event_batches_lost_total counter\n"
      "tandem_router_kv_event_batches_lost_total " +
      std::to_string(s.kv_event_batches_lost) +
      "\n# HELP tandem_router_prefix_index_blocks Page hashes in the router's prefix index.\n"
      "# TYPE tandem_router_prefix_index_blocks gauge\ntandem_router_prefix_index_blocks " +
      std::to_string(s.prefix_index_blocks) + "\n";
  return out;
}

}  // namespace tandem
