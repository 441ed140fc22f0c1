#include "model/cuda/device_sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cuda/check.h"
#include "backend/cuda/sampling.h"
#include "backend/cuda/token_bitmask.h"
#include "core/error.h"

namespace tandem::cuda_model {

namespace {
constexpr int64_t kTop = cuda::kMaxTopLogprobs;
// The multi-CTA sampling path (a row over several CTAs) pays off for few rows (bench_sampling,
// docs/perf.md): it wins every case at 1 row; at 32 rows it wins the rows without a cut
// (temperature, min-p) but loses those with top-k / top-p; at 128 rows the single-CTA path wins
// all. Both paths give the same tokens.
constexpr int64_t kMultiCtaRows = 64;     // without top-k / top-p in the batch
constexpr int64_t kMultiCtaCutRows = 16;  // with
}  // namespace

DeviceSampler::DeviceSampler(int64_t rows_cap, int64_t vocab)
    : rows_cap_(rows_cap), vocab_(vocab), words_((vocab + 31) / 32) {
  const auto R = static_cast<size_t>(rows_cap);
  params_ = DeviceMem(R * sizeof(cuda::SamplingRowParams));
  tokens_ = DeviceMem(R * sizeof(int32_t));
  logprobs_ = DeviceMem(R * sizeof(float));
  top_ids_ = DeviceMem(R * kTop * sizeof(int32_t));
  top_lp_ = DeviceMem(R * kTop * sizeof(float));
  workspace_ = DeviceMem(cuda::sample_workspace_bytes(std::min(rows_cap, kMultiCtaRows), vocab));
  host_ = PinnedMem(R * (sizeof(cuda::SamplingRowParams) + 8 + kTop * 8));
  mask_row_ = DeviceMem(R * sizeof(int32_t));
  host_mask_row_ = PinnedMem(R * sizeof(int32_t));
  cuda::SamplingRowParams greedy;
  greedy.temperature = 0.0f;
  const std::vector<cuda::SamplingRowParams> rows(R, greedy);
  greedy_ = DeviceMem(R * sizeof(cuda::SamplingRowParams));
  TANDEM_CUDA_CHECK(cudaMemcpy(greedy_.as<void>(), rows.data(), R * sizeof(cuda::SamplingRowParams),
                               cudaMemcpyHostToDevice));
}

void DeviceSampler::argmax(const float* logits, int64_t rows, int32_t* tokens,
                           cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument, rows <= rows_cap_, rows,
                    " sampling rows exceed the CUDA model's ", rows_cap_);
  if (rows <= 0) return;
  const bool multi = !batch_invariant_ && rows <= kMultiCtaRows;
  cuda::sample_launch({logits, DType::kF32, greedy_.as<cuda::SamplingRowParams>(), tokens, nullptr,
                       nullptr, nullptr, rows, vocab_, multi ? workspace_.as<void>() : nullptr},
                      stream);
}

void DeviceSampler::sample(float* logits, const std::vector<DeviceSampling>& rows,
                           const std::function<void()>& wait_masks, std::vector<SampledToken>& out,
                           cudaStream_t stream) {
  enqueue(logits, rows, wait_masks, stream);
  collect(out, stream);
}

