#!/usr/bin/env bash
# Runs tests/e2e/openai_client.py (official openai client and jsonschema from PyPI, in a cached venv)
# against `tandem serve` on the demo model (TANDEM_TLS=1: over HTTPS, a self-signed certificate
# made with the openssl command, which the client alone trusts). Exit 77 (skipped) when the client cannot be
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
tls_args=()
tls_dir=""
if [ "${TANDEM_TLS:-0}" = 1 ]; then
  # HTTPS with a self-signed certificate made here; the client trusts exactly it.
  command -v openssl >/dev/null || { echo "no openssl command: skipped"; exit 77; }
  tls_dir=$(mktemp -d)
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj /CN=localhost \
    -addext subjectAltName=IP:127.0.0.1,DNS:localhost -keyout "$tls_dir/key.pem" \
    -out "$tls_dir/cert.pem" >/dev/null 2>&1 || { echo "openssl req failed"; exit 1; }
  tls_args=(--ssl-certfile "$tls_dir/cert.pem" --ssl-keyfile "$tls_dir/key.pem")
  export TANDEM_CA_FILE="$tls_dir/cert.pem"
fi
# shellcheck disable=SC2086  # TANDEM_SERVE_ARGS is a word list
"$bin" serve --port 0 "${tls_args[@]}" ${TANDEM_SERVE_ARGS:-} >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$log"; [ -z "$tls_dir" ] || rm -rf "$tls_dir"' EXIT
for _ in $(seq 600); do
  url=$(grep -o 'https\?://[0-9.]*:[0-9]*' "$log" | head -1)
  [ -n "$url" ] && break
  kill -0 $pid 2>/dev/null || { cat "$log"; exit 1; }
  sleep 0.1
done
[ -n "$url" ] || { echo "server did not start"; cat "$log"; exit 1; }
"$py" "$src/tests/e2e/openai_client.py" "$url"
