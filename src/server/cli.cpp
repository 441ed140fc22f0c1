#include "server/cli.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "comm/gloo_comm.h"
#include "comm/group_watchdog.h"
#include "comm/local_launcher.h"
#include "comm/tcp_store.h"
#include "core/env.h"
#include "core/error.h"
#include "disagg/decode_instance.h"
#include "disagg/prefill_instance.h"
#include "engine/engine.h"
#include "engine/speculative.h"
#include "model/convert.h"
#include "model/load_progress.h"
#include "model/qwen3_5_moe.h"
#include "model/qwen3_moe.h"
#include "net/cluster_auth.h"
#ifdef TANDEM_WITH_CUDA
#include "core/cuda_check.h"
#include "model/cuda/qwen3_5_moe_cuda.h"
#include "model/cuda/qwen3_moe_cuda.h"
#include "transfer/cuda/cuda_ipc_transfer.h"
#endif
#include "disagg/instance_api.h"
#include "events/kv_events_config.h"
#include "events/zmq_publisher.h"
#include "server/bench/bench_cli.h"
#include "server/grammar/grammar.h"
#include "server/http/http_server.h"
#include "server/http/instance_metrics.h"
#include "server/parsers/chat_parser.h"
#include "server/planner.h"
#include "server/replica_router.h"
#include "server/router.h"
#include "server/startup.h"
#include "server/tokenizer/chat_template.h"
#include "server/tokenizer/tokenizer.h"

#ifndef TANDEM_DEMO_MODEL_DIR
#define TANDEM_DEMO_MODEL_DIR "models/demo"
#endif

namespace tandem {

namespace {

// The embedded demo model: next to an installed binary (PREFIX/bin/tandem ->
// PREFIX/share/tandem/demo, wherever PREFIX was moved), else the source tree it was built from.
const std::string& demo_model_dir() {
  static const std::string dir = [] {
    std::error_code ec;
    const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) {
      const auto p = (exe.parent_path() / ".." / "share" / "tandem" / "demo").lexically_normal();
      if (std::filesystem::exists(p / "config.json", ec)) return p.string();
    }
    return std::string(TANDEM_DEMO_MODEL_DIR);
  }();
  return dir;
}

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

// --kv-cache-dtype (generate / serve / prefill / decode): CudaModelOptions::kv_cache_fp8.
void add_kv_cache_dtype_option(CLI::App* cmd, std::string& dtype) {
  cmd->add_option("--kv-cache-dtype", dtype,
                  "KV cache element type, as vLLM: auto (bf16 on the GPU) or fp8 (E4M3, with "
                  "each attention layer's self_attn.k_scale / v_scale from the checkpoint, else "
                  "1.0; twice the pages for the same memory; --device cuda, Qwen3-MoE or "
                  "Qwen3.5, no MTP, no --deterministic)")
      ->check(CLI::IsMember({"auto", "fp8"}));
}

// Whether --kv-cache-dtype asks for an FP8 KV cache; throws kUnsupported for a device that has
// none (the CPU model keeps fp32 KV) and kInvalidArgument for an unknown dtype.
bool kv_cache_fp8(const std::string& dtype, const std::string& device) {
  TANDEM_CHECK_KIND(kInvalidArgument, dtype == "auto" || dtype == "fp8",
                    "--kv-cache-dtype must be auto or fp8, not '", dtype, "'");
  const bool fp8 = dtype == "fp8";
  TANDEM_CHECK_KIND(kUnsupported, !fp8 || device == "cuda",
                    "--kv-cache-dtype fp8 needs --device cuda (the CPU model keeps an fp32 KV "
                    "cache), not --device ",
                    device);
  return fp8;
}

// The model for --device cpu|cuda; the engine config sizes the GPU model's buffers. On the
// GPU, a KV cache size not given (kv_cache_mb <= 0) becomes what gpu_memory_utilization
// leaves after the model (vLLM's default behaviour); on the CPU it is the engine's default.
// --kv-events-config: a ZMQ publisher of the engine's prefix-cache events (null when the
// JSON is empty or leaves events off). The medium is where the KV pages live.
std::shared_ptr<KvEventSink> make_kv_event_publisher(const std::string& json,
                                                     const std::string& device) {
  if (json.empty()) return nullptr;
  const KvEventsConfig c = parse_kv_events_config(json);
  if (!c.active()) return nullptr;
  auto p = std::make_shared<ZmqKvEventPublisher>(c, 0, device == "cuda" ? "GPU" : "CPU");
  std::cerr << "tandem: KV events on " << p->endpoint()
            << (p->replay_endpoint().empty() ? "" : ", replay on " + p->replay_endpoint())
            << std::endl;
  return p;
}

std::unique_ptr<Model> load_model(const std::string& dir, const std::string& device,
                                  EngineConfig& engine, double gpu_memory_utilization = 0.9,
                                  const std::string& kv_cache_dtype = "auto") {
  [[maybe_unused]] const bool fp8_kv = kv_cache_fp8(kv_cache_dtype, device);
  if (device == "cpu") {
    if (engine.kv_cache_mb <= 0) engine.kv_cache_mb = EngineConfig{}.kv_cache_mb;
    return load_cpu_model(dir);  // by config.json's model_type
  }
  TANDEM_CHECK_KIND(kInvalidArgument, device == "cuda", "--device must be cpu or cuda, not '",
                    device, "'");
#ifdef TANDEM_WITH_CUDA
  CudaModelOptions o;
  o.max_tokens = engine.max_batched_tokens;
  o.max_seqs = engine.max_num_seqs;
  o.page_size = engine.page_size;
  o.graph_max_context = engine.max_model_len;
  o.deterministic = engine.deterministic;
  o.kv_cache_fp8 = fp8_kv;
  if (ModelConfig::from_dir(dir).is_hybrid()) {  // Qwen3.5: one GPU
    TANDEM_CHECK_KIND(kUnsupported, !engine.deterministic, dir,
                      "/config.json: --deterministic is not supported for Qwen3.5 hybrid models "
                      "on the GPU (Qwen3-MoE only; --device cpu is batch-invariant)");
    auto model = Qwen35MoeCuda::load(dir, o);
    if (engine.kv_cache_mb <= 0) {
      engine.kv_cache_mb = model->kv_cache_budget_mb(gpu_memory_utilization);
      std::cerr << "tandem: KV cache " << engine.kv_cache_mb << " MiB (--gpu-memory-utilization "
                << gpu_memory_utilization << ")" << std::endl;
    }
    return model;
  }
  auto model = Qwen3MoeCuda::load(dir, o);
  if (engine.kv_cache_mb <= 0) {
    engine.kv_cache_mb = model->kv_cache_budget_mb(gpu_memory_utilization);
    std::cerr << "tandem: KV cache " << engine.kv_cache_mb << " MiB (--gpu-memory-utilization "
              << gpu_memory_utilization << ")" << std::endl;
  }
  return model;
#else
  TANDEM_THROW(kUnsupported, "--device cuda: this tandem was built without CUDA");
#endif
}

// --deterministic (tandem generate / serve / prefill / decode).
void add_deterministic_flag(CLI::App* cmd, bool& on) {
  cmd->add_flag("--deterministic", on,
                "Batch-invariant numerics: a request's tokens and logprobs do not depend on the "
                "other requests of its batch, on prompt chunking or on prefix-cache hits "
                "(--device cuda: Qwen3-MoE on one GPU, no MTP, one rank; slower prefill; "
                "docs/api.md)");
}

// tandem plan --model: whether one rank of a role fits a GPU (server/planner.h).
void add_memory_fit_options(CLI::App* cmd, MemoryFitArgs& a) {
  cmd->add_option("--model", a.model, "Memory-fit mode: checkpoint directory (config.json only)");
  cmd->add_option("--role", a.role, "serve (1 rank), prefill (TP = EP = ranks), decode (DP = EP)")
      ->check(CLI::IsMember({"serve", "prefill", "decode"}));
  cmd->add_option("--ranks", a.ranks, "Ranks of the instance")->check(CLI::PositiveNumber);
  cmd->add_option("--gpu-memory-gb", a.gpu_memory_gb, "One GPU's memory in GB (H200: 141)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--gpu-memory-utilization", a.gpu_memory_utilization,
                  "Share of the GPU for weights, activations and KV")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_option("--max-model-len", a.max_model_len, "Default: max_position_embeddings")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--page-size", a.page_size)->check(CLI::PositiveNumber);
  cmd->add_option("--max-num-seqs", a.max_num_seqs, "Running sequences per rank")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-num-batched-tokens", a.max_num_batched_tokens,
                  "Tokens per step (default: 1024, decode 4096)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--kv-cache-dtype", a.kv_cache_dtype, "auto (bf16) or fp8")
      ->check(CLI::IsMember({"auto", "fp8"}));
  cmd->add_flag("--mxfp8-native", a.mxfp8_native,
                "MXFP8 kept as FP8 codes (TANDEM_CUDA_MXFP8=native), not dequantized to bf16");
}

