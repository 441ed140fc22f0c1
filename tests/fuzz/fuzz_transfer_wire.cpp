// The host KV transfer's wire decoders (transfer/wire.h) and the CUDA IPC backend's HIDDEN
// reassembly (transfer/hidden_chunks.h) over peer bytes. A HELLO that decodes re-encodes to
// the same bytes.
#include <array>
#include <cstdlib>

#include "core/error.h"
#include "fuzz_input.h"
#include "transfer/hidden_chunks.h"
#include "transfer/wire.h"

using namespace tandem;
using namespace tandem::transfer;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  try {
    switch (in.byte() % 7) {
      case 0: {
        std::array<uint8_t, wire::kHeaderBytes> h{};
        const auto b = in.bytes(h.size());
        std::copy(b.begin(), b.end(), h.begin());
        wire::decode_header(h);
        break;
      }
      case 1: {
        const auto body = in.rest_span();
        const wire::Hello h = wire::decode_hello(body);
        const auto again = wire::encode_hello(h);  // header + body
        if (again.size() != wire::kHeaderBytes + body.size() ||
            !std::equal(body.begin(), body.end(), again.begin() + wire::kHeaderBytes)) {
          std::abort();  // the codec does not round-trip
        }
        break;
      }
      case 2: wire::decode_layer_prefix(in.rest_span()); break;
      case 3: wire::decode_finish(in.rest_span()); break;
      case 4: wire::decode_hidden(in.rest_span()); break;
      case 5: {
        std::array<uint8_t, wire::kReplyHeaderBytes> h{};
        const auto b = in.bytes(h.size());
        std::copy(b.begin(), b.end(), h.begin());
        uint32_t n = 0;
        wire::decode_reply_header(h, n);
        break;
      }
      default: {  // a receiver's HIDDEN chunks: the descriptor, then (offset, total, chunk)*
        const int64_t tokens = in.take<uint16_t>() % 512;
        const int64_t hidden = in.take<uint8_t>() % 64;
        HiddenAssembler a(std::max<int64_t>(tokens, 1), hidden, 4096);
        while (in.left() > 0) {
          const uint64_t offset = in.take<uint32_t>();
          const uint64_t total = in.take<uint32_t>();
          const auto chunk = in.bytes(in.take<uint16_t>() % 8192);
          if (a.add(offset, total,
                    {reinterpret_cast<const uint8_t*>(chunk.data()), chunk.size()})) {
            a.take();
            break;
          }
        }
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
