// The device KV transfer: the kv_copy kernel against its CPU reference, and the cuda-ipc
// backend end to end across processes on one GPU (prefill ranks -> decode rank, head merge,
// page sizes that differ, a cancel; the prompt's hidden states; a hybrid's recurrent state
// slot to slot, and from a prefill TP rank's device buffer: the whole state its model gathered).
// Every CUDA call runs in forked children (fork after CUDA init is undefined), so the parent never
// touches the GPU; skips without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
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

// A device pool for a KvCache (one allocation, all layers), filled from host bits; with
// state_slots > 0 also device state slots (one allocation, as a GPU model's alloc_states).
struct DevicePool {
  KvGeometry g;
  std::shared_ptr<void> mem;
  cudaStream_t stream = nullptr;
  KvCache cache;

  DevicePool(KvGeometry geom, const std::vector<uint16_t>& host, int64_t state_slots = 0,
             int64_t slot_elems = 0)
      : g(geom) {
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
    if (state_slots > 0) {
      ext.alloc_states = [](size_t bytes) {
        void* q = nullptr;
        TANDEM_CUDA_CHECK(cudaMalloc(&q, bytes));
        TANDEM_CUDA_CHECK(cudaMemset(q, 0, bytes));
        return std::shared_ptr<void>(q, [](void* x) { cudaFree(x); });
      };
      ext.copy_states = [](void* dst, const void* src, size_t bytes, int kind) {
        TANDEM_CUDA_CHECK(cudaMemcpy(dst, src, bytes, static_cast<cudaMemcpyKind>(kind)));
      };
    }
    cache = KvCache(g, std::move(ext));
    if (state_slots > 0) cache.allocate_states(state_slots, slot_elems);
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
          // Odd trials: an FP8 KV cache (--kv-cache-dtype fp8), 1-byte elements (the pools'
          // uint16_t words then hold two).
          const int eb = trial % 2 == 0 ? 2 : 1;
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
          std::vector<uint16_t> src(static_cast<size_t>(snp * 2 * src_heads * sps * hd * eb / 2));
          std::vector<uint16_t> dst(static_cast<size_t>(dnp * 2 * dst_heads * dps * hd * eb / 2),
                                    kPoison);
          fill_random(src, rng());
          auto st = random_pages(sp_need, snp, rng()), dt = random_pages(dp_need, dnp, rng());
          cuda::KvCopyParams p{};
          p.src_heads = src_heads;
          p.src_page_size = sps;
          p.head_dim = hd;
          p.elem_bytes = eb;
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
                         "trial %d: mismatch (hd %d x %d bytes, heads %d->%d, %d from %d/%d, "
                         "pages %d/%d)\n",
                         trial, hd, eb, src_heads, dst_heads, nh, so, dof, sps, dps);
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

// Random f32 bits (NaN payloads, infinities, -0 and denormals included) for rows [begin, tokens)
// of a prompt's hidden states: both sides make the same ones from the seed.
std::vector<float> hidden_rows(int64_t tokens, int64_t begin, int64_t hidden, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>((tokens - begin) * hidden));
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < v.size(); i += 2) {
    const uint64_t u = rng();
    std::memcpy(&v[i], &u, std::min<size_t>(8, (v.size() - i) * 4));
  }
  return v;
}

