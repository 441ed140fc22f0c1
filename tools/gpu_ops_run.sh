#!/usr/bin/env bash
# The one script for the single-GPU machine: runs the CUDA backend op tests and the op
# benchmark from binaries built elsewhere (it builds nothing), prints the benchmark table last.
#
#   tools/gpu_ops_run.sh BINARY_DIR      (from the repo root; e.g. build-ops-bin)
#
# BINARY_DIR must hold test_backend_cuda and bench_ops_cuda (targets of
# src/backend/cuda/CMakeLists.cmake; they need libcudart.so.13 and libcublasLt.so.13, not Gloo
# or NCCL). Logs and the CSV go to $OUT when set (the device tool's folder), else
# /tmp/gpu_ops_run. Exit status: 0 only when the tests passed (not skipped) and the benchmark
# ran every row.
#
# Steps: 1. test_backend_cuda: every kernel vs the CPU reference (fresh random inputs, poisoned
# outputs, bf16 1e-2 / fp32 1e-5 relative, integer outputs exact); 2. bench_ops_cuda: per-kernel
# time beside the measured copy-bandwidth / GEMM-rate bound at 1, 32, 128, 8192 tokens;
# 2b. bench_fp8_gemm (when present): block-scaled FP8 GEMM vs bf16 on Qwen3-30B-A3B shapes;
# 2c. bench_fp8_linear (when present): FP8-weight gemv / grouped GEMM vs bf16 at decode shapes;
# 2d. bench_attention --prefill-only (when present) and bench/cuda/attention_torch_baseline.py:
# prefill attention (ours FA2, FlashInfer sm90) beside PyTorch SDPA cuDNN / flash, same run;
# 2e. bench_deltanet (when present): Qwen3.5 conv1d + gated delta rule, decode and prefill,
# then bench/cuda/deltanet_torch_baseline.py (fla's Triton kernel, transformers' torch reference)
# when the flash-linear-attention wheels are in BINARY_DIR/whl (or $TANDEM_FLA_WHEELS);
# 3. the tests again under compute-sanitizer memcheck (out-of-bounds / misaligned accesses),
# time-limited: a timeout there is reported, not counted as a failure.
set -uo pipefail

BIN=${1:?usage: tools/gpu_ops_run.sh BINARY_DIR}
BIN=$(cd "$BIN" && pwd)
LOG=${OUT:-/tmp/gpu_ops_run}
mkdir -p "$LOG"

# The binaries were linked against libcudart.so.13 and libcublasLt.so.13: find them there.
source "$(dirname "$0")/gpu_libs.sh"
find_gpu_libs libcudart.so.13 libcublasLt.so.13

{
  echo "== machine ($(date -u +%FT%TZ))"
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>/dev/null
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  for b in test_backend_cuda bench_ops_cuda; do
    missing=$(ldd "$BIN/$b" 2>&1 | grep -E 'not found|GLIBC' || true)
    [ -n "$missing" ] && echo "MISSING for $b: $missing"
  done
} 2>&1 | tee "$LOG/env.txt"

status=0
declare -A RC
step() {  # step NAME TIMEOUT_S CMD...: runs with a time limit, logs to $LOG/NAME.log
  local name=$1 limit=$2
  shift 2
  echo
  echo "== $name ($*)"
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  RC[$name]=$rc
  return $rc
}

# 1. Tests.
step test_backend_cuda 150 "$BIN/test_backend_cuda"
rc=${RC[test_backend_cuda]}
grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|tests? from .* ran' \
  "$LOG/test_backend_cuda.log" | head -40
if [ $rc -eq 0 ] && grep -q '^\[  SKIPPED \]' "$LOG/test_backend_cuda.log"; then
  echo "!! test_backend_cuda skipped on the GPU machine (no device visible?)"
  rc=3
  RC[test_backend_cuda]=3
fi
if [ $rc -ne 0 ]; then
  echo "!! test_backend_cuda exited with $rc (124: timed out); failures:"
  grep -B2 -A12 -E 'Failure|FATAL|what\(\)' "$LOG/test_backend_cuda.log" | head -120
  status=1
fi

# 2. Benchmark.
export TANDEM_BENCH_CSV="$LOG/bench_ops_cuda.csv"
step bench_ops_cuda 220 "$BIN/bench_ops_cuda"
rc=${RC[bench_ops_cuda]}
if [ $rc -ne 0 ]; then
  echo "!! bench_ops_cuda exited with $rc (124: timed out); last lines:"
  grep -E 'FAILED|FATAL' "$LOG/bench_ops_cuda.log" | head -20
  tail -5 "$LOG/bench_ops_cuda.log"
  status=1
fi

# 2b. Block-scaled FP8 GEMM beside the bf16 one (when the binary was packed).
if [ -x "$BIN/bench_fp8_gemm" ]; then
  step bench_fp8_gemm 200 "$BIN/bench_fp8_gemm"
  if [ "${RC[bench_fp8_gemm]}" -ne 0 ]; then
    echo "!! bench_fp8_gemm exited with ${RC[bench_fp8_gemm]} (124: timed out); last lines:"
    tail -5 "$LOG/bench_fp8_gemm.log"
    status=1
  fi
fi

# 2c. FP8-weight gemv / grouped GEMM beside the bf16 ones (when the binary was packed).
if [ -x "$BIN/bench_fp8_linear" ]; then
  step bench_fp8_linear 200 "$BIN/bench_fp8_linear"
  if [ "${RC[bench_fp8_linear]}" -ne 0 ]; then
    echo "!! bench_fp8_linear exited with ${RC[bench_fp8_linear]} (124: timed out); last lines:"
    tail -5 "$LOG/bench_fp8_linear.log"
    status=1
  fi
