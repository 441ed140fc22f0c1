#include "events/kv_event_codec.h"

#include <msgpack.hpp>

#include "core/error.h"

namespace tandem {

const char* kv_group_kind(int32_t group) {
  return group == kKvGroupState ? "mamba" : "full_attention";
}

namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void pack_str(Packer& pk, std::string_view s) {
  pk.pack_str(static_cast<uint32_t>(s.size()));
  pk.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

void pack_hashes(Packer& pk, const std::vector<uint64_t>& h) {
  pk.pack_array(static_cast<uint32_t>(h.size()));
  for (uint64_t x : h) pk.pack_uint64(x);
}

// Fields in vLLM's order; `name` is written before each value in the map form.
struct Fields {
  Packer& pk;
  bool map;
  void key(std::string_view name) {
    if (map) pack_str(pk, name);
  }
};

void pack_stored(Packer& pk, const KvBlockStored& e, const KvEventBatchInfo& info) {
  const bool map = info.encoding == KvEventEncoding::kMap;
  // array: tag + 10 fields up to kv_cache_spec_kind (sliding_window, a trailing default, is
  // omitted); map: tag + 7 required + group_idx + kv_cache_spec_kind (extra_keys omitted).
  if (map) {
    pk.pack_map(10);
  } else {
    pk.pack_array(11);
  }
  Fields f{pk, map};
  f.key("type");
  pack_str(pk, "BlockStored");
  f.key("block_hashes");
  pack_hashes(pk, e.block_hashes);
  f.key("parent_block_hash");
  if (e.parent_hash) {
    pk.pack_uint64(*e.parent_hash);
  } else {
    pk.pack_nil();
  }
  f.key("token_ids");
  pk.pack_array(static_cast<uint32_t>(e.token_ids.size()));
  for (int32_t t : e.token_ids) pk.pack_int32(t);
  f.key("block_size");
  pk.pack_int64(e.block_size);
  f.key("lora_id");
  pk.pack_nil();
  f.key("medium");
  pack_str(pk, info.medium);
  f.key("lora_name");
  pk.pack_nil();
  if (!map) pk.pack_nil();  // extra_keys (a default; kept in the array to reach group_idx)
  f.key("group_idx");
  pk.pack_int32(e.group_idx);
  f.key("kv_cache_spec_kind");
  pack_str(pk, kv_group_kind(e.group_idx));
}

void pack_removed(Packer& pk, const KvBlockRemoved& e, const KvEventBatchInfo& info) {
  const bool map = info.encoding == KvEventEncoding::kMap;
  if (map) {
    pk.pack_map(4);
  } else {
    pk.pack_array(4);
  }
  Fields f{pk, map};
  f.key("type");
  pack_str(pk, "BlockRemoved");
  f.key("block_hashes");
  pack_hashes(pk, e.block_hashes);
  f.key("medium");
  pack_str(pk, info.medium);
  f.key("group_idx");
  pk.pack_int32(e.group_idx);
}

void pack_cleared(Packer& pk, const KvEventBatchInfo& info) {
  if (info.encoding == KvEventEncoding::kMap) {
    pk.pack_map(1);
    pack_str(pk, "type");
  } else {
    pk.pack_array(1);
  }
  pack_str(pk, "AllBlocksCleared");
}

// ---- decoding ----

[[noreturn]] void bad(const std::string& what) {
  TANDEM_THROW(kInvalidArgument, "KV event batch: ", what);
}

const msgpack::object* map_get(const msgpack::object& o, std::string_view key) {
  for (uint32_t i = 0; i < o.via.map.size; ++i) {
    const auto& kv = o.via.map.ptr[i];
    if (kv.key.type == msgpack::type::STR &&
        std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) == key) {
      return &kv.val;
    }
  }
  return nullptr;
}

uint64_t as_hash(const msgpack::object& o) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) return o.via.u64;
  if (o.type == msgpack::type::NEGATIVE_INTEGER) return static_cast<uint64_t>(o.via.i64);
  if (o.type == msgpack::type::BIN && o.via.bin.size >= 1) {  // bytes hashes: their last 8 bytes
    uint64_t h = 0;
    const uint32_t n = o.via.bin.size;
    for (uint32_t i = n > 8 ? n - 8 : 0; i < n; ++i) {
      h = (h << 8) | static_cast<uint8_t>(o.via.bin.ptr[i]);
    }
    return h;
  }
  bad("a block hash is neither an integer nor bytes");
}

int64_t as_int(const msgpack::object& o, const char* what) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) return static_cast<int64_t>(o.via.u64);
  if (o.type == msgpack::type::NEGATIVE_INTEGER) return o.via.i64;
  bad(std::string(what) + " is not an integer");
}

std::vector<uint64_t> as_hashes(const msgpack::object* o) {
  if (o == nullptr || o->type != msgpack::type::ARRAY) bad("block_hashes is not an array");
  std::vector<uint64_t> out;
  out.reserve(o->via.array.size);
  for (uint32_t i = 0; i < o->via.array.size; ++i) out.push_back(as_hash(o->via.array.ptr[i]));
  return out;
}

bool is_nil(const msgpack::object* o) { return o == nullptr || o->type == msgpack::type::NIL; }

// An event as named fields, whichever encoding it came in.
struct EventView {
  std::string tag;
  const msgpack::object* fields[11] = {};  // in vLLM's order (see the header)
};

