// Multi-GPU tests of the CUDA all-reduce (one process per visible GPU, forked by the local
// launcher; skipped without 2 GPUs). Every check: fresh random inputs per rank, outputs
// poisoned with NaN first, compared element by element with a float64 CPU reference of the
// sum (bf16: 1e-2 relative, fp32: 1e-5, plus the fp32 accumulation bound), NaN never passes,
// and the results of all ranks must be bit-identical.
//
// Checks that can fail (what each test asserts):
//   AllSizesAllPaths  1 element .. 64 MiB (odd sizes too), bf16 + fp32, one-shot / two-shot /
//                     NCCL / auto, out of place, in place and registered-input.
//   BackToBack100     100 calls without host sync, mixed sizes and algorithms, in place,
//                     registered; each result kept and checked (races between calls).
//   RegisteredBackToBack 100 producer-writes + registered all-reduces without host sync.
//   CudaGraphReplay   a captured sequence (one-shot, two-shot, NCCL, auto, registered, in
//                     place) replayed with new inputs 5 times, then 20 times back to back.
//   FallbacksAndErrors misaligned / oversized messages: auto falls back to NCCL (correct),
//                     explicit algorithms throw; mismatched configs across ranks throw.
// Env: TANDEM_COMM_TEST_WORLD=N uses N ranks (default: every visible GPU, at most 16).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "comm/cuda/check.h"
#include "comm/cuda/cuda_comm.h"
#include "comm/local_launcher.h"
#include "core/dtype.h"
#include "core/error.h"

