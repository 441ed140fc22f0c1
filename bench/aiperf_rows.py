#!/usr/bin/env python3
"""Rows of bench/serve_load.py's table from an `aiperf profile` artifact directory (stdlib only).

  bench/aiperf_rows.py ARTIFACT_DIR --concurrency C [--label L] [--csv FILE] [--steady]

Prints, in serve_load.py's columns (output tok/s, TTFT, ITL and TPOT p50 / p99 in ms):
- `L` (aiperf's own figures over the whole profiling phase, from profile_export_aiperf.json):
  tok/s is aiperf's output_token_throughput; ITL is aiperf's inter_chunk_latency (the gap
  between SSE events, as serve_load.py and vLLM's client time it); TPOT is aiperf's
  inter_token_latency, which is per request (latency - TTFT) / (output tokens - 1), the same as
  serve_load.py's TPOT.
- `L-window` with --steady (from the records, profile_export.jsonl, --export-level records):
  the same figures in serve_load.py --steady's window, from the end of the warm-up (the time the
  first C requests have finished) to the last request's start. Event times are rebuilt from each
  record's start, TTFT and inter-chunk gaps; an event counts output_tokens / events tokens.
Also prints the mean input / output lengths (server-reported with --use-server-token-count).
"""
import argparse, json, os


def pct(v, q):
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def metric(rec, name):
    m = rec.get("metrics", {}).get(name)
    return None if m is None else m.get("value")


def window_row(records, conc):
    """serve_load.py --steady's window over aiperf's per-request records (times in s)."""
    reqs = []
    for r in records:
        md = r.get("metadata", {})
        ttft, icl, osl = (metric(r, "time_to_first_token"), metric(r, "inter_chunk_latency"),
                          metric(r, "output_sequence_length"))
        if r.get("error") or ttft is None or not osl or "request_start_ns" not in md:
            continue
        t0 = md["request_start_ns"] * 1e-9
        stamps = [t0 + ttft * 1e-3]
        for g in icl or []:
            stamps.append(stamps[-1] + g * 1e-3)
        reqs.append({"t0": t0, "stamps": stamps, "tokens": osl})
    if len(reqs) <= conc:
        raise SystemExit("aiperf_rows: --steady needs more than --concurrency finished records")
    lo = sorted(q["stamps"][-1] for q in reqs)[conc - 1]
    hi = max(q["t0"] for q in reqs)
    if hi <= lo:
        raise SystemExit("aiperf_rows: no steady window (more requests, or a shorter ramp)")
    inside = lambda t: lo <= t <= hi
    tokens = sum(q["tokens"] / len(q["stamps"]) for q in reqs for t in q["stamps"] if inside(t))
    ttft = [1e3 * (q["stamps"][0] - q["t0"]) for q in reqs if inside(q["t0"])]
    itl = [1e3 * (b - a) for q in reqs for a, b in zip(q["stamps"], q["stamps"][1:])
           if inside(a) and inside(b)]
    tpot = [1e3 * (q["stamps"][-1] - q["stamps"][0]) / (q["tokens"] - 1)
            for q in reqs if q["tokens"] > 1 and inside(q["t0"])]
    return {"n": len(reqs), "tok_s": tokens / (hi - lo), "ttft_p50": pct(ttft, .5),
            "ttft_p99": pct(ttft, .99), "itl_p50": pct(itl, .5), "itl_p99": pct(itl, .99),
            "tpot_p50": pct(tpot, .5), "tpot_p99": pct(tpot, .99)}


def emit(row, csv_path):
    print("| {label} | {concurrency} | {ok} | {tok_s:.0f} | {ttft_p50:.1f} | {ttft_p99:.1f} | "
          "{itl_p50:.2f} | {itl_p99:.2f} | {tpot_p50:.2f} | {tpot_p99:.2f} |".format(**row),
          flush=True)
    if csv_path:
        new = not os.path.exists(csv_path)
        with open(csv_path, "a") as f:
            if new:
                f.write(",".join(row) + "\n")
            f.write(",".join(str(v) for v in row.values()) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--label", default="aiperf")
    ap.add_argument("--csv", default="")
    ap.add_argument("--steady", action="store_true")
    a = ap.parse_args()
    s = json.load(open(os.path.join(a.dir, "profile_export_aiperf.json")))
    get = lambda k, f="avg": (s.get(k) or {}).get(f, float("nan"))
    good = int(get("request_count"))  # aiperf counts the successful ones here
    errors = sum(e.get("count", 0) for e in s.get("error_summary") or [])
    total = int(get("completed_request_count")) if "completed_request_count" in s else good + errors
    if errors:
        print("   aiperf: %d failed requests: %s" % (errors, json.dumps(s.get("error_summary"))[:600]))
    if good == 0:
        raise SystemExit("aiperf_rows: no request succeeded")
    print("   aiperf %s: %d successful requests, input length mean %.0f, output length mean %.0f tokens, "
          "%.1f s" % (s.get("aiperf_version", "?"), good, get("input_sequence_length"),
                      get("output_sequence_length"), get("benchmark_duration")))
    emit({"label": a.label, "concurrency": a.concurrency, "ok": "%d/%d" % (good, total),
          "tok_s": get("output_token_throughput"),
          "ttft_p50": get("time_to_first_token", "p50"),
          "ttft_p99": get("time_to_first_token", "p99"),
          "itl_p50": get("inter_chunk_latency", "p50"),
          "itl_p99": get("inter_chunk_latency", "p99"),
          "tpot_p50": get("inter_token_latency", "p50"),
          "tpot_p99": get("inter_token_latency", "p99")}, a.csv)
    if a.steady:
        with open(os.path.join(a.dir, "profile_export.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        w = window_row(records, a.concurrency)
        n = w.pop("n")
        emit(dict({"label": a.label + "-window", "concurrency": a.concurrency,
                   "ok": "%d/%d" % (n, len(records))}, **w), a.csv)


if __name__ == "__main__":
    main()
