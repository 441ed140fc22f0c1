// MoE dispatch / combine over peer-mapped memory (CUDA IPC), prefill (EP, input replicated)
// and decode (DP-EP, sparse all-to-all). This header holds what the kernels and their callers
// share and needs no CUDA headers (the CPU emulation test includes it); moe.h declares the
// launch functions, moe_kernels.cuh holds the device code, cuda_moe.h the decode communicator.
//
// Notation: T tokens (device count, at most max_tokens), k = top_k, H = hidden, E experts in
// contiguous blocks of L = E / N per rank (rank r owns [r L, (r + 1) L)), N ranks (2..16).
// Expert ids in topk_ids must be distinct within a token and lie in [0, E).
//
// ---- Prefill (EP) ----------------------------------------------------------------------------
// Every rank holds the same T tokens. prefill_dispatch selects the (token, slot) pairs whose
// expert is local and packs the token rows per local expert (expert-major; within an expert,
// ascending token): a count kernel (one block per tile of 256 tokens: counting sort of the
// tile's pairs by local expert, in shared memory), a scan kernel (one block: tile bases and the
// expert offsets) and a gather (a block per token: rows, metadata, slot map). prefill_combine
// sums each token's local pairs, weight * expert output, in ascending expert id in fp32 (one
// fma per pair, starting from 0) and writes the partial (bf16 or fp32) for every token (zeros
// when none is local, and for t in [T, max_tokens)), typically straight into the all-reduce's
// registered buffer; the all-reduce then sums the ranks' partials in rank order, which is
// ascending expert order too.
//
// ---- Decode (DP-EP) --------------------------------------------------------------------------
// Per rank, in this order, each one enqueued after the previous has completed in stream order
// (same stream, or events): dispatch_send, dispatch_recv, [experts], combine_send,
// combine_recv. Loops of dispatch only or combine only are fine too (the receive buffers are
// double-buffered by call parity; see "reuse" below).
//
// dispatch_send (rank s): block 0 stages s's routing in shared memory, ranks s's pairs (the
//   position of token t among s's tokens that chose expert e: population counts over one
//   token bitmap per expert, or a counting sort when those do not fit), pushes to
//   every rank d the per-local-expert counts and T, and one routing row per token that has an
//   expert on d, at meta[parity][s][t]: (token, epoch stamp, k ids, k weights, k ranks);
//   blocks 1.. push each token's payload row once to every rank d that owns one of its experts
//   (at most once per destination), into d's xbuf[parity][s][t]. Then every block b releases
//   moe_flags.dispatch[b][s] = epoch on every rank (also ranks it sent nothing to).
// dispatch_recv (rank d): every block waits for all N x send_blocks flags, computes the
//   expert offsets from the counts (rows ordered by local expert, then source rank, then the
//   source's token order: the order of comm/moe_dispatch.h), and for every source token whose
//   routing row carries this call's stamp copies the row to its packed position(s); it also
//   writes each row's routing metadata (source rank, source token, slot, global expert,
//   weight) and expert_offsets[L + 1] (the last = pairs).
// combine_send (rank d): row r of the expert output goes to its home rank s at
//   cbuf[parity][token][slot]; then flags as above (moe_flags.combine).
// combine_recv (rank s): every block waits for all flags, then token t's output is
//   sum over its k slots in ascending expert id of fma(weight, float(out), acc) from 0 (fp32),
//   stored as bf16 (or fp32).
//
// Epochs: every kernel kind keeps a call counter in this rank's MoeSignal (read by every
// block at the start, advanced by the last block to finish); a send kernel publishes
// epoch = calls + 1, the matching receive kernel waits for flags >= its own calls + 1. Ranks
// run the same sequence of calls, so counters agree without resets (no host involvement:
// valid inside CUDA graphs). Parity = calls & 1 picks the receive buffer. A routing row left
// from an older call of the same parity carries an older stamp and is skipped.
// Reuse: rank s can only run dispatch_send #c+2 (parity of #c) after its dispatch_recv #c+1,
// which waited for rank d's dispatch_send #c+1, which d enqueued after its dispatch_recv #c
// (the reads of parity c) completed. The same argument holds for combine.
// No spinning block waits for another block of its own grid: no residency requirement.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/cuda/all_reduce_params.h"  // kMaxRanks

