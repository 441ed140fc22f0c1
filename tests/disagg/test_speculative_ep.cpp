// MTP speculative decoding on a decode instance (DP attention + EP MoE): the MTP layer's MoE
// block is sharded by experts as the target's and runs through the same all-to-all, so every
// rank runs num_speculative_tokens MTP passes per step, empty ones included
// (Model::mtp_collective, SpecDecoder::pad_mtp_passes). Greedy tokens, drafts and counters equal
// DP 1's; the experts are really sharded; uneven work (idle ranks) does not hang; ranks running
// the fused step (Model::forward_verify_draft), all or some of them, equal ranks that do not.
// Qwen3.5 hybrids (their MTP layer local, their state rollback a rank-local replay) under DP too.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <utility>

#include "comm/local_comm.h"
#include "core/error.h"
#include "disagg/decode_instance.h"
#include "disagg/prefill_instance.h"
#include "engine/engine.h"
#include "engine/golden.h"
#include "engine/mtp_weights.h"
#include "model/qwen3_5_moe.h"
#include "model/qwen3_moe.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

// Random MTP weights (a MoE layer) for the fixture, one directory per process.
struct RandomMtp {
  std::string dir;
  RandomMtp(const std::string& model_dir, uint64_t seed) {
    dir = (fs::temp_directory_path() / ("tandem_mtpep_" + fs::path(model_dir).filename().string() +
                                        "_" + std::to_string(::getpid())))
              .string();
    testing::write_random_mtp(model_dir, dir, seed);
  }
  ~RandomMtp() { fs::remove_all(dir); }
};

