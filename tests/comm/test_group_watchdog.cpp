// The group watchdog: a rank that dies (kill -9 of its process) is noticed by the others within
// its timeout, naming the rank; a healthy group raises nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <thread>

#include "comm/group_watchdog.h"
#include "comm/local_launcher.h"
#include "comm/tcp_store.h"
#include "core/error.h"

namespace tandem::comm {
namespace {

std::shared_ptr<TcpStore> group_store() {
  const RankEnv env = RankEnv::from_env();
  TcpStoreOptions o = TcpStoreOptions::of(env);
  o.timeout = std::chrono::seconds(10);
  return std::make_shared<TcpStore>(o);
}

TEST(GroupWatchdog, NoticesAKilledRankWithinItsTimeout) {
  auto results = run_local_ranks(
      3,
      [](int rank) {
        auto store = group_store();
        std::atomic<int> lost{-5};
        std::atomic<int64_t> when_ms{0};
        const auto t0 = std::chrono::steady_clock::now();
        WatchdogOptions o;
        o.interval = std::chrono::milliseconds(50);
        o.timeout = std::chrono::milliseconds(1500);  // (a loaded CI machine delays threads)
        auto dog = std::make_unique<GroupWatchdog>(
            store,
            [&](int r, const std::string&) {
              when_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
              lost = r;
            },
            o);
        store->barrier();
        if (rank == 2) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1000));
          ::kill(::getpid(), SIGKILL);
        }
        for (int i = 0; i < 1000 && lost == -5; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        TANDEM_CHECK(lost == 2, "rank ", rank, ": lost ", lost.load());
        TANDEM_CHECK(when_ms > 2000 && when_ms < 8000, "noticed after ", when_ms.load(), " ms");
        dog.reset();
        store->set("done/" + std::to_string(rank), "1");
        if (rank == 0) store->get("done/1");  // rank 1 still reads the store served here
      },
      std::chrono::seconds(60), std::chrono::seconds(10));
  ASSERT_EQ(results.size(), 3u);
  EXPECT_TRUE(results[0].ok) << results[0].message;
  EXPECT_TRUE(results[1].ok) << results[1].message;
  EXPECT_EQ(results[2].term_signal, SIGKILL);
}

TEST(GroupWatchdog, QuietWhileEveryRankLives) {
  auto results = run_local_ranks(
      2,
      [](int rank) {
        auto store = group_store();
        std::atomic<bool> lost{false};
        WatchdogOptions o;
        o.interval = std::chrono::milliseconds(50);
        o.timeout = std::chrono::milliseconds(2000);
        auto dog = std::make_unique<GroupWatchdog>(
            store, [&](int, const std::string&) { lost = true; }, o);
        std::this_thread::sleep_for(std::chrono::milliseconds(3000));
        TANDEM_CHECK(!lost, "rank ", rank, ": a live rank was reported lost");
        store->barrier();
        dog.reset();
        store->barrier();
      },
      std::chrono::seconds(60));
  EXPECT_EQ(describe_failures(results), "");
}

}  // namespace
}  // namespace tandem::comm
