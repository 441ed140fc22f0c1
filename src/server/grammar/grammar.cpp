#include "server/grammar/grammar.h"

#include <xgrammar/xgrammar.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <deque>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <string_view>
#include <variant>

#include "core/error.h"
#include "model/config.h"
#include "server/tokenizer/tokenizer.h"

namespace tandem::grammar {

class CompiledGrammar {
 public:
  CompiledGrammar(xgrammar::CompiledGrammar g, std::vector<int32_t> stop_ids,
                  std::shared_ptr<const std::vector<uint32_t>> also)
      : grammar(std::move(g)), stop_ids(std::move(stop_ids)), also_allowed(std::move(also)) {}
  xgrammar::CompiledGrammar grammar;
  std::vector<int32_t> stop_ids;
  // JSON grammars: the mask is ANDed with this one (tokens without raw control bytes).
  // NOTE: xgrammar 0.2.8's strings with minLength / maxLength admit raw control characters
  // (U+0000..U+001F but CR / LF), which JSON forbids; our JSON is compact, so no control byte
  // but a suffix's newline is ever valid.
  std::shared_ptr<const std::vector<uint32_t>> also_allowed;
};

namespace {

std::atomic<int64_t> g_live{0};

/// Special tokens the grammar may spell (their text is what the chat parser reads): the
/// tool-call tags. Other special tokens (the think tags too: the engine gates on their ids) are
/// never allowed by a grammar.
bool grammar_visible(const std::string& s) { return s == "<tool_call>" || s == "</tool_call>"; }

std::string ebnf_literal(const std::string& s) { return nlohmann::json(s).dump(); }

void set_bit(std::span<uint32_t> mask, int32_t id) {
  if (id >= 0 && static_cast<size_t>(id) / 32 < mask.size()) {
    mask[static_cast<size_t>(id) / 32] |= 1u << (static_cast<uint32_t>(id) % 32);
  }
}

class Constraint final : public TokenConstraint {
 public:
  explicit Constraint(const ConstraintOptions& o) : o_(o) {
    if (o.grammar) {
      matcher_.emplace(o.grammar->grammar, o.grammar->stop_ids,
                       /*terminate_without_stop_token=*/false, /*max_rollback_tokens=*/0);
    }
    switch (o.think) {
      case ThinkStart::kContent: phase_ = Phase::kGrammar; break;
      case ThinkStart::kInThink: phase_ = Phase::kThinking; break;
      case ThinkStart::kAuto: phase_ = Phase::kFirst; break;
    }
    if (o.think_end_id < 0) phase_ = Phase::kGrammar;  // no single-token </think>: no gating
    ++g_live;
  }
  ~Constraint() override { --g_live; }

  bool fill_next_mask(std::span<uint32_t> mask) override {
    if (phase_ == Phase::kThinking) {
      if (o_.thinking_budget < 0 || think_tokens_ < o_.thinking_budget) return false;
      std::fill(mask.begin(), mask.end(), 0u);  // the budget is spent: </think> only
      set_bit(mask, o_.think_end_id);
      return true;
    }
    if (!matcher_) return false;
    if (matcher_->IsTerminated()) {
      std::fill(mask.begin(), mask.end(), 0u);
      for (int32_t id : o_.grammar->stop_ids) set_bit(mask, id);
      return true;
    }
    int64_t shape = static_cast<int64_t>(mask.size());
    DLTensor t{};
    t.data = mask.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = DLDataType{kDLInt, 32, 1};
    t.shape = &shape;
    bool needed = matcher_->FillNextTokenBitmask(&t);
    if (const auto& also = o_.grammar->also_allowed) {
      for (size_t i = 0; i < mask.size() && i < also->size(); ++i) mask[i] &= (*also)[i];
      needed = true;
    }
    if (phase_ == Phase::kFirst && needed && o_.think_start_id >= 0) {
      set_bit(mask, o_.think_start_id);  // the reply may open a think block first
    }
    return needed;
  }

  bool accept(int32_t token, std::string& error) override {
    const Undo undo{phase_, think_tokens_, false};
    if (!advance(token, error)) {
      phase_ = undo.phase;  // a refused token changes nothing
      think_tokens_ = undo.think_tokens;
      return false;
    }
    history_.push_back(undo);
    history_.back().matched = matched_;
    if (history_.size() > kHistory) history_.pop_front();
    return true;
  }