std::string fixture() { return testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2"; }
std::string demo() { return testing::source_dir() + "/models/demo"; }
bool has_demo_mtp() { return fs::exists(demo() + "/model-mtp.safetensors"); }

// What one decode instance produced.
struct DecodeRun {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, int> errors;
  // The MTP's drafts (recorded by a hook that keeps them), by request and tokens so far.
  std::map<std::string, std::vector<int32_t>> drafts;
  EngineStats stats;
  bool completed = false;
};

// Runs `reqs` through prefill (one rank) -> decode instance (dp ranks, EP). Every request is
// reserved before any is prefilled, so the prompts' pages are fresh on every rank whatever
// dp. The decode side writes the MTP KV of prompt positions from the prompts' hidden states
// (they come with the KV); the prefill instance runs without its prefix cache, as a prompt
// position it took from there would travel without one (its MTP KV zeros), at the whim of the
// timing (here some prompts share a prefix).
DecodeRun run_decode(const std::string& dir, const std::string& mtp, int dp, int64_t k,
                     const std::vector<GenRequest>& reqs, ModelFactory model = {}) {
  DecodeRun res;
  std::mutex mu;
  std::condition_variable cv;
  DecodeInstanceConfig cfg;
  cfg.model_dir = dir;
  cfg.dp = dp;
  cfg.engine.num_pages = 256;
  cfg.engine.num_speculative_tokens = k;
  cfg.max_decode_batch = 8;
  cfg.mtp_dir = mtp;
  cfg.model = std::move(model);
  if (k > 0) {
    cfg.engine.spec_draft_hook = [&](const std::string& id, std::span<const int32_t> tokens,
                                     std::vector<int32_t>& drafts) {
      std::lock_guard<std::mutex> lock(mu);  // (every rank's thread)
      res.drafts[id + "@" + std::to_string(tokens.size())] = drafts;
    };
  }
  int finished = 0;
  DecodeInstance d(cfg);
  PrefillInstanceConfig pcfg;
  pcfg.model_dir = dir;
  pcfg.engine.num_pages = 256;
  pcfg.engine.enable_prefix_cache = false;
  PrefillInstance p(pcfg);
  std::vector<transfer::TransferDescriptor> dsts;
  for (const GenRequest& r : reqs) {
    auto dst = d.accept(r, p.kv_sharding(), [&, id = r.id](const StepOutput& o) {
      std::lock_guard<std::mutex> lock(mu);
      res.tokens[id].insert(res.tokens[id].end(), o.token_ids.begin(), o.token_ids.end());
      if (o.finished) {
        if (o.finish_reason == FinishReason::kError) ++res.errors[id];
        ++finished;
        cv.notify_all();
      }
    });
    EXPECT_TRUE(dst.has_value()) << r.id;
    if (!dst) return res;
    dsts.push_back(*dst);
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    p.submit(reqs[i], dsts[i],
             [&d, id = reqs[i].id](const std::string& error, const StepOutput& first) {
               if (error.empty()) {
                 d.prefilled(id, first);
               } else {
                 d.fail(id, error);
               }
             });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    res.completed = cv.wait_for(lock, std::chrono::seconds(90),
                                [&] { return finished == static_cast<int>(reqs.size()); });
  }
  res.stats = d.stats();
  return res;
}

// Prompts of several lengths and max_tokens: ranks run out of work at different steps (idle
// ranks serve their experts with empty passes), sequences near max_tokens draft fewer than K.
std::vector<GenRequest> requests(const std::string& dir, int count) {
  const int64_t vocab = ModelConfig::from_dir(dir).vocab_size;
  std::vector<GenRequest> reqs;
  const testing::Golden g = testing::load_golden(dir);
  for (int i = 0; i < count; ++i) {
    GenRequest r;
    r.id = "q" + std::to_string(i);
    const auto& c = g.cases[static_cast<size_t>(i) % g.cases.size()];
    r.prompt_ids = c.prompt_ids;
    for (int j = 0; j < i / static_cast<int>(g.cases.size()); ++j) {
      r.prompt_ids.push_back(static_cast<int32_t>((7 * i + 3 * j + 1) % vocab));
    }
    r.max_tokens = 5 + (i * 7) % 23;
    r.sampling.temperature = 0;
    reqs.push_back(r);
  }
  return reqs;
}

void expect_counters_consistent(const EngineStats& st, int64_t k) {
  ASSERT_EQ(st.spec_accepted_per_pos.size(), static_cast<size_t>(k));
  int64_t accepted = 0;
  for (int64_t a : st.spec_accepted_per_pos) accepted += a;
  EXPECT_EQ(accepted, st.spec_num_accepted_tokens);
  EXPECT_GT(st.spec_num_drafts, 0);
  EXPECT_LE(st.spec_num_draft_tokens, k * st.spec_num_drafts);
}

// DP 2 and 4 with K = 1..3: the greedy tokens of the instance without speculation and of DP 1,
// and the same drafts (the MTP's argmax at every position) and counters as DP 1: the CPU EP
// MoE sums each token's expert outputs in ascending expert id as one process does, and every
// op is per row, so the MTP's logits are bitwise DP 1's whatever batch a rank runs.
void expect_dp_equals_dp1(const std::string& dir, const std::string& mtp, bool real_head) {
  const std::vector<GenRequest> reqs = requests(dir, 6);
  const DecodeRun plain = run_decode(dir, "", 1, 0, reqs);
  ASSERT_TRUE(plain.completed);
  for (int64_t k = 1; k <= 3; ++k) {
    SCOPED_TRACE("K = " + std::to_string(k));
    const DecodeRun one = run_decode(dir, mtp, 1, k, reqs);
    ASSERT_TRUE(one.completed);
    EXPECT_EQ(one.tokens, plain.tokens);
    EXPECT_TRUE(one.errors.empty());
    expect_counters_consistent(one.stats, k);
    if (real_head) EXPECT_GT(one.stats.spec_num_accepted_tokens, 0);
    for (int dp : {2, 4}) {
      SCOPED_TRACE("dp = " + std::to_string(dp));
      const DecodeRun many = run_decode(dir, mtp, dp, k, reqs);
      ASSERT_TRUE(many.completed) << "the instance did not finish (a rank out of lockstep?)";
      EXPECT_TRUE(many.errors.empty());
      EXPECT_EQ(many.tokens, plain.tokens);
      EXPECT_EQ(many.drafts, one.drafts);
      EXPECT_EQ(many.stats.spec_num_drafts, one.stats.spec_num_drafts);
      EXPECT_EQ(many.stats.spec_num_draft_tokens, one.stats.spec_num_draft_tokens);
      EXPECT_EQ(many.stats.spec_num_accepted_tokens, one.stats.spec_num_accepted_tokens);
      EXPECT_EQ(many.stats.spec_accepted_per_pos, one.stats.spec_accepted_per_pos);
    }
  }
}

TEST(SpecDecodeEp, RandomHeadDpEqualsDp1ForK1To3) {
  const RandomMtp mtp(fixture(), 5);
  expect_dp_equals_dp1(fixture(), mtp.dir, /*real_head=*/false);
}

// The demo model's trained head: drafts are accepted, so acceptance and the rollback of
// rejected positions run across ranks too.
TEST(SpecDecodeEp, DemoHeadDpEqualsDp1ForK1To3) {
  if (!has_demo_mtp()) GTEST_SKIP() << "models/demo has no MTP head";
  expect_dp_equals_dp1(demo(), demo(), /*real_head=*/true);
}

// One sequence on a DP 2 instance: rank 1 never drafts, yet rank 0's MTP passes need rank 1's
// experts every step (K passes of rank 1 with empty batches). Without them rank 0 would wait
// in the all-to-all until the group's timeout and the request would fail.
TEST(SpecDecodeEp, OneBusyRankOneIdleRankDoesNotHang) {
  const RandomMtp mtp(fixture(), 9);
  std::vector<GenRequest> reqs = requests(fixture(), 1);
  reqs[0].max_tokens = 20;
  const DecodeRun plain = run_decode(fixture(), "", 1, 0, reqs);
  for (int64_t k : {1, 3}) {
    const auto t0 = std::chrono::steady_clock::now();
    const DecodeRun r = run_decode(fixture(), mtp.dir, 2, k, reqs);
    ASSERT_TRUE(r.completed) << "K " << k;
    EXPECT_TRUE(r.errors.empty());
    EXPECT_EQ(r.tokens, plain.tokens);
    EXPECT_GT(r.stats.spec_num_drafts, 0);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  }
}

// Each rank holds only its own MTP experts (mtp.layers.0.mlp.experts.*); the router, attention,
// fc and norms are whole on every rank.
TEST(SpecDecodeEp, MtpExpertsAreSharded) {
  const std::string dir = fixture();
  const RandomMtp mtp(dir, 3);
  const ModelConfig c = ModelConfig::from_dir(dir);
  const int64_t expert_bytes = 3 * c.moe_intermediate_size * c.hidden_size * 4;  // fp32
  auto whole = Qwen3MoeCpu::load(dir);
  EXPECT_EQ(whole->mtp_weight_bytes(), 0);
  whole->load_mtp(mtp.dir);
  const int64_t all = whole->mtp_weight_bytes();
  EXPECT_FALSE(whole->mtp_collective());
  ASSERT_GT(all, c.num_experts * expert_bytes);
  for (int dp : {1, 2, 4}) {
    auto comms = comm::LocalCommunicator::create_group(dp);
    for (int r = 0; r < dp; ++r) {
      auto m =
          Qwen3MoeCpu::load(dir, ShardSpec::decode(r, dp), comms[static_cast<size_t>(r)].get());
      m->load_mtp(mtp.dir);
      EXPECT_EQ(m->mtp_weight_bytes(), all - (c.num_experts - c.num_experts / dp) * expert_bytes)
          << "dp " << dp << " rank " << r;
      EXPECT_EQ(m->mtp_collective(), dp > 1);
    }
  }
}

// The MTP passes each step of the ranks of a decode instance ran (CountingModel over a rank's
// model), by rank: (passes -> steps), and the fused steps.
struct PassTally {
  std::mutex mu;
  std::map<int, std::map<int64_t, int64_t>> steps_by_passes;
  std::map<int, int64_t> fused_steps;
  std::map<int, bool> collective;  // the rank's Model::mtp_collective()
};

// The engine's rule for a collective MTP layer: every step runs exactly K passes (pass 0, the
// chained ones, empty ones for what the rank does not draft), also an empty step and a step
// whose forward failed; without it, K - 1 chained passes at most, none for an empty step. With
// `chain`, the model drafts "on its device" (greedy rows argmax'd here, Model::mtp_draft_chain
// by its host reference), each chain counting its 1 + chain.size() passes, as the GPU model
// under decode EP runs one exchange per pass of the chain. With `fused` too, steady steps run
// fused (Model::forward_verify_draft by its host reference, each of its passes counted), as the
// GPU model's do. A step's passes are those between its target call and the next one's.
class CountingModel final : public Model {
 public:
  CountingModel(Model& inner, bool collective, bool chain = false, bool fused = false)
      : inner_(inner), collective_(collective), chain_(chain), fused_(fused) {}
  // A decode instance's rank (DecodeInstanceConfig::model): owns the rank's model, whose MTP
  // layer loads through here and says whether it is collective; the device paths on, fused
  // steps with `fused`; each step's passes and the fused steps counted into `tally`.
  CountingModel(std::unique_ptr<Model> rank_model, bool fused, std::shared_ptr<PassTally> tally,
                int rank)
      : owned_(std::move(rank_model)),
        inner_(*owned_),
        chain_(true),
        fused_(fused),
        tally_(std::move(tally)),
        rank_(rank) {}
  const ModelConfig& config() const override { return inner_.config(); }
  KvGeometry kv_geometry(int64_t p, int64_t s) const override { return inner_.kv_geometry(p, s); }
  // Hybrids: the recurrent states and their replay are the inner model's.
  int64_t state_slot_elems() const override { return inner_.state_slot_elems(); }
  bool replay_states(const std::vector<StateReplay>& replays, KvCache& kv) override {
    return inner_.replay_states(replays, kv);
  }
  void forward(const ForwardBatch& b, KvCache& kv, std::vector<float>& logits) override {
    target_call();
    if (fail_forward) TANDEM_THROW(kInternal, "forward failed (test)");
    inner_.forward(b, kv, logits);
  }
  void load_mtp(const std::string& dir) override { inner_.load_mtp(dir); }
  bool has_mtp() const override { return inner_.has_mtp(); }
  bool mtp_collective() const override { return collective_.value_or(inner_.mtp_collective()); }
  KvGeometry mtp_kv_geometry(int64_t p, int64_t s) const override {
    return inner_.mtp_kv_geometry(p, s);
  }
  void mtp_forward(const ForwardBatch& b, const float* hidden, KvCache& kv,
                   std::vector<float>& logits, std::vector<float>& hidden_out) override {
    ++passes;
    inner_.mtp_forward(b, hidden, kv, logits, hidden_out);
  }
  // The device paths (chain_): greedy rows only.
  bool samples_on_device() const override { return chain_; }
  void forward_sample(const ForwardBatch& b, KvCache& kv, const std::vector<DeviceSampling>& rows,
                      std::vector<SampledToken>& out,
                      const std::function<void()>& wait_masks = {}) override {
    target_call();
    if (wait_masks) wait_masks();
    if (fail_forward) TANDEM_THROW(kInternal, "forward failed (test)");
    ForwardBatch keep = b;  // the target's hidden states stay "on the device" (here)
    keep.hidden_out = &last_hidden_;
    std::vector<float> logits;
    inner_.forward(keep, kv, logits);
    if (b.hidden_out != nullptr) *b.hidden_out = last_hidden_;
    argmax(logits, static_cast<int64_t>(rows.size()), out);
  }
  void mtp_forward_sample(const ForwardBatch& b, const float* hidden, KvCache& kv,
                          const std::vector<DeviceSampling>& rows, std::vector<SampledToken>& out,
                          std::vector<float>& hidden_out) override {
    std::vector<float> logits;
    mtp_forward(b, hidden, kv, logits, hidden_out);
    argmax(logits, static_cast<int64_t>(rows.size()), out);
  }
  bool mtp_drafts_on_device() const override { return chain_; }
  void mtp_draft_chain(const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                       const std::vector<MtpChainPass>& chain, KvCache& kv,
                       std::vector<std::vector<int32_t>>& drafts) override {
    mtp_draft_chain_on_host(inner_, last_hidden_, first, hidden_rows, chain, kv, drafts);
    passes += 1 + static_cast<int64_t>(chain.size());  // one exchange per pass
    ++chains;
  }
  bool fuses_verify_and_draft() const override { return chain_ && fused_; }
  // Model::forward_verify_draft's default (the host reference): its MTP passes through
  // mtp_forward (counted).
  void forward_verify_draft(const ForwardBatch& b, KvCache& kv,
                            const std::vector<DeviceSampling>& rows, KvCache& mtp_kv,
                            VerifyDraftStep& step, std::vector<SampledToken>& out) override {
    ++fused_steps;
    if (tally_) {
      std::lock_guard<std::mutex> lock(tally_->mu);
      ++tally_->fused_steps[rank_];
    }
    Model::forward_verify_draft(b, kv, rows, mtp_kv, step, out);
  }
  int64_t passes = 0, chains = 0, fused_steps = 0;
  bool fail_forward = false;

 private:
  // A step's first model call: the step before ran passes - step_start_ MTP passes.
  void target_call() {
    if (tally_ && target_calls_ > 0) {
      std::lock_guard<std::mutex> lock(tally_->mu);
      ++tally_->steps_by_passes[rank_][passes - step_start_];
      tally_->collective[rank_] = mtp_collective();
    }
    ++target_calls_;
    step_start_ = passes;
  }
  void argmax(const std::vector<float>& logits, int64_t rows, std::vector<SampledToken>& out) {
    const int64_t v = config().vocab_size;
    out.assign(static_cast<size_t>(rows), {});
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data() + r * v;
      out[static_cast<size_t>(r)].token =
          static_cast<int32_t>(std::max_element(row, row + v) - row);
    }
  }
  std::unique_ptr<Model> owned_;
  Model& inner_;
  std::optional<bool> collective_;  // unset: the inner model's
  bool chain_, fused_;
  std::shared_ptr<PassTally> tally_;
  int rank_ = 0;
  int64_t target_calls_ = 0, step_start_ = 0;
  std::vector<float> last_hidden_;
};

