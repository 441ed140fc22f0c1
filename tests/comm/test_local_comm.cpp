// LocalCommunicator (ranks as threads) against serial references, and the decode MoE
// all-to-all. The checks in tandem::comm::testing are shared with test_gloo_comm.cpp (same
// binary): they throw on a mismatch, so they also work inside forked ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "comm/local_comm.h"
#include "comm/moe_dispatch.h"
#include "core/error.h"

namespace tandem::comm::testing {

namespace {

// Deterministic per-(seed, rank) data, so every rank can rebuild every other rank's input.
std::vector<float> rank_floats(uint64_t seed, int rank, int64_t count) {
  std::mt19937_64 rng(seed * 7919 + static_cast<uint64_t>(rank));
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  std::vector<float> v(static_cast<size_t>(count));
  for (auto& x : v) x = u(rng);
  return v;
}

template <typename T>
void require_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  TANDEM_CHECK(got.size() == want.size(), what, ": size ", got.size(), " != ", want.size());
  if (!got.empty()) {
    TANDEM_CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0, what,
                 ": contents differ");
  }
}

}  // namespace

/// Every collective of the interface against a serial reference (bit-exact).
void check_collectives(Communicator& comm, uint64_t seed) {
  const int n = comm.world_size(), me = comm.rank();
  // all_reduce_sum, fp32: rank-order sum, bit-exact; i32 / i64 too.
  for (int64_t count : {0, 1, 3, 7, 1000, 4099}) {
    std::vector<float> data = rank_floats(seed + 1, me, count);
    comm.all_reduce_sum(data.data(), count, DType::kF32);
    std::vector<float> want = rank_floats(seed + 1, 0, count);
    for (int r = 1; r < n; ++r) {
      std::vector<float> x = rank_floats(seed + 1, r, count);
      for (int64_t i = 0; i < count; ++i) want[static_cast<size_t>(i)] += x[static_cast<size_t>(i)];
    }
    require_equal(data, want, "all_reduce_sum f32 count " + std::to_string(count));
  }
  {
    std::vector<int32_t> a(5);
    std::vector<int64_t> b(3);
    for (int i = 0; i < 5; ++i) a[static_cast<size_t>(i)] = me * 10 + i;
    for (int i = 0; i < 3; ++i) b[static_cast<size_t>(i)] = (int64_t{1} << 40) * me + i;
    comm.all_reduce_sum(a.data(), 5, DType::kI32);
    comm.all_reduce_sum(b.data(), 3, DType::kI64);
    const int64_t s = int64_t{n} * (n - 1) / 2;
    for (int i = 0; i < 5; ++i)
      TANDEM_CHECK(a[static_cast<size_t>(i)] == s * 10 + n * i, "i32 sum");
    for (int i = 0; i < 3; ++i) {
      TANDEM_CHECK(b[static_cast<size_t>(i)] == (int64_t{1} << 40) * s + n * i, "i64 sum");
    }
  }
  // all_gather.
  for (int64_t count : {0, 1, 5, 1000}) {
    std::vector<float> in = rank_floats(seed + 2, me, count);
    std::vector<float> out(static_cast<size_t>(count * n), -1.f);
    comm.all_gather(in.data(), out.data(), count, DType::kF32);
    std::vector<float> want;
    for (int r = 0; r < n; ++r) {
      auto x = rank_floats(seed + 2, r, count);
      want.insert(want.end(), x.begin(), x.end());
    }
    require_equal(out, want, "all_gather count " + std::to_string(count));
  }
  // all_gather_v with zeros among the counts.
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<int64_t> counts(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r)
      counts[static_cast<size_t>(r)] = (r * 7 + variant * 3) % (4 + variant * 40);
    if (variant == 2) std::fill(counts.begin(), counts.end(), 0);
    std::vector<float> in = rank_floats(seed + 3 + variant, me, counts[static_cast<size_t>(me)]);
    const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
    std::vector<float> out(static_cast<size_t>(total), -1.f);
    comm.all_gather_v(in.data(), out.data(), counts, DType::kF32);
    std::vector<float> want;
    for (int r = 0; r < n; ++r) {
      auto x = rank_floats(seed + 3 + variant, r, counts[static_cast<size_t>(r)]);
      want.insert(want.end(), x.begin(), x.end());
    }
    require_equal(out, want, "all_gather_v variant " + std::to_string(variant));
  }
  // all_to_all_v: rank s sends cnt(s, d) values encoding (s, d, i) to rank d.
  for (int variant = 0; variant < 3; ++variant) {
    auto cnt = [&](int s, int d) -> int64_t {
      if (variant == 2) return 0;
      return ((s + 1) * (d + 2) * (variant + 1)) % (5 + 100 * variant) * ((s + d) % 3 != 0);
    };
    std::vector<int64_t> send_counts(static_cast<size_t>(n)), recv_counts(static_cast<size_t>(n));
    std::vector<float> in, want;
    for (int d = 0; d < n; ++d) {
      send_counts[static_cast<size_t>(d)] = cnt(me, d);
      for (int64_t i = 0; i < cnt(me, d); ++i)
        in.push_back(static_cast<float>(me * 1000000 + d * 10000 + i));
    }
    for (int s = 0; s < n; ++s) {
      recv_counts[static_cast<size_t>(s)] = cnt(s, me);
      for (int64_t i = 0; i < cnt(s, me); ++i)
        want.push_back(static_cast<float>(s * 1000000 + me * 10000 + i));
    }
    std::vector<float> out(want.size(), -1.f);
    comm.all_to_all_v(in.data(), send_counts, out.data(), recv_counts, DType::kF32);
    require_equal(out, want, "all_to_all_v variant " + std::to_string(variant));
  }
  // Equal all_to_all of int64 (how counts are exchanged).
  {
    std::vector<int64_t> in(static_cast<size_t>(n)), out(static_cast<size_t>(n), -1),
        want(static_cast<size_t>(n));
    for (int d = 0; d < n; ++d) {
      in[static_cast<size_t>(d)] = me * 100 + d;
      want[static_cast<size_t>(d)] = d * 100 + me;
    }
    comm.all_to_all(in.data(), out.data(), 1, DType::kI64);
    require_equal(out, want, "all_to_all");
  }
  // broadcast from every root.
  for (int root = 0; root < n; ++root) {
    for (int64_t count : {0, 1, 100}) {
      std::vector<float> data = rank_floats(seed + 10 + root, me, count);
      comm.broadcast(data.data(), count, DType::kF32, root);
      require_equal(data, rank_floats(seed + 10 + root, root, count),
                    "broadcast root " + std::to_string(root));
    }
  }
  comm.barrier();
  // send / recv: rank 0 exchanges with every other rank (0 sends first), two tags in order,
  // blobs of 0, 1 and 1 MiB.
  for (int peer = 1; peer < n; ++peer) {
    if (me != 0 && me != peer) continue;
    const int other = me == 0 ? peer : 0;
    std::vector<float> mine = rank_floats(seed + 20, me, 33), theirs(33);
    std::vector<uint8_t> big(1 << 20);
    for (size_t i = 0; i < big.size(); ++i)
      big[i] = static_cast<uint8_t>(i * 31 + static_cast<size_t>(peer));
    if (me == 0) {
      comm.send(mine.data(), 33 * 4, other, 5);
      comm.send_blob({}, other, 6);
      comm.send_blob(std::span<const uint8_t>(big.data(), 1), other, 6);
      comm.send_blob(big, other, 6);
      comm.recv(theirs.data(), 33 * 4, other, 7);
    } else {
      comm.recv(theirs.data(), 33 * 4, other, 5);
      TANDEM_CHECK(comm.recv_blob(other, 6).empty(), "empty blob");
      TANDEM_CHECK(comm.recv_blob(other, 6) == std::vector<uint8_t>(big.begin(), big.begin() + 1),
                   "1-byte blob");
      TANDEM_CHECK(comm.recv_blob(other, 6) == big, "1 MiB blob");
      comm.send(mine.data(), 33 * 4, other, 7);
    }
    require_equal(theirs, rank_floats(seed + 20, other, 33), "send/recv");
  }
  comm.barrier();
}

