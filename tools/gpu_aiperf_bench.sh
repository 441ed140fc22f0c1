#!/usr/bin/env bash
# The serving figure with a load client that is not ours (issue "Kernels at the limit",
# Benchmarks; item 5's load): aiperf (NVIDIA's client, PyPI) beside bench/serve_load.py against
# the same `tandem serve --device cuda` in one run, at bench_itl's steady load: an 8-layer
# real-shape random Qwen3-30B-A3B checkpoint (TANDEM_ITL_LAYERS) with the real Qwen3 tokenizer
# copied in, concurrency 128, prompts / outputs uniform in [0.5, 1.5] x 1024 / 256 tokens,
# 3 x concurrency requests, the first 128 started over 2 s, streaming, ignore_eos, the
# step-time policy off (as gpu_itl_bench.sh's "off" run).
#   tools/gpu_aiperf_bench.sh BIN_DIR CSV
# aiperf comes from .whl/aiperf (tools/fetch_aiperf.sh: site.tar.xz, or wheels) installed into
# TANDEM_AIPERF_SITE (default /tmp/aiperf_site), or is taken as it is there when
# TANDEM_AIPERF_SITE is set and .whl/aiperf is absent. It runs with TANDEM_AIPERF_PYTHON
# (default python3; it needs 3.12 with the GPU image's packages, see tools/fetch_aiperf.sh).
# Rows (serve_load.py's columns; CSV appended to CSV):
#   steady/serve_load    serve_load.py --steady (its steady window)
#   steady/aiperf        aiperf's own summary over its whole run (ITL = its inter-chunk latency,
#                        the SSE-event gap that serve_load.py times; TPOT = its inter-token
#                        latency, per request (latency - TTFT) / (tokens - 1))
#   steady/aiperf-window aiperf's records in serve_load.py's steady window (bench/aiperf_rows.py)
# aiperf's prompts are random vocabulary tokens (--prompt-corpus random, like serve_load.py's
# random ids) as text, so the server's token count of a prompt differs a little from the one
# asked; the lengths it reports come from the server (--use-server-token-count).
# The same on the CPU: TANDEM_ITL_MODEL=models/demo TANDEM_ITL_DEVICE=cpu and a smaller load via
# TANDEM_ITL_CONCURRENCY, TANDEM_ITL_PROMPT (1024), TANDEM_ITL_OUT (256), TANDEM_ITL_STEP_TOKENS
# (8192), TANDEM_ITL_KV_MB (24000), TANDEM_ITL_VOCAB (151936); TANDEM_AIPERF_REQUESTS (3 x
# concurrency), TANDEM_AIPERF_ARGS (more aiperf flags), TANDEM_AIPERF_TIMEOUT_S (180: aiperf's
# limit); without TANDEM_ITL_MODEL,
# TANDEM_AIPERF_CKPT_ARGS (more make_random_checkpoint flags: a smaller random checkpoint, still
# with Qwen3's vocabulary and tokenizer, e.g. "--hidden 256 --experts 8 --top-k 2").
set -uo pipefail
BIN=$1; CSV=$2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/tools/serve_address.sh"
layers=${TANDEM_ITL_LAYERS:-8}
conc=${TANDEM_ITL_CONCURRENCY:-128}
device=${TANDEM_ITL_DEVICE:-cuda}
plen=${TANDEM_ITL_PROMPT:-1024}
olen=${TANDEM_ITL_OUT:-256}
nreq=${TANDEM_AIPERF_REQUESTS:-$((3 * conc))}
py=${TANDEM_AIPERF_PYTHON:-python3}
site=${TANDEM_AIPERF_SITE:-/tmp/aiperf_site}
whl=$ROOT/.whl/aiperf
rm -f "$CSV"

