#!/usr/bin/env bash
# Every GPU test suite in one device call of at most 10 minutes (tools/gpu_model_run.sh runs them
# one after another with the benchmarks, which takes longer): the suites at once on the one GPU
# (ranks as processes sharing it), the disaggregated roles over the Qwen3.5 fixtures beside them,
# then short benchmarks while the call's time lasts. Unpacks the binaries packed by
# tools/pack_gpu_bin.sh; builds nothing.
#
#   tools/gpu_suites.sh PACK_DIR [--budget-s S]     (from the repo root; default budget 570 s)
#
# Pack at least: tandem make_random_checkpoint test_backend_cuda test_model_cuda
# test_model_cuda_sharded test_transfer_cuda test_comm_cuda bench_attention bench_qwen35_cuda
# bench_fp8_linear profile_decode_cuda (TANDEM_PACK_BINS="..." tools/pack_gpu_bin.sh build DIR).
#
# Parallel phase (each with its own time limit; all must pass):
#   test_backend_cuda         every kernel against its CPU reference
#   test_model_cuda           golden fixtures: teacher-forced logits, greedy through the engine,
#                             graphs above batch 256, FP8 / MXFP8 / FP8 KV, MTP
#   test_model_cuda_sharded   prefill TP=2 and decode DP=2/EP=2 on ranks sharing the GPU,
#                             Qwen3-MoE and Qwen3.5 (bf16 and block FP8)
#   test_transfer_cuda        KV + state over CUDA IPC
#   test_comm_w2              test_comm_cuda's all-reduce and DP-EP dispatch / combine at
#                             TANDEM_COMM_TEST_WORLD=2 (two ranks on the one GPU)
#   gpu_roles_q35             tests/e2e/gpu_roles_test.sh over both Qwen3.5 fixtures
# Then, one at a time while the budget lasts (benchmarks: rc is reported, not failed):
#   q35_fp8_decode   Qwen3.5-35B-A3B cut to 4 layers: decode rows in bf16, block FP8 with
#                    W8A16 experts (TANDEM_CUDA_FP8_ACT=0), W8A8 (the default), and W8A8 with
#                    the dense linears bf16 (--fp8-dense-bf16: only the experts FP8); then
#                    one batch-1 decode step of each format kernel by kernel (CUPTI)
#   bench_attention  paged decode over bf16 and FP8 KV pages, prefill attention
#   profile_decode_fp8  one block-FP8 Qwen3-30B-A3B decode step at batch 1, kernel by kernel
#   bench_fp8_linear    the FP8 dense linear paths by rows
# Logs: /tmp/gpu_suites, and $OUT/logs.tgz (rewritten every 15 s, so a cut call still returns
# them). Exit status 0 only when every suite passed.
set -uo pipefail
PACK=${1:?usage: tools/gpu_suites.sh PACK_DIR [--budget-s S]}
shift
BUDGET=570
while [ $# -gt 0 ]; do
  case $1 in
    --budget-s) BUDGET=$2; shift ;;
    *) echo "unknown flag $1"; exit 2 ;;
  esac
  shift
done
ROOT=$(pwd)
LOG=/tmp/gpu_suites
rm -rf "$LOG" && mkdir -p "$LOG"
BIN=/tmp/tandem_gpu_bin
rm -rf "$BIN" && mkdir -p "$BIN"
T0=$SECONDS
python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
  "$PACK/bin.tar.xz" "$BIN" || { echo "cannot unpack $PACK/bin.tar.xz"; exit 2; }
