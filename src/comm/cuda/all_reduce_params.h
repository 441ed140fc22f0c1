// Custom all-reduce over peer-mapped memory (CUDA IPC): one-shot and two-shot, bf16 and fp32,
// sum. This header holds what the kernels and their callers share and needs no CUDA headers
// (the CPU emulation test includes it); all_reduce.h declares the launch functions,
// all_reduce_kernels.cuh holds the device code.
//
// Memory each rank exposes to its peers (one cudaMalloc, opened by the peers through IPC):
//   [ Signal | staging parity 0 (max_bytes) | staging parity 1 (max_bytes) | registered input ]
//
// Synchronisation (no host involvement, valid inside CUDA graphs):
// - Block b of every rank meets only block b of the other ranks. Each block keeps an epoch
//   (Signal::epoch[b]) that grows by one per barrier; to pass barrier e, thread t < N stores e
//   into rank t's Signal::flags[b][my rank] (st.release.sys) and spins until its own
//   flags[b][t] >= e (ld.acquire.sys). Ranks run the same calls in the same order with the
//   same grid, so epochs agree without ever being reset.
// - Copy mode: each block copies its part of the input into this rank's staging buffer, passes
//   one barrier, then reads the same part from every rank's staging and reduces. Calls
//   alternate between two staging buffers (parity = Signal::call_count & 1, advanced by the
//   last block to finish). NOTE why no end barrier is needed: rank q can only start kernel
//   k+2 (same parity as k) after its kernel k+1 finished, and kernel k+1 has at least one
//   block that waited for our flag from our kernel k+1, which we only write once our kernel k
//   (the reads of q's parity buffer) is complete.
// - Registered mode: the producer wrote this rank's input into the registered buffer itself;
//   no copy, but an end barrier so that no peer still reads it when the next producer writes.
//   The registered input is clobbered (two-shot keeps its partial sums there).
// - Every block reduces the ranks in rank order 0..N-1 in fp32, so all ranks get bit-identical
//   results.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace tandem::comm::cuda {

constexpr int kMaxRanks = 16;
constexpr int kMaxBlocks = 512;
constexpr int kMaxThreads = 512;

/// Cross-GPU synchronisation state of one rank, at the start of its peer-mapped allocation.
struct Signal {
  uint32_t flags[kMaxBlocks][kMaxRanks];  // written by peers: [block][src rank] = src's epoch
  uint32_t epoch[kMaxBlocks];             // this rank's epoch per block (own block only)
  uint32_t call_count;                    // kernels run in copy mode: staging parity
  uint32_t blocks_done;                   // blocks finished in the running copy-mode kernel
};

/// Bytes reserved for the Signal at the start of the allocation (keeps staging 64 KiB aligned).
constexpr size_t kSignalBytes = (sizeof(Signal) + 65535) / 65536 * 65536;

enum class AllReduceKernel { kOneShot, kTwoShot };

struct AllReduceParams {
  void const* input;           // [count] this rank's input (copy mode; ignored when registered)
  void* output;                // [count] this rank's result; may equal input (in place)
  void* data[kMaxRanks];       // per rank (peer-mapped): copy mode: staging [2][parity_stride]
                               // bytes; registered mode: the registered input [count]
  Signal* signals[kMaxRanks];  // per rank (peer-mapped)
  size_t parity_stride;        // bytes from staging parity 0 to parity 1
  size_t count;                // elements per rank
  int rank;                    // this rank
  int world_size;              // ranks, 2..kMaxRanks
  uint64_t timeout_ns;         // a spin longer than this traps (0: wait forever)
};

/// Launch shape chosen from the message size; every rank must launch the same shape.
struct AllReduceShape {
  int blocks;
  int threads;
};

/// Elements per 16-byte vector for a dtype (8 for bf16, 4 for fp32).
constexpr int all_reduce_vec_elems(DType dtype) { return dtype == DType::kBF16 ? 8 : 4; }

/// Grid for a kernel: one 16-byte vector per thread, blocks of 32..max_threads threads, at
/// most max_blocks blocks (one-shot: the whole message; two-shot: one rank's segment).
inline AllReduceShape all_reduce_shape(AllReduceKernel kind, size_t count, DType dtype,
                                       int world_size, int max_blocks,
                                       int max_threads = kMaxThreads) {
  const size_t vec = static_cast<size_t>(all_reduce_vec_elems(dtype));
  const size_t nvec = (count + vec - 1) / vec;
  const size_t work =
      kind == AllReduceKernel::kOneShot ? nvec : (nvec + world_size - 1) / world_size;
  const size_t threads = std::min<size_t>(static_cast<size_t>(max_threads),
                                          std::max<size_t>(32, (work + 31) / 32 * 32));
  const size_t blocks = std::clamp<size_t>((work + threads - 1) / threads, 1,
                                           static_cast<size_t>(std::min(max_blocks, kMaxBlocks)));
  return {static_cast<int>(blocks), static_cast<int>(threads)};
}

}  // namespace tandem::comm::cuda
