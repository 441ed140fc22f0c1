// The token bitmask (structured outputs) on the GPU against the CPU reference
// tandem::apply_token_bitmask: fp32 and bf16 logits, vocabularies off a multiple of 32, a row
// map with unmasked rows, all-allowed and all-disallowed words. Fresh random inputs every run
// (the seed is printed on failure). Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/cuda/token_bitmask.h"
#include "cuda_test_util.h"
#include "engine/sampling.h"

namespace tandem::cuda {
namespace {

using test_util::CudaFixture;
using test_util::DeviceBuffer;

class TokenBitmaskCuda : public CudaFixture<> {};

TEST_F(TokenBitmaskCuda, MatchesTheCpuReference) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t vocab : {1, 31, 33, 1000, 151936}) {
      for (bool mapped : {false, true}) {
        const int64_t rows = 5, words = (vocab + 31) / 32 + 1;  // a padded mask row
        std::vector<int32_t> mask(static_cast<size_t>(rows * words));
        for (auto& w : mask) w = static_cast<int32_t>(rng_());
        for (int64_t i = 0; i < words; ++i) mask[size_t(words + i)] = -1;     // row 1: all allowed
        for (int64_t i = 0; i < words; ++i) mask[size_t(2 * words + i)] = 0;  // row 2: none
        std::vector<int32_t> map = {4, -1, 2, 0, 1};
        std::vector<float> logits(static_cast<size_t>(rows * vocab));
        for (auto& x : logits) x = static_cast<float>(rng_() % 2000) / 100.0f - 10.0f;
        std::vector<uint16_t> bf(logits.size());
        for (size_t i = 0; i < logits.size(); ++i) {
          bf[i] = f32_to_bf16(logits[i]);
          if (dtype == DType::kBF16) logits[i] = bf16_to_f32(bf[i]);
        }
        // Reference: row r through its mask row.
        std::vector<float> want = logits;
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t m = mapped ? map[size_t(r)] : r;
          if (m < 0) continue;
          std::span<float> row(want.data() + r * vocab, size_t(vocab));
          std::span<const uint32_t> bits(reinterpret_cast<const uint32_t*>(mask.data()) + m * words,
                                         size_t(words));
          apply_token_bitmask(row, bits);
        }
        DeviceBuffer<int32_t> dmask(mask), dmap(map);
        DeviceBuffer<float> df(logits);
        DeviceBuffer<uint16_t> db(bf);
        TokenBitmaskParams p{};
        p.logits = dtype == DType::kF32 ? static_cast<void*>(df.ptr) : static_cast<void*>(db.ptr);
        p.dtype = dtype;
        p.bitmask = dmask.ptr;
        p.mask_row = mapped ? dmap.ptr : nullptr;
        p.rows = rows;
        p.vocab = vocab;
        p.words = words;
        apply_token_bitmask_launch(p, stream_);
        sync();
        std::vector<float> got(logits.size());
        if (dtype == DType::kF32) {
          got = df.download();
        } else {
          std::vector<uint16_t> gb = db.download();
          for (size_t i = 0; i < gb.size(); ++i) got[i] = bf16_to_f32(gb[i]);
        }
        ASSERT_EQ(got, want) << trace() << " vocab " << vocab << " mapped " << mapped << " dtype "
                             << dtype_name(dtype);
      }
    }
  }
}

TEST_F(TokenBitmaskCuda, RefusesBadShapes) {
  TokenBitmaskParams p{};
  p.dtype = DType::kF32;
  p.rows = 1;
  p.vocab = 100;
  p.words = 3;  // needs 4
  EXPECT_THROW(apply_token_bitmask_launch(p, stream_), Error);
}

}  // namespace
}  // namespace tandem::cuda
