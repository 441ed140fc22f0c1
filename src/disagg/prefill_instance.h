// A prefill instance (DESIGN.md sections 1, 3, 4): TP=t attention + EP=t MoE. Rank 0 schedules
// (chunked prefill under a token budget, FCFS) with an Engine whose requests stop after their
// first token, broadcasts each step's batch to the other ranks, and every rank runs forward on
// the same batch. Every rank streams its KV heads to the decode instance through its transfer
// sender (transfer/transfer.h: a rank holding a replica of a head sends nothing); rank 0
// samples token 1 and every rank finishes the transfer with it.
//
// Hybrid models (Qwen3.5): every rank keeps the state slots of its DeltaNet value heads
// (model/hybrid_state.h) under rank 0's slot ids, and makes rank 0's prefix-cache state copies
// (the step carries them); after a prompt's last chunk rank 0 gathers the ranks' parts into the
// whole state, which goes with its FINISH (the decode side holds whole states: DP ranks); into
// a device state slot the decode side reserved (cuda-ipc), a GPU model merges it on the devices
// (Model::gather_state_device) and rank 0 copies it there with the KV.
//
// MTP on the decode side (TransferDescriptor::hidden_size > 0): rank 0 also gathers the prompt's
// final hidden states (ForwardBatch::hidden_out, chunk by chunk; after the final norm every
// rank's are the same, the residual stream being all-reduced), which go before its FINISH.
//
// NOTE: a prompt's KV leaves during the forward of its last chunk, layer by layer (the
// model's ForwardBatch::on_layer_kv hook, right after the layer's KV write): the transfer
// engine moves whole layers of a request, and a layer is complete only once the last chunk
// wrote it, so earlier chunks send nothing. The host backend copies each layer during
// send_layer, so the pages may be reused as soon as the forward returns.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "disagg/instance_parts.h"
#include "disagg/prompt_hidden_cache.h"
#include "disagg/protocol.h"
#include "engine/engine.h"
#include "transfer/transfer.h"

namespace tandem {

namespace comm {
class Communicator;
}

/// What a prefill instance exports (/metrics; the router picks by queued input tokens).
struct PrefillLoad {
  int64_t queued_input_tokens = 0;  // prompt tokens submitted and not computed yet
  int64_t input_tokens_total = 0;   // prompt tokens computed so far
  double input_tokens_per_s = 0;    // prompt tokens computed over the last 10 s, per second
  bool alive = true;
  HistogramCounts queue_time;        // rank 0's engine (EngineStats)
  HistogramCounts iteration_tokens;  // likewise
};

/// A prefill instance's pools (leak checks) and the counters of what returns to them.
struct PrefillPools {
  int64_t kv_pages_free = 0, kv_pages_total = 0;
  int64_t state_slots_free = 0, state_slots_total = 0;  // hybrid models: running sequences'
  int64_t preemptions = 0;
  int64_t prefix_cache_hits = 0;  // prompt tokens
};

/// Called once when a prefill ends, except after abort(): error empty and `first` the first
/// output (token 1 and its logprobs, prompt logprobs) when the KV went out, else why not.
using PrefillDone = std::function<void(const std::string& error, const StepOutput& first)>;

/// What the router needs of a prefill instance (this process's, or a remote one). Thread-safe.
class PrefillClient {
 public:
  virtual ~PrefillClient() = default;
  /// How the instance's ranks hold the KV heads (the decode side expects its senders).
  virtual transfer::KvSharding kv_sharding() const = 0;
  /// Queues the request's prefill; its KV goes to `dst` (from the decode instance's accept),
  /// then on_done runs. Throws Error(kInvalidArgument) for a request that can never run.
  virtual void submit(const GenRequest& req, transfer::TransferDescriptor dst,
                      PrefillDone on_done) = 0;
  /// Drops a queued or running prefill (no-op when unknown or done).
  virtual void abort(const std::string& id) = 0;
  virtual PrefillLoad load() const = 0;
};

struct PrefillInstanceConfig {
  std::string model_dir;
  int tp = 1;           // ranks (TP = EP)
  EngineConfig engine;  // rank 0's scheduler (max_batched_tokens: the chunk budget)
  /// The parts (instance_parts.h); empty: Qwen3MoeCpu from model_dir and the host TCP backend.
  ModelFactory model;
  std::shared_ptr<transfer::TransferBackend> transfer;
  /// For speculating decode instances: the budget (MiB) of the prompt pages' hidden states
  /// kept for prefix-cache hits (PromptHiddenCache); 0: none kept (a hit's pages then travel
  /// without hidden states).
  int64_t hidden_cache_mb = 256;
};

class PrefillInstance final : public PrefillClient {
 public:
  /// Loads the t shards and starts the rank threads (ranks as threads of this process);
  /// throws what loading throws.
  explicit PrefillInstance(PrefillInstanceConfig config);
  /// One process per rank: this process is rank comm->rank() of comm->world_size() (= tp),
  /// e.g. a GlooCommunicator from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. Collective:
  /// every rank's process constructs one. Only rank 0 serves the client calls below.
  PrefillInstance(PrefillInstanceConfig config, std::unique_ptr<comm::Communicator> comm);
  /// Stops the ranks; live prefills fail ("shutting down"). On ranks > 0 of a process group,
  /// returns once rank 0 has stopped the group (see wait()).
  ~PrefillInstance() override;

