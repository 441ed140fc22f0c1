// The CUDA communicator of one rank (one process per GPU): bootstraps through a TcpStore,
// maps every rank's peer buffer through CUDA IPC, and runs the all-reduce with our one-shot /
// two-shot kernels (all_reduce.h) or NCCL, chosen by size. No host synchronisation per call,
// so calls can be captured in CUDA graphs. NVLink multicast is never used.
//
// Usage (every rank, same calls in the same order, on one stream at a time):
//   auto comm = CudaComm::from_env();              // RANK, WORLD_SIZE, MASTER_ADDR/PORT
//   comm->all_reduce(x, x, n, DType::kBF16, stream);   // in place, copies into staging
//   // or: a producer writes into comm->registered_input(), then
//   comm->all_reduce_registered(y, n, DType::kBF16, stream);
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "comm/cuda/all_reduce.h"
#include "comm/cuda/nccl_comm.h"
#include "comm/tcp_store.h"
#include "core/dtype.h"

namespace tandem::comm {

enum class AllReduceAlgo { kAuto, kOneShot, kTwoShot, kNccl };

/// "auto", "one_shot", "two_shot", "nccl".
const char* all_reduce_algo_name(AllReduceAlgo algo);

/// Sizes are bytes of one rank's message. Every rank must use the same values (checked at
/// construction).
struct CudaAllReduceConfig {
  /// Largest message the custom kernels take; each rank allocates 3 x this (two staging
  /// buffers and the registered input) plus 64 KiB of flags.
  size_t max_bytes = size_t(64) << 20;
  /// kAuto: one-shot up to this size.
  size_t one_shot_max_bytes = size_t(16) << 20;
  /// kAuto: two-shot above one_shot_max_bytes up to this size, NCCL above.
  size_t two_shot_max_bytes = size_t(16) << 20;
  /// Blocks per launch at most; 0: two per multiprocessor. Always capped so that every block
  /// of a launch is resident (blocks spin on their peers).
  int max_blocks = 0;
  /// A cross-GPU wait longer than this traps the kernel (a peer died or calls mismatched).
  std::chrono::milliseconds spin_timeout{std::chrono::seconds(20)};

  /// Defaults for world_size ranks (docs/perf-notes-comm.md), then the environment:
  /// TANDEM_AR_MAX_BYTES, TANDEM_AR_ONE_SHOT_MAX_BYTES, TANDEM_AR_TWO_SHOT_MAX_BYTES
  /// (bytes, suffix K/M/G for KiB/MiB/GiB), TANDEM_AR_MAX_BLOCKS, TANDEM_AR_SPIN_TIMEOUT_MS.
  static CudaAllReduceConfig defaults(int world_size);
  void apply_env();
};

class CudaComm {
 public:
  /// Collective. Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (and LOCAL_RANK for the
  /// GPU, default RANK % visible GPUs); config defaults to CudaAllReduceConfig::defaults().
  static std::unique_ptr<CudaComm> from_env();
  static std::unique_ptr<CudaComm> from_env(const CudaAllReduceConfig& config);

  /// Collective over the store's ranks; sets the current device to `device`.
  CudaComm(std::shared_ptr<TcpStore> store, int device, CudaAllReduceConfig config);
  /// Synchronises the device and the ranks, then unmaps and frees (collective).
  ~CudaComm();
  CudaComm(const CudaComm&) = delete;
  CudaComm& operator=(const CudaComm&) = delete;

  /// Sum over ranks of input [count] into output [count] (output may equal input; otherwise
  /// they must not overlap). dtype kBF16 or kF32. kAuto picks by size (choose()); an explicit
  /// one-/two-shot needs 16-byte aligned pointers and count * size <= max_bytes.
  void all_reduce(void const* input, void* output, size_t count, DType dtype, cudaStream_t stream,
                  AllReduceAlgo algo = AllReduceAlgo::kAuto);

  /// This rank's registered input buffer ([max_bytes] bytes, peer-mapped): a producer writes
  /// the message here, then all_reduce_registered() reduces without a copy. Clobbered.
  void* registered_input() const { return registered_; }
  size_t registered_bytes() const { return config_.max_bytes; }
  /// Sum over ranks of registered_input()[0..count) into output (not inside the registered
  /// buffer). The call returns (on the stream) only once every peer has read this rank's
  /// registered input, so the next producer may overwrite it.
  void all_reduce_registered(void* output, size_t count, DType dtype, cudaStream_t stream,
                             AllReduceAlgo algo = AllReduceAlgo::kAuto);

  /// Signals and every rank's registered buffer (data[q]), for kernels that fuse their producer
  /// with the registered one-shot (MoE prefill combine); input, output and count left unset.
  cuda::AllReduceParams registered_params() const;

  /// What kAuto runs for a message of `bytes` (16-byte aligned pointers or not).
  AllReduceAlgo choose(size_t bytes, bool aligned = true) const;
  /// Collective: sets the kAuto thresholds; every rank must pass the same values (checked).
  void set_thresholds(size_t one_shot_max_bytes, size_t two_shot_max_bytes);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }
  const CudaAllReduceConfig& config() const { return config_; }
  /// Throws kUnsupported when there is none (ranks sharing a GPU).
  NcclComm& nccl();
  /// True when two ranks of the group run on one GPU (tests): then there is no NCCL and the
  /// custom kernels carry every all-reduce (up to max_bytes).
  bool shared_device() const { return shared_device_; }
  /// TANDEM_ALLOW_SHARED_GPU=1: ranks may share a GPU (refused otherwise: usually a wrong
  /// LOCAL_RANK / CUDA_VISIBLE_DEVICES).
  static bool allow_shared_device();
  TcpStore& store() { return *store_; }

 private:
  void launch_custom(void const* input, void* output, size_t count, DType dtype,
                     cudaStream_t stream, AllReduceAlgo algo, bool registered);
  void check_device() const;

  std::shared_ptr<TcpStore> store_;
  int rank_ = 0;
  int world_size_ = 1;
  int device_ = 0;
  CudaAllReduceConfig config_;
  std::string key_;  // store key prefix of this communicator
  int threshold_calls_ = 0;
  void* base_ = nullptr;                    // own peer-mapped allocation
  void* peer_bases_[cuda::kMaxRanks] = {};  // every rank's allocation, mapped here
  void* registered_ = nullptr;
  cuda::AllReduceParams params_{};  // pointers filled at init; per call: in/out/count
  std::unique_ptr<NcclComm> nccl_;  // null when ranks share a GPU
  bool shared_device_ = false;
};

}  // namespace tandem::comm
