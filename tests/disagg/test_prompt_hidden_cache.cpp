// PromptHiddenCache (src/disagg/prompt_hidden_cache.h): the prompt pages' hidden states a
// prefill kept fill in the pages a later prompt's prefix-cache hit skipped, as far back as every
// page is kept; the budget evicts the least recently used; other tokens find nothing.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "disagg/prompt_hidden_cache.h"

namespace tandem {
namespace {

constexpr int64_t kPage = 4, kHidden = 3;

// Rows of positions [begin, end) of a prompt: a function of the tokens up to each position, as
// a model's hidden states are.
std::vector<float> rows_of(const std::vector<int32_t>& prompt, int64_t begin, int64_t end) {
  std::vector<float> rows;
  float acc = 0;
  for (int64_t t = 0; t < end; ++t) {
    acc = acc * 0.5f + static_cast<float>(prompt[static_cast<size_t>(t)]);
    for (int64_t j = 0; t >= begin && j < kHidden; ++j) rows.push_back(acc + 0.25f * j);
  }
  return rows;
}

std::vector<int32_t> tokens(int64_t n, int32_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::mt19937 gen(static_cast<uint32_t>(seed));
  for (auto& x : t) x = static_cast<int32_t>(gen() % 1000);
  return t;
}

TEST(PromptHiddenCache, FillsTheHitPagesFromAnEarlierPrompt) {
  PromptHiddenCache cache(kPage, kHidden, 1 << 20);
  const std::vector<int32_t> a = tokens(14, 1);  // 3 full pages and 2 tokens
  transfer::PromptHidden ha{0, rows_of(a, 0, 14)};
  EXPECT_EQ(cache.complete(a, ha), 0);
  EXPECT_EQ(ha.begin, 0);
  EXPECT_EQ(cache.pages(), 3);
  // b shares a's first 2 pages; its prefill computed positions 8.. (a 2-page hit).
  std::vector<int32_t> b(a.begin(), a.begin() + 8);
  for (int32_t t : tokens(9, 2)) b.push_back(t);
  transfer::PromptHidden hb{8, rows_of(b, 8, 17)};
  EXPECT_EQ(cache.complete(b, hb), 8);
  EXPECT_EQ(hb.begin, 0);
  EXPECT_EQ(hb.rows, rows_of(b, 0, 17));
  EXPECT_EQ(cache.pages(), 5);  // b's pages 2 and 3 too
  // A prompt whose first page differs finds nothing before its computed rows.
  std::vector<int32_t> c = b;
  c[0] += 1;
  transfer::PromptHidden hc{8, rows_of(c, 8, 17)};
  EXPECT_EQ(cache.complete(c, hc), 0);
  EXPECT_EQ(hc.begin, 8);
  // Rows that do not start on a page boundary are left alone.
  transfer::PromptHidden hd{6, rows_of(b, 6, 17)};
  EXPECT_EQ(cache.complete(b, hd), 0);
  EXPECT_EQ(hd.begin, 6);
}

TEST(PromptHiddenCache, BudgetEvictsTheLeastRecentAndFillsBackToTheFirstMissing) {
  const int64_t page_bytes = kPage * kHidden * static_cast<int64_t>(sizeof(float));
  PromptHiddenCache cache(kPage, kHidden, 3 * page_bytes);  // 3 pages
  const std::vector<int32_t> a = tokens(16, 3);             // 4 pages: page 0 evicted
  transfer::PromptHidden ha{0, rows_of(a, 0, 16)};
  cache.complete(a, ha);
  EXPECT_EQ(cache.pages(), 3);
  EXPECT_EQ(cache.bytes(), 3 * page_bytes);
  // A hit of pages 0..2: pages 1 and 2 are kept, page 0 is not: rows from position 4.
  std::vector<int32_t> b(a.begin(), a.begin() + 12);
  b.push_back(7);
  transfer::PromptHidden hb{12, rows_of(b, 12, 13)};
  EXPECT_EQ(cache.complete(b, hb), 8);
  EXPECT_EQ(hb.begin, 4);
  EXPECT_EQ(hb.rows, rows_of(b, 4, 13));
  // No budget: nothing kept.
  PromptHiddenCache none(kPage, kHidden, 0);
  transfer::PromptHidden h0{0, rows_of(a, 0, 16)};
  none.complete(a, h0);
  EXPECT_EQ(none.pages(), 0);
}

TEST(PromptHiddenCache, RefusesRowsThatDoNotEndAtThePrompt) {
  PromptHiddenCache cache(kPage, kHidden, 1 << 20);
  const std::vector<int32_t> a = tokens(8, 4);
  transfer::PromptHidden h{2, rows_of(a, 2, 7)};
  EXPECT_THROW(cache.complete(a, h), Error);
  EXPECT_THROW(PromptHiddenCache(0, kHidden, 1), Error);
}

}  // namespace
}  // namespace tandem