TEST(SpecDecodeEp, CollectiveMtpRunsKPassesEveryStep) {
  const RandomMtp mtp(fixture(), 4);
  auto inner = Qwen3MoeCpu::load(fixture());
  inner->load_mtp(mtp.dir);
  struct Mode {
    bool collective, chain, fused;
  };
  for (const Mode& m :
       {Mode{true, false, false}, Mode{false, false, false}, Mode{true, true, false},
        Mode{false, true, false}, Mode{true, true, true}}) {
    const bool collective = m.collective, chain = m.chain;
    for (int64_t k : {1, 3}) {
      SCOPED_TRACE("collective " + std::to_string(collective) + " chain " + std::to_string(chain) +
                   " fused " + std::to_string(m.fused) + " K " + std::to_string(k));
      CountingModel model(*inner, collective, chain, m.fused);
      EngineConfig cfg;
      cfg.num_speculative_tokens = k;
      Engine engine(model, cfg);
      for (const GenRequest& r : requests(fixture(), 3)) engine.add(r, nullptr);
      int64_t steps = 0, short_steps = 0;
      auto step = [&] {
        const int64_t before = model.passes;
        ScheduledBatch batch = engine.schedule();
        if (engine.forward(batch)) engine.complete(batch);
        return model.passes - before;
      };
      while (engine.has_work()) {
        const int64_t n = step();
        ++steps;
        if (collective) {
          EXPECT_EQ(n, k) << "step " << steps;
        } else {
          EXPECT_LE(n, k);
          short_steps += n < k;
        }
      }
      EXPECT_GT(steps, 3);
      // An empty step (nothing scheduled, as an idle decode rank's).
      EXPECT_EQ(step(), collective ? k : 0);
      // A step whose forward fails: its requests end with an error, the passes still run.
      GenRequest r = requests(fixture(), 1)[0];
      r.id = "fails";
      StepOutput last;
      engine.add(r, [&](const StepOutput& o) { last = o; });
      model.fail_forward = true;
      EXPECT_EQ(step(), collective ? k : 0);
      EXPECT_TRUE(last.finished);
      EXPECT_EQ(last.finish_reason, FinishReason::kError);
      model.fail_forward = false;
      if (!collective && k > 1) EXPECT_GT(short_steps, 0);  // the rule is not vacuous
      if (chain) EXPECT_GT(model.chains, 0);
      if (m.fused) EXPECT_GT(model.fused_steps, 0);
    }
  }
}

