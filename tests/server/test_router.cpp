// Disaggregated serving in one process: router -> prefill instance (TP=t, ranks as threads)
// -> KV hand-off over loopback TCP -> decode instance (DP=d, EP=d, lockstep ranks), against
// the single-process engine:
//  - every golden fixture: greedy output token for token, logprobs within 1e-4;
//  - prefill TP=4 on a model with 2 KV heads (replicated heads, every head sent once);
//  - TP=2 on an MQA model;
//  - 32 concurrent requests spread over two decode instances;
//  - a decode instance killed mid-stream ends only its requests, with an error.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <mutex>
#include <thread>

#include "comm/local_comm.h"
#include "core/error.h"
#include "engine/decode_instance.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "engine/prefill_instance.h"
#include "model/qwen3_moe.h"
#include "server/instance_api.h"
#include "server/router.h"

namespace tandem {
namespace {

using namespace std::chrono_literals;

struct Result {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top;
  FinishReason reason = FinishReason::kNone;
  std::string error;
  int finished = 0;
};

// Collects outputs of many requests from any thread.
class Collector {
 public:
  explicit Collector(size_t n) : results_(n) {}
  OutputCallback callback(size_t i) {
    return [this, i](const StepOutput& o) {
      std::lock_guard<std::mutex> lock(mu_);
      Result& r = results_[i];
      r.ids.insert(r.ids.end(), o.token_ids.begin(), o.token_ids.end());
      r.logprobs.insert(r.logprobs.end(), o.token_logprobs.begin(), o.token_logprobs.end());
      r.top.insert(r.top.end(), o.top_logprobs.begin(), o.top_logprobs.end());
      if (o.finished) {
        r.reason = o.finish_reason;
        r.error = o.error;
        ++r.finished;
        ++done_;
        cv_.notify_all();
      }
    };
  }
  bool wait_all(std::chrono::seconds timeout = 120s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return done_ == results_.size(); });
  }
  // Waits until every request has at least `n` tokens or has finished.
  bool wait_tokens(size_t n, std::chrono::seconds timeout = 60s) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] {
      for (const auto& r : results_) {
        if (r.ids.size() < n && r.finished == 0) return false;
      }
      return true;
    });
  }
  void poke() { cv_.notify_all(); }
  std::vector<Result> results() {
    std::lock_guard<std::mutex> lock(mu_);
    return results_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Result> results_;
  size_t done_ = 0;
};

GenRequest greedy(const std::string& id, const std::vector<int32_t>& prompt, int32_t max_tokens) {
  GenRequest r;
  r.id = id;
  r.prompt_ids = prompt;
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.sampling.logprobs = 3;
  return r;
}

EngineConfig small_engine() {
  EngineConfig c;
  c.page_size = 16;
  c.num_pages = 512;
  c.max_batched_tokens = 64;  // several chunks for the longer prompts
  return c;
}

// The single-process engine's outputs for the requests (submitted together, one batch).
std::vector<Result> run_single(const std::string& dir, const std::vector<GenRequest>& reqs) {
  auto model = Qwen3MoeCpu::load(dir);
  Engine engine(*model, small_engine());
  Collector c(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) engine.add(reqs[i], c.callback(i));
  while (engine.step()) {
  }
  return c.results();
}

