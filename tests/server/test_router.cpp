// Disaggregated serving in one process: router -> prefill instance (TP=t, ranks as threads)
// -> KV hand-off over loopback TCP -> decode instance (DP=d, EP=d, lockstep ranks), against
// the single-process engine:
//  - every golden fixture: greedy output token for token, logprobs within 1e-4;
//  - prefill TP=4 on a model with 2 KV heads (replicated heads, every head sent once);
//  - TP=2 on an MQA model;
//  - 32 concurrent requests spread over two decode instances;
//  - a decode instance killed mid-stream ends only its requests, with an error;
//  - membership heals: a router started before its instances serves once they are up, marks
//    a dead one unready (503, not 429), and re-admits it restarted on the same port;
//  - the bounded router queue: requests wait for a slot, time out retryably, overflow to 429.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <mutex>
#include <thread>

#include "comm/local_comm.h"
#include "core/error.h"
#include "disagg/decode_instance.h"
#include "disagg/instance_api.h"
#include "disagg/prefill_instance.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "engine/mtp_weights.h"
#include "model/qwen3_5_moe.h"
#include "model/qwen3_moe.h"
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
  int32_t retry_after_s = 0;
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
        r.retry_after_s = o.retry_after_s;
        ++r.finished;
        ++done_;
      }
      // Every output (wait_tokens counts tokens: notified on finishes only, it returned at the
      // first finish, and the kill test then killed an instance whose last finished sequence's
      // outputs were still on the way, lost with it and not among its running ones).
      cv_.notify_all();
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
// Changes to the instances' configurations (speculation, a transfer backend).
struct ClusterSetup {
  std::function<void(PrefillInstanceConfig&)> prefill;
  std::function<void(DecodeInstanceConfig&)> decode;
};

struct Cluster {
  std::unique_ptr<PrefillInstance> prefill;
  std::vector<std::unique_ptr<DecodeInstance>> decode;
  std::vector<std::unique_ptr<InstanceServer>> servers;  // remote only: [prefill, decode...]
  std::unique_ptr<RemotePrefill> remote_prefill;
  std::vector<std::unique_ptr<RemoteDecode>> remote_decode;
  std::unique_ptr<Router> router;

  Cluster(const std::string& dir, int tp, int dp, int num_decode = 1, int64_t max_decode_batch = 32,
          bool remote = false, RouterConfig rcfg = {}, const ClusterSetup& setup = {}) {
    PrefillInstanceConfig pc;
    pc.model_dir = dir;
    pc.tp = tp;
    pc.engine = small_engine();
    if (setup.prefill) setup.prefill(pc);
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
      if (setup.decode) setup.decode(dc);
      decode.push_back(std::make_unique<DecodeInstance>(dc));
      ds.push_back(decode.back().get());
      if (remote) {
        servers.push_back(std::make_unique<InstanceServer>(ds.back(), nullptr, "127.0.0.1", 0));
        remote_decode.push_back(
            std::make_unique<RemoteDecode>("127.0.0.1:" + std::to_string(servers.back()->port())));
        ds.back() = remote_decode.back().get();
      }
    }
    router = std::make_unique<Router>(std::vector<PrefillClient*>{p}, ds, rcfg);
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
  EXPECT_EQ(cluster.prefill->transfer_errors(), 0);  // (each rank ends each transfer once)
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
  EXPECT_EQ(cluster.prefill->transfer_errors(), 0);
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
  constexpr size_t kTokens = 400;
  std::vector<GenRequest> reqs = many_requests(g, 8, static_cast<int32_t>(kTokens), "k");
  Cluster cluster(dir, 2, 2, /*num_decode=*/2, /*max_decode_batch=*/4, remote);
  Collector c(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) cluster.router->submit(reqs[i], c.callback(i));
  ASSERT_TRUE(c.wait_tokens(2));
  // The victim: an instance with requests on it (the router may have placed all of them on
  // one instance when they arrived together, before any load report).
  // Its requests: running or waiting (a sequence preempted for KV pages waits on the
  // instance and ends with it too).
  auto held = [&](size_t d) {
    const EngineStats s = cluster.decode[d]->stats();
    return s.running + s.waiting;
  };
  const int victim = held(0) > 0 ? 0 : 1;
  const int64_t on_victim = held(static_cast<size_t>(victim));
  ASSERT_GT(on_victim, 0);
  cluster.kill_decode(static_cast<size_t>(victim));
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
      EXPECT_EQ(r.ids.size(), kTokens);
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

// ---- MTP speculation on the decode instances. ----

// Every call of a speculating engine's draft hook: the tokens so far and the MTP layer's own
// drafts (before the hook replaces them), per request.
struct DraftLog {
  std::mutex mu;
  std::map<std::string, std::vector<std::vector<int32_t>>> calls;
};

// Drafts from the reference continuations, wrong where (position * 7 + id length) % 5 == 0 (so
// several accepted lengths occur; deterministic whatever the order of the calls across ranks),
// logging the MTP's drafts first.
EngineConfig::SpecHookFn logging_oracle(const std::vector<GenRequest>& reqs,
                                        const std::vector<Result>& ref, int64_t vocab,
                                        std::shared_ptr<DraftLog> log) {
  std::map<std::string, std::vector<int32_t>> full;
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::vector<int32_t> t = reqs[i].prompt_ids;
    t.insert(t.end(), ref[i].ids.begin(), ref[i].ids.end());
    full[reqs[i].id] = t;
  }
  return [full, vocab, log](const std::string& id, std::span<const int32_t> tokens,
                            std::vector<int32_t>& drafts) {
    {
      std::lock_guard<std::mutex> lock(log->mu);
      std::vector<int32_t> call = {static_cast<int32_t>(tokens.size())};
      call.insert(call.end(), drafts.begin(), drafts.end());
      log->calls[id].push_back(std::move(call));
    }
    auto it = full.find(id);
    if (it == full.end()) return;
    for (size_t m = 0; m < drafts.size(); ++m) {
      const size_t pos = tokens.size() + m;
      if (pos < it->second.size()) drafts[m] = it->second[pos];
      if ((pos * 7 + id.size()) % 5 == 0) drafts[m] = static_cast<int32_t>((drafts[m] + 1) % vocab);
    }
  };
}

