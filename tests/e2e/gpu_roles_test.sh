#!/usr/bin/env bash
# GPU instances on one machine (the H200 run; every rank a process, ranks sharing the GPU):
#   router -> prefill TP=2 (--device cuda --nprocs 2) -> two decode instances DP=2/EP=2
#   (--device cuda --nprocs 2 each), against colocated `tandem serve --device cuda`:
#   - every golden case of each GPU-shaped fixture: the same greedy tokens as serve, by the
#     margin rule (tokens agree up to the first step where serve's top1-top2 logprob margin
#     is under 0.5; bf16 numerics of another sharding may flip a near tie there);
#   - the same with the decode instances speculating (MTP, K = 2) for models with an MTP head,
#     and the router's spec-decode counters;
#   - 32 concurrent streaming requests over the two decode instances all complete;
#   - kill -9 of one decode rank mid-stream ends only that instance's streams, with an error;
#     the other instance's streams complete and its page pools return to their baseline.
#   gpu_roles_test.sh TANDEM_BIN FIXTURE_DIR...
set -uo pipefail
bin="$1"; shift
dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do
    for c in $(pgrep -P "$p" 2>/dev/null); do kill -9 "$c" 2>/dev/null; done
    kill -9 "$p" 2>/dev/null
  done
  wait 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
export NCCL_NVLS_ENABLE=0

start() {  # start NAME ARGS...: `tandem ARGS` in the background, waits for its address line
  local name="$1"; shift
  "$bin" "$@" >"$dir/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  eval "${name}_pid=$pid"
  for _ in $(seq 1200); do
    addr=$(grep -o 'on [0-9.]*:[0-9][0-9]*\|http://[0-9.]*:[0-9]*' "$dir/$name.log" 2>/dev/null | head -1 | grep -o '[0-9.]*:[0-9]*$')
    [ -n "$addr" ] && { eval "${name}_addr=$addr"; return 0; }
    kill -0 "$pid" 2>/dev/null || { echo "$name exited:"; cat "$dir/$name.log"; exit 1; }
    sleep 0.1
  done
  echo "$name did not start"; cat "$dir/$name.log"; exit 1
}
stop_all() {
  for p in "${pids[@]}"; do
    for c in $(pgrep -P "$p" 2>/dev/null); do kill -9 "$c" 2>/dev/null; done
    kill -9 "$p" 2>/dev/null
  done
  wait 2>/dev/null
  pids=()
}

# compare MODEL: every golden case through the router and through serve, by the margin rule.
compare() {
  python3 - "$1" "$router_addr" "$serve_addr" <<'PY'
import json, sys, urllib.request
model, router, serve = sys.argv[1:4]
golden = json.load(open(model + "/golden.json"))
def complete(addr, ids, n):
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": n, "temperature": 0,
                       "logprobs": 2, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://{addr}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    out = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]
    return out
compared = 0
for i, c in enumerate(golden["cases"]):
    a = complete(router, c["prompt_ids"], c["max_tokens"])
    b = complete(serve, c["prompt_ids"], c["max_tokens"])
    ta, tb = a["logprobs"]["tokens"], b["logprobs"]["tokens"]
    tops = b["logprobs"]["top_logprobs"]
    for t in range(len(tb)):
        lp = sorted(tops[t].values(), reverse=True)
        if len(lp) < 2 or lp[0] - lp[1] < 0.5:
            break
        assert t < len(ta) and ta[t] == tb[t], (model, i, t, ta[:t + 1], tb[:t + 1])
        compared += 1
assert compared > 0, "no step compared"
print(f"{model.split('/')[-1]}: router == serve on {compared} greedy steps")
PY
}

status=0
for model in "$@"; do
  name=$(basename "$model")
  common=(--model "$model" --device cuda --kv-cache-mb 256 --max-model-len 1024)
  start decA decode "${common[@]}" --nprocs 2 --port 0 --max-decode-batch 32 --metrics-port 0
  start decB decode "${common[@]}" --nprocs 2 --port 0 --max-decode-batch 32 --metrics-port 0
  start pre prefill "${common[@]}" --nprocs 2 --port 0
  start router router --model "$model" --served-model-name m --prefill "$pre_addr" --decode "$decA_addr,$decB_addr" --port 0
  start serve serve "${common[@]}" --served-model-name m --port 0 --no-prefix-cache
  compare "$model" || status=1
  stop_all
done

# Started in the other order: the router first, pointed at ports the instances take later, then
# the decode instances, then the prefill instance; the router admits each as it comes up (its
# /health turns 200 once a prefill and a decode instance are ready), and serves the same tokens.
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
model="$1"
common=(--model "$model" --device cuda --kv-cache-mb 256 --max-model-len 1024)
pP=$(free_port); pA=$(free_port); pB=$(free_port)
start router router --model "$model" --served-model-name m --prefill "127.0.0.1:$pP" \
  --decode "127.0.0.1:$pA,127.0.0.1:$pB" --port 0
start decA decode "${common[@]}" --nprocs 2 --port "$pA" --max-decode-batch 32
start decB decode "${common[@]}" --nprocs 2 --port "$pB" --max-decode-batch 32
start pre prefill "${common[@]}" --nprocs 2 --port "$pP"
up=0
for _ in $(seq 600); do
  curl -sf -o /dev/null "http://$router_addr/health" && { up=1; break; }
  sleep 0.1
done
if [ $up = 1 ]; then
  start serve serve "${common[@]}" --served-model-name m --port 0 --no-prefix-cache
  echo "router started first, then decode, then prefill: ready"
  compare "$model" || status=1
