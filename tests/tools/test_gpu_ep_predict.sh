#!/usr/bin/env bash
# tools/gpu_ep_predict.sh without a GPU: make_random_checkpoint runs for real with --config-only
# (each slice's flags must make a valid config), bench_qwen35_cuda is a stand-in that checks the
# checkpoints' configs (the TP4 slice's heads, top-k 3 over the k-2 weights, the 248k head) and
# writes rows in bench_qwen35_cuda's CSV format; predict_ep.py --check must then find every row.
#   tests/tools/test_gpu_ep_predict.sh SOURCE_DIR MAKE_RANDOM_CHECKPOINT
set -euo pipefail
src=${1:?usage: $0 SOURCE_DIR MAKE_RANDOM_CHECKPOINT}
mrc=${2:?usage: $0 SOURCE_DIR MAKE_RANDOM_CHECKPOINT}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/bin"
cat > "$dir/bin/make_random_checkpoint" <<EOF
#!/usr/bin/env bash
set -e
"$mrc" "\$@" --config-only > /dev/null
out=
while [ \$# -gt 0 ]; do [ "\$1" = --out ] && out=\$2; shift; done
echo weights > "\$out/model-00001-of-00001.safetensors"
EOF
cat > "$dir/bin/bench_qwen35_cuda" <<'EOF'
#!/usr/bin/env python3
import json, os, sys
a = sys.argv[1:]
dirs = [a[i + 1] for i in range(len(a)) if a[i] == "--checkpoint"]
arg = lambda f, d: a[a.index(f) + 1] if f in a else d
batches = [int(b) for b in arg("--batches", "1,32,128").split(",")]
rows = ['gemm_8192^3,8192,"8192x8192x8192 (the GEMM ceiling)",1600,1600,4e8,1.1e12']
for d in dirs:
    label = os.path.basename(d)
    c = json.load(open(os.path.join(d, "config.json")))["text_config"]
    assert os.path.exists(os.path.join(d, "model-00001-of-00001.safetensors")), d
    fmt, sl, kind = label.split("_")
    layers = {"pair": 2, "attn": 1, "attn2": 2}[kind]
    assert c["num_hidden_layers"] == layers, label
    assert c["full_attention_interval"] == (2 if kind == "pair" else 1), label
    assert ("quantization_config" in json.dumps(c) or "quantization_config" in
            open(os.path.join(d, "config.json")).read()) == (fmt == "fp8"), label
    want = {"ep8": (64, 10), "ep16": (32, 10), "dbase": (8, 2), "head": (8, 2),
            "tp4k2": (128, 2), "tp4k3": (128, 3), "tp4base": (8, 2)}[sl]
    assert (c["num_experts"], c["num_experts_per_tok"]) == want, (label, c["num_experts"])
    tp = sl.startswith("tp4")
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == ((8, 1) if tp else (32, 2))
    assert (c["linear_num_key_heads"], c["linear_num_value_heads"]) == ((4, 16) if tp else (16, 64))
    assert c["shared_expert_intermediate_size"] == (256 if tp else 1024), label
    assert c["moe_intermediate_size"] == (128 if want[0] == 8 else 1024), label
    assert c["vocab_size"] == (248320 if sl == "head" else 1024), label
    if sl == "tp4k3":
        assert os.path.islink(os.path.join(d, "model-00001-of-00001.safetensors")), label
    us = 1000.0 * layers + c["num_experts"] * c["num_experts_per_tok"] + (500 if sl == "head" else 0)
    if "--decode-only" in a:
        for b in batches:
            rows.append(f'decode_ctx2048,{b},"{label}: {b} seqs x 2048 ctx, graph, switches '
                        f'default",{us + b},{us / 2},1e9,0')
    else:
        assert arg("--prefill", "") == "6000"
        rows.append(f'prefill,6000,"{label}: one prompt, eager (MFU = bound / us)",{us * 20},1,1,1')
with open(os.environ["TANDEM_BENCH_CSV"], "w") as f:
    f.write("op,tokens,shape,us,bound_us,bytes,flops\n" + "\n".join(rows) + "\n")
print("== table")
EOF
chmod +x "$dir/bin/"*
run() {
  "$src/tools/gpu_ep_predict.sh" "$dir/bin" --out "$dir/out" "$@" > "$dir/log" 2>&1 ||
    { cat "$dir/log"; echo "FAIL: gpu_ep_predict.sh $*"; exit 1; }
}
run
grep -q '^| fp8 | 256 |' "$dir/out/tables.md" || { cat "$dir/log"; echo "FAIL: no fp8 B 256 row"; exit 1; }
grep -q '^| bf16 | 64 | .*(measured (bf16))' "$dir/out/tables.md" ||
  { cat "$dir/log"; echo "FAIL: the head is not measured"; exit 1; }
ls "$dir/out/ep_decode_bf16.csv" "$dir/out/ep_prefill_fp8.csv" > /dev/null
run --quick --formats fp8
grep -q '^| fp8 | 256 | .*(computed)' "$dir/out/tables.md" ||
  { cat "$dir/log"; echo "FAIL: quick: no computed-head fp8 row"; exit 1; }
if grep -q '^| bf16 |' "$dir/out/tables.md" || grep -q '^| fp8 | 64 |' "$dir/out/tables.md"; then
  echo "FAIL: quick fp8 printed bf16 or B 64 rows"
  exit 1
fi
# A failing bench: the script's status is not 0.
printf '#!/bin/sh\nexit 1\n' > "$dir/bin/bench_qwen35_cuda"
if "$src/tools/gpu_ep_predict.sh" "$dir/bin" --out "$dir/out2" --quick --formats bf16 \
  > "$dir/log" 2>&1; then
  cat "$dir/log"
  echo "FAIL: a failing bench gave status 0"
  exit 1
fi
echo "PASS"
