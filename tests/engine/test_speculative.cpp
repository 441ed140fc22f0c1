// MTP speculative decoding (engine/speculative.h): lossless greedy decoding on every golden
// fixture and the demo model with K = 1..4 (alone, batched, chunked, prefix-cache hits,
// preemption), the sampled output distribution (chi-square against non-speculative sampling,
// and a wrong acceptance rule that the same bound rejects), configuration errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <random>

#include "chi_square.h"
#include "core/error.h"
#include "engine/engine.h"
#include "engine/speculative.h"
#include "golden.h"
#include "model/qwen3_5_moe.h"
#include "model/qwen3_moe.h"
#include "model/safetensors.h"
#include "mtp_weights.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;
using testing::Golden;

std::unique_ptr<Qwen3MoeCpu> load_with_mtp(const std::string& dir) {
  auto m = Qwen3MoeCpu::load(dir);
  m->load_mtp(testing::random_mtp_dir(dir));
  return m;
}

struct Out {
  std::vector<int32_t> ids;
  std::vector<float> lps;
  std::vector<std::vector<TokenLogprob>> top;
  std::vector<float> prompt_lps;
  FinishReason reason = FinishReason::kNone;
  int finished = 0;
};

struct RunResult {
  std::vector<Out> outs;  // wave * requests + i
  EngineStats stats;
};

// Runs the requests through one engine, all at once; `waves` times one after the other
// (later waves hit the prefix cache).
RunResult run(Model& model, const std::vector<GenRequest>& reqs, const EngineConfig& cfg,
              int waves = 1, int64_t* state_replays = nullptr) {
  Engine engine(model, cfg);
  RunResult res;
  res.outs.resize(reqs.size() * static_cast<size_t>(waves));
  for (int w = 0; w < waves; ++w) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      GenRequest r = reqs[i];
      r.id = "w" + std::to_string(w) + "-" + r.id;
      Out& o = res.outs[static_cast<size_t>(w) * reqs.size() + i];
      engine.add(std::move(r), [&o](const StepOutput& s) {
        o.ids.insert(o.ids.end(), s.token_ids.begin(), s.token_ids.end());
        o.lps.insert(o.lps.end(), s.token_logprobs.begin(), s.token_logprobs.end());
        o.top.insert(o.top.end(), s.top_logprobs.begin(), s.top_logprobs.end());
        o.prompt_lps.insert(o.prompt_lps.end(), s.prompt_token_logprobs.begin(),
                            s.prompt_token_logprobs.end());
        if (s.finished) {
          o.reason = s.finish_reason;
          ++o.finished;
        }
      });
    }
    while (engine.step()) {
    }
  }
  EXPECT_EQ(engine.blocks().num_available(), engine.blocks().num_pages()) << "leaked KV pages";
  res.stats = engine.stats();
  if (state_replays != nullptr) *state_replays = engine.state_replays();
  return res;
}

std::vector<GenRequest> greedy_requests(const Golden& g) {
  std::vector<GenRequest> reqs;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    GenRequest r;
    r.id = "r" + std::to_string(i);
    r.prompt_ids = g.cases[i].prompt_ids;
    r.max_tokens = g.cases[i].max_tokens;
    r.sampling.temperature = 0;
    r.sampling.logprobs = 3;
    reqs.push_back(r);
  }
  return reqs;
}

void expect_same(const Out& got, const Out& want, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(got.finished, 1);
  EXPECT_EQ(got.reason, want.reason);
  ASSERT_EQ(got.ids, want.ids);
  ASSERT_EQ(got.prompt_lps.size(), want.prompt_lps.size());
  for (size_t t = 0; t < got.prompt_lps.size(); ++t) {
    EXPECT_NEAR(got.prompt_lps[t], want.prompt_lps[t], 1e-5) << "prompt position " << t;
  }
  ASSERT_EQ(got.lps.size(), want.lps.size());
  for (size_t t = 0; t < got.lps.size(); ++t) {
    EXPECT_NEAR(got.lps[t], want.lps[t], 1e-5) << "position " << t;
    ASSERT_EQ(got.top[t].size(), want.top[t].size());
    for (size_t k = 0; k < got.top[t].size(); ++k) {
      EXPECT_EQ(got.top[t][k].id, want.top[t][k].id) << "position " << t << " rank " << k;
    }
  }
}

// Drafts from the reference continuation, each wrong with probability 0.3 (so every accepted
// length 0..K occurs): exercises acceptance, the bonus token and the rollback of rejected KV.
EngineConfig::SpecHookFn oracle(const std::vector<GenRequest>& reqs, const std::vector<Out>& ref,
                                int64_t vocab) {
  std::map<std::string, std::vector<int32_t>> full;
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::vector<int32_t> t = reqs[i].prompt_ids;
    t.insert(t.end(), ref[i].ids.begin(), ref[i].ids.end());
    full[reqs[i].id] = t;
  }
  return testing::oracle_drafts(std::move(full), vocab);
}

class SpecLosslessTest : public ::testing::TestWithParam<std::string> {};

// Greedy speculation with K = 1..4 gives the tokens (and logprobs) of the same model without it:
// batched, alone, chunked, with prefix-cache hits, preempted, with random MTP drafts and with
// mostly-right ones.
void expect_lossless_for_k1_to_4(Model& model, const Golden& g, bool golden_exact) {
  Model* m = &model;
  const std::vector<GenRequest> reqs = greedy_requests(g);
  EngineConfig base;
  const RunResult ref = run(*m, reqs, base);
  ASSERT_EQ(ref.outs.size(), reqs.size());
  if (golden_exact) {
    for (size_t i = 0; i < reqs.size(); ++i) ASSERT_EQ(ref.outs[i].ids, g.cases[i].output_ids);
  }

  int64_t longest = 0;
  for (const auto& r : reqs) {
    longest = std::max<int64_t>(longest, static_cast<int64_t>(r.prompt_ids.size()) + r.max_tokens);
  }
  for (int64_t k = 1; k <= kMaxSpeculativeTokens; ++k) {
    SCOPED_TRACE("K = " + std::to_string(k));
    EngineConfig spec = base;
    spec.num_speculative_tokens = k;
    auto check = [&](const RunResult& r, const std::string& what) {
      ASSERT_EQ(r.outs.size() % reqs.size(), 0u);
      for (size_t i = 0; i < r.outs.size(); ++i) {
        expect_same(r.outs[i], ref.outs[i % reqs.size()], what + " case " + std::to_string(i));
      }
      EXPECT_GT(r.stats.spec_num_drafts, 0) << what;
      int64_t per_pos = 0;
      for (int64_t a : r.stats.spec_accepted_per_pos) per_pos += a;
      EXPECT_EQ(per_pos, r.stats.spec_num_accepted_tokens) << what;
      EXPECT_LE(r.stats.spec_num_accepted_tokens, r.stats.spec_num_draft_tokens) << what;
    };
    check(run(*m, reqs, spec), "batched");
    EngineConfig alone = spec;
    alone.max_num_seqs = 1;
    check(run(*m, reqs, alone), "alone");
    EngineConfig chunked = spec;
    chunked.max_batched_tokens = 7;
    check(run(*m, reqs, chunked), "chunked");
    check(run(*m, reqs, spec, /*waves=*/2), "prefix-cache hits");
    EngineConfig tight = spec;
    tight.max_model_len = longest;
    tight.num_pages = (longest + tight.page_size - 1) / tight.page_size + 2;
    tight.max_batched_tokens = 64;
    const RunResult preempted = run(*m, reqs, tight);
    check(preempted, "preempted");
    // Drafts that are mostly right: every accepted length, the bonus token, rollbacks.
    EngineConfig good = spec;
    good.spec_draft_hook = oracle(reqs, ref.outs, m->config().vocab_size);
    const RunResult o = run(*m, reqs, good);
    check(o, "oracle drafts");
    EXPECT_GT(o.stats.spec_num_accepted_tokens, 0);
    EXPECT_LT(o.stats.spec_num_accepted_tokens, o.stats.spec_num_draft_tokens);
    EngineConfig good_chunked = chunked;
    good_chunked.spec_draft_hook = oracle(reqs, ref.outs, m->config().vocab_size);
    check(run(*m, reqs, good_chunked, 2), "oracle drafts, chunked, prefix-cache hits");
    EngineConfig good_tight = tight;
    good_tight.spec_draft_hook = oracle(reqs, ref.outs, m->config().vocab_size);
    check(run(*m, reqs, good_tight), "oracle drafts, preempted");
  }
}

