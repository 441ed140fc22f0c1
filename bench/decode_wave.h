// The engine configuration of the decode benchmarks that run waves of `batch` requests of
// `prompt_len` prompt tokens and `max_tokens` new ones (bench_engine_host, bench_spec_cuda): room
// for every request at once (pages, sequences, context), 16-token pages, no prefix cache.
#pragma once

#include <cstdint>

#include "engine/engine.h"

namespace tandem::bench {

inline EngineConfig decode_wave_config(int64_t batch, int64_t prompt_len, int64_t max_tokens) {
  EngineConfig cfg;
  cfg.max_num_seqs = batch;
  cfg.max_batched_tokens = 2048;
  cfg.page_size = 16;
  cfg.num_pages = batch * ((prompt_len + max_tokens + 8 + 15) / 16) + 16;
  cfg.max_model_len = prompt_len + max_tokens + 8;
  cfg.enable_prefix_cache = false;
  return cfg;
}

}  // namespace tandem::bench
