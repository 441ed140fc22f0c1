"""`tandem serve` as a worker behind NVIDIA Dynamo's KV-aware router, through Dynamo's documented
custom-engine path ("KV Events for Custom Engines", ZMQ relay mode): Dynamo's KvEventPublisher
subscribes to Tandem's KV-event socket (vLLM's wire format) and relays the events to Dynamo's
event plane, and this worker forwards each preprocessed request (token ids) to the local
`tandem serve` over its OpenAI completions API (a prompt of token ids).

UNTESTED here: it needs the ai-dynamo package and its runtime (etcd / NATS or its ZMQ event
plane), which this project does not install. What is tested offline is the event stream itself,
decoded with vLLM's msgspec structs (tests/e2e/kv_events_consumer.py), in the tagged-map
encoding Dynamo documents ("encoding": "map", Tandem's default).

Run beside `tandem serve --port 8000 --page-size 16 --kv-events-config
'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'`:
    python3 tandem_worker.py --model qwen3-moe --tandem http://127.0.0.1:8000 --block-size 16
"""
import argparse
import json
import urllib.request

from dynamo.llm import KvEventPublisher, register_model  # ai-dynamo (not installed here)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tandem", default="http://127.0.0.1:8000")
    p.add_argument("--block-size", type=int, default=16)  # = tandem --page-size
    p.add_argument("--kv-events", default="tcp://127.0.0.1:5557")
    return p.parse_args()


async def main():
    args = parse()

    async def generate(request):
        # Dynamo hands the worker token ids; Tandem's completions API takes them as the prompt.
        body = {"model": args.model, "prompt": request["token_ids"], "stream": False,
                "max_tokens": request.get("stop_conditions", {}).get("max_tokens") or 256}
        req = urllib.request.Request(args.tandem + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req).read())
        yield {"text": out["choices"][0]["text"], "finish_reason": out["choices"][0]["finish_reason"]}

    component, _ = await register_model(model=args.model, generator=generate)
    # Relay mode: Tandem's ZMQ events -> Dynamo's event plane -> its KvIndexer.
    KvEventPublisher(component=component, kv_block_size=args.block_size,
                     zmq_endpoint=args.kv_events, zmq_topic="")


if __name__ == "__main__":
    import asyncio

    asyncio.run(main())
