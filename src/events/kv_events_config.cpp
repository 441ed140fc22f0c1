#include "events/kv_events_config.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace tandem {

KvEventsConfig parse_kv_events_config(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    TANDEM_THROW(kInvalidArgument, "--kv-events-config: not JSON (", e.what(), ")");
  }
  TANDEM_CHECK_KIND(kInvalidArgument, j.is_object(), "--kv-events-config: not a JSON object");
  KvEventsConfig c;
  bool publisher_set = false;
  for (const auto& item : j.items()) {
    // Named, not a structured binding: the lambda below captures it (clang 14, the fuzzing
    // build's compiler, does not capture structured bindings).
    const std::string& key = item.key();
    const nlohmann::json& v = item.value();
    auto need = [&](bool ok, const char* type) {
      TANDEM_CHECK_KIND(kInvalidArgument, ok, "--kv-events-config: ", key, " must be ", type);
    };
    if (key == "enable_kv_cache_events") {
      need(v.is_boolean(), "a boolean");
      c.enable_kv_cache_events = v.get<bool>();
    } else if (key == "publisher") {
      need(v.is_string() || v.is_null(), "\"zmq\" or \"null\"");
      if (v.is_string()) {
        c.publisher = v.get<std::string>();
        TANDEM_CHECK_KIND(kInvalidArgument, c.publisher == "zmq" || c.publisher == "null",
                          "--kv-events-config: publisher must be \"zmq\" or \"null\", not \"",
                          c.publisher, "\"");
        publisher_set = true;
      }
    } else if (key == "endpoint") {
      need(v.is_string(), "a string");
      c.endpoint = v.get<std::string>();
    } else if (key == "replay_endpoint") {
      need(v.is_string() || v.is_null(), "a string or null");
      if (v.is_string()) c.replay_endpoint = v.get<std::string>();
    } else if (key == "buffer_steps" || key == "hwm" || key == "max_queue_size") {
      need(v.is_number_integer() && v.get<int64_t>() >= 0, "a non-negative integer");
      int64_t x = v.get<int64_t>();
      (key == "buffer_steps" ? c.buffer_steps : key == "hwm" ? c.hwm : c.max_queue_size) = x;
    } else if (key == "topic") {
      need(v.is_string(), "a string");
      c.topic = v.get<std::string>();
    } else if (key == "encoding") {
      need(v.is_string() && (v == "array" || v == "map"), "\"array\" or \"map\"");
      c.encoding = v == "map" ? KvEventEncoding::kMap : KvEventEncoding::kArray;
    } else {
      TANDEM_THROW(kInvalidArgument, "--kv-events-config: unknown field \"", key, "\"");
    }
  }
  if (!publisher_set) c.publisher = c.enable_kv_cache_events ? "zmq" : "null";
  TANDEM_CHECK_KIND(kInvalidArgument, c.max_queue_size > 0,
                    "--kv-events-config: max_queue_size must be positive");
  for (const std::string* ep : {&c.endpoint, c.replay_endpoint ? &*c.replay_endpoint : nullptr}) {
    if (ep == nullptr) continue;
    TANDEM_CHECK_KIND(kInvalidArgument,
                      ep->rfind("tcp://", 0) == 0 || ep->rfind("ipc://", 0) == 0 ||
                          ep->rfind("inproc://", 0) == 0,
                      "--kv-events-config: endpoint \"", *ep,
                      "\" is not tcp://, ipc:// or inproc://");
  }
  return c;
}

std::string offset_endpoint_port(const std::string& endpoint, int32_t rank) {
  if (endpoint.empty() || rank == 0) return endpoint;
  if (endpoint.find("inproc") != std::string::npos) return endpoint + "_dp" + std::to_string(rank);
  const size_t colon = endpoint.rfind(':');
  TANDEM_CHECK_KIND(
      kInvalidArgument, endpoint.rfind("tcp://", 0) == 0 && colon != std::string::npos,
      "KV events endpoint ", endpoint, ": a data-parallel rank needs tcp://host:port");
  int port = 0;
  try {
    port = std::stoi(endpoint.substr(colon + 1));
  } catch (const std::exception&) {
    TANDEM_THROW(kInvalidArgument, "KV events endpoint ", endpoint, ": bad port");
  }
  return endpoint.substr(0, colon + 1) + std::to_string(port + rank);
}

}  // namespace tandem