TEST_P(SpecLosslessTest, GreedyTokensUnchangedForK1To4) {
  auto model = load_with_mtp(GetParam());
  expect_lossless_for_k1_to_4(*model, testing::load_golden(GetParam()), /*golden_exact=*/true);
}

// Qwen3.5 hybrids (the MTP layer of model/qwen3_5_mtp.cpp, random weights): the same, through
// the DeltaNet rollback of rejected drafts (SpecDecoder::rollback_states).
class SpecHybridLosslessTest : public ::testing::TestWithParam<std::string> {};

TEST_P(SpecHybridLosslessTest, GreedyTokensUnchangedForK1To4) {
  auto model = load_cpu_model(GetParam());
  model->load_mtp(testing::random_mtp_dir(GetParam()));
  ASSERT_TRUE(model->has_mtp());
  expect_lossless_for_k1_to_4(*model, testing::load_golden(GetParam()), /*golden_exact=*/false);
}

// A rejected draft's DeltaNet state rolls back by replaying the verify's own recurrence inputs
// (Model::replay_states): the same tokens and logprobs as the second forward it replaces
// (EngineConfig::spec_state_replay off), and the replay is what ran.
TEST_P(SpecHybridLosslessTest, StateReplayEqualsTheRollbackForward) {
  auto model = load_cpu_model(GetParam());
  model->load_mtp(testing::random_mtp_dir(GetParam()));
  const std::vector<GenRequest> reqs = greedy_requests(testing::load_golden(GetParam()));
  const RunResult ref = run(*model, reqs, EngineConfig{});
  for (int64_t k : {1, 3}) {
    SCOPED_TRACE("K = " + std::to_string(k));
    EngineConfig spec;
    spec.num_speculative_tokens = k;
    for (int64_t tokens : {int64_t{1024}, int64_t{7}}) {  // batched, and chunked beside prefills
      spec.max_batched_tokens = tokens;
      int64_t replays = -1, forwards = -1;
      spec.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);  // (fresh draws)
      const RunResult replayed = run(*model, reqs, spec, 1, &replays);
      EngineConfig off = spec;
      off.spec_state_replay = false;
      off.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);
      const RunResult forwarded = run(*model, reqs, off, 1, &forwards);
      EXPECT_GT(replays, 0);
      EXPECT_EQ(forwards, 0);
      EXPECT_GT(replayed.stats.spec_num_accepted_tokens, 0);
      EXPECT_LT(replayed.stats.spec_num_accepted_tokens, replayed.stats.spec_num_draft_tokens);
      for (size_t i = 0; i < reqs.size(); ++i) {
        expect_same(replayed.outs[i], forwarded.outs[i], "case " + std::to_string(i));
        expect_same(replayed.outs[i], ref.outs[i], "case " + std::to_string(i) + " vs no spec");
      }
      EXPECT_EQ(replayed.stats.spec_num_accepted_tokens, forwarded.stats.spec_num_accepted_tokens);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SpecHybridLosslessTest,
                         ::testing::ValuesIn(testing::hybrid_golden_dirs()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string n = fs::path(info.param).filename().string();
                           for (char& ch : n) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

// Token-level stops, min_tokens, penalties, logit_bias and prompt logprobs act inside the accepted
// drafts exactly as they do one token at a time (the drafts mostly right, so stops land inside
// accepted runs).
TEST(SpecLossless, StopsPenaltiesAndMinTokensInsideAcceptedDrafts) {
  const std::string dir = testing::source_dir() + "/models/demo";
  if (!fs::exists(dir + "/golden.json")) GTEST_SKIP() << "no demo model";
  auto model = load_with_mtp(dir);
  const Golden g = testing::load_golden(dir);
  std::vector<GenRequest> reqs;
  for (size_t i = 0; i < g.cases.size(); ++i) {
    const auto& c = g.cases[i];
    GenRequest r;
    r.prompt_ids = c.prompt_ids;
    r.max_tokens = 40;
    r.sampling.temperature = 0;
    r.sampling.logprobs = 2;
    GenRequest stop = r;  // stops at a token of its continuation
    stop.id = "stop" + std::to_string(i);
    stop.stop_token_ids = {c.output_ids[std::min<size_t>(6, c.output_ids.size() - 1)]};
    reqs.push_back(stop);
    GenRequest pen = r;  // penalties change the argmax
    pen.id = "pen" + std::to_string(i);
    pen.sampling.repetition_penalty = 1.5f;
    pen.sampling.frequency_penalty = 0.4f;
    pen.sampling.logit_bias = {{c.output_ids[0], -5.0f}};
    reqs.push_back(pen);
    GenRequest min = r;  // EOS and a stop id suppressed for 10 tokens
    min.id = "min" + std::to_string(i);
    min.min_tokens = 10;
    min.stop_token_ids = {c.output_ids[std::min<size_t>(3, c.output_ids.size() - 1)]};
    reqs.push_back(min);
    GenRequest plp = r;  // prompt logprobs (the prompt bypasses the prefix cache)
    plp.id = "plp" + std::to_string(i);
    plp.sampling.prompt_logprobs = 2;
    reqs.push_back(plp);
  }
  const RunResult ref = run(*model, reqs, EngineConfig{});
  for (int64_t k = 1; k <= kMaxSpeculativeTokens; ++k) {
    EngineConfig spec;
    spec.num_speculative_tokens = k;
    spec.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);
    const RunResult r = run(*model, reqs, spec);
    for (size_t i = 0; i < reqs.size(); ++i) {
      expect_same(r.outs[i], ref.outs[i], reqs[i].id + " K = " + std::to_string(k));
    }
    EXPECT_GT(r.stats.spec_num_accepted_tokens, 0);
  }
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = fs::path(info.param).filename().string();
  for (auto& ch : n) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SpecLosslessTest, ::testing::ValuesIn(testing::golden_dirs()),
                         param_name);

// The demo model's own MTP head (tools/train_mtp.py, committed into models/demo with the model):
// greedy mean acceptance length on the golden prompts at K = 3 (tokens per verify step) above
// a floor. Skips while the demo checkpoint has no mtp.* tensors.
// A model that "samples on its device" (the CPU model with its rows sampled here, as the GPU
// sampler samples them: greedy rows their argmax, sampled rows one draw keyed by (seed,
// counter)): the engine's device path for speculation (verify rows and MTP drafts as sampled
// tokens, no logits) must give exactly the host path's tokens and logprobs (greedy), and
// exactly the tokens of non-speculative device sampling (sampled; SpecSamplingTest).
class DeviceGreedy final : public Model {
 public:
  explicit DeviceGreedy(Model& m) : m_(m) {}
  const ModelConfig& config() const override { return m_.config(); }
  KvGeometry kv_geometry(int64_t pages, int64_t page) const override {
    return m_.kv_geometry(pages, page);
  }
  // Hybrids: the recurrent states and their replay are the wrapped model's.
  int64_t state_slot_elems() const override { return m_.state_slot_elems(); }
  bool replay_states(const std::vector<StateReplay>& replays, KvCache& kv) override {
    ++state_replay_calls;
    return m_.replay_states(replays, kv);
  }
  void forward(const ForwardBatch& b, KvCache& kv, std::vector<float>& logits) override {
    ++host_forwards;
    forward_keeping_hidden(b, kv, logits);
  }
  bool samples_on_device() const override { return true; }
  void forward_sample(const ForwardBatch& b, KvCache& kv, const std::vector<DeviceSampling>& rows,
                      std::vector<SampledToken>& out,
                      const std::function<void()>& wait_masks = {}) override {
    if (wait_masks) wait_masks();
    std::vector<float> logits;
    forward_keeping_hidden(b, kv, logits);
    for (const auto& s : b.seqs) verify_rows += s.logits == LogitsMode::kAll ? s.num_tokens : 0;
    pick(logits, rows, out);
  }
  bool has_mtp() const override { return m_.has_mtp(); }
  KvGeometry mtp_kv_geometry(int64_t pages, int64_t page) const override {
    return m_.mtp_kv_geometry(pages, page);
  }
  void mtp_forward(const ForwardBatch& b, const float* hidden, KvCache& kv,
                   std::vector<float>& logits, std::vector<float>& hidden_out) override {
    ++host_drafts;
    m_.mtp_forward(b, hidden, kv, logits, hidden_out);
  }
  void mtp_forward_sample(const ForwardBatch& b, const float* hidden, KvCache& kv,
                          const std::vector<DeviceSampling>& rows, std::vector<SampledToken>& out,
                          std::vector<float>& hidden_out) override {
    std::vector<float> logits;
    m_.mtp_forward(b, hidden, kv, logits, hidden_out);
    device_drafts += static_cast<int64_t>(rows.size());
    pick(logits, rows, out);
  }
  // chain: drafts "on the device" (Model::mtp_draft_chain, its host reference): the target's
  // hidden states stay in the model, as a GPU model keeps them.
  bool mtp_drafts_on_device() const override { return chain; }
  void mtp_draft_chain(const ForwardBatch& first, std::span<const int64_t> hidden_rows,
                       const std::vector<MtpChainPass>& passes, KvCache& kv,
                       std::vector<std::vector<int32_t>>& drafts) override {
    ++chains;
    for (const MtpChainPass& p : passes) {
      for (const uint8_t w : p.writes) rows_past_their_drafts += w == 0 ? 1 : 0;
    }
    mtp_draft_chain_on_host(m_, last_hidden_, first, hidden_rows, passes, kv, drafts);
    device_drafts += static_cast<int64_t>(drafts[0].size());
  }
  void warm_up_speculative(KvCache&, KvCache& mtp_kv, int64_t max_batch, int64_t k) override {
    EXPECT_EQ(mtp_kv.geometry().num_layers, 1);  // the MTP layer's own pool
    warmed_verify.emplace_back(max_batch, k);
  }
  // fused: the verify step and the next drafts in one call (Model::forward_verify_draft, its
  // host reference over the hidden states kept here).
  bool fuses_verify_and_draft() const override { return fused; }
  void forward_verify_draft(const ForwardBatch& b, KvCache& kv,
                            const std::vector<DeviceSampling>& rows, KvCache& mtp_kv,
                            VerifyDraftStep& step, std::vector<SampledToken>& out) override {
    ++fused_steps;
    EXPECT_EQ(b.hidden_out, nullptr) << "a fused step asked for the hidden states";
    snapshot_verify_states(*this, b, step, kv);
    forward_sample(b, kv, rows, out);
    verify_draft_on_host(m_, last_hidden_, b, out, mtp_kv, step);
    rollback_verify_states(*this, b, step, kv);
  }
  bool chain = false, fused = false;
  int64_t fused_steps = 0, state_replay_calls = 0;
  int64_t host_forwards = 0, host_drafts = 0, verify_rows = 0, device_drafts = 0;
  int64_t chains = 0, rows_past_their_drafts = 0, hidden_to_host = 0;
  std::vector<std::pair<int64_t, int64_t>> warmed_verify;  // warm_up_speculative's (batch, K)
  mutable int64_t sampled_rows = 0;

 private:
  void pick(const std::vector<float>& logits, const std::vector<DeviceSampling>& rows,
            std::vector<SampledToken>& out) const {
    const int64_t v = config().vocab_size;
    ASSERT_EQ(logits.size(), rows.size() * static_cast<size_t>(v));
    out.assign(rows.size(), {});
    SamplingParams greedy;
    greedy.temperature = 0;
    SamplerRng rng(0);
    for (size_t r = 0; r < rows.size(); ++r) {
      std::span<const float> row(logits.data() + static_cast<int64_t>(r) * v,
                                 static_cast<size_t>(v));
      const DeviceSampling& d = rows[r];
      if (d.temperature >= 1e-5f) {
        // A sampled row: one draw keyed by (seed, counter), as the GPU's Philox stream is, so
        // a request's token at an output position does not depend on the step that drew it.
        ASSERT_TRUE(d.bias.empty() && d.mask == nullptr) << "the test's device has no biases";
        SamplingParams sp;
        sp.temperature = d.temperature;
        sp.top_k = d.top_k;
        sp.top_p = d.top_p;
        sp.min_p = d.min_p;
        std::seed_seq key{static_cast<uint32_t>(d.seed), static_cast<uint32_t>(d.seed >> 32),
                          static_cast<uint32_t>(d.counter), static_cast<uint32_t>(d.counter >> 32)};
        SamplerRng keyed(key);
        out[r].token = sample_token(row, sp, {}, {}, keyed);
        ++sampled_rows;
      } else {
        out[r].token = sample_token(row, greedy, {}, {}, rng);
      }
      out[r].logprob = token_logprob(row, out[r].token);
      if (rows[r].logprobs > 0) {
        for (const auto& t : top_logprobs(row, rows[r].logprobs))
          out[r].top.emplace_back(t.id, t.logprob);
      }
    }
  }
  // The target's hidden states of every forward kept here (chain); batch.hidden_out filled
  // only when the engine asks for it.
  void forward_keeping_hidden(const ForwardBatch& b, KvCache& kv, std::vector<float>& logits) {
    ForwardBatch fb = b;
    if (b.hidden_out != nullptr) ++hidden_to_host;
    fb.hidden_out = &last_hidden_;
    m_.forward(fb, kv, logits);
    if (b.hidden_out != nullptr) *b.hidden_out = last_hidden_;
  }
  Model& m_;
  std::vector<float> last_hidden_;
};

TEST_P(SpecLosslessTest, DeviceSampledGreedyEqualsHostPath) {
  const Golden g = testing::load_golden(GetParam());
  auto model = load_with_mtp(GetParam());
  const std::vector<GenRequest> reqs = greedy_requests(g);
  const RunResult ref = run(*model, reqs, EngineConfig{});
  for (int64_t k = 1; k <= kMaxSpeculativeTokens; ++k) {
    SCOPED_TRACE("K = " + std::to_string(k));
    EngineConfig spec;
    spec.num_speculative_tokens = k;
    for (const bool good : {false, true}) {
      EngineConfig c = spec;
      if (good) c.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);
      DeviceGreedy dev(*model);
      const RunResult r = run(dev, reqs, c);
      for (size_t i = 0; i < reqs.size(); ++i) {
        expect_same(r.outs[i], ref.outs[i],
                    std::string(good ? "oracle " : "") + "case " + std::to_string(i));
      }
      EXPECT_GT(dev.verify_rows, 0) << "no verify step sampled on the device";
      EXPECT_GT(dev.device_drafts, 0) << "no draft sampled on the device";
      EXPECT_EQ(dev.host_drafts, 0) << "greedy drafts took host logits";
      EXPECT_EQ(dev.host_forwards, 0) << "greedy steps took host logits";
      if (good) EXPECT_GT(r.stats.spec_num_accepted_tokens, 0);
    }
  }
}

