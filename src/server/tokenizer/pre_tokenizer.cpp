#include "server/tokenizer/pre_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "core/error.h"
#include "server/tokenizer/regex.h"
#include "server/tokenizer/utf8.h"

namespace tandem {
namespace {

// GPT-2's ByteLevel regex, used when ByteLevel has use_regex = true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::array<char32_t, 256> byte_to_code_point() {
  std::array<char32_t, 256> table{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) table[b] = printable[b] ? char32_t(b) : next++;
  return table;
}

std::string json_type_name(const nlohmann::json& j) {
  static constexpr const char* kNames[] = {"null",   "object", "array",  "string", "boolean",
                                           "number", "number", "number", "binary", "discarded"};
  return kNames[static_cast<int>(j.type())];
}

const nlohmann::json& field(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  TANDEM_CHECK_KIND(kInvalidArgument, it != j.end(), where, ": missing field '", key, "'");
  return *it;
}

bool bool_field(const nlohmann::json& j, const char* key, bool fallback, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  TANDEM_CHECK_KIND(kInvalidArgument, it->is_boolean(), where, ".", key,
                    ": expected a boolean, got ", json_type_name(*it));
  return it->get<bool>();
}

std::string type_of(const nlohmann::json& j, const std::string& where) {
  TANDEM_CHECK_KIND(kInvalidArgument, j.is_object(), where, ": expected an object, got ",
                    json_type_name(j));
  const nlohmann::json& type = field(j, "type", where);
  TANDEM_CHECK_KIND(kInvalidArgument, type.is_string(), where, ".type: expected a string");
  return type.get<std::string>();
}

// Applies an HF split behavior to the alternating match / non-match stretches of `text`.
void split_by_matches(std::string_view text, const std::vector<std::pair<size_t, size_t>>& found,
                      SplitBehavior behavior, bool invert, std::vector<std::string_view>& out) {
  struct Piece {
    size_t begin, end;
    bool is_match;
  };
  std::vector<Piece> pieces;
  pieces.reserve(found.size() * 2 + 1);
  size_t prev = 0;
  for (const auto& [b, e] : found) {
    if (prev < b) pieces.push_back({prev, b, invert});
    pieces.push_back({b, e, !invert});
    prev = e;
  }
  if (prev < text.size()) pieces.push_back({prev, text.size(), invert});

  std::vector<std::pair<size_t, size_t>> spans;
  spans.reserve(pieces.size());
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Piece& p : pieces) spans.emplace_back(p.begin, p.end);
      break;
    case SplitBehavior::kRemoved:
      for (const Piece& p : pieces) {
        if (!p.is_match) spans.emplace_back(p.begin, p.end);
      }
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Piece& p : pieces) {
        if (p.is_match && !previous_match && !spans.empty()) {
          spans.back().second = p.end;
        } else {
          spans.emplace_back(p.begin, p.end);
        }
        previous_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
        if (it->is_match && !previous_match && !spans.empty()) {
          spans.back().first = it->begin;
        } else {
          spans.emplace_back(it->begin, it->end);
        }
        previous_match = it->is_match;
      }
      std::reverse(spans.begin(), spans.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      bool first = true;
      for (const Piece& p : pieces) {
        if (!first && p.is_match == previous_match) {
          spans.back().second = p.end;
        } else {
          spans.emplace_back(p.begin, p.end);
        }
        previous_match = p.is_match;
        first = false;
      }
      break;
    }
  }
  for (const auto& [b, e] : spans) {
    if (e > b) out.push_back(text.substr(b, e - b));
  }
}

}  // namespace

const std::array<std::string, 256>& byte_level_alphabet() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    const auto cps = byte_to_code_point();
    for (int b = 0; b < 256; ++b) utf8::append(t[b], cps[b]);
    return t;
  }();
  return table;
}

