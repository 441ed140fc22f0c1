// Multi-GPU tests of the MoE dispatch / combine kernels (one process per visible GPU, forked by
// the local launcher; skipped without 2 GPUs). CPU references: moe_reference.h (same orders and
// fp32 operations, so bf16 results must match bit for bit). Every check: fresh inputs, outputs
// poisoned with 0xff (NaN in bf16 / fp32) first, rows past the token count must stay poisoned.
//
// Checks that can fail (what each test asserts):
//   DecodeRoutings    per shape (E 128 / 64, H 2048 / 4096, k 8 / 6, bf16 and fp8 payloads,
//                     max_tokens up to 512): random, skewed (expert 0 in every token), all tokens
//                     to the first experts (one rank gets everything), sparse (most experts
//                     empty), one token per rank, zero tokens on one rank, zero everywhere:
//                     expert offsets, every packed row's routing metadata (source, token, slot,
//                     expert, weight) and payload (bf16: exact; fp8: scales exact, codes within
//                     one step), then the stand-in expert and combine: bf16 bit-exact (fp8: rel L2
//                     <= 2e-2), rows >= T untouched.
//   DecodeBackToBack100  100 full steps (dispatch, expert, combine) without host sync, 4 input
//                     sets with T = max, 0 on one rank, 1, odd; every step's output and offsets
//                     kept and checked; then 100 dispatch-only calls (receive double-buffering).
//   DecodeGraphReplay a captured step replayed with new inputs and new device token counts 6
//                     times, then 20 times back to back.
//   Prefill           dispatch (offsets, rows, slot map, packed rows exact) and combine + all-
//                     reduce, fused in one kernel and as two (sums into the registered buffer,
//                     then the registered one-shot), bf16 and fp32 partials, exact vs the rank-
//                     order fp32 sum of the ranks' partials; T = 0, 1, up to 4096 x 4096;
//                     then 20 calls back to back, fused and unfused mixed.
//   ConfigErrors      mismatched configs across ranks and bad shapes throw.
// Env: TANDEM_COMM_TEST_WORLD=N uses N ranks (default: every visible GPU, at most 16).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "comm/cuda/check.h"
#include "comm/cuda/cuda_comm.h"
#include "comm/cuda/cuda_moe.h"
#include "comm/local_launcher.h"
#include "core/dtype.h"
#include "core/error.h"
#include "moe_reference.h"

