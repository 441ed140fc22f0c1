#include "server/startup.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace tandem {

namespace {

double secs(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::string gb(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GB", double(bytes) / 1e9);
  return buf;
}

}  // namespace

StartupMonitor::StartupMonitor(std::ostream& log, std::chrono::milliseconds print_every)
    : log_(log), print_every_(print_every), t0_(Clock::now()), phase_t0_(t0_) {}

void StartupMonitor::end_phase_locked(Clock::time_point now) {
  if (phase_.empty()) return;
  const double s = secs(now - phase_t0_);
  done_.emplace_back(phase_, s);
  if (phase_ == "weights" && bytes_read_ > 0) print_progress_locked(now, /*final=*/true);
  char buf[160];
  std::snprintf(buf, sizeof buf, "tandem: startup: %-9s %8.2f s\n", phase_.c_str(), s);
  log_ << buf << std::flush;
  phase_.clear();
}

void StartupMonitor::phase(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  end_phase_locked(now);
  phase_ = name;
  phase_t0_ = now;
}

void StartupMonitor::ready() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  end_phase_locked(now);
  ready_ = true;
  char buf[160];
  std::snprintf(buf, sizeof buf, "tandem: startup: ready in %.2f s\n", secs(now - t0_));
  log_ << buf << std::flush;
}

bool StartupMonitor::is_ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_;
}

std::vector<std::pair<std::string, double>> StartupMonitor::phases() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::string StartupMonitor::status_json() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (ready_) return "";
  const auto now = Clock::now();
  nlohmann::ordered_json j;
  j["status"] = "starting";
  j["phase"] = phase_.empty() ? "init" : phase_;
  j["elapsed_s"] = secs(now - t0_);
  nlohmann::ordered_json ph = nlohmann::ordered_json::array();
  for (const auto& [n, s] : done_) ph.push_back({{"name", n}, {"seconds", s}});
  j["phases"] = ph;
  uint64_t total = 0;
  for (const auto& [d, t] : totals_) total += t;
  if (total > 0) {
    const double el = reading_ ? secs(now - first_read_) : 0.0;
    const double rate = el > 0 ? double(bytes_read_) / el : 0.0;
    nlohmann::ordered_json w;
    w["bytes_read"] = bytes_read_;
    w["bytes_total"] = total;
    w["bytes_per_s"] = rate;
    w["eta_s"] = rate > 0 && total > bytes_read_ ? double(total - bytes_read_) / rate : 0.0;
    j["weights"] = w;
  }
  if (graphs_total_ > 0) j["graphs"] = {{"captured", graphs_done_}, {"total", graphs_total_}};
  return j.dump();
}

void StartupMonitor::on_checkpoint(const std::string& dir, uint64_t total_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t& t = totals_[dir];
  t = std::max(t, total_bytes);
}

void StartupMonitor::on_tensor(const std::string& dir, const std::string& name, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!seen_.insert(dir + '\n' + name).second) return;
  const auto now = Clock::now();
  if (!reading_) {
    reading_ = true;
    first_read_ = last_print_ = now;
  }
  bytes_read_ += bytes;
  if (now - last_print_ >= print_every_) print_progress_locked(now, /*final=*/false);
}

void StartupMonitor::on_graph(int64_t batch, int64_t done, int64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  graphs_done_ = done;
  graphs_total_ = total;
  const auto now = Clock::now();
  if (done != total && now - last_graph_print_ < print_every_) return;
  last_graph_print_ = now;
  char buf[160];
  std::snprintf(buf, sizeof buf, "tandem: graphs %lld / %lld captured (batch %lld)\n",
                static_cast<long long>(done), static_cast<long long>(total),
                static_cast<long long>(batch));
  log_ << buf << std::flush;
}

// "tandem: weights 12.30 / 61.00 GB (20%), 4.10 GB/s, ETA 12 s"
void StartupMonitor::print_progress_locked(Clock::time_point now, bool final) {
  last_print_ = now;
  uint64_t total = 0;
  for (const auto& [d, t] : totals_) total += t;
  const double el = secs(now - first_read_);
  const double rate = el > 0 ? double(bytes_read_) / el : 0.0;
  char buf[200];
  if (final) {
    std::snprintf(buf, sizeof buf, "tandem: weights %s read in %.2f s (%.2f GB/s)\n",
                  gb(bytes_read_).c_str(), el, rate / 1e9);
  } else {
    const double eta = rate > 0 && total > bytes_read_ ? double(total - bytes_read_) / rate : 0.0;
    std::snprintf(buf, sizeof buf, "tandem: weights %s / %s (%d%%), %.2f GB/s, ETA %.0f s\n",
                  gb(bytes_read_).c_str(), gb(total).c_str(),
                  total > 0 ? static_cast<int>(100.0 * double(bytes_read_) / double(total)) : 0,
                  rate / 1e9, eta);
  }
  log_ << buf << std::flush;
}

uint64_t raise_open_file_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  if (r.rlim_cur < r.rlim_max) {
    rlimit want = r;
    want.rlim_cur = r.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &want) == 0) r = want;
  }
  return static_cast<uint64_t>(r.rlim_cur);
}

void DeferredEngineClient::set(EngineClient* engine) {
  engine_.store(engine, std::memory_order_release);
}

namespace {
EngineClient& started(const std::atomic<EngineClient*>& e) {
  EngineClient* p = e.load(std::memory_order_acquire);
  TANDEM_CHECK_KIND(kOutOfResources, p != nullptr, "the server is starting; retry later");
  return *p;
}
}  // namespace

void DeferredEngineClient::submit(GenRequest request, OutputCallback on_output) {
  started(engine_).submit(std::move(request), std::move(on_output));
}
void DeferredEngineClient::abort(const std::string& id) {
  if (EngineClient* p = engine_.load(std::memory_order_acquire)) p->abort(id);
}
EngineStats DeferredEngineClient::stats() const {
  EngineClient* p = engine_.load(std::memory_order_acquire);
  return p ? p->stats() : EngineStats{};
}
int64_t DeferredEngineClient::max_model_len() const {
  EngineClient* p = engine_.load(std::memory_order_acquire);
  return p ? p->max_model_len() : 0;
}
int64_t DeferredEngineClient::vocab_size() const {
  EngineClient* p = engine_.load(std::memory_order_acquire);
  return p ? p->vocab_size() : 0;
}
bool DeferredEngineClient::supports_constraints() const {
  EngineClient* p = engine_.load(std::memory_order_acquire);
  return p ? p->supports_constraints() : false;
}
bool DeferredEngineClient::constraints_from_spec() const {
  EngineClient* p = engine_.load(std::memory_order_acquire);
  return p ? p->constraints_from_spec() : false;
}
std::vector<int32_t> DeferredEngineClient::eos_token_ids() const {
  EngineClient* p = engine_.load(std::memory_order_acquire);
  return p ? p->eos_token_ids() : std::vector<int32_t>{};
}

}  // namespace tandem