// Requests whose counters differ when the decode side's first step does not verify.
std::vector<GenRequest> spec_requests() {
  std::vector<GenRequest> reqs;
  const int32_t max_tokens[] = {13, 10, 14, 11, 9};
  for (int i = 0; i < 5; ++i) {
    std::vector<int32_t> prompt;
    for (int j = 0; j < 5 + 11 * i; ++j) prompt.push_back((3 + 7 * i + 5 * j) % 97);
    GenRequest r = greedy("s" + std::to_string(i), prompt, max_tokens[i]);
    r.sampling.logprobs = -1;
    reqs.push_back(r);
  }
  return reqs;
}

EngineConfig spec_engine(EngineConfig::SpecHookFn hook) {
  EngineConfig c = small_engine();
  c.num_speculative_tokens = 3;
  c.spec_draft_hook = std::move(hook);
  return c;
}

// A cluster whose instances transfer through `backend` and whose decode instance speculates
// (spec_engine(hook), the random MTP layer of `dir`).
ClusterSetup speculating_setup(const std::string& dir,
                               std::shared_ptr<transfer::TransferBackend> backend,
                               EngineConfig::SpecHookFn hook) {
  ClusterSetup setup;
  setup.prefill = [backend](PrefillInstanceConfig& c) { c.transfer = backend; };
  setup.decode = [dir, backend, hook](DecodeInstanceConfig& c) {
    c.engine = spec_engine(hook);
    c.mtp_dir = testing::random_mtp_dir(dir);
    c.transfer = backend;
  };
  return setup;
}

struct SpecRun {
  std::vector<Result> results;
  EngineStats stats;
  std::shared_ptr<DraftLog> log = std::make_shared<DraftLog>();
};

// One speculating engine (the MTP layer's KV of each prompt from its own prefill step); without
// `ref`, one that does not speculate.
SpecRun run_single_spec(const std::string& dir, const std::vector<GenRequest>& reqs,
                        const std::vector<Result>* ref, bool one_by_one = false) {
  auto model = load_cpu_model(dir);
  model->load_mtp(testing::random_mtp_dir(dir));
  SpecRun run;
  Engine engine(*model, ref == nullptr ? small_engine()
                                       : spec_engine(logging_oracle(
                                             reqs, *ref, model->config().vocab_size, run.log)));
  Collector c(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    engine.add(reqs[i], c.callback(i));
    while (one_by_one && engine.step()) {
    }
  }
  while (engine.step()) {
  }
  run.results = c.results();
  run.stats = engine.stats();
  return run;
}

