// MoE dispatch / combine latency on one host: ours (peer-mapped CUDA IPC kernels, CudaMoe)
// beside NCCL in the same run, every op captured as a loop in a CUDA graph.
//
// Decode (DP-EP): T = 1, 8, 32, 128, 512 tokens per rank x hidden 2048 / 4096, top-8 of 128
// experts, uniform random routing, bf16 payload (and fp8 dispatch as an extra column):
//   dispatch = dispatch_send + dispatch_recv (routing, at-most-once rows, packing per expert)
//   combine  = combine_send + combine_recv (pair outputs home, weighted sum in expert order)
//   NCCL baseline: one ncclGroup of ncclSend/ncclRecv per peer moving the same payload bytes
//   (counts known on the host: no routing, no packing, no reduction; generous to NCCL).
// Prefill (EP), 4096 tokens x 4096: combine = weighted local sum written into the registered
// all-reduce buffer + one-shot registered all-reduce, against NCCL all-reduce of the same bytes
// (and against local sum + NCCL all-reduce); prefill dispatch (routing + gather) for reference.
//
//   bench_moe [--world N] [--trials T] [--quick]
// Forks N ranks (default 2) unless RANK is set. Per call = event time of a captured loop /
// iterations; median over trials; slowest rank. CSV to $TANDEM_BENCH_MOE_CSV when set.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_comm_util.h"
#include "comm/cuda/check.h"
#include "comm/cuda/cuda_comm.h"
#include "comm/cuda/cuda_moe.h"
#include "comm/local_launcher.h"
#include "core/dtype.h"
#include "moe_reference.h"

using namespace tandem;
using namespace tandem::comm;
using tandem::bench::median;
using tandem::bench::Options;
using tandem::comm::moe_ref::Tokens;