namespace tandem::comm {
namespace {

using std::chrono::seconds;
constexpr size_t kMiB = size_t(1) << 20;
constexpr size_t kMaxTestBytes = 64 * kMiB;

int visible_gpus() {
  static const int n = run_in_child(
      [] {
        int c = 0;
        return cudaGetDeviceCount(&c) == cudaSuccess ? c : 0;
      },
      0);
  return n;
}

int test_world() {
  if (const char* v = std::getenv("TANDEM_COMM_TEST_WORLD")) return std::atoi(v);
  return std::min(visible_gpus(), 16);
}

// ---- inputs and the float64 reference --------------------------------------------------------

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Rank `rank`'s input for a seed: values in [-1, 1) as stored (bf16 bits or fp32).
std::vector<uint8_t> make_input(DType dtype, size_t count, uint64_t seed, int rank) {
  std::vector<uint8_t> out(count * dtype_size(dtype));
  uint64_t s = seed * 1000003ull + static_cast<uint64_t>(rank) * 7919ull + 1;
  for (size_t i = 0; i < count; ++i) {
    float x = static_cast<float>(static_cast<double>(splitmix(s) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
    if (dtype == DType::kBF16) {
      uint16_t h = f32_to_bf16(x);
      std::memcpy(out.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(out.data() + 4 * i, &x, 4);
    }
  }
  return out;
}

float element(DType dtype, const uint8_t* p, size_t i) {
  if (dtype == DType::kBF16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return bf16_to_f32(h);
  }
  float f;
  std::memcpy(&f, p + 4 * i, 4);
  return f;
}

struct Reference {
  DType dtype;
  size_t count;
  std::vector<double> sum;     // [count]
  std::vector<float> abs_sum;  // [count] sum of |x|: bounds the fp32 accumulation error
  std::vector<uint8_t> mine;   // this rank's input
};

Reference make_reference(DType dtype, size_t count, uint64_t seed, int rank, int world) {
  Reference ref{dtype, count, std::vector<double>(count, 0.0), std::vector<float>(count, 0.f), {}};
  for (int q = 0; q < world; ++q) {
    auto in = make_input(dtype, count, seed, q);
    for (size_t i = 0; i < count; ++i) {
      const double x = element(dtype, in.data(), i);
      ref.sum[i] += x;
      ref.abs_sum[i] += static_cast<float>(std::fabs(x));
    }
    if (q == rank) ref.mine = std::move(in);
  }
  return ref;
}

// Empty when out matches; else the first mismatches.
std::string compare(const Reference& ref, const uint8_t* out, int world) {
  const double rtol = ref.dtype == DType::kBF16 ? 1e-2 : 1e-5;
  const double acc_tol = world * 0x1.0p-23;  // fp32 accumulation of `world` terms
  std::ostringstream os;
  int bad = 0;
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < ref.count; ++i) {
    const double got = element(ref.dtype, out, i);
    const double err = std::fabs(got - ref.sum[i]);
    const double tol = rtol * std::fabs(ref.sum[i]) + acc_tol * ref.abs_sum[i];
    err2 += std::isfinite(err) ? err * err : 1e300;
    ref2 += ref.sum[i] * ref.sum[i];
    if (!(err <= tol)) {  // NaN fails
      if (bad < 5) os << " [" << i << "] got " << got << " want " << ref.sum[i] << ";";
      ++bad;
    }
  }
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  if (bad == 0 && rel <= rtol) return {};
  std::ostringstream head;
  head << bad << " of " << ref.count << " elements wrong, rel L2 " << rel << ":" << os.str();
  return head.str();
}

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// Throws unless every rank's output hashes the same (all ranks must agree bit for bit). Our
// kernels sum in rank order everywhere; NCCL is only held to it on two ranks (a + b == b + a).
void check_identical_across_ranks(CudaComm& comm, const std::string& key, const uint8_t* out,
                                  size_t bytes) {
  const uint64_t h = fnv1a(out, bytes);
  auto all = comm.store().all_gather(key, std::span(reinterpret_cast<const uint8_t*>(&h), 8));
  for (int q = 0; q < comm.world_size(); ++q) {
    uint64_t hq;
    std::memcpy(&hq, all[q].data(), 8);
    TANDEM_CHECK(hq == h, key, ": rank ", q, " result differs from rank ", comm.rank());
  }
}

// Whether a call's result must be bit-identical across ranks.
bool must_be_identical(const CudaComm& comm, AllReduceAlgo algo, size_t bytes) {
  if (algo == AllReduceAlgo::kAuto) algo = comm.choose(bytes);
  return algo != AllReduceAlgo::kNccl || comm.world_size() == 2;
}

// ---- device buffers ------------------------------------------------------------------------

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { TANDEM_CUDA_CHECK(cudaMalloc(&ptr, bytes)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* get() const { return static_cast<char*>(ptr); }
};

void poison(void* p, size_t bytes, cudaStream_t s) {
  TANDEM_CUDA_CHECK(cudaMemsetAsync(p, 0xff, bytes, s));  // all-ones: NaN in bf16 and fp32
}

std::vector<uint8_t> download(const void* p, size_t bytes, cudaStream_t s) {
  std::vector<uint8_t> h(bytes);
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(h.data(), p, bytes, cudaMemcpyDeviceToHost, s));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
  return h;
}

void upload(void* p, const std::vector<uint8_t>& h, cudaStream_t s) {
  TANDEM_CUDA_CHECK(cudaMemcpyAsync(p, h.data(), h.size(), cudaMemcpyHostToDevice, s));
}

CudaAllReduceConfig test_config(int world) {
  CudaAllReduceConfig c = CudaAllReduceConfig::defaults(world);
  c.max_bytes = kMaxTestBytes;
  return c;
}

// How one call is made.
enum class Mode { kOutOfPlace, kInPlace, kRegistered };

struct Path {
  AllReduceAlgo algo;
  Mode mode;
};

std::string describe(DType dtype, size_t count, Path p) {
  std::ostringstream os;
  os << dtype_name(dtype) << " count " << count << " " << all_reduce_algo_name(p.algo) << " "
     << (p.mode == Mode::kOutOfPlace ? "out-of-place"
         : p.mode == Mode::kInPlace  ? "in-place"
                                     : "registered");
  return os.str();
}

// Enqueues one call reading `in` (device, this rank's input) and writing `out`. Ranks sharing a
// GPU (TANDEM_ALLOW_SHARED_GPU) have no NCCL communicator, by CudaComm's contract: a path that
// names NCCL runs as two-shot there, so the shared-GPU run still covers every other case.
void enqueue(CudaComm& comm, Path p, const void* in, void* out, size_t count, DType dtype,
             cudaStream_t s) {
  if (comm.shared_device() && p.algo == AllReduceAlgo::kNccl) p.algo = AllReduceAlgo::kTwoShot;
  const size_t bytes = count * dtype_size(dtype);
  switch (p.mode) {
    case Mode::kOutOfPlace: comm.all_reduce(in, out, count, dtype, s, p.algo); break;
    case Mode::kInPlace:
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice, s));
      comm.all_reduce(out, out, count, dtype, s, p.algo);
      break;
    case Mode::kRegistered:  // the "producer" writes the registered buffer
      TANDEM_CUDA_CHECK(
          cudaMemcpyAsync(comm.registered_input(), in, bytes, cudaMemcpyDeviceToDevice, s));
      comm.all_reduce_registered(out, count, dtype, s, p.algo);
      break;
  }
}

class CudaAllReduceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = test_world();
    if (world_ < 2) {
      GTEST_SKIP() << "needs >= 2 GPUs, found " << visible_gpus()
                   << " (TANDEM_COMM_TEST_WORLD overrides)";
    }
  }
  // Runs body(rank) in world_ processes; fails the test with every rank's error.
  void run_ranks(const std::function<void(int)>& body, seconds timeout = seconds(240)) {
    auto results = run_local_ranks(world_, body, timeout);
    EXPECT_EQ(describe_failures(results), "");
  }
  int world_ = 0;
};