// Wraps a backend, counting per request the hidden_size the destination asked for and the
// hidden-state floats the prefill ranks sent (every rank's FINISH payload).
class RecordingBackend final : public transfer::TransferBackend {
 public:
  struct Seen {
    int64_t hidden_size = -1;  // the descriptor's (rank 0's begin)
    int64_t hidden_floats = 0;
    int64_t hidden_begin = -1;
  };
  explicit RecordingBackend(std::shared_ptr<transfer::TransferBackend> inner)
      : inner_(std::move(inner)) {}
  std::string_view name() const override { return inner_->name(); }
  bool carries_prompt_hidden() const override { return inner_->carries_prompt_hidden(); }
  std::unique_ptr<transfer::TransferSender> make_sender(const KvCache& cache,
                                                        const transfer::KvSharding& sharding,
                                                        int rank,
                                                        transfer::SenderCallbacks cbs) override {
    return std::make_unique<Sender>(inner_->make_sender(cache, sharding, rank, std::move(cbs)),
                                    *this);
  }
  std::unique_ptr<transfer::TransferReceiver> make_receiver(
      KvCache& cache, transfer::ReceiverCallbacks cbs) override {
    return inner_->make_receiver(cache, std::move(cbs));
  }
  std::map<std::string, Seen> seen() {
    std::lock_guard<std::mutex> lock(mu_);
    return seen_;
  }

 private:
  class Sender final : public transfer::TransferSender {
   public:
    Sender(std::unique_ptr<transfer::TransferSender> inner, RecordingBackend& b)
        : inner_(std::move(inner)), b_(b) {}
    void begin(const std::string& request, std::vector<transfer::TransferDescriptor> dst,
               std::vector<int32_t> pages) override {
      {
        std::lock_guard<std::mutex> lock(b_.mu_);
        b_.seen_[request].hidden_size = dst.front().hidden_size;
      }
      inner_->begin(request, std::move(dst), std::move(pages));
    }
    void send_layer(const std::string& request, int64_t layer,
                    transfer::TokenRange tokens) override {
      inner_->send_layer(request, layer, tokens);
    }
    void finish(const std::string& request, int32_t token, float logprob) override {
      inner_->finish(request, token, logprob);
    }
    void finish_with(const std::string& request, int32_t token, float logprob,
                     transfer::FinishPayload payload) override {
      {
        std::lock_guard<std::mutex> lock(b_.mu_);
        Seen& s = b_.seen_[request];
        s.hidden_floats += static_cast<int64_t>(payload.hidden.rows.size());
        if (!payload.hidden.empty()) s.hidden_begin = payload.hidden.begin;
      }
      inner_->finish_with(request, token, logprob, std::move(payload));
    }
    void abort(const std::string& request) override { inner_->abort(request); }

   private:
    std::unique_ptr<transfer::TransferSender> inner_;
    RecordingBackend& b_;
  };
  std::shared_ptr<transfer::TransferBackend> inner_;
  std::mutex mu_;
  std::map<std::string, Seen> seen_;
};

