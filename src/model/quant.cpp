#include "model/quant.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace tandem {

namespace {

std::array<float, 256> make_f8_table() {
  std::array<float, 256> t{};
  for (int c = 0; c < 256; ++c) t[static_cast<size_t>(c)] = f8e4m3_to_f32(static_cast<uint8_t>(c));
  return t;
}

bool is_f8_nan(uint8_t c) { return (c & 0x7f) == 0x7f; }

std::string shape_str(int64_t a, int64_t b) { return Shape{a, b}.str(); }

// A slice [row_range) x [col_range) inside a [rows, cols] tensor.
void check_slice(const std::string& name, int64_t rows, int64_t cols, IndexRange row_range,
                 IndexRange col_range) {
  TANDEM_CHECK_KIND(
      kInvalidArgument,
      0 <= row_range.begin && row_range.begin <= row_range.end && row_range.end <= rows &&
          0 <= col_range.begin && col_range.begin <= col_range.end && col_range.end <= cols,
      "tensor '", name, "': rows [", row_range.begin, ", ", row_range.end, ") x columns [",
      col_range.begin, ", ", col_range.end, ") outside ", shape_str(rows, cols));
}

}  // namespace

const float* f8e4m3_table() {
  static const std::array<float, 256> table = make_f8_table();
  return table.data();
}

WeightReader::WeightReader(const Checkpoint& ckpt, const QuantConfig& quant,
                           std::string config_origin)
    : ckpt_(ckpt), quant_(quant), config_origin_(std::move(config_origin)) {}

bool WeightReader::is_quantized(const std::string& name) const {
  return ckpt_.get(name).dtype == DType::kF8E4M3;
}

void WeightReader::read(const std::string& name, int64_t rows, int64_t cols, IndexRange row_range,
                        IndexRange col_range, float* dst) const {
  check_slice(name, rows, cols, row_range, col_range);
  TensorView src = ckpt_.get(name, {rows, cols});
  if (src.dtype == DType::kF8E4M3) {
    read_fp8(name, src, rows, cols, row_range, col_range, dst);
    return;
  }
  const int64_t w = col_range.size();
  if (col_range.begin == 0 && col_range.end == cols) {
    Checkpoint::to_f32(src, dst, row_range.begin, row_range.end);
    return;
  }
  TensorView flat = src;  // [rows * cols]: element ranges are row ranges
  flat.shape = Shape{rows * cols};
  for (int64_t i = row_range.begin; i < row_range.end; ++i) {
    Checkpoint::to_f32(flat, dst + (i - row_range.begin) * w, i * cols + col_range.begin,
                       i * cols + col_range.end);
  }
}

std::vector<float> WeightReader::read_scales(const std::string& name, int64_t rows, int64_t cols,
                                             int64_t s0, int64_t s1) const {
  const std::string file = ckpt_.file_of(name);
  TANDEM_CHECK_KIND(kInvalidArgument, quant_.quantized(), file, ": tensor '", name,
                    "' is stored as F8_E4M3 but ", config_origin_,
                    " has no quantization_config (its scales cannot be known)");
  const std::string scale_name = quant_.scale_name(name);
  TANDEM_CHECK_KIND(kInvalidArgument, ckpt_.has(scale_name), file, ": tensor '", name,
                    "' is F8_E4M3 (", weight_quant_name(quant_.method), ") but its scale tensor '",
                    scale_name, "' is missing from ", ckpt_.dir());
  const int64_t br = quant_.block_rows, bc = quant_.block_cols;
  const int64_t srows = (rows + br - 1) / br, scols = (cols + bc - 1) / bc;
  const TensorView sv = ckpt_.get(scale_name);
  const std::string sfile = ckpt_.file_of(scale_name);
  TANDEM_CHECK_KIND(kInvalidArgument, sv.shape == Shape({srows, scols}), sfile, ": scale tensor '",
                    scale_name, "' has shape ", sv.shape.str(), ", expected ",
                    shape_str(srows, scols), " for '", name, "' of shape ", shape_str(rows, cols),
                    " in ", br, "x", bc, " blocks");
  std::vector<float> scale(static_cast<size_t>((s1 - s0) * scols));
  if (quant_.method == WeightQuant::kMxfp8) {
    TANDEM_CHECK_KIND(kInvalidArgument, sv.dtype == DType::kE8M0, sfile, ": scale tensor '",
                      scale_name, "' has dtype ", dtype_name(sv.dtype),
                      ", expected E8M0 (U8 or F8_E8M0) for MXFP8");
    const auto* codes = static_cast<const uint8_t*>(sv.data) + s0 * scols;
    for (size_t i = 0; i < scale.size(); ++i) {
      TANDEM_CHECK_KIND(kInvalidArgument, codes[i] != 0xff, sfile, ": scale tensor '", scale_name,
                        "': E8M0 code 0xff (NaN) at [", s0 + static_cast<int64_t>(i) / scols, ", ",
                        static_cast<int64_t>(i) % scols, "]");
      scale[i] = e8m0_to_f32(codes[i]);
    }
  } else {
    TANDEM_CHECK_KIND(
        kInvalidArgument,
        sv.dtype == DType::kF32 || sv.dtype == DType::kBF16 || sv.dtype == DType::kF16, sfile,
        ": scale tensor '", scale_name, "' has dtype ", dtype_name(sv.dtype), ", expected f32");
    Checkpoint::to_f32(sv, scale.data(), s0, s1);
    for (size_t i = 0; i < scale.size(); ++i) {
      TANDEM_CHECK_KIND(kInvalidArgument, std::isfinite(scale[i]), sfile, ": scale tensor '",
                        scale_name, "': non-finite scale ", scale[i], " at [",
                        s0 + static_cast<int64_t>(i) / scols, ", ", static_cast<int64_t>(i) % scols,
                        "]");
    }
  }
  return scale;
}

