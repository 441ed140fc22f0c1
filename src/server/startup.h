// Start-up that a person can watch (`tandem serve`): each phase (tokenizer, weights, mtp,
// kv_cache, graphs) is printed with its time, the weights' load with bytes, rate and ETA (the
// checkpoint's LoadObserver, model/load_progress.h), and the HTTP front listens from the start:
// GET /health and /ready answer 503 with status_json() (the phase, its progress) until ready(),
// then 200; API routes answer 503 meanwhile (HttpServerConfig::startup_status).
//
//   StartupMonitor mon(std::cerr);
//   DeferredEngineClient client;               // what the HTTP front serves from the start
//   cfg.startup_status = [&] { return mon.status_json(); };
//   mon.phase("weights");  { ScopedLoadObserver o(&mon); load...; }
//   mon.phase("kv_cache"); AsyncEngine engine(...);   // EngineConfig::on_startup_phase -> "graphs"
//   client.set(&engine); mon.ready();
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/request.h"
#include "model/load_progress.h"

namespace tandem {

class StartupMonitor final : public LoadObserver {
 public:
  /// Lines go to `log`; `print_every` bounds how often a weights progress line is printed.
  explicit StartupMonitor(std::ostream& log,
                          std::chrono::milliseconds print_every = std::chrono::seconds(2));

  /// Ends the current phase (printing its time) and starts `name`.
  void phase(const std::string& name);
  /// Ends the last phase and prints the time to ready; status_json() is "" from now on.
  void ready();
  bool is_ready() const;
  /// While starting: {"status": "starting", "phase", "elapsed_s", "phases": [{"name",
  /// "seconds"}...], "weights": {"bytes_read", "bytes_total", "bytes_per_s", "eta_s"}}; "" once
  /// ready.
  std::string status_json() const;
  /// The phases that ended, with their seconds.
  std::vector<std::pair<std::string, double>> phases() const;

  // LoadObserver (any thread).
  void on_checkpoint(const std::string& dir, uint64_t total_bytes) override;
  void on_tensor(const std::string& dir, const std::string& name, uint64_t bytes) override;
  void on_graph(int64_t batch, int64_t done, int64_t total) override;

 private:
  using Clock = std::chrono::steady_clock;
  void end_phase_locked(Clock::time_point now);
  void print_progress_locked(Clock::time_point now, bool final);

  std::ostream& log_;
  const std::chrono::milliseconds print_every_;
  mutable std::mutex mu_;
  const Clock::time_point t0_;
  std::string phase_;
  Clock::time_point phase_t0_;
  std::vector<std::pair<std::string, double>> done_;
  bool ready_ = false;
  // Weights: per directory its total; tensors read once each.
  std::map<std::string, uint64_t> totals_;
  std::set<std::string> seen_;
  uint64_t bytes_read_ = 0;
  Clock::time_point first_read_{}, last_print_{};
  bool reading_ = false;
  int64_t graphs_done_ = 0, graphs_total_ = 0;
  Clock::time_point last_graph_print_{};
};

/// Raises this process's open-file limit to its hard limit (as vLLM and SGLang do at start): a
/// server or a load client with 1,024 streams needs more than the usual soft limit of 1,024
/// descriptors. Returns the limit now in force.
uint64_t raise_open_file_limit();

/// The EngineClient the HTTP front serves while the engine does not exist yet: forwards to the
/// engine once set(); before that, submit() refuses (kOutOfResources: "starting") and stats()
/// is empty. set() is called once, before start-up ends.
class DeferredEngineClient final : public EngineClient {
 public:
  void set(EngineClient* engine);
  void submit(GenRequest request, OutputCallback on_output) override;
  void abort(const std::string& id) override;
  EngineStats stats() const override;
  int64_t max_model_len() const override;
  int64_t vocab_size() const override;
  bool supports_constraints() const override;
  bool constraints_from_spec() const override;
  std::vector<int32_t> eos_token_ids() const override;

 private:
  std::atomic<EngineClient*> engine_{nullptr};
};

}  // namespace tandem