// A speculating decode instance gets each prompt's final hidden states from the prefill
// instance (TP 2: rank 0's, 4 * hidden bytes per prompt token) and runs its MTP layer over the
// prompt before the first decode step: the MTP layer's own drafts, step by step, the tokens and
// the spec counters are a single speculating engine's, under decode DP 1 and DP 2 (a
// collective MTP layer: the prompt's rows ride in pass 0 of a step's K passes). Without the
// hidden states the first decode step would not verify and the drafts would attend to zeros.
void expect_spec_like_single(const std::string& dir, int tp, const std::vector<int>& dps,
                             bool remote) {
  const std::vector<GenRequest> reqs = spec_requests();
  // No speculation: the oracle's continuations.
  const std::vector<Result> ref = run_single_spec(dir, reqs, nullptr).results;
  const SpecRun want = run_single_spec(dir, reqs, &ref);
  ASSERT_GT(want.stats.spec_num_accepted_tokens, 0);
  ASSERT_LT(want.stats.spec_num_accepted_tokens, want.stats.spec_num_draft_tokens);
  const int64_t hidden = ModelConfig::from_dir(dir).hidden_size;
  for (int dp : dps) {
    SCOPED_TRACE("decode dp " + std::to_string(dp) + (remote ? " remote" : ""));
    auto backend = std::make_shared<RecordingBackend>(host_transfer_backend({}));
    SpecRun got;
    const ClusterSetup setup = speculating_setup(
        dir, backend, logging_oracle(reqs, ref, ModelConfig::from_dir(dir).vocab_size, got.log));
    Cluster cluster(dir, tp, dp, /*num_decode=*/1, /*max_decode_batch=*/32, remote, {}, setup);
    got.results = run_router(*cluster.router, reqs);
    got.stats = cluster.decode[0]->stats();
    for (size_t i = 0; i < reqs.size(); ++i) {
      SCOPED_TRACE(reqs[i].id);
      EXPECT_EQ(got.results[i].reason, FinishReason::kLength) << got.results[i].error;
      EXPECT_EQ(got.results[i].ids, ref[i].ids);
      std::lock_guard<std::mutex> lock(got.log->mu);
      EXPECT_EQ(got.log->calls[reqs[i].id], want.log->calls[reqs[i].id]);
    }
    EXPECT_EQ(got.stats.spec_num_drafts, want.stats.spec_num_drafts);
    EXPECT_EQ(got.stats.spec_num_draft_tokens, want.stats.spec_num_draft_tokens);
    EXPECT_EQ(got.stats.spec_num_accepted_tokens, want.stats.spec_num_accepted_tokens);
    EXPECT_EQ(got.stats.spec_accepted_per_pos, want.stats.spec_accepted_per_pos);
    const auto seen = backend->seen();
    for (const GenRequest& r : reqs) {
      ASSERT_TRUE(seen.contains(r.id)) << r.id;
      EXPECT_EQ(seen.at(r.id).hidden_size, hidden) << r.id;
      EXPECT_EQ(seen.at(r.id).hidden_floats, static_cast<int64_t>(r.prompt_ids.size()) * hidden)
          << r.id;  // once, from one rank
      EXPECT_EQ(seen.at(r.id).hidden_begin, 0) << r.id;
    }
    EXPECT_EQ(cluster.prefill->transfer_errors(), 0);
  }
}

TEST(Disaggregated, SpeculativeDecodeGetsThePromptsMtpKv) {
  expect_spec_like_single(fixture("hub_gqa_top2"), 2, {1, 2}, false);
}

// Qwen3.5 (hybrid): the recurrent state and the hidden states travel with rank 0's FINISH; the
// decode instance speculates with DP 1 (hybrids refuse MTP under DP > 1).
TEST(Disaggregated, SpeculativeHybridDecodeGetsThePromptsMtpKv) {
  const std::string dir = fixture("qwen35_text_hd64_int2_fused");
  expect_spec_like_single(dir, splits(dir, ShardSpec::prefill(0, 2)) ? 2 : 1, {1}, false);
}

TEST(DisaggregatedRemote, SpeculativeDecodeGetsThePromptsMtpKv) {
  expect_spec_like_single(fixture("hub_gqa_top2"), 2, {1, 2}, true);
}

// A prompt whose first pages the prefill instance takes from its prefix cache: those positions
// are not computed there, and their hidden states come from the pages it kept of the earlier
// prompt (PromptHiddenCache), so the decode side's MTP KV of the whole prompt is built and its
// drafts, tokens and spec counters are those of one speculating engine serving the two prompts
// one after the other (where the second hits the prefix cache and its MTP KV too). Without the
// kept pages (hidden_cache_mb 0) the rows start at the first computed position.
TEST(Disaggregated, SpeculativeDecodeAfterAPrefillPrefixCacheHit) {
  const std::string dir = fixture("hub_gqa_top2");
  std::vector<GenRequest> reqs = spec_requests();
  reqs.resize(2);
  for (int j = 0; j < 40; ++j) reqs[0].prompt_ids.push_back((11 + 3 * j) % 97);
  reqs[1].prompt_ids = reqs[0].prompt_ids;
  reqs[1].prompt_ids.resize(37);  // pages 0 and 1 (32 tokens) cached by the first
  reqs[1].prompt_ids.push_back(5);
  const std::vector<Result> ref = run_single_spec(dir, reqs, nullptr, true).results;
  const SpecRun want = run_single_spec(dir, reqs, &ref, /*one_by_one=*/true);
  const int64_t hidden = ModelConfig::from_dir(dir).hidden_size;
  for (const int64_t cache_mb : {256, 0}) {
    SCOPED_TRACE("hidden cache " + std::to_string(cache_mb) + " MiB");
    auto backend = std::make_shared<RecordingBackend>(host_transfer_backend({}));
    SpecRun got;
    ClusterSetup setup = speculating_setup(
        dir, backend, logging_oracle(reqs, ref, ModelConfig::from_dir(dir).vocab_size, got.log));
    setup.prefill = [backend, cache_mb](PrefillInstanceConfig& c) {
      c.transfer = backend;
      c.hidden_cache_mb = cache_mb;
    };
    Cluster cluster(dir, /*tp=*/2, /*dp=*/1, 1, 32, false, {}, setup);
    for (size_t i = 0; i < reqs.size(); ++i) {  // one after the other: the second hits the cache
      const std::vector<Result> r = run_router(*cluster.router, {reqs[i]});
      EXPECT_EQ(r[0].ids, ref[i].ids) << reqs[i].id;
    }
    const auto seen = backend->seen();
    ASSERT_TRUE(seen.contains("s0") && seen.contains("s1"));
    EXPECT_EQ(seen.at("s0").hidden_begin, 0);
    const int64_t begin = cache_mb > 0 ? 0 : 32;
    EXPECT_EQ(seen.at("s1").hidden_begin, begin);
    EXPECT_EQ(seen.at("s1").hidden_floats, (38 - begin) * hidden);
    const EngineStats st = cluster.decode[0]->stats();
    EXPECT_GT(st.spec_num_drafts, 0);
    if (cache_mb > 0) {  // the whole prompt's MTP KV: the drafts are one engine's
      std::lock_guard<std::mutex> a(got.log->mu), b(want.log->mu);
      EXPECT_EQ(got.log->calls["s1"], want.log->calls["s1"]);
      EXPECT_EQ(st.spec_num_accepted_tokens, want.stats.spec_num_accepted_tokens);
      EXPECT_EQ(st.spec_accepted_per_pos, want.stats.spec_accepted_per_pos);
    }
  }
}