namespace tandem::comm {
namespace {

using cuda::MoePayload;
using moe_ref::RoutingKind;
using moe_ref::Tokens;
using std::chrono::seconds;

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

struct Dev {
  void* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t bytes) : n(std::max<size_t>(bytes, 16)) {
    TANDEM_CUDA_CHECK(cudaMalloc(&p, n));
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class T>
void upload(void* dst, const std::vector<T>& v, cudaStream_t s) {
  if (!v.empty())
    TANDEM_CUDA_CHECK(
        cudaMemcpyAsync(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s));
}

template <class T>
std::vector<T> download(const void* src, size_t n, cudaStream_t s) {
  std::vector<T> v(n);
  if (n)
    TANDEM_CUDA_CHECK(cudaMemcpyAsync(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, s));
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

void poison(void* p, size_t bytes, cudaStream_t s) {
  TANDEM_CUDA_CHECK(cudaMemsetAsync(p, 0xff, bytes, s));
}

class CudaMoeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = test_world();
    if (world_ < 2)
      GTEST_SKIP() << "needs >= 2 GPUs, found " << visible_gpus()
                   << " (TANDEM_COMM_TEST_WORLD overrides)";
  }
  void run_ranks(const std::function<void(int)>& body, seconds timeout = seconds(300)) {
    auto results = run_local_ranks(world_, body, timeout);
    EXPECT_EQ(describe_failures(results), "");
  }
  int world_ = 0;
};

std::unique_ptr<CudaComm> make_comm(size_t max_bytes = size_t(64) << 20) {
  CudaAllReduceConfig c = CudaAllReduceConfig::defaults(RankEnv::from_env().world_size);
  c.max_bytes = max_bytes;
  return CudaComm::from_env(c);
}

// ---- decode helpers ----------------------------------------------------------------------------

struct DecodeShape {
  int E, H, k, max_tokens;
  MoePayload payload;
  int send_blocks;
};

std::string shape_name(const DecodeShape& s) {
  std::ostringstream os;
  os << "E" << s.E << " H" << s.H << " k" << s.k << " max" << s.max_tokens
     << (s.payload == MoePayload::kFP8 ? " fp8" : " bf16");
  return os.str();
}

std::vector<Tokens> make_ranks(const DecodeShape& sh, const std::vector<int>& T, RoutingKind kind,
                               uint64_t seed) {
  std::vector<Tokens> v;
  for (size_t r = 0; r < T.size(); ++r)
    v.push_back(moe_ref::make_tokens(T[r], sh.max_tokens, sh.k, sh.H, sh.E, kind, seed * 131 + r));
  return v;
}

// This rank's inputs on the device.
struct DevInputs {
  Dev x, ids, w, count;
  explicit DevInputs(const DecodeShape& sh)
      : x(size_t(sh.max_tokens) * sh.H * 2),
        ids(size_t(sh.max_tokens) * sh.k * 4),
        w(size_t(sh.max_tokens) * sh.k * 4),
        count(16) {}
  void set(const Tokens& t, cudaStream_t s) {
    upload(x.p, t.x, s);
    upload(ids.p, t.ids, s);
    upload(w.p, t.w, s);
    upload(count.p, std::vector<int32_t>{t.T}, s);
  }
};

// Compares dispatch_recv's outputs with the reference; empty when equal.
std::string check_dispatch(const CudaMoe& moe, const moe_ref::DecodeRecv& ref,
                           const int32_t* d_offsets, const void* d_rows, cudaStream_t s,
                           bool check_meta = true) {
  const int L = moe.local_experts();
  auto off = download<int32_t>(d_offsets, L + 1, s);
  if (off != ref.offsets) {
    std::ostringstream os;
    os << "expert offsets differ: got total " << off[L] << " want " << ref.offsets[L];
    for (int e = 0; e <= L; ++e)
      if (off[e] != ref.offsets[e]) {
        os << " (first at expert " << e << ": " << off[e] << " vs " << ref.offsets[e] << ")";
        break;
      }
    return os.str();
  }
  const int n = ref.num_rows();
  if (n == 0) return {};
  if (check_meta) {
    if (download<int32_t>(moe.row_src(), n, s) != ref.row_src) return "row_src differs";
    if (download<int32_t>(moe.row_token(), n, s) != ref.row_token) return "row_token differs";
    if (download<int32_t>(moe.row_slot(), n, s) != ref.row_slot) return "row_slot differs";
    if (download<int32_t>(moe.row_expert(), n, s) != ref.row_expert) return "row_expert differs";
    if (download<float>(moe.row_weight(), n, s) != ref.row_weight) return "row_weight differs";
  }
  const size_t rb = moe.row_bytes();
  auto rows = download<uint8_t>(d_rows, size_t(n) * rb, s);
  const int H = moe.config().hidden;
  if (moe.config().payload == MoePayload::kBF16) {
    if (rows != ref.rows) {
      size_t i = 0;
      while (rows[i] == ref.rows[i]) ++i;
      return "packed row " + std::to_string(i / rb) + " differs at byte " + std::to_string(i % rb);
    }
    return {};
  }
  int off_by_one = 0;
  for (int r = 0; r < n; ++r) {
    const uint8_t* g = rows.data() + r * rb;
    const uint8_t* w = ref.rows.data() + r * rb;
    if (std::memcmp(g + H, w + H, size_t(H / cuda::kMoeFp8Group) * 4) != 0)
      return "fp8 scales of row " + std::to_string(r) + " differ";
    for (int i = 0; i < H; ++i) {
      if (g[i] == w[i]) continue;
      if ((g[i] & 0x80) != (w[i] & 0x80) || std::abs(int(g[i] & 0x7f) - int(w[i] & 0x7f)) > 1)
        return "fp8 code of row " + std::to_string(r) + " element " + std::to_string(i) + ": " +
               std::to_string(g[i]) + " vs " + std::to_string(w[i]);
      ++off_by_one;
    }
  }
  if (off_by_one > 0)
    std::printf("  note: %d fp8 codes one step off the CPU rounding\n", off_by_one);
  return {};
}

// Compares combine_recv's output [max_tokens, H] bf16 with the reference (fp32 [T, H]).
std::string check_out(const std::vector<uint16_t>& got, const std::vector<float>& want, int T,
                      int H, bool exact) {
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const uint16_t w16 = f32_to_bf16(want[i]);
    if (exact && got[i] != w16)
      return "element " + std::to_string(i) + " (token " + std::to_string(i / H) + "): got " +
             std::to_string(bf16_to_f32(got[i])) + " want " + std::to_string(bf16_to_f32(w16));
    const double g = bf16_to_f32(got[i]);
    if (!std::isfinite(g)) return "non-finite at element " + std::to_string(i);
    err2 += (g - want[i]) * (g - want[i]);
    ref2 += double(want[i]) * want[i];
  }
  if (!exact && ref2 > 0 && std::sqrt(err2 / ref2) > 2e-2)
    return "rel L2 error " + std::to_string(std::sqrt(err2 / ref2));
  for (size_t i = size_t(T) * H; i < got.size(); ++i)
    if (got[i] != 0xffff)
      return "row " + std::to_string(i / H) + " >= T " + std::to_string(T) + " was written";
  return {};
}

// References of every rank for one step: received rows, expert outputs, this rank's output.
struct StepRef {
  std::vector<moe_ref::DecodeRecv> recv;
  std::vector<std::vector<uint16_t>> eo;
  std::vector<float> out;  // this rank's
};

StepRef make_ref(const std::vector<Tokens>& in, int rank, const DecodeShape& sh) {
  StepRef r;
  const int N = static_cast<int>(in.size());
  r.recv.resize(N);
  r.eo.resize(N);
  for (int d = 0; d < N; ++d) {
    r.recv[d] = moe_ref::decode_dispatch(in, d, sh.E, sh.payload);
    r.eo[d] = moe_ref::fake_expert(r.recv[d].rows.data(), r.recv[d].row_expert.data(),
                                   r.recv[d].num_rows(), sh.H, sh.payload);
  }
  r.out = moe_ref::decode_combine(in, rank, sh.E, r.recv, r.eo);
  return r;
}

CudaMoeConfig moe_config(const DecodeShape& sh) {
  CudaMoeConfig c;
  c.num_experts = sh.E;
  c.hidden = sh.H;
  c.top_k = sh.k;
  c.max_tokens = sh.max_tokens;
  c.payload = sh.payload;
  c.send_blocks = sh.send_blocks;
  return c;
}

// ---- tests -------------------------------------------------------------------------------------

TEST_F(CudaMoeTest, DecodeRoutings) {
  run_ranks([](int rank) {
    auto comm = make_comm(4 << 20);
    const int N = comm->world_size();
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const std::vector<DecodeShape> shapes = {{128, 2048, 8, 128, MoePayload::kBF16, 0},
                                             {64, 4096, 6, 40, MoePayload::kBF16, 3},
                                             {128, 4096, 8, 64, MoePayload::kFP8, 0},
                                             {128, 4096, 8, 512, MoePayload::kBF16, 0}};
    struct Case {
      const char* name;
      RoutingKind kind;
      std::function<int(int r, int max)> T;
    };
    const std::vector<Case> cases = {
        {"random", RoutingKind::kRandom, [](int r, int m) { return r % 2 ? m * 3 / 5 + 1 : m; }},
        {"skewed", RoutingKind::kSkewed, [](int, int m) { return m * 3 / 4; }},
        {"all-first", RoutingKind::kAllFirst, [](int r, int m) { return r % 2 ? m : m / 2; }},
        {"sparse", RoutingKind::kSparse, [](int r, int m) { return m - r; }},
        {"one-token", RoutingKind::kRandom, [](int, int) { return 1; }},
        {"zero-on-one-rank", RoutingKind::kRandom,
         [](int r, int m) { return r == 1 ? 0 : m / 3 + 1; }},
        {"zero-everywhere", RoutingKind::kRandom, [](int, int) { return 0; }},
    };
    uint64_t seed = 100;
    int checked = 0;
    for (const DecodeShape& sh : shapes) {
      CudaMoe moe(*comm, moe_config(sh));
      DevInputs din(sh);
      Dev eo(size_t(moe.max_recv_rows()) * sh.H * 2);
      Dev out(size_t(sh.max_tokens) * sh.H * 2);
      for (const Case& c : cases) {
        if (sh.max_tokens == 512 && c.kind != RoutingKind::kRandom)
          continue;  // big shape: random only
        std::vector<int> T;
        for (int r = 0; r < N; ++r)
          T.push_back(std::max(0, std::min(sh.max_tokens, c.T(r, sh.max_tokens))));
        const auto in = make_ranks(sh, T, c.kind, ++seed);
        const std::string what = shape_name(sh) + " " + c.name;
        din.set(in[rank], s);
        poison(moe.recv_x(), size_t(moe.max_recv_rows()) * moe.row_bytes(), s);
        poison(const_cast<int32_t*>(moe.expert_offsets()), size_t(moe.local_experts() + 1) * 4, s);
        poison(eo.p, eo.n, s);
        poison(out.p, out.n, s);
        moe.dispatch_send(din.x.p, din.ids.as<int32_t>(), din.w.as<float>(),
                          din.count.as<int32_t>(), s);
        moe.dispatch_recv(s);
        TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
        const StepRef ref = make_ref(in, rank, sh);
        std::string err =
            check_dispatch(moe, ref.recv[rank], moe.expert_offsets(), moe.recv_x(), s);
        TANDEM_CHECK(err.empty(), what, ": dispatch: ", err);
        cuda::moe_fake_expert_launch(moe.recv_x(), moe.expert_offsets(), moe.row_expert(), eo.p,
                                     moe.local_experts(), sh.H, sh.payload, 132, s);
        moe.combine_send(eo.p, s);
        moe.combine_recv(out.p, s);
        auto got = download<uint16_t>(out.p, size_t(sh.max_tokens) * sh.H, s);
        err = check_out(got, ref.out, T[rank], sh.H, sh.payload == MoePayload::kBF16);
        TANDEM_CHECK(err.empty(), what, ": combine: ", err);
        ++checked;
      }
    }
    TANDEM_CUDA_CHECK(cudaStreamDestroy(s));
    if (rank == 0) std::printf("[rank 0] DecodeRoutings: %d cases ok\n", checked);
  });
}

TEST_F(CudaMoeTest, DecodeBackToBack100) {
  run_ranks([](int rank) {
    auto comm = make_comm(4 << 20);
    const int N = comm->world_size();
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const DecodeShape sh{128, 1024, 8, 32, MoePayload::kBF16, 0};
    CudaMoe moe(*comm, moe_config(sh));
    constexpr int kSets = 4, kIters = 100;
    std::vector<std::vector<Tokens>> in;
    std::vector<std::unique_ptr<DevInputs>> din;
    std::vector<StepRef> ref;
    for (int k = 0; k < kSets; ++k) {
      std::vector<int> T;
      for (int r = 0; r < N; ++r)
        T.push_back(k == 0 ? 32 : k == 1 ? (r == 1 ? 0 : 32) : k == 2 ? 1 : 17 + r % 5);
      in.push_back(
          make_ranks(sh, T, k == 3 ? RoutingKind::kSkewed : RoutingKind::kRandom, 500 + k));
      din.push_back(std::make_unique<DevInputs>(sh));
      din.back()->set(in.back()[rank], s);
      ref.push_back(make_ref(in.back(), rank, sh));
    }
    const int L = moe.local_experts();
    const size_t out_bytes = size_t(sh.max_tokens) * sh.H * 2;
    Dev eo(size_t(moe.max_recv_rows()) * sh.H * 2);
    Dev outs(out_bytes * kIters), offs(size_t(L + 1) * 4 * kIters);
    poison(outs.p, outs.n, s);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    comm->store().barrier();
    for (int i = 0; i < kIters; ++i) {
      DevInputs& d = *din[i % kSets];
      moe.dispatch_send(d.x.p, d.ids.as<int32_t>(), d.w.as<float>(), d.count.as<int32_t>(), s);
      moe.dispatch_recv(s);
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(offs.as<char>() + size_t(L + 1) * 4 * i,
                                        moe.expert_offsets(), size_t(L + 1) * 4,
                                        cudaMemcpyDeviceToDevice, s));
      cuda::moe_fake_expert_launch(moe.recv_x(), moe.expert_offsets(), moe.row_expert(), eo.p, L,
                                   sh.H, sh.payload, 132, s);
      moe.combine_send(eo.p, s);
      moe.combine_recv(outs.as<char>() + out_bytes * i, s);
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < kIters; ++i) {
      const int k = i % kSets;
      auto off = download<int32_t>(offs.as<char>() + size_t(L + 1) * 4 * i, L + 1, s);
      TANDEM_CHECK(off == ref[k].recv[rank].offsets, "step ", i, ": expert offsets differ");
      auto got = download<uint16_t>(outs.as<char>() + out_bytes * i, out_bytes / 2, s);
      std::string err = check_out(got, ref[k].out, in[k][rank].T, sh.H, true);
      TANDEM_CHECK(err.empty(), "step ", i, " (set ", k, "): ", err);
    }
    // Dispatch only, 100 times: the receive buffers alternate by parity; keep every result.
    const size_t rows_bytes = size_t(moe.max_recv_rows()) * moe.row_bytes();
    Dev saved(rows_bytes * kIters);
    for (int i = 0; i < kIters; ++i) {
      DevInputs& d = *din[(i * 3 + 1) % kSets];
      moe.dispatch_send(d.x.p, d.ids.as<int32_t>(), d.w.as<float>(), d.count.as<int32_t>(), s);
      moe.dispatch_recv(s);
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(saved.as<char>() + rows_bytes * i, moe.recv_x(), rows_bytes,
                                        cudaMemcpyDeviceToDevice, s));
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(offs.as<char>() + size_t(L + 1) * 4 * i,
                                        moe.expert_offsets(), size_t(L + 1) * 4,
                                        cudaMemcpyDeviceToDevice, s));
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < kIters; ++i) {
      const int k = (i * 3 + 1) % kSets;
      const auto& r = ref[k].recv[rank];
      // the row metadata arrays hold the last call's only: checked for the last call
      std::string err = check_dispatch(moe, r, offs.as<int32_t>() + (L + 1) * i,
                                       saved.as<char>() + rows_bytes * i, s, i == kIters - 1);
      TANDEM_CHECK(err.empty(), "dispatch-only call ", i, " (set ", k, "): ", err);
    }
    TANDEM_CUDA_CHECK(cudaStreamDestroy(s));
    if (rank == 0)
      std::printf("[rank 0] %d back-to-back steps + %d dispatch-only calls ok\n", kIters, kIters);
  });
}

