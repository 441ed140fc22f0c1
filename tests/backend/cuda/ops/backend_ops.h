// One kernel-test harness for the CUDA backend (issue 31 item 5), in the manner of llama.cpp's
// test-backend-ops: every op lists its cases once (registry(): shapes, dtypes, edge cases), and
// each case runs against its CPU reference (src/backend/cpu/ops.h or a host reference of its
// own) and can be timed.
//
//   check_case: fresh random inputs from a seed, the CPU reference, every output poisoned
//     (NaN bytes 0xff for bf16 / fp32, 0x7f7f7f7f for int32) or set to its initial contents
//     (in-place outputs), one launch, then each output compared: exact or ||out - ref|| / ||ref||
//     under a tolerance by dtype (bf16 1e-2, fp32 1e-5; a case may set its own), a non-finite
//     output failing; elements masked "untouched" and the guard elements after an output must
//     still hold the poison. A deterministic case is relaunched and must give the same bytes.
//   time_case: the same inputs, warm-up launches, then CUDA-event timing of back-to-back
//     launches; GB/s from the case's bytes(), TFLOP/s from its flops().
//
// No gtest here: tests/backend/cuda/test_backend_ops_cuda.cpp makes every registered case a
// parameterised test (Cuda/BackendOps.Check/<Op>_<shape>), bench/cuda/bench_backend_ops.cpp
// times them (--perf) or checks them without gtest (--check).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace tandem::cuda::backend_ops {

using Bits = std::vector<uint16_t>;  // bf16 bit patterns on the host

std::vector<float> to_f32(Bits const& b);
Bits to_bf16(std::vector<float> const& f);

/// The random source of one case run (every draw of a case comes from it, so the seed
/// reproduces the inputs). randn and uniform_bf16 draw one seed from the generator and fill
/// from a fast splitmix64 stream (large weight matrices in milliseconds).
class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  /// Normal values (mean, standard deviation scale).
  std::vector<float> randn(size_t n, float scale = 1.0f, float mean = 0.0f);
  /// Random bf16 values (their exact fp32 values via to_f32).
  Bits randn_bf16(size_t n, float scale = 1.0f, float mean = 0.0f) {
    return to_bf16(randn(n, scale, mean));
  }
  /// Uniform bf16 values in [lo, hi] (bf16 rounding may reach hi).
  Bits uniform_bf16(size_t n, float lo, float hi);
  int64_t uniform(int64_t lo, int64_t hi);  // [lo, hi]
  float uniform_real(float lo, float hi);   // [lo, hi)
  std::mt19937& gen() { return gen_; }

 private:
  std::mt19937 gen_;
};

/// How an output is compared with its reference.
enum class Compare {
  kRelErr,   // ||out - ref|| / ||ref|| < tol over the compared elements; non-finite fails
  kExact,    // bf16: the bits of bf16(ref); fp32: out == ref; int32, E4M3: out == ref
  kScratch,  // poisoned before the launch, never compared (workspaces)
};

/// Per element of an output with a mask.
enum class Elem : uint8_t {
  kCompare,    // compared with the reference
  kUntouched,  // must still hold the poison
  kIgnore,     // not checked
};

/// One device output of a case. dtype: kBF16, kF32, kI32 or kF8E4M3 (codes, always exact).
struct Output {
  std::string name;
  DType dtype = DType::kBF16;
  void* ptr = nullptr;  // device, count + guard elements
  size_t count = 0;
  size_t guard = 0;  // elements after `count` that must stay poison (written past the end)
  Compare compare = Compare::kRelErr;
  double tol = -1;               // kRelErr; < 0: by dtype (bf16 1e-2, fp32 1e-5)
  bool elementwise = false;      // kRelErr: also |out - ref| <= 3 tol (|ref| + rms(ref)) each
  std::vector<float> ref;        // bf16 / fp32 reference, count elements
  std::vector<double> ref_f64;   // non-empty: the kRelErr reference instead of ref
  std::vector<int32_t> ref_i32;  // int32 reference, count elements
  std::vector<uint8_t> ref_u8;   // E4M3 codes reference, count elements
  std::vector<Elem> mask;        // empty: every element compared
  std::vector<uint8_t> initial;  // non-empty: uploaded instead of the poison (in-place)
  Output& exact() {
    compare = Compare::kExact;
    return *this;
  }
  Output& tolerance(double t) {
    tol = t;
    return *this;
  }
  Output& per_element() {
    elementwise = true;
    return *this;
  }
  Output& guarded(size_t g) {
    guard = g;
    return *this;
  }
  template <typename T>
  Output& initially(std::vector<T> const& host);
};

