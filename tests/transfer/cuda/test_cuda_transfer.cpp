// The device KV transfer: the kv_copy kernel against its CPU reference, and the cuda-ipc
// backend end to end across processes on one GPU (prefill ranks -> decode rank, head merge,
// page sizes that differ, a cancel). Every CUDA call runs in forked children (fork after
// CUDA init is undefined), so the parent never touches the GPU; skips without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/local_launcher.h"
#include "comm/tcp_store.h"
#include "core/cuda_check.h"
#include "core/error.h"
#include "kv/kv_cache.h"
#include "transfer/cuda/cuda_ipc_transfer.h"
#include "transfer/cuda/kv_copy.h"

namespace tandem::transfer {
namespace {

int visible_gpus() {
  static const int n = comm::run_in_child(
      [] {
        int c = 0;
        return cudaGetDeviceCount(&c) == cudaSuccess ? c : 0;
      },
      0);
  return n;
}

#define REQUIRE_GPU() \
  if (visible_gpus() == 0) GTEST_SKIP() << "no CUDA device"

constexpr uint16_t kPoison = 0xFFC1;  // a bf16 NaN

// Random bf16 bits that are finite and never the poison.
void fill_random(std::vector<uint16_t>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (auto& x : v) x = static_cast<uint16_t>(0x3C00 + rng() % 0x0400);
}

std::vector<int32_t> random_pages(int64_t count, int64_t num_pages, uint64_t seed) {
  std::vector<int32_t> all(static_cast<size_t>(num_pages));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<size_t>(count));
  return all;
}

// A device pool for a KvCache (one allocation, all layers), filled from host bits.
struct DevicePool {
  KvGeometry g;
  std::shared_ptr<void> mem;
  cudaStream_t stream = nullptr;
  KvCache cache;

  DevicePool(KvGeometry geom, const std::vector<uint16_t>& host) : g(geom) {
    g.dtype = DType::kBF16;
    const size_t bytes = host.size() * 2;
    void* p = nullptr;
    TANDEM_CUDA_CHECK(cudaMalloc(&p, bytes));
    mem = std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
    TANDEM_CUDA_CHECK(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice));
    TANDEM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    KvCache::External ext;
    const size_t layer = static_cast<size_t>(g.page_elems() * g.num_pages) * 2;
    for (int64_t l = 0; l < g.num_layers; ++l)
      ext.layers.push_back(static_cast<char*>(p) + l * layer);
    ext.owner = mem;
    ext.stream = stream;
    cache = KvCache(g, std::move(ext));
  }
  std::vector<uint16_t> read() const {
    std::vector<uint16_t> h(static_cast<size_t>(g.page_elems() * g.num_pages * g.num_layers));
    TANDEM_CUDA_CHECK(cudaDeviceSynchronize());
    TANDEM_CUDA_CHECK(cudaMemcpy(h.data(), mem.get(), h.size() * 2, cudaMemcpyDeviceToHost));
    return h;
  }
};

