#!/usr/bin/env bash
# The one script for the multi-GPU machine: runs the communication tests and benchmarks from
# binaries built elsewhere (it builds nothing): the kernels emulated on CPU threads, a GPU smoke
# test, the MoE dispatch/combine benchmark, the all-reduce benchmark, then the multi-GPU MoE and
# all-reduce tests; prints the benchmark tables last.
#
#   tools/gpu_comm_run.sh [BINARY_DIR]      (from the repo root; default build-comm-bin)
#
# BINARY_DIR holds test_comm_emulated, test_comm_cuda, bench_allreduce and bench_moe (targets of
# src/comm/CMakeLists.cmake; none of them links Gloo, which the GPU machines lack). test_comm
# (CPU tests that link Gloo) runs only when present there and its libraries resolve.
# Logs and CSVs go to $OUT when set (the device tool's folder), else /tmp/gpu_comm_run.
# Exit status: 0 only when every step passed. Step time limits sum to 495 s (620 s in the rare
# case where the fallback MoE build runs too); a normal run takes 2-4 minutes.
# TANDEM_GPU_RUN_STEPS="name ..." runs only those steps (names as printed, e.g. bench_moe
# test_comm_cuda_moe); TANDEM_BENCH_ARGS adds arguments to both benchmarks (e.g. --quick).
#
# What can fail:
#   test_comm_emulated  all-reduce and MoE kernels' device code on CPU threads vs CPU references
#   test_comm_cuda (one process per GPU)
#     CudaAllReduceTest.*  all-reduce vs a float64 reference (bf16 1e-2 / fp32 1e-5 relative +
#                     accumulation bound; NaN-poisoned outputs), 1 element .. 64 MiB, one-shot /
#                     two-shot / NCCL / auto, in place, registered input; 100 back-to-back calls;
#                     CUDA-graph replays; bit-identical results across ranks; fallbacks and errors.
#     CudaMoeTest.*   MoE decode dispatch/combine (random / skewed / all-to-one-rank / sparse
#                     routing, one token, zero tokens on a rank or everywhere, bf16 bit-exact and
#                     fp8 payloads, up to 512 tokens x 4096): offsets, row metadata, packed rows,
#                     combine output vs CPU references; 100 steps back to back + 100 dispatch-only
#                     calls; CUDA-graph replays with changing device token counts; prefill
#                     dispatch + combine fused into the registered all-reduce (bit-exact, up to
#                     4096 x 4096) and 20 calls back to back; config mismatch errors.
#   The benchmarks print PASS/FAIL per target; their exit status reflects only crashes.
set -uo pipefail

BIN=${1:-build-comm-bin}
BIN=$(cd "$BIN" && pwd)
LOG=${OUT:-/tmp/gpu_comm_run}
mkdir -p "$LOG"

# NOTE: NVLink multicast (NVLS) can take the shared GPU host down: off, always.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The binaries were linked here against libcudart.so.13 and libnccl.so.2: find them there.
source "$(dirname "$0")/gpu_libs.sh"
find_gpu_libs libnccl.so.2 libcudart.so.13

{
  echo "== machine"
  date -u
  nvidia-smi -L
  nvidia-smi topo -m 2>/dev/null | head -8
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
  for b in test_comm test_comm_emulated test_comm_cuda bench_allreduce bench_moe; do
    [ -e "$BIN/$b" ] || { echo "($b not in $BIN)"; continue; }
    missing=$(ldd "$BIN/$b" 2>&1 | grep -E 'not found|GLIBC' || true)
    [ -n "$missing" ] && echo "MISSING for $b: $missing"
  done
} 2>&1 | tee "$LOG/env.txt"

status=0
declare -A RC
step() {  # step NAME TIMEOUT_S CMD...: runs with a time limit, logs to $LOG/NAME.log
  local name=$1 limit=$2
  shift 2
  if [ -n "${TANDEM_GPU_RUN_STEPS:-}" ] && [[ " $TANDEM_GPU_RUN_STEPS " != *" $name "* ]]; then
    RC[$name]=skipped
    return
  fi
  echo
  echo "== $name ($*) [$(date -u +%H:%M:%S)]"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|tests? from .* ran|rank [0-9]+:|cases ok|calls ok|replays ok|back-to-back ok|MISSING' \
    "$LOG/$name.log" | head -40
  if [ $rc -eq 0 ] && [[ $name == test_comm_cuda* || $name == *test_moe* ]] && grep -q '^\[  SKIPPED \]' "$LOG/$name.log"; then
    echo "!! $name skipped GPU tests on the GPU machine (fewer than 2 GPUs visible?)"
    rc=3
  fi
  if [ $rc -ne 0 ]; then
    echo "!! $name exited with $rc (124: timed out); last lines:"
    tail -25 "$LOG/$name.log"
    status=1
  fi
  echo "   ($name: rc $rc, $((SECONDS - t0)) s)"
  RC[$name]=$rc
}

