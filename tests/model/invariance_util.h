// Batch invariance of a model's forward (--deterministic, issue 15 item 6), shared by the CPU
// test (CI) and the GPU one: request A's logits rows (its prompt's last token, then one per
// teacher-forced decode token) must be bitwise the same
//   - alone (one prompt chunk, then one-token steps: on the GPU the bucket-1 graph),
//   - batched with random other sequences in every step (their prompt chunks of random sizes
//     and their decode tokens: mixed steps, pure decode steps of several batch sizes, A at a
//     random place in the batch),
//   - with A's prompt chunked at odd sizes (1-token chunks included),
//   - after a prefix-cache hit (A's first pages are another sequence's, A computes the rest),
// and the combinations. Bitwise-equal logits rows give equal tokens and logprobs whatever the
// sampler (a function of the row, the seed and the output position).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/forward_batch.h"
#include "model/model.h"

namespace tandem::testing {

struct InvarianceRequest {
  std::vector<int32_t> prompt;
  std::vector<int32_t> decode;  // fed one per step after the prompt (teacher forcing)
};

struct InvarianceSchedule {
  std::vector<int64_t> chunks;  // A's prompt chunk sizes (the rest in one chunk); empty: one
  int64_t others_max = 0;       // other sequences per step: uniform in [0, others_max]
  int64_t cached_pages = 0;     // pages of A's prompt taken from a donor (prefix-cache hit)
  uint64_t seed = 1;
};

// Runs request `r` on `model` under `sched` and returns A's logits rows, back to back.
inline std::vector<float> invariance_trace(Model& model, KvCache& kv, int64_t page_size,
                                           const InvarianceRequest& r,
                                           const InvarianceSchedule& sched) {
  const int64_t vocab = model.config().vocab_size;
  const int64_t num_pages = kv.geometry().num_pages;
  std::mt19937_64 rng(sched.seed);
  auto uniform = [&](int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int32_t next_page = 1;  // page 0 stays unused (a captured step's padding may read it)
  auto alloc_pages = [&](std::vector<int32_t>& table, int64_t tokens) {
    while (static_cast<int64_t>(table.size()) * page_size < tokens) {
      if (next_page >= num_pages) throw std::runtime_error("invariance_trace: KV cache too small");
      table.push_back(next_page++);
    }
  };
  struct Other {
    std::vector<int32_t> tokens, table;
    int64_t prompt = 0, pos = 0;  // prompt length, tokens in the KV
  };
  std::vector<Other> others;
  auto new_other = [&] {
    Other o;
    o.prompt = uniform(1, 70);
    for (int64_t i = 0; i < o.prompt + 24; ++i) {
      o.tokens.push_back(static_cast<int32_t>(uniform(0, vocab - 1)));
    }
    return o;
  };
  std::vector<float> logits, out;
  // One forward: A's item (tokens [start, start + n), logits kLast when `want`) with random
  // others around it. Returns A's logits row when wanted.
  std::vector<int32_t> a_tokens = r.prompt;
  a_tokens.insert(a_tokens.end(), r.decode.begin(), r.decode.end());
  std::vector<int32_t> a_table;
  auto step = [&](int64_t start, int64_t n, bool want) {
    alloc_pages(a_table, start + n);
    ForwardSeq a;
    a.tokens = a_tokens.data() + start;
    a.num_tokens = n;
    a.start_pos = start;
    a.block_table = a_table.data();
    a.num_pages = static_cast<int64_t>(a_table.size());
    a.logits = want ? LogitsMode::kLast : LogitsMode::kNone;
    ForwardBatch b;
    const int64_t k = sched.others_max > 0 ? uniform(0, sched.others_max) : 0;
    while (static_cast<int64_t>(others.size()) < k) others.push_back(new_other());
    std::shuffle(others.begin(), others.end(), rng);
    std::vector<size_t> picked;
    for (int64_t i = 0; i < k; ++i) {
      Other& o = others[static_cast<size_t>(i)];
      if (o.pos >= static_cast<int64_t>(o.tokens.size())) o = new_other();  // retired
      ForwardSeq s;
      const int64_t left = o.pos < o.prompt ? o.prompt - o.pos : 1;
      s.num_tokens = o.pos < o.prompt ? uniform(1, left) : 1;
      s.start_pos = o.pos;
      s.tokens = o.tokens.data() + o.pos;
      alloc_pages(o.table, o.pos + s.num_tokens);
      s.block_table = o.table.data();
      s.num_pages = static_cast<int64_t>(o.table.size());
      s.logits = o.pos + s.num_tokens >= o.prompt ? LogitsMode::kLast : LogitsMode::kNone;
      b.seqs.push_back(s);
      picked.push_back(static_cast<size_t>(i));
    }
    const auto at = static_cast<size_t>(uniform(0, static_cast<int64_t>(b.seqs.size())));
    b.seqs.insert(b.seqs.begin() + static_cast<std::ptrdiff_t>(at), a);
    model.forward(b, kv, logits);
    for (size_t i = 0; i < picked.size(); ++i) {
      Other& o = others[picked[i]];
      o.pos += b.seqs[i < at ? i : i + 1].num_tokens;
    }
    if (!want) return;
    int64_t row = 0;
    for (size_t i = 0; i < at; ++i) {
      const ForwardSeq& s = b.seqs[i];
      row += s.logits == LogitsMode::kAll ? s.num_tokens : (s.logits == LogitsMode::kLast ? 1 : 0);
    }
    out.insert(out.end(), logits.begin() + row * vocab, logits.begin() + (row + 1) * vocab);
  };

  const auto L = static_cast<int64_t>(r.prompt.size());
  int64_t pos = 0;
  if (sched.cached_pages > 0) {  // a donor with A's prompt prefills it; A takes its pages
    std::vector<int32_t> donor_table;
    alloc_pages(donor_table, L);
    ForwardSeq d;
    d.tokens = r.prompt.data();
    d.num_tokens = L;
    d.block_table = donor_table.data();
    d.num_pages = static_cast<int64_t>(donor_table.size());
    d.logits = LogitsMode::kNone;
    ForwardBatch b;
    b.seqs.push_back(d);
    model.forward(b, kv, logits);
    pos = std::min(sched.cached_pages * page_size, L - 1);
    a_table.assign(donor_table.begin(), donor_table.begin() + pos / page_size);
    pos = static_cast<int64_t>(a_table.size()) * page_size;
  }
  for (const int64_t c : sched.chunks) {
    if (pos + c >= L) break;
    step(pos, c, false);
    pos += c;
  }
  step(pos, L - pos, true);
  for (size_t i = 0; i < r.decode.size(); ++i) step(L + static_cast<int64_t>(i), 1, true);
  return out;
}

// EXPECT that `got` equals `want` bit for bit, naming the first differing row.
inline void expect_same_bits(const std::vector<float>& want, const std::vector<float>& got,
                             int64_t vocab, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t r = 0; r * vocab < want.size(); ++r) {
    const float* a = want.data() + r * vocab;
    const float* b = got.data() + r * vocab;
    if (std::memcmp(a, b, static_cast<size_t>(vocab) * sizeof(float)) == 0) continue;
    double worst = 0;
    int64_t differ = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (std::memcmp(a + i, b + i, sizeof(float)) != 0) ++differ;
      worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]));
    }
    ADD_FAILURE() << what << ": logits row " << r << " (0: the prompt's last token) differs in "
                  << differ << " of " << vocab << " entries, max |diff| " << worst;
    return;
  }
}