TEST(KvCopy, MatchesReferenceOnRandomShapes) {
  REQUIRE_GPU();
  const int rc = comm::run_in_child(
      [] {
        std::mt19937_64 rng(1234);
        for (int trial = 0; trial < 12; ++trial) {
          const int hd = (trial % 3 == 0) ? 64 : 128;
          const int src_heads = 1 + static_cast<int>(rng() % 4),
                    dst_heads = 1 + static_cast<int>(rng() % 8);
          const int nh = 1 + static_cast<int>(rng() % std::min(src_heads, dst_heads));
          const int so = static_cast<int>(rng() % (src_heads - nh + 1));
          const int dof = static_cast<int>(rng() % (dst_heads - nh + 1));
          const int sps = 1 << (rng() % 5), dps = 1 << (rng() % 5);
          const int64_t tokens = 1 + static_cast<int64_t>(rng() % 300);
          const int64_t tb = static_cast<int64_t>(rng() % tokens);
          const int64_t sp_need = (tokens + sps - 1) / sps, dp_need = (tokens + dps - 1) / dps;
          const int64_t snp = sp_need + 5, dnp = dp_need + 7;
          std::vector<uint16_t> src(static_cast<size_t>(snp * 2 * src_heads * sps * hd));
          std::vector<uint16_t> dst(static_cast<size_t>(dnp * 2 * dst_heads * dps * hd), kPoison);
          fill_random(src, rng());
          auto st = random_pages(sp_need, snp, rng()), dt = random_pages(dp_need, dnp, rng());
          cuda::KvCopyParams p{};
          p.src_heads = src_heads;
          p.src_page_size = sps;
          p.head_dim = hd;
          p.num_dests = 1;
          cuda::KvCopyDest& dd = p.dests[0];
          dd.token_begin = tb;
          dd.token_end = tokens;
          dd.dst_heads = dst_heads;
          dd.src_head_offset = so;
          dd.dst_head_offset = dof;
          dd.num_heads = nh;
          dd.dst_page_size = dps;
          // Reference on the host.
          std::vector<uint16_t> want = dst;
          p.src = src.data();
          dd.dst = want.data();
          dd.src_table = st.data();
          dd.dst_table = dt.data();
          cuda::kv_copy_reference(p);
          // The kernel.
          uint16_t *d_src, *d_dst;
          int32_t *d_st, *d_dt;
          TANDEM_CUDA_CHECK(cudaMalloc(&d_src, src.size() * 2));
          TANDEM_CUDA_CHECK(cudaMalloc(&d_dst, dst.size() * 2));
          TANDEM_CUDA_CHECK(cudaMalloc(&d_st, st.size() * 4));
          TANDEM_CUDA_CHECK(cudaMalloc(&d_dt, dt.size() * 4));
          TANDEM_CUDA_CHECK(cudaMemcpy(d_src, src.data(), src.size() * 2, cudaMemcpyHostToDevice));
          TANDEM_CUDA_CHECK(cudaMemcpy(d_dst, dst.data(), dst.size() * 2, cudaMemcpyHostToDevice));
          TANDEM_CUDA_CHECK(cudaMemcpy(d_st, st.data(), st.size() * 4, cudaMemcpyHostToDevice));
          TANDEM_CUDA_CHECK(cudaMemcpy(d_dt, dt.data(), dt.size() * 4, cudaMemcpyHostToDevice));
          p.src = d_src;
          dd.dst = d_dst;
          dd.src_table = d_st;
          dd.dst_table = d_dt;
          cuda::kv_copy_launch(p, nullptr);
          std::vector<uint16_t> got(dst.size());
          TANDEM_CUDA_CHECK(cudaMemcpy(got.data(), d_dst, got.size() * 2, cudaMemcpyDeviceToHost));
          cudaFree(d_src);
          cudaFree(d_dst);
          cudaFree(d_st);
          cudaFree(d_dt);
          size_t moved = 0;
          for (size_t i = 0; i < want.size(); ++i) moved += want[i] != kPoison;
          if (moved == 0 || got != want) {
            std::fprintf(stderr,
                         "trial %d: mismatch (hd %d, heads %d->%d, %d from %d/%d, pages %d/%d)\n",
                         trial, hd, src_heads, dst_heads, nh, so, dof, sps, dps);
            return 1;
          }
        }
        return 0;
      },
      2);
  EXPECT_EQ(rc, 0);
}

// A split 4 -> 1+1+1+1 in one launch: each destination its own page size, pages and head.
TEST(KvCopy, SeveralDestinationsInOneLaunch) {
  REQUIRE_GPU();
  const int rc = comm::run_in_child(
      [] {
        constexpr int hd = 128, heads = 4, sps = 16;
        constexpr int64_t tokens = 333, snp = 30;
        std::vector<uint16_t> src(static_cast<size_t>(snp * 2 * heads * sps * hd));
        fill_random(src, 7);
        auto st = random_pages((tokens + sps - 1) / sps, snp, 8);
        cuda::KvCopyParams p{};
        p.src_heads = heads;
        p.src_page_size = sps;
        p.head_dim = hd;
        p.num_dests = heads;
        std::vector<std::vector<uint16_t>> want(heads), got(heads);
        std::vector<std::vector<int32_t>> dt(heads);
        std::vector<uint16_t*> d_dst(heads);
        std::vector<int32_t*> d_dt(heads);
        for (int i = 0; i < heads; ++i) {
          const int dps = 4 << i;
          const int64_t dnp = (tokens + dps - 1) / dps + 3;
          want[i].assign(static_cast<size_t>(dnp * 2 * dps * hd), kPoison);
          dt[i] = random_pages((tokens + dps - 1) / dps, dnp, 20 + i);
          cuda::KvCopyDest& d = p.dests[i];
          d.token_begin = 5 + i;  // (as if four requests: other ranges, one launch)
          d.token_end = tokens - 7 * i;
          d.dst_heads = 1;
          d.src_head_offset = i;
          d.num_heads = 1;
          d.dst_page_size = dps;
          TANDEM_CUDA_CHECK(cudaMalloc(&d_dst[i], want[i].size() * 2));
          TANDEM_CUDA_CHECK(
              cudaMemcpy(d_dst[i], want[i].data(), want[i].size() * 2, cudaMemcpyHostToDevice));
          TANDEM_CUDA_CHECK(cudaMalloc(&d_dt[i], dt[i].size() * 4));
          TANDEM_CUDA_CHECK(
              cudaMemcpy(d_dt[i], dt[i].data(), dt[i].size() * 4, cudaMemcpyHostToDevice));
        }
        cuda::KvCopyParams h = p;
        h.src = src.data();
        for (int i = 0; i < heads; ++i) {
          h.dests[i].src_table = st.data();
          h.dests[i].dst = want[i].data();
          h.dests[i].dst_table = dt[i].data();
        }
        cuda::kv_copy_reference(h);
        uint16_t* d_src = nullptr;
        int32_t* d_st = nullptr;
        TANDEM_CUDA_CHECK(cudaMalloc(&d_src, src.size() * 2));
        TANDEM_CUDA_CHECK(cudaMemcpy(d_src, src.data(), src.size() * 2, cudaMemcpyHostToDevice));
        TANDEM_CUDA_CHECK(cudaMalloc(&d_st, st.size() * 4));
        TANDEM_CUDA_CHECK(cudaMemcpy(d_st, st.data(), st.size() * 4, cudaMemcpyHostToDevice));
        p.src = d_src;
        for (int i = 0; i < heads; ++i) {
          p.dests[i].src_table = d_st;
          p.dests[i].dst = d_dst[i];
          p.dests[i].dst_table = d_dt[i];
        }
        cuda::kv_copy_launch(p, nullptr);
        for (int i = 0; i < heads; ++i) {
          got[i].resize(want[i].size());
          TANDEM_CUDA_CHECK(
              cudaMemcpy(got[i].data(), d_dst[i], got[i].size() * 2, cudaMemcpyDeviceToHost));
          if (got[i] != want[i]) {
            std::fprintf(stderr, "destination %d differs\n", i);
            return 1;
          }
        }
        return 0;
      },
      2);
  EXPECT_EQ(rc, 0);
}