// A fused step's chained passes all run on a collective layer, even those whose positions fall
// past every block table (no live row: an empty pass, the exchange still made).
TEST(SpecDecodeEp, FusedStepRunsKPassesPastTheBlockTables) {
  const RandomMtp mtp(fixture(), 4);
  auto inner = Qwen3MoeCpu::load(fixture());
  inner->load_mtp(mtp.dir);
  for (const bool collective : {true, false}) {
    for (int64_t k : {1, 3, 4}) {
      SCOPED_TRACE("collective " + std::to_string(collective) + " K " + std::to_string(k));
      CountingModel model(*inner, collective, /*chain=*/true, /*fused=*/true);
      // Two sequences verifying 2 drafts each at positions 13..15 of one page of 16, both
      // accepted (forced): the chained passes sit at 16.., outside the tables.
      const int64_t ps = 16;
      KvCache kv(model.kv_geometry(4, ps));
      KvCache mkv = model.make_mtp_kv_cache(4, ps);
      const std::vector<std::vector<int32_t>> tokens = {{7, 1, 2}, {9, 3, 4}};
      const std::vector<int32_t> tables = {0, 1};
      ForwardBatch b;
      for (size_t i = 0; i < tokens.size(); ++i) {
        b.seqs.push_back({tokens[i].data(), 3, 13, &tables[i], 1, LogitsMode::kAll, -1});
      }
      DeviceSampling greedy;
      greedy.temperature = 0.0f;
      const std::vector<DeviceSampling> rows(6, greedy);
      VerifyDraftStep step;
      step.num_drafts = k;
      step.forced = {2, 2};
      std::vector<SampledToken> out;
      const int64_t before = model.passes;
      model.forward_verify_draft(b, kv, rows, mkv, step, out);
      EXPECT_EQ(model.passes - before, collective ? k : 1);
      ASSERT_EQ(step.drafts.size(), 2u);
      EXPECT_EQ(step.accepted, (std::vector<int32_t>{2, 2}));
      for (const auto& d : step.drafts) EXPECT_EQ(d.size(), static_cast<size_t>(k));
    }
  }
}

