// The prompt's hidden states in chunks (transfer/hidden_chunks.h, the cuda-ipc backend's way to
// carry them over its small control frames): the HIDDEN wire message split and put back together
// bit for bit, and every chunk or message that does not fit the descriptor refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "transfer/hidden_chunks.h"
#include "transfer/wire.h"

namespace tandem::transfer {
namespace {

using ::testing::HasSubstr;

// Random bits as floats: NaNs with payloads, infinities, -0 and denormals included.
std::vector<float> random_rows(int64_t rows, int64_t hidden, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(rows * hidden));
  std::mt19937 rng(seed);
  for (float& x : v) {
    const uint32_t u = rng();
    std::memcpy(&x, &u, 4);
  }
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Feeds every chunk of `message` (split at chunk_bytes) in order; returns what add() returned
// for the last one.
bool feed(HiddenAssembler& a, const std::vector<uint8_t>& message, size_t chunk_bytes) {
  bool whole = false;
  uint64_t at = 0;
  for (auto c : split_chunks(message, chunk_bytes)) {
    whole = a.add(at, message.size(), c);
    at += c.size();
  }
  return whole;
}

// The message of add()'s Error (kInvalidArgument) for `fn`, "" when it did not throw.
std::string refusal(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.message();
  }
  return "";
}

TEST(HiddenChunks, SplitCoversTheMessageInOrder) {
  std::vector<uint8_t> msg(1000);
  for (size_t i = 0; i < msg.size(); ++i) msg[i] = static_cast<uint8_t>(i * 7);
  const auto chunks = split_chunks(msg, 256);
  ASSERT_EQ(chunks.size(), 4u);
  std::vector<uint8_t> back;
  for (size_t i = 0; i < chunks.size(); ++i) {
    EXPECT_EQ(chunks[i].size(), i < 3 ? 256u : 232u);
    back.insert(back.end(), chunks[i].begin(), chunks[i].end());
  }
  EXPECT_EQ(back, msg);
  EXPECT_EQ(split_chunks(std::vector<uint8_t>(512), 256).size(), 2u);  // exact multiple
  EXPECT_TRUE(split_chunks({}, 256).empty());
  EXPECT_THROW(split_chunks(msg, 0), Error);
}

// More rows than one 1 MiB control frame holds (700 x 512 floats: 1.4 MiB, 6 chunks of the
// default size), from row 0 and from a later row (a prefix-cache hit at the prefill): the rows
// come back bit for bit, and only the last chunk makes the message whole.
TEST(HiddenChunks, ReassemblesRowsLargerThanAFrameBitForBit) {
  constexpr int64_t kTokens = 700, kHidden = 512;
  for (const int64_t begin : {int64_t{0}, int64_t{123}}) {
    SCOPED_TRACE("row_begin " + std::to_string(begin));
    const auto rows = random_rows(kTokens - begin, kHidden, 5 + static_cast<uint32_t>(begin));
    const auto msg = wire::encode_hidden({begin, kHidden, rows});
    ASSERT_GT(msg.size(), size_t{1} << 20);
    const auto chunks = split_chunks(msg);
    EXPECT_EQ(chunks.size(), (msg.size() + kHiddenChunkBytes - 1) / kHiddenChunkBytes);
    HiddenAssembler a(kTokens, kHidden);
    EXPECT_FALSE(a.started());
    uint64_t at = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      EXPECT_LE(chunks[i].size(), kHiddenChunkBytes);
      EXPECT_EQ(a.add(at, msg.size(), chunks[i]), i + 1 == chunks.size());
      at += chunks[i].size();
      EXPECT_TRUE(a.started());
    }
    ASSERT_TRUE(a.whole());
    const PromptHidden got = a.take();
    EXPECT_EQ(got.begin, begin);
    EXPECT_TRUE(same_bits(got.rows, rows));
  }
  // One row, in one chunk.
  const auto one = random_rows(1, 3, 9);
  HiddenAssembler a(4, 3);
  EXPECT_TRUE(feed(a, wire::encode_hidden({3, 3, one}), kHiddenChunkBytes));
  EXPECT_TRUE(same_bits(a.take().rows, one));
}

