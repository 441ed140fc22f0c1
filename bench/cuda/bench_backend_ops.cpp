// Every case of the kernel-test harness (tests/backend/cuda/ops/backend_ops.h), timed or checked
// without gtest, as llama.cpp's test-backend-ops modes:
//
//   bench_backend_ops [--perf] [--op OP] [--filter TEXT] [--seed N] [--ms T]
//       time each case: warm-up launches, then about T ms (default 20) of back-to-back launches
//       between two CUDA events; per launch: us, GB/s from the case's bytes (inputs + outputs,
//       or the case's own count), TFLOP/s where the case counts flops (GEMMs). The inputs stay
//       in L2 where they fit: an upper bound for small cases (bench_ops_cuda is the careful
//       bound-relative benchmark).
//   bench_backend_ops --check [--op OP] [--filter TEXT] [--seed N]
//       each case against its CPU reference; exit status 1 when one fails.
//   bench_backend_ops --list [--op OP] [--filter TEXT]
//
// --op: cases of that op only (exact name, e.g. RmsNorm); --filter: cases whose <Op>_<shape>
// contains TEXT; --seed: the input seed (default 1 for --perf, a fresh one per case for --check).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "backend_ops.h"

using namespace tandem::cuda::backend_ops;

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: bench_backend_ops [--perf | --check | --list] [--op OP] [--filter TEXT] "
               "[--seed N] [--ms T]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  enum class Mode { kPerf, kCheck, kList } mode = Mode::kPerf;
  std::string op, filter;
  long long seed = -1;
  double ms = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> char const* { return i + 1 < argc ? argv[++i] : nullptr; };
    if (a == "--perf") {
      mode = Mode::kPerf;
    } else if (a == "--check") {
      mode = Mode::kCheck;
    } else if (a == "--list") {
      mode = Mode::kList;
    } else if (a == "--op" || a == "--filter" || a == "--seed" || a == "--ms") {
      char const* v = value();
      if (!v) return usage();
      if (a == "--op") op = v;
      if (a == "--filter") filter = v;
      if (a == "--seed") seed = std::atoll(v);
      if (a == "--ms") ms = std::atof(v);
    } else {
      return usage();
    }
  }
  std::vector<CaseInfo const*> cases;
  for (CaseInfo const& c : registry()) {
    if (!op.empty() && c.op != op) continue;
    if (!filter.empty() && c.name().find(filter) == std::string::npos) continue;
    cases.push_back(&c);
  }
  if (mode == Mode::kList) {
    for (CaseInfo const* c : cases) std::printf("%s\n", c->name().c_str());
    return 0;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_backend_ops: no CUDA device\n");
    return 1;
  }
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) return 1;
  int failed = 0;
  if (mode == Mode::kPerf) {
    std::printf("%-16s %-44s %10s %9s %9s\n", "op", "shape", "us", "GB/s", "TFLOP/s");
  }
  for (CaseInfo const* info : cases) {
    const uint32_t s = seed >= 0             ? static_cast<uint32_t>(seed)
                       : mode == Mode::kPerf ? 1u
                                             : (std::random_device{}() & 0x7fffffffu) | 1u;
    try {
      auto c = info->make();
      if (mode == Mode::kPerf) {
        const PerfResult p = time_case(*c, s, stream, ms);
        std::printf("%-16s %-44s %10.2f %9.1f ", info->op.c_str(), info->shape.c_str(), p.us,
                    p.gbps);
        if (c->flops() > 0) {
          std::printf("%9.2f\n", p.tflops);
        } else {
          std::printf("%9s\n", "-");
        }
      } else {
        const CheckResult r = check_case(*c, s, stream);
        std::printf("%-4s %s (seed %u)\n", r.ok() ? "OK" : "FAIL", info->name().c_str(), s);
        for (std::string const& f : r.failures) std::printf("       %s\n", f.c_str());
        failed += !r.ok();
      }
    } catch (std::exception const& e) {
      std::printf("FAIL %s: %s\n", info->name().c_str(), e.what());
      ++failed;
    }
    std::fflush(stdout);
  }
  (void)cudaStreamDestroy(stream);
  if (mode == Mode::kCheck) {
    std::printf("%zu cases, %d failed\n", cases.size(), failed);
  }
  return failed ? 1 : 0;
}
