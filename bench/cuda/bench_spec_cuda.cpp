// MTP speculative decoding on one GPU at real shapes with random weights (generated on the
// device, as bench_model_cuda: the MTP layer too, Qwen3MoeCuda::random_mtp):
//   1. verify-step cost: one target step over K + 1 tokens for each of B sequences (logits of
//      all, the captured verify graph) vs the one-token decode step it replaces (its graph),
//      at 1k context, B = 1 / 8 / 32 / 128, K = 1..4; beside them one MTP draft pass over B
//      tokens (eager);
//   2. end-to-end decode tok/s through the engine (greedy, device sampling) without
//      speculation and with K drafts accepted each with probability p (the benchmark switch
//      EngineConfig::spec_forced_accept_prob: NOT lossless, the cost of a real acceptance
//      rate), same run. Mean acceptance length = 1 + p + ... + p^K (2.53 at K = 3, p = 0.7).
// Models: Qwen3-30B-A3B (48 layers, or --layers N), one Qwen3-235B-A22B layer (vocab 1024);
// or (--checkpoint DIR: a host-timed verify-cost table, then end to end) a checkpoint on disk
// with its mtp.* tensors, e.g. a real-shape Qwen3.5 written by `make_random_checkpoint --preset
// qwen3.5-35b-a3b --mtp`. A hybrid's speculative rows run five ways: the defaults (the fused
// step: verify, acceptance, the rejected drafts' DeltaNet states rolled back by the replay of
// the verify's inputs and the draft chain on the device with one synchronisation; verify steps
// in CUDA graphs), "unfused" (the same parts with the acceptance and the rollback through the
// host: Qwen35MoeCuda::set_fused_step off), "passes" (drafts pass by pass through the host:
// set_device_chain off), "eager-verify" (set_verify_graphs off) and "forward" (the rollback by a
// second forward: EngineConfig::spec_state_replay off).
// --profile-calls adds each row's model calls in its timed wave (count x host milliseconds).
//
//   bench_spec_cuda [--model 30b|235b-layer|all] [--layers N] [--verify-only] [--e2e-only]
//                   [--checkpoint DIR] [--profile-calls]
//                   [--batches 1,8,32,128] [--tokens N] [--e2e-batches 1,32]
//                   [--ks 1,2,3 --ps 0.6,0.7,0.8] [--temperature T]
// --ks / --ps: the end-to-end grid (every K with every p; default K = 3 at p = 0.6 / 0.7 / 0.8
// and K = 1 at 0.7); --temperature: sampled requests (seeded, on the device) instead of greedy.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "../decode_wave.h"
#include "backend/cuda/check.h"
#include "bench_util.h"
#include "core/error.h"
#include "engine/engine.h"
#include "model/cuda/mtp_cuda.h"
#include "model/cuda/qwen3_5_moe_cuda.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "model/cuda/random_fill.h"

using namespace tandem;

namespace {

ModelConfig qwen3_30b() {
  ModelConfig c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = 48;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.head_dim = 128;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.norm_topk_prob = true;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 40960;
  c.eos_token_ids = {151645};
  return c;
}

ModelConfig qwen3_235b_layer() {
  ModelConfig c = qwen3_30b();
  c.vocab_size = 1024;
  c.eos_token_ids = {1023};
  c.hidden_size = 4096;
  c.intermediate_size = 12288;
  c.moe_intermediate_size = 1536;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 4;
  return c;
}

std::vector<int64_t> parse_list(const char* s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::atoll(item.c_str()));
  return v;
}

