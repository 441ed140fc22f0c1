// The harness of backend_ops.h: the registry, check_case, time_case.
#include "backend_ops.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <set>
#include <sstream>

#include "backend/cuda/check.h"
#include "core/error.h"

namespace tandem::cuda::backend_ops {

std::vector<float> to_f32(Bits const& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = bf16_to_f32(b[i]);
  return f;
}

Bits to_bf16(std::vector<float> const& f) {
  Bits b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = f32_to_bf16(f[i]);
  return b;
}

namespace {

// splitmix64: the bulk stream of randn / uniform_bf16 (about a nanosecond a value; the large
// weight matrices of the GEMM cases would take seconds from std::mt19937 distributions).
struct SplitMix {
  uint64_t s;
  uint64_t operator()() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

SplitMix bulk_stream(std::mt19937& gen) {
  const uint64_t hi = gen(), lo = gen();
  return SplitMix{(hi << 32) | lo};
}

}  // namespace

std::vector<float> Rng::randn(size_t n, float scale, float mean) {
  // Box-Muller over 24-bit uniforms: u1 in (0, 1], u2 in [0, 1).
  SplitMix sm = bulk_stream(gen_);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i += 2) {
    const uint64_t z = sm();
    const float u1 = static_cast<float>((z >> 40) + 1) * 0x1p-24f;
    const float u2 = static_cast<float>((z >> 16) & 0xffffff) * 0x1p-24f;
    const float r = std::sqrt(-2.0f * std::log(u1));
    const float a = 6.2831853f * u2;
    v[i] = mean + scale * r * std::cos(a);
    if (i + 1 < n) v[i + 1] = mean + scale * r * std::sin(a);
  }
  return v;
}

Bits Rng::uniform_bf16(size_t n, float lo, float hi) {
  SplitMix sm = bulk_stream(gen_);
  Bits b(n);
  for (size_t i = 0; i < n; i += 2) {
    const uint64_t z = sm();
    b[i] = f32_to_bf16(lo + (hi - lo) * static_cast<float>(z >> 40) * 0x1p-24f);
    if (i + 1 < n) {
      b[i + 1] = f32_to_bf16(lo + (hi - lo) * static_cast<float>((z >> 8) & 0xffffff) * 0x1p-24f);
    }
  }
  return b;
}

int64_t Rng::uniform(int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(gen_);
}

float Rng::uniform_real(float lo, float hi) {
  return std::uniform_real_distribution<float>(lo, hi)(gen_);
}

// ------------------------------------------------------------------------------ OpCase

OpCase::~OpCase() {
  for (void* p : allocations_) (void)cudaFree(p);
}

void* OpCase::alloc_bytes(size_t bytes) {
  void* p = nullptr;
  TANDEM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  allocations_.push_back(p);
  return p;
}

void OpCase::copy_to_device(void* dst, void const* src, size_t bytes) {
  if (bytes) TANDEM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

Output& OpCase::output(std::string name, DType dtype, void* ptr, size_t count) {
  TANDEM_CHECK(dtype == DType::kBF16 || dtype == DType::kF32 || dtype == DType::kI32 ||
                   dtype == DType::kF8E4M3,
               "backend_ops output dtype");
  Output o;
  o.name = std::move(name);
  o.dtype = dtype;
  o.ptr = ptr;
  o.count = count;
  outputs_.push_back(std::move(o));
  return outputs_.back();
}

size_t OpCase::output_bytes() const {
  size_t b = 0;
  for (Output const& o : outputs_) {
    if (o.compare != Compare::kScratch) b += o.count * dtype_size(o.dtype);
  }
  return b;
}

// ------------------------------------------------------------------------------ registry

std::vector<CaseInfo> const& registry() {
  static const std::vector<CaseInfo> cases = [] {
    std::vector<CaseInfo> r;
    register_op_cases(r);
    register_gemv_cases(r);
    register_fp8_cases(r);
    register_moe_gemm_cases(r);
    std::set<std::string> names;
    for (CaseInfo const& c : r) {
      TANDEM_CHECK(names.insert(c.name()).second, "backend_ops: duplicate case ", c.name());
    }
    return r;
  }();
  return cases;
}

// ------------------------------------------------------------------------------ check

namespace {

uint8_t poison_byte(DType dt) { return dt == DType::kI32 ? 0x7f : 0xff; }

// Poisons every output (count + guard elements) or uploads its initial contents.
void prepare(std::vector<Output>& outs) {
  for (Output& o : outs) {
    const size_t es = dtype_size(o.dtype), total = (o.count + o.guard) * es;
    if (!o.initial.empty()) {
      TANDEM_CHECK(o.initial.size() == o.count * es, "backend_ops: ", o.name, " initial size");
      TANDEM_CUDA_CHECK(cudaMemset(o.ptr, poison_byte(o.dtype), total));
      TANDEM_CUDA_CHECK(
          cudaMemcpy(o.ptr, o.initial.data(), o.initial.size(), cudaMemcpyHostToDevice));
    } else if (total) {
      TANDEM_CUDA_CHECK(cudaMemset(o.ptr, poison_byte(o.dtype), total));
    }
  }
  TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
}

std::vector<uint8_t> download(Output const& o) {
  std::vector<uint8_t> h((o.count + o.guard) * dtype_size(o.dtype));
  if (!h.empty()) TANDEM_CUDA_CHECK(cudaMemcpy(h.data(), o.ptr, h.size(), cudaMemcpyDeviceToHost));
  return h;
}

bool is_poison(uint8_t const* p, size_t es, uint8_t byte) {
  for (size_t b = 0; b < es; ++b) {
    if (p[b] != byte) return false;
  }
  return true;
}

float value(uint8_t const* p, DType dt) {
  if (dt == DType::kBF16) {
    uint16_t u;
    std::memcpy(&u, p, 2);
    return bf16_to_f32(u);
  }
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// Compares one downloaded output; appends failures.
void compare(Output const& o, std::vector<uint8_t> const& h, std::vector<std::string>& fails) {
  const size_t es = dtype_size(o.dtype);
  const uint8_t pb = poison_byte(o.dtype);
  auto fail = [&](std::string const& what) { fails.push_back(o.name + ": " + what); };
  if (!o.mask.empty() && o.mask.size() != o.count) {
    fail("mask of " + std::to_string(o.mask.size()) + " elements");
    return;
  }
  // Written past the end.
  size_t past = 0, first_past = 0;
  for (size_t i = o.count; i < o.count + o.guard; ++i) {
    if (!is_poison(h.data() + i * es, es, pb) && past++ == 0) first_past = i;
  }
  if (past) {
    fail(std::to_string(past) + " of the " + std::to_string(o.guard) +
         " guard elements after the output written, first at " + std::to_string(first_past));
  }
  if (o.compare == Compare::kScratch) return;
  auto masked = [&](size_t i) { return o.mask.empty() ? Elem::kCompare : o.mask[i]; };
  // Untouched elements.
  size_t leaked = 0, first_leak = 0;
  for (size_t i = 0; i < o.count; ++i) {
    if (masked(i) == Elem::kUntouched && !is_poison(h.data() + i * es, es, pb) && leaked++ == 0) {
      first_leak = i;
    }
  }
  if (leaked) {
    fail(std::to_string(leaked) + " elements written that must stay untouched, first at " +
         std::to_string(first_leak));
  }
  // Compared elements still holding the poison (a hint when the comparison fails).
  size_t unwritten = 0;
  for (size_t i = 0; i < o.count; ++i) {
    if (masked(i) == Elem::kCompare && is_poison(h.data() + i * es, es, pb)) ++unwritten;
  }
  const std::string hint =
      unwritten ? " (" + std::to_string(unwritten) + " elements still poison: not written)" : "";

  const bool f64 = !o.ref_f64.empty();
  const size_t ref_size = o.dtype == DType::kI32      ? o.ref_i32.size()
                          : o.dtype == DType::kF8E4M3 ? o.ref_u8.size()
                          : f64                       ? o.ref_f64.size()
                                                      : o.ref.size();
  if (ref_size != o.count) {
    fail("reference of " + std::to_string(ref_size) + " elements");
    return;
  }
  if (f64 && o.compare == Compare::kExact) {
    fail("an exact comparison takes ref, not ref_f64");
    return;
  }

  if (o.dtype == DType::kF8E4M3) {  // codes: exact
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < o.count; ++i) {
      if (masked(i) == Elem::kCompare && h[i] != o.ref_u8[i] && bad++ == 0) first = i;
    }
    if (bad) {
      fail(std::to_string(bad) + " of " + std::to_string(o.count) + " codes differ; first [" +
           std::to_string(first) + "]: " + std::to_string(h[first]) + " vs " +
           std::to_string(o.ref_u8[first]) + hint);
    }
    return;
  }
  if (o.compare == Compare::kExact || o.dtype == DType::kI32) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < o.count; ++i) {
      if (masked(i) != Elem::kCompare) continue;
      uint8_t const* p = h.data() + i * es;
      bool eq;
      if (o.dtype == DType::kI32) {
        int32_t v;
        std::memcpy(&v, p, 4);
        eq = v == o.ref_i32[i];
      } else if (o.dtype == DType::kBF16) {
        uint16_t u;
        std::memcpy(&u, p, 2);
        eq = u == f32_to_bf16(o.ref[i]) && !std::isnan(o.ref[i]);
      } else {
        eq = value(p, o.dtype) == o.ref[i];  // NaN never equals
      }
      if (!eq && bad++ == 0) first = i;
    }
    if (bad) {
      std::ostringstream s;
      s << bad << " of " << o.count << " elements differ; first [" << first << "]: ";
      if (o.dtype == DType::kI32) {
        int32_t v;
        std::memcpy(&v, h.data() + first * es, 4);
        s << v << " vs " << o.ref_i32[first];
      } else {
        s << value(h.data() + first * es, o.dtype) << " vs " << o.ref[first];
      }
      fail(s.str() + hint);
    }
    return;
  }
  // ||out - ref|| / ||ref||, infinite when an output is not finite.
  const double tol = o.tol >= 0 ? o.tol : o.dtype == DType::kBF16 ? 1e-2 : 1e-5;
  double num = 0, den = 0, err = 0;
  bool finite = true;
  for (size_t i = 0; i < o.count && finite; ++i) {
    if (masked(i) != Elem::kCompare) continue;
    const float v = value(h.data() + i * es, o.dtype);
    if (!std::isfinite(v)) {
      finite = false;
      break;
    }
    const double r = f64 ? o.ref_f64[i] : double(o.ref[i]);
    const double d = double(v) - r;
    num += d * d;
    den += r * r;
  }
  err = finite ? std::sqrt(num / std::max(den, 1e-30)) : INFINITY;
  if (!(err < tol)) {
    std::ostringstream s;
    s << "relative error " << err << " not below " << tol << hint;
    fail(s.str());
  }
  if (o.elementwise) {  // no element off by more than 3 tol (|ref| + rms(ref))
    double sq = 0;
    size_t n = 0;
    for (size_t i = 0; i < o.count; ++i) {
      if (masked(i) != Elem::kCompare) continue;
      const double r = f64 ? o.ref_f64[i] : double(o.ref[i]);
      sq += r * r;
      ++n;
    }
    const double rms = std::sqrt(sq / double(std::max<size_t>(n, 1)));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < o.count; ++i) {
      if (masked(i) != Elem::kCompare) continue;
      const double r = f64 ? o.ref_f64[i] : double(o.ref[i]);
      const double v = value(h.data() + i * es, o.dtype);
      if ((!std::isfinite(v) || std::fabs(v - r) > 3 * tol * (std::fabs(r) + rms)) && bad++ == 0) {
        first = i;
      }
    }
    if (bad) {
      std::ostringstream s;
      s << bad << " of " << n << " elements off by more than 3 tol (|ref| + rms(ref)); first ["
        << first << "]: " << value(h.data() + first * es, o.dtype) << " vs "
        << (f64 ? o.ref_f64[first] : double(o.ref[first]));
      fail(s.str());
    }
  }
}

}  // namespace

