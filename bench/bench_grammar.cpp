// Structured-output cost on the host (xgrammar): the time to build the tokenizer info, to
// compile a typical JSON schema and json_object (fresh compiler: no cache), a cache hit, and
// the per-step mask fill at batch 1 / 32 / 128 (one thread, as the engine's MaskWorker fills
// a step's masks), beside the measured CPU decode step of the demo model at the same batch in
// the same run. The mask is built while the step's forward runs, so a ratio below 1 is hidden.
//   build/bench_grammar [--tokenizer DIR] [--model DIR] [--steps N]
// --tokenizer: whose vocabulary the grammar works over (default: the demo model's; e.g. the
// Qwen3 tokenizer of tools/fetch_qwen3_tokenizer.sh for a 151k vocabulary).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "model/qwen3_moe.h"
#include "server/grammar/grammar.h"
#include "server/tokenizer/tokenizer.h"

#ifndef TANDEM_DEMO_MODEL_DIR
#define TANDEM_DEMO_MODEL_DIR "models/demo"
#endif

using namespace tandem;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// A typical agent schema: nested object, enum, bounded integer, array of strings, optional.
const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
      "required": ["street", "city"]},
    "active": {"type": "boolean"},
    "score": {"type": "number"}
  },
  "required": ["name", "age", "role", "active"]
})";

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Mean seconds per step to fill the masks of `batch` constrained sequences (a random allowed
/// token accepted after each step; a finished walk starts over).
double mask_step_seconds(grammar::GrammarCompiler& gc, const Tokenizer& tok, int batch, int steps,
                         const std::vector<int32_t>& stop_ids) {
  grammar::ConstraintOptions o;
  o.grammar = gc.compile({grammar::GrammarKind::kJsonSchema, kSchema});
  o.vocab_size = gc.vocab_size();
  std::vector<std::shared_ptr<TokenConstraint>> cs;
  for (int b = 0; b < batch; ++b) cs.push_back(grammar::make_constraint(o));
  const size_t words = static_cast<size_t>(bitmask_words(gc.vocab_size()));
  std::vector<std::vector<uint32_t>> masks(static_cast<size_t>(batch),
                                           std::vector<uint32_t>(words));
  std::mt19937_64 rng(1);
  std::vector<int32_t> allowed;
  double fill = 0;
  for (int s = 0; s < steps; ++s) {
    const double t0 = now();
    for (int b = 0; b < batch; ++b) cs[size_t(b)]->fill_next_mask(masks[size_t(b)]);
    fill += now() - t0;
    for (int b = 0; b < batch; ++b) {  // (not timed) a random allowed token, preferring text
      allowed.clear();
      const auto& m = masks[size_t(b)];
      for (int32_t id = 0; id < static_cast<int32_t>(gc.vocab_size()); ++id) {
        if (bitmask_allows(m, id)) allowed.push_back(id);
      }
      const bool can_stop = std::any_of(stop_ids.begin(), stop_ids.end(), [&](int32_t id) {
        return id < int32_t(words * 32) && bitmask_allows(m, id);
      });
      std::string err;
      if (allowed.empty() || (can_stop && rng() % 4 == 0)) {
        cs[size_t(b)] = grammar::make_constraint(o);  // start a new output
        continue;
      }
      cs[size_t(b)]->accept(allowed[rng() % allowed.size()], err);
    }
    (void)tok;
  }
  return fill / steps;
}

/// Seconds per CPU decode step of `model` at `batch` running sequences.
double decode_step_seconds(Model& model, int batch, int steps) {
  EngineConfig cfg;
  cfg.max_num_seqs = std::max(batch, 1);
  cfg.max_batched_tokens = std::max(1024, batch * 8);
  cfg.max_model_len = 512;
  cfg.kv_cache_mb = 256;
  Engine e(model, cfg);
  for (int b = 0; b < batch; ++b) {
    GenRequest r;
    r.id = "r" + std::to_string(b);
    r.prompt_ids = {1, 2, 3, 4, 5, 6, 7, static_cast<int32_t>(8 + b % 100)};
    r.max_tokens = steps + 8;
    r.ignore_eos = true;
    r.sampling.temperature = 0;
    e.add(std::move(r), nullptr);
  }
  for (int i = 0; i < 3; ++i) e.step();  // prefill (one step) and warm-up decode steps
  const double t0 = now();
  for (int s = 0; s < steps; ++s) e.step();
  return (now() - t0) / steps;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_dir = TANDEM_DEMO_MODEL_DIR, tok_dir;
  int steps = 30;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      model_dir = argv[++i];
    } else if (a == "--tokenizer" && i + 1 < argc) {
      tok_dir = argv[++i];
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::max(1, std::atoi(argv[++i]));
    } else {
      std::cerr << "usage: bench_grammar [--tokenizer DIR] [--model DIR] [--steps N]\n";
      return 2;
    }
  }
  if (tok_dir.empty()) tok_dir = model_dir;
  std::unique_ptr<Tokenizer> tok = Tokenizer::from_dir(tok_dir);
  if (!tok) {
    std::cerr << "bench_grammar: no tokenizer.json in " << tok_dir << "\n";
    return 1;
  }
  std::unique_ptr<Model> model = Qwen3MoeCpu::load(model_dir);
  std::vector<int32_t> stop;
  if (tok->eos_token_id()) stop.push_back(*tok->eos_token_id());
  for (const char* s : {"<|im_end|>", "<|endoftext|>"}) {
    if (auto id = tok->token_to_id(s)) stop.push_back(*id);
  }
  const int64_t vocab = tok->vocab_size();
  std::cout << "tokenizer " << tok_dir << " (" << vocab << " ids), model " << model_dir << "\n";

  double t0 = now();
  grammar::GrammarCompiler gc(*tok, vocab, stop);
  std::cout << "tokenizer info (once per server): " << (now() - t0) * 1e3 << " ms\n";
  std::vector<double> schema_t, object_t;
  for (int rep = 0; rep < 5; ++rep) {
    grammar::GrammarCompiler fresh(*tok, vocab, stop);
    t0 = now();
    fresh.compile({grammar::GrammarKind::kJsonSchema, kSchema});
    schema_t.push_back(now() - t0);
    t0 = now();
    fresh.compile({grammar::GrammarKind::kJsonObject});
    object_t.push_back(now() - t0);
  }
  gc.compile({grammar::GrammarKind::kJsonSchema, kSchema});
  t0 = now();
  for (int i = 0; i < 1000; ++i) gc.compile({grammar::GrammarKind::kJsonSchema, kSchema});
  const double hit = (now() - t0) / 1000;
  std::cout << "compile json_schema (typical, 8 properties): " << median(schema_t) * 1e3
            << " ms median of 5\n"
            << "compile json_object: " << median(object_t) * 1e3 << " ms median of 5\n"
            << "cache hit: " << hit * 1e6 << " us\n\n";

  std::cout << "batch  mask fill / step (ms)  CPU decode step (ms)  ratio\n";
  for (int batch : {1, 32, 128}) {
    const double mask = mask_step_seconds(gc, *tok, batch, steps, stop);
    const double step = decode_step_seconds(*model, batch, std::max(5, steps / 3));
    std::printf("%5d  %22.3f  %20.3f  %5.3f\n", batch, mask * 1e3, step * 1e3, mask / step);
  }
  return 0;
}
