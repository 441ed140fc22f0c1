// One byte codec for every message that crosses a process boundary (the roles' messages in
// disagg/protocol, the host KV transfer's wire format, the CUDA IPC control frames).
//
// A message's fields are listed once, in a function template that both directions run:
//
//   template <class Io, codec::Is<Msg> M>
//   void fields(Io& io, M& m) { io(m.id); io(m.tokens); io.as<uint8_t>(m.kind); ... }
//
// With a Writer (M deduced const) it appends the fields; with a Reader it fills them in, in the
// same order. Integers and floats go as their bytes (little-endian: static_assert'ed), a bool as
// one byte, a string or a vector of plain values as a length then its bytes, a vector of records
// as a count then each record's fields (seq). A family of messages picks its length width
// (i64 or u32), the ErrorKind a malformed message throws and its name in errors (Format).
//
// The Reader checks every read against the bytes that remain and every length or count, before
// anything is allocated, against what the remaining bytes can hold (at the element's size, so a
// count whose byte size would wrap 64 bits is refused) and against the caller's cap.
#pragma once

#include <bit>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/error.h"

namespace tandem::codec {

static_assert(std::endian::native == std::endian::little,
              "the byte codec writes values as the host stores them: little-endian hosts only");

/// How a length or count is written: i64 (the roles' messages) or u32 (the transfer formats).
enum class LenWidth : uint8_t { kI64, kU32 };

/// A message family's conventions.
struct Format {
  LenWidth len = LenWidth::kI64;
  ErrorKind error = ErrorKind::kIo;  // what a malformed message throws
  const char* what = "message";      // its name in errors: "malformed <what>: ..."
};

/// No cap beyond what the remaining bytes can hold.
inline constexpr size_t kUnbounded = std::numeric_limits<size_t>::max();

/// A value sent as its bytes.
template <class T>
concept Plain = std::is_trivially_copyable_v<T> && !std::is_pointer_v<T>;

/// M is T or const T (a fields() function's message: const when writing).
template <class M, class T>
concept Is = std::same_as<std::remove_const_t<M>, T>;

// (Reader's checks: throws through fail(), naming the message.)
#define TANDEM_CODEC_CHECK(cond, ...) \
  do {                                \
    if (!(cond)) [[unlikely]]         \
      fail(__VA_ARGS__);              \
  } while (0)

/// Appends fields to a byte buffer.
class Writer {
 public:
  static constexpr bool kReading = false;
  explicit Writer(Format format = {}) : format_(format) {}

  // ---- the fields API (the same calls as Reader's) ----
  template <Plain T>
  void operator()(const T& v) {
    put(v);
  }
  void operator()(const bool& b) { put<uint8_t>(b ? 1 : 0); }
  template <Plain T>
  void operator()(const std::vector<T>& v, size_t cap = kUnbounded) {
    check_cap(v.size(), cap);
    put_vec(v);
  }
  void operator()(const std::string& s, size_t cap = kUnbounded) {
    check_cap(s.size(), cap);
    put_str(s);
  }
  /// A field sent as W (an enum or a narrower or wider integer).
  template <Plain W, class T>
  void as(const T& v) {
    put<W>(static_cast<W>(v));
  }
  /// An optional: a presence byte, then the value (T{} when absent).
  template <Plain T>
  void opt(const std::optional<T>& v) {
    put<uint8_t>(v.has_value() ? 1 : 0);
    put<T>(v.value_or(T{}));
  }
  /// A vector of records: the count, then each(io, record) for each.
  template <class T, class F>
  void seq(const std::vector<T>& v, F&& each, size_t /*min_record_bytes*/ = 1,
           size_t cap = kUnbounded) {
    check_cap(v.size(), cap);
    put_len(v.size());
    for (const T& e : v) each(*this, e);
  }
  /// A vector of records, each with its own fields(io, record) (found by argument lookup).
  template <class T>
  void records(const std::vector<T>& v, size_t min_record_bytes = 1, size_t cap = kUnbounded) {
    seq(
        v, [](Writer& io, const T& e) { fields(io, e); }, min_record_bytes, cap);
  }
  /// Whether a part of n bytes follows (a part an older peer may not send): when writing,
  /// always.
  bool has(size_t /*n*/) const { return true; }
  /// Plain values that fill the rest of the message (no count: the message's size says it).
  template <Plain T>
  void tail(const std::vector<T>& v) {
    append(v.data(), v.size() * sizeof(T));
  }
  /// Bytes that fill the rest of the message.
  void tail(std::span<const uint8_t> bytes) { append(bytes.data(), bytes.size()); }

  // ---- primitives ----
  template <Plain T>
  void put(const T& v) {
    append(&v, sizeof(T));
  }
  template <Plain T>
  void put_vec(const T* data, int64_t n) {
    put_len(static_cast<size_t>(n));
    append(data, static_cast<size_t>(n) * sizeof(T));
  }
  template <Plain T>
  void put_vec(const std::vector<T>& v) {
    put_vec(v.data(), static_cast<int64_t>(v.size()));
  }
  void put_str(std::string_view s) { put_vec(s.data(), static_cast<int64_t>(s.size())); }

  std::vector<uint8_t>& bytes() { return buf_; }
  size_t size() const { return buf_.size(); }

 private:
  void append(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), b, b + n);
  }
  void put_len(size_t n) {
    if (format_.len == LenWidth::kU32) {
      TANDEM_CHECK(n <= std::numeric_limits<uint32_t>::max(), "a length of ", n, " in a ",
                   format_.what, " does not fit its u32");
      put<uint32_t>(static_cast<uint32_t>(n));
    } else {
      put<int64_t>(static_cast<int64_t>(n));
    }
  }
  void check_cap(size_t n, size_t cap) const {
    TANDEM_CHECK(n <= cap, "a length of ", n, " in a ", format_.what, " is over its limit of ",
                 cap);
  }
  Format format_;
  std::vector<uint8_t> buf_;
};

