// Host loaders shared by the CPU models (Qwen3MoeCpu, Qwen35MoeCpu and its MTP layer): a
// checkpoint tensor as fp32, and row / column slices of a [rows, cols] weight read through the
// WeightReader (block FP8 / MXFP8 dequantized, model/quant.h), so that a rank reads only its part.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "model/quant.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace tandem {

/// `name` (bf16/f16/f32 on disk) as an fp32 tensor of the expected shape; `plus_one` stores
/// 1 + w (Qwen3.5's zero-centred RMSNorm weights), computed in fp32 as transformers does.
inline HostTensor load_f32(const Checkpoint& ckpt, const std::string& name, const Shape& shape,
                           bool plus_one = false) {
  TensorView src = ckpt.get(name, shape);
  HostTensor t(DType::kF32, shape);
  Checkpoint::to_f32(src, t.ptr<float>());
  if (plus_one) {
    float* p = t.ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = 1.0f + p[i];
  }
  return t;
}

/// Rows [range) of a [rows, cols] tensor.
struct RowSlice {
  std::string name;
  int64_t rows;
  IndexRange range;
};

/// [sum of the slices' rows, cols]: the slices one after the other (fused QKV / gate-up, a
/// rank's rows of them), reading only the rows asked for.
inline HostTensor load_rows(const WeightReader& wr, const std::vector<RowSlice>& slices,
                            int64_t cols) {
  int64_t total = 0;
  for (const auto& s : slices) total += s.range.size();
  HostTensor t(DType::kF32, {total, cols});
  float* dst = t.ptr<float>();
  for (const auto& s : slices) {
    if (s.range.size() > 0) wr.read(s.name, s.rows, cols, s.range, {0, cols}, dst);
    dst += s.range.size() * cols;
  }
  return t;
}

/// A whole [rows, cols] weight.
inline HostTensor load_matrix(const WeightReader& wr, const std::string& name, int64_t rows,
                              int64_t cols) {
  return load_rows(wr, {{name, rows, {0, rows}}}, cols);
}

/// Columns [range) of a [rows, cols] tensor (row-parallel projections), reading only those.
inline HostTensor load_cols(const WeightReader& wr, const std::string& name, int64_t rows,
                            int64_t cols, IndexRange range) {
  HostTensor t(DType::kF32, {rows, range.size()});
  wr.read(name, rows, cols, {0, rows}, range, t.ptr<float>());
  return t;
}

/// Whole [rows_i, cols] tensors one after the other (fused projections of an unsharded layer).
inline HostTensor load_concat(const Checkpoint& ckpt,
                              const std::vector<std::pair<std::string, int64_t>>& parts,
                              int64_t cols) {
  int64_t total = 0;
  for (const auto& [name, rows] : parts) total += rows;
  HostTensor t(DType::kF32, {total, cols});
  float* dst = t.ptr<float>();
  for (const auto& [name, rows] : parts) {
    Checkpoint::to_f32(ckpt.get(name, {rows, cols}), dst);
    dst += rows * cols;
  }
  return t;
}

}  // namespace tandem
