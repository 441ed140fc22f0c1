// Helpers of the fuzz harnesses (tests/fuzz/fuzz_*.cpp): the libFuzzer entry point every
// harness defines, and a reader that takes choices and pieces from the input's bytes.
//
// A harness runs under libFuzzer in the clang build (-DTANDEM_FUZZ=ON: coverage-guided, with
// ASan + UBSan), and in the normal build as `fuzz_replay_<name>` over its committed corpus
// (tests/fuzz/corpus/<name>/, ctest Fuzz.<name>). A harness returns normally for every input:
// the errors the code under test throws for bad input (tandem::Error, ApiError) are its
// expected answers; anything else (a crash, another exception, a sanitizer report, a hang)
// is a finding.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace tandem::fuzz {

/// Consumes the input front to back; past its end every read returns zeros / empty.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  uint8_t byte() { return p_ < end_ ? *p_++ : 0; }
  template <typename T>
  T take() {
    T v{};
    const size_t n = std::min(sizeof(T), left());
    std::memcpy(&v, p_, n);
    p_ += n;
    return v;
  }
  /// Up to n bytes.
  std::string_view bytes(size_t n) {
    n = std::min(n, left());
    std::string_view s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  /// The rest of the input.
  std::string_view rest() { return bytes(left()); }
  std::span<const uint8_t> rest_span() {
    std::span<const uint8_t> s(p_, left());
    p_ = end_;
    return s;
  }
  size_t left() const { return static_cast<size_t>(end_ - p_); }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

}  // namespace tandem::fuzz