TEST_F(CudaMoeTest, DecodeGraphReplay) {
  run_ranks([](int rank) {
    auto comm = make_comm(4 << 20);
    const int N = comm->world_size();
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const DecodeShape sh{128, 2048, 8, 64, MoePayload::kBF16, 0};
    CudaMoe moe(*comm, moe_config(sh));
    const int L = moe.local_experts();
    constexpr int kReplays = 6;
    const int Ts[kReplays] = {64, 0, 1, 50, 33, 64};
    std::vector<std::vector<Tokens>> in;
    std::vector<std::unique_ptr<DevInputs>> staged;
    std::vector<StepRef> ref;
    for (int r = 0; r < kReplays; ++r) {
      std::vector<int> T;
      for (int q = 0; q < N; ++q) T.push_back(q == 0 ? Ts[r] : Ts[(r + q) % kReplays]);
      in.push_back(
          make_ranks(sh, T, r == 3 ? RoutingKind::kSparse : RoutingKind::kRandom, 900 + r));
      staged.push_back(std::make_unique<DevInputs>(sh));
      staged.back()->set(in.back()[rank], s);
      ref.push_back(make_ref(in.back(), rank, sh));
    }
    DevInputs g(sh);  // the graph's inputs
    g.set(in[0][rank], s);
    const size_t out_bytes = size_t(sh.max_tokens) * sh.H * 2;
    Dev eo(size_t(moe.max_recv_rows()) * sh.H * 2), out(out_bytes), saved(out_bytes * kReplays);
    auto step = [&] {
      moe.dispatch_send(g.x.p, g.ids.as<int32_t>(), g.w.as<float>(), g.count.as<int32_t>(), s);
      moe.dispatch_recv(s);
      cuda::moe_fake_expert_launch(moe.recv_x(), moe.expert_offsets(), moe.row_expert(), eo.p, L,
                                   sh.H, sh.payload, 132, s);
      moe.combine_send(eo.p, s);
      moe.combine_recv(out.p, s);
    };
    step();  // eager once
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    comm->store().barrier();
    cudaGraph_t graph;
    TANDEM_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    step();
    TANDEM_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    auto copy_in = [&](int r) {
      DevInputs& st = *staged[r];
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(g.x.p, st.x.p, g.x.n, cudaMemcpyDeviceToDevice, s));
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(g.ids.p, st.ids.p, g.ids.n, cudaMemcpyDeviceToDevice, s));
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(g.w.p, st.w.p, g.w.n, cudaMemcpyDeviceToDevice, s));
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(g.count.p, st.count.p, 4, cudaMemcpyDeviceToDevice, s));
    };
    for (int r = 0; r < kReplays; ++r) {
      copy_in(r);
      poison(out.p, out_bytes, s);
      TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, s));
      TANDEM_CUDA_CHECK(cudaMemcpyAsync(saved.as<char>() + out_bytes * r, out.p, out_bytes,
                                        cudaMemcpyDeviceToDevice, s));
    }
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int r = 0; r < kReplays; ++r) {
      auto got = download<uint16_t>(saved.as<char>() + out_bytes * r, out_bytes / 2, s);
      std::string err = check_out(got, ref[r].out, in[r][rank].T, sh.H, true);
      TANDEM_CHECK(err.empty(), "replay ", r, ": ", err);
    }
    poison(out.p, out_bytes, s);
    for (int i = 0; i < 20; ++i) TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, s));
    auto got = download<uint16_t>(out.p, out_bytes / 2, s);
    std::string err = check_out(got, ref[kReplays - 1].out, in[kReplays - 1][rank].T, sh.H, true);
    TANDEM_CHECK(err.empty(), "20 replays back to back: ", err);
    TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
    TANDEM_CUDA_CHECK(cudaGraphDestroy(graph));
    TANDEM_CUDA_CHECK(cudaStreamDestroy(s));
    if (rank == 0) std::printf("[rank 0] decode graph replays ok\n");
  });
}