echo "unpacked in $((SECONDS - T0)) s"
# NVLink multicast can take the shared host's GPUs down: off, always.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TANDEM_SOURCE_DIR=$ROOT
[ -d "$BIN/qwen3_tokenizer" ] && export TANDEM_QWEN3_TOKENIZER_DIR=$BIN/qwen3_tokenizer
source "$ROOT/tools/gpu_libs.sh"
find_gpu_libs libcudart.so.13 libcublasLt.so.13 libcublas.so.13 libnccl.so.2
for f in "$BIN"/lib/*; do
  ldconfig -p 2>/dev/null | grep -q "$(basename "$f") " && rm -f "$f"
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$BIN/lib"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  git -C "$ROOT" log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
} | tee "$LOG/env.txt"
saver=
if [ -n "${OUT:-}" ]; then
  ( while true; do tar -C "$LOG" -czf "$OUT/logs.tgz.part" . 2>/dev/null &&
      mv "$OUT/logs.tgz.part" "$OUT/logs.tgz"; sleep 15; done ) &
  saver=$!
fi
declare -A PID
start() {  # start NAME LIMIT CMD...: in the background, its log and exit status in LOG/NAME.log
  local name=$1 limit=$2
  shift 2
  ( timeout --kill-after=5 "$limit" "$@" > "$LOG/$name.log" 2>&1; echo "rc=$?" >> "$LOG/$name.log" ) &
  PID[$name]=$!
}
status=0
report() {
  local name=$1
  echo
  echo "== $name: $(tail -1 "$LOG/$name.log") (124: timed out)"
  grep -E '^\[  PASSED  \]|^\[  FAILED  \]|tests? from .* ran|^\[ [a-z0-9_]+ \]|^(PASSED|FAILED)' \
    "$LOG/$name.log" | head -40
  local skipped
  skipped=$(grep -c '^\[  SKIPPED \] ' "$LOG/$name.log")
  [ "$skipped" -gt 0 ] && echo "($skipped SKIPPED lines)"
  if ! grep -q '^rc=0$' "$LOG/$name.log"; then
    [[ $name == bench* || $name == q35* || $name == profile* ]] || status=1
    grep -B2 -A10 -E 'Failure$|what\(\)|FATAL' "$LOG/$name.log" | head -60
    tail -8 "$LOG/$name.log"
  elif [[ $name == test_* ]] && grep -q '^\[  SKIPPED \]' "$LOG/$name.log"; then
    echo "!! $name skipped tests on the GPU machine"
    status=1
  fi
}

suites=(test_backend_cuda test_transfer_cuda test_comm_w2 test_model_cuda gpu_roles_q35
        test_model_cuda_sharded)
start test_backend_cuda 420 "$BIN/test_backend_cuda"
start test_model_cuda 330 "$BIN/test_model_cuda"
start test_model_cuda_sharded 400 "$BIN/test_model_cuda_sharded"
start test_transfer_cuda 150 "$BIN/test_transfer_cuda"
start test_comm_w2 200 env TANDEM_COMM_TEST_WORLD=2 "$BIN/test_comm_cuda" \
  --gtest_filter='CudaMoeTest.*:CudaAllReduceTest.*'
start gpu_roles_q35 400 "$ROOT/tests/e2e/gpu_roles_test.sh" "$BIN/tandem" \
  "$ROOT/tests/data/fixtures/qwen35_text_hd64_int2_fused" \
  "$ROOT/tests/data/fixtures/qwen35_vl_hd256_int4_tied_bf16"
for n in "${suites[@]}"; do
  wait "${PID[$n]}"
  echo "[$((SECONDS - T0)) s] $n done: $(tail -1 "$LOG/$n.log")"
done
for n in "${suites[@]}"; do report "$n"; done

bench() {  # bench NAME LIMIT CMD...: alone on the GPU, cut to what is left of the budget
  local name=$1 limit=$2 left=$((BUDGET - (SECONDS - T0)))
  shift 2
  if [ "$left" -lt 30 ]; then
    echo "(no time left for $name)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "[$((SECONDS - T0)) s] $name (limit $limit s)"
  start "$name" "$limit" "$@"
  wait "${PID[$name]}"
}
q35="--decode-only --quick --batches 1,32,128,256 --contexts 1024"
bench q35_fp8_decode 300 bash -c "set -e; d=/dev/shm/gpu_suites_q35; rm -rf \$d
  '$BIN/make_random_checkpoint' --out \$d/bf16 --preset qwen3.5-35b-a3b --layers 4 > /dev/null
  '$BIN/make_random_checkpoint' --out \$d/fp8 --preset qwen3.5-35b-a3b --layers 4 --format fp8 > /dev/null
  echo '== bf16'; '$BIN/bench_qwen35_cuda' --checkpoint \$d/bf16 $q35
  echo '== block FP8, W8A16 experts'; TANDEM_CUDA_FP8_ACT=0 '$BIN/bench_qwen35_cuda' --checkpoint \$d/fp8 $q35
  echo '== block FP8, W8A8 experts'; '$BIN/bench_qwen35_cuda' --checkpoint \$d/fp8 $q35
  echo '== block FP8, W8A8 experts, dense linears bf16'; '$BIN/bench_qwen35_cuda' --checkpoint \$d/fp8 $q35 --fp8-dense-bf16
  for f in bf16 fp8; do echo \"== batch-1 decode step kernel by kernel, \$f\"
    '$BIN/bench_qwen35_cuda' --checkpoint \$d/\$f --decode-only --quick --batches 1 --contexts 1024 \
      --profile-decode 1 | sed -n '/profile/,\$p' | head -60; done
  rm -rf \$d"
TANDEM_BENCH_CSV=$LOG/bench_attention.csv bench bench_attention 150 "$BIN/bench_attention" --quick
bench profile_decode_fp8 120 "$BIN/profile_decode_cuda" --batch 1 --variants default --fp8
bench bench_fp8_linear 150 "$BIN/bench_fp8_linear" --quick
for n in q35_fp8_decode bench_attention profile_decode_fp8 bench_fp8_linear; do
  [ -f "$LOG/$n.log" ] && { echo; echo "== $n ($(tail -1 "$LOG/$n.log"))"; tail -60 "$LOG/$n.log"; }
done
rm -rf /dev/shm/gpu_suites_q35
[ -n "$saver" ] && kill "$saver" 2>/dev/null
[ -n "${OUT:-}" ] && tar -C "$LOG" -czf "$OUT/logs.tgz" .
echo "total $((SECONDS - T0)) s; suites $([ $status = 0 ] && echo passed || echo FAILED)"
exit $status
