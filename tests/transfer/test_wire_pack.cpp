// Packing pages to the dense transfer layout and back, and the wire format's parsers.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "transfer/kv_pack.h"
#include "transfer/wire.h"

namespace tandem::transfer {
namespace {

constexpr uint32_t kPoison = 0x7FBADBADu;  // a NaN no computation produces

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

void poison(KvCache& c) {
  const auto& g = c.geometry();
  for (int64_t l = 0; l < g.num_layers; ++l) {
    float* p = c.layer(l);
    for (int64_t i = 0; i < g.num_pages * g.page_elems(); ++i) std::memcpy(p + i, &kPoison, 4);
  }
}

TEST(KvPack, RepagesTokenRangesAndLeavesTheRestAlone) {
  // Source: page_size 4, 4 heads; take heads [1, 3) of 13 tokens from scattered pages.
  KvCache src(KvGeometry{2, 8, 4, 4, 3});
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (int64_t l = 0; l < 2; ++l) {
    for (int64_t i = 0; i < 8 * src.geometry().page_elems(); ++i) src.layer(l)[i] = u(rng);
  }
  // A chunk: tokens [3, 13) of a 13-token prompt, crossing both sides' page boundaries.
  const std::vector<int32_t> src_pages = {6, 2, 7, 0};
  const int64_t t0 = 3, t1 = 13, n = t1 - t0, heads = 2, d = 3;
  std::vector<float> packed(static_cast<size_t>(packed_layer_elems(heads, n, d)));
  pack_layer(src, 1, src_pages, 1, heads, t0, t1, packed.data());
  for (int64_t kv = 0; kv < 2; ++kv) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* row =
            src.head_rows(1, src_pages[static_cast<size_t>(t / 4)], static_cast<int>(kv), 1 + h) +
            (t % 4) * d;
        for (int64_t j = 0; j < d; ++j) {
          ASSERT_EQ(packed[static_cast<size_t>(((kv * heads + h) * n + t - t0) * d + j)], row[j]);
        }
      }
    }
  }

  // Destination: page_size 8, 3 heads; write them as local heads [0, 2).
  KvCache dst(KvGeometry{2, 5, 3, 8, 3});
  poison(dst);
  const std::vector<int32_t> dst_pages = {4, 1};
  unpack_layer(packed.data(), dst, 1, dst_pages, 0, heads, t0, t1);
  for (int64_t p = 0; p < 5; ++p) {
    for (int64_t kv = 0; kv < 2; ++kv) {
      for (int64_t h = 0; h < 3; ++h) {
        for (int64_t slot = 0; slot < 8; ++slot) {
          const float* row = dst.head_rows(1, p, static_cast<int>(kv), h) + slot * d;
          const int64_t idx = p == 4 ? 0 : p == 1 ? 1 : -1;
          const int64_t t = idx * 8 + slot;
          const bool written = idx >= 0 && h < heads && t >= t0 && t < t1;
          for (int64_t j = 0; j < d; ++j) {
            if (written) {
              const float* want = src.head_rows(1, src_pages[static_cast<size_t>(t / 4)],
                                                static_cast<int>(kv), 1 + h) +
                                  (t % 4) * d;
              ASSERT_EQ(bits(row[j]), bits(want[j])) << "page " << p << " slot " << slot;
            } else {
              ASSERT_EQ(bits(row[j]), kPoison) << "page " << p << " head " << h << " slot " << slot;
            }
          }
        }
      }
    }
  }
  // Layer 0 untouched.
  for (int64_t i = 0; i < 5 * dst.geometry().page_elems(); ++i) {
    ASSERT_EQ(bits(dst.layer(0)[i]), kPoison);
  }
  EXPECT_THROW(pack_layer(src, 1, src_pages, 3, 2, t0, t1, packed.data()), Error);  // heads
  EXPECT_THROW(pack_layer(src, 1, src_pages, 0, 2, 10, 17, packed.data()), Error);  // tokens
}

