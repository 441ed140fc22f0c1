// MoE dispatch / combine on CUDA (protocol and layouts: moe_params.h).
//
// Decode (DP-EP): CudaMoe owns one peer-mapped allocation per rank (CUDA IPC, like CudaComm's)
// and this rank's packed receive outputs. Every rank, the same calls in the same order, each
// after the previous in stream order; token counts live on the device, so a whole step can be
// captured in a CUDA graph:
//   moe.dispatch_send(x, topk_ids, topk_weights, d_num_tokens, s);  // push rows out
//   moe.dispatch_recv(s);         // wait, pack per local expert: recv_x(), expert_offsets(),
//   row_*() experts(moe.recv_x(), moe.expert_offsets()) -> expert_out   // [rows, H] bf16,
//   unweighted moe.combine_send(expert_out, s); moe.combine_recv(out, s);     // out[t] = sum_j
//   w[t][j] * expert_out(t, j), ascending expert, fp32
// x, topk_ids, topk_weights and num_tokens must stay valid until combine_recv (it re-reads them).
// The halves can be put on other streams to overlap compute, as long as each starts after the
// previous call of this list completed (events).
//
// Prefill (EP): prefill_dispatch_launch / prefill_combine_launch (moe.h) on caller buffers;
// prefill_combine_all_reduce() fuses the weighted sum into the all-reduce's registered input.
// NVLink multicast is never used.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "comm/cuda/cuda_comm.h"
#include "comm/cuda/moe.h"
#include "comm/cuda/moe_params.h"

namespace tandem::comm {

struct CudaMoeConfig {
  int num_experts = 128;  // E, divisible by the world size
  int hidden = 4096;      // H: multiple of 8 (bf16) or of 128 (fp8)
  int top_k = 8;
  int max_tokens = 256;  // per rank
  cuda::MoePayload payload = cuda::MoePayload::kBF16;
  int send_blocks = 0;  // grid of the send kernels; 0: min(SMs, max_tokens + 1); same on all ranks
  int recv_blocks = 0;  // grid of the receive kernels; 0: SMs
  std::chrono::milliseconds spin_timeout{std::chrono::seconds(20)};
};

class CudaMoe {
 public:
  /// Collective over comm's ranks (same config everywhere, checked). Sets comm's device.
  CudaMoe(CudaComm& comm, CudaMoeConfig config);
  /// Synchronises the device and the ranks, then unmaps and frees (collective).
  ~CudaMoe();
  CudaMoe(const CudaMoe&) = delete;
  CudaMoe& operator=(const CudaMoe&) = delete;

  /// x: bf16 [max_tokens, H]; topk_ids int32 / topk_weights fp32 [max_tokens, k];
  /// num_tokens: device int32 [1], clamped to max_tokens. 16-byte aligned x.
  void dispatch_send(void const* x, int32_t const* topk_ids, float const* topk_weights,
                     int32_t const* num_tokens, cudaStream_t stream);
  void dispatch_recv(cudaStream_t stream);
  /// expert_out: bf16 [max_recv_rows, H], row r = the expert output of recv_x() row r.
  void combine_send(void const* expert_out, cudaStream_t stream);
  /// out: [max_tokens, H] bf16 (or fp32 when out_f32); rows >= num_tokens are not written.
  void combine_recv(void* out, cudaStream_t stream, bool out_f32 = false);

  // dispatch_recv's outputs (device, fixed addresses; valid after it ran on the stream).
  void* recv_x() const { return params_.out_x; }  // [max_recv_rows, row_bytes]
  int32_t const* expert_offsets() const { return params_.expert_offsets; }  // [L + 1]
  int32_t const* row_src() const { return params_.row_src; }
  int32_t const* row_token() const { return params_.row_token; }
  int32_t const* row_slot() const { return params_.row_slot; }
  int32_t const* row_expert() const { return params_.row_expert; }
  float const* row_weight() const { return params_.row_weight; }
  size_t row_bytes() const { return cuda::moe_row_bytes(config_.payload, config_.hidden); }
  int max_recv_rows() const { return params_.max_recv_rows; }
  int local_experts() const { return params_.local_experts; }
  int expert_begin() const { return rank_ * params_.local_experts; }
  const CudaMoeConfig& config() const { return config_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }

 private:
  CudaComm& comm_;
  CudaMoeConfig config_;
  int rank_ = 0, world_ = 1, device_ = 0, recv_blocks_ = 1;
  std::string key_;
  void* base_ = nullptr;
  void* local_ = nullptr;  // packed outputs and row metadata
  void* peer_bases_[cuda::kMaxRanks] = {};
  cuda::MoeDecodeParams params_{};
};

/// Prefill combine + all-reduce into out [max_tokens, H] (bf16, or fp32 when p.out_f32; p.out
/// is ignored). max_tokens * H * size must fit comm's max_bytes. kAuto / kOneShot with `fused`:
/// one kernel (the weighted local sums go into the registered buffer, then the one-shot reduce
/// of the same tokens; blocks capped at comm's max_blocks). Otherwise: the weighted sums into
/// comm.registered_input(), then all_reduce_registered(algo).
void prefill_combine_all_reduce(CudaComm& comm, cuda::PrefillCombineParams p, void* out, int blocks,
                                cudaStream_t stream, AllReduceAlgo algo = AllReduceAlgo::kAuto,
                                bool fused = true);

}  // namespace tandem::comm
