// The all-reduce kernels' device code (src/comm/cuda/all_reduce_kernels.cuh) run on the CPU:
// every CUDA thread is a std::thread, __syncthreads a std::barrier, the cross-GPU flags C++
// release/acquire atomics, and peer memory plain host memory shared by the rank threads. It
// checks, without a GPU and in CI, the index arithmetic (tails, segments, grid strides), the
// per-block epochs, the staging parity across back-to-back calls with changing grids, the
// registered mode, in place, and that every rank's result is bit-identical to an fp32 sum in
// rank order. Built with -fsanitize=thread it also checks the protocol for data races (the
// no-end-barrier argument of the copy mode in particular). Not covered: the GPU's own memory
// model, timing, IPC, NCCL.
#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "core/dtype.h"
// The CUDA built-ins the device code uses (shared with test_moe_emulated.cpp).
// NOTE: the emulated built-ins must precede the device code.
// clang-format off
#include "cuda_emulation.h"
#include "comm/cuda/all_reduce_kernels.cuh"
// clang-format on

namespace tandem::comm::cuda {
namespace {

using KernelFn = void (*)(AllReduceParams);

template <typename T, int N>
KernelFn pick(AllReduceKernel kind, bool registered) {
  if (kind == AllReduceKernel::kOneShot)
    return registered ? detail::one_shot_kernel<T, N, true> : detail::one_shot_kernel<T, N, false>;
  return registered ? detail::two_shot_kernel<T, N, true> : detail::two_shot_kernel<T, N, false>;
}

template <int N>
KernelFn pick_kernel(DType dtype, AllReduceKernel kind, bool registered) {
  return dtype == DType::kBF16 ? pick<__nv_bfloat16, N>(kind, registered)
                               : pick<float, N>(kind, registered);
}

// Runs one kernel launch: every thread of every block at once, then joins them.
void launch(KernelFn fn, AllReduceShape shape, const AllReduceParams& p) {
  std::vector<std::unique_ptr<std::barrier<>>> bars;
  for (int b = 0; b < shape.blocks; ++b)
    bars.push_back(std::make_unique<std::barrier<>>(shape.threads));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(shape.blocks * shape.threads));
  for (int b = 0; b < shape.blocks; ++b) {
    for (int t = 0; t < shape.threads; ++t) {
      threads.emplace_back([&, b, t] {
        emu::thread_idx = {static_cast<unsigned>(t), 0, 0};
        emu::block_idx = {static_cast<unsigned>(b), 0, 0};
        emu::block_dim = {static_cast<unsigned>(shape.threads), 1, 1};
        emu::grid_dim = {static_cast<unsigned>(shape.blocks), 1, 1};
        emu::block_sync = bars[static_cast<size_t>(b)].get();
        fn(p);
      });
    }
  }
  for (auto& th : threads) th.join();
}

// One rank's "peer-mapped allocation", laid out as CudaComm lays it out.
struct RankMemory {
  size_t max_bytes;
  std::vector<uint8_t> raw;
  uint8_t* base;
  explicit RankMemory(size_t max) : max_bytes(max), raw(kSignalBytes + 3 * max + 256, 0) {
    base = raw.data() + (256 - reinterpret_cast<uintptr_t>(raw.data()) % 256) % 256;
  }
  Signal* signal() { return reinterpret_cast<Signal*>(base); }
  uint8_t* staging() { return base + kSignalBytes; }
  uint8_t* registered() { return base + kSignalBytes + 2 * max_bytes; }
};

enum class Mode { kOutOfPlace, kInPlace, kRegistered };

struct Call {
  AllReduceKernel kind;
  Mode mode;
  DType dtype;
  size_t count;
};

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::vector<uint8_t> make_input(DType dtype, size_t count, uint64_t seed) {
  std::vector<uint8_t> out(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    const float x =
        static_cast<float>(static_cast<double>(splitmix(seed) >> 11) * 0x1.0p-53 * 2 - 1);
    if (dtype == DType::kBF16) {
      const uint16_t h = f32_to_bf16(x);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &x, 4);
    }
  }
  return out;
}