// The draft chain in one model call (Model::mtp_draft_chain, as the GPU model runs it without
// the hidden states leaving the device): the same drafts as pass-by-pass drafting, so the same
// tokens and the same acceptance counts, no hidden state asked on the host, sequences past their
// K (the context's end) riding along without writing KV.
TEST_P(SpecLosslessTest, DraftChainOnDeviceEqualsPassByPass) {
  const Golden g = testing::load_golden(GetParam());
  auto model = load_with_mtp(GetParam());
  std::vector<GenRequest> reqs = greedy_requests(g);
  int64_t context = 0;  // uneven ends: the longest sequences draft fewer than K at the end
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].max_tokens = std::max<int32_t>(2, reqs[i].max_tokens - static_cast<int32_t>(i % 3));
    context =
        std::max(context, static_cast<int64_t>(reqs[i].prompt_ids.size()) + reqs[i].max_tokens);
  }
  const RunResult ref = run(*model, reqs, EngineConfig{});
  int64_t past = 0;
  for (int64_t k = 1; k <= kMaxSpeculativeTokens; ++k) {
    SCOPED_TRACE("K = " + std::to_string(k));
    EngineConfig c;
    c.num_speculative_tokens = k;
    c.max_model_len = context;
    c.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);
    DeviceGreedy passes(*model);
    const RunResult by_pass = run(passes, reqs, c);
    c.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);  // its draws again
    DeviceGreedy dev(*model);
    dev.chain = true;
    const RunResult chained = run(dev, reqs, c);
    // Without the oracle: the MTP's own drafts (the hook replaces them after drafting).
    EngineConfig own = c;
    own.spec_draft_hook = {};
    DeviceGreedy passes_own(*model);
    const RunResult by_pass_own = run(passes_own, reqs, own);
    DeviceGreedy dev_own(*model);
    dev_own.chain = true;
    const RunResult chained_own = run(dev_own, reqs, own);
    for (size_t i = 0; i < reqs.size(); ++i) {
      expect_same(chained.outs[i], ref.outs[i], "oracle case " + std::to_string(i));
      expect_same(chained_own.outs[i], ref.outs[i], "case " + std::to_string(i));
    }
    EXPECT_EQ(chained_own.stats.spec_num_drafts, by_pass_own.stats.spec_num_drafts);
    EXPECT_EQ(chained_own.stats.spec_num_accepted_tokens,
              by_pass_own.stats.spec_num_accepted_tokens);
    EXPECT_EQ(chained.stats.spec_num_accepted_tokens, by_pass.stats.spec_num_accepted_tokens);
    EXPECT_GT(dev_own.chains, 0) << "no draft chain ran";
    EXPECT_EQ(dev_own.host_drafts, 0) << "a pass ran on the host";
    EXPECT_EQ(dev_own.hidden_to_host, 0) << "the engine asked for the hidden states";
    EXPECT_GT(passes_own.hidden_to_host, 0);
    past += dev_own.rows_past_their_drafts;
  }
  EXPECT_GT(past, 0) << "no sequence drafted fewer than the chain's passes";
}