// Rank 0 is the decode rank (4 KV heads, page 8); ranks 1..2 are prefill TP=2 ranks (2 heads
// each, page 4). Request "a" completes with its KV merged; request "b" is cancelled by the
// receiver after the senders began it, and the senders see it fail.
TEST(CudaIpc, PrefillRanksToDecodeRankAcrossProcesses) {
  REQUIRE_GPU();
  constexpr int64_t kLayers = 3, kHeads = 4, kHd = 64, kTokens = 37;
  const KvSharding src{kHeads, 2};
  auto source_bits = [&](int prank) {  // prefill rank prank's pool
    std::vector<uint16_t> v(static_cast<size_t>(kLayers * 20 * 2 * 2 * 4 * kHd));
    fill_random(v, 99 + prank);
    return v;
  };
  auto src_table = [] { return random_pages(10, 20, 5); };
  auto dst_table = [] { return random_pages(5, 7, 6); };  // pages 7..11 are "b"'s
  auto results = comm::run_local_ranks(
      3,
      [&](int rank) {
        comm::RankEnv env = comm::RankEnv::from_env();
        comm::TcpStore store(comm::TcpStoreOptions::of(env));
        auto backend = make_cuda_ipc_backend();
        TransferDescriptor d;
        d.request_id = "a";
        d.dst_heads = {0, kHeads};
        d.src = src;
        d.num_tokens = kTokens;
        d.page_size = 8;
        d.head_dim = kHd;
        d.num_layers = kLayers;
        d.dst_pages = dst_table();
        if (rank == 0) {
          KvGeometry g{kLayers, 12, kHeads, 8, kHd};
          DevicePool pool(
              g, std::vector<uint16_t>(static_cast<size_t>(kLayers * 12 * 2 * kHeads * 8 * kHd),
                                       kPoison));
          std::mutex mu;
          std::condition_variable cv;
          std::set<std::string> complete, failed;
          int32_t token = -1;
          ReceiverCallbacks cbs;
          cbs.on_complete = [&](const std::string& id, int32_t t, float) {
            std::lock_guard<std::mutex> l(mu);
            complete.insert(id);
            token = t;
            cv.notify_all();
          };
          cbs.on_error = [&](const std::string& id, const std::string&) {
            std::lock_guard<std::mutex> l(mu);
            failed.insert(id);
            cv.notify_all();
          };
          auto rx = backend->make_receiver(pool.cache, cbs);
          d.dst_address = rx->address();
          rx->expect(d);
          TransferDescriptor b = d;  // pages disjoint from "a"'s
          b.request_id = "b";
          b.dst_pages = {11, 10, 9, 8, 7};
          std::set<int32_t> used(d.dst_pages.begin(), d.dst_pages.end());
          for (int32_t p : b.dst_pages) TANDEM_CHECK(!used.count(p), "test: pages overlap");
          rx->expect(b);
          store.set("addr", rx->address());
          {
            std::unique_lock<std::mutex> l(mu);
            TANDEM_CHECK(
                cv.wait_for(l, std::chrono::seconds(60), [&] { return complete.count("a"); }),
                "request a did not complete");
          }
          TANDEM_CHECK(token == 42, "first token ", token);
          store.get("b_begun");
          TANDEM_CHECK(rx->cancel("b"), "cancel b");
          TANDEM_CHECK(!rx->cancel("b"), "cancel b twice");
          // Expected pool: every page of "a" holds the merged heads, the rest stays poison.
          std::vector<uint16_t> want(static_cast<size_t>(kLayers * 12 * 2 * kHeads * 8 * kHd),
                                     kPoison);
          for (int pr = 0; pr < 2; ++pr) {
            auto s = source_bits(pr);
            auto st = src_table();
            for (int64_t l = 0; l < kLayers; ++l) {
              cuda::KvCopyParams p{};
              p.src = s.data() + l * 20 * 2 * 2 * 4 * kHd;
              p.src_heads = 2;
              p.src_page_size = 4;
              p.head_dim = kHd;
              p.num_dests = 1;
              p.dests[0].src_table = st.data();
              p.dests[0].token_end = kTokens;
              p.dests[0].dst = want.data() + l * 12 * 2 * kHeads * 8 * kHd;
              p.dests[0].dst_table = d.dst_pages.data();
              p.dests[0].dst_heads = kHeads;
              p.dests[0].src_head_offset = 0;
              p.dests[0].dst_head_offset = 2 * pr;
              p.dests[0].num_heads = 2;
              p.dests[0].dst_page_size = 8;
              cuda::kv_copy_reference(p);
            }
          }
          // Pages of "b" may have been partly written before the cancel: compare the others.
          auto got = pool.read();
          const int64_t page_elems = 2 * kHeads * 8 * kHd;
          for (int64_t l = 0; l < kLayers; ++l) {
            for (int64_t pg = 0; pg < 12; ++pg) {
              if (pg >= 7) continue;  // "b"'s pages
              const size_t off = static_cast<size_t>((l * 12 + pg) * page_elems);
              TANDEM_CHECK(std::equal(want.begin() + off, want.begin() + off + page_elems,
                                      got.begin() + off),
                           "layer ", l, " page ", pg, " differs");
            }
          }
          store.set("checked", "1");
        } else {
          const int prank = rank - 1;
          KvGeometry g{kLayers, 20, 2, 4, kHd};
          DevicePool pool(g, source_bits(prank));
          std::mutex mu;
          std::condition_variable cv;
          std::set<std::string> sent, failed;
          SenderCallbacks cbs;
          cbs.on_sent = [&](const std::string& id) {
            std::lock_guard<std::mutex> l(mu);
            sent.insert(id);
            cv.notify_all();
          };
          cbs.on_error = [&](const std::string& id, const std::string&) {
            std::lock_guard<std::mutex> l(mu);
            failed.insert(id);
            cv.notify_all();
          };
          auto tx = backend->make_sender(pool.cache, src, prank, cbs);
          d.dst_address = store.get_string("addr");
          tx->begin("a", {d}, src_table());
          for (int64_t l = kLayers - 1; l >= 0; --l) {  // any order, in two token ranges
            tx->send_layer("a", l, {0, 20});
            tx->send_layer("a", l, {20, -1});
          }
          tx->finish("a", 42, -0.5f);
          {
            std::unique_lock<std::mutex> l(mu);
            TANDEM_CHECK(cv.wait_for(l, std::chrono::seconds(60), [&] { return sent.count("a"); }),
                         "request a not sent");
          }
          TransferDescriptor b = d;
          b.request_id = "b";
          b.dst_pages = {11, 10, 9, 8, 7};
          tx->begin("b", {b}, src_table());
          tx->send_layer("b", 0);
          store.add("b_count", 1);
          if (prank == 1) {
            while (store.add("b_count", 0) < 2)
              std::this_thread::sleep_for(std::chrono::milliseconds(5));
            store.set("b_begun", "1");
          }
          {
            std::unique_lock<std::mutex> l(mu);
            TANDEM_CHECK(
                cv.wait_for(l, std::chrono::seconds(60), [&] { return failed.count("b"); }),
                "the cancel of b did not reach the sender");
          }
          tx->abort("b");
          store.get("checked");
        }
        store.barrier();
      },
      std::chrono::seconds(120));
  EXPECT_EQ(comm::describe_failures(results), "");
}

}  // namespace
}  // namespace tandem::transfer
