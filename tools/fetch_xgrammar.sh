#!/usr/bin/env bash
# Fetches the source distribution of xgrammar 0.2.8 (Apache-2.0; the grammar engine of
# structured outputs, DESIGN.md section 5) and unpacks it into
#   ${TANDEM_XGRAMMAR_DIR:-${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}/xgrammar-0.2.8}
# CMake runs this at configure time (cmake/xgrammar.cmake) and builds only the C++ core
# (the static library, no Python bindings). Nothing is committed; running it again is a no-op.
#
# pip prepares an sdist's metadata with its build backend, so the backend (scikit-build-core,
# setuptools_scm, nanobind) is installed into the cache first (--target, not system-wide) and
# the download runs with --no-build-isolation. The tarball is checked against its SHA-256.
#
# Usage: tools/fetch_xgrammar.sh      # prints the source directory on success
set -euo pipefail

VERSION="0.2.8"
SDIST_SHA256="8305646fd2b319d6c3003f51a1665e54cbbe9cba1fb636bc41d0b46434ccbb80"
BUILD_REQS=(scikit-build-core==1.1.2 setuptools_scm==10.3.4 nanobind==3.1.0)

cache_root="${TANDEM_CACHE_DIR:-${HOME:-/tmp}/.cache/tandem}"
dest="${TANDEM_XGRAMMAR_DIR:-$cache_root/xgrammar-$VERSION}"

if [[ -f "$dest/.tandem-complete" && -f "$dest/include/xgrammar/xgrammar.h" ]]; then
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
py="$(pick_python)" || { echo "fetch_xgrammar: needs python3 with pip" >&2; exit 1; }

export PIP_ROOT_USER_ACTION=ignore  # (CI runs as root)
mkdir -p "$cache_root"
tmp="$(mktemp -d "$cache_root/.xgrammar.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
  --target "$tmp/backend" "${BUILD_REQS[@]}" >&2
PYTHONPATH="$tmp/backend" "$py" -m pip download --quiet --disable-pip-version-check --no-deps \
  --no-binary=:all: --no-build-isolation --dest "$tmp" "xgrammar==$VERSION" >&2
sdist="$tmp/xgrammar-$VERSION.tar.gz"
[[ -f "$sdist" ]] || { echo "fetch_xgrammar: pip did not produce $sdist" >&2; exit 1; }
[[ "$(sha256sum "$sdist" | cut -d' ' -f1)" == "$SDIST_SHA256" ]] ||
  { echo "fetch_xgrammar: $sdist checksum mismatch" >&2; exit 1; }
tar -xzf "$sdist" -C "$tmp"
rm -rf "$dest"
mv "$tmp/xgrammar-$VERSION" "$dest"
touch "$dest/.tandem-complete"
echo "$dest"
