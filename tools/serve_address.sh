#!/usr/bin/env bash
# Sourced by the serving benchmarks: serve_address LOG PID prints the host:port that a
# `tandem serve --port 0` process (PID) writes to LOG once it listens, waiting up to 180 s;
# prints nothing (status 1) when the process exits first or the time runs out.
serve_address() {
  local log=$1 pid=$2 addr= _
  for _ in $(seq 1800); do
    addr=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" 2>/dev/null | head -1 | sed 's|http://||')
    [ -n "$addr" ] && { echo "$addr"; return 0; }
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
