#!/usr/bin/env bash
# Disaggregated vs colocated serving on one GPU (issue "GPU instances" benchmark): a real-shape
# random checkpoint (make_random_checkpoint --preset TANDEM_DISAGG_PRESET, default qwen3-30b-a3b;
# TANDEM_DISAGG_LAYERS layers, default 8 so that all processes fit one GPU, 0 = full depth;
# TANDEM_DISAGG_FORMAT bf16 or fp8, default bf16), 1024-token prompts, 256 output tokens, streaming;
# bench/serve_load.py at concurrency 32 (and 128 unless TANDEM_DISAGG_QUICK=1) through
#   1. router -> prefill (TP=1) -> decode (DP=1), every instance its own process on this GPU;
#   2. `tandem serve --device cuda` alone on the same GPU, same requests.
# On one GPU the instances time-share the SMs, so this measures the path, not the isolation
# disaggregation buys on separate GPUs.
#   tools/gpu_disagg_bench.sh BIN_DIR CSV
set -uo pipefail
BIN=$1; CSV=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
layers=${TANDEM_DISAGG_LAYERS:-8}
preset=${TANDEM_DISAGG_PRESET:-qwen3-30b-a3b}
format=${TANDEM_DISAGG_FORMAT:-bf16}
ck=/dev/shm/disagg_ckpt
rm -rf "$ck"
shape=(--preset "$preset")
[ "$layers" = 0 ] || shape+=(--layers "$layers")
[ "$format" = bf16 ] || shape+=(--format "$format")
"$BIN/make_random_checkpoint" --out "$ck" "${shape[@]}" || exit 1
echo "checkpoint: $preset, ${layers/#0/all} layers, $format ($(du -sh "$ck" | cut -f1))"
dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do pkill -9 -P "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$dir" "$ck"; }
trap cleanup EXIT
start() {
  local name="$1"; shift
  "$BIN/tandem" "$@" >"$dir/$name.log" 2>&1 &
  pids+=("$!")
  for _ in $(seq 1800); do
    addr=$(grep -o 'on [0-9.]*:[0-9][0-9]*\|http://[0-9.]*:[0-9]*' "$dir/$name.log" 2>/dev/null | head -1 | grep -o '[0-9.]*:[0-9]*$')
    [ -n "$addr" ] && { eval "${name}_addr=$addr"; return 0; }
    sleep 0.1
  done
  echo "$name did not start"; cat "$dir/$name.log"; exit 1
}
common=(--model "$ck" --device cuda --max-model-len 2048)
concs="32"; [ "${TANDEM_DISAGG_QUICK:-0}" = 1 ] || concs="32 128"
echo "| path | concurrency | ok | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
start dec decode "${common[@]}" --port 0 --max-decode-batch 128 --kv-cache-mb 16000
start pre prefill "${common[@]}" --port 0 --kv-cache-mb 8000 --max-num-batched-tokens 8192
start router router --model "$ck" --served-model-name m --prefill "$pre_addr" --decode "$dec_addr" --port 0
for c in $concs; do
  python3 "$ROOT/bench/serve_load.py" --url "http://$router_addr" --concurrency "$c" \
    --requests $((2 * c)) --prompt-len 1024 --max-tokens 256 --label disaggregated --csv "$CSV"
done
for p in "${pids[@]}"; do pkill -9 -P "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; done; wait 2>/dev/null
pids=()
start serve serve "${common[@]}" --served-model-name m --port 0 --max-num-seqs 128 --max-num-batched-tokens 8192 --kv-cache-mb 24000
for c in $concs; do
  python3 "$ROOT/bench/serve_load.py" --url "http://$serve_addr" --concurrency "$c" \
    --requests $((2 * c)) --prompt-len 1024 --max-tokens 256 --label colocated --csv "$CSV"
done
