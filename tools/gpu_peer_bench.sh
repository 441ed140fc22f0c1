#!/usr/bin/env bash
# The peers' published serving rows on one H200 (issue 30, item 2), run with `tandem bench serve`
# against `tandem serve --device cuda` over full-depth random checkpoints at the published shapes
# (make_random_checkpoint, in /dev/shm), with --ignore-eos; beside each row the engine's own
# decode throughput at the same batch (bench_qwen35_cuda / bench_model_cuda, same machine, same
# run) for the 0.9x target. Unpacks the binaries as tools/gpu_model_run.sh does; builds nothing.
#
#   tools/gpu_peer_bench.sh PACK_DIR [--quick] [--fp8] [--models q35,q30] \
#       [--rows engine,serve,long,single] [--budget-s S]
#
# Rows (per model):
#   serve   1,000 in / 2,000 out at concurrency 200 (vLLM 0.17.1, GPUStack lab: Qwen3.5-35B-A3B
#           6,947 output tok/s bf16, 8,146 FP8)
#   long    8,192 in / 1,024 out at the largest concurrency the KV cache holds, <= 1,024 (SGLang
#           0.5.16, Qwen3.6-35B-A3B at 1,024: ~2,337 bf16 / ~3,356 FP8 output tok/s)
#   single  8,192 in / 1,024 out at concurrency 1: TPOT and the 8k TTFT (SGLang with MTP: TPOT
#           2.23 / 1.98 ms, TTFT 182 / 138 ms bf16 / FP8)
#   engine  the engine's decode step at the serve and long rows' batches (no HTTP), for the
#           "serving >= 0.9x the engine's decode throughput" target
# --quick: one wave per row (serve 200 prompts, long = its concurrency, single 2) and the engine
# rows' quick mode; default: serve 800, long 2 x its concurrency, single 5.
# --fp8: the checkpoint written as block FP8 directly (make_random_checkpoint --format fp8: the
# layout `tandem convert --format fp8` makes of the bf16 one, about half its size, no convert).
# --budget-s S: each row's time limit (default 240 quick, 540 full); a row past it is cut and
# reported as such. The models: q35 (Qwen3.5-35B-A3B, 40 layers, ~69 GB bf16) and q30
# (Qwen3-30B-A3B, 48 layers, ~61 GB); one at a time in /dev/shm (deleted after). When /dev/shm
# cannot hold the whole model, it is cut to the layers that fit (a multiple of 4 for q35) and
# the table says so: such a row does not compare with the published one.
# Env: TANDEM_PEER_UTIL_Q35 (default 0.75: Qwen3.5's DeltaNet state slots, ~63 MB per sequence,
# are allocated beside the KV budget), TANDEM_PEER_UTIL_Q30 (0.9), TANDEM_PEER_SEQS (256: the
# server's --max-num-seqs), TANDEM_PEER_SHM (/dev/shm), TANDEM_PEER_KEEP=1 (the last model's
# checkpoint stays in TANDEM_PEER_SHM/peer_MODEL for a later benchmark; removed otherwise).
# Output: $OUT/peer_bench (or /tmp/peer_bench): each row's result JSON (vLLM's fields), the
# server logs (start-up phases and time to ready), table.md; the table is printed last.
# Time (device): per model about 1 min to write the checkpoint, 1 min for the engine rows, 1 min
# to start the server, then the rows: quick ~2 + 4 + 0.5 min.
# TANDEM_PEER_DRY_RUN=BUILD_DIR: the same flow on the CPU with tiny shapes and short rows, from
# BUILD_DIR's binaries (no PACK_DIR unpacking, no engine rows): checks the script, not speed.
set -uo pipefail
PACK=${1:?usage: tools/gpu_peer_bench.sh PACK_DIR [--quick] [--fp8] [--models q35,q30] [--rows ...]}
shift
quick=0; fp8=0; models=q35,q30; rows=engine,serve,long,single; budget=
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --fp8) fp8=1 ;;
    --models) models=$2; shift ;;
    --rows) rows=$2; shift ;;
    --budget-s) budget=$2; shift ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
