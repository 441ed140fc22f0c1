// A decode instance (DESIGN.md sections 1, 3, 4): DP=d attention + EP=d MoE. d ranks, each an
// Engine over its shard of the model with its own KV cache and requests, stepping in lockstep
// (the MoE all-to-all is collective, so a rank with nothing to do still forwards an empty
// batch). Requests arrive prefilled: accept() reserves pages on the least-loaded rank and
// expects the transfer there (each rank has its own transfer receiver writing into its KV
// cache); once the KV is complete and the prefill's first output arrived (prefilled()), the
// request is admitted on that rank.
//
//   DecodeInstance decode(cfg);                                  // loads d shards, d threads
//   auto dst = decode.accept(req, prefill.kv_sharding(), out);   // nullopt: no rank has room
//   prefill.submit(req, *dst, on_done);   // KV -> dst; on_done(first) -> decode.prefilled()
//   // ... tokens stream through `out` from the rank's thread.
//
// The ranks run as threads of this process (a thread-local communicator group) or one process
// per rank (e.g. Gloo from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); both run the same
// loop: rank 0 holds the registry, and each lockstep iteration it broadcasts the commands of the
// client calls (reserve on rank r, admit, release, abort: disagg/protocol.h), every rank applies
// its own and steps, and rank 0 gathers what each rank produced (reservations with the rank's
// receiver address, outputs, transfer events, load).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "disagg/instance_parts.h"
#include "disagg/protocol.h"
#include "engine/engine.h"
#include "transfer/transfer.h"

namespace tandem {

namespace comm {
class Communicator;
}

/// Batch size per rank against the limit (exported on /metrics, read by the router).
struct DecodeLoad {
  std::vector<int64_t> batch_per_rank;  // running + waiting + reserved, per DP rank
  int64_t max_decode_batch = 0;         // per rank
  bool alive = true;
  /// Free KV pages per rank as last reported (this process's instance only: not on the wire).
  std::vector<int64_t> kv_pages_free_per_rank;
  /// The smallest rank batch: where the next request would go.
  int64_t min_batch() const;
  int64_t total_batch() const;
  bool has_room() const { return alive && min_batch() < max_decode_batch; }
};

/// What the router needs of a decode instance (this process's DecodeInstance, or a remote one
/// through disagg/instance_api). Thread-safe.
class DecodeClient {
 public:
  virtual ~DecodeClient() = default;
  /// Validates the request (throws Error(kInvalidArgument)), reserves KV pages for its prompt
  /// on the least-loaded rank with room under max_decode_batch, expects its KV from a prefill
  /// instance sharded as `src`, and registers on_output, which from then on gets exactly one
  /// finished callback. nullopt when no rank has room or pages.
  virtual std::optional<transfer::TransferDescriptor> accept(const GenRequest& req,
                                                             const transfer::KvSharding& src,
                                                             OutputCallback on_output) = 0;
  /// The prefill instance's first output of an accepted request (token 1, its logprobs, the
  /// prompt logprobs): the request starts once this and its KV have arrived.
  virtual void prefilled(const std::string& id, const StepOutput& first) = 0;
  /// Ends an accepted request whose prefill failed: pages released, finished with kError.
  virtual void fail(const std::string& id, const std::string& error) = 0;
  /// Ends a request (accepted or running) with kAbort; pages freed at once.
  virtual void abort(const std::string& id) = 0;
  virtual DecodeLoad load() const = 0;
  virtual int64_t max_model_len() const = 0;
  virtual int64_t vocab_size() const = 0;
};

struct DecodeInstanceConfig {
  std::string model_dir;
  int dp = 1;                         // ranks (DP = EP)
  EngineConfig engine;                // per rank
  int64_t max_decode_batch = 32;      // sequences per rank (running + waiting + reserved)
  std::string kv_host = "127.0.0.1";  // the transfer receivers listen here (free ports)
  // NOTE: a receiver fails a transfer after this long without data, counted from accept():
  // it covers the request's wait in the prefill queue, hence longer than the backend default.
  std::chrono::milliseconds transfer_timeout{std::chrono::minutes(10)};
  /// The parts (instance_parts.h); empty: Qwen3MoeCpu from model_dir and the host TCP backend
  /// (bound to kv_host, with transfer_timeout). A given backend brings its own settings.
  ModelFactory model;
  std::shared_ptr<transfer::TransferBackend> transfer;
  /// MTP speculative decoding (engine.num_speculative_tokens > 0): the directory of the MTP
  /// layer's weights, loaded into every rank's model (Model::load_mtp). Qwen3-MoE: attention,
  /// fc, norms and router whole on every rank, the MoE block's experts sharded as the target's
  /// (each rank its own) and run through the same EP all-to-all, so every rank runs
  /// num_speculative_tokens MTP passes in every step, empty ones included
  /// (Model::mtp_collective, Engine::pad_mtp_passes); the verify is the rank's ordinary
  /// lockstep forward. A rank's steady steps run fused (Model::forward_verify_draft: the
  /// verify, pass 0 and the K - 1 chained passes in one call), whatever its peers run.
  /// Hybrids (Qwen3.5): the MTP layer whole on every rank (its passes rank-local), a rejected
  /// draft's state rolled back by a rank-local replay (Model::replay_states); refused with
  /// dp > 1 only when the replay is off (the rollback would be a forward only some ranks run).
  std::string mtp_dir;
};

class DecodeInstance final : public DecodeClient {
 public:
  /// Loads the d shards and starts the rank threads; throws what loading throws.
  explicit DecodeInstance(DecodeInstanceConfig config);
  /// One process per rank: this process is rank comm->rank() of comm->world_size() (= dp).
  /// Collective: every rank's process constructs one. Only rank 0 serves the client calls.
  DecodeInstance(DecodeInstanceConfig config, std::unique_ptr<comm::Communicator> comm);
  /// Stops the ranks; every live request gets a finished callback (kAbort).
  ~DecodeInstance() override;

