#!/usr/bin/env bash
# The one script for the multi-GPU machine: runs the communication tests and the all-reduce
# benchmark from binaries built elsewhere (it builds nothing), prints the benchmark table last.
#
#   tools/gpu_comm_run.sh BINARY_DIR      (from the repo root; e.g. build-comm)
#
# BINARY_DIR must hold test_comm, test_comm_cuda and bench_allreduce (targets of
# src/comm/CMakeLists.cmake). Logs and the CSV go to $OUT when set (the device tool's folder),
# else /tmp/gpu_comm_run. Exit status: 0 only when every step passed.
#
# What can fail (test_comm_cuda, one process per GPU): all-reduce results vs a float64 CPU
# reference (bf16 1e-2 / fp32 1e-5 relative + accumulation bound; NaN-poisoned outputs), 1
# element .. 64 MiB, one-shot / two-shot / NCCL / auto, in place, registered input; 100
# back-to-back calls without host sync; CUDA-graph capture + replays; bit-identical results
# across ranks; fallbacks and error paths. test_comm: the TCP store and the launcher (CPU).
# The benchmark prints PASS/FAIL per target (<= 0.5x NCCL up to 512 KiB, <= 1x above) but
# its exit status reflects only crashes.
set -uo pipefail

BIN=${1:?usage: tools/gpu_comm_run.sh BINARY_DIR}
BIN=$(cd "$BIN" && pwd)
LOG=${OUT:-/tmp/gpu_comm_run}
mkdir -p "$LOG"

# NOTE: NVLink multicast (NVLS) can take the shared GPU host down: off, always.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The binaries were linked here against libcudart.so.13 and libnccl.so.2: find them there.
add_lib_dir() {
  case ":${LD_LIBRARY_PATH:-}:" in *":$1:"*) ;; *) LD_LIBRARY_PATH="$1${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
}
for lib in libnccl.so.2 libcudart.so.13; do
  if ! ldconfig -p 2>/dev/null | grep -q "$lib"; then
    for f in /usr/local/cuda/lib64/$lib /usr/local/cuda/lib/$lib \
             $(find /usr /opt -name "$lib" -not -path '*/proc/*' 2>/dev/null | head -3); do
      if [ -e "$f" ]; then add_lib_dir "$(dirname "$f")"; break; fi
    done
  fi
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"

{
  echo "== machine"
  nvidia-smi -L
  nvidia-smi topo -m 2>/dev/null | head -8
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)='
  for b in test_comm test_comm_cuda bench_allreduce; do
    missing=$(ldd "$BIN/$b" 2>&1 | grep -E 'not found|GLIBC' || true)
    [ -n "$missing" ] && echo "MISSING for $b: $missing"
  done
} 2>&1 | tee "$LOG/env.txt"

status=0
step() {  # step NAME TIMEOUT_S CMD...: runs with a time limit, logs to $LOG/NAME.log
  local name=$1 limit=$2
  shift 2
  echo
  echo "== $name ($*)"
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|tests? from .* ran|rank [0-9]+:|cases ok|calls ok|replays ok' \
    "$LOG/$name.log" | head -40
  if [ $rc -eq 0 ] && [[ $name == test_comm_cuda* ]] && grep -q '^\[  SKIPPED \]' "$LOG/$name.log"; then
    echo "!! $name skipped GPU tests on the GPU machine (fewer than 2 GPUs visible?)"
    rc=3
  fi
  if [ $rc -ne 0 ]; then
    echo "!! $name exited with $rc (124: timed out); last lines:"
    tail -25 "$LOG/$name.log"
    status=1
  fi
  RC[$name]=$rc
}
declare -A RC

step test_comm 60 "$BIN/test_comm"
# A quick GPU smoke first, then the benchmark (so a hang in the long tests cannot cost it).
step test_comm_cuda_smoke 120 "$BIN/test_comm_cuda" --gtest_filter='*FallbacksAndErrors*'
export TANDEM_BENCH_CSV="$LOG/bench_allreduce.csv"
step bench_allreduce 240 "$BIN/bench_allreduce" --world 2
step test_comm_cuda 330 "$BIN/test_comm_cuda" --gtest_filter='-*FallbacksAndErrors*'

echo
echo "== summary: test_comm rc=${RC[test_comm]} smoke rc=${RC[test_comm_cuda_smoke]}" \
     "test_comm_cuda rc=${RC[test_comm_cuda]} bench rc=${RC[bench_allreduce]} (logs in $LOG)"
grep -hE '^\[  (PASSED|FAILED) ' "$LOG/test_comm.log" "$LOG/test_comm_cuda_smoke.log" \
  "$LOG/test_comm_cuda.log" 2>/dev/null
# The benchmark's targets, thresholds and tables, last.
sed -n '/^== targets/,$p' "$LOG/bench_allreduce.log"
exit $status