TEST(HiddenChunks, RefusesMessagesThatDoNotFitTheDescriptor) {
  constexpr int64_t kTokens = 10, kHidden = 4;
  const auto rows = random_rows(kTokens, kHidden, 1);
  const auto msg = wire::encode_hidden({0, kHidden, rows});  // 32 + 160 bytes
  auto first_chunk = [&](HiddenAssembler& a, uint64_t total) {
    return [&a, &msg, total] { a.add(0, total, std::span<const uint8_t>(msg).first(16)); };
  };
  {
    HiddenAssembler none(kTokens, 0);  // the descriptor asks for none
    EXPECT_THAT(refusal(first_chunk(none, msg.size())), HasSubstr("asks for no hidden states"));
  }
  {
    HiddenAssembler a(kTokens, kHidden);  // not whole rows
    EXPECT_THAT(refusal(first_chunk(a, msg.size() - 4)), HasSubstr("is not 32 + k * 16"));
  }
  {
    HiddenAssembler a(kTokens, kHidden);  // more rows than the prompt: never allocated
    EXPECT_THAT(refusal(first_chunk(a, 32 + 16 * (kTokens + 1))), HasSubstr("for 1 <= k <= 10"));
    HiddenAssembler b(kTokens, kHidden);  // no rows
    EXPECT_THAT(refusal(first_chunk(b, 32)), HasSubstr("is not 32 + k * 16"));
    HiddenAssembler c(kTokens, kHidden);  // a huge total
    EXPECT_THAT(refusal(first_chunk(c, uint64_t{1} << 62)), HasSubstr("for 1 <= k <= 10"));
  }
  // A message of the right size that is not this descriptor's rows.
  auto whole_refusal = [&](std::vector<uint8_t> m, int64_t tokens) {
    HiddenAssembler a(tokens, kHidden);
    return refusal([&] { feed(a, m, 64); });
  };
  auto other_type = msg;
  other_type[4] = static_cast<uint8_t>(wire::MsgType::kFinish);
  EXPECT_THAT(whole_refusal(other_type, kTokens), HasSubstr("not a HIDDEN"));
  auto bad_magic = msg;
  bad_magic[0] ^= 0xFF;
  EXPECT_THAT(whole_refusal(bad_magic, kTokens), HasSubstr("not a KV transfer stream"));
  // hidden_size 8 in the message, 4 in the descriptor (same bytes: 5 rows of 8 = 10 of 4).
  EXPECT_THAT(whole_refusal(wire::encode_hidden({0, 8, random_rows(5, 8, 2)}), kTokens),
              HasSubstr("the descriptor wants rows up to 10 x 4"));
  // Rows that stop short of the prompt's end.
  EXPECT_THAT(whole_refusal(wire::encode_hidden({0, kHidden, random_rows(9, kHidden, 3)}), kTokens),
              HasSubstr("HIDDEN of rows [0, 9) x 4"));
  // The prompt's end, but the descriptor's prompt is longer.
  EXPECT_THAT(whole_refusal(msg, kTokens + 2), HasSubstr("rows up to 12 x 4"));
}

TEST(HiddenChunks, RefusesChunksOutOfOrderOrSize) {
  constexpr int64_t kTokens = 10, kHidden = 4;
  const auto msg = wire::encode_hidden({0, kHidden, random_rows(kTokens, kHidden, 4)});
  const std::span<const uint8_t> all(msg);
  const uint64_t total = msg.size();
  // Each case: a fresh assembler that got the first 64 bytes in one chunk, then the bad add.
  auto after_first = [&](const std::function<void(HiddenAssembler&)>& bad) {
    HiddenAssembler a(kTokens, kHidden, 64);
    EXPECT_FALSE(a.add(0, total, all.first(64)));
    return refusal([&] { bad(a); });
  };
  EXPECT_THAT(after_first([&](HiddenAssembler& a) { a.add(96, total, all.subspan(96, 32)); }),
              HasSubstr("at byte 96 (expected 1 to 64 bytes at byte 64"));  // a gap
  EXPECT_THAT(after_first([&](HiddenAssembler& a) { a.add(32, total, all.subspan(32, 32)); }),
              HasSubstr("at byte 32"));  // an overlap
  EXPECT_THAT(after_first([&](HiddenAssembler& a) { a.add(64, total, all.subspan(64, 65)); }),
              HasSubstr("HIDDEN chunk of 65 bytes"));  // over max_chunk
  EXPECT_THAT(after_first([&](HiddenAssembler& a) { a.add(64, total, all.subspan(64, 0)); }),
              HasSubstr("HIDDEN chunk of 0 bytes"));  // empty
  EXPECT_THAT(after_first([&](HiddenAssembler& a) { a.add(64, total - 16, all.subspan(64, 32)); }),
              HasSubstr("after chunks of a 192-byte one"));  // another total
  {
    HiddenAssembler a(kTokens, kHidden, 64);  // the first chunk not at byte 0
    EXPECT_THAT(refusal([&] { a.add(64, total, all.subspan(64, 64)); }), HasSubstr("at byte 64"));
  }
  {
    HiddenAssembler a(kTokens, kHidden, 256);  // a last chunk past the total
    EXPECT_FALSE(a.add(0, total, all.first(100)));
    std::vector<uint8_t> longer(msg.begin() + 100, msg.end());
    longer.push_back(0);
    EXPECT_THAT(refusal([&] { a.add(100, total, longer); }), HasSubstr("of 192)"));
  }
  {
    HiddenAssembler a(kTokens, kHidden, 64);  // a second HIDDEN after the first was whole
    EXPECT_THROW(a.take(), Error);            // not whole yet
    EXPECT_TRUE(feed(a, msg, 64));
    EXPECT_THAT(refusal([&] { a.add(0, total, all.first(64)); }), HasSubstr("a second HIDDEN"));
    EXPECT_EQ(a.take().rows.size(), static_cast<size_t>(kTokens * kHidden));
  }
  EXPECT_THROW(HiddenAssembler(0, kHidden), Error);
  EXPECT_THROW(HiddenAssembler(kTokens, -1), Error);
  EXPECT_THROW(HiddenAssembler(kTokens, kHidden, 0), Error);
}

}  // namespace
}  // namespace tandem::transfer
