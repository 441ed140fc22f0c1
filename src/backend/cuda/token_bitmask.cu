#include <cuda_bf16.h>

#include <cmath>
#include <type_traits>

#include "backend/cuda/check.h"
#include "backend/cuda/token_bitmask.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kThreads = 256;

// grid (ceil(words / (kThreads / 32)), rows): one warp per 32-bit word, one lane per token, so
// a warp reads one word (broadcast) and writes 32 consecutive logits.
template <typename T>
__global__ void apply_token_bitmask_kernel(T* __restrict__ logits,
                                           int32_t const* __restrict__ bitmask,
                                           int32_t const* __restrict__ mask_row, int64_t vocab,
                                           int64_t words) {
  const int64_t row = blockIdx.y;
  const int64_t mrow = mask_row ? mask_row[row] : row;
  if (mrow < 0) return;
  const int64_t word = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int64_t id = word * 32 + threadIdx.x % 32;
  if (id >= vocab) return;
  const uint32_t bits = static_cast<uint32_t>(bitmask[mrow * words + word]);
  if (((bits >> (threadIdx.x % 32)) & 1u) == 0) {
    if constexpr (std::is_same_v<T, float>) {
      logits[row * vocab + id] = -INFINITY;
    } else {
      logits[row * vocab + id] = __float2bfloat16(-INFINITY);
    }
  }
}

__global__ void apply_logit_bias_kernel(float* __restrict__ logits,
                                        LogitBiasEntry const* __restrict__ entries, int64_t count,
                                        int64_t vocab) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= count) return;
  const LogitBiasEntry e = entries[j];
  logits[e.row * vocab + e.id] += e.bias;
}

}  // namespace

void apply_logit_bias_launch(LogitBiasParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument, p.count >= 0 && p.vocab > 0, "apply_logit_bias: count ",
                    p.count, ", vocab ", p.vocab);
  if (p.count == 0) return;
  TANDEM_CHECK_KIND(kInvalidArgument, p.logits != nullptr && p.entries != nullptr,
                    "apply_logit_bias: null logits / entries");
  const auto blocks = static_cast<unsigned>((p.count + kThreads - 1) / kThreads);
  apply_logit_bias_kernel<<<blocks, kThreads, 0, stream>>>(p.logits, p.entries, p.count, p.vocab);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

void apply_token_bitmask_launch(TokenBitmaskParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument, p.rows >= 0 && p.vocab > 0 && p.words * 32 >= p.vocab,
                    "apply_token_bitmask: rows ", p.rows, ", vocab ", p.vocab, ", words ", p.words,
                    " (need words >= ceil(vocab / 32))");
  TANDEM_CHECK_KIND(kInvalidArgument, p.dtype == DType::kF32 || p.dtype == DType::kBF16,
                    "apply_token_bitmask: logits must be f32 or bf16");
  TANDEM_CHECK_KIND(kInvalidArgument, p.rows <= 65535, "apply_token_bitmask: at most 65535 rows");
  if (p.rows == 0) return;
  const int64_t used_words = (p.vocab + 31) / 32;
  dim3 grid(static_cast<unsigned>((used_words + kThreads / 32 - 1) / (kThreads / 32)),
            static_cast<unsigned>(p.rows));
  if (p.dtype == DType::kF32) {
    apply_token_bitmask_kernel<float><<<grid, kThreads, 0, stream>>>(
        static_cast<float*>(p.logits), p.bitmask, p.mask_row, p.vocab, p.words);
  } else {
    apply_token_bitmask_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(p.logits), p.bitmask, p.mask_row, p.vocab, p.words);
  }
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tandem::cuda