bool WeightReader::fp8_columns_splittable(IndexRange col_range, int64_t block_cols) {
  if (block_cols <= 0) return false;
  const int64_t off = col_range.begin % block_cols;
  return off == 0 || col_range.size() <= block_cols - off;
}

void WeightReader::read_fp8_codes(const std::string& name, int64_t rows, int64_t cols,
                                  IndexRange row_range, IndexRange col_range, uint8_t* q,
                                  float* row_scales) const {
  constexpr int64_t kBlockK = 128;  // the GPU kernels' K block
  check_slice(name, rows, cols, row_range, col_range);
  const TensorView src = ckpt_.get(name, {rows, cols});
  const std::string file = ckpt_.file_of(name);
  TANDEM_CHECK_KIND(kInvalidArgument, src.dtype == DType::kF8E4M3, file, ": tensor '", name,
                    "' has dtype ", dtype_name(src.dtype), ", expected F8_E4M3 (block FP8)");
  if (quant_.method == WeightQuant::kMxfp8) {
    TANDEM_CHECK_KIND(kUnsupported, fp8_columns_splittable(col_range, kBlockK), file, ": tensor '",
                      name, "': columns [", col_range.begin, ", ", col_range.end,
                      ") straddle 128-column blocks (cannot be requantized to block FP8)");
    // The 128x128 blocks the range touches, on the whole tensor's grid, dequantized and
    // requantized (quantize_fp8_block): the codes a whole-tensor requantization gives.
    const IndexRange br{row_range.begin / kBlockK * kBlockK,
                        std::min(rows, (row_range.end + kBlockK - 1) / kBlockK * kBlockK)};
    const IndexRange bc{col_range.begin / kBlockK * kBlockK,
                        std::min(cols, (col_range.end + kBlockK - 1) / kBlockK * kBlockK)};
    const int64_t sw = bc.size(), sbc = (sw + kBlockK - 1) / kBlockK;
    std::vector<float> vals(static_cast<size_t>(br.size() * sw));
    read(name, rows, cols, br, bc, vals.data());
    std::vector<uint8_t> sq(vals.size());
    std::vector<float> ss(static_cast<size_t>((br.size() + kBlockK - 1) / kBlockK * sbc));
    quantize_fp8_block(vals.data(), br.size(), sw, sq.data(), ss.data());
    const int64_t w = col_range.size(), kb = (w + kBlockK - 1) / kBlockK;
    const int64_t c_off = col_range.begin - bc.begin, b0 = c_off / kBlockK;
    for (int64_t i = row_range.begin; i < row_range.end; ++i) {
      const int64_t li = i - br.begin;
      std::memcpy(q + (i - row_range.begin) * w, sq.data() + li * sw + c_off,
                  static_cast<size_t>(w));
      for (int64_t j = 0; j < kb; ++j) {
        row_scales[(i - row_range.begin) * kb + j] = ss[(li / kBlockK) * sbc + b0 + j];
      }
    }
    return;
  }
  TANDEM_CHECK_KIND(kUnsupported,
                    quant_.method == WeightQuant::kFp8Block && quant_.block_cols == kBlockK &&
                        quant_.block_rows > 0,
                    config_origin_, ": quantization_config ", weight_quant_name(quant_.method),
                    " with ", quant_.block_rows, "x", quant_.block_cols,
                    " blocks cannot stay FP8 on the GPU (block FP8 with 128-wide blocks can)");
  TANDEM_CHECK_KIND(kUnsupported, fp8_columns_splittable(col_range, kBlockK), file, ": tensor '",
                    name, "': columns [", col_range.begin, ", ", col_range.end,
                    ") straddle its 128-column scale blocks (cannot stay FP8)");
  const int64_t br = quant_.block_rows;
  const IndexRange sr = block_range(row_range, br);
  const std::vector<float> scale = read_scales(name, rows, cols, sr.begin, sr.end);
  const int64_t scols = (cols + kBlockK - 1) / kBlockK, w = col_range.size();
  const int64_t kb = (w + kBlockK - 1) / kBlockK, b0 = col_range.begin / kBlockK;
  const auto* codes = static_cast<const uint8_t*>(src.data);
  for (int64_t i = row_range.begin; i < row_range.end; ++i) {
    const uint8_t* row = codes + i * cols + col_range.begin;
    uint8_t* out = q + (i - row_range.begin) * w;
    for (int64_t j = 0; j < w; ++j) {
      TANDEM_CHECK_KIND(kInvalidArgument, (row[j] & 0x7f) != 0x7f, file, ": tensor '", name,
                        "': E4M3 NaN code at [", i, ", ", col_range.begin + j, "]");
    }
    std::memcpy(out, row, static_cast<size_t>(w));
    const float* srow = scale.data() + (i / br - sr.begin) * scols;
    for (int64_t j = 0; j < kb; ++j) row_scales[(i - row_range.begin) * kb + j] = srow[b0 + j];
  }
}