// ---- tests ---------------------------------------------------------------------------------

TEST_F(CudaAllReduceTest, AllSizesAllPaths) {
  run_ranks([](int rank) {
    auto comm = CudaComm::from_env(test_config(RankEnv::from_env().world_size));
    const int world = comm->world_size();
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    DeviceBuffer d_in(kMaxTestBytes), d_out(kMaxTestBytes);
    const std::vector<Path> paths = {
        {AllReduceAlgo::kOneShot, Mode::kOutOfPlace}, {AllReduceAlgo::kTwoShot, Mode::kOutOfPlace},
        {AllReduceAlgo::kNccl, Mode::kOutOfPlace},    {AllReduceAlgo::kAuto, Mode::kOutOfPlace},
        {AllReduceAlgo::kOneShot, Mode::kInPlace},    {AllReduceAlgo::kTwoShot, Mode::kInPlace},
        {AllReduceAlgo::kOneShot, Mode::kRegistered}, {AllReduceAlgo::kTwoShot, Mode::kRegistered},
        {AllReduceAlgo::kAuto, Mode::kRegistered}};
    int cases = 0;
    uint64_t seed = 1;
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      const size_t max_count = kMaxTestBytes / dtype_size(dtype);
      const std::vector<size_t> counts = {1,
                                          2,
                                          3,
                                          7,
                                          8,
                                          9,
                                          15,
                                          16,
                                          17,
                                          31,
                                          33,
                                          100,
                                          255,
                                          1000,
                                          1023,
                                          1024,
                                          4095,
                                          4097,
                                          65539,
                                          262143,
                                          1 << 20,
                                          3000001,
                                          max_count - 3,
                                          max_count};
      for (size_t count : counts) {
        for (Path p : paths) {
          const std::string what = describe(dtype, count, p);
          const size_t bytes = count * dtype_size(dtype);
          Reference ref = make_reference(dtype, count, ++seed, rank, world);
          upload(d_in.get(), ref.mine, s);
          poison(d_out.get(), bytes, s);
          enqueue(*comm, p, d_in.get(), d_out.get(), count, dtype, s);
          TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
          auto out = download(d_out.get(), bytes, s);
          std::string err = compare(ref, out.data(), world);
          TANDEM_CHECK(err.empty(), what, ": ", err);
          if (must_be_identical(*comm, p.algo, bytes))
            check_identical_across_ranks(*comm, "sizes/" + std::to_string(cases), out.data(),
                                         bytes);
          else
            comm->store().barrier();
          ++cases;
        }
      }
    }
    TANDEM_CUDA_CHECK(cudaStreamDestroy(s));
    if (rank == 0) std::printf("[rank 0] AllSizesAllPaths: %d cases ok\n", cases);
  });
}

