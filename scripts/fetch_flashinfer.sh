#!/usr/bin/env bash
# Fetches the headers the optional FlashInfer Hopper prefill attention is compiled from
# (src/backend/cuda/flashinfer/, CMake option TANDEM_FLASHINFER):
#   - FlashInfer's headers and its matching CUTLASS from the PyPI wheel flashinfer-python
#     (flashinfer/data/include, flashinfer/data/cutlass/{include,tools/util/include});
#   - a CCCL newer than CUDA 13.0's (FlashInfer 0.7 uses cuda::fast_mod_div, which CCCL 3.1
#     has) from the PyPI wheel nvidia-cuda-cccl (nvidia/cu13/include/cccl).
# Both wheels are downloaded with pip (never installed), checked against known SHA-256 sums and
# unpacked into
#   ${TANDEM_FLASHINFER_DIR:-${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}/flashinfer-<versions>}
# as include/, cutlass/include, cutlass/tools/util/include and cccl/. Nothing is committed;
# running it again is a no-op (a stamp file marks a complete unpack).
#
# Usage: scripts/fetch_flashinfer.sh        # prints the directory on success, exit 1 otherwise
set -euo pipefail

FI_VERSION="0.7.4"
FI_SHA256="a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32"
CCCL_VERSION="13.1.115"
CCCL_SHA256="d4a9e0590cd34290cda27f402a67fbf42e3ed043bdd927c6dd52419c860f2f92"

cache_root="${TANDEM_CACHE_DIR:-${HOME:-/tmp}/.cache/tandem}"
dest="${TANDEM_FLASHINFER_DIR:-$cache_root/flashinfer-$FI_VERSION-cccl-$CCCL_VERSION}"
stamp="$dest/.complete"

if [[ -f "$stamp" ]]; then
  echo "$dest"
  exit 0
fi
# One fetch at a time per destination (several builds may configure at once).
mkdir -p "$(dirname "$dest")"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$dest.lock"
  flock 9
  if [[ -f "$stamp" ]]; then
    echo "$dest"
    exit 0
  fi
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
py="$(pick_python)" || { echo "fetch_flashinfer: needs python3 with pip" >&2; exit 1; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fetch() {  # fetch REQUIREMENT SHA256: downloads the wheel into $tmp/<sha>/, prints its path
  local dir="$tmp/$2"
  mkdir -p "$dir"
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$dir" "$1" >&2
  local wheel
  wheel="$(ls "$dir"/*.whl | head -n1)"
  if [[ "$(sha256sum "$wheel" | cut -d' ' -f1)" != "$2" ]]; then
    echo "fetch_flashinfer: checksum mismatch for $wheel" >&2
    exit 1
  fi
  echo "$wheel"
}
fi_wheel="$(fetch "flashinfer-python==$FI_VERSION" "$FI_SHA256")"
cccl_wheel="$(fetch "nvidia-cuda-cccl==$CCCL_VERSION" "$CCCL_SHA256")"

rm -rf "$dest"
mkdir -p "$dest"
"$py" - "$fi_wheel" "$cccl_wheel" "$dest" <<'PY'
import os, sys, zipfile
fi_wheel, cccl_wheel, dest = sys.argv[1:4]
def unpack(wheel, pairs):
    n = 0
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.endswith("/"):
                continue
            for prefix, out in pairs:
                if name.startswith(prefix):
                    target = os.path.join(dest, out, name[len(prefix):])
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with z.open(name) as src, open(target, "wb") as dst:
                        dst.write(src.read())
                    n += 1
                    break
    if n == 0:
        sys.exit(f"fetch_flashinfer: nothing unpacked from {wheel}")
unpack(fi_wheel, [("flashinfer/data/include/", "include"),
                  ("flashinfer/data/cutlass/include/", "cutlass/include"),
                  ("flashinfer/data/cutlass/tools/util/include/", "cutlass/tools/util/include")])
unpack(cccl_wheel, [("nvidia/cu13/include/cccl/", "cccl")])
PY
for f in include/flashinfer/attention/hopper/prefill_sm90.cuh cutlass/include/cute/tensor.hpp \
         cutlass/tools/util/include/cutlass/util/command_line.h \
         cccl/cuda/__cmath/fast_modulo_division.h; do
  [[ -f "$dest/$f" ]] || { echo "fetch_flashinfer: $f missing after unpack" >&2; exit 1; }
done
touch "$stamp"
echo "$dest"
