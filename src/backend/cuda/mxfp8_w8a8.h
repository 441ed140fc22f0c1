// MXFP8 checkpoints (E4M3 codes + one E8M0 power-of-two scale per row and 32 columns) on the
// W8A8 kernels, whose weight scales cover 128 columns. Two load-time conversions:
//
//  - row 128 (mxfp8_to_row128, this header): one f32 scale per row and 128 columns, the
//    largest of the block's four E8M0 scales; the codes of a 32-column sub-block whose scale is
//    2^d times smaller are re-encoded as e4m3(value * 2^-d). A power-of-two shift of an E4M3
//    value is exact while it stays at or above E4M3's smallest normal (2^-6) and exact below it
//    when its mantissa fits the subnormal grid (multiples of 2^-9); only values within ~2^-6 of
//    zero relative to the block's largest scale can round. So this is MXFP8's own numerics up
//    to those few codes (counted, and measured by bench_mxfp8_w8a8), at 4 bytes of scale per
//    128 weights (3% over block FP8's) and a kernel with per-row weight scales.
//  - 128 x 128 blocks (the model's TANDEM_CUDA_MXFP8=block path, model/quant.h
//    quantize_fp8_block over the dequantized values): the block FP8 kernels unchanged, but
//    every value is rounded a second time at a coarser scale (docs/perf.md: about MXFP8's own
//    error again, twice the KL).
#pragma once

#include <cstdint>

namespace tandem::cuda {

/// q [n, k] E4M3 and e8m0 [n, ceil(k / 32)] (k % 128 == 0) -> q_out [n, k] E4M3 (may alias q)
/// and row_scale [n, k / 128] f32 (powers of two). Host memory. Returns the number of codes
/// whose value changed (rounded by the shift; 0 when every sub-block shares its block's scale).
int64_t mxfp8_to_row128(uint8_t const* q, uint8_t const* e8m0, int64_t n, int64_t k, uint8_t* q_out,
                        float* row_scale);

}  // namespace tandem::cuda
