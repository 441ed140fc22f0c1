#!/usr/bin/env bash
# Data-parallel serving without disaggregation, as processes on the demo model: two
# `tandem serve --control-port 0 --kv-events-config ...` replicas behind
# `tandem router --replica ... --kv-events-endpoints ...`:
#   - greedy chat completions through the router give the text `tandem serve` gives alone;
#   - a multi-turn conversation's later turns are routed to the replica holding its prefix
#     (the router's tandem_router_prefix_hit_tokens_total grows; the replicas' own
#     vllm:prefix_cache_hits_total agree);
#   - a replica killed (SIGKILL): the router keeps serving on the other one.
set -uo pipefail
bin="$1"
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$dir"/*.log; do echo "== $f"; tail -20 "$f"; done; exit 1; }

# start NAME PATTERN ARGS...: runs `tandem ARGS`, waits until its log matches PATTERN.
start() {
  local name="$1" pattern="$2"; shift 2
  "$bin" "$@" >"$dir/$name.log" 2>&1 &
  pids+=("$!")
  eval "${name}_pid=$!"
  for _ in $(seq 600); do
    grep -q "$pattern" "$dir/$name.log" 2>/dev/null && return 0
    kill -0 "$!" 2>/dev/null || fail "$name exited"
    sleep 0.1
  done
  fail "$name did not start"
}
field() { grep -o "$2" "$dir/$1.log" | head -1; }

kv='{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'
for r in a b; do
  start "$r" "control port" serve --port 0 --control-port 0 --kv-events-config "$kv"
done
start ref "serving" serve --port 0
ctl() { field "$1" 'control port [0-9]*' | awk '{print $3}'; }
pub() { field "$1" 'KV events on tcp://[0-9.:]*' | awk '{print $4}'; }
rep() { field "$1" 'replay on tcp://[0-9.:]*' | awk '{print $3}'; }
http() { field "$1" 'http://[0-9.]*:[0-9]*'; }
start router "router on" router --port 0 --replica "127.0.0.1:$(ctl a),127.0.0.1:$(ctl b)" \
  --kv-events-endpoints "$(pub a),$(pub b)" --kv-events-replay-endpoints "$(rep a),$(rep b)"
R=$(http router); REF=$(http ref)
for _ in $(seq 100); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "$R/ready")" = 200 ] && break
  sleep 0.1
done

chat() {  # URL MESSAGES_JSON -> the reply text
  curl -sf "$1/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"demo\",\"max_tokens\":8,\"temperature\":0,\"messages\":$2}" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"])'
}
sys='{"role":"system","content":"'"$(printf 'You answer briefly and precisely. %.0s' $(seq 12))"'"}'
for c in 1 2 3 4; do
  msgs="[$sys"
  for t in 1 2 3; do
    msgs="$msgs,{\"role\":\"user\",\"content\":\"conversation $c question $t\"}]"
    got=$(chat "$R" "$msgs") || fail "router request failed"
    want=$(chat "$REF" "$msgs") || fail "reference request failed"
    [ "$got" = "$want" ] || fail "conversation $c turn $t: router '$got' != serve '$want'"
    reply=$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$got")
    msgs="${msgs%]},{\"role\":\"assistant\",\"content\":$reply}"
  done
done
sleep 0.3
hit=$(curl -s "$R/metrics" | awk '/^tandem_router_prefix_hit_tokens_total/ {print $2}')
routed=$(curl -s "$R/metrics" | awk '/^tandem_router_prompt_tokens_total/ {print $2}')
echo "router: $routed prompt tokens routed, $hit held by the picked replica"
[ "${hit:-0}" -gt 0 ] || fail "no prefix-aware pick"

kill -9 "$a_pid"
sleep 0.5
for i in 1 2 3; do
  chat "$R" "[{\"role\":\"user\",\"content\":\"after the kill $i\"}]" >/dev/null || fail "the router stopped serving"
done
echo "replica router: OK"