  bool can_rollback() const override { return true; }

  void rollback(int32_t num_tokens) override {
    TANDEM_CHECK(num_tokens >= 0 && static_cast<size_t>(num_tokens) <= history_.size(),
                 "structured output: cannot roll back ", num_tokens, " tokens (", history_.size(),
                 " kept)");
    int matched = 0;
    for (int32_t i = 0; i < num_tokens; ++i) {
      const Undo u = history_.back();
      history_.pop_back();
      phase_ = u.phase;
      think_tokens_ = u.think_tokens;
      matched += u.matched ? 1 : 0;
    }
    if (matched > 0) matcher_->Rollback(matched);
  }

 private:
  enum class Phase { kFirst, kThinking, kGrammar };
  // What accept() changed, to undo it: the phase and think count before it, and whether the
  // token went into the matcher.
  struct Undo {
    Phase phase;
    int32_t think_tokens;
    bool matched;
  };
  static constexpr size_t kHistory = 16;  // >= the drafts of one step (kMaxSpeculativeTokens)

  bool advance(int32_t token, std::string& error) {
    matched_ = false;
    if (phase_ == Phase::kFirst) {
      if (token == o_.think_start_id) {
        phase_ = Phase::kThinking;
        return true;
      }
      phase_ = Phase::kGrammar;
    }
    if (phase_ == Phase::kThinking) {
      if (token == o_.think_end_id) {
        phase_ = Phase::kGrammar;
      } else {
        ++think_tokens_;
      }
      return true;
    }
    if (!matcher_) return true;
    if (matcher_->AcceptToken(token)) {
      matched_ = true;
      return true;
    }
    error = "structured output: token " + std::to_string(token) +
            " does not continue the requested format";
    return false;
  }

  ConstraintOptions o_;
  std::optional<xgrammar::GrammarMatcher> matcher_;
  Phase phase_ = Phase::kGrammar;
  int32_t think_tokens_ = 0;
  bool matched_ = false;      // the last advance() fed the matcher
  std::deque<Undo> history_;  // the last kHistory accepted tokens, oldest first
};

}  // namespace

std::string GrammarSpec::key() const {
  std::string k = std::to_string(static_cast<int>(kind)) + (strict ? "s" : "n") +
                  std::to_string(suffix.size()) + ":" + suffix + "|";
  if (kind == GrammarKind::kChoice) return k + nlohmann::json(choices).dump();
  return k + text;
}

struct GrammarCompiler::Impl {
  Impl(xgrammar::TokenizerInfo info) : info(info), compiler(info, /*max_threads=*/2, false) {}
  xgrammar::TokenizerInfo info;
  xgrammar::GrammarCompiler compiler;
  std::vector<int32_t> stop_ids;
  std::shared_ptr<const std::vector<uint32_t>> no_control_bytes;  // see CompiledGrammar
};

GrammarCompiler::GrammarCompiler(const Tokenizer& tok, int64_t vocab_size,
                                 std::vector<int32_t> stop_ids, size_t cache_capacity)
    : vocab_size_(std::max<int64_t>(vocab_size, tok.vocab_size())),
      capacity_(std::max<size_t>(1, cache_capacity)) {
  std::vector<std::string> vocab(static_cast<size_t>(tok.vocab_size()));
  for (int32_t id = 0; id < static_cast<int32_t>(vocab.size()); ++id) {
    if (tok.is_special(id)) {
      std::string s = tok.id_to_token(id);
      if (grammar_visible(s)) vocab[static_cast<size_t>(id)] = s;  // else "": never allowed
    } else {
      vocab[static_cast<size_t>(id)] = std::string(tok.token_bytes(id));
    }
  }
  if (stop_ids.empty() && tok.eos_token_id()) stop_ids.push_back(*tok.eos_token_id());
  std::erase_if(stop_ids, [&](int32_t id) { return id < 0 || id >= vocab_size_; });
  TANDEM_CHECK_KIND(kInvalidArgument, !stop_ids.empty(),
                    "structured outputs need the model's EOS token id");
  auto find = [&](const char* s) {
    std::optional<int32_t> id = tok.token_to_id(s);
    return id ? *id : -1;
  };
  think_start_id_ = find("<think>");
  think_end_id_ = find("</think>");
  xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, static_cast<int>(vocab_size_),
                               stop_ids);
  impl_ = std::make_unique<Impl>(info);
  auto clean =
      std::make_shared<std::vector<uint32_t>>(static_cast<size_t>(bitmask_words(vocab_size_)));
  for (int32_t id = 0; id < static_cast<int32_t>(vocab.size()); ++id) {
    const bool ok = std::none_of(vocab[size_t(id)].begin(), vocab[size_t(id)].end(), [](char c) {
      return static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\r';
    });
    if (ok) (*clean)[size_t(id) / 32] |= 1u << (static_cast<uint32_t>(id) % 32);
  }
  for (int32_t id : stop_ids) (*clean)[size_t(id) / 32] |= 1u << (static_cast<uint32_t>(id) % 32);
  impl_->no_control_bytes = std::move(clean);
  impl_->stop_ids = std::move(stop_ids);
}