// MTP on the decode side (descriptor hidden_size > 0) over cuda-ipc, as the TCP backend's
// TcpTransfer.PromptHiddenStatesTravelBeforeTheFinish: the prompt's final hidden states of a
// 32k-token prompt at hidden 2048 (256 MiB of f32, 256 times the control frames' 1 MiB limit)
// travel from one sending rank before its FINISH and reach on_hidden right before on_complete
// bit for bit, from row 0 or from a later row (a prefix-cache hit at the prefill). Rank 0 is the
// decode rank (4 KV heads), ranks 1..2 the prefill TP=2 ranks. Requests, one after the other:
//   a      every row from prefill rank 0               -> complete, rows intact
//   p      rows 8.. from prefill rank 1                -> complete, rows from 8 intact
//   n      asked for, nobody sends them                -> fails ("hidden states")
//   w      rows short of the prompt's end; a state     -> refused at the sender (then aborted)
//   plain  asks for none: rows refused at the sender   -> completes without on_hidden
//   cut    the receiver cancels while rank 0 streams   -> cancel() true, within 5 s (well under
//          the 10 s control timeout a lost ack would cost: the CANCEL and its ack pass between
//          chunks), no receiver callback after it, one sender callback each
//   after  the same connections after the cut          -> complete, rows intact (the cut's
//          late chunks are dropped, not mistaken for this request's)
//   gone   rank 0's sender destroyed while streaming   -> fails (lost connection), no sender
//          callback
TEST(CudaIpc, PromptHiddenStatesTravelBeforeTheFinish) {
  REQUIRE_GPU();
  constexpr int64_t kLayers = 2, kHeads = 4, kHd = 64, kTokens = 32768, kHidden = 2048;
  constexpr int64_t kPage = 16, kPages = kTokens / kPage;
  const KvSharding src{kHeads, 2};
  std::vector<int32_t> table(static_cast<size_t>(kPages));
  std::iota(table.begin(), table.end(), 0);
  auto seed = [](const std::string& id) { return std::hash<std::string>()(id); };
  auto results = comm::run_local_ranks(
      3,
      [&](int rank) {
        comm::RankEnv env = comm::RankEnv::from_env();
        comm::TcpStore store(comm::TcpStoreOptions::of(env));
        auto backend = make_cuda_ipc_backend();
        TANDEM_CHECK(backend->carries_prompt_hidden(), "cuda-ipc carries no hidden states");
        TransferDescriptor d;
        d.dst_heads = {0, kHeads};
        d.src = src;
        d.num_tokens = kTokens;
        d.page_size = kPage;
        d.head_dim = kHd;
        d.num_layers = kLayers;
        d.dst_pages = table;
        std::mutex mu;
        std::condition_variable cv;
        auto wait = [&](auto done) {
          std::unique_lock<std::mutex> l(mu);
          return cv.wait_for(l, std::chrono::seconds(60), done);
        };
        if (rank == 0) {
          KvGeometry g{kLayers, kPages, kHeads, kPage, kHd};
          DevicePool pool(
              g, std::vector<uint16_t>(
                     static_cast<size_t>(kLayers * kPages * 2 * kHeads * kPage * kHd), kPoison));
          std::vector<std::string> order;  // "hidden id", "complete id", "error id"
          std::map<std::string, PromptHidden> hidden;
          std::map<std::string, std::string> errors;
          ReceiverCallbacks cbs;
          cbs.on_complete = [&](const std::string& id, int32_t t, float) {
            std::lock_guard<std::mutex> l(mu);
            order.push_back("complete " + id);
            if (t != 42) errors[id] = "first token " + std::to_string(t);
            cv.notify_all();
          };
          cbs.on_error = [&](const std::string& id, const std::string& m) {
            std::lock_guard<std::mutex> l(mu);
            order.push_back("error " + id);
            errors[id] = m;
            cv.notify_all();
          };
          cbs.on_hidden = [&](const std::string& id, PromptHidden h) {
            std::lock_guard<std::mutex> l(mu);
            order.push_back("hidden " + id);
            hidden[id] = std::move(h);
          };
          auto rx = backend->make_receiver(pool.cache, cbs);
          store.set("addr", rx->address());
          auto expect = [&](const std::string& id, int64_t hidden_size) {
            TransferDescriptor x = d;
            x.request_id = id;
            x.dst_address = rx->address();
            x.hidden_size = hidden_size;
            rx->expect(x);
            store.set("ready_" + id, "1");
          };
          auto ended = [&](const std::string& id) {
            return std::find(order.begin(), order.end(), "complete " + id) != order.end() ||
                   errors.count(id);
          };
          auto complete_with = [&](const std::string& id, int64_t begin) {
            const auto want = hidden_rows(kTokens, begin, kHidden, seed(id));
            TANDEM_CHECK(wait([&] { return ended(id); }), "request ", id, " did not end");
            std::lock_guard<std::mutex> l(mu);
            TANDEM_CHECK(!errors.count(id), "request ", id, " failed: ", errors[id]);
            auto it = hidden.find(id);
            TANDEM_CHECK(it != hidden.end(), "request ", id, ": no hidden states");
            TANDEM_CHECK(it->second.begin == begin, "request ", id, ": rows from ",
                         it->second.begin);
            TANDEM_CHECK(it->second.rows.size() == want.size() &&
                             std::memcmp(it->second.rows.data(), want.data(),
                                         want.size() * sizeof(float)) == 0,
                         "request ", id, ": the hidden states differ");
            hidden.erase(it);
          };
          auto fails_with = [&](const std::string& id, const std::string& why) {
            TANDEM_CHECK(wait([&] { return ended(id); }), "request ", id, " did not end");
            std::lock_guard<std::mutex> l(mu);
            TANDEM_CHECK(errors.count(id) && errors[id].find(why) != std::string::npos, "request ",
                         id, " should fail with '", why,
                         "': ", errors.count(id) ? errors[id] : "it completed");
            TANDEM_CHECK(!hidden.count(id), "request ", id, ": hidden states of a failed one");
          };
          expect("a", kHidden);
          complete_with("a", 0);
          expect("p", kHidden);
          complete_with("p", 8);
          expect("n", kHidden);
          fails_with("n", "without the prompt's hidden states");
          expect("w", kHidden);
          fails_with("w", "aborted");
          expect("plain", 0);
          TANDEM_CHECK(wait([&] { return ended("plain"); }), "request plain did not end");
          expect("cut", kHidden);
          store.get("cut_streaming");
          const auto t0 = std::chrono::steady_clock::now();
          TANDEM_CHECK(rx->cancel("cut"), "cancel of cut");
          const auto took = std::chrono::steady_clock::now() - t0;
          TANDEM_CHECK(took < std::chrono::seconds(5), "the cancel waited ",
                       std::chrono::duration_cast<std::chrono::milliseconds>(took).count(),
                       " ms for the senders' acks");
          store.set("cut_cancelled", "1");
          expect("after", kHidden);
          complete_with("after", 0);
          expect("gone", kHidden);
          fails_with("gone", "lost the control connection");
          store.get("senders_done");
          std::lock_guard<std::mutex> l(mu);
          const std::vector<std::string> want = {
              "hidden a", "complete a",     "hidden p",     "complete p",     "error n",
              "error w",  "complete plain", "hidden after", "complete after", "error gone"};
          std::string got;
          for (const auto& o : order) got += o + "; ";
          TANDEM_CHECK(order == want, "callbacks in the order: ", got);
        } else {
          const int prank = rank - 1;
          KvGeometry g{kLayers, kPages, 2, kPage, kHd};
          std::vector<uint16_t> bits(static_cast<size_t>(kLayers * kPages * 2 * 2 * kPage * kHd));
          fill_random(bits, 500 + prank);
          DevicePool pool(g, bits);
          std::map<std::string, std::string> outcome;  // the first: "sent" or "error: message"
          std::map<std::string, int> calls;
          SenderCallbacks cbs;
          cbs.on_sent = [&](const std::string& id) {
            std::lock_guard<std::mutex> l(mu);
            if (!calls[id]++) outcome[id] = "sent";
            cv.notify_all();
          };
          cbs.on_error = [&](const std::string& id, const std::string& m) {
            std::lock_guard<std::mutex> l(mu);
            if (!calls[id]++) outcome[id] = "error: " + m;
            cv.notify_all();
          };
          auto tx = backend->make_sender(pool.cache, src, prank, cbs);
          const std::string addr = store.get_string("addr");
          auto begin = [&](const std::string& id, int64_t hidden_size) {
            store.get("ready_" + id);
            TransferDescriptor x = d;
            x.request_id = id;
            x.dst_address = addr;
            x.hidden_size = hidden_size;
            tx->begin(id, {x}, table);
            for (int64_t l = 0; l < kLayers; ++l) tx->send_layer(id, l);
            // Both ranks began before either ends it (a failure could refuse a later BEGIN).
            store.add(id + "_begun", 1);
            while (store.add(id + "_begun", 0) < 2) {
              std::this_thread::sleep_for(std::chrono::milliseconds(2));
            }
          };
          auto rows = [&](const std::string& id, int64_t begin) {
            return PromptHidden{begin, hidden_rows(kTokens, begin, kHidden, seed(id))};
          };
          auto result = [&](const std::string& id) {
            TANDEM_CHECK(wait([&] { return outcome.count(id); }), "no callback for ", id);
            std::lock_guard<std::mutex> l(mu);
            return outcome[id];
          };
          auto expect_kind = [&](ErrorKind kind, const std::function<void()>& fn,
                                 const std::string& what) {
            try {
              fn();
            } catch (const Error& e) {
              TANDEM_CHECK(e.kind() == kind, what, ": ", e.what());
              return;
            }
            TANDEM_CHECK(false, what, " was not refused");
          };
          for (const std::string id : {"a", "p"}) {
            begin(id, kHidden);
            const int from = id == "a" ? 0 : 1;
            if (prank == from) {
              tx->finish_with(id, 42, -0.5f, {{}, rows(id, id == "a" ? 0 : 8)});
            } else {
              tx->finish(id, 42, -0.5f);
            }
            TANDEM_CHECK(result(id) == "sent", id, ": ", result(id));
          }
          begin("n", kHidden);
          tx->finish("n", 42, -0.5f);
          result("n");  // (the receiver fails it; a cuda-ipc sender hears "sent")
          begin("w", kHidden);
          if (prank == 0) {
            PromptHidden h = rows("w", 0);
            h.rows.resize(h.rows.size() - kHidden);
            expect_kind(
                ErrorKind::kInvalidArgument,
                [&] {
                  tx->finish_with("w", 42, -0.5f, {{}, h});
                },
                "rows short of the prompt's end");
            expect_kind(
                ErrorKind::kUnsupported, [&] { tx->finish_with_state("w", 42, -0.5f, {1.f}); },
                "a recurrent state");
          }
          tx->abort("w");
          begin("plain", 0);
          if (prank == 0) {
            expect_kind(
                ErrorKind::kInvalidArgument,
                [&] {
                  tx->finish_with("plain", 42, -0.5f, {{}, rows("plain", 0)});
                },
                "hidden states where none were asked for");
          }
          tx->finish("plain", 42, -0.5f);
          TANDEM_CHECK(result("plain") == "sent", "plain: ", result("plain"));
          begin("cut", kHidden);
          if (prank == 0) {
            tx->finish_with("cut", 42, -0.5f, {{}, rows("cut", 0)});
            store.set("cut_streaming", "1");
            result("cut");  // one callback: "sent" or the cancel, by timing
          } else {
            store.get("cut_cancelled");  // rank 1 has not finished: the cut cannot complete
            TANDEM_CHECK(result("cut").find("cancelled") != std::string::npos,
                         "cut: ", result("cut"));
            tx->abort("cut");
          }
          begin("after", kHidden);
          if (prank == 0) {
            tx->finish_with("after", 42, -0.5f, {{}, rows("after", 0)});
          } else {
            tx->finish("after", 42, -0.5f);
          }
          TANDEM_CHECK(result("after") == "sent", "after: ", result("after"));
          begin("gone", kHidden);
          if (prank == 0) {
            tx->finish_with("gone", 42, -0.5f, {{}, rows("gone", 0)});
            tx.reset();  // stops at its next chunk (long before 256 MiB are out): no FINISH
            std::this_thread::sleep_for(std::chrono::milliseconds(200));
            std::lock_guard<std::mutex> l(mu);
            TANDEM_CHECK(!outcome.count("gone"),
                         "a callback after the sender was destroyed: ", outcome["gone"]);
          } else {
            TANDEM_CHECK(result("gone").find("cancelled") != std::string::npos,
                         "gone: ", result("gone"));
            tx->abort("gone");
          }
          std::lock_guard<std::mutex> l(mu);
          for (const auto& [id, n] : calls) {
            TANDEM_CHECK(n == 1, "request ", id, ": ", n, " sender callbacks");
          }
          store.add("senders", 1);
          if (store.add("senders", 0) == 2) store.set("senders_done", "1");
        }
        store.barrier();
      },
      std::chrono::seconds(300));
  EXPECT_EQ(comm::describe_failures(results), "");
}

