#!/usr/bin/env bash
# CI's sanitizer and fuzzing stages (docs/operations.md, "Security"), in two CPU-only build
# folders (-DTANDEM_CUDA=OFF, ccache as the main build):
#   asan  the CPU test binaries under AddressSanitizer + UndefinedBehaviorSanitizer (leaks and
#         any UB report fail), built in the fuzzing folder build-fuzz (clang, -DTANDEM_FUZZ=ON:
#         every target ASan + UBSan + libFuzzer's coverage hooks, which the tests link and do not
#         use), so the tests and the harnesses share one build of the libraries
#   tsan  the threaded suites under ThreadSanitizer (g++, build-tsan; tools/tsan_suppressions.txt
#         holds third-party entries only): the thread pool, transfer, cluster key, KV events, the
#         instances, the router / instance control / HTTP / HTTPS suites and the async engine
#         (test_server_threads, test_engine_threads: the files of those suites only)
#   fuzz  every libFuzzer harness of tests/fuzz for FUZZ_SECONDS from its committed corpus
#         (build-fuzz); each corpus is first run in full (the corpus replay); a crash, hang
#         (> 10 s an input), leak or sanitizer report fails, the input is kept under
#         build-fuzz/artifacts/
# Usage: tools/ci_security.sh [asan] [tsan] [fuzz]   (default: all three, in that order)
#   FUZZ_SECONDS (default 10 per harness, seed 1), JOBS (default nproc), ASAN_FILTER / TSAN_FILTER
#   (gtest filters for every binary of the stage; default: each binary's own below),
#   CI_SECURITY_LOCK (a file: each stage's cmake + ninja run under `flock` on it, the tests and
#   the fuzzing do not; for a machine whose builds share one lock), FUZZ_DIR / TSAN_DIR (the build
#   folders, default build-fuzz / build-tsan).
# TIMINGS, cold (no ccache), 2 cores, -j2, measured 7 Dec 2026 as the build's CPU time (user +
# sys) / 2, i.e. two idle cores (the wall time, at nice 19 beside other builds, in brackets):
#   asan + fuzz build (build-fuzz, clang: 12 test binaries + 8 harnesses)  19.8 min (48 min)
#   asan tests 6.0 min; tsan build (build-tsan, g++: 7 binaries) 9.1 min (34 min);
#   tsan tests 1.6 min; fuzzing 1.5 min. docs/operations.md, Security, has the table.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
FUZZ_SECONDS=${FUZZ_SECONDS:-10}
FUZZ_DIR=${FUZZ_DIR:-build-fuzz}
TSAN_DIR=${TSAN_DIR:-build-tsan}
stages=${*:-asan tsan fuzz}
common=(-G Ninja -DTANDEM_CUDA=OFF -DTANDEM_BENCH=OFF -DTANDEM_COMM_TSAN=OFF)
harnesses="http openai_request chat_template chat_parser tokenizer instance_protocol transfer_wire
           model_files"
