// A sharded CUDA model's collectives. See shard_comms.h.
#include "model/cuda/shard_comms.h"

#include <algorithm>

#include "backend/cuda/check.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/moe_gemm.h"
#include "comm/cuda/cuda_comm.h"
#include "comm/cuda/cuda_moe.h"
#include "core/error.h"

namespace tandem::cuda_model {

using cuda::bf16;

ShardComms::ShardComms(const ModelConfig& c, const ShardPlan& plan,
                       std::shared_ptr<comm::TcpStore> store)
    : c_(c), plan_(plan), store_(std::move(store)) {}

ShardComms::~ShardComms() {
  ep_.reset();
  ar_.reset();
}

void* ShardComms::registered() const { return ar_ ? ar_->registered_input() : nullptr; }

void ShardComms::connect(int device, int64_t t_cap, int64_t rows_cap, bool any_moe,
                         size_t min_bytes) {
  if (plan_.spec.size <= 1) return;
  TANDEM_CHECK_KIND(kInvalidArgument, store_ != nullptr,
                    "a sharded CUDA model needs the group's store (CudaModelOptions::store)");
  const int64_t h = c_.hidden_size, v = c_.vocab_size;
  comm::CudaAllReduceConfig ac = comm::CudaAllReduceConfig::defaults(plan_.spec.size);
  if (tp()) {
    // One buffer carries a whole step's activations and a chunk of logits rows.
    head_chunk_ = std::min(rows_cap, std::max<int64_t>(1, (int64_t{32} << 20) / (4 * v)));
    const size_t need = std::max({static_cast<size_t>(t_cap * h) * sizeof(bf16),
                                  static_cast<size_t>(head_chunk_ * v) * 4, min_bytes});
    ac.max_bytes = std::max(ac.max_bytes, (need + 4095) / 4096 * 4096);
    lm_local_ =
        DeviceMem(static_cast<size_t>(head_chunk_ * std::max<int64_t>(plan_.vocab.size(), 1)) *
                  sizeof(float));
  } else {
    ac.max_bytes = size_t(1) << 20;  // decode: the IPC base of the MoE exchange only
  }
  ar_ = std::make_unique<comm::CudaComm>(store_, device, ac);
  if (dp_ep() && any_moe) {
    comm::CudaMoeConfig mc;
    mc.num_experts = static_cast<int>(c_.num_experts);
    mc.hidden = static_cast<int>(h);
    mc.top_k = static_cast<int>(c_.num_experts_per_tok);
    mc.max_tokens = static_cast<int>(t_cap);
    ep_ = std::make_unique<comm::CudaMoe>(*ar_, mc);
    ep_max_rows_ = ep_->max_recv_rows();
    const auto T = static_cast<size_t>(t_cap);
    ep_logits_ = DeviceMem(T * static_cast<size_t>(c_.num_experts) * sizeof(float));
    ep_ids_ = DeviceMem(T * static_cast<size_t>(c_.num_experts_per_tok) * sizeof(int32_t));
    ep_w_ = DeviceMem(T * static_cast<size_t>(c_.num_experts_per_tok) * sizeof(float));
    ep_act_ =
        DeviceMem(static_cast<size_t>(ep_max_rows_ * c_.moe_intermediate_size) * sizeof(bf16));
    ep_out_ = DeviceMem(static_cast<size_t>(ep_max_rows_ * h) * sizeof(bf16));
    cuda::moe_gemm_prepare();
  }
}

void ShardComms::reduce(void* out, int64_t count, DType dtype, cudaStream_t stream) {
  if (tp()) ar_->all_reduce_registered(out, static_cast<size_t>(count), dtype, stream);
}

void ShardComms::head(cuda::GemmLt& gemm, const bf16* x, const bf16* w, int64_t count,
                      float* logits, cudaStream_t stream) {
  const int64_t h = c_.hidden_size, v = c_.vocab_size;
  cuda::GemmParams gp{};
  gp.x = x;
  gp.w = w;
  gp.m = count;
  gp.n = v;
  gp.k = h;
  gp.y_f32 = logits;
  if (!tp()) {
    gemm.run(gp, stream);
    return;
  }
  // Vocab-parallel: this rank's columns of each row, placed into a zeroed full-width row of
  // the registered buffer; the all-reduce (a sum with every other column zero) gathers them.
  const int64_t vl = plan_.vocab.size();
  auto* reg = static_cast<float*>(ar_->registered_input());
  for (int64_t b = 0; b < count; b += head_chunk_) {
    const int64_t cnt = std::min(head_chunk_, count - b);
    TANDEM_CUDA_CHECK(
        cudaMemsetAsync(reg, 0, static_cast<size_t>(cnt * v) * sizeof(float), stream));
    if (vl > 0) {
      gp.x = x + b * h;
      gp.m = cnt;
      gp.n = vl;
      gp.y_f32 = lm_local_.as<float>();
      gemm.run(gp, stream);
      TANDEM_CUDA_CHECK(cudaMemcpy2DAsync(
          reg + plan_.vocab.begin, v * sizeof(float), lm_local_.as<float>(), vl * sizeof(float),
          vl * sizeof(float), cnt, cudaMemcpyDeviceToDevice, stream));
    }
    ar_->all_reduce_registered(logits + b * v, static_cast<size_t>(cnt * v), DType::kF32, stream);
  }
}

void ShardComms::moe_ep(const EpExperts& w, const bf16* xn, bf16* y, int64_t n,
                        const int32_t* num_real, bool warmup, bool norm_topk, bool fp8_activations,
                        cuda::GemmLt& gemm, cudaStream_t stream) {
  const int64_t h = c_.hidden_size, inter = c_.moe_intermediate_size, E = c_.num_experts,
                k = c_.num_experts_per_tok, L = plan_.experts.size();
  if (n > 0) {
    cuda::GemmParams rp{};
    rp.x = xn;
    rp.w = w.router;
    rp.m = n;
    rp.n = E;
    rp.k = h;
    rp.y_f32 = ep_logits_.as<float>();
    gemm.run(rp, stream);  // fp32 router logits, as MoeLayer
    cuda::topk_softmax_launch({ep_logits_.as<float>(), ep_ids_.as<int32_t>(), ep_w_.as<float>(), n,
                               E, k, norm_topk, DType::kF32},
                              stream);
  }
  if (warmup) return;
  ep_->dispatch_send(xn, ep_ids_.as<int32_t>(), ep_w_.as<float>(), num_real, stream);
  ep_->dispatch_recv(stream);
  const auto* rx = static_cast<const bf16*>(ep_->recv_x());
  cuda::MoeGemmParams gu{rx,
                         w.gate_up,
                         ep_act_.as<bf16>(),
                         ep_->expert_offsets(),
                         ep_max_rows_,
                         2 * inter,
                         h,
                         L,
                         cuda::MoeGemmEpilogue::kSiluMul};
  gu.w_fp8 = w.gate_up_q;
  gu.w_scale = w.gate_up_s;
  gu.w_e8m0 = w.gate_up_e;
  gu.fp8_activations = fp8_activations;
  cuda::moe_gemm_launch(gu, stream);
  cuda::MoeGemmParams dn{ep_act_.as<bf16>(),
                         w.down,
                         ep_out_.as<bf16>(),
                         ep_->expert_offsets(),
                         ep_max_rows_,
                         h,
                         inter,
                         L,
                         cuda::MoeGemmEpilogue::kPlain};
  dn.w_fp8 = w.down_q;
  dn.w_scale = w.down_s;
  dn.w_e8m0 = w.down_e;
  dn.fp8_activations = fp8_activations;
  cuda::moe_gemm_launch(dn, stream);
  ep_->combine_send(ep_out_.as<bf16>(), stream);
  // Rows past the real tokens (padding) are not written by the combine: keep them finite.
  TANDEM_CUDA_CHECK(cudaMemsetAsync(y, 0, static_cast<size_t>(n * h) * sizeof(bf16), stream));
  ep_->combine_recv(y, stream);
}

}  // namespace tandem::cuda_model
