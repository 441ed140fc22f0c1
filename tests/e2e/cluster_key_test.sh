#!/usr/bin/env bash
# The cluster key across processes on the demo model (docs/operations.md, Security):
#   - `tandem decode --nprocs 2` (its rank store keyed; the key from TANDEM_CLUSTER_KEY_FILE),
#     `tandem prefill --cluster-key-file`, and a keyed router serve a completion;
#   - a router without the key, and one with another key, never get the instances ready (503),
#     and the instances log the refused connections with their addresses and count them in
#     tandem_auth_failures_total on /metrics; the keyed router serves on;
#   - an instance listening on a non-loopback address without a key warns at start;
#   - the keyed router over HTTPS (--ssl-certfile / --ssl-keyfile, when the openssl command is
#     there): curl trusting the self-signed certificate gets the same completion.
set -uo pipefail
bin="$1"
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do
    for c in $(pgrep -P "$p" 2>/dev/null); do kill "$c" 2>/dev/null; done
    kill "$p" 2>/dev/null
  done
  wait 2>/dev/null
  [ -n "${KEEP:-}" ] && echo "kept $dir" || rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$dir"/*.log; do echo "--- $f"; tail -n 20 "$f"; done; exit 1; }

# start NAME ARGS...: runs `tandem ARGS` in the background, waits for its address line.
start() {
  local name="$1"; shift
  "$bin" "$@" >"$dir/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  for _ in $(seq 300); do
    addr=$(grep -o ' on \(https\?://\)\?[0-9.]*:[0-9][0-9]*' "$dir/$name.log" 2>/dev/null | head -1 |
           grep -o '[0-9.]*:[0-9][0-9]*$')
    [ -n "$addr" ] && { eval "${name}_addr=$addr"; return 0; }
    kill -0 "$pid" 2>/dev/null || fail "$name exited"
    sleep 0.1
  done
  fail "$name did not start"
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
ready() {  # ready URL SECONDS: true once /ready answers 200
  for _ in $(seq $(($2 * 10))); do
    [ "$(curl -sk -o /dev/null -w '%{http_code}' "$1/ready")" = 200 ] && return 0
    sleep 0.1
  done
  return 1
}
complete() {  # complete URL [curl args...]: the completion's text
  local url="$1"; shift
  curl -s "$@" "$url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model":"demo","prompt":"It is a truth","max_tokens":6,"temperature":0}' |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])'
}

od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$dir/key"
od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$dir/other"
p_dec=$(free_port); p_pre=$(free_port); m_dec=$(free_port)
TANDEM_CLUSTER_KEY_FILE="$dir/key" start dec decode --nprocs 2 --port "$p_dec" --metrics-port "$m_dec" \
  --kv-cache-mb 64
start pre prefill --cluster-key-file "$dir/key" --port "$p_pre" --kv-cache-mb 64
start router router --cluster-key-file "$dir/key" --prefill "127.0.0.1:$p_pre" \
  --decode "127.0.0.1:$p_dec" --port 0
ready "http://$router_addr" 60 || fail "the keyed router never got ready"
text=$(complete "http://$router_addr") || fail "no completion through the keyed router"
[ -n "$text" ] || fail "empty completion"
grep -q WARNING "$dir/dec.log" && fail "a loopback instance with a key warned"

before=$(curl -s "http://127.0.0.1:$m_dec/metrics" | grep 'tandem_auth_failures_total{channel="control"}' |
         awk '{print $2}')
[ -n "$before" ] || fail "no tandem_auth_failures_total on the decode instance's /metrics"
start nokey router --prefill "127.0.0.1:$p_pre" --decode "127.0.0.1:$p_dec" --port 0
start wrongkey router --cluster-key-file "$dir/other" --prefill "127.0.0.1:$p_pre" \
  --decode "127.0.0.1:$p_dec" --port 0
ready "http://$nokey_addr" 2 && fail "a router without the key got ready"
ready "http://$wrongkey_addr" 1 && fail "a router with another key got ready"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://$nokey_addr/v1/completions" \
  -H 'Content-Type: application/json' -d '{"model":"demo","prompt":"Hi","max_tokens":2}')
[ "$code" = 503 ] || fail "a request through the key-less router: $code, want 503"
after=$(curl -s "http://127.0.0.1:$m_dec/metrics" | grep 'tandem_auth_failures_total{channel="control"}' |
        awk '{print $2}')
[ "$after" -gt "$before" ] || fail "refusals not counted ($before -> $after)"
grep -q 'refused control connection with 127.0.0.1:[0-9]' "$dir/dec.log" ||
  fail "the decode instance did not log a refused peer's address"
grep -q 'refused control connection with 127.0.0.1:[0-9]' "$dir/pre.log" ||
  fail "the prefill instance did not log a refused peer's address"
[ "$(complete "http://$router_addr")" = "$text" ] || fail "the keyed router stopped serving"

# A non-loopback listener without a key warns.
start open decode --host 0.0.0.0 --port 0 --kv-cache-mb 16
grep -q 'WARNING: .*without a cluster key' "$dir/open.log" || fail "no warning for an open listener"

# The router over HTTPS.
if command -v openssl >/dev/null; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=localhost \
    -addext subjectAltName=IP:127.0.0.1 -keyout "$dir/tls.key" -out "$dir/tls.crt" >/dev/null 2>&1 ||
    fail "openssl req"
  start tls router --cluster-key-file "$dir/key" --prefill "127.0.0.1:$p_pre" \
    --decode "127.0.0.1:$p_dec" --port 0 --ssl-certfile "$dir/tls.crt" --ssl-keyfile "$dir/tls.key"
  grep -q "router on https://" "$dir/tls.log" || fail "the TLS router does not say https"
  ready "https://$tls_addr" 60 || fail "the TLS router never got ready"
  [ "$(complete "https://$tls_addr" --cacert "$dir/tls.crt")" = "$text" ] || fail "HTTPS completion differs"
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://$tls_addr/health")
  [ "$code" = 000 ] || fail "plain HTTP to the TLS port answered $code"
fi
echo "PASS"
