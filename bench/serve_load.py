#!/usr/bin/env python3
"""Streaming load client (stdlib only, like `vllm bench serve`): token-id prompts of a fixed
length, a fixed concurrency, ignore_eos; prints output tok/s, TTFT, ITL and TPOT percentiles (ms).

  bench/serve_load.py --url http://127.0.0.1:8000 --concurrency 32 --requests 64 \
      --prompt-len 1024 --max-tokens 256 [--vocab 151936] [--label router] [--csv FILE] [--procs P]
      [--steady [--ramp-s S]]

--steady: a steady-state load instead of synchronised waves (equal lengths make each
"generation" of requests start together, so a wave's prompts land in the same steps): prompt
and output lengths uniform in [0.5, 1.5] x --prompt-len / --max-tokens (seeded), the first
--concurrency requests staggered over --ramp-s seconds, closed loop; default 4 x concurrency
requests. The figures are of the steady window only: from the end of the warm-up (the time
the first `concurrency` requests have finished) to the last request's start (after it the
concurrency falls): output tok/s counts the tokens stamped inside it, ITL the gaps inside it,
TTFT the requests started inside it.

ITL is timed per SSE event as vLLM's client does (an event carrying k tokens gives one gap, then
k - 1 zero gaps); TPOT per request is (last - first token) / (tokens - 1). The connections are
spread over --procs processes (default: one per 8 connections, at most the CPU count) so that one
interpreter's lock does not delay reads: with every connection in one process, events queue in
the sockets and arrive "together", which showed as ITL p50 of 0.03 ms at concurrency 128.
"""
import argparse, http.client, json, multiprocessing as mp, os, random, threading, time, urllib.parse


def pct(v, q):
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def one(url, prompt, max_tokens, out):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=1200)
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps, ok, buf = [], False, b""
    while True:
        chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                ok = ok or bool(stamps)
                continue
            try:
                j = json.loads(data)
            except ValueError:
                continue
            if "error" in j:
                continue
            now = time.perf_counter()
            for c in j.get("choices", []):
                k = len(c.get("token_ids") or []) or (1 if c.get("text") else 0)
                stamps.extend([now] * k)
                if c.get("finish_reason") == "length":
                    ok = True
    conn.close()
    out.append({"ok": ok, "t0": t0, "stamps": stamps})


def proc_main(url, prompts, max_tokens, threads, start, queue, delays):
    """One client process: `threads` connections pulling request indices from a shared counter
    (connection j first waits delays[j] seconds: the staggered start of --steady)."""
    results, lock, idx = [], threading.Lock(), [0]
    mine = prompts

    def worker(j):
        time.sleep(delays[j] if j < len(delays) else 0.0)
        while True:
            with lock:
                if idx[0] >= len(mine):
                    return
                i = idx[0]
                idx[0] += 1
            one(url, mine[i], max_tokens[i], results)

    start.wait()
    ts = [threading.Thread(target=worker, args=(j,)) for j in range(threads)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    queue.put(results)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=0, help="default: 2 x concurrency")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--label", default="")
    ap.add_argument("--csv", default="")
    ap.add_argument("--procs", type=int, default=0, help="client processes (default: concurrency / 8)")
    ap.add_argument("--steady", action="store_true",
                    help="random lengths around the given ones, staggered starts, steady window")
    ap.add_argument("--ramp-s", type=float, default=2.0, help="--steady: starts spread over this")
    a = ap.parse_args()
    n = a.requests or (4 if a.steady else 2) * a.concurrency
    rng = random.Random(0)
    if a.steady:
        plens = [rng.randint(a.prompt_len // 2, a.prompt_len * 3 // 2) for _ in range(n)]
        olens = [rng.randint(max(1, a.max_tokens // 2), a.max_tokens * 3 // 2) for _ in range(n)]
    else:
        plens, olens = [a.prompt_len] * n, [a.max_tokens] * n
    prompts = [[rng.randrange(10, a.vocab - 10) for _ in range(p)] for p in plens]
    procs = max(1, min(a.procs or (a.concurrency + 7) // 8, a.concurrency, os.cpu_count() or 1))
    # Connections and requests dealt round-robin over the processes (each keeps its own share).
    threads = [a.concurrency // procs + (1 if p < a.concurrency % procs else 0) for p in range(procs)]
    shares = [prompts[p::procs] for p in range(procs)]
    oshares = [olens[p::procs] for p in range(procs)]
    # --steady: connection c of the whole client starts at c / concurrency x ramp (dealt as the
    # connections are: process p holds connections p, p + procs, ...).
    delays = [[(p + j * procs) * a.ramp_s / a.concurrency if a.steady else 0.0
               for j in range(threads[p])] for p in range(procs)]
    ctx = mp.get_context("fork")
    start, queue = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=proc_main,
                      args=(a.url, shares[p], oshares[p], threads[p], start, queue, delays[p]))
          for p in range(procs)]
    [p.start() for p in ps]
    t0 = time.perf_counter()
    start.set()
    results = []
    for _ in ps:
        results.extend(queue.get())
    wall = time.perf_counter() - t0
    [p.join() for p in ps]
    ok = [r for r in results if r["ok"]]
    lo, hi = t0, t0 + wall  # the measured window: the whole run, or the steady part
    if a.steady and len(ok) > a.concurrency:
        lo = sorted(r["stamps"][-1] for r in ok if r["stamps"])[a.concurrency - 1]
        hi = max(r["t0"] for r in results)
        if hi <= lo:
            raise SystemExit("--steady: no steady window (more requests, or a shorter ramp)")
    inside = lambda t: lo <= t <= hi
    tokens = sum(1 for r in ok for t in r["stamps"] if inside(t))
    ttft = [1e3 * (r["stamps"][0] - r["t0"]) for r in ok if r["stamps"] and inside(r["t0"])]
    itl = [1e3 * (b - a_) for r in ok for a_, b in zip(r["stamps"], r["stamps"][1:])
           if inside(a_) and inside(b)]
    tpot = [1e3 * (r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1)
            for r in ok if len(r["stamps"]) > 1 and inside(r["t0"])]
    wall = hi - lo
    row = {"label": a.label, "concurrency": a.concurrency, "ok": f"{len(ok)}/{n}",
           "tok_s": tokens / wall, "ttft_p50": pct(ttft, .5), "ttft_p99": pct(ttft, .99),
           "itl_p50": pct(itl, .5), "itl_p99": pct(itl, .99),
           "tpot_p50": pct(tpot, .5), "tpot_p99": pct(tpot, .99)}
    print("| {label} | {concurrency} | {ok} | {tok_s:.0f} | {ttft_p50:.1f} | {ttft_p99:.1f} | "
          "{itl_p50:.2f} | {itl_p99:.2f} | {tpot_p50:.2f} | {tpot_p99:.2f} |".format(**row), flush=True)
    if a.csv:
        new = not __import__("os").path.exists(a.csv)
        with open(a.csv, "a") as f:
            if new:
                f.write(",".join(row) + "\n")
            f.write(",".join(str(v) for v in row.values()) + "\n")


if __name__ == "__main__":
    main()