GrammarCompiler::~GrammarCompiler() = default;

namespace {

/// xgrammar's messages start "[hh:mm:ss] /path/file.cc:123: ": the reason only.
std::string xgrammar_reason(const std::exception& e) {
  std::string msg = e.what();
  if (size_t cc = msg.find(".cc:"); cc != std::string::npos) {
    if (size_t colon = msg.find(": ", cc + 4); colon != std::string::npos) {
      msg = msg.substr(colon + 2);
    }
  }
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  return msg;
}

// ---- Bounded numbers in JSON grammars. ----
//
// xgrammar 0.2.8 writes an unbounded JSON integer as "0" | "-"? [1-9] [0-9]* and an unbounded
// number with a fraction and an exponent of any length: a model that loops on digits runs to
// max_tokens and leaves invalid JSON. It honours minimum / maximum (a range rule, whose digits
// are bounded when both sides are), but has no knob for digit counts. So, without touching
// xgrammar:
//  1. the schema is rewritten before conversion (bound_schema): an integer open on a side gets
//     the int64 bound there (xgrammar then writes the exact int64 range, at most 19 digits); a
//     number bounded on one side only gets +-kNumberBound on the other (xgrammar's range rule:
//     at most 6 fraction digits, no exponent). Bounds the schema gives are kept.
//  2. a number bounded on neither side keeps its exponent and fraction, so xgrammar's rule for
//     it is replaced in the grammar it produced (bound_json_numbers: printed as EBNF, its number
//     and integer rules found by their exact shape, re-parsed): at most kIntDigits integer
//     digits, kFractionDigits fraction digits and kExponentDigits exponent digits. This covers
//     the numbers of json_object and of "any" values too, and the integers the rewrite cannot
//     reach (an alternative of a type array that also holds "number").
// Not covered: an integer with multipleOf and no bound (xgrammar's modulo automaton; bounding
// it would make xgrammar drop multipleOf).

constexpr int kIntDigits = 19;       // int64's width
constexpr int kFractionDigits = 17;  // a double's round-trip precision
constexpr int kExponentDigits = 3;   // a double's exponent is at most 308
constexpr double kNumberBound = 1e18;

bool is_bound(const nlohmann::ordered_json& s, const char* key) {
  auto it = s.find(key);
  return it != s.end() && it->is_number();
}

/// Step 1 on one schema node and every schema below it.
void bound_schema(nlohmann::ordered_json& s) {
  if (!s.is_object()) return;
  for (const char* key :
       {"additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems",
        "contains", "propertyNames", "not", "if", "then", "else", "items"}) {
    if (auto it = s.find(key); it != s.end()) {
      if (it->is_array()) {
        for (auto& sub : *it) bound_schema(sub);
      } else {
        bound_schema(*it);
      }
    }
  }
  for (const char* key : {"anyOf", "oneOf", "allOf", "prefixItems"}) {
    if (auto it = s.find(key); it != s.end() && it->is_array()) {
      for (auto& sub : *it) bound_schema(sub);
    }
  }
  for (const char* key :
       {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}) {
    if (auto it = s.find(key); it != s.end() && it->is_object()) {
      for (auto& [name, sub] : it->items()) bound_schema(sub);
    }
  }
  // xgrammar reads the type only when none of these comes first.
  for (const char* key : {"$ref", "const", "enum", "anyOf", "oneOf", "allOf"}) {
    if (s.contains(key)) return;
  }
  auto type = s.find("type");
  if (type == s.end()) return;
  auto has_type = [&](const char* t) {
    if (type->is_string()) return *type == t;
    return type->is_array() && std::find(type->begin(), type->end(), t) != type->end();
  };
  const bool lower = is_bound(s, "minimum") || is_bound(s, "exclusiveMinimum");
  const bool upper = is_bound(s, "maximum") || is_bound(s, "exclusiveMaximum");
  if (has_type("number")) {
    // (an integer alternative of the same type array shares these bounds)
    if (lower && !upper) s["maximum"] = kNumberBound;
    if (upper && !lower) s["minimum"] = -kNumberBound;
  } else if (has_type("integer")) {
    if (s.contains("multipleOf") && !lower && !upper) return;
    if (!lower) s["minimum"] = std::numeric_limits<int64_t>::min();
    if (!upper) s["maximum"] = std::numeric_limits<int64_t>::max();
  }
}

/// Step 1 on a schema's text; text that is not JSON is left for xgrammar to refuse.
std::string bound_schema_text(const std::string& text) {
  // (ordered: xgrammar writes properties in the schema's order)
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text, nullptr, false);
  if (j.is_discarded()) return text;
  bound_schema(j);
  return j.dump();
}

