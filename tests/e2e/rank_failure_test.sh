#!/usr/bin/env bash
# A follower rank of a process-group instance dies (kill -9): the instance notices within 2 s
# (the group watchdog's heartbeats, not a collective's timeout), and exits non-zero so that its
# supervisor restarts it; for `tandem decode --nprocs 2` and `tandem prefill --nprocs 2`.
set -uo pipefail
bin="$1"
dir=$(mktemp -d)
trap 'pkill -9 -P $$ 2>/dev/null; rm -rf "$dir"' EXIT
status=0
for role in decode prefill; do
  "$bin" "$role" --nprocs 2 --port 0 --kv-cache-mb 64 >"$dir/$role.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    grep -q 'on [0-9.]*:[0-9]' "$dir/$role.log" && break
    sleep 0.1
  done
  grep -q 'on [0-9.]*:[0-9]' "$dir/$role.log" || { echo "$role did not start"; cat "$dir/$role.log"; exit 1; }
  victim=$(pgrep -P "$pid" | sort -n | tail -1)
  t0=$(date +%s.%N)
  kill -9 "$victim"
  wait "$pid"
  rc=$?
  t1=$(date +%s.%N)
  took=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
  echo "$role: a rank killed, the instance exited with $rc after $took s"
  if [ "$rc" -eq 0 ] || python3 -c "import sys; sys.exit(0 if $t1 - $t0 < 6 else 1)"; [ $? -ne 0 ]; then
    echo "FAILED: $role should exit non-zero within seconds"; cat "$dir/$role.log"; status=1
  fi
  grep -q "lost a rank" "$dir/$role.log" || { echo "FAILED: no watchdog line"; cat "$dir/$role.log"; status=1; }
done
exit $status