void WeightReader::read_mxfp8_codes(const std::string& name, int64_t rows, int64_t cols,
                                    IndexRange row_range, IndexRange col_range, uint8_t* q,
                                    uint8_t* e8m0) const {
  constexpr int64_t kB = 32;
  check_slice(name, rows, cols, row_range, col_range);
  const TensorView src = ckpt_.get(name, {rows, cols});
  const std::string file = ckpt_.file_of(name);
  TANDEM_CHECK_KIND(kInvalidArgument, src.dtype == DType::kF8E4M3, file, ": tensor '", name,
                    "' has dtype ", dtype_name(src.dtype), ", expected F8_E4M3 (MXFP8)");
  TANDEM_CHECK_KIND(
      kUnsupported,
      quant_.method == WeightQuant::kMxfp8 && quant_.block_cols == kB && quant_.block_rows == 1,
      config_origin_, ": quantization_config ", weight_quant_name(quant_.method), " with ",
      quant_.block_rows, "x", quant_.block_cols, " blocks is not MXFP8 (1x32 E8M0 blocks)");
  TANDEM_CHECK_KIND(kUnsupported,
                    col_range.begin % kB == 0 && (col_range.end % kB == 0 || col_range.end == cols),
                    file, ": tensor '", name, "': columns [", col_range.begin, ", ", col_range.end,
                    ") straddle its 32-column scale blocks (cannot stay MXFP8)");
  const std::string scale_name = quant_.scale_name(name);
  TANDEM_CHECK_KIND(kInvalidArgument, ckpt_.has(scale_name), file, ": tensor '", name,
                    "' is F8_E4M3 (MXFP8) but its scale tensor '", scale_name, "' is missing from ",
                    ckpt_.dir());
  const int64_t scols = (cols + kB - 1) / kB;
  const TensorView sv = ckpt_.get(scale_name);
  const std::string sfile = ckpt_.file_of(scale_name);
  TANDEM_CHECK_KIND(kInvalidArgument, sv.shape == Shape({rows, scols}), sfile, ": scale tensor '",
                    scale_name, "' has shape ", sv.shape.str(), ", expected ",
                    shape_str(rows, scols), " for '", name, "' of shape ", shape_str(rows, cols),
                    " in 1x32 blocks");
  TANDEM_CHECK_KIND(kInvalidArgument, sv.dtype == DType::kE8M0, sfile, ": scale tensor '",
                    scale_name, "' has dtype ", dtype_name(sv.dtype),
                    ", expected E8M0 (U8 or F8_E8M0) for MXFP8");
  const auto* codes = static_cast<const uint8_t*>(src.data);
  const auto* scodes = static_cast<const uint8_t*>(sv.data);
  const int64_t w = col_range.size(), kb = (w + kB - 1) / kB, b0 = col_range.begin / kB;
  for (int64_t i = row_range.begin; i < row_range.end; ++i) {
    const uint8_t* row = codes + i * cols + col_range.begin;
    for (int64_t j = 0; j < w; ++j) {
      TANDEM_CHECK_KIND(kInvalidArgument, !is_f8_nan(row[j]), file, ": tensor '", name,
                        "': E4M3 NaN code at [", i, ", ", col_range.begin + j, "]");
    }
    std::memcpy(q + (i - row_range.begin) * w, row, static_cast<size_t>(w));
    for (int64_t j = 0; j < kb; ++j) {
      const uint8_t e = scodes[i * scols + b0 + j];
      TANDEM_CHECK_KIND(kInvalidArgument, e != 0xff, sfile, ": scale tensor '", scale_name,
                        "': E8M0 code 0xff (NaN) at [", i, ", ", b0 + j, "]");
      e8m0[(i - row_range.begin) * kb + j] = e;
    }
  }
}