// A decode instance's ranks over CountingModel: rank r fuses when fuses(r) says so.
ModelFactory counted_ranks(const std::string& dir, std::function<bool(int)> fuses,
                           std::shared_ptr<PassTally> tally) {
  return [=](const ShardSpec& shard, comm::Communicator* comm) -> std::unique_ptr<Model> {
    return std::make_unique<CountingModel>(load_cpu_model(dir, shard, comm), fuses(shard.rank),
                                           tally, shard.rank);
  };
}

// Decode EP ranks running the fused step (Model::forward_verify_draft: the verify, pass 0 over
// every verify position and K - 1 chained passes, each one exchange). Each rank decides alone,
// so every rank fusing, only rank 0 fusing (the others verify, then draft and pad to K), and a
// busy fusing rank beside idle ones give the greedy tokens of no speculation and the drafts and
// counters of ranks that never fuse (themselves those of the host path); and with a collective
// MTP layer every rank runs K passes in every step (one pass off, a rank's exchanges would pair
// with another pass's or layer's). Hybrids: their MTP layer local, the verify collective.
// `collective`: whether the ranks' MTP layer must be collective (nullopt: either).
void expect_fused_equals_unfused(const std::string& dir, const std::string& mtp,
                                 std::optional<bool> collective) {
  for (const int count : {6, 1}) {  // 1: rank 0 busy, the others idle
    std::vector<GenRequest> reqs = requests(dir, count);
    if (count == 1) reqs[0].max_tokens = 20;
    const DecodeRun plain = run_decode(dir, "", 1, 0, reqs);
    ASSERT_TRUE(plain.completed);
    for (int64_t k = 1; k <= 3; ++k) {
      for (int dp : {2, 4}) {
        SCOPED_TRACE(std::to_string(count) + " requests, K = " + std::to_string(k) +
                     ", dp = " + std::to_string(dp));
        const DecodeRun host = run_decode(dir, mtp, dp, k, reqs);
        auto run = [&](const std::function<bool(int)>& fuses, const std::string& what) {
          SCOPED_TRACE(what);
          auto tally = std::make_shared<PassTally>();
          DecodeRun r = run_decode(dir, mtp, dp, k, reqs, counted_ranks(dir, fuses, tally));
          EXPECT_TRUE(r.completed) << "the instance did not finish (a rank out of lockstep?)";
          EXPECT_TRUE(r.errors.empty());
          EXPECT_EQ(r.tokens, plain.tokens);
          for (int rank = 0; rank < dp; ++rank) {
            const int64_t fused = tally->fused_steps[rank];
            if (!fuses(rank)) EXPECT_EQ(fused, 0) << "rank " << rank;
            if (fuses(rank) && rank == 0) EXPECT_GT(fused, 0) << "rank 0 never fused";
            if (collective) EXPECT_EQ(tally->collective[rank], *collective) << "rank " << rank;
            if (!tally->collective[rank]) continue;
            EXPECT_FALSE(tally->steps_by_passes[rank].empty()) << "rank " << rank;
            for (const auto& [passes, steps] : tally->steps_by_passes[rank]) {
              EXPECT_EQ(passes, k)
                  << "rank " << rank << ": " << steps << " steps of " << passes << " MTP passes";
            }
          }
          return r;
        };
        const DecodeRun unfused = run([](int) { return false; }, "no rank fuses");
        EXPECT_EQ(unfused.drafts, host.drafts);
        struct Layout {
          std::string what;
          std::function<bool(int)> fuses;
        };
        for (const Layout& l : {Layout{"every rank fuses", [](int) { return true; }},
                                Layout{"rank 0 fuses", [](int rank) { return rank == 0; }}}) {
          const std::string& what = l.what;
          const DecodeRun fused = run(l.fuses, what);
          EXPECT_EQ(fused.drafts, unfused.drafts) << what;
          EXPECT_EQ(fused.stats.spec_num_drafts, unfused.stats.spec_num_drafts) << what;
          EXPECT_EQ(fused.stats.spec_num_draft_tokens, unfused.stats.spec_num_draft_tokens) << what;
          EXPECT_EQ(fused.stats.spec_num_accepted_tokens, unfused.stats.spec_num_accepted_tokens)
              << what;
          EXPECT_EQ(fused.stats.spec_accepted_per_pos, unfused.stats.spec_accepted_per_pos) << what;
          expect_counters_consistent(fused.stats, k);
        }
      }
    }
  }
}