int byte_level_byte(char32_t cp) {
  static const std::array<int16_t, 512> inverse = [] {
    std::array<int16_t, 512> inv;
    inv.fill(-1);
    const auto cps = byte_to_code_point();
    for (int b = 0; b < 256; ++b) inv[cps[b]] = static_cast<int16_t>(b);
    return inv;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

// ---- Normalizer ------------------------------------------------------------------------

std::unique_ptr<Normalizer> Normalizer::from_json(const nlohmann::json& j,
                                                  const std::string& where) {
  auto n = std::make_unique<Normalizer>();
  if (!j.is_null()) n->add(j, where);
  return n;
}

void Normalizer::add(const nlohmann::json& j, const std::string& where) {
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    const nlohmann::json& list = field(j, "normalizers", where);
    TANDEM_CHECK_KIND(kInvalidArgument, list.is_array(), where, ".normalizers: expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      add(list[i], where + ".normalizers[" + std::to_string(i) + "]");
    }
  } else if (type == "NFC") {
    steps_.push_back(Step::kNfc);
  } else if (type == "NFD") {
    steps_.push_back(Step::kNfd);
  } else if (type == "NFKC") {
    steps_.push_back(Step::kNfkc);
  } else if (type == "NFKD") {
    steps_.push_back(Step::kNfkd);
  } else if (type == "Lowercase") {
    steps_.push_back(Step::kLowercase);
  } else {
    TANDEM_THROW(kUnsupported, where, ".type: normalizer '", type,
                 "' is not supported (supported: Sequence, NFC, NFD, NFKC, NFKD, Lowercase)");
  }
}

std::string Normalizer::normalize(std::string_view text) const {
  std::string current(text);
  for (Step step : steps_) {
    if (step == Step::kLowercase) {
      std::string lowered;
      lowered.reserve(current.size());
      size_t pos = 0;
      while (pos < current.size()) {
        utf8::append(lowered, static_cast<char32_t>(utf8proc_tolower(
                                  static_cast<utf8proc_int32_t>(utf8::next(current, &pos)))));
      }
      current = std::move(lowered);
      continue;
    }
    if (utf8::is_ascii(current)) continue;  // every normal form of ASCII is itself
    int options = UTF8PROC_STABLE;
    switch (step) {
      case Step::kNfc: options |= UTF8PROC_COMPOSE; break;
      case Step::kNfd: options |= UTF8PROC_DECOMPOSE; break;
      case Step::kNfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
      case Step::kNfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
      case Step::kLowercase: break;
    }
    utf8proc_uint8_t* out = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(current.data()),
                     static_cast<utf8proc_ssize_t>(current.size()), &out,
                     static_cast<utf8proc_option_t>(options));
    TANDEM_CHECK_KIND(kInvalidArgument, n >= 0,
                      "unicode normalization failed: ", utf8proc_errmsg(n));
    current.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
    std::free(out);
  }
  return current;
}

// ---- PreTokenizer ----------------------------------------------------------------------

struct PreTokenizer::Step {
  enum class Kind { kSplitRegex, kSplitString, kByteLevel, kDigits } kind;
  std::unique_ptr<Regex> regex;  // kSplitRegex, kByteLevel with use_regex
  std::string literal;           // kSplitString
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;   // kByteLevel
  bool individual_digits = false;  // kDigits
};

PreTokenizer::PreTokenizer() = default;
PreTokenizer::~PreTokenizer() = default;

std::unique_ptr<PreTokenizer> PreTokenizer::from_json(const nlohmann::json& j,
                                                      const std::string& where) {
  std::unique_ptr<PreTokenizer> p(new PreTokenizer());
  if (!j.is_null()) p->add(j, where);
  return p;
}

