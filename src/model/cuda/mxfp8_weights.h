// MXFP8 checkpoints on the GPU (docs/architecture.md, "MXFP8 on the GPU"), picked at
// construction by TANDEM_CUDA_MXFP8 (mxfp8_gpu_mode_from_env):
//   unset / "dequant" (the default): dequantized to bf16 at load, the path verified on the H200;
//   "native": E4M3 codes and their per-1x32 E8M0 scales kept as stored; the W8A16 kernels fold
//     the power-of-two scale into the in-register conversion (backend/cuda/fp8_linear.h), so the
//     GPU computes over exactly the checkpoint's values;
//   "block": requantized at load to 128x128 block FP8 (WeightReader::read_fp8_codes; the error
//     it adds per tensor kind: `tandem convert --format fp8` of the MXFP8 checkpoint), then the
//     block-FP8 kernels, W8A8 included.
// native and block are opt-in until a device run has measured them (issue 29).
// Host code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/cuda/cuda_mem.h"
#include "model/quant.h"

namespace tandem::cuda_model {

/// quant is MXFP8 (1x32 E8M0 blocks).
bool is_mxfp8(const QuantConfig& quant);

enum class Mxfp8Gpu { kDequant, kNative, kBlock };

/// TANDEM_CUDA_MXFP8: unset, "" or "dequant": kDequant; "native": kNative; "block": kBlock;
/// anything else: kInvalidArgument naming the variable.
Mxfp8Gpu mxfp8_gpu_mode_from_env();

/// WeightReader::read_mxfp8_codes, then the native kernels' range check: every E8M0 code in
/// [cuda::kMxfp8MinCode, cuda::kMxfp8MaxCode], else kUnsupported naming the tensor and the way
/// out (TANDEM_CUDA_MXFP8=block or dequant).
void read_mxfp8_for_gpu(const WeightReader& wr, const std::string& name, int64_t rows, int64_t cols,
                        IndexRange row_range, IndexRange col_range, uint8_t* q, uint8_t* e8m0);

/// One expert's gate_proj and up_proj ([inter, hidden] each, prefix `ep`) as native MXFP8,
/// packed as moe_pack_gate_up packs rows: codes to q_dst [2 inter, hidden], E8M0 to e_dst
/// [2 inter, ceil(hidden / 32)] (device).
void upload_mxfp8_gate_up(const WeightReader& wr, const std::string& ep, int64_t inter,
                          int64_t hidden, uint8_t* q_dst, uint8_t* e_dst, Uploader& up);

/// Experts [first, first + count) of one MoE layer in block FP8 (names `prefix` + e + ".", e.g.
/// "model.layers.3.mlp.experts."), prepared on the host by the CPU pool: gate / up codes and
/// their per-row 128-column scales (read_fp8_codes) packed by rows as moe_pack_gate_up_rows packs
/// them, gate_up_q [count, 2 inter, hidden], gate_up_s [count, 2 inter,
/// fp8_row_scale_cols(hidden)]; down_proj as read_fp8_codes gives it, down_q [count, hidden,
/// inter], down_s [count, hidden, fp8_row_scale_cols(inter)].
struct Fp8ExpertsHost {
  std::vector<uint8_t> gate_up_q, down_q;
  std::vector<float> gate_up_s, down_s;
};
void prepare_fp8_experts(const WeightReader& wr, const std::string& prefix, int64_t first,
                         int64_t count, int64_t inter, int64_t hidden, Fp8ExpertsHost& out);

/// prepare_fp8_experts' arrays to the device runs of local expert 0 of the range (same
/// shapes), a group of experts at a time (at most ~256 MB of host buffers), each group one
/// contiguous upload per array: the loaders' path for a layer's experts.
void upload_fp8_experts(const WeightReader& wr, const std::string& prefix, int64_t first,
                        int64_t count, int64_t inter, int64_t hidden, uint8_t* gate_up_q,
                        float* gate_up_s, uint8_t* down_q, float* down_s, Uploader& up);

}  // namespace tandem::cuda_model