TEST(SpecDecodeEp, FusedStepsEqualUnfusedAndNoSpeculation) {
  const RandomMtp mtp(fixture(), 5);
  expect_fused_equals_unfused(fixture(), mtp.dir, true);
}

// The trained head: drafts accepted, so fused steps accept and reject across ranks too.
TEST(SpecDecodeEp, DemoHeadFusedStepsEqualUnfused) {
  if (!has_demo_mtp()) GTEST_SKIP() << "models/demo has no MTP head";
  expect_fused_equals_unfused(demo(), demo(), std::nullopt);
}

TEST(SpecDecodeEp, HybridFusedStepsEqualUnfused) {
  const std::string dir = testing::hybrid_golden_dirs().front();
  const RandomMtp mtp(dir, 2);
  expect_fused_equals_unfused(dir, mtp.dir, false);
}

// Qwen3.5 hybrids: each rank keeps the MTP layer whole and local, and a rejected draft's
// DeltaNet state rolls back by the replay of its verify's inputs, rank-local: DP 2 and 4 give
// DP 1's tokens, drafts and counters.
TEST(SpecDecodeEp, HybridDpEqualsDp1ForK1To3) {
  const std::string dir = testing::hybrid_golden_dirs().front();
  const RandomMtp mtp(dir, 2);
  expect_dp_equals_dp1(dir, mtp.dir, /*real_head=*/false);
}

