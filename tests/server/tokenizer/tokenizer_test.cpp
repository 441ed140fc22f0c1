// Tokenizer tests: golden encode/decode cases from Hugging Face tokenizers (Qwen3's real
// tokenizer and a small byte-level BPE with pipeline variants), linear scaling, and load errors.
#include "server/tokenizer/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>

#include "core/error.h"
#include "tokenizer_test_util.h"

namespace tandem {
namespace {

using testing::load_fixture;

constexpr int kMaxReportedMismatches = 10;

std::vector<int32_t> ids_of(const nlohmann::ordered_json& j) {
  return j.get<std::vector<int32_t>>();
}

// Checks one fixture case ({text, ids, ids_no_special, decoded, decoded_skip_special}).
// Returns false on a mismatch.
bool check_case(const Tokenizer& tok, const nlohmann::ordered_json& c) {
  const std::string text = c["text"].get<std::string>();
  SCOPED_TRACE("text: " + nlohmann::json(text).dump());
  const auto expected = ids_of(c["ids"]);
  const auto ids = tok.encode(text);
  EXPECT_EQ(ids, expected);
  EXPECT_EQ(tok.encode(text, /*parse_special=*/false), ids_of(c["ids_no_special"]));
  EXPECT_EQ(tok.decode(expected), c["decoded"].get<std::string>());
  EXPECT_EQ(tok.decode(expected, /*skip_special=*/true),
            c["decoded_skip_special"].get<std::string>());
  return !::testing::Test::HasFailure();
}

// A fresh, empty temporary directory removed at scope exit.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("tandem_tok_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
  }

 private:
  std::filesystem::path path_;
};

const nlohmann::ordered_json& mini_fixture() {
  static const nlohmann::ordered_json j = load_fixture("mini_bpe_cases.json");
  return j;
}

// The mini tokenizer.json with one variant's pre_tokenizer and normalizer.
std::string mini_json(const nlohmann::ordered_json& variant) {
  nlohmann::ordered_json j = mini_fixture()["tokenizer_json"];
  j["pre_tokenizer"] = variant["pre_tokenizer"];
  j["normalizer"] = variant["normalizer"];
  return j.dump();
}

// The fastest of three runs of `fn`, in milliseconds.
template <class Fn>
double fastest_ms(Fn&& fn) {
  double best = 1e300;
  for (int i = 0; i < 3; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    best = std::min(
        best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                  .count());
  }
  return best;
}

// Pseudo-English text with many distinct words, numbers and punctuation.
std::string english_text(size_t bytes) {
  static const char* kSyllables[] = {"the", "an",    "ing",  "con", "ver",   "sa",   "tion",
                                     "pro", "cess",  "data", "mod", "el",    "serv", "er",
                                     "to",  "ken",   "ize",  "re",  "quest", "ly",   "un",
                                     "der", "stand", "al",   "go",  "rithm"};
  std::mt19937 rng(7);
  std::string out;
  out.reserve(bytes + 64);
  while (out.size() < bytes) {
    const int syllables = 1 + static_cast<int>(rng() % 4);
    std::string word;
    for (int i = 0; i < syllables; ++i) word += kSyllables[rng() % std::size(kSyllables)];
    if (rng() % 9 == 0) word[0] = static_cast<char>(word[0] - 32);
    if (rng() % 17 == 0) word = std::to_string(rng() % 100000);
    if (rng() % 23 == 0) word += "'s";
    out += word;
    switch (rng() % 12) {
      case 0: out += ", "; break;
      case 1: out += ". "; break;
      case 2: out += rng() % 5 == 0 ? ".\n\n" : "\n"; break;
      default: out += " ";
    }
  }
  return out;
}

// ---- Qwen3 (real tokenizer files; see tools/fetch_qwen3_tokenizer.sh) ----

TEST(Qwen3Tokenizer, EncodeAndDecodeMatchHuggingFace) {
  TANDEM_REQUIRE_QWEN3(tok);
  const auto fixture = load_fixture("qwen3_tokenizer_cases.json");
  int mismatches = 0;
  for (const auto& c : fixture["cases"]) {
    if (!check_case(*tok, c) && ++mismatches >= kMaxReportedMismatches) break;
  }
  EXPECT_GE(fixture["cases"].size(), 300u);
}