// Random floats (a recurrent state's values), reproducible from the seed.
std::vector<float> state_values(int64_t elems, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(elems));
  for (float& x : v) x = n(rng);
  return v;
}

TEST(CudaIpc, RecurrentStateSlotToSlot) {
  REQUIRE_GPU();
  // A hybrid's KV (2 attention layers) and its state slots: the prompt's state goes from the
  // prefill rank's device slot into the decode rank's reserved slot, bit for bit.
  constexpr int64_t kLayers = 2, kHeads = 2, kHd = 64, kPage = 16, kPages = 16, kTokens = 100;
  constexpr int64_t kSlots = 8, kElems = 3 * (3 * 1024 + 4 * 64 * 64) + 5;  // odd on purpose
  const KvSharding src{kHeads, 1};
  auto results = comm::run_local_ranks(
      2,
      [&](int rank) {
        comm::RankEnv env = comm::RankEnv::from_env();
        comm::TcpStore store(comm::TcpStoreOptions::of(env));
        auto backend = make_cuda_ipc_backend();
        TANDEM_CHECK(backend->carries_device_state(), "cuda-ipc copies no device state");
        TransferDescriptor d;
        d.dst_heads = {0, kHeads};
        d.src = src;
        d.num_tokens = kTokens;
        d.page_size = kPage;
        d.head_dim = kHd;
        d.num_layers = kLayers;
        d.dst_pages = random_pages(7, kPages, 7);
        d.state_elems = kElems;
        std::mutex mu;
        std::condition_variable cv;
        auto wait = [&](auto done) {
          std::unique_lock<std::mutex> l(mu);
          return cv.wait_for(l, std::chrono::seconds(60), done);
        };
        auto refused = [&](ErrorKind kind, const std::function<void()>& fn,
                           const std::string& what) {
          try {
            fn();
          } catch (const Error& e) {
            TANDEM_CHECK(e.kind() == kind, what, ": ", e.what());
            return;
          }
          TANDEM_CHECK(false, what, " was not refused");
        };
        const size_t kv_elems = static_cast<size_t>(kLayers * kPages * 2 * kHeads * kPage * kHd);
        if (rank == 0) {
          KvGeometry g{kLayers, kPages, kHeads, kPage, kHd};
          DevicePool pool(g, std::vector<uint16_t>(kv_elems, kPoison), kSlots, kElems);
          // Poison every slot (NaN bits), so a slot nobody wrote is seen.
          std::vector<float> poison(static_cast<size_t>(kSlots * kElems));
          const uint32_t nan_bits = 0x7FC0DEAD;
          for (float& f : poison) std::memcpy(&f, &nan_bits, 4);
          TANDEM_CUDA_CHECK(cudaMemcpy(pool.cache.state_data(0), poison.data(),
                                       poison.size() * sizeof(float), cudaMemcpyHostToDevice));
          std::map<std::string, std::string> ended;  // "complete" or the error
          bool state_cb = false;
          ReceiverCallbacks cbs;
          cbs.on_complete = [&](const std::string& id, int32_t, float) {
            std::lock_guard<std::mutex> l(mu);
            ended[id] = "complete";
            cv.notify_all();
          };
          cbs.on_error = [&](const std::string& id, const std::string& m) {
            std::lock_guard<std::mutex> l(mu);
            ended[id] = m;
            cv.notify_all();
          };
          cbs.on_state = [&](const std::string&, std::vector<float>) { state_cb = true; };
          auto rx = backend->make_receiver(pool.cache, cbs);
          store.set("addr", rx->address());
          auto desc = [&](const std::string& id, int32_t slot) {
            TransferDescriptor x = d;
            x.request_id = id;
            x.dst_address = rx->address();
            x.dst_state_slot = slot;
            return x;
          };
          auto slot = [&](int64_t s) {
            std::vector<float> v(static_cast<size_t>(kElems));
            TANDEM_CUDA_CHECK(cudaMemcpy(v.data(), pool.cache.state_data(s), v.size() * 4,
                                         cudaMemcpyDeviceToHost));
            return v;
          };
          auto outcome = [&](const std::string& id) {
            TANDEM_CHECK(wait([&] { return ended.count(id) > 0; }), "request ", id, " did not end");
            std::lock_guard<std::mutex> l(mu);
            return ended[id];
          };
          // Bad descriptors are refused: slot out of range, wrong size, no slot at all.
          refused(
              ErrorKind::kInvalidArgument, [&] { rx->expect(desc("bad", kSlots)); },
              "a slot out of range");
          refused(
              ErrorKind::kInvalidArgument, [&] { rx->expect(desc("bad", -2)); }, "a negative slot");
          refused(
              ErrorKind::kInvalidArgument,
              [&] {
                TransferDescriptor x = desc("bad", 1);
                x.state_elems = kElems + 1;
                rx->expect(x);
              },
              "a state of another size");
          refused(
              ErrorKind::kInvalidArgument, [&] { rx->expect(desc("bad", -1)); },
              "a state without a slot");
          // 1. The state lands in slot 5, bit for bit; its neighbours stay untouched.
          rx->expect(desc("s", 5));
          store.set("ready_s", "1");
          TANDEM_CHECK(outcome("s") == "complete", "s: ", outcome("s"));
          const std::vector<float> want = state_values(kElems, 11);
          const std::vector<float> got = slot(5);
          TANDEM_CHECK(std::memcmp(got.data(), want.data(), want.size() * 4) == 0,
                       "the transferred state differs from the sender's");
          for (int64_t s : {4, 6}) {
            const std::vector<float> other = slot(s);
            TANDEM_CHECK(std::memcmp(other.data(), poison.data(), other.size() * 4) == 0, "slot ",
                         s, " was written");
          }
          TANDEM_CHECK(!state_cb, "on_state called for a device state");
          // 2. Every sender finished without copying the state: the request fails.
          rx->expect(desc("none", 2));
          store.set("ready_none", "1");
          TANDEM_CHECK(
              outcome("none").find("without copying the recurrent state") != std::string::npos,
              "none: ", outcome("none"));
          // 3. Cancelled after the state copy was enqueued, before the FINISH.
          rx->expect(desc("c", 3));
          store.set("ready_c", "1");
          store.get("c_state_sent");
          TANDEM_CHECK(rx->cancel("c"), "cancel of c");
          store.set("c_cancelled", "1");
          // 4. The same slot again, another state: complete and exact.
          rx->expect(desc("after", 3));
          store.set("ready_after", "1");
          TANDEM_CHECK(outcome("after") == "complete", "after: ", outcome("after"));
          const std::vector<float> want2 = state_values(kElems, 12);
          const std::vector<float> got2 = slot(3);
          TANDEM_CHECK(std::memcmp(got2.data(), want2.data(), want2.size() * 4) == 0,
                       "the second state differs");
          TANDEM_CHECK(!ended.count("c"), "a callback for the cancelled request");
          store.get("sender_done");
        } else {
          KvGeometry g{kLayers, kPages, kHeads, kPage, kHd};
          std::vector<uint16_t> bits(kv_elems);
          fill_random(bits, 900);
          DevicePool pool(g, bits, kSlots, kElems);
          auto put_state = [&](int64_t s, uint64_t seed) {
            const std::vector<float> v = state_values(kElems, seed);
            TANDEM_CUDA_CHECK(cudaMemcpy(pool.cache.state_data(s), v.data(), v.size() * 4,
                                         cudaMemcpyHostToDevice));
          };
          std::map<std::string, std::string> outcome;
          SenderCallbacks cbs;
          cbs.on_sent = [&](const std::string& id) {
            std::lock_guard<std::mutex> l(mu);
            outcome.emplace(id, "sent");
            cv.notify_all();
          };
          cbs.on_error = [&](const std::string& id, const std::string& m) {
            std::lock_guard<std::mutex> l(mu);
            outcome.emplace(id, "error: " + m);
            cv.notify_all();
          };
          auto tx = backend->make_sender(pool.cache, src, 0, cbs);
          const std::string addr = store.get_string("addr");
          const std::vector<int32_t> table = random_pages(7, kPages, 8);
          auto begin = [&](const std::string& id, int32_t dst_slot) {
            store.get("ready_" + id);
            TransferDescriptor x = d;
            x.request_id = id;
            x.dst_address = addr;
            x.dst_state_slot = dst_slot;
            tx->begin(id, {x}, table);
            for (int64_t l = 0; l < kLayers; ++l) tx->send_layer(id, l);
          };
          auto result = [&](const std::string& id) {
            TANDEM_CHECK(wait([&] { return outcome.count(id) > 0; }), "no callback for ", id);
            std::lock_guard<std::mutex> l(mu);
            return outcome[id];
          };
          // A descriptor naming a slot the receiver does not have: refused before BEGIN.
          refused(
              ErrorKind::kInvalidArgument,
              [&] {
                TransferDescriptor x = d;
                x.request_id = "bad";
                x.dst_address = addr;
                x.dst_state_slot = kSlots + 3;
                tx->begin("bad", {x}, table);
              },
              "a destination slot out of the receiver's range");
          put_state(1, 11);
          begin("s", 5);
          refused(
              ErrorKind::kInvalidArgument, [&] { tx->send_state("s", kSlots); },
              "a source slot out of range");
          tx->send_state("s", 1);
          refused(
              ErrorKind::kInvalidArgument, [&] { tx->send_state("s", 1); }, "a second send_state");
          // The model's next write of the slot (on its stream) waits for the copy's read.
          const std::vector<float> next = state_values(kElems, 99);
          TANDEM_CUDA_CHECK(cudaMemcpyAsync(pool.cache.state_data(1), next.data(), next.size() * 4,
                                            cudaMemcpyHostToDevice, pool.stream));
          TANDEM_CUDA_CHECK(cudaStreamSynchronize(pool.stream));
          tx->finish("s", 7, -0.1f);
          TANDEM_CHECK(result("s") == "sent", "s: ", result("s"));
          begin("none", 2);
          tx->finish("none", 7, -0.1f);
          result("none");
          put_state(4, 12);
          begin("c", 3);
          tx->send_state("c", 4);
          store.set("c_state_sent", "1");
          store.get("c_cancelled");
          TANDEM_CHECK(result("c").find("cancelled") != std::string::npos, "c: ", result("c"));
          tx->abort("c");
          begin("after", 3);
          tx->send_state("after", 4);
          tx->finish("after", 7, -0.1f);
          TANDEM_CHECK(result("after") == "sent", "after: ", result("after"));
          store.set("sender_done", "1");
        }
        store.barrier();
      },
      std::chrono::seconds(120));
  EXPECT_EQ(comm::describe_failures(results), "");
}