/// The decode MoE all-to-all with a stand-in expert: every rank's combined output must equal
/// the serial accumulation in ascending expert id, bit for bit.
void check_moe_all_to_all(Communicator& comm, int64_t num_experts, int64_t top_k, uint64_t seed) {
  const int n = comm.world_size(), me = comm.rank();
  const int64_t hidden = 24;
  // A stand-in expert e: y = x * (e + 1) / 8 + e.
  auto expert = [](int32_t e, const float* x, float w, float* out, int64_t h) {
    for (int64_t d = 0; d < h; ++d)
      out[d] = w * (x[d] * static_cast<float>(e + 1) / 8.f + static_cast<float>(e));
  };
  MoeAllToAll a2a(comm, num_experts, hidden, top_k);
  for (int step = 0; step < 3; ++step) {
    // Token counts differ per rank and step, zero included.
    const int64_t num_tokens = (me * 5 + step * 3) % 7 == 0 ? 0 : (me * 5 + step * 3) % 7 + step;
    std::mt19937_64 rng(seed * 131 + static_cast<uint64_t>(me * 17 + step));
    std::vector<float> x = rank_floats(seed + static_cast<uint64_t>(step), me, num_tokens * hidden);
    std::vector<int32_t> ids(static_cast<size_t>(num_tokens * top_k));
    std::vector<float> w(ids.size());
    std::vector<int32_t> perm(static_cast<size_t>(num_experts));
    for (int64_t t = 0; t < num_tokens; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);  // distinct experts, any order
      for (int64_t j = 0; j < top_k; ++j) {
        ids[static_cast<size_t>(t * top_k + j)] = perm[static_cast<size_t>(j)];
        w[static_cast<size_t>(t * top_k + j)] =
            std::uniform_real_distribution<float>(0.f, 1.f)(rng);
      }
    }
    a2a.dispatch(x.data(), ids.data(), w.data(), num_tokens);
    // Run the local experts; pairs are grouped by expert.
    const auto& off = a2a.expert_offsets();
    TANDEM_CHECK(static_cast<int64_t>(off.size()) == num_experts / n + 1, "expert_offsets size");
    for (int64_t e = 0; e < num_experts / n; ++e) {
      for (int64_t p = off[static_cast<size_t>(e)]; p < off[static_cast<size_t>(e + 1)]; ++p) {
        TANDEM_CHECK(a2a.pair_expert()[p] == a2a.expert_begin() + e,
                     "pair grouped under the wrong expert");
      }
    }
    for (int64_t p = 0; p < a2a.num_pairs(); ++p) {
      expert(a2a.pair_expert()[p], a2a.pair_x() + p * hidden, a2a.pair_weight()[p],
             a2a.pair_out() + p * hidden, hidden);
    }
    std::vector<float> out(static_cast<size_t>(num_tokens * hidden), -7.f);
    a2a.combine(out.data());
    // Serial reference: out = 0; += contributions in ascending expert id.
    std::vector<float> want(out.size(), 0.f), c(static_cast<size_t>(hidden));
    for (int64_t t = 0; t < num_tokens; ++t) {
      std::vector<std::pair<int32_t, float>> pairs;
      for (int64_t j = 0; j < top_k; ++j) {
        pairs.push_back(
            {ids[static_cast<size_t>(t * top_k + j)], w[static_cast<size_t>(t * top_k + j)]});
      }
      std::sort(pairs.begin(), pairs.end());
      for (auto [e, wt] : pairs) {
        expert(e, x.data() + t * hidden, wt, c.data(), hidden);
        for (int64_t d = 0; d < hidden; ++d)
          want[static_cast<size_t>(t * hidden + d)] += c[static_cast<size_t>(d)];
      }
    }
    require_equal(out, want,
                  "moe combine, rank " + std::to_string(me) + " step " + std::to_string(step));
  }
}

}  // namespace tandem::comm::testing