/// Step 1 on the JSON schemas inside a structural tag ({"type": "json_schema" or
/// "qwen_xml_parameter", "json_schema": ...} anywhere in its format).
void bound_tag_node(nlohmann::ordered_json& j) {
  if (j.is_array()) {
    for (auto& e : j) bound_tag_node(e);
    return;
  }
  if (!j.is_object()) return;
  for (auto& [key, value] : j.items()) {
    if (key == "json_schema") {
      bound_schema(value);
    } else {
      bound_tag_node(value);
    }
  }
}

std::string bound_tag_schemas(const std::string& text) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text, nullptr, false);
  if (j.is_discarded()) return text;
  bound_tag_node(j);
  return j.dump();
}

/// Step 2: the grammar with xgrammar's unbounded number and integer rules replaced by bounded
/// ones. The rules are recognised by the exact EBNF xgrammar 0.2.8 prints for them (after its
/// normalisation), e.g. for a number rule N:
///   N ::= ((N_1 N_2 N_3 N_5))          N_1 ::= ("" | ("-"))
///   N_2 ::= (("0") | ([1-9] [0-9]*))   N_3 ::= ("" | ("." D{1, -1}))    D ::= (([0-9]))
///   N_4 ::= ("" | ([+\-]))             N_5 ::= ("" | ([eE] N_4 D{1, -1}))
/// and for an integer rule I:  I ::= (("0") | (S [1-9] [0-9]*))  with S ::= ("" | ("-")).
/// A grammar with neither comes back unchanged.
xgrammar::Grammar bound_json_numbers(const xgrammar::Grammar& g) {
  const std::string text = g.ToString();
  // The rules in order: a rule starts a line with "name ::= "; other lines continue it.
  std::vector<std::pair<std::string, std::string>> rules;
  std::map<std::string, size_t> index;
  auto rule_name = [](std::string_view line) -> std::string_view {
    const size_t sep = line.find(" ::= ");
    if (sep == std::string_view::npos || sep == 0) return {};
    const std::string_view name = line.substr(0, sep);
    const bool ok = std::all_of(name.begin(), name.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
    });
    return ok ? name : std::string_view{};
  };
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string_view line = std::string_view(text).substr(pos, end - pos);
    pos = end + 1;
    if (const std::string_view name = rule_name(line); !name.empty()) {
      index[std::string(name)] = rules.size();
      rules.emplace_back(std::string(name), std::string(line.substr(name.size() + 5)));
    } else if (!rules.empty()) {
      rules.back().second += "\n" + std::string(line);
    }
  }
  auto body = [&](const std::string& name) -> const std::string* {
    auto it = index.find(name);
    return it == index.end() ? nullptr : &rules[it->second].second;
  };
  auto is = [&](const std::string& name, const char* expected) {
    const std::string* b = body(name);
    return b != nullptr && *b == expected;
  };
  auto short_body = [&](const std::string& name) -> const std::string* {
    const std::string* b = body(name);
    return b != nullptr && b->size() <= 200 ? b : nullptr;
  };
  static const std::regex kNumber(R"(^\(\((\w+) (\w+) (\w+) (\w+)\)\)$)");
  static const std::regex kFraction(R"(^\("" \| \("\." (\w+)\{1, -1\}\)\)$)");
  static const std::regex kExponent(R"(^\("" \| \(\[eE\] (\w+) (\w+)\{1, -1\}\)\)$)");
  static const std::regex kInteger(R"(^\(\("0"\) \| \((\w+) \[1-9\] \[0-9\]\*\)\)$)");
  const char* kSign = R"(("" | ("-")))";
  const char* kDigit = "(([0-9]))";
  std::string number_rule = "tandem_bounded_number", integer_rule = "tandem_bounded_integer";
  while (index.count(number_rule) || index.count(integer_rule)) {
    number_rule += "_";
    integer_rule += "_";
  }
  bool changed = false;
  for (auto& [name, b] : rules) {
    std::smatch m, f, e;
    if (b.size() > 200) continue;  // (both shapes are short; std::regex recurses per character)
    if (std::regex_match(b, m, kNumber) && is(m[1], kSign) &&
        is(m[2], R"((("0") | ([1-9] [0-9]*)))") && short_body(m[3]) &&
        std::regex_match(*body(m[3]), f, kFraction) && is(f[1], kDigit) && short_body(m[4]) &&
        std::regex_match(*body(m[4]), e, kExponent) && is(e[1], R"(("" | ([+\-])))") &&
        e[2] == f[1]) {
      b = number_rule;
      changed = true;
    } else if (std::regex_match(b, m, kInteger) && is(m[1], kSign)) {
      b = integer_rule;
      changed = true;
    }
  }
  if (!changed) return g;
  auto digits = [](int lo, int hi) {
    return "[0-9]{" + std::to_string(lo) + "," + std::to_string(hi) + "}";
  };
  std::string ebnf;
  for (const auto& [name, b] : rules) ebnf += name + " ::= " + b + "\n";
  ebnf += number_rule + R"( ::= "-"? ("0" | [1-9] )" + digits(0, kIntDigits - 1) + R"() ("." )" +
          digits(1, kFractionDigits) + R"()? ([eE] [+\-]? )" + digits(1, kExponentDigits) + ")?\n";
  ebnf += integer_rule + R"( ::= "0" | "-"? [1-9] )" + digits(0, kIntDigits - 1) + "\n";
  return xgrammar::Grammar::FromEBNF(ebnf);
}

