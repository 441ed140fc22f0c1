// What a sharded CUDA model (any architecture) does across its group, written once beside the
// runner (model/cuda/runner.h):
//   - the rank's CUDA communicators, built from CudaModelOptions::store: the all-reduce
//     (comm/cuda/cuda_comm.h; prefill TP: its registered buffer holds a step's activations and a
//     chunk of logits rows; decode EP: the IPC base of the exchange) and the decode DP/EP
//     dispatch / combine (comm/cuda/cuda_moe.h) with the MoE block's intermediates;
//   - prefill TP: row-parallel sums (a producer writes its partial products into partial(),
//     reduce() sums them over the ranks) and the vocab-parallel lm_head (head());
//   - decode DP/EP: the MoE block through the exchange (moe_ep()), inside graphs or eager.
// Nothing here on a single rank but head()'s one GEMM.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "backend/cuda/gemm.h"
#include "core/dtype.h"
#include "model/config.h"
#include "model/cuda/cuda_mem.h"
#include "model/shard.h"

namespace tandem {
namespace comm {
class CudaComm;
class CudaMoe;
class TcpStore;
}  // namespace comm

namespace cuda_model {

/// One MoE layer's router and this rank's experts (bf16, or FP8 when the *_q codes are set:
/// backend/cuda/moe_gemm.h's w_fp8 / w_scale / w_e8m0).
struct EpExperts {
  const cuda::bf16* router = nullptr;   // [E, H]
  const cuda::bf16* gate_up = nullptr;  // [local, 2I, H] packed (moe_pack_gate_up)
  const cuda::bf16* down = nullptr;     // [local, H, I]
  const uint8_t *gate_up_q = nullptr, *down_q = nullptr;
  const float *gate_up_s = nullptr, *down_s = nullptr;
  const uint8_t *gate_up_e = nullptr, *down_e = nullptr;
};

class ShardComms {
 public:
  /// The plan's rank; `store` is the group's bootstrap store (required when sharded).
  ShardComms(const ModelConfig& c, const ShardPlan& plan, std::shared_ptr<comm::TcpStore> store);
  ~ShardComms();
  ShardComms(const ShardComms&) = delete;
  ShardComms& operator=(const ShardComms&) = delete;

  /// Prefill TP over several ranks (heads split, sums after the mixers and MoE blocks).
  bool tp() const { return plan_.tensor_parallel() && plan_.spec.size > 1; }
  /// Decode DP/EP over several ranks (experts by the exchange, every step collective).
  bool dp_ep() const { return plan_.data_parallel() && plan_.spec.size > 1; }

  /// Builds the communicators (collective: every rank of the group calls it at the same point)
  /// for steps of t_cap tokens and rows_cap logits rows on `device`; `any_moe`: the exchange
  /// for decode EP; `min_bytes`: the registered buffer holds at least this (e.g. a state layer).
  /// Nothing on a single rank.
  void connect(int device, int64_t t_cap, int64_t rows_cap, bool any_moe, size_t min_bytes = 0);

  /// Prefill TP: the registered buffer a row-parallel producer writes its partial sums into;
  /// otherwise `out` itself.
  template <typename T>
  T* partial(T* out) const {
    return tp() ? static_cast<T*>(registered()) : out;
  }
  /// Prefill TP: the partials (partial()) summed over the ranks into out [count]; else nothing.
  void reduce(void* out, int64_t count, DType dtype, cudaStream_t stream);
  /// The all-reduce (null on a single rank) and its registered input.
  comm::CudaComm* all_reduce() const { return ar_.get(); }
  void* registered() const;

  /// fp32 logits [count, vocab] of the hidden rows x [count, H] into `logits` through `w` (this
  /// rank's lm_head rows, ShardPlan::vocab): one GEMM, or vocab-parallel under prefill TP (each
  /// rank's columns placed into zeroed full rows of the registered buffer, all-reduced in
  /// chunks of logits rows).
  void head(cuda::GemmLt& gemm, const cuda::bf16* x, const cuda::bf16* w, int64_t count,
            float* logits, cudaStream_t stream);

  /// Decode EP MoE block over n tokens (xn [n, H] -> y [n, H]): router and top-k here (none for
  /// n == 0), the tokens to their experts' ranks (num_real: the real tokens on the device), this
  /// rank's experts over what arrived, the outputs back home, summed per token in ascending
  /// expert id. Token counts stay on the device (graphs). warmup: a graph's first run, padding
  /// only: no exchange (the peers are not running it). Collective otherwise: every rank runs it
  /// once per MoE layer and pass.
  void moe_ep(const EpExperts& w, const cuda::bf16* xn, cuda::bf16* y, int64_t n,
              const int32_t* num_real, bool warmup, bool norm_topk, bool fp8_activations,
              cuda::GemmLt& gemm, cudaStream_t stream);

  /// The decode EP exchange (null otherwise).
  comm::CudaMoe* ep() const { return ep_.get(); }

 private:
  const ModelConfig& c_;
  ShardPlan plan_;
  std::shared_ptr<comm::TcpStore> store_;
  std::unique_ptr<comm::CudaComm> ar_;  // all-reduce (prefill TP); the IPC base of ep_
  std::unique_ptr<comm::CudaMoe> ep_;   // decode DP/EP dispatch / combine
  // moe_ep's intermediates: router logits [t_cap, E] fp32, top-k ids / weights [t_cap, k],
  // activations [ep_max_rows_, I] and expert outputs [ep_max_rows_, H] bf16.
  DeviceMem ep_logits_, ep_ids_, ep_w_, ep_act_, ep_out_;
  int64_t ep_max_rows_ = 0;
  DeviceMem lm_local_;      // prefill TP: [head_chunk_, this rank's vocab rows] fp32
  int64_t head_chunk_ = 0;  // prefill TP: logits rows per all-reduce
};

}  // namespace cuda_model
}  // namespace tandem