// The schedules every model test runs: each must reproduce the first (alone) bit for bit.
inline std::vector<std::pair<std::string, InvarianceSchedule>> invariance_schedules(
    int64_t others_max) {
  return {
      {"alone", {}},
      {"batched seed 1", {{}, others_max, 0, 1}},
      {"batched seed 2", {{}, others_max, 0, 2}},
      {"chunked 5,1,11,7", {{5, 1, 11, 7}, 0, 0, 3}},
      {"chunked 1,1,3 + batched", {{1, 1, 3}, others_max, 0, 4}},
      {"prefix-cache hit 2 pages", {{}, 0, 2, 5}},
      {"prefix-cache hit 1 page + chunked 3 + batched", {{3}, others_max, 1, 6}},
  };
}

// A request of `prompt_len` prompt tokens and `decode_len` decode tokens drawn from `seed`.
inline InvarianceRequest invariance_request(int64_t vocab, int64_t prompt_len, int64_t decode_len,
                                            uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> tok(0, vocab - 1);
  InvarianceRequest r;
  for (int64_t i = 0; i < prompt_len; ++i) r.prompt.push_back(static_cast<int32_t>(tok(rng)));
  for (int64_t i = 0; i < decode_len; ++i) r.decode.push_back(static_cast<int32_t>(tok(rng)));
  return r;
}

}  // namespace tandem::testing
