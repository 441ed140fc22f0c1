#!/usr/bin/env bash
# Qwen3.5-397B-A17B's multi-GPU layouts predicted from one GPU (issue #28, docs/perf.md "Multi-GPU
# layouts predicted from one GPU"): writes the rank-slice checkpoints with make_random_checkpoint,
# runs bench_qwen35_cuda on them, then prints tools/predict_ep.py's tables. Run by
# tools/gpu_model_run.sh (step bench_ep_predict, which unpacks the binaries and sets the library
# path); alone: tools/gpu_ep_predict.sh BIN_DIR [--quick] [--formats bf16,fp8] [--out DIR]
#   BIN_DIR   holds make_random_checkpoint and bench_qwen35_cuda
#   --quick   batches 32 and 256 only, bench_qwen35_cuda --quick, the lm_head computed from bytes
#             instead of measured
#   --formats bf16 | fp8 | bf16,fp8 (default): which half to run
#   --out DIR the CSVs, logs and the tables (tables.md) go there (default /tmp/gpu_ep_predict)
#   TANDEM_EP_PREDICT_ARGS: more predict_ep.py arguments (--moe-csv FILE, --h200-nominal)
#
# Checkpoints (one DeltaNet + one attention layer "pair", the attention layer "attn", two
# attention layers "attn2"; vocab 1024; the 397B preset's shapes but for the flags listed):
#   decode (DP attention + EP): ep8 = --experts 64, ep16 = --experts 32 (top-10 kept: B x 10
#     pairs per rank over E / EP experts, as a rank receives); dbase = --experts 8 --top-k 2
#     --moe-intermediate 128 (the same non-expert weights, the routed experts almost gone: the
#     split and, from attn2, the per-step fixed cost); head = dbase's attention layer with the
#     real 248,320 vocab (the lm_head's measured cost; bf16 in both formats, written once).
#     bench_qwen35_cuda --decode-only --batches 32,64,128,256 --contexts 2048.
#   prefill (TP4 / EP4): tp4k2 = --heads 8 --kv-heads 1 --linear-key-heads 4
#     --linear-value-heads 16 --shared-intermediate 256 --experts 128 --top-k 2 (one rank's
#     slice, ShardPlan / DeltaNetHeads / HybridSlices of src/model); tp4k3 = the same weights
#     (symbolic links) with top-k 3 in config.json (a rank's tokens pick 10 / 4 = 2.5 local
#     experts on average: predict_ep.py takes the mean of k 2 and 3); tp4base = tp4 with the
#     tiny MoE. bench_qwen35_cuda --prefill-only --prefill 6000.
# Sizes (bf16): decode set 14.3 GB (ep8 5.6, ep16 3.2, dbase 1.3, head 4.3), prefill set 10 GB;
# FP8 about half, the head not rewritten. Each set is written, run and removed before the next
# (peak 14.3 GB: /dev/shm when it has 16 GB free, else /tmp).
# Device time (estimate): writes ~34 GB at 1-2 GB/s = 17-34 s, loads ~46 GB at ~3 GB/s = 15 s,
# 4 bench processes (CUDA start-up + ceilings ~8 s each) and their rows (~40 decode rows,
# 14 prefills of 6000 tokens) ~40 s: 2-3 minutes for both formats; --quick --formats bf16
# about 1 minute. Step limit in gpu_model_run.sh: 420 s.
set -uo pipefail
BIN=${1:?usage: tools/gpu_ep_predict.sh BIN_DIR [--quick] [--formats bf16,fp8] [--out DIR]}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
quick=0 formats=bf16,fp8 out=/tmp/gpu_ep_predict
while [ $# -gt 0 ]; do
  case $1 in
    --quick) quick=1 ;;
    --formats) formats=${2:?--formats needs a value}; shift ;;
    --out) out=${2:?--out needs a value}; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
for f in ${formats//,/ }; do
  [[ $f == bf16 || $f == fp8 ]] || { echo "--formats: bf16 and / or fp8, got $f"; exit 2; }
done
MRC=$BIN/make_random_checkpoint BENCH=$BIN/bench_qwen35_cuda
[ -x "$MRC" ] && [ -x "$BENCH" ] || { echo "need $MRC and $BENCH"; exit 2; }
mkdir -p "$out"
batches=32,64,128,256 bench_args=()
[ $quick = 1 ] && batches=32,256 bench_args=(--quick)

d=/dev/shm/tandem_ep.$$
[ "$(df --output=avail -k /dev/shm 2> /dev/null | tail -1)" -gt 16000000 ] 2> /dev/null ||
  d=/tmp/tandem_ep.$$
rm -rf "$d" && mkdir -p "$d" || exit 2
trap 'rm -rf "$d"' EXIT
echo "checkpoints in $d; formats $formats; batches $batches; quick $quick"

P397=(--preset qwen3.5-397b-a17b --vocab 1024)
TP4=(--heads 8 --kv-heads 1 --linear-key-heads 4 --linear-value-heads 16
  --shared-intermediate 256 --experts 128)
TINY=(--experts 8 --top-k 2 --moe-intermediate 128)
status=0
t_start=$SECONDS

# ckpt NAME KIND FMT FLAGS...: writes $d/NAME (KIND pair | attn | attn2).
ckpt() {
  local name=$1 kind=$2 fmt=$3 layers every
  shift 3
  case $kind in
    pair) layers=2 every=2 ;;
    attn) layers=1 every=1 ;;
    attn2) layers=2 every=1 ;;
  esac
  local t0=$SECONDS
  "$MRC" --out "$d/$name" "${P397[@]}" --layers $layers --full-attention-interval $every \
    --format "$fmt" "$@" > "$out/write_$name.log" 2>&1 ||
    { echo "!! make_random_checkpoint $name failed:"; tail -5 "$out/write_$name.log"; return 1; }
  echo "   wrote $name: $(du -sh "$d/$name" | cut -f1) in $((SECONDS - t0)) s"
}

