#!/usr/bin/env bash
# The one script for the single-GPU machine (issue "CUDA backend on one H200"): unpacks the
# binaries packed by tools/pack_gpu_bin.sh, runs every GPU test, then the benchmarks, and prints
# the tables last. It builds nothing.
#
#   tools/gpu_model_run.sh PACK_DIR        (from the repo root; PACK_DIR holds bin.tar.xz)
#
# TANDEM_GPU_RUN_STEPS="name ..." runs only those steps; TANDEM_BENCH_ARGS goes to the C++
# benchmarks (e.g. --quick). Logs and CSVs go to /tmp/gpu_model_run, and as one logs.tgz to
# $OUT when set (the device tool brings back only a few files).
# Wheels in .whl/ (openai and the packages it needs that the image lacks) are installed into
# /tmp/site for the openai client step.
#
# Steps (each time-limited; exit status 0 only when every test step passed, not skipped):
#   test_backend_cuda  every kernel vs its CPU reference (norms, attention, MoE GEMM and layer,
#                      sampling, ...), fresh random inputs, poisoned outputs; CudaSampling also
#                      runs the single- and multi-CTA paths and expects the same tokens and top-n
#   test_model_cuda    golden fixtures on the GPU: teacher-forced logits vs the CPU model,
#                      greedy through the engine (alone / batched / chunked / graphs / eager)
#   test_spec_kernels  test_backend_cuda's speculative-step kernels alone (short runs)
#   test_model_cuda_det  --deterministic: batch / chunk / cache-hit invariance, bitwise
#   test_model_cuda_q35mtp  Qwen3.5 MTP speculation on the GPU (vs the CPU MTP, lossless, chi-square)
#   test_server_cuda   the HTTP tests of the "Serving" issue, the real-engine ones over the GPU
#                      model (TANDEM_TEST_DEVICE=cuda)
#   openai_client      the official openai client against `tandem serve --device cuda`
#   memcheck_model     compute-sanitizer memcheck over one fixture's model tests
#   bench_itl          colocated serve at concurrency 128, step-time policy off vs the relative
#                      target (--step-time-factor 3), steady and two-wave loads: ITL p50 / p99,
#                      output tok/s and their ratios, the per-step trace's predicted vs measured
#                      step times (tools/gpu_itl_bench.sh)
#   bench_aiperf       the serving figure with an outside client: aiperf (PyPI) beside
#                      serve_load.py on one server at bench_itl's steady load; runs when
#                      .whl/aiperf holds tools/fetch_aiperf.sh's output (tools/gpu_aiperf_bench.sh)
#   bench_moe_layer, moe_torch, bench_attention, bench_deltanet_verify (the DeltaNet ops at the
#   decode and verify shapes), bench_fp8_gemm, bench_fp8_linear, bench_sampling,
#   sampling_torch (bench/cuda/sampling_torch_baseline.py beside bench_sampling's CSV),
#   bench_grammar, bench_model_cuda (also with --fp8, and --mxfp8: bench_model_mxfp8,
#   bench_fp8_mxfp8, and --deterministic: bench_model_det), profile_decode (per-kernel decode
#   step), profile_decode_fp8 (the same in block FP8, W8A8),
#   bench_qwen35_cuda (a 4-layer Qwen3.5-35B-A3B checkpoint written by make_random_checkpoint),
#   bench_qwen35_122b (one Qwen3.5-122B-A10B DeltaNet + attention pair and the attention layer),
#   bench_qwen35_397b (the same for Qwen3.5-397B-A17B: 512 experts, top-10),
#   bench_ep_predict (Qwen3.5-397B-A17B's EP8 / EP16 decode and TP4 / EP4 prefill predicted
#   from one rank's slice measured here, bf16 and FP8: tools/gpu_ep_predict.sh, 2-3 minutes;
#   TANDEM_EP_ARGS="--quick --formats bf16" for about one),
#   bench_spec_verify, bench_spec_e2e, bench_spec_grid, bench_spec_fused (the defaults: draft
#   passes in graphs, the draft chain on the device, the fused speculative step),
#   bench_spec_q35 (Qwen3.5-35B-A3B with an MTP layer from make_random_checkpoint --mtp: the
#   defaults / drafts pass by pass / eager verify steps / the rollback by a second forward),
#   bench_spec_sampled (sampled rows speculating on the device) (MTP speculative decoding:
#   bench_spec_cuda)
set -uo pipefail
PACK=${1:?usage: tools/gpu_model_run.sh PACK_DIR}
PACK=$(cd "$PACK" && pwd)
ROOT=$(pwd)
LOG=/tmp/gpu_model_run
rm -rf "$LOG" && mkdir -p "$LOG"
BIN=/tmp/tandem_gpu_bin
rm -rf "$BIN" && mkdir -p "$BIN"
python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
  "$PACK/bin.tar.xz" "$BIN" || { echo "cannot unpack $PACK/bin.tar.xz"; exit 2; }