fi

# 2d. Prefill attention (when packed): ours (FA2 kernel) and FlashInfer sm90 beside PyTorch SDPA
# (cuDNN, flash backends) in the same run, with the ratios (bench/cuda/attention_torch_baseline.py).
if [ -x "$BIN/bench_attention" ]; then
  export TANDEM_BENCH_CSV="$LOG/bench_attention.csv"
  step bench_attention 200 "$BIN/bench_attention" --prefill-only
  if [ "${RC[bench_attention]}" -ne 0 ]; then
    echo "!! bench_attention exited with ${RC[bench_attention]} (124: timed out); last lines:"
    tail -5 "$LOG/bench_attention.log"
    status=1
  fi
  step attention_torch 200 python3 "$(dirname "$0")/../bench/cuda/attention_torch_baseline.py" \
    --ours "$LOG/bench_attention.csv" --csv "$LOG/attention_torch.csv" ||
    echo "(attention_torch_baseline.py exited with ${RC[attention_torch]})"
fi

# 2e. Qwen3.5 DeltaNet ops (conv1d, gated delta rule) at Qwen3.5-35B-A3B shapes (when packed).
if [ -x "$BIN/bench_deltanet" ]; then
  TANDEM_BENCH_CSV="$LOG/bench_deltanet.csv" step bench_deltanet 200 "$BIN/bench_deltanet"
  if [ "${RC[bench_deltanet]}" -ne 0 ]; then
    echo "!! bench_deltanet exited with ${RC[bench_deltanet]} (124: timed out); last lines:"
    tail -5 "$LOG/bench_deltanet.log"
    status=1
  fi
  # Beside flash-linear-attention's Triton kernel and transformers' torch reference, same run:
  # the wheels (flash-linear-attention, fla-core, einops; `pip download --no-deps` elsewhere)
  # in $TANDEM_FLA_WHEELS (default BINARY_DIR/whl), installed offline into /tmp.
  whl=${TANDEM_FLA_WHEELS:-$BIN/whl}
  if ls "$whl"/*.whl > /dev/null 2>&1; then
    pip install -q --no-deps --no-index --target /tmp/tandem_fla "$whl"/*.whl > "$LOG/fla_pip.log" 2>&1 ||
      for w in "$whl"/*.whl; do python3 -m zipfile -e "$w" /tmp/tandem_fla; done
    # fla first (Triton's autotune + JIT on a fresh machine: most of its time), each worker
    # with its own limit inside the step's.
    PYTHONPATH=/tmp/tandem_fla step deltanet_torch 300 python3 \
      "$(dirname "$0")/../bench/cuda/deltanet_torch_baseline.py" --ours "$LOG/bench_deltanet.csv" \
      --csv "$LOG/deltanet_torch.csv" --workers fla,torch --timeouts 200,90 || echo "(deltanet_torch_baseline.py exited with ${RC[deltanet_torch]})"
  fi
fi

# 3. Memory checker (Firecracker machines run it; seen working 2026-11-04).
if command -v compute-sanitizer > /dev/null; then
  step memcheck 100 compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$BIN/test_backend_cuda" --gtest_filter='-*MoeLayer*:*Gemm*'
  rc=${RC[memcheck]}
  grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) |Invalid|out of bounds' "$LOG/memcheck.log" | head -20
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "(memcheck timed out: incomplete, not counted)"
  elif [ $rc -ne 0 ]; then
    echo "!! memcheck exited with $rc"
    grep -B2 -A10 -E '=========.*(Invalid|Error)' "$LOG/memcheck.log" | head -60
    status=1
  fi
else
  echo "(no compute-sanitizer on PATH: memcheck skipped)"
  RC[memcheck]=na
fi

echo
echo "== summary: test_backend_cuda rc=${RC[test_backend_cuda]} bench rc=${RC[bench_ops_cuda]}" \
     "memcheck rc=${RC[memcheck]} (logs in $LOG)"
grep -hE '^\[  (PASSED|FAILED) ' "$LOG/test_backend_cuda.log" 2>/dev/null
[ -f "$LOG/bench_fp8_gemm.log" ] && { echo "== bench_fp8_gemm"; cat "$LOG/bench_fp8_gemm.log"; }
[ -f "$LOG/bench_fp8_linear.log" ] && { echo "== bench_fp8_linear"; cat "$LOG/bench_fp8_linear.log"; }
[ -f "$LOG/bench_deltanet.log" ] && { echo "== bench_deltanet"; sed -n '/^== table/,$p' "$LOG/bench_deltanet.log"; }
[ -f "$LOG/deltanet_torch.log" ] && { echo "== gated delta rule vs fla / transformers"; cat "$LOG/deltanet_torch.log"; }
[ -f "$LOG/bench_attention.log" ] && { echo "== bench_attention --prefill-only";
  grep -E 'TFLOP/s|FAILED|not run' "$LOG/bench_attention.log"; }
[ -f "$LOG/attention_torch.log" ] && { echo "== prefill attention vs PyTorch SDPA";
  cat "$LOG/attention_torch.log"; }
# The benchmark's table, last.
sed -n '/^== ceilings/p;/^== table/,$p' "$LOG/bench_ops_cuda.log"
exit $status
