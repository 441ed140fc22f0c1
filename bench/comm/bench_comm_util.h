// Shared by the communication benchmarks (bench_allreduce, bench_moe): options, median, the
// slowest rank's value, and main (fork the ranks locally unless RANK is set).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/cuda/cuda_comm.h"
#include "comm/local_launcher.h"

namespace tandem::bench {

struct Options {
  int world = 2;
  int trials = 0;  // set by each benchmark's main (its default)
  bool quick = false;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The slowest rank's value, on every rank (all-gather of `v` under `key`).
inline double max_over_ranks(comm::CudaComm& comm, const std::string& key, double v) {
  auto all = comm.store().all_gather(key, std::span(reinterpret_cast<const uint8_t*>(&v), 8));
  double m = 0;
  for (auto& b : all) {
    double x;
    std::memcpy(&x, b.data(), 8);
    m = std::max(m, x);
  }
  return m;
}

/// main of a communication benchmark: parses [--world N] [--trials T] [--quick] (--quick caps
/// the trials at `quick_trials`); without RANK in the environment forks `world` ranks (each
/// runs bench_rank, `timeout` for all), else runs bench_rank as one rank of a group.
inline int comm_bench_main(int argc, char** argv, const char* name, int default_trials,
                           int quick_trials, std::chrono::seconds timeout,
                           const std::function<int(const Options&)>& bench_rank) {
  Options opt;
  opt.trials = default_trials;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--world" && i + 1 < argc)
      opt.world = std::atoi(argv[++i]);
    else if (a == "--trials" && i + 1 < argc)
      opt.trials = std::atoi(argv[++i]);
    else if (a == "--quick")
      opt.quick = true;
    else {
      std::fprintf(stderr, "usage: %s [--world N] [--trials T] [--quick]\n", argv[0]);
      return 2;
    }
  }
  if (opt.quick) opt.trials = std::min(opt.trials, quick_trials);
  comm::disable_nvlink_multicast_env();
  if (std::getenv("RANK") == nullptr) {
    // Launcher: one child per rank; this process never touches CUDA.
    auto results = comm::run_local_ranks(
        opt.world,
        [&](int) {
          if (bench_rank(opt) != 0) throw std::runtime_error("bench failed");
        },
        timeout);
    std::string failures = comm::describe_failures(results);
    if (!failures.empty()) {
      std::fprintf(stderr, "%s failed:\n%s", name, failures.c_str());
      return 1;
    }
    return 0;
  }
  try {
    return bench_rank(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s rank %s: %s\n", name, std::getenv("RANK"), e.what());
    return 1;
  }
}

}  // namespace tandem::bench