float load(DType dtype, const uint8_t* p, size_t i) {
  if (dtype == DType::kBF16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return bf16_to_f32(h);
  }
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

// What every rank must produce bit for bit: fp32 sum in rank order, rounded once.
std::vector<uint8_t> expected(DType dtype, const std::vector<std::vector<uint8_t>>& inputs,
                              size_t count) {
  std::vector<uint8_t> out(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    float acc = load(dtype, inputs[0].data(), i);
    for (size_t q = 1; q < inputs.size(); ++q) acc += load(dtype, inputs[q].data(), i);
    if (dtype == DType::kBF16) {
      const uint16_t h = f32_to_bf16(acc);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &acc, 4);
    }
  }
  return out;
}

// Every rank runs `calls` back to back on its own thread (no synchronisation between calls but
// the kernels' own flags); results are checked at the end.
template <int N>
void run_sequence(const std::vector<Call>& calls, int max_blocks, int max_threads,
                  size_t max_bytes) {
  std::vector<std::unique_ptr<RankMemory>> mem;
  for (int r = 0; r < N; ++r) mem.push_back(std::make_unique<RankMemory>(max_bytes));
  // inputs[call][rank], outputs[call][rank]
  std::vector<std::vector<std::vector<uint8_t>>> inputs(calls.size()), outputs(calls.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    for (int r = 0; r < N; ++r) {
      inputs[c].push_back(make_input(calls[c].dtype, calls[c].count, c * 131 + r * 7 + 1));
      outputs[c].emplace_back(calls[c].count * dtype_size(calls[c].dtype) + 16, 0xff);  // NaN
    }
  }
  std::vector<std::thread> ranks;
  for (int r = 0; r < N; ++r) {
    ranks.emplace_back([&, r] {
      for (size_t c = 0; c < calls.size(); ++c) {
        const Call& call = calls[c];
        const size_t bytes = call.count * dtype_size(call.dtype);
        AllReduceParams p{};
        p.count = call.count;
        p.rank = r;
        p.world_size = N;
        p.parity_stride = max_bytes;
        p.timeout_ns = 120ull * 1000 * 1000 * 1000;
        uint8_t* out = outputs[c][static_cast<size_t>(r)].data();
        p.output = out;
        p.input = inputs[c][static_cast<size_t>(r)].data();
        const bool registered = call.mode == Mode::kRegistered;
        if (call.mode == Mode::kInPlace) {
          std::memcpy(out, p.input, bytes);
          p.input = out;
        } else if (registered) {
          std::memcpy(mem[static_cast<size_t>(r)]->registered(), p.input, bytes);  // producer
          p.input = nullptr;
        }
        for (int q = 0; q < N; ++q) {
          p.signals[q] = mem[static_cast<size_t>(q)]->signal();
          p.data[q] = registered ? mem[static_cast<size_t>(q)]->registered()
                                 : mem[static_cast<size_t>(q)]->staging();
        }
        const auto shape =
            all_reduce_shape(call.kind, call.count, call.dtype, N, max_blocks, max_threads);
        launch(pick_kernel<N>(call.dtype, call.kind, registered), shape, p);
      }
    });
  }
  for (auto& t : ranks) t.join();

  for (size_t c = 0; c < calls.size(); ++c) {
    const Call& call = calls[c];
    const size_t bytes = call.count * dtype_size(call.dtype);
    const auto want = expected(call.dtype, inputs[c], call.count);
    for (int r = 0; r < N; ++r) {
      const auto& got = outputs[c][static_cast<size_t>(r)];
      size_t first_bad = bytes;
      for (size_t i = 0; i < bytes; ++i) {
        if (got[i] != want[i]) {
          first_bad = i;
          break;
        }
      }
      ASSERT_EQ(first_bad, bytes) << "call " << c << " rank " << r << " of " << N << ": "
                                  << (call.kind == AllReduceKernel::kOneShot ? "one" : "two")
                                  << "-shot " << dtype_name(call.dtype) << " count " << call.count
                                  << " mode " << static_cast<int>(call.mode)
                                  << ": first wrong byte " << first_bad;
      // Nothing written past the end (the tail vector is masked).
      for (size_t i = bytes; i < got.size(); ++i) ASSERT_EQ(got[i], 0xff) << "wrote past end";
    }
  }
  // Every block's epoch agrees across ranks; the call counter advanced once per copy call.
  uint32_t copy_calls = 0;
  for (const Call& c : calls) copy_calls += c.mode != Mode::kRegistered;
  for (int r = 0; r < N; ++r) {
    EXPECT_EQ(mem[static_cast<size_t>(r)]->signal()->call_count, copy_calls);
    EXPECT_EQ(mem[static_cast<size_t>(r)]->signal()->blocks_done, 0u);
    for (int b = 0; b < kMaxBlocks; ++b)
      ASSERT_EQ(mem[static_cast<size_t>(r)]->signal()->epoch[b], mem[0]->signal()->epoch[b]);
  }
}

