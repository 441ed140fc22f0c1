// After a verify step, on the device: each sequence's accepted drafts and the metadata of the
// MTP passes that draft its next tokens (Model::forward_verify_draft), so that no host round
// trip sits between the target's verify forward and the next drafts. Framework-free: a params
// struct in, a stream; asynchronous and CUDA-graph safe (no host sync, no allocation).
//
// Per sequence s with verify tokens x_0 .. x_k (its last token, then k drafts; tokens
// [seq_begin[s], seq_begin[s + 1])) at positions start .. start + k, and the target's tokens
// y_0 .. y_k of those rows (y_j: the target's token after x_0 .. x_j):
//   a = min(forced, k) when forced >= 0 (benchmarks), else the leading j with y_j == x_{j+1};
//   accepted = a;
//   pass 0 of the MTP layer runs over the k + 1 positions: its token at position start + j is
//     the token at start + j + 1: x_{j+1} for j < a (the accepted drafts), y_j otherwise (y_a
//     is the target's next token; positions past start + a hold dead values the next steps
//     overwrite before reading); its logits row is the token index of position start + a;
//   chained pass p = 1 .. passes sits at position start + a + p: that position clamped into
//     the block table (num_pages * page_size positions), its MTP KV slot
//     table[pos / page_size] * page_size + pos % page_size, -1 past the table (no KV written;
//     that draft is unspecified).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace tandem::cuda {

struct SpecAdvanceParams {
  int32_t const* sampled = nullptr;     // [tokens] y: the target's token of each verify row
  int32_t const* verify_ids = nullptr;  // [tokens] x: per sequence its last token, then its drafts
  int32_t const* seq_begin = nullptr;   // [seqs + 1] token offsets
  int32_t const* forced = nullptr;      // [seqs] accepted drafts forced (>= 0), -1: by the target
  int32_t const* start = nullptr;       // [seqs] the position of x_0
  int32_t const* tables = nullptr;      // [seqs, table_width] block tables
  int32_t const* num_pages = nullptr;   // [seqs] pages of each table (<= table_width)
  int64_t seqs = 0, table_width = 0, page_size = 0;
  int64_t passes = 0;              // chained MTP passes (K - 1 >= 0)
  int32_t* accepted = nullptr;     // [seqs] out: a
  int32_t* mtp_ids = nullptr;      // [tokens] out: pass 0's tokens
  int32_t* mtp_rows = nullptr;     // [seqs] out: pass 0's logits row (a token index)
  int32_t* chain_pos = nullptr;    // [passes, seqs] out
  int64_t* chain_slots = nullptr;  // [passes, seqs] out
};

/// Launches on `stream`; throws Error(kInvalidArgument) for bad shapes or a null pointer.
void spec_advance_launch(SpecAdvanceParams const& p, cudaStream_t stream);

/// The CPU reference over host arrays of the same layout (the pointers of `p` ignored).
struct SpecAdvanceHost {
  std::vector<int32_t> sampled, verify_ids, seq_begin, forced, start, tables, num_pages;
  std::vector<int32_t> accepted, mtp_ids, mtp_rows, chain_pos;  // out
  std::vector<int64_t> chain_slots;                             // out
};
void spec_advance_reference(SpecAdvanceParams const& shape, SpecAdvanceHost& h);

}  // namespace tandem::cuda