bool splits(const std::string& dir, const ShardSpec& spec) {
  try {
    ShardPlan::make(ModelConfig::from_dir(dir), spec);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// One prefill instance, `num_decode` decode instances, a router over them. Remote: the router
// reaches the instances through their InstanceServers over loopback TCP (as in separate
// processes), not through the objects.
struct Cluster {
  std::unique_ptr<PrefillInstance> prefill;
  std::vector<std::unique_ptr<DecodeInstance>> decode;
  std::vector<std::unique_ptr<InstanceServer>> servers;  // remote only: [prefill, decode...]
  std::unique_ptr<RemotePrefill> remote_prefill;
  std::vector<std::unique_ptr<RemoteDecode>> remote_decode;
  std::unique_ptr<Router> router;

  Cluster(const std::string& dir, int tp, int dp, int num_decode = 1, int64_t max_decode_batch = 32,
          bool remote = false) {
    PrefillInstanceConfig pc;
    pc.model_dir = dir;
    pc.tp = tp;
    pc.engine = small_engine();
    prefill = std::make_unique<PrefillInstance>(pc);
    PrefillClient* p = prefill.get();
    if (remote) {
      servers.push_back(std::make_unique<InstanceServer>(nullptr, p, "127.0.0.1", 0));
      remote_prefill =
          std::make_unique<RemotePrefill>("127.0.0.1:" + std::to_string(servers.back()->port()));
      p = remote_prefill.get();
    }
    std::vector<DecodeClient*> ds;
    for (int i = 0; i < num_decode; ++i) {
      DecodeInstanceConfig dc;
      dc.model_dir = dir;
      dc.dp = dp;
      dc.engine = small_engine();
      dc.max_decode_batch = max_decode_batch;
      decode.push_back(std::make_unique<DecodeInstance>(dc));
      ds.push_back(decode.back().get());
      if (remote) {
        servers.push_back(std::make_unique<InstanceServer>(ds.back(), nullptr, "127.0.0.1", 0));
        remote_decode.push_back(
            std::make_unique<RemoteDecode>("127.0.0.1:" + std::to_string(servers.back()->port())));
        ds.back() = remote_decode.back().get();
      }
    }
    router = std::make_unique<Router>(std::vector<PrefillClient*>{p}, ds);
  }
  // Stops decode instance i like a crashed process (and its control server with it).
  void kill_decode(size_t i) {
    decode[i]->kill();
    if (!servers.empty()) servers[1 + i]->stop();
  }
  ~Cluster() {
    router.reset();
    remote_decode.clear();
    remote_prefill.reset();
    servers.clear();
    prefill.reset();  // before the decode instances: its failure callbacks reach them
    decode.clear();
  }
};

std::vector<Result> run_router(Router& router, const std::vector<GenRequest>& reqs) {
  Collector c(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) router.submit(reqs[i], c.callback(i));
  EXPECT_TRUE(c.wait_all()) << "requests did not finish";
  return c.results();
}

void expect_same(const std::vector<Result>& want, const std::vector<Result>& got,
                 const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    EXPECT_EQ(got[i].finished, 1);
    EXPECT_EQ(got[i].reason, want[i].reason) << got[i].error;
    ASSERT_EQ(got[i].ids, want[i].ids);
    ASSERT_EQ(got[i].logprobs.size(), want[i].logprobs.size());
    for (size_t t = 0; t < want[i].logprobs.size(); ++t) {
      EXPECT_NEAR(got[i].logprobs[t], want[i].logprobs[t], 1e-4) << "token " << t;
    }
    ASSERT_EQ(got[i].top.size(), want[i].top.size());
    for (size_t t = 0; t < want[i].top.size(); ++t) {
      ASSERT_EQ(got[i].top[t].size(), want[i].top[t].size()) << "token " << t;
      for (size_t k = 0; k < want[i].top[t].size(); ++k) {
        EXPECT_NEAR(got[i].top[t][k].logprob, want[i].top[t][k].logprob, 1e-4)
            << "token " << t << " rank " << k;
      }
    }
  }
}

std::vector<GenRequest> golden_requests(const testing::Golden& g) {
  std::vector<GenRequest> reqs;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    reqs.push_back(greedy("g" + std::to_string(i), g.cases[i].prompt_ids, g.cases[i].max_tokens));
  }
  return reqs;
}

// ---- Golden fixtures: router -> prefill TP=2 -> decode DP=2. ----

class DisaggregatedGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(DisaggregatedGolden, MatchesSingleProcess) {
  testing::Golden g = testing::load_golden(GetParam());
  const int tp = splits(g.dir, ShardSpec::prefill(0, 2)) ? 2 : 1;
  const int dp = splits(g.dir, ShardSpec::decode(0, 2)) ? 2 : 1;
  if (tp == 1 || dp == 1) std::cerr << g.name << ": TP=" << tp << " DP=" << dp << "\n";
  std::vector<GenRequest> reqs = golden_requests(g);
  std::vector<Result> want = run_single(g.dir, reqs);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(want[i].ids, g.cases[i].output_ids);
  Cluster cluster(g.dir, tp, dp);
  expect_same(want, run_router(*cluster.router, reqs), g.name);
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = std::filesystem::path(info.param).filename().string();
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DisaggregatedGolden, ::testing::ValuesIn(testing::golden_dirs()),
                         param_name);

// ---- Layouts. ----

std::string fixture(const std::string& name) {
  return testing::source_dir() + "/tests/data/fixtures/" + name;
}

TEST(Disaggregated, PrefillTp4OverTwoKvHeads) {
  const std::string dir = fixture("hub_gqa_top2");  // 8 q heads, 2 KV heads, 16 experts
  ASSERT_EQ(ModelConfig::from_dir(dir).num_key_value_heads, 2);
  testing::Golden g = testing::load_golden(dir);
  std::vector<GenRequest> reqs = golden_requests(g);
  Cluster cluster(dir, /*tp=*/4, /*dp=*/2);
  EXPECT_EQ(cluster.prefill->num_senders(), 2);  // ranks 0 and 2; 1 and 3 hold replicas
  expect_same(run_single(dir, reqs), run_router(*cluster.router, reqs), "TP=4 over 2 KV heads");
}

TEST(Disaggregated, PrefillTp2OnMqa) {
  const std::string dir = fixture("hub_mqa_hd128");  // 1 KV head
  ASSERT_EQ(ModelConfig::from_dir(dir).num_key_value_heads, 1);
  testing::Golden g = testing::load_golden(dir);
  std::vector<GenRequest> reqs = golden_requests(g);
  Cluster cluster(dir, /*tp=*/2, /*dp=*/2);
  EXPECT_EQ(cluster.prefill->num_senders(), 1);
  expect_same(run_single(dir, reqs), run_router(*cluster.router, reqs), "MQA TP=2");
}

TEST(Disaggregated, SeededSamplingStopIdsAndPromptLogprobsMatchSingle) {
  const std::string dir = fixture("hub_gqa_top2");
  testing::Golden g = testing::load_golden(dir);
  std::vector<GenRequest> reqs = golden_requests(g);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].sampling.temperature = 0.8f;
    reqs[i].sampling.top_p = 0.9f;
    reqs[i].sampling.seed = 1234 + i;
    reqs[i].sampling.prompt_logprobs = 1;
    if (i == 0) reqs[i].stop_token_ids = {g.cases[0].output_ids[2]};
  }
  std::vector<Result> want = run_single(dir, reqs);
  Cluster cluster(dir, 2, 2);
  Collector c(reqs.size());
  std::vector<std::vector<float>> prompt_lp(reqs.size());
  std::mutex mu;
  for (size_t i = 0; i < reqs.size(); ++i) {
    OutputCallback inner = c.callback(i);
    cluster.router->submit(reqs[i], [&, i, inner](const StepOutput& o) {
      {
        std::lock_guard<std::mutex> lock(mu);
        prompt_lp[i].insert(prompt_lp[i].end(), o.prompt_token_logprobs.begin(),
                            o.prompt_token_logprobs.end());
      }
      inner(o);
    });
  }
  ASSERT_TRUE(c.wait_all());
  expect_same(want, c.results(), "seeded");
  EXPECT_EQ(want[0].reason, FinishReason::kStop);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(prompt_lp[i].size(), reqs[i].prompt_ids.size() - 1) << i;
  }
}