else
  echo "the router started first never became ready"; tail -5 "$dir/router.log"; status=1
fi
stop_all

# MTP speculative decoding on the GPU decode instances (models that ship an MTP head: the demo
# model): the same greedy tokens as serve without speculation, by the margin rule, and the
# router's /metrics counts the drafts and accepted tokens of every rank of both instances.
spec='{"method": "mtp", "num_speculative_tokens": 2}'
for model in "$@"; do
  [ -f "$model/model-mtp.safetensors" ] || continue
  common=(--model "$model" --device cuda --kv-cache-mb 256 --max-model-len 1024)
  start decA decode "${common[@]}" --nprocs 2 --port 0 --max-decode-batch 32 --speculative-config "$spec"
  start decB decode "${common[@]}" --nprocs 2 --port 0 --max-decode-batch 32 --speculative-config "$spec"
  start pre prefill "${common[@]}" --nprocs 2 --port 0
  start router router --model "$model" --served-model-name m --prefill "$pre_addr" --decode "$decA_addr,$decB_addr" --port 0
  start serve serve "${common[@]}" --served-model-name m --port 0 --no-prefix-cache
  compare "$model" || status=1
  sleep 2  # the router polls its instances' counters
  m=$(curl -sf "http://$router_addr/metrics")
  drafts=$(echo "$m" | grep '^vllm:spec_decode_num_drafts_total' | awk '{print int($2)}')
  tokens=$(echo "$m" | grep '^vllm:spec_decode_num_draft_tokens_total' | awk '{print int($2)}')
  accepted=$(echo "$m" | grep '^vllm:spec_decode_num_accepted_tokens_total' | awk '{print int($2)}')
  echo "$(basename "$model"), speculating decode instances: drafts ${drafts:-none}, draft tokens ${tokens:-none}, accepted ${accepted:-none}"
  if ! { [ "${drafts:-0}" -gt 0 ] && [ "${tokens:-0}" -ge "$drafts" ] && [ "$tokens" -le $((2 * drafts)) ] && [ "${accepted:-0}" -gt 0 ]; }; then
    echo "the router's MTP counters are missing or wrong"; status=1
  fi
  stop_all
done

# Load and failure, on the first fixture.
model="$1"
common=(--model "$model" --device cuda --kv-cache-mb 256 --max-model-len 1024)
start decA decode "${common[@]}" --nprocs 2 --port 0 --max-decode-batch 32 --metrics-port 0
start decB decode "${common[@]}" --nprocs 2 --port 0 --max-decode-batch 32 --metrics-port 0
start pre prefill "${common[@]}" --nprocs 2 --port 0
start router router --model "$model" --served-model-name m --prefill "$pre_addr" --decode "$decA_addr,$decB_addr" --port 0
mport() { grep -o "/metrics on port [0-9]*" "$dir/$1.log" | grep -o "[0-9]*$"; }
pages() { curl -sf "http://127.0.0.1:$(mport "$1")/metrics" | grep '^tandem_decode_kv_pages_free' | sort; }
sleep 1
baseB=$(pages decB)
echo "decode B free pages at start: $(echo $baseB | tr '\n' ' ')"
python3 - "$router_addr" 32 200 <<'PY' || status=1
import json, sys, threading, urllib.request
addr, n, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ok = []
def run(i):
    body = json.dumps({"model": "m", "prompt": [1 + i, 2, 3, 4, 5], "max_tokens": tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"http://{addr}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    text = urllib.request.urlopen(req, timeout=600).read().decode()
    ok.append('"finish_reason":"length"' in text and "[DONE]" in text)
ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
[t.start() for t in ts]
[t.join() for t in ts]
assert len(ok) == n and all(ok), f"{sum(ok)} of {n} streams completed"
print(f"{n} concurrent streams over two decode instances: all completed")
PY
# Long streams on both instances, then kill -9 one rank of decode A.
for i in $(seq 8); do
  curl -sN "http://$router_addr/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"m\",\"prompt\":[$i,2,3],\"max_tokens\":600,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}" \
    >"$dir/s$i.txt" &
  pids+=("$!")
done
sleep 3
victim=$(pgrep -P "$decA_pid" | tail -1)
echo "killing decode A rank process $victim"
kill -9 "$victim"
for _ in $(seq 3000); do
  n=$(grep -l '\[DONE\]' "$dir"/s*.txt 2>/dev/null | wc -l)
  [ "$n" -eq 8 ] && break
  sleep 0.1
done
errors=$(grep -l '"error"\|failed' "$dir"/s*.txt | wc -l)
done_ok=$(grep -l '"finish_reason":"length"' "$dir"/s*.txt | wc -l)
echo "streams: $errors ended with an error, $done_ok completed"
if ! { [ "$errors" -ge 1 ] && [ "$done_ok" -ge 1 ] && [ $((errors + done_ok)) -eq 8 ]; }; then
  for f in "$dir"/s*.txt; do echo "== $f"; tail -c 300 "$f"; echo; done
  status=1
fi
sleep 1
afterB=$(pages decB)
echo "decode B free pages at the end: $(echo $afterB | tr '\n' ' ')"
[ -n "$baseB" ] && [ "$baseB" == "$afterB" ] || { echo "decode B's page pool did not return to its baseline"; status=1; }
curl -sf "http://$router_addr/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"m","prompt":[1,2,3],"max_tokens":5,"temperature":0}' | grep -q '"finish_reason":"length"' \
  || { echo "the router stopped serving after a decode rank died"; status=1; }
[ $status -eq 0 ] && echo "gpu_roles_test: PASSED" || echo "gpu_roles_test: FAILED"
exit $status