#if defined(__CUDACC__)
#define TANDEM_MOE_HD __host__ __device__
#else
#define TANDEM_MOE_HD
#endif

namespace tandem::comm::cuda {

constexpr int kMoeMaxBlocks = 1024;  // blocks of a send kernel (flags per block)
constexpr int kMoeMaxTopK = 16;
constexpr int kMoeMaxExperts = 1024;          // E (decode: all experts; prefill: L)
constexpr int kMoeFp8Group = 128;             // fp8 payload: one fp32 scale per 128 elements
constexpr int kMoeSmemBytes = 40 * 1024;      // dynamic shared memory of dispatch_recv
constexpr int kMoeSendSmemBytes = 96 * 1024;  // of dispatch_send (block 0 stages the routing)
constexpr int kMoePrefillTile = 256;          // tokens per block of the prefill count kernel
constexpr int kMoePrefillSmemBytes = 40 * 1024;

/// Payload of the decode dispatch rows.
enum class MoePayload : int32_t {
  kBF16 = 0,  // row = H bf16
  kFP8 = 1,   // row = H e4m3 bytes, then H / 128 fp32 scales (scale = amax / 448)
};

/// Bytes of one dispatch row (fp8: padded to 16 bytes).
TANDEM_MOE_HD constexpr size_t moe_row_bytes(MoePayload p, int hidden) {
  return p == MoePayload::kBF16
             ? size_t(hidden) * 2
             : (size_t(hidden) + size_t(hidden / kMoeFp8Group) * 4 + 15) / 16 * 16;
}

/// Bytes of one routing row pushed by dispatch_send: token, epoch stamp, then k ids, k weights,
/// k ranks (int32 / fp32 words).
TANDEM_MOE_HD constexpr size_t moe_meta_bytes(int top_k) {
  return (size_t(8 + 12 * top_k) + 15) / 16 * 16;
}

/// int32 scratch of prefill_dispatch: ranks of the pairs in their tile [max_tokens * k], then
/// per tile the local experts' counts, turned into bases [tiles][L].
TANDEM_MOE_HD constexpr size_t moe_prefill_scratch_ints(int max_tokens, int top_k,
                                                        int local_experts) {
  return size_t(max_tokens) * top_k +
         size_t((max_tokens + kMoePrefillTile - 1) / kMoePrefillTile) * local_experts;
}

enum MoeKind : int {
  kMoeDispatchSend = 0,
  kMoeDispatchRecv = 1,
  kMoeCombineSend = 2,
  kMoeCombineRecv = 3
};

/// Cross-GPU synchronisation of one rank's decode buffers (start of its peer allocation).
struct MoeSignal {
  uint32_t dispatch[kMoeMaxBlocks][kMaxRanks];  // [sender block][src rank] = src's epoch
  uint32_t combine[kMoeMaxBlocks][kMaxRanks];
  uint32_t calls[4];  // per MoeKind: calls completed on this rank
  uint32_t done[4];   // blocks finished in the running kernel
};

/// Byte offsets inside one rank's peer allocation (the same on every rank).
struct MoeLayout {
  size_t signal = 0;  // MoeSignal
  size_t counts = 0;  // int32 [2][N][L + 1]: per source, per local expert; [L] = source's T
  size_t meta = 0;    // [2][N][max_tokens][meta_bytes] routing rows at the source's token
  size_t xbuf = 0;    // [2][N][max_tokens][row_bytes] payload rows at the source's token
  size_t cbuf = 0;    // bf16 [2][max_tokens][k][H] pair outputs at (token, slot)
  size_t total = 0;
  size_t counts_parity = 0;  // bytes from parity 0 to 1 of each region
  size_t meta_parity = 0;
  size_t xbuf_parity = 0;
  size_t cbuf_parity = 0;
};

TANDEM_MOE_HD inline size_t moe_align(size_t x, size_t a) { return (x + a - 1) / a * a; }

inline MoeLayout moe_layout(int world, int local_experts, int max_tokens, int top_k, int hidden,
                            MoePayload payload) {
  MoeLayout l;
  l.signal = 0;
  size_t off = moe_align(sizeof(MoeSignal), 4096);
  l.counts = off;
  l.counts_parity = moe_align(size_t(world) * (local_experts + 1) * 4, 256);
  off += 2 * l.counts_parity;
  l.meta = off = moe_align(off, 4096);
  l.meta_parity = moe_align(size_t(world) * max_tokens * moe_meta_bytes(top_k), 256);
  off += 2 * l.meta_parity;
  l.xbuf = off = moe_align(off, 4096);
  l.xbuf_parity = moe_align(size_t(world) * max_tokens * moe_row_bytes(payload, hidden), 256);
  off += 2 * l.xbuf_parity;
  l.cbuf = off = moe_align(off, 4096);
  l.cbuf_parity = moe_align(size_t(max_tokens) * top_k * hidden * 2, 256);
  off += 2 * l.cbuf_parity;
  l.total = moe_align(off, 1 << 16);
  return l;
}

// ---- prefill -----------------------------------------------------------------------------------

struct PrefillDispatchParams {
  void const* x;              // bf16 [max_tokens, H], the same on every rank
  int32_t const* topk_ids;    // [max_tokens, k] global expert ids
  float const* topk_weights;  // [max_tokens, k] (nullable: row_weight not written)
  int32_t const* num_tokens;  // [1] device token count T <= max_tokens (nullable: max_tokens)
  void* out_x;                // bf16 [max_tokens * min(k, L), H] packed rows
  int32_t* expert_offsets;    // [L + 1] exclusive scan of the per-expert counts; [L] = rows
  int32_t* row_token;         // [max_tokens * min(k, L)] token of each row
  int32_t* row_slot;          // [max_tokens * min(k, L)] slot (0..k-1) of each row
  float* row_weight;          // [max_tokens * min(k, L)] (nullable)
  int32_t* slot_row;          // [max_tokens, k] row of each local (token, slot), -1 otherwise
  int32_t* scratch;           // [moe_prefill_scratch_ints(max_tokens, k, L)]
  int max_tokens;
  int top_k;
  int hidden;         // multiple of 8
  int expert_begin;   // this rank's first expert
  int local_experts;  // L (<= kMoeMaxExperts)
};

struct PrefillCombineParams {
  void const* expert_out;     // bf16 [rows, H]: expert output of each packed row (unweighted)
  int32_t const* slot_row;    // [max_tokens, k] from prefill_dispatch
  int32_t const* topk_ids;    // [max_tokens, k]
  float const* topk_weights;  // [max_tokens, k]
  int32_t const* num_tokens;  // [1] (nullable: max_tokens)
  void* out;                  // [max_tokens, H] bf16 or fp32 partial (every row written)
  int max_tokens;
  int top_k;
  int hidden;   // multiple of 8
  int out_f32;  // 1: fp32 partial, 0: bf16
};

// ---- decode ------------------------------------------------------------------------------------

/// Everything the four decode kernels need; filled once by CudaMoe, per call only the inputs.
struct MoeDecodeParams {
  // inputs of this rank (dispatch_send; combine_recv re-reads ids and weights)
  void const* x;              // bf16 [max_tokens, H]
  int32_t const* topk_ids;    // [max_tokens, k]
  float const* topk_weights;  // [max_tokens, k]
  int32_t const* num_tokens;  // [1] device count T <= max_tokens
  // combine
  void const* expert_out;  // bf16 [max_recv_rows, H], rows as out_x (combine_send)
  void* out;               // [max_tokens, H] bf16 or fp32 (combine_recv); rows >= T untouched
  int out_f32;
  // peer-mapped allocations of every rank (MoeLayout)
  char* peer[kMaxRanks];
  // this rank's local outputs of dispatch_recv
  void* out_x;              // [max_recv_rows, row_bytes] packed per local expert
  int32_t* expert_offsets;  // [L + 1]
  int32_t* row_src;         // [max_recv_rows]
  int32_t* row_token;
  int32_t* row_slot;
  int32_t* row_expert;  // global id
  float* row_weight;
  int32_t* rank_scratch;  // [max_tokens, k] dispatch_send: rank of each pair in its expert
  MoeLayout layout;
  int rank;
  int world_size;
  int num_experts;    // E
  int local_experts;  // L = E / N
  int top_k;
  int hidden;  // multiple of 128 for fp8, of 8 for bf16
  int max_tokens;
  int max_recv_rows;  // N * max_tokens * min(k, L)
  MoePayload payload;
  int send_blocks;      // grid of dispatch_send and combine_send (same on all ranks)
  uint64_t timeout_ns;  // a spin longer than this traps (0: forever)
};

}  // namespace tandem::comm::cuda