  std::optional<transfer::TransferDescriptor> accept(const GenRequest& req,
                                                     const transfer::KvSharding& src,
                                                     OutputCallback on_output) override;
  void prefilled(const std::string& id, const StepOutput& first) override;
  void fail(const std::string& id, const std::string& error) override;
  void abort(const std::string& id) override;
  DecodeLoad load() const override;
  int64_t max_model_len() const override;
  int64_t vocab_size() const override;

  /// Tests: stops like a crashed process - the ranks and the KV receiver stop, no callback
  /// runs any more, load().alive turns false.
  void kill();
  /// Blocks until this process's ranks have stopped (rank 0 stopping, or a failure).
  void wait();
  /// True where the client calls work (rank 0 is here).
  bool is_leader() const { return first_rank_ == 0; }
  /// Summed engine counters of the ranks (of this process's rank only, in a process group).
  EngineStats stats() const;

 private:
  struct Rank;
  struct Pending {  // accepted, not admitted yet
    GenRequest req;
    OutputCallback on_output;
    int rank = 0;
    std::vector<int32_t> pages;
    bool kv_done = false;    // the transfer completed
    bool has_first = false;  // prefilled() arrived
    StepOutput first;
  };

  // Every rank's loop, threads and processes alike: rank 0's commands (the client calls since
  // the last iteration) to every rank, a step when any rank has work, each rank's report back.
  void rank_main(Rank& rank);
  void rank_loop(Rank& rank);
  /// Loads the MTP layer (config_.mtp_dir) into a rank's model; hybrids refused with dp > 1
  /// when the state replay is off.
  void load_mtp(Model& model) const;
  void init_receivers();
  std::vector<uint8_t> take_commands();
  void apply_commands(Rank& rank, const std::vector<DecodeCommand>& cmds);
  // The one place a rank's TransferDescriptor is made.
  transfer::TransferDescriptor descriptor(Rank& rank, const std::string& address,
                                          const std::string& id, int64_t num_tokens,
                                          const transfer::KvSharding& src,
                                          const std::vector<int32_t>& pages, bool speculate) const;
  std::vector<uint8_t> take_report(Rank& rank);
  void handle_report(int r, const std::vector<uint8_t>& report);
  // Queues a command for the next iteration (rank 0).
  void queue(DecodeCommand c);
  void release(int r, const std::string& id, std::vector<int32_t> pages, bool cancel);
  // Admits the request if its KV and its first output are both in (called under mu_; the
  // admission itself runs on the rank in the next iteration).
  void admit_if_ready(const std::string& id);
  // Ends a pending request: cancels its transfer (unless the transfer itself failed: from the
  // receiver's callback, which must not cancel), releases its pages, finishes it.
  void end_pending(const std::string& id, FinishReason reason, const std::string& error,
                   bool cancel_transfer = true);
  // Rank 0 after a failure: every accepted and running request ends with `why`.
  void fail_all(const std::string& why);
  void stop_ranks();
  OutputCallback guard(OutputCallback cb, const std::string& id);

  DecodeInstanceConfig config_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // this process's ranks (all of them as threads)
  int first_rank_ = 0;
  std::shared_ptr<transfer::TransferBackend> transfer_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> dead_{false};

  // Rank 0 (leader_mu_): the next iteration's commands, accept() calls waiting for their rank's
  // reservation, the per-rank load as last reported.
  struct Reservation {
    bool done = false;
    DecodeReport::Reservation r;
  };
  mutable std::mutex leader_mu_;
  std::condition_variable cmd_cv_;  // a command was queued
  std::condition_variable res_cv_;  // a reservation was answered
  std::vector<DecodeCommand> cmds_;
  std::unordered_map<std::string, std::shared_ptr<Reservation>> reservations_;
  std::vector<int64_t> batch_, free_pages_;
  std::vector<EngineStats> reported_stats_;  // per rank, its last report (ranks as processes)
  bool idle_ = false;                        // the last iteration stepped no rank
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  int running_ranks_ = 0;  // this process's rank threads still in their loop

  mutable std::mutex mu_;                                      // the registry below (rank 0)
  std::unordered_map<std::string, Pending> pending_;           // request id -> accepted request
  std::unordered_map<std::string, int> running_ids_;           // request id -> rank
  std::unordered_map<std::string, OutputCallback> callbacks_;  // running requests' outputs
};

}  // namespace tandem