// ---- prefill -----------------------------------------------------------------------------------

struct PrefillCase {
  int T, max_tokens, k, E, H;
  RoutingKind kind;
  bool device_count;
  int out_f32;
};

struct PrefillBuffers {
  Dev x, ids, w, count, out_x, offsets, row_token, row_slot, row_weight, slot_row, scratch, eo, out;
  PrefillBuffers(int max_tokens, int k, int L, int H)
      : x(size_t(max_tokens) * H * 2),
        ids(size_t(max_tokens) * k * 4),
        w(size_t(max_tokens) * k * 4),
        count(16),
        out_x(size_t(max_tokens) * std::min(k, L) * H * 2),
        offsets(size_t(L + 1) * 4),
        row_token(size_t(max_tokens) * std::min(k, L) * 4),
        row_slot(size_t(max_tokens) * std::min(k, L) * 4),
        row_weight(size_t(max_tokens) * std::min(k, L) * 4),
        slot_row(size_t(max_tokens) * k * 4),
        scratch(cuda::moe_prefill_scratch_ints(max_tokens, k, L) * 4),
        eo(size_t(max_tokens) * std::min(k, L) * H * 2),
        out(size_t(max_tokens) * H * 4) {}
};

// The expected all-reduced output: rank-order fp32 sum of the ranks' rounded partials.
std::vector<uint8_t> prefill_expected(const PrefillCase& c, const Tokens& in, int N,
                                      uint64_t seed) {
  const int L = c.E / N;
  std::vector<float> acc(size_t(c.max_tokens) * c.H, 0.f);
  for (int q = 0; q < N; ++q) {
    const auto r = moe_ref::prefill_dispatch(in, q * L, L);
    const auto eo = moe_ref::random_bf16(size_t(std::max(1, r.offsets[L])) * c.H, seed * 31 + q);
    const auto part = moe_ref::prefill_combine(in, r, eo);
    for (size_t i = 0; i < acc.size(); ++i) {
      const float v = c.out_f32 ? part[i] : bf16_to_f32(f32_to_bf16(part[i]));
      acc[i] = q == 0 ? v : acc[i] + v;
    }
  }
  std::vector<uint8_t> out(acc.size() * (c.out_f32 ? 4 : 2));
  for (size_t i = 0; i < acc.size(); ++i) {
    if (c.out_f32) {
      std::memcpy(out.data() + 4 * i, &acc[i], 4);
    } else {
      const uint16_t h = f32_to_bf16(acc[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

void prefill_enqueue(CudaComm& comm, const PrefillCase& c, PrefillBuffers& b, void* out,
                     cudaStream_t s, bool fused = true) {
  const int N = comm.world_size(), L = c.E / N;
  cuda::PrefillDispatchParams p{b.x.p,
                                b.ids.as<int32_t>(),
                                b.w.as<float>(),
                                c.device_count ? b.count.as<int32_t>() : nullptr,
                                b.out_x.p,
                                b.offsets.as<int32_t>(),
                                b.row_token.as<int32_t>(),
                                b.row_slot.as<int32_t>(),
                                b.row_weight.as<float>(),
                                b.slot_row.as<int32_t>(),
                                b.scratch.as<int32_t>(),
                                c.max_tokens,
                                c.k,
                                c.H,
                                comm.rank() * L,
                                L};
  cuda::prefill_dispatch_launch(p, 132, s);
  cuda::PrefillCombineParams cp{b.eo.p,
                                b.slot_row.as<int32_t>(),
                                b.ids.as<int32_t>(),
                                b.w.as<float>(),
                                c.device_count ? b.count.as<int32_t>() : nullptr,
                                nullptr,
                                c.max_tokens,
                                c.k,
                                c.H,
                                c.out_f32};
  prefill_combine_all_reduce(comm, cp, out, 132, s, AllReduceAlgo::kOneShot, fused);
}

TEST_F(CudaMoeTest, Prefill) {
  run_ranks([](int rank) {
    auto comm = make_comm(size_t(64) << 20);
    const int N = comm->world_size();
    cudaStream_t s;
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const std::vector<PrefillCase> cases = {
        {200, 256, 8, 128, 1024, RoutingKind::kRandom, true, 0},
        {256, 256, 8, 128, 1024, RoutingKind::kSkewed, false, 0},
        {100, 128, 8, 128, 2048, RoutingKind::kAllFirst, true, 1},
        {1, 16, 8, 128, 1024, RoutingKind::kRandom, true, 0},
        {0, 16, 8, 128, 1024, RoutingKind::kRandom, true, 0},
        {300, 300, 6, 64, 1024, RoutingKind::kSparse, true, 1},
        {4096, 4096, 8, 128, 4096, RoutingKind::kRandom, true, 0},
    };
    uint64_t seed = 7000;
    for (const PrefillCase& c : cases) {
      for (bool fused : {true, false}) {
        ++seed;
        const int L = c.E / N;
        const Tokens in = moe_ref::make_tokens(c.T, c.max_tokens, c.k, c.H, c.E, c.kind, seed);
        PrefillBuffers b(c.max_tokens, c.k, L, c.H);
        upload(b.x.p, in.x, s);
        upload(b.ids.p, in.ids, s);
        upload(b.w.p, in.w, s);
        upload(b.count.p, std::vector<int32_t>{c.T}, s);
        const auto ref = moe_ref::prefill_dispatch(in, rank * L, L);
        const int rows = ref.offsets[L];
        upload(b.eo.p, moe_ref::random_bf16(size_t(std::max(1, rows)) * c.H, seed * 31 + rank), s);
        poison(b.out_x.p, b.out_x.n, s);
        poison(b.offsets.p, b.offsets.n, s);
        poison(b.slot_row.p, b.slot_row.n, s);
        poison(b.out.p, b.out.n, s);
        prefill_enqueue(*comm, c, b, b.out.p, s, fused);
        TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
        std::ostringstream what;
        what << (fused ? "fused " : "unfused ") << "prefill T " << c.T << " max " << c.max_tokens
             << " k " << c.k << " E " << c.E << " H " << c.H << " " << moe_ref::routing_name(c.kind)
             << (c.out_f32 ? " f32" : " bf16");
        TANDEM_CHECK(download<int32_t>(b.offsets.p, L + 1, s) == ref.offsets, what.str(),
                     ": offsets");
        TANDEM_CHECK(download<int32_t>(b.slot_row.p, size_t(c.max_tokens) * c.k, s) == ref.slot_row,
                     what.str(), ": slot_row");
        TANDEM_CHECK(download<int32_t>(b.row_token.p, rows, s) == ref.row_token, what.str(),
                     ": row_token");
        TANDEM_CHECK(download<int32_t>(b.row_slot.p, rows, s) == ref.row_slot, what.str(),
                     ": row_slot");
        TANDEM_CHECK(download<float>(b.row_weight.p, rows, s) == ref.row_weight, what.str(),
                     ": row_weight");
        TANDEM_CHECK(download<uint16_t>(b.out_x.p, size_t(rows) * c.H, s) == ref.rows, what.str(),
                     ": packed rows");
        const auto want = prefill_expected(c, in, N, seed);
        const auto got = download<uint8_t>(b.out.p, want.size(), s);
        if (got != want) {
          size_t i = 0;
          while (got[i] == want[i]) ++i;
          TANDEM_THROW(kInternal, what.str(), ": combine + all-reduce differs at byte ", i,
                       " (token ", i / (size_t(c.H) * (c.out_f32 ? 4 : 2)), ")");
        }
      }
    }
    // 20 calls back to back, two input sets, every output kept.
    const PrefillCase c{200, 256, 8, 128, 1024, RoutingKind::kRandom, true, 0};
    const int L = c.E / N;
    std::vector<std::unique_ptr<PrefillBuffers>> bufs;
    std::vector<std::vector<uint8_t>> want;
    for (int k = 0; k < 2; ++k) {
      const Tokens in = moe_ref::make_tokens(c.T - 50 * k, c.max_tokens, c.k, c.H, c.E,
                                             RoutingKind::kRandom, 8000 + k);
      bufs.push_back(std::make_unique<PrefillBuffers>(c.max_tokens, c.k, L, c.H));
      PrefillBuffers& b = *bufs.back();
      upload(b.x.p, in.x, s);
      upload(b.ids.p, in.ids, s);
      upload(b.w.p, in.w, s);
      upload(b.count.p, std::vector<int32_t>{in.T}, s);
      const auto ref = moe_ref::prefill_dispatch(in, rank * L, L);
      upload(
          b.eo.p,
          moe_ref::random_bf16(size_t(std::max(1, ref.offsets[L])) * c.H, (8000 + k) * 31 + rank),
          s);
      want.push_back(prefill_expected(c, in, N, 8000 + k));
    }
    const size_t ob = size_t(c.max_tokens) * c.H * 2;
    Dev outs(ob * 20);
    poison(outs.p, outs.n, s);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    comm->store().barrier();
    // fused and unfused calls mixed: they share the all-reduce's per-block epochs
    for (int i = 0; i < 20; ++i)
      prefill_enqueue(*comm, c, *bufs[i % 2], outs.as<char>() + ob * i, s, i % 3 != 0);
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < 20; ++i)
      TANDEM_CHECK(download<uint8_t>(outs.as<char>() + ob * i, ob, s) == want[i % 2],
                   "prefill call ", i, " of 20 back to back differs");
    TANDEM_CUDA_CHECK(cudaStreamDestroy(s));
    if (rank == 0) std::printf("[rank 0] prefill cases + 20 back-to-back ok\n");
  });
}

TEST_F(CudaMoeTest, ConfigErrors) {
  run_ranks([](int rank) {
    auto comm = make_comm(1 << 20);
    CudaMoeConfig c;
    c.num_experts = 128;
    c.hidden = 1024;
    c.max_tokens = rank == 0 ? 16 : 32;  // differs across ranks
    bool threw = false;
    try {
      CudaMoe moe(*comm, c);
    } catch (const Error& e) {
      threw = std::string(e.what()).find("another MoE config") != std::string::npos;
    }
    TANDEM_CHECK(threw, "mismatched MoE configs were accepted");
    c.max_tokens = 16;
    c.num_experts = 127;  // does not divide (any world >= 2 but 127)
    threw = false;
    try {
      CudaMoe moe(*comm, c);
    } catch (const Error& e) {
      threw = e.kind() == ErrorKind::kInvalidArgument;
    }
    TANDEM_CHECK(threw, "127 experts were accepted");
  });
}

}  // namespace
}  // namespace tandem::comm
