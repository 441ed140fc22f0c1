// Driving a model's forward by hand in tests: sequences with disjoint pages (and, for hybrid
// models, a state slot each) in one KV cache, and a step that runs every sequence's pending
// tokens. Shared by the sharded-model suites (Qwen3-MoE and Qwen3.5).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "model/model.h"

namespace tandem::testing {

inline constexpr int64_t kHarnessPageSize = 16;

struct Seq {
  std::vector<int32_t> tokens;
  std::vector<int32_t> table;
  int32_t slot = 0;    // its pages' block and, for hybrid models, its state slot
  int64_t cached = 0;  // tokens already in the KV cache
};

inline int64_t pages_for(int64_t max_len) {
  return (max_len + kHarnessPageSize - 1) / kHarnessPageSize;
}

/// Room for num_seqs sequences of max_len tokens (and their state slots, hybrid models).
inline KvCache make_cache(const Model& m, int64_t num_seqs, int64_t max_len) {
  KvCache kv(m.kv_geometry(std::max<int64_t>(1, num_seqs * pages_for(max_len)), kHarnessPageSize));
  if (m.state_slot_elems() > 0) {
    kv.allocate_states(std::max<int64_t>(1, num_seqs), m.state_slot_elems());
  }
  return kv;
}

/// Sequence `slot` of a cache made by make_cache (disjoint pages per slot).
inline Seq make_seq(int64_t slot, int64_t max_len, const std::vector<int32_t>& prompt) {
  Seq s;
  s.tokens = prompt;
  s.slot = static_cast<int32_t>(slot);
  const int64_t p = pages_for(max_len);
  for (int64_t i = 0; i < p; ++i) s.table.push_back(static_cast<int32_t>(slot * p + i));
  return s;
}

/// One forward over every sequence's pending tokens (up to `upto` tokens each when given).
inline std::vector<float> run_step(Model& m, KvCache& kv, const std::vector<Seq*>& seqs,
                                   LogitsMode mode, int64_t upto = -1) {
  ForwardBatch batch;
  std::vector<int64_t> ends;
  for (Seq* s : seqs) {
    const int64_t end = upto < 0 ? static_cast<int64_t>(s->tokens.size())
                                 : std::min<int64_t>(upto, static_cast<int64_t>(s->tokens.size()));
    ForwardSeq fs;
    fs.tokens = s->tokens.data() + s->cached;
    fs.num_tokens = end - s->cached;
    fs.start_pos = s->cached;
    fs.block_table = s->table.data();
    fs.num_pages = static_cast<int64_t>(s->table.size());
    fs.logits = mode;
    fs.state_slot = kv.num_state_slots() > 0 ? s->slot : -1;
    batch.seqs.push_back(fs);
    ends.push_back(end);
  }
  std::vector<float> logits;
  m.forward(batch, kv, logits);
  for (size_t i = 0; i < seqs.size(); ++i) seqs[i]->cached = ends[i];
  return logits;
}

inline int32_t argmax(const float* row, int64_t v) {
  return static_cast<int32_t>(std::max_element(row, row + v) - row);
}

/// A greedy continuation: each token and the logits row behind it.
struct Greedy {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
};

/// `steps` greedy tokens of `prompt`, alone in its own cache.
inline Greedy greedy_alone(Model& m, const std::vector<int32_t>& prompt, int steps) {
  const int64_t v = m.config().vocab_size;
  const int64_t max_len = static_cast<int64_t>(prompt.size()) + steps;
  KvCache kv = make_cache(m, 1, max_len);
  Seq s = make_seq(0, max_len, prompt);
  Greedy g;
  std::vector<float> lg = run_step(m, kv, {&s}, LogitsMode::kLast);
  for (int i = 0; i < steps; ++i) {
    g.tokens.push_back(argmax(lg.data(), v));
    g.logits.push_back(lg);
    if (i + 1 == steps) break;
    s.tokens.push_back(g.tokens.back());
    lg = run_step(m, kv, {&s}, LogitsMode::kLast);
  }
  return g;
}

/// One rank's sequences decoded greedily together: the prompts' step, then a step per token;
/// sequence j stops after steps[j] tokens (into *out[j]), and the rank keeps calling forward
/// (an empty batch once its own are done) for max_steps steps, as its peers' collectives need.
inline void greedy_together(Model& m, KvCache& kv, std::vector<Seq>& seqs,
                            const std::vector<int>& steps, int max_steps,
                            const std::vector<Greedy*>& out) {
  const int64_t v = m.config().vocab_size;
  std::vector<size_t> active(seqs.size());  // indices into seqs / out
  for (size_t j = 0; j < active.size(); ++j) active[j] = j;
  auto batch = [&] {
    std::vector<Seq*> b;
    for (size_t j : active) b.push_back(&seqs[j]);
    return b;
  };
  std::vector<float> lg = run_step(m, kv, batch(), LogitsMode::kLast);  // the prompts
  for (int step = 0; step < max_steps; ++step) {
    EXPECT_EQ(static_cast<int64_t>(lg.size()), static_cast<int64_t>(active.size()) * v);
    std::vector<size_t> next;
    for (size_t a = 0; a < active.size(); ++a) {
      const size_t j = active[a];
      Greedy& g = *out[j];
      std::vector<float> row(lg.begin() + static_cast<int64_t>(a) * v,
                             lg.begin() + static_cast<int64_t>(a + 1) * v);
      g.tokens.push_back(argmax(row.data(), v));
      g.logits.push_back(std::move(row));
      if (static_cast<int>(g.tokens.size()) < steps[j]) {
        seqs[j].tokens.push_back(g.tokens.back());
        next.push_back(j);
      }
    }
    active = next;
    if (step + 1 < max_steps) lg = run_step(m, kv, batch(), LogitsMode::kLast);  // may be empty
  }
}

}  // namespace tandem::testing
