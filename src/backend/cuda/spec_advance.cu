// spec_advance_launch (spec_advance.h): one thread per sequence (a handful of tokens and
// passes each); the launch is tiny and sits between the verify's sampler and the MTP passes.
#include "backend/cuda/check.h"
#include "backend/cuda/spec_advance.h"
#include "core/error.h"

namespace tandem::cuda {

namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) spec_advance_kernel(SpecAdvanceParams p) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (s >= p.seqs) return;
  const int32_t b = p.seq_begin[s], k = p.seq_begin[s + 1] - b - 1;
  int32_t a = 0;
  if (p.forced[s] >= 0) {
    a = min(p.forced[s], k);
  } else {
    while (a < k && p.sampled[b + a] == p.verify_ids[b + a + 1]) ++a;
  }
  p.accepted[s] = a;
  for (int32_t j = 0; j <= k; ++j)
    p.mtp_ids[b + j] = j < a ? p.verify_ids[b + j + 1] : p.sampled[b + j];
  p.mtp_rows[s] = b + a;
  const int64_t ps = p.page_size, cap = static_cast<int64_t>(p.num_pages[s]) * ps;
  for (int64_t q = 1; q <= p.passes; ++q) {
    const int64_t pos = static_cast<int64_t>(p.start[s]) + a + q;
    const int64_t o = (q - 1) * p.seqs + s;
    p.chain_pos[o] = static_cast<int32_t>(pos < cap ? pos : cap - 1);
    p.chain_slots[o] =
        pos < cap ? static_cast<int64_t>(p.tables[s * p.table_width + pos / ps]) * ps + pos % ps
                  : -1;
  }
}

}  // namespace

void spec_advance_launch(SpecAdvanceParams const& p, cudaStream_t stream) {
  TANDEM_CHECK_KIND(kInvalidArgument,
                    p.seqs >= 0 && p.passes >= 0 && p.page_size > 0 && p.table_width > 0,
                    "spec_advance: ", p.seqs, " sequences, ", p.passes, " passes, page size ",
                    p.page_size, ", table width ", p.table_width);
  if (p.seqs == 0) return;
  TANDEM_CHECK_KIND(kInvalidArgument,
                    p.sampled && p.verify_ids && p.seq_begin && p.forced && p.start && p.tables &&
                        p.num_pages && p.accepted && p.mtp_ids && p.mtp_rows &&
                        (p.passes == 0 || (p.chain_pos && p.chain_slots)),
                    "spec_advance: a null input or output");
  const auto blocks = static_cast<unsigned>((p.seqs + kThreads - 1) / kThreads);
  spec_advance_kernel<<<blocks, kThreads, 0, stream>>>(p);
  TANDEM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tandem::cuda