void bench_verify(const std::string& name, Qwen3MoeCuda& model,
                  const std::vector<int64_t>& batches) {
  const ModelConfig& c = model.config();
  const int64_t ctx = 1024, ps = 16, per_seq = (ctx + 16 + ps - 1) / ps;
  const int64_t bmax = *std::max_element(batches.begin(), batches.end());
  const int64_t pages = bmax * per_seq + 8;
  cudaStream_t st = model.stream();
  KvCache kv = model.make_kv_cache(pages, ps);
  KvCache mkv = model.make_mtp_kv_cache(pages, ps);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    cuda::random_fill_bf16(kv.layer_data(l), kv.geometry().page_elems() * pages, 100 + l, 0.f, 1.f,
                           st);
  }
  cuda::random_fill_bf16(mkv.layer_data(0), mkv.geometry().page_elems() * pages, 99, 0.f, 1.f, st);
  bench::Timer timer;
  timer.stream = st;
  timer.create_events();
  std::printf("\n== %s: verify step (K + 1 tokens per sequence) vs decode step, %lld context\n",
              name.c_str(), static_cast<long long>(ctx));
  std::printf("%-14s %6s %3s %11s %11s %9s %13s %13s\n", "model", "batch", "K", "step_us",
              "decode_us", "ratio", "mtp_pass_us", "graph");
  std::vector<int32_t> tables(static_cast<size_t>(bmax * per_seq));
  std::iota(tables.begin(), tables.end(), 0);
  std::vector<int32_t> tokens(static_cast<size_t>(bmax * 5));
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>((i * 7919) % c.vocab_size);
  std::vector<float> hidden(static_cast<size_t>(bmax * c.hidden_size), 0.5f);
  for (int64_t b : batches) {
    double decode_us = 0;
    // One MTP pass over b tokens (a chained draft pass): eager.
    ForwardBatch mb;
    for (int64_t i = 0; i < b; ++i) {
      mb.seqs.push_back(
          {tokens.data() + i, 1, ctx - 1, tables.data() + i * per_seq, per_seq, LogitsMode::kLast});
    }
    for (int w = 0; w < 3; ++w) model.mtp_forward_device(mb, hidden.data(), mkv);
    const double mtp_us =
        1e3 * bench::upper_median(bench::event_samples_ms(st, timer.ev0, timer.ev1, 0, 20, [&] {
          model.mtp_forward_device(mb, hidden.data(), mkv);
        }));
    // The pass's stages (CUDA events between them; the events add a little).
    if (MtpCuda* mtp = model.mtp()) {
      mtp->profile_stages(true);
      std::vector<std::string> names;
      std::vector<std::vector<float>> samples;
      for (int rep = 0; rep < 10; ++rep) {
        model.mtp_forward_device(mb, hidden.data(), mkv);
        const auto st_ms = mtp->stage_ms();
        if (samples.empty()) samples.resize(st_ms.size());
        for (size_t i = 0; i < st_ms.size(); ++i) {
          if (rep == 0) names.push_back(st_ms[i].first);
          samples[i].push_back(st_ms[i].second);
        }
      }
      mtp->profile_stages(false);
      std::string line;
      for (size_t i = 0; i < samples.size(); ++i) {
        std::sort(samples[i].begin(), samples[i].end());
        char buf[96];
        std::snprintf(buf, sizeof(buf), "%s%s %.1f", i ? ", " : "", names[i].c_str(),
                      1e3 * samples[i][samples[i].size() / 2]);
        line += buf;
      }
      std::printf("%-14s %6lld   MTP pass stages (median us): %s\n", name.c_str(),
                  static_cast<long long>(b), line.c_str());
    }
    for (int64_t k = 0; k <= 4; ++k) {
      const int64_t q = k + 1;
      ForwardBatch fb;
      for (int64_t i = 0; i < b; ++i) {
        fb.seqs.push_back({tokens.data() + i * 5, q, ctx - 1, tables.data() + i * per_seq, per_seq,
                           q == 1 ? LogitsMode::kLast : LogitsMode::kAll});
      }
      for (int w = 0; w < 3; ++w) model.forward_device(fb, kv);  // capture + warm
      const double us =
          1e3 * bench::upper_median(bench::event_samples_ms(st, timer.ev0, timer.ev1, 0, 20,
                                                            [&] { model.forward_device(fb, kv); }));
      if (k == 0) decode_us = us;
      bool graph = false;
      for (const auto& [gb, gq] : model.captured_verify_graphs()) graph |= gq == q;
      if (q == 1) graph = !model.captured_buckets().empty();
      std::printf("%-14s %6lld %3lld %11.1f %11.1f %8.2fx %13.1f %13s\n", name.c_str(),
                  static_cast<long long>(b), static_cast<long long>(k), us, decode_us,
                  us / decode_us, mtp_us, graph ? "yes" : "eager");
      std::fflush(stdout);
    }
  }
}

