// The parts of the disaggregated roles below the router: the engine's step parts (an empty
// forward for lockstep decode), the role messages' codecs, decode admission limits and
// failures, prefill refusals and transfer failures.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "comm/local_comm.h"
#include "comm/local_launcher.h"
#include "core/error.h"
#include "disagg/decode_instance.h"
#include "disagg/instance_parts.h"
#include "disagg/lockstep.h"
#include "disagg/prefill_instance.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "model/hybrid_state.h"
#include "model/qwen3_5_moe.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

using namespace std::chrono_literals;

std::string fixture() { return testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2"; }

EngineConfig small_engine() {
  EngineConfig c;
  c.page_size = 16;
  c.num_pages = 256;
  return c;
}

GenRequest greedy(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens) {
  GenRequest r;
  r.id = id;
  r.prompt_ids = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  return r;
}

TEST(EngineParts, EmptyBatchForwardsAndStepStillWorks) {
  auto model = Qwen3MoeCpu::load(fixture());
  Engine e(*model, small_engine());
  ScheduledBatch empty = e.schedule();
  EXPECT_TRUE(empty.empty());
  EXPECT_TRUE(e.forward(empty));  // what a decode DP rank with no requests does each step
  e.complete(empty);
  int outputs = 0;
  e.add(greedy("a", {1, 2, 3}, 3),
        [&](const StepOutput& o) { outputs += static_cast<int>(o.token_ids.size()); });
  for (;;) {
    ScheduledBatch b = e.schedule();
    if (b.empty()) break;
    ASSERT_TRUE(e.forward(b));
    e.complete(b);
  }
  EXPECT_EQ(outputs, 3);
  EXPECT_FALSE(e.step());
}

// ---- Codecs. ----

TEST(RoleMessages, StepOutputAndDescriptorRoundTrip) {
  StepOutput o;
  o.id = "x";
  o.token_ids = {1, 2};
  o.token_logprobs = {-0.5f, -0.25f};
  o.top_logprobs = {{{1, -0.5f}}, {{2, -0.25f}, {3, -2.f}}};
  o.prompt_token_logprobs = {-3.f};
  o.prompt_top_logprobs = {{{9, -3.f}}};
  o.num_cached_prompt_tokens = 16;
  o.finished = true;
  o.finish_reason = FinishReason::kStop;
  o.stop_token_id = 2;
  o.error = "e";
  std::vector<uint8_t> b = encode_step_output(o);
  StepOutput r = decode_step_output(b.data(), b.size());
  EXPECT_EQ(r.id, o.id);
  EXPECT_EQ(r.token_ids, o.token_ids);
  EXPECT_EQ(r.token_logprobs, o.token_logprobs);
  EXPECT_EQ(r.top_logprobs[1][1].id, 3);
  EXPECT_EQ(r.prompt_top_logprobs[0][0].id, 9);
  EXPECT_EQ(r.num_cached_prompt_tokens, 16);
  EXPECT_TRUE(r.finished);
  EXPECT_EQ(r.finish_reason, FinishReason::kStop);
  EXPECT_EQ(r.stop_token_id, 2);
  EXPECT_EQ(r.error, "e");
  EXPECT_THROW(decode_step_output(b.data(), b.size() - 3), Error);
  transfer::TransferDescriptor d;
  d.request_id = "q";
  d.dst_address = "h:1";
  d.dst_pages = {4, 2};
  d.dst_heads = {0, 2};
  d.src = {2, 4};
  d.num_tokens = 20;
  d.page_size = 16;
  d.head_dim = 8;
  d.num_layers = 3;
  d.state_elems = 77;
  d.hidden_size = 55;
  ByteWriter w;
  put_descriptor(w, d);
  ByteReader rd(w.bytes());
  transfer::TransferDescriptor e = get_descriptor(rd);
  EXPECT_EQ(e.request_id, "q");
  EXPECT_EQ(e.dst_address, "h:1");
  EXPECT_EQ(e.dst_pages, d.dst_pages);
  EXPECT_EQ(e.dst_heads, d.dst_heads);
  EXPECT_EQ(e.src, d.src);
  EXPECT_EQ(e.num_tokens, 20);
  EXPECT_EQ(e.num_layers, 3);
  EXPECT_EQ(e.state_elems, 77);
  EXPECT_EQ(e.hidden_size, 55);
  EXPECT_EQ(rd.left(), 0u);
}

// The prefill step carries each sequence's state slot and rank 0's prefix-cache state copies
// (hybrid models' TP ranks mirror them), in order; a cut message is refused.
TEST(RoleMessages, PrefillStepCarriesStateSlotsAndCopies) {
  PrefillStep st;
  st.ends.push_back({"e", true, 7, -0.5f});
  PrefillStep::Seq a;
  a.id = "a";
  a.tokens = {1, 2, 3};
  a.table = {5};
  a.start = 16;
  a.logits = LogitsMode::kLast;
  a.state_slot = 3;
  PrefillStep::Seq b = a;
  b.id = "b";
  b.state_slot = -1;
  b.last = true;
  b.dst.request_id = "b";
  b.dst.num_tokens = 19;
  st.seqs = {a, b};
  st.state_saves = {{0, 4}, {1, 5}};
  st.state_restores = {{5, 2}};
  const std::vector<uint8_t> bytes = encode_prefill_step(st);
  const PrefillStep r = decode_prefill_step(bytes);
  ASSERT_EQ(r.seqs.size(), 2u);
  EXPECT_EQ(r.seqs[0].state_slot, 3);
  EXPECT_EQ(r.seqs[1].state_slot, -1);
  EXPECT_EQ(r.seqs[1].dst.num_tokens, 19);
  ASSERT_EQ(r.state_saves.size(), 2u);
  EXPECT_EQ(r.state_saves[1].src, 1);
  EXPECT_EQ(r.state_saves[1].dst, 5);
  ASSERT_EQ(r.state_restores.size(), 1u);
  EXPECT_EQ(r.state_restores[0].src, 5);
  EXPECT_EQ(r.state_restores[0].dst, 2);
  const ForwardBatch fb = r.forward();
  EXPECT_EQ(fb.seqs[0].state_slot, 3);
  EXPECT_EQ(fb.seqs[0].start_pos, 16);
  EXPECT_THROW(decode_prefill_step(std::vector<uint8_t>(bytes.begin(), bytes.end() - 4)), Error);
}

// ---- Instances. ----

TEST(DecodeInstance, AdmissionLimitsAndFailures) {
  DecodeInstanceConfig cfg;
  cfg.model_dir = fixture();
  cfg.dp = 2;
  cfg.engine = small_engine();
  cfg.max_decode_batch = 2;
  std::mutex mu;
  std::vector<StepOutput> ends;
  auto cb = [&](const StepOutput& o) {
    std::lock_guard<std::mutex> lock(mu);
    if (o.finished) ends.push_back(o);
  };
  DecodeInstance d(cfg);  // NOTE: after `ends`: its destructor ends live requests through cb
  // 2 ranks x 2: four reservations, spread over both ranks (each its own receiver), then no
  // room.
  const transfer::KvSharding src{2, 2};
  std::vector<std::string> addresses;
  std::vector<int> ranks;
  {
    auto probe = d.accept(greedy("probe", {1}, 1), src, cb);
    ASSERT_TRUE(probe.has_value());
    addresses.push_back(probe->dst_address);
    d.abort("probe");
    for (int i = 0; i < 200 && d.load().batch_per_rank[0] + d.load().batch_per_rank[1] > 0; ++i) {
      std::this_thread::sleep_for(5ms);
    }
  }
  for (int i = 0; i < 4; ++i) {
    auto dst = d.accept(greedy("r" + std::to_string(i), std::vector<int32_t>(40, 5), 4), src, cb);
    ASSERT_TRUE(dst.has_value()) << i;
    EXPECT_EQ(dst->dst_pages.size(), 3u);  // ceil(40 / 16)
    EXPECT_EQ(dst->dst_heads, (transfer::HeadRange{0, 2}));
    EXPECT_EQ(dst->num_tokens, 40);
    ranks.push_back(dst->dst_address == addresses[0] ? 0 : 1);
  }
  EXPECT_EQ(std::count(ranks.begin(), ranks.end(), 0), 2);
  EXPECT_FALSE(d.accept(greedy("r4", {1}, 1), src, cb).has_value());
  EXPECT_EQ(d.load().batch_per_rank, (std::vector<int64_t>{2, 2}));
  EXPECT_FALSE(d.load().has_room());
  // Bad requests throw; duplicate ids too.
  EXPECT_THROW(d.accept(greedy("bad", {}, 1), src, cb), Error);
  EXPECT_THROW(d.accept(greedy("r0", {1}, 1), src, cb), Error);
  // A failed prefill and an abort end their requests and give the pages back.
  d.fail("r0", "prefill failed");
  d.abort("r1");
  d.abort("unknown");
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(ends.size(), 3u);  // the probe, r0, r1
    EXPECT_EQ(ends[1].finish_reason, FinishReason::kError);
    EXPECT_EQ(ends[1].error, "prefill failed");
    EXPECT_EQ(ends[2].finish_reason, FinishReason::kAbort);
  }
  for (int i = 0; i < 200 && d.load().has_room() == false; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(d.load().has_room());
}

TEST(PrefillInstance, RefusesBadDestinationsAndCountsTransferFailures) {
  PrefillInstanceConfig cfg;
  cfg.model_dir = fixture();
  cfg.tp = 4;  // 2 KV heads: ranks 0 and 2 send, 1 and 3 hold replicas
  cfg.engine = small_engine();
  PrefillInstance p(cfg);
  EXPECT_EQ(p.num_senders(), 2);
  EXPECT_EQ(p.kv_sharding(), (transfer::KvSharding{2, 4}));
  transfer::TransferDescriptor dst;
  dst.dst_address = "127.0.0.1:" + std::to_string(comm::pick_free_port());  // nobody there
  dst.dst_pages = {0, 1, 2};
  dst.dst_heads = {0, 2};
  dst.num_tokens = 40;
  dst.page_size = 16;
  dst.head_dim = 8;
  dst.num_layers = 2;
  // Too few pages / a prompt of another length: refused at once.
  transfer::TransferDescriptor small = dst;
  small.dst_pages = {0};
  EXPECT_THROW(p.submit(greedy("y", std::vector<int32_t>(40, 5), 1), small, nullptr), Error);
  EXPECT_THROW(p.submit(greedy("z", {1, 2}, 1), dst, nullptr), Error);
  // Hidden states of another size than the model's (a speculating decode side asks for them).
  transfer::TransferDescriptor hid = dst;
  hid.hidden_size = ModelConfig::from_dir(fixture()).hidden_size + 1;
  EXPECT_THROW(p.submit(greedy("h", std::vector<int32_t>(40, 5), 1), hid, nullptr), Error);
  // An unreachable destination: the prefill itself completes (token 1), the transfer fails
  // at the senders (the decode side would end the request).
  std::promise<std::pair<std::string, StepOutput>> done;
  p.submit(greedy("x", std::vector<int32_t>(40, 5), 4), dst,
           [&](const std::string& error, const StepOutput& first) {
             done.set_value({error, first});
           });
  auto f = done.get_future();
  ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
  auto [error, first] = f.get();
  EXPECT_EQ(error, "");
  EXPECT_EQ(first.token_ids.size(), 1u);
  EXPECT_EQ(p.load().queued_input_tokens, 0);
  EXPECT_EQ(p.load().input_tokens_total, 40);
  for (int i = 0; i < 3000 && p.transfer_errors() < 2; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(p.transfer_errors(), 2);  // both sending ranks
}

// A process group's ranks (here over LocalCommunicator, each rank's DecodeInstance in its own
// thread; tests/e2e/roles_test.sh runs `tandem decode --nprocs 2` over Gloo): rank 0 holds the
// registry and messages the other rank each lockstep iteration; requests land on both ranks
// and decode as one engine would.
TEST(DecodeInstance, ProcessGroupRanks) {
  DecodeInstanceConfig cfg;
  cfg.model_dir = fixture();
  cfg.dp = 2;
  cfg.engine = small_engine();
  cfg.max_decode_batch = 2;
  auto comms = comm::LocalCommunicator::create_group(2);
  std::thread follower([&] {
    DecodeInstance d1(cfg, std::move(comms[1]));
    EXPECT_FALSE(d1.is_leader());
    d1.wait();
  });
  struct Join {
    std::thread& t;
    ~Join() { t.join(); }
  } join{follower};
  [&] {
    DecodeInstance d(cfg, std::move(comms[0]));
    ASSERT_TRUE(d.is_leader());
    TANDEM_CHECK(d.load().batch_per_rank.size() == 2u, "batch per rank");
    // The reference: one engine over the whole model.
    auto model = Qwen3MoeCpu::load(fixture());
    Engine ref(*model, small_engine());
    std::map<std::string, std::vector<int32_t>> want, got;
    std::vector<GenRequest> reqs = {greedy("a", std::vector<int32_t>(40, 5), 6),
                                    greedy("b", {1, 2, 3, 4, 5}, 6)};
    for (const auto& r : reqs) {
      ref.add(r, [&, id = r.id](const StepOutput& o) {
        want[id].insert(want[id].end(), o.token_ids.begin(), o.token_ids.end());
      });
    }
    while (ref.step()) {
    }
    PrefillInstanceConfig pcfg;
    pcfg.model_dir = fixture();
    pcfg.engine = small_engine();
    PrefillInstance p(pcfg);
    std::mutex mu;
    std::condition_variable cv;
    int finished = 0;
    std::set<std::string> addresses;
    for (const auto& r : reqs) {
      auto dst = d.accept(r, p.kv_sharding(), [&, id = r.id](const StepOutput& o) {
        std::lock_guard<std::mutex> lock(mu);
        got[id].insert(got[id].end(), o.token_ids.begin(), o.token_ids.end());
        if (o.finished) {
          TANDEM_CHECK(o.finish_reason == FinishReason::kLength, "request ", id,
                       " ended early: ", o.error);
          ++finished;
          cv.notify_all();
        }
      });
      TANDEM_CHECK(dst.has_value(), "no room for ", r.id);
      addresses.insert(dst->dst_address);
      p.submit(r, *dst, [&d, id = r.id](const std::string& error, const StepOutput& first) {
        if (error.empty()) {
          d.prefilled(id, first);
        } else {
          d.fail(id, error);
        }
      });
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      TANDEM_CHECK(cv.wait_for(lock, 60s, [&] { return finished == 2; }), "timed out");
    }
    TANDEM_CHECK(addresses.size() == 2u, "both requests on one rank");
    TANDEM_CHECK(got == want, "the tokens differ from one engine's");
    // Admission limits: 2 ranks x 2, then no room; abort and fail free the pages.
    for (int i = 0; i < 200 && d.load().total_batch() > 0; ++i) std::this_thread::sleep_for(5ms);
    const transfer::KvSharding src{2, 1};
    for (int i = 0; i < 4; ++i) {
      TANDEM_CHECK(d.accept(greedy("r" + std::to_string(i), {1, 2}, 2), src, nullptr),
                   "no room for r", i);
    }
    TANDEM_CHECK(!d.accept(greedy("r4", {1}, 1), src, nullptr), "room for r4");
    TANDEM_CHECK(d.load().batch_per_rank == (std::vector<int64_t>{2, 2}), "batch per rank");
    d.fail("r0", "prefill failed");
    for (int i = 1; i < 4; ++i) d.abort("r" + std::to_string(i));
    for (int i = 0; i < 200 && d.load().total_batch() > 0; ++i) std::this_thread::sleep_for(5ms);
    TANDEM_CHECK(d.load().total_batch() == 0, "pages not released");
  }();
}

// ---- Qwen3.5 hybrid models through the roles. ----

std::string hybrid_fixture(const std::string& name) {
  return testing::source_dir() + "/tests/data/fixtures/" + name;
}

struct Got {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  int finished = 0;
  FinishReason reason = FinishReason::kStop;
  std::string error;
};

// Colocated: one engine, every request at once.
std::map<std::string, Got> colocated(const std::string& dir, const std::vector<GenRequest>& reqs) {
  std::map<std::string, Got> want;
  auto model = load_cpu_model(dir);
  EXPECT_GT(model->state_slot_elems(), 0);
  Engine e(*model, small_engine());
  for (const GenRequest& r : reqs) {
    e.add(r, [&want, id = r.id](const StepOutput& o) {
      Got& w = want[id];
      w.ids.insert(w.ids.end(), o.token_ids.begin(), o.token_ids.end());
      w.logprobs.insert(w.logprobs.end(), o.token_logprobs.begin(), o.token_logprobs.end());
      if (o.finished) ++w.finished;
    });
  }
  while (e.step()) {
  }
  return want;
}

// In-process roles: a prefill instance of `tp` ranks (its engine `pre`) and a decode instance
// of `dp` ranks. Every request of `waves` goes through both, a wave once the one before it has
// finished; those of `aborted` are aborted on both sides right after their submission (as the
// router does when a client goes away). Returns the decode side's outputs of the others;
// `pools` gets the prefill instance's pools once they are whole again (or after 30 s).
// `backend` / `prefill_model`: the transfer backend of both sides and the prefill ranks' models
// (defaults: host TCP, the CPU model).
std::map<std::string, Got> disaggregated(
    const std::string& dir, int tp, int dp, const EngineConfig& pre,
    const std::vector<std::vector<GenRequest>>& waves, const std::set<std::string>& aborted,
    PrefillPools& pools, int64_t& transfer_errors,
    std::shared_ptr<transfer::TransferBackend> backend = nullptr, ModelFactory prefill_model = {}) {
  DecodeInstanceConfig dcfg;
  dcfg.model_dir = dir;
  dcfg.transfer = backend;
  dcfg.dp = dp;
  dcfg.engine = small_engine();
  dcfg.max_decode_batch = 8;
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Got> got;
  DecodeInstance d(dcfg);
  PrefillInstanceConfig pcfg;
  pcfg.model_dir = dir;
  pcfg.tp = tp;
  pcfg.engine = pre;
  pcfg.transfer = backend;
  pcfg.model = std::move(prefill_model);
  PrefillInstance p(pcfg);
  EXPECT_EQ(p.kv_sharding().tp, tp);
  for (const std::vector<GenRequest>& reqs : waves) {
    for (const GenRequest& r : reqs) {
      auto dst = d.accept(r, p.kv_sharding(), [&, id = r.id](const StepOutput& o) {
        std::lock_guard<std::mutex> lock(mu);
        Got& w = got[id];
        w.ids.insert(w.ids.end(), o.token_ids.begin(), o.token_ids.end());
        w.logprobs.insert(w.logprobs.end(), o.token_logprobs.begin(), o.token_logprobs.end());
        if (o.finished) {
          ++w.finished;
          w.reason = o.finish_reason;
          w.error = o.error;
          cv.notify_all();
        }
      });
      EXPECT_TRUE(dst.has_value()) << r.id;
      if (!dst) continue;
      EXPECT_GT(dst->state_elems, 0);
      p.submit(r, *dst, [&d, id = r.id](const std::string& error, const StepOutput& first) {
        if (error.empty()) {
          d.prefilled(id, first);
        } else {
          d.fail(id, error);
        }
      });
      if (aborted.count(r.id)) {
        p.abort(r.id);
        d.abort(r.id);
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, 120s, [&] {
      for (const GenRequest& r : reqs) {
        if (!aborted.count(r.id) && got[r.id].finished == 0) return false;
      }
      return true;
    })) << "not every request finished";
  }
  for (int i = 0; i < 3000; ++i) {
    pools = p.pools();
    if (pools.state_slots_free == pools.state_slots_total &&
        pools.kv_pages_free == pools.kv_pages_total) {
      break;
    }
    std::this_thread::sleep_for(10ms);
  }
  transfer_errors = p.transfer_errors();
  std::lock_guard<std::mutex> lock(mu);
  std::map<std::string, Got> out;
  for (const auto& reqs : waves) {
    for (const GenRequest& r : reqs) {
      if (!aborted.count(r.id)) out[r.id] = got[r.id];
    }
  }
  return out;
}

// Every request's decode output: the colocated greedy tokens exactly; logprobs bit for bit
// when `exact` (TP 1: the same kernels on both sides), else within 1e-4 (a TP prefill sums
// its all-reduces in another order: its KV and states differ in the last bits).
void expect_colocated(const std::map<std::string, Got>& got, const std::map<std::string, Got>& want,
                      const std::vector<GenRequest>& reqs, bool exact) {
  for (const auto& [id, h] : got) {
    SCOPED_TRACE(id);
    const Got& w = want.at(id);
    EXPECT_EQ(h.error, "");
    EXPECT_EQ(h.finished, 1);
    EXPECT_EQ(h.ids, w.ids);
    if (exact) {
      EXPECT_EQ(h.logprobs, w.logprobs);
    } else {
      ASSERT_EQ(h.logprobs.size(), w.logprobs.size());
      for (size_t i = 0; i < h.logprobs.size(); ++i) {
        EXPECT_NEAR(h.logprobs[i], w.logprobs[i], 1e-4) << "token " << i;
      }
    }
    for (const GenRequest& r : reqs) {
      if (r.id == id) EXPECT_EQ(static_cast<int32_t>(h.ids.size()), r.max_tokens);
    }
  }
}

// A prefill instance (TP 1, and TP 2: each rank its DeltaNet value heads' states, gathered on
// rank 0) and a decode instance (DP 1, and DP 2 with EP experts) in-process on each Qwen3.5
// fixture: the attention layers' KV and the DeltaNet layers' recurrent state (with the FINISH of
// the transfer) move from one to the other, and every request gets exactly the colocated
// engine's greedy tokens (and logprobs: see expect_colocated); afterwards the prefill
// instance's pages and state slots are all free.
TEST(HybridInstances, PrefillThenDecodeGiveTheColocatedTokensAndLogprobs) {
  for (int tp : {1, 2})
    for (int dp : {1, 2})
      for (const char* name : {"qwen35_text_hd64_int2_fused", "qwen35_vl_hd256_int4_tied_bf16"}) {
        SCOPED_TRACE(std::string(name) + ", prefill tp " + std::to_string(tp) + ", decode dp " +
                     std::to_string(dp));
        const std::string dir = hybrid_fixture(name);
        const testing::Golden g = testing::load_golden(dir);
        ASSERT_FALSE(g.cases.empty());
        std::vector<GenRequest> reqs;
        for (size_t i = 0; i < g.cases.size(); ++i) {
          GenRequest r = greedy("h" + std::to_string(i), g.cases[i].prompt_ids,
                                std::max<int32_t>(2, g.cases[i].max_tokens));
          r.sampling.logprobs = 0;
          reqs.push_back(r);
        }
        const std::map<std::string, Got> want = colocated(dir, reqs);
        PrefillPools pools;
        int64_t errors = -1;
        const std::map<std::string, Got> got =
            disaggregated(dir, tp, dp, small_engine(), {reqs}, {}, pools, errors);
        expect_colocated(got, want, reqs, tp == 1);
        EXPECT_EQ(errors, 0);
        EXPECT_GT(pools.state_slots_total, 0);
        EXPECT_EQ(pools.state_slots_free, pools.state_slots_total);
        EXPECT_EQ(pools.kv_pages_free, pools.kv_pages_total);
      }
}

// ---- Prefill TP > 1 into device state slots (the path cuda-ipc takes), on the host. ----

// The CPU model of a prefill TP rank that, like a GPU model, "gathers the whole state on the
// device": gather_state_device merges the ranks' parts on rank 0 (gather_hybrid_state; host
// memory stands in for the device buffer).
class DeviceGatherModel final : public Model {
 public:
  DeviceGatherModel(std::unique_ptr<Model> inner, comm::Communicator* comm)
      : inner_(std::move(inner)), comm_(comm) {}
  const ModelConfig& config() const override { return inner_->config(); }
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const override {
    return inner_->kv_geometry(num_pages, page_size);
  }
  KvCache make_kv_cache(int64_t num_pages, int64_t page_size) override {
    return inner_->make_kv_cache(num_pages, page_size);
  }
  int64_t state_slot_elems() const override { return inner_->state_slot_elems(); }
  void forward(const ForwardBatch& batch, KvCache& kv, std::vector<float>& logits) override {
    inner_->forward(batch, kv, logits);
  }
  bool gather_state(KvCache& kv, int64_t slot, int root, std::vector<float>& out) override {
    out = gather_hybrid_state(*comm_, config(), kv.read_state(slot), root);
    return true;
  }
  const float* gather_state_device(KvCache& kv, int64_t slot) override {
    whole_ = gather_hybrid_state(*comm_, config(), kv.read_state(slot), 0);
    ++device_gathers;
    return whole_.data();
  }
  bool gathers_state_on_device() const override { return true; }
  static inline std::atomic<int> device_gathers{0};

 private:
  std::unique_ptr<Model> inner_;
  comm::Communicator* comm_;
  std::vector<float> whole_;
};

// The host TCP backend dressed as a device one (carries_device_state): the decode side reserves
// state slots; a sender's send_state_from keeps the state and sends it with its FINISH, the
// receiver writes it into the reserved slot (not through on_state), as cuda-ipc's copy would.
class SlotBackend final : public transfer::TransferBackend {
 public:
  explicit SlotBackend(std::shared_ptr<transfer::TransferBackend> host) : host_(std::move(host)) {}
  std::string_view name() const override { return "slot-test"; }
  bool carries_device_state() const override { return true; }
  std::unique_ptr<transfer::TransferSender> make_sender(const KvCache& cache,
                                                        const transfer::KvSharding& sharding,
                                                        int rank,
                                                        transfer::SenderCallbacks cbs) override {
    return std::make_unique<Sender>(host_->make_sender(cache, sharding, rank, std::move(cbs)),
                                    this);
  }
  std::unique_ptr<transfer::TransferReceiver> make_receiver(
      KvCache& cache, transfer::ReceiverCallbacks cbs) override {
    auto r = std::make_unique<Receiver>(cache);
    Receiver* raw = r.get();
    transfer::ReceiverCallbacks wrapped = cbs;
    wrapped.on_state = [raw](const std::string& id, std::vector<float> state) {
      std::lock_guard<std::mutex> lock(raw->mu);
      auto it = raw->slots.find(id);
      TANDEM_CHECK(it != raw->slots.end(), "a state for ", id, " without a reserved slot");
      raw->cache.write_state(it->second, state.data());
      raw->slots.erase(it);
    };
    r->inner = host_->make_receiver(cache, std::move(wrapped));
    return r;
  }
  std::atomic<int> states_sent{0};

 private:
  struct Sender final : transfer::TransferSender {
    Sender(std::unique_ptr<transfer::TransferSender> in, SlotBackend* b)
        : inner(std::move(in)), backend(b) {}
    void begin(const std::string& request, std::vector<transfer::TransferDescriptor> dests,
               std::vector<int32_t> src_pages) override {
      for (auto& d : dests) d.dst_state_slot = -1;  // (the host backend carries it in FINISH)
      inner->begin(request, std::move(dests), std::move(src_pages));
    }
    void send_layer(const std::string& request, int64_t layer,
                    transfer::TokenRange tokens) override {
      inner->send_layer(request, layer, tokens);
    }
    std::vector<size_t> send_layers(const std::vector<std::string>& requests,
                                    int64_t layer) override {
      return inner->send_layers(requests, layer);
    }
    void send_state_from(const std::string& request, const float* src, int64_t elems) override {
      TANDEM_CHECK_KIND(kInvalidArgument, src != nullptr && elems > 0, "no state for ", request);
      std::lock_guard<std::mutex> lock(mu);
      states[request].assign(src, src + elems);
      ++backend->states_sent;
    }
    void finish(const std::string& request, int32_t first_token, float logprob) override {
      finish_with(request, first_token, logprob, {});
    }
    void finish_with(const std::string& request, int32_t first_token, float logprob,
                     transfer::FinishPayload payload) override {
      // (a device state went by send_state_from: the rank's payload carries none)
      TANDEM_CHECK(payload.state.empty(), "a host state beside a device state slot");
      {
        std::lock_guard<std::mutex> lock(mu);
        if (auto it = states.find(request); it != states.end()) {
          payload.state = std::move(it->second);
          states.erase(it);
        }
      }
      inner->finish_with(request, first_token, logprob, std::move(payload));
    }
    void abort(const std::string& request) override { inner->abort(request); }
    std::unique_ptr<transfer::TransferSender> inner;
    SlotBackend* backend;
    std::mutex mu;
    std::map<std::string, std::vector<float>> states;
  };
  struct Receiver final : transfer::TransferReceiver {
    explicit Receiver(KvCache& c) : cache(c) {}
    std::string address() const override { return inner->address(); }
    void expect(const transfer::TransferDescriptor& d) override {
      TANDEM_CHECK(d.dst_state_slot >= 0, "no reserved state slot in the descriptor of ",
                   d.request_id);
      {
        std::lock_guard<std::mutex> lock(mu);
        slots[d.request_id] = d.dst_state_slot;
      }
      transfer::TransferDescriptor host = d;
      host.dst_state_slot = -1;
      inner->expect(host);
    }
    bool cancel(const std::string& request) override { return inner->cancel(request); }
    std::optional<transfer::TransferProgress> progress(const std::string& request) const override {
      return inner->progress(request);
    }
    KvCache& cache;
    std::mutex mu;
    std::map<std::string, int32_t> slots;
    std::unique_ptr<transfer::TransferReceiver> inner;
  };
  std::shared_ptr<transfer::TransferBackend> host_;
};

// Prefill TP 2 to decode ranks that reserved device state slots: each prompt's state is merged
// by the model "on the device" (gather_state_device on rank 0, gather_state on rank 1: one
// collective) and rank 0 sends it with send_state_from, into the reserved slot; the decode side
// gets the colocated tokens. A prefill model that merges on the host is refused the slot.
TEST(HybridInstances, TensorParallelPrefillSendsTheStateGatheredOnTheDevice) {
  const std::string dir = hybrid_fixture("qwen35_text_hd64_int2_fused");
  const testing::Golden g = testing::load_golden(dir);
  std::vector<GenRequest> reqs;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    GenRequest r = greedy("v" + std::to_string(i), g.cases[i].prompt_ids,
                          std::max<int32_t>(2, g.cases[i].max_tokens));
    r.sampling.logprobs = 0;
    reqs.push_back(r);
  }
  const std::map<std::string, Got> want = colocated(dir, reqs);
  const ModelFactory cpu = cpu_model_factory(dir);
  for (int dp : {1, 2}) {
    SCOPED_TRACE("decode dp " + std::to_string(dp));
    auto backend = std::make_shared<SlotBackend>(host_transfer_backend({}));
    DeviceGatherModel::device_gathers = 0;
    PrefillPools pools;
    int64_t errors = -1;
    const std::map<std::string, Got> got = disaggregated(
        dir, 2, dp, small_engine(), {reqs}, {}, pools, errors, backend,
        [cpu](const ShardSpec& spec, comm::Communicator* comm) -> std::unique_ptr<Model> {
          return std::make_unique<DeviceGatherModel>(cpu(spec, comm), comm);
        });
    expect_colocated(got, want, reqs, false);
    EXPECT_EQ(errors, 0);
    EXPECT_EQ(backend->states_sent.load(), static_cast<int>(reqs.size()));
    EXPECT_EQ(DeviceGatherModel::device_gathers.load(), static_cast<int>(reqs.size()));
    EXPECT_EQ(pools.state_slots_free, pools.state_slots_total);
    EXPECT_EQ(pools.kv_pages_free, pools.kv_pages_total);
  }
  // The CPU model merges on the host: a reserved device slot is refused at submit.
  auto backend = std::make_shared<SlotBackend>(host_transfer_backend({}));
  DecodeInstanceConfig dcfg;
  dcfg.model_dir = dir;
  dcfg.engine = small_engine();
  dcfg.transfer = backend;
  DecodeInstance d(dcfg);
  PrefillInstanceConfig pcfg;
  pcfg.model_dir = dir;
  pcfg.tp = 2;
  pcfg.engine = small_engine();
  pcfg.transfer = backend;
  PrefillInstance p(pcfg);
  auto dst = d.accept(reqs[0], p.kv_sharding(), [](const StepOutput&) {});
  ASSERT_TRUE(dst.has_value());
  EXPECT_GE(dst->dst_state_slot, 0);
  try {
    p.submit(reqs[0], *dst, [](const std::string&, const StepOutput&) {});
    ADD_FAILURE() << "a host-merging TP 2 prefill accepted a device state slot";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
  }
  d.abort(reqs[0].id);
}

// A TP 2 prefill instance whose pages are short (sequences preempted and recomputed), some of
// whose requests are aborted, then (one at a time, so the hits do not depend on timing) prompts
// that share a prefix with the first ones (prefix-cache hits resume from state checkpoints,
// restored on every rank): the others get the colocated tokens, and every page and state slot
// comes back (the other rank holds slots under rank 0's ids).
TEST(HybridInstances, TensorParallelPrefillPreemptsAbortsAndHitsThePrefixCache) {
  const std::string dir = hybrid_fixture("qwen35_text_hd64_int2_fused");
  const testing::Golden g = testing::load_golden(dir);
  const testing::GoldenCase* longest = &g.cases[0];
  for (const auto& c : g.cases) {
    if (c.prompt_ids.size() > longest->prompt_ids.size()) longest = &c;
  }
  const std::vector<int32_t>& base = longest->prompt_ids;
  ASSERT_GE(base.size(), 200u);
  // Prompts sharing the first 160 tokens (checkpoints every 64 tokens: hits at 128), then
  // their own tails.
  auto request = [&](int i) {
    std::vector<int32_t> prompt(base.begin(), base.begin() + 160);
    for (int j = 0; j < 40 + 10 * (i % 6); ++j) {
      prompt.push_back(base[static_cast<size_t>((160 + 7 * i + j) % base.size())]);
    }
    GenRequest r = greedy("p" + std::to_string(i), prompt, 4);
    r.sampling.logprobs = 0;
    return r;
  };
  std::vector<std::vector<GenRequest>> waves(1);
  std::vector<GenRequest> all;
  std::set<std::string> aborted = {"p2", "p5"};
  for (int i = 0; i < 6; ++i) waves[0].push_back(request(i));
  for (int i = 6; i < 8; ++i) waves.push_back({request(i)});
  for (const auto& w : waves) all.insert(all.end(), w.begin(), w.end());
  const std::map<std::string, Got> want = colocated(dir, all);
  EngineConfig pre = small_engine();
  pre.num_pages = 30;  // 480 tokens: two of the ~200-token prompts at once, not more
  pre.max_model_len = 256;
  pre.max_batched_tokens = 256;  // four prompts start at once (chunks end at checkpoints)
  pre.max_num_seqs = 4;
  pre.num_state_checkpoints = 16;
  PrefillPools pools;
  int64_t errors = -1;
  const std::map<std::string, Got> got =
      disaggregated(dir, 2, 1, pre, waves, aborted, pools, errors);
  EXPECT_EQ(got.size(), all.size() - aborted.size());
  expect_colocated(got, want, all, false);
  EXPECT_EQ(errors, 0);
  EXPECT_GT(pools.preemptions, 0) << "the test wants preemption";
  EXPECT_GE(pools.prefix_cache_hits, 2 * 128) << "the test wants prefix-cache hits";
  EXPECT_EQ(pools.state_slots_total, 4);
  EXPECT_EQ(pools.state_slots_free, pools.state_slots_total) << "leaked state slots";
  EXPECT_EQ(pools.kv_pages_free, pools.kv_pages_total) << "leaked KV pages";
}

// A TP size the DeltaNet heads do not split over is refused at start-up, naming the heads.
TEST(HybridInstances, PrefillTensorParallelThatDoesNotSplitIsRefused) {
  PrefillInstanceConfig c;
  c.model_dir = hybrid_fixture("qwen35_vl_hd256_int4_tied_bf16");  // 2 value heads
  c.tp = 4;  // (its query, KV heads and experts split over 4)
  c.engine = small_engine();
  try {
    PrefillInstance p(c);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.message();
    EXPECT_NE(e.message().find("linear_num_value_heads 2 do not split over 4"), std::string::npos)
        << e.message();
  }
}

}  // namespace
}  // namespace tandem
