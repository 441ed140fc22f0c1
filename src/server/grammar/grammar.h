// Structured outputs on xgrammar's C++ core: grammars (JSON schema, any JSON object, regex,
// choice, EBNF) compiled once per tokenizer and cached, and the per-request TokenConstraint
// the engine consults (the token mask before each sample, the sampled token after). The
// constraint also knows the reasoning block: with reasoning on, the grammar starts after
// </think>, and a thinking budget forces </think> when it is spent.
//
//   grammar::GrammarCompiler compiler(tokenizer, vocab_size, eos_ids);
//   auto g = compiler.compile({.kind = grammar::GrammarKind::kJsonSchema, .text = schema});
//   grammar::ConstraintOptions o;  o.grammar = g;
//   request.constraint = grammar::make_constraint(o);   // one per request
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/constraint.h"

namespace tandem {
class Tokenizer;
}

namespace tandem::grammar {

enum class GrammarKind {
  kJsonObject,     // any JSON object (response_format json_object)
  kJsonSchema,     // text: the schema's JSON
  kRegex,          // text: the regular expression
  kChoice,         // choices: one of these strings exactly
  kEbnf,           // text: an EBNF grammar (xgrammar's dialect, root rule "root")
  kStructuralTag,  // text: an xgrammar structural tag ({"type": "structural_tag", ...})
};

struct GrammarSpec {
  GrammarKind kind = GrammarKind::kJsonObject;
  std::string text;
  std::vector<std::string> choices;
  bool strict = true;  // JSON schema: no properties / items beyond those the schema names
  std::string suffix;  // literal text the output must end with after the grammar ("": none)
  /// The cache key: everything that changes the compiled grammar.
  std::string key() const;
};

/// A compiled grammar (xgrammar's, for one tokenizer); shared by the requests that use it.
class CompiledGrammar;

/// Compiles grammars for one tokenizer and model vocabulary, caching the last
/// `cache_capacity` distinct ones (keyed by GrammarSpec::key(); the compiler belongs to one
/// tokenizer). Thread-safe.
class GrammarCompiler {
 public:
  /// `vocab_size`: the model's (at least the tokenizer's; ids past the tokenizer are never
  /// allowed). `stop_ids`: the ids that end a generation (allowed once the grammar is
  /// complete); empty: the tokenizer's eos_token.
  GrammarCompiler(const Tokenizer& tokenizer, int64_t vocab_size, std::vector<int32_t> stop_ids,
                  size_t cache_capacity = 256);
  ~GrammarCompiler();

  /// Throws Error(kInvalidArgument) with xgrammar's reason for a schema, regex or grammar it
  /// refuses.
  std::shared_ptr<const CompiledGrammar> compile(const GrammarSpec& spec);

  int64_t vocab_size() const { return vocab_size_; }
  /// Ids of the <think> / </think> tokens when each is one token, else -1.
  int32_t think_start_id() const { return think_start_id_; }
  int32_t think_end_id() const { return think_end_id_; }
  int64_t cache_hits() const;
  size_t cache_size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int64_t vocab_size_ = 0;
  int32_t think_start_id_ = -1;
  int32_t think_end_id_ = -1;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<const CompiledGrammar>> cache_;
  std::list<std::string> order_;  // keys, oldest first
  size_t capacity_;
  int64_t hits_ = 0;
};

/// Where a reply starts relative to the reasoning block.
enum class ThinkStart {
  kContent,  // no reasoning: the grammar starts at the first token
  kInThink,  // the prompt left <think> open: the grammar starts after </think>
  kAuto,     // the reply may open <think> with its first token (else the grammar starts)
};

struct ConstraintOptions {
  std::shared_ptr<const CompiledGrammar> grammar;  // null: none (a thinking budget alone)
  ThinkStart think = ThinkStart::kContent;
  int32_t think_start_id = -1;   // <think> (kAuto)
  int32_t think_end_id = -1;     // </think> (kInThink, kAuto, a budget)
  int32_t thinking_budget = -1;  // think-block tokens before </think> is forced; -1: no limit
  int64_t vocab_size = 0;        // the mask's width (a budget without a grammar needs it)
};

/// A fresh constraint (one per request: it holds the request's grammar state).
std::shared_ptr<TokenConstraint> make_constraint(const ConstraintOptions& options);

/// What a request asks of its constraint, as data: the grammar (none: a thinking budget
/// alone) and where the reply starts relative to the reasoning block. Its encoding is
/// GenRequest::constraint_spec, compiled where the request samples.
struct ConstraintRequest {
  std::optional<GrammarSpec> grammar;
  ThinkStart think = ThinkStart::kContent;
  int32_t thinking_budget = -1;  // -1: no limit
};
/// A JSON text (GenRequest::constraint_spec).
std::string encode_constraint_request(const ConstraintRequest& r);
/// Throws Error(kInvalidArgument) naming what is wrong with a spec.
ConstraintRequest decode_constraint_request(const std::string& spec);

/// Checks a grammar without compiling it for a tokenizer (xgrammar parses the schema, regex
/// or EBNF): the front of a router, whose instances compile. Throws Error(kInvalidArgument)
/// with xgrammar's reason, as compile() does.
void validate(const GrammarSpec& spec);

/// The request's ConstraintOptions with `compiler` (its grammar compiled: cached; think ids
/// and vocabulary from the compiler). Throws Error(kInvalidArgument) for a grammar xgrammar
/// refuses, or a thinking budget without a single </think> token.
ConstraintOptions constraint_options(GrammarCompiler& compiler, const ConstraintRequest& r);

/// An instance's EngineConfig::constraint_factory: decodes a spec and builds its constraint
/// with one GrammarCompiler for the model (the tokenizer of `model_dir`, `vocab_size`, the
/// EOS ids), created at the first constrained request and shared by every engine given this
/// factory (copies share it). Throws Error(kInvalidArgument) for a bad spec, or when the
/// model has no tokenizer.
ConstraintFactory instance_constraint_factory(std::string model_dir, int64_t vocab_size,
                                              std::vector<int32_t> eos_ids);
/// The same with the vocabulary size and EOS ids of `model_dir`'s config (ModelConfig).
ConstraintFactory instance_constraint_factory(const std::string& model_dir);

/// tool_choice "required" / a named function: the grammar of one call of one of `tools` (an
/// OpenAI tools array; or only the one named `only`, when not empty), its arguments valid
/// against that tool's parameters schema, after a "<tool_call>\n" the prompt already holds.
/// Hermes (Qwen3): {"name": ..., "arguments": {...}} then "\n</tool_call>".
GrammarSpec hermes_tool_call_grammar(const nlohmann::ordered_json& tools, const std::string& only);
/// Qwen3-Coder / Qwen3.5 XML: "<function=NAME>\n" <parameter=P>...</parameter> ...
/// "\n</function>\n</tool_call>" (a structural tag; parameter values in xgrammar's qwen_xml
/// style: strings raw, other types as JSON, the schema's property order).
GrammarSpec xml_tool_call_grammar(const nlohmann::ordered_json& tools, const std::string& only);

/// Constraints alive now (tests: a finished or aborted request releases its own).
int64_t live_constraints();

}  // namespace tandem::grammar
