// vLLM's KV-event wire format (vllm/distributed/kv_events.py): a KVEventBatch
// [ts, [events...], data_parallel_rank] encoded with msgpack, each event a msgspec tagged struct
// (BlockStored / BlockRemoved / AllBlocksCleared) with vLLM's field order:
//   BlockStored:  block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//                 lora_name, extra_keys, group_idx, kv_cache_spec_kind,
//                 kv_cache_spec_sliding_window
//   BlockRemoved: block_hashes, medium, group_idx
// Two encodings of an event, as vLLM has published them: kMap, the tagged map {"type":
// "BlockStored", "block_hashes": ...} with default-valued optional fields omitted (vLLM since it
// dropped msgspec's array_like in 2026; the format Dynamo documents for custom engines); kArray,
// the array_like form ["BlockStored", field, ...] with trailing defaults omitted (vLLM before,
// for consumers that decode only that). The batch is an array in both. The decoder takes either.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kv/kv_events.h"

namespace tandem {

enum class KvEventEncoding { kArray, kMap };

struct KvEventBatchInfo {
  double ts = 0;                   // seconds since the epoch
  int32_t data_parallel_rank = 0;  // the publishing rank
  std::string medium = "GPU";      // vLLM's medium ("GPU"; "CPU" for a host-memory cache)
  KvEventEncoding encoding = KvEventEncoding::kMap;
};

/// One KVEventBatch payload (the third frame of a published message).
std::string encode_kv_event_batch(const std::vector<KvEvent>& events, const KvEventBatchInfo& info);

struct DecodedKvEventBatch {
  double ts = 0;
  std::optional<int32_t> data_parallel_rank;
  std::vector<KvEvent> events;  // events of unknown types are skipped
};

/// Decodes a payload in either encoding (and vLLM's older, shorter field lists). Throws
/// Error(kInvalidArgument) naming what is malformed.
DecodedKvEventBatch decode_kv_event_batch(std::string_view payload);

/// vLLM's kv_cache_spec_kind of a group: "full_attention" (kKvGroupAttention), "mamba"
/// (kKvGroupState).
const char* kv_group_kind(int32_t group);

}  // namespace tandem