TEST(Qwen3Tokenizer, DecodeMatchesHuggingFace) {
  TANDEM_REQUIRE_QWEN3(tok);
  const auto fixture = load_fixture("qwen3_tokenizer_cases.json");
  for (const auto& c : fixture["decode_cases"]) {
    const auto ids = ids_of(c["ids"]);
    SCOPED_TRACE("ids: " + c["ids"].dump());
    EXPECT_EQ(tok->decode(ids), c["text"].get<std::string>());
    EXPECT_EQ(tok->decode(ids, true), c["text_skip_special"].get<std::string>());
  }
}

TEST(Qwen3Tokenizer, MetadataMatchesTransformers) {
  TANDEM_REQUIRE_QWEN3(tok);
  const auto fixture = load_fixture("qwen3_tokenizer_cases.json")["tokenizer"];
  EXPECT_EQ(tok->vocab_size(), fixture["vocab_size"].get<int64_t>());
  EXPECT_EQ(tok->eos_token().value_or(""), fixture["eos_token"].get<std::string>());
  EXPECT_EQ(tok->pad_token().value_or(""), fixture["pad_token"].get<std::string>());
  EXPECT_FALSE(tok->bos_token().has_value());
  EXPECT_EQ(tok->eos_token_id(), 151645);
  EXPECT_EQ(nlohmann::json(tok->special_tokens_map()),
            nlohmann::json(fixture["special_tokens_map"]));
  EXPECT_EQ(tok->special_token_ids(), fixture["special_ids"].get<std::vector<int32_t>>());
  for (const auto& [token, id] : fixture["token_to_id"].items()) {
    EXPECT_EQ(tok->token_to_id(token), id.get<int32_t>()) << token;
    EXPECT_EQ(tok->id_to_token(id.get<int32_t>()), token);
  }
  EXPECT_TRUE(tok->is_special(151644));   // <|im_start|>
  EXPECT_FALSE(tok->is_special(151667));  // <think> is added but not special
  EXPECT_EQ(tok->id_to_token(-1), "");
  EXPECT_EQ(tok->id_to_token(1 << 30), "");
  const auto chat = load_fixture("chat_template_cases.json");
  EXPECT_EQ(tok->chat_template(), chat["templates"]["qwen3"].get<std::string>());
}

TEST(Qwen3Tokenizer, EncodesOneMegabyteOfEnglishInLinearTime) {
  TANDEM_REQUIRE_QWEN3(tok);
  const std::string text = english_text(1 << 20);
  const auto ids = tok->encode(text);
  EXPECT_GT(ids.size(), text.size() / 8);
  EXPECT_EQ(tok->decode(ids), text);
  // No wall-clock bound (sanitizer builds and loaded CI machines vary); the cost of a 4x
  // longer input must stay linear: a quadratic merge loop would cost 16x.
  const std::string quarter = english_text(1 << 18);
  const double small_ms = fastest_ms([&] { (void)tok->encode(quarter); });
  const double large_ms = fastest_ms([&] { (void)tok->encode(text); });
  EXPECT_LT(large_ms, 8.0 * small_ms + 20.0)
      << small_ms << " ms for 256 KiB, " << large_ms << " ms for 1 MiB";
  std::printf("[ info     ] Qwen3 encode: %.1f ms for 256 KiB, %.1f ms for 1 MiB (%zu tokens)\n",
              small_ms, large_ms, ids.size());
}

// ---- mini byte-level BPE (committed fixture) ----

TEST(MiniBpeTokenizer, AllPipelineVariantsMatchHuggingFace) {
  for (const auto& variant : mini_fixture()["variants"]) {
    SCOPED_TRACE("variant " + variant["name"].get<std::string>());
    const auto tok = Tokenizer::from_json(mini_json(variant));
    int mismatches = 0;
    for (const auto& c : variant["cases"]) {
      if (!check_case(*tok, c) && ++mismatches >= kMaxReportedMismatches) break;
    }
  }
}