  /// Blocks until this process's ranks have stopped (rank 0 stopping, or a failure).
  void wait();
  /// True where the client calls work (rank 0 is here).
  bool is_leader() const { return first_rank_ == 0; }

  transfer::KvSharding kv_sharding() const override { return sharding_; }
  void submit(const GenRequest& req, transfer::TransferDescriptor dst,
              PrefillDone on_done) override;
  void abort(const std::string& id) override;
  PrefillLoad load() const override;

  /// Ranks that send KV to a decode rank holding every head (each head travels once).
  int num_senders() const;
  /// Transfers that failed at a sender (the decode side ends those requests).
  int64_t transfer_errors() const { return transfer_errors_; }
  /// Rank 0's pools after its last iteration (the other ranks use rank 0's page and state
  /// slot ids, so these count theirs too).
  PrefillPools pools() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return pools_;
  }

 private:
  struct Rank;
  struct Job;

  void init_ranks(int first_rank, int count);
  void leader_loop(comm::Communicator& comm);
  void follower_loop(Rank& rank, comm::Communicator& comm);
  void rank_main(int r);
  // Rank 0: applies submissions and aborts; waits a little while idle. True: stop.
  bool take_inbox();
  // Rank 0: the step message of this batch (the transfer ends queued since the last one too).
  PrefillStep make_step(const ScheduledBatch& batch, bool stop);
  // Every rank: ends the transfers of earlier steps (finish with token 1, or abort); begins
  // those of the prompts whose last chunk runs now (a failure flag per sequence); sends one
  // layer of them (from inside the forward).
  void end_transfers(Rank& rank, const PrefillStep& step);
  // Counts a failed transfer once per (request, rank).
  void note_transfer_error(const std::string& id, int rank);
  std::vector<int64_t> begin_transfers(Rank& rank, const PrefillStep& step);
  void send_layer(Rank& rank, const PrefillStep& step, int64_t layer, std::vector<int64_t>& failed);
  // Every rank (collective): the whole recurrent state of each prompt that ended in this step
  // and whose transfer did not fail, merged on rank 0 (empty elsewhere, and for other models).
  // `ok`: rank 0's forward succeeded (the other ranks pass true: they cannot know). TP > 1 and
  // a destination that reserved a device state slot: the model merges it on rank 0's device
  // (Model::gather_state_device) and rank 0's sender copies it there, device to device, with
  // the KV (a refusal fails the sequence: `failed`, on rank 0).
  std::vector<std::vector<float>> gather_states(Rank& rank, comm::Communicator& comm,
                                                const PrefillStep& step,
                                                std::vector<int64_t>& failed, bool ok);
  // TP 1, a destination that reserved a device state slot (descriptor dst_state_slot, a device
  // transfer backend): each prompt that ended in this step has its state slot copied there,
  // device to device, before its transfer finishes (a refusal fails the sequence: `failed`).
  void send_device_states(Rank& rank, const PrefillStep& step, std::vector<int64_t>& failed);
  // Rank 0: the pool counters after a step.
  void note_pools();
  void on_output(Job& job, const StepOutput& out);
  void end_job(const std::string& id, const std::string& error, const StepOutput& first);
  // A job whose decode side speculates: the hidden rows of the prompt pages its prefix-cache
  // hit skipped, from hidden_cache_; its own full pages kept there.
  void complete_hidden(Job& job);
  void count_computed(int64_t tokens);

  PrefillInstanceConfig config_;
  transfer::KvSharding sharding_;
  std::vector<std::unique_ptr<comm::Communicator>> comms_;  // this process's ranks'
  std::vector<std::unique_ptr<Rank>> ranks_;                // ranks_[i] is rank first_rank_ + i
  int first_rank_ = 0;
  bool hybrid_ = false;             // the model keeps a recurrent state per sequence
  std::unique_ptr<Engine> engine_;  // rank 0's scheduler and sampler over rank 0's shard
  std::shared_ptr<transfer::TransferBackend> transfer_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> dead_{false};
  std::atomic<int64_t> transfer_errors_{0};
  std::mutex errors_mu_;
  std::set<std::pair<std::string, int>> failed_transfers_;  // (request, rank) counted once

  mutable std::mutex inbox_mu_;
  std::condition_variable inbox_cv_;
  std::deque<std::pair<GenRequest, std::shared_ptr<Job>>> submitted_;
  std::vector<std::string> aborts_;

  // Rank 0 thread only.
  std::unordered_map<std::string, std::shared_ptr<Job>> jobs_;
  std::unique_ptr<PromptHiddenCache> hidden_cache_;  // rank 0, at the first job that wants it
  std::vector<TransferEnd> ends_;  // for the next step's message (the other ranks' senders)
  std::vector<StateCopy> saves_;   // likewise: the checkpoint copies of the last complete()

  mutable std::mutex stats_mu_;
  int64_t queued_tokens_ = 0;
  int64_t computed_total_ = 0;
  PrefillPools pools_;
  HistogramCounts queue_time_, iteration_tokens_;               // rank 0's engine, after each step
  mutable std::deque<std::pair<double, int64_t>> rate_window_;  // (seconds, tokens) per step
};

}  // namespace tandem
