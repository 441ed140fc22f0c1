#!/usr/bin/env bash
# `tandem bench serve` and `tandem bench latency` as a user runs them, on the demo model:
#   - `tandem serve` prints its start-up phases, then the "serving ... on http://" line;
#   - bench serve (token-id prompts to /v1/completions, concurrency 3) completes every request
#     with the asked lengths and writes vLLM's result JSON where asked;
#   - bench serve against a port nobody listens on counts every request failed, exit 0, no hang;
#   - bench latency over two prompt sizes writes one result per size;
#   - bad flags are refused by name.
set -uo pipefail
bin="$1"
src="$2"
dir=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$dir"/*.log "$dir"/*.txt; do [ -f "$f" ] && { echo "--- $f"; tail -30 "$f"; }; done; exit 1; }

"$bin" serve --port 0 --kv-cache-mb 64 --disable-access-log > "$dir/serve.log" 2>&1 &
pid=$!
addr=
for _ in $(seq 600); do
  addr=$(grep -o 'http://[0-9.]*:[0-9]*' "$dir/serve.log" 2>/dev/null | head -1 | sed 's|http://||')
  [ -n "$addr" ] && break
  kill -0 "$pid" 2>/dev/null || fail "serve exited"
  sleep 0.1
done
[ -n "$addr" ] || fail "serve did not start"
for phase in tokenizer weights kv_cache graphs; do
  grep -q "tandem: startup: $phase " "$dir/serve.log" || fail "no '$phase' phase line"
done
grep -q "tandem: startup: ready in" "$dir/serve.log" || fail "no ready line"
grep -q "tandem: weights .* read in" "$dir/serve.log" || fail "no weights summary line"
[ "$(curl -s -o /dev/null -w '%{http_code}' "http://$addr/health")" = 200 ] || fail "/health not 200"

timeout 120 "$bin" bench serve --base-url "http://$addr" --tokenizer "$src/models/demo" \
  --num-prompts 6 --random-input-len 16 --random-output-len 4 --max-concurrency 3 --ignore-eos \
  --save-result --result-dir "$dir/res" --result-filename r.json --disable-tqdm > "$dir/bench.txt" 2>&1 \
  || fail "bench serve exited $?"
grep -q "Serving Benchmark Result" "$dir/bench.txt" || fail "no report"
python3 - "$dir/res/r.json" <<'PY' || fail "result JSON"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["completed"] == 6 and j["failed"] == 0, j
assert j["total_input_tokens"] == 6 * 16 and j["total_output_tokens"] == 6 * 4, j
assert j["model_id"] == "demo" and j["max_concurrency"] == 3 and j["request_rate"] == "inf", j
for k in ("mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "p90_e2el_ms", "output_throughput"):
    assert k in j and j[k] > 0, k
PY

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
timeout 60 "$bin" bench serve --port "$port" --model demo --tokenizer "$src/models/demo" \
  --num-prompts 3 --random-input-len 8 --random-output-len 2 --disable-tqdm > "$dir/dead.txt" 2>&1 \
  || fail "bench serve against a dead port exited $?"
grep -q "Failed requests: *3" "$dir/dead.txt" || fail "dead port: not 3 failed"

timeout 120 "$bin" bench latency --input-len 8,32 --output-len 4 --num-iters 2 \
  --num-iters-warmup 1 --output-json "$dir/lat.json" > "$dir/lat.txt" 2>&1 || fail "bench latency"
python3 - "$dir/lat.json" <<'PY' || fail "latency JSON"
import json, sys
j = json.load(open(sys.argv[1]))
r = j["results"]
assert [x["input_len"] for x in r] == [8, 32], r
for x in r:
    assert len(x["latencies"]) == 2 and x["mean_ttft_ms"] > 0 and x["mean_tpot_ms"] > 0, x
PY
grep -q "Avg latency:" "$dir/lat.txt" || fail "no Avg latency line"

"$bin" bench serve --backend nope > "$dir/bad.txt" 2>&1 && fail "--backend nope accepted"
grep -q -- "--backend" "$dir/bad.txt" || fail "bad --backend not named"
"$bin" bench serve --port "$port" --metric-percentiles 9x --tokenizer "$src/models/demo" \
  --model demo > "$dir/bad2.txt" 2>&1 && fail "bad percentile accepted"
grep -q "metric-percentiles" "$dir/bad2.txt" || fail "bad percentile not named"
echo "bench CLI: ok"