[ -n "$budget" ] || budget=$([ $quick = 1 ] && echo 240 || echo 540)
dry=${TANDEM_PEER_DRY_RUN:-}
ROOT=$(pwd)
RES=${OUT:-/tmp}/peer_bench
mkdir -p "$RES"
BIN=/tmp/tandem_gpu_bin
device=cuda
if [ -n "$dry" ]; then
  BIN=$(cd "$dry" && pwd); device=cpu; rows=${rows//engine/}
  echo "dry run on the CPU (tiny shapes) with $BIN"
elif PACK=$(cd "$PACK" && pwd) && { [ ! -x "$BIN/tandem" ] || [ "$PACK/bin.tar.xz" -nt "$BIN/tandem" ]; }; then
  rm -rf "$BIN" && mkdir -p "$BIN"
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    "$PACK/bin.tar.xz" "$BIN" || { echo "cannot unpack $PACK/bin.tar.xz"; exit 2; }
fi
export NCCL_NVLS_ENABLE=0
if [ -z "$dry" ]; then
  source "$ROOT/tools/gpu_libs.sh"
  find_gpu_libs libcudart.so.13 libcublasLt.so.13 libcublas.so.13
  for f in "$BIN"/lib/*; do
    ldconfig -p 2>/dev/null | grep -q "$(basename "$f") " && rm -f "$f"
  done
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$BIN/lib"
fi
SHM=${TANDEM_PEER_SHM:-/dev/shm}
SEQS=${TANDEM_PEER_SEQS:-256}
has_row() { [[ ",$rows," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$RES/gpu.txt"
echo "shm: $(df -h "$SHM" | tail -1)"

pid=; ck=
cleanup() {
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
  wait 2>/dev/null
  [ -n "$ck" ] && rm -rf "$ck"
}
trap cleanup EXIT

TABLE="$RES/table.md"
{
  echo "| model | row | ours | published | source | ratio | engine decode tok/s (same batch) | serving / engine |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
} > "$TABLE"
row() { echo "| $* |" >> "$TABLE"; }
ratio() { python3 -c "
import sys
def num(x):
    try: return float(x)
    except ValueError: return 0.0
a, b = num(sys.argv[1]), num(sys.argv[2])
print(f'{a / b:.2f}x' if a > 0 and b > 0 else '-')" "$1" "$2"; }
# jget FILE KEY [DIGITS]: a field of a result JSON, rounded ("" when missing)
jget() { python3 -c "
import json, sys
v = json.load(open(sys.argv[1])).get(sys.argv[2], '')
print(f'{v:.{int(sys.argv[3])}f}' if isinstance(v, (int, float)) else v)" "$1" "$2" "${3:-1}" 2>/dev/null; }

for model in ${models//,/ }; do
  case $model in
    q35) preset=qwen3.5-35b-a3b; full_layers=40; step=4; gb_per_layer=1.65; util=${TANDEM_PEER_UTIL_Q35:-0.75}
         name="Qwen3.5-35B-A3B" ;;
    q30) preset=qwen3-30b-a3b; full_layers=48; step=1; gb_per_layer=1.25; util=${TANDEM_PEER_UTIL_Q30:-0.9}
         name="Qwen3-30B-A3B" ;;
    *) echo "unknown model $model (q35, q30)"; continue ;;
  esac
  fmt=$([ $fp8 = 1 ] && echo fp8 || echo bf16)
  # /dev/shm room: the checkpoint; block FP8 (--fp8) takes about 0.51 of bf16's bytes per layer.
  avail_gb=$(df -B1 --output=avail "$SHM" | tail -1 | awk '{printf "%d", $1 / 1e9}')  # GB, as below
  need_factor=$([ $fp8 = 1 ] && echo 0.52 || echo 1.02)
  layers=$(python3 -c "import math;a,g,f,s,L=$avail_gb,$gb_per_layer,$need_factor,$step,$full_layers
n=int((a-3)/(g*f)); n=min(L,n-n%s); print(max(n,0))")
  [ -n "$dry" ] && { layers=2; step=2; full_layers=2; }
  label="$name $fmt"
  [ "$layers" -lt "$full_layers" ] && label="$label ($layers of $full_layers layers: /dev/shm holds ${avail_gb} GB)"
  [ "$layers" -ge "$step" ] || { echo "== $model: /dev/shm has ${avail_gb} GB, too little"; continue; }
  echo; echo "== $label [$(date -u +%H:%M:%S)]"
  ck="$SHM/peer_$model"
  rm -rf "$ck"
  t0=$SECONDS
  shape=(--preset "$preset" --layers "$layers")
  [ $fp8 = 1 ] && shape+=(--format fp8)
  [ -n "$dry" ] && shape+=(--hidden 64 --intermediate 128 --moe-intermediate 32 --experts 8 --top-k 2
                          --heads 4 --kv-heads 2 --head-dim 16 --vocab 512)
  [ -n "$dry" ] && [ $model = q35 ] && shape+=(--full-attention-interval 2 --linear-key-heads 2
                          --linear-value-heads 4 --linear-key-dim 16 --linear-value-dim 16
                          --shared-intermediate 32)
  "$BIN/make_random_checkpoint" --out "$ck" "${shape[@]}" > "$RES/${model}_checkpoint.log" 2>&1 \
    || { echo "checkpoint failed"; tail -5 "$RES/${model}_checkpoint.log"; continue; }
  echo "   checkpoint ($fmt): $((SECONDS - t0)) s"
  dir=$ck

  # --- the server (its start-up log: phases, time to ready) ---
  log="$RES/${model}_${fmt}_serve.log"
  t0=$SECONDS
  mem=(--gpu-memory-utilization "$util")
  [ -n "$dry" ] && mem=(--kv-cache-mb 256)
  "$BIN/tandem" serve --model "$dir" --device "$device" --served-model-name m --port 0 \
    --max-num-seqs "$SEQS" --max-num-batched-tokens 8192 --max-model-len 10240 \
    "${mem[@]}" --disable-access-log > "$log" 2>&1 &
  pid=$!
  # Ready: the "serving ... on http://" line (up to 15 min; a 70 GB load prints its progress).
  addr=
  for i in $(seq 9000); do
    addr=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" 2>/dev/null | head -1 | sed 's|http://||')
    [ -n "$addr" ] && break
    kill -0 "$pid" 2>/dev/null || break
    [ $((i % 200)) = 0 ] && { grep -E '^tandem: (weights|startup)' "$log" | tail -1 | sed 's/^/   ... /'; }
    sleep 0.1
  done
  if [ -z "$addr" ]; then echo "serve did not start"; tail -20 "$log"; kill -9 "$pid" 2>/dev/null; pid=; continue; fi
  ready_s=$(grep -o 'startup: ready in [0-9.]*' "$log" | grep -o '[0-9.]*$')  # the server's own
  grep -E '^tandem: (startup|weights|KV cache)' "$log" | sed 's/^/   /'
  # The largest concurrency the KV cache holds at 8,192 + 1,024 tokens (page size 16).
  pages=$(curl -s "http://$addr/metrics" | awk '/^tandem_kv_pages_total /{print int($2)}')
  conc_long=$(python3 -c "p=int('${pages:-0}' or 0); print(max(1, min(1024, $SEQS, p // (9216 // 16))))")
  echo "   ready in ${ready_s} s; KV pages ${pages:-?}: long-row concurrency $conc_long"
  bench() {  # bench TAG CONCURRENCY PROMPTS IN OUT
    local tag=$1 c=$2 n=$3 in=$4 out=$5
    timeout --kill-after=10 "$budget" "$BIN/tandem" bench serve --base-url "http://$addr" --model m \
      --tokenizer "$dir" --dataset-name random --random-input-len "$in" --random-output-len "$out" \
      --num-prompts "$n" --max-concurrency "$c" --ignore-eos --disable-tqdm \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
      --save-result --result-dir "$RES" --result-filename "${model}_${fmt}_$tag.json" \
      --metadata "model=$name" "format=$fmt" "layers=$layers" > "$RES/${model}_${fmt}_$tag.txt" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "   $tag: cut at the ${budget} s budget"
    grep -E 'Successful|Failed requests|Output token throughput|Mean TTFT|Mean TPOT|P99 ITL' \
      "$RES/${model}_${fmt}_$tag.txt" | sed "s/^/   $tag: /"
  }
  if [ -n "$dry" ]; then  # tiny rows: the flow only
    has_row serve && bench serve 4 8 64 16
    has_row long && bench long "$(( conc_long < 4 ? conc_long : 4 ))" 4 512 8
    has_row single && bench single 1 2 512 8
  else
    has_row serve && bench serve 200 $([ $quick = 1 ] && echo 200 || echo 800) 1000 2000
    has_row long && bench long "$conc_long" $([ $quick = 1 ] && echo "$conc_long" || echo $((2 * conc_long))) 8192 1024
    has_row single && bench single 1 $([ $quick = 1 ] && echo 2 || echo 5) 8192 1024
  fi
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; pid=

  # --- the engine's own decode step at the same batches (same machine, GPU free again) ---
  eng_serve=; eng_long=
  if has_row engine; then
    csv="$RES/${model}_${fmt}_engine.csv"
    if [ $model = q35 ]; then
      TANDEM_BENCH_CSV=$csv timeout --kill-after=10 "$budget" "$BIN/bench_qwen35_cuda" --checkpoint "$dir" \
        --decode-only --batches "200,$conc_long" --contexts 2048,8704 $([ $quick = 1 ] && echo --quick) \
        > "$RES/${model}_${fmt}_engine.log" 2>&1
      eng() { python3 - "$csv" "$1" "$2" <<'EOF'
import csv, sys
b, ctx = int(sys.argv[2]), sys.argv[3]
for r in csv.DictReader(open(sys.argv[1])):
    if r["op"] == "decode_ctx" + ctx and int(r["tokens"]) == b and float(r["us"]) > 0:
        print(f'{b / float(r["us"]) * 1e6:.0f}'); break
EOF
      }
    else
      TANDEM_BENCH_CSV=$csv timeout --kill-after=10 "$budget" "$BIN/bench_model_cuda" --checkpoint "$dir" \
        --no-prefill --batches "200,$conc_long" $([ $quick = 1 ] && echo --quick) \
        > "$RES/${model}_${fmt}_engine.log" 2>&1
      eng() { python3 - "$csv" "$1" <<'EOF'
import csv, sys
b, best = int(sys.argv[2]), None
for r in csv.DictReader(open(sys.argv[1])):
    if r["phase"] == "decode" and int(r["batch"]) == b and float(r["us"]) > 0:
        if best is None or int(r["ctx"]) > int(best["ctx"]): best = r
if best: print(f'{b / float(best["us"]) * 1e6:.0f} (ctx {best["ctx"]})')
EOF
      }
    fi
    eng_serve=$(eng 200 2048 2>/dev/null); eng_long=$(eng "$conc_long" 8704 2>/dev/null)
    echo "   engine decode tok/s: batch 200 ${eng_serve:-?}, batch $conc_long ${eng_long:-?}"
  fi

  # --- the table ---
  pub() { [ $model = q35 ] && { [ $fmt = fp8 ] && echo "$2" || echo "$1"; } || echo "-"; }
  f=$RES/${model}_${fmt}
  if has_row serve; then
    o=$(jget "$f"_serve.json output_throughput); p=$(pub 6947 8146)
    row "$label | 1,000/2,000 c200 output tok/s | ${o:-failed} | $p | vLLM 0.17.1, GPUStack lab | $(ratio "$o" "$p") | ${eng_serve:-} | $(ratio "$o" "${eng_serve%% *}")"
  fi
  if has_row long; then
    o=$(jget "$f"_long.json output_throughput); p=$(pub 2337 3356)
    row "$label | 8,192/1,024 c$conc_long (published at c1,024) output tok/s | ${o:-failed} | $p | SGLang 0.5.16 (Qwen3.6-35B-A3B) | $(ratio "$o" "$p") | ${eng_long:-} | $(ratio "$o" "${eng_long%% *}")"
    t=$(jget "$f"_long.json mean_tpot_ms 2); p=$(pub 32.7 27.9)
    row "$label | 8,192/1,024 c$conc_long mean TPOT ms | ${t:-failed} | $p | SGLang 0.5.16 | $(ratio "$p" "$t") | | "
  fi
  if has_row single; then
    t=$(jget "$f"_single.json mean_tpot_ms 2); p=$(pub 2.23 1.98)
    row "$label | c1 mean TPOT ms (no speculation) | ${t:-failed} | $p | SGLang 0.5.16 with MTP | $(ratio "$p" "$t") | | "
    t=$(jget "$f"_single.json mean_ttft_ms); p=$(pub 182 138)
    row "$label | c1 TTFT ms, 8,192-token prompt | ${t:-failed} | $p | SGLang 0.5.16 | $(ratio "$p" "$t") | | "
  fi
  row "$label | time to ready s (load, KV, graphs) | $ready_s | - | - | - | | "
  [ "${TANDEM_PEER_KEEP:-0}" = 1 ] && { echo "   (kept $ck)"; ck=; continue; }
  rm -rf "$ck"; ck=
done
echo
echo "== peers' rows (ratio > 1: ours better; throughput ours / theirs, latency theirs / ours)"
cat "$TABLE"