void WeightReader::read_fp8(const std::string& name, const TensorView& q, int64_t rows,
                            int64_t cols, IndexRange row_range, IndexRange col_range,
                            float* dst) const {
  const std::string file = ckpt_.file_of(name);
  TANDEM_CHECK_KIND(kInvalidArgument, quant_.quantized(), file, ": tensor '", name,
                    "' is stored as F8_E4M3 but ", config_origin_,
                    " has no quantization_config (its scales cannot be known)");
  const int64_t br = quant_.block_rows, bc = quant_.block_cols;
  const int64_t scols = (cols + bc - 1) / bc;
  // The scale rows this range touches, as f32.
  const IndexRange sr = block_range(row_range, br);
  const int64_t s0 = sr.begin;
  const std::vector<float> scale = read_scales(name, rows, cols, sr.begin, sr.end);

  const float* table = f8e4m3_table();
  const auto* codes = static_cast<const uint8_t*>(q.data);
  const int64_t w = col_range.size();
  for (int64_t i = row_range.begin; i < row_range.end; ++i) {
    const uint8_t* row = codes + i * cols;
    const float* srow = scale.data() + (i / br - s0) * scols;
    float* out = dst + (i - row_range.begin) * w;
    for (int64_t j = col_range.begin; j < col_range.end; ++j) {
      const uint8_t c = row[j];
      TANDEM_CHECK_KIND(kInvalidArgument, !is_f8_nan(c), file, ": tensor '", name,
                        "': E4M3 NaN code at [", i, ", ", j, "]");
      out[j - col_range.begin] = table[c] * srow[j / bc];
    }
  }
}

void quantize_fp8_block(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale_inv) {
  constexpr int64_t kB = 128;
  const int64_t scols = (cols + kB - 1) / kB;
  for (int64_t r0 = 0; r0 < rows; r0 += kB) {
    for (int64_t c0 = 0; c0 < cols; c0 += kB) {
      const int64_t r1 = std::min(rows, r0 + kB), c1 = std::min(cols, c0 + kB);
      float amax = 0.f;
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t j = c0; j < c1; ++j) amax = std::max(amax, std::fabs(w[i * cols + j]));
      }
      const float s = amax > 0.f ? amax / 448.0f : 1.0f;
      scale_inv[(r0 / kB) * scols + c0 / kB] = s;
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t j = c0; j < c1; ++j) q[i * cols + j] = f32_to_f8e4m3(w[i * cols + j] / s);
      }
    }
  }
}

uint8_t mxfp8_scale_code(float amax) {
  if (!(amax > 0.f)) return 127;
  TANDEM_CHECK(std::isfinite(amax), "mxfp8_scale_code: non-finite block maximum ", amax);
  // The smallest e with amax <= 448 * 2^e (exact comparisons in double).
  int e = std::ilogb(amax) - 8;
  while (std::ldexp(448.0, e) < amax) ++e;
  while (std::ldexp(448.0, e - 1) >= amax) --e;
  return static_cast<uint8_t>(std::clamp(e, -127, 127) + 127);
}

void quantize_mxfp8(const float* w, int64_t rows, int64_t cols, uint8_t* q, uint8_t* e8m0) {
  constexpr int64_t kB = 32;
  const int64_t scols = (cols + kB - 1) / kB;
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = w + i * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kB) {
      const int64_t c1 = std::min(cols, c0 + kB);
      float amax = 0.f;
      for (int64_t j = c0; j < c1; ++j) amax = std::max(amax, std::fabs(row[j]));
      const uint8_t code = mxfp8_scale_code(amax);
      e8m0[i * scols + c0 / kB] = code;
      const int shift = 127 - static_cast<int>(code);  // w / 2^(code - 127)
      for (int64_t j = c0; j < c1; ++j) q[i * cols + j] = f32_to_f8e4m3(std::ldexp(row[j], shift));
    }
  }
}

}  // namespace tandem
