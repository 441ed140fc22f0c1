#!/usr/bin/env python3
"""Soak load: CONCURRENCY workers send mixed streaming / non-streaming completions to URL for
SECONDS, some disconnecting on purpose mid-response. Every request must end in a complete
response or an explicit error (an HTTP error status with a JSON error, or a stream error
event followed by [DONE]) within its deadline. Prints a JSON summary; exits 1 on any failure."""
import http.client, json, random, socket, sys, threading, time
from urllib.parse import urlparse

url, seconds, concurrency = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
u = urlparse(url)
DEADLINE = 120.0  # a request may not take longer than this (decode restarts included)
lock = threading.Lock()
stats = {"requests": 0, "complete": 0, "disconnects": 0, "errors": {}, "failures": []}
latencies = []


def note(kind, detail=""):
    with lock:
        stats["requests"] += 1
        if kind == "complete":
            stats["complete"] += 1
        elif kind == "disconnect":
            stats["disconnects"] += 1
        elif kind == "error":
            stats["errors"][detail] = stats["errors"].get(detail, 0) + 1
        else:
            stats["failures"].append(detail)


def cause(message):
    for key in ("lost the connection", "failed", "shutting down", "router queue",
                "no decode instance", "no prefill instance", "reachable"):
        if key in message:
            return key
    return message[:60]


def one(rng):
    stream = rng.random() < 0.5
    disconnect = rng.random() < 0.1
    body = {"model": "demo", "prompt": rng.choice(["It is a truth", "Emma", "Mr. Darcy", "Hello"]),
            "max_tokens": rng.randint(4, 48), "temperature": 0.7, "ignore_eos": True,
            "stream": stream}
    t0 = time.time()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=DEADLINE)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status == 429:
            note("failure", "429: " + r.read().decode()[:200])  # capacity exists: never full
            return
        if r.status != 200:
            data = r.read().decode()
            try:
                msg = json.loads(data)["error"]["message"]
            except Exception:
                note("failure", f"status {r.status} without a JSON error: {data[:200]}")
                return
            note("error", f"{r.status} {cause(msg)}")
            return
        if not stream:
            data = json.loads(r.read())
            ok = data["choices"][0]["finish_reason"] == "length"
            note("complete" if ok else "failure", "" if ok else json.dumps(data)[:200])
            latencies.append(time.time() - t0)
            return
        events, error = 0, None
        while True:
            line = r.fp.readline()
            if not line:
                note("failure", f"stream cut without [DONE] after {events} events")
                return
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                break
            events += 1
            j = json.loads(payload)
            if "error" in j:
                error = j["error"]["message"]
            if disconnect and events >= 2:
                note("disconnect")
                return
        if error:
            note("error", "stream " + cause(error))
        else:
            note("complete")
            latencies.append(time.time() - t0)
    except socket.timeout:
        note("failure", f"no answer within {DEADLINE} s")
    except (ConnectionError, http.client.HTTPException) as e:
        note("failure", f"connection: {e!r}")
    finally:
        conn.close()


def worker(seed):
    rng = random.Random(seed)
    end = time.time() + seconds
    while time.time() < end:
        one(rng)


threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
for t in threads:
    t.start()
for t in threads:
    t.join()
latencies.sort()
q = lambda p: round(latencies[min(len(latencies) - 1, int(p * len(latencies)))], 3) if latencies else None
stats["latency_s"] = {"p50": q(0.5), "p99": q(0.99)}
stats["failures"] = stats["failures"][:20] + ([f"... {len(stats['failures']) - 20} more"] if len(stats["failures"]) > 20 else [])
print(json.dumps(stats, indent=1))
sys.exit(1 if stats["failures"] or stats["complete"] == 0 else 0)
