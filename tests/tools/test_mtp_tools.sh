#!/usr/bin/env bash
# The MTP tools end to end: make_random_checkpoint --mtp writes a checkpoint whose own mtp.*
# tensors `tandem generate --speculative-config` loads (same greedy tokens as without), and
# tools/train_mtp.py (when a python with torch is there; else exit 77 = skipped) trains a few
# steps on it, writes a separate MTP directory and adds mtp.* to a sharded index in place.
#   tests/tools/test_mtp_tools.sh MAKE_RANDOM_CHECKPOINT TANDEM SOURCE_DIR
set -euo pipefail
mrc=${1:?usage: $0 MAKE_RANDOM_CHECKPOINT TANDEM SOURCE_DIR}
tandem=${2:?}
src=${3:?}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

"$mrc" --out "$dir/ck" --layers 2 --hidden 64 --intermediate 128 --moe-intermediate 32 \
  --experts 8 --top-k 2 --heads 4 --kv-heads 2 --head-dim 16 --vocab 512 --max-position 512 \
  --seed 3 --shard-gb 0.0002 --mtp >/dev/null
gen=(generate --model "$dir/ck" --prompt-ids 1,2,3,4 --max-tokens 16 --temperature 0 --json)
want=$("$tandem" "${gen[@]}")
for k in 1 3; do
  got=$("$tandem" "${gen[@]}" --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}")
  [ "$(echo "$got" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"])')" = \
    "$(echo "$want" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"])')" ] ||
    { echo "FAIL: K=$k changed the tokens: $got vs $want"; exit 1; }
  echo "$got" | grep -q '"spec"' || { echo "FAIL: no spec in $got"; exit 1; }
done

# Qwen3.5 (hybrid): --mtp writes the published layout's mtp.* (a full-attention layer); the
# same greedy tokens with K = 2, through the DeltaNet state rollback.
"$mrc" --out "$dir/q35" --preset qwen3.5-35b-a3b --layers 4 --full-attention-interval 2 \
  --hidden 64 --moe-intermediate 32 --shared-intermediate 48 --experts 8 --top-k 2 --heads 4 \
  --kv-heads 2 --head-dim 64 --linear-key-heads 2 --linear-value-heads 4 --linear-key-dim 16 \
  --linear-value-dim 16 --vocab 512 --max-position 512 --seed 5 --shard-gb 0.0002 --mtp >/dev/null
grep -q '"mtp_num_hidden_layers": 1,' "$dir/q35/config.json" || { echo "FAIL: qwen3.5 config"; exit 1; }
q35=(generate --model "$dir/q35" --prompt-ids 1,2,3,4 --max-tokens 16 --temperature 0 --ignore-eos --json)
want=$("$tandem" "${q35[@]}")
got=$("$tandem" "${q35[@]}" --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}')
[ "$(echo "$got" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"])')" = \
  "$(echo "$want" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"])')" ] ||
  { echo "FAIL: qwen3.5 K=2 changed the tokens: $got vs $want"; exit 1; }
echo "$got" | grep -q '"spec"' || { echo "FAIL: no spec in $got"; exit 1; }

py=${PYTHON:-}
if [ -z "$py" ]; then
  for c in python3 /usr/bin/python3; do
    if "$c" -c "import torch" 2>/dev/null; then py=$c; break; fi
  done
fi
[ -n "$py" ] || { echo "SKIP: train_mtp.py needs a python with torch"; exit 77; }
"$py" "$src/tools/train_mtp.py" --model "$dir/ck" --synthetic-tokens 4000 --steps 3 --seq-len 32 \
  --batch 4 --out "$dir/mtp" --device cpu --dtype f32
"$tandem" "${gen[@]}" --speculative-config \
  "{\"method\": \"mtp\", \"num_speculative_tokens\": 2, \"model\": \"$dir/mtp\"}" >"$dir/out.json"
python3 - "$dir/out.json" "$want" <<'PY'
import json, sys
got = json.load(open(sys.argv[1]))
want = json.loads(sys.argv[2])
assert got["ids"] == want["ids"], (got, want)
assert got["spec"]["steps"] > 0, got
PY
# In place: model-mtp.safetensors and the index's weight_map.
"$py" "$src/tools/train_mtp.py" --model "$dir/ck" --synthetic-tokens 4000 --steps 2 --seq-len 32 \
  --batch 4 --out "$dir/ck" --device cpu >/dev/null
grep -q '"mtp.fc.weight": "model-mtp.safetensors"' "$dir/ck/model.safetensors.index.json" ||
  { echo "FAIL: mtp.* not in the index"; exit 1; }
"$tandem" "${gen[@]}" --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}' \
  >"$dir/out2.json"
python3 -c "import json,sys; a=json.load(open('$dir/out2.json')); b=json.loads(sys.argv[1]); assert a['ids']==b['ids']" "$want"
echo "OK"