// --speculative-config (tandem generate / serve / decode): the MTP layer from the model's own
// checkpoint or "model", K drafts per step. Empty: no speculation.
void add_speculative_option(CLI::App* cmd, std::string& json) {
  cmd->add_option("--speculative-config", json,
                  "Speculative decoding, as vLLM: '{\"method\": \"mtp\", "
                  "\"num_speculative_tokens\": K}' (K 1..4; optionally \"model\": DIR, the MTP "
                  "weights' directory; default: the model's own mtp.* tensors)");
}

// --cluster-key-file (tandem prefill / decode / router), or TANDEM_CLUSTER_KEY_FILE (a mounted
// Kubernetes Secret): the key of every internal connection (net/cluster_auth.h).
void add_cluster_key_option(CLI::App* cmd, std::string& path) {
  cmd->add_option("--cluster-key-file", path,
                  "File holding the deployment's shared secret (16+ bytes, e.g. `openssl rand "
                  "-hex 32`): every internal connection (router <-> instance control, KV "
                  "transfer, the rank group's store) then starts with a mutual HMAC handshake "
                  "(docs/operations.md, Security)")
      ->envname("TANDEM_CLUSTER_KEY_FILE");
}

// The key of --cluster-key-file (null: none given).
net::KeyRef cluster_key(const std::string& path) {
  return path.empty() ? nullptr : net::ClusterKey::from_file(path);
}

// Loads the MTP layer into `model` and sets the engine's K.
void apply_speculative(const std::string& json, const std::string& model_dir,
                       const std::string& device, Model& model, EngineConfig& engine) {
  if (json.empty()) return;
  const SpeculativeConfig sc = parse_speculative_config(json);
  // The GPU: Qwen3MoeCuda's MTP layer (model/cuda/mtp_cuda.h) and Qwen35MoeCuda's (the
  // published Qwen3.5 layout, as the CPU Qwen35MoeCpu's).
  TANDEM_CHECK_KIND(kUnsupported, device == "cpu" || device == "cuda",
                    "--speculative-config: not supported with --device ", device,
                    " yet (use --device cpu or cuda)");
  model.load_mtp(sc.model.empty() ? model_dir : sc.model);
  engine.num_speculative_tokens = sc.num_speculative_tokens;
}

struct GenerateArgs {
  std::string model = demo_model_dir();
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
  std::string device = "cpu";
  std::string speculative_config;
  bool deterministic = false;
  std::string kv_cache_dtype = "auto";  // --kv-cache-dtype
};

int run_generate(const GenerateArgs& a) {
  EngineConfig cfg;
  cfg.max_num_seqs = 1;
  cfg.deterministic = a.deterministic;
  if (!a.speculative_config.empty()) parse_speculative_config(a.speculative_config);  // early
  std::unique_ptr<Model> model = load_model(a.model, a.device, cfg, 0.9, a.kv_cache_dtype);
  apply_speculative(a.speculative_config, a.model, a.device, *model, cfg);
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
    if (cfg.num_speculative_tokens > 0) {
      const EngineStats st = engine.stats();
      j["spec"] = {{"steps", st.spec_num_drafts},
                   {"draft_tokens", st.spec_num_draft_tokens},
                   {"accepted_tokens", st.spec_num_accepted_tokens}};
    }
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

/// --tool-call-parser (default: by the model's family) and --reasoning-parser.
struct ParserArgs {
  std::string tool_call_parser;  // "": from config.json's model_type
  std::string reasoning_parser = "qwen3";

  void add_to(CLI::App* cmd) {
    cmd->add_option("--tool-call-parser", tool_call_parser,
                    "Tool calls in chat replies: hermes (Qwen3), qwen3_coder (XML; Qwen3.5, "
                    "Qwen3-Coder) or none (default: by the model's model_type)")
        ->check(CLI::IsMember({"hermes", "qwen3_coder", "none"}));
    cmd->add_option("--reasoning-parser", reasoning_parser,
                    "<think> blocks into reasoning_content: qwen3 or none")
        ->check(CLI::IsMember({"qwen3", "none"}));
  }

  void apply(HttpServerConfig& cfg, const std::string& model_dir) const {
    cfg.reasoning_parser = reasoning_parser;
    cfg.tool_call_parser = tool_call_parser;
    if (!cfg.tool_call_parser.empty()) return;
    std::string model_type;
    std::ifstream in(model_dir + "/config.json");
    if (in) {
      nlohmann::json c = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (c.is_object() && c.contains("model_type") && c["model_type"].is_string()) {
        model_type = c["model_type"].get<std::string>();
      }
    }
    cfg.tool_call_parser =
        parsers::tool_format_for_model_type(model_type) == parsers::ToolFormat::kQwen3Coder
            ? "qwen3_coder"
            : "hermes";
  }
};

// The HTTP front's flags (tandem serve and tandem router).
struct HttpArgs {
  std::vector<std::string> allowed_origins;
  int idle_timeout_s = HttpServerConfig{}.idle_timeout_s;
  int header_timeout_s = HttpServerConfig{}.header_timeout_s;
  int drain_seconds = HttpServerConfig{}.drain_seconds;
  bool disable_access_log = false;
  std::string ssl_certfile, ssl_keyfile;
};

void add_http_options(CLI::App* cmd, HttpArgs& h) {
  cmd->add_option("--allowed-origins", h.allowed_origins,
                  "CORS: origins allowed to call from a browser, comma-separated ('*': any; "
                  "default: none)")
      ->delimiter(',');
  cmd->add_option("--http-idle-timeout", h.idle_timeout_s,
                  "Seconds a keep-alive connection may wait for its next request")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--http-header-timeout", h.header_timeout_s,
                  "Seconds a started request has to send its headers and body")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--drain-seconds", h.drain_seconds,
                  "On SIGTERM: seconds in-flight requests may take before they end with an error")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--disable-access-log", h.disable_access_log,
                "No access-log line per request on stderr");
  auto* cert = cmd->add_option("--ssl-certfile", h.ssl_certfile,
                               "Serve HTTPS: the PEM certificate chain (with --ssl-keyfile)");
  auto* key = cmd->add_option("--ssl-keyfile", h.ssl_keyfile,
                              "Serve HTTPS: the PEM private key (with --ssl-certfile)");
  cert->needs(key);
  key->needs(cert);
}

