#!/usr/bin/env bash
# make_random_checkpoint end to end: a 2-layer tiny-shape checkpoint (several shards + index)
# loads with the model loader and generates through `tandem generate`; the bytes depend on the
# seed only (not on the thread count).
#   tests/tools/test_random_checkpoint.sh MAKE_RANDOM_CHECKPOINT TANDEM
set -euo pipefail
mrc=${1:?usage: $0 MAKE_RANDOM_CHECKPOINT TANDEM}
tandem=${2:?usage: $0 MAKE_RANDOM_CHECKPOINT TANDEM}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

flags=(--layers 2 --hidden 64 --intermediate 128 --moe-intermediate 32 --experts 8 --top-k 2
       --heads 4 --kv-heads 2 --head-dim 16 --vocab 512 --max-position 512 --seed 7
       --shard-gb 0.0002)
"$mrc" --out "$dir/a" "${flags[@]}" --threads 3
"$mrc" --out "$dir/b" "${flags[@]}" --threads 1

shards=$(ls "$dir/a"/model-*-of-*.safetensors | wc -l)
[ "$shards" -ge 2 ] || { echo "FAIL: expected several shards, got $shards"; exit 1; }
for f in "$dir/a"/*; do
  cmp "$f" "$dir/b/$(basename "$f")" || { echo "FAIL: $(basename "$f") depends on --threads"; exit 1; }
done

out=$("$tandem" generate --model "$dir/a" --prompt-ids 1,2,3,4,5 --max-tokens 6 \
      --temperature 0 --ignore-eos --json)
echo "$out"
n=$(printf '%s' "$out" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["ids"]))')
[ "$n" = 6 ] || { echo "FAIL: expected 6 generated ids, got $n"; exit 1; }
echo "PASS: $shards shards, generated $n tokens"
