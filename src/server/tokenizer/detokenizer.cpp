#include "server/tokenizer/detokenizer.h"

#include "server/tokenizer/tokenizer.h"
#include "server/tokenizer/utf8.h"

namespace tandem {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_(skip_special_tokens) {}

std::string IncrementalDetokenizer::add(int32_t id) {
  return add(std::span<const int32_t>(&id, 1));
}

std::string IncrementalDetokenizer::add(std::span<const int32_t> ids) {
  for (int32_t id : ids) {
    if (skip_special_ && tokenizer_->is_special(id)) continue;
    pending_ += tokenizer_->token_bytes(id);
  }
  std::string out;
  const size_t used = utf8::sanitize_prefix(pending_, out);
  pending_.erase(0, used);
  return out;
}

std::string IncrementalDetokenizer::flush() {
  std::string out = pending_.empty() ? std::string() : utf8::sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace tandem
