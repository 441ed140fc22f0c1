#!/usr/bin/env python3
"""The gated delta rule prefill at bench_deltanet's shapes, by the two public implementations:

- flash-linear-attention's Triton `chunk_gated_delta_rule` (the kernel vLLM and SGLang use for
  Qwen3.5 / Qwen3-Next prefill), q/k L2-normalised in the kernel, GVA (16 k / 32 v heads),
  fp32 initial and final state, varlen (`cu_seqlens`) for several sequences;
- transformers' `torch_chunk_gated_delta_rule` (the eager fallback of its Qwen3.5 model; q/k
  heads repeated to the value heads first, as the model does; one batch of equal lengths).

Shapes: Qwen3.5-35B-A3B's DeltaNet layer (16 k / 32 v heads of 128), bf16 inputs, gates given
(beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) computed beforehand and not timed).
CUDA events, median of 20 after 3 warm-ups (the Triton autotune and JIT run in the warm-ups);
fla also as its kernels' GPU time (torch.profiler: without the Python launch overhead between
them; the column compared with ours). Each implementation runs in its own process: transformers' Qwen3.5 module
binds fla's kernel when fla is importable, so its torch reference is timed without fla on the
path; the first case's outputs of the two are compared (relative error).
flash-linear-attention is not on the GPU machine's image: install its wheels first (no network
there), e.g.

    pip install --no-deps --no-index --target /tmp/fla .whl/*.whl
    PYTHONPATH=/tmp/fla python3 bench/cuda/deltanet_torch_baseline.py [--ours CSV] [--csv PATH]

--ours: bench_deltanet's CSV of the same run; prints our time beside (gated_delta_rule rows).
--workers fla,torch / --timeouts 60,40: which implementations run, in that order, each killed
after its own limit (seconds; Triton's autotune and JIT on a fresh machine take most of fla's).
Each worker prints when it got through its imports and its first (autotuning) call.
Also checks that fla and transformers agree (relative error of the outputs) so a timing is of a
correct call.
"""
import argparse
import csv
import os
import subprocess
import sys
import threading
import time

T_START = time.time()

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
                if row.get("op", "").startswith("gated_delta_rule"):
                    ours[(row["op"], row.get("shape", ""))] = float(row.get("us", "nan"))
    except OSError as e:
        print(f"(no --ours CSV: {e})")
    return ours