void PreTokenizer::add(const nlohmann::json& j, const std::string& where) {
  const std::string type = type_of(j, where);
  if (type == "Sequence") {
    const nlohmann::json& list = field(j, "pretokenizers", where);
    TANDEM_CHECK_KIND(kInvalidArgument, list.is_array(), where,
                      ".pretokenizers: expected an array");
    for (size_t i = 0; i < list.size(); ++i) {
      add(list[i], where + ".pretokenizers[" + std::to_string(i) + "]");
    }
  } else if (type == "Split") {
    Step step;
    const nlohmann::json& pattern = field(j, "pattern", where);
    TANDEM_CHECK_KIND(kInvalidArgument, pattern.is_object(), where,
                      ".pattern: expected an object with 'Regex' or 'String'");
    if (auto it = pattern.find("Regex"); it != pattern.end() && it->is_string()) {
      step.kind = Step::Kind::kSplitRegex;
      try {
        step.regex = std::make_unique<Regex>(it->get<std::string>());
      } catch (const Error& e) {
        TANDEM_THROW(kInvalidArgument, where, ".pattern.Regex: ", e.message());
      }
    } else if (auto it2 = pattern.find("String"); it2 != pattern.end() && it2->is_string()) {
      step.kind = Step::Kind::kSplitString;
      step.literal = it2->get<std::string>();
      TANDEM_CHECK_KIND(kInvalidArgument, !step.literal.empty(), where,
                        ".pattern.String: must not be empty");
    } else {
      TANDEM_THROW(kInvalidArgument, where, ".pattern: expected a 'Regex' or 'String' string");
    }
    const nlohmann::json& behavior = field(j, "behavior", where);
    TANDEM_CHECK_KIND(kInvalidArgument, behavior.is_string(), where,
                      ".behavior: expected a string");
    const std::string b = behavior.get<std::string>();
    if (b == "Removed") {
      step.behavior = SplitBehavior::kRemoved;
    } else if (b == "Isolated") {
      step.behavior = SplitBehavior::kIsolated;
    } else if (b == "MergedWithPrevious") {
      step.behavior = SplitBehavior::kMergedWithPrevious;
    } else if (b == "MergedWithNext") {
      step.behavior = SplitBehavior::kMergedWithNext;
    } else if (b == "Contiguous") {
      step.behavior = SplitBehavior::kContiguous;
    } else {
      TANDEM_THROW(kInvalidArgument, where, ".behavior: unknown split behavior '", b, "'");
    }
    step.invert = bool_field(j, "invert", false, where);
    steps_.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    Step step;
    step.kind = Step::Kind::kByteLevel;
    step.add_prefix_space = bool_field(j, "add_prefix_space", true, where);
    if (bool_field(j, "use_regex", true, where)) {
      step.regex = std::make_unique<Regex>(kGpt2Pattern);
    }
    has_byte_level_ = true;
    steps_.push_back(std::move(step));
  } else if (type == "Digits") {
    Step step;
    step.kind = Step::Kind::kDigits;
    step.individual_digits = bool_field(j, "individual_digits", false, where);
    steps_.push_back(std::move(step));
  } else {
    TANDEM_THROW(kUnsupported, where, ".type: pre-tokenizer '", type,
                 "' is not supported (supported: Sequence, Split, ByteLevel, Digits)");
  }
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& words,
                         std::deque<std::string>& storage) const {
  std::vector<std::string_view> current{text};
  std::vector<std::string_view> next;
  std::vector<std::pair<size_t, size_t>> found;
  for (const Step& step : steps_) {
    next.clear();
    for (std::string_view piece : current) {
      found.clear();
      switch (step.kind) {
        case Step::Kind::kSplitRegex:
          step.regex->find_all(piece, found);
          split_by_matches(piece, found, step.behavior, step.invert, next);
          break;
        case Step::Kind::kSplitString: {
          size_t pos = 0;
          while ((pos = piece.find(step.literal, pos)) != std::string_view::npos) {
            found.emplace_back(pos, pos + step.literal.size());
            pos += step.literal.size();
          }
          split_by_matches(piece, found, step.behavior, step.invert, next);
          break;
        }
        case Step::Kind::kByteLevel: {
          std::string_view word = piece;
          if (step.add_prefix_space && (word.empty() || word.front() != ' ')) {
            storage.push_back(" " + std::string(word));
            word = storage.back();
          }
          if (step.regex) {
            step.regex->find_all(word, found);
            split_by_matches(word, found, SplitBehavior::kIsolated, false, next);
          } else if (!word.empty()) {
            next.push_back(word);
          }
          break;
        }
        case Step::Kind::kDigits: {
          size_t pos = 0;
          while (pos < piece.size()) {
            const size_t begin = pos;
            const char32_t cp = utf8::next(piece, &pos);
            const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(cp));
            if (cat == UTF8PROC_CATEGORY_ND || cat == UTF8PROC_CATEGORY_NL ||
                cat == UTF8PROC_CATEGORY_NO) {
              found.emplace_back(begin, pos);
            }
          }
          if (!step.individual_digits) {
            // Merge adjacent digit matches into runs.
            std::vector<std::pair<size_t, size_t>> runs;
            for (const auto& m : found) {
              if (!runs.empty() && runs.back().second == m.first) {
                runs.back().second = m.second;
              } else {
                runs.push_back(m);
              }
            }
            found.swap(runs);
          }
          split_by_matches(piece, found, SplitBehavior::kIsolated, false, next);
          break;
        }
      }
    }
    current.swap(next);
  }
  for (std::string_view w : current) {
    if (!w.empty()) words.push_back(w);
  }
}

}  // namespace tandem
