// KV transfer over the cuda-ipc backend on one GPU: a 6000-token Qwen3-235B-shaped KV (94
// layers x 4 KV heads x 128 x (k, v), bf16 = 1.16 GB per request), 1 and 8 requests at once,
// for unchanged heads (TP=1 -> 4 heads), split (TP=1 -> four 1-head receivers) and merge
// (TP=4 -> one 4-head receiver); GB/s of KV moved beside cudaMemcpy device-to-device of the
// same bytes in the same run, and the time from the last layer's compute to "KV complete"
// when each layer is sent right after a (simulated, 1 ms) layer of prefill compute.
//   bench_kv_transfer [--tokens 6000] [--layers 94]
// Prints a table; TANDEM_BENCH_CSV=FILE also writes it as CSV.
#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda_check.h"
#include "transfer/cuda/cuda_ipc_transfer.h"

using namespace tandem;
using namespace tandem::transfer;
using Clock = std::chrono::steady_clock;

namespace {

__global__ void spin_kernel(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

struct Pool {
  std::shared_ptr<void> mem;
  KvCache cache;
  Pool(KvGeometry g, cudaStream_t stream) {
    g.dtype = DType::kBF16;
    const size_t layer = static_cast<size_t>(g.page_elems() * g.num_pages) * 2;
    void* p = nullptr;
    TANDEM_CUDA_CHECK(cudaMalloc(&p, layer * static_cast<size_t>(g.num_layers)));
    TANDEM_CUDA_CHECK(cudaMemset(p, 0x3c, layer * static_cast<size_t>(g.num_layers)));
    mem = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
    KvCache::External ext;
    for (int64_t l = 0; l < g.num_layers; ++l)
      ext.layers.push_back(static_cast<char*>(p) + l * layer);
    ext.owner = mem;
    ext.stream = stream;
    cache = KvCache(g, std::move(ext));
  }
};

struct Result {
  std::string shape;
  int requests;
  double ms, gbps, memcpy_gbps, tail_us;
};

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 6000, layers = 94;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--tokens")) tokens = std::atoll(argv[++i]);
    if (!std::strcmp(argv[i], "--layers")) layers = std::atoll(argv[++i]);
  }
  constexpr int64_t kHeads = 4, kHd = 128, kPage = 16;
  const int64_t pages = (tokens + kPage - 1) / kPage;
  const double req_bytes = static_cast<double>(layers * kHeads * kHd * 2 * 2 * tokens);
  cudaDeviceProp prop{};
  TANDEM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int clock_khz = 0;
  TANDEM_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  std::printf(
      "== bench_kv_transfer on %s: %lld tokens x %lld layers x %lld KV heads x %lld, bf16 "
      "= %.3f GB per request\n",
      prop.name, static_cast<long long>(tokens), static_cast<long long>(layers),
      static_cast<long long>(kHeads), static_cast<long long>(kHd), req_bytes / 1e9);
  cudaStream_t model_stream;
  TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&model_stream, cudaStreamNonBlocking));
  std::vector<Result> results;

  for (const char* shape : {"unchanged", "split", "merge"}) {
    for (int nreq : {1, 8}) {
      const int src_tp = std::string(shape) == "merge" ? 4 : 1;
      const int nrx = std::string(shape) == "split" ? 4 : 1;
      const KvSharding sharding{kHeads, src_tp};
      auto backend = make_cuda_ipc_backend();
      std::mutex mu;
      std::condition_variable cv;
      int complete = 0;
      Clock::time_point t_done;
      ReceiverCallbacks rcb;
      rcb.on_complete = [&](const std::string&, int32_t, float) {
        std::lock_guard<std::mutex> l(mu);
        if (++complete == nreq * nrx) t_done = Clock::now();
        cv.notify_all();
      };
      rcb.on_error = [&](const std::string& id, const std::string& m) {
        std::fprintf(stderr, "receiver error %s: %s\n", id.c_str(), m.c_str());
        std::abort();
      };
      SenderCallbacks scb;
      scb.on_sent = [](const std::string&) {};
      scb.on_error = [](const std::string& id, const std::string& m) {
        std::fprintf(stderr, "sender error %s: %s\n", id.c_str(), m.c_str());
        std::abort();
      };
      std::vector<std::unique_ptr<Pool>> dst_pools, src_pools;
      std::vector<std::unique_ptr<TransferReceiver>> rxs;
      std::vector<std::unique_ptr<TransferSender>> txs;
      for (int r = 0; r < nrx; ++r) {
        dst_pools.push_back(std::make_unique<Pool>(
            KvGeometry{layers, pages * nreq, kHeads / nrx, kPage, kHd}, model_stream));
        rxs.push_back(backend->make_receiver(dst_pools.back()->cache, rcb));
      }
      for (int s = 0; s < src_tp; ++s) {
        src_pools.push_back(std::make_unique<Pool>(
            KvGeometry{layers, pages * nreq, kHeads / src_tp, kPage, kHd}, model_stream));
        txs.push_back(backend->make_sender(src_pools.back()->cache, sharding, s, scb));
      }
      auto run = [&](bool with_compute, double& ms, double& tail_us) {
        {
          std::lock_guard<std::mutex> l(mu);
          complete = 0;
        }
        static int serial = 0;
        std::vector<std::string> ids;
        for (int q = 0; q < nreq; ++q) {
          const std::string id = "r" + std::to_string(serial++);
          ids.push_back(id);
          std::vector<TransferDescriptor> ds;
          std::vector<int32_t> table(static_cast<size_t>(pages));
          for (int64_t p = 0; p < pages; ++p)
            table[static_cast<size_t>(p)] = static_cast<int32_t>(q * pages + p);
          for (int r = 0; r < nrx; ++r) {
            TransferDescriptor d;
            d.request_id = id;
            d.dst_address = rxs[r]->address();
            d.dst_pages = table;
            d.dst_heads = {r * kHeads / nrx, (r + 1) * kHeads / nrx};
            d.src = sharding;
            d.num_tokens = tokens;
            d.page_size = kPage;
            d.head_dim = kHd;
            d.num_layers = layers;
            rxs[r]->expect(d);
            ds.push_back(d);
          }
          for (auto& tx : txs) tx->begin(id, ds, table);
        }
        TANDEM_CUDA_CHECK(cudaStreamSynchronize(model_stream));
        const auto t0 = Clock::now();
        cudaEvent_t last = nullptr;
        TANDEM_CUDA_CHECK(cudaEventCreate(&last));
        if (with_compute) {
          for (int64_t l = 0; l < layers; ++l) {
            spin_kernel<<<1, 32, 0, model_stream>>>(static_cast<long long>(clock_khz));
            for (auto& tx : txs) tx->send_layers(ids, l);
          }
        } else {  // each sender on its own thread, as prefill ranks are their own processes
          std::vector<std::thread> threads;
          for (auto& tx : txs) {
            threads.emplace_back([&, t = tx.get()] {
              for (int64_t l = 0; l < layers; ++l) t->send_layers(ids, l);
            });
          }
          for (auto& t : threads) t.join();
        }
        TANDEM_CUDA_CHECK(cudaEventRecord(last, model_stream));
        for (auto& tx : txs)
          for (auto& id : ids) tx->finish(id, 1, 0.f);
        TANDEM_CUDA_CHECK(cudaEventSynchronize(last));
        const auto t_last = Clock::now();
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return complete == nreq * nrx; });
        ms = std::chrono::duration<double, std::milli>(t_done - t0).count();
        tail_us = std::chrono::duration<double, std::micro>(t_done - t_last).count();
        if (t_done < t_last) tail_us = 0;
        cudaEventDestroy(last);
      };
      double ms = 0, tail = 0, best = 1e30;
      run(false, ms, tail);  // warm-up (registration)
      for (int rep = 0; rep < 3; ++rep) {
        run(false, ms, tail);
        best = std::min(best, ms);
      }
      double ms_c = 0, tail_c = 0;
      run(true, ms_c, tail_c);
      // Baseline: one cudaMemcpy of the same bytes, device to device.
      const size_t bytes = static_cast<size_t>(req_bytes) * nreq;
      void *a = nullptr, *b = nullptr;
      TANDEM_CUDA_CHECK(cudaMalloc(&a, bytes));
      TANDEM_CUDA_CHECK(cudaMalloc(&b, bytes));
      cudaEvent_t e0, e1;
      cudaEventCreate(&e0);
      cudaEventCreate(&e1);
      float mc = 1e30f;
      for (int rep = 0; rep < 4; ++rep) {
        cudaEventRecord(e0, model_stream);
        cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, model_stream);
        cudaEventRecord(e1, model_stream);
        cudaEventSynchronize(e1);
        float t = 0;
        cudaEventElapsedTime(&t, e0, e1);
        if (rep > 0) mc = std::min(mc, t);
      }
      cudaFree(a);
      cudaFree(b);
      Result r{shape, nreq, best, req_bytes * nreq / (best * 1e6), bytes / (mc * 1e6), tail_c};
      results.push_back(r);
      std::printf(
          "%-9s x%d: %8.2f ms  %7.1f GB/s  (cudaMemcpy D2D %7.1f GB/s, %.2fx)  "
          "streamed behind 1 ms/layer compute: complete %.0f us after the last layer\n",
          shape, nreq, best, r.gbps, r.memcpy_gbps, r.gbps / r.memcpy_gbps, tail_c);
    }
  }
  std::printf("\n== summary (KV GB/s = request bytes / time; cudaMemcpy moves the same bytes)\n");
  std::printf(
      "| shape | requests | ms | GB/s | cudaMemcpy GB/s | ratio | tail after last layer (us) |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (const auto& r : results) {
    std::printf("| %s | %d | %.2f | %.1f | %.1f | %.2f | %.0f |\n", r.shape.c_str(), r.requests,
                r.ms, r.gbps, r.memcpy_gbps, r.gbps / r.memcpy_gbps, r.tail_us);
  }
  if (const char* csv = std::getenv("TANDEM_BENCH_CSV")) {
    std::ofstream f(csv);
    f << "shape,requests,ms,gbps,memcpy_gbps,tail_us\n";
    for (const auto& r : results)
      f << r.shape << "," << r.requests << "," << r.ms << "," << r.gbps << "," << r.memcpy_gbps
        << "," << r.tail_us << "\n";
  }
  return 0;
}