// The fused step (Model::forward_verify_draft: verify, acceptance and the next drafts in one
// model call, as the GPU model runs it with one host synchronisation) gives what the unfused
// step gives (verify, then the draft chain): the same tokens, logprobs and counters, with the
// MTP's own drafts, an oracle's, forced acceptance (benchmarks; the drafts emitted whatever the
// target says) and sampled requests drawn on the device; sequences near max_tokens (uneven
// ends) and one-token decodes (no drafts yet) inside fused steps.
TEST_P(SpecLosslessTest, FusedStepEqualsUnfused) {
  const Golden g = testing::load_golden(GetParam());
  auto model = load_with_mtp(GetParam());
  std::vector<GenRequest> reqs = greedy_requests(g);
  for (size_t i = 0; i < reqs.size(); ++i) {
    reqs[i].max_tokens = std::max<int32_t>(2, reqs[i].max_tokens - static_cast<int32_t>(i % 3));
    if (i % 2 == 1) {  // sampled on the device (its draws keyed by seed and position)
      reqs[i].sampling.temperature = 0.8f;
      reqs[i].sampling.seed = 100 + i;
      reqs[i].sampling.logprobs = -1;
    }
  }
  const RunResult ref = run(*model, reqs, EngineConfig{});
  std::vector<GenRequest> plain = reqs;  // forced acceptance: no logprobs (device rows)
  for (auto& r : plain) r.sampling.logprobs = -1;
  for (int64_t k = 1; k <= kMaxSpeculativeTokens; ++k) {
    for (const int mode : {0, 1, 2}) {  // own drafts, the oracle's, forced acceptance
      SCOPED_TRACE("K = " + std::to_string(k) + " mode " + std::to_string(mode));
      EngineConfig c;
      c.num_speculative_tokens = k;
      const std::vector<GenRequest>& rs = mode == 2 ? plain : reqs;
      if (mode == 1) c.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);
      if (mode == 2) c.spec_forced_accept_prob = 0.7;
      DeviceGreedy unfused(*model);
      unfused.chain = true;
      const RunResult want = run(unfused, rs, c);
      if (mode == 1) c.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);
      DeviceGreedy dev(*model);
      dev.chain = dev.fused = true;
      const RunResult got = run(dev, rs, c);
      for (size_t i = 0; i < rs.size(); ++i) {
        expect_same(got.outs[i], want.outs[i], "case " + std::to_string(i));
        if (mode != 2 && i % 2 == 0)
          expect_same(got.outs[i], ref.outs[i], "greedy " + std::to_string(i));
      }
      EXPECT_EQ(got.stats.spec_num_drafts, want.stats.spec_num_drafts);
      EXPECT_EQ(got.stats.spec_num_draft_tokens, want.stats.spec_num_draft_tokens);
      EXPECT_EQ(got.stats.spec_num_accepted_tokens, want.stats.spec_num_accepted_tokens);
      EXPECT_EQ(got.stats.spec_accepted_per_pos, want.stats.spec_accepted_per_pos);
      EXPECT_GT(dev.fused_steps, 0) << "no step ran fused";
      EXPECT_EQ(unfused.fused_steps, 0);
      EXPECT_EQ(dev.host_drafts, 0) << "a pass ran on the host";
      EXPECT_EQ(dev.hidden_to_host, 0) << "the engine asked for the hidden states";
      if (mode != 0) EXPECT_GT(got.stats.spec_num_accepted_tokens, 0);
    }
  }
}