void apply_http_args(const HttpArgs& h, HttpServerConfig& cfg) {
  cfg.allowed_origins = h.allowed_origins;
  cfg.idle_timeout_s = h.idle_timeout_s;
  cfg.header_timeout_s = h.header_timeout_s;
  cfg.drain_seconds = h.drain_seconds;
  cfg.ssl_certfile = h.ssl_certfile;
  cfg.ssl_keyfile = h.ssl_keyfile;
  if (!h.disable_access_log) {
    cfg.access_log = [](const std::string& line) { std::cerr << line + "\n" << std::flush; };
  }
}

struct ServeArgs {
  std::string model = demo_model_dir();
  std::string served_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  int http_threads = 2;
  HttpArgs http;
  EngineConfig engine;
  std::string device = "cpu";
  double gpu_memory_utilization = 0.9;
  std::string kv_cache_dtype = "auto";  // --kv-cache-dtype
  ParserArgs parsers;
  std::string speculative_config;
  std::string kv_events_config;
  int control_port = -1;         // >= 0: a replica for `tandem router --replica`
  std::string cluster_key_file;  // the control port's key ("": none)
};

// Blocks SIGINT / SIGTERM in this thread and the threads it starts (defined below).
sigset_t block_stop_signals();
void wait_for_stop_signal(const sigset_t& set);

// tandem serve: the HTTP front listens from the start (GET /health: 503 with the start-up
// phase until the engine is ready, server/startup.h) while the tokenizer, the weights (with
// progress lines), the KV cache and the CUDA graphs come up, each phase printed with its time.
int run_serve(const ServeArgs& a) {
  EngineConfig ecfg = a.engine;
  ecfg.kv_events = make_kv_event_publisher(a.kv_events_config, a.device);
  // A router's requests carry their constraint as a spec: compiled here, where they sample.
  if (a.control_port >= 0) ecfg.constraint_factory = grammar::instance_constraint_factory(a.model);
  if (!a.speculative_config.empty()) parse_speculative_config(a.speculative_config);  // early
  (void)kv_cache_fp8(a.kv_cache_dtype, a.device);  // early too: refused before the port opens
  StartupMonitor mon(std::cerr);
  raise_open_file_limit();  // one descriptor per client connection
  mon.phase("tokenizer");
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_dir(a.model);
  std::unique_ptr<ChatTemplate> chat = tok ? ChatTemplate::from_dir(a.model) : nullptr;
  DeferredEngineClient client;
  HttpServerConfig cfg;
  cfg.host = a.host;
  cfg.port = static_cast<uint16_t>(a.port);
  cfg.api_key = a.api_key;
  cfg.num_threads = a.http_threads;
  // SIGINT / SIGTERM: during start-up the process exits at once; once serving, the server
  // drains (--drain-seconds), as HttpServerConfig::stop_on_signals does.
  cfg.stop_on_signals = false;
  apply_http_args(a.http, cfg);
  cfg.model_name = a.served_name;
  if (cfg.model_name.empty()) {
    std::string dir = a.model;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    cfg.model_name = a.model == demo_model_dir() ? "demo" : dir.substr(dir.rfind('/') + 1);
  }
  a.parsers.apply(cfg, a.model);
  cfg.startup_status = [&mon] { return mon.status_json(); };
  const sigset_t signals = block_stop_signals();
  HttpServer server(cfg, client, tok.get(), chat.get());
  server.start();
  std::thread([&server, &mon, signals, drain = cfg.drain_seconds] {
    int sig = 0;
    sigwait(&signals, &sig);
    if (!mon.is_ready()) {
      std::cerr << "tandem: stopped during start-up (signal " << sig << ")" << std::endl;
      std::_Exit(128 + sig);
    }
    server.drain(std::chrono::seconds(drain));
  }).detach();
  // (neither "http://" nor "on HOST:PORT" here: scripts wait for the "serving ... on http://"
  // line below)
  std::cerr << "tandem: starting; port " << server.port()
            << " answers GET /health with the start-up phase (503 until ready)" << std::endl;
  ScopedLoadObserver observe(&mon);  // weights read, graphs captured (model/load_progress.h)
  mon.phase("weights");
  std::unique_ptr<Model> model =
      load_model(a.model, a.device, ecfg, a.gpu_memory_utilization, a.kv_cache_dtype);
  if (!a.speculative_config.empty()) {
    mon.phase("mtp");
    apply_speculative(a.speculative_config, a.model, a.device, *model, ecfg);
  }
  mon.phase("kv_cache");  // the engine allocates the KV cache and state slots, then "graphs"
  ecfg.on_startup_phase = [&mon](const std::string& phase) { mon.phase(phase); };
  AsyncEngine engine(std::move(model), ecfg);
  client.set(&engine);
  std::unique_ptr<InstanceServer> control;  // (goes before the engine)
  if (a.control_port >= 0) {
    control = std::make_unique<InstanceServer>(&engine, a.host, a.control_port,
                                               cluster_key(a.cluster_key_file));
  }
  mon.ready();
  std::cerr << "tandem: serving '" << cfg.model_name << "' (" << a.model << ") on "
            << (cfg.ssl_certfile.empty() ? "http://" : "https://") << cfg.host << ":"
            << server.port() << "  max_model_len " << engine.max_model_len()
            << (tok ? "" : "  (no tokenizer: token-id prompts only)")
            << (control ? "  control port " + std::to_string(control->port()) : "") << std::endl;
  server.wait();
  server.stop();  // (before the engine goes)
  client.set(nullptr);
  return 0;
}

// ---- Disaggregated roles: tandem prefill / decode / router. ----

