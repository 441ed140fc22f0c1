// Optional comparison: FlashInfer's FA2-style single-sequence causal prefill (contiguous NHD
// K/V, headers of the flashinfer-python wheel) beside our paged prefill kernel on the same
// problem, each as TFLOP/s (FLOPs = 4 * T(T+1)/2 * head_dim * q_heads). Not part of the main
// build: configure with -DTANDEM_FLASHINFER_INCLUDE=<wheel>/flashinfer/data/include and, with
// CUDA 13.0, -DTANDEM_FLASHINFER_CCCL=<a newer CCCL include> (FlashInfer 0.7 uses
// cuda::fast_mod_div).
//
//   bench_attention_flashinfer     prints one line per (kernel, T)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <flashinfer/attention/default_prefill_params.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/variants.cuh>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/attention.h"
#include "backend/cuda/check.h"

namespace {

using FiParams = flashinfer::SinglePrefillParams<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16>;
constexpr int64_t kQHeads = 32, kKvHeads = 4, kHeadDim = 128, kPageSize = 16;

__global__ void fill_kernel(__nv_bfloat16* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16((h & 0xffff) / 32768.f - 1.f);
  }
}

// Median milliseconds of `fn` over 9 timed runs after 2 warm-ups.
template <class F>
float time_ms(cudaStream_t s, F const& fn) {
  cudaEvent_t a, b;
  TANDEM_CUDA_CHECK(cudaEventCreate(&a));
  TANDEM_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < 11; ++i) {
    TANDEM_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    TANDEM_CUDA_CHECK(cudaEventRecord(b, s));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 2) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  return t[t.size() / 2];
}

}  // namespace

int main() {
  using namespace tandem::cuda;
  cudaStream_t s;
  TANDEM_CUDA_CHECK(cudaStreamCreate(&s));
  for (int64_t T : {2048, 8192}) {
    const size_t nq = T * kQHeads * kHeadDim, nkv = T * kKvHeads * kHeadDim;
    const int64_t pages = (T + kPageSize - 1) / kPageSize;
    __nv_bfloat16 *q, *k, *v, *o, *pool;
    int32_t *table, *tseq, *pos;
    TANDEM_CUDA_CHECK(cudaMalloc(&q, nq * 2));
    TANDEM_CUDA_CHECK(cudaMalloc(&o, nq * 2));
    TANDEM_CUDA_CHECK(cudaMalloc(&k, nkv * 2));
    TANDEM_CUDA_CHECK(cudaMalloc(&v, nkv * 2));
    TANDEM_CUDA_CHECK(cudaMalloc(&pool, 2 * nkv * 2));  // pages * 2 * kv_heads * 16 * 128
    TANDEM_CUDA_CHECK(cudaMalloc(&table, pages * 4));
    TANDEM_CUDA_CHECK(cudaMalloc(&tseq, T * 4));
    TANDEM_CUDA_CHECK(cudaMalloc(&pos, T * 4));
    fill_kernel<<<1024, 256, 0, s>>>(q, nq, 1);
    fill_kernel<<<1024, 256, 0, s>>>(k, nkv, 2);
    fill_kernel<<<1024, 256, 0, s>>>(v, nkv, 3);
    fill_kernel<<<1024, 256, 0, s>>>(pool, 2 * nkv, 4);
    std::vector<int32_t> ht(pages), hs(T, 0), hp(T);
    std::iota(ht.begin(), ht.end(), 0);
    std::shuffle(ht.begin(), ht.end(), std::mt19937(7));
    std::iota(hp.begin(), hp.end(), 0);
    TANDEM_CUDA_CHECK(cudaMemcpy(table, ht.data(), pages * 4, cudaMemcpyHostToDevice));
    TANDEM_CUDA_CHECK(cudaMemcpy(tseq, hs.data(), T * 4, cudaMemcpyHostToDevice));
    TANDEM_CUDA_CHECK(cudaMemcpy(pos, hp.data(), T * 4, cudaMemcpyHostToDevice));
    const float scale = 0.08838834764831845f;
    const double flops = 4.0 * 0.5 * T * (T + 1) * kHeadDim * kQHeads;

    FiParams fp(q, k, v, nullptr, o, nullptr, nullptr, kQHeads, kKvHeads, T, T, kQHeads * kHeadDim,
                kHeadDim, kKvHeads * kHeadDim, kHeadDim, kHeadDim,
                /*window_left=*/-1, /*logits_soft_cap=*/0.f, scale, 1.f, 1e4f);
    const float fi_ms = time_ms(s, [&] {
      cudaError_t st = flashinfer::SinglePrefillWithKVCacheDispatched<
          128, 128, flashinfer::PosEncodingMode::kNone, false, flashinfer::MaskMode::kCausal, false,
          flashinfer::DefaultAttention<false, false, false, false>, FiParams>(fp, nullptr, s);
      TANDEM_CUDA_CHECK(st);
    });
    std::printf("flashinfer_single_prefill_fa2  T %5lld  %8.3f ms  %6.1f TFLOP/s\n",
                static_cast<long long>(T), fi_ms, flops / (fi_ms * 1e-3) / 1e12);

    PagedAttentionParams p{q,       pool,     table,    tseq,      pos,   o,    T,
                           kQHeads, kKvHeads, kHeadDim, kPageSize, pages, scale};
    p.num_prefill_tokens = T;
    const float our_ms = time_ms(s, [&] { paged_attention_launch(p, s); });
    std::printf("tandem_paged_prefill           T %5lld  %8.3f ms  %6.1f TFLOP/s\n",
                static_cast<long long>(T), our_ms, flops / (our_ms * 1e-3) / 1e12);
    for (void* ptr : {static_cast<void*>(q), static_cast<void*>(o), static_cast<void*>(k),
                      static_cast<void*>(v), static_cast<void*>(pool), static_cast<void*>(table),
                      static_cast<void*>(tseq), static_cast<void*>(pos)}) {
      (void)cudaFree(ptr);
    }
  }
  return 0;
}