// The fused step under everything the lossless test varies (alone, batched, chunked, prefix-cache
// hits, preempted with a tight pool where the chain's pages may not be there, oracle drafts):
// the same greedy tokens as without speculation, no page leaked (run() checks).
TEST_P(SpecLosslessTest, FusedStepLosslessForK1To4) {
  auto model = load_with_mtp(GetParam());
  DeviceGreedy dev(*model);
  dev.chain = dev.fused = true;
  expect_lossless_for_k1_to_4(dev, testing::load_golden(GetParam()), /*golden_exact=*/true);
  EXPECT_GT(dev.fused_steps, 0);
  EXPECT_EQ(dev.host_drafts, 0);
}

// Qwen3.5 hybrids: the fused step rolls a rejected draft's DeltaNet state back inside the model
// call (Model::forward_verify_draft from VerifyDraftStep::spare_slots, the reference of the GPU
// step's device-driven replay): the same tokens, logprobs and counters as the unfused step (its
// rollback in SpecDecoder::rollback_states) and as no speculation, with mostly-right drafts (every
// accepted length) and forced acceptance, batched and chunked beside prefills; the engine
// replays nothing itself after a fused step, and without the state replay nothing fuses.
TEST_P(SpecHybridLosslessTest, FusedStepRollsStatesBackLikeTheEngine) {
  auto model = load_cpu_model(GetParam());
  model->load_mtp(testing::random_mtp_dir(GetParam()));
  std::vector<GenRequest> reqs = greedy_requests(testing::load_golden(GetParam()));
  for (size_t i = 0; i < reqs.size(); ++i) {  // uneven ends
    reqs[i].max_tokens = std::max<int32_t>(2, reqs[i].max_tokens - static_cast<int32_t>(i % 3));
  }
  const RunResult ref = run(*model, reqs, EngineConfig{});
  std::vector<GenRequest> plain = reqs;  // forced acceptance: no logprobs (device rows)
  for (auto& r : plain) r.sampling.logprobs = -1;
  for (int64_t k : {1, 3, 4}) {
    for (int64_t tokens : {int64_t{1024}, int64_t{7}}) {
      for (const int mode : {0, 1}) {  // the oracle's drafts, forced acceptance
        SCOPED_TRACE("K = " + std::to_string(k) + " max_batched_tokens " + std::to_string(tokens) +
                     " mode " + std::to_string(mode));
        EngineConfig c;
        c.num_speculative_tokens = k;
        c.max_batched_tokens = tokens;
        const std::vector<GenRequest>& rs = mode == 1 ? plain : reqs;
        if (mode == 1) c.spec_forced_accept_prob = 0.6;
        auto fresh = [&] {
          EngineConfig e = c;
          if (mode == 0) e.spec_draft_hook = oracle(reqs, ref.outs, model->config().vocab_size);
          return e;
        };
        DeviceGreedy unfused(*model);
        unfused.chain = true;
        int64_t engine_replays = -1;
        const RunResult want = run(unfused, rs, fresh(), 1, &engine_replays);
        DeviceGreedy dev(*model);
        dev.chain = dev.fused = true;
        int64_t fused_replays = -1;
        const RunResult got = run(dev, rs, fresh(), 1, &fused_replays);
        for (size_t i = 0; i < rs.size(); ++i) {
          expect_same(got.outs[i], want.outs[i], "case " + std::to_string(i));
          if (mode == 0) expect_same(got.outs[i], ref.outs[i], "no spec " + std::to_string(i));
        }
        EXPECT_EQ(got.stats.spec_num_draft_tokens, want.stats.spec_num_draft_tokens);
        EXPECT_EQ(got.stats.spec_num_accepted_tokens, want.stats.spec_num_accepted_tokens);
        EXPECT_EQ(got.stats.spec_accepted_per_pos, want.stats.spec_accepted_per_pos);
        EXPECT_LT(got.stats.spec_num_accepted_tokens, got.stats.spec_num_draft_tokens);
        EXPECT_GT(dev.fused_steps, 0) << "no step ran fused";
        EXPECT_GT(engine_replays, 0);
        // The same rollbacks, counted; after a fused step each one ran inside it.
        EXPECT_EQ(fused_replays, engine_replays);
        EXPECT_GT(dev.state_replay_calls, 0) << "the fused step replayed no state";
        EXPECT_EQ(dev.host_forwards, 0) << "a rollback ran a forward";
      }
    }
  }
  // Without the state replay a hybrid's step does not fuse (its rollback needs a forward).
  EngineConfig off;
  off.num_speculative_tokens = 2;
  off.spec_state_replay = false;
  DeviceGreedy dev(*model);
  dev.chain = dev.fused = true;
  const RunResult r = run(dev, reqs, off);
  EXPECT_EQ(dev.fused_steps, 0);
  for (size_t i = 0; i < reqs.size(); ++i) expect_same(r.outs[i], ref.outs[i], "replay off");
}

// EngineConfig::warm_up also warms speculative decoding with the configured K (verify steps and
// draft passes, every batch up to max_num_seqs); without speculation or warm-up, nothing.
TEST(SpecWarmUp, VerifyStepsOfTheConfiguredK) {
  auto model = load_with_mtp(testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2");
  for (const int64_t k : {0, 1, 3}) {
    for (const bool warm : {false, true}) {
      EngineConfig c;
      c.max_num_seqs = 12;
      c.num_speculative_tokens = k;
      c.warm_up = warm;
      DeviceGreedy dev(*model);
      Engine engine(dev, c);
      if (warm && k > 0) {
        ASSERT_EQ(dev.warmed_verify.size(), 1u);
        EXPECT_EQ(dev.warmed_verify[0], std::make_pair(int64_t{12}, k));
      } else {
        EXPECT_TRUE(dev.warmed_verify.empty()) << "K " << k << " warm " << warm;
      }
    }
  }
}

TEST(SpecDemoHead, AcceptanceLengthAboveFloor) {
  const std::string dir = testing::source_dir() + "/models/demo";
  if (!fs::exists(dir + "/config.json") || !Checkpoint(dir).has("mtp.fc.weight")) {
    GTEST_SKIP() << "models/demo has no MTP head (tools/train_mtp.py)";
  }
  // NOTE: the floor is below the figure measured when the head was trained (docs/perf.md):
  // raise it with each retrained head.
  // Measured 1.352 for the committed head (models/demo/README.md has the tools/train_mtp.py
  // command; held-out first-draft agreement 0.268); the floor leaves
  // room for other machines' float rounding.
  constexpr double kFloor = 1.3;
  auto model = Qwen3MoeCpu::load(dir);
  model->load_mtp(dir);
  std::vector<GenRequest> reqs = greedy_requests(testing::load_golden(dir));
  for (auto& r : reqs) r.max_tokens = 64;
  EngineConfig cfg;
  const RunResult base = run(*model, reqs, cfg);
  cfg.num_speculative_tokens = 3;
  const RunResult r = run(*model, reqs, cfg);
  for (size_t i = 0; i < reqs.size(); ++i) expect_same(r.outs[i], base.outs[i], "demo");
  ASSERT_GT(r.stats.spec_num_drafts, 0);
  const double len =
      1.0 + double(r.stats.spec_num_accepted_tokens) / double(r.stats.spec_num_drafts);
  std::cout << "demo MTP head, K = 3: mean acceptance length " << len << "\n";
  EXPECT_GT(len, kFloor);
}

// ---- Sampling: the distribution of sampled continuations ------------------------------

// Counts of each 3-token continuation over n seeded requests.
std::map<std::vector<int32_t>, int64_t> sample_counts(Model& model, const GenRequest& proto,
                                                      EngineConfig cfg, int n,
                                                      EngineStats* stats = nullptr) {
  cfg.max_num_seqs = 128;
  cfg.max_waiting = n + 1;
  std::vector<GenRequest> reqs;
  for (int i = 0; i < n; ++i) {
    GenRequest r = proto;
    r.id = "s" + std::to_string(i);
    r.sampling.seed = static_cast<uint64_t>(1000 + i);
    reqs.push_back(r);
  }
  const RunResult res = run(model, reqs, cfg);
  std::map<std::vector<int32_t>, int64_t> counts;
  for (const Out& o : res.outs) ++counts[o.ids];
  if (stats) *stats = res.stats;
  return counts;
}

using testing::chi_square;
using testing::chi_square_bound;

class SpecSamplingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2";  // vocab 256
    model_ = load_with_mtp(dir_);
    proto_.prompt_ids = testing::load_golden(dir_).cases[0].prompt_ids;
    proto_.max_tokens = 3;
    proto_.sampling.temperature = 0.8f;
    proto_.sampling.top_k = 4;
  }
  std::string dir_;
  std::unique_ptr<Qwen3MoeCpu> model_;
  GenRequest proto_;
  static constexpr int kSamples = 3000;
};