struct InstanceArgs {
  std::string model = demo_model_dir();
  int ranks = 1;  // --tp (prefill) or --dp (decode)
  std::string host = "127.0.0.1";
  int port = 0;           // control protocol (the router connects here); KV receivers: free ports
  int metrics_port = -1;  // GET /metrics here (-1: none)
  int nprocs = 1;         // fork this many rank processes here (a process group)
  int64_t max_decode_batch = 32;
  int drain_seconds = 30;  // SIGTERM: requests in flight may finish this long
  EngineConfig engine;
  std::string device = "cpu";
  double gpu_memory_utilization = 0.9;  // --device cuda, without --kv-cache-mb
  std::string kv_cache_dtype = "auto";  // --kv-cache-dtype
  std::string speculative_config;       // decode instances only
  std::string cluster_key_file;         // "": no cluster key
  net::KeyRef key;                      // loaded from it (once, before the ranks fork)
  std::string kv_events_config;         // prefill instances (rank 0's prefix cache)
};

// Blocks SIGINT / SIGTERM in this thread and the threads it starts; wait_for_stop_signal()
// then returns when one arrives.
sigset_t block_stop_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

void wait_for_stop_signal(const sigset_t& set) {
  int sig = 0;
  sigwait(&set, &sig);
}

int env_world_size() { return static_cast<int>(env::integer("WORLD_SIZE").value_or(1)); }

// --nprocs N: forks one process per rank of a local group, each running `role` as one rank
// (the group bootstraps through RANK / WORLD_SIZE / MASTER_* set by the launcher).
int run_local_group(const InstanceArgs& a, const char* ranks_flag,
                    int (*role)(const InstanceArgs&)) {
  TANDEM_CHECK_KIND(kInvalidArgument, a.ranks == 1 || a.ranks == a.nprocs, ranks_flag, " ", a.ranks,
                    " differs from --nprocs ", a.nprocs);
  if (a.device == "cuda") {
    // LOCAL_RANK picks each rank's GPU; with fewer GPUs than ranks they share them (tests:
    // CUDA IPC works between processes on one device, NCCL is then left out).
    const int gpus = comm::run_in_child(
        [] {
#ifdef TANDEM_WITH_CUDA
          int c = 0;
          return cudaGetDeviceCount(&c) == cudaSuccess ? c : 0;
#else
          return 0;
#endif
        },
        0);
    TANDEM_CHECK_KIND(kUnsupported, gpus > 0, "--device cuda: no CUDA device is visible");
    if (gpus < a.nprocs) {
      std::cerr << "tandem: " << a.nprocs << " ranks on " << gpus
                << " GPU(s): ranks share GPUs (tests only; no NCCL)" << std::endl;
      ::setenv("TANDEM_ALLOW_SHARED_GPU", "1", 1);
    }
  }
  InstanceArgs one = a;
  one.nprocs = 1;
  one.ranks = a.nprocs;
  auto results = comm::run_local_ranks(
      a.nprocs,
      [&](int) {
        if (role(one) != 0) TANDEM_THROW(kInternal, "the rank failed");
      },
      std::chrono::hours(24 * 365), std::chrono::seconds(10));
  const std::string failures = comm::describe_failures(results);
  if (!failures.empty()) std::cerr << failures;
  return failures.empty() ? 0 : 1;
}

// This process's rank watchdog (process groups only); disarmed once the instance is stopping.
std::unique_ptr<comm::GroupWatchdog> g_watchdog;

// A rank > 0 serves until rank 0 stops the group; a signal here ends the process at once
// (its peers see the group fail).
template <typename Instance>
int follow_group(Instance& instance, const sigset_t& signals) {
  std::atomic<bool> group_done{false};
  std::thread([&] {
    instance.wait();
    g_watchdog.reset();  // a normal stop: rank 0 goes away next
    group_done = true;
    ::kill(::getpid(), SIGTERM);
  }).detach();
  wait_for_stop_signal(signals);
  if (!group_done) std::_Exit(0);
  return 0;
}

// The parts of this process's ranks for --device: the model factory and the KV transfer
// backend (instance_parts.h). `store` is the process group's (null: ranks as threads).
void choose_parts(const InstanceArgs& a, std::shared_ptr<comm::TcpStore> store,
                  std::chrono::milliseconds transfer_timeout, ModelFactory& model,
                  std::shared_ptr<transfer::TransferBackend>& backend) {
  [[maybe_unused]] const bool fp8_kv = kv_cache_fp8(a.kv_cache_dtype, a.device);
  if (a.device == "cpu") {  // the defaults: Qwen3MoeCpu, host TCP (with the cluster key)
    if (a.key) backend = host_transfer_backend({a.host, transfer_timeout, a.key});
    return;
  }
  TANDEM_CHECK_KIND(kInvalidArgument, a.device == "cuda", "--device must be cpu or cuda, not '",
                    a.device, "'");
#ifdef TANDEM_WITH_CUDA
  check_cuda_model_config(ModelConfig::from_dir(a.model), a.model + "/config.json");
  TANDEM_CHECK_KIND(kInvalidArgument, store != nullptr || a.ranks == 1, "--device cuda with ",
                    a.ranks,
                    " ranks needs one process per rank: --nprocs N (or RANK / WORLD_SIZE)");
  CudaModelOptions o;
  o.max_tokens = a.engine.max_batched_tokens;
  o.max_seqs = std::max(a.engine.max_num_seqs, a.max_decode_batch);
  o.page_size = a.engine.page_size;
  o.graph_max_context = a.engine.max_model_len;
  o.gpu_memory_utilization = a.gpu_memory_utilization;
  // --deterministic on the GPU: one unsharded model (Qwen3MoeCuda refuses a sharded one too).
  TANDEM_CHECK_KIND(kUnsupported, !a.engine.deterministic || a.ranks == 1,
                    "--deterministic with --device cuda: one rank only (--tp / --dp 1), not ",
                    a.ranks);
  o.deterministic = a.engine.deterministic;
  o.kv_cache_fp8 = fp8_kv;
  o.store = store;
  const int local_rank = store ? comm::RankEnv::from_env().local_rank : 0;
  const std::string dir = a.model;
  model = [o, dir, local_rank](const ShardSpec& shard, comm::Communicator*) mutable {
    int gpus = 0;
    TANDEM_CUDA_CHECK(cudaGetDeviceCount(&gpus));
    TANDEM_CHECK_KIND(kUnsupported, gpus > 0, "--device cuda: no CUDA device is visible");
    o.device = local_rank % gpus;
    o.shard = shard;
    // Qwen3-MoE or Qwen3.5, the rank's slice (prefill TP/EP, decode DP/EP).
    return load_cuda_model(dir, o);
  };
  transfer::CudaIpcOptions t;
  t.bind_host = a.host;
  t.timeout = transfer_timeout;
  t.key = a.key;
  backend = transfer::make_cuda_ipc_backend(t);
#else
  (void)store;
  (void)transfer_timeout;
  (void)model;
  (void)backend;
  TANDEM_THROW(kUnsupported, "--device cuda: this tandem was built without CUDA");
#endif
}

