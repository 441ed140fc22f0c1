#!/usr/bin/env bash
# Runs tests/e2e/openai_client.py (official openai client and jsonschema from PyPI, in a cached venv)
# against `tandem serve` on the demo model. Exit 77 (skipped) when the client cannot be
# installed (no network); any other failure fails the test.
#   TANDEM_OPENAI_PYTHON  a python that imports openai already (skips the venv; the GPU machine)
#   TANDEM_SERVE_ARGS     extra `tandem serve` arguments, e.g. "--device cuda"
set -uo pipefail
bin="$1"; src="$2"
py="${TANDEM_OPENAI_PYTHON:-}"
if [ -z "$py" ]; then
  venv="${TANDEM_CACHE_DIR:-${HOME:-/tmp}/.cache/tandem}/openai-venv"
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import openai, jsonschema" 2>/dev/null; then
    python3 -m venv "$venv" >/dev/null 2>&1 && "$venv/bin/pip" install -q openai jsonschema >/dev/null 2>&1 \
      || { echo "cannot install the openai client: skipped"; exit 77; }
  fi
  py="$venv/bin/python"
fi
log=$(mktemp)
# shellcheck disable=SC2086  # TANDEM_SERVE_ARGS is a word list
"$bin" serve --port 0 ${TANDEM_SERVE_ARGS:-} >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 600); do
  url=$(grep -o 'http://[0-9.]*:[0-9]*' "$log" | head -1)
  [ -n "$url" ] && break
  kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
[ -n "$url" ] || { echo "server did not start"; cat "$log"; exit 1; }
"$py" "$src/tests/e2e/openai_client.py" "$url"
