// The communicator of one rank in a group of ranks: the collectives and point-to-point
// messages that tensor-, expert- and data-parallel execution needs. Backend-neutral (raw
// pointers, element counts, a dtype): the CPU implementations are GlooCommunicator (one
// process per rank, TCP) and LocalCommunicator (ranks as threads, for tests); the CUDA
// communicator implements the same interface over device pointers.
//
// NOTE: every collective must be called by every rank of the group, in the same order, with
// agreeing arguments (counts, root); a rank with nothing to contribute still calls it with a
// count of 0. One thread drives a communicator at a time (like an NCCL communicator).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"

namespace tandem::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;

  /// This rank, in [0, world_size()).
  virtual int rank() const = 0;
  /// Number of ranks in the group.
  virtual int world_size() const = 0;

  /// In place: data[i] = sum over ranks of data[i] (count elements of dtype kF32, kI32 or
  /// kI64). NOTE: the sum is taken in rank order, ((x0 + x1) + x2) + ..., and every rank gets
  /// bit-identical results, so replicated activations never drift apart between ranks.
  virtual void all_reduce_sum(void* data, int64_t count, DType dtype) = 0;

  /// out[r * count, (r + 1) * count) = rank r's in[0, count). out holds world_size * count
  /// elements and must not overlap in.
  virtual void all_gather(const void* in, void* out, int64_t count, DType dtype) = 0;

  /// Variable-size all-gather: rank r contributes counts[r] elements (in), and out receives
  /// every rank's elements back to back in rank order (sum(counts) elements). Every rank passes
  /// the same counts (world_size entries).
  virtual void all_gather_v(const void* in, void* out, std::span<const int64_t> counts,
                            DType dtype) = 0;

  /// Variable-size all-to-all: this rank sends send_counts[r] elements to rank r, taken from
  /// in back to back in rank order, and receives recv_counts[r] elements from rank r into out
  /// back to back in rank order. recv_counts[r] must equal rank r's send_counts[rank()]
  /// (exchange the counts first, e.g. with all_to_all of one kI64 per peer). in and out must
  /// not overlap.
  virtual void all_to_all_v(const void* in, std::span<const int64_t> send_counts, void* out,
                            std::span<const int64_t> recv_counts, DType dtype) = 0;

  /// Copies root's data[0, count) into data on every other rank.
  virtual void broadcast(void* data, int64_t count, DType dtype, int root) = 0;

  /// Returns once every rank has entered the barrier.
  virtual void barrier() = 0;

  /// Sends bytes to peer under tag (tag in [0, 2^24)). Synchronous: may not return before
  /// the peer posts the matching recv (same tag, same size; LocalCommunicator always waits
  /// for it), so order sends and receives so that they cannot deadlock (e.g. the lower rank
  /// sends first). Messages between two ranks under one tag arrive in order.
  virtual void send(const void* data, int64_t bytes, int peer, uint32_t tag) = 0;
  /// Receives exactly bytes from peer under tag into data (blocks).
  virtual void recv(void* data, int64_t bytes, int peer, uint32_t tag) = 0;

  // ---- Conveniences built on the calls above (same rules). ----

  /// Equal-size all-to-all: count elements to and from every rank (in and out hold
  /// world_size * count elements each).
  void all_to_all(const void* in, void* out, int64_t count, DType dtype);
  /// A blob of any size: its length under tag, then its bytes under tag.
  void send_blob(std::span<const uint8_t> blob, int peer, uint32_t tag);
  std::vector<uint8_t> recv_blob(int peer, uint32_t tag);
};

/// Sums n elements of src into dst (dst[i] += src[i]) for the dtypes all_reduce_sum takes;
/// throws kUnsupported for the others. Shared by the CPU implementations.
void add_into(void* dst, const void* src, int64_t n, DType dtype);

}  // namespace tandem::comm
