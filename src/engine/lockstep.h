// The parts every multi-rank role loop is built from (STYLE.md point 2): agreeing on whether a
// step runs, broadcasting rank 0's decisions, and a small byte codec for those messages.
//   decode DP:   work = agree_any(comm, engine.has_work()); if (work) step with forward().
//   prefill TP:  rank 0 schedules, broadcast_bytes(encoded batch), every rank forwards.
// NOTE: every call here is collective: every rank of the group makes it, in the same order.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "engine/request.h"
#include "transfer/transfer.h"

namespace tandem {

/// True on every rank when `mine` is true on any rank (an all-reduce of one flag).
bool agree_any(comm::Communicator& comm, bool mine);

/// Sums one counter over the ranks (every rank gets the total).
int64_t sum_over_ranks(comm::Communicator& comm, int64_t mine);

/// root's bytes become every rank's bytes (the size first, then the payload).
void broadcast_bytes(comm::Communicator& comm, std::vector<uint8_t>& bytes, int root);

/// Appends plain values, vectors and strings to a byte buffer (host byte order: the ranks of
/// one instance share a machine type).
class ByteWriter {
 public:
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vec(const T* data, int64_t n) {
    put<int64_t>(n);
    const auto* p = reinterpret_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + n * static_cast<int64_t>(sizeof(T)));
  }
  template <typename T>
  void put_vec(const std::vector<T>& v) {
    put_vec(v.data(), static_cast<int64_t>(v.size()));
  }
  void put_str(const std::string& s) { put_vec(s.data(), static_cast<int64_t>(s.size())); }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

/// Reads what ByteWriter wrote; throws Error(kIo) on a short buffer.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  explicit ByteReader(const std::vector<uint8_t>& b) : ByteReader(b.data(), b.size()) {}

  template <typename T>
  T get() {
    T v;
    take(&v, sizeof(T));
    return v;
  }
  template <typename T>
  std::vector<T> get_vec() {
    const int64_t n = get<int64_t>();
    TANDEM_CHECK_KIND(kIo, n >= 0 && static_cast<size_t>(n) * sizeof(T) <= left(),
                      "truncated message");
    std::vector<T> v(static_cast<size_t>(n));
    take(v.data(), v.size() * sizeof(T));
    return v;
  }
  std::string get_str() {
    std::vector<char> v = get_vec<char>();
    return std::string(v.begin(), v.end());
  }
  size_t left() const { return static_cast<size_t>(end_ - p_); }

 private:
  void take(void* dst, size_t n) {
    TANDEM_CHECK_KIND(kIo, n <= left(), "truncated message");
    if (n) std::memcpy(dst, p_, n);
    p_ += n;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

// The messages the roles exchange (between ranks, and with the router: server/instance_api).
void put_step_output(ByteWriter& w, const StepOutput& out);
StepOutput get_step_output(ByteReader& r);
std::vector<uint8_t> encode_step_output(const StepOutput& out);
StepOutput decode_step_output(const uint8_t* data, size_t size);
void put_request(ByteWriter& w, const GenRequest& r);
GenRequest get_request(ByteReader& r);
void put_descriptor(ByteWriter& w, const transfer::TransferDescriptor& d);
transfer::TransferDescriptor get_descriptor(ByteReader& r);

}  // namespace tandem