// Shared by the back-to-back tests: `iters` calls enqueued without host synchronisation, each
// into its own output, then all checked.
void back_to_back(int rank, int iters, const std::function<Path(int)>& path_of,
                  bool registered_only) {
  auto comm = CudaComm::from_env(test_config(RankEnv::from_env().world_size));
  const int world = comm->world_size();
  cudaStream_t s;
  TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Sizes per iteration: small, odd, medium, large-ish; bf16 and fp32.
  struct Shape {
    size_t count;
    DType dtype;
  };
  const std::vector<Shape> shapes = {{4096, DType::kBF16},
                                     {12345, DType::kBF16},
                                     {65536, DType::kF32},
                                     {1 << 20, DType::kBF16},
                                     {77777, DType::kF32}};
  constexpr int kSets = 4;  // distinct inputs per shape
  size_t max_bytes = 0;
  for (auto sh : shapes) max_bytes = std::max(max_bytes, sh.count * dtype_size(sh.dtype));
  std::vector<std::vector<Reference>> refs(shapes.size());
  std::vector<std::unique_ptr<DeviceBuffer>> inputs;  // [shape * kSets + set]
  uint64_t seed = 1000;
  for (size_t k = 0; k < shapes.size(); ++k) {
    for (int j = 0; j < kSets; ++j) {
      refs[k].push_back(make_reference(shapes[k].dtype, shapes[k].count, ++seed, rank, world));
      inputs.push_back(std::make_unique<DeviceBuffer>(max_bytes));
      upload(inputs.back()->get(), refs[k].back().mine, s);
    }
  }
  DeviceBuffer outs(max_bytes * iters);
  poison(outs.get(), max_bytes * iters, s);
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
  comm->store().barrier();

  for (int i = 0; i < iters; ++i) {
    const size_t k = static_cast<size_t>(i) % shapes.size();
    const int set = (i / static_cast<int>(shapes.size())) % kSets;
    Path p = path_of(i);
    if (registered_only) p.mode = Mode::kRegistered;
    enqueue(*comm, p, inputs[k * kSets + set]->get(), outs.get() + max_bytes * i, shapes[k].count,
            shapes[k].dtype, s);
  }
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
  for (int i = 0; i < iters; ++i) {
    const size_t k = static_cast<size_t>(i) % shapes.size();
    const int set = (i / static_cast<int>(shapes.size())) % kSets;
    const size_t bytes = shapes[k].count * dtype_size(shapes[k].dtype);
    auto out = download(outs.get() + max_bytes * i, bytes, s);
    std::string err = compare(refs[k][set], out.data(), world);
    Path p = path_of(i);
    if (registered_only) p.mode = Mode::kRegistered;
    TANDEM_CHECK(err.empty(), "iteration ", i, " (", describe(shapes[k].dtype, shapes[k].count, p),
                 "): ", err);
    if (must_be_identical(*comm, p.algo, bytes))
      check_identical_across_ranks(*comm, "b2b/" + std::to_string(i), out.data(), bytes);
  }
  TANDEM_CUDA_CHECK(cudaStreamDestroy(s));
  if (rank == 0) std::printf("[rank 0] %d back-to-back calls ok\n", iters);
}

