#include "server/tokenizer/bpe.h"

#include <mutex>
#include <queue>

#include "core/error.h"
#include "server/tokenizer/pre_tokenizer.h"

namespace tandem {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

std::unique_ptr<BpeModel> BpeModel::from_json(const nlohmann::json& model,
                                              const std::string& where) {
  const std::string at = where + ": model";
  TANDEM_CHECK_KIND(kInvalidArgument, model.is_object(), at, ": expected an object");
  auto type = model.find("type");
  if (type != model.end()) {
    TANDEM_CHECK_KIND(kUnsupported, type->is_string() && type->get<std::string>() == "BPE", at,
                      ".type: only BPE models are supported, got ", type->dump());
  }
  auto dropout = model.find("dropout");
  TANDEM_CHECK_KIND(kUnsupported,
                    dropout == model.end() || dropout->is_null() ||
                        (dropout->is_number() && dropout->get<double>() == 0.0),
                    at, ".dropout: BPE dropout is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    auto it = model.find(key);
    TANDEM_CHECK_KIND(
        kUnsupported,
        it == model.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty()),
        at, ".", key, ": non-empty values are not supported");
  }
  auto byte_fallback = model.find("byte_fallback");
  TANDEM_CHECK_KIND(kUnsupported,
                    byte_fallback == model.end() || byte_fallback->is_null() ||
                        (byte_fallback->is_boolean() && !byte_fallback->get<bool>()),
                    at, ".byte_fallback: byte fallback is not supported");

  std::unique_ptr<BpeModel> m(new BpeModel());
  if (auto it = model.find("ignore_merges"); it != model.end() && it->is_boolean()) {
    m->ignore_merges_ = it->get<bool>();
  }

  auto vocab_it = model.find("vocab");
  TANDEM_CHECK_KIND(kInvalidArgument, vocab_it != model.end(), at, ": missing field 'vocab'");
  TANDEM_CHECK_KIND(kInvalidArgument, vocab_it->is_object(), at,
                    ".vocab: expected an object of token -> id");
  const nlohmann::json& vocab = *vocab_it;
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    TANDEM_CHECK_KIND(kInvalidArgument, it.value().is_number_integer(), at, ".vocab[\"", it.key(),
                      "\"]: expected an integer id");
    const int64_t id = it.value().get<int64_t>();
    TANDEM_CHECK_KIND(kInvalidArgument, id >= 0 && id < (int64_t{1} << 31), at, ".vocab[\"",
                      it.key(), "\"]: id ", id, " out of range");
    max_id = std::max(max_id, id);
  }
  m->id_to_token_.resize(static_cast<size_t>(max_id + 1));
  m->token_to_id_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    m->id_to_token_[id] = it.key();
    m->token_to_id_.emplace(it.key(), id);
  }

  const auto& alphabet = byte_level_alphabet();
  for (int b = 0; b < 256; ++b) {
    auto it = m->token_to_id_.find(alphabet[b]);
    m->byte_ids_[b] = it == m->token_to_id_.end() ? -1 : it->second;
  }
  if (auto unk = model.find("unk_token"); unk != model.end() && unk->is_string()) {
    m->unk_id_ = m->token_to_id(unk->get<std::string>());
  }

  auto merges_it = model.find("merges");
  TANDEM_CHECK_KIND(kInvalidArgument, merges_it != model.end(), at, ": missing field 'merges'");
  TANDEM_CHECK_KIND(kInvalidArgument, merges_it->is_array(), at, ".merges: expected an array");
  const nlohmann::json& merges = *merges_it;
  m->merges_.reserve(merges.size());
  std::string left, right;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const nlohmann::json& entry = merges[rank];
    if (entry.is_string()) {
      const std::string& s = entry.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      TANDEM_CHECK_KIND(kInvalidArgument,
                        space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                        at, ".merges[", rank, "]: expected \"left right\", got \"", s, "\"");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
               entry[1].is_string()) {
      left = entry[0].get<std::string>();
      right = entry[1].get<std::string>();
    } else {
      TANDEM_THROW(kInvalidArgument, at, ".merges[", rank,
                   "]: expected a \"left right\" string or a [left, right] pair");
    }
    const auto l = m->token_to_id(left);
    const auto r = m->token_to_id(right);
    const auto merged = m->token_to_id(left + right);
    TANDEM_CHECK_KIND(kInvalidArgument, l && r && merged, at, ".merges[", rank, "]: \"", left,
                      "\" + \"", right, "\" uses a token missing from model.vocab");
    m->merges_[pair_key(*l, *r)] = Merge{static_cast<int32_t>(rank), *merged};
  }
  return m;
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = token_to_id_.find(token);
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

const std::string& BpeModel::id_to_token(int32_t id) const {
  static const std::string no_token;
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) return no_token;
  return id_to_token_[id];
}

size_t BpeModel::cache_size() const {
  std::shared_lock lock(cache_mutex_);
  return cache_.size();
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(start), out.end());
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(std::string(word), std::move(ids));
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    std::string spelled;
    for (char c : word) spelled += byte_level_alphabet()[static_cast<uint8_t>(c)];
    if (auto id = token_to_id(spelled)) {
      out.push_back(*id);
      return;
    }
  }
  // Symbols form a doubly linked list; a min-heap of candidate merges ordered by
  // (rank, position) drives the merges, as in HF tokenizers' Word::merge_all.
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool alive;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (char c : word) {
    int32_t id = byte_ids_[static_cast<uint8_t>(c)];
    if (id < 0) {
      if (!unk_id_) continue;  // a byte missing from the vocabulary: HF drops it
      id = *unk_id_;
    }
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, n + 1, true});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Candidate> storage;
  storage.reserve(symbols.size());
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue(std::greater<>{},
                                                                               std::move(storage));
  auto push_pair = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    auto it = merges_.find(pair_key(symbols[pos].id, symbols[next].id));
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) push_pair(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    auto it = merges_.find(pair_key(left.id, right.id));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;  // stale entry
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

}  // namespace tandem
