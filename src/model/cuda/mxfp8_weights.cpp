#include "model/cuda/mxfp8_weights.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm.h"
#include "core/env.h"
#include "core/error.h"

namespace tandem::cuda_model {

bool is_mxfp8(const QuantConfig& quant) {
  return quant.method == WeightQuant::kMxfp8 && quant.block_rows == 1 &&
         quant.block_cols == cuda::kMxfp8BlockK;
}

Mxfp8Gpu mxfp8_gpu_mode_from_env() {
  const std::string mode = env::choice("TANDEM_CUDA_MXFP8").value_or("dequant");
  if (mode == "native") return Mxfp8Gpu::kNative;
  return mode == "block" ? Mxfp8Gpu::kBlock : Mxfp8Gpu::kDequant;
}

void read_mxfp8_for_gpu(const WeightReader& wr, const std::string& name, int64_t rows, int64_t cols,
                        IndexRange row_range, IndexRange col_range, uint8_t* q, uint8_t* e8m0) {
  wr.read_mxfp8_codes(name, rows, cols, row_range, col_range, q, e8m0);
  const int64_t count = row_range.size() * cuda::mxfp8_scale_cols(col_range.size());
  TANDEM_CHECK_KIND(kUnsupported, cuda::mxfp8_codes_in_range(e8m0, count),
                    wr.checkpoint().file_of(name), ": tensor '", name,
                    "': an E8M0 scale outside 2^", cuda::kMxfp8MinCode - 127, " .. 2^",
                    cuda::kMxfp8MaxCode - 127,
                    " (the native MXFP8 kernels' range); TANDEM_CUDA_MXFP8=block requantizes it "
                    "to block FP8 instead, =dequant loads it as bf16");
}

void upload_mxfp8_gate_up(const WeightReader& wr, const std::string& ep, int64_t inter,
                          int64_t hidden, uint8_t* q_dst, uint8_t* e_dst, Uploader& up) {
  const int64_t ke = cuda::mxfp8_scale_cols(hidden);
  std::vector<uint8_t> gq(static_cast<size_t>(inter * hidden)), uq(gq.size()), pq(2 * gq.size());
  std::vector<uint8_t> ge(static_cast<size_t>(inter * ke)), ue(ge.size()), pe(2 * ge.size());
  read_mxfp8_for_gpu(wr, ep + "gate_proj.weight", inter, hidden, {0, inter}, {0, hidden}, gq.data(),
                     ge.data());
  read_mxfp8_for_gpu(wr, ep + "up_proj.weight", inter, hidden, {0, inter}, {0, hidden}, uq.data(),
                     ue.data());
  cuda::moe_pack_gate_up_rows(gq.data(), uq.data(), inter, static_cast<size_t>(hidden), pq.data());
  cuda::moe_pack_gate_up_rows(ge.data(), ue.data(), inter, static_cast<size_t>(ke), pe.data());
  up.put(q_dst, pq.data(), pq.size());
  up.put(e_dst, pe.data(), pe.size());
}

void upload_fp8_gate_up(const WeightReader& wr, const std::string& ep, int64_t inter,
                        int64_t hidden, uint8_t* q_dst, float* s_dst, Uploader& up) {
  const int64_t kb = cuda::fp8_row_scale_cols(hidden);
  std::vector<uint8_t> gq(static_cast<size_t>(inter * hidden)), uq(gq.size()), pq(2 * gq.size());
  std::vector<float> gs(static_cast<size_t>(inter * kb)), us(gs.size()), ps(2 * gs.size());
  wr.read_fp8_codes(ep + "gate_proj.weight", inter, hidden, {0, inter}, {0, hidden}, gq.data(),
                    gs.data());
  wr.read_fp8_codes(ep + "up_proj.weight", inter, hidden, {0, inter}, {0, hidden}, uq.data(),
                    us.data());
  cuda::moe_pack_gate_up_rows(gq.data(), uq.data(), inter, static_cast<size_t>(hidden), pq.data());
  cuda::moe_pack_gate_up_rows(gs.data(), us.data(), inter, static_cast<size_t>(kb) * sizeof(float),
                              ps.data());
  up.put(q_dst, pq.data(), pq.size());
  up.put(s_dst, ps.data(), ps.size() * sizeof(float));
}

}  // namespace tandem::cuda_model
