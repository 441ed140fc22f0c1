#!/usr/bin/env bash
# Fetches aiperf (NVIDIA's OpenAI-compatible load client, PyPI) for the GPU machine, which has no
# network: the pinned wheels of aiperf 0.13.0 and of the packages it imports on the path
# tools/gpu_aiperf_bench.sh takes that the GPU image (python 3.12) lacks, for manylinux x86-64.
# Nothing is committed: the output goes to .whl/aiperf/ (ignored; the device tool carries it
# when `carry` names .whl).
#
#   tools/fetch_aiperf.sh [--wheels] [--slim] [--reuse-whl]
#
# Default: the wheels installed (--no-deps, for cp312 manylinux) into one folder and packed as
# .whl/aiperf/site.tar.xz (8.1 MB: xz over the installed files is ~40% smaller than the wheels'
# per-file deflate); __pycache__, C / Cython sources and the debug info of crick's extensions
# (crick ships its .so with debug info: 7.7 MB installed, 0.85 MB without) are left out.
# --wheels: the 15 wheels themselves in .whl/aiperf/ instead (13.6 MB).
# --slim: also leaves out aiperf/operator, aiperf/api and aiperf/plot (a Kubernetes operator, a
#   FastAPI service and plot dashboards: their dependencies kopf, fastapi, plotly and dash are
#   neither in this set nor on the GPU image, so they cannot be imported there anyway) and the sample
#   images of aiperf's image synthesis (text loads never read them): 7.0 MB.
# --reuse-whl: wheels already in .whl/ itself with the same file name (the openai client's set
#   holds pydantic, pydantic_core, annotated_types, typing_inspection at these versions) are not
#   packed again; .whl/aiperf/from_whl.txt lists them and tools/gpu_aiperf_bench.sh installs them
#   from .whl/ (6.2 MB; 5.0 MB with --slim).
#
# The set was found by tracing every import of `aiperf profile` (completions endpoint,
# streaming, synthetic prompts, server token counts, summary + records export, --ui none) against
# `tandem serve`, in a python 3.12 venv holding only the GPU image's packages plus these; each one
# left out makes that run fail (crick: the metrics accumulator imports it at module level; ffmpeg
# and future: the synthetic dataset composer imports ffmpeg, which imports past.builtins), except
# those the image already has (aiohttp, numpy, transformers, tokenizers, rich, psutil, pillow,
# aiofiles, jinja2, tqdm, pyyaml, uvloop, ...). Left out because that run never imports them:
# zstandard, brotli, ruamel.yaml.clib (ruamel.yaml falls back to pure python), setproctitle,
# datasets, fastapi/uvicorn, dash/plotly/kaleido, kopf/kubernetes-asyncio, optuna, textual,
# soundfile, aiosqlite, jmespath, starlette-compress, python-multipart.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUTDIR=${TANDEM_AIPERF_WHEELS:-$ROOT/.whl/aiperf}
mode=tar slim=0 reuse=0
for a in "$@"; do
  case $a in
    --wheels) mode=wheels ;;
    --slim) slim=1 ;;
    --reuse-whl) reuse=1 ;;
    *) echo "usage: tools/fetch_aiperf.sh [--wheels] [--slim] [--reuse-whl]" >&2; exit 2 ;;
  esac
done

# name==version and the sha256 of the wheel pip picks for cp312 manylinux x86-64.
PINS="
aiperf==0.13.0 a20100fd127f1d10ea45d4946b1658a186030e86770344c80dfd256a60192f34
annotated-types==0.8.0 f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0
crick==0.0.8 d3d519d7db779b80a6b34daf30ae3c8d1969c8621c96d8ddf7cc93b8791b0fa2
cyclopts==4.25.3 40e76b3153ea90e885abd8d3a4d8184db5a5eec2fde8540025aae8d72fc973fc
ffmpeg-python==0.2.0 ac441a0404e053f8b6a1113a77c0f452f1cfc62f6344a769475ffdc0f56c23c5
future==1.0.0 929292d34f5872e70396626ef385ec22355a1fae8ad29e1a734c3e43f9fbc216
msgspec==0.23.0 c08f294663135183bd633efd843645687285a445054a876c37506d4e9de7d80b
orjson==3.11.9 be4fa4f0af7fa18951f7ab3fc2148e223af211bf03f59e1c6034ec3f97f21d61
pydantic==2.14.4 653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc
pydantic-core==2.50.5 470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d
pydantic-settings==2.16.3 d1db16a2d34006323a1b42c0640898da58adfbad7ec30baaa9e2b18aafc08999
python-dotenv==1.2.4 42269a8a5b3fd54ffa6f3d84b18abed50064717576b4ecf03dc4a55d8aa04fdc
pyzmq==26.4.0 ef8c6ecc1d520debc147173eaa3765d53f06cd8dbe7bd377064cdbc53ab456f5
ruamel.yaml==0.18.17 9c8ba9eb3e793efdf924b60d521820869d5bf0cb9c6f1b82d82de8295e290b9d
typing-inspection==0.4.5 bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39
"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
req=$tmp/req.txt
while read -r pin sha; do
  [ -n "$pin" ] && echo "$pin --hash=sha256:$sha" >> "$req"
done <<< "$PINS"
python3 -m pip download -q --no-deps --require-hashes "${PLAT[@]}" -d "$tmp/w" -r "$req"
[ "$(ls "$tmp"/w/*.whl | wc -l)" -eq "$(grep -c . "$req")" ] || { echo "missing wheels" >&2; exit 1; }

rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
if [ "$reuse" = 1 ]; then
  for w in "$tmp"/w/*.whl; do
    if cmp -s "$w" "$ROOT/.whl/$(basename "$w")"; then
      basename "$w" >> "$OUTDIR/from_whl.txt"
      rm "$w"
    fi
  done
fi
if [ "$mode" = wheels ]; then
  cp "$tmp"/w/*.whl "$OUTDIR"/
else
  site=$tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile "${PLAT[@]}" --target "$site" \
    "$tmp"/w/*.whl
  find "$site" -name __pycache__ -prune -exec rm -rf {} +
  find "$site" \( -name '*.c' -o -name '*.c.in' -o -name '*.pyx' -o -name '*.pxd' \) -delete
  find "$site" -name '*.so' -exec strip --strip-debug {} \;
  if [ "$slim" = 1 ]; then
    rm -rf "$site"/aiperf/operator "$site"/aiperf/api "$site"/aiperf/plot \
      "$site"/aiperf/dataset/generator/assets/source_images
  fi
  tar -C "$site" -cf - . | xz -9e -T2 > "$OUTDIR/site.tar.xz"
fi
echo "$OUTDIR: $(du -sh "$OUTDIR" | cut -f1) ($(ls "$OUTDIR" | tr '\n' ' '))"