// A request that opts out of speculation (allow_speculation false) on a speculating decode
// instance asks for no hidden states either (decode DP 2: the reserve command carries it to
// the rank); the others get theirs; the tokens are the single engine's.
TEST(Disaggregated, OptedOutRequestGetsNoHiddenStates) {
  const std::string dir = fixture("hub_gqa_top2");
  std::vector<GenRequest> reqs = spec_requests();
  ASSERT_GE(reqs.size(), 2u);
  for (size_t i = 0; i < reqs.size(); i += 2) reqs[i].allow_speculation = false;
  const std::vector<Result> ref = run_single(dir, reqs);
  const int64_t hidden = ModelConfig::from_dir(dir).hidden_size;
  auto backend = std::make_shared<RecordingBackend>(host_transfer_backend({}));
  const ClusterSetup setup = speculating_setup(dir, backend, {});
  Cluster cluster(dir, /*tp=*/2, /*dp=*/2, 1, 32, false, {}, setup);
  expect_same(ref, run_router(*cluster.router, reqs), "opted out");
  const auto seen = backend->seen();
  for (size_t i = 0; i < reqs.size(); ++i) {
    const std::string& id = reqs[i].id;
    ASSERT_TRUE(seen.contains(id)) << id;
    const bool opted_out = i % 2 == 0;
    EXPECT_EQ(seen.at(id).hidden_size, opted_out ? 0 : hidden) << id;
    EXPECT_EQ(seen.at(id).hidden_floats,
              opted_out ? 0 : static_cast<int64_t>(reqs[i].prompt_ids.size()) * hidden)
        << id;
  }
}

