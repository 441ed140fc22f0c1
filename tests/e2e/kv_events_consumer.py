"""A KV-event consumer with its own schema, as vLLM defines it (msgspec structs, PyPI msgspec and
pyzmq), against `tandem serve --kv-events-config`: it subscribes late (so it catches up through
the replay socket), sends chat requests that share a prefix, decodes every batch with the
structs, reproduces every block hash from its tokens (the chain hash in docs/operations.md) and
checks that the prefix cache reported the shared prefix once. Both KV cache groups are accepted:
0 (`full_attention`, the paged KV) and, from a hybrid model, 1 (`mamba`, its recurrent-state
checkpoints, each under the hash of the page it follows); each group is its own set.

usage: kv_events_consumer.py URL PUB_ENDPOINT REPLAY_ENDPOINT TOPIC array|map
"""
import json
import sys
import time
import urllib.request
from typing import Any

import msgspec
import zmq

url, endpoint, replay_endpoint, topic, encoding = sys.argv[1:6]
array_like = encoding == "array"


# The structs of vllm/distributed/kv_events.py (array_like: vLLM before it moved to tagged
# maps; both are msgspec's tagged structs with omit_defaults).
class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# vLLM's first KV-event structs (five BlockStored fields): newer fields are extra trailing
# array elements, which msgspec ignores.
class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


M = (1 << 64) - 1


def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def page_hash(parent, tokens):
    h = parent ^ 0x9E3779B97F4A7C15
    for t in tokens:
        h = mix((h + (t & 0xFFFFFFFF) + 0x632BE59BD9B4E019) & M)
    return mix(h) | 1


decoder = msgspec.msgpack.Decoder(KVEventBatch)
old_decoder = msgspec.msgpack.Decoder(OldBatch)
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.connect(endpoint)
sub.setsockopt_string(zmq.SUBSCRIBE, topic)
replay = ctx.socket(zmq.DEALER)
replay.connect(replay_endpoint)
time.sleep(0.3)

KINDS = {0: "full_attention", 1: "mamba"}  # group_idx -> kv_cache_spec_kind
held, batches, next_seq = {g: {} for g in KINDS}, 0, 0


def apply(seq, payload):
    global batches, next_seq
    batch = decoder.decode(payload)
    if array_like:
        old_decoder.decode(payload)  # (an old consumer reads the same bytes)
    assert batch.data_parallel_rank == 0, batch
    for e in batch.events:
        if isinstance(e, BlockStored):
            assert e.medium in ("CPU", "GPU") and e.lora_id is None, e
            assert e.group_idx in KINDS and e.kv_cache_spec_kind == KINDS[e.group_idx], e
            group = held[e.group_idx]
            parent = e.parent_block_hash or 0
            for i, h in enumerate(e.block_hashes):
                toks = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
                assert page_hash(parent, toks) == h, ("hash does not reproduce", e)
                assert h not in group, "stored twice"
                group[h] = toks
                parent = h
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                held[e.group_idx or 0].pop(h)
        else:
            for group in held.values():
                group.clear()
    batches += 1
    next_seq = seq + 1


def chat(text):
    body = {"model": "demo", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": "You are a careful assistant. " * 20},
                         {"role": "user", "content": text}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()


def drain(timeout_s):
    global next_seq
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not sub.poll(50):
            continue
        t, seq_b, payload = sub.recv_multipart()
        assert t == topic.encode()
        seq = int.from_bytes(seq_b, "big")
        if seq > next_seq:  # late, or a gap: the replay socket has the rest
            replay.send_multipart([b"", next_seq.to_bytes(8, "big")])
            while True:
                _, rseq_b, rpayload = replay.recv_multipart()
                rseq = int.from_bytes(rseq_b, "big", signed=True)
                if rseq == -1:
                    break
                if rseq >= next_seq:
                    apply(rseq, rpayload)
        if seq >= next_seq:
            apply(seq, payload)


chat("first question")  # published before this consumer saw anything but seq 0
drain(0.5)
chat("second question")
chat("third question")
drain(2.0)
assert batches >= 3, batches
assert next_seq > 1
# The system prompt's pages were stored once and then hit: every held page is distinct.
assert len(held[0]) > 0
print(f"kv events ({encoding}): {batches} batches decoded with vLLM's msgspec structs, "
      f"{len(held[0])} pages and {len(held[1])} state checkpoints held, every hash reproduced "
      f"from its tokens")