def kernel_us(fn, reps=10):
    """GPU kernel time per call (sum of the device time of its kernels, torch.profiler): what
    the call costs the GPU without the Python launch overhead between its kernels."""
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        total = 0.0
        for e in prof.key_averages():
            total += getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))
        return total / reps
    except Exception as e:  # noqa: BLE001 - report and go on with the eager time
        print(f"(profiler failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
        return float("nan")


def worker(which, out_prefix):
    """One implementation in this process: prints 'RESULT shape call_us kernel_us' lines and saves
    the first case's output for the parent's cross-check."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    if which == "fla":
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        print(f"fla {getattr(fla, '__version__', '?')} from {fla.__file__}")
    else:
        try:
            import fla  # noqa: F401
            print("WARNING: fla importable in the torch worker: transformers may dispatch to it")
        except ImportError:
            pass
        torch_ref, where = find_torch_reference()
        import inspect
        import transformers
        print(f"transformers {transformers.__version__}: {where}.torch_chunk_gated_delta_rule "
              f"defined in {inspect.getsourcefile(torch_ref)}")
    print(f"imports done at {time.time() - T_START:.1f} s", flush=True)
    for ci, (seqs, n) in enumerate(CASES):
        q, k, v, g, beta, h0 = inputs(seqs, n, gen)
        cu = torch.arange(0, seqs + 1, device="cuda", dtype=torch.long) * n
        if which == "fla":
            def run():
                return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                              output_final_state=True,
                                              use_qk_l2norm_in_kernel=True,
                                              cu_seqlens=cu if seqs > 1 else None)
            run()
            torch.cuda.synchronize()
            print(f"first call ({seqs} seq x {n}) done at {time.time() - T_START:.1f} s",
                  flush=True)
            eager = timed(run)
            gpu = kernel_us(run)
            out = run()[0].float()
        else:
            rep = HV // HK
            qr = q.view(seqs, n, HK, DK).repeat_interleave(rep, dim=2)
            kr = k.view(seqs, n, HK, DK).repeat_interleave(rep, dim=2)
            vr, gr, br = v.view(seqs, n, HV, DV), g.view(seqs, n, HV), beta.view(seqs, n, HV)

            def run():
                return torch_ref(qr, kr, vr, g=gr, beta=br, chunk_size=64, initial_state=h0,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
            eager = timed(run, reps=5 if seqs * n > 4096 else 10, warm=2)
            gpu = kernel_us(run, reps=2)
            out = run()[0].float().reshape(1, seqs * n, HV, DV)
        if ci == 0:
            torch.save(out.cpu(), f"{out_prefix}_{which}.pt")
        print(f"RESULT {seqs} seq x {n} tok|{eager:.2f}|{gpu:.2f}", flush=True)
        print(f"{which} {seqs} seq x {n} tok: {eager:.1f} us per call, {gpu:.1f} us of kernels",
              flush=True)
        del q, k, v, g, beta, h0, out
        torch.cuda.empty_cache()
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours")
    ap.add_argument("--csv")
    ap.add_argument("--worker", choices=["fla", "torch"])
    ap.add_argument("--out-prefix", default="/tmp/deltanet_baseline")
    ap.add_argument("--worker-timeout", type=float, default=120)
    ap.add_argument("--workers", default="fla,torch")
    ap.add_argument("--timeouts", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    if args.worker:
        return worker(args.worker, args.out_prefix)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    # Two processes: fla with PYTHONPATH as given; transformers' torch reference without it (when
    # fla is importable, transformers' Qwen3.5 model uses fla's kernel; its torch function is what
    # runs without it).
    res = {}
    envs = {"fla": dict(os.environ),
            "torch": {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}}
    order = [w for w in args.workers.split(",") if w in envs]
    limits = [float(x) for x in args.timeouts.split(",") if x]
    for wi, which in enumerate(order):
        env = envs[which]
        limit = limits[wi] if wi < len(limits) else args.worker_timeout
        # Streamed (a worker killed by a time limit still shows how far it got), each with its
        # own limit.
        proc = subprocess.Popen([sys.executable, __file__, "--worker", which, "--out-prefix",
                                 args.out_prefix], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(limit, proc.kill)
        timer.start()
        for line in proc.stdout:
            line = line.rstrip()
            if line.startswith("RESULT "):
                shape, eager, gpu = line[7:].split("|")
                res[(which, shape)] = (float(eager), float(gpu))
            elif "warn" not in line.lower():
                print(f"[{which}] {line}", flush=True)
        rc = proc.wait()
        timer.cancel()
        if rc != 0:
            print(f"[{which}] exited {rc} (killed after {limit} s when negative)")
    err = float("nan")
    try:
        a = torch.load(f"{args.out_prefix}_fla.pt")
        b = torch.load(f"{args.out_prefix}_torch.pt")
        err = ((a - b).norm() / b.norm()).item()
    except Exception as e:  # noqa: BLE001
        print(f"(no cross-check: {e})")
    print(f"fla vs transformers' torch reference, 1 seq x 1024 tok: relative error {err:.2e}")
    ours = read_ours(args.ours)
    nan = float("nan")
    print(f"{'shape':22} {'fla_kern':>10} {'fla_call':>10} {'torch_call':>10} {'ours':>9} "
          f"{'fla/ours':>9}")
    rows = []
    for seqs, n in CASES:
        shape = f"{seqs} seq x {n} tok"
        fe, fg = res.get(("fla", shape), (nan, nan))
        te, _ = res.get(("torch", shape), (nan, nan))
        our = ours.get(("gated_delta_rule", shape), nan)
        fla_best = fg if fg == fg else fe
        ratio = fla_best / our if our == our and our > 0 else nan
        print(f"{shape:22} {fg:10.1f} {fe:10.1f} {te:10.1f} {our:9.1f} {ratio:9.2f}", flush=True)
        rows.append((shape, fg, fe, te, our))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("shape,fla_kernel_us,fla_call_us,torch_ref_call_us,ours_us\n")
            for r in rows:
                f.write(f"{r[0]},{r[1]:.2f},{r[2]:.2f},{r[3]:.2f},{r[4]:.2f}\n")
    print(f"(cross-check err {err:.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
