#include "server/replica_router.h"

#include <algorithm>
#include <iostream>

#include "core/error.h"
#include "disagg/instance_api.h"
#include "events/zmq_subscriber.h"
#include "net/address.h"

namespace tandem {

struct ReplicaRouter::Replica {
  std::string name;
  std::unique_ptr<RemoteReplica> client;
  std::unique_ptr<ZmqKvEventSubscriber> events;
  // Under mu_:
  bool up = false;
  int64_t pending_tokens = 0;  // prompt tokens placed here whose first output has not come
};

ReplicaRouter::ReplicaRouter(const std::vector<std::string>& endpoints, RouterConfig config)
    : config_(std::move(config)), index_(config_.prefix_index_blocks) {
  TANDEM_CHECK_KIND(kInvalidArgument, !endpoints.empty(), "the router needs a replica");
  for (const std::string& e : endpoints) {
    auto r = std::make_unique<Replica>();
    r->name = e;
    r->client = std::make_unique<RemoteReplica>(e, config_.cluster_key);
    const int id = static_cast<int>(replicas_.size());
    const auto i = static_cast<size_t>(id);
    KvEventSubscriberConfig sc;
    sc.topic = config_.kv_events_topic;
    if (i < config_.kv_events_endpoints.size()) {
      sc.endpoint = config_.kv_events_endpoints[i];
      if (i < config_.kv_events_replay_endpoints.size()) {
        sc.replay_endpoint = config_.kv_events_replay_endpoints[i];
      }
    } else if (config_.kv_events_port > 0) {
      const std::string host = net::split_host_port(e, "replica address").host;
      sc.endpoint = "tcp://" + net::join_host_port(host, config_.kv_events_port);
      if (config_.kv_events_replay_port > 0) {
        sc.replay_endpoint = "tcp://" + net::join_host_port(host, config_.kv_events_replay_port);
      }
    }
    if (!sc.endpoint.empty() && id < PrefixIndex::kMaxInstances) {
      indexed_ = true;
      r->events = std::make_unique<ZmqKvEventSubscriber>(
          sc, [this, id](int64_t, DecodedKvEventBatch&& b) { index_.apply(id, b.events); },
          [this, id](int64_t, int64_t) {
            events_lost_.fetch_add(1);
            index_.forget(id);
          });
    }
    replicas_.push_back(std::move(r));
  }
  for (auto& r : replicas_) r->up = r->client->load();
  monitor_ = std::thread([this] { monitor(); });
}

ReplicaRouter::~ReplicaRouter() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  monitor_.join();
  for (auto& r : replicas_) r->events.reset();  // (their callbacks reach index_)
  for (auto& r : replicas_) r->client.reset();
}

void ReplicaRouter::monitor() {
  std::unique_lock<std::mutex> lock(stop_mu_);
  while (!stop_) {
    lock.unlock();
    for (auto& r : replicas_) {
      const bool up = r->client->load() && !r->client->draining();
      std::lock_guard<std::mutex> l(mu_);
      if (up != r->up) {
        std::string line = "replica " + r->name + (up ? " up" : " down");
        if (config_.log) {
          config_.log(line);
        } else {
          std::cerr << "tandem: router: " << line << std::endl;
        }
      }
      r->up = up;
    }
    lock.lock();
    stop_cv_.wait_for(lock, config_.health_interval, [this] { return stop_; });
  }
}

int ReplicaRouter::pick(const std::vector<int32_t>& prompt, int64_t& new_tokens) {
  std::vector<int64_t> held;
  if (indexed_) held = index_.match(prompt, PrefixIndex::kMaxInstances);
  std::vector<PrefillCandidate> c(replicas_.size());
  for (size_t i = 0; i < replicas_.size(); ++i) {
    c[i].usable = replicas_[i]->up;
    c[i].queued_tokens = replicas_[i]->pending_tokens;
    if (i < held.size()) c[i].cached_tokens = held[i];
  }
  const int k = pick_prefix_aware(c, static_cast<int64_t>(prompt.size()));
  if (k >= 0) {
    new_tokens = static_cast<int64_t>(prompt.size()) - c[static_cast<size_t>(k)].cached_tokens;
    routed_prompt_ += static_cast<int64_t>(prompt.size());
    routed_cached_ += c[static_cast<size_t>(k)].cached_tokens;
  }
  return k;
}

