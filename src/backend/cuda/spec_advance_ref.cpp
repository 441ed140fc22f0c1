// The CPU reference of spec_advance_launch (spec_advance.h), written plainly.
#include <algorithm>

#include "backend/cuda/spec_advance.h"
#include "core/error.h"

namespace tandem::cuda {

void spec_advance_reference(SpecAdvanceParams const& shape, SpecAdvanceHost& h) {
  const auto seqs = static_cast<size_t>(shape.seqs);
  TANDEM_CHECK(h.seq_begin.size() == seqs + 1 && h.forced.size() == seqs &&
                   h.start.size() == seqs && h.num_pages.size() == seqs &&
                   h.tables.size() == seqs * static_cast<size_t>(shape.table_width),
               "spec_advance_reference: inconsistent host arrays");
  const auto tokens = static_cast<size_t>(h.seq_begin.back());
  TANDEM_CHECK(h.sampled.size() == tokens && h.verify_ids.size() == tokens,
               "spec_advance_reference: ", tokens, " tokens");
  const auto passes = static_cast<size_t>(shape.passes);
  h.accepted.assign(seqs, 0);
  h.mtp_ids.assign(tokens, 0);
  h.mtp_rows.assign(seqs, 0);
  h.chain_pos.assign(passes * seqs, 0);
  h.chain_slots.assign(passes * seqs, 0);
  const int64_t ps = shape.page_size;
  for (size_t s = 0; s < seqs; ++s) {
    const int32_t b = h.seq_begin[s], k = h.seq_begin[s + 1] - b - 1;
    int32_t a = 0;
    if (h.forced[s] >= 0) {
      a = std::min(h.forced[s], k);
    } else {
      while (a < k && h.sampled[static_cast<size_t>(b + a)] ==
                          h.verify_ids[static_cast<size_t>(b + a + 1)]) {
        ++a;
      }
    }
    h.accepted[s] = a;
    for (int32_t j = 0; j <= k; ++j) {
      h.mtp_ids[static_cast<size_t>(b + j)] = j < a ? h.verify_ids[static_cast<size_t>(b + j + 1)]
                                                    : h.sampled[static_cast<size_t>(b + j)];
    }
    h.mtp_rows[s] = b + a;
    const int64_t cap = int64_t{h.num_pages[s]} * ps;
    for (size_t p = 1; p <= passes; ++p) {
      const int64_t pos = int64_t{h.start[s]} + a + static_cast<int64_t>(p);
      const size_t o = (p - 1) * seqs + s;
      h.chain_pos[o] = static_cast<int32_t>(std::min(pos, cap - 1));
      h.chain_slots[o] = pos < cap ? int64_t{h.tables[s * static_cast<size_t>(shape.table_width) +
                                                      static_cast<size_t>(pos / ps)]} *
                                             ps +
                                         pos % ps
                                   : -1;
    }
  }
}

}  // namespace tandem::cuda
