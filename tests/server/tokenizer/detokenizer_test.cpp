// Incremental detokenizer: concatenated output equals Tokenizer::decode, and every piece is
// well-formed UTF-8.
#include "server/tokenizer/detokenizer.h"

#include <gtest/gtest.h>

#include "server/tokenizer/utf8.h"
#include "tokenizer_test_util.h"

namespace tandem {
namespace {

using testing::load_fixture;

// Streams `ids` one at a time; checks each piece and returns the concatenation.
std::string stream(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special) {
  IncrementalDetokenizer detok(tok, skip_special);
  std::string all;
  for (int32_t id : ids) {
    const std::string piece = detok.add(id);
    EXPECT_TRUE(utf8::is_valid(piece)) << "ill-formed piece after id " << id;
    EXPECT_LE(detok.pending_bytes(), 3u);
    all += piece;
  }
  const std::string tail = detok.flush();
  EXPECT_TRUE(utf8::is_valid(tail));
  EXPECT_EQ(detok.pending_bytes(), 0u);
  return all + tail;
}

void check_stream(const Tokenizer& tok, const std::vector<int32_t>& ids,
                  const std::string& expected, const std::string& expected_skip) {
  SCOPED_TRACE("ids: " + nlohmann::json(ids).dump());
  EXPECT_EQ(stream(tok, ids, false), expected);
  EXPECT_EQ(stream(tok, ids, true), expected_skip);
}

std::unique_ptr<Tokenizer> mini_tokenizer() {
  const auto fixture = load_fixture("mini_bpe_cases.json");
  nlohmann::ordered_json j = fixture["tokenizer_json"];
  return Tokenizer::from_json(j.dump());
}

TEST(IncrementalDetokenizer, Qwen3StreamsEqualHuggingFaceDecode) {
  TANDEM_REQUIRE_QWEN3(tok);
  const auto fixture = load_fixture("qwen3_tokenizer_cases.json");
  for (const auto& c : fixture["cases"]) {
    check_stream(*tok, c["ids"].get<std::vector<int32_t>>(), c["decoded"].get<std::string>(),
                 c["decoded_skip_special"].get<std::string>());
    if (HasFailure()) return;
  }
  // Id sequences that cut characters apart or are plain invalid UTF-8.
  for (const auto& c : fixture["decode_cases"]) {
    check_stream(*tok, c["ids"].get<std::vector<int32_t>>(), c["text"].get<std::string>(),
                 c["text_skip_special"].get<std::string>());
    if (HasFailure()) return;
  }
}

TEST(IncrementalDetokenizer, MiniTokenizerStreamsEqualDecode) {
  const auto tok = mini_tokenizer();
  const auto fixture = load_fixture("mini_bpe_cases.json");
  for (const auto& c : fixture["variants"][0]["cases"]) {
    const auto ids = c["ids"].get<std::vector<int32_t>>();
    check_stream(*tok, ids, tok->decode(ids), tok->decode(ids, true));
  }
}

TEST(IncrementalDetokenizer, HoldsBackPartialCharacters) {
  const auto tok = mini_tokenizer();
  const std::string emoji = "\xf0\x9f\x98\x80";  // U+1F600, not in the mini vocabulary
  std::vector<int32_t> bytes;
  for (unsigned char b : emoji) {
    int32_t found = -1;
    for (int32_t id = 0; id < tok->vocab_size() && found < 0; ++id) {
      if (tok->token_bytes(id) == std::string(1, static_cast<char>(b))) found = id;
    }
    ASSERT_GE(found, 0);
    bytes.push_back(found);
  }
  IncrementalDetokenizer detok(*tok);
  EXPECT_EQ(detok.add(bytes[0]), "");
  EXPECT_EQ(detok.pending_bytes(), 1u);
  EXPECT_EQ(detok.add(bytes[1]), "");
  EXPECT_EQ(detok.add(bytes[2]), "");
  EXPECT_EQ(detok.pending_bytes(), 3u);
  EXPECT_EQ(detok.add(bytes[3]), emoji);
  EXPECT_EQ(detok.pending_bytes(), 0u);

  // An unfinished character becomes U+FFFD at the end, like HF decode.
  EXPECT_EQ(detok.add(bytes[0]), "");
  EXPECT_EQ(detok.flush(), std::string(utf8::kReplacement));
  // A byte that can never start a character is replaced at once.
  EXPECT_EQ(detok.add(bytes[1]), std::string(utf8::kReplacement));
  // Several ids at once.
  EXPECT_EQ(detok.add(std::span<const int32_t>(bytes)), emoji);
}

TEST(IncrementalDetokenizer, SkipsSpecialTokensWhenAsked) {
  const auto tok = mini_tokenizer();
  const auto ids = tok->encode("a<|endoftext|>b");
  IncrementalDetokenizer keep(*tok, false);
  IncrementalDetokenizer skip(*tok, true);
  std::string kept, skipped;
  for (int32_t id : ids) {
    kept += keep.add(id);
    skipped += skip.add(id);
  }
  EXPECT_EQ(kept, tok->decode(ids));
  EXPECT_NE(kept.find("<|endoftext|>"), std::string::npos);
  EXPECT_EQ(skipped, tok->decode(ids, true));
  EXPECT_EQ(skipped.find("<|endoftext|>"), std::string::npos);
}

}  // namespace
}  // namespace tandem