void DeviceSampler::enqueue(float* logits, const std::vector<DeviceSampling>& rows,
                            const std::function<void()>& wait_masks, cudaStream_t stream) {
  const auto R = static_cast<int64_t>(rows.size());
  TANDEM_CHECK_KIND(kInvalidArgument, R <= rows_cap_, R, " sampling rows exceed the CUDA model's ",
                    rows_cap_);
  pending_ = 0;
  if (R == 0) return;
  auto h2d = [&](void* dst, const void* src, size_t bytes) {
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
  };
  auto d2h = [&](void* dst, const void* src, size_t bytes) {
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  };
  // The pinned buffer: params [R] | tokens [R] | logprobs [R] | top ids | top logprobs.
  auto* hp = host_.as<cuda::SamplingRowParams>();
  auto* ht = reinterpret_cast<int32_t*>(hp + R);
  auto* hl = reinterpret_cast<float*>(ht + R);
  auto* hti = reinterpret_cast<int32_t*>(hl + R);
  auto* htl = reinterpret_cast<float*>(hti + R * kTop);
  int32_t max_top = 0;
  int64_t num_bias = 0;
  bool any_mask = false, any_cut = false;
  for (int64_t r = 0; r < R; ++r) {
    const DeviceSampling& d = rows[static_cast<size_t>(r)];
    cuda::SamplingRowParams p;
    p.temperature = d.temperature;
    p.top_k = d.top_k;
    p.top_p = d.top_p;
    p.min_p = d.min_p;
    p.seed = d.seed;
    p.counter = d.counter;
    p.want_logprob = d.logprobs >= 0 ? 1 : 0;
    p.n_top = static_cast<int32_t>(std::clamp<int64_t>(d.logprobs, 0, kTop));
    max_top = std::max(max_top, p.n_top);
    hp[r] = p;
    num_bias += static_cast<int64_t>(d.bias.size());
    any_mask |= d.mask != nullptr;
    any_cut |= !(d.temperature < 1e-5f) && ((d.top_k > 0 && d.top_k < vocab_) || d.top_p < 1.0f);
  }
  h2d(params_.as<void>(), hp, static_cast<size_t>(R) * sizeof(cuda::SamplingRowParams));

  // Logit biases: one entry per (row, id), the ids distinct within a row (no write races).
  if (num_bias > 0) {
    if (num_bias > bias_cap_) {
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));  // the old buffers may be in flight
      bias_cap_ = std::max<int64_t>(num_bias, 2 * bias_cap_);
      bias_ = DeviceMem(static_cast<size_t>(bias_cap_) * sizeof(cuda::LogitBiasEntry));
      host_bias_ = PinnedMem(static_cast<size_t>(bias_cap_) * sizeof(cuda::LogitBiasEntry));
    }
    auto* hb = host_bias_.as<cuda::LogitBiasEntry>();
    int64_t j = 0;
    for (int64_t r = 0; r < R; ++r) {
      for (const auto& [id, b] : rows[static_cast<size_t>(r)].bias) {
        TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < vocab_, "logit_bias: token id ", id,
                          " outside the vocabulary (", vocab_, ")");
        hb[j++] = {static_cast<int32_t>(r), id, b};
      }
    }
    h2d(bias_.as<void>(), hb, static_cast<size_t>(num_bias) * sizeof(cuda::LogitBiasEntry));
    cuda::apply_logit_bias_launch({logits, bias_.as<cuda::LogitBiasEntry>(), num_bias, vocab_},
                                  stream);
  }

  // Structured outputs: the masks of this step (filled by the engine while the forward ran).
  if (any_mask) {
    if (wait_masks) wait_masks();
    if (mask_.size() == 0) {
      mask_ = DeviceMem(static_cast<size_t>(rows_cap_ * words_) * sizeof(uint32_t));
      host_mask_ = PinnedMem(static_cast<size_t>(rows_cap_ * words_) * sizeof(uint32_t));
    }
    auto* hm = host_mask_.as<uint32_t>();
    auto* hr = host_mask_row_.as<int32_t>();
    int32_t masked = 0;
    for (int64_t r = 0; r < R; ++r) {
      const DeviceSampling& d = rows[static_cast<size_t>(r)];
      hr[r] = -1;
      if (d.mask == nullptr || d.mask_active == nullptr || !*d.mask_active) continue;
      uint32_t* dst = hm + static_cast<int64_t>(masked) * words_;
      const size_t n = std::min(d.mask->size(), static_cast<size_t>(words_));
      std::memcpy(dst, d.mask->data(), n * sizeof(uint32_t));
      std::fill(dst + n, dst + words_, 0u);  // ids past the mask's words: disallowed
      hr[r] = masked++;
    }
    if (masked > 0) {
      h2d(mask_.as<void>(), hm, static_cast<size_t>(masked * words_) * sizeof(uint32_t));
      h2d(mask_row_.as<void>(), hr, static_cast<size_t>(R) * sizeof(int32_t));
      cuda::TokenBitmaskParams mp{};
      mp.logits = logits;
      mp.dtype = DType::kF32;
      mp.bitmask = mask_.as<int32_t>();
      mp.mask_row = mask_row_.as<int32_t>();
      mp.rows = R;
      mp.vocab = vocab_;
      mp.words = words_;
      cuda::apply_token_bitmask_launch(mp, stream);
    }
  }

  const bool multi = !batch_invariant_ && R <= (any_cut ? kMultiCtaCutRows : kMultiCtaRows);
  cuda::sample_launch({logits, DType::kF32, params_.as<cuda::SamplingRowParams>(),
                       tokens_.as<int32_t>(), logprobs_.as<float>(), top_ids_.as<int32_t>(),
                       top_lp_.as<float>(), R, vocab_, multi ? workspace_.as<void>() : nullptr},
                      stream);
  d2h(ht, tokens_.as<void>(), static_cast<size_t>(R) * 4);
  d2h(hl, logprobs_.as<void>(), static_cast<size_t>(R) * 4);
  if (max_top > 0) {
    d2h(hti, top_ids_.as<void>(), static_cast<size_t>(R * kTop) * 4);
    d2h(htl, top_lp_.as<void>(), static_cast<size_t>(R * kTop) * 4);
  }
  pending_ = R;
}

void DeviceSampler::collect(std::vector<SampledToken>& out, cudaStream_t stream) {
  const int64_t R = pending_;
  pending_ = 0;
  out.clear();
  if (R == 0) return;
  auto* hp = host_.as<cuda::SamplingRowParams>();
  auto* ht = reinterpret_cast<int32_t*>(hp + R);
  auto* hl = reinterpret_cast<float*>(ht + R);
  auto* hti = reinterpret_cast<int32_t*>(hl + R);
  auto* htl = reinterpret_cast<float*>(hti + R * kTop);
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  out.resize(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    SampledToken& o = out[static_cast<size_t>(r)];
    o.token = ht[r];
    o.logprob = hl[r];
    for (int32_t j = 0; j < hp[r].n_top; ++j) {
      if (hti[r * kTop + j] < 0) break;
      o.top.emplace_back(hti[r * kTop + j], htl[r * kTop + j]);
    }
  }
}

}  // namespace tandem::cuda_model