/// Reads what a Writer of the same Format wrote; throws Error(format.error) on malformed bytes.
class Reader {
 public:
  static constexpr bool kReading = true;
  explicit Reader(std::span<const uint8_t> bytes, Format format = {})
      : p_(bytes.data()),
        begin_(bytes.data()),
        end_(bytes.data() + bytes.size()),
        format_(format) {}
  Reader(const uint8_t* data, size_t size, Format format = {})
      : Reader(std::span<const uint8_t>(data, size), format) {}

  // ---- the fields API (the same calls as Writer's) ----
  template <Plain T>
  void operator()(T& v) {
    v = get<T>();
  }
  void operator()(bool& b) { b = get<uint8_t>() != 0; }
  template <Plain T>
  void operator()(std::vector<T>& v, size_t cap = kUnbounded) {
    v = get_vec<T>(cap);
  }
  void operator()(std::string& s, size_t cap = kUnbounded) { s = get_str(cap); }
  template <Plain W, class T>
  void as(T& v) {
    v = static_cast<T>(get<W>());
  }
  template <Plain T>
  void opt(std::optional<T>& v) {
    const bool has = get<uint8_t>() != 0;
    const T value = get<T>();
    if (has) {
      v = value;
    } else {
      v.reset();
    }
  }
  /// min_record_bytes: the fewest bytes one record takes (bounds the count by what remains).
  template <class T, class F>
  void seq(std::vector<T>& v, F&& each, size_t min_record_bytes = 1, size_t cap = kUnbounded) {
    const size_t n = get_len(min_record_bytes, cap);
    v.clear();
    // NOTE: no reserve: a record may be far larger in memory than its bytes here.
    for (size_t i = 0; i < n; ++i) each(*this, v.emplace_back());
  }
  template <class T>
  void records(std::vector<T>& v, size_t min_record_bytes = 1, size_t cap = kUnbounded) {
    seq(
        v, [](Reader& io, T& e) { fields(io, e); }, min_record_bytes, cap);
  }
  bool has(size_t n) const { return left() >= n; }
  template <Plain T>
  void tail(std::vector<T>& v) {
    TANDEM_CODEC_CHECK(left() % sizeof(T) == 0, "the last ", left(),
                       " bytes are not whole values of ", sizeof(T), " bytes");
    v.resize(left() / sizeof(T));
    take(v.data(), v.size() * sizeof(T));
  }
  void tail(std::span<const uint8_t>& bytes) { bytes = rest(); }

  // ---- primitives ----
  template <Plain T>
  T get() {
    T v;
    take(&v, sizeof(T));
    return v;
  }
  /// A length or count of elements of elem_bytes each: at most what remains, and cap.
  size_t get_len(size_t elem_bytes, size_t cap = kUnbounded) {
    const size_t at = pos();
    uint64_t n = 0;
    if (format_.len == LenWidth::kU32) {
      n = get<uint32_t>();
    } else {
      const auto v = get<int64_t>();
      TANDEM_CODEC_CHECK(v >= 0, "a negative length (", v, ") at byte ", at);
      n = static_cast<uint64_t>(v);
    }
    // NOTE: compared by division: a count near 2^62 must not wrap the product.
    TANDEM_CODEC_CHECK(n <= left() / (elem_bytes == 0 ? 1 : elem_bytes), "a length of ", n,
                       " at byte ", at, " is more than the ", left(), " bytes left");
    TANDEM_CODEC_CHECK(n <= cap, "a length of ", n, " at byte ", at, " is over the limit of ", cap);
    return static_cast<size_t>(n);
  }
  template <Plain T>
  std::vector<T> get_vec(size_t cap = kUnbounded) {
    const size_t n = get_len(sizeof(T), cap);
    std::vector<T> v(n);
    take(v.data(), n * sizeof(T));
    return v;
  }
  std::string get_str(size_t cap = kUnbounded) {
    const size_t n = get_len(1, cap);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  /// The bytes that remain (all consumed).
  std::span<const uint8_t> rest() {
    std::span<const uint8_t> r(p_, left());
    p_ = end_;
    return r;
  }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  size_t pos() const { return static_cast<size_t>(p_ - begin_); }
  /// Throws unless every byte was read.
  void expect_end() const { TANDEM_CODEC_CHECK(left() == 0, left(), " trailing bytes"); }
  /// Throws Error(format.error) "malformed <what>: <args>".
  template <class... Args>
  [[noreturn]] void fail(const Args&... args) const {
    throw Error(format_.error, detail::concat("malformed ", format_.what, ": ", args...));
  }

 private:
  void take(void* dst, size_t n) {
    TANDEM_CODEC_CHECK(n <= left(), "truncated at byte ", pos(), " of ", end_ - begin_);
    if (n) std::memcpy(dst, p_, n);
    p_ += n;
  }
  const uint8_t* p_;
  const uint8_t* begin_;
  const uint8_t* end_;
  Format format_;
};

/// A message's bytes from its fields(io, m) (found by argument lookup).
template <class M>
std::vector<uint8_t> encode(const M& m, Format format = {}) {
  Writer w(format);
  fields(w, m);
  return std::move(w.bytes());
}

/// A message from the front of `bytes` by its fields(io, m); with `whole`, every byte must be
/// read.
template <class M>
M decode(std::span<const uint8_t> bytes, Format format = {}, bool whole = false) {
  Reader r(bytes, format);
  M m{};
  fields(r, m);
  if (whole) r.expect_end();
  return m;
}

#undef TANDEM_CODEC_CHECK

}  // namespace tandem::codec
