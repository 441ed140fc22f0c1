#include "transfer/hidden_chunks.h"

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "transfer/wire.h"

namespace tandem::transfer {

std::vector<std::span<const uint8_t>> split_chunks(std::span<const uint8_t> message,
                                                   size_t chunk_bytes) {
  TANDEM_CHECK_KIND(kInvalidArgument, chunk_bytes >= 1, "split_chunks: chunk_bytes must be >= 1");
  std::vector<std::span<const uint8_t>> out;
  out.reserve((message.size() + chunk_bytes - 1) / chunk_bytes);
  for (size_t at = 0; at < message.size(); at += chunk_bytes) {
    out.push_back(message.subspan(at, std::min(chunk_bytes, message.size() - at)));
  }
  return out;
}

HiddenAssembler::HiddenAssembler(int64_t num_tokens, int64_t hidden_size, size_t max_chunk)
    : num_tokens_(num_tokens), hidden_size_(hidden_size), max_chunk_(max_chunk) {
  TANDEM_CHECK_KIND(
      kInvalidArgument, num_tokens >= 1 && hidden_size >= 0 && max_chunk >= 1,
      "HiddenAssembler: needs num_tokens >= 1, hidden_size >= 0, max_chunk >= 1, got ", num_tokens,
      ", ", hidden_size, ", ", max_chunk);
}

bool HiddenAssembler::add(uint64_t offset, uint64_t total, std::span<const uint8_t> chunk) {
  TANDEM_CHECK_KIND(kInvalidArgument, !whole_, "a second HIDDEN (the hidden states were whole)");
  if (total_ == 0) {
    // The whole message is 16 + 16 + k * row bytes with 1 <= k <= num_tokens: bounded by the
    // descriptor (at most 1 GiB, TransferDescriptor::validate) before it is allocated.
    const uint64_t row = sizeof(float) * static_cast<uint64_t>(hidden_size_);
    const uint64_t fixed = wire::kHeaderBytes + wire::kHiddenPrefixBytes;
    TANDEM_CHECK_KIND(kInvalidArgument, row > 0, "HIDDEN of ", total,
                      " bytes where the descriptor asks for no hidden states");
    TANDEM_CHECK_KIND(kInvalidArgument,
                      total > fixed && (total - fixed) % row == 0 &&
                          (total - fixed) / row <= static_cast<uint64_t>(num_tokens_),
                      "HIDDEN of ", total, " bytes is not ", fixed, " + k * ", row,
                      " for 1 <= k <= ", num_tokens_);
    total_ = total;
    bytes_.reserve(total);
  }
  TANDEM_CHECK_KIND(kInvalidArgument, total == total_, "HIDDEN chunk of a ", total,
                    "-byte message after chunks of a ", total_, "-byte one");
  TANDEM_CHECK_KIND(kInvalidArgument,
                    !chunk.empty() && chunk.size() <= max_chunk_ && offset == bytes_.size() &&
                        chunk.size() <= total_ - offset,
                    "HIDDEN chunk of ", chunk.size(), " bytes at byte ", offset, " (expected 1 to ",
                    std::min<uint64_t>(max_chunk_, total_ - bytes_.size()), " bytes at byte ",
                    bytes_.size(), " of ", total_, ")");
  bytes_.insert(bytes_.end(), chunk.begin(), chunk.end());
  if (bytes_.size() < total_) return false;

  const std::span<const uint8_t> message(bytes_);
  const wire::MsgHeader h = wire::decode_header(message.first<wire::kHeaderBytes>());
  TANDEM_CHECK_KIND(kInvalidArgument,
                    h.type == wire::MsgType::kHidden && h.body_bytes == total_ - wire::kHeaderBytes,
                    "HIDDEN chunks hold a message of type ", static_cast<int>(h.type), " with ",
                    h.body_bytes, " body bytes, not a HIDDEN of ", total_ - wire::kHeaderBytes);
  wire::Hidden hidden = wire::decode_hidden(message.subspan(wire::kHeaderBytes));
  const int64_t rows = static_cast<int64_t>(hidden.rows.size()) / hidden_size_;
  TANDEM_CHECK_KIND(kInvalidArgument,
                    hidden.hidden_size == hidden_size_ && hidden.row_begin + rows == num_tokens_,
                    "HIDDEN of rows [", hidden.row_begin, ", ", hidden.row_begin + rows, ") x ",
                    hidden.hidden_size, ", the descriptor wants rows up to ", num_tokens_, " x ",
                    hidden_size_);
  std::vector<uint8_t>().swap(bytes_);
  hidden_ = {hidden.row_begin, std::move(hidden.rows)};
  whole_ = true;
  return true;
}

PromptHidden HiddenAssembler::take() {
  TANDEM_CHECK_KIND(kInvalidArgument, whole_, "HiddenAssembler::take before the message is whole");
  return std::exchange(hidden_, {});
}

}  // namespace tandem::transfer
