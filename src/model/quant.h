// Quantized linear weights (config.h QuantConfig): the dequantizing reader every CPU load goes
// through, and the block-FP8 / MXFP8 quantizers of `tandem convert`.
//
//   block FP8 (Qwen / DeepSeek "fp8"): weight F8_E4M3 [N, K], weight_scale_inv F32
//     [ceil(N / 128), ceil(K / 128)]; W[i][j] = e4m3(q[i][j]) * scale_inv[i / 128][j / 128].
//   MXFP8 (ModelOpt "MXFP8"): weight F8_E4M3 [N, K], weight_scale U8 (E8M0) [N, ceil(K / 32)];
//     W[i][j] = e4m3(q[i][j]) * 2^(e[i][j / 32] - 127).
// Both products are computed in fp32 (for MXFP8 exact: a power of two), as torch does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/safetensors.h"
#include "model/shard.h"

namespace tandem {

/// The 256 E4M3 codes as f32 (exact; the NaN codes 0x7f and 0xff are NaN).
const float* f8e4m3_table();

/// Reads [rows, cols] weights as fp32: bf16 / f16 / f32 as stored, F8_E4M3 dequantized with
/// its scale tensor. Only the requested rows x columns are read and each element takes the
/// scale of its own block, so a shard narrower than a block (or straddling two) loads exactly
/// the values of the whole tensor. Errors name the file, the tensor and the field.
class WeightReader {
 public:
  /// `config_origin` names config.json in errors.
  WeightReader(const Checkpoint& ckpt, const QuantConfig& quant, std::string config_origin);

  /// dst: [row_range.size(), col_range.size()] row-major.
  void read(const std::string& name, int64_t rows, int64_t cols, IndexRange row_range,
            IndexRange col_range, float* dst) const;
  /// The whole [rows, cols] tensor.
  void read(const std::string& name, int64_t rows, int64_t cols, float* dst) const {
    read(name, rows, cols, {0, rows}, {0, cols}, dst);
  }
  /// True when `name` is stored as F8_E4M3 (and so needs its scales).
  bool is_quantized(const std::string& name) const;

  /// Block FP8 kept as stored (the GPU's FP8 linears, backend/cuda/fp8_linear.h): the E4M3
  /// codes of rows x columns of `name` into q ([row_range.size(), col_range.size()]) and their
  /// row scales into row_scales ([row_range.size(), ceil(col_range.size() / 128)]: the scale of
  /// each row's block for every 128 columns of the range). Needs block FP8 with 128-wide column
  /// blocks and a column range whose 128-column groups each lie in one block
  /// (fp8_columns_splittable); errors name the file, the tensor and the field, as read's.
  /// MXFP8 goes through it too, requantized to block FP8 (the GPU's "block" MXFP8 path,
  /// docs/architecture.md, "MXFP8 on the GPU"): the dequantized tensor's 128x128 blocks (on the
  /// whole tensor's block grid, so any slice gives the codes of the whole) through
  /// quantize_fp8_block.
  void read_fp8_codes(const std::string& name, int64_t rows, int64_t cols, IndexRange row_range,
                      IndexRange col_range, uint8_t* q, float* row_scales) const;
  /// MXFP8 kept as stored (the GPU's native MXFP8 path): the E4M3 codes of rows x columns into q
  /// ([row_range.size(), col_range.size()]) and their E8M0 codes into e8m0 ([row_range.size(),
  /// ceil(col_range.size() / 32)]). Needs MXFP8 and col_range.begin % 32 == 0 (and, when it is
  /// not the last column, col_range.end % 32 == 0); errors as read_fp8_codes'.
  void read_mxfp8_codes(const std::string& name, int64_t rows, int64_t cols, IndexRange row_range,
                        IndexRange col_range, uint8_t* q, uint8_t* e8m0) const;

  /// Whether read_fp8_codes can take col_range: it starts on a block boundary or lies inside
  /// one block (a shard narrower than a block keeps that block's scales).
  static bool fp8_columns_splittable(IndexRange col_range, int64_t block_cols);

  const Checkpoint& checkpoint() const { return ckpt_; }
  const QuantConfig& quant() const { return quant_; }

 private:
  // The scale tensor of `name` as f32 rows [s0, s1) of its [ceil(rows / br), ceil(cols / bc)],
  // validated (presence, shape, dtype, finite).
  std::vector<float> read_scales(const std::string& name, int64_t rows, int64_t cols, int64_t s0,
                                 int64_t s1) const;
  void read_fp8(const std::string& name, const TensorView& q, int64_t rows, int64_t cols,
                IndexRange row_range, IndexRange col_range, float* dst) const;

  const Checkpoint& ckpt_;
  QuantConfig quant_;
  std::string config_origin_;
};

/// Block FP8 as Qwen and DeepSeek publish it: per 128x128 block (partial at the edges)
/// scale_inv = amax / 448 (1 for an all-zero block), q = e4m3(w / scale_inv).
/// q: [rows, cols]; scale_inv: [ceil(rows / 128), ceil(cols / 128)].
void quantize_fp8_block(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale_inv);

/// MXFP8: per 1x32 block along the input dim (the last one partial when cols % 32 != 0) the
/// smallest power-of-two scale 2^(e - 127) with amax / scale <= 448 (so nothing saturates; the
/// E8M0 code e is clamped to [0, 254], 127 for an all-zero block), q = e4m3(w / scale).
/// q: [rows, cols]; e8m0: [rows, ceil(cols / 32)].
void quantize_mxfp8(const float* w, int64_t rows, int64_t cols, uint8_t* q, uint8_t* e8m0);

/// The E8M0 code quantize_mxfp8 picks for a block whose largest magnitude is `amax`.
uint8_t mxfp8_scale_code(float amax);

}  // namespace tandem
