// GlooCommunicator over loopback TCP, rendezvous through TcpStore: ranks as threads and as
// forked processes (torchrun-style environment), against the same serial references as the
// LocalCommunicator (bit-exact: both sum in rank order).
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <vector>

#include "comm/gloo_comm.h"
#include "comm/local_launcher.h"
#include "comm/moe_dispatch.h"
#include "comm/tcp_store.h"
#include "core/error.h"

namespace tandem::comm::testing {
// Defined in test_local_comm.cpp (same binary).
void check_collectives(Communicator& comm, uint64_t seed);
void check_moe_all_to_all(Communicator& comm, int64_t num_experts, int64_t top_k, uint64_t seed);
}  // namespace tandem::comm::testing

namespace tandem::comm {
namespace {

using namespace std::chrono_literals;

TcpStoreOptions store_options(int rank, int world, int port) {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.rank = rank;
  o.world_size = world;
  o.timeout = 20s;
  return o;
}

GlooOptions gloo_options() {
  GlooOptions o;
  o.timeout = 20s;
  return o;
}

// Runs body(comm) on `world` threads, each with its own TcpStore client and Gloo context.
void run_gloo_threads(int world, const std::function<void(Communicator&)>& body) {
  auto root_store = std::make_unique<TcpStore>(store_options(0, world, 0));
  const int port = root_store->port();
  std::vector<std::future<void>> others;
  for (int r = 1; r < world; ++r) {
    others.push_back(std::async(std::launch::async, [=, &body] {
      TcpStore store(store_options(r, world, port));
      GlooCommunicator comm(store, gloo_options());
      body(comm);
    }));
  }
  std::exception_ptr err;
  try {
    GlooCommunicator comm(*root_store, gloo_options());
    body(comm);
  } catch (...) {
    err = std::current_exception();
  }
  for (auto& f : others) f.get();  // rethrows a rank's failure
  root_store.reset();
  if (err) std::rethrow_exception(err);
}

TEST(GlooComm, CollectivesAsThreads) {
  for (int n : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(n));
    run_gloo_threads(n, [](Communicator& comm) { testing::check_collectives(comm, 1234); });
  }
}

TEST(GlooComm, MoeAllToAllAsThreads) {
  run_gloo_threads(3, [](Communicator& comm) {
    testing::check_moe_all_to_all(comm, 12, 2, 5);
    testing::check_moe_all_to_all(comm, 6, 4, 6);
  });
}

TEST(GlooComm, SingleRankWorld) {
  run_gloo_threads(1, [](Communicator& comm) { testing::check_collectives(comm, 9); });
}

TEST(GlooComm, ForkedRanksFromEnv) {
  // Each child bootstraps from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, as under
  // torchrun (the launcher sets them); a failed check throws, which fails that child.
  auto results = run_local_ranks(
      3,
      [](int) {
        GlooOptions o;
        o.timeout = 20s;
        auto comm = GlooCommunicator::from_env(o);
        testing::check_collectives(*comm, 77);
        testing::check_moe_all_to_all(*comm, 6, 2, 8);
      },
      60s, 5s);
  EXPECT_EQ(describe_failures(results), "");
}

}  // namespace
}  // namespace tandem::comm