export NCCL_NVLS_ENABLE=0
[ -d "$BIN/qwen3_tokenizer" ] && export TANDEM_QWEN3_TOKENIZER_DIR=$BIN/qwen3_tokenizer
export TANDEM_SOURCE_DIR=$ROOT
source "$(dirname "$0")/gpu_libs.sh"
find_gpu_libs libcudart.so.13 libcublasLt.so.13 libcublas.so.13
# Of the carried libraries keep only those the machine lacks (python and torch keep theirs).
for f in "$BIN"/lib/*; do
  ldconfig -p 2>/dev/null | grep -q "$(basename "$f") " && rm -f "$f"
done
echo "carried libraries used: $(ls "$BIN/lib" | tr '\n' ' ')"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$BIN/lib"

{
  echo "== machine ($(date -u +%FT%TZ))"
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader 2>/dev/null
  for b in "$BIN"/*; do
    [ -f "$b" ] || continue
    missing=$(ldd "$b" 2>&1 | grep -E 'not found|GLIBC' || true)
    [ -n "$missing" ] && echo "MISSING for $(basename "$b"): $missing"
  done
  git -C "$ROOT" log -1 --format='commit %h %s' 2>/dev/null
} 2>&1 | tee "$LOG/env.txt"

status=0
declare -A RC
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  if [ -n "${TANDEM_GPU_RUN_STEPS:-}" ] && [[ " $TANDEM_GPU_RUN_STEPS " != *" $name "* ]]; then
    RC[$name]=skipped
    return 0
  fi
  echo
  echo "== $name [$(date -u +%H:%M:%S)]"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|tests? from .* ran|^\[ [a-z0-9_]+ \]' \
    "$LOG/$name.log" | head -60
  if [ $rc -eq 0 ] && [[ $name == test_* ]] && grep -q '^\[  SKIPPED \]' "$LOG/$name.log"; then
    echo "!! $name skipped tests on the GPU machine"
    rc=3
  fi
  if [ $rc -ne 0 ]; then
    echo "!! $name exited with $rc (124: timed out); failures / last lines:"
    grep -B3 -A14 -E 'Failure$|FATAL|what\(\)|Error|error:' "$LOG/$name.log" | head -150
    tail -15 "$LOG/$name.log"
    [[ $name == bench* || $name == moe_torch ]] || status=1
  fi
  echo "   ($name: rc $rc, $((SECONDS - t0)) s)"
  RC[$name]=$rc
  # Logs so far, in case the device tool's time limit ends the script.
  [ -n "${OUT:-}" ] && tar -C "$LOG" -czf "$OUT/logs.tgz" . 2>/dev/null
  return 0
}

step test_backend_cuda 420 "$BIN/test_backend_cuda"
step test_model_cuda 150 "$BIN/test_model_cuda" --gtest_filter='-CudaBatchInvariance.*:*CudaQwen35Mtp*'
# The speculative step's kernels alone (a subset of test_backend_cuda, for a short run): the
# after-verify metadata (spec_advance) and the rejection sampler vs their CPU references.
step test_spec_kernels 60 "$BIN/test_backend_cuda" --gtest_filter='*SpecAdvance*:*SpecAccept*:*SpecReplay*'
# MTP speculative decoding of Qwen3.5 hybrids on the GPU (issue 13): the MTP pass and hidden_out
# vs the CPU model, greedy lossless K = 1..4, the sampled chi-square.
step test_model_cuda_q35mtp 150 "$BIN/test_model_cuda" --gtest_filter='*CudaQwen35Mtp*'
# --deterministic (issue 15 item 6): a request's logits bitwise the same alone / batched /
# chunked / after a prefix-cache hit (demo model, 30B layer shapes), 64 seeded engine requests vs
# solo; each test prints the default mode's count of differing schedules beside.
step test_model_cuda_det 150 "$BIN/test_model_cuda" --gtest_filter='CudaBatchInvariance.*'
# GPU instances (issue "GPU instances"): ranks as processes sharing the GPU.
step test_transfer_cuda 120 "$BIN/test_transfer_cuda"
step test_model_cuda_sharded 420 "$BIN/test_model_cuda_sharded"
step gpu_roles 420 "$ROOT/tests/e2e/gpu_roles_test.sh" "$BIN/tandem" \
  "$ROOT/tests/data/fixtures/hub_gqa8_hd128_top8_bf16" "$ROOT/models/demo"
export TANDEM_TEST_DEVICE=cuda
# RealEngineTest.SixtyFour... holds on the GPU only in --deterministic mode: its twin
# RealEngineDetTest runs here instead (the default one skips on the GPU by design).
step test_server_cuda 120 "$BIN/test_server" --gtest_filter='-RealEngineTest.SixtyFourConcurrentStreamsMatchSolo'
unset TANDEM_TEST_DEVICE
if ls "$ROOT"/.whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$ROOT"/.whl/*.whl > "$LOG/pip.log" 2>&1 || echo "!! wheel install failed"
  export PYTHONPATH=/tmp/site
fi
# NOTE: --no-prefix-cache: the client checks that a streamed and a non-streamed greedy request
# give the same text; on the GPU a prefix-cache hit computes the prompt's last token in another
# GEMM shape, and bf16 rounding may then flip a near-tie token (docs/architecture.md).
export TANDEM_OPENAI_PYTHON=python3 TANDEM_SERVE_ARGS="--device cuda --no-prefix-cache"
step openai_client 90 "$ROOT/tests/e2e/openai_client_test.sh" "$BIN/tandem" "$ROOT"
unset TANDEM_OPENAI_PYTHON TANDEM_SERVE_ARGS
if command -v compute-sanitizer > /dev/null; then
  step memcheck_model 200 compute-sanitizer --tool memcheck --error-exitcode 99 \
    "$BIN/test_model_cuda" --gtest_filter='*TeacherForced*hub_top8*:*BadInputs*hub_top8*'
fi

export TANDEM_BENCH_CSV="$LOG/bench_kv_transfer.csv"
step bench_kv_transfer 180 "$BIN/bench_kv_transfer"
unset TANDEM_BENCH_CSV
# Disaggregated (router + prefill + decode, each one process on this GPU) vs colocated serve on
# a real-shape random Qwen3-30B-A3B checkpoint cut to TANDEM_DISAGG_LAYERS layers.
step bench_disagg 420 "$ROOT/tools/gpu_disagg_bench.sh" "$BIN" "$LOG/bench_disagg.csv"
# Steady ITL (step-time policy off vs the relative target F = 3, concurrency 128, 1024 / 256
# tokens: a steady load and two waves; each server's --step-trace summarised).
step bench_itl 420 "$ROOT/tools/gpu_itl_bench.sh" "$BIN" "$LOG/bench_itl.csv"
# The same steady load through aiperf (NVIDIA's client, carried in .whl/aiperf) and serve_load.py,
# one server, one row each (issue 15, Benchmarks: a load client that is not ours).
if [ -f "$ROOT/.whl/aiperf/site.tar.xz" ] || ls "$ROOT"/.whl/aiperf/*.whl > /dev/null 2>&1; then
  step bench_aiperf 300 "$ROOT/tools/gpu_aiperf_bench.sh" "$BIN" "$LOG/bench_aiperf.csv"
fi
export TANDEM_BENCH_CSV="$LOG/bench_moe_layer.csv"
step bench_moe_layer 120 "$BIN/bench_moe_layer" ${TANDEM_BENCH_ARGS:-}
step moe_torch 150 python3 "$ROOT/bench/cuda/moe_torch_baseline.py" --csv "$LOG/moe_torch.csv"
export TANDEM_BENCH_CSV="$LOG/bench_attention.csv"
step bench_attention 120 "$BIN/bench_attention" ${TANDEM_BENCH_ARGS:-}
export TANDEM_BENCH_CSV="$LOG/bench_gemv.csv"
step bench_gemv 60 "$BIN/bench_ops_cuda" --gemv
# The DeltaNet ops at the decode and speculative verify shapes (B x 2 / 4 tokens: the chunked
# form vs the per-token recurrence), when packed (the full table: tools/gpu_ops_run.sh).
[ -x "$BIN/bench_deltanet" ] && step bench_deltanet_verify 90 "$BIN/bench_deltanet" --verify
[ -x "$BIN/bench_fp8_gemm" ] && step bench_fp8_gemm 200 "$BIN/bench_fp8_gemm"
export TANDEM_BENCH_CSV="$LOG/bench_sampling.csv"
# Paths single (one CTA per row) and multi.
step bench_sampling 120 "$BIN/bench_sampling" ${TANDEM_BENCH_ARGS:-}
# The same-run PyTorch baseline of the sampling cases, beside ours (issue 15 item 4).
step sampling_torch 120 python3 "$ROOT/bench/cuda/sampling_torch_baseline.py" \
  --ours "$LOG/bench_sampling.csv" --csv "$LOG/sampling_torch.csv"
# Structured outputs: grammar compile and per-step mask fill with the Qwen3 vocabulary on this
# machine's CPU (the masks are filled on the host while the GPU runs the step; compare with the
# decode step of bench_model_cuda below at the same batch).
[ -x "$BIN/bench_grammar" ] && [ -d "$BIN/qwen3_tokenizer" ] &&
  step bench_grammar 120 "$BIN/bench_grammar" --tokenizer "$BIN/qwen3_tokenizer" \
    --model "$ROOT/models/demo"
export TANDEM_BENCH_CSV="$LOG/bench_model_cuda.csv"
step bench_model_cuda 240 "$BIN/bench_model_cuda" ${TANDEM_BENCH_ARGS:-}
# Where a decode step's time goes, kernel by kernel (CUPTI activity records of the captured
# graph; nsys is not on the image): Qwen3-30B-A3B shapes at batch 1 and 8, 1k context.
[ -x "$BIN/profile_decode_cuda" ] &&
  step profile_decode 240 "$BIN/profile_decode_cuda" --batch 1 --batch 8
# The same in block FP8 with FP8 activations (issue 29: batch 1 at 0.84x of bf16 with half the
# bytes): which kernels and gaps a batch-1 FP8 step spends its time in.
[ -x "$BIN/profile_decode_cuda" ] &&
  step profile_decode_fp8 240 "$BIN/profile_decode_cuda" --batch 1 --batch 8 --variants default --fp8
# --deterministic beside the default in one run (Qwen3-30B-A3B, decode 1 / 32 / 128 at 1k
# context, prefill 2k): the "--deterministic vs default" table (docs/perf.md).
export TANDEM_BENCH_CSV="$LOG/bench_model_det.csv"
step bench_model_det 240 "$BIN/bench_model_cuda" --model 30b --quick --batches 1,32,128 \
  --deterministic
# Block FP8 beside bf16 in one run (Qwen3-30B-A3B, decode 1 / 32, prefill 2k; the weights
# E4M3 in device memory): the "FP8 vs bf16" table. Then the FP8-weight kernels alone.
export TANDEM_BENCH_CSV="$LOG/bench_model_fp8.csv"
step bench_model_fp8 300 "$BIN/bench_model_cuda" --model 30b --quick --fp8 --fp8-act
[ -x "$BIN/bench_fp8_linear" ] && step bench_fp8_linear 200 "$BIN/bench_fp8_linear" --quick
# MXFP8 (issue "FP8" item 3): bf16, block FP8 and MXFP8 both ways (native per-32 scales,
# requantized to 128x128 blocks) in one run, decode 1 / 32 / 128; then the MXFP8 kernels alone.
export TANDEM_BENCH_CSV="$LOG/bench_model_mxfp8.csv"
step bench_model_mxfp8 300 "$BIN/bench_model_cuda" --model 30b --fp8 --mxfp8 --batches 1,32,128 \
  --no-prefill
[ -x "$BIN/bench_fp8_linear" ] && step bench_fp8_mxfp8 120 "$BIN/bench_fp8_linear" --mxfp8
# Whole-model prefill with each MoE path forced (the layer bench's routing is not the model's).
for mp in mma cublas padded; do
  export TANDEM_BENCH_CSV="$LOG/bench_prefill_$mp.csv"
  step "prefill_moe_$mp" 120 "$BIN/bench_model_cuda" --model 30b --prefill-only --moe-path $mp
done
# One Qwen3-235B-A22B layer (real vocab) written to disk by the checkpoint tool, then loaded
# through the safetensors path (mmap -> pinned staging -> device) and benchmarked.
export TANDEM_BENCH_CSV="$LOG/bench_model_ckpt.csv"
step bench_model_ckpt 200 bash -c "rm -rf /tmp/q235l && \
  '$BIN/make_random_checkpoint' --out /tmp/q235l --preset qwen3-235b-a22b --layers 1 && \
  '$BIN/bench_model_cuda' --checkpoint /tmp/q235l ${TANDEM_BENCH_ARGS:-}; rc=\$?; rm -rf /tmp/q235l; exit \$rc"
# Qwen3.5-35B-A3B, 4 layers (3 DeltaNet + 1 gated attention) at real shapes with the real
# vocab, written by the checkpoint tool (~7.5 GB) and loaded by Qwen35MoeCuda (when packed).
if [ -x "$BIN/bench_qwen35_cuda" ]; then
  # Decode 1 / 32 / 128 at 1k and 8k; the decode switches' defaults, with each opt-in of
  # Qwen35MoeCuda (shared expert forked, one-kernel DeltaNet step), and every switch off.
  Q35_ARGS="--batches 1,32,128 --contexts 1024,8192 --prefill 8192,2048 \
--switches default,default+fork,default+fused,default+fork+fused,base --profile-prefill 8192"
  export TANDEM_BENCH_CSV="$LOG/bench_qwen35_cuda.csv"
  step bench_qwen35_cuda 300 bash -c "rm -rf /tmp/q35l && \
    '$BIN/make_random_checkpoint' --out /tmp/q35l --preset qwen3.5-35b-a3b --layers 4 && \
    '$BIN/bench_qwen35_cuda' --checkpoint /tmp/q35l ${TANDEM_Q35_BENCH_ARGS:-$Q35_ARGS}; rc=\$?; rm -rf /tmp/q35l; exit \$rc"
  # One layer of each kind at real shapes (a DeltaNet + attention pair and the attention layer
  # alone, vocab 1024 so the head is < 1% of the bound): the DeltaNet layer's figures are the
  # pair's minus the attention layer's. 122B-A10B: 15 GB; 397B-A17B (512 experts, top-10: the
  # wide router / permute kernels): 12.9 GB of bf16 experts per layer, 39.2 GB in all (/tmp
  # when /dev/shm has less than 42 GB free), the pair's 26 GB on the GPU. Then one 8k prefill
  # of each under CUPTI (--profile-prefill: per-kernel times, the kernels in order).
  for q in 122b:qwen3.5-122b-a10b 397b:qwen3.5-397b-a17b; do
    name=${q%%:*} preset=${q#*:}
    export TANDEM_BENCH_CSV="$LOG/bench_qwen35_$name.csv"
    step "bench_qwen35_$name" 300 bash -c "d=/dev/shm/q${name}l; \
      [ \$(df --output=avail -k /dev/shm | tail -1) -gt 42000000 ] || d=/tmp/q${name}l; rm -rf \$d && \
      for kind in pair:2:2 attn:1:1; do IFS=: read -r out layers every <<< \$kind; \
        '$BIN/make_random_checkpoint' --out \$d/\$out --preset $preset --layers \$layers \
          --full-attention-interval \$every --vocab 1024 || exit 1; done && \
      '$BIN/bench_qwen35_cuda' --checkpoint \$d/pair --checkpoint \$d/attn --batches 1,8,32,128 \
        --contexts 1024 --prefill 2048,8192 --profile-prefill 8192; rc=\$?; rm -rf \$d; exit \$rc"
  done
  # Issue #28: one EP rank's slice of Qwen3.5-397B-A17B (64 / 32 experts, top-10) decoding
  # 32-256 sequences at 2k context, one TP4 rank's slice prefilling 6000 tokens, bf16 and FP8,
  # then tools/predict_ep.py's per-step tables for EP8 / EP16 decode and TP4 / EP4 prefill with
  # the dispatch / combine and all-reduce costs modelled (docs/perf.md "Multi-GPU layouts
  # predicted from one GPU"). Slices written to /dev/shm (/tmp), removed afterwards.
  ep_args=${TANDEM_EP_ARGS:-}
  [[ " ${TANDEM_BENCH_ARGS:-} " == *" --quick "* ]] && ep_args="--quick $ep_args"
  step bench_ep_predict 420 "$ROOT/tools/gpu_ep_predict.sh" "$BIN" --out "$LOG/ep_predict" $ep_args
fi
# MTP speculative decoding (issue "MTP speculative decoding"): the verify-step cost (K + 1
# tokens vs the 1-token step, 30B 48 layers and one 235B layer, B 1 / 8 / 32 / 128, K 0..4) and
# end-to-end decode through the engine without / with speculation at forced acceptance p.
[ -x "$BIN/bench_spec_cuda" ] &&
  step bench_spec_verify 240 "$BIN/bench_spec_cuda" --verify-only
[ -x "$BIN/bench_spec_cuda" ] &&
  step bench_spec_e2e 300 "$BIN/bench_spec_cuda" --model 30b --e2e-only
# The e2e grid (batch 1 / 8 / 32, K 1..3, p 0.6 / 0.7 / 0.8), then the default speculative step
# (draft passes in CUDA graphs, the chain on the device, fused with the verify), and sampled
# requests speculating on the device (temperature 0.7, seeded).
# bench_spec_verify's "MTP pass stages" lines time each stage of one draft pass (the 235B
# layer's 1 ms pass at batch 1).
[ -x "$BIN/bench_spec_cuda" ] &&
  step bench_spec_grid 240 "$BIN/bench_spec_cuda" --model 30b --e2e-only --e2e-batches 1,8,32 \
    --ks 1,2,3 --ps 0.6,0.7,0.8 --tokens 64
[ -x "$BIN/bench_spec_cuda" ] &&
  step bench_spec_sampled 180 "$BIN/bench_spec_cuda" \
    --model 30b --e2e-only --e2e-batches 1,32 --ks 3 --ps 0.7 --tokens 64 --temperature 0.7
# The fused speculative step (verify, sampler, acceptance and the draft chain on the stream, one
# host sync per step; chained draft passes replay graphs).
[ -x "$BIN/bench_spec_cuda" ] &&
  step bench_spec_fused 180 "$BIN/bench_spec_cuda" --model 30b \
    --e2e-only --e2e-batches 1,8,32 --ks 1,3 --ps 0.7 --tokens 128
# Qwen3.5-35B-A3B at real shapes with an MTP layer (make_random_checkpoint --mtp: all 40
# layers, ~70 GB in /dev/shm), end to end with forced acceptance: the defaults beside drafts
# pass by pass, eager verify steps and the DeltaNet rollback by a second forward, and the
# no-speculation baseline, same run (bench_spec_cuda --checkpoint).
[ -x "$BIN/bench_spec_cuda" ] && [ -x "$BIN/make_random_checkpoint" ] &&
  step bench_spec_q35 420 bash -c "d=/dev/shm/q35mtp; rm -rf \$d && \
    '$BIN/make_random_checkpoint' --out \$d --preset qwen3.5-35b-a3b --mtp ${TANDEM_Q35_SPEC_LAYERS:+--layers $TANDEM_Q35_SPEC_LAYERS} && \
    '$BIN/bench_spec_cuda' --checkpoint \$d --e2e-batches ${TANDEM_Q35_SPEC_BATCHES:-1,8,32} --ks 1,3 \
      --ps 0.7 --tokens 64; rc=\$?; rm -rf \$d; exit \$rc"
# Where a decode step's time goes: per-kernel GPU time at batch 1 and 32 (when nsys exists).
if command -v nsys > /dev/null; then
  for b in 1 32; do
    step "profile_decode_b$b" 150 bash -c "nsys profile -q -f true -o /tmp/prof_b$b \
      '$BIN/bench_model_cuda' --model 30b --decode-only $b > /dev/null && \
      nsys stats -q --report cuda_gpu_kern_sum --format csv /tmp/prof_b$b.nsys-rep"
  done
fi

echo
echo "== summary"
for k in "${!RC[@]}"; do echo "  $k rc=${RC[$k]}"; done | sort
for f in bench_deltanet_verify bench_spec_q35 bench_spec_verify bench_spec_e2e bench_spec_grid bench_spec_sampled bench_spec_fused bench_kv_transfer bench_disagg bench_itl bench_aiperf bench_moe_layer moe_torch bench_attention bench_gemv bench_fp8_gemm bench_fp8_linear bench_sampling sampling_torch bench_grammar; do
  [ -f "$LOG/$f.log" ] && { echo; echo "== $f (tail)"; tail -40 "$LOG/$f.log"; }
done
[ -f "$LOG/bench_model_cuda.log" ] && sed -n '/^== summary/,$p' "$LOG/bench_model_cuda.log"
[ -f "$LOG/profile_decode.log" ] && { echo; echo "== profile_decode"; cat "$LOG/profile_decode.log"; }
[ -f "$LOG/profile_decode_fp8.log" ] && { echo; echo "== profile_decode_fp8"; cat "$LOG/profile_decode_fp8.log"; }
[ -f "$LOG/bench_model_fp8.log" ] && sed -n '/^== FP8 vs bf16/,$p' "$LOG/bench_model_fp8.log"
[ -f "$LOG/bench_model_mxfp8.log" ] && sed -n '/^== FP8 vs bf16/,$p' "$LOG/bench_model_mxfp8.log"
[ -f "$LOG/bench_fp8_mxfp8.log" ] && sed -n '/^== MXFP8/,$p' "$LOG/bench_fp8_mxfp8.log"
[ -f "$LOG/bench_qwen35_cuda.log" ] && sed -n '/^== table/,$p' "$LOG/bench_qwen35_cuda.log"
[ -f "$LOG/bench_qwen35_122b.log" ] && sed -n '/^== table/,$p' "$LOG/bench_qwen35_122b.log"
[ -f "$LOG/bench_qwen35_397b.log" ] && sed -n '/^== table/,$p' "$LOG/bench_qwen35_397b.log"
[ -f "$LOG/ep_predict/tables.md" ] && { echo; cat "$LOG/ep_predict/tables.md"; }
for mp in mma cublas padded; do
  [ -f "$LOG/prefill_moe_$mp.log" ] && grep -E 'prefill' "$LOG/prefill_moe_$mp.log" | tail -2
done
[ -f "$LOG/bench_model_ckpt.log" ] && grep -E '^== loaded' "$LOG/bench_model_ckpt.log" &&
  sed -n '/^== summary/,$p' "$LOG/bench_model_ckpt.log"
[ -n "${OUT:-}" ] && tar -C "$LOG" -czf "$OUT/logs.tgz" .
exit $status
