#!/usr/bin/env bash
# Packs the single-GPU binaries (built here) for the GPU machine: OUT_DIR/bin.tar.xz holding
# the binaries and lib/ with the shared libraries they need that a bare CUDA image may lack
# (Gloo, PCRE2, utf8proc, curl, ...; glibc, libstdc++ and the CUDA libraries stay the machine's
# own). The device tool carries at most 64 MiB, hence xz with a window over all binaries
# (compressing takes ~8 GB of memory).
#
#   tools/pack_gpu_bin.sh BUILD_DIR OUT_DIR
#
# Then on the GPU machine: tools/gpu_model_run.sh OUT_DIR. TANDEM_PACK_BINS="a b" packs only those
# binaries (the device tool carries 64 MiB with the tree).
set -euo pipefail
build=${1:?usage: tools/pack_gpu_bin.sh BUILD_DIR OUT_DIR}
out=${2:?usage: tools/pack_gpu_bin.sh BUILD_DIR OUT_DIR}
bins=${TANDEM_PACK_BINS:-"profile_decode_cuda tandem test_server test_backend_cuda test_model_cuda bench_model_cuda bench_ops_cuda
      bench_moe_layer bench_attention bench_sampling bench_fp8_gemm bench_fp8_linear bench_deltanet bench_qwen35_cuda make_random_checkpoint
      test_transfer_cuda test_model_cuda_sharded bench_kv_transfer bench_grammar bench_spec_cuda"}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib" "$out"
for b in $bins; do
  [ -x "$build/$b" ] || { echo "($b not built: left out)"; continue; }
  strip --strip-debug -o "$stage/$b" "$build/$b"
  ldd "$build/$b" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libresolv.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|\
      libcuda.so*|libcudart.so*|libcublas*.so*|libnccl.so*) ;;
      *) cp -Ln "$lib" "$stage/lib/" 2>/dev/null || true ;;
    esac
  done
done
# The real Qwen3 tokenizer files for the HTTP tests that use them (tools/fetch_qwen3_tokenizer.sh).
tok="${TANDEM_QWEN3_TOKENIZER_DIR:-${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}/qwen3_tokenizer}"
[ -f "$tok/tokenizer.json" ] && cp -r "$tok" "$stage/qwen3_tokenizer"
# One xz stream with a window over every binary: each links most of the same CUDA objects, so
# all but the first compress to their differences (20 binaries: ~20 MB instead of ~120 MB).
# TANDEM_PACK_XZ_PRESET 1 packs ~5x faster for ~10% more bytes.
tar -C "$stage" -cf - . | xz -T1 --lzma2=preset="${TANDEM_PACK_XZ_PRESET:-6}",dict=768MiB > "$out/bin.tar.xz"
ls -la "$out/bin.tar.xz"