TEST_F(SpecSamplingTest, DistributionEqualsNonSpeculative) {
  const auto base = sample_counts(*model_, proto_, EngineConfig{}, kSamples);
  for (const bool penalties : {false, true}) {
    SCOPED_TRACE(penalties ? "penalties, top-p, min-p" : "temperature, top-k");
    GenRequest p = proto_;
    if (penalties) {
      p.sampling.repetition_penalty = 1.3f;
      p.sampling.presence_penalty = 0.5f;
      p.sampling.top_p = 0.9f;
      p.sampling.min_p = 0.05f;
    }
    const auto want = penalties ? sample_counts(*model_, p, EngineConfig{}, kSamples) : base;
    EngineConfig spec;
    spec.num_speculative_tokens = 2;
    EngineStats st;
    const auto got = sample_counts(*model_, p, spec, kSamples, &st);
    const auto [x2, df] = chi_square(got, want);
    EXPECT_LT(x2, chi_square_bound(df)) << "df " << df;
    EXPECT_GT(st.spec_num_draft_tokens, 0);
    std::cout << "random MTP drafts: " << st.spec_num_accepted_tokens << " of "
              << st.spec_num_draft_tokens << " accepted, chi-square " << x2 << " (df " << df
              << ", bound " << chi_square_bound(df) << ")\n";
    // Deterministic drafts (q one-hot): the most frequent continuation, often accepted.
    const std::vector<int32_t> mode = testing::most_frequent(want);
    const size_t prompt_len = p.prompt_ids.size();
    EngineConfig hooked = spec;
    hooked.spec_draft_hook = testing::drafts_from(mode, prompt_len);
    EngineStats hs;
    const auto got2 = sample_counts(*model_, p, hooked, kSamples, &hs);
    const auto [x2b, dfb] = chi_square(got2, want);
    EXPECT_LT(x2b, chi_square_bound(dfb)) << "df " << dfb;
    EXPECT_GT(hs.spec_num_accepted_tokens, hs.spec_num_draft_tokens / 10);
    std::cout << "deterministic drafts: " << hs.spec_num_accepted_tokens << " of "
              << hs.spec_num_draft_tokens << " accepted, chi-square " << x2b << " (df " << dfb
              << ", bound " << chi_square_bound(dfb) << ")\n";
  }
}

// Sampled speculation on a Qwen3.5 hybrid (the rollback of the DeltaNet states of rejected
// drafts): 3-token continuations with K = 2 and deterministic drafts (the most frequent
// continuation, often accepted, so both rollbacks and full acceptances happen) follow the
// distribution without speculation.
TEST(SpecHybridSampling, DistributionEqualsNonSpeculative) {
  const std::string dir =
      testing::source_dir() + "/tests/data/fixtures/qwen35_text_hd64_int2_fused";
  if (!fs::exists(dir + "/golden.json")) GTEST_SKIP() << "no fixture";
  auto model = load_cpu_model(dir);
  model->load_mtp(testing::random_mtp_dir(dir));
  GenRequest proto;
  proto.prompt_ids = testing::load_golden(dir).cases[0].prompt_ids;
  proto.max_tokens = 3;
  proto.sampling.temperature = 0.8f;
  proto.sampling.top_k = 4;
  constexpr int kN = 2000;
  const auto want = sample_counts(*model, proto, EngineConfig{}, kN);
  const std::vector<int32_t> mode = testing::most_frequent(want);
  const size_t prompt_len = proto.prompt_ids.size();
  EngineConfig spec;
  spec.num_speculative_tokens = 2;
  spec.spec_draft_hook = testing::drafts_from(mode, prompt_len);
  EngineStats st;
  const auto got = sample_counts(*model, proto, spec, kN, &st);
  const auto [x2, df] = chi_square(got, want);
  EXPECT_LT(x2, chi_square_bound(df)) << "df " << df;
  EXPECT_GT(st.spec_num_accepted_tokens, st.spec_num_draft_tokens / 10);
  EXPECT_LT(st.spec_num_accepted_tokens, st.spec_num_draft_tokens);  // rollbacks happened
  std::cout << "hybrid, deterministic drafts: " << st.spec_num_accepted_tokens << " of "
            << st.spec_num_draft_tokens << " accepted, chi-square " << x2 << " (df " << df
            << ", bound " << chi_square_bound(df) << ")\n";
}

// The rule itself over overlapping p and q (random MTP drafts above rarely overlap the
// target's top-k): drafts d ~ q, then accept_draft; the tokens must follow p. Accepting every
// draft gives q instead, which the same bound rejects.
TEST(SpecAcceptRule, OutputFollowsTargetDistribution) {
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int trial = 0; trial < 4; ++trial) {
    const size_t v = 6;
    std::vector<float> p(v), q(v);
    float zp = 0, zq = 0;
    for (size_t i = 0; i < v; ++i) {
      p[i] = i == 0 && trial == 1 ? 0.0f : u(gen);  // a token the target never takes
      q[i] = i == 1 && trial == 2 ? 0.0f : u(gen);  // one the draft never proposes
      zp += p[i];
      zq += q[i];
    }
    for (size_t i = 0; i < v; ++i) {
      p[i] /= zp;
      q[i] /= zq;
    }
    SamplerRng rng(100 + static_cast<uint64_t>(trial));
    const int n = 60000;
    std::vector<int64_t> got(v, 0), wrong(v, 0);
    int64_t accepted = 0;
    for (int i = 0; i < n; ++i) {
      const int32_t d = sample_from_weights(q, rng);
      const AcceptResult r = trial == 3 ? accept_draft(p, {}, 2, rng)  // one-hot q at 2
                                        : accept_draft(p, q, d, rng);
      ++got[static_cast<size_t>(r.token)];
      accepted += r.accepted;
      ++wrong[static_cast<size_t>(d)];
    }
    double x2 = 0, x2_wrong = 0;
    for (size_t i = 0; i < v; ++i) {
      const double e = p[i] * n;
      if (e == 0) {
        EXPECT_EQ(got[i], 0) << "token " << i << " has p = 0";
        continue;
      }
      x2 += (double(got[i]) - e) * (double(got[i]) - e) / e;
      x2_wrong += (double(wrong[i]) - e) * (double(wrong[i]) - e) / e;
    }
    const int64_t df = static_cast<int64_t>(v) - 1 - (trial == 1 ? 1 : 0);
    SCOPED_TRACE("trial " + std::to_string(trial));
    EXPECT_LT(x2, chi_square_bound(df));
    EXPECT_GT(x2_wrong, chi_square_bound(df));  // always accepting: tokens follow q
    EXPECT_GT(accepted, 0);
    EXPECT_LT(accepted, n);
  }
}

