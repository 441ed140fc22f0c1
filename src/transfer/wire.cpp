#include "transfer/wire.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace tandem::transfer::wire {

namespace {

template <typename T>
void put(std::vector<uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

// Reads fields in order from a body, checking that each one is there.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> bytes, const char* what) : bytes_(bytes), what_(what) {}
  template <typename T>
  T take() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string take_string(size_t n) {
    need(n);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  void expect_end() const {
    TANDEM_CHECK_KIND(kInvalidArgument, pos_ == bytes_.size(), "malformed ", what_, ": ",
                      bytes_.size() - pos_, " trailing bytes");
  }

 private:
  void need(size_t n) const {
    TANDEM_CHECK_KIND(kInvalidArgument, bytes_.size() - pos_ >= n, "malformed ", what_,
                      ": truncated at byte ", pos_, " of ", bytes_.size());
  }
  std::span<const uint8_t> bytes_;
  const char* what_;
  size_t pos_ = 0;
};

void put_header(std::vector<uint8_t>& out, MsgType type, uint64_t body_bytes) {
  put<uint32_t>(out, kMagic);
  put<uint16_t>(out, static_cast<uint16_t>(type));
  put<uint16_t>(out, kVersion);
  put<uint64_t>(out, body_bytes);
}

// Appends the floats' bytes (a message's payload after its fixed fields).
void put_floats(std::vector<uint8_t>& out, const std::vector<float>& v) {
  const size_t at = out.size(), bytes = v.size() * sizeof(float);
  out.resize(at + bytes);
  if (bytes > 0) std::memcpy(out.data() + at, v.data(), bytes);
}

}  // namespace

std::vector<uint8_t> encode_hello(const Hello& h) {
  std::vector<uint8_t> body;
  put<uint32_t>(body, static_cast<uint32_t>(h.request_id.size()));
  body.insert(body.end(), h.request_id.begin(), h.request_id.end());
  put<int32_t>(body, h.src_rank);
  put<int32_t>(body, h.src.tp);
  put<int64_t>(body, h.src.num_kv_heads);
  put<int64_t>(body, h.heads.begin);
  put<int64_t>(body, h.heads.end);
  put<int64_t>(body, h.num_layers);
  put<int64_t>(body, h.num_tokens);
  put<int64_t>(body, h.head_dim);
  put<uint8_t>(body, h.dtype);
  std::vector<uint8_t> out;
  out.reserve(kHeaderBytes + body.size());
  put_header(out, MsgType::kHello, body.size());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

std::vector<uint8_t> encode_layer(const LayerPrefix& prefix, int64_t payload_floats) {
  const uint64_t body = kLayerPrefixBytes + static_cast<uint64_t>(payload_floats) * 4;
  std::vector<uint8_t> out;
  out.reserve(kHeaderBytes + body);
  put_header(out, MsgType::kLayer, body);
  put<int64_t>(out, prefix.layer);
  put<int64_t>(out, prefix.token_begin);
  put<int64_t>(out, prefix.token_end);
  out.resize(kHeaderBytes + body);
  return out;
}

std::vector<uint8_t> encode_finish(const Finish& f) {
  std::vector<uint8_t> out;
  const uint64_t state_bytes = f.state.size() * sizeof(float);
  put_header(out, MsgType::kFinish, kFinishBytes + state_bytes);
  put<int32_t>(out, f.first_token);
  put<float>(out, f.logprob);
  put_floats(out, f.state);
  return out;
}

std::vector<uint8_t> encode_hidden(const Hidden& h) {
  std::vector<uint8_t> out;
  const uint64_t row_bytes = h.rows.size() * sizeof(float);
  put_header(out, MsgType::kHidden, kHiddenPrefixBytes + row_bytes);
  put<int64_t>(out, h.row_begin);
  put<int64_t>(out, h.hidden_size);
  put_floats(out, h.rows);
  return out;
}

std::vector<uint8_t> encode_reply(const Reply& r) {
  const size_t n = std::min<size_t>(r.message.size(), kMaxReplyMessageBytes);
  std::vector<uint8_t> out;
  put<uint32_t>(out, kReplyMagic);
  put<uint16_t>(out, r.ok ? 0 : 1);
  put<uint16_t>(out, 0);
  put<uint32_t>(out, static_cast<uint32_t>(n));
  out.insert(out.end(), r.message.begin(), r.message.begin() + static_cast<ptrdiff_t>(n));
  return out;
}

MsgHeader decode_header(std::span<const uint8_t, kHeaderBytes> bytes) {
  Reader in(bytes, "message header");
  const auto magic = in.take<uint32_t>();
  const auto type = in.take<uint16_t>();
  const auto version = in.take<uint16_t>();
  const auto body = in.take<uint64_t>();
  TANDEM_CHECK_KIND(kInvalidArgument, magic == kMagic, "not a KV transfer stream (magic 0x",
                    std::hex, magic, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, version == kVersion, "unsupported KV transfer version ",
                    version, " (this build speaks ", kVersion, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, type >= 1 && type <= 4, "unknown KV transfer message type ",
                    type);
  return {static_cast<MsgType>(type), body};
}

Hello decode_hello(std::span<const uint8_t> body) {
  Reader in(body, "HELLO");
  Hello h;
  const auto id_bytes = in.take<uint32_t>();
  h.request_id = in.take_string(id_bytes);
  h.src_rank = in.take<int32_t>();
  h.src.tp = in.take<int32_t>();
  h.src.num_kv_heads = in.take<int64_t>();
  h.heads.begin = in.take<int64_t>();
  h.heads.end = in.take<int64_t>();
  h.num_layers = in.take<int64_t>();
  h.num_tokens = in.take<int64_t>();
  h.head_dim = in.take<int64_t>();
  h.dtype = in.take<uint8_t>();
  in.expect_end();
  return h;
}

LayerPrefix decode_layer_prefix(std::span<const uint8_t> body) {
  Reader in(body.first(std::min(body.size(), kLayerPrefixBytes)), "LAYER");
  LayerPrefix p;
  p.layer = in.take<int64_t>();
  p.token_begin = in.take<int64_t>();
  p.token_end = in.take<int64_t>();
  return p;
}

Finish decode_finish(std::span<const uint8_t> body) {
  Reader in(body, "FINISH");
  Finish f;
  f.first_token = in.take<int32_t>();
  f.logprob = in.take<float>();
  TANDEM_CHECK_KIND(kInvalidArgument, (body.size() - kFinishBytes) % sizeof(float) == 0,
                    "malformed FINISH: a state of ", body.size() - kFinishBytes,
                    " bytes is not whole floats");
  f.state.resize((body.size() - kFinishBytes) / sizeof(float));
  for (float& v : f.state) v = in.take<float>();
  in.expect_end();
  return f;
}

Hidden decode_hidden(std::span<const uint8_t> body) {
  Reader in(body, "HIDDEN");
  Hidden h;
  h.row_begin = in.take<int64_t>();
  h.hidden_size = in.take<int64_t>();
  const size_t bytes = body.size() - kHiddenPrefixBytes;
  // NOTE: hidden_size bounded first (as descriptors bound it): 4 * 2^62 would wrap to 0.
  TANDEM_CHECK_KIND(kInvalidArgument,
                    h.row_begin >= 0 && h.hidden_size >= 1 && h.hidden_size <= (int64_t{1} << 20) &&
                        bytes % (sizeof(float) * static_cast<uint64_t>(h.hidden_size)) == 0,
                    "malformed HIDDEN: ", bytes, " bytes of rows from row ", h.row_begin,
                    " are not whole rows of hidden_size ", h.hidden_size);
  h.rows.resize(bytes / sizeof(float));
  if (bytes > 0) std::memcpy(h.rows.data(), body.data() + kHiddenPrefixBytes, bytes);
  return h;
}

bool decode_reply_header(std::span<const uint8_t, kReplyHeaderBytes> bytes,
                         uint32_t& message_bytes) {
  Reader in(bytes, "reply");
  const auto magic = in.take<uint32_t>();
  const auto status = in.take<uint16_t>();
  in.take<uint16_t>();
  message_bytes = in.take<uint32_t>();
  TANDEM_CHECK_KIND(kInvalidArgument, magic == kReplyMagic, "not a KV transfer reply (magic 0x",
                    std::hex, magic, ")");
  TANDEM_CHECK_KIND(kInvalidArgument, status <= 1, "unknown reply status ", status);
  TANDEM_CHECK_KIND(kInvalidArgument, message_bytes <= kMaxReplyMessageBytes, "reply message of ",
                    message_bytes, " bytes is over the limit");
  return status == 0;
}

}  // namespace tandem::transfer::wire
