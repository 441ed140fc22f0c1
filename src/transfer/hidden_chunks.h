// The prompt's hidden states (TransferDescriptor::hidden_size) over a transport whose frames are
// small: the cuda-ipc backend's control connection (frames of at most 1 MiB) carries them as the
// one HIDDEN wire message (wire::encode_hidden: 16-byte header, row_begin, hidden_size, f32 rows),
// cut into chunks of at most kHiddenChunkBytes that travel in order, one frame each, and are put
// back together by HiddenAssembler on the receiver. A 32k-token prompt at hidden 2048 is 256 MiB:
// no frame (and no buffer on the peer's word) ever grows with it, and other frames on the same
// connection (BEGIN, CANCEL, other requests' FINISH) go between two chunks, not after the whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "transfer/transfer.h"

namespace tandem::transfer {

/// The most bytes of the HIDDEN message one chunk carries.
constexpr size_t kHiddenChunkBytes = 256 * 1024;

/// The chunks of `message` in order: spans into it of chunk_bytes (>= 1) each, the last one
/// shorter; none for an empty message.
std::vector<std::span<const uint8_t>> split_chunks(std::span<const uint8_t> message,
                                                   size_t chunk_bytes = kHiddenChunkBytes);

/// Puts one request's HIDDEN message back together from its chunks and decodes it (wire.h), with
/// every size checked against the request's descriptor before anything is allocated. Not
/// thread-safe (the receiver holds its lock).
class HiddenAssembler {
 public:
  /// For a descriptor of `num_tokens` prompt positions asking for `hidden_size` floats per row
  /// (0: it asks for none; every chunk is refused).
  HiddenAssembler(int64_t num_tokens, int64_t hidden_size, size_t max_chunk = kHiddenChunkBytes);

  /// Adds the chunk at byte `offset` of a message of `total` bytes; returns true when it made the
  /// message whole (it is decoded then: take()). Throws Error(kInvalidArgument) on a total that
  /// is not a HIDDEN of whole rows ending at num_tokens, a total other than the first chunk's,
  /// a chunk that is empty, over max_chunk, not where the previous one ended or past the total,
  /// a chunk after the message was whole (a second HIDDEN), or a message that does not decode
  /// to this descriptor's rows. After a throw the assembler is of no further use.
  bool add(uint64_t offset, uint64_t total, std::span<const uint8_t> chunk);

  bool started() const { return total_ > 0; }
  bool whole() const { return whole_; }
  /// The rows, once whole (then the assembler holds nothing).
  PromptHidden take();

 private:
  int64_t num_tokens_;
  int64_t hidden_size_;
  size_t max_chunk_;
  uint64_t total_ = 0;
  std::vector<uint8_t> bytes_;  // the message so far
  bool whole_ = false;
  PromptHidden hidden_;
};

}  // namespace tandem::transfer