// One PrefillInstance per rank (as with one process per rank), over a group's communicators.
TEST(Disaggregated, PrefillOneInstancePerRank) {
  const std::string dir = fixture("tf5_step2_sharded");
  testing::Golden g = testing::load_golden(dir);
  std::vector<GenRequest> reqs = golden_requests(g);
  PrefillInstanceConfig pc;
  pc.model_dir = dir;
  pc.tp = 2;
  pc.engine = small_engine();
  auto comms = comm::LocalCommunicator::create_group(2);
  std::unique_ptr<comm::Communicator> c1 = std::move(comms[1]);
  auto follower = std::async(std::launch::async, [&] {
    PrefillInstance rank1(pc, std::move(c1));  // collective with rank 0's constructor
    EXPECT_FALSE(rank1.is_leader());
    rank1.wait();  // until rank 0 stops the group
  });
  {
    auto leader = std::make_unique<PrefillInstance>(pc, std::move(comms[0]));
    ASSERT_TRUE(leader->is_leader());
    DecodeInstanceConfig dc;
    dc.model_dir = dir;
    dc.dp = 2;
    dc.engine = small_engine();
    DecodeInstance decode(dc);
    {
      Router router({leader.get()}, {&decode});
      expect_same(run_single(dir, reqs), run_router(router, reqs), "one instance per rank");
    }
    leader.reset();  // stops the group
  }
  ASSERT_EQ(follower.wait_for(30s), std::future_status::ready);
  follower.get();
}

// ---- Load spreading and failures. ----

