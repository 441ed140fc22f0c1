// The messages peers send each other (disagg/protocol.h): the router <-> instance control
// bodies (requests, transfer descriptors, step outputs, loads) and the ranks' step broadcast,
// commands and reports. Decoding never allocates past what the bytes can hold; a descriptor
// that decodes is validated as a receiver or sender would.
#include "core/error.h"
#include "disagg/protocol.h"
#include "fuzz_input.h"

using namespace tandem;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const uint8_t which = in.byte();
  const auto body = in.rest_span();
  const std::vector<uint8_t> bytes(body.begin(), body.end());
  try {
    ByteReader r(bytes);
    switch (which % 8) {
      case 0: decode_step_output(bytes.data(), bytes.size()); break;
      case 1: get_request(r); break;
      case 2: get_descriptor(r).validate(); break;
      case 3: decode_prefill_step(bytes); break;
      case 4: decode_decode_commands(bytes); break;
      case 5: decode_decode_report(bytes); break;
      case 6: get_stats(r); break;
      default: {  // a request re-encoded decodes to the same bytes
        const GenRequest req = get_request(r);
        ByteWriter w;
        put_request(w, req);
        ByteReader again(w.bytes());
        get_request(again);
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
