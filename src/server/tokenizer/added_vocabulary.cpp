#include "server/tokenizer/added_vocabulary.h"

#include <utf8proc.h>

#include <algorithm>

#include "server/tokenizer/pre_tokenizer.h"
#include "server/tokenizer/utf8.h"

namespace tandem {
namespace {

bool is_word_char(char32_t cp) {
  if (cp == '_') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO: return true;
    default: return false;
  }
}

// Code point ending at byte offset `end` (end > 0) of well-formed text.
char32_t previous_char(std::string_view text, size_t end) {
  size_t begin = end - 1;
  while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
  return utf8::next(text, &begin);
}

}  // namespace

void AddedVocabulary::Trie::insert(std::string_view key, int32_t token) {
  if (key.empty()) return;
  if (nodes.empty()) nodes.emplace_back();
  first_byte[static_cast<uint8_t>(key[0])] = true;
  int32_t node = 0;
  for (char c : key) {
    const auto b = static_cast<uint8_t>(c);
    int32_t child = -1;
    for (const auto& [byte, index] : nodes[node].children) {
      if (byte == b) child = index;
    }
    if (child < 0) {
      child = static_cast<int32_t>(nodes.size());
      nodes[node].children.emplace_back(b, child);
      nodes.emplace_back();
    }
    node = child;
  }
  if (nodes[node].token < 0) nodes[node].token = token;  // first definition wins
}

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens, const Normalizer& normalizer)
    : tokens_(std::move(tokens)) {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const AddedToken& t = tokens_[i];
    if (t.normalized) {
      tries_[1].insert(normalizer.normalize(utf8::sanitize(t.content)), static_cast<int32_t>(i));
    } else {
      tries_[0].insert(t.content, static_cast<int32_t>(i));
    }
  }
}

void AddedVocabulary::split(std::string_view text, bool normalized_pass, bool parse_special,
                            std::vector<Piece>& out) const {
  const Trie& trie = tries_[normalized_pass ? 1 : 0];
  size_t plain_begin = 0;  // start of the plain text not yet emitted
  size_t pos = 0;
  while (pos < text.size() && !trie.nodes.empty()) {
    if (!trie.first_byte[static_cast<uint8_t>(text[pos])]) {
      ++pos;
      continue;
    }
    // Longest token starting at pos.
    int32_t best = -1;
    size_t best_end = 0;
    int32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      const auto b = static_cast<uint8_t>(text[i]);
      int32_t child = -1;
      for (const auto& [byte, index] : trie.nodes[node].children) {
        if (byte == b) {
          child = index;
          break;
        }
      }
      if (child < 0) break;
      node = child;
      if (trie.nodes[node].token >= 0) {
        best = trie.nodes[node].token;
        best_end = i + 1;
      }
    }
    if (best < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[best];
    size_t start = pos;
    size_t stop = best_end;
    pos = best_end;  // the matcher resumes after this match whether or not it is used
    if (token.special && !parse_special) continue;
    if (token.single_word) {
      const bool start_ok = start == 0 || !is_word_char(previous_char(text, start));
      size_t after = stop;
      const bool stop_ok = stop == text.size() || !is_word_char(utf8::next(text, &after));
      if (!start_ok || !stop_ok) continue;
    }
    if (token.lstrip) {
      while (start > plain_begin && utf8::is_white_space(previous_char(text, start))) {
        do {
          --start;
        } while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80);
      }
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t next = stop;
        if (!utf8::is_white_space(utf8::next(text, &next))) break;
        stop = next;
      }
      pos = std::max(pos, stop);
    }
    if (plain_begin < start) out.push_back({plain_begin, start, -1});
    out.push_back({start, stop, token.id});
    plain_begin = stop;
  }
  if (plain_begin < text.size()) out.push_back({plain_begin, text.size(), -1});
}

}  // namespace tandem
