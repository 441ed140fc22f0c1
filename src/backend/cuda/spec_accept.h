// Speculative decoding's acceptance on the GPU: rejection sampling of K draft tokens per
// sequence against the target's distributions (Leviathan et al. 2023), the random numbers from
// the request's seeded counter-based stream as the device sampler draws them (sampling.h).
// Framework-free: a params struct in, a stream; asynchronous and CUDA-graph safe (no host
// sync, no allocation; the grid depends only on the number of sequences).
//
// Per sequence s with k = num_drafts[s] drafts d_0..d_{k-1} (k <= K):
//   for j = 0..k-1:
//     u = the uniform of (seed, counter + j) under the tag "ACPT" (53 bits of Philox4x32-10);
//     accept d_j when u * q_j(d_j) < p_j(d_j) (in double; q one-hot at d_j when q is nullptr:
//       u < p_j(d_j)), i.e. with probability min(1, p_j(d_j) / q_j(d_j));
//     else the token is drawn from max(0, p_j - q_j) (p_j when that is zero everywhere) and
//       the sequence stops;
//   all k accepted: the bonus token is drawn from p_k.
// A draw from weights w at output position n = counter + j is the device sampler's draw: the
// uniform of (seed, n) under its tag "DRAW", the target floor(u * W) of the total fixed-point
// mass W = sum of round(w_i * 2^40), and the first id in id order whose running mass exceeds
// it. So all sums are exact integers (the token does not depend on the thread layout), and
// the CPU reference (spec_accept_reference) gives the very same tokens.
// p and q are probabilities as the sampler's transforms leave them (temperature, top-k, top-p,
// min-p: tandem::token_distribution); entries outside [0, 1] or NaN count as 0 in the draws.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace tandem::cuda {

/// The random stream's tags (Philox counter word w): the sampler's draw and the acceptance.
inline constexpr uint32_t kDrawTag = 0x44524157u;    // "DRAW" (sampling.cu's draw_target)
inline constexpr uint32_t kAcceptTag = 0x41435054u;  // "ACPT"

/// Per-sequence parameters (device array). POD.
struct SpecAcceptRow {
  uint64_t seed = 0;       // the request's device seed
  uint64_t counter = 0;    // the output position of the first verified token
  int32_t num_drafts = 0;  // k in [0, K]
};

struct SpecAcceptParams {
  float const* p = nullptr;         // [seqs, K + 1, vocab] the target's distributions, row j after
                                    // the last token and drafts 0..j-1
  float const* q = nullptr;         // [seqs, K, vocab] the drafts' distributions; nullptr: one-hot
  int32_t const* drafts = nullptr;  // [seqs, K] (entries past num_drafts unused)
  SpecAcceptRow const* rows = nullptr;  // [seqs]
  int32_t* tokens = nullptr;  // [seqs, K + 1] out: accepted drafts then the final token, -1 after
  int32_t* num_accepted = nullptr;     // [seqs] out: drafts accepted, in [0, k]
  int64_t seqs = 0, K = 0, vocab = 0;  // K >= 0; vocab in [1, 2^23]
};

/// Launches on `stream`; throws Error(kInvalidArgument) for bad shapes or a null pointer.
void spec_accept_launch(SpecAcceptParams const& p, cudaStream_t stream);

/// The CPU reference (host arrays of the same layout), for the tests: the same tokens.
void spec_accept_reference(std::vector<float> const& p, std::vector<float> const& q,
                           std::vector<int32_t> const& drafts,
                           std::vector<SpecAcceptRow> const& rows, int64_t K, int64_t vocab,
                           std::vector<int32_t>& tokens, std::vector<int32_t>& num_accepted);

/// The stream's uniform in [0, 1) for (seed, counter, tag), on the host (53 bits).
double spec_uniform(uint64_t seed, uint64_t counter, uint32_t tag);

}  // namespace tandem::cuda