# bench NAME ARGS... -- DIRS: one bench_qwen35_cuda process, its CSV $out/NAME.csv.
bench() {
  local name=$1 t0=$SECONDS
  shift
  TANDEM_BENCH_CSV="$out/$name.csv" "$BENCH" "$@" ${bench_args[@]+"${bench_args[@]}"} > "$out/$name.log" 2>&1
  local rc=$?
  grep -E '^== /|^(decode|prefill)|FAILED|FATAL' "$out/$name.log" | head -60
  echo "   ($name: rc $rc, $((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || status=1
}

head_done=0
csvs=()
for fmt in ${formats//,/ }; do
  echo "== $fmt decode set (DP attention + EP8 / EP16) [$(date -u +%H:%M:%S)]"
  dirs=()
  ok=1
  for kind in pair attn; do
    ckpt "${fmt}_ep8_$kind" $kind $fmt --experts 64 || ok=0
    ckpt "${fmt}_ep16_$kind" $kind $fmt --experts 32 || ok=0
    dirs+=(--checkpoint "$d/${fmt}_ep8_$kind" --checkpoint "$d/${fmt}_ep16_$kind")
  done
  for kind in pair attn attn2; do
    ckpt "${fmt}_dbase_$kind" $kind $fmt "${TINY[@]}" || ok=0
    dirs+=(--checkpoint "$d/${fmt}_dbase_$kind")
  done
  if [ $quick = 0 ] && [ $head_done = 0 ]; then
    # The head as bf16 in both formats (convert leaves lm_head unquantized): written once.
    ckpt "${fmt}_head_attn" attn $fmt "${TINY[@]}" --vocab 248320 && head_done=1 &&
      dirs+=(--checkpoint "$d/${fmt}_head_attn")
  fi
  if [ $ok = 1 ]; then
    bench "ep_decode_$fmt" --decode-only --batches $batches --contexts 2048 "${dirs[@]}"
    csvs+=(--csv "$out/ep_decode_$fmt.csv")
  else
    status=1
  fi
  rm -rf "${d:?}"/*

  echo "== $fmt prefill set (TP4 / EP4, 6000 tokens) [$(date -u +%H:%M:%S)]"
  dirs=()
  ok=1
  for kind in pair attn; do
    ckpt "${fmt}_tp4k2_$kind" $kind $fmt "${TP4[@]}" --top-k 2 || ok=0
    # top-k 3: the same weights (the router does not depend on k), config.json rewritten.
    mkdir -p "$d/${fmt}_tp4k3_$kind" &&
      for f in "$d/${fmt}_tp4k2_$kind"/*; do
        [ "$(basename "$f")" = config.json ] || ln -s "$f" "$d/${fmt}_tp4k3_$kind/"
      done &&
      sed 's/"num_experts_per_tok": 2,/"num_experts_per_tok": 3,/' \
        "$d/${fmt}_tp4k2_$kind/config.json" > "$d/${fmt}_tp4k3_$kind/config.json" &&
      grep -q '"num_experts_per_tok": 3,' "$d/${fmt}_tp4k3_$kind/config.json" ||
      { echo "!! tp4k3 config for $kind"; ok=0; }
    dirs+=(--checkpoint "$d/${fmt}_tp4k2_$kind" --checkpoint "$d/${fmt}_tp4k3_$kind")
  done
  for kind in pair attn attn2; do
    ckpt "${fmt}_tp4base_$kind" $kind $fmt "${TP4[@]}" "${TINY[@]}" || ok=0
    dirs+=(--checkpoint "$d/${fmt}_tp4base_$kind")
  done
  if [ $ok = 1 ]; then
    bench "ep_prefill_$fmt" --prefill-only --prefill 6000 "${dirs[@]}"
    csvs+=(--csv "$out/ep_prefill_$fmt.csv")
  else
    status=1
  fi
  rm -rf "${d:?}"/*
done

echo "== predict_ep.py (all steps $((SECONDS - t_start)) s)"
if [ ${#csvs[@]} -gt 0 ]; then
  python3 "$ROOT/tools/predict_ep.py" "${csvs[@]}" --formats "$formats" --batches $batches \
    ${TANDEM_EP_PREDICT_ARGS:-} --check | tee "$out/tables.md"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  status=1
fi
exit $status