// A decode instance that does not speculate asks for no hidden states, and none travel.
TEST(Disaggregated, NoHiddenStatesWithoutSpeculation) {
  const std::string dir = fixture("hub_gqa_top2");
  const std::vector<GenRequest> reqs = spec_requests();
  auto backend = std::make_shared<RecordingBackend>(host_transfer_backend({}));
  ClusterSetup setup;
  setup.prefill = [&](PrefillInstanceConfig& c) { c.transfer = backend; };
  setup.decode = [&](DecodeInstanceConfig& c) { c.transfer = backend; };
  Cluster cluster(dir, /*tp=*/2, /*dp=*/2, 1, 32, false, {}, setup);
  expect_same(run_single(dir, reqs), run_router(*cluster.router, reqs), "no speculation");
  const auto seen = backend->seen();
  ASSERT_EQ(seen.size(), reqs.size());
  for (const auto& [id, s] : seen) {
    EXPECT_EQ(s.hidden_size, 0) << id;
    EXPECT_EQ(s.hidden_floats, 0) << id;
  }
}

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
  // (The router's loads are up to one health interval old.)
  std::string m;
  for (int i = 0; i < 100; ++i) {
    m = cluster.router->metrics_text();
    if (m.find("tandem_decode_batch{instance=\"0\",rank=\"1\"} 0") != std::string::npos) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_NE(m.find("tandem_prefill_queued_input_tokens{instance=\"0\"} 0"), std::string::npos) << m;
  EXPECT_NE(m.find("tandem_decode_batch{instance=\"0\",rank=\"1\"} 0"), std::string::npos) << m;
  EXPECT_GT(cluster.prefill->load().input_tokens_total, 0);
  // The front's engine stats aggregate the decode instances' KV pages (not 0).
  EXPECT_EQ(cluster.router->stats().kv_pages_total, st.kv_pages_total);
  // ... and the engines' histograms: the prefill instance's queue times (the 4 that streamed
  // were scheduled there at least) and the tokens per step of both kinds of instance.
  const EngineStats rs = cluster.router->stats();
  EXPECT_GE(rs.queue_time.count, 4u);
  EXPECT_GT(st.iteration_tokens.count, 0u);                     // the decode instance's steps
  EXPECT_GT(rs.iteration_tokens.sum, st.iteration_tokens.sum);  // and the prefill instance's
  EXPECT_GT(cluster.prefill->load().input_tokens_per_s, 0.0);   // (over the last 10 s)
  // A request that can never run is refused synchronously.
  GenRequest bad = greedy("bad", {}, 4);
  EXPECT_THROW(cluster.router->submit(bad, nullptr), Error);
}

// ---- Membership that heals, and the router queue. ----

// A loopback port nothing listens on now (bound, then released).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

bool wait_for(const std::function<bool()>& cond, std::chrono::milliseconds timeout = 10s) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (cond()) return true;
    std::this_thread::sleep_for(10ms);
  }
  return cond();
}

ErrorKind submit_error(Router& router, const GenRequest& req) {
  try {
    router.submit(req, [](const StepOutput&) {});
  } catch (const Error& e) {
    return e.kind();
  }
  ADD_FAILURE() << "submit did not throw";
  return ErrorKind::kInternal;
}

struct DecodeProcess {  // a decode instance and its control server, like one process
  std::unique_ptr<DecodeInstance> instance;
  std::unique_ptr<InstanceServer> server;
  DecodeProcess(const std::string& dir, int port) {
    DecodeInstanceConfig dc;
    dc.model_dir = dir;
    dc.dp = 1;
    dc.engine = small_engine();
    instance = std::make_unique<DecodeInstance>(dc);
    server = std::make_unique<InstanceServer>(instance.get(), nullptr, "127.0.0.1", port);
  }
  void kill() {  // as kill -9 would: the connection drops, nothing more is sent
    instance->kill();
    server->stop();
  }
};

