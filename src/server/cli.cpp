#include "server/cli.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "engine/engine.h"
#include "model/qwen3_moe.h"
#include "server/http/http_server.h"
#include "server/planner.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

#ifndef TANDEM_DEMO_MODEL_DIR
#define TANDEM_DEMO_MODEL_DIR "models/demo"
#endif

namespace tandem {

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      size_t used = 0;
      long v = std::stol(item, &used);
      TANDEM_CHECK_KIND(kInvalidArgument, used == item.size(), "bad token id '", item, "'");
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::logic_error&) {
      TANDEM_THROW(kInvalidArgument, "--prompt-ids: bad token id '", item, "'");
    }
  }
  return ids;
}

struct GenerateArgs {
  std::string model = TANDEM_DEMO_MODEL_DIR;
  std::string prompt;
  std::string prompt_ids;
  int max_tokens = 64;
  float temperature = 1.0f;
  float top_p = 1.0f;
  int top_k = 0;
  float min_p = 0.0f;
  int64_t seed = -1;
  int logprobs = -1;
  bool json = false;
  bool ignore_eos = false;
};

int run_generate(const GenerateArgs& a) {
  std::unique_ptr<Model> model = Qwen3MoeCpu::load(a.model);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_dir(a.model);
  GenRequest req;
  req.id = "cli";
  if (!a.prompt_ids.empty()) {
    req.prompt_ids = parse_ids(a.prompt_ids);
  } else {
    TANDEM_CHECK_KIND(kInvalidArgument, tok != nullptr, "model ", a.model,
                      " has no tokenizer.json: use --prompt-ids");
    req.prompt_ids = tok->encode(a.prompt, /*parse_special=*/true);
  }
  req.max_tokens = a.max_tokens;
  req.ignore_eos = a.ignore_eos;
  req.sampling.temperature = a.temperature;
  req.sampling.top_p = a.top_p;
  req.sampling.top_k = a.top_k;
  req.sampling.min_p = a.min_p;
  if (a.seed >= 0) req.sampling.seed = static_cast<uint64_t>(a.seed);
  req.sampling.logprobs = a.logprobs;

  EngineConfig cfg;
  cfg.max_num_seqs = 1;
  Engine engine(*model, cfg);
  std::vector<int32_t> ids;
  nlohmann::json logprobs = nlohmann::json::array();
  std::string error;
  std::unique_ptr<IncrementalDetokenizer> detok;
  if (tok && !a.json) detok = std::make_unique<IncrementalDetokenizer>(*tok, /*skip_special=*/true);
  engine.add(req, [&](const StepOutput& out) {
    for (size_t i = 0; i < out.token_ids.size(); ++i) {
      ids.push_back(out.token_ids[i]);
      if (detok) std::cout << detok->add(out.token_ids[i]) << std::flush;
      if (i < out.top_logprobs.size()) {
        nlohmann::json pos = nlohmann::json::array();
        for (const auto& t : out.top_logprobs[i]) pos.push_back({t.id, t.logprob});
        logprobs.push_back(pos);
      }
    }
    if (out.finish_reason == FinishReason::kError) error = out.error;
  });
  auto t0 = std::chrono::steady_clock::now();
  while (engine.step()) {
  }
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  TANDEM_CHECK_KIND(kInternal, error.empty(), error);
  if (a.json) {
    nlohmann::json j;
    j["ids"] = ids;
    j["text"] = tok ? tok->decode(ids, /*skip_special=*/true) : "";
    j["logprobs"] = logprobs;
    std::cout << j.dump() << "\n";
  } else {
    if (detok) std::cout << detok->flush();
    if (!tok) {
      for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? "," : "") << ids[i];
    }
    std::cout << "\n";
    std::cerr << "[" << ids.size() << " tokens in " << secs << " s, "
              << (secs > 0 ? static_cast<double>(ids.size()) / secs : 0.0) << " tok/s]\n";
  }
  return 0;
}

struct ServeArgs {
  std::string model = TANDEM_DEMO_MODEL_DIR;
  std::string served_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  int http_threads = 2;
  EngineConfig engine;
};

int run_serve(const ServeArgs& a) {
  std::unique_ptr<Qwen3MoeCpu> model = Qwen3MoeCpu::load(a.model);
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_dir(a.model);
  std::unique_ptr<ChatTemplate> chat = tok ? ChatTemplate::from_dir(a.model) : nullptr;
  AsyncEngine engine(std::move(model), a.engine);
  HttpServerConfig cfg;
  cfg.host = a.host;
  cfg.port = static_cast<uint16_t>(a.port);
  cfg.api_key = a.api_key;
  cfg.num_threads = a.http_threads;
  cfg.stop_on_signals = true;
  cfg.model_name = a.served_name;
  if (cfg.model_name.empty()) {
    std::string dir = a.model;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    cfg.model_name = a.model == TANDEM_DEMO_MODEL_DIR ? "demo" : dir.substr(dir.rfind('/') + 1);
  }
  HttpServer server(cfg, engine, tok.get(), chat.get());
  server.start();
  std::cerr << "tandem: serving '" << cfg.model_name << "' (" << a.model << ") on http://"
            << cfg.host << ":" << server.port() << "  max_model_len "
            << engine.max_model_len() << (tok ? "" : "  (no tokenizer: token-id prompts only)")
            << std::endl;
  server.wait();
  return 0;
}

}  // namespace