/// One case of one op: set up inputs and outputs from a seed, the CPU reference, the launch.
class OpCase {
 public:
  virtual ~OpCase();
  /// Draws the inputs from rng, uploads them (upload / alloc), declares the outputs (output).
  /// Called once per object (check_case or time_case, on a fresh case from CaseInfo::make).
  virtual void setup(Rng& rng) = 0;
  /// Fills the outputs' ref / ref_i32 (and may adjust masks); not called by time_case.
  virtual void reference() = 0;
  /// The op on `stream` (may launch several kernels; time_case times it as one).
  virtual void launch(cudaStream_t stream) = 0;
  /// Bytes moved per launch for GB/s; default: every uploaded input plus every output.
  virtual double bytes() const { return static_cast<double>(input_bytes_ + output_bytes()); }
  /// Floating-point operations per launch for TFLOP/s (0: not reported).
  virtual double flops() const { return 0; }
  /// Relaunches (outputs re-poisoned each time) that must reproduce the first launch's bytes.
  virtual int deterministic_repeats() const { return 0; }

  std::vector<Output>& outputs() { return outputs_; }

 protected:
  /// Device copy of `host`, owned by the case, counted in bytes().
  template <typename T>
  T* upload(std::vector<T> const& host);
  __nv_bfloat16* upload_bf16(Bits const& host) {
    return reinterpret_cast<__nv_bfloat16*>(upload(host));
  }
  /// Uninitialised device memory of `count` elements, owned by the case, not counted.
  template <typename T>
  T* alloc(size_t count);
  /// A new output of `count` elements (+ guard) at `ptr` (from alloc).
  Output& output(std::string name, DType dtype, void* ptr, size_t count);
  size_t output_bytes() const;

 private:
  void* alloc_bytes(size_t bytes);
  void copy_to_device(void* dst, void const* src, size_t bytes);
  std::vector<void*> allocations_;
  std::vector<Output> outputs_;
  size_t input_bytes_ = 0;
};

template <typename T>
T* OpCase::upload(std::vector<T> const& host) {
  T* p = alloc<T>(host.size());
  copy_to_device(p, host.data(), host.size() * sizeof(T));
  input_bytes_ += host.size() * sizeof(T);
  return p;
}

template <typename T>
T* OpCase::alloc(size_t count) {
  return static_cast<T*>(alloc_bytes(count * sizeof(T)));
}

template <typename T>
Output& Output::initially(std::vector<T> const& host) {
  initial.resize(host.size() * sizeof(T));
  if (!host.empty()) std::memcpy(initial.data(), host.data(), initial.size());
  return *this;
}

/// One registered case: the op, its shape / dtype / variant string (letters, digits and '_'
/// only: it is the gtest parameter name), and a factory (nothing touches the GPU before make()).
struct CaseInfo {
  std::string op;
  std::string shape;
  std::function<std::unique_ptr<OpCase>()> make;
  std::string name() const { return op + "_" + shape; }
};

/// Every case of every op, in registration order (built on first use, host only).
std::vector<CaseInfo> const& registry();

/// What check_case found: one line per failed check (empty: passed).
struct CheckResult {
  std::vector<std::string> failures;
  bool ok() const { return failures.empty(); }
};

/// Runs one case against its reference on `stream` (see the top of this file).
CheckResult check_case(OpCase& c, uint32_t seed, cudaStream_t stream);

struct PerfResult {
  double us = 0;      // per launch
  double gbps = 0;    // bytes() / time
  double tflops = 0;  // flops() / time
  int launches = 0;
};

/// Times one case: warm-up, then about `target_ms` of back-to-back launches between two CUDA
/// events (at least 5 launches).
PerfResult time_case(OpCase& c, uint32_t seed, cudaStream_t stream, double target_ms = 20);

// Registration of each op's cases (ops_cases.cpp, gemv_cases.cpp, fp8_cases.cpp,
// moe_gemm_cases.cpp).
void register_op_cases(std::vector<CaseInfo>& r);
void register_gemv_cases(std::vector<CaseInfo>& r);
void register_fp8_cases(std::vector<CaseInfo>& r);
void register_moe_gemm_cases(std::vector<CaseInfo>& r);

/// Registers `make` as op/shape (shape: non [A-Za-z0-9_] characters become '_').
template <typename F>
void add_case(std::vector<CaseInfo>& r, std::string op, std::string shape, F make) {
  for (auto& ch : shape) {
    const bool ok =
        (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
    if (!ok) ch = '_';
  }
  r.push_back({std::move(op), std::move(shape), std::function<std::unique_ptr<OpCase>()>(make)});
}

}  // namespace tandem::cuda::backend_ops