// Without the replay (EngineConfig::spec_state_replay off) the rollback is a forward that only some
// ranks would run: a hybrid speculating with --dp above 1 is refused then, --dp 1 still speculates.
TEST(SpecDecodeEp, HybridWithoutStateReplayRefusedUnderDpAbove1) {
  const std::string dir = testing::hybrid_golden_dirs().front();
  const RandomMtp mtp(dir, 2);
  DecodeInstanceConfig cfg;
  cfg.model_dir = dir;
  cfg.dp = 2;
  cfg.engine.num_pages = 64;
  cfg.engine.num_speculative_tokens = 2;
  cfg.engine.spec_state_replay = false;
  cfg.mtp_dir = mtp.dir;
  try {
    DecodeInstance d(cfg);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("--dp 2"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("replay"), std::string::npos) << e.message();
  }
  cfg.dp = 1;
  DecodeInstance one(cfg);
}

// (Moved from test_speculative.cpp with the roles.) The tokens of one engine without
// speculation, as test_speculative.cpp's run() gives them.
std::vector<std::vector<int32_t>> one_engine_tokens(Model& model,
                                                    const std::vector<GenRequest>& reqs) {
  Engine engine(model, EngineConfig{});
  std::vector<std::vector<int32_t>> ids(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    GenRequest r = reqs[i];
    r.id = "w0-" + r.id;
    engine.add(std::move(r), [&ids, i](const StepOutput& s) {
      ids[i].insert(ids[i].end(), s.token_ids.begin(), s.token_ids.end());
    });
  }
  while (engine.step()) {
  }
  EXPECT_EQ(engine.blocks().num_available(), engine.blocks().num_pages()) << "leaked KV pages";
  return ids;
}