TEST_F(CudaAllReduceTest, BackToBack100) {
  run_ranks([](int rank) {
    back_to_back(
        rank, 100,
        [](int i) {
          static const AllReduceAlgo algos[] = {AllReduceAlgo::kOneShot, AllReduceAlgo::kTwoShot,
                                                AllReduceAlgo::kOneShot, AllReduceAlgo::kAuto,
                                                AllReduceAlgo::kTwoShot, AllReduceAlgo::kNccl,
                                                AllReduceAlgo::kOneShot};
          const Mode mode = i % 5 == 4   ? Mode::kRegistered
                            : i % 3 == 0 ? Mode::kInPlace
                                         : Mode::kOutOfPlace;
          return Path{algos[i % 7], mode};
        },
        false);
  });
}

TEST_F(CudaAllReduceTest, RegisteredBackToBack) {
  run_ranks([](int rank) {
    back_to_back(
        rank, 100,
        [](int i) {
          return Path{i % 2 == 0 ? AllReduceAlgo::kOneShot : AllReduceAlgo::kTwoShot,
                      Mode::kRegistered};
        },
        true);
  });
}

TEST_F(CudaAllReduceTest, CudaGraphReplay) {
  run_ranks([](int rank) {
    auto comm = CudaComm::from_env(test_config(RankEnv::from_env().world_size));
    const int world = comm->world_size();
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    struct Step {
      size_t count;
      DType dtype;
      Path path;
    };
    // Five copy-mode custom kernels (odd): each replay starts on the other staging parity.
    const std::vector<Step> steps = {
        {3001, DType::kBF16, {AllReduceAlgo::kOneShot, Mode::kOutOfPlace}},
        {300001, DType::kF32, {AllReduceAlgo::kTwoShot, Mode::kOutOfPlace}},
        {1 << 19, DType::kBF16, {AllReduceAlgo::kNccl, Mode::kOutOfPlace}},
        {65536, DType::kBF16, {AllReduceAlgo::kAuto, Mode::kInPlace}},
        {40000, DType::kF32, {AllReduceAlgo::kOneShot, Mode::kRegistered}},
        {3001, DType::kBF16, {AllReduceAlgo::kOneShot, Mode::kOutOfPlace}},
        {2 << 20, DType::kBF16, {AllReduceAlgo::kTwoShot, Mode::kInPlace}},
        {999, DType::kF32, {AllReduceAlgo::kTwoShot, Mode::kRegistered}},
        {8, DType::kBF16, {AllReduceAlgo::kOneShot, Mode::kOutOfPlace}},
    };
    constexpr int kReplays = 5;
    std::vector<std::unique_ptr<DeviceBuffer>> g_in, g_out;  // graph's buffers [step]
    std::vector<std::vector<std::unique_ptr<DeviceBuffer>>> staged(kReplays);  // [replay][step]
    std::vector<std::vector<std::unique_ptr<DeviceBuffer>>> saved(kReplays);   // [replay][step]
    std::vector<std::vector<Reference>> refs(kReplays);
    uint64_t seed = 5000;
    for (const Step& st : steps) {
      const size_t bytes = st.count * dtype_size(st.dtype);
      g_in.push_back(std::make_unique<DeviceBuffer>(bytes));
      g_out.push_back(std::make_unique<DeviceBuffer>(bytes));
    }
    for (int r = 0; r < kReplays; ++r) {
      for (const Step& st : steps) {
        const size_t bytes = st.count * dtype_size(st.dtype);
        refs[r].push_back(make_reference(st.dtype, st.count, ++seed, rank, world));
        staged[r].push_back(std::make_unique<DeviceBuffer>(bytes));
        upload(staged[r].back()->get(), refs[r].back().mine, s);
        saved[r].push_back(std::make_unique<DeviceBuffer>(bytes));
      }
    }
    // Every step once eagerly first: NCCL connects lazily, better not inside the capture.
    for (size_t j = 0; j < steps.size(); ++j)
      enqueue(*comm, steps[j].path, staged[0][j]->get(), g_out[j]->get(), steps[j].count,
              steps[j].dtype, s);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    comm->store().barrier();

    cudaGraph_t graph;
    TANDEM_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (size_t j = 0; j < steps.size(); ++j)
      enqueue(*comm, steps[j].path, g_in[j]->get(), g_out[j]->get(), steps[j].count, steps[j].dtype,
              s);
    TANDEM_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    // Replays with new inputs, no host synchronisation in between.
    for (int r = 0; r < kReplays; ++r) {
      for (size_t j = 0; j < steps.size(); ++j) {
        const size_t bytes = steps[j].count * dtype_size(steps[j].dtype);
        TANDEM_CUDA_CHECK(cudaMemcpyAsync(g_in[j]->get(), staged[r][j]->get(), bytes,
                                          cudaMemcpyDeviceToDevice, s));
        poison(g_out[j]->get(), bytes, s);
      }
      TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, s));
      for (size_t j = 0; j < steps.size(); ++j) {
        const size_t bytes = steps[j].count * dtype_size(steps[j].dtype);
        TANDEM_CUDA_CHECK(cudaMemcpyAsync(saved[r][j]->get(), g_out[j]->get(), bytes,
                                          cudaMemcpyDeviceToDevice, s));
      }
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    auto check_replay = [&](int r, const std::string& tag) {
      for (size_t j = 0; j < steps.size(); ++j) {
        const size_t bytes = steps[j].count * dtype_size(steps[j].dtype);
        auto out = download(saved[r][j]->get(), bytes, s);
        std::string err = compare(refs[r][j], out.data(), world);
        TANDEM_CHECK(err.empty(), tag, " replay ", r, " step ", j, " (",
                     describe(steps[j].dtype, steps[j].count, steps[j].path), "): ", err);
        if (must_be_identical(*comm, steps[j].path.algo, bytes))
          check_identical_across_ranks(
              *comm, tag + "/" + std::to_string(r) + "/" + std::to_string(j), out.data(), bytes);
      }
    };
    for (int r = 0; r < kReplays; ++r) check_replay(r, "graph");

    // 20 more replays back to back on the last inputs (in-place steps re-copy their input).
    for (int k = 0; k < 20; ++k) TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, s));
    for (size_t j = 0; j < steps.size(); ++j) {
      const size_t bytes = steps[j].count * dtype_size(steps[j].dtype);
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(saved[kReplays - 1][j]->get(), g_out[j]->get(), bytes,
                                        cudaMemcpyDeviceToDevice, s));
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    check_replay(kReplays - 1, "graph x20");

    TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
    TANDEM_CUDA_CHECK(cudaStreamDestroy(s));
    if (rank == 0) std::printf("[rank 0] graph replays ok\n");
  });
}

