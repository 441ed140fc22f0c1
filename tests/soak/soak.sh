#!/usr/bin/env bash
# A bounded soak (docs/operations.md): router + 1 prefill + 2 decode instances on loopback,
# mixed streaming / non-streaming requests at CONCURRENCY with random client disconnects, a
# decode instance killed (SIGKILL) and restarted on the same port every SECONDS/5.
#   tests/soak/soak.sh BIN [SECONDS=60] [CONCURRENCY=16]     (the long form: 600 64)
# Fails unless every request got a complete response or an explicit error (none hangs, no
# 429 while capacity exists) and the decode instances' KV pages and batches are back to
# zero in use at the end.
set -uo pipefail
bin="$1"; secs="${2:-60}"; conc="${3:-16}"
here="$(cd "$(dirname "$0")" && pwd)"
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  [ -n "${KEEP:-}" ] && echo "kept $dir" || rm -rf "$dir"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
p_pre=$(free_port); p_d0=$(free_port); p_d1=$(free_port); p_http=$(free_port)

"$bin" router --prefill "127.0.0.1:$p_pre" --decode "127.0.0.1:$p_d0,127.0.0.1:$p_d1" \
  --port "$p_http" --max-queue 4096 --queue-timeout 60 --disable-access-log >"$dir/router.log" 2>&1 &
pids+=("$!")
"$bin" prefill --port "$p_pre" --kv-cache-mb 64 >"$dir/pre.log" 2>&1 &
pids+=("$!")
start_decode() {  # start_decode I: decode instance I on its port
  local port; port=$([ "$1" = 0 ] && echo "$p_d0" || echo "$p_d1")
  "$bin" decode --port "$port" --kv-cache-mb 64 --max-decode-batch 64 >>"$dir/dec$1.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  eval "dec$1_pid=$pid"
}
start_decode 0
start_decode 1
metrics() { curl -s "http://127.0.0.1:$p_http/metrics"; }
all_up() { [ "$(metrics | grep -c '^tandem_instance_up{.*} 1')" = 3 ]; }
for _ in $(seq 600); do all_up && break; sleep 0.1; done
all_up || { echo "the instances did not come up"; cat "$dir"/*.log; exit 1; }

python3 "$here/soak_client.py" "http://127.0.0.1:$p_http" "$secs" "$conc" >"$dir/summary.json" &
client=$!
period=$(python3 -c "print(max(5, $secs / 5))")
victim=0; restarts=0
t_end=$(( $(date +%s) + ${secs%.*} ))
while kill -0 "$client" 2>/dev/null && [ "$(date +%s)" -lt "$((t_end - 5))" ]; do
  sleep "$period"
  [ "$(date +%s)" -lt "$((t_end - 5))" ] || break
  eval "pid=\$dec${victim}_pid"
  kill -9 "$pid"; wait "$pid" 2>/dev/null
  sleep 1
  start_decode "$victim"
  restarts=$((restarts + 1))
  victim=$((1 - victim))
done
wait "$client"; rc=$?
cat "$dir/summary.json"
[ "$rc" = 0 ] || { echo "soak: requests failed"; tail -20 "$dir/router.log"; exit 1; }

# Everything released: all instances up, no sequence on any rank, no KV page in use.
clean=0
for _ in $(seq 300); do
  m=$(metrics)
  used=$(awk '/^tandem_kv_pages_used / {print $2}' <<<"$m")
  batch=$(awk '/^tandem_decode_batch\{/ {s += $2} END {print s + 0}' <<<"$m")
  queued=$(awk '/^tandem_router_queued_requests / {print $2}' <<<"$m")
  if all_up && [ "$used" = 0 ] && [ "$batch" = 0 ] && [ "$queued" = 0 ]; then clean=1; break; fi
  sleep 0.1
done
[ "$clean" = 1 ] || { echo "soak: not back to baseline (pages used $used, batch $batch, queued $queued)"; echo "$m" | grep -E '^tandem_(kv|decode|instance|router)'; exit 1; }
echo "soak: $restarts decode restarts; pools back to baseline"
