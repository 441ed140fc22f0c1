// A deterministic EngineClient for the HTTP tests: a thread that emits one token per step
// for every live request, next = (last * 31 + 7) % vocab, starting from the last prompt id.
// Honours max_tokens, stop_token_ids, eos / ignore_eos, min_tokens and abort; fakes logprobs.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "engine/request.h"

namespace tandem::testing {

class FakeEngine final : public EngineClient {
 public:
  struct Options {
    int64_t vocab = 1000;
    int64_t max_model_len = 4096;
    int32_t eos = -1;         // -1: no EOS
    int64_t max_live = 4096;  // submit beyond this throws kOutOfResources
    std::chrono::microseconds step{1000};
    /// A request whose prompt ends in a key emits that script first, then the formula.
    std::map<int32_t, std::vector<int32_t>> scripts;
  };

  explicit FakeEngine(Options o) : opt_(o), thread_([this] { loop(); }) {}
  FakeEngine() : FakeEngine(Options{}) {}
  ~FakeEngine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  /// The tokens a request generates alone (before stop ids / EOS are applied).
  static int32_t next_token(int32_t last, int64_t vocab) {
    return int32_t((int64_t(last) * 31 + 7) % vocab);
  }

  void submit(GenRequest r, OutputCallback cb) override {
    TANDEM_CHECK_KIND(kInvalidArgument, !r.prompt_ids.empty(), "empty prompt");
    TANDEM_CHECK_KIND(kInvalidArgument,
                      int64_t(r.prompt_ids.size()) + r.max_tokens <= opt_.max_model_len, "prompt (",
                      r.prompt_ids.size(), ") + max_tokens (", r.max_tokens,
                      ") is over the model length ", opt_.max_model_len);
    std::lock_guard<std::mutex> lock(mu_);
    TANDEM_CHECK_KIND(kOutOfResources, int64_t(live_.size()) < opt_.max_live, "waiting queue full");
    TANDEM_CHECK_KIND(kInvalidArgument, !live_.count(r.id), "duplicate id ", r.id);
    submitted_.push_back(r);
    Live l;
    l.last = r.prompt_ids.back();
    l.request = std::move(r);
    l.cb = std::move(cb);
    std::string id = l.request.id;
    live_.emplace(id, std::move(l));
    cv_.notify_all();
  }

  void abort(const std::string& id) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (live_.count(id)) {
      aborted_.push_back(id);
      pending_aborts_.insert(id);
    }
    cv_.notify_all();
  }

  EngineStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    EngineStats s;
    s.running = int64_t(live_.size());
    s.waiting = 0;
    s.kv_pages_total = 100;
    s.kv_pages_free = 100 - int64_t(live_.size());
    s.prefix_cache_queries = 10;
    s.prefix_cache_hits = 5;
    s.generation_tokens = generated_;
    return s;
  }
  int64_t max_model_len() const override { return opt_.max_model_len; }
  int64_t vocab_size() const override { return opt_.vocab; }

  // --- for tests ---
  std::vector<std::string> aborted() const {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_;
  }
  std::vector<GenRequest> submitted() const {
    std::lock_guard<std::mutex> lock(mu_);
    return submitted_;
  }
  size_t live() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }
  /// Waits until no request is live; false on timeout.
  bool wait_idle(std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) const {
    auto until = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < until) {
      if (live() == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return live() == 0;
  }
  /// From now on every request fails with kError after this many tokens (-1: never).
  void set_error_after(int n) { error_after_ = n; }
  /// The failures of set_error_after carry this retry_after_s (a request never started).
  void set_retry_after(int s) { retry_after_ = s; }
  /// Pauses / resumes token generation (to hold requests live).
  void set_paused(bool p) {
    paused_ = p;
    cv_.notify_all();
  }

  /// Fake logprob of `id` at output position `pos`.
  static float fake_logprob(int32_t id) { return -0.25f - 0.125f * float(id % 8); }

 private:
  struct Live {
    GenRequest request;
    OutputCallback cb;
    int32_t last = 0;
    int32_t generated = 0;
    bool first = true;
  };

  void fill_first(const GenRequest& r, StepOutput& out) {
    out.num_cached_prompt_tokens = int32_t(r.prompt_ids.size() / 2);
    if (r.sampling.prompt_logprobs < 0) return;
    for (size_t j = 1; j < r.prompt_ids.size(); ++j) {
      int32_t id = r.prompt_ids[j];
      out.prompt_token_logprobs.push_back(fake_logprob(id));
      out.prompt_top_logprobs.push_back(top(id, r.sampling.prompt_logprobs));
    }
  }

  std::vector<TokenLogprob> top(int32_t id, int32_t n) const {
    std::vector<TokenLogprob> t;
    for (int32_t i = 0; i < n; ++i) {
      t.push_back({int32_t((id + i) % opt_.vocab), fake_logprob(id) - 0.5f * float(i)});
    }
    return t;
  }

  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, opt_.step, [&] { return stop_; });
      if (stop_) break;
      std::vector<std::pair<OutputCallback, StepOutput>> outs;
      for (auto it = live_.begin(); it != live_.end();) {
        Live& l = it->second;
        const GenRequest& r = l.request;
        StepOutput out;
        out.id = r.id;
        if (l.first) fill_first(r, out);
        if (pending_aborts_.erase(r.id)) {
          out.finished = true;
          out.finish_reason = FinishReason::kAbort;
        } else if (paused_) {
          ++it;
          continue;
        } else if (error_after_ >= 0 && l.generated >= error_after_) {
          out.finished = true;
          out.finish_reason = FinishReason::kError;
          out.error = "fake engine failure";
          out.retry_after_s = retry_after_;
        } else {
          auto script = opt_.scripts.find(r.prompt_ids.back());
          int32_t tok = script != opt_.scripts.end() && size_t(l.generated) < script->second.size()
                            ? script->second[size_t(l.generated)]
                            : next_token(l.last, opt_.vocab);
          l.last = tok;
          ++l.generated;
          ++generated_;
          out.token_ids.push_back(tok);
          if (r.sampling.logprobs >= 0) {
            out.token_logprobs.push_back(fake_logprob(tok));
            if (r.sampling.logprobs > 0)
              out.top_logprobs.push_back(top(tok, r.sampling.logprobs));
            else
              out.top_logprobs.push_back({});
          }
          const bool can_stop = l.generated > r.min_tokens;
          const bool is_stop = std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), tok) !=
                               r.stop_token_ids.end();
          const bool is_eos = tok == opt_.eos && !r.ignore_eos;
          if (can_stop && (is_stop || is_eos)) {
            out.finished = true;
            out.finish_reason = FinishReason::kStop;
            out.stop_token_id = tok;
          } else if (l.generated >= r.max_tokens) {
            out.finished = true;
            out.finish_reason = FinishReason::kLength;
          }
        }
        l.first = false;
        if (out.finished) {
          outs.emplace_back(std::move(l.cb), std::move(out));
          it = live_.erase(it);
        } else {
          outs.emplace_back(l.cb, std::move(out));
          ++it;
        }
      }
      lock.unlock();
      for (auto& [cb, out] : outs) cb(out);
      lock.lock();
    }
  }

  Options opt_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Live> live_;
  std::set<std::string> pending_aborts_;
  std::vector<std::string> aborted_;
  std::vector<GenRequest> submitted_;
  int64_t generated_ = 0;
  std::atomic<int> error_after_{-1};
  std::atomic<int> retry_after_{0};
  std::atomic<bool> paused_{false};
  bool stop_ = false;
  std::thread thread_;  // NOTE: last member: started after the others exist
};

/// The tokens the fake engine generates for a prompt ending in `last` (no stop ids, no EOS).
inline std::vector<int32_t> fake_tokens(int32_t last, int n, int64_t vocab = 1000) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    last = FakeEngine::next_token(last, vocab);
    out.push_back(last);
  }
  return out;
}

}  // namespace tandem::testing
