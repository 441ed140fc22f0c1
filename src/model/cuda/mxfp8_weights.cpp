#include "model/cuda/mxfp8_weights.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cuda/fp8_linear.h"
#include "backend/cuda/moe_gemm.h"
#include "core/env.h"
#include "core/error.h"
#include "core/thread_pool.h"

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

void prepare_fp8_experts(const WeightReader& wr, const std::string& prefix, int64_t first,
                         int64_t count, int64_t inter, int64_t hidden, Fp8ExpertsHost& out) {
  const int64_t kbh = cuda::fp8_row_scale_cols(hidden), kbi = cuda::fp8_row_scale_cols(inter);
  const size_t guq = static_cast<size_t>(2 * inter * hidden),
               gus = static_cast<size_t>(2 * inter * kbh);
  const size_t dnq = static_cast<size_t>(hidden * inter), dns = static_cast<size_t>(hidden * kbi);
  const auto n = static_cast<size_t>(count);
  out.gate_up_q.resize(guq * n);
  out.gate_up_s.resize(gus * n);
  out.down_q.resize(dnq * n);
  out.down_s.resize(dns * n);
  ThreadPool::global().parallel_for(count, 1, [&](int64_t b, int64_t e) {
    std::vector<uint8_t> gq(guq / 2), uq(guq / 2);
    std::vector<float> gs(gus / 2), us(gus / 2);
    for (int64_t i = b; i < e; ++i) {
      const std::string ep = prefix + std::to_string(first + i) + ".";
      wr.read_fp8_codes(ep + "gate_proj.weight", inter, hidden, {0, inter}, {0, hidden}, gq.data(),
                        gs.data());
      wr.read_fp8_codes(ep + "up_proj.weight", inter, hidden, {0, inter}, {0, hidden}, uq.data(),
                        us.data());
      cuda::moe_pack_gate_up_rows(gq.data(), uq.data(), inter, static_cast<size_t>(hidden),
                                  out.gate_up_q.data() + i * guq);
      cuda::moe_pack_gate_up_rows(gs.data(), us.data(), inter,
                                  static_cast<size_t>(kbh) * sizeof(float),
                                  out.gate_up_s.data() + i * gus);
      wr.read_fp8_codes(ep + "down_proj.weight", hidden, inter, {0, hidden}, {0, inter},
                        out.down_q.data() + i * dnq, out.down_s.data() + i * dns);
    }
  });
}

namespace {
// Experts a group: at most ~256 MB of host buffers, at least one expert.
int64_t expert_group(size_t bytes_per_expert, int64_t count) {
  return std::clamp<int64_t>(static_cast<int64_t>((size_t{256} << 20) / bytes_per_expert), 1,
                             std::max<int64_t>(count, 1));
}
}  // namespace

void upload_fp8_experts(const WeightReader& wr, const std::string& prefix, int64_t first,
                        int64_t count, int64_t inter, int64_t hidden, uint8_t* gate_up_q,
                        float* gate_up_s, uint8_t* down_q, float* down_s, Uploader& up) {
  const int64_t kbh = cuda::fp8_row_scale_cols(hidden), kbi = cuda::fp8_row_scale_cols(inter);
  const size_t guq = static_cast<size_t>(2 * inter * hidden),
               gus = static_cast<size_t>(2 * inter * kbh);
  const size_t dnq = static_cast<size_t>(hidden * inter), dns = static_cast<size_t>(hidden * kbi);
  const int64_t group = expert_group(guq + dnq + (gus + dns) * sizeof(float), count);
  Fp8ExpertsHost h;
  for (int64_t g0 = 0; g0 < count; g0 += group) {
    const int64_t n = std::min(group, count - g0);
    prepare_fp8_experts(wr, prefix, first + g0, n, inter, hidden, h);
    up.put(gate_up_q + g0 * guq, h.gate_up_q.data(), h.gate_up_q.size());
    up.put(gate_up_s + g0 * gus, h.gate_up_s.data(), h.gate_up_s.size() * sizeof(float));
    up.put(down_q + g0 * dnq, h.down_q.data(), h.down_q.size());
    up.put(down_s + g0 * dns, h.down_s.data(), h.down_s.size() * sizeof(float));
  }
}

}  // namespace tandem::cuda_model