// A checkpoint's verify-step cost through the Model interface (host-timed forward_sample, greedy
// rows, its synchronisation included): B sequences at 256 tokens of context, a decode step
// (one token each), verify steps of K + 1 = 2 / 4 tokens (logits of all), and one MTP pass over
// B tokens (mtp_forward_sample); each the median of 10.
void bench_verify_model(const std::string& name, Model& model,
                        const std::vector<int64_t>& batches) {
  const ModelConfig& c = model.config();
  const int64_t ctx = 256, ps = 16, per_seq = (ctx + 16) / ps + 1;
  const int64_t bmax = *std::max_element(batches.begin(), batches.end());
  KvCache kv = model.make_kv_cache(bmax * per_seq + 8, ps);
  KvCache mkv = model.make_mtp_kv_cache(bmax * per_seq + 8, ps);
  if (model.state_slot_elems() > 0) kv.allocate_states(bmax, model.state_slot_elems());
  std::vector<int32_t> tables(static_cast<size_t>(bmax * per_seq));
  std::iota(tables.begin(), tables.end(), 0);
  std::vector<int32_t> tokens(static_cast<size_t>(bmax * (ctx + 8)));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 7919) % c.vocab_size);
  }
  std::printf(
      "\n== %s: verify step (K + 1 tokens per sequence) vs decode step, %lld context, "
      "host-timed forward_sample\n",
      name.c_str(), static_cast<long long>(ctx));
  std::printf("%-14s %6s %3s %11s %11s %9s %13s\n", "model", "batch", "K", "step_us", "decode_us",
              "ratio", "mtp_pass_us");
  std::vector<SampledToken> out;
  std::vector<float> hid(static_cast<size_t>(bmax * c.hidden_size), 0.5f), hout;
  DeviceSampling greedy;
  greedy.temperature = 0.0f;
  auto time_us = [](const std::function<void()>& f) {
    std::vector<double> us;
    for (int r = 0; r < 13; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      us.push_back(1e6 *
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    us.erase(us.begin(), us.begin() + 3);  // warm-up (graph capture, plans)
    return bench::median(us);
  };
  for (int64_t b : batches) {
    // The prompts (their states and KV), max_tokens (2048) at a time.
    for (int64_t i0 = 0; i0 < b; i0 += 2048 / ctx) {
      ForwardBatch pre;
      for (int64_t i = i0; i < std::min(b, i0 + 2048 / ctx); ++i) {
        pre.seqs.push_back({tokens.data() + i * (ctx + 8), ctx, 0, tables.data() + i * per_seq,
                            per_seq, LogitsMode::kLast, static_cast<int32_t>(i)});
      }
      model.forward_sample(pre, kv, std::vector<DeviceSampling>(pre.seqs.size(), greedy), out);
    }
    ForwardBatch mb;
    for (int64_t i = 0; i < b; ++i) {
      mb.seqs.push_back({tokens.data() + i * (ctx + 8) + ctx, 1, ctx, tables.data() + i * per_seq,
                         per_seq, LogitsMode::kLast, -1});
    }
    const std::vector<DeviceSampling> mrows(static_cast<size_t>(b), greedy);
    const double mtp_us =
        time_us([&] { model.mtp_forward_sample(mb, hid.data(), mkv, mrows, out, hout); });
    double decode_us = 0;
    for (int64_t k : {0, 1, 3}) {
      const int64_t q = k + 1;
      ForwardBatch fb;
      for (int64_t i = 0; i < b; ++i) {
        fb.seqs.push_back({tokens.data() + i * (ctx + 8) + ctx, q, ctx, tables.data() + i * per_seq,
                           per_seq, q == 1 ? LogitsMode::kLast : LogitsMode::kAll,
                           static_cast<int32_t>(i)});
      }
      fb.keep_recurrent_inputs = q > 1 && model.state_slot_elems() > 0;
      const std::vector<DeviceSampling> rows(static_cast<size_t>(b * q), greedy);
      const double us = time_us([&] { model.forward_sample(fb, kv, rows, out); });
      if (k == 0) decode_us = us;
      std::printf("%-14s %6lld %3lld %11.1f %11.1f %8.2fx %13.1f\n", name.c_str(),
                  static_cast<long long>(b), static_cast<long long>(k), us, decode_us,
                  us / decode_us, mtp_us);
      std::fflush(stdout);
    }
  }
}

// A Model that forwards every call to `inner` and adds up the host wall time of the calls that
// run work (--profile-calls: where a speculative step's time goes, per mode).
class CallTimer final : public Model {
 public:
  explicit CallTimer(Model& inner) : m_(inner) {}
  const ModelConfig& config() const override { return m_.config(); }
  KvGeometry kv_geometry(int64_t p, int64_t s) const override { return m_.kv_geometry(p, s); }
  KvCache make_kv_cache(int64_t p, int64_t s) override { return m_.make_kv_cache(p, s); }
  int64_t kv_cache_mb_hint() const override { return m_.kv_cache_mb_hint(); }
  int64_t state_slot_elems() const override { return m_.state_slot_elems(); }
  bool replay_states(const std::vector<StateReplay>& r, KvCache& kv) override {
    return timed("replay_states", [&] { return m_.replay_states(r, kv); });
  }
  void forward(const ForwardBatch& b, KvCache& kv, std::vector<float>& l) override {
    timed("forward", [&] { m_.forward(b, kv, l); });
  }
  void load_mtp(const std::string& dir) override { m_.load_mtp(dir); }
  bool has_mtp() const override { return m_.has_mtp(); }
  bool mtp_collective() const override { return m_.mtp_collective(); }
  KvGeometry mtp_kv_geometry(int64_t p, int64_t s) const override {
    return m_.mtp_kv_geometry(p, s);
  }
  void mtp_forward(const ForwardBatch& b, const float* h, KvCache& kv, std::vector<float>& l,
                   std::vector<float>& ho) override {
    timed("mtp_forward", [&] { m_.mtp_forward(b, h, kv, l, ho); });
  }
  void warm_up(KvCache& kv, int64_t mb) override { m_.warm_up(kv, mb); }
  void warm_up_speculative(KvCache& kv, KvCache& mkv, int64_t mb, int64_t k) override {
    m_.warm_up_speculative(kv, mkv, mb, k);
  }
  KvCache make_mtp_kv_cache(int64_t p, int64_t s) override { return m_.make_mtp_kv_cache(p, s); }
  void mtp_forward_sample(const ForwardBatch& b, const float* h, KvCache& kv,
                          const std::vector<DeviceSampling>& rows, std::vector<SampledToken>& out,
                          std::vector<float>& ho) override {
    timed("mtp_forward_sample", [&] { m_.mtp_forward_sample(b, h, kv, rows, out, ho); });
  }
  bool mtp_drafts_on_device() const override { return m_.mtp_drafts_on_device(); }
  void mtp_draft_chain(const ForwardBatch& f, std::span<const int64_t> hr,
                       const std::vector<MtpChainPass>& c, KvCache& kv,
                       std::vector<std::vector<int32_t>>& d) override {
    timed("mtp_draft_chain", [&] { m_.mtp_draft_chain(f, hr, c, kv, d); });
  }
  bool fuses_verify_and_draft() const override { return m_.fuses_verify_and_draft(); }
  void forward_verify_draft(const ForwardBatch& b, KvCache& kv,
                            const std::vector<DeviceSampling>& rows, KvCache& mkv,
                            VerifyDraftStep& st, std::vector<SampledToken>& out) override {
    timed("forward_verify_draft", [&] { m_.forward_verify_draft(b, kv, rows, mkv, st, out); });
  }
  bool samples_on_device() const override { return m_.samples_on_device(); }
  void forward_sample(const ForwardBatch& b, KvCache& kv, const std::vector<DeviceSampling>& rows,
                      std::vector<SampledToken>& out,
                      const std::function<void()>& wait_masks) override {
    timed("forward_sample", [&] { m_.forward_sample(b, kv, rows, out, wait_masks); });
  }
  // (a Qwen3.5 model's fused-step stages too: Qwen35MoeCuda::profile_fused_stages)
  void reset() {
    totals_.clear();
    if (auto* q = dynamic_cast<Qwen35MoeCuda*>(&m_)) (void)q->take_fused_stage_times();
  }
  // "name calls x ms, ..." of the calls since reset(), then the fused step's stages (device /
  // host ms per step).
  std::string report() const {
    std::string r;
    for (const auto& [name, t] : totals_) {
      char buf[128];
      std::snprintf(buf, sizeof(buf), "%s%s %lld x %.1f ms", r.empty() ? "" : ", ", name.c_str(),
                    static_cast<long long>(t.first), t.second);
      r += buf;
    }
    if (auto* q = dynamic_cast<Qwen35MoeCuda*>(&m_)) {
      const auto stages = q->take_fused_stage_times();
      if (!stages.empty()) r += "\n    fused step stages (device / host ms per step):";
      for (const auto& t : stages) {
        char buf[160];
        const double n = static_cast<double>(t.calls);
        std::snprintf(buf, sizeof(buf), " %s %.3f / %.3f;", t.name.c_str(), t.device_ms / n,
                      t.host_ms / n);
        r += buf;
      }
    }
    return r;
  }

 private:
  template <class F>
  std::invoke_result_t<F> timed(const std::string& name, F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    struct Add {
      std::pair<int64_t, double>& t;
      std::chrono::steady_clock::time_point t0;
      ~Add() {
        ++t.first;
        t.second +=
            1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    } add{totals_[name], t0};
    return f();
  }
  Model& m_;
  std::map<std::string, std::pair<int64_t, double>> totals_;
};

struct E2e {
  double tok_s = 0, accept_len = 0;
  int64_t tokens = 0;
};

// One engine (warmed up: the graphs of every bucket up to batch), two waves of `batch`
// requests: the first warms the GEMM plans and captures what warm-up does not, the second is
// timed from the step after every request has its first token.
E2e run_engine(Model& model, int64_t batch, int64_t k, double p, int64_t prompt_len,
               int64_t max_tokens, float temperature, bool state_replay = true) {
  EngineConfig cfg = bench::decode_wave_config(batch, prompt_len, max_tokens);
  cfg.num_speculative_tokens = k;
  cfg.spec_forced_accept_prob = k > 0 ? p : -1.0;
  cfg.spec_state_replay = state_replay;
  cfg.warm_up = true;  // every bucket's graphs before the first wave (as tandem serve does)
  Engine engine(model, cfg);
  std::mt19937 rng(5);
  E2e e;
  for (int wave = 0; wave < 2; ++wave) {
    std::vector<int64_t> produced(static_cast<size_t>(batch), 0);
    for (int64_t i = 0; i < batch; ++i) {
      GenRequest r;
      r.id = "w" + std::to_string(wave) + "-" + std::to_string(i);
      for (int64_t t = 0; t < prompt_len; ++t) {
        r.prompt_ids.push_back(static_cast<int32_t>(rng() % (model.config().vocab_size - 1)));
      }
      r.max_tokens = static_cast<int32_t>(max_tokens);
      r.ignore_eos = true;
      r.sampling.temperature = temperature;
      r.sampling.seed = static_cast<uint64_t>(i);
      engine.add(r, [&produced, i](const StepOutput& o) {
        produced[static_cast<size_t>(i)] += static_cast<int64_t>(o.token_ids.size());
      });
    }
    auto all_started = [&] {
      return std::all_of(produced.begin(), produced.end(), [](int64_t n) { return n > 0; });
    };
    while (!all_started() && engine.step()) {
    }
    const int64_t before = std::accumulate(produced.begin(), produced.end(), int64_t{0});
    const EngineStats s0 = engine.stats();
    if (auto* ct = dynamic_cast<CallTimer*>(&model)) ct->reset();
    const auto t0 = std::chrono::steady_clock::now();
    while (engine.step()) {
    }
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const EngineStats s1 = engine.stats();
    e.tokens = std::accumulate(produced.begin(), produced.end(), int64_t{0}) - before;
    e.tok_s = static_cast<double>(e.tokens) / sec;
    const int64_t drafts = s1.spec_num_drafts - s0.spec_num_drafts;
    e.accept_len = drafts > 0
                       ? 1.0 + double(s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens) /
                                   double(drafts)
                       : 1.0;
  }
  return e;
}

void bench_e2e(const std::string& name, Model& inner, const std::vector<int64_t>& batches,
               int64_t max_tokens, const std::vector<std::pair<int64_t, double>>& runs,
               float temperature, bool profile_calls = false) {
  CallTimer timer(inner);  // --profile-calls: each row's model calls in the timed wave
  Model& model = profile_calls ? static_cast<Model&>(timer) : inner;
  if (auto* q = dynamic_cast<Qwen35MoeCuda*>(&inner)) q->profile_fused_stages(profile_calls);
  auto calls = [&] {
    if (profile_calls) std::printf("    calls: %s\n", timer.report().c_str());
  };
  // A hybrid's rollback modes (see the top of the file).
  struct Mode {
    const char* name;
    bool replay, verify_graphs, chain, fused;
  };
  auto* q35 = dynamic_cast<Qwen35MoeCuda*>(&inner);
  std::vector<Mode> modes = {{"-", true, true, true, true}};
  if (q35 != nullptr) {
    modes = {{"default", true, true, true, true},
             {"unfused", true, true, true, false},
             {"passes", true, true, false, true},
             {"eager-verify", true, false, true, true},
             {"forward", false, true, true, true}};
  }
  std::printf(
      "\n== %s: end-to-end decode through the engine (%s, 256-token prompts, %lld "
      "new tokens each), speculation with forced acceptance p\n",
      name.c_str(), temperature > 0 ? "sampled on the device" : "greedy",
      static_cast<long long>(max_tokens));
  std::printf("%-14s %6s %3s %5s %14s %12s %10s %9s\n", "model", "batch", "K", "p", "rollback",
              "tok/s", "accept_len", "speedup");
  for (int64_t b : batches) {
    if (q35 != nullptr) q35->set_verify_graphs(true);
    const E2e base = run_engine(model, b, 0, 0, 256, max_tokens, temperature);
    std::printf("%-14s %6lld %3d %5s %14s %12.1f %10.2f %8.2fx\n", name.c_str(),
                static_cast<long long>(b), 0, "-", "-", base.tok_s, 1.0, 1.0);
    calls();
    for (const auto& [k, p] : runs) {
      // An untimed run first: the first speculative engine after a change of K pays one-time
      // costs (the MTP passes' GEMM plans and attention plans of new shapes) that would
      // otherwise land on whichever mode came first.
      run_engine(model, b, k, p, 256, max_tokens, temperature);
      for (const Mode& m : modes) {
        if (q35 != nullptr) {
          q35->set_verify_graphs(m.verify_graphs);
          q35->set_device_chain(m.chain);
          q35->set_fused_step(m.fused);
        }
        const E2e e = run_engine(model, b, k, p, 256, max_tokens, temperature, m.replay);
        std::printf("%-14s %6lld %3lld %5.1f %14s %12.1f %10.2f %8.2fx\n", name.c_str(),
                    static_cast<long long>(b), static_cast<long long>(k), p, m.name, e.tok_s,
                    e.accept_len, e.tok_s / base.tok_s);
        calls();
        std::fflush(stdout);
      }
    }
  }
  if (q35 != nullptr) {
    q35->set_verify_graphs(true);
    q35->set_device_chain(true);
    q35->set_fused_step(true);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string which = "all";
  int64_t layers = 0, max_tokens = 128;
  bool verify = true, e2e = true;
  std::vector<int64_t> batches{1, 8, 32, 128}, e2e_batches{1, 32}, ks;
  std::vector<double> ps;
  float temperature = 0.0f;
  std::string checkpoint;
  bool profile_calls = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--profile-calls") == 0) profile_calls = true;
    if (std::strcmp(argv[i], "--checkpoint") == 0 && i + 1 < argc) checkpoint = argv[++i];
    if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc) which = argv[++i];
    if (std::strcmp(argv[i], "--layers") == 0 && i + 1 < argc) layers = std::atoll(argv[++i]);
    if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) max_tokens = std::atoll(argv[++i]);
    if (std::strcmp(argv[i], "--batches") == 0 && i + 1 < argc) batches = parse_list(argv[++i]);
    if (std::strcmp(argv[i], "--e2e-batches") == 0 && i + 1 < argc) {
      e2e_batches = parse_list(argv[++i]);
    }
    if (std::strcmp(argv[i], "--ks") == 0 && i + 1 < argc) ks = parse_list(argv[++i]);
    if (std::strcmp(argv[i], "--ps") == 0 && i + 1 < argc) {
      std::stringstream ss(argv[++i]);
      for (std::string item; std::getline(ss, item, ',');) ps.push_back(std::atof(item.c_str()));
    }
    if (std::strcmp(argv[i], "--temperature") == 0 && i + 1 < argc) {
      temperature = static_cast<float>(std::atof(argv[++i]));
    }
    if (std::strcmp(argv[i], "--verify-only") == 0) e2e = false;
    if (std::strcmp(argv[i], "--e2e-only") == 0) verify = false;
  }
  // K = 3 at p = 0.6 / 0.7 / 0.8 (acceptance length 2.18 / 2.53 / 2.95), K = 1 at 0.7; or the
  // --ks x --ps grid.
  std::vector<std::pair<int64_t, double>> runs = {{3, 0.6}, {3, 0.7}, {3, 0.8}, {1, 0.7}};
  if (!ks.empty() || !ps.empty()) {
    if (ks.empty()) ks = {3};
    if (ps.empty()) ps = {0.7};
    runs.clear();
    for (int64_t k : ks) {
      for (double p : ps) runs.emplace_back(k, p);
    }
  }
  try {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      std::printf("no CUDA device: nothing to measure\n");
      return 0;
    }
    struct M {
      std::string name;
      ModelConfig c;
    };
    if (!checkpoint.empty()) {  // end to end only
      CudaModelOptions o;
      o.max_tokens = 2048;
      o.max_seqs =
          std::max<int64_t>(128, *std::max_element(e2e_batches.begin(), e2e_batches.end()));
      o.page_size = 16;
      o.graph_max_context = 2048;
      std::unique_ptr<Model> model = load_cuda_model(checkpoint, o);
      model->load_mtp(checkpoint);
      std::string name = checkpoint.substr(checkpoint.find_last_of('/') + 1);
      name = name.empty() ? checkpoint : name;
      std::printf("== %s: %s, %lld layers\n", name.c_str(), model->config().model_type.c_str(),
                  static_cast<long long>(model->config().num_hidden_layers));
      if (verify) bench_verify_model(name, *model, {1, 8, 32});
      if (e2e) bench_e2e(name, *model, e2e_batches, max_tokens, runs, temperature, profile_calls);
      return 0;
    }
    std::vector<M> models;
    if (which == "30b" || which == "all") {
      ModelConfig c = qwen3_30b();
      if (layers > 0) c.num_hidden_layers = layers;
      models.push_back({"30b-" + std::to_string(c.num_hidden_layers) + "L", c});
    }
    if (which == "235b-layer" || which == "all")
      models.push_back({"235b-layer", qwen3_235b_layer()});
    for (const M& m : models) {
      CudaModelOptions o;
      o.max_tokens = 2048;
      o.max_seqs = std::max<int64_t>(128, *std::max_element(batches.begin(), batches.end()));
      o.page_size = 16;
      o.graph_max_context = 2048;
      auto model = Qwen3MoeCuda::random(m.c, o, 7);
      model->random_mtp(8);
      std::printf("== %s: %.1f GB of weights (MTP layer included)\n", m.name.c_str(),
                  model->weight_bytes() / 1e9);
      if (verify) bench_verify(m.name, *model, batches);
      if (e2e && m.c.num_hidden_layers > 1)
        bench_e2e(m.name, *model, e2e_batches, max_tokens, runs, temperature);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_spec_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
