#include "transfer/wire.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "core/byte_codec.h"
#include "core/error.h"

namespace tandem::transfer::wire {

namespace {

// Each message's fields, once (core/byte_codec.h): u32 lengths, Error(kInvalidArgument) naming
// the message when its bytes are malformed.
codec::Format format(const char* what) {
  return {codec::LenWidth::kU32, ErrorKind::kInvalidArgument, what};
}

// The 16-byte header as it travels.
struct Header {
  uint32_t magic = kMagic;
  uint16_t type = 0;
  uint16_t version = kVersion;
  uint64_t body_bytes = 0;
};

template <class Io, codec::Is<Header> M>
void fields(Io& io, M& h) {
  io(h.magic);
  io(h.type);
  io(h.version);
  io(h.body_bytes);
}

// The 12 bytes before a REPLY's message.
struct ReplyHeader {
  uint32_t magic = kReplyMagic;
  uint16_t status = 0;
  uint16_t reserved = 0;
  uint32_t message_bytes = 0;
};

template <class Io, codec::Is<ReplyHeader> M>
void fields(Io& io, M& h) {
  io(h.magic);
  io(h.status);
  io(h.reserved);
  io(h.message_bytes);
}

}  // namespace

template <class Io, codec::Is<Hello> M>
void fields(Io& io, M& h) {
  io(h.request_id);  // (the receiver bounds the body by kMaxHelloBytes first)
  io(h.src_rank);
  io.template as<int32_t>(h.src.tp);
  io(h.src.num_kv_heads);
  io(h.heads.begin);
  io(h.heads.end);
  io(h.num_layers);
  io(h.num_tokens);
  io(h.head_dim);
  io(h.dtype);
}

template <class Io, codec::Is<LayerPrefix> M>
void fields(Io& io, M& p) {
  io(p.layer);
  io(p.token_begin);
  io(p.token_end);
}

template <class Io, codec::Is<Finish> M>
void fields(Io& io, M& f) {
  io(f.first_token);
  io(f.logprob);
  io.tail(f.state);  // the rest of the body: whole floats
}

template <class Io, codec::Is<Hidden> M>
void fields(Io& io, M& h) {
  io(h.row_begin);
  io(h.hidden_size);
  if constexpr (Io::kReading) {
    // NOTE: hidden_size bounded first (as descriptors bound it): 4 * 2^62 would wrap to 0.
    const size_t bytes = io.left();
    if (!(h.row_begin >= 0 && h.hidden_size >= 1 && h.hidden_size <= (int64_t{1} << 20) &&
          bytes % (sizeof(float) * static_cast<uint64_t>(h.hidden_size)) == 0)) {
      io.fail(bytes, " bytes of rows from row ", h.row_begin, " are not whole rows of hidden_size ",
              h.hidden_size);
    }
  }
  io.tail(h.rows);
}

namespace {

// Header + the message's fields (+ payload_bytes the caller appends).
template <class Msg>
std::vector<uint8_t> encode_message(MsgType type, const Msg& m, const char* what,
                                    uint64_t payload_bytes = 0) {
  codec::Writer out(format(what));
  const Header header{kMagic, static_cast<uint16_t>(type), kVersion, 0};
  fields(out, header);
  fields(out, m);
  // The header's body_bytes, now that the body is written (no second copy of a large body).
  const uint64_t body_bytes = out.size() - kHeaderBytes + payload_bytes;
  static_assert(offsetof(Header, body_bytes) == 8 && sizeof(Header) == kHeaderBytes);
  std::memcpy(out.bytes().data() + offsetof(Header, body_bytes), &body_bytes, sizeof(body_bytes));
  return std::move(out.bytes());
}

template <class Msg>
Msg decode_message(std::span<const uint8_t> body, const char* what) {
  return codec::decode<Msg>(body, format(what), /*whole=*/true);
}

}  // namespace

std::vector<uint8_t> encode_hello(const Hello& h) {
  return encode_message(MsgType::kHello, h, "HELLO");
}

std::vector<uint8_t> encode_layer(const LayerPrefix& prefix, int64_t payload_floats) {
  const uint64_t payload = static_cast<uint64_t>(payload_floats) * 4;
  std::vector<uint8_t> out = encode_message(MsgType::kLayer, prefix, "LAYER", payload);
  out.resize(kHeaderBytes + kLayerPrefixBytes + payload);
  return out;
}

std::vector<uint8_t> encode_finish(const Finish& f) {
  return encode_message(MsgType::kFinish, f, "FINISH");
}

std::vector<uint8_t> encode_hidden(const Hidden& h) {
  return encode_message(MsgType::kHidden, h, "HIDDEN");
}

std::vector<uint8_t> encode_reply(const Reply& r) {
  const size_t n = std::min<size_t>(r.message.size(), kMaxReplyMessageBytes);
  codec::Writer out(format("reply"));
  const ReplyHeader header{kReplyMagic, static_cast<uint16_t>(r.ok ? 0 : 1), 0,
                           static_cast<uint32_t>(n)};
  fields(out, header);
  out.tail(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(r.message.data()), n));
  return std::move(out.bytes());
}

MsgHeader decode_header(std::span<const uint8_t, kHeaderBytes> bytes) {
  const auto h = codec::decode<Header>(bytes, format("message header"), /*whole=*/true);
  TANDEM_CHECK_KIND(kInvalidArgument, h.magic == kMagic, "not a KV transfer stream (magic 0x",
                    std::hex, h.magic, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, h.version == kVersion, "unsupported KV transfer version ",
                    h.version, " (this build speaks ", kVersion, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, h.type >= 1 && h.type <= 4,
                    "unknown KV transfer message type ", h.type);
  return {static_cast<MsgType>(h.type), h.body_bytes};
}

Hello decode_hello(std::span<const uint8_t> body) { return decode_message<Hello>(body, "HELLO"); }

LayerPrefix decode_layer_prefix(std::span<const uint8_t> body) {
  return decode_message<LayerPrefix>(body.first(std::min(body.size(), kLayerPrefixBytes)), "LAYER");
}

Finish decode_finish(std::span<const uint8_t> body) {
  return decode_message<Finish>(body, "FINISH");
}

Hidden decode_hidden(std::span<const uint8_t> body) {
  return decode_message<Hidden>(body, "HIDDEN");
}

bool decode_reply_header(std::span<const uint8_t, kReplyHeaderBytes> bytes,
                         uint32_t& message_bytes) {
  const auto h = codec::decode<ReplyHeader>(bytes, format("reply"), /*whole=*/true);
  message_bytes = h.message_bytes;
  TANDEM_CHECK_KIND(kInvalidArgument, h.magic == kReplyMagic, "not a KV transfer reply (magic 0x",
                    std::hex, h.magic, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, h.status <= 1, "unknown reply status ", h.status);
  TANDEM_CHECK_KIND(kInvalidArgument, message_bytes <= kMaxReplyMessageBytes, "reply message of ",
                    message_bytes, " bytes is over the limit");
  return h.status == 0;
}

}  // namespace tandem::transfer::wire