// This process's instance: one rank of a process group when RANK / WORLD_SIZE / ... are set
// (ranks defaults to the group's size), else the whole instance with its ranks as threads.
// The group's store is shared by the control-plane communicator (Gloo) and, on the GPU, the
// model's CUDA communicators.
template <typename Instance, typename Config>
std::unique_ptr<Instance> make_instance(const InstanceArgs& a, Config& cfg, int& ranks,
                                        std::chrono::milliseconds transfer_timeout) {
  if (env_world_size() > 1) {
    // Gloo writes to its peers' sockets without MSG_NOSIGNAL: a write to a dead rank's socket
    // would kill this process with SIGPIPE before the watchdog below reports the loss. Ignored,
    // the write fails, the group's loop ends with an error and the watchdog exits as it should.
    std::signal(SIGPIPE, SIG_IGN);
    if (ranks == 1) ranks = env_world_size();
    const comm::RankEnv env = comm::RankEnv::from_env();
    comm::TcpStoreOptions so = comm::TcpStoreOptions::of(env);
    so.key = a.key;
    auto store = std::make_shared<comm::TcpStore>(so);
    InstanceArgs per = a;
    per.ranks = ranks;
    choose_parts(per, store, transfer_timeout, cfg.model, cfg.transfer);
    auto gloo = std::make_unique<comm::GlooCommunicator>(*store);  // (every rank is up now)
    // A dead rank (or rank 0's store gone) is noticed within 2 s, off the data path: the
    // process exits non-zero, the router sees the instance fail (its requests end with an
    // error) and the supervisor restarts the group.
    g_watchdog = std::make_unique<comm::GroupWatchdog>(
        store, [rank = env.rank](int, const std::string& why) {
          std::cerr << "tandem: rank " << rank << ": the instance lost a rank (" << why
                    << "): exiting" << std::endl;
          std::_Exit(3);
        });
    return std::make_unique<Instance>(cfg, std::move(gloo));
  }
  choose_parts(a, nullptr, transfer_timeout, cfg.model, cfg.transfer);
  return std::make_unique<Instance>(cfg);
}

// The leader's part: the control server (started by the caller), /metrics when asked, a
// line on stderr, then serving until SIGINT / SIGTERM.
int lead_instance(const InstanceArgs& a, InstanceServer& server, const sigset_t& signals,
                  const std::string& what, std::function<std::string()> metrics_text) {
  std::unique_ptr<MetricsEndpoint> metrics;
  if (a.metrics_port >= 0) {
    metrics = std::make_unique<MetricsEndpoint>(a.host, a.metrics_port, std::move(metrics_text));
  }
  if (const std::string w = net::open_listener_warning(a.key, a.host, what.c_str()); !w.empty()) {
    std::cerr << w << std::endl;
  }
  std::cerr << "tandem: " << what << " on " << a.host << ":" << server.port()
            << (metrics ? ", /metrics on port " + std::to_string(metrics->port()) : "")
            << std::endl;
  wait_for_stop_signal(signals);
  server.drain(std::chrono::seconds(a.drain_seconds));  // in-flight requests finish, then stop
  g_watchdog.reset();                                   // stopping: the other ranks go away next
  return 0;
}

int run_prefill(const InstanceArgs& a) {
  if (a.nprocs > 1) return run_local_group(a, "--tp", run_prefill);
  TANDEM_CHECK(a.key || a.cluster_key_file.empty(), "the cluster key is loaded before the ranks");
  const sigset_t signals = block_stop_signals();
  PrefillInstanceConfig cfg;
  cfg.model_dir = a.model;
  cfg.tp = a.ranks;
  cfg.engine = a.engine;
  // Rank 0 owns the prefix cache (the other ranks follow its steps): only it publishes.
  const int64_t rank = env::integer("RANK").value_or(0);
  if (rank == 0) cfg.engine.kv_events = make_kv_event_publisher(a.kv_events_config, a.device);
  // Structured outputs: token 1 samples here, so its grammar is compiled here.
  cfg.engine.constraint_factory = grammar::instance_constraint_factory(a.model);
  auto instance = make_instance<PrefillInstance>(a, cfg, cfg.tp, std::chrono::minutes(1));
  PrefillInstance& prefill = *instance;
  if (!prefill.is_leader()) return follow_group(prefill, signals);
  InstanceServer server(nullptr, &prefill, a.host, a.port, a.key);
  return lead_instance(a, server, signals,
                       "prefill instance (TP=" + std::to_string(a.ranks) + ", " + a.model + ")",
                       [&] {
                         return instances_metrics_text({{"0", prefill.load()}}, {});
                       });
}

int run_decode(const InstanceArgs& a) {
  if (a.nprocs > 1) return run_local_group(a, "--dp", run_decode);
  TANDEM_CHECK(a.key || a.cluster_key_file.empty(), "the cluster key is loaded before the ranks");
  const sigset_t signals = block_stop_signals();
  DecodeInstanceConfig cfg;
  cfg.model_dir = a.model;
  cfg.dp = a.ranks;
  cfg.engine = a.engine;
  cfg.engine.constraint_factory = grammar::instance_constraint_factory(a.model);  // (as prefill)
  cfg.max_decode_batch = a.max_decode_batch;
  cfg.kv_host = a.host;
  if (!a.speculative_config.empty()) {  // the CPU or the CUDA model (its MTP layer on each rank)
    const SpeculativeConfig sc = parse_speculative_config(a.speculative_config);
    cfg.engine.num_speculative_tokens = sc.num_speculative_tokens;
    cfg.mtp_dir = sc.model.empty() ? a.model : sc.model;
  }
  auto instance = make_instance<DecodeInstance>(a, cfg, cfg.dp, cfg.transfer_timeout);
  DecodeInstance& decode = *instance;
  if (!decode.is_leader()) return follow_group(decode, signals);
  InstanceServer server(&decode, nullptr, a.host, a.port, a.key);
  return lead_instance(
      a, server, signals,
      "decode instance (DP=" + std::to_string(cfg.dp) + ", " + a.model + "), max decode batch " +
          std::to_string(a.max_decode_batch) + " per rank",
      [&] {
        const DecodeLoad l = decode.load();
        std::string t = instances_metrics_text({}, {{"0", l}});
        t += "# HELP tandem_decode_kv_pages_free Free KV pages per DP rank.\n"
             "# TYPE tandem_decode_kv_pages_free gauge\n";
        for (size_t r = 0; r < l.kv_pages_free_per_rank.size(); ++r) {
          t += "tandem_decode_kv_pages_free{instance=\"0\",rank=\"" + std::to_string(r) + "\"} " +
               std::to_string(l.kv_pages_free_per_rank[r]) + "\n";
        }
        return t;
      });
}