TEST(RouterMembership, StartsBeforeItsInstancesAndReadmitsARestartedOne) {
  const std::string dir = fixture("hub_gqa_top2");
  testing::Golden g = testing::load_golden(dir);
  const int pport = free_port(), dport = free_port();
  std::mutex log_mu;
  std::vector<std::string> log;
  RouterConfig rc;
  rc.log = [&](const std::string& l) {
    std::lock_guard<std::mutex> lock(log_mu);
    log.push_back(l);
  };
  auto owned = std::make_unique<Router>(rc);
  Router& router = *owned;
  router.watch_prefill("127.0.0.1:" + std::to_string(pport));
  router.watch_decode("localhost:" + std::to_string(dport));  // a name, resolved
  EXPECT_FALSE(router.ready());
  // Nothing up: unavailable (503), not "at the batch limit" (429).
  EXPECT_EQ(submit_error(router, greedy("early", g.cases[0].prompt_ids, 4)), ErrorKind::kIo);

  PrefillInstanceConfig pc;
  pc.model_dir = dir;
  pc.tp = 1;
  pc.engine = small_engine();
  PrefillInstance prefill(pc);
  InstanceServer pserver(nullptr, &prefill, "127.0.0.1", pport);
  auto decode = std::make_unique<DecodeProcess>(dir, dport);
  ASSERT_TRUE(wait_for([&] { return router.ready(); })) << "the router never saw its instances";
  std::vector<GenRequest> reqs = many_requests(g, 4, 8, "up");
  for (const Result& r : run_router(router, reqs)) {
    EXPECT_EQ(r.reason, FinishReason::kLength) << r.error;
  }

  // Killed during load: its requests end with an error, the router turns unready, and new
  // requests are refused as unavailable.
  Collector c(16);
  std::vector<GenRequest> running = many_requests(g, 16, 700, "dying");
  for (size_t i = 0; i < running.size(); ++i) router.submit(running[i], c.callback(i));
  ASSERT_TRUE(c.wait_tokens(1));
  const int64_t on_victim = decode->instance->load().total_batch();
  ASSERT_GT(on_victim, 0);
  decode->kill();
  ASSERT_TRUE(c.wait_all(30s));
  int errors = 0;
  for (const Result& r : c.results()) {
    EXPECT_EQ(r.finished, 1);
    if (r.reason == FinishReason::kError) {
      ++errors;
      EXPECT_NE(r.error.find("decode instance"), std::string::npos) << r.error;
    } else {
      EXPECT_EQ(r.ids.size(), 700u);  // finished before the kill
    }
  }
  EXPECT_GE(errors, 1);  // (one may finish between the count and the kill)
  ASSERT_TRUE(wait_for([&] { return !router.ready(); }));
  EXPECT_EQ(submit_error(router, greedy("down", g.cases[0].prompt_ids, 4)), ErrorKind::kIo);

  // Restarted on the same port: re-admitted, and serves.
  decode = std::make_unique<DecodeProcess>(dir, dport);
  ASSERT_TRUE(wait_for([&] { return router.ready(); }))
      << "the restarted instance was not re-admitted";
  for (const Result& r : run_router(router, many_requests(g, 4, 8, "again"))) {
    EXPECT_EQ(r.reason, FinishReason::kLength) << r.error;
  }
  owned.reset();  // (before the instances, as a process would end)
  int ups = 0, downs = 0;
  for (const auto& l : log) {
    const bool d = l.find("decode instance 127.0.0.1:") != std::string::npos;
    ups += d && l.find("is up") != std::string::npos;
    downs += d && l.find("unready") != std::string::npos;
  }
  EXPECT_EQ(ups, 2);
  EXPECT_EQ(downs, 1);
}

// Deterministic instances for the queue: a decode side with `cap` slots whose requests run
// until finish_one(), and a prefill side that is done at once.
class SlotDecode final : public DecodeClient {
 public:
  explicit SlotDecode(int64_t cap) : cap_(cap) {}
  std::optional<transfer::TransferDescriptor> accept(const GenRequest& req,
                                                     const transfer::KvSharding&,
                                                     OutputCallback cb) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<int64_t>(live_.size()) >= cap_) return std::nullopt;
    live_.emplace_back(req.id, std::move(cb));
    return transfer::TransferDescriptor{};
  }
  void prefilled(const std::string&, const StepOutput&) override {}
  void fail(const std::string& id, const std::string& e) override {
    end(id, FinishReason::kError, e);
  }
  void abort(const std::string& id) override { end(id, FinishReason::kAbort, ""); }
  DecodeLoad load() const override {
    std::lock_guard<std::mutex> lock(mu_);
    DecodeLoad l;
    l.batch_per_rank = {static_cast<int64_t>(live_.size())};
    l.max_decode_batch = cap_;
    return l;
  }
  int64_t max_model_len() const override { return 1000; }
  int64_t vocab_size() const override { return 100; }
  void finish_one() {
    std::string id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (live_.empty()) return;
      id = live_.front().first;
    }
    end(id, FinishReason::kLength, "");
  }
  size_t live() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_.size();
  }

 private:
  void end(const std::string& id, FinishReason reason, const std::string& error) {
    OutputCallback cb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = live_.begin(); it != live_.end(); ++it) {
        if (it->first == id) {
          cb = std::move(it->second);
          live_.erase(it);
          break;
        }
      }
    }
    if (!cb) return;
    StepOutput out;
    out.id = id;
    out.finished = true;
    out.finish_reason = reason;
    out.error = error;
    cb(out);
  }
  int64_t cap_;
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, OutputCallback>> live_;
};

class InstantPrefill final : public PrefillClient {
 public:
  transfer::KvSharding kv_sharding() const override { return {}; }
  void submit(const GenRequest&, transfer::TransferDescriptor, PrefillDone done) override {
    done("", StepOutput{});
  }
  void abort(const std::string&) override {}
  PrefillLoad load() const override { return {}; }
};

