#!/usr/bin/env bash
# Steady inter-token latency in colocated serving (issue "Kernels at the limit", item 5): the
# step-time policy off (the token budget alone, --step-time-target-ms 0) against on (auto, and
# any targets in TANDEM_ITL_TARGETS) at the same load: `tandem serve --device cuda` over a
# real-shape random Qwen3-30B-A3B checkpoint cut to TANDEM_ITL_LAYERS layers (default 8, as
# tools/gpu_disagg_bench.sh), bench/serve_load.py at concurrency 128, 1024-token prompts, 256
# output tokens, streaming. Prints each run's row, then ITL p99 / p50 and output tok/s against
# the policy-off run (targets: p99 <= 3x p50, tok/s within 10%).
#   tools/gpu_itl_bench.sh BIN_DIR CSV
set -uo pipefail
BIN=$1; CSV=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
layers=${TANDEM_ITL_LAYERS:-8}
conc=${TANDEM_ITL_CONCURRENCY:-128}
targets="0 -1 ${TANDEM_ITL_TARGETS:-}"
ck=/dev/shm/q30_itl
rm -rf "$ck" "$CSV"
"$BIN/make_random_checkpoint" --out "$ck" --preset qwen3-30b-a3b --layers "$layers" || exit 1
dir=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir" "$ck"; }
trap cleanup EXIT
echo "| step-time target ms | concurrency | ok | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for t in $targets; do
  "$BIN/tandem" serve --model "$ck" --device cuda --max-model-len 2048 --served-model-name m \
    --port 0 --max-num-seqs 128 --max-num-batched-tokens 8192 --kv-cache-mb 24000 \
    --step-time-target-ms "$t" > "$dir/serve_$t.log" 2>&1 &
  pid=$!
  addr=
  for _ in $(seq 1800); do
    addr=$(grep -o 'http://[0-9.]*:[0-9]*' "$dir/serve_$t.log" 2>/dev/null | head -1 | sed 's|http://||')
    [ -n "$addr" ] && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$addr" ] || { echo "serve (target $t) did not start"; cat "$dir/serve_$t.log"; exit 1; }
  python3 "$ROOT/bench/serve_load.py" --url "http://$addr" --concurrency "$conc" \
    --requests $((2 * conc)) --prompt-len 1024 --max-tokens 256 --vocab "${TANDEM_ITL_VOCAB:-151936}" \
    --label "$t" --csv "$CSV" || exit 1
  # The policy's view: steps, mean tokens per step, preemptions (the server's /metrics).
  python3 - "$addr" <<'EOF'
import sys, urllib.request
t = urllib.request.urlopen("http://%s/metrics" % sys.argv[1], timeout=10).read().decode()
rows = {}
for line in t.splitlines():
    if line.startswith("tandem_iteration_tokens_total_") or line.startswith("tandem_num_preemptions_total"):
        k, v = line.rsplit(" ", 1)
        rows[k] = float(v)
n, s = rows.get("tandem_iteration_tokens_total_count", 0), rows.get("tandem_iteration_tokens_total_sum", 0)
print("   steps %d, mean tokens/step %.0f, preemptions %d" % (n, s / max(n, 1), rows.get("tandem_num_preemptions_total", 0)))
EOF
  kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=
done
python3 - "$CSV" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
off = next(r for r in rows if r["label"] == "0")
for r in rows:
    p50, p99, tok = float(r["itl_p50"]), float(r["itl_p99"]), float(r["tok_s"])
    print("target %s ms: ITL p99/p50 %.2f (target <= 3), tok/s %.0f = %.3f x policy off (target >= 0.9)"
          % (r["label"], p99 / p50, tok, tok / float(off["tok_s"])))
EOF