/// The spec's grammar (suffix included), parsed; throws what xgrammar throws.
xgrammar::Grammar build_grammar(const GrammarSpec& spec) {
  std::optional<xgrammar::Grammar> g;
  switch (spec.kind) {
    case GrammarKind::kJsonObject:
      g = bound_json_numbers(xgrammar::Grammar::FromJSONSchema(
          R"({"type": "object"})", /*any_whitespace=*/false, std::nullopt, std::nullopt,
          /*strict_mode=*/false));
      break;
    case GrammarKind::kJsonSchema:
      g = bound_json_numbers(
          xgrammar::Grammar::FromJSONSchema(bound_schema_text(spec.text), /*any_whitespace=*/false,
                                            std::nullopt, std::nullopt, spec.strict));
      break;
    case GrammarKind::kRegex: g = xgrammar::Grammar::FromRegex(spec.text); break;
    case GrammarKind::kChoice: {
      std::string ebnf = "root ::=";
      for (size_t i = 0; i < spec.choices.size(); ++i) {
        ebnf += (i ? " | " : " ") + ebnf_literal(spec.choices[i]);
      }
      g = xgrammar::Grammar::FromEBNF(ebnf);
      break;
    }
    case GrammarKind::kEbnf: g = xgrammar::Grammar::FromEBNF(spec.text); break;
    case GrammarKind::kStructuralTag: {
      // NOTE: without the tokenizer's info, so token-level formats ("token", ...) are refused
      // alike at a router's front and where the grammar is compiled.
      auto r = xgrammar::Grammar::FromStructuralTag(bound_tag_schemas(spec.text));
      if (auto* err = std::get_if<xgrammar::StructuralTagError>(&r)) {
        std::visit([](const auto& e) { throw Error(ErrorKind::kInvalidArgument, e.what()); }, *err);
      }
      g = bound_json_numbers(std::get<xgrammar::Grammar>(std::move(r)));
      break;
    }
  }
  if (!spec.suffix.empty()) {
    g = xgrammar::Grammar::Concat(
        {*g, xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(spec.suffix))});
  }
  return *g;
}

}  // namespace

void validate(const GrammarSpec& spec) {
  try {
    (void)build_grammar(spec);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(ErrorKind::kInvalidArgument, xgrammar_reason(e));
  }
}