// Mixed calls: sizes that give 1..max_blocks blocks and tails, both kernels, all modes.
std::vector<Call> mixed_calls(int n) {
  std::vector<Call> calls;
  const size_t counts[] = {1, 7, 8, 9, 33, 260, 1000, 2049, 4099, 777};
  const Mode modes[] = {Mode::kOutOfPlace, Mode::kInPlace, Mode::kRegistered, Mode::kOutOfPlace};
  for (int i = 0; i < n; ++i) {
    calls.push_back({i % 3 == 1 ? AllReduceKernel::kTwoShot : AllReduceKernel::kOneShot,
                     modes[i % 4], i % 5 == 2 ? DType::kF32 : DType::kBF16,
                     counts[static_cast<size_t>(i) % 10]});
  }
  return calls;
}

TEST(AllReduceEmulated, OneShotTwoShotTwoRanks) {
  // 32 threads x up to 3 blocks: several blocks per call, several vectors per thread.
  run_sequence<2>(mixed_calls(24), /*max_blocks=*/3, /*max_threads=*/32, /*max_bytes=*/64 << 10);
}

TEST(AllReduceEmulated, ThreeAndFourRanks) {
  run_sequence<3>(mixed_calls(12), 2, 32, 64 << 10);
  run_sequence<4>(mixed_calls(12), 3, 32, 64 << 10);
}

TEST(AllReduceEmulated, EveryTailAndSegmentSplit) {
  std::vector<Call> calls;
  for (size_t count = 1; count <= 70; ++count) {
    calls.push_back({AllReduceKernel::kTwoShot, Mode::kOutOfPlace, DType::kBF16, count});
    calls.push_back({AllReduceKernel::kOneShot, Mode::kInPlace, DType::kF32, count});
  }
  run_sequence<3>(calls, 2, 32, 4096);
}

TEST(AllReduceEmulated, RegisteredBackToBack) {
  // The producer rewrites the registered input right after each call: only the end barrier
  // keeps it from overwriting what a peer still reads.
  std::vector<Call> calls;
  for (int i = 0; i < 12; ++i)
    calls.push_back({i % 2 ? AllReduceKernel::kTwoShot : AllReduceKernel::kOneShot,
                     Mode::kRegistered, i % 3 ? DType::kBF16 : DType::kF32,
                     static_cast<size_t>(300 + 97 * i)});
  run_sequence<2>(calls, 3, 32, 64 << 10);
}

TEST(AllReduceEmulated, LargestMessageFillsBuffers) {
  // count * size == max_bytes, in both staging parities and the registered buffer.
  const size_t max_bytes = 16 << 10;
  std::vector<Call> calls = {
      {AllReduceKernel::kOneShot, Mode::kOutOfPlace, DType::kBF16, max_bytes / 2},
      {AllReduceKernel::kTwoShot, Mode::kOutOfPlace, DType::kF32, max_bytes / 4},
      {AllReduceKernel::kTwoShot, Mode::kRegistered, DType::kBF16, max_bytes / 2 - 3},
      {AllReduceKernel::kOneShot, Mode::kInPlace, DType::kF32, max_bytes / 4 - 1}};
  run_sequence<2>(calls, 4, 32, max_bytes);
}

}  // namespace
}  // namespace tandem::comm::cuda