step test_comm_emulated 30 "$BIN/test_comm_emulated"
if [ -n "${TANDEM_GPU_RUN_STEPS:-}" ] && [[ " $TANDEM_GPU_RUN_STEPS " != *" test_comm "* ]]; then
  RC[test_comm]=skipped
elif [ -x "$BIN/test_comm" ] && ! ldd "$BIN/test_comm" 2>&1 | grep -q 'not found'; then
  step test_comm 40 "$BIN/test_comm"
else
  echo; echo "== test_comm skipped (not in $BIN, or its libraries such as libgloo are missing here)"
  RC[test_comm]=skipped
fi
# A quick GPU smoke first; the MoE steps next, then the all-reduce ones (known good).
step test_comm_cuda_smoke 40 "$BIN/test_comm_cuda" --gtest_filter='*FallbacksAndErrors*:*ConfigErrors*'
step test_comm_cuda_moe 80 "$BIN/test_comm_cuda" --gtest_filter='CudaMoeTest.*:-*ConfigErrors*'
export TANDEM_BENCH_MOE_CSV="$LOG/bench_moe.csv"
step bench_moe 45 "$BIN/bench_moe" --world 2 ${TANDEM_BENCH_ARGS:-}
# If the current MoE kernels failed, the previous build (verified on 2 x H200) runs instead,
# when BINARY_DIR carries it in fallback/ or fallback-*/ (its sources beside it).
FB=$(ls -d "$BIN"/fallback*/ 2>/dev/null | head -1)
failed() { local r=${RC[$1]:-skipped}; [ "$r" != 0 ] && [ "$r" != skipped ]; }
if [ -n "$FB" ] && { failed test_comm_cuda_moe || failed bench_moe; }; then
  echo; echo "!! the current MoE build failed: running the previous one from $FB"
  step fallback_test_moe 80 "$FB/test_comm_cuda" --gtest_filter='CudaMoeTest.*:-*ConfigErrors*'
  TANDEM_BENCH_MOE_CSV="$LOG/fallback_bench_moe.csv" step fallback_bench_moe 45 "$FB/bench_moe" --world 2
fi
export TANDEM_BENCH_CSV="$LOG/bench_allreduce.csv"
step bench_allreduce 100 "$BIN/bench_allreduce" --world 2 ${TANDEM_BENCH_ARGS:-}
step test_comm_cuda 200 "$BIN/test_comm_cuda" --gtest_filter='CudaAllReduceTest.*:-*FallbacksAndErrors*'

# compute-sanitizer racecheck (shared-memory hazards) once, on one MoE routing case and the
# all-reduce back-to-back test; skipped when compute-sanitizer is absent.
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$CS" ]; then
  step racecheck_moe 90 "$CS" --tool racecheck --target-processes all --error-exitcode 9 \
    "$BIN/test_comm_cuda" --gtest_filter='CudaMoeTest.Prefill'
  step racecheck_allreduce 90 "$CS" --tool racecheck --target-processes all --error-exitcode 9 \
    "$BIN/test_comm_cuda" --gtest_filter='CudaAllReduceTest.CudaGraphReplay'
  grep -hE 'RACECHECK SUMMARY|ERROR SUMMARY|hazard' "$LOG"/racecheck_*.log | sort | uniq -c | head
else
  echo; echo "== racecheck skipped (no compute-sanitizer)"
fi

echo
echo "== summary: emulated rc=${RC[test_comm_emulated]} test_comm rc=${RC[test_comm]}" \
     "smoke rc=${RC[test_comm_cuda_smoke]} moe tests rc=${RC[test_comm_cuda_moe]}" \
     "all-reduce tests rc=${RC[test_comm_cuda]} bench_moe rc=${RC[bench_moe]}" \
     "bench_allreduce rc=${RC[bench_allreduce]}" \
     "racecheck rc=${RC[racecheck_moe]:-none}/${RC[racecheck_allreduce]:-none}" \
     "${RC[fallback_test_moe]:+fallback moe tests rc=${RC[fallback_test_moe]} fallback bench rc=${RC[fallback_bench_moe]}}" \
     "(logs in $LOG)"
grep -hE '^\[  (PASSED|FAILED) ' "$LOG"/test_comm*.log 2>/dev/null
# The benchmarks' targets, thresholds and tables, last.
[ -f "$LOG/bench_allreduce.log" ] && sed -n '/^== targets/,$p' "$LOG/bench_allreduce.log"
[ -f "$LOG/bench_moe.log" ] && sed -n '/^== moe targets/,$p' "$LOG/bench_moe.log"
if [ -f "$LOG/fallback_bench_moe.log" ]; then
  echo; echo "== FALLBACK: the previous MoE build's benchmark ($FB)"
  sed -n '/^== moe targets/,$p' "$LOG/fallback_bench_moe.log"
fi
exit $status
