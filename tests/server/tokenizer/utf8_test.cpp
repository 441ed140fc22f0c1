#include "server/tokenizer/utf8.h"

#include <gtest/gtest.h>

namespace tandem {
namespace {

const std::string R(utf8::kReplacement);

TEST(Utf8, SanitizeMatchesPythonReplaceErrors) {
  // Expected values are Python's bytes.decode("utf-8", "replace").
  EXPECT_EQ(utf8::sanitize("\xf0\x9f\x98"
                           "a"),
            R + "a");
  EXPECT_EQ(utf8::sanitize("\xe0\x80\x80"), R + R + R);
  EXPECT_EQ(utf8::sanitize("\xed\xa0\x80"), R + R + R);
  EXPECT_EQ(utf8::sanitize("\xf4\x90\x80\x80"), R + R + R + R);
  EXPECT_EQ(utf8::sanitize("\xc0\xaf"), R + R);
  EXPECT_EQ(utf8::sanitize("\xe2\x82"), R);
  EXPECT_EQ(utf8::sanitize("\xe2\x82"
                           "a"),
            R + "a");
  EXPECT_EQ(utf8::sanitize("\xf0\x9f\x98\x80"), "\xf0\x9f\x98\x80");
  EXPECT_EQ(utf8::sanitize("\xff\xfe"), R + R);
  EXPECT_EQ(utf8::sanitize("\x80"
                           "abc"),
            R + "abc");
  EXPECT_EQ(utf8::sanitize("\xf1\x80\x80\xc3\xa9"), R + "\xc3\xa9");
  EXPECT_EQ(utf8::sanitize(""), "");
}

TEST(Utf8, SanitizePrefixHoldsBackOnlyIncompleteCharacters) {
  std::string out;
  EXPECT_EQ(utf8::sanitize_prefix("ab\xf0\x9f", out), 2u);
  EXPECT_EQ(out, "ab");
  out.clear();
  EXPECT_EQ(utf8::sanitize_prefix("\xf0\x9f"
                                  "a",
                                  out),
            3u);  // known bad: replaced at once
  EXPECT_EQ(out, R + "a");
  out.clear();
  EXPECT_EQ(utf8::sanitize_prefix("\xe0\x80", out), 2u);  // E0 80 can never be valid
  EXPECT_EQ(out, R + R);
}

TEST(Utf8, ValidityAndCodePoints) {
  EXPECT_TRUE(utf8::is_valid("h\xc3\xa9llo \xe4\xbd\xa0 \xf0\x9f\x98\x80"));
  EXPECT_FALSE(utf8::is_valid("\xed\xa0\x80"));
  EXPECT_FALSE(utf8::is_valid("\xc3"));
  EXPECT_EQ(utf8::length("h\xc3\xa9\xf0\x9f\x98\x80"), 3u);
  EXPECT_EQ(utf8::from_u32(utf8::to_u32("a\xc3\xa9\xf0\x9f\x98\x80")), "a\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_TRUE(utf8::is_python_space(0x1C));
  EXPECT_FALSE(utf8::is_white_space(0x1C));
  EXPECT_TRUE(utf8::is_white_space(0x3000));
  EXPECT_FALSE(utf8::is_python_space(0x200B));
}

}  // namespace
}  // namespace tandem
