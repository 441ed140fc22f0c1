// The engine's own host time per decode step, without a model: a model that "runs on a device"
// (samples_on_device, the fused speculative step, drafts on the device) and returns at once, so
// that a step's wall time is the engine's scheduling, output processing and bookkeeping. B
// sequences decode N tokens each, without speculation and with K = 1..4 drafts (forced acceptance
// p, as the GPU benchmarks run them); each row prints host ms per engine step beside the
// non-speculative row of the same run. A GPU step's time adds to these (it does not overlap
// them: the engine waits for the step, then does this work).
//   build/bench_engine_host [--batch B] [--tokens N] [--prompt-len P] [--accept-prob p]
//       [--vocab V] [--state-floats S]
// --state-floats: recurrent state slots of S floats (on the host) per sequence, as a hybrid's.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "decode_wave.h"
#include "engine/engine.h"
#include "model/model.h"

using namespace tandem;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Every sampled token is 1, every draft 1: greedy acceptance would take every draft, forced
// acceptance (the benchmark switch) decides instead.
class NullDeviceModel final : public Model {
 public:
  NullDeviceModel(int64_t vocab, int64_t state_floats) : state_floats_(state_floats) {
    c_.model_type = "qwen3_moe";
    c_.vocab_size = vocab;
    c_.hidden_size = 8;
    c_.num_hidden_layers = 1;
    c_.num_attention_heads = 1;
    c_.num_key_value_heads = 1;
    c_.head_dim = 8;
    c_.max_position_embeddings = 1 << 20;
    c_.eos_token_ids = {0};
  }
  const ModelConfig& config() const override { return c_; }
  int64_t state_slot_elems() const override { return state_floats_; }
  KvGeometry kv_geometry(int64_t num_pages, int64_t page_size) const override {
    return {1, num_pages, 1, page_size, 8};
  }
  void forward(const ForwardBatch&, KvCache&, std::vector<float>&) override {
    TANDEM_THROW(kInternal, "bench_engine_host: host logits asked");
  }
  bool has_mtp() const override { return true; }
  KvGeometry mtp_kv_geometry(int64_t num_pages, int64_t page_size) const override {
    return kv_geometry(num_pages, page_size);
  }
  void load_mtp(const std::string&) override {}
  void mtp_forward(const ForwardBatch& batch, const float*, KvCache&, std::vector<float>&,
                   std::vector<float>&) override {
    if (batch.num_tokens() > 0) TANDEM_THROW(kInternal, "bench_engine_host: host drafts asked");
  }
  bool samples_on_device() const override { return true; }
  void forward_sample(const ForwardBatch& batch, KvCache&, const std::vector<DeviceSampling>& rows,
                      std::vector<SampledToken>& out, const std::function<void()>& wait) override {
    if (wait) wait();
    out.assign(rows.size(), SampledToken{1, -0.5f, {}});
    (void)batch;
  }
  bool mtp_drafts_on_device() const override { return true; }
  void mtp_draft_chain(const ForwardBatch& first, std::span<const int64_t>,
                       const std::vector<MtpChainPass>& chain, KvCache&,
                       std::vector<std::vector<int32_t>>& drafts) override {
    drafts.assign(chain.size() + 1,
                  std::vector<int32_t>(static_cast<size_t>(first.num_logit_rows()), 1));
  }
  bool fuses_verify_and_draft() const override { return true; }
  void forward_verify_draft(const ForwardBatch& batch, KvCache& kv,
                            const std::vector<DeviceSampling>& rows, KvCache&,
                            VerifyDraftStep& step, std::vector<SampledToken>& out) override {
    forward_sample(batch, kv, rows, out, {});
    step.accepted.clear();
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      const int32_t k = static_cast<int32_t>(batch.seqs[i].num_tokens) - 1;
      step.accepted.push_back(step.forced[i] >= 0 ? std::min(step.forced[i], k) : k);
    }
    step.drafts.assign(batch.seqs.size(),
                       std::vector<int32_t>(static_cast<size_t>(step.num_drafts), 1));
  }

 private:
  ModelConfig c_;
  int64_t state_floats_ = 0;
};

struct Row {
  double ms_per_step = 0, tokens_per_step = 0;
};

Row run(Model& model, const EngineConfig& cfg, int batch, int tokens, int prompt_len) {
  Engine engine(model, cfg);
  int64_t got = 0;
  for (int b = 0; b < batch; ++b) {
    GenRequest r;
    r.id = "b" + std::to_string(b);
    for (int i = 0; i < prompt_len; ++i) r.prompt_ids.push_back(2 + (i * 7 + b * 13) % 1000);
    r.max_tokens = tokens;
    r.ignore_eos = true;
    engine.add(r, [&](const StepOutput& o) { got += static_cast<int64_t>(o.token_ids.size()); });
  }
  while (got < batch) engine.step();  // the prompts and their first tokens
  const int64_t first = got;
  int64_t steps = 0;
  const double t0 = now();
  while (engine.step()) ++steps;
  const double secs = now() - t0;
  Row row;
  row.ms_per_step = steps > 0 ? 1e3 * secs / static_cast<double>(steps) : 0;
  row.tokens_per_step =
      steps > 0 ? static_cast<double>(got - first) / static_cast<double>(steps) : 0;
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  int batch = 32, tokens = 256, prompt_len = 256;
  double accept = 0.7;
  int64_t vocab = 151936, state_floats = 0;
  CLI::App app{"the engine's host time per decode step, without a model"};
  app.add_option("--batch", batch);
  app.add_option("--tokens", tokens);
  app.add_option("--prompt-len", prompt_len);
  app.add_option("--accept-prob", accept);
  app.add_option("--vocab", vocab);
  app.add_option("--state-floats", state_floats);
  CLI11_PARSE(app, argc, argv);
  NullDeviceModel model(vocab, state_floats);
  const EngineConfig cfg = bench::decode_wave_config(batch, prompt_len, tokens);
  run(model, cfg, batch, 16, prompt_len);  // warm up
  const Row base = run(model, cfg, batch, tokens, prompt_len);
  std::printf(
      "engine host time per step, no model: batch %d, %d new tokens, prompts %d, vocab %lld, "
      "state floats %lld\n",
      batch, tokens, prompt_len, static_cast<long long>(vocab),
      static_cast<long long>(state_floats));
  std::printf("%-4s %5s %14s %16s %14s\n", "K", "p", "ms per step", "tokens per step", "vs K = 0");
  std::printf("%-4s %5s %14.3f %16.2f %13.2fx\n", "0", "-", base.ms_per_step, base.tokens_per_step,
              1.0);
  for (int64_t k = 1; k <= 4; ++k) {
    EngineConfig s = cfg;
    s.num_speculative_tokens = k;
    s.spec_forced_accept_prob = accept;
    const Row r = run(model, s, batch, tokens, prompt_len);
    std::printf("%-4lld %5.2f %14.3f %16.2f %13.2fx\n", static_cast<long long>(k), accept,
                r.ms_per_step, r.tokens_per_step, r.ms_per_step / base.ms_per_step);
  }
  return 0;
}