TEST(Wire, RoundTripsAndRejectsMalformedInput) {
  wire::Hello h;
  h.request_id = "chatcmpl-42-0";
  h.src_rank = 3;
  h.src = KvSharding{4, 8};
  h.heads = {1, 2};
  h.num_layers = 94;
  h.num_tokens = 6000;
  h.head_dim = 128;
  const auto bytes = wire::encode_hello(h);
  const auto hdr = wire::decode_header(
      std::span<const uint8_t, wire::kHeaderBytes>(bytes.data(), wire::kHeaderBytes));
  EXPECT_EQ(hdr.type, wire::MsgType::kHello);
  ASSERT_EQ(hdr.body_bytes, bytes.size() - wire::kHeaderBytes);
  const std::span<const uint8_t> body(bytes.data() + wire::kHeaderBytes, hdr.body_bytes);
  const auto back = wire::decode_hello(body);
  EXPECT_EQ(back.request_id, h.request_id);
  EXPECT_EQ(back.src_rank, 3);
  EXPECT_EQ(back.src, h.src);
  EXPECT_EQ(back.heads, h.heads);
  EXPECT_EQ(back.num_tokens, 6000);
  EXPECT_THROW(wire::decode_hello(body.first(body.size() - 1)), Error);  // truncated

  auto bad = bytes;
  bad[0] ^= 0xFF;  // magic
  EXPECT_THROW(wire::decode_header(
                   std::span<const uint8_t, wire::kHeaderBytes>(bad.data(), wire::kHeaderBytes)),
               Error);

  const auto layer = wire::encode_layer({5, 16, 32}, 10);
  EXPECT_EQ(layer.size(), wire::kHeaderBytes + wire::kLayerPrefixBytes + 40);
  const auto prefix =
      wire::decode_layer_prefix(std::span<const uint8_t>(layer).subspan(wire::kHeaderBytes));
  EXPECT_EQ(prefix.layer, 5);
  EXPECT_EQ(prefix.token_begin, 16);
  EXPECT_EQ(prefix.token_end, 32);

  const auto fin = wire::encode_finish({1234, -0.25f});
  const auto f = wire::decode_finish(std::span<const uint8_t>(fin).subspan(wire::kHeaderBytes));
  EXPECT_EQ(f.first_token, 1234);
  EXPECT_EQ(f.logprob, -0.25f);
  EXPECT_TRUE(f.state.empty());
  // With a hybrid model's recurrent state.
  const std::vector<float> state = {1.5f, -2.f, 3.25f};
  const auto fs = wire::encode_finish({9, -1.f, state});
  EXPECT_EQ(fs.size(), wire::kHeaderBytes + wire::kFinishBytes + 12);
  EXPECT_EQ(wire::decode_header(
                std::span<const uint8_t, wire::kHeaderBytes>(fs.data(), wire::kHeaderBytes))
                .body_bytes,
            wire::kFinishBytes + 12);
  const auto g = wire::decode_finish(std::span<const uint8_t>(fs).subspan(wire::kHeaderBytes));
  EXPECT_EQ(g.first_token, 9);
  EXPECT_EQ(g.state, state);
  EXPECT_THROW(
      wire::decode_finish(std::span<const uint8_t>(fs).subspan(wire::kHeaderBytes, 8 + 11)),
      Error);  // not whole floats
  EXPECT_THROW(wire::decode_finish(std::span<const uint8_t>(fs).subspan(wire::kHeaderBytes, 6)),
               Error);  // truncated

  // The prompt's hidden states (MTP on the decode side): rows 5.. of hidden_size 2.
  const std::vector<float> rows = {0.5f, -1.f, 2.f, 3.5f, -4.25f, 6.f};
  const auto hid = wire::encode_hidden({5, 2, rows});
  EXPECT_EQ(hid.size(), wire::kHeaderBytes + wire::kHiddenPrefixBytes + 24);
  const auto hh = wire::decode_header(
      std::span<const uint8_t, wire::kHeaderBytes>(hid.data(), wire::kHeaderBytes));
  EXPECT_EQ(hh.type, wire::MsgType::kHidden);
  EXPECT_EQ(hh.body_bytes, wire::kHiddenPrefixBytes + 24);
  const auto hbody = std::span<const uint8_t>(hid).subspan(wire::kHeaderBytes);
  const auto hd = wire::decode_hidden(hbody);
  EXPECT_EQ(hd.row_begin, 5);
  EXPECT_EQ(hd.hidden_size, 2);
  EXPECT_EQ(hd.rows, rows);
  EXPECT_THROW(wire::decode_hidden(hbody.first(wire::kHiddenPrefixBytes + 20)),
               Error);                                        // not whole rows
  EXPECT_THROW(wire::decode_hidden(hbody.first(12)), Error);  // truncated
  const auto zero = wire::encode_hidden({0, 0, {}});
  EXPECT_THROW(wire::decode_hidden(std::span<const uint8_t>(zero).subspan(wire::kHeaderBytes)),
               Error);  // hidden_size 0
  const auto neg = wire::encode_hidden({-1, 2, rows});
  EXPECT_THROW(wire::decode_hidden(std::span<const uint8_t>(neg).subspan(wire::kHeaderBytes)),
               Error);  // a negative first row

  const auto reply = wire::encode_reply({false, "nope"});
  uint32_t n = 0;
  EXPECT_FALSE(wire::decode_reply_header(
      std::span<const uint8_t, wire::kReplyHeaderBytes>(reply.data(), wire::kReplyHeaderBytes), n));
  EXPECT_EQ(n, 4u);
}

}  // namespace
}  // namespace tandem::transfer