std::vector<GenRequest> many_requests(const testing::Golden& g, int n, int32_t max_tokens,
                                      const std::string& prefix) {
  std::vector<GenRequest> reqs;
  for (int i = 0; i < n; ++i) {
    const auto& c = g.cases[static_cast<size_t>(i) % g.cases.size()];
    std::vector<int32_t> prompt = c.prompt_ids;
    prompt.push_back(static_cast<int32_t>(i % 50) + 3);  // distinct prompts
    GenRequest r = greedy(prefix + std::to_string(i), prompt, max_tokens);
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  return reqs;
}

TEST(Disaggregated, ThirtyTwoConcurrentOverTwoDecodeInstances) {
  const std::string dir = fixture("hub_gqa_top2");
  testing::Golden g = testing::load_golden(dir);
  std::vector<GenRequest> reqs = many_requests(g, 32, 12, "c");
  std::vector<Result> want = run_single(dir, reqs);
  // 2 instances x 2 ranks x 8 = 32 slots: every request fits, spread over both.
  Cluster cluster(dir, 2, 2, /*num_decode=*/2, /*max_decode_batch=*/8);
  expect_same(want, run_router(*cluster.router, reqs), "32 concurrent");
  for (const auto& d : cluster.decode) EXPECT_GT(d->stats().generation_tokens, 0);
  // Beyond capacity: refused with kOutOfResources, not queued forever.
}

void kill_test(bool remote) {
  const std::string dir = fixture("hub_gqa_top2");
  testing::Golden g = testing::load_golden(dir);
  std::vector<GenRequest> reqs = many_requests(g, 8, 400, "k");
  Cluster cluster(dir, 2, 2, /*num_decode=*/2, /*max_decode_batch=*/4, remote);
  Collector c(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) cluster.router->submit(reqs[i], c.callback(i));
  ASSERT_TRUE(c.wait_tokens(2));
  const int64_t on_victim = cluster.decode[0]->stats().running;
  ASSERT_GT(on_victim, 0);
  cluster.kill_decode(0);
  ASSERT_TRUE(c.wait_all());
  int errors = 0, ok = 0;
  for (const Result& r : c.results()) {
    EXPECT_EQ(r.finished, 1);
    if (r.reason == FinishReason::kError) {
      ++errors;
      EXPECT_NE(r.error.find("decode instance"), std::string::npos) << r.error;
    } else {
      ++ok;
      EXPECT_EQ(r.reason, FinishReason::kLength);
      EXPECT_EQ(r.ids.size(), 400u);
    }
  }
  EXPECT_EQ(errors, on_victim);
  EXPECT_EQ(ok, static_cast<int>(reqs.size()) - on_victim);
  // The dead instance is never picked again: new requests go to the live one.
  std::vector<GenRequest> more = many_requests(g, 4, 5, "after");
  std::vector<Result> after = run_router(*cluster.router, more);
  for (const Result& r : after) EXPECT_EQ(r.reason, FinishReason::kLength) << r.error;
}

TEST(Disaggregated, KilledDecodeInstanceEndsOnlyItsRequests) { kill_test(false); }

// ---- The same over the control protocol (instance_api), as separate processes would. ----

TEST(DisaggregatedRemote, GoldenOverControlProtocol) {
  for (const std::string name : {"hub_gqa_top2", "tf5_step2_sharded"}) {
    const std::string dir = fixture(name);
    testing::Golden g = testing::load_golden(dir);
    std::vector<GenRequest> reqs = golden_requests(g);
    Cluster cluster(dir, 2, 2, /*num_decode=*/2, /*max_decode_batch=*/32, /*remote=*/true);
    expect_same(run_single(dir, reqs), run_router(*cluster.router, reqs), name + " remote");
  }
}

TEST(DisaggregatedRemote, KilledDecodeInstanceEndsOnlyItsRequests) { kill_test(true); }

TEST(Disaggregated, AbortAndMetrics) {
  const std::string dir = fixture("hub_gqa_top2");
  testing::Golden g = testing::load_golden(dir);
  Cluster cluster(dir, 2, 2);
  std::vector<GenRequest> reqs = many_requests(g, 8, 600, "a");
  Collector c(reqs.size());
  // The first half is aborted at once (queued for prefill or its KV in flight), the second
  // half once it streams (decoding).
  for (size_t i = 0; i < reqs.size(); ++i) {
    cluster.router->submit(reqs[i], c.callback(i));
    if (i < 4) cluster.router->abort(reqs[i].id);
  }
  ASSERT_TRUE(c.wait_tokens(1));
  for (size_t i = 4; i < reqs.size(); ++i) cluster.router->abort(reqs[i].id);
  ASSERT_TRUE(c.wait_all());
  std::vector<Result> got = c.results();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].finished, 1);
    if (i < 4) {
      EXPECT_EQ(got[i].reason, FinishReason::kAbort) << i;
    } else {  // the tiny model may finish before the abort lands
      EXPECT_TRUE(got[i].reason == FinishReason::kAbort || got[i].ids.size() == 600u) << i;
    }
  }
  // Every page is back once the ranks applied the aborts.
  for (int i = 0; i < 100 && cluster.decode[0]->stats().kv_pages_free <
                                 cluster.decode[0]->stats().kv_pages_total;
       ++i) {
    std::this_thread::sleep_for(10ms);
  }
  EngineStats st = cluster.decode[0]->stats();
  EXPECT_EQ(st.kv_pages_free, st.kv_pages_total);
  const std::string m = cluster.router->metrics_text();
  EXPECT_NE(m.find("tandem_prefill_queued_input_tokens{instance=\"0\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("tandem_decode_batch{instance=\"0\",rank=\"1\"} 0"), std::string::npos) << m;
  EXPECT_GT(cluster.prefill->load().input_tokens_total, 0);
  EXPECT_GT(cluster.prefill->load().input_tokens_per_s, 0.0);  // (over the last 10 s)
  // A request that can never run is refused synchronously.
  GenRequest bad = greedy("bad", {}, 4);
  EXPECT_THROW(cluster.router->submit(bad, nullptr), Error);
}

}  // namespace
}  // namespace tandem
