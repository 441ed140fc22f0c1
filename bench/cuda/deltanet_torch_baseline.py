#!/usr/bin/env python3
"""The gated delta rule prefill at bench_deltanet's shapes, by the two public implementations:

- flash-linear-attention's Triton `chunk_gated_delta_rule` (the kernel vLLM and SGLang use for
  Qwen3.5 / Qwen3-Next prefill), q/k L2-normalised in the kernel, GVA (16 k / 32 v heads),
  fp32 initial and final state, varlen (`cu_seqlens`) for several sequences;
- transformers' `torch_chunk_gated_delta_rule` (the eager fallback of its Qwen3.5 model; q/k
  heads repeated to the value heads first, as the model does; one batch of equal lengths).

Shapes: Qwen3.5-35B-A3B's DeltaNet layer (16 k / 32 v heads of 128), bf16 inputs, gates given
(beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) computed beforehand and not timed).
CUDA events, median of 20 after 3 warm-ups (the Triton autotune and JIT run in the warm-ups).
flash-linear-attention is not on the GPU machine's image: install its wheels first (no network
there), e.g.

    pip install --no-deps --no-index --target /tmp/fla .whl/*.whl
    PYTHONPATH=/tmp/fla python3 bench/cuda/deltanet_torch_baseline.py [--ours CSV] [--csv PATH]

--ours: bench_deltanet's CSV of the same run; prints our time beside (gated_delta_rule rows).
Also checks that fla and transformers agree (relative error of the outputs) so a timing is of a
correct call.
"""
import argparse
import csv
import sys
import time

import torch

HK, HV, DK, DV = 16, 32, 128, 128
CASES = [(1, 1024), (1, 8192), (8, 1024)]  # (sequences, tokens each)


def timed(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def inputs(seqs, n, gen):
    dev = "cuda"
    T = seqs * n
    q = torch.randn(1, T, HK, DK, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, T, HK, DK, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, T, HV, DV, device=dev, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(1, T, HV, device=dev, dtype=torch.float32, generator=gen)
    a = torch.randn(1, T, HV, device=dev, dtype=torch.float32, generator=gen)
    beta = torch.sigmoid(b)
    g = -torch.nn.functional.softplus(a)  # A_log 0, dt_bias 0
    h0 = torch.randn(seqs, HV, DK, DV, device=dev, dtype=torch.float32, generator=gen) * 0.1
    return q, k, v, g, beta, h0


def find_torch_reference():
    for mod in ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                "transformers.models.qwen3_5.modeling_qwen3_5",
                "transformers.models.qwen3_next.modeling_qwen3_next"):
        try:
            m = __import__(mod, fromlist=["torch_chunk_gated_delta_rule"])
            return getattr(m, "torch_chunk_gated_delta_rule"), mod
        except (ImportError, AttributeError):
            continue
    return None, None


def read_ours(path):
    ours = {}
    if not path:
        return ours
    try:
        with open(path) as f:
            for row in csv.DictReader(f):
                op = row.get("op") or row.get("name") or ""
                if op.startswith("gated_delta_rule"):
                    ours[(op, row.get("shape", ""))] = float(row.get("us", "nan"))
    except OSError as e:
        print(f"(no --ours CSV: {e})")
    return ours


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours")
    ap.add_argument("--csv")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    try:
        import triton
        print(f"triton {triton.__version__}")
    except ImportError:
        print("no triton")
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        print(f"fla {getattr(fla, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - report why and go on with the torch reference
        print(f"flash-linear-attention not importable: {e!r}")
        chunk_gated_delta_rule = None
    torch_ref, where = find_torch_reference()
    import transformers
    print(f"transformers {transformers.__version__}: torch_chunk_gated_delta_rule from {where}")

    ours = read_ours(args.ours)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'shape':22} {'fla_us':>10} {'torch_us':>10} {'ours_us':>10} {'fla/ours':>9} "
          f"{'fla-vs-torch':>13}")
    for seqs, n in CASES:
        q, k, v, g, beta, h0 = inputs(seqs, n, gen)
        cu = torch.arange(0, seqs + 1, device="cuda", dtype=torch.long) * n
        fla_us = torch_us = float("nan")
        o_fla = o_ref = None
        if chunk_gated_delta_rule is not None:
            def run_fla():
                return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                              output_final_state=True,
                                              use_qk_l2norm_in_kernel=True,
                                              cu_seqlens=cu if seqs > 1 else None)
            try:
                fla_us = timed(run_fla)
                o_fla = run_fla()[0].float()
            except Exception as e:  # noqa: BLE001
                print(f"fla failed at {seqs}x{n}: {e!r}")
        if torch_ref is not None:
            rep = HV // HK
            qr = q.view(seqs, n, HK, DK).repeat_interleave(rep, dim=2)
            kr = k.view(seqs, n, HK, DK).repeat_interleave(rep, dim=2)
            vr, gr, br = v.view(seqs, n, HV, DV), g.view(seqs, n, HV), beta.view(seqs, n, HV)

            def run_ref():
                return torch_ref(qr, kr, vr, g=gr, beta=br, chunk_size=64, initial_state=h0,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
            try:
                torch_us = timed(run_ref, reps=5 if seqs * n > 4096 else 10, warm=1)
                o_ref = run_ref()[0].float().reshape(1, seqs * n, HV, DV)
            except Exception as e:  # noqa: BLE001
                print(f"torch reference failed at {seqs}x{n}: {e!r}")
        err = float("nan")
        if o_fla is not None and o_ref is not None:
            err = ((o_fla - o_ref).norm() / o_ref.norm()).item()
        shape = f"{seqs} seq x {n} tok"
        our = ours.get(("gated_delta_rule", shape), float("nan"))
        ratio = fla_us / our if our == our and our > 0 else float("nan")
        print(f"{shape:22} {fla_us:10.1f} {torch_us:10.1f} {our:10.1f} {ratio:9.2f} {err:13.2e}",
              flush=True)
        rows.append((shape, fla_us, torch_us, our, err))
        del q, k, v, g, beta, h0
        torch.cuda.empty_cache()
        time.sleep(0.1)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("shape,fla_us,torch_us,ours_us,fla_vs_torch_rel_err\n")
            for r in rows:
                f.write(f"{r[0]},{r[1]:.2f},{r[2]:.2f},{r[3]:.2f},{r[4]:.3e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