namespace {

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t n) { TANDEM_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 16))); }
  ~Dev() { cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <class T>
void upload(void* dst, const std::vector<T>& v) {
  TANDEM_CUDA_CHECK(cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

struct Timer {
  CudaComm& comm;
  cudaStream_t s;
  Options opt;
  cudaEvent_t e0, e1;
  int keys = 0;

  // Median us per call of fn over a captured loop of iters calls; the slowest rank's value.
  double time(const std::function<void()>& fn, int iters) {
    for (int i = 0; i < 2; ++i) fn();  // eager warm-up (NCCL connects lazily)
    TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
    cudaGraph_t g;
    TANDEM_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < iters; ++i) fn();
    TANDEM_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec;
    TANDEM_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    TANDEM_CUDA_CHECK(cudaGraphDestroy(g));
    std::vector<double> per;
    for (int t = 0; t < 2 + opt.trials; ++t) {
      TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
      comm.store().barrier();
      fn();  // untimed: lines the ranks up on the GPUs
      TANDEM_CUDA_CHECK(cudaEventRecord(e0, s));
      TANDEM_CUDA_CHECK(cudaGraphLaunch(exec, s));
      TANDEM_CUDA_CHECK(cudaEventRecord(e1, s));
      TANDEM_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      TANDEM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (t >= 2) per.push_back(1000.0 * ms / iters);
    }
    TANDEM_CUDA_CHECK(cudaGraphExecDestroy(exec));
    return bench::max_over_ranks(comm, "bench_moe/t" + std::to_string(keys++), median(per));
  }
};

struct DecodeRow {
  int T, H;
  double disp, disp_nccl, comb, comb_nccl, disp_fp8, step;
  double disp_mib, comb_mib;  // payload bytes this rank sends to peers
};

// Group send/recv of per-peer byte counts (self excluded).
void nccl_exchange(ncclComm_t nc, int rank, int world, const void* sendbuf, void* recvbuf,
                   const std::vector<size_t>& send_bytes, const std::vector<size_t>& recv_bytes,
                   size_t stride, cudaStream_t s) {
  TANDEM_NCCL_CHECK(ncclGroupStart());
  for (int p = 0; p < world; ++p) {
    if (p == rank) continue;
    if (send_bytes[p])
      TANDEM_NCCL_CHECK(ncclSend(static_cast<const char*>(sendbuf) + stride * p, send_bytes[p],
                                 ncclUint8, p, nc, s));
    if (recv_bytes[p])
      TANDEM_NCCL_CHECK(
          ncclRecv(static_cast<char*>(recvbuf) + stride * p, recv_bytes[p], ncclUint8, p, nc, s));
  }
  TANDEM_NCCL_CHECK(ncclGroupEnd());
}

int bench_rank(const Options& opt) {
  CudaAllReduceConfig arc = CudaAllReduceConfig::defaults(RankEnv::from_env().world_size);
  arc.max_bytes = size_t(64) << 20;
  auto comm = CudaComm::from_env(arc);
  const int rank = comm->rank(), N = comm->world_size();
  cudaStream_t s;
  TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Timer tm{*comm, s, opt, nullptr, nullptr};
  TANDEM_CUDA_CHECK(cudaEventCreate(&tm.e0));
  TANDEM_CUDA_CHECK(cudaEventCreate(&tm.e1));
  if (rank == 0) {
    cudaDeviceProp prop{};
    TANDEM_CUDA_CHECK(cudaGetDeviceProperties(&prop, comm->device()));
    const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
    std::printf("bench_moe: %d ranks, %s (%d SMs), NCCL %d, NCCL_NVLS_ENABLE=%s, trials %d\n", N,
                prop.name, prop.multiProcessorCount, nccl_runtime_version(),
                nvls ? nvls : "(unset)", opt.trials);
    std::fflush(stdout);
  }

  const int E = 128, k = 8, max_tokens = 512;
  const int L = E / N;
  std::vector<DecodeRow> rows;
  const std::vector<int> Hs = {2048, 4096};
  const std::vector<int> Ts =
      opt.quick ? std::vector<int>{1, 128, 512} : std::vector<int>{1, 8, 32, 128, 512};
  for (int H : Hs) {
    CudaMoeConfig mc;
    mc.num_experts = E;
    mc.hidden = H;
    mc.top_k = k;
    mc.max_tokens = max_tokens;
    CudaMoe moe(*comm, mc);
    mc.payload = cuda::MoePayload::kFP8;
    CudaMoe moe8(*comm, mc);
    Dev x(size_t(max_tokens) * H * 2), ids(size_t(max_tokens) * k * 4),
        w(size_t(max_tokens) * k * 4), cnt(16), eo(size_t(moe.max_recv_rows()) * H * 2),
        out(size_t(max_tokens) * H * 2);
    // NCCL buffers: per peer a max-size slot
    const size_t slot_bytes = size_t(max_tokens) * k * H * 2;
    Dev nsend(slot_bytes * N), nrecv(slot_bytes * N);
    TANDEM_CUDA_CHECK(cudaMemset(nsend.p, 0, slot_bytes * N));
    for (int T : Ts) {
      std::vector<Tokens> all;
      for (int q = 0; q < N; ++q)
        all.push_back(moe_ref::make_tokens(T, max_tokens, k, H, E, moe_ref::RoutingKind::kRandom,
                                           uint64_t(T) * 1000 + H + q));
      const Tokens& mine = all[rank];
      upload(x.p, mine.x);
      upload(ids.p, mine.ids);
      upload(w.p, mine.w);
      upload(cnt.p, std::vector<int32_t>{T});
      // bytes per peer: dispatch rows (token once per destination rank), combine pairs
      std::vector<size_t> d_send(N, 0), d_recv(N, 0), c_send(N, 0), c_recv(N, 0);
      for (int q = 0; q < N; ++q) {
        for (int t = 0; t < T; ++t) {
          uint32_t mask = 0;
          for (int j = 0; j < k; ++j) {
            const int d = all[q].ids[size_t(t) * k + j] / L;
            mask |= 1u << d;
            if (q == rank && d != rank) c_recv[d] += size_t(H) * 2;  // my pair computed on d
            if (q != rank && d == rank) c_send[q] += size_t(H) * 2;  // q's pair computed here
          }
          if (q == rank) {
            for (int d = 0; d < N; ++d)
              if (d != rank && (mask >> d & 1u)) d_send[d] += size_t(H) * 2;
          } else if (mask >> rank & 1u) {
            d_recv[q] += size_t(H) * 2;
          }
        }
      }
      DecodeRow r{T, H, 0, 0, 0, 0, 0, 0, 0, 0};
      for (int q = 0; q < N; ++q) {
        r.disp_mib += d_send[q] / 1048576.0;
        r.comb_mib += c_send[q] / 1048576.0;
      }
      const int iters = T >= 512 ? 10 : 20;
      auto* idp = ids.as<int32_t>();
      auto* wp = w.as<float>();
      auto* cp = cnt.as<int32_t>();
      r.disp = tm.time(
          [&] {
            moe.dispatch_send(x.p, idp, wp, cp, s);
            moe.dispatch_recv(s);
          },
          iters);
      // the expert outputs for combine: the stand-in expert on the last dispatch
      cuda::moe_fake_expert_launch(moe.recv_x(), moe.expert_offsets(), moe.row_expert(), eo.p, L, H,
                                   cuda::MoePayload::kBF16, 132, s);
      r.comb = tm.time(
          [&] {
            moe.combine_send(eo.p, s);
            moe.combine_recv(out.p, s);
          },
          iters);
      r.step = tm.time(
          [&] {
            moe.dispatch_send(x.p, idp, wp, cp, s);
            moe.dispatch_recv(s);
            moe.combine_send(eo.p, s);
            moe.combine_recv(out.p, s);
          },
          iters);
      r.disp_fp8 = tm.time(
          [&] {
            moe8.dispatch_send(x.p, idp, wp, cp, s);
            moe8.dispatch_recv(s);
          },
          iters);
      ncclComm_t nc = comm->nccl().get();
      r.disp_nccl = tm.time(
          [&] { nccl_exchange(nc, rank, N, nsend.p, nrecv.p, d_send, d_recv, slot_bytes, s); },
          iters);
      r.comb_nccl = tm.time(
          [&] { nccl_exchange(nc, rank, N, nsend.p, nrecv.p, c_send, c_recv, slot_bytes, s); },
          iters);
      rows.push_back(r);
      if (rank == 0) {
        std::printf(
            "  T %4d H %d: dispatch %.2f (nccl %.2f) combine %.2f (nccl %.2f) step %.2f "
            "fp8-dispatch %.2f us\n",
            T, H, r.disp, r.disp_nccl, r.comb, r.comb_nccl, r.step, r.disp_fp8);
        std::fflush(stdout);
      }
    }
  }

  // ---- prefill: 4096 tokens x 4096 ----
  const int PT = 4096, PH = 4096;
  const Tokens pin = moe_ref::make_tokens(PT, PT, k, PH, E, moe_ref::RoutingKind::kRandom, 4242);
  const int max_rows = PT * std::min(k, L);
  Dev px(size_t(PT) * PH * 2), pids(size_t(PT) * k * 4), pw(size_t(PT) * k * 4), pcnt(16),
      pout_x(size_t(max_rows) * PH * 2), poff(size_t(L + 1) * 4), prt(size_t(max_rows) * 4),
      prs(size_t(max_rows) * 4), prw(size_t(max_rows) * 4), psr(size_t(PT) * k * 4),
      peo(size_t(max_rows) * PH * 2), pout(size_t(PT) * PH * 2), pbuf(size_t(PT) * PH * 2),
      pscratch(cuda::moe_prefill_scratch_ints(PT, k, L) * 4);
  upload(px.p, pin.x);
  upload(pids.p, pin.ids);
  upload(pw.p, pin.w);
  upload(pcnt.p, std::vector<int32_t>{PT});
  {
    const auto eo = moe_ref::random_bf16(size_t(max_rows) * PH, 99 + rank);
    upload(peo.p, eo);
    // tiny values in the NCCL buffer so repeated in-place sums stay finite
    std::vector<uint16_t> tiny(size_t(PT) * PH, f32_to_bf16(1e-30f));
    upload(pbuf.p, tiny);
  }
  cuda::PrefillDispatchParams dp{px.p,
                                 pids.as<int32_t>(),
                                 pw.as<float>(),
                                 pcnt.as<int32_t>(),
                                 pout_x.p,
                                 poff.as<int32_t>(),
                                 prt.as<int32_t>(),
                                 prs.as<int32_t>(),
                                 prw.as<float>(),
                                 psr.as<int32_t>(),
                                 pscratch.as<int32_t>(),
                                 PT,
                                 k,
                                 PH,
                                 rank * L,
                                 L};
  cuda::PrefillCombineParams cpp{peo.p,
                                 psr.as<int32_t>(),
                                 pids.as<int32_t>(),
                                 pw.as<float>(),
                                 pcnt.as<int32_t>(),
                                 pbuf.p,
                                 PT,
                                 k,
                                 PH,
                                 0};
  const size_t pcount = size_t(PT) * PH;
  const int pit = 5;
  const double p_disp = tm.time([&] { cuda::prefill_dispatch_launch(dp, 264, s); }, pit);
  const double p_local = tm.time([&] { cuda::prefill_combine_launch(cpp, 264, s); }, pit);
  const double p_ours = tm.time(
      [&] {
        prefill_combine_all_reduce(*comm, cpp, pout.p, 264, s, AllReduceAlgo::kOneShot, true);
      },
      pit);
  const double p_unfused = tm.time(
      [&] {
        prefill_combine_all_reduce(*comm, cpp, pout.p, 264, s, AllReduceAlgo::kOneShot, false);
      },
      pit);
  const double p_nccl =
      tm.time([&] { comm->nccl().all_reduce(pbuf.p, pbuf.p, pcount, DType::kBF16, s); }, pit);
  const double p_local_nccl = tm.time(
      [&] {
        cuda::prefill_combine_launch(cpp, 264, s);
        comm->nccl().all_reduce(pbuf.p, pout.p, pcount, DType::kBF16, s);
      },
      pit);

  if (rank == 0) {
    if (const char* csv = std::getenv("TANDEM_BENCH_MOE_CSV")) {
      std::ofstream f(csv);
      f << "T,H,dispatch_us,dispatch_nccl_us,combine_us,combine_nccl_us,step_us,dispatch_fp8_us,"
           "dispatch_MiB,combine_MiB\n";
      for (const auto& r : rows)
        f << r.T << "," << r.H << "," << r.disp << "," << r.disp_nccl << "," << r.comb << ","
          << r.comb_nccl << "," << r.step << "," << r.disp_fp8 << "," << r.disp_mib << ","
          << r.comb_mib << "\n";
      f << "prefill,4096x4096,dispatch " << p_disp << ",local " << p_local << ",ours " << p_ours
        << ",ours_unfused " << p_unfused << ",nccl_ar " << p_nccl << ",local+nccl " << p_local_nccl
        << "\n";
    }
    std::printf("\n== moe targets (decode at 128 tokens x 4096: <= 25 us and <= 0.33x NCCL)\n");
    int misses = 0;
    for (const auto& r : rows) {
      if (r.T != 128 || r.H != 4096) continue;
      const bool d_ok = r.disp <= 25.0, c_ok = r.comb <= 25.0;
      const bool dr_ok = r.disp / r.disp_nccl <= 0.33, cr_ok = r.comb / r.comb_nccl <= 0.33;
      misses += !d_ok + !c_ok + !dr_ok + !cr_ok;
      std::printf(
          "  dispatch %.2f us (%s), %.2fx NCCL (%s); combine %.2f us (%s), %.2fx NCCL (%s)\n",
          r.disp, d_ok ? "PASS" : "FAIL", r.disp / r.disp_nccl, dr_ok ? "PASS" : "FAIL", r.comb,
          c_ok ? "PASS" : "FAIL", r.comb / r.comb_nccl, cr_ok ? "PASS" : "FAIL");
    }
    std::printf("  %d target misses\n", misses);
    std::printf(
        "\n== decode dispatch/combine, %d GPUs, top-%d of %d experts, uniform routing, CUDA graph: "
        "us "
        "per call (slowest rank's median)\n",
        N, k, E);
    std::printf("%5s %5s %9s %9s %6s %9s %9s %6s %8s %9s %8s %8s\n", "T", "H", "dispatch", "nccl",
                "ratio", "combine", "nccl", "ratio", "step", "disp-fp8", "d MiB", "c MiB");
    for (const auto& r : rows)
      std::printf("%5d %5d %9.2f %9.2f %6.2f %9.2f %9.2f %6.2f %8.2f %9.2f %8.2f %8.2f\n", r.T, r.H,
                  r.disp, r.disp_nccl, r.disp / r.disp_nccl, r.comb, r.comb_nccl,
                  r.comb / r.comb_nccl, r.step, r.disp_fp8, r.disp_mib, r.comb_mib);
    std::printf(
        "\n== prefill 4096 tokens x 4096, %d GPUs (bf16, %.0f MiB all-reduced): us per call\n", N,
        pcount * 2 / 1048576.0);
    std::printf("  dispatch (route + gather)            %9.2f\n", p_disp);
    std::printf("  local weighted sum alone             %9.2f\n", p_local);
    std::printf("  ours: fused sum + 1-shot (1 kernel)  %9.2f\n", p_ours);
    std::printf("  ours: sum into registered, 1-shot    %9.2f\n", p_unfused);
    std::printf("  NCCL all-reduce of the same bytes    %9.2f   (ours / this = %.2f)\n", p_nccl,
                p_ours / p_nccl);
    std::printf("  local sum + NCCL all-reduce          %9.2f   (ours / this = %.2f)\n",
                p_local_nccl, p_ours / p_local_nccl);
    std::fflush(stdout);
  }
  TANDEM_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaEventDestroy(tm.e0);
  cudaEventDestroy(tm.e1);
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tandem::bench::comm_bench_main(argc, argv, "bench_moe", /*default_trials=*/15,
                                        /*quick_trials=*/5, std::chrono::seconds(280), bench_rank);
}
