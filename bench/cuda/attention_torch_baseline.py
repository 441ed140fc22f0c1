#!/usr/bin/env python3
"""Causal prefill attention as a PyTorch user runs it, at the shapes of bench_attention's
prefill rows: one sequence of T = 2048 / 8192 tokens, 32 q / 4 kv heads (Qwen3-30B-A3B) and
64 q / 4 kv (Qwen3-235B-A22B), head_dim 128, bf16, is_causal.

torch.nn.functional.scaled_dot_product_attention under each of the cuDNN and flash backends
(sdpa_kernel), with enable_gqa=True where the backend takes it, else K/V repeated to the q heads
before timing. CUDA events, median of 20 after 5 warm-ups. FLOPs = 4 * T (T + 1) / 2 *
head_dim * q_heads (the causal pairs, as bench_attention counts them).

    python3 bench/cuda/attention_torch_baseline.py [--ours BENCH_ATTENTION_CSV] [--csv PATH]

With --ours (the CSV bench_attention writes to $TANDEM_BENCH_CSV) the table adds our prefill
rows (attn_prefill: FA2 kernel; attn_prefill_fi_*: FlashInfer sm90) and each one's ratio to
cuDNN SDPA.
"""
import argparse
import csv
import sys

import torch
import torch.nn.functional as F

HEAD_DIM = 128
KV_HEADS = 4
SHAPES = [(32, 2048), (64, 2048), (32, 8192), (64, 8192)]


def flops(q_heads, t):
    return 4.0 * t * (t + 1) / 2 * HEAD_DIM * q_heads


def time_us(fn):
    for _ in range(5):
        fn()
    times = []
    for _ in range(20):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def sdpa_us(backend, q_heads, t):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, q_heads, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, KV_HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, KV_HEADS, t, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    with sdpa_kernel(be):
        try:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.cuda.synchronize()
            return time_us(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True)), "gqa"
        except (RuntimeError, TypeError):
            pass
        rep = q_heads // KV_HEADS
        ke, ve = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return time_us(lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)), "repeat"


def read_ours(path):
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            op = r["op"]
            if not op.startswith("attn_prefill") or op.endswith("FAILED"):
                continue
            if op in ("attn_prefill_simple", "attn_prefill_8w2b", "attn_prefill_4w2b"):
                continue
            q_heads = int(r["shape"].split("q/")[0])
            rows[(op, q_heads, int(r["tokens"]))] = float(r["us"])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", help="bench_attention CSV ($TANDEM_BENCH_CSV)")
    ap.add_argument("--csv")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    ours = read_ours(args.ours) if args.ours else {}
    out = []
    print(f"{'kernel':28} {'heads':>8} {'T':>6} {'us':>10} {'TFLOP/s':>8} {'vs cuDNN':>9}")
    for q_heads, t in SHAPES:
        fl = flops(q_heads, t)
        base = {}
        for be in ("cudnn", "flash"):
            try:
                us, how = sdpa_us(be, q_heads, t)
            except Exception as e:  # noqa: BLE001 (a backend that refuses the shape)
                print(f"sdpa_{be:23} {q_heads:>5}q/4 {t:6d}  failed: {str(e).splitlines()[0]}")
                continue
            base[be] = us
            out.append((f"sdpa_{be}_{how}", q_heads, t, us))
        rows = [(name, us) for (name, qh, tt, us) in out if tt == t and qh == q_heads]
        rows += [(op, us) for (op, qh, tt), us in sorted(ours.items()) if qh == q_heads and tt == t]
        for name, us in rows:
            ratio = base["cudnn"] / us if "cudnn" in base else float("nan")
            print(f"{name:28} {q_heads:>5}q/4 {t:6d} {us:10.1f} {fl / (us * 1e-6) / 1e12:8.1f} "
                  f"{ratio:8.2f}x", flush=True)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("kernel,q_heads,tokens,us,tflops\n")
            for name, q_heads, t, us in out:
                f.write(f"{name},{q_heads},{t},{us:.2f},{flops(q_heads, t) / (us * 1e-6) / 1e12:.1f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