TEST(MiniBpeTokenizer, LongWordsAreNotQuadratic) {
  const auto tok = Tokenizer::from_json(mini_json(mini_fixture()["variants"][0]));
  std::mt19937 rng(3);
  std::string word;
  static const char kLetters[] = "abcdeghijklmnopqrstuvwyz";  // no "fix": an added token
  for (int i = 0; i < 300000; ++i) word.push_back(kLetters[rng() % (sizeof(kLetters) - 1)]);
  const auto ids = tok->encode(word);
  EXPECT_EQ(tok->decode(ids), " " + word);  // this variant adds a prefix space
  // Linear, not quadratic, in the word's length: 4x the letters must cost well under 16x.
  const std::string quarter = word.substr(0, word.size() / 4);
  const double small_ms = fastest_ms([&] { (void)tok->encode(quarter); });
  const double large_ms = fastest_ms([&] { (void)tok->encode(word); });
  EXPECT_LT(large_ms, 8.0 * small_ms + 20.0) << small_ms << " ms vs " << large_ms << " ms";
  const std::string spaces(200000, ' ');
  EXPECT_EQ(tok->decode(tok->encode(spaces + "x")), spaces + "x");
}

TEST(MiniBpeTokenizer, IllFormedUtf8IsReplacedBeforeEncoding) {
  const auto tok = Tokenizer::from_json(mini_json(mini_fixture()["variants"][0]));
  EXPECT_EQ(tok->encode("a\xff"
                        "b\xe2\x82"),
            tok->encode("a\xEF\xBF\xBD"
                        "b\xEF\xBF\xBD"));
}

TEST(MiniBpeTokenizer, VocabularyAccessors) {
  const auto tok = Tokenizer::from_json(mini_json(mini_fixture()["variants"][0]));
  const auto eot = tok->token_to_id("<|endoftext|>");
  ASSERT_TRUE(eot.has_value());
  EXPECT_TRUE(tok->is_special(*eot));
  EXPECT_EQ(tok->id_to_token(*eot), "<|endoftext|>");
  const auto g = tok->token_to_id("\xC4\xA0");  // "Ġ", the space byte
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(tok->token_bytes(*g), " ");
  EXPECT_FALSE(tok->token_to_id("definitely-not-a-token").has_value());
  EXPECT_EQ(tok->decode(std::vector<int32_t>{-5, 1 << 29}), "");  // unknown ids are skipped
  bool found_tag = false;
  for (const AddedToken& t : tok->added_tokens()) {
    if (t.content == "<tag>") {
      found_tag = true;
      EXPECT_TRUE(t.single_word);
      EXPECT_FALSE(t.special);
    }
  }
  EXPECT_TRUE(found_tag);
}

// ---- loading and errors ----

template <typename F>
void expect_error(F&& f, ErrorKind kind, std::initializer_list<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& fragment : fragments) {
      EXPECT_NE(e.message().find(fragment), std::string::npos)
          << "'" << fragment << "' not in: " << e.message();
    }
  }
}

TEST(TokenizerLoading, FromDirWithoutTokenizerJsonReturnsNull) {
  TempDir dir;
  EXPECT_EQ(Tokenizer::from_dir(dir.path().string()), nullptr);
  EXPECT_EQ(Tokenizer::from_dir((dir.path() / "missing").string()), nullptr);
}

TEST(TokenizerLoading, FromDirReadsConfigAndChatTemplateFile) {
  TempDir dir;
  dir.write("tokenizer.json", mini_json(mini_fixture()["variants"][0]));
  dir.write(
      "tokenizer_config.json",
      R"({"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "<|endoftext|>",
                "pad_token": null, "model_max_length": 4096,
                "chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]})");
  auto tok = Tokenizer::from_dir(dir.path().string());
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_token().value_or(""), "<s>");
  EXPECT_EQ(tok->eos_token().value_or(""), "<|endoftext|>");
  EXPECT_FALSE(tok->pad_token().has_value());
  EXPECT_EQ(tok->model_max_length(), 4096);
  EXPECT_EQ(tok->chat_template(), "D");
  EXPECT_EQ(tok->named_chat_template("tool_use").value_or(""), "T");
  EXPECT_EQ(tok->special_tokens_map().dump(), R"({"bos_token":"<s>","eos_token":"<|endoftext|>"})");
  dir.write("chat_template.jinja", "J{{ x }}");
  tok = Tokenizer::from_dir(dir.path().string());
  EXPECT_EQ(tok->chat_template(), "J{{ x }}");
}

