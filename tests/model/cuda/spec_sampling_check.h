// Sampled speculation on a GPU model against its own non-speculative sampling (the CudaMtp /
// CudaQwen35Mtp sampling tests): 3000 seeded 3-token continuations of golden case `c`'s prompt
// at temperature 0.8 / top-k 4, with K = 2 (drawn on the device), follow the
// distribution without speculation by the chi-square of tests/engine/chi_square.h, with
// deterministic drafts (the most frequent continuation, often accepted) and with the model's own
// MTP drafts; most seeds give the very same tokens; always accepting (forced acceptance at
// p = 1) fails the same bound. `gpu` has its MTP layer loaded.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "engine/chi_square.h"
#include "engine/engine.h"
#include "engine/golden.h"

namespace tandem::cuda_golden {

inline void expect_spec_sampling_matches(Model& gpu, const testing::Golden& g, size_t c) {
  constexpr int kSamples = 3000;
  using Counts = std::map<std::vector<int32_t>, int64_t>;
  auto sample = [&](EngineConfig cfg, std::vector<std::vector<int32_t>>* ids, EngineStats* stats) {
    cfg.max_num_seqs = 128;
    cfg.max_batched_tokens = 2048;
    cfg.page_size = 16;
    cfg.kv_cache_mb = 64;
    cfg.max_waiting = kSamples + 1;
    Engine engine(gpu, cfg);
    std::vector<std::vector<int32_t>> out(kSamples);
    for (int i = 0; i < kSamples; ++i) {
      GenRequest r;
      r.id = "s" + std::to_string(i);
      r.prompt_ids = g.cases[c].prompt_ids;
      r.max_tokens = 3;
      r.sampling.temperature = 0.8f;
      r.sampling.top_k = 4;
      r.sampling.seed = static_cast<uint64_t>(1000 + i);
      engine.add(r, [&out, i](const StepOutput& s) {
        out[static_cast<size_t>(i)].insert(out[static_cast<size_t>(i)].end(), s.token_ids.begin(),
                                           s.token_ids.end());
      });
    }
    while (engine.step()) {
    }
    EXPECT_EQ(engine.blocks().num_available(), engine.blocks().num_pages()) << "leaked KV pages";
    if (stats) *stats = engine.stats();
    Counts counts;
    for (const auto& t : out) ++counts[t];
    if (ids) *ids = std::move(out);
    return counts;
  };
  std::vector<std::vector<int32_t>> base_ids;
  const Counts want = sample(EngineConfig{}, &base_ids, nullptr);
  const std::vector<int32_t> mode = testing::most_frequent(want);
  const size_t prompt_len = g.cases[c].prompt_ids.size();
  for (const bool hooked : {true, false}) {
    SCOPED_TRACE(hooked ? "deterministic drafts" : "random MTP drafts");
    EngineConfig spec;
    spec.num_speculative_tokens = 2;
    if (hooked) {
      spec.spec_draft_hook = testing::drafts_from(mode, prompt_len);
    }
    std::vector<std::vector<int32_t>> ids;
    EngineStats st;
    const Counts got = sample(spec, &ids, &st);
    const auto [x2, df] = testing::chi_square(got, want);
    int same = 0;
    for (int i = 0; i < kSamples; ++i)
      same += ids[static_cast<size_t>(i)] == base_ids[static_cast<size_t>(i)];
    std::printf(
        "[ %s ] sampled, K = 2, %s: %lld of %lld drafts accepted, chi-square %.1f (df "
        "%lld, bound %.1f), %d of %d continuations token-identical\n",
        g.name.c_str(), hooked ? "deterministic drafts" : "MTP drafts",
        static_cast<long long>(st.spec_num_accepted_tokens),
        static_cast<long long>(st.spec_num_draft_tokens), x2, static_cast<long long>(df),
        testing::chi_square_bound(df), same, kSamples);
    EXPECT_LT(x2, testing::chi_square_bound(df)) << "df " << df;
    EXPECT_GT(st.spec_num_draft_tokens, 0);
    if (hooked) {
      EXPECT_GT(st.spec_num_accepted_tokens, st.spec_num_draft_tokens / 10);
    }
    EXPECT_GT(same, kSamples / 2);
  }
  EngineConfig wrong;
  wrong.num_speculative_tokens = 2;
  wrong.spec_forced_accept_prob = 1.0;
  const Counts bad = sample(wrong, nullptr, nullptr);
  const auto [x2w, dfw] = testing::chi_square(bad, want);
  std::printf("[ %s ] always accept: chi-square %.1f (df %lld, bound %.1f)\n", g.name.c_str(), x2w,
              static_cast<long long>(dfw), testing::chi_square_bound(dfw));
  EXPECT_GT(x2w, testing::chi_square_bound(dfw)) << "df " << dfw;
}

}  // namespace tandem::cuda_golden
