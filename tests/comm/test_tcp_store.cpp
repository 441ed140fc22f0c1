// CPU-only tests of the bootstrap store and the local launcher (run in CI).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "comm/local_launcher.h"
#include "comm/tcp_store.h"
#include "core/error.h"
#include "net/cluster_auth.h"

namespace tandem::comm {
namespace {

using namespace std::chrono_literals;

TcpStoreOptions opts(int rank, int world, int port, std::chrono::milliseconds timeout = 10s) {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.rank = rank;
  o.world_size = world;
  o.timeout = timeout;
  return o;
}

// Runs fn(store) on `world` threads, rank 0 first (it picks the port).
void run_group(int world, const std::function<void(TcpStore&)>& fn,
               std::chrono::milliseconds timeout = 10s) {
  auto root = std::make_unique<TcpStore>(opts(0, world, 0, timeout));
  const int port = root->port();
  std::vector<std::future<void>> others;
  for (int r = 1; r < world; ++r) {
    others.push_back(std::async(std::launch::async, [=, &fn] {
      TcpStore s(opts(r, world, port, timeout));
      fn(s);
    }));
  }
  std::exception_ptr err;
  try {
    fn(*root);
  } catch (...) {
    err = std::current_exception();
  }
  for (auto& f : others) f.get();  // rethrows a rank's failure
  root.reset();
  if (err) std::rethrow_exception(err);
}

TEST(TcpStore, SetGetAcrossRanks) {
  run_group(4, [](TcpStore& s) {
    s.set("hello/" + std::to_string(s.rank()), "from " + std::to_string(s.rank()));
    for (int r = 0; r < s.world_size(); ++r)
      EXPECT_EQ(s.get_string("hello/" + std::to_string(r)), "from " + std::to_string(r));
  });
}

TEST(TcpStore, GetBlocksUntilSet) {
  run_group(2, [](TcpStore& s) {
    if (s.rank() == 1) {
      std::this_thread::sleep_for(300ms);
      s.set("late", "value");
    } else {
      auto t0 = std::chrono::steady_clock::now();
      EXPECT_EQ(s.get_string("late"), "value");
      EXPECT_GE(std::chrono::steady_clock::now() - t0, 250ms);
    }
  });
}

TEST(TcpStore, BinaryBlobsAndOverwrite) {
  run_group(2, [](TcpStore& s) {
    std::vector<uint8_t> blob(8 << 20);
    for (size_t i = 0; i < blob.size(); ++i) blob[i] = static_cast<uint8_t>(i * 131 + 7);
    blob[5] = 0;  // embedded zeros survive
    if (s.rank() == 0) {
      s.set("blob", blob);
      s.set("k", "one");
      s.set("k", "two");
    }
    s.barrier();
    EXPECT_EQ(s.get("blob"), blob);
    EXPECT_EQ(s.get_string("k"), "two");
    EXPECT_TRUE(s.get("blob").size() == blob.size());
  });
}

TEST(TcpStore, AddIsAtomic) {
  run_group(4, [](TcpStore& s) {
    for (int i = 0; i < 100; ++i) s.add("counter", 1);
    s.barrier();
    EXPECT_EQ(s.add("counter", 0), 400);
  });
}

TEST(TcpStore, BarrierOrdersRanks) {
  std::atomic<int> phase_count{0};
  run_group(4, [&](TcpStore& s) {
    for (int round = 0; round < 20; ++round) {
      phase_count.fetch_add(1);
      s.barrier();
      // Every rank has incremented for this round before anyone passes the barrier.
      EXPECT_GE(phase_count.load(), 4 * (round + 1));
      s.barrier();
    }
  });
}

TEST(TcpStore, AllGather) {
  run_group(3, [](TcpStore& s) {
    std::string mine(static_cast<size_t>(s.rank() + 1), static_cast<char>('a' + s.rank()));
    auto all =
        s.all_gather("ag", std::span(reinterpret_cast<const uint8_t*>(mine.data()), mine.size()));
    ASSERT_EQ(all.size(), 3u);
    EXPECT_EQ(std::string(all[0].begin(), all[0].end()), "a");
    EXPECT_EQ(std::string(all[1].begin(), all[1].end()), "bb");
    EXPECT_EQ(std::string(all[2].begin(), all[2].end()), "ccc");
  });
}

TEST(TcpStore, GetTimesOutWithClearError) {
  TcpStore s(opts(0, 1, 0, 10s));
  auto t0 = std::chrono::steady_clock::now();
  try {
    s.get("never", 200ms);
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("never"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(TcpStore, BarrierTimesOutWhenARankIsMissing) {
  TcpStore s(opts(0, 2, 0, 300ms));  // rank 1 never comes
  try {
    s.barrier();
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 of 2 ranks arrived"), std::string::npos) << e.what();
  }
}

TEST(TcpStore, ConnectTimesOutWithClearError) {
  const int port = pick_free_port();  // nobody listens there
  auto t0 = std::chrono::steady_clock::now();
  try {
    TcpStore s(opts(1, 2, port, 300ms));
    FAIL() << "connected to nothing";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_NE(std::string(e.what()).find("could not connect"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(port)), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST(TcpStore, RejectsMismatchedWorldSizeAndDuplicateRank) {
  TcpStore root(opts(0, 3, 0, 2s));
  try {
    TcpStore bad(opts(1, 4, root.port(), 2s));
    FAIL() << "world size mismatch accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("WORLD_SIZE=4"), std::string::npos) << e.what();
  }
  TcpStore one(opts(1, 3, root.port(), 2s));
  try {
    TcpStore dup(opts(1, 3, root.port(), 2s));
    FAIL() << "duplicate rank accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK=1"), std::string::npos) << e.what();
  }
}

TEST(TcpStore, ClientSeesServerLoss) {
  auto root = std::make_unique<TcpStore>(opts(0, 2, 0, 500ms));
  TcpStore client(opts(1, 2, root->port(), 500ms));
  // Rank 0 goes away while rank 1 is still connected: it waits up to its timeout, then stops.
  std::thread closer([&] { root.reset(); });
  closer.join();
  EXPECT_THROW(client.get("anything"), Error);
}

// The cluster key on the store: keyed ranks bootstrap as before; a rank with another key or
// none is refused (counted), and a raw client that skips the handshake sets nothing.
TEST(TcpStore, ClusterKeyAdmitsOnlyRanksWithIt) {
  const net::KeyRef key = net::ClusterKey::from_bytes(std::string(32, 'k'));
  const net::KeyRef other = net::ClusterKey::from_bytes(std::string(32, 'o'));
  auto keyed = [&](int rank, int port, net::KeyRef k) {
    TcpStoreOptions o = opts(rank, 2, port, 3s);
    o.key = std::move(k);
    return o;
  };
  auto root = std::make_unique<TcpStore>(keyed(0, 0, key));
  const int port = root->port();
  const uint64_t before = net::failures(net::Channel::kStore);
  for (const net::KeyRef& k : {other, net::KeyRef()}) {
    try {
      TcpStore s(keyed(1, port, k));
      ADD_FAILURE() << "a rank without the key joined the store";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kIo);
    }
  }
  EXPECT_GE(net::failures(net::Channel::kStore), before + 2);
  std::thread follower([&] {
    TcpStore s(keyed(1, port, key));
    s.set("from-1", "hello");
    s.barrier();
  });
  EXPECT_EQ(root->get_string("from-1"), "hello");
  root->barrier();
  follower.join();
}

TEST(RankEnv, ParsesAndValidates) {
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "10.1.2.3", 1);
  ::setenv("MASTER_PORT", "1234", 1);
  ::unsetenv("LOCAL_RANK");
  RankEnv e = RankEnv::from_env();
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "10.1.2.3");
  EXPECT_EQ(e.master_port, 1234);
  ::setenv("RANK", "2", 1);
  EXPECT_THROW(RankEnv::from_env(), Error);
  ::setenv("RANK", "x", 1);
  EXPECT_THROW(RankEnv::from_env(), Error);
  ::unsetenv("RANK");
  try {
    RankEnv::from_env();
    FAIL();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("RANK"), std::string::npos);
  }
  ::unsetenv("WORLD_SIZE");
  ::unsetenv("MASTER_ADDR");
  ::unsetenv("MASTER_PORT");
}

// Processes, not threads: the launcher's environment and the store across fork().
TEST(LocalLauncher, RanksBootstrapFromEnvironment) {
  auto results = run_local_ranks(
      3,
      [](int rank) {
        RankEnv env = RankEnv::from_env();
        TANDEM_CHECK(env.rank == rank && env.world_size == 3, "bad env");
        const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
        TANDEM_CHECK(nvls != nullptr && std::string(nvls) == "0", "NVLS not disabled");
        TcpStoreOptions o;
        o.host = env.master_addr;
        o.port = env.master_port;
        o.rank = env.rank;
        o.world_size = env.world_size;
        o.timeout = std::chrono::seconds(20);
        TcpStore s(o);
        s.set("r" + std::to_string(rank), std::to_string(rank * 10));
        s.barrier();
        int sum = 0;
        for (int q = 0; q < 3; ++q) sum += std::stoi(s.get_string("r" + std::to_string(q)));
        TANDEM_CHECK(sum == 30, "sum ", sum);
      },
      std::chrono::seconds(60));
  EXPECT_EQ(describe_failures(results), "");
}

TEST(LocalLauncher, ReportsFailuresAndKillsHangs) {
  auto results = run_local_ranks(
      2,
      [](int rank) {
        if (rank == 0) TANDEM_THROW(kInternal, "rank zero broke");
        std::this_thread::sleep_for(std::chrono::seconds(60));  // hangs: killed after grace
      },
      std::chrono::seconds(30), std::chrono::seconds(1));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_FALSE(results[0].ok);
  EXPECT_NE(results[0].message.find("rank zero broke"), std::string::npos) << results[0].message;
  EXPECT_FALSE(results[1].ok);
  EXPECT_TRUE(results[1].timed_out);
}

TEST(LocalLauncher, RunInChild) {
  EXPECT_EQ(run_in_child([] { return 42; }, -1), 42);
  EXPECT_EQ(run_in_child([]() -> int { throw std::runtime_error("x"); }, -1), -1);
}

}  // namespace
}  // namespace tandem::comm
