#!/usr/bin/env bash
# CI's sanitizer and fuzzing stages (docs/operations.md, "Security"), each in its own CPU-only
# build folder (-DTANDEM_CUDA=OFF, ccache as the main build):
#   asan  the CPU test binaries under AddressSanitizer + UndefinedBehaviorSanitizer (g++; leaks
#         and any UB report fail), the fuzz corpora replayed under them too
#   tsan  the threaded suites (thread pool, transfer, KV events, instances; with
#         CI_SECURITY_FULL=1 also server / router and the async engine) under ThreadSanitizer (g++;
#         tools/tsan_suppressions.txt holds third-party entries only)
#   fuzz  every libFuzzer harness of tests/fuzz for FUZZ_SECONDS from its committed corpus
#         (clang, ASan + UBSan + coverage); a crash, hang (> 10 s an input), leak or sanitizer
#         report fails, the input is kept under build-fuzz/artifacts/
# Usage: tools/ci_security.sh [asan] [tsan] [fuzz]   (default: all three, in that order)
#   FUZZ_SECONDS (default 10 per harness, seed 1), JOBS (default nproc), ASAN_FILTER / TSAN_FILTER
#   (gtest filters; default: every test of the ASan binaries, the threaded suites under TSan),
#   CI_SECURITY_LOCK (a file: each stage's cmake + ninja run under `flock` on it, the tests and
#   the fuzzing do not; for a machine whose builds share one lock).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
FUZZ_SECONDS=${FUZZ_SECONDS:-10}
stages=${*:-asan tsan fuzz}
common=(-G Ninja -DTANDEM_CUDA=OFF -DTANDEM_BENCH=OFF -DTANDEM_COMM_TSAN=OFF)
harnesses="http openai_request chat_template chat_parser tokenizer instance_protocol transfer_wire
           model_files"
# ASan + UBSan: every test of the CPU test binaries but test_engine's numeric sweeps (the golden
# and speculative fixtures: minutes of float arithmetic, the kernels' own tests cover them).
asan_full="test_core:* test_backend:* test_kv:* test_net:* test_transfer:* test_tokenizer:* test_comm:*
           test_model:* test_events:* test_disagg:* test_server:*
           test_engine:-Fixtures/*:Spec*:DeterministicEngine.*"
# TSan slows these 5-15x: the suites with threads that talk (the thread pool, the transfer
# backends, the KV-event publisher, the instances' lockstep loops; with CI_SECURITY_FULL=1 also
# the router and its control protocol, the HTTP front and the async engine, whose build (the
# server layer, xgrammar, test_server) adds ~15 min cold on 2 cores). test_disagg's SpecDecodeEp
# (emulated EP ranks with speculation) passes too but takes 14 min under TSan: in neither list.
tsan_ci="test_core:ThreadPool.* test_net:* test_transfer:* test_events:* test_disagg:-SpecDecodeEp.*"
tsan_full="$tsan_ci
           test_server:InstanceAuth.*:Disaggregated.*:DisaggregatedRemote.*:RouterMembership.*:RouterQueue.*:HttpServerTest.*:HttpsTest.*
           test_engine:AsyncEngine.*"
# CI (.ci/run) runs the default lists: under ASan + UBSan the peer-facing byte paths (the
# cluster key, the transfer wire) and the fuzz corpora, under TSan tsan_ci. CI_SECURITY_FULL=1
# runs the full lists (both pass; every CPU test binary under ASan + UBSan is a 38 min cold build
# on 2 cores, too long for CI's hour; docs/operations.md, Security).
if [ "${CI_SECURITY_FULL:-0}" = 1 ]; then
  asan_runs=$asan_full
  tsan_runs=$tsan_full
else
  asan_runs="test_net:* test_transfer:*"
  tsan_runs=$tsan_ci
fi
export TANDEM_SOURCE_DIR="$PWD"

build() {  # cmake / ninja, under CI_SECURITY_LOCK's flock when set
  if [ -n "${CI_SECURITY_LOCK:-}" ]; then flock "$CI_SECURITY_LOCK" "$@"; else "$@"; fi
}

took() { echo "ci_security: $1: $(($(date +%s) - $2)) s"; }

run_bins() {  # dir filter bins...: each test binary, in turn
  local dir=$1 filter=$2
  shift 2
  for b in "$@"; do
    echo "== $dir/$b"
    "$dir/$b" --gtest_filter="$filter" --gtest_brief=1
  done
}

for stage in $stages; do
  t0=$(date +%s)
  case $stage in
    asan)
      build cmake -S . -B build-asan "${common[@]}" -DTANDEM_SANITIZE=address,undefined >/dev/null
      replays=$(for h in $harnesses; do echo -n "fuzz_replay_$h "; done)
      # shellcheck disable=SC2086  # word lists
      build ninja -C build-asan -j "$JOBS" $(for r in $asan_runs; do echo -n "${r%%:*} "; done) $replays
      took "asan build" "$t0"
      t1=$(date +%s)
      export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
      export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
      for r in $asan_runs; do run_bins build-asan "${ASAN_FILTER:-${r#*:}}" "${r%%:*}"; done
      for h in $harnesses; do build-asan/fuzz_replay_$h tests/fuzz/corpus/$h; done
      unset ASAN_OPTIONS UBSAN_OPTIONS
      took "asan tests" "$t1"
      ;;
    tsan)
      build cmake -S . -B build-tsan "${common[@]}" -DTANDEM_SANITIZE=thread >/dev/null
      # shellcheck disable=SC2086
      build ninja -C build-tsan -j "$JOBS" $(for r in $tsan_runs; do echo -n "${r%%:*} "; done | tr ' ' '\n' | sort -u)
      took "tsan build" "$t0"
      t1=$(date +%s)
      # Suppressions: third-party libraries built without TSan only, each entry says why.
      export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tools/tsan_suppressions.txt"
      for r in $tsan_runs; do run_bins build-tsan "${TSAN_FILTER:-${r#*:}}" "${r%%:*}"; done
      unset TSAN_OPTIONS
      took "tsan tests" "$t1"
      ;;
    fuzz)
      build cmake -S . -B build-fuzz "${common[@]}" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang \
        -DTANDEM_FUZZ=ON >/dev/null
      # shellcheck disable=SC2086
      build ninja -C build-fuzz -j "$JOBS" $(for h in $harnesses; do echo -n "fuzz_$h "; done)
      took "fuzz build" "$t0"
      t1=$(date +%s)
      mkdir -p build-fuzz/artifacts
      export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
      export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
      for h in $harnesses; do
        work=$(mktemp -d)  # new inputs land here, not in the committed corpus
        echo "== fuzz_$h, $FUZZ_SECONDS s"
        status=0
        build-fuzz/fuzz_$h -max_total_time="$FUZZ_SECONDS" -seed=1 -timeout=10 -rss_limit_mb=4096 \
          -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$h-" "$work" \
          tests/fuzz/corpus/$h >"build-fuzz/fuzz_$h.log" 2>&1 || status=$?
        grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|stat::new_units_added)" \
          "build-fuzz/fuzz_$h.log" || true
        rm -rf "$work"
        if [ "$status" -ne 0 ]; then
          tail -n 60 "build-fuzz/fuzz_$h.log"
          echo "fuzz_$h failed ($status): the input is in build-fuzz/artifacts/"
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