struct RouterArgs {
  std::string model = demo_model_dir();  // tokenizer and chat template
  std::string served_name;
  std::vector<std::string> prefill;
  std::vector<std::string> decode;
  std::vector<std::string> replica;  // colocated `tandem serve --control-port` replicas
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;
  int http_threads = 2;
  int metrics_port = -1;  // instances' /metrics here (the front's own /metrics is on --port)
  ParserArgs parsers;
  HttpArgs http;
  int max_queue = static_cast<int>(RouterConfig{}.max_queue);
  double queue_timeout_s = 30;
  double resolve_interval_s = 10;
  std::string cluster_key_file;  // "": no cluster key
  int kv_events_port = 0, kv_events_replay_port = 0;
  std::vector<std::string> kv_events_endpoints, kv_events_replay_endpoints;
  std::string kv_events_topic;
  int64_t prefix_index_blocks = RouterConfig{}.prefix_index_blocks;
};

int run_router(const RouterArgs& a) {
  RouterConfig rcfg;
  rcfg.max_queue = static_cast<size_t>(a.max_queue);
  rcfg.queue_timeout = std::chrono::milliseconds(static_cast<int64_t>(a.queue_timeout_s * 1e3));
  rcfg.resolve_interval =
      std::chrono::milliseconds(static_cast<int64_t>(a.resolve_interval_s * 1e3));
  rcfg.cluster_key = cluster_key(a.cluster_key_file);
  rcfg.kv_events_port = a.kv_events_port;
  rcfg.kv_events_replay_port = a.kv_events_replay_port;
  rcfg.kv_events_topic = a.kv_events_topic;
  rcfg.kv_events_endpoints = a.kv_events_endpoints;
  rcfg.kv_events_replay_endpoints = a.kv_events_replay_endpoints;
  rcfg.prefix_index_blocks = a.prefix_index_blocks;
  // The instances may start before or after the router, and come and go: it connects to
  // each when it answers (see Router). --replica: colocated `tandem serve` replicas instead.
  std::unique_ptr<Router> disagg;
  std::unique_ptr<ReplicaRouter> replicas;
  EngineClient* client = nullptr;
  std::function<bool()> ready;
  std::function<std::string()> metrics_text;
  if (!a.replica.empty()) {
    TANDEM_CHECK_KIND(kInvalidArgument, a.prefill.empty() && a.decode.empty(),
                      "router: --replica excludes --prefill and --decode");
    replicas = std::make_unique<ReplicaRouter>(a.replica, rcfg);
    client = replicas.get();
    ready = [&] { return replicas->ready(); };
    metrics_text = [&] { return replicas->metrics_text(); };
  } else {
    TANDEM_CHECK_KIND(kInvalidArgument, !a.prefill.empty() && !a.decode.empty(),
                      "router: give --prefill and --decode, or --replica");
    disagg = std::make_unique<Router>(rcfg);
    for (const auto& e : a.prefill) disagg->watch_prefill(e);
    for (const auto& e : a.decode) disagg->watch_decode(e);
    client = disagg.get();
    ready = [&] { return disagg->ready(); };
    metrics_text = [&] { return disagg->metrics_text(); };
  }
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_dir(a.model);
  std::unique_ptr<ChatTemplate> chat = tok ? ChatTemplate::from_dir(a.model) : nullptr;
  HttpServerConfig cfg;
  cfg.host = a.host;
  cfg.port = static_cast<uint16_t>(a.port);
  cfg.api_key = a.api_key;
  cfg.num_threads = a.http_threads;
  cfg.stop_on_signals = true;
  apply_http_args(a.http, cfg);
  cfg.ready = ready;
  cfg.extra_metrics = metrics_text;
  cfg.model_name = a.served_name;
  if (cfg.model_name.empty()) {  // as tandem serve names it
    std::string dir = a.model;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    cfg.model_name = a.model == demo_model_dir() ? "demo" : dir.substr(dir.rfind('/') + 1);
  }
  a.parsers.apply(cfg, a.model);
  HttpServer server(cfg, *client, tok.get(), chat.get());
  server.start();
  std::unique_ptr<MetricsEndpoint> metrics;
  if (a.metrics_port >= 0) {
    metrics = std::make_unique<MetricsEndpoint>(a.host, a.metrics_port, metrics_text);
  }
  std::cerr << "tandem: router on " << (cfg.ssl_certfile.empty() ? "http://" : "https://")
            << cfg.host << ":" << server.port() << " over "
            << (replicas ? std::to_string(a.replica.size()) + " replica(s)"
                         : std::to_string(a.prefill.size()) + " prefill and " +
                               std::to_string(a.decode.size()) + " decode address(es)")
            << (metrics ? ", instances' /metrics on port " + std::to_string(metrics->port()) : "")
            << std::endl;
  server.wait();
  return 0;
}

}  // namespace

struct ConvertArgs {
  std::string model;
  std::string out;
  std::string format;
  double shard_gb = 4.0;
};

// tandem convert: a progress line on stderr, the per-kind error table on stdout.
int run_convert(const ConvertArgs& a) {
  ConvertOptions o;
  o.in_dir = a.model;
  o.out_dir = a.out;
  TANDEM_CHECK_KIND(kInvalidArgument, a.format == "mxfp8" || a.format == "fp8",
                    "--format must be mxfp8 or fp8 (128x128 blocks), not '", a.format, "'");
  o.format = a.format == "mxfp8" ? WeightQuant::kMxfp8 : WeightQuant::kFp8Block;
  o.shard_bytes = static_cast<uint64_t>(a.shard_gb * double(1ull << 30));
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  int last_pct = -1;
  o.progress = [&](int64_t done, int64_t total, uint64_t bytes, uint64_t total_bytes) {
    const int pct =
        total_bytes > 0 ? static_cast<int>(100.0 * double(bytes) / double(total_bytes)) : 100;
    if (!tty && pct / 10 == last_pct / 10 && done != total) return;  // a line per 10% in logs
    if (tty && pct == last_pct && done != total) return;
    last_pct = pct;
    char line[160];
    std::snprintf(line, sizeof line, "convert: %3d%% [%-30s] %lld/%lld tensors, %.1f/%.1f MB", pct,
                  std::string(static_cast<size_t>(pct * 30 / 100), '#').c_str(),
                  static_cast<long long>(done), static_cast<long long>(total), double(bytes) / 1e6,
                  double(total_bytes) / 1e6);
    std::cerr << (tty ? "\r" : "") << line << (tty && done != total ? "" : "\n") << std::flush;
  };
  ConvertReport r = convert_checkpoint(o);
  std::cout << "wrote " << a.out << " (" << a.format << ")\n" << format_report(r);
  return 0;
}