TEST_F(CudaAllReduceTest, FallbacksAndErrors) {
  run_ranks([](int rank) {
    CudaAllReduceConfig cfg = CudaAllReduceConfig::defaults(RankEnv::from_env().world_size);
    cfg.max_bytes = 1 * kMiB;
    auto comm = CudaComm::from_env(cfg);
    const int world = comm->world_size();
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    DeviceBuffer d_in(4 * kMiB + 64), d_out(4 * kMiB + 64);

    // Ranks sharing a GPU: no NCCL, so what would fall back to it is refused, clearly.
    if (comm->shared_device()) {
      for (const auto& [bytes, aligned] :
           {std::pair<size_t, bool>{2002, false}, std::pair<size_t, bool>{2 * kMiB + 16, true}}) {
        bool threw = false;
        try {
          (void)comm->choose(bytes, aligned);
        } catch (const Error& e) {
          threw = e.kind() == ErrorKind::kInvalidArgument;
        }
        TANDEM_CHECK(threw, "shared GPU: ", bytes, " bytes (aligned ", aligned,
                     ") did not throw kInvalidArgument");
      }
    }
    // Misaligned pointers: auto takes NCCL and is right; explicit one-shot refuses.
    if (!comm->shared_device()) {
      const size_t count = 1001;
      Reference ref = make_reference(DType::kBF16, count, 77, rank, world);
      upload(d_in.get() + 2, ref.mine, s);
      poison(d_out.get() + 2, count * 2, s);
      TANDEM_CHECK(comm->choose(count * 2, false) == AllReduceAlgo::kNccl, "misaligned -> NCCL");
      comm->all_reduce(d_in.get() + 2, d_out.get() + 2, count, DType::kBF16, s);
      auto out = download(d_out.get() + 2, count * 2, s);
      std::string err = compare(ref, out.data(), world);
      TANDEM_CHECK(err.empty(), "misaligned auto: ", err);
      bool threw = false;
      try {
        comm->all_reduce(d_in.get() + 2, d_out.get() + 2, count, DType::kBF16, s,
                         AllReduceAlgo::kOneShot);
      } catch (const Error& e) {
        threw = e.kind() == ErrorKind::kInvalidArgument;
      }
      TANDEM_CHECK(threw, "misaligned one-shot did not throw kInvalidArgument");
    }
    // Larger than max_bytes: auto takes NCCL; explicit two-shot refuses.
    if (!comm->shared_device()) {
      const size_t count = (2 * kMiB) / 4 + 5;
      Reference ref = make_reference(DType::kF32, count, 78, rank, world);
      upload(d_in.get(), ref.mine, s);
      poison(d_out.get(), count * 4, s);
      comm->all_reduce(d_in.get(), d_out.get(), count, DType::kF32, s);
      auto out = download(d_out.get(), count * 4, s);
      std::string err = compare(ref, out.data(), world);
      TANDEM_CHECK(err.empty(), "oversized auto: ", err);
      bool threw = false;
      try {
        comm->all_reduce(d_in.get(), d_out.get(), count, DType::kF32, s, AllReduceAlgo::kTwoShot);
      } catch (const Error& e) {
        threw = e.kind() == ErrorKind::kInvalidArgument;
      }
      TANDEM_CHECK(threw, "oversized two-shot did not throw kInvalidArgument");
    }
    // Unsupported dtype and an output inside the registered buffer.
    {
      bool threw = false;
      try {
        comm->all_reduce(d_in.get(), d_out.get(), 16, DType::kF16, s);
      } catch (const Error& e) {
        threw = e.kind() == ErrorKind::kUnsupported;
      }
      TANDEM_CHECK(threw, "f16 did not throw kUnsupported");
      threw = false;
      try {
        comm->all_reduce_registered(comm->registered_input(), 16, DType::kF32, s);
      } catch (const Error& e) {
        threw = e.kind() == ErrorKind::kInvalidArgument;
      }
      TANDEM_CHECK(threw, "registered output aliasing the input did not throw");
    }
    // Thresholds: collective update, then auto follows them.
    comm->set_thresholds(4096, 65536);
    TANDEM_CHECK(comm->choose(4096) == AllReduceAlgo::kOneShot, "4 KiB -> one-shot");
    TANDEM_CHECK(comm->choose(4097) == AllReduceAlgo::kTwoShot, "4 KiB + 1 -> two-shot");
    TANDEM_CHECK(comm->choose(65537) ==
                     (comm->shared_device() ? AllReduceAlgo::kTwoShot : AllReduceAlgo::kNccl),
                 "64 KiB + 1 -> NCCL (two-shot where ranks share a GPU)");
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    TANDEM_CUDA_CHECK(cudaStreamDestroy(s));
  });

  // Ranks with different configs refuse to start, on every rank, with a clear error.
  run_ranks([](int rank) {
    CudaAllReduceConfig cfg = CudaAllReduceConfig::defaults(RankEnv::from_env().world_size);
    cfg.max_bytes = 1 * kMiB;
    cfg.one_shot_max_bytes = rank == 0 ? 4096 : 8192;
    try {
      auto comm = CudaComm::from_env(cfg);
    } catch (const Error& e) {
      TANDEM_CHECK(std::string(e.what()).find("another all-reduce config") != std::string::npos,
                   "unexpected error: ", e.what());
      return;
    }
    TANDEM_THROW(kInternal, "mismatched configs were accepted");
  });
}

}  // namespace
}  // namespace tandem::comm