int cli_main(int argc, char** argv) {
  CLI::App app{"Tandem: a disaggregated MoE inference server"};
  app.require_subcommand(1);

  GenerateArgs gen;
  auto* g = app.add_subcommand("generate", "Generate from one prompt on the CPU backend");
  g->add_option("--model", gen.model, "Model directory (default: the embedded demo model)");
  auto* prompt = g->add_option("--prompt", gen.prompt, "Prompt text");
  auto* prompt_ids = g->add_option("--prompt-ids", gen.prompt_ids, "Prompt token ids: 1,2,3");
  prompt->excludes(prompt_ids);
  g->add_option("--max-tokens", gen.max_tokens, "Tokens to generate")->check(CLI::PositiveNumber);
  g->add_option("--temperature", gen.temperature, "0 = greedy")->check(CLI::NonNegativeNumber);
  g->add_option("--top-p", gen.top_p)->check(CLI::Range(0.0f, 1.0f));
  g->add_option("--top-k", gen.top_k);
  g->add_option("--min-p", gen.min_p)->check(CLI::Range(0.0f, 1.0f));
  g->add_option("--seed", gen.seed);
  g->add_option("--logprobs", gen.logprobs, "Top-K logprobs per generated token")
      ->check(CLI::Range(0, 20));
  g->add_flag("--json", gen.json, "Print {ids, text, logprobs} as JSON");
  g->add_flag("--ignore-eos", gen.ignore_eos, "Do not stop at EOS");

  ServeArgs srv;
  auto* sv = app.add_subcommand("serve", "Serve the OpenAI API (one colocated instance)");
  sv->add_option("--model", srv.model, "Model directory (default: the embedded demo model)");
  sv->add_option("--served-model-name", srv.served_name, "Model name in the API");
  sv->add_option("--host", srv.host, "Address to listen on");
  sv->add_option("--port", srv.port, "Port (0: any free port)")->check(CLI::Range(0, 65535));
  sv->add_option("--api-key", srv.api_key, "Require 'Authorization: Bearer KEY'");
  sv->add_option("--http-threads", srv.http_threads)->check(CLI::Range(1, 256));
  sv->add_option("--max-num-seqs", srv.engine.max_num_seqs, "Running sequences at most")
      ->check(CLI::PositiveNumber);
  sv->add_option("--max-model-len", srv.engine.max_model_len, "Context length (default: model's)")
      ->check(CLI::PositiveNumber);
  sv->add_option("--max-num-batched-tokens", srv.engine.max_batched_tokens,
                 "Tokens per step (chunked prefill budget)")
      ->check(CLI::PositiveNumber);
  sv->add_option("--max-waiting", srv.engine.max_waiting, "Queue limit (then 429)")
      ->check(CLI::PositiveNumber);
  sv->add_option("--kv-cache-mb", srv.engine.kv_cache_mb, "KV cache size")
      ->check(CLI::PositiveNumber);
  sv->add_option("--page-size", srv.engine.page_size, "Tokens per KV page")
      ->check(CLI::PositiveNumber);
  bool no_prefix_cache = false;
  sv->add_flag("--no-prefix-cache", no_prefix_cache, "Disable prefix caching");

  PlannerInputs plan_in;
  auto* pl = app.add_subcommand("plan", "Replica counts for prefill and decode instances");
  pl->add_option("--input-tps", plan_in.input_tokens_per_s, "Prompt tokens/s arriving")
      ->required();
  pl->add_option("--prefill-capacity-tps", plan_in.prefill_capacity_tps,
                 "Prompt tokens/s one prefill instance sustains (measured)")
      ->required();
  pl->add_option("--queued-input-tokens", plan_in.queued_input_tokens);
  pl->add_option("--drain-seconds", plan_in.drain_seconds);
  pl->add_option("--concurrent-seqs", plan_in.concurrent_sequences, "Sequences decoding")
      ->required();
  pl->add_option("--dp", plan_in.decode_dp, "Ranks per decode instance");
  pl->add_option("--max-decode-batch", plan_in.max_decode_batch, "Per-rank batch threshold");
  pl->add_option("--utilisation", plan_in.target_utilisation, "Planned fraction of capacity");

  try {
    app.parse(argc, argv);
    if (pl->parsed()) {
      PlannerOutput out = plan_replicas(plan_in);
      nlohmann::json j = {{"prefill_instances", out.prefill_instances},
                          {"decode_instances", out.decode_instances}};
      std::cout << out.explanation << j.dump() << "\n";
      return 0;
    }
    if (sv->parsed()) {
      srv.engine.enable_prefix_cache = !no_prefix_cache;
      return run_serve(srv);
    }
    if (g->parsed()) {
      if (gen.prompt.empty() && gen.prompt_ids.empty()) {
        TANDEM_THROW(kInvalidArgument, "generate: give --prompt or --prompt-ids");
      }
      return run_generate(gen);
    }
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const Error& e) {
    std::cerr << "error: " << e.message() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace tandem