// token_distribution is the distribution sample_token draws from (every transform).
TEST(SpecAcceptRule, TokenDistributionMatchesSampleToken) {
  std::mt19937_64 gen(9);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(40);
  for (float& x : logits) x = nd(gen);
  logits[7] = logits[8];  // a tie
  std::vector<int32_t> prompt = {1, 2, 3}, output = {3, 7, 7};
  for (int variant = 0; variant < 4; ++variant) {
    SamplingParams sp;
    sp.temperature = 0.9f;
    if (variant == 1) sp.top_k = 5;
    if (variant == 2) {
      sp.top_p = 0.7f;
      sp.min_p = 0.05f;
    }
    if (variant == 3) {
      sp.top_k = 12;
      sp.top_p = 0.8f;
      sp.repetition_penalty = 1.4f;
      sp.frequency_penalty = 0.3f;
      sp.logit_bias = {{5, 2.0f}};
    }
    std::vector<float> probs;
    token_distribution(logits, sp, prompt, output, probs);
    SamplerRng rng(77);
    const int n = 40000;
    std::vector<int64_t> got(logits.size(), 0);
    for (int i = 0; i < n; ++i)
      ++got[static_cast<size_t>(sample_token(logits, sp, prompt, output, rng))];
    double x2 = 0;
    int64_t support = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      if (probs[i] == 0) {
        EXPECT_EQ(got[i], 0) << "variant " << variant << " token " << i;
        continue;
      }
      ++support;
      const double e = probs[i] * n;
      x2 += (double(got[i]) - e) * (double(got[i]) - e) / e;
    }
    EXPECT_LT(x2, chi_square_bound(std::max<int64_t>(1, support - 1))) << "variant " << variant;
  }
}

// The bound has power: accepting every draft (a wrong rule; the benchmark switch at p = 1)
// gives the drafts' distribution, which the same test rejects.
TEST_F(SpecSamplingTest, WrongAcceptanceRuleFailsTheBound) {
  const auto base = sample_counts(*model_, proto_, EngineConfig{}, kSamples);
  EngineConfig wrong;
  wrong.num_speculative_tokens = 2;
  wrong.spec_forced_accept_prob = 1.0;
  const auto got = sample_counts(*model_, proto_, wrong, kSamples);
  const auto [x2, df] = chi_square(got, base);
  EXPECT_GT(x2, chi_square_bound(df)) << "df " << df;
  std::cout << "always accept: chi-square " << x2 << " (df " << df << ", bound "
            << chi_square_bound(df) << ")\n";
}

// Sampled requests on a device-sampling model (DeviceGreedy: draws keyed by (seed, counter)):
// verify rows and drafts stay on the device (no host logits), the drafts are the MTP's argmax
// (q one-hot) and row j's draw is the one non-speculative decoding makes at that output
// position, so every request gets exactly the tokens it gets without speculation, for K = 1..4,
// with random MTP drafts and with mostly-right ones (every accepted length, the bonus token).
TEST_F(SpecSamplingTest, DeviceRowsGiveTheNonSpeculativeTokens) {
  GenRequest p = proto_;
  p.max_tokens = 8;
  p.sampling.top_p = 0.95f;
  std::vector<GenRequest> reqs;
  for (int i = 0; i < 48; ++i) {
    GenRequest r = p;
    r.id = "s" + std::to_string(i);
    r.sampling.seed = static_cast<uint64_t>(500 + i);
    reqs.push_back(r);
  }
  EngineConfig cfg;
  cfg.max_num_seqs = 16;  // several waves: batches of mixed prefill and verify steps
  DeviceGreedy base_dev(*model_);
  const RunResult base = run(base_dev, reqs, cfg);
  EXPECT_GT(base_dev.sampled_rows, 0);
  for (int64_t k = 1; k <= kMaxSpeculativeTokens; ++k) {
    for (const bool good : {false, true}) {
      SCOPED_TRACE("K = " + std::to_string(k) + (good ? ", oracle drafts" : ", MTP drafts"));
      EngineConfig c = cfg;
      c.num_speculative_tokens = k;
      if (good) c.spec_draft_hook = oracle(reqs, base.outs, model_->config().vocab_size);
      DeviceGreedy dev(*model_);
      const RunResult r = run(dev, reqs, c);
      for (size_t i = 0; i < reqs.size(); ++i) {
        EXPECT_EQ(r.outs[i].ids, base.outs[i].ids) << "request " << i;
      }
      EXPECT_EQ(dev.host_forwards, 0) << "sampled verify steps took host logits";
      EXPECT_EQ(dev.host_drafts, 0) << "sampled requests' drafts took host logits";
      EXPECT_GT(dev.verify_rows, 0);
      EXPECT_GT(r.stats.spec_num_draft_tokens, 0);
      if (good) {
        EXPECT_GT(r.stats.spec_num_accepted_tokens, r.stats.spec_num_draft_tokens / 4);
      }
    }
  }
}

// The device path's distribution against the host sampler's (another random stream): the
// chi-square of SpecSamplingTest with deterministic drafts (the most frequent continuation,
// often accepted); always accepting (forced acceptance at p = 1, on the device path too) fails
// the same bound.
TEST_F(SpecSamplingTest, DeviceRowsDistributionEqualsNonSpeculative) {
  const auto want = sample_counts(*model_, proto_, EngineConfig{}, kSamples);
  const std::vector<int32_t> mode = testing::most_frequent(want);
  const size_t prompt_len = proto_.prompt_ids.size();
  EngineConfig spec;
  spec.num_speculative_tokens = 2;
  spec.spec_draft_hook = testing::drafts_from(mode, prompt_len);
  DeviceGreedy dev(*model_);
  EngineStats st;
  const auto got = sample_counts(dev, proto_, spec, kSamples, &st);
  const auto [x2, df] = chi_square(got, want);
  EXPECT_LT(x2, chi_square_bound(df)) << "df " << df;
  EXPECT_GT(st.spec_num_accepted_tokens, st.spec_num_draft_tokens / 10);
  EXPECT_EQ(dev.host_forwards, 0);
  std::cout << "device rows, deterministic drafts: " << st.spec_num_accepted_tokens << " of "
            << st.spec_num_draft_tokens << " accepted, chi-square " << x2 << " (df " << df
            << ", bound " << chi_square_bound(df) << ")\n";
  EngineConfig wrong;
  wrong.num_speculative_tokens = 2;
  wrong.spec_forced_accept_prob = 1.0;
  DeviceGreedy dev2(*model_);
  const auto bad = sample_counts(dev2, proto_, wrong, kSamples);
  const auto [x2w, dfw] = chi_square(bad, want);
  EXPECT_GT(x2w, chi_square_bound(dfw)) << "df " << dfw;
  EXPECT_EQ(dev2.host_forwards, 0);
}