CheckResult check_case(OpCase& c, uint32_t seed, cudaStream_t stream) {
  CheckResult r;
  try {
    Rng rng(seed);
    c.setup(rng);
    c.reference();
    prepare(c.outputs());
    c.launch(stream);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
    TANDEM_CUDA_CHECK(cudaGetLastError());
    std::vector<std::vector<uint8_t>> first;
    for (Output const& o : c.outputs()) {
      first.push_back(download(o));
      compare(o, first.back(), r.failures);
    }
    for (int rep = 0; rep < c.deterministic_repeats(); ++rep) {
      prepare(c.outputs());
      c.launch(stream);
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
      for (size_t i = 0; i < c.outputs().size(); ++i) {
        Output const& o = c.outputs()[i];
        if (o.compare == Compare::kScratch) continue;
        std::vector<uint8_t> again = download(o);
        std::vector<std::string> fails;  // the relaunch against the reference and guards too
        compare(o, again, fails);
        for (auto& f : fails)
          r.failures.push_back("relaunch " + std::to_string(rep + 1) + ": " + f);
        again.resize(o.count * dtype_size(o.dtype));
        if (!std::equal(again.begin(), again.end(), first[i].begin())) {
          r.failures.push_back(o.name + ": relaunch " + std::to_string(rep + 1) +
                               " differs bitwise from the first launch");
        }
      }
    }
  } catch (std::exception const& e) {
    r.failures.push_back(std::string("exception: ") + e.what());
  }
  return r;
}

// ------------------------------------------------------------------------------ perf

PerfResult time_case(OpCase& c, uint32_t seed, cudaStream_t stream, double target_ms) {
  Rng rng(seed);
  c.setup(rng);
  prepare(c.outputs());
  for (int i = 0; i < 3; ++i) c.launch(stream);  // warm-up (and tuning, for GemmLt)
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t start, stop;
  TANDEM_CUDA_CHECK(cudaEventCreate(&start));
  TANDEM_CUDA_CHECK(cudaEventCreate(&stop));
  auto timed = [&](int n) {
    TANDEM_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int i = 0; i < n; ++i) c.launch(stream);
    TANDEM_CUDA_CHECK(cudaEventRecord(stop, stream));
    TANDEM_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return static_cast<double>(ms);
  };
  const double one = std::max(timed(1), 1e-3);
  const int n = static_cast<int>(std::clamp(target_ms / one, 5.0, 10000.0));
  const double ms = timed(n);
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  PerfResult p;
  p.launches = n;
  p.us = ms * 1e3 / n;
  p.gbps = c.bytes() / (p.us * 1e3);
  p.tflops = c.flops() / (p.us * 1e6);
  return p;
}

}  // namespace tandem::cuda::backend_ops
