#!/usr/bin/env bash
# make_random_checkpoint end to end: a 2-layer tiny-shape checkpoint (several shards + index)
# and a 4-layer Qwen3.5 hybrid one load with the model loader and generate through
# `tandem generate`; the bytes depend on the seed only (not on the thread count).
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

# Qwen3.5 hybrid shapes (4 layers, full attention every 2nd, head_dim 64, DeltaNet 2 / 4 heads).
q35=(--preset qwen3.5-35b-a3b --layers 4 --full-attention-interval 2 --hidden 64
     --moe-intermediate 32 --shared-intermediate 48 --experts 8 --top-k 2 --heads 4 --kv-heads 2
     --head-dim 64 --linear-key-heads 2 --linear-value-heads 4 --linear-key-dim 16
     --linear-value-dim 16 --vocab 512 --max-position 512 --seed 9 --shard-gb 0.0002)
"$mrc" --out "$dir/q35a" "${q35[@]}" --threads 3
"$mrc" --out "$dir/q35b" "${q35[@]}" --threads 1
for f in "$dir/q35a"/*; do
  cmp "$f" "$dir/q35b/$(basename "$f")" || { echo "FAIL: qwen3.5 $(basename "$f") depends on --threads"; exit 1; }
done
grep -q '"model_type": "qwen3_5_moe"' "$dir/q35a/config.json" || { echo "FAIL: not a qwen3_5_moe config"; exit 1; }
out=$("$tandem" generate --model "$dir/q35a" --prompt-ids 1,2,3,4,5 --max-tokens 6 \
      --temperature 0 --ignore-eos --json)
echo "$out"
n35=$(printf '%s' "$out" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["ids"]))')
[ "$n35" = 6 ] || { echo "FAIL: qwen3.5: expected 6 generated ids, got $n35"; exit 1; }
# The larger Qwen3.5 presets carry their published shapes (config.json only: no weights).
check_cfg() {  # DIR FIELD VALUE...
  local d=$1; shift
  while [ $# -gt 0 ]; do
    grep -q "\"$1\": $2," "$d/config.json" || { echo "FAIL: $d: $1 is not $2"; cat "$d/config.json"; exit 1; }
    shift 2
  done
}
"$mrc" --out "$dir/q122" --preset qwen3.5-122b-a10b --config-only
check_cfg "$dir/q122" hidden_size 3072 num_hidden_layers 48 num_experts 256 num_experts_per_tok 8 \
  moe_intermediate_size 1024 shared_expert_intermediate_size 1024 num_attention_heads 32 \
  num_key_value_heads 2 head_dim 256 linear_num_key_heads 16 linear_num_value_heads 64
"$mrc" --out "$dir/q397" --preset qwen3.5-397b-a17b --config-only
check_cfg "$dir/q397" hidden_size 4096 num_hidden_layers 60 num_experts 512 num_experts_per_tok 10 \
  moe_intermediate_size 1024 num_attention_heads 32 num_key_value_heads 2 linear_num_value_heads 64
[ ! -e "$dir/q397/model.safetensors.index.json" ] || { echo "FAIL: --config-only wrote weights"; exit 1; }
echo "PASS: $shards shards, generated $n tokens; qwen3.5 generated $n35 tokens"
