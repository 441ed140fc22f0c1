#!/usr/bin/env bash
# bench/aiperf_rows.py on a hand-made aiperf artifact directory: the summary row maps aiperf's
# metrics to serve_load.py's columns (ITL = inter_chunk_latency, TPOT = inter_token_latency,
# ok = successful / all, a failed request counted),
# the steady-window row rebuilds event times from the records (start + TTFT + inter-chunk gaps)
# and keeps serve_load.py's window (first `concurrency` requests finished .. last start); too few
# records is an error naming the reason.
#   tests/tools/test_aiperf_rows.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: $0 SOURCE_DIR}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir" <<'PY'
import json, os, sys
d = sys.argv[1]
pct = lambda a, b: {"unit": "ms", "avg": 0.0, "p50": a, "p99": b}
json.dump({"aiperf_version": "0.13.0", "request_count": {"avg": 3.0},
           "completed_request_count": {"avg": 4.0},
           "output_token_throughput": {"avg": 1234.0},
           "time_to_first_token": pct(11.0, 12.0), "inter_chunk_latency": pct(21.0, 22.0),
           "inter_token_latency": pct(31.0, 32.0), "input_sequence_length": {"avg": 8.0},
           "output_sequence_length": {"avg": 3.0}, "benchmark_duration": {"avg": 0.8},
           "error_summary": [{"error_details": {"code": 400}, "count": 1}]}, open(os.path.join(d, "profile_export_aiperf.json"), "w"))
def rec(start_s, ttft, icl, osl):
    return {"metadata": {"request_start_ns": int(round(start_s * 1e9))},
            "metrics": {"time_to_first_token": {"value": ttft, "unit": "ms"},
                        "inter_chunk_latency": {"value": icl, "unit": "ms"},
                        "output_sequence_length": {"value": osl, "unit": "tokens"}}}
# A: events at .1 .2 .3 (ends first: the window opens at .3); B: starts .35, events .45 .49 .59
# .70 (all inside); C: starts .72 (the last start: the window closes), events .77 .82 (outside).
with open(os.path.join(d, "profile_export.jsonl"), "w") as f:
    for r in (rec(0.0, 100.0, [100.0, 100.0], 3), rec(0.35, 100.0, [40.0, 100.0, 110.0], 4),
              rec(0.72, 50.0, [50.0], 2)):
        f.write(json.dumps(r) + "\n")
    # A failed request (a 400): no metrics, left out of the window.
    f.write(json.dumps({"metadata": {"request_start_ns": 500000000}, "metrics": {},
                        "error": {"code": 400, "message": "too long"}}) + "\n")
PY
out=$(python3 "$src/bench/aiperf_rows.py" "$dir" --concurrency 1 --label steady/aiperf --steady \
  --csv "$dir/rows.csv")
echo "$out"
# Inside [.3, .72]: tokens A 1 + B 4 = 5 in 0.42 s (12 tok/s); TTFT of B, C: 100, 50; gaps of B:
# 40, 100, 110; TPOT of B (.70 - .45) / 3 = 83.33 ms, of C 50 ms.
want_sum='| steady/aiperf | 1 | 3/4 | 1234 | 11.0 | 12.0 | 21.00 | 22.00 | 31.00 | 32.00 |'
want_win='| steady/aiperf-window | 1 | 3/4 | 12 | 100.0 | 100.0 | 100.00 | 110.00 | 83.33 | 83.33 |'
grep -qxF "$want_sum" <<< "$out" || { echo "FAIL: want $want_sum"; exit 1; }
grep -qxF "$want_win" <<< "$out" || { echo "FAIL: want $want_win"; exit 1; }
[ "$(wc -l < "$dir/rows.csv")" -eq 3 ] && head -1 "$dir/rows.csv" | grep -q '^label,concurrency,ok,tok_s' ||
  { echo "FAIL: csv"; cat "$dir/rows.csv"; exit 1; }
# Concurrency 3 with 3 successful records: no steady window.
if err=$(python3 "$src/bench/aiperf_rows.py" "$dir" --concurrency 3 --steady 2>&1); then
  echo "FAIL: no window accepted: $err"; exit 1
fi
grep -q "needs more than --concurrency finished records" <<< "$err" || { echo "FAIL: $err"; exit 1; }
echo "aiperf_rows: 1 passed, 0 failed"
