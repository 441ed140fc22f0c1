#include "model/cuda/spec_stage.h"

#include <algorithm>
#include <cstring>

#include "core/cuda_check.h"
#include "core/error.h"

namespace tandem::cuda_model {

void SpecAdvanceStage::Buffers::grow(size_t bytes) {
  if (dev.size() >= bytes) return;
  dev = DeviceMem(bytes * 2);
  host = PinnedMem(bytes * 2);
}

cuda::SpecAdvanceParams SpecAdvanceStage::stage(const ForwardBatch& verify,
                                                const std::vector<int32_t>& forced, int64_t passes,
                                                int64_t page_size,
                                                const std::vector<std::vector<int32_t>>& extra,
                                                cudaStream_t stream) {
  const auto n = static_cast<int64_t>(verify.seqs.size());
  const int64_t T = verify.num_tokens();
  TANDEM_CHECK(static_cast<int64_t>(forced.size()) == n && passes >= 0,
               "spec_advance: ", forced.size(), " forced counts for ", n, " sequences");
  for (const auto& e : extra) {
    TANDEM_CHECK(static_cast<int64_t>(e.size()) == n, "spec_advance: ", e.size(),
                 " per-sequence values for ", n, " sequences");
  }
  int64_t width = 1;
  for (const ForwardSeq& f : verify.seqs) width = std::max(width, f.num_pages);
  // Inputs: x [T] | offsets [n + 1] | forced | starts | pages [n each] | extra [n each] |
  // tables [n, width].
  const auto E = static_cast<int64_t>(extra.size());
  const auto ints = static_cast<size_t>(T + (n + 1) + (4 + E) * n + n * width);
  in_.grow(ints * sizeof(int32_t));
  auto* h = in_.host.as<int32_t>();
  int32_t *h_ids = h, *h_begin = h_ids + T, *h_forced = h_begin + n + 1, *h_start = h_forced + n,
          *h_pages = h_start + n, *h_extra = h_pages + n, *h_tables = h_extra + E * n;
  int64_t t = 0;
  for (int64_t i = 0; i < n; ++i) {
    const ForwardSeq& f = verify.seqs[static_cast<size_t>(i)];
    h_begin[i] = static_cast<int32_t>(t);
    for (int64_t j = 0; j < f.num_tokens; ++j) h_ids[t++] = f.tokens[j];
    h_forced[i] = forced[static_cast<size_t>(i)];
    h_start[i] = static_cast<int32_t>(f.start_pos);
    h_pages[i] = static_cast<int32_t>(f.num_pages);
    for (int64_t e = 0; e < E; ++e) {
      h_extra[e * n + i] = extra[static_cast<size_t>(e)][static_cast<size_t>(i)];
    }
    std::memset(h_tables + i * width, 0, static_cast<size_t>(width) * sizeof(int32_t));
    std::memcpy(h_tables + i * width, f.block_table,
                static_cast<size_t>(f.num_pages) * sizeof(int32_t));
  }
  h_begin[n] = static_cast<int32_t>(t);
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(in_.dev.as<void>(), h, ints * sizeof(int32_t),
                                    cudaMemcpyHostToDevice, stream));
  auto* d = in_.dev.as<int32_t>();
  extra_.clear();
  for (int64_t e = 0; e < E; ++e) extra_.push_back(d + (h_extra - h) + e * n);
  // Outputs: accepted [n] | mtp_rows [n] | mtp_ids [T] | chained positions [passes, n] | slots
  // (int64) [passes, n].
  const auto P = static_cast<size_t>(passes), N = static_cast<size_t>(n);
  const size_t ints_out = 2 * N + static_cast<size_t>(T) + P * N;
  out_.grow((ints_out + 1) / 2 * 8 + P * N * sizeof(int64_t));
  auto* o = out_.dev.as<int32_t>();
  cuda::SpecAdvanceParams ap;
  ap.verify_ids = d;
  ap.seq_begin = d + T;
  ap.forced = ap.seq_begin + n + 1;
  ap.start = ap.forced + n;
  ap.num_pages = ap.start + n;
  ap.tables = d + (h_tables - h);
  ap.seqs = n;
  ap.table_width = width;
  ap.page_size = page_size;
  ap.passes = passes;
  ap.accepted = o;
  ap.mtp_rows = o + N;
  ap.mtp_ids = o + 2 * N;
  ap.chain_pos = ap.mtp_ids + T;
  ap.chain_slots = reinterpret_cast<int64_t*>(o + (ints_out + 1) / 2 * 2);
  seqs_ = n;
  return ap;
}

void SpecAdvanceStage::accepted_to_host(cudaStream_t stream) {
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(out_.host.as<int32_t>(), out_.dev.as<int32_t>(),
                                    static_cast<size_t>(seqs_) * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream));
}

}  // namespace tandem::cuda_model