std::shared_ptr<const CompiledGrammar> GrammarCompiler::compile(const GrammarSpec& spec) {
  const std::string key = spec.key();
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = cache_.find(key); it != cache_.end()) {
    ++hits_;
    return it->second;
  }
  std::shared_ptr<const CompiledGrammar> out;
  try {
    const bool json =
        spec.kind == GrammarKind::kJsonSchema || spec.kind == GrammarKind::kJsonObject;
    out = std::make_shared<CompiledGrammar>(impl_->compiler.CompileGrammar(build_grammar(spec)),
                                            impl_->stop_ids,
                                            json ? impl_->no_control_bytes : nullptr);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(ErrorKind::kInvalidArgument, xgrammar_reason(e));
  }
  cache_.emplace(key, out);
  order_.push_back(key);
  while (cache_.size() > capacity_) {
    cache_.erase(order_.front());
    order_.pop_front();
  }
  return out;
}

int64_t GrammarCompiler::cache_hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

size_t GrammarCompiler::cache_size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cache_.size();
}

std::shared_ptr<TokenConstraint> make_constraint(const ConstraintOptions& options) {
  return std::make_shared<Constraint>(options);
}

int64_t live_constraints() { return g_live.load(); }

// ---- The constraint as data (GenRequest::constraint_spec). ----

namespace {

constexpr const char* kKindNames[] = {"json_object", "json_schema", "regex",
                                      "choice",      "ebnf",        "structural_tag"};
constexpr const char* kThinkNames[] = {"content", "in_think", "auto"};

template <size_t N>
int index_of(const char* const (&names)[N], const std::string& s, const char* what) {
  for (size_t i = 0; i < N; ++i) {
    if (s == names[i]) return static_cast<int>(i);
  }
  TANDEM_THROW(kInvalidArgument, "constraint spec: unknown ", what, " '", s, "'");
}

}  // namespace

std::string encode_constraint_request(const ConstraintRequest& r) {
  nlohmann::json j = {{"think", kThinkNames[static_cast<int>(r.think)]},
                      {"thinking_budget", r.thinking_budget}};
  if (r.grammar) {
    const GrammarSpec& g = *r.grammar;
    j["grammar"] = {{"kind", kKindNames[static_cast<int>(g.kind)]},
                    {"text", g.text},
                    {"choices", g.choices},
                    {"strict", g.strict},
                    {"suffix", g.suffix}};
  }
  return j.dump();
}

ConstraintRequest decode_constraint_request(const std::string& spec) {
  ConstraintRequest r;
  try {
    const nlohmann::json j = nlohmann::json::parse(spec);
    r.think = static_cast<ThinkStart>(
        index_of(kThinkNames, j.at("think").get<std::string>(), "reasoning start"));
    r.thinking_budget = j.at("thinking_budget").get<int32_t>();
    if (j.contains("grammar")) {
      const nlohmann::json& g = j.at("grammar");
      GrammarSpec s;
      s.kind = static_cast<GrammarKind>(
          index_of(kKindNames, g.at("kind").get<std::string>(), "grammar kind"));
      s.text = g.at("text").get<std::string>();
      s.choices = g.at("choices").get<std::vector<std::string>>();
      s.strict = g.at("strict").get<bool>();
      s.suffix = g.at("suffix").get<std::string>();
      r.grammar = std::move(s);
    }
  } catch (const nlohmann::json::exception& e) {
    TANDEM_THROW(kInvalidArgument, "constraint spec: ", e.what());
  }
  return r;
}

ConstraintOptions constraint_options(GrammarCompiler& gc, const ConstraintRequest& r) {
  ConstraintOptions o;
  o.think = r.think;
  o.think_start_id = gc.think_start_id();
  o.think_end_id = gc.think_end_id();
  o.thinking_budget = r.think == ThinkStart::kContent ? -1 : r.thinking_budget;
  o.vocab_size = gc.vocab_size();
  TANDEM_CHECK_KIND(kInvalidArgument, o.thinking_budget < 0 || o.think_end_id >= 0,
                    "'thinking_budget' needs a tokenizer with a </think> token");
  if (r.grammar) o.grammar = gc.compile(*r.grammar);
  return o;
}