TEST(RouterQueue, WaitsForASlotTimesOutRetryablyAndOverflows) {
  SlotDecode decode(1);
  InstantPrefill prefill;
  RouterConfig rc;
  rc.max_queue = 2;
  rc.queue_timeout = 300ms;
  rc.log = [](const std::string&) {};
  Router router({&prefill}, {&decode}, rc);
  auto req = [](const std::string& id) { return greedy(id, {1, 2, 3}, 4); };
  {  // A second request waits for the slot, then runs.
    Collector c(2);
    router.submit(req("a"), c.callback(0));
    router.submit(req("b"), c.callback(1));  // queued, not refused
    EXPECT_EQ(router.snapshot().queued_requests, 1);
    decode.finish_one();
    ASSERT_TRUE(wait_for([&] { return decode.live() == 1; }));  // b took the freed slot
    EXPECT_EQ(router.snapshot().queued_requests, 0);
    decode.finish_one();
    ASSERT_TRUE(c.wait_all());
    for (const Result& r : c.results()) EXPECT_EQ(r.reason, FinishReason::kLength) << r.error;
  }
  {  // Behind a request that holds the slot: the queued ones time out with a retryable
     // error; beyond --max-queue they are refused at once (429); a queued one can be aborted.
    Collector c(3);
    router.submit(req("x"), c.callback(0));
    router.submit(req("y"), c.callback(1));
    router.submit(req("z"), c.callback(2));
    EXPECT_EQ(router.snapshot().queued_requests, 2);
    EXPECT_EQ(submit_error(router, req("overflow")), ErrorKind::kOutOfResources);
    router.abort("z");
    ASSERT_TRUE(wait_for([&] { return c.results()[1].finished == 1; }, 5s));
    std::vector<Result> got = c.results();
    EXPECT_EQ(got[1].reason, FinishReason::kError);
    EXPECT_NE(got[1].error.find("router queue"), std::string::npos) << got[1].error;
    EXPECT_NE(got[1].error.find("batch limit"), std::string::npos) << got[1].error;
    EXPECT_EQ(got[1].retry_after_s, 1);
    EXPECT_EQ(got[2].reason, FinishReason::kAbort);
    EXPECT_EQ(got[0].finished, 0);  // still holds the slot
    decode.finish_one();
    ASSERT_TRUE(c.wait_all());
    EXPECT_EQ(c.results()[0].reason, FinishReason::kLength);
  }
}

// A decode instance draining (SIGTERM): the router sends it nothing new but lets its running
// request finish; new requests go to the other instance; then it stops.
TEST(RouterMembership, DrainingDecodeInstanceLeavesThePoolFirst) {
  SlotDecode slot_a(4), slot_b(4);
  InstantPrefill prefill;
  InstanceServer server_a(&slot_a, nullptr, "127.0.0.1", 0);
  InstanceServer server_b(&slot_b, nullptr, "127.0.0.1", 0);
  RemoteDecode a("127.0.0.1:" + std::to_string(server_a.port()));
  RemoteDecode b("127.0.0.1:" + std::to_string(server_b.port()));
  RouterConfig rc;
  rc.log = [](const std::string&) {};
  Router router({&prefill}, {&a, &b}, rc);
  ASSERT_TRUE(wait_for([&] { return router.ready(); }));
  auto req = [](const std::string& id) { return greedy(id, {1, 2, 3}, 4); };
  Collector c(4);
  router.submit(req("first"), c.callback(0));
  const bool on_a = slot_a.live() == 1;
  SlotDecode& victim = on_a ? slot_a : slot_b;
  SlotDecode& other = on_a ? slot_b : slot_a;
  InstanceServer& victim_server = on_a ? server_a : server_b;
  ASSERT_EQ(victim.live(), 1u);
  std::thread drainer([&] { victim_server.drain(10s); });
  ASSERT_TRUE(wait_for([&] { return victim_server.draining(); }));
  std::this_thread::sleep_for(100ms);  // (the router's next load poll sees it)
  for (int i = 1; i < 4; ++i) router.submit(req("next" + std::to_string(i)), c.callback(i));
  EXPECT_EQ(victim.live(), 1u);  // nothing new there
  EXPECT_EQ(other.live(), 3u);
  victim.finish_one();  // the running request completes normally
  drainer.join();       // and the drain ends once it has (not after 10 s)
  for (int i = 0; i < 3; ++i) other.finish_one();
  ASSERT_TRUE(c.wait_all());
  for (const Result& r : c.results()) EXPECT_EQ(r.reason, FinishReason::kLength) << r.error;
  EXPECT_TRUE(router.ready());  // the other instance serves on
}

}  // namespace
}  // namespace tandem
