// --kv-events-config: vLLM's KVEventsConfig (vllm/config/kv_events.py) as JSON, with its
// fields and defaults: enable_kv_cache_events (false), publisher ("null" or "zmq"; absent:
// "zmq" when enabled), endpoint ("tcp://*:5557"), replay_endpoint (none), buffer_steps (10000),
// hwm (100000), max_queue_size (100000), topic (""). One Tandem field beside them: encoding
// ("map", vLLM's tagged-map events since it dropped msgspec's array_like, as Dynamo documents
// the wire format; or "array", the array_like events of earlier vLLM, for consumers that only
// decode those). Any other field is refused by name.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "events/kv_event_codec.h"

namespace tandem {

struct KvEventsConfig {
  bool enable_kv_cache_events = false;
  std::string publisher = "null";
  std::string endpoint = "tcp://*:5557";
  std::optional<std::string> replay_endpoint;
  int64_t buffer_steps = 10000;
  int64_t hwm = 100000;
  int64_t max_queue_size = 100000;
  std::string topic;
  KvEventEncoding encoding = KvEventEncoding::kMap;

  /// On: events are recorded and published.
  bool active() const { return enable_kv_cache_events && publisher == "zmq"; }
};

/// Parses the JSON; throws Error(kInvalidArgument) naming the flag and the field.
KvEventsConfig parse_kv_events_config(const std::string& json);

/// vLLM's offset_endpoint_port: a data-parallel rank r > 0 publishes on port + r
/// ("tcp://*:5557" -> "tcp://*:5559" for r 2), an inproc endpoint gets "_dp<r>".
std::string offset_endpoint_port(const std::string& endpoint, int32_t rank);

}  // namespace tandem
