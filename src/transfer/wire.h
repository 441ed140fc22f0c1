// Wire format of the host (TCP) transfer backend. Integers are little-endian, KV values IEEE
// binary32 little-endian (static_assert'ed: both ends run on x86-64 / aarch64 hosts).
//
// One TCP connection per (request, source rank, destination rank), sender -> receiver:
//   HELLO, then LAYER pieces (each layer's token ranges in order and without gaps, layers in any
//   order and interleaved), then (one sending rank, when the descriptor asks) HIDDEN, then FINISH.
// Every message is a 16-byte header followed by body_bytes of body:
//   header  u32 magic "TKV1" | u16 type | u16 version (1) | u64 body_bytes
//   HELLO   u32 id_bytes | id | i32 src_rank | i32 src_tp | i64 src_num_kv_heads |
//           i64 head_begin | i64 head_end (global heads this rank sends) | i64 num_layers |
//           i64 num_tokens | i64 head_dim | u8 dtype (0 = f32)
//   LAYER   i64 layer | i64 token_begin | i64 token_end |
//           f32 [2 (k, v), heads, token_end - token_begin, head_dim]     (transfer/kv_pack.h)
//   HIDDEN  i64 row_begin | i64 hidden_size | f32 [num_tokens - row_begin, hidden_size]
//           (descriptor hidden_size > 0: the prompt's final hidden states, after the target's
//           final norm, of positions row_begin.. num_tokens - 1, for the decode side's MTP layer;
//           f32 as the KV payload: 4 * hidden_size bytes per prompt token; the cuda-ipc backend
//           sends this same message cut into chunks over its control frames: hidden_chunks.h)
//   FINISH  i32 first_token | f32 logprob | f32 state[n]   (n = 0, or the descriptor's
//           state_elems: a hybrid model's recurrent state, from one sending rank)
// The receiver answers once on the same connection, receiver -> sender:
//   REPLY   u32 magic "TKVR" | u16 status (0 ok, 1 error) | u16 reserved | u32 message_bytes |
//           message (UTF-8)
//   ok after it accepted this connection's FINISH; error at the first problem, after which it
//   reads and discards until the sender closes (so the sender reads the message, not a reset).
// The receiver bounds every size in advance (from its descriptor and the HELLO: a LAYER body is
// at most one whole layer of the connection's heads), so it checks body_bytes before reading
// a body and never allocates on a peer's word.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "transfer/head_map.h"

namespace tandem::transfer::wire {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

constexpr uint32_t kMagic = 0x31564B54;       // "TKV1"
constexpr uint32_t kReplyMagic = 0x52564B54;  // "TKVR"
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 16;
constexpr size_t kReplyHeaderBytes = 12;
constexpr size_t kLayerPrefixBytes = 24;        // i64 layer, token_begin, token_end
constexpr size_t kFinishBytes = 8;              // without a state
constexpr size_t kHiddenPrefixBytes = 16;       // i64 row_begin, hidden_size
constexpr uint64_t kMaxHelloBytes = 64 * 1024;  // request ids are short
constexpr uint32_t kMaxReplyMessageBytes = 64 * 1024;

enum class MsgType : uint16_t { kHello = 1, kLayer = 2, kFinish = 3, kHidden = 4 };

struct MsgHeader {
  MsgType type = MsgType::kHello;
  uint64_t body_bytes = 0;
};

struct Hello {
  std::string request_id;
  int32_t src_rank = 0;
  KvSharding src;
  HeadRange heads;  // global heads this connection carries
  int64_t num_layers = 0;
  int64_t num_tokens = 0;
  int64_t head_dim = 0;
  uint8_t dtype = 0;  // 0 = f32 (the only one so far)
};

struct LayerPrefix {
  int64_t layer = 0;
  int64_t token_begin = 0;
  int64_t token_end = 0;
};

struct Finish {
  int32_t first_token = 0;
  float logprob = 0.0f;
  std::vector<float> state;  // empty, or the request's recurrent state
};

struct Hidden {
  int64_t row_begin = 0;
  int64_t hidden_size = 0;
  std::vector<float> rows;  // [num_tokens - row_begin, hidden_size]
};

struct Reply {
  bool ok = true;
  std::string message;
};

/// Header + body of a HELLO.
std::vector<uint8_t> encode_hello(const Hello& hello);
/// Header + prefix of a LAYER, followed by room for payload_floats floats starting at byte
/// kHeaderBytes + kLayerPrefixBytes (fill them with pack_layer).
std::vector<uint8_t> encode_layer(const LayerPrefix& prefix, int64_t payload_floats);
/// Header + body of a FINISH.
std::vector<uint8_t> encode_finish(const Finish& finish);
/// Header + body of a HIDDEN.
std::vector<uint8_t> encode_hidden(const Hidden& hidden);
/// The whole REPLY (the message is truncated to kMaxReplyMessageBytes).
std::vector<uint8_t> encode_reply(const Reply& reply);

/// Parse functions throw Error(kInvalidArgument) on malformed input.
MsgHeader decode_header(std::span<const uint8_t, kHeaderBytes> bytes);
Hello decode_hello(std::span<const uint8_t> body);
/// The prefix of a LAYER body (the payload follows it).
LayerPrefix decode_layer_prefix(std::span<const uint8_t> body);
Finish decode_finish(std::span<const uint8_t> body);
/// Checks the rows are whole (hidden_size >= 1), not their count against a descriptor.
Hidden decode_hidden(std::span<const uint8_t> body);
/// Returns ok and sets message_bytes (checked against kMaxReplyMessageBytes).
bool decode_reply_header(std::span<const uint8_t, kReplyHeaderBytes> bytes,
                         uint32_t& message_bytes);

}  // namespace tandem::transfer::wire
