// Byte-level BPE model: vocabulary, ranked merges and the merge loop, with a word cache.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tandem {

/// Transparent string hash so maps keyed by std::string accept std::string_view look-ups.
struct StringHash {
  using is_transparent = void;  ///< enables heterogeneous look-up
  /// Hash of the bytes of `s`.
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

/// The "model" of tokenizer.json with type "BPE", over the byte-level alphabet.
class BpeModel {
 public:
  /// Builds from the "model" object. Accepts merges as "a b" strings or [a, b] pairs.
  /// `where` names the file for error messages (e.g. "tokenizer.json"). Throws
  /// Error(kInvalidArgument) naming the field for malformed input and Error(kUnsupported)
  /// for BPE options this implementation does not have (dropout, subword prefixes).
  static std::unique_ptr<BpeModel> from_json(const nlohmann::json& model, const std::string& where);

  /// Appends the token ids of one pre-tokenized word, given as raw bytes.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  /// One past the largest id of the model vocabulary.
  int64_t id_limit() const { return static_cast<int64_t>(id_to_token_.size()); }

  /// Id of a vocabulary token (byte-level spelling), if present.
  std::optional<int32_t> token_to_id(std::string_view token) const;

  /// Token string (byte-level spelling) of an id; empty for ids not in the vocabulary.
  const std::string& id_to_token(int32_t id) const;

  /// Number of cached words (for tests and metrics).
  size_t cache_size() const;

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  BpeModel() = default;
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  std::vector<std::string> id_to_token_;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_to_id_;
  std::unordered_map<uint64_t, Merge> merges_;  // key: (left id << 32) | right id
  std::array<int32_t, 256> byte_ids_{};         // id of each byte's single-character token
  std::optional<int32_t> unk_id_;
  bool ignore_merges_ = false;

  static constexpr size_t kCacheCapacity = 65536;
  static constexpr size_t kMaxCachedWordBytes = 128;
  mutable std::shared_mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace tandem