EventView view_event(const msgpack::object& o) {
  EventView v;
  static const char* kStored[] = {"block_hashes",
                                  "parent_block_hash",
                                  "token_ids",
                                  "block_size",
                                  "lora_id",
                                  "medium",
                                  "lora_name",
                                  "extra_keys",
                                  "group_idx",
                                  "kv_cache_spec_kind",
                                  "kv_cache_spec_sliding_window"};
  static const char* kRemoved[] = {"block_hashes", "medium", "group_idx"};
  if (o.type == msgpack::type::ARRAY) {
    if (o.via.array.size == 0 || o.via.array.ptr[0].type != msgpack::type::STR) {
      bad("an event array does not start with its type");
    }
    v.tag.assign(o.via.array.ptr[0].via.str.ptr, o.via.array.ptr[0].via.str.size);
    for (uint32_t i = 1; i < o.via.array.size && i <= 11; ++i)
      v.fields[i - 1] = &o.via.array.ptr[i];
    return v;
  }
  if (o.type != msgpack::type::MAP) bad("an event is neither an array nor a map");
  const msgpack::object* t = map_get(o, "type");
  if (t == nullptr || t->type != msgpack::type::STR) bad("an event map has no \"type\"");
  v.tag.assign(t->via.str.ptr, t->via.str.size);
  if (v.tag == "BlockStored") {
    for (int i = 0; i < 11; ++i) v.fields[i] = map_get(o, kStored[i]);
  } else if (v.tag == "BlockRemoved") {
    for (int i = 0; i < 3; ++i) v.fields[i] = map_get(o, kRemoved[i]);
  }
  return v;
}

}  // namespace

std::string encode_kv_event_batch(const std::vector<KvEvent>& events,
                                  const KvEventBatchInfo& info) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_array(3);
  pk.pack_double(info.ts);
  pk.pack_array(static_cast<uint32_t>(events.size()));
  for (const KvEvent& e : events) {
    if (const auto* s = std::get_if<KvBlockStored>(&e)) {
      pack_stored(pk, *s, info);
    } else if (const auto* r = std::get_if<KvBlockRemoved>(&e)) {
      pack_removed(pk, *r, info);
    } else {
      pack_cleared(pk, info);
    }
  }
  pk.pack_int32(info.data_parallel_rank);
  return std::string(buf.data(), buf.size());
}

DecodedKvEventBatch decode_kv_event_batch(std::string_view payload) {
  msgpack::object_handle oh;
  try {
    oh = msgpack::unpack(payload.data(), payload.size());
  } catch (const std::exception& e) {
    bad(std::string("not msgpack (") + e.what() + ")");
  }
  const msgpack::object& root = oh.get();
  const msgpack::object *ts = nullptr, *events = nullptr, *rank = nullptr;
  if (root.type == msgpack::type::ARRAY) {
    if (root.via.array.size < 2) bad("a batch array has fewer than 2 fields");
    ts = &root.via.array.ptr[0];
    events = &root.via.array.ptr[1];
    if (root.via.array.size > 2) rank = &root.via.array.ptr[2];
  } else if (root.type == msgpack::type::MAP) {
    ts = map_get(root, "ts");
    events = map_get(root, "events");
    rank = map_get(root, "data_parallel_rank");
  } else {
    bad("the batch is neither an array nor a map");
  }
  if (events == nullptr || events->type != msgpack::type::ARRAY) bad("events is not an array");
  DecodedKvEventBatch out;
  if (ts != nullptr && ts->type == msgpack::type::FLOAT64) out.ts = ts->via.f64;
  if (ts != nullptr && ts->type == msgpack::type::FLOAT32) out.ts = ts->via.f64;
  if (!is_nil(rank))
    out.data_parallel_rank = static_cast<int32_t>(as_int(*rank, "data_parallel_rank"));
  for (uint32_t i = 0; i < events->via.array.size; ++i) {
    EventView v = view_event(events->via.array.ptr[i]);
    if (v.tag == "BlockStored") {
      KvBlockStored s;
      s.block_hashes = as_hashes(v.fields[0]);
      if (!is_nil(v.fields[1])) s.parent_hash = as_hash(*v.fields[1]);
      if (v.fields[2] == nullptr || v.fields[2]->type != msgpack::type::ARRAY) {
        bad("token_ids is not an array");
      }
      for (uint32_t j = 0; j < v.fields[2]->via.array.size; ++j) {
        s.token_ids.push_back(
            static_cast<int32_t>(as_int(v.fields[2]->via.array.ptr[j], "a token id")));
      }
      if (v.fields[3] == nullptr) bad("BlockStored has no block_size");
      s.block_size = as_int(*v.fields[3], "block_size");
      if (!is_nil(v.fields[8]))
        s.group_idx = static_cast<int32_t>(as_int(*v.fields[8], "group_idx"));
      out.events.emplace_back(std::move(s));
    } else if (v.tag == "BlockRemoved") {
      KvBlockRemoved r;
      r.block_hashes = as_hashes(v.fields[0]);
      if (!is_nil(v.fields[2]))
        r.group_idx = static_cast<int32_t>(as_int(*v.fields[2], "group_idx"));
      out.events.emplace_back(std::move(r));
    } else if (v.tag == "AllBlocksCleared") {
      out.events.emplace_back(KvAllBlocksCleared{});
    }
  }
  return out;
}

}  // namespace tandem