ConstraintFactory instance_constraint_factory(std::string model_dir, int64_t vocab_size,
                                              std::vector<int32_t> eos_ids) {
  struct Shared {
    std::once_flag once;
    std::unique_ptr<Tokenizer> tok;
    std::unique_ptr<GrammarCompiler> compiler;
    std::string error;  // why there is none
  };
  auto shared = std::make_shared<Shared>();
  return [shared, model_dir = std::move(model_dir), vocab_size,
          eos_ids = std::move(eos_ids)](const std::string& spec) {
    std::call_once(shared->once, [&] {
      try {
        shared->tok = Tokenizer::from_dir(model_dir);
        if (!shared->tok) {
          shared->error = model_dir + " has no tokenizer.json";
          return;
        }
        shared->compiler = std::make_unique<GrammarCompiler>(*shared->tok, vocab_size, eos_ids);
      } catch (const std::exception& e) {
        shared->error = e.what();
      }
    });
    TANDEM_CHECK_KIND(kInvalidArgument, shared->compiler != nullptr,
                      "structured outputs need the model's tokenizer: ", shared->error);
    return make_constraint(constraint_options(*shared->compiler, decode_constraint_request(spec)));
  };
}

ConstraintFactory instance_constraint_factory(const std::string& model_dir) {
  const ModelConfig mc = ModelConfig::from_dir(model_dir);
  std::vector<int32_t> eos;
  for (int64_t id : mc.eos_token_ids) eos.push_back(static_cast<int32_t>(id));
  return instance_constraint_factory(model_dir, mc.vocab_size, std::move(eos));
}

// ---- Forced tool calls. ----

using ojson = nlohmann::ordered_json;

/// tool_choice "required" / named with Hermes calls: the JSON of one call after the primed
/// "<tool_call>\n": {"name": <one of the tools (or the named one)>, "arguments": <that tool's
/// parameters schema>}, then "\n</tool_call>".
GrammarSpec hermes_tool_call_grammar(const ojson& tools, const std::string& only) {
  ojson alternatives = ojson::array();
  for (const auto& t : tools) {
    const ojson& fn = t["function"];
    const std::string name = fn["name"].get<std::string>();
    if (!only.empty() && name != only) continue;
    ojson params = fn.contains("parameters") && fn["parameters"].is_object()
                       ? fn["parameters"]
                       : ojson{{"type", "object"}};
    alternatives.push_back({{"type", "object"},
                            {"properties", {{"name", {{"const", name}}}, {"arguments", params}}},
                            {"required", ojson::array({"name", "arguments"})}});
  }
  GrammarSpec g{GrammarKind::kJsonSchema};
  g.text = (alternatives.size() == 1 ? alternatives[0] : ojson{{"anyOf", alternatives}}).dump();
  g.suffix = "\n</tool_call>";
  return g;
}

/// tool_choice "required" / named with Qwen3-Coder / Qwen3.5 XML calls: after the primed
/// "<tool_call>\n", one "<function=NAME>\n" block of one of the tools (or the named one) whose
/// <parameter=P> values follow that tool's parameters schema (xgrammar's qwen_xml style:
/// strings raw, other types as JSON, required parameters present, in the schema's order), then
/// "\n</function>\n</tool_call>": an xgrammar structural tag.
GrammarSpec xml_tool_call_grammar(const ojson& tools, const std::string& only) {
  ojson tags = ojson::array();
  for (const auto& t : tools) {
    const ojson& fn = t["function"];
    const std::string name = fn["name"].get<std::string>();
    if (!only.empty() && name != only) continue;
    ojson params = fn.contains("parameters") && fn["parameters"].is_object()
                       ? fn["parameters"]
                       : ojson{{"type", "object"}};
    tags.push_back({{"type", "tag"},
                    {"begin", "<function=" + name + ">\n"},
                    // (at most one whitespace character where the layout allows any: the template's
                    // newlines fit, a model that would write whitespace forever cannot)
                    {"content",
                     {{"type", "json_schema"},
                      {"json_schema", params},
                      {"style", "qwen_xml"},
                      {"max_whitespace_cnt", 1}}},
                    {"end", "\n</function>\n</tool_call>"}});
  }
  GrammarSpec g{GrammarKind::kStructuralTag};
  const ojson format = tags.size() == 1 ? tags[0] : ojson{{"type", "or"}, {"elements", tags}};
  g.text = ojson{{"type", "structural_tag"}, {"format", format}}.dump();
  return g;
}

}  // namespace tandem::grammar