// Prefill TP=2 of a hybrid: each rank holds only its heads' part of the state (a slot of another
// size than the destination's), so rank 0 sends the whole state its model gathered on the device
// (Model::gather_state_device) from that buffer with send_state_from; rank 1 sends its KV only.
// The decode rank's reserved slot gets the buffer bit for bit and the request completes.
TEST(CudaIpc, Tp2WholeStateFromADeviceBuffer) {
  REQUIRE_GPU();
  constexpr int64_t kLayers = 2, kHeads = 2, kHd = 64, kPage = 16, kPages = 8, kTokens = 40;
  constexpr int64_t kSlots = 4, kElems = 2 * (3 * 256 + 2 * 64 * 64) + 3, kPart = kElems / 2;
  const KvSharding src{kHeads, 2};
  auto results = comm::run_local_ranks(
      3,
      [&](int rank) {
        // Each rank's steps on stderr, with the time (a rank killed by the runner says nothing).
        const auto t0 = std::chrono::steady_clock::now();
        auto trace = [&](const std::string& what) {
          const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::steady_clock::now() - t0)
                              .count();
          std::fprintf(stderr, "[%6lld ms] rank %d: %s\n", static_cast<long long>(ms), rank,
                       what.c_str());
        };
        comm::RankEnv env = comm::RankEnv::from_env();
        comm::TcpStore store(comm::TcpStoreOptions::of(env));
        auto backend = make_cuda_ipc_backend();
        TransferDescriptor d;
        d.request_id = "t";
        d.dst_heads = {0, kHeads};
        d.src = src;
        d.num_tokens = kTokens;
        d.page_size = kPage;
        d.head_dim = kHd;
        d.num_layers = kLayers;
        d.dst_pages = random_pages(3, kPages, 31);
        d.state_elems = kElems;
        d.dst_state_slot = 2;
        std::mutex mu;
        std::condition_variable cv;
        if (rank == 0) {
          KvGeometry g{kLayers, kPages, kHeads, kPage, kHd};
          DevicePool pool(
              g,
              std::vector<uint16_t>(
                  static_cast<size_t>(kLayers * kPages * 2 * kHeads * kPage * kHd), kPoison),
              kSlots, kElems);
          std::string ended;
          ReceiverCallbacks cbs;
          cbs.on_complete = [&](const std::string&, int32_t, float) {
            std::lock_guard<std::mutex> l(mu);
            ended = "complete";
            cv.notify_all();
          };
          cbs.on_error = [&](const std::string&, const std::string& m) {
            std::lock_guard<std::mutex> l(mu);
            ended = m;
            std::fprintf(stderr, "receiver: %s\n", m.c_str());  // seen if killed
            cv.notify_all();
          };
          auto rx = backend->make_receiver(pool.cache, cbs);
          d.dst_address = rx->address();
          rx->expect(d);
          store.set("addr", rx->address());
          trace("receiver expects the request at " + rx->address());
          {
            std::unique_lock<std::mutex> l(mu);
            TANDEM_CHECK(cv.wait_for(l, std::chrono::seconds(60), [&] { return !ended.empty(); }),
                         "the request did not end");
          }
          trace("receiver: the request ended: " + ended);
          TANDEM_CHECK(ended == "complete", "t: ", ended);
          std::vector<float> got(static_cast<size_t>(kElems));
          TANDEM_CUDA_CHECK(cudaMemcpy(got.data(), pool.cache.state_data(2), got.size() * 4,
                                       cudaMemcpyDeviceToHost));
          const std::vector<float> want = state_values(kElems, 21);
          TANDEM_CHECK(std::memcmp(got.data(), want.data(), want.size() * 4) == 0,
                       "the whole state differs from rank 0's device buffer");
        } else {
          const int prank = rank - 1;
          KvGeometry g{kLayers, kPages, kHeads / 2, kPage, kHd};
          std::vector<uint16_t> bits(static_cast<size_t>(kLayers * kPages * 2 * kPage * kHd));
          fill_random(bits, 40 + prank);
          DevicePool pool(g, bits, kSlots, kPart);  // this rank's part of each state
          std::string outcome;
          SenderCallbacks cbs;
          cbs.on_sent = [&](const std::string&) {
            std::lock_guard<std::mutex> l(mu);
            outcome = "sent";
            cv.notify_all();
          };
          cbs.on_error = [&](const std::string&, const std::string& m) {
            std::lock_guard<std::mutex> l(mu);
            outcome = "error: " + m;
            std::fprintf(stderr, "prefill rank %d: %s\n", prank, m.c_str());
            cv.notify_all();
          };
          auto tx = backend->make_sender(pool.cache, src, prank, cbs);
          d.dst_address = store.get_string("addr");
          tx->begin("t", {d}, random_pages(3, kPages, 32));
          trace("began");
          for (int64_t l = 0; l < kLayers; ++l) tx->send_layer("t", l);
          trace("layers sent");
          if (prank == 0) {
            // The gathered whole state: a device buffer beside the cache's slots.
            const std::vector<float> whole = state_values(kElems, 21);
            float* buf = nullptr;
            TANDEM_CUDA_CHECK(cudaMalloc(&buf, whole.size() * 4));
            TANDEM_CUDA_CHECK(
                cudaMemcpy(buf, whole.data(), whole.size() * 4, cudaMemcpyHostToDevice));
            auto refused = [&](const std::function<void()>& fn, const std::string& what) {
              try {
                fn();
              } catch (const Error& e) {
                TANDEM_CHECK(e.kind() == ErrorKind::kInvalidArgument, what, ": ", e.what());
                return;
              }
              TANDEM_CHECK(false, what, " was not refused");
            };
            refused([&] { tx->send_state("t", 1); }, "a slot holding only this rank's part");
            refused([&] { tx->send_state_from("t", buf, kElems - 1); }, "a buffer of another size");
            refused([&] { tx->send_state_from("t", nullptr, kElems); }, "a null buffer");
            tx->send_state_from("t", buf, kElems);
            trace("state sent");
            refused([&] { tx->send_state_from("t", buf, kElems); }, "a second state");
            // The buffer may be rewritten once the model's stream passed the copy.
            TANDEM_CUDA_CHECK(cudaMemsetAsync(buf, 0xff, whole.size() * 4, pool.stream));
            TANDEM_CUDA_CHECK(cudaStreamSynchronize(pool.stream));
            tx->finish("t", 5, -0.2f);
            trace("finished");
            {
              std::unique_lock<std::mutex> l(mu);
              TANDEM_CHECK(
                  cv.wait_for(l, std::chrono::seconds(60), [&] { return !outcome.empty(); }),
                  "no callback");
            }
            TANDEM_CUDA_CHECK(cudaFree(buf));
          } else {
            tx->finish("t", 5, -0.2f);
            trace("finished");
            std::unique_lock<std::mutex> l(mu);
            TANDEM_CHECK(cv.wait_for(l, std::chrono::seconds(60), [&] { return !outcome.empty(); }),
                         "no callback");
          }
          trace("outcome: " + outcome);
          TANDEM_CHECK(outcome == "sent", "prefill rank ", prank, ": ", outcome);
        }
        store.barrier();
        trace("done");
      },
      std::chrono::seconds(120));
  EXPECT_EQ(comm::describe_failures(results), "");
}

}  // namespace
}  // namespace tandem::transfer