// A decode instance (DP = 2, EP MoE) speculates too: the MTP layer's experts are sharded like
// the target's and its MoE runs through the same all-to-all (test_speculative_ep.cpp); each
// rank verifies with its ordinary lockstep forward; the tokens are one engine's, without
// speculation.
TEST(SpecDecodeInstance, SameTokensAsOneEngine) {
  const std::string dir = testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2";
  std::vector<GenRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    GenRequest r;
    r.id = "d" + std::to_string(i);
    r.prompt_ids = std::vector<int32_t>(static_cast<size_t>(5 + 11 * i), 3 + i);
    r.max_tokens = 14;
    r.sampling.temperature = 0;
    reqs.push_back(r);
  }
  auto ref_model = Qwen3MoeCpu::load(dir);
  const std::vector<std::vector<int32_t>> want = one_engine_tokens(*ref_model, reqs);

  DecodeInstanceConfig cfg;
  cfg.model_dir = dir;
  cfg.dp = 2;
  cfg.engine.num_pages = 256;
  cfg.engine.num_speculative_tokens = 3;
  cfg.max_decode_batch = 4;
  cfg.mtp_dir = testing::random_mtp_dir(dir);
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::vector<int32_t>> got;
  int finished = 0;
  DecodeInstance d(cfg);
  PrefillInstanceConfig pcfg;
  pcfg.model_dir = dir;
  pcfg.engine.num_pages = 256;
  PrefillInstance p(pcfg);
  for (const GenRequest& r : reqs) {
    auto dst = d.accept(r, p.kv_sharding(), [&, id = r.id](const StepOutput& o) {
      std::lock_guard<std::mutex> lock(mu);
      got[id].insert(got[id].end(), o.token_ids.begin(), o.token_ids.end());
      if (o.finished) {
        ++finished;
        cv.notify_all();
      }
    });
    ASSERT_TRUE(dst.has_value());
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
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return finished == 4; }));
  }
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[reqs[i].id], want[i]) << i;
  // The MTP counters, summed over the ranks (what the router's /metrics shows).
  const EngineStats st = d.stats();
  ASSERT_EQ(st.spec_accepted_per_pos.size(), 3u);
  EXPECT_GT(st.spec_num_drafts, 0);
  EXPECT_GE(st.spec_num_draft_tokens, st.spec_num_drafts);  // fewer than K near max_tokens
  EXPECT_LE(st.spec_num_draft_tokens, 3 * st.spec_num_drafts);
  int64_t accepted = 0;
  for (int64_t a : st.spec_accepted_per_pos) accepted += a;
  EXPECT_EQ(accepted, st.spec_num_accepted_tokens);
}

}  // namespace
}  // namespace tandem