TEST(TokenizerLoading, MalformedJsonNamesTheFile) {
  TempDir dir;
  dir.write("tokenizer.json", "{\"model\": [1, 2,");
  expect_error([&] { Tokenizer::from_dir(dir.path().string()); }, ErrorKind::kIo,
               {"tokenizer.json", "malformed JSON"});
  dir.write("tokenizer.json", mini_json(mini_fixture()["variants"][0]));
  dir.write("tokenizer_config.json", "not json");
  expect_error([&] { Tokenizer::from_dir(dir.path().string()); }, ErrorKind::kIo,
               {"tokenizer_config.json", "malformed JSON"});
  dir.write("tokenizer_config.json", R"({"eos_token": 5})");
  expect_error([&] { Tokenizer::from_dir(dir.path().string()); }, ErrorKind::kInvalidArgument,
               {"tokenizer_config.json", "eos_token"});
}

TEST(TokenizerLoading, MalformedFieldsAreNamed) {
  const nlohmann::ordered_json base =
      nlohmann::ordered_json::parse(mini_json(mini_fixture()["variants"][0]));
  auto with = [&](auto&& edit) {
    nlohmann::ordered_json j = base;
    edit(j);
    return j.dump();
  };
  expect_error([&] { Tokenizer::from_json(with([](auto& j) {
                       j["model"]["vocab"] = {1, 2};
                     })); },
               ErrorKind::kInvalidArgument, {"tokenizer.json", "model.vocab"});
  expect_error([&] { Tokenizer::from_json(with([](auto& j) { j["model"].erase("merges"); })); },
               ErrorKind::kInvalidArgument, {"model", "merges"});
  expect_error(
      [&] { Tokenizer::from_json(with([](auto& j) { j["model"]["merges"][1] = "nospace"; })); },
      ErrorKind::kInvalidArgument, {"model.merges[1]"});
  expect_error(
      [&] { Tokenizer::from_json(with([](auto& j) { j["model"]["merges"][2] = "zzz qqq"; })); },
      ErrorKind::kInvalidArgument, {"model.merges[2]", "missing from model.vocab"});
  expect_error(
      [&] { Tokenizer::from_json(with([](auto& j) { j["model"]["vocab"]["x"] = "seven"; })); },
      ErrorKind::kInvalidArgument, {"model.vocab[\"x\"]"});
  expect_error(
      [&] { Tokenizer::from_json(with([](auto& j) { j["model"]["type"] = "WordPiece"; })); },
      ErrorKind::kUnsupported, {"model.type"});
  expect_error(
      [&] {
        Tokenizer::from_json(with([](auto& j) { j["normalizer"] = {{"type", "Precompiled"}}; }));
      },
      ErrorKind::kUnsupported, {"normalizer", "Precompiled"});
  expect_error(
      [&] {
        Tokenizer::from_json(with([](auto& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }));
      },
      ErrorKind::kUnsupported, {"pre_tokenizer", "Metaspace"});
  expect_error(
      [&] {
        Tokenizer::from_json(with([](auto& j) {
          j["pre_tokenizer"] = {{"type", "Sequence"},
                                {"pretokenizers",
                                 {{{"type", "Split"},
                                   {"pattern", {{"Regex", "(unclosed"}}},
                                   {"behavior", "Isolated"}},
                                  {{"type", "ByteLevel"}}}}};
        }));
      },
      ErrorKind::kInvalidArgument, {"pre_tokenizer.pretokenizers[0].pattern.Regex", "(unclosed"});
  expect_error(
      [&] {
        Tokenizer::from_json(with([](auto& j) {
          j["pre_tokenizer"] = {
              {"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Sideways"}};
        }));
      },
      ErrorKind::kInvalidArgument, {"behavior", "Sideways"});
  expect_error(
      [&] {
        Tokenizer::from_json(with([](auto& j) { j["decoder"] = {{"type", "WordPiece"}}; }));
      },
      ErrorKind::kUnsupported, {"decoder"});
  expect_error(
      [&] { Tokenizer::from_json(with([](auto& j) { j["added_tokens"][0].erase("content"); })); },
      ErrorKind::kInvalidArgument, {"added_tokens[0].content"});
  expect_error([&] { Tokenizer::from_json("[]"); }, ErrorKind::kInvalidArgument,
               {"expected a JSON object"});
}

}  // namespace
}  // namespace tandem
