#!/usr/bin/env bash
# Installs the Debian packages of DESIGN.md section 5 that are missing. Idempotent and
# quiet when everything is present.
set -euo pipefail
pkgs=(cmake ninja-build ccache g++ pkg-config libgtest-dev libgmock-dev libbenchmark-dev
      libboost-dev nlohmann-json3-dev libpcre2-dev libutf8proc-dev libspdlog-dev libfmt-dev
      libcli11-dev libgloo-dev libcurl4-openssl-dev clang-format clang-tidy python3-pip
      libssl-dev clang libclang-rt-14-dev
      libzmq3-dev cppzmq-dev libmsgpack-cxx-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
