#!/usr/bin/env bash
# Disaggregated serving of the Qwen3.5 hybrid fixtures as separate processes on the CPU (issue
# "Qwen3.5 hybrid MoE", Deliver 5): router -> `tandem prefill` (TP 1 on every fixture; TP 2 as
# processes, --nprocs 2, and as threads, --tp 2) -> `tandem decode` (DP 1, and DP 2 with EP
# experts as processes) against colocated `tandem serve`:
#   - every golden case (token-id prompts: the fixtures have no tokenizer): the same greedy
#     token ids and logprobs (within 1e-4) through the router as through serve (the prefill
#     instance sends the attention layers' KV and the DeltaNet layers' recurrent state; at TP 2
#     each rank holds its value heads' part of the state, merged on rank 0);
#   - a TP size the DeltaNet value heads do not split over (prefill --tp 4 on a fixture of 2)
#     exits non-zero at start-up with an error naming them.
#   hybrid_roles_test.sh TANDEM_BIN FIXTURE_DIR...
set -uo pipefail
bin="$1"; shift
dir=$(mktemp -d)
pids=()
cleanup_pids() {  # (a --nprocs instance's rank processes are its children)
  for p in "${pids[@]}"; do
    for c in $(pgrep -P "$p" 2>/dev/null); do kill "$c" 2>/dev/null; done
    kill "$p" 2>/dev/null
  done
  wait 2>/dev/null
}
cleanup() {
  cleanup_pids
  rm -rf "$dir"
}
trap cleanup EXIT

start() {  # start NAME ARGS...: `tandem ARGS` in the background, waits for its address line
  local name="$1"; shift
  # (emptied here: the background job's own redirection may come after the first grep below,
  # which would then read the address of the previous run's process of this name)
  : >"$dir/$name.log"
  "$bin" "$@" >"$dir/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  for _ in $(seq 600); do
    addr=$(grep -o 'on [0-9.]*:[0-9][0-9]*\|http://[0-9.]*:[0-9]*' "$dir/$name.log" 2>/dev/null | head -1 | grep -o '[0-9.]*:[0-9]*$')
    [ -n "$addr" ] && { eval "${name}_addr=$addr"; return 0; }
    kill -0 "$pid" 2>/dev/null || { echo "$name exited:"; cat "$dir/$name.log"; exit 1; }
    sleep 0.1
  done
  echo "$name did not start"; cat "$dir/$name.log"; exit 1
}
stop_all() {
  cleanup_pids
  pids=()
}
wait_ready() {
  for _ in $(seq 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$1/ready")" = 200 ] && return 0
    sleep 0.1
  done
  echo "$1 never got ready"; cat "$dir"/*.log; exit 1
}

status=0
runs=()
# model|decode flags|prefill flags
for model in "$@"; do runs+=("$model||"); done
runs+=("$1|--nprocs 2|" "$1||--nprocs 2" "${2:-$1}|--nprocs 2|--tp 2")
for run in "${runs[@]}"; do
  IFS='|' read -r model dec_flags pre_flags <<<"$run"
  common=(--model "$model" --kv-cache-mb 64)
  # shellcheck disable=SC2086
  start dec decode "${common[@]}" --port 0 $dec_flags
  # shellcheck disable=SC2086
  start pre prefill "${common[@]}" --port 0 $pre_flags
  start router router --model "$model" --served-model-name m --prefill "$pre_addr" --decode "$dec_addr" --port 0
  start serve serve "${common[@]}" --served-model-name m --port 0
  wait_ready "$router_addr"
  python3 - "$model" "$router_addr" "$serve_addr" "${pre_flags:+ (prefill $pre_flags)}${dec_flags:+ (decode $dec_flags)}" <<'PY' || status=1
import json, sys, urllib.request
model, router, serve = sys.argv[1:4]
golden = json.load(open(model + "/golden.json"))
def complete(addr, ids, n):
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": n, "temperature": 0,
                       "logprobs": 1}).encode()
    req = urllib.request.Request(f"http://{addr}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]
for i, c in enumerate(golden["cases"]):
    n = max(2, c["max_tokens"])
    a, b = complete(router, c["prompt_ids"], n), complete(serve, c["prompt_ids"], n)
    ta, tb = a["logprobs"]["tokens"], b["logprobs"]["tokens"]
    la, lb = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
    assert ta == tb, (model, i, ta, tb)
    assert len(la) == len(lb) == len(tb) and max(abs(p - q) for p, q in zip(la, lb)) < 1e-4, \
        (model, i, la, lb)
    assert a["text"] == b["text"], (model, i)
print(f"{model.split('/')[-1]}{sys.argv[4]}: router == serve on {len(golden['cases'])} cases")
PY
  stop_all
done

# A TP size the DeltaNet value heads do not split over is refused at start-up (exit status
# non-zero, the heads named).
model="${2:-$1}"
if [ "$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("text_config", c)["linear_num_value_heads"])' "$model/config.json")" = 2 ]; then
  timeout 60 "$bin" prefill --tp 4 --model "$model" --port 0 --kv-cache-mb 64 >"$dir/refused.log" 2>&1
  rc=$?
  if [ "$rc" = 0 ] || [ "$rc" = 124 ] || ! grep -q "linear_num_value_heads 2 do not split over 4" "$dir/refused.log"; then
    echo "'prefill --tp 4' on a model of 2 value heads: rc $rc, want a start-up error naming them"
    cat "$dir/refused.log"; status=1
  else
    echo "'prefill --tp 4' refused: $(grep -o 'linear_num_value_heads.*' "$dir/refused.log" | head -1)"
  fi
fi
exit $status