void ReplicaRouter::submit(GenRequest request, OutputCallback on_output) {
  const std::string id = request.id;
  // A replica that turns out to be gone (its connection lost since the last poll) is marked
  // down and the request goes to the next pick: it has not started anywhere.
  for (size_t attempt = 0;; ++attempt) {
    int64_t new_tokens = 0;
    int k = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      k = pick(request.prompt_ids, new_tokens);
      TANDEM_CHECK_KIND(kIo, k >= 0, "no replica is ready");
      replicas_[static_cast<size_t>(k)]->pending_tokens += new_tokens;
      live_[id] = k;
    }
    auto started = std::make_shared<std::atomic<bool>>(false);
    auto settle = [this, k, new_tokens, started] {  // its prompt is no longer pending there
      if (started->exchange(true)) return;
      std::lock_guard<std::mutex> lock(mu_);
      replicas_[static_cast<size_t>(k)]->pending_tokens -= new_tokens;
    };
    try {
      replicas_[static_cast<size_t>(k)]->client->submit(
          request, [this, id, settle, on_output](const StepOutput& out) {
            settle();
            if (out.finished) {
              std::lock_guard<std::mutex> lock(mu_);
              live_.erase(id);
            }
            on_output(out);
          });
      if (indexed_) index_.predict(k, request.prompt_ids);
      return;
    } catch (const Error& e) {
      settle();
      std::lock_guard<std::mutex> lock(mu_);
      live_.erase(id);
      if (e.kind() != ErrorKind::kIo || attempt + 1 >= replicas_.size()) throw;
      replicas_[static_cast<size_t>(k)]->up = false;  // (the monitor brings it back)
    } catch (...) {
      settle();
      std::lock_guard<std::mutex> lock(mu_);
      live_.erase(id);
      throw;
    }
  }
}

void ReplicaRouter::abort(const std::string& id) {
  int k = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(id);
    if (it == live_.end()) return;
    k = it->second;
  }
  replicas_[static_cast<size_t>(k)]->client->abort(id);
}

EngineStats ReplicaRouter::stats() const {
  EngineStats s;
  for (const auto& r : replicas_) s.add(r->client->stats());
  return s;
}

int64_t ReplicaRouter::max_model_len() const {
  int64_t m = 0;
  for (const auto& r : replicas_) m = std::max(m, r->client->max_model_len());
  return m > 0 ? m : int64_t{1} << 40;  // (none seen yet: refused as unavailable, not as too long)
}

int64_t ReplicaRouter::vocab_size() const {
  for (const auto& r : replicas_) {
    if (r->client->vocab_size() > 0) return r->client->vocab_size();
  }
  return 0;
}

bool ReplicaRouter::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& r : replicas_) {
    if (r->up) return true;
  }
  return false;
}

std::string ReplicaRouter::metrics_text() const {
  std::string out =
      "# HELP tandem_replica_up Whether the replica answers.\n# TYPE tandem_replica_up gauge\n";
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& r : replicas_) {
    out += "tandem_replica_up{address=\"" + r->name + "\"} " + (r->up ? "1" : "0") + "\n";
  }
  out +=
      "# HELP tandem_replica_pending_prompt_tokens Prompt tokens placed on the replica, not "
      "started yet.\n# TYPE tandem_replica_pending_prompt_tokens gauge\n";
  for (const auto& r : replicas_) {
    out += "tandem_replica_pending_prompt_tokens{address=\"" + r->name + "\"} " +
           std::to_string(r->pending_tokens) + "\n";
  }
  out +=
      "# HELP tandem_router_prompt_tokens_total Prompt tokens routed.\n"
      "# TYPE tandem_router_prompt_tokens_total counter\ntandem_router_prompt_tokens_total " +
      std::to_string(routed_prompt_.load()) +
      "\n# HELP tandem_router_prefix_hit_tokens_total Of them, held by the picked replica (the "
      "prefix index's view).\n# TYPE tandem_router_prefix_hit_tokens_total counter\n"
      "tandem_router_prefix_hit_tokens_total " +
      std::to_string(routed_cached_.load()) +
      "\n# HELP tandem_router_kv_event_batches_lost_total KV event batches lost.\n"
      "# TYPE tandem_router_kv_event_batches_lost_total counter\n"
      "tandem_router_kv_event_batches_lost_total " +
      std::to_string(events_lost_.load()) + "\n";
  return out;
}

}  // namespace tandem