// A prefilled request with its prompt's hidden states (Engine::add_prefilled, as a decode
// instance admits one): the first step that schedules it runs the MTP layer over the prompt
// instead of decoding it (on an otherwise idle engine an MTP-only step), the next one verifies
// drafts; the drafts, tokens and counters are those of the engine that computed the prompt
// itself, beside a request that it computes itself, on the host path and on the device-like
// ones (drafts sampled on the device, the draft chain in one call, the fused verify + draft
// step: the held prompt's pass goes through the host hidden states). Bad shapes are refused.
TEST(SpecPrefilled, PromptHiddenStatesGiveTheSameDraftsAsComputingThePrompt) {
  const std::string dir = testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2";
  auto model = load_with_mtp(dir);
  const int64_t h = model->config().hidden_size;
  GenRequest r;
  r.id = "p";
  for (int j = 0; j < 21; ++j) r.prompt_ids.push_back((5 + 3 * j) % 89);
  r.max_tokens = 12;
  r.sampling.temperature = 0;
  GenRequest q = r;  // computed by the engine itself (a busy engine: the hold leaves a batch)
  q.id = "q";
  q.prompt_ids.resize(9);
  q.max_tokens = 15;
  const auto n = static_cast<int64_t>(r.prompt_ids.size());
  using Calls = std::map<std::string, std::vector<std::vector<int32_t>>>;
  auto config = [](Calls& calls) {  // the MTP's drafts, as the hook sees them
    EngineConfig c;
    c.num_pages = 64;
    c.num_speculative_tokens = 3;
    c.spec_draft_hook = [&calls](const std::string& id, std::span<const int32_t> tokens,
                                 std::vector<int32_t>& drafts) {
      std::vector<int32_t> call = {static_cast<int32_t>(tokens.size())};
      call.insert(call.end(), drafts.begin(), drafts.end());
      calls[id].push_back(std::move(call));
    };
    return c;
  };
  auto collect = [](std::map<std::string, std::vector<int32_t>>& out) {
    return [&out](const StepOutput& o) {
      out[o.id].insert(out[o.id].end(), o.token_ids.begin(), o.token_ids.end());
    };
  };
  for (const bool busy : {false, true}) {
    Calls want_calls;
    std::map<std::string, std::vector<int32_t>> want;
    Engine one(*model, config(want_calls));
    one.add(r, collect(want));
    if (busy) one.add(q, collect(want));
    while (one.step()) {
    }
    ASSERT_EQ(static_cast<int64_t>(want["p"].size()), r.max_tokens);
    for (int variant = 0; variant < 4; ++variant) {
      SCOPED_TRACE(std::string(busy ? "busy, " : "idle, ") + "variant " + std::to_string(variant));
      DeviceGreedy dev(*model);
      dev.chain = variant >= 2;
      dev.fused = variant == 3;
      Model& m = variant == 0 ? static_cast<Model&>(*model) : dev;
      Calls calls;
      Engine two(m, config(calls));
      std::map<std::string, std::vector<int32_t>> got;
      if (busy) {
        two.add(q, collect(got));
        ASSERT_TRUE(two.step());  // q's prefill
      }
      // The prefill: the prompt's KV and final hidden states, computed into the decode
      // engine's own reserved pages (as a transfer would write them).
      std::vector<int32_t> pages;
      ASSERT_TRUE(two.reserve_pages(n, pages));
      std::vector<float> logits, hidden;
      ForwardBatch b;
      b.seqs.push_back({r.prompt_ids.data(), n, 0, pages.data(), static_cast<int64_t>(pages.size()),
                        LogitsMode::kLast});
      b.hidden_out = &hidden;
      model->forward(b, two.kv_cache(), logits);
      ASSERT_EQ(static_cast<int64_t>(hidden.size()), n * h);
      const auto first =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      ASSERT_EQ(first, want["p"][0]);
      EXPECT_THROW(two.add_prefilled(r, nullptr, pages, first, 0.f, {},
                                     std::vector<float>(hidden.begin(), hidden.end() - 1)),
                   Error);  // not whole rows
      EXPECT_THROW(two.add_prefilled(r, nullptr, pages, first, 0.f, {}, hidden, 1),
                   Error);  // rows past the prompt
      two.add_prefilled(r, collect(got), pages, first, 0.f, {}, hidden, 0);
      const int64_t before = two.stats().spec_num_drafts;
      ASSERT_TRUE(two.step());  // p: the MTP layer over its prompt only
      EXPECT_EQ(got["p"].size(), 1u);
      ASSERT_EQ(calls["p"].size(), 1u);
      const int64_t after = two.stats().spec_num_drafts;
      ASSERT_TRUE(two.step());  // p verifies its drafts
      EXPECT_EQ(two.stats().spec_num_drafts - after, busy ? 2 : 1);
      if (!busy) EXPECT_EQ(before, 0);
      while (two.step()) {
      }
      EXPECT_EQ(got, want);
      EXPECT_EQ(calls, want_calls);
      const EngineStats a = one.stats(), c = two.stats();
      EXPECT_EQ(c.spec_num_drafts, a.spec_num_drafts);
      EXPECT_EQ(c.spec_num_draft_tokens, a.spec_num_draft_tokens);
      EXPECT_EQ(c.spec_num_accepted_tokens, a.spec_num_accepted_tokens);
      EXPECT_EQ(two.blocks().num_available(), two.blocks().num_pages());
      if (variant == 3) EXPECT_GT(dev.fused_steps, 0);
      if (variant == 2) EXPECT_GT(dev.chains, 0);
    }
  }
}

// ---- Configuration ---------------------------------------------------------------------

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(part), std::string::npos) << e.message();
  }
}

TEST(SpecConfig, ParsesVllmSpelling) {
  SpeculativeConfig c =
      parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": 3})");
  EXPECT_EQ(c.method, "mtp");
  EXPECT_EQ(c.num_speculative_tokens, 3);
  EXPECT_EQ(c.model, "");
  c = parse_speculative_config(R"({"method":"mtp","num_speculative_tokens":1,"model":"/x"})");
  EXPECT_EQ(c.model, "/x");
}

TEST(SpecConfig, BadConfigsAreRefused) {
  expect_error([] { parse_speculative_config("mtp"); }, "not a JSON object");
  expect_error(
      [] { parse_speculative_config(R"({"method": "eagle", "num_speculative_tokens": 1})"); },
      "method \"eagle\" is not supported");
  expect_error([] { parse_speculative_config(R"({"num_speculative_tokens": 1})"); }, "method \"\"");
  expect_error(
      [] { parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": 0})"); },
      "num_speculative_tokens must be in [1, 4]");
  expect_error(
      [] { parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": 5})"); },
      "num_speculative_tokens must be in [1, 4]");
  expect_error(
      [] { parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": "2"})"); },
      "must be an integer");
  expect_error(
      [] { parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": 2, "k": 1})"); },
      "unknown field \"k\"");
}

TEST(SpecConfig, ModelWithoutMtpWeights) {
  const std::string dir = testing::source_dir() + "/tests/data/fixtures/hub_gqa_top2";
  auto model = Qwen3MoeCpu::load(dir);
  expect_error([&] { model->load_mtp(dir); }, "no MTP weights");
  EngineConfig cfg;
  cfg.num_speculative_tokens = 2;
  expect_error([&] { Engine e(*model, cfg); }, "needs the model's MTP layer");
}

// Hybrid checkpoints without a (complete) MTP layer: a clear error naming the missing mtp.*
// tensor (the text fixture has none, the VL fixture three of them).
TEST(SpecConfig, HybridWithoutMtpWeights) {
  for (const std::string& dir : testing::hybrid_golden_dirs()) {
    auto model = load_cpu_model(dir);
    expect_error([&] { model->load_mtp(dir); }, "mtp.");
    EXPECT_FALSE(model->has_mtp());
  }
}

}  // namespace
}  // namespace tandem