# aiperf's packages.
if [ -f "$whl/site.tar.xz" ] || ls "$whl"/*.whl > /dev/null 2>&1; then
  rm -rf "$site" && mkdir -p "$site"
  if [ -f "$whl/site.tar.xz" ]; then
    # (python's tarfile, as gpu_model_run.sh unpacks its pack: no xz binary needed)
    "$py" -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
      "$whl/site.tar.xz" "$site" || { echo "cannot unpack $whl/site.tar.xz"; exit 1; }
  fi
  wheels=()
  ls "$whl"/*.whl > /dev/null 2>&1 && wheels+=("$whl"/*.whl)
  if [ -f "$whl/from_whl.txt" ]; then
    while read -r w; do
      [ -f "$ROOT/.whl/$w" ] || { echo "missing .whl/$w ($whl/from_whl.txt): run tools/fetch_aiperf.sh again"; exit 1; }
      wheels+=("$ROOT/.whl/$w")
    done < "$whl/from_whl.txt"
  fi
  if [ ${#wheels[@]} -gt 0 ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${wheels[@]}" || { echo "aiperf wheel install failed"; exit 1; }
  fi
elif [ -z "${TANDEM_AIPERF_SITE:-}" ]; then
  echo "no aiperf: run tools/fetch_aiperf.sh (writes .whl/aiperf) and carry .whl"; exit 1
fi
aiperf=(env PYTHONPATH="$site" HF_HUB_DISABLE_TELEMETRY=1 "$py" -m aiperf)
"${aiperf[@]}" --version || { echo "aiperf does not start (PYTHONPATH=$site, $py)"; exit 1; }
PYTHONPATH=$site "$py" - <<'EOF'
import importlib.metadata as md
names = ["aiohttp", "numpy", "transformers", "tokenizers", "rich", "psutil", "pillow", "aiofiles",
         "jinja2", "tqdm", "pyyaml", "uvloop", "pydantic", "pyzmq"]
def ver(n):
    try:
        return md.version(n)
    except md.PackageNotFoundError:
        return "-"
print("   aiperf uses: " + " ".join("%s %s" % (n, ver(n)) for n in names))
EOF

dir=$(mktemp -d)
pid='' made=''
cleanup() { [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$dir" ${made:+"$made"}; }
trap cleanup EXIT
if [ -n "${TANDEM_ITL_MODEL:-}" ]; then
  ck=$TANDEM_ITL_MODEL
else
  ck=/dev/shm/q30_aiperf; made=$ck
  rm -rf "$ck"
  # shellcheck disable=SC2086
  "$BIN/make_random_checkpoint" --out "$ck" --preset qwen3-30b-a3b --layers "$layers" \
    ${TANDEM_AIPERF_CKPT_ARGS:-} || exit 1
  tok=${TANDEM_QWEN3_TOKENIZER_DIR:-$BIN/qwen3_tokenizer}
  [ -f "$tok/tokenizer.json" ] || { echo "no Qwen3 tokenizer in $tok (tools/fetch_qwen3_tokenizer.sh)"; exit 1; }
  cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$ck"/
fi
ck=$(cd "$ck" && pwd)  # aiperf takes a relative path for a hub id
[ -f "$ck/tokenizer.json" ] || { echo "$ck has no tokenizer.json (aiperf sends text prompts)"; exit 1; }

"$BIN/tandem" serve --model "$ck" --device "$device" --max-model-len 2048 --served-model-name m \
  --port 0 --max-num-seqs "$conc" --max-num-batched-tokens "${TANDEM_ITL_STEP_TOKENS:-8192}" \
  --kv-cache-mb "${TANDEM_ITL_KV_MB:-24000}" --step-time-target-ms 0 --step-time-factor 0 \
  --disable-access-log > "$dir/serve.log" 2>&1 &
pid=$!
addr=$(serve_address "$dir/serve.log" "$pid")
[ -n "$addr" ] || { echo "serve did not start"; cat "$dir/serve.log"; exit 1; }

echo "| load / client | concurrency | ok | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms | TPOT p99 ms |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
t0=$SECONDS
timeout --kill-after=5 150 python3 "$ROOT/bench/serve_load.py" --url "http://$addr" --concurrency "$conc" \
  --prompt-len "$plen" --max-tokens "$olen" --vocab "${TANDEM_ITL_VOCAB:-151936}" \
  --label steady/serve_load --csv "$CSV" --steady --requests "$nreq" || exit 1
echo "   (serve_load.py: $((SECONDS - t0)) s)"
t0=$SECONDS
# shellcheck disable=SC2086
timeout --kill-after=5 "${TANDEM_AIPERF_TIMEOUT_S:-180}" "${aiperf[@]}" profile --model m --url "http://$addr" --endpoint-type completions --streaming \
  --tokenizer "$ck" --prompt-corpus random --isl "$plen" --osl "$olen" --random-range-ratio 0.5 \
  --concurrency "$conc" --concurrency-ramp-duration 2 --request-count "$nreq" --random-seed 0 \
  --extra-inputs ignore_eos:true --use-server-token-count --export-level records \
  --ui none --no-server-metrics --no-gpu-telemetry --output-artifact-dir "$dir/aiperf" \
  ${TANDEM_AIPERF_ARGS:-} > "$dir/aiperf.log" 2>&1
rc=$?
echo "   (aiperf: rc $rc, $((SECONDS - t0)) s)"
if [ $rc -ne 0 ] || [ ! -f "$dir/aiperf/profile_export_aiperf.json" ]; then
  tail -40 "$dir/aiperf.log"; exit 1
fi
python3 "$ROOT/bench/aiperf_rows.py" "$dir/aiperf" --concurrency "$conc" --label steady/aiperf \
  --csv "$CSV" --steady || exit 1
[ -n "${TANDEM_AIPERF_KEEP:-}" ] && cp -r "$dir/aiperf" "$TANDEM_AIPERF_KEEP"
exit 0
