#!/usr/bin/env bash
# Runs tests/e2e/kv_events_consumer.py (PyPI msgspec and pyzmq, in a cached venv) against
# `tandem serve --kv-events-config`, once per encoding. Exit 77 (skipped) when the packages
# cannot be installed (no network); any other failure fails the test.
set -uo pipefail
bin="$1"; src="$2"
venv="${TANDEM_CACHE_DIR:-${HOME:-/tmp}/.cache/tandem}/kv-events-venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import msgspec, zmq" 2>/dev/null; then
  python3 -m venv "$venv" >/dev/null 2>&1 && "$venv/bin/pip" install -q msgspec pyzmq >/dev/null 2>&1 \
    || { echo "cannot install msgspec and pyzmq: skipped"; exit 77; }
fi
for enc in array map; do
  log=$(mktemp)
  cfg="{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:*\", \"replay_endpoint\": \"tcp://127.0.0.1:*\", \"topic\": \"kv\", \"encoding\": \"$enc\"}"
  "$bin" serve --port 0 --kv-events-config "$cfg" >"$log" 2>&1 &
  pid=$!
  url=""; ev=""
  for _ in $(seq 600); do
    url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -1)
    ev=$(grep -o 'KV events on tcp://[0-9.]*:[0-9]*, replay on tcp://[0-9.]*:[0-9]*' "$log" | head -1)
    [ -n "$url" ] && [ -n "$ev" ] && break
    kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.1
  done
  [ -n "$url" ] && [ -n "$ev" ] || { echo "server did not start"; cat "$log"; kill $pid; exit 1; }
  pub=$(echo "$ev" | awk '{print $4}' | tr -d ,)
  rep=$(echo "$ev" | awk '{print $7}')
  "$venv/bin/python" "$src/tests/e2e/kv_events_consumer.py" "$url" "$pub" "$rep" kv "$enc"
  rc=$?
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
  [ $rc -eq 0 ] || { cat "$log"; rm -f "$log"; exit $rc; }
  rm -f "$log"
done