int cli_main(int argc, char** argv) {
  CLI::App app{"Tandem: a disaggregated MoE inference server"};
  app.require_subcommand(1);
  // --help shows every option's default (subcommands inherit this).
  app.option_defaults()->always_capture_default();
  app.add_flag_callback(
         "--help-env",
         [] {
           std::cout << env::help();
           throw CLI::Success();
         },
         "Print the environment variables Tandem reads (name, type, default, meaning) and exit")
      ->trigger_on_parse();

  GenerateArgs gen;
  auto* g = app.add_subcommand("generate", "Generate from one prompt");
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
  g->add_option("--device", gen.device, "cpu or cuda (one GPU)");
  add_deterministic_flag(g, gen.deterministic);
  add_kv_cache_dtype_option(g, gen.kv_cache_dtype);
  add_speculative_option(g, gen.speculative_config);

  ServeArgs srv;
  auto* sv = app.add_subcommand("serve", "Serve the OpenAI API (one colocated instance)");
  sv->add_option("--model", srv.model, "Model directory (default: the embedded demo model)");
  sv->add_option("--served-model-name", srv.served_name, "Model name in the API");
  sv->add_option("--host", srv.host, "Address to listen on");
  sv->add_option("--port", srv.port, "Port (0: any free port)")->check(CLI::Range(0, 65535));
  sv->add_option("--api-key", srv.api_key, "Require 'Authorization: Bearer KEY'");
  sv->add_option("--http-threads", srv.http_threads, "HTTP io threads")->check(CLI::Range(1, 256));
  add_http_options(sv, srv.http);
  sv->add_option("--device", srv.device, "cpu or cuda (one GPU)");
  sv->add_option("--max-num-seqs", srv.engine.max_num_seqs, "Running sequences at most")
      ->check(CLI::PositiveNumber);
  sv->add_option("--max-model-len", srv.engine.max_model_len, "Context length (default: model's)")
      ->check(CLI::PositiveNumber);
  sv->add_option("--max-num-batched-tokens", srv.engine.max_batched_tokens,
                 "Tokens per step (chunked prefill budget; a cap under --step-time-target-ms)")
      ->check(CLI::PositiveNumber);
  srv.engine.warm_up = true;  // the GPU model's decode graphs before the first request
  srv.engine.step_time_target_ms = 0;
  sv->add_option("--step-time-target-ms", srv.engine.step_time_target_ms,
                 "Size prompt chunks so that a step takes about this long, decode rows first, "
                 "from a model of the step time fit online (ms; -1: auto, 2-3x the time of a "
                 "decode step over every live sequence; 0 (default): off, the token budget "
                 "alone). A step with prompt work still computes at least 16 prompt tokens")
      ->check(CLI::Range(-1.0, 1e6));
  sv->add_option("--step-time-factor", srv.engine.step_time_factor,
                 "With --step-time-target-ms -1: the target is at least this many times the "
                 "predicted decode-only step over every live sequence, more (up to 25x) when "
                 "the arriving prompt work needs it to keep up (>= 1; 0 (default): 2-3x by the "
                 "prompt work arriving)")
      ->check(CLI::Range(0.0, 1e6));
  sv->add_option("--step-trace", srv.engine.step_trace_path,
                 "Write one CSV line per step (shape, the policy's target and predicted time, "
                 "the measured time) to this file");
  sv->add_option("--max-waiting", srv.engine.max_waiting, "Queue limit (then 429)")
      ->check(CLI::PositiveNumber);
  srv.engine.kv_cache_mb = 0;  // 0: the engine's default on the CPU, from the GPU's memory
  sv->add_option("--kv-cache-mb", srv.engine.kv_cache_mb,
                 "KV cache size (default: 512 on the CPU; on the GPU what "
                 "--gpu-memory-utilization leaves after the model)")
      ->check(CLI::PositiveNumber);
  sv->add_option("--gpu-memory-utilization", srv.gpu_memory_utilization,
                 "Share of the GPU's memory for weights, activations and KV (--device cuda)")
      ->check(CLI::Range(0.05, 1.0));
  sv->add_option("--page-size", srv.engine.page_size, "Tokens per KV page")
      ->check(CLI::PositiveNumber);
  bool no_prefix_cache = false;
  sv->add_flag("--no-prefix-cache", no_prefix_cache, "Disable prefix caching");
  sv->add_option("--control-port", srv.control_port,
                 "Also serve as a replica of `tandem router --replica` on this port (0: any)")
      ->check(CLI::Range(0, 65535));
  add_cluster_key_option(sv, srv.cluster_key_file);
  sv->add_option("--kv-events-config", srv.kv_events_config,
                 "vLLM's KVEventsConfig as JSON: publish the prefix cache's block events "
                 "(docs/operations.md)");
  add_deterministic_flag(sv, srv.engine.deterministic);
  add_kv_cache_dtype_option(sv, srv.kv_cache_dtype);
  add_speculative_option(sv, srv.speculative_config);
  srv.parsers.add_to(sv);

  PlannerInputs plan_in;
  MemoryFitArgs fit;
  auto* pl = app.add_subcommand(
      "plan", "Replica counts for prefill and decode instances, or (--model) whether a role fits");
  auto* pl_tps = pl->add_option("--input-tps", plan_in.input_tokens_per_s,
                                "Prompt tokens/s arriving (replica mode: required)");
  auto* pl_cap = pl->add_option("--prefill-capacity-tps", plan_in.prefill_capacity_tps,
                                "Prompt tokens/s one prefill instance sustains (measured; replica "
                                "mode: required)");
  pl->add_option("--queued-input-tokens", plan_in.queued_input_tokens);
  pl->add_option("--drain-seconds", plan_in.drain_seconds);
  auto* pl_seqs = pl->add_option("--concurrent-seqs", plan_in.concurrent_sequences,
                                 "Sequences decoding (replica mode: required)");
  pl->add_option("--dp", plan_in.decode_dp, "Ranks per decode instance");
  pl->add_option("--max-decode-batch", plan_in.max_decode_batch, "Per-rank batch threshold");
  pl->add_option("--utilisation", plan_in.target_utilisation, "Planned fraction of capacity");
  add_memory_fit_options(pl, fit);
  ConvertArgs conv;
  auto* cv = app.add_subcommand(
      "convert", "Quantize a checkpoint's linear weights statically (MXFP8 or 128x128 block FP8)");
  cv->add_option("--model", conv.model, "Input checkpoint (bf16, block FP8 or MXFP8)")->required();
  cv->add_option("--out", conv.out, "Output directory (new or empty)")->required();
  cv->add_option("--format", conv.format, "mxfp8 or fp8")->required();
  cv->add_option("--shard-gb", conv.shard_gb, "Safetensors file size limit")
      ->check(CLI::PositiveNumber);

  InstanceArgs pre, dec;
  auto* pf = app.add_subcommand("prefill", "Run a prefill instance (TP=EP ranks), for a router");
  auto* dc = app.add_subcommand("decode", "Run a decode instance (DP=EP ranks), for a router");
  for (auto [cmd, a] : {std::pair{pf, &pre}, std::pair{dc, &dec}}) {
    cmd->add_option("--model", a->model, "Model directory (default: the embedded demo model)");
    add_deterministic_flag(cmd, a->engine.deterministic);
    add_kv_cache_dtype_option(cmd, a->kv_cache_dtype);
    cmd->add_option("--host", a->host, "Address to listen on (control and KV)");
    cmd->add_option("--port", a->port, "Control port for the router (0: any)")
        ->check(CLI::Range(0, 65535));
    cmd->add_option("--max-model-len", a->engine.max_model_len)->check(CLI::PositiveNumber);
    cmd->add_option("--kv-cache-mb", a->engine.kv_cache_mb, "KV cache per rank")
        ->check(CLI::PositiveNumber);
    cmd->add_option("--page-size", a->engine.page_size, "Tokens per KV page")
        ->check(CLI::PositiveNumber);
    cmd->add_option(
           "--drain-seconds", a->drain_seconds,
           "On SIGTERM: seconds the requests in flight may take (routers send nothing new)")
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--metrics-port", a->metrics_port, "Serve GET /metrics on this port (0: any)")
        ->check(CLI::Range(0, 65535));
    cmd->add_option("--device", a->device,
                    "cpu or cuda (one GPU per rank, LOCAL_RANK picks it; ranks may share one)");
    cmd->add_option("--gpu-memory-utilization", a->gpu_memory_utilization,
                    "Share of the GPU's memory for this rank's weights, activations and KV "
                    "(--device cuda, without --kv-cache-mb)")
        ->check(CLI::Range(0.01, 1.0));
    add_cluster_key_option(cmd, a->cluster_key_file);
  }
  pf->add_option("--tp", pre.ranks, "Ranks (tensor and expert parallel)")
      ->check(CLI::PositiveNumber);
  for (auto [cmd, a] : {std::pair{pf, &pre}, std::pair{dc, &dec}}) {
    cmd->add_option("--nprocs", a->nprocs,
                    "Fork one process per rank here (else: ranks are threads, or this process "
                    "is one rank when WORLD_SIZE > 1)")
        ->check(CLI::PositiveNumber);
  }
  pf->add_option("--max-num-batched-tokens", pre.engine.max_batched_tokens,
                 "Prompt tokens per step (chunk budget)")
      ->check(CLI::PositiveNumber);
  dec.engine.max_batched_tokens = 4096;
  // 0: the engine's default on the CPU; on the GPU what --gpu-memory-utilization leaves.
  pre.engine.kv_cache_mb = dec.engine.kv_cache_mb = 0;
  dc->add_option("--dp", dec.ranks, "Ranks (data parallel attention, expert parallel MoE)")
      ->check(CLI::PositiveNumber);
  dc->add_option("--max-decode-batch", dec.max_decode_batch, "Sequences per rank at most")
      ->check(CLI::PositiveNumber);
  add_speculative_option(dc, dec.speculative_config);
  pf->add_option("--kv-events-config", pre.kv_events_config,
                 "vLLM's KVEventsConfig as JSON: publish the prefix cache's block events "
                 "(docs/operations.md)");

  RouterArgs rt;
  auto* ro = app.add_subcommand("router", "OpenAI front over prefill and decode instances");
  ro->add_option("--prefill", rt.prefill,
                 "Prefill instances HOST:PORT[,...] (a host name may resolve to several)")
      ->delimiter(',');
  ro->add_option("--decode", rt.decode,
                 "Decode instances HOST:PORT[,...] (a host name may resolve to several)")
      ->delimiter(',');
  ro->add_option("--replica", rt.replica,
                 "Instead of --prefill / --decode: colocated `tandem serve` replicas, "
                 "HOST:CONTROL_PORT[,...] (their --control-port): data-parallel serving")
      ->delimiter(',');
  ro->add_option("--model", rt.model, "Model directory for the tokenizer and chat template");
  ro->add_option("--served-model-name", rt.served_name, "Model name in the API");
  ro->add_option("--host", rt.host, "Address to listen on");
  ro->add_option("--port", rt.port, "Port (0: any free port)")->check(CLI::Range(0, 65535));
  ro->add_option("--api-key", rt.api_key, "Require 'Authorization: Bearer KEY'");
  ro->add_option("--http-threads", rt.http_threads, "HTTP io threads")->check(CLI::Range(1, 256));
  add_http_options(ro, rt.http);
  ro->add_option("--max-queue", rt.max_queue,
                 "Requests that may wait in the router while every decode instance is at its "
                 "batch limit (then 429)")
      ->check(CLI::NonNegativeNumber);
  ro->add_option("--queue-timeout", rt.queue_timeout_s,
                 "Seconds a request may wait in the router queue (then 429 with Retry-After)")
      ->check(CLI::PositiveNumber);
  ro->add_option("--resolve-interval", rt.resolve_interval_s,
                 "Seconds between DNS lookups of instance host names (one instance per address)")
      ->check(CLI::PositiveNumber);
  ro->add_option("--kv-events-port", rt.kv_events_port,
                 "Prefix-aware routing: subscribe to each prefill instance's KV events on this "
                 "port of its host (its --kv-events-config endpoint; 0: least-queued routing)")
      ->check(CLI::Range(0, 65535));
  ro->add_option("--kv-events-replay-port", rt.kv_events_replay_port,
                 "The instances' KV-event replay port (0: none)")
      ->check(CLI::Range(0, 65535));
  ro->add_option("--kv-events-topic", rt.kv_events_topic, "The instances' KV-event topic");
  ro->add_option("--kv-events-endpoints", rt.kv_events_endpoints,
                 "With --replica: each replica's KV-event endpoint tcp://HOST:PORT[,...], in "
                 "order (instead of --kv-events-port; several replicas on one host)")
      ->delimiter(',');
  ro->add_option("--kv-events-replay-endpoints", rt.kv_events_replay_endpoints,
                 "With --kv-events-endpoints: their replay endpoints, in order")
      ->delimiter(',');
  ro->add_option("--prefix-index-blocks", rt.prefix_index_blocks,
                 "Page hashes the router's prefix index keeps at most (LRU)")
      ->check(CLI::PositiveNumber);
  ro->add_option("--metrics-port", rt.metrics_port,
                 "Serve the instances' GET /metrics (queued input tokens, input tokens/s, batch "
                 "per rank vs limit) on this port (0: any)")
      ->check(CLI::Range(0, 65535));
  rt.parsers.add_to(ro);
  add_cluster_key_option(ro, rt.cluster_key_file);

  bench::BenchCli bench_cli(
      app,
      [](const std::string& dir, const std::string& device, EngineConfig& cfg, double util) {
        return load_model(dir, device, cfg, util);
      },
      demo_model_dir());

  try {
    app.parse(argc, argv);
    env::validate();  // a bad value fails here, naming the variable
    if (pf->parsed()) {
      pre.key = cluster_key(pre.cluster_key_file);
      return run_prefill(pre);
    }
    if (dc->parsed()) {
      dec.key = cluster_key(dec.cluster_key_file);
      return run_decode(dec);
    }
    if (ro->parsed()) return run_router(rt);
    if (cv->parsed()) return run_convert(conv);
    if (bench_cli.parsed()) return bench_cli.run();
    if (pl->parsed()) {
      if (!fit.model.empty()) return print_memory_fit(fit, std::cout);
      TANDEM_CHECK_KIND(kInvalidArgument, pl_tps->count() && pl_cap->count() && pl_seqs->count(),
                        "plan: give --model DIR (will a role fit a GPU?) or --input-tps, "
                        "--prefill-capacity-tps and --concurrent-seqs (replica counts)");
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
