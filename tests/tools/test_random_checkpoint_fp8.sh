#!/usr/bin/env bash
# make_random_checkpoint --format fp8 end to end, for a Qwen3-MoE and a Qwen3.5 (with MTP) tiny
# shape: the same tensors (names, dtypes, shapes), config.json (quantization_config) and
# generation_config.json as `tandem convert --format fp8` of the bf16 checkpoint of the same
# flags; dequantized weights within E4M3's rounding of that bf16 checkpoint's, the other tensors
# its bytes; the bytes independent of --threads; a few greedy steps on the CPU model with finite
# logprobs. The layout check is shown to fail on the bf16 checkpoint (every linear left bf16).
#   tests/tools/test_random_checkpoint_fp8.sh MAKE_RANDOM_CHECKPOINT TANDEM
set -euo pipefail
mrc=${1:?usage: $0 MAKE_RANDOM_CHECKPOINT TANDEM}
tandem=${2:?usage: $0 MAKE_RANDOM_CHECKPOINT TANDEM}
check="python3 $(cd "$(dirname "$0")" && pwd)/check_fp8_checkpoint.py"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# hidden 160 / moe-intermediate 144: edge blocks of the 128 x 128 scale grid.
q3=(--layers 2 --hidden 160 --intermediate 128 --moe-intermediate 144 --experts 8 --top-k 2
    --heads 4 --kv-heads 2 --head-dim 16 --vocab 512 --max-position 512 --seed 7
    --shard-gb 0.0005)
q35=(--preset qwen3.5-35b-a3b --layers 4 --full-attention-interval 2 --hidden 160
     --moe-intermediate 32 --shared-intermediate 48 --experts 8 --top-k 2 --heads 4 --kv-heads 2
     --head-dim 64 --linear-key-heads 2 --linear-value-heads 4 --linear-key-dim 16
     --linear-value-dim 16 --vocab 512 --max-position 512 --seed 9 --shard-gb 0.0005 --mtp)

run_case() {  # NAME FLAGS...
  local m=$1; shift
  local flags=("$@")
  "$mrc" --out "$dir/$m.bf16" "${flags[@]}" >/dev/null
  "$tandem" convert --model "$dir/$m.bf16" --out "$dir/$m.conv" --format fp8 >/dev/null 2>&1
  "$mrc" --out "$dir/$m.fp8" "${flags[@]}" --format fp8 --threads 3
  "$mrc" --out "$dir/$m.fp8t1" "${flags[@]}" --format fp8 --threads 1 >/dev/null
  for f in "$dir/$m.fp8"/*; do
    cmp "$f" "$dir/$m.fp8t1/$(basename "$f")" ||
      { echo "FAIL: $m: $(basename "$f") depends on --threads"; exit 1; }
  done
  $check layout "$dir/$m.fp8" "$dir/$m.conv" || { echo "FAIL: $m: not convert's layout"; exit 1; }
  $check values "$dir/$m.fp8" "$dir/$m.bf16" || { echo "FAIL: $m: values"; exit 1; }
  # The check can fail: the bf16 checkpoint (linears left bf16, no quantization_config).
  if $check layout "$dir/$m.bf16" "$dir/$m.conv" >/dev/null; then
    echo "FAIL: $m: the layout check passes a bf16 checkpoint"; exit 1
  fi
  out=$("$tandem" generate --model "$dir/$m.fp8" --prompt-ids 1,2,3,4,5 --max-tokens 6 \
        --temperature 0 --ignore-eos --logprobs 3 --json)
  echo "$m: $out"
  printf '%s' "$out" | python3 -c '
import json, math, sys
j = json.load(sys.stdin)
lp = [x[1] for pos in j["logprobs"] for x in pos]
assert len(j["ids"]) == 6, "%d ids, not 6" % len(j["ids"])
assert len(j["logprobs"]) == 6 and lp, "no logprobs"
assert all(isinstance(x, (int, float)) and math.isfinite(x) for x in lp), f"non-finite: {lp}"
' || { echo "FAIL: $m: greedy steps on the fp8 checkpoint"; exit 1; }
}
run_case q3 "${q3[@]}"
run_case q35 "${q35[@]}"
echo "PASS"