namespace tandem::comm {
namespace {

using namespace std::chrono_literals;

TEST(LocalComm, CollectivesMatchSerialReference) {
  for (int n : {1, 2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(n));
    run_local_group(n, [](Communicator& comm) { testing::check_collectives(comm, 42); });
  }
}

TEST(LocalComm, MoeAllToAllMatchesSerialSum) {
  for (int n : {1, 2, 3, 4}) {
    for (int64_t k : {1, 2, 4}) {
      SCOPED_TRACE("world " + std::to_string(n) + " top_k " + std::to_string(k));
      run_local_group(n,
                      [k](Communicator& comm) { testing::check_moe_all_to_all(comm, 12, k, 7); });
    }
  }
}

TEST(LocalComm, MoeAllToAllRejectsUnevenExperts) {
  run_local_group(3, [](Communicator& comm) { EXPECT_THROW(MoeAllToAll(comm, 8, 16, 2), Error); });
}

TEST(LocalComm, FailingRankAbortsTheGroup) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    run_local_group(
        3,
        [](Communicator& comm) {
          if (comm.rank() == 1) TANDEM_THROW(kInvalidArgument, "boom");
          comm.barrier();  // ranks 0 and 2 wait here until the abort
        },
        60s);
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("boom"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST(LocalComm, MismatchedCollectivesThrow) {
  EXPECT_THROW(run_local_group(2,
                               [](Communicator& comm) {
                                 float x = 1.f;
                                 if (comm.rank() == 0) {
                                   comm.all_reduce_sum(&x, 1, DType::kF32);
                                 } else {
                                   comm.broadcast(&x, 1, DType::kF32, 0);
                                 }
                               }),
               Error);
  EXPECT_THROW(run_local_group(2,
                               [](Communicator& comm) {
                                 std::vector<float> x(static_cast<size_t>(comm.rank() + 1));
                                 comm.all_reduce_sum(x.data(), comm.rank() + 1, DType::kF32);
                               }),
               Error);
  EXPECT_THROW(run_local_group(2,
                               [](Communicator& comm) {
                                 float x = 0;
                                 comm.all_reduce_sum(&x, 1, DType::kBF16);
                               }),
               Error);
}

TEST(LocalComm, TimesOutWithoutPeer) {
  auto comms = LocalCommunicator::create_group(2, 200ms);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(comms[0]->barrier(), Error);
  float x = 0;
  EXPECT_THROW(comms[0]->recv(&x, 4, 1, 0), Error);  // the group is aborted by now
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(LocalComm, SendWaitsForTheReceiver) {
  auto comms = LocalCommunicator::create_group(2, 10s);
  std::atomic<bool> sent{false};
  float v = 3.f, got = 0.f;
  std::thread sender([&] {
    comms[0]->send(&v, 4, 1, 9);
    sent = true;
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(sent.load());  // synchronous, as over Gloo
  comms[1]->recv(&got, 4, 0, 9);
  sender.join();
  EXPECT_TRUE(sent.load());
  EXPECT_EQ(got, 3.f);
}

}  // namespace
}  // namespace tandem::comm
