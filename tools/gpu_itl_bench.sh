#!/usr/bin/env bash
# Steady inter-token latency in colocated serving (issue "Kernels at the limit", item 5): the
# step-time policy off (the token budget alone, --step-time-target-ms 0) against on, at the same
# load: `tandem serve --device cuda` over a real-shape random Qwen3-30B-A3B checkpoint cut to
# TANDEM_ITL_LAYERS layers (default 8, as tools/gpu_disagg_bench.sh), bench/serve_load.py at
# concurrency 128 around 1024-token prompts and 256 output tokens, streaming.
#   tools/gpu_itl_bench.sh BIN_DIR CSV
# TANDEM_ITL_CONFIGS: space-separated LABEL:TARGET_MS:FACTOR, one fresh server each (default
# "off:0:0 f3:-1:3": off, and the relative target, 3x the predicted decode-only step);
# TANDEM_ITL_TARGETS (older form): extra fixed targets (ms), factor 0.
# TANDEM_ITL_LOADS: "steady" (serve_load.py --steady: random lengths in [0.5, 1.5]x, staggered
# starts, 3 x concurrency requests, the steady window only) and/or "waves" (2 x concurrency
# requests of exactly 1024 / 256: two synchronised waves); default "steady waves".
# Each server writes --step-trace (kept in TANDEM_ITL_TRACE_DIR when set); after each run its
# summary (the policy's model checked: predicted vs measured step time, decode-only and mixed
# steps apart) is printed.
# Prints each run's row, then ITL p99 / p50 and output tok/s against the policy-off run of the
# same load (targets: p99 <= 3x p50, tok/s within 10%).
# The same on the CPU (the method checked without a GPU): TANDEM_ITL_MODEL=models/demo
# TANDEM_ITL_DEVICE=cpu, with a smaller load via TANDEM_ITL_CONCURRENCY, TANDEM_ITL_PROMPT
# (1024), TANDEM_ITL_OUT (256), TANDEM_ITL_STEP_TOKENS (8192), TANDEM_ITL_KV_MB (24000),
# TANDEM_ITL_VOCAB (151936).
set -uo pipefail
BIN=$1; CSV=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/tools/serve_address.sh"
layers=${TANDEM_ITL_LAYERS:-8}
conc=${TANDEM_ITL_CONCURRENCY:-128}
configs=${TANDEM_ITL_CONFIGS:-"off:0:0 f3:-1:3"}
for t in ${TANDEM_ITL_TARGETS:-}; do configs="$configs t$t:$t:0"; done
loads=${TANDEM_ITL_LOADS:-"steady waves"}
device=${TANDEM_ITL_DEVICE:-cuda}
plen=${TANDEM_ITL_PROMPT:-1024}
olen=${TANDEM_ITL_OUT:-256}
rm -f "$CSV"
if [ -n "${TANDEM_ITL_MODEL:-}" ]; then
  ck=$TANDEM_ITL_MODEL; made=
else
  ck=/dev/shm/q30_itl; made=$ck
  rm -rf "$ck"
  "$BIN/make_random_checkpoint" --out "$ck" --preset qwen3-30b-a3b --layers "$layers" || exit 1
fi
dir=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir" ${made:+"$made"}; }
trap cleanup EXIT
echo "| load / config | concurrency | ok | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for load in $loads; do
  for c in $configs; do
    IFS=: read -r label t f <<< "$c"
    trace="${TANDEM_ITL_TRACE_DIR:-$dir}/trace_${load}_$label.csv"
    "$BIN/tandem" serve --model "$ck" --device "$device" --max-model-len 2048 --served-model-name m \
      --port 0 --max-num-seqs "$conc" --max-num-batched-tokens "${TANDEM_ITL_STEP_TOKENS:-8192}" \
      --kv-cache-mb "${TANDEM_ITL_KV_MB:-24000}" \
      --step-time-target-ms "$t" --step-time-factor "$f" --step-trace "$trace" \
      > "$dir/serve_$label.log" 2>&1 &
    pid=$!
    addr=$(serve_address "$dir/serve_$label.log" "$pid")
    [ -n "$addr" ] || { echo "serve ($label) did not start"; cat "$dir/serve_$label.log"; exit 1; }
    if [ "$load" = steady ]; then
      extra=(--steady --requests $((3 * conc)))
    else
      extra=(--requests $((2 * conc)))
    fi
    python3 "$ROOT/bench/serve_load.py" --url "http://$addr" --concurrency "$conc" \
      --prompt-len "$plen" --max-tokens "$olen" --vocab "${TANDEM_ITL_VOCAB:-151936}" \
      --label "$load/$label" --csv "$CSV" "${extra[@]}" || exit 1
    kill -9 "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=
    # The policy's model against the measured steps (after the first 50: the fit's warm-up).
    python3 - "$trace" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))[50:]
def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else float("nan")
for kind, sel in (("decode-only", lambda r: float(r["prefill_tokens"]) == 0),
                  ("mixed", lambda r: float(r["prefill_tokens"]) > 0)):
    rs = [r for r in rows if sel(r)]
    if not rs:
        print("   %s steps: none" % kind)
        continue
    meas = [float(r["measured_ms"]) for r in rs]
    err = [(float(r["predicted_ms"]) - float(r["measured_ms"])) / max(float(r["measured_ms"]), 1e-6)
           for r in rs]
    over = sum(1 for r in rs if float(r["target_ms"]) > 0 and float(r["measured_ms"]) > 1.1 * float(r["target_ms"]))
    print("   %s steps %d: measured p50 %.2f p99 %.2f max %.2f ms; (predicted - measured) / measured "
          "p10 %+.0f%% p50 %+.0f%% p90 %+.0f%%; target p50 %.2f ms, %d steps > 1.1x target; "
          "prompt tokens/step p50 %.0f; decode rows p50 %.0f"
          % (kind, len(rs), pct(meas, .5), pct(meas, .99), max(meas), 100 * pct(err, .1),
             100 * pct(err, .5), 100 * pct(err, .9), pct([float(r["target_ms"]) for r in rs], .5),
             over, pct([float(r["prefill_tokens"]) for r in rs], .5),
             pct([float(r["decode_rows"]) for r in rs], .5)))
EOF
  done
done
python3 - "$CSV" <<'EOF'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
for r in rows:
    load = r["label"].split("/")[0]
    off = next((o for o in rows if o["label"].split("/")[0] == load and o["label"].endswith("/off")), r)
    p50, p99, tok = float(r["itl_p50"]), float(r["itl_p99"]), float(r["tok_s"])
    print("%s: ITL p99/p50 %.2f (target <= 3), tok/s %.0f = %.3f x policy off (target >= 0.9)"
          % (r["label"], p99 / p50, tok, tok / float(off["tok_s"])))
EOF
