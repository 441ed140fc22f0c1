// core/byte_codec.h: one fields() list runs both directions; every length is
// checked against the bytes left and the caller's cap before anything is
// allocated; a malformed message throws the family's ErrorKind naming it.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "core/byte_codec.h"
#include "core/error.h"

namespace tandem {
namespace {

struct Pair {
  int32_t a = 0;
  float b = 0;
};

struct Msg {
  std::string id;
  std::vector<int32_t> ids;
  bool flag = false;
  uint8_t kind = 0;  // sent as i32
  std::optional<uint64_t> seed;
  std::vector<Pair> pairs;  // records
  std::vector<float> rest;  // the tail
};

template <class Io, codec::Is<Pair> M>
void fields(Io& io, M& p) {
  io(p.a);
  io(p.b);
}

template <class Io, codec::Is<Msg> M>
void fields(Io& io, M& m) {
  io(m.id, 16);
  io(m.ids);
  io(m.flag);
  io.template as<int32_t>(m.kind);
  io.opt(m.seed);
  io.records(m.pairs, 8);
  io.tail(m.rest);
}

constexpr codec::Format kI64{codec::LenWidth::kI64, ErrorKind::kIo, "test message"};
constexpr codec::Format kU32{codec::LenWidth::kU32, ErrorKind::kInvalidArgument, "TEST"};

Msg sample() {
  Msg m;
  m.id = "req-1";
  m.ids = {3, -1, 7};
  m.flag = true;
  m.kind = 5;
  m.seed = 42;
  m.pairs = {{1, 0.5f}, {2, -2.f}};
  m.rest = {1.f, 2.f};
  return m;
}

void expect_same(const Msg& a, const Msg& b) {
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.flag, b.flag);
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.seed, b.seed);
  ASSERT_EQ(a.pairs.size(), b.pairs.size());
  for (size_t i = 0; i < a.pairs.size(); ++i) {
    EXPECT_EQ(a.pairs[i].a, b.pairs[i].a);
    EXPECT_EQ(a.pairs[i].b, b.pairs[i].b);
  }
  EXPECT_EQ(a.rest, b.rest);
}

TEST(ByteCodec, OneFieldListRoundTripsInBothFormats) {
  for (const codec::Format f : {kI64, kU32}) {
    const Msg m = sample();
    const std::vector<uint8_t> bytes = codec::encode(m, f);
    const size_t len = f.len == codec::LenWidth::kI64 ? 8 : 4;
    // id, ids, flag, kind, seed (presence + value), pairs, rest
    EXPECT_EQ(bytes.size(), len + 5 + len + 12 + 1 + 4 + 9 + len + 16 + 8);
    expect_same(codec::decode<Msg>(bytes, f, /*whole=*/true), m);
    Msg none = m;
    none.seed.reset();
    EXPECT_FALSE(codec::decode<Msg>(codec::encode(none, f), f).seed.has_value());
  }
}

TEST(ByteCodec, LittleEndianBytesAsWritten) {
  codec::Writer w(kU32);
  w(uint32_t{0x01020304});
  w(std::string("ab"));
  EXPECT_EQ(w.bytes(), (std::vector<uint8_t>{4, 3, 2, 1, 2, 0, 0, 0, 'a', 'b'}));
}

// Every way a message can lie about itself: an Error of the family's kind,
// naming it.
TEST(ByteCodec, MalformedBytesThrowTheFamilysKindBeforeAllocating) {
  const std::vector<uint8_t> good = codec::encode(sample(), kI64);
  auto refused = [](const std::vector<uint8_t>& bytes, codec::Format f) {
    try {
      codec::decode<Msg>(bytes, f, /*whole=*/true);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), f.error);
      EXPECT_NE(e.message().find(std::string("malformed ") + f.what), std::string::npos)
          << e.message();
      return true;
    }
    return false;
  };
  for (size_t cut = 0; cut < good.size() - 8; ++cut) {  // (the tail takes any whole floats)
    EXPECT_TRUE(refused({good.begin(), good.begin() + static_cast<ptrdiff_t>(cut)}, kI64)) << cut;
  }
  // A tail that is not whole floats.
  std::vector<uint8_t> odd = good;
  odd.pop_back();
  EXPECT_TRUE(refused(odd, kI64));
  // Counts that are negative, that wrap 64 bits at their element size, or past
  // what is left.
  for (const int64_t n : {int64_t{-1}, int64_t{1} << 62, int64_t{1} << 61, int64_t{1000000}}) {
    codec::Writer w(kI64);
    w.put_str("x");
    w.put<int64_t>(n);  // the ids' count
    w.put<int32_t>(7);
    EXPECT_TRUE(refused(w.bytes(), kI64)) << n;
  }
  // A string over its cap (16), though the bytes are there.
  codec::Writer big(kU32);
  big.put_str(std::string(17, 'x'));
  big.put<uint32_t>(0);
  EXPECT_TRUE(refused(big.bytes(), kU32));
  // A count of records past what the bytes left can hold at 8 bytes each.
  const std::vector<uint8_t> three = {3, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8};
  codec::Reader r(three, kU32);
  std::vector<Pair> pairs;
  EXPECT_THROW(r.records(pairs, 8), Error);
  // Trailing bytes where the whole message must be read.
  const std::vector<uint8_t> two = {1, 2};
  codec::Reader t(two, kU32);
  t.get<uint8_t>();
  EXPECT_THROW(t.expect_end(), Error);
}

}  // namespace
}  // namespace tandem