# ASan + UBSan: every test of the CPU test binaries but test_engine's numeric sweeps (the golden
# and speculative fixtures: minutes of float arithmetic, the kernels' own tests cover them).
asan_runs="test_core:* test_backend:* test_kv:* test_net:* test_transfer:* test_tokenizer:* test_comm:*
           test_model:* test_events:* test_disagg:* test_server:*
           test_engine:-Fixtures/*:Spec*:DeterministicEngine.*"
# TSan slows these 5-15x: the suites with threads that talk. test_disagg's SpecDecodeEp
# (emulated EP ranks with speculation) passes too but takes 14 min under TSan: left out.
tsan_runs="test_core:ThreadPool.* test_net:* test_transfer:* test_events:* test_disagg:-SpecDecodeEp.*
           test_server_threads:InstanceAuth.*:Disaggregated.*:DisaggregatedRemote.*:RouterMembership.*:RouterQueue.*:HttpServerTest.*:HttpsTest.*
           test_engine_threads:AsyncEngine.*"
fuzz_targets=$(for h in $harnesses; do echo -n "fuzz_$h "; done)
export TANDEM_SOURCE_DIR="$PWD"

build() {  # cmake / ninja, under CI_SECURITY_LOCK's flock when set
  if [ -n "${CI_SECURITY_LOCK:-}" ]; then flock "$CI_SECURITY_LOCK" "$@"; else "$@"; fi
}

configure_fuzz() {  # build-fuzz: clang, every target ASan + UBSan + libFuzzer's coverage
  build cmake -S . -B "$FUZZ_DIR" "${common[@]}" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
    -DTANDEM_FUZZ=ON >/dev/null
}

took() { echo "ci_security: $1: $(($(date +%s) - $2)) s"; }

failed=""  # the test binaries that failed: every binary runs, the stage fails at its end
run_bins() {  # dir filter bins...: each test binary, in turn
  local dir=$1 filter=$2
  shift 2
  for b in "$@"; do
    echo "== $dir/$b"
    "$dir/$b" --gtest_filter="$filter" --gtest_brief=1 || failed="$failed $b"
  done
}
fail_if_any() {  # stage: exit 1 naming the failed binaries, if any
  if [ -n "$failed" ]; then echo "ci_security: $1 failed in:$failed"; exit 1; fi
}

for stage in $stages; do
  t0=$(date +%s)
  case $stage in
    asan)
      # The test binaries and the harnesses in one go: the fuzz stage then builds nothing.
      configure_fuzz
      # shellcheck disable=SC2046,SC2086  # word lists
      build ninja -C "$FUZZ_DIR" -j "$JOBS" $(for r in $asan_runs; do echo -n "${r%%:*} "; done) $fuzz_targets
      took "asan build" "$t0"
      t1=$(date +%s)
      export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
      export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
      for r in $asan_runs; do run_bins "$FUZZ_DIR" "${ASAN_FILTER:-${r#*:}}" "${r%%:*}"; done
      unset ASAN_OPTIONS UBSAN_OPTIONS
      took "asan tests" "$t1"
      fail_if_any asan
      ;;
    tsan)
      build cmake -S . -B "$TSAN_DIR" "${common[@]}" -DTANDEM_SANITIZE=thread >/dev/null
      # shellcheck disable=SC2046,SC2086
      build ninja -C "$TSAN_DIR" -j "$JOBS" $(for r in $tsan_runs; do echo -n "${r%%:*} "; done | tr ' ' '\n' | sort -u)
      took "tsan build" "$t0"
      t1=$(date +%s)
      # Suppressions: third-party libraries built without TSan only, each entry says why.
      export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tools/tsan_suppressions.txt"
      for r in $tsan_runs; do run_bins "$TSAN_DIR" "${TSAN_FILTER:-${r#*:}}" "${r%%:*}"; done
      unset TSAN_OPTIONS
      took "tsan tests" "$t1"
      fail_if_any tsan
      ;;
    fuzz)
      configure_fuzz
      # shellcheck disable=SC2046,SC2086
      build ninja -C "$FUZZ_DIR" -j "$JOBS" $fuzz_targets
      took "fuzz build" "$t0"
      t1=$(date +%s)
      mkdir -p "$FUZZ_DIR/artifacts"
      export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
      export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
      for h in $harnesses; do
        work=$(mktemp -d)  # new inputs land here, not in the committed corpus
        echo "== fuzz_$h, $FUZZ_SECONDS s"
        status=0
        "$FUZZ_DIR/fuzz_$h" -max_total_time="$FUZZ_SECONDS" -seed=1 -timeout=10 -rss_limit_mb=4096 \
          -print_final_stats=1 -artifact_prefix="$FUZZ_DIR/artifacts/$h-" "$work" \
          "tests/fuzz/corpus/$h" >"$FUZZ_DIR/fuzz_$h.log" 2>&1 || status=$?
        grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::new_units_added)" \
          "$FUZZ_DIR/fuzz_$h.log" || true
        rm -rf "$work"
        if [ "$status" -ne 0 ]; then
          tail -n 60 "$FUZZ_DIR/fuzz_$h.log"
          echo "fuzz_$h failed ($status): the input is in $FUZZ_DIR/artifacts/"
          exit 1
        fi
      done
      unset ASAN_OPTIONS UBSAN_OPTIONS
      took "fuzzing" "$t1"
      ;;
    *) echo "unknown stage $stage (asan, tsan, fuzz)"; exit 2 ;;
  esac
  took "$stage" "$t0"
done
